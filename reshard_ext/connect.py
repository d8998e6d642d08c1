"""rx.connect: one process group over separately launched jobs.

A trainer (torchrun, Ray actors) and an inference engine (its own launcher, or a
single process) each have their own torch.distributed world, or none. A refit between
them needs one group holding the ranks of both: `rx.connect(address, world_size, rank)`
makes it, over a TCP key-value store, without touching either job's world.

The store: group rank 0 hosts a torch TCPStore at `address` ("host:port", a port it
can bind on that host) and every other rank connects to it; so rank 0 must stay
connected until every other rank has closed the group (close() on rank 0 waits for
them). An existing store (a TCPStore your launcher already runs) can be passed as
`store=`: then nobody hosts one and `address` only names the group in messages. All
keys live under "reshard_ext/connect/<name>/", so groups of different names share a
store without meeting.

Joining: every rank announces itself in the store and counts itself in; when all
`world_size` ranks have, the group forms on every rank. If they have not all come
within `timeout` seconds, the first rank to give up closes the join for all
(atomically: the join either forms on every rank or fails on every rank) and every
joined rank raises rx.ReshardError naming the ranks that never came; a rank that
arrives later raises at once. A rank that cannot reach the store (rank 0 never came
up) raises naming rank 0.

The group: a torch ProcessGroup with a gloo backend for CPU tensors (reshard_ext's
metadata exchange, execute headers, the CPU transport) and, where every member has
CUDA, an NCCL backend for CUDA tensors (backend="torch"); the NCCL and direct
transports make their own communicators over it, as on any group. Its members are
numbered 0..world_size-1 in the group only: torch.distributed's get_rank(group) and
get_process_group_ranks(group) do not know it (use group.rank, group.size), but its
process_group takes torch collectives (dist.all_reduce(t, group=g.process_group)).
"""
from __future__ import annotations

import atexit
import datetime
import os
import pickle
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import groups
from .backoff import Backoff
from .errors import ReshardError

DEFAULT_TIMEOUT_S = 300.0
_PREFIX = "reshard_ext/connect/"
_CLOSING = "closing"  # under the name: set by rank 0 on the store it hosts when its group closes


class _Stale(Exception):
    """The store this rank reached belongs to a group that is closing (its host's old
    store, still up for a moment): connect to the address again."""


@dataclass(frozen=True)
class Member:
    """What one rank told the others when it joined."""

    rank: int  # in the group
    group_size: int  # the world_size it passed
    host: str
    pid: int
    job: Any  # its torch.distributed world's identity (its store's address), None if unknown
    world_rank: int  # its rank in its own world (0 where it has none)
    world_size: int  # its own world's size (1 where it has none)
    cuda: bool  # torch sees a CUDA device


class ConnectedGroup(groups.Standalone):
    """A process group over separately launched jobs, made by `rx.connect`. Pass it as
    `group=` to rx.plan, rx.swap_model_weights and the adapters; `process_group` is its
    torch ProcessGroup (torch collectives take it). `rank` and `size` are this process's
    rank in the group and the group's size; `members` what each rank announced.

    Close it on every rank when done (`close()`, or `with rx.connect(...) as group:`): it
    drops the host channel, NCCL communicators and cached swap plans of the group; plans
    made over it raise ReshardError afterwards. Plans keep the group's torch objects (and
    on rank 0 the store's listening socket) alive: drop them before connecting again at
    the same address."""

    def __init__(self, record: groups.Standalone, address: str, name: str, members: list[Member], timeout_s: float,
                 base_store: Any, own_store: Any, hosts_store: bool):
        super().__init__(record.process_group, record.rank, record.size, record.store, record.key, record.worlds,
                         record.process_ids)
        self.address = address
        self.name = name
        self.members = members
        self.timeout_s = timeout_s
        self._base = base_store
        self._own = own_store  # this group's keys (no other group's, whatever its name)
        self._hosts = hosts_store

    @property
    def rank_offset(self) -> int:
        """This rank's group rank minus its rank in its own torch.distributed world: the
        `rank_offset` of its job's models where its job's ranks hold consecutive group
        ranks in world order (the adapters find it themselves; see Standalone.from_world)."""
        return self.rank - self.members[self.rank].world_rank

    def close(self, timeout: float | None = None) -> None:
        """Leaves the group. Collective: every rank calls it once its refits are done, and
        it returns once every rank has (or after `timeout` seconds, default the join
        timeout), since a rank's state (its shared-memory segments, its end of the
        connections) must outlive its peers' last execute. Then drops this process's state
        of the group (host channel, NCCL communicators, cached swap plans) and shuts its
        backends down; plans made over it raise ReshardError afterwards. Idempotent."""
        if self.closed:
            return
        limit = self.timeout_s if timeout is None else float(timeout)
        try:
            if self._hosts:  # a rank that connects again once this returns must not join on this store, which goes
                self._base.set(f"{_PREFIX}{self.name}/{_CLOSING}", "1")
            self._own.add("left", 1)
            deadline = time.monotonic() + limit
            backoff = Backoff(1e-3, 0.05)
            while self._own.add("left", 0) < self.size and time.monotonic() < deadline:
                backoff.pause()
        except RuntimeError:
            pass  # the store is gone: its host left first (it died, or it gave up waiting)
        groups.release(self)
        _OPEN.discard(self)
        self._shutdown()

    def _shutdown(self) -> None:
        """Shuts the backends down and lets go of the store (the host's stops listening
        once nothing else holds it)."""
        try:
            self.process_group.shutdown()
        except Exception:  # noqa: BLE001 - already broken or shut: nothing more to release
            pass
        # Our references go: once no plan holds the group either, its store (and on rank 0
        # the listening socket) goes with it.
        self.process_group = self._base = self._own = self.store = None

    def __enter__(self) -> ConnectedGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"ConnectedGroup({self.address!r}, rank={self.rank}, size={self.size}, {state})"


