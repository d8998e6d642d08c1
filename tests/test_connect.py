"""rx.connect: one group over separately launched jobs (CPU, gloo).

A 2-rank "trainer" and a 2-rank "engine" are separate process sets, each with its own
torch.distributed world on its own port (or, for the engine, none at all); they meet
in a group made by rx.connect at a third port and refit through it, bit for bit.
"""
from __future__ import annotations

import time

import pytest
import torch
from _cases import bits_equal, run_case
from _dist import free_port
from _jobs import run_jobs

TRAINER_ENGINE = ((2, "gloo"), (2, "gloo"))  # each job its own world
ENGINE_WITHOUT_WORLD = ((2, "gloo"), (2, None))
IDS = torch.tensor([0, 3, 7, 12, 15, 9])
JOIN_TIMEOUT_S = 5.0  # the joins that must fail wait this long


def _rank(job: int, local: int, sizes: tuple[int, ...]) -> int:
    """The group rank convention of rx.connect: each job's ranks in a row, in job order."""
    return sum(sizes[:job]) + local


def _matrix(job, local, sizes, port, cases):
    import reshard_ext as rx

    rank, world = _rank(job, local, sizes), sum(sizes)
    with rx.connect(f"127.0.0.1:{port}", world, rank, timeout=60) as group:
        assert (group.rank, group.size) == (rank, world)
        return [run_case(rank, world, case, group=group) for case in cases]


@pytest.mark.parametrize("jobs", [TRAINER_ENGINE, ENGINE_WITHOUT_WORLD], ids=["own-worlds", "engine-without-world"])
def test_layout_matrix_across_jobs(jobs):
    """The layout matrix (sources and destinations on any ranks of either job, casts) over
    the connected group: every destination piece bit for bit, twice (sources updated in
    place between refits)."""
    run_jobs(jobs, _matrix, free_port(), ("tp", "casts"))


def _side_by_side(job, local, sizes, port):
    """Two connected groups on one store (the second by store= and name=, its ranks in
    reverse order) and the job's own world, used in turn: none meets another's keys."""
    import torch.distributed as dist

    import reshard_ext as rx
    from reshard_ext import Layout, Mesh, Replicate, Shard

    rank, world = _rank(job, local, sizes), sum(sizes)
    first = rx.connect(f"127.0.0.1:{port}", world, rank, timeout=60)
    client = dist.TCPStore("127.0.0.1", port, None, False)
    second = rx.connect(None, world, world - 1 - rank, store=client, name="second", timeout=60)
    full = torch.arange(32 * 6, dtype=torch.float32).reshape(32, 6)

    def one(group, me):  # group rank 0..1 hold the rows, ranks 2..3 each receive them all
        out = torch.full((32, 6), float("nan"))
        src = {"w": (full.chunk(2)[me].clone(), Layout((32, 6), torch.float32, Mesh([0, 1]), [Shard(0)]))} \
            if me < 2 else {}
        dst = {"w": (out, Layout((32, 6), torch.float32, Mesh([2, 3]), [Replicate()]))} if me >= 2 else {}
        return rx.plan(src, dst, group=group), out, me >= 2

    plans = [one(first, rank), one(second, world - 1 - rank)]
    own = None
    if dist.is_initialized():  # the job's own world, beside them: its rank 0 sends to its rank 1
        me = dist.get_rank()
        w = torch.full((4, 4), float(job + 1)) if me == 0 else torch.zeros(4, 4)
        lay = (Layout((4, 4), torch.float32, Mesh([0]), [Replicate()]),
               Layout((4, 4), torch.float32, Mesh([1]), [Replicate()]))
        own = (rx.plan({"x": (w, lay[0])} if me == 0 else {}, {"x": (w, lay[1])} if me == 1 else {}), w)
    landed = []
    for step in range(2):
        for p, out, receives in plans:
            out.fill_(float("nan"))
            rx.execute(p, verify=step == 1)
            landed.append(not receives or bits_equal(out, full))
            if step == 1:
                rx.verify(p)  # re-reads both sides: digests only
        if own is not None:
            rx.execute(own[0], verify=step == 1)
            landed.append(torch.equal(own[1], torch.full((4, 4), float(job + 1))))
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, group=second.process_group)  # torch collectives take its process group
    from reshard_ext import groups  # what per-group state (channels, NCCL communicators, plans) is keyed by

    keys = {groups.key(first), groups.key(second)} | ({groups.key(None)} if dist.is_initialized() else set())
    second.close()
    first.close()
    return landed, t.item(), len(keys)


