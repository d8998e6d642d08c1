"""The private host channel of a process group: execute headers, and the CPU
transport's data, over gloo contexts of reshard_ext's own.

Why not the caller's group: a point-to-point wait that times out in gloo closes that
pair's connection for good, and gloo cannot cancel a posted message. Over the caller's
group one dead or late peer would break it for every later use; here it only costs a
fresh connection for that pair.

- Connections are per pair and lazy (TORCH_GLOO_LAZY_INIT): a pair (a, b) talks over
  generation g, a gloo context whose store keys are its own. When either end's wait on
  the pair fails (a timeout closes it; the other end then sees "connection closed",
  now or at its next message), each end moves that pair to generation g + 1 exactly
  once, so both ends meet again on a clean connection, without any other rank.
- First contact on a generation is agreed through one store counter per pair (`_meet`):
  both ends post there only once both counted themselves in, and an end that gives up
  first kills the generation for both. Posting alone would block the worker (gloo's
  passive end of a lazy connection waits for the peer's first message, for minutes), or
  leave messages that the peer's next execute would match on arrival.
- Every message is posted and waited for on one worker thread per channel, with the
  execute's deadline as gloo's timeout: a lazy connection may block while the peer has
  not arrived, and the calling thread must stay free to honour plan.abort(). A new
  execute first waits until the worker has finished everything earlier, so an aborted
  execute's messages complete or time out (closing their pairs) before new ones go out
  on the same connections.
- Execute headers between two processes of one host skip gloo: each rank posts them in
  a shared-memory mailbox of its own that its peers on the host map (_C.HostMailbox), so
  no round trip through worker threads delays an execute's first GPU work. A pair uses
  it where both ranks made one and share the host's /dev/shm (decided alike at both ends).
- The CPU transport's data between two processes of one host skips gloo too: each rank
  makes a segment of rings, one per sender of its host (_C.HostRing), the first time it
  moves data; a pair uses them where both ranks made theirs (decided alike at both ends).
  Chunks carry the execute's token, so a ring needs no reset after an aborted execute.
- One execute at a time per group in a process: a second thread is refused; two groups
  over the same ranks have two channels (groups.key holds torch's name for the group).
- A rank that fails an execute raises an alarm (in its mailbox; in the store where a rank
  is on another host) that the others' PeerWatch reads while they wait (peer_watch.py),
  and every execute ends with its outcome on every rank (outcome.py), which between hosts
  travels on a lane of its own (outcome_lane).
"""
from __future__ import annotations

import atexit
import os
import queue
import socket
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from .. import _C, groups
from ..backoff import Backoff
from ..errors import ReshardError
from ..options import default_timeout, env_default, scoped_external_env, wait_time
from .peer_watch import PeerWatch

HEADER_TAG = 1
REMAP_TAG = 0  # the direct transport's new IPC exports after a receiver's local rebind (transports/direct.py)
_MAGIC = 0x52584844  # "RXHD"
# Header fields (int64): what both ends of a pair must agree on before data moves.
# ATTEMPT: the sender's Session.attempt (not checked: each end takes the larger, exchange_headers).
MAGIC, PLAN, SEQ, VERSION, FLAGS, STATUS, BATCHES, EPOCH, SWAP_GEN, REMAP, ATTEMPT = range(11)
HEADER_LEN = 11
HAS_VERSION = 1  # FLAGS bit
COMM_UNUSABLE = 2  # FLAGS bit: the sender's NCCL communicator needs a rebuild
IN_SWAP = 4  # FLAGS bit: a warm rx.swap_model_weights round (headers go to every rank of the group)
REPLAN = 8  # FLAGS bit (with IN_SWAP): the sender takes the swap's slow path; nobody moves data
VERIFIES = 16  # FLAGS bit: the sender runs rx.execute(verify=True) (the check is collective)
_POLL_S = 0.05  # how often a waiting caller looks at its abort flag
_ARRIVE, _LEAVE = 1, 10  # what an end adds to its pair's counter of a generation (Channel._meet)
REPLAN_HERE = -1  # Session.swap of a rank that takes the swap's slow path
# A pair's ring: 4 slots of 128 KiB (512 KiB of /dev/shm per rank of the host, per rank):
# a chunk stays in the caches between the two copies, and the sender runs ahead by three.
_RING_SLOTS, _RING_SLOT_BYTES = 4, 128 << 10


def data_tag(plan_id: int, seq: int, attempt: int = 0) -> int:
    """The gloo tag of an execute's data messages: a message abandoned by an earlier
    execute, or by an earlier attempt at this one, can never match a later one."""
    return 2 + (plan_id * 0x9E3779B1 + seq * 0x85EBCA77 + attempt) % (1 << 30)


def data_token(plan_id: int, seq: int) -> int:
    """The token of an execute's chunks in the shared-memory rings (never 0)."""
    return (plan_id * 0x9E3779B97F4A7C15 + seq) % (1 << 64) or 1


