"""Verified refits (DESIGN section 2): `rx.execute(plan, verify=True)` and `rx.verify(plan)`.

Every op of a plan gets a 64-bit digest at both ends: on the sender of what the receiver
must hold (after casts and MXFP8), on the receiver of what it wrote or holds
(csrc/kernels/digest.h; computed inside the pack/unpack kernels). Only digests travel,
and per op only when they differ: each rank's digest sums (sends minus receives, lane by
lane, summed where the digests are: on the GPU for the GPU transports) ride in the
execute's outcome, the exchange that ends every execute on every rank
(transports/outcome.py), which adds them up: all zero, every op matched (a mismatch that
cancels in the sum has a ~2^-64 chance). Only otherwise does each sender send each of its
receivers one vector, in the canonical op order both ends share, the receiver compares,
and ReshardError is raised on every rank of the group, naming the tensors, boxes and
ranks (one more all-reduce, and an all-gather of the reports).
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import groups
from .collectives import first_failed_rank
from .errors import ReshardError
from .transports.digests import DeviceDigests, Digests, lanes
from .transports.p2p import P2PExchange

_MAX_LISTED = 20
_PINNED = threading.local()  # a pinned landing place for the device sums, per thread


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

    def describe(self, op: Any) -> str:
        """`'name'[global box]` of one op (a _C.PlannedOp of RankPlan.sends/recvs/copies)."""
        box = ", ".join(f"{g}:{g + n}" for g, n in zip(op.global_start, op.size))
        return f"'{self.names.name(op.dst_name)}'[{box}]"


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


def _pinned(cuda: bool) -> torch.Tensor:
    buf = getattr(_PINNED, "buf", None)
    if buf is None:
        buf = _PINNED.buf = torch.empty(2, dtype=torch.int64, pin_memory=cuda)
    return buf


def _zero(lo: int, hi: int, differ: int) -> bool:
    """Whether the group's lane sums (mod 2^32) and copy flags add up to nothing."""
    return lo % 2**32 == 0 and hi % 2**32 == 0 and differ == 0


def sums_of(digests: Digests | None, copies: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """This rank's (lo, hi, differ): the lane sums of its send digests minus its receive
    digests, and whether a same-rank copy differs. The ranks add them up in the execute's
    outcome (transports/outcome.py); all zero: every op matched (a mismatch that cancels in
    the sum has a ~2^-64 chance). A device's digests are summed where they are and only
    the two sums come to the host, once the refit that wrote them is done (which raises
    where its transfers failed)."""
    differ = int(copies is not None and bool(np.any(copies[0] != copies[1])))
    if digests is None:
        return np.array([0, 0, differ], dtype=np.int64)
    if isinstance(digests, DeviceDigests):
        lanes_on_device = digests.lane_difference()
        landed = _pinned(lanes_on_device.is_cuda)
        landed.copy_(lanes_on_device, non_blocking=True)
        done = torch.cuda.Event() if lanes_on_device.is_cuda else None
        if done is not None:
            done.record()
        digests.settle()
        if done is not None:
            done.synchronize()
        return np.array([int(landed[0]), int(landed[1]), differ], dtype=np.int64)
    send, recv = digests
    return np.append(lanes(send) - lanes(recv), differ)


def check(ops: Ops, digests: Digests, what: str, copies: tuple[np.ndarray, np.ndarray] | None = None,
          sums: np.ndarray | None = None) -> None:
    """Where the group's digest sums (sums_of, added up by the execute's outcome) are not
    zero: compares every op's digests across its two ends (and, given `copies`, the source
    and destination digests of same-rank copies), and raises ReshardError on every rank of
    the group naming them. Collective (every rank has the same sums)."""
    if sums is not None and _zero(*(int(v) for v in sums)):
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
