"""The NVSHMEM transport (DESIGN section 4): the NCCL path's pack and unpack kernels
(casts and MXFP8 fused alike) around NVSHMEM put-with-signal instead of NCCL send/recv.

Staging lives in one symmetric region per plan: STAGING_SLOTS slots of one size on every
rank (the largest receive + send buffer any rank needs in a batch), each holding this
rank's receive buffer at its start (the symmetric part: peers put there) and its send
buffer after it, then the signal words. A batch is packed into the local send buffer, put
into each receiver's receive buffer with a signal (nvshmemx_putmem_signal_on_stream:
NVLink peer copies within a node, the network proxy across nodes, the same call); the
receiver's stream waits for the signals, unpacks, and tells the senders of the batch that
next uses the slot that it is free (csrc/comm/nvshmem_comm.h). Flow control stays on the
GPU; the host waits once per execute, bounded by RESHARD_EXT_TIMEOUT.

Binding is collective the first time (region choice, receive offsets exchanged);
rebinding tensors later is local, as the region and the offsets do not change.
"""
from __future__ import annotations

from typing import Any

import torch

from .. import _C, groups
from ..collectives import all_gather_objects, first_failed_rank
from ..errors import InternalError
from ..options import Options
from ..planning import _raise
from . import nvshmem_lib
from .cuda import CudaTransport

# Symmetric staging slots of a plan with several batches: batch b + 1 is packed and put while
# batch b is unpacked. rx.plan's max_batch_bytes bound counts them (execution._staging_depth).
STAGING_SLOTS = 2

_ALIGN = 16  # the pack and unpack kernels' item


def _up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def check_one_message_per_pair(tables: Any, rank: int) -> None:
    """Raises InternalError where batch b of `tables` (bound with direct_bytes 0) has two
    messages between this rank and one peer: a receiver's stream waits for one signal per
    sender and batch, so a second put into a busy slot would wait for its own free signal
    forever. The planner's op order (by peer) makes one run per pair; this is its guard."""
    for b in range(tables.num_batches):
        for side, verb in ((0, "sends"), (1, "receives")):
            peers = [m.peer for m in tables.messages(b)[side] if m.bytes > 0]
            twice = sorted({p for p in peers if peers.count(p) > 1})
            if twice:
                raise InternalError(f"NVSHMEM plan: rank {rank} {verb} {peers.count(twice[0])} messages "
                                    f"{'to' if side == 0 else 'from'} rank {twice[0]} in batch {b}; the transport "
                                    f"needs one per pair and batch (its signals are per pair)")


class _Puts:
    """Stands in for CudaTransport's communicator (its pipelined path keys on one); the
    executor's NVSHMEM transport (csrc/comm/executor.cc) carries the bytes."""

    usable = True
    timeout = 0.0
    exchange: Any = None  # the plan's _C.NvshmemExchange, once bound

    def abort(self) -> None:
        # The host wait gives up at once; NVSHMEM's stream waits cannot be cancelled (they end
        # when the signals come, or never: the plan is unusable after).
        if self.exchange is not None:
            self.exchange.abort()


