"""Backoff: the pause between polls of every Python host wait (collectives, channel, connect)."""
from __future__ import annotations

import pytest

from reshard_ext import backoff
from reshard_ext.backoff import Backoff


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], list[object]]:
    """Virtual time: time.monotonic reads it; time.sleep advances it and os.sched_yield
    takes a microsecond; both log themselves in order (a sleep as its length)."""
    now: list[float] = [0.0]
    log: list[object] = []

    def sleep(s: float) -> None:
        log.append(s)
        now[0] += s

    def sched_yield() -> None:
        log.append("yield")
        now[0] += 1e-6

    monkeypatch.setattr(backoff.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(backoff.time, "sleep", sleep)
    monkeypatch.setattr(backoff.os, "sched_yield", sched_yield)
    return now, log


def test_the_pause_doubles_up_to_its_cap(calls: tuple[list[float], list[object]]) -> None:
    _, log = calls
    b = Backoff(1e-3, 0.02)
    for _ in range(8):
        b.pause()
    assert log == [1e-3, 2e-3, 4e-3, 8e-3, 16e-3, 0.02, 0.02, 0.02]


def test_without_a_spin_the_first_pause_sleeps(calls: tuple[list[float], list[object]]) -> None:
    _, log = calls
    b = Backoff(1e-3, 0.05)
    assert not b.spinning()
    b.pause()
    assert log == [1e-3]


def test_the_spin_yields_before_the_first_sleep(calls: tuple[list[float], list[object]]) -> None:
    """For `spin_s` from its creation a pause yields the CPU; then it sleeps from the first
    pause on, doubling as without a spin."""
    now, log = calls
    now[0] = 5.0  # the spin counts from creation, not from time zero
    b = Backoff(1e-5, 5e-4, spin_s=1e-4)
    while b.spinning():
        b.pause()
    spins = len(log)
    assert spins == 100 and set(log) == {"yield"}
    for _ in range(8):
        b.pause()
    assert log[spins:] == [1e-5, 2e-5, 4e-5, 8e-5, 16e-5, 32e-5, 5e-4, 5e-4]
    assert not b.spinning()