_OPEN: set[ConnectedGroup] = set()


@atexit.register
def _release_at_exit() -> None:
    """Groups still open at exit: dropped locally (no waiting for the other ranks) while
    the interpreter is whole, so no gloo thread releases them during finalisation."""
    for g in list(_OPEN):
        groups.release(g)
        g._shutdown()
    _OPEN.clear()


def _parse(address: str) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ReshardError(f"rx.connect: address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def _own_world() -> tuple[Any, int, int]:
    """(job, rank, size) of this process's torch.distributed world; a process without one
    is a world of its own. The job is the address of the world's store, the same on
    every rank of one world (None where the store is of a kind without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return f"process:{socket.gethostname()}:{os.getpid()}", 0, 1
    job: Any = None
    try:
        s = dist.distributed_c10d._get_default_store()
        while isinstance(s, dist.PrefixStore):
            s = s.underlying_store
        if isinstance(s, dist.TCPStore):
            job = f"tcp:{s.host}:{s.port}"
        elif isinstance(s, dist.FileStore):
            job = f"file:{getattr(s, 'path', None)}"
    except Exception:  # noqa: BLE001 - unknown store kind: members are matched by consecutive ranks
        job = None
    return job, dist.get_rank(), dist.get_world_size()


def _store(address: str, rank: int, timeout_s: float) -> Any:
    host, port = _parse(address)
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        try:
            return dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - e.g. the port is taken
            raise ReshardError(f"rx.connect: rank 0 cannot host the group's store at {address} ({e}); pick a free "
                               f"port on that host, or pass store= an existing store") from e
    # Wait for the listener here: TCPStore's own connect retries log a stack trace each time.
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=max(min(deadline - time.monotonic(), 1.0), 0.01)).close()
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ReshardError(f"rx.connect: rank {rank} could not reach the group's store at {address} within "
                                   f"{timeout_s:g} s: rank 0, which hosts it, is not there (it did not come, or it "
                                   f"gave up waiting for the others and left) ({e})") from e
            time.sleep(0.05)
    try:
        return dist.TCPStore(host, port, None, False, timeout)
    except Exception as e:  # noqa: BLE001 - it listened a moment ago: rank 0 left, or another server is there
        raise ReshardError(f"rx.connect: rank {rank} could not connect to the group's store at {address} ({e})") from e


def _present(join: Any, world_size: int) -> dict[int, Member]:
    return {r: _member(join, r) for r in range(world_size) if join.check([f"member/{r}"])}


def _member(join: Any, rank: int) -> Member:
    return pickle.loads(bytes.fromhex(join.get(f"member/{rank}").decode()))


def _verdict(join: Any, world_size: int) -> str:
    """Sets the join's verdict unless some rank did first; returns the one that holds:
    "ok" where every rank has come and all passed the same world_size; else "fail:<missing
    ranks>:<the world sizes passed, where they differ>"."""
    present = _present(join, world_size)
    sizes = {r: m.group_size for r, m in present.items()}
    if len(present) == world_size and set(sizes.values()) == {world_size}:
        return join.compare_set("verdict", "", "ok").decode()
    missing = ",".join(str(r) for r in range(world_size) if r not in present)
    differ = ",".join(f"{r}={n}" for r, n in sorted(sizes.items())) if len(set(sizes.values())) > 1 else ""
    return join.compare_set("verdict", "", f"fail:{missing}:{differ}").decode()


def _failure(verdict: str, address: str, world_size: int, timeout_s: float) -> ReshardError:
    _, missing, differ = (verdict.split(":", 2) + ["", ""])[:3]
    if differ:
        return ReshardError(f"rx.connect: the ranks of the group at {address} passed different world sizes "
                            f"(rank=world_size: {differ}); every rank that joined raises this")
    who = f"ranks [{missing}] did not" if missing else "not every rank did"
    return ReshardError(f"rx.connect: {who} join the group of {world_size} ranks at {address} within {timeout_s:g} s "
                        f"(timeout=); every rank that joined raises this")


def _join(base: Any, name: str, me: Member, world_size: int, address: str, deadline: float,
          timeout_s: float, hosts: bool, shared: bool) -> tuple[Any, list[Member], str]:
    """Announces `me`, waits for the others; returns the join's store, every member and
    the group's token. The join of this rank's n-th group of this name on this store is
    generation n (counted per rank), so ranks that close a group and connect again on a
    store that stays (`shared`: store=) meet afresh; on a store rank 0 hosts for this
    group alone, a second claim of a rank is a second process with its rank."""
    closing = f"{_PREFIX}{name}/{_CLOSING}"
    if me.rank != 0 and base.check([closing]):
        raise _Stale
    generation = base.add(f"{_PREFIX}{name}/claim/{me.rank}", 1) - 1
    if generation and not shared:
        raise ReshardError(f"rx.connect: rank {me.rank} joined the group at {address} twice: two processes passed "
                           f"rank={me.rank}")
    join = dist.PrefixStore(f"{_PREFIX}{name}/g{generation}/", base)
    if me.rank == 0:
        join.set("token", uuid.uuid4().hex[:16])
    join.set(f"member/{me.rank}", pickle.dumps(me).hex())
    if join.add("arrived", 1) >= world_size:
        verdict = _verdict(join, world_size)
    else:
        backoff = Backoff(1e-3, 0.05)
        while not join.check(["verdict"]) and time.monotonic() < deadline:
            if me.rank != 0 and base.check([closing]):
                raise _Stale
            backoff.pause()  # polled: TCPStore.wait logs a warning when it times out
        # past the deadline: closes the join for everyone, unless it formed meanwhile
        verdict = join.get("verdict").decode() if join.check(["verdict"]) else _verdict(join, world_size)
    if verdict != "ok":
        join.add("seen", 1)
        if hosts:
            _hold_for_readers(join)
        raise _failure(verdict, address, world_size, timeout_s)
    members = [_member(join, r) for r in range(world_size)]
    return join, members, join.get("token").decode()


def _hold_for_readers(join: Any) -> None:
    """The store's host after a failed join: keeps it up briefly, until every rank that
    joined has read the verdict (else theirs would end in a lost connection)."""
    deadline = time.monotonic() + 5.0
    try:
        while join.add("seen", 0) < join.add("arrived", 0) and time.monotonic() < deadline:
            time.sleep(0.01)
    except RuntimeError:
        pass


def _backends(store: Any, rank: int, size: int, timeout_s: float, cuda: bool, name: str) -> Any:
    """The group's torch ProcessGroup: gloo for CPU tensors, NCCL for CUDA ones where
    `cuda` (every member has CUDA), built as init_process_group builds
    "cpu:gloo,cuda:nccl" (the NCCL communicator is made lazily, on first use)."""
    from torch._C._distributed_c10d import ProcessGroup, ProcessGroupGloo

    timeout = datetime.timedelta(seconds=timeout_s)
    pg = ProcessGroup(store, rank, size)
    gloo = ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
    gloo._set_sequence_number_for_group()
    pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
    if cuda and dist.is_nccl_available():
        from torch._C._distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        nccl = ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, options)
        nccl._set_sequence_number_for_group()
        pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, nccl)
    pg._set_default_backend(ProcessGroup.BackendType.GLOO)
    pg._set_group_name(name)  # type: ignore[arg-type]  # a plain str at run time
    return pg