@dataclass
class Session:
    """One execute as the transports see it."""

    plan_id: int
    seq: int
    version: int | None
    status: int  # 0, or 1: this rank failed a local check and moves no data
    deadline: float  # time.monotonic() by which every wait gives up
    timeout: float  # seconds (messages)
    abort: threading.Event
    epoch: int = 0  # GPU: the NCCL communicator generation this rank runs
    comm_unusable: bool = False
    error: str = ""  # with status 1: this rank's own problem, raised after telling the peers
    verdict: Verdict | None = None  # filled by exchange_headers
    # A swap round (rx.swap_model_weights): the generation of the cached plan this rank runs,
    # or REPLAN_HERE where it takes the slow path. None: a plain execute.
    swap: int | None = None
    remap: int = 0  # bytes of the message this rank sends each direct sender after the headers (0: none)
    verify: bool = False  # rx.execute(verify=True)
    # Why `abort` was set when not by plan.abort(): a peer failed or died (the channel's watch);
    # stop_cause: the cause line of a peer that cannot report its own (its process is gone)
    stop_reason: str = ""
    stop_cause: str = ""
    stop_cause_rank: int = -1  # the rank stop_cause is about
    # How many calls with this (plan, seq) failed before this one, as this rank and the peers
    # it exchanged headers with agree (the larger of theirs): a retry's gloo messages never
    # match those of a call still running late on another host (data_tag, outcome.py).
    attempt: int = 0
    attempt_fixed: bool = False  # a peer's header or outcome row confirmed `attempt`

    @property
    def token(self) -> int:
        """This execute's identity on every rank (never 0): alarms and ring chunks carry it."""
        return data_token(self.plan_id, self.seq)

    def stopped(self, what: str) -> str:
        """The message of this execute stopped by its abort flag while `what`."""
        if self.stop_reason:
            return f"{self.stop_reason}; this rank stopped while {what}"
        return f"rx.execute was aborted (plan.abort()) while {what}"

    def header(self, batches: int) -> list[int]:
        flags = ((HAS_VERSION if self.version is not None else 0) | (COMM_UNUSABLE if self.comm_unusable else 0)
                 | (VERIFIES if self.verify else 0))
        if self.swap is not None:
            flags |= IN_SWAP | (REPLAN if self.swap == REPLAN_HERE else 0)
        return [_MAGIC, self.plan_id, self.seq, self.version or 0, flags, self.status, batches, self.epoch,
                self.swap if self.swap is not None else 0, self.remap, self.attempt]

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


class _Headers:
    """Our execute header and one row per peer for theirs: int64 tensors with numpy views."""

    __slots__ = ("_ops", "_ops_key", "mine", "mine_np", "received_np", "rows")

    def __init__(self, peers: int):
        self.mine_np = np.zeros(HEADER_LEN, dtype=np.int64)
        self.received_np = np.zeros((peers, HEADER_LEN), dtype=np.int64)
        self.mine = torch.from_numpy(self.mine_np)
        self.rows = list(torch.from_numpy(self.received_np))
        self._ops: list[tuple[str, int, torch.Tensor]] = []
        self._ops_key: tuple | None = None

    def ops(self, ranks: list[int], rows: list[int]) -> list[tuple[str, int, torch.Tensor]]:
        """The (kind, peer, tensor) messages of a gloo header exchange with `ranks`, whose
        headers land in `rows` (made once per ranks)."""
        key = (tuple(ranks), tuple(rows))
        if self._ops_key != key:
            self._ops = [("send", p, self.mine) for p in ranks] + \
                [("recv", p, self.rows[i]) for p, i in zip(ranks, rows)]
            self._ops_key = key
        return self._ops


class _Task:
    """One job of the worker. `latch` stays locked until the job has run: a bare lock is the
    cheapest one-shot signal between two threads (an Event builds a Condition per job)."""

    __slots__ = ("done", "error", "fn", "latch", "result")

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.latch = threading.Lock()
        self.latch.acquire()
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None