class NvshmemTransport(CudaTransport):
    def __init__(self, group: Any, options: Options):
        # collective: every rank raises alike if one cannot run it
        self.pe_of = nvshmem_lib.world(group, options.resolved_batch_bytes())
        super().__init__(group, comm=_Puts(), options=options, nccl=False)
        self.group = group
        self.direct_bytes = 0  # every message is staged: puts land in symmetric memory only
        self.timeout = options.resolved_timeout("nvshmem")
        self.collective_bind = True
        self.puts: Any = None
        self._region = -1
        self._layout: tuple[int, int, int, int] = (0, 0, 0, 0)  # (base, slots, slot bytes, this rank's recv bytes)

    def rearm(self) -> None:
        """Takes a stop of an earlier execute back (before this one's watch starts)."""
        if self.puts is not None:
            self.puts.rearm()

    # --- binding ---------------------------------------------------------------------
    def bind_plan(self, plan: Any, errors: list[str]) -> None:
        tables = plan.tables
        need = (tables.send_buffer_bytes, tables.recv_buffer_bytes, STAGING_SLOTS if tables.num_batches > 1 else 1)
        what = "binding an NVSHMEM plan (rx.plan)"
        votes = all_gather_objects((errors, need, nvshmem_lib.free_regions()), self.group, what, self.timeout)
        agreed = [e for v in votes for e in v[0]]
        if agreed:
            _raise(agreed)
        # A slot holds a rank's largest receive and send buffers of a batch side by side: the
        # largest such sum of any rank (the planner kept slots x the sum within max_batch_bytes).
        stride = max(_ALIGN, *(_up(v[1][0]) + _up(v[1][1]) for v in votes))
        slots = max(v[1][2] for v in votes)
        npes = len(self.pe_of)
        signal_offset = slots * stride
        failure: Exception | None = None
        try:
            self._region, base = nvshmem_lib.take_region([v[2] for v in votes], signal_offset + 16 * npes)
            self._layout = (base, slots, stride, _up(tables.recv_buffer_bytes))
            self.staging_bytes = signal_offset
            # The counters restart with this plan: its signal words are zeroed (in the constructor)
            # on every rank before any peer can signal.
            self.puts = _C.NvshmemExchange(base, signal_offset, npes, slots, torch.cuda.current_device(),
                                           self.timeout)
            self.comm.exchange = self.puts
            self.executor.set_transport(_C.nvshmem_transport(self.puts))
        except Exception as e:  # noqa: BLE001 - re-raised below, after every rank knows
            failure = e
        self._every_rank_ok(failure, what, "set up")  # nvshmem_barrier_all cannot time out: all enter it or none
        _C.nvshmem_barrier()
        try:
            self._bind_local(plan)
            mine = self._receive_offsets(tables)
        except Exception as e:  # noqa: BLE001 - re-raised below, after every rank knows
            failure, mine = e, {}
        offsets = all_gather_objects(mine, self.group, what, self.timeout)
        if failure is None:
            try:
                self._set_batches(tables, offsets)
            except Exception as e:  # noqa: BLE001
                failure = e
        self._every_rank_ok(failure, what, "bind")
        self.collective_bind = False  # rebinding tensors keeps the region and the offsets

    def _every_rank_ok(self, failure: Exception | None, what: str, step: str) -> None:
        """Raises on every rank where any rank's `step` failed: its own error there, a pointer
        to it on the others."""
        failed = first_failed_rank(self.group, failure is not None, what, self.timeout)
        if failure is not None:
            raise failure
        if failed >= 0:
            _raise([f"rank {failed} failed to {step} its part of the NVSHMEM plan; see that rank's error"])

    def bind(self, tables: Any) -> tuple[list[int], list[int]]:
        base, slots, stride, recv_b = self._layout
        recv = [base + i * stride for i in range(slots)]
        return [r + recv_b for r in recv], recv

    def staging_ranges(self) -> list[tuple[int, int]]:
        base, slots, stride, _ = self._layout
        return [(base, base + slots * stride)]

    def _bind_local(self, plan: Any) -> None:
        send_bufs, recv_bufs = self.bind(plan.tables)
        src, dst = plan._bound_refs()
        plan.tables.bind(src, dst, send_bufs, recv_bufs, self.direct_bytes, plan._codec_receivers)
        self.prepare(plan.tables)

    def _receive_offsets(self, tables: Any) -> dict[int, list[tuple[int, int, int]]]:
        """{sender group rank: [(batch, offset in the region, bytes)]} of this rank's messages."""
        base = self._layout[0]
        out: dict[int, list[tuple[int, int, int]]] = {}
        for b in range(tables.num_batches):
            for m in tables.messages(b)[1]:
                if m.bytes > 0:
                    out.setdefault(m.peer, []).append((b, m.ptr - base, m.bytes))
        return out

    def _set_batches(self, tables: Any, offsets: list[dict]) -> None:
        me = groups.rank(self.group)
        check_one_message_per_pair(tables, me)
        base = self._layout[0]
        sends: list[list[tuple]] = [[] for _ in range(tables.num_batches)]
        recvs: list[list[int]] = [[] for _ in range(tables.num_batches)]
        for b in range(tables.num_batches):
            out, inc = tables.messages(b)
            sends[b] = [(m.peer, m.ptr, m.bytes) for m in out if m.bytes > 0]
            recvs[b] = [self.pe_of[m.peer] for m in inc if m.bytes > 0]
        for peer in {p for batch in sends for p, _, _ in batch}:
            theirs = offsets[peer].get(me, [])
            ours = [(b, n) for b, batch in enumerate(sends) for p, _, n in batch if p == peer]
            if [(b, n) for b, _, n in theirs] != ours:
                raise InternalError(f"NVSHMEM plan: rank {me} sends {ours[:4]}... to rank {peer}, which expects "
                                       f"{[(b, n) for b, _, n in theirs][:4]}...")
        table = []
        for b, batch in enumerate(sends):
            cursor: dict[int, int] = {}
            row = []
            for peer, ptr, n in batch:
                k = cursor.get(peer, 0)
                cursor[peer] = k + 1
                off = [o for bb, o, _ in offsets[peer][me] if bb == b][k]
                row.append((self.pe_of[peer], ptr, base + off, n))
            table.append(row)
        self.puts.set_batches(table, recvs)

    def __del__(self) -> None:
        nvshmem_lib.release_region(getattr(self, "_region", -1))