def connect(address: str | None, world_size: int, rank: int, *, timeout: float = DEFAULT_TIMEOUT_S,
            store: Any = None, name: str = "default") -> ConnectedGroup:
    """One process group over ranks of separately launched jobs (see the module doc).

    Every rank of the group calls it, in whichever job it lives, with the same `address`
    and `world_size` and its own `rank` in 0..world_size-1. A job's own torch.distributed
    world, if it has one, is left as it is: pass the returned group as `group=` to
    rx.plan / rx.swap_model_weights / the adapters, and the job's models keep their own
    process groups.

    address: "host:port" where group rank 0 hosts the group's TCPStore (rank 0 binds the
    port; the others connect there). Ignored for hosting when `store` is given.
    world_size: ranks in the group (e.g. trainer ranks + engine ranks).
    rank: this process's rank in the group. Convention that needs no rank_offset: each
    job's ranks take consecutive group ranks in the order of their own world (trainer
    world ranks 0..T-1 as group ranks 0..T-1, engine world ranks 0..E-1 as T..T+E-1);
    the adapters then find each model rank's group rank themselves (ConnectedGroup).
    timeout: seconds to wait for every rank to join; also the default timeout of the
    group's gloo and NCCL backends (as init_process_group's timeout).
    store: an existing torch Store to meet in instead (then nobody hosts one).
    name: keeps groups made on one store apart. On a store= that outlives its groups, a
    closed group's name can be joined again (each rank's n-th join of a name meets the
    others' n-th); after a join that failed there, use another name.

    Raises rx.ReshardError on every rank that joined when some rank did not join within
    `timeout` (naming it) or when the ranks disagree on world_size; at once on a second
    process that passes a rank already taken (on a store rank 0 hosts; with store= it
    waits for a group of its own, and times out).
    """
    timeout_s = float(timeout)
    where = str(address) if address is not None else "the given store"
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ReshardError(f"rx.connect: world_size must be a positive int, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ReshardError(f"rx.connect: rank must be an int in 0..{world_size - 1}, got {rank!r}")
    if not timeout_s > 0:
        raise ReshardError(f"rx.connect: timeout must be a positive number of seconds, got {timeout!r}")
    if store is None and address is None:
        raise ReshardError("rx.connect: pass an address 'host:port' (rank 0 hosts the store there) or store=")
    hosts = store is None and rank == 0
    job, world_rank, world_ranks = _own_world()
    me = Member(rank, world_size, socket.gethostname(), os.getpid(), job, world_rank, world_ranks,
                torch.cuda.is_available())
    deadline = time.monotonic() + timeout_s
    while True:
        base = store if store is not None else _store(where, rank, max(deadline - time.monotonic(), 0.1))
        try:
            join, members, token = _join(base, name, me, world_size, where, deadline, timeout_s, hosts,
                                         store is not None)
            break
        except ReshardError:
            raise
        except (_Stale, RuntimeError) as e:  # the host's last group's store, going (or gone) under us
            if store is not None or rank == 0 or time.monotonic() >= deadline:
                raise ReshardError(f"rx.connect: rank {rank} lost the group's store at {where} while joining "
                                   f"({str(e) or 'its group closed'}): rank 0, which hosts it, left") from e
            time.sleep(0.05)
    own = dist.PrefixStore(f"{token}/", join)  # this group's keys: a later group of the same name has others
    key = ("rx.connect", where, name, token)
    try:
        pg = _backends(own, rank, world_size, timeout_s, all(m.cuda for m in members), f"reshard_ext:{name}:{token}")
    except RuntimeError as e:
        raise ReshardError(f"rx.connect: every rank joined the group at {where}, but connecting its gloo backend "
                           f"failed: a rank died or left meanwhile ({e})") from e
    record = groups.Standalone(pg, rank, world_size, dist.PrefixStore("state/", own), key,
                               [(m.job, m.world_rank) for m in members], tuple((m.host, m.pid) for m in members))
    group = ConnectedGroup(record, where, name, members, timeout_s, base, own, hosts)
    groups.register(group)
    _OPEN.add(group)
    return group


__all__ = ["connect", "ConnectedGroup", "Member", "DEFAULT_TIMEOUT_S"]
