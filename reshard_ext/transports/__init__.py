"""Transports: how a plan's batches move. Each one packs, exchanges and unpacks the
descriptor tables built at plan time; they differ in where kernels run and what
carries the bytes.

  cpu    CPU box kernels + torch.distributed point-to-point (gloo)
  torch  CUDA box kernels + torch.distributed point-to-point (any GPU backend)
  nccl   CUDA box kernels + the C++ NCCL communicator on CUDA streams, pipelined
"""
from __future__ import annotations

from typing import Any, Protocol


class Transport(Protocol):
    def bind(self, tables: Any) -> tuple[list[int], list[int]]:
        """Allocates staging for `tables`; returns (send buffer ptrs, recv buffer ptrs)."""

    def run(self, tables: Any) -> None:
        """Moves every batch: local copies, pack, exchange, unpack."""