def test_two_groups_and_the_own_world_side_by_side():
    got = run_jobs(TRAINER_ENGINE, _side_by_side, free_port())
    for landed, total, keys in got:
        assert all(landed) and len(landed) == 6
        assert total == 1 + 2 + 3 + 4
        assert keys == 3  # no state shared between the groups


def _models(job, local, sizes, port, offset):
    """Megatron-like models that live in their own worlds (trainer TP2, engine DP2) refit
    through the connected group; the adapters place each model rank at its group rank."""
    from _models import GPT, Config, check_filled, fill, make_groups

    import reshard_ext as rx

    cfg = Config()
    if job == 0:
        model = GPT(cfg, make_groups(2, base=0, tp=2, pp=1, dp=1))
        fill(model, 1)
        src, dst = model, None
    else:
        model = GPT(cfg, make_groups(2, base=0, tp=1, pp=1, dp=2))
        src, dst = None, model
    kwargs = {"dst_rank_offset": offset} if offset is not None and job == 1 else {}
    with rx.connect(f"127.0.0.1:{port}", sum(sizes), _rank(job, local, sizes), timeout=60) as group:
        assert group.rank_offset == sum(sizes[:job])
        rx.swap_model_weights(src, dst, group=group, **kwargs)
        first = check_filled(model, 1) if job == 1 else []
        if job == 0:
            fill(model, 2)  # an optimizer step, in place
        rx.swap_model_weights(src, dst, group=group, **kwargs)  # warm: the cached plan
        second = check_filled(model, 2) if job == 1 else []
    with torch.no_grad():
        logits = model(IDS)
    return first, second, logits


@pytest.mark.parametrize("offset", [None, 2], ids=["found", "explicit-rank-offset"])
def test_megatron_models_in_their_own_worlds(offset):
    got = run_jobs(TRAINER_ENGINE, _models, free_port(), offset)
    for first, second, _ in got:
        assert first == [] and second == []
    for _, _, logits in got:  # TP2 and TP1 sum in different orders
        torch.testing.assert_close(logits, got[0][2], rtol=1e-5, atol=1e-5)


def _imported(job, local, sizes):
    import reshard_ext  # noqa: F401


def _join(job, local, sizes, port, world, absent):
    import reshard_ext as rx

    rank = _rank(job, local, sizes)
    if rank in absent:
        return None
    start = time.monotonic()
    try:
        rx.connect(f"127.0.0.1:{port}", world, rank, timeout=JOIN_TIMEOUT_S)
    except rx.ReshardError as e:
        return str(e), time.monotonic() - start
    return "joined", time.monotonic() - start


@pytest.mark.parametrize("world,absent,named", [
    (5, (), "ranks [4] did not join"),  # never launched
    (4, (3,), "ranks [3] did not join"),  # launched, never calls connect
    (4, (0,), "rank 0, which hosts it, is not there"),  # the store's host
], ids=["never-launched", "never-calls", "store-host"])
def test_a_rank_that_never_joins_is_named_on_every_rank(world, absent, named):
    """Every rank that joined raises within the timeout (not the harness's), naming the
    rank that did not come."""
    run_jobs(TRAINER_ENGINE, _imported)  # the ranks that come call connect within moments of each other
    got = run_jobs(TRAINER_ENGINE, _join, free_port(), world, absent, timeout=60)
    for rank, answer in enumerate(got):
        if rank in absent:
            continue
        message, seconds = answer
        assert named in message, (rank, message)
        assert seconds < 30, (rank, seconds)  # bounded by its timeout, not by the harness or a store default


def _twice(job, local, sizes, port):
    import reshard_ext as rx

    rank = min(_rank(job, local, sizes), 2)  # the last two processes both pass rank 2; nobody passes 3
    try:
        rx.connect(f"127.0.0.1:{port}", 4, rank, timeout=JOIN_TIMEOUT_S)
    except rx.ReshardError as e:
        return str(e)
    return "joined"


def test_a_rank_passed_twice():
    run_jobs(TRAINER_ENGINE, _imported)
    got = run_jobs(TRAINER_ENGINE, _twice, free_port(), timeout=60)
    assert sum("joined the group at" in m and "twice" in m for m in got) == 1, got
    assert sum("ranks [3] did not join" in m for m in got) == 3, got


