"""Verified refits (DESIGN section 2): `rx.execute(plan, verify=True)` and `rx.verify(plan)`.

Every op of a plan gets a 64-bit digest at both ends: on the sender of what the receiver
must hold (after casts and MXFP8), on the receiver of what it wrote or holds
(csrc/kernels/digest.h; computed inside the pack/unpack kernels). Only digests travel,
and per op only when they differ: one all-reduce of every rank's digest sums (sends
minus receives, lane by lane, summed where the digests are: on the GPU for the direct
transport) tells all ranks at once whether every op matched (a mismatch that cancels in
the sum has a ~2^-64 chance). Only then does each sender send
each of its receivers one vector, in the canonical op order both ends share, the
receiver compares, and ReshardError is raised on every rank of the group, naming the
tensors, boxes and ranks (one more all-reduce, and an all-gather of the reports).

Where every rank of a CPU (gloo) group is on one host, the first all-reduce goes through
the group's shared-memory mailboxes instead (each rank posts its sums to every other and
adds up theirs): gloo's ring needs every process scheduled in turn at each of its steps,
which on a busy host costs milliseconds.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import groups
from .collectives import first_failed_rank, wait
from .errors import ReshardError
from .transports.channel import HEADER_LEN, Session
from .transports.digests import DeviceDigests, Digests, lanes
from .transports.p2p import P2PExchange

_MAX_LISTED = 20
# A check's row in the mailboxes: a magic unlike an execute header's, so that a rank whose
# peer posts the other kind (it runs another call) raises instead of adding it up.
_CHECK_MAGIC = 0x52584348  # "RXCH"
KIND, PLAN, SEQ, LO, HI, DIFFER = range(6)


def empty(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.uint64)


class Ops:
    """What the digest check needs of a bound plan's ops, read once from its RankPlan."""

    def __init__(self, rank_plan: Any, dst_names: Any, group: Any, timeout_s: float, channel: Any = None,
                 plan_id: int = 0):
        self.rank = groups.rank(group)
        self.channel = channel  # the group's host channel (its mailboxes), where the transport has one
        self.plan_id = plan_id
        self.names = dst_names
        self.sends = rank_plan.sends()
        self.recvs = rank_plan.recvs()
        self.copies = rank_plan.copies()
        self.send_peers = np.array([op.peer for op in self.sends], dtype=np.int64)
        self.recv_peers = np.array([op.peer for op in self.recvs], dtype=np.int64)
        self.p2p = P2PExchange(group, timeout_s)
        self.device = groups.collective_device(group)
        self._side: Any = None  # read_back's stream and pinned buffer, made by its first call
        self._pinned: Any = None

    def read_back(self, t: torch.Tensor, work: Any) -> _ReadBack:
        """Queues the copy of `t` into pinned host memory once `work` (a collective on it) is
        done, on a side stream: a collective that never completes blocks that stream alone."""
        if self._side is None:
            self._side = torch.cuda.Stream(t.device)
            self._pinned = torch.empty(3, dtype=torch.int64).pin_memory()
        self._side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self._side):
            work.wait()
            self._pinned.copy_(t, non_blocking=True)
            return _ReadBack(self._pinned)

    def describe(self, op: Any) -> str:
        """`'name'[global box]` of one op (a _C.PlannedOp of RankPlan.sends/recvs/copies)."""
        box = ", ".join(f"{g}:{g + n}" for g, n in zip(op.global_start, op.size))
        return f"'{self.names.name(op.dst_name)}'[{box}]"