class Channel:
    """See the module doc. One per set of group ranks in a process (`channel_of`)."""

    def __init__(self, group: Any, lane: str = ""):
        self.group = group
        self.rank = groups.rank(group)
        self.size = groups.size(group)
        self.ranks = groups.ranks(group)
        self.key = groups.key(group)
        self.others = [r for r in range(self.size) if r != self.rank]  # a swap round's header ranks
        key = "-".join(map(str, self.ranks)) if len(self.ranks) <= 16 else f"{hash(self.ranks) & 0xFFFFFFFF:x}"
        # two groups over the same ranks have channels of their own (groups.key holds torch's name)
        self._prefix = f"reshard_ext/channel/{self.size}/{key}/{_key_tag(self.key)}/{lane}"
        self.store = groups.store(group)
        self._contexts: dict[int, Any] = {}
        self._gen: dict[int, int] = {}  # peer -> generation of our pair (worker thread only)
        self._met: set[tuple[int, int]] = set()  # (peer, generation) on which both ends post
        self._waiting: dict[int, int] = {}  # peer -> the generation we counted ourselves in first (_meet)
        self._busy = threading.Lock()
        self.owner: str | None = None  # the thread in an execute, for the refusal message
        self._jobs: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._last: _Task | None = None  # the worker runs jobs in order: when it is done, all are
        self._headers: _Headers | None = None  # see header_buffers
        self._mailbox: Any = None
        self._announced = "-"
        if not lane:  # an outcome lane carries gloo messages only
            self._mailbox, self._announced = self._open_mailbox()
        self._lane: Channel | None = None  # see outcome_lane
        self._why, self._why_text = "", ""  # this rank's last alarm in the store (raise_alarm)
        # (peer, plan, seq, attempt) -> an outcome union of a later attempt that reached this
        # rank while it was still in an earlier one (outcome lanes; outcome._talk_to)
        self.early: dict[tuple[int, int, int, int], np.ndarray] = {}
        self._local: dict[int, bool] = {}  # peer -> whether our headers go through the mailboxes
        self._all_local: bool | None = None  # see all_local
        self._splits: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}  # see split()
        self._ring: Any = None  # this rank's data rings (_C.HostRing), made by make_ring
        self._ring_made = False
        self._ring_peers: dict[int, bool] = {}  # peer -> whether our data goes through the rings
        self._ring_lock = threading.Lock()
        self.closed = False  # its group was closed (rx.connect's ConnectedGroup.close())
        self.watch = PeerWatch(self)  # fail fast
        self._worker = threading.Thread(target=self._work, name=f"reshard_ext channel {key}", daemon=True)
        self._worker.start()

    def outcome_lane(self) -> Channel:
        """A channel of the same ranks with pair connections and a worker of its own: the
        outcome of an execute between hosts travels there, never queued behind this
        channel's data messages (gloo cannot cancel those, so a stopped execute's stay
        posted until its deadline)."""
        if self._lane is None:
            self._lane = Channel(self.group, lane="outcome/")
            self._lane._local = {p: False for p in self.others}
            self._lane._all_local = False
        return self._lane

    # --- headers through shared memory (same host) --------------------------------------
    def _mailbox_key(self, rank: int) -> str:
        return f"{self._prefix}mailbox/{rank}"

    def _open_mailbox(self) -> tuple[Any, str]:
        """This rank's header mailbox and its announcement in the store, "<host> <name>" ("-": none).
        Made with the channel: every rank of a plan has made its channel before rx.plan
        returns anywhere, so a peer's announcement is there by the first header exchange."""
        mailbox, value = None, "-"
        if self.size > 1 and bool(env_default("RESHARD_EXT_HOST_MAILBOX")):
            try:
                mailbox = _C.HostMailbox(self.rank, self.size, HEADER_LEN)
                value = f"{_host_key()} {mailbox.name}"
            except Exception:  # noqa: BLE001 - no shared memory here: headers go over gloo
                mailbox = None
        self.store.set(self._mailbox_key(self.rank), value)
        return mailbox, value

    def local(self, peer: int) -> bool:
        """Whether our headers with `peer` go through the mailboxes: both ranks made one on
        the same /dev/shm (both ends decide alike from the two announcements)."""
        known = self._local.get(peer)
        if known is None:
            key = self._mailbox_key(peer)
            limit = default_timeout("gloo")
            try:  # there since rx.plan (learn_peers); bounded by the reshard timeout, not the store's, all the same
                self.store.wait([key], wait_time(limit))
            except RuntimeError:
                raise ReshardError(f"rank {self.rank} cannot reach rank {peer} of its group: rank {peer} never made "
                                   f"a plan over this group, or the group's store is gone (the process that hosts "
                                   f"it exited)") from None
            mine = self._announced
            theirs = self.store.get(key).decode()
            known = mine != "-" and theirs != "-" and mine.split(" ")[0] == theirs.split(" ")[0]
            if known:
                self._mailbox.attach(peer, theirs.split(" ", 1)[1])
            self._local[peer] = known
        return known

    def all_local(self) -> bool:
        """Whether every other rank of the group is reached through the mailboxes (the same
        answer on every rank: one rank without a mailbox, or on another host, makes it False
        for all)."""
        if self._all_local is None:
            self._all_local = self._mailbox is not None and all(self.local(p) for p in self.others)
        return self._all_local

    def learn_peers(self, rings: bool = False) -> None:
        """Reads every rank's mailbox announcement, and makes and announces this rank's data
        rings (rings: the plan moves its data through them), at the end of rx.plan: every
        rank made its channel by then, and no execute waits on the store for a peer that
        never gets that far."""
        for p in self.others:
            self.local(p)
        if rings:
            self.make_ring()

    def split(self, ranks: list[int]) -> tuple[list[int], list[int]]:
        """Indices into `ranks` of the peers our headers reach through the mailboxes, and of the
        others (remembered per list of ranks)."""
        key = tuple(ranks)
        known = self._splits.get(key)
        if known is None:
            near = [self.local(p) for p in ranks]
            known = self._splits[key] = ([i for i, n in enumerate(near) if n], [i for i, n in enumerate(near) if not n])
        return known

    def mailbox_exchange(self, peers: list[int], header: np.ndarray, rows: np.ndarray, session: Session,
                         before_wait: Callable[[], None] | None = None,
                         enough: Callable[[list[int]], bool] | None = None) -> dict[int, str]:
        """Our header to each of `peers` (all local) and theirs into rows (in peers' order);
        before_wait runs while they travel. Returns {peer: error} of the pairs that failed:
        what did not arrive by the deadline, or once enough(peers not done yet) says so, is
        withdrawn, alike at both ends. An abort withdraws at once too, so no exchange stays
        open past its execute."""
        mailbox = self._mailbox
        mailbox.post(peers, header)
        try:
            if before_wait is not None:
                before_wait()
            while not mailbox.poll(min(max(session.remaining(), 0.0), _POLL_S), rows):
                if session.abort.is_set():
                    raise ReshardError(session.stopped("exchanging execute headers"))
                if session.remaining() <= 0 or (enough is not None and enough(list(mailbox.unfinished()))):
                    break
        finally:
            outcome = mailbox.finish(rows)
        return {p: _MAILBOX_FAILURES[o] for p, o in zip(peers, outcome) if o}

    # --- fail fast: alarms and gone processes -------------------------------------------
    def _alarm_key(self, plan_id: int, seq: int) -> str:
        return f"{self._prefix}alarm/{plan_id}/{seq}"

    def _why_key(self, rank: int) -> str:
        return f"{self._prefix}why/{rank}"

    def raise_alarm(self, session: Session, text: str, left: bool = False, gave_up: int = -1) -> None:
        """Tells every other rank that this rank failed `session`'s execute, and why: in its
        mailbox (ranks of this host read it while they wait) and, where some rank is on
        another host, in the store. left: this rank leaves without the execute's outcome
        round (plan.abort()), so nobody waits for its row; gave_up: the rank it stopped
        waiting for (-1: none), so that a rank on another host that never hears this one's
        union still knows why that rank is silent (Alarm.gave_up)."""
        if self._mailbox is not None:
            self._mailbox.raise_alarm(session.token, session.attempt, text, left)
        if self.all_local():
            return
        try:  # the failure path only: two small writes; a store that is gone reads as no alarm
            self._why = f"{session.plan_id} {session.seq} {session.attempt} {int(left)} {gave_up}"
            self.store.set(self._why_key(self.rank), f"{self._why} 0\n{text}")
            self._why_text = text
            self.store.set(self._alarm_key(session.plan_id, session.seq), "1")
        except RuntimeError:
            pass

    def begin_call(self, session: Session, stale: tuple[int, int] | None = None, attempt: int = 0,
                   lingering: Sequence[int] = ()) -> None:
        """This rank enters `session`'s execute: an alarm it raised earlier under the same
        token (an execute that did not count: stale, its (plan, seq)) is taken back first, so
        that the other ranks never read it as this execute's. attempt: how many calls with
        this token did not count before this one (a retry); lingering: ranks of this host
        not heard from in the last of them and still in it as it ended here (`lingering`).
        The retry waits, within its deadline, until they have left that call: a rank late
        past the timeout must end the call the others gave up on before they retry, else its
        data lands in their retry while its own call (and theirs, without its row) fails."""
        if self._mailbox is not None:
            waiting = list(lingering)
            backoff = Backoff(1e-3, 0.02)
            while waiting and session.remaining() > 0 and not session.abort.is_set():
                waiting = self._mailbox.behind(waiting, session.token, attempt)
                waiting = list(set(waiting) - set(self.gone(waiting)))
                if waiting:
                    backoff.pause()
            self._mailbox.begin(session.token, attempt)
        if stale is not None and not self.all_local():
            try:
                self.store.delete_key(self._alarm_key(*stale))
                # marked taken back, not deleted: a peer may be reading it for its answer's
                # causes (and a get of a deleted key would wait out the store's timeout)
                if self._why:
                    self.store.set(self._why_key(self.rank), f"{self._why} 1\n{self._why_text}")
            except RuntimeError:
                pass

    def lingering(self, session: Session, attempt: int) -> list[int]:
        """The ranks of this host in `session`'s execute at `attempt` or an earlier one now
        (as this rank's call of it, which did not count, ends)."""
        if self._mailbox is None:
            return []
        return list(self._mailbox.behind([r for r in self.others if self._local.get(r)], session.token, attempt + 1))

    def end_call(self) -> None:
        if self._mailbox is not None:
            self._mailbox.end()

    def alarms(self, session: Session, ranks: list[int], remote: bool = True,
               tokens: dict[int, int] | None = None, causes: bool = False) -> dict[int, Alarm]:
        """{rank: Alarm} of the ranks among `ranks` that raised an alarm for `session`'s
        execute (or, for a rank in `tokens`, for that token's): from their mailboxes, and
        (remote) from the store for the others. causes: the causes of an answer, not a
        reason to stop: also the alarms of ranks that left the execute since, or took them
        back as they began their next attempt. An alarm of another attempt of `session`'s
        execute is none of its."""
        found: dict[int, Alarm] = {}
        local = [r for r in ranks if self._local.get(r)]
        if tokens or causes:
            for r in local:
                token = (tokens or {}).get(r, session.token)
                got = self._mailbox.read_alarm(r, token)
                if got is not None and (token != session.token or got[2] == session.attempt):
                    found[r] = Alarm(got[0].decode(errors="replace"), bool(got[1]))
        elif local:
            for r in self._mailbox.alarmed(local, session.token):
                got = self._mailbox.read_alarm(r, session.token)
                if got is not None:
                    found[r] = Alarm(got[0].decode(errors="replace"), bool(got[1]))
        far = [r for r in ranks if not self._local.get(r)]
        if far and remote:
            try:
                if causes or self.store.check([self._alarm_key(session.plan_id, session.seq)]):
                    for r in far:
                        key = self._why_key(r)
                        if not self.store.check([key]):
                            continue
                        head, _, text = self.store.get(key).decode(errors="replace").partition("\n")
                        plan, seq, attempt, left, gave_up, back = (int(x) for x in head.split())
                        # a rank still in an attempt the others gave up on: not this attempt's cause
                        if (plan, seq, attempt) == (session.plan_id, session.seq, session.attempt) and (
                                causes or not back):
                            found[r] = Alarm(text, bool(left), gave_up)
            except (RuntimeError, ValueError):
                pass
        return found

    def gone(self, ranks: list[int]) -> list[int]:
        """The ranks among `ranks` on this host whose process has exited."""
        local = [r for r in ranks if self._local.get(r)]
        return list(self._mailbox.gone(local)) if local else []

    # --- the CPU transport's data through shared memory (same host) ---------------------
    def _ring_key(self, rank: int) -> str:
        return f"{self._prefix}ring/{rank}"

    def make_ring(self) -> None:
        """This rank's rings, one per rank whose headers go through the mailboxes (the same
        list at every rank of the host), announced in the store ("-": none). Made (once) by
        the first plan that voted for them (rx.Tuning.host_ring), at the end of rx.plan."""
        with self._ring_lock:
            if not self._ring_made:
                self._make_ring()

    def _make_ring(self) -> None:
        self._ring_made = True
        value = "-"
        if self._mailbox is not None:
            near = sorted([self.rank] + [p for p in self.others if self.local(p)])
            if len(near) > 1:
                try:
                    self._ring = _C.HostRing(self.rank, near, _RING_SLOTS, _RING_SLOT_BYTES)
                    value = self._ring.name
                except Exception:  # noqa: BLE001 - /dev/shm full or missing: data goes over gloo
                    self._ring = None
        self.store.set(self._ring_key(self.rank), value)

    def ring_peer(self, peer: int, session: Session) -> bool:
        """Whether the CPU transport's data with `peer` goes through the rings: both ranks
        made theirs (both ends decide alike from the two announcements). The peer announces
        on its first data exchange, which pairs with ours."""
        known = self._ring_peers.get(peer)
        if known is not None:
            return known
        with self._ring_lock:
            if not self._ring_made:
                self._make_ring()
            return self._ring_peer(peer, max(session.remaining(), 1.0))

    def _ring_peer(self, peer: int, limit: float) -> bool:
        known = self._ring_peers.get(peer)
        if known is None:
            if self._ring is None or not self.local(peer):
                known = False
            else:
                key = self._ring_key(peer)
                try:  # there since rx.plan (learn_peers)
                    self.store.wait([key], wait_time(limit))
                except RuntimeError:
                    raise ReshardError(f"rank {self.rank} cannot reach rank {peer}'s data rings: rank {peer} made "
                                       f"no plan that moves data over this group, or the group's store is gone "
                                       f"(the process that hosts it exited)") from None
                theirs = self.store.get(key).decode()
                known = theirs != "-"
                if known:
                    self._ring.attach(peer, theirs)
            self._ring_peers[peer] = known
        return known

    def _ring_exchange(self, ops: list[tuple[str, int, torch.Tensor]], token: int, session: Session,
                       hashed: tuple | None) -> dict[int, str]:
        """ops (byte tensors, every peer a ring peer) through the rings; {peer: error} of
        the pairs that did not finish by the deadline or were aborted."""
        ring = self._ring
        sends = [(peer, t.data_ptr(), t.numel()) for kind, peer, t in ops if kind == "send"]
        recvs = [(peer, t.data_ptr(), t.numel()) for kind, peer, t in ops if kind != "send"]
        if hashed is not None:
            ring.begin_verified(token, sends, recvs, *hashed)
        else:
            ring.begin(token, sends, recvs)
        try:
            while not ring.poll(min(max(session.remaining(), 0.0), _POLL_S)):
                if session.abort.is_set() or session.remaining() <= 0:
                    break
            late = session.stopped("moving data through the shared-memory rings") if session.abort.is_set() else \
                f"nothing moved for {session.timeout:g} s: it died, stalled or moved on"
            return {peer: why or late for peer, why in ring.unfinished()}
        finally:
            ring.end()

    # --- one execute at a time -------------------------------------------------------
    def enter(self, what: str = "rx.execute") -> None:
        if self.closed:
            raise ReshardError(f"{what}: the group made by rx.connect was closed; plans made over it cannot run "
                               f"(connect again and plan again)")
        if not self._busy.acquire(blocking=False):
            raise ReshardError(
                f"{what}: an execute on the process group of ranks {list(self.ranks)} is running in this process "
                f"(thread {self.owner!r}); concurrent executes on one group are refused: run them one after "
                f"another, or use separate process groups")
        self.owner = threading.current_thread().name

    def leave(self) -> None:
        self.owner = None
        self._busy.release()

    def close(self) -> None:
        """Ends the channel of a group that closes: later executes raise, the worker
        stops once its jobs are done, and the shared-memory segments and gloo contexts
        go with the last reference."""
        self.closed = True
        self.watch.close()
        if self._lane is not None:
            self._lane.close()
        self._jobs.put(None)  # type: ignore[arg-type]  # the worker's end
        self._worker.join(timeout=_POLL_S * 20)  # it holds the channel (and so the group's store) while it runs
        self._mailbox = None
        self._ring = None
        self._contexts.clear()

    # --- the worker --------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            task = self._jobs.get()
            if task is None:
                return
            try:
                task.result = task.fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                task.error = e
            task.done = True
            task.latch.release()

    def submit(self, fn: Callable[[], Any]) -> _Task:
        task = self._last = _Task(fn)
        self._jobs.put(task)
        return task

    def wait(self, task: _Task, session: Session, what: str) -> Any:
        """The task's result; ReshardError when aborted, or when the worker is still
        busy a second past the deadline (a connection that cannot be made)."""
        while not task.latch.acquire(timeout=_POLL_S):
            if session.abort.is_set():
                raise ReshardError(session.stopped(what))
            if session.remaining() < -1.0:
                raise ReshardError(f"rx.execute: {what} did not finish within {session.timeout:g} s")
        task.latch.release()  # open for good: a later wait on the same task returns at once
        if task.error is not None:
            raise task.error
        return task.result

    def header_buffers(self, peers: int) -> _Headers:
        """The buffers an execute's headers travel in, reused while no earlier message may
        still touch them: the worker has finished every job, and the exchange that last
        used them completed with every peer (keep_headers)."""
        bufs = self._headers
        if bufs is None or len(bufs.rows) != peers or (self._last is not None and not self._last.done):
            bufs = _Headers(peers)
        self._headers = None
        return bufs

    def keep_headers(self, bufs: _Headers) -> None:
        self._headers = bufs

    def drain(self, session: Session) -> None:
        """Waits until the worker has finished everything submitted before (an earlier,
        abandoned execute's messages complete or time out)."""
        if self._last is not None and not self._last.done:
            self.wait(self.submit(lambda: None), session, "waiting for an earlier execute's messages to finish")

    # --- messages (worker thread) -------------------------------------------------------
    def _context(self, gen: int) -> Any:
        ctx = self._contexts.get(gen)
        if ctx is None:
            from torch._C._distributed_c10d import ProcessGroupGloo

            # Lazy: a pair connects when it first talks, so a generation needs only the
            # two ranks of the pair that moved to it. Read at construction only. Waits
            # pass their own (the execute's) timeout; this one is gloo's default.
            timeout = wait_time(default_timeout("gloo"))
            with scoped_external_env("TORCH_GLOO_LAZY_INIT", "1"):
                store = dist.PrefixStore(f"{self._prefix}g{gen}/", self.store)
                ctx = ProcessGroupGloo(store, self.rank, self.size, timeout)
            self._contexts[gen] = ctx
        return ctx

    def _meet_key(self, peer: int, gen: int) -> str:
        return f"{self._prefix}meet/g{gen}/{min(self.rank, peer)}-{max(self.rank, peer)}"

    def _meet(self, peer: int) -> bool:
        """Whether both ends of the pair with `peer` post on its generation now: each end
        adds _ARRIVE to the pair's counter of it once, and the first to arrive polls it until
        the other did. A first end that gives up adds _LEAVE (`_give_up`): a later arrival
        then reads more than 2 * _ARRIVE, and both ends move on to the next generation."""
        gen = self._gen.get(peer, 0)
        if (peer, gen) in self._met:
            return True
        key = self._meet_key(peer, gen)
        if self._waiting.get(peer) == gen:
            count = self.store.add(key, 0)
        else:
            count = self.store.add(key, _ARRIVE)
            if count > 2 * _ARRIVE:  # the first end left: neither end posts on this generation
                self._gen[peer] = gen + 1
                return self._meet(peer)
            self._context(gen)  # a peer that met us waits in gloo until our address is in the store
            if count == _ARRIVE:
                self._waiting[peer] = gen
        if count != 2 * _ARRIVE:
            return False
        self._waiting.pop(peer, None)
        self._met.add((peer, gen))
        return True

    def _give_up(self, peer: int) -> bool:
        """Ends our wait for `peer` on its generation (deadline or abort). True where it
        counted itself in meanwhile: it posts there, so we post too."""
        gen = self._gen.get(peer, 0)
        if self._waiting.pop(peer, None) != gen:
            return False
        if self.store.add(self._meet_key(peer, gen), _LEAVE) == _ARRIVE + _LEAVE:
            self._gen[peer] = gen + 1  # dead for both: the peer finds out when it arrives
            return False
        self._met.add((peer, gen))
        return True

    def _closed(self, peer: int, gen: int) -> None:
        """Our pair with `peer` at `gen` failed after connecting: gloo closed it, which
        its other end sees too, so both ends move to gen + 1 (once)."""
        if self._gen.get(peer, 0) == gen:
            self._gen[peer] = gen + 1

    def exchange(self, ops: list[tuple[str, int, torch.Tensor]], tag: int, session: Session,
                 retry_closed: bool = False, token: int | None = None, hashed: tuple | None = None) -> dict[int, str]:
        """Posts every (kind, peer, tensor) op and waits for all of them until the
        session's deadline; returns {peer: error} for the pairs that failed. token (data
        of the CPU transport, byte tensors): the execute's, and pairs of one host go through
        the rings first (hashed: HostRing.begin_verified's tables, batch and digests). With
        retry_closed, a pair that its peer had already closed (it failed at some earlier
        point; we find out now) is tried again on its next generation while time remains:
        the first gloo messages of an execute whose headers went through the mailboxes
        find out there (the peer's messages of this execute are posted on its generation)."""
        errors: dict[int, str] = {}
        if token is not None:
            near = [op for op in ops if self.ring_peer(op[1], session)]
            if near:  # every rank moves its ring pairs before its gloo ones: no cycle of waits
                errors = self._ring_exchange(near, token, session, hashed)
                ops = [op for op in ops if not self._ring_peers[op[1]]]
        by_peer: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for kind, peer, tensor in ops:
            by_peer.setdefault(peer, []).append((kind, tensor))
        todo = list(by_peer)
        for _attempt in range(3 if retry_closed else 1):
            posted = []
            backoff = Backoff(1e-3, 0.05)
            while todo:  # post to every peer that meets us on the pair's generation; wait for the others
                waiting = []
                for peer in todo:
                    if not self._meet(peer):
                        waiting.append(peer)
                        continue
                    gen = self._gen.get(peer, 0)
                    ctx = self._context(gen)
                    for kind, tensor in by_peer[peer]:
                        try:
                            posted.append((peer, gen, (ctx.send if kind == "send" else ctx.recv)([tensor], peer, tag)))
                        except RuntimeError as e:  # the pair is closed already
                            posted.append((peer, gen, e))
                todo = waiting
                if todo and (session.remaining() <= 0 or session.abort.is_set()):
                    late = [peer for peer in todo if self._give_up(peer)]
                    for peer in todo:
                        if peer not in late:
                            errors[peer] = "it never joined (it did not reach the connection in time)"
                    todo = late
                elif todo:
                    backoff.pause()
            failed: dict[int, tuple[int, BaseException]] = {}
            for peer, gen, work in posted:
                if isinstance(work, BaseException):
                    failed.setdefault(peer, (gen, work))
                    continue
                try:
                    work.wait(wait_time(max(session.remaining(), 1e-3)))
                except RuntimeError as e:
                    failed.setdefault(peer, (gen, e))
            for peer, (gen, err) in failed.items():
                self._closed(peer, gen)
                # Not our own wait timing out: the peer had closed the pair earlier. Even where
                # our send completed: gloo matched it to a receive the peer posted before closing.
                if retry_closed and "Timed out" not in str(err) and session.remaining() > 0:
                    todo.append(peer)
                else:
                    errors[peer] = gloo_words(err, session.timeout)
            if not todo:
                break
        for peer in todo:
            errors[peer] = "the connection kept closing"
        return errors


