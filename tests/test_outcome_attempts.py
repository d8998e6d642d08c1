"""The outcome's unions between hosts carry the attempt of the call they answer for
(outcome._talk_to): one pair's messages scripted, so that each rule is seen alone; and an
alarm is a cause only for its own attempt (Channel.alarms). The 4-process cases are
test_outcome.py's stall and never-calls tests."""
from __future__ import annotations

import threading
import time

import numpy as np
import torch

from reshard_ext.transports import outcome
from reshard_ext.transports.channel import Session

PLAN, SEQ, PEER = 7, 3, 1


class _Lane:
    """An outcome lane whose receives from PEER are the scripted unions, in order."""

    def __init__(self, script: list[np.ndarray]):
        self.script = list(script)
        self.sent: list[int] = []  # the attempt of each union sent to PEER
        self.early: dict = {}

    def submit(self, fn):
        return fn

    def wait(self, task, session, what):
        return task()

    def exchange(self, ops, tag, session, retry_closed=False):
        for kind, peer, t in ops:
            assert peer == PEER
            if kind == "send":
                self.sent.append(int(t[outcome.U_ATTEMPT]))
            elif not self.script:
                return {peer: "it sent nothing within 1 s"}
            else:
                t.copy_(torch.from_numpy(self.script.pop(0)))
        return {}


class _Channel:
    size, rank = 2, 0

    def __init__(self, lane: _Lane):
        self.lane = lane

    def outcome_lane(self) -> _Lane:
        return self.lane


def _session(attempt: int, fixed: bool) -> Session:
    return Session(PLAN, SEQ, None, 0, time.monotonic() + 1.0, 1.0, threading.Event(), attempt=attempt,
                   attempt_fixed=fixed)


def _union(attempt: int, mark: int = 0) -> np.ndarray:
    u = outcome._union_of(2, _session(attempt, True), outcome.Part())
    u[outcome.U_LO] = mark  # tells the scripted unions apart
    return u


def _talk(lane: _Lane, execute: Session) -> np.ndarray | None:
    u = _union(execute.attempt)
    return outcome._talk_to(_Channel(lane), execute, execute, PEER, u, True, u.size, set())  # type: ignore[arg-type]


def test_a_union_of_an_earlier_attempt_is_dropped_and_the_next_one_read() -> None:
    lane = _Lane([_union(0, mark=1), _union(1, mark=2)])
    got = _talk(lane, _session(1, True))
    assert got is not None and got[outcome.U_LO] == 2 and not lane.script
    assert lane.sent == [1]  # ours went once


def test_a_union_of_a_later_attempt_waits_for_this_ranks_own_retry() -> None:
    """A rank still in the attempt the others gave up on must not consume their retry's
    union for good: it keeps it, and its own retry reads it instead of a message."""
    lane = _Lane([_union(1, mark=5)])
    late = _session(0, True)
    assert _talk(lane, late) is None and late.attempt == 0
    retry = _session(1, True)
    got = _talk(lane, retry)
    assert got is not None and got[outcome.U_LO] == 5 and not lane.early
    assert lane.sent == [0, 1]


def test_a_rank_that_skipped_the_failed_call_joins_the_others_attempt() -> None:
    """Without a header from any peer (no data peers) its count is not confirmed: it takes
    the peer's and sends its union again, at that count, in place of the one the peer dropped."""
    lane = _Lane([_union(2, mark=9)])
    skipper = _session(0, False)
    got = _talk(lane, skipper)
    assert got is not None and got[outcome.U_LO] == 9
    assert skipper.attempt == 2 and skipper.attempt_fixed
    assert lane.sent == [0, 2]


def test_an_alarm_of_another_attempt_is_not_this_attempts_cause():
    """A rank past its deadline looks once more at its peers' alarms (PeerWatch.last_look),
    also of those that left the call: a peer's alarm from the failed call before a retry
    (same execute number, same token) must not be read as the retry's cause."""
    from reshard_ext import _C
    from reshard_ext.transports.channel import Channel
    from reshard_ext.transports.peer_watch import PeerWatch

    a, b = _C.HostMailbox(0, 2, 11), _C.HostMailbox(1, 2, 11)
    a.attach(1, b.name)
    channel = object.__new__(Channel)  # only what alarms() reads on one host
    channel._mailbox, channel._local, channel.others = a, {1: True}, [1]
    retry = _session(1, True)
    retry.deadline = time.monotonic() - 1.0
    b.begin(retry.token, 0)
    b.raise_alarm(retry.token, 0, "rank 1: rank 0 sent no execute header within 1 s", False)
    b.end()  # rank 1 left the failed call (attempt 0) and has not begun the retry
    PeerWatch(channel).last_look(retry, [1])
    assert retry.stop_reason == ""
    b.begin(retry.token, 1)
    b.raise_alarm(retry.token, 1, "rank 1: the data exchange with rank 0 failed", False)
    b.end()  # it failed the retry too, and left it
    PeerWatch(channel).last_look(retry, [1])
    assert retry.stop_reason == "rank 1 failed this execute"