def _closed(job, local, sizes, port):
    import gc

    import reshard_ext as rx
    from reshard_ext import Layout, Mesh, Replicate

    rank, world = _rank(job, local, sizes), sum(sizes)
    lay = (Layout((8,), torch.float32, Mesh([0]), [Replicate()]), Layout((8,), torch.float32, Mesh([3]), [Replicate()]))
    x = torch.arange(8.0) if rank in (0, 3) else None

    def refit(group):
        out = torch.zeros(8)
        p = rx.plan({"x": (x, lay[0])} if rank == 0 else {}, {"x": (out, lay[1])} if rank == 3 else {}, group=group)
        rx.execute(p)
        return p, rank != 3 or torch.equal(out, x)

    address = f"127.0.0.1:{port}"
    group = rx.connect(address, world, rank, timeout=60)
    plan, ok = refit(group)
    group.close()
    group.close()  # idempotent
    errors = []
    for call, arg in ((rx.execute, plan), (rx.verify, plan), (lambda g: rx.plan({}, {}, group=g), group)):
        try:
            call(arg)
            errors.append("no error")
        except rx.ReshardError as e:
            errors.append(str(e))
    del plan, arg
    gc.collect()  # the closed group's store (rank 0's socket) goes with the last plan over it
    with rx.connect(address, world, rank, timeout=60) as again:  # the same address again
        _, ok_again = refit(again)
    return ok, errors, ok_again


def test_close_then_connect_again():
    for ok, errors, ok_again in run_jobs(TRAINER_ENGINE, _closed, free_port()):
        assert ok and ok_again
        assert all("closed" in e for e in errors), errors


def _p2p(job, local, sizes, port):
    """The point-to-point ops reshard_ext posts over a group (torch backend, digest
    exchange) work on a connected group, addressed by group rank."""
    import reshard_ext as rx
    from reshard_ext import groups

    rank, world = _rank(job, local, sizes), sum(sizes)
    with rx.connect(f"127.0.0.1:{port}", world, rank, timeout=60) as group:
        got = torch.zeros(3)
        ops = [groups.p2p_op("send", torch.full((3,), float(rank)), group, (rank + 1) % world),
               groups.p2p_op("recv", got, group, (rank - 1) % world)]
        for work in groups.batch_isend_irecv(ops):
            work.wait()
        return got.tolist(), groups.ranks(group), groups.global_rank(group, 2)


def test_point_to_point_by_group_rank():
    for rank, (got, ranks, two) in enumerate(run_jobs(ENGINE_WITHOUT_WORLD, _p2p, free_port())):
        assert got == [float((rank - 1) % 4)] * 3
        assert ranks == (0, 1, 2, 3) and two == 2


def test_bad_arguments_raise_before_any_connection():
    import reshard_ext as rx

    for args, kwargs, what in [(("127.0.0.1:1", 0, 0), {}, "world_size"), (("127.0.0.1:1", 2, 2), {}, "rank"),
                               (("127.0.0.1:1", 2, 0), {"timeout": 0}, "timeout"), ((None, 2, 1), {}, "address"),
                               (("nohostport", 2, 1), {}, "host:port")]:
        with pytest.raises(rx.ReshardError, match=what):
            rx.connect(*args, **kwargs)


def test_model_ranks_map_to_group_ranks():
    """Standalone.from_world: by job where jobs are known; else by consecutive ranks."""
    import reshard_ext as rx
    from reshard_ext.groups import Standalone

    worlds = [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2)]
    assert [Standalone(None, 3, 5, None, (), worlds).from_world(r) for r in range(3)] == [2, 3, 4]
    assert Standalone(None, 1, 5, None, (), worlds).from_world(0) == 0
    shuffled = [("b", 1), ("a", 0), ("b", 0), ("a", 1)]
    assert Standalone(None, 2, 4, None, (), shuffled).from_world(1) == 0
    unknown = [(None, 0), (None, 1), (None, 0), (None, 1)]
    assert Standalone(None, 3, 4, None, (), unknown).from_world(0) == 2
    with pytest.raises(rx.ReshardError, match="rank 2 of this process's torch.distributed world"):
        Standalone(None, 0, 5, None, (), worlds).from_world(2)
    with pytest.raises(rx.ReshardError, match="not a member"):
        Standalone(None, 1, 4, None, (), unknown).from_world(2)
