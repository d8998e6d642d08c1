"""Fail fast: a rank that fails an execute, or dies, stops its peers within a fraction of
a second instead of at their timeout.

A rank that fails raises an alarm (Channel.raise_alarm: the execute's token and why, in
its shared-memory mailbox for the ranks of its host, in the store for the others). While
an execute runs, one thread per channel looks every _TICK_S at the other ranks' alarms
and, every _ALIVE_S, whether the process of a rank of this host is gone; the store (ranks
on other hosts) every _REMOTE_S. On either it stops the execute the way plan.abort()
does: the session's abort flag, which every wait of the transports polls, and the
transport's abort (NCCL's communicator, the direct and NVSHMEM host waits). An execute
shorter than one tick is never looked at.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_TICK_S = 0.05
_ALIVE_S = 0.25
_REMOTE_S = 0.5


class PeerWatch:
    def __init__(self, channel: Any):
        self._channel = channel
        self._cv = threading.Condition()
        self._current: tuple[Any, Callable[[], None]] | None = None  # (session, the transport's abort)
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self, session: Any, stop: Callable[[], None]) -> None:
        """Watches `session` until end(); stop() aborts its transport."""
        with self._cv:
            self._current = (session, stop)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="reshard_ext peer watch", daemon=True)
                self._thread.start()
            self._cv.notify()

    def end(self) -> None:
        """Stops watching: once this returns, the watch stops nothing of the session."""
        with self._cv:
            self._current = None

    def close(self) -> None:
        """Ends the watch's thread (the channel's group closed): it holds the channel, and so
        the group's store, while it runs."""
        with self._cv:
            self._closed, self._current = True, None
            self._cv.notify()
            thread = self._thread
        # joined, so that the store's socket is gone once the group's close returns
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=_TICK_S * 20)

    def _run(self) -> None:
        handled: Any = None
        while True:
            with self._cv:
                while not self._closed and (self._current is None or self._current[0] is handled):
                    self._cv.wait(_TICK_S if self._current is not None else None)
                if self._closed or self._current is None:
                    return
                session = self._current[0]
            handled = session if self._watch(session) else None

    def last_look(self, session: Any, peers: list[int]) -> None:
        """Once more, as this rank's part fails without the watch having stopped it: one of
        its peers may have raised its alarm after the last tick. That alarm then is the
        cause and this rank's failure (a peer that left sends no header, no data) only what
        followed, as where the watch had seen it. Also the alarm of a peer that left the
        call since, or took it back as it began its retry: it still says why this attempt
        failed. Of two ranks failing at once, at least one keeps its own cause: each looks
        before it raises its alarm."""
        if not session.stop_reason and not session.abort.is_set():
            alarms = self._channel.alarms(session, peers, causes=True)
            session.stop_reason = f"rank {min(alarms)} failed this execute" if alarms else ""

    def _watch(self, session: Any) -> bool:
        """Looks at the peers until the execute ends (False) or one failed or died (True:
        the execute is stopped)."""
        ch = self._channel
        ticks = 0
        alive_every, remote_every = round(_ALIVE_S / _TICK_S), round(_REMOTE_S / _TICK_S)
        while True:
            with self._cv:
                self._cv.wait(_TICK_S)
                if self._current is None or self._current[0] is not session:
                    return False
            ticks += 1
            cause, reason = "", ""
            alarms = ch.alarms(session, ch.others, remote=ticks % remote_every == 0)
            if alarms:
                r = min(alarms)
                reason = f"rank {r} failed this execute"
            elif ticks % alive_every == 0:
                gone = ch.gone(ch.others)
                if gone:
                    cause = f"rank {gone[0]}: its process exited during the execute (killed or crashed)"
                    reason = cause
                    session.stop_cause_rank = gone[0]
            if not reason:
                continue
            with self._cv:
                if self._current is None or self._current[0] is not session:
                    return False
                session.stop_reason, session.stop_cause = reason, cause
                session.abort.set()
                self._current[1]()
            return True
