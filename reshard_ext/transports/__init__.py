"""Transports: how a plan's batches move. Each one packs, exchanges and unpacks the
descriptor tables built at plan time; they differ in where kernels run and what
carries the bytes.

  cpu    CPU box kernels + torch.distributed point-to-point (gloo)
  torch  CUDA box kernels + torch.distributed point-to-point (any GPU backend)
  nccl   CUDA box kernels + the C++ NCCL communicator on CUDA streams, pipelined
  direct CUDA IPC writes straight into the receivers' destinations (one host)
  nvshmem CUDA box kernels + NVSHMEM put-with-signal into symmetric staging, pipelined
"""
from __future__ import annotations

from typing import Any, Protocol


class Transport(Protocol):
    direct_bytes: int  # ExecTables.bind's message cut (0: one message per peer and batch)

    def bind(self, tables: Any) -> tuple[list[int], list[int]]:
        """Allocates staging for `tables`; returns (send buffer ptrs, recv buffer ptrs)."""

    def prepare(self, tables: Any) -> None:
        """Once the tables are bound: device uploads, message views."""

    def run(self, tables: Any, verify: bool = False) -> Any:
        """Moves every batch: local copies, pack, exchange, unpack. verify: returns the
        (send, recv) digests of every op (uint64 arrays), computed as the kernels copy."""

    def read_digests(self, tables: Any) -> tuple:
        """rx.verify: (send, recv, copy source, copy destination) digests per op, read
        from the bound tensors; moves nothing."""