class _ReadBack:
    """A device-to-host copy queued on the current stream (Ops.read_back's side stream),
    waited for like a collective (collectives.wait polls is_completed)."""

    def __init__(self, pinned: torch.Tensor):
        self.pinned = pinned
        self.event = torch.cuda.Event()
        self.event.record()

    def is_completed(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        pass

    @property
    def values(self) -> list[int]:
        return [int(v) for v in self.pinned.tolist()]


def _groups(peers: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(peer, op indices) per peer; ops are sorted by peer (planner.h)."""
    if peers.size == 0:
        return []
    cut = np.flatnonzero(np.diff(peers)) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [peers.size]))
    return [(int(peers[a]), np.arange(a, b)) for a, b in zip(starts, ends)]


def _exchange(ops: Ops, send: np.ndarray) -> np.ndarray:
    """Sends every receiver the digests of this rank's sends to it; returns the senders'
    digests aligned with this rank's recv ops."""
    p2p_ops, landed = [], []
    for peer, idx in _groups(ops.send_peers):
        t = torch.from_numpy(send[idx].view(np.int64)).to(ops.device)
        p2p_ops.append(groups.p2p_op("send", t, ops.p2p.group, peer))
    for peer, idx in _groups(ops.recv_peers):
        t = torch.empty(idx.size, dtype=torch.int64, device=ops.device)
        p2p_ops.append(groups.p2p_op("recv", t, ops.p2p.group, peer))
        landed.append((idx, t))
    ops.p2p.run(p2p_ops)
    theirs = empty(len(ops.recvs))
    for idx, t in landed:
        theirs[idx] = t.cpu().numpy().view(np.uint64)
    return theirs


def _mailbox_sums(ops: Ops, sums: np.ndarray, what: str, seq: int, limit: float) -> np.ndarray:
    """The group's sums of `sums` (lo, hi, differ) through the host's mailboxes: this rank's
    row to every other rank, theirs added to it. ReshardError where a rank posts nothing
    in time, or a row of another call (another plan or execute; seq 0 is rx.verify's).
    Not cut short by plan.abort() (the data has landed): an exchange left open would take
    the peer's next header as its row, and both would wait out their timeouts."""
    channel = ops.channel
    mine = np.zeros(HEADER_LEN, dtype=np.int64)
    mine[[KIND, PLAN, SEQ]] = _CHECK_MAGIC, ops.plan_id, seq
    mine[[LO, HI, DIFFER]] = sums
    others = channel.others
    rows = np.zeros((len(others), HEADER_LEN), dtype=np.int64)
    session = Session(ops.plan_id, seq, None, 0, time.monotonic() + limit, limit, threading.Event())
    failed = channel.mailbox_exchange(others, mine, rows, session)
    if failed:
        raise ReshardError(f"{what}: rank(s) {sorted(failed)} did not join the digest check within {limit:g} s "
                           f"(rx.Options.timeout, default RESHARD_EXT_P2P_TIMEOUT); a rank stalled, died or did "
                           f"not make the same call")
    odd = [r for r, row in zip(others, rows) if list(row[[KIND, PLAN, SEQ]]) != list(mine[[KIND, PLAN, SEQ]])]
    if odd:
        raise ReshardError(f"{what}: rank(s) {odd} posted another call's digest check than rank {ops.rank} "
                           f"(plan {ops.plan_id}, execute {seq}): the ranks did not make the same call")
    return sums + rows[:, [LO, HI, DIFFER]].sum(axis=0)


def _zero(lo: int, hi: int, differ: int) -> bool:
    """Whether the group's lane sums (mod 2^32) and copy flags add up to nothing."""
    return lo % 2**32 == 0 and hi % 2**32 == 0 and differ == 0


def _all_match(ops: Ops, digests: Digests, copies_differ: bool, what: str, seq: int, limit: float) -> bool:
    """One all-reduce: the group's sums of send and of receive digests agree lane by lane
    (and no rank's copies differ). Every rank gets the same answer."""
    if isinstance(digests, DeviceDigests) and digests.buf.device.type == ops.device.type:
        # Queued behind the refit's last reads, before the host waits for them: launched
        # on a GPU gone idle, the same steps cost several times longer.
        t = torch.nn.functional.pad(digests.lane_difference().to(ops.device), (0, 1), value=int(copies_differ))
        work = dist.all_reduce(t, group=ops.p2p.group, async_op=True)
        if t.is_cuda:  # the answer's copy to the host is queued too
            landed = ops.read_back(t, work)
            digests.settle()
            wait(landed, what, limit)
            return _zero(*landed.values)
        digests.settle()
    else:
        if isinstance(digests, DeviceDigests):
            digests.settle()
            send, recv = digests.host()
        else:
            send, recv = digests
        sums = np.append(lanes(send) - lanes(recv), int(copies_differ))
        if ops.channel is not None and ops.device.type == "cpu" and ops.channel.all_local():
            return _zero(*(int(v) for v in _mailbox_sums(ops, sums, what, seq, limit)))
        t = torch.from_numpy(sums).to(ops.device)
        work = dist.all_reduce(t, group=ops.p2p.group, async_op=True)
    wait(work, what, limit)
    return _zero(*t.tolist())


def check(ops: Ops, digests: Digests, what: str, copies: tuple[np.ndarray, np.ndarray] | None = None,
          seq: int = 0, timeout_s: float | None = None) -> None:
    """Compares every op's digests across its two ends (and, given `copies`, the source
    and destination digests of same-rank copies); raises ReshardError on every rank of
    the group when any differ. Collective. seq: the execute's number (0: rx.verify);
    timeout_s: how long it waits for the other ranks (default: the plan's timeout)."""
    limit = ops.p2p.timeout_s if timeout_s is None else timeout_s
    if _all_match(ops, digests, copies is not None and bool(np.any(copies[0] != copies[1])), what, seq, limit):
        return
    send, recv = digests.host() if isinstance(digests, DeviceDigests) else digests
    theirs = _exchange(ops, send)
    errors = []
    for j in np.flatnonzero(theirs != recv):
        op = ops.recvs[j]
        errors.append(f"{ops.describe(op)} from rank {op.peer} to rank {ops.rank}: the sender's digest "
                      f"{int(theirs[j]):016x}, the receiver's {int(recv[j]):016x}")
    if copies is not None:
        for c in np.flatnonzero(copies[0] != copies[1]):
            op = ops.copies[c]
            errors.append(f"{ops.describe(op)} copied on rank {ops.rank}: the source's digest "
                          f"{int(copies[0][c]):016x}, the destination's {int(copies[1][c]):016x}")
    if first_failed_rank(ops.p2p.group, bool(errors), what, ops.p2p.timeout_s) < 0:
        return
    reports: list[Any] = [None] * groups.size(ops.p2p.group)
    dist.all_gather_object(reports, (len(errors), errors[:_MAX_LISTED]), group=ops.p2p.group)
    shown = [e for _, listed in reports for e in listed][:_MAX_LISTED]
    total = sum(n for n, _ in reports)
    more = f"\n  ... and {total - len(shown)} more" if total > len(shown) else ""
    raise ReshardError(f"{what}: destination pieces differ from their sources (bit for bit, digests of what the "
                       f"receiver must hold):\n  " + "\n  ".join(shown) + more)
