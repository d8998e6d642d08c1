"""torch.distributed point-to-point exchange of one batch's messages."""
from __future__ import annotations

import ctypes
from typing import Any

import torch

from .. import _C, groups
from ..errors import ReshardError
from ..options import wait_time


def byte_view(ptr: int, nbytes: int, buffers: list[torch.Tensor]) -> torch.Tensor:
    """A uint8 tensor over [ptr, ptr + nbytes): a slice of a staging buffer when it lies
    in one, else (host memory only: a direct message) a zero-copy view of the address."""
    for buf in buffers:
        base = buf.data_ptr()
        if base <= ptr and ptr + nbytes <= base + buf.numel():
            return buf[ptr - base : ptr - base + nbytes]
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


def message_ops(messages: tuple[list[_C.Message], list[_C.Message]],
                buffers: list[torch.Tensor]) -> list[tuple[str, int, torch.Tensor]]:
    """(kind, peer, byte view) of a batch's messages (ExecTables.messages), in posting order."""
    sends, recvs = messages
    return [("send", m.peer, byte_view(m.ptr, m.bytes, buffers)) for m in sends] + \
        [("recv", m.peer, byte_view(m.ptr, m.bytes, buffers)) for m in recvs]


class P2PExchange:
    """Posts every message of a batch at once and waits for all of them. A peer that never
    posts its half must not hang the refit for the process group's own timeout (30 min by
    default): waits give up after `timeout_s` and raise."""

    def __init__(self, group: Any, timeout_s: float):
        self.group = group
        self.timeout_s = timeout_s
        self._global: dict[int, int] = {}

    def global_rank(self, group_rank: int) -> int:
        g = self._global.get(group_rank)
        if g is None:
            g = self._global[group_rank] = groups.global_rank(self.group, group_rank)
        return g

    def views(self, messages: tuple[list[_C.Message], list[_C.Message]], buffers: list[torch.Tensor]) -> list[Any]:
        """Turns a batch's messages (ExecTables.messages) into P2P ops once, at bind time."""
        sends, recvs = messages
        return [groups.p2p_op("send", byte_view(m.ptr, m.bytes, buffers), self.group, m.peer) for m in sends] + \
            [groups.p2p_op("recv", byte_view(m.ptr, m.bytes, buffers), self.group, m.peer) for m in recvs]

    @staticmethod
    def start(ops: list[Any]) -> list[Any]:
        """Posts every message; returns the requests to wait on."""
        return groups.batch_isend_irecv(ops)

    def finish(self, reqs: list[Any], ops: list[Any], timeout_s: float | None = None) -> None:
        limit = self.timeout_s if timeout_s is None else timeout_s
        timeout = wait_time(limit)
        for req in reqs:
            try:
                req.wait(timeout)
            except RuntimeError as e:
                peers = sorted({op.peer for op in ops})
                raise ReshardError(
                    f"refit transfer with ranks {peers} (global) did not complete within {limit:g} s "
                    f"(rx.execute(timeout=...), rx.Options.timeout, default RESHARD_EXT_TIMEOUT): a peer died, "
                    f"skipped rx.execute, or runs another plan. The process group may be unusable now. ({e})"
                ) from e

    def run(self, ops: list[Any], timeout_s: float | None = None) -> None:
        self.finish(self.start(ops), ops, timeout_s)