class SwapReplan(ReshardError):
    """A swap round in which some rank takes the slow path: no data moved on any rank."""


class Alarm(NamedTuple):
    """Another rank's alarm: why it failed an execute (its cause lines), whether it left
    without the outcome round (plan.abort() on one host), and the rank it gave up waiting
    for (-1: none, or not known: a mailbox alarm says no more than why and left)."""

    why: str
    left: bool
    gave_up: int = -1


@dataclass
class Verdict:
    """What the header exchange of an execute found, pair by pair."""

    bad: dict[int, str]  # peer -> why no data moves with it (a line in words, naming both ranks)
    seqs: dict[int, int]  # peer -> the execute number its header carried (same plan only)
    # peers of bad whose line is no cause: they failed a check of their own (their error says
    # why), or the deadline went by before any data moved
    quiet: set[int] = field(default_factory=set)
    disagree: set[str] = field(default_factory=set)  # the lines of bad that are the two headers disagreeing
    rebuild: bool = False  # GPU: some peer's NCCL communicator needs a rebuild (or a newer one exists)
    agreed: bool = False  # every peer's header matched (data failures later do not change it)
    replan: bool = False  # a swap round in which some rank takes the slow path: no data moves anywhere
    remaps: dict[int, int] = field(default_factory=dict)  # agreed peer -> bytes of its message after the headers

    def message(self, rank: int) -> str:
        return f"rx.execute on rank {rank}: no data moved with ranks {sorted(self.bad)}:\n  " + "\n  ".join(
            why for _, why in sorted(self.bad.items()))


