"""CPU transport: C++ box kernels over host memory, gloo point-to-point."""
from __future__ import annotations

from typing import Any

import torch

from .p2p import P2PExchange


class CpuTransport:
    def __init__(self, group: Any):
        self.p2p = P2PExchange(group)
        self.send_buf = torch.empty(0, dtype=torch.uint8)
        self.recv_buf = torch.empty(0, dtype=torch.uint8)
        self._regions: list[tuple[list, list]] = []

    def bind(self, tables: Any) -> tuple[list[int], list[int]]:
        # One staging pair, sized for the largest batch, reused by every execute.
        if self.send_buf.numel() < tables.send_buffer_bytes:
            self.send_buf = torch.empty(tables.send_buffer_bytes, dtype=torch.uint8)
        if self.recv_buf.numel() < tables.recv_buffer_bytes:
            self.recv_buf = torch.empty(tables.recv_buffer_bytes, dtype=torch.uint8)
        self._regions = [tables.regions(b) for b in range(tables.num_batches)]
        return [self.send_buf.data_ptr()], [self.recv_buf.data_ptr()]

    def run(self, tables: Any) -> None:
        tables.run_copies_cpu()
        for b, regions in enumerate(self._regions):
            tables.run_pack_cpu(b)
            self.p2p.exchange(regions, self.send_buf, self.recv_buf)
            tables.run_unpack_cpu(b)
