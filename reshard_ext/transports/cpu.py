"""CPU transport: C++ box kernels over host memory, gloo point-to-point."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from ..options import Options
from .p2p import P2PExchange

# A verified execute moves each batch in this many rounds (ExecTables::round_messages) and
# digests the direct receives of a round as soon as it landed, while the bytes are still
# in cache and the next round moves. Every rank must use the same number.
VERIFY_ROUNDS = 8


class CpuTransport:
    def __init__(self, group: Any, options: Options):
        # Ops of at least this many bytes travel as their own message, straight from / into
        # the tensor when their box is contiguous: on the CPU every copy avoided is memory
        # bandwidth won, while a message costs little.
        self.direct_bytes = options.resolved_direct_bytes("cpu")
        self.p2p = P2PExchange(group, options.resolved_timeout("gloo"))
        self.send_buf = torch.empty(0, dtype=torch.uint8)
        self.recv_buf = torch.empty(0, dtype=torch.uint8)
        self._ops: list[list[Any]] = []
        self._round_ops: list[list[list[Any]]] = []  # built by the first verified execute

    def bind(self, tables: Any) -> tuple[list[int], list[int]]:
        # One staging pair, sized for the largest batch, reused by every execute.
        if self.send_buf.numel() < tables.send_buffer_bytes:
            self.send_buf = torch.empty(tables.send_buffer_bytes, dtype=torch.uint8)
        if self.recv_buf.numel() < tables.recv_buffer_bytes:
            self.recv_buf = torch.empty(tables.recv_buffer_bytes, dtype=torch.uint8)
        return [self.send_buf.data_ptr()], [self.recv_buf.data_ptr()]

    def prepare(self, tables: Any) -> None:
        bufs = [self.send_buf, self.recv_buf]
        self._ops = [self.p2p.views(tables.messages(b), bufs) for b in range(tables.num_batches)]
        self._round_ops = []

    def _rounds(self, tables: Any, b: int) -> list[list[Any]]:
        if not self._round_ops:
            bufs = [self.send_buf, self.recv_buf]
            self._round_ops = [[self.p2p.views(tables.round_messages(c, r, VERIFY_ROUNDS), bufs)
                                for r in range(VERIFY_ROUNDS)] for c in range(tables.num_batches)]
        return self._round_ops[b]

    def run(self, tables: Any, verify: bool = False) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """verify: also returns the digests of every send and recv op (verification.py),
        computed by the pack and unpack kernels as they copy."""
        send, recv = (np.zeros(n, dtype=np.uint64) for n in tables.num_ops[:2])
        if not self._ops:
            tables.run_copies_cpu()
        for b, ops in enumerate(self._ops):
            if not verify:
                tables.run_pack_cpu(b)
                reqs = self.p2p.start(ops)
                if b == 0:
                    tables.run_copies_cpu()  # same-rank copies while gloo's threads move batch 0
                self.p2p.finish(reqs, ops)
                tables.run_unpack_cpu(b)
                continue
            tables.run_pack_cpu_verified(b, send)
            rounds = self._rounds(tables, b)
            reqs = [self.p2p.start(r) for r in rounds]
            # direct messages have no pack: read their sources while gloo's threads send them
            tables.digest_direct_sends_cpu(b, send)
            if b == 0:
                tables.run_copies_cpu()
            for r, (round_ops, round_reqs) in enumerate(zip(rounds, reqs)):
                self.p2p.finish(round_reqs, round_ops)
                tables.digest_direct_recv_round_cpu(b, r, VERIFY_ROUNDS, recv)
            tables.run_unpack_cpu_verified(b, recv, direct=False)
        return (send, recv) if verify else None

    def read_digests(self, tables: Any) -> tuple[np.ndarray, ...]:
        """rx.verify: (send, recv, copy source, copy destination) digests per op, read
        from the bound tensors without moving anything."""
        out = tuple(np.zeros(n, dtype=np.uint64) for n in tables.num_ops)
        copy_dst = np.zeros_like(out[2])
        tables.read_digests_cpu(*out, copy_dst)
        return out + (copy_dst,)
