"""The pause between polls of the Python layer's host waits (store keys, peers, async
collectives); csrc/common/backoff.h is the C++ side's. Imports nothing of reshard_ext."""
from __future__ import annotations

import os
import time


class Backoff:
    """Sleeps `first_s`, then twice as long after each sleep up to `cap_s` (which bounds
    how late a poll sees its answer). With `spin_s`, the first `spin_s` seconds from its
    creation yield the CPU instead: short sleeps overshoot by the timer slack, so a wait
    that ends soon polls. Deadlines and aborts stay with the caller, which words them."""

    def __init__(self, first_s: float, cap_s: float, spin_s: float = 0.0) -> None:
        self._pause_s = first_s
        self._cap_s = cap_s
        self._spin_until = time.monotonic() + spin_s if spin_s > 0 else None

    def spinning(self) -> bool:
        """Whether pause() still yields rather than sleeps."""
        if self._spin_until is not None and time.monotonic() >= self._spin_until:
            self._spin_until = None  # the spin is over for good: no clock reads from here on
        return self._spin_until is not None

    def pause(self) -> None:
        if self.spinning():
            os.sched_yield()
            return
        time.sleep(self._pause_s)
        self._pause_s = min(self._pause_s * 2, self._cap_s)
