"""CPU transport: C++ box kernels over host memory, gloo point-to-point on the group's
private channel (transports/channel.py)."""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from ..errors import ReshardError
from ..options import Options
from .channel import Session, channel_of, data_tag, data_token, exchange_headers
from .p2p import message_ops

# Bytes of a direct message per round of a verified execute over gloo (ExecTables::
# round_messages), hashed beside the next round's transfer: few rounds, since each one is a
# gloo exchange whose hand-offs cost more than hashing a piece that has left the cache.
# Pairs of one host hash in the rings instead, chunk by chunk as they copy (HostRing).
VERIFY_PIECE = 64 << 20


class CpuTransport:
    def __init__(self, group: Any, options: Options):
        # Ops of at least this many bytes travel as their own message, straight from / into
        # the tensor when their box is contiguous: on the CPU every copy avoided is memory
        # bandwidth won, while a message costs little.
        self.direct_bytes = options.resolved_direct_bytes("cpu")
        self.channel = channel_of(group)
        self.rings = options.resolved_host_ring()  # rx.plan's vote: alike on every rank
        self.rank = self.channel.rank
        self.send_buf = torch.empty(0, dtype=torch.uint8)
        self.recv_buf = torch.empty(0, dtype=torch.uint8)
        self._ops: list[list[tuple[str, int, torch.Tensor]]] = []
        self._bufs: list[torch.Tensor] = []
        self.peers: list[int] = []
        self.staging_bytes = 0

    def bind(self, tables: Any) -> tuple[list[int], list[int]]:
        # One staging pair, sized for the largest batch, reused by every execute.
        if self.send_buf.numel() < tables.send_buffer_bytes:
            self.send_buf = torch.empty(tables.send_buffer_bytes, dtype=torch.uint8)
        if self.recv_buf.numel() < tables.recv_buffer_bytes:
            self.recv_buf = torch.empty(tables.recv_buffer_bytes, dtype=torch.uint8)
        self.staging_bytes = tables.send_buffer_bytes + tables.recv_buffer_bytes
        return [self.send_buf.data_ptr()], [self.recv_buf.data_ptr()]

    def prepare(self, tables: Any) -> None:
        self._bufs = [self.send_buf, self.recv_buf]
        self._ops = [message_ops(tables.messages(b), self._bufs) for b in range(tables.num_batches)]
        self.peers = sorted({peer for ops in self._ops for _, peer, _ in ops})

    def abort(self) -> None:
        """Nothing to stop here: the caller's wait polls the session's abort flag."""

    def _staged(self, t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return any(ptr == b.untyped_storage().data_ptr() for b in (self.send_buf, self.recv_buf))

    def run(self, tables: Any, session: Session, verify: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
        """verify: also returns the digests of every send and recv op (verification.py),
        computed by the pack and unpack kernels as they copy."""
        digests = (np.zeros(tables.num_ops[0], dtype=np.uint64), np.zeros(tables.num_ops[1], dtype=np.uint64)) \
            if verify else None
        send, recv = digests or (None, None)
        if not self.peers:  # idle, or only same-rank copies: nobody to agree with (the direct transport's may disagree)
            if session.status != 0:
                raise ReshardError(session.error)
            if session.verdict is not None and session.verdict.bad:
                raise ReshardError(session.verdict.message(self.rank) + "\n  (this rank wrote no destination)")
            tables.run_copies_cpu()
            return digests

        def pack(b: int) -> None:
            if verify:
                tables.run_pack_cpu_verified(b, send)
            else:
                tables.run_pack_cpu(b)

        ch = self.channel
        ok = session.status == 0
        if session.verdict is None:
            ch.drain(session)
            exchange_headers(ch, self.peers, session, tables.num_batches, (lambda: pack(0)) if ok else None)
        elif ok:  # the direct transport exchanged the headers with every peer
            pack(0)
        verdict = session.verdict
        assert verdict is not None  # exchange_headers set it
        good = set() if not ok else set(self.peers) - set(verdict.bad)
        # A rank that cannot agree with every peer still moves the data of the pairs that
        # agree (those peers complete), but writes none of its own destinations.
        writes = ok and not verdict.bad
        tag = data_tag(session.plan_id, session.seq, session.attempt)
        token = data_token(session.plan_id, session.seq) if self.rings else None
        # Verified, with every peer on this host's rings: direct messages are hashed as the
        # rings copy them, in one round per batch.
        in_rings = verify and self.rings and all(ch.ring_peer(p, session) for p in good)
        failed: dict[int, str] = {}
        wrote = False
        for b, ops in enumerate(self._ops):
            if not good:
                break
            if b > 0:
                pack(b)
            # Verified: direct messages move in rounds of VERIFY_PIECE bytes: the sources of
            # round r + 1 are hashed while round r moves (just before the worker sends them),
            # the destinations of round r as soon as it landed.
            rounds = tables.piece_rounds(b, VERIFY_PIECE) if verify and not in_rings else 1
            per_round = [message_ops(tables.round_messages(b, r, rounds, VERIFY_PIECE), self._bufs)
                         for r in range(rounds)] if verify and not in_rings else [ops]

            def submit(r: int, writes: bool, good: set[int], b: int = b, per_round: list = per_round,
                       rounds: int = rounds) -> Any:
                if verify and not in_rings:
                    tables.digest_direct_send_round_cpu(b, r, rounds, send, VERIFY_PIECE)
                use = [(kind, peer, t if writes or kind == "send" or self._staged(t) else torch.empty_like(t))
                       for kind, peer, t in per_round[r] if peer in good]
                hashed = (tables, b, send, recv) if in_rings else None
                return ch.submit(functools.partial(ch.exchange, use, tag, session, retry_closed=True, token=token,
                                                   hashed=hashed))

            task = submit(0, writes, good)
            if b == 0 and writes:
                tables.run_copies_cpu()  # same-rank copies while the worker moves batch 0
                wrote = True
            for r in range(rounds):
                following = submit(r + 1, writes, good) if r + 1 < rounds else None  # queued behind round r
                errors = ch.wait(task, session, f"moving batch {b} of {len(self._ops)}")
                if errors:
                    failed.update(errors)
                    good -= set(errors)
                    writes = False
                if writes and verify and not in_rings:
                    tables.digest_direct_recv_round_cpu(b, r, rounds, recv, VERIFY_PIECE)
                if following is None:
                    break
                task = following
            if writes:
                if verify:
                    tables.run_unpack_cpu_verified(b, recv)
                else:
                    tables.run_unpack_cpu(b)
                wrote = True
        for peer, why in failed.items():
            verdict.bad[peer] = f"rank {self.rank}: the data exchange with rank {peer} failed ({why})"
        if session.status != 0:
            raise ReshardError(session.error)
        if verdict.bad:
            raise ReshardError(verdict.message(self.rank) + ("\n  (this rank's destinations are partly written)"
                                                             if wrote else "\n  (this rank wrote no destination)"))
        return digests

    def read_digests(self, tables: Any) -> tuple[np.ndarray, ...]:
        """rx.verify: (send, recv, copy source, copy destination) digests per op, read
        from the bound tensors without moving anything."""
        out = tuple(np.zeros(n, dtype=np.uint64) for n in tables.num_ops)
        copy_dst = np.zeros_like(out[2])
        tables.read_digests_cpu(*out, copy_dst)
        return out + (copy_dst,)
