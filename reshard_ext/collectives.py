"""Collectives over the caller's process group, bounded by the reshard timeout.

`rx.plan` agrees on metadata with a few small collectives. A rank that stalls, dies or
never calls `rx.plan` must not keep the others waiting for the process group's own
timeout (30 minutes by default): every wait here polls the work and raises
ReshardError after the reshard timeout (rx.Options.timeout, default
RESHARD_EXT_TIMEOUT). Polling works for gloo and NCCL
collectives alike, and a collective given up on still completes in the background if
the late rank joins it, so the group's order of collectives is kept.
"""
from __future__ import annotations

import pickle
import time
from typing import Any

import torch
import torch.distributed as dist

from . import groups
from .backoff import Backoff
from .errors import ReshardError
from .options import default_timeout

_SPIN_S = 1e-3  # how long wait() polls before it sleeps between polls
# The longest sleep between polls: a wait sees its completion at most this late. Ranks that
# reach a collective early (a verified execute's check) otherwise oversleep a slower peer.
_MAX_PAUSE_S = 5e-4


def wait(work: Any, what: str, timeout_s: float | None = None) -> None:
    """Waits for an async collective; ReshardError after the timeout (default
    RESHARD_EXT_TIMEOUT) or when the collective fails (a peer died)."""
    limit = default_timeout("gloo") if timeout_s is None else timeout_s
    deadline = time.monotonic() + limit
    backoff = Backoff(1e-5, _MAX_PAUSE_S, spin_s=_SPIN_S)
    try:
        while not work.is_completed():
            if not backoff.spinning() and time.monotonic() > deadline:
                raise ReshardError(
                    f"{what}: not every rank of the group joined within {limit:g} s (rx.Options.timeout, default "
                    f"RESHARD_EXT_TIMEOUT); "
                    f"a rank stalled, died or did not make the same call")
            backoff.pause()
        work.wait()
    except ReshardError:
        raise
    except RuntimeError as e:  # gloo / NCCL: a peer died or the connection broke
        raise ReshardError(f"{what}: the collective failed, a rank of the group died or left it ({e})") from e


def all_gather_objects(obj: Any, group: Any, what: str, timeout_s: float | None = None) -> list[Any]:
    """dist.all_gather_object with a bounded wait: every rank's `obj`, in group rank order."""
    world = groups.size(group)
    device = groups.collective_device(group)
    data = pickle.dumps(obj)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    wait(dist.all_gather(sizes, size, group=group, async_op=True), what, timeout_s)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    wait(dist.all_gather(out, buf, group=group, async_op=True), what, timeout_s)
    return [pickle.loads(t[:n].cpu().numpy().tobytes()) for t, n in zip(out, lengths)]


def first_failed_rank(group: Any, failed: bool, what: str = "rx.plan", timeout_s: float | None = None) -> int:
    """One all-reduce: the lowest group rank that passed failed=True, or -1. Lets a
    failure on one rank (an allocation, a local check) raise on every rank at once
    instead of leaving the others waiting in their next collective."""
    world = groups.size(group)
    t = torch.tensor([world - groups.rank(group) if failed else 0], dtype=torch.int64,
                     device=groups.collective_device(group))
    wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True), what, timeout_s)
    top = int(t.item())
    return world - top if top else -1