def exchange_headers(channel: Channel, peers: list[int], session: Session, batches: int,
                     before_wait: Callable[[], None] | None = None) -> Verdict:
    """Every peer's header against ours; `before_wait` runs while the headers travel
    (the first pack). Pairs are judged one by one, alike at both ends.

    A swap round (session.swap set) carries rx.swap_model_weights' agreement instead of an
    all-reduce of its own: headers go to every rank of the group, so every rank sees every
    rank's plan generation and REPLAN flag and reaches the same `replan` (then nobody moves
    data and every rank takes the swap's slow path together). The plan's checks (status,
    plan, execute number, version, batches) still apply to the data peers only."""
    swap = session.swap is not None
    ranks = channel.others if swap else peers
    bufs = channel.header_buffers(len(ranks))
    ours = session.header(batches)
    bufs.mine_np[:] = ours
    local, remote = channel.split(ranks)
    task = None
    if remote:
        ops = bufs.ops([ranks[i] for i in remote], remote)
        task = channel.submit(lambda: channel.exchange(ops, HEADER_TAG, session, retry_closed=True))
    errors: dict[int, str] = {}
    if local:
        every = len(local) == len(ranks)  # then their headers land in place
        rows = bufs.received_np if every else np.zeros((len(local), HEADER_LEN), dtype=np.int64)
        errors = channel.mailbox_exchange([ranks[i] for i in local] if not every else ranks, bufs.mine_np, rows,
                                          session, before_wait)
        if not every:
            bufs.received_np[local] = rows
    elif before_wait is not None:
        before_wait()
    if task is not None:
        errors.update(channel.wait(task, session, "exchanging execute headers"))
    if not errors:
        channel.keep_headers(bufs)
    verdict = Verdict({}, {})
    data = set(peers) if swap else None
    replan = session.swap == REPLAN_HERE
    # a header equal to ours agrees in every check below and asks for no rebuild and no
    # remap, unless ours does
    same_ok = ours[STATUS] == 0 and not ours[FLAGS] & (COMM_UNUSABLE | REPLAN) and not ours[REMAP]
    me = channel.rank
    # The attempt is the largest of this execute's headers: a rank that skipped a failed call
    # (it never came) joins the others' retry, at their count.
    attempt, heard = session.attempt, False
    for p, h in zip(ranks, bufs.received_np.tolist()):  # a row is read only where its receive completed
        if same_ok and h == ours and p not in errors:
            heard = True
            continue
        if p in errors:
            verdict.bad[p] = (f"rank {p} sent no execute header within {session.timeout:g} s: it did not call "
                              f"rx.execute for this plan, stalled or died")
            continue
        if h[MAGIC] == _MAGIC and h[PLAN] == session.plan_id and h[SEQ] == session.seq:
            attempt, heard = max(attempt, h[ATTEMPT]), True
        why = ""
        pair = _Pair(me, p, ours, h)
        if h[MAGIC] != _MAGIC:
            why = f"rank {p} sent rank {me} something other than an execute header (the ranks made different calls)"
        elif bool(h[FLAGS] & IN_SWAP) != swap:
            why = pair.differ("made different calls", lambda x: "rx.swap_model_weights" if x[FLAGS] & IN_SWAP else
                              "rx.execute (or another collective)")
        elif swap and (h[FLAGS] & REPLAN or h[SWAP_GEN] != session.swap):
            replan = True  # its models changed, it failed to describe them, or it holds another plan
        elif data is not None and p not in data:
            pass  # no data with it: only its swap fields matter
        elif h[STATUS] != 0:
            why = f"rank {p} failed a check of its own before moving data (see its error)"
            verdict.quiet.add(p)
        elif h[PLAN] != session.plan_id:
            why = pair.same("ran different plans (ranks call rx.execute on plans in different orders, or one "
                            "skipped one)")
        elif h[SEQ] != session.seq:
            verdict.seqs[p] = h[SEQ]
            why = pair.differ("are at different executes of this plan", lambda x: f"#{x[SEQ]}",
                              "an earlier execute ran on one of them only; the next execute resynchronises")
        elif (h[FLAGS] & HAS_VERSION, h[VERSION]) != (ours[FLAGS] & HAS_VERSION, ours[VERSION]):
            why = pair.differ(VERSION_SPLIT,
                              lambda x: str(x[VERSION]) if x[FLAGS] & HAS_VERSION else "None",
                              "every rank must pass the same")
        elif h[BATCHES] != batches:
            why = pair.differ("have different batch counts in this plan", lambda x: str(x[BATCHES]))
        elif bool(h[FLAGS] & VERIFIES) != session.verify:
            why = pair.differ(VERIFY_SPLIT, lambda x: str(bool(x[FLAGS] & VERIFIES)),
                              "every rank must pass the same")
        if (h[MAGIC] == _MAGIC and (data is None or p in data)
                and (h[FLAGS] & COMM_UNUSABLE or h[EPOCH] != session.epoch)):
            verdict.rebuild = True
        if why:
            verdict.bad[p] = why
            if p not in verdict.quiet:
                verdict.disagree.add(why)
        elif h[REMAP] and (data is None or p in data):
            verdict.remaps[p] = h[REMAP]
    if errors and session.remaining() <= 0:  # the deadline went by waiting: no time is left to move data
        for p in peers:
            if p not in verdict.bad:
                verdict.bad[p] = f"rank {me} ran out of time before moving data"
                verdict.quiet.add(p)
    if replan:
        # Every rank saw the same headers: all leave together (no rebuild, a collective, either).
        verdict.replan, verdict.rebuild, verdict.seqs, verdict.remaps = True, False, {}, {}
        for p in ranks:
            verdict.bad.setdefault(p, "takes rx.swap_model_weights' slow path with every rank (a model changed)")
    verdict.agreed = not verdict.bad
    session.attempt, session.attempt_fixed = attempt, session.attempt_fixed or heard
    session.verdict = verdict
    return verdict


