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
- One execute at a time per group in a process: a second thread is refused.
"""
from __future__ import annotations

import atexit
import datetime
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import _C, groups
from ..errors import ReshardError
from ..options import env_default, scoped_external_env

HEADER_TAG = 1
REMAP_TAG = 0  # the direct transport's new IPC exports after a receiver's local rebind (transports/direct.py)
_MAGIC = 0x52584844  # "RXHD"
# Header fields (int64): what both ends of a pair must agree on before data moves.
MAGIC, PLAN, SEQ, VERSION, FLAGS, STATUS, BATCHES, EPOCH, SWAP_GEN, REMAP = range(10)
HEADER_LEN = 10
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


def data_tag(plan_id: int, seq: int) -> int:
    """The gloo tag of an execute's data messages: a message abandoned by an earlier
    execute can never match a later one."""
    return 2 + (plan_id * 0x9E3779B1 + seq) % (1 << 30)


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

    def header(self, batches: int) -> list[int]:
        flags = ((HAS_VERSION if self.version is not None else 0) | (COMM_UNUSABLE if self.comm_unusable else 0)
                 | (VERIFIES if self.verify else 0))
        if self.swap is not None:
            flags |= IN_SWAP | (REPLAN if self.swap == REPLAN_HERE else 0)
        return [_MAGIC, self.plan_id, self.seq, self.version or 0, flags, self.status, batches, self.epoch,
                self.swap if self.swap is not None else 0, self.remap]

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

    def __init__(self, group: Any):
        self.group = group
        self.rank = groups.rank(group)
        self.size = groups.size(group)
        self.ranks = groups.ranks(group)
        self.key = groups.key(group)
        self.others = [r for r in range(self.size) if r != self.rank]  # a swap round's header ranks
        key = "-".join(map(str, self.ranks)) if len(self.ranks) <= 16 else f"{hash(self.ranks) & 0xFFFFFFFF:x}"
        self._prefix = f"reshard_ext/channel/{self.size}/{key}/"
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
        self._mailbox, self._announced = self._open_mailbox()
        self._local: dict[int, bool] = {}  # peer -> whether our headers go through the mailboxes
        self._all_local: bool | None = None  # see all_local
        self._splits: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}  # see split()
        self._mail_open: tuple[np.ndarray, Session] | None = None  # an aborted execute's header exchange
        self._ring: Any = None  # this rank's data rings (_C.HostRing), made on first use
        self._ring_made = False
        self._ring_peers: dict[int, bool] = {}  # peer -> whether our data goes through the rings
        self._ring_lock = threading.Lock()
        self.closed = False  # its group was closed (rx.connect's ConnectedGroup.close())
        self._worker = threading.Thread(target=self._work, name=f"reshard_ext channel {key}", daemon=True)
        self._worker.start()

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
            limit = float(env_default("RESHARD_EXT_P2P_TIMEOUT"))
            try:  # there since rx.plan; bounded by the reshard timeout, not the store's, all the same
                self.store.wait([key], datetime.timedelta(seconds=limit))
            except RuntimeError as e:
                raise ReshardError(f"rank {self.rank}: rank {peer} announced no header channel within {limit:g} s "
                                   f"(RESHARD_EXT_P2P_TIMEOUT): it never made a plan over this group ({e})") from e
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
                         before_wait: Callable[[], None] | None = None) -> dict[int, str]:
        """Our header to each of `peers` (all local) and theirs into rows (in peers' order);
        before_wait runs while they travel. Returns {peer: error} of the pairs that failed:
        what did not arrive by the deadline is withdrawn, alike at both ends. An abort leaves
        the exchange open until its deadline, as a gloo message stays posted: a peer's next
        execute still pairs with this one, not with our next (drain settles it first)."""
        self._settle_mail(session)
        mailbox = self._mailbox
        mailbox.post(peers, header)
        self._mail_open = (rows, session)
        if before_wait is not None:
            before_wait()
        self._await_mail(rows, session, session, "while exchanging execute headers")
        self._mail_open = None
        outcome = mailbox.finish(rows)
        return {p: _MAILBOX_FAILURES[o] for p, o in zip(peers, outcome) if o}

    def _settle_mail(self, session: Session) -> None:
        """Waits until an aborted execute's open header exchange is done or past its deadline
        (then withdrawn); ReshardError where `session` is aborted or runs out first."""
        if self._mail_open is None:
            return
        rows, old = self._mail_open
        self._await_mail(rows, old, session, "while an earlier execute's headers settled")
        self._mailbox.finish(rows)
        self._mail_open = None

    def _await_mail(self, rows: np.ndarray, owner: Session, session: Session, what: str) -> None:
        """Polls the open exchange (of `owner`'s execute) until it is done or past owner's
        deadline; ReshardError where `session` is aborted or a second past its own."""
        while not self._mailbox.poll(min(max(min(owner.remaining(), session.remaining()), 0.0), _POLL_S), rows):
            if session.abort.is_set():
                raise ReshardError(f"rx.execute was aborted (plan.abort()) {what}")
            if owner.remaining() <= 0:
                return
            if session.remaining() < -1.0:
                raise ReshardError(f"rx.execute: an earlier execute's headers did not settle within "
                                   f"{session.timeout:g} s")

    # --- the CPU transport's data through shared memory (same host) ---------------------
    def _ring_key(self, rank: int) -> str:
        return f"{self._prefix}ring/{rank}"

    def _make_ring(self) -> None:
        """This rank's rings, one per rank whose headers go through the mailboxes (the same
        list at every rank of the host), announced in the store ("-": none). Made when a plan
        that voted for them (rx.Options.host_ring) first moves data."""
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
        with self._ring_lock:
            known = self._ring_peers.get(peer)
            if known is not None:
                return known
            if not self._ring_made:
                self._make_ring()
            if self._ring is None or not self.local(peer):
                known = False
            else:
                key = self._ring_key(peer)
                try:
                    self.store.wait([key], datetime.timedelta(seconds=max(session.remaining(), 1.0)))
                except RuntimeError as e:
                    raise ReshardError(f"rank {self.rank}: rank {peer} announced no data rings within "
                                       f"{session.timeout:g} s ({e})") from e
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
            late = "aborted (plan.abort())" if session.abort.is_set() else \
                f"Timed out after {session.timeout:g} s in the shared-memory ring (the peer died, stalled or moved on)"
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
                raise ReshardError(f"rx.execute was aborted (plan.abort()) while {what}")
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
        self._settle_mail(session)

    # --- messages (worker thread) -------------------------------------------------------
    def _context(self, gen: int) -> Any:
        ctx = self._contexts.get(gen)
        if ctx is None:
            from torch._C._distributed_c10d import ProcessGroupGloo

            # Lazy: a pair connects when it first talks, so a generation needs only the
            # two ranks of the pair that moved to it. Read at construction only. Waits
            # pass their own (the execute's) timeout; this one is gloo's default.
            timeout = datetime.timedelta(seconds=float(env_default("RESHARD_EXT_P2P_TIMEOUT")))
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
            pause = 1e-3
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
                    time.sleep(pause)
                    pause = min(2 * pause, 0.05)
            failed: dict[int, tuple[int, BaseException]] = {}
            for peer, gen, work in posted:
                if isinstance(work, BaseException):
                    failed.setdefault(peer, (gen, work))
                    continue
                try:
                    work.wait(datetime.timedelta(seconds=max(session.remaining(), 1e-3)))
                except RuntimeError as e:
                    failed.setdefault(peer, (gen, e))
            for peer, (gen, err) in failed.items():
                self._closed(peer, gen)
                message = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
                # Not our own wait timing out: the peer had closed the pair earlier. Even where
                # our send completed: gloo matched it to a receive the peer posted before closing.
                if retry_closed and "Timed out" not in message and session.remaining() > 0:
                    todo.append(peer)
                else:
                    errors[peer] = message
            if not todo:
                break
        for peer in todo:
            errors[peer] = "the connection kept closing"
        return errors


class SwapReplan(ReshardError):
    """A swap round in which some rank takes the slow path: no data moved on any rank."""


@dataclass
class Verdict:
    """What the header exchange of an execute found, pair by pair."""

    bad: dict[int, str]  # peer -> why no data moves with it
    seqs: dict[int, int]  # peer -> the execute number its header carried (same plan only)
    rebuild: bool = False  # GPU: some peer's NCCL communicator needs a rebuild (or a newer one exists)
    agreed: bool = False  # every peer's header matched (data failures later do not change it)
    replan: bool = False  # a swap round in which some rank takes the slow path: no data moves anywhere
    remaps: dict[int, int] = field(default_factory=dict)  # agreed peer -> bytes of its message after the headers

    def message(self, rank: int) -> str:
        lines = [f"rank {p}: {why}" for p, why in sorted(self.bad.items())]
        return f"rx.execute on rank {rank}: no data moved with ranks {sorted(self.bad)}:\n  " + "\n  ".join(lines)


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
    for p, h in zip(ranks, bufs.received_np.tolist()):  # a row is read only where its receive completed
        if same_ok and h == ours and p not in errors:
            continue
        if p in errors:
            verdict.bad[p] = (f"no header within {session.timeout:g} s: it did not call rx.execute for this plan, "
                              f"stalled or died ({errors[p]})")
            continue
        why = ""
        if h[MAGIC] != _MAGIC:
            why = "sent something other than an execute header"
        elif bool(h[FLAGS] & IN_SWAP) != swap:
            why = ("runs rx.swap_model_weights and this rank rx.execute" if not swap else
                   "runs rx.execute (or another collective) and this rank rx.swap_model_weights")
        elif swap and (h[FLAGS] & REPLAN or h[SWAP_GEN] != session.swap):
            replan = True  # its models changed, it failed to describe them, or it holds another plan
        elif data is not None and p not in data:
            pass  # no data with it: only its swap fields matter
        elif h[STATUS] != 0:
            why = "failed a check of its own before moving data (see its error)"
        elif h[PLAN] != session.plan_id:
            why = "is executing another plan (ranks execute plans in different orders, or one skipped one)"
        elif h[SEQ] != session.seq:
            verdict.seqs[p] = h[SEQ]
            why = (f"is at execute #{h[SEQ]} of this plan and this rank at #{session.seq}: an earlier execute ran on "
                   f"one of them only (the next execute resynchronises)")
        elif (h[FLAGS] & HAS_VERSION, h[VERSION]) != (ours[FLAGS] & HAS_VERSION, ours[VERSION]):
            why = (f"executes version {h[VERSION] if h[FLAGS] & HAS_VERSION else None} and this rank version "
                   f"{session.version}")
        elif h[BATCHES] != batches:
            why = f"has {h[BATCHES]} batches in this plan and this rank {batches}"
        elif bool(h[FLAGS] & VERIFIES) != session.verify:
            why = f"runs rx.execute with verify={bool(h[FLAGS] & VERIFIES)} and this rank verify={session.verify}"
        if (h[MAGIC] == _MAGIC and (data is None or p in data)
                and (h[FLAGS] & COMM_UNUSABLE or h[EPOCH] != session.epoch)):
            verdict.rebuild = True
        if why:
            verdict.bad[p] = why
        elif h[REMAP] and (data is None or p in data):
            verdict.remaps[p] = h[REMAP]
    if replan:
        # Every rank saw the same headers: all leave together (no rebuild, a collective, either).
        verdict.replan, verdict.rebuild, verdict.seqs, verdict.remaps = True, False, {}, {}
        for p in ranks:
            verdict.bad.setdefault(p, "takes rx.swap_model_weights' slow path with every rank (a model changed)")
    verdict.agreed = not verdict.bad
    session.verdict = verdict
    return verdict


_MAILBOX_FAILURES = {1: "it posted no execute header in time", 2: "it did not take this rank's execute header in time"}


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
_CHANNELS_LOCK = threading.Lock()


@atexit.register
def _close_mailboxes() -> None:
    """Removes this process's header mailboxes and data rings from /dev/shm (a killed process
    leaves its own; the next segment made on the host removes them)."""
    for ch in list(_CHANNELS.values()):
        ch._mailbox = None  # a forked child's copy leaves the parent's segment (the destructor checks)
        ch._ring = None  # a worker still polling it holds its own reference


def _close_group(group: groups.Standalone) -> None:
    with _CHANNELS_LOCK:
        ch = _CHANNELS.pop(group.key, None)
    if ch is not None:
        ch.close()


groups.on_close(_close_group)


def channel_of(group: Any) -> Channel:
    """The channel of `group`'s ranks (created once per process, locally: no collective)."""
    key = groups.key(group)
    with _CHANNELS_LOCK:
        ch = _CHANNELS.get(key)
        # A process group created again (destroy_process_group, init again) has a new store.
        if ch is None or ch.store is not groups.store(group):
            ch = _CHANNELS[key] = Channel(group)
        return ch
