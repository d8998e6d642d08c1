"""torch.distributed point-to-point exchange of one batch's messages."""
from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.distributed as dist


def byte_view(ptr: int, nbytes: int, buffers: list[torch.Tensor]) -> torch.Tensor:
    """A uint8 tensor over [ptr, ptr + nbytes): a slice of a staging buffer when it lies
    in one, else (host memory only: a direct message) a zero-copy view of the address."""
    for buf in buffers:
        base = buf.data_ptr()
        if base <= ptr and ptr + nbytes <= base + buf.numel():
            return buf[ptr - base : ptr - base + nbytes]
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


class P2PExchange:
    """Posts every message of a batch at once and waits for all of them."""

    def __init__(self, group: Any):
        self.group = group
        self._global: dict[int, int] = {}

    def global_rank(self, group_rank: int) -> int:
        g = self._global.get(group_rank)
        if g is None:
            g = self._global[group_rank] = dist.get_global_rank(self.group, group_rank)
        return g

    def views(self, messages: tuple[list, list], buffers: list[torch.Tensor]) -> list[Any]:
        """Turns (peer, ptr, bytes) messages into P2P ops once, at bind time."""
        sends, recvs = messages
        return [
            dist.P2POp(dist.isend, byte_view(ptr, n, buffers), self.global_rank(peer), self.group)
            for peer, ptr, n in sends
        ] + [
            dist.P2POp(dist.irecv, byte_view(ptr, n, buffers), self.global_rank(peer), self.group)
            for peer, ptr, n in recvs
        ]

    @staticmethod
    def start(ops: list[Any]) -> list[Any]:
        """Posts every message; returns the requests to wait on."""
        return dist.batch_isend_irecv(ops) if ops else []

    @staticmethod
    def finish(reqs: list[Any]) -> None:
        for req in reqs:
            req.wait()

    @classmethod
    def run(cls, ops: list[Any]) -> None:
        cls.finish(cls.start(ops))