class _Pair:
    """Two ranks' headers, for a line that reads alike at both ends (the lower rank first)."""

    def __init__(self, me: int, peer: int, mine: list[int], theirs: list[int]):
        (self.a, self.ha), (self.b, self.hb) = sorted(((me, mine), (peer, theirs)), key=lambda x: x[0])

    def same(self, what: str) -> str:
        return f"ranks {self.a} and {self.b} {what}"

    def differ(self, what: str, show: Callable[[list[int]], str], hint: str = "") -> str:
        return (f"ranks {self.a} and {self.b} {what}: {show(self.ha)} on rank {self.a}, {show(self.hb)} on rank "
                f"{self.b}" + (f" ({hint})" if hint else ""))


# the words of a pair's disagreement on the version or verify= (the outcome says it for the group)
VERSION_SPLIT, VERIFY_SPLIT = "passed different versions to rx.execute", "passed different verify= to rx.execute"
_MAILBOX_FAILURES = {1: "it posted nothing in time", 2: "it did not take this rank's message in time"}


def gloo_words(err: BaseException, timeout: float) -> str:
    """What a failed gloo message of a pair says of the peer, in a user's words (gloo's own
    text names its source files and guesses at causes)."""
    text = str(err)
    if "Timed out" in text:
        kind = "send" if "send operation" in text else "recv"
        return (f"it did not take this rank's message within {timeout:g} s" if kind == "send"
                else f"it sent nothing within {timeout:g} s")
    if any(w in text for w in ("Connection closed", "Connection reset", "Broken pipe", "closed by peer")):
        return "it closed the connection (its process exited, or it had already given up on this execute)"
    if "timeout caused pair closure" in text:  # gloo closed the pair when an earlier wait on it timed out
        return "the connection to it had closed after an earlier wait on it timed out"
    first = text.splitlines()[0] if text else type(err).__name__
    first = first.split("] ", 1)[-1] if first.startswith("[") else first  # gloo's "[file.cc:N] " prefix
    return first.split(". This is typically", 1)[0][:300]


