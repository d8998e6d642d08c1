"""collectives.wait: the bounded poll every host wait on a collective goes through."""
from __future__ import annotations

import pytest

from reshard_ext import backoff, collectives
from reshard_ext.errors import ReshardError


class _Work:
    """A collective that completes at virtual time `done_at` (or fails in wait())."""

    def __init__(self, clock: list[float], done_at: float, error: str = "") -> None:
        self.clock, self.done_at, self.error = clock, done_at, error

    def is_completed(self) -> bool:
        return self.clock[0] >= self.done_at

    def wait(self) -> None:
        if self.error:
            raise RuntimeError(self.error)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], list[float]]:
    """Virtual time: time.monotonic reads it, time.sleep advances it and logs each pause."""
    now, pauses = [0.0], []

    def sleep(s: float) -> None:
        pauses.append(s)
        now[0] += s

    def tick() -> float:
        now[0] += 1e-6  # every poll costs a little time
        return now[0]

    monkeypatch.setattr(collectives.time, "monotonic", tick)
    monkeypatch.setattr(collectives.time, "sleep", sleep)
    monkeypatch.setattr(backoff.os, "sched_yield", lambda: None)
    return now, pauses


def test_a_long_wait_sees_its_completion_within_the_pause_cap(clock: tuple[list[float], list[float]]) -> None:
    """A rank early at a collective (the check's all-reduce) polls at least once a
    millisecond past its spin, however long it waited: it does not oversleep a slower
    peer's finish."""
    now, pauses = clock
    collectives.wait(_Work(now, done_at=0.2), "test", timeout_s=5.0)
    assert pauses and max(pauses) <= 1e-3
    assert now[0] - 0.2 <= 1e-3


def test_a_wait_past_its_timeout_raises(clock: tuple[list[float], list[float]]) -> None:
    now, _ = clock
    with pytest.raises(ReshardError, match="within 0.05 s"):
        collectives.wait(_Work(now, done_at=1e9), "test", timeout_s=0.05)


def test_a_failed_collective_raises_reshard_error(clock: tuple[list[float], list[float]]) -> None:
    now, _ = clock
    with pytest.raises(ReshardError, match="a rank of the group died"):
        collectives.wait(_Work(now, done_at=0.0, error="Connection closed by peer"), "test", timeout_s=1.0)