def _host_key() -> str:
    """Equal for two processes iff they share this host's /dev/shm (where shm_open's segments
    live) as the same user (a segment is readable by its owner only)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat("/dev/shm")
        return f"{boot}:{st.st_dev}:{st.st_ino}:{os.getuid()}"
    except OSError:
        return f"{socket.gethostname()}:{os.getuid()}"


_CHANNELS: dict[tuple, Channel] = {}  # groups.key -> its channel
_MADE: list[Channel] = []  # every channel this process made (their worker threads keep them alive)
_CHANNELS_LOCK = threading.Lock()


@atexit.register
def _close_mailboxes() -> None:
    """Removes this process's header mailboxes and data rings from /dev/shm (a killed process
    leaves its own; the next segment made on the host removes them), those of channels of
    destroyed process groups too."""
    for ch in list(_MADE):
        ch._mailbox = None  # a forked child's copy leaves the parent's segment (the destructor checks)
        ch._ring = None  # a worker still polling it holds its own reference


def _close_group(group: groups.Standalone) -> None:
    with _CHANNELS_LOCK:
        ch = _CHANNELS.pop(group.key, None)
        if ch is not None:
            _MADE[:] = [c for c in _MADE if c is not ch]
    if ch is not None:
        ch.close()


groups.on_close(_close_group)


def _key_tag(key: tuple) -> str:
    """A store-key-safe tag of a groups.key, alike on every member."""
    return f"{zlib.crc32(repr(key).encode()):08x}"


def channel_of(group: Any) -> Channel:
    """The channel of `group` (created once per process, locally: no collective)."""
    key = groups.key(group)
    with _CHANNELS_LOCK:
        ch = _CHANNELS.get(key)
        # A process group created again (destroy_process_group, init again) has a new store.
        if ch is None or ch.store is not groups.store(group):
            ch = _CHANNELS[key] = Channel(group)
            _MADE.append(ch)
        return ch
