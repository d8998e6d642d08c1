"""CPU refits over real gloo process groups: the layout matrix, bit for bit."""
import pytest
from _cases import CASES, run_case
from _dist import run_ranks


@pytest.mark.parametrize("case", sorted(CASES))  # "two" included: any world >= 2
# 1024: staging (send + receive, every peer's region) bounded hard; many batches
@pytest.mark.parametrize("max_batch_bytes", [None, 1024])
def test_matrix_world4(case, max_batch_bytes):
    run_ranks(4, run_case, case, "cpu", max_batch_bytes)


def test_tp8():
    run_ranks(8, run_case, "tp", "cpu", None)


@pytest.mark.parametrize("case", ["casts", "two", "tp"])
def test_world2_backend_cpu_explicit(case):
    run_ranks(2, run_case, case, "cpu", None, "cpu")


def _with_direct_messages(rank, world, case, direct_bytes, rings):
    import reshard_ext as rx

    options = rx.Options(tuning=rx.Tuning(direct_bytes=direct_bytes, host_ring=rings))
    return run_case(rank, world, case, "cpu", None, options=options)


@pytest.mark.parametrize("rings", [True, False], ids=["rings", "gloo"])
@pytest.mark.parametrize("case", ["tp", "casts", "meshes", "pp_experts"])
@pytest.mark.parametrize("direct_bytes", [1, 64])
def test_direct_messages(case, direct_bytes, rings):
    """Ops sent straight from / received straight into tensors (no staging) where
    contiguous, staged otherwise: same bits, through the shared-memory rings and over gloo."""
    run_ranks(4, _with_direct_messages, case, direct_bytes, rings)


def _ring_vote(rank, world, votes):
    import torch

    import reshard_ext as rx
    from reshard_ext import Layout, Mesh, Replicate

    full = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    s, d = (Layout((64, 64), torch.float32, Mesh([r]), [Replicate()]) for r in (0, 1))
    out = torch.zeros(64, 64)
    plan = rx.plan({"w": (full.clone(), s)} if rank == 0 else {}, {"w": (out, d)} if rank == 1 else {},
                   options=rx.Options(tuning=rx.Tuning(host_ring=votes[rank])))
    rx.execute(plan, verify=True)
    return plan.transport.rings, rank == 0 or torch.equal(out, full)


@pytest.mark.parametrize("votes", [(True, True), (True, False), (False, True), (False, False)])
def test_the_rings_need_every_ranks_vote(votes):
    """A plan moves through the rings only where every rank allows them (rx.plan's vote):
    one rank's host_ring=False puts every pair of the plan on gloo."""
    assert run_ranks(2, _ring_vote, votes) == [(all(votes), True)] * 2


def _rebind(rank, world):
    import torch
    from _cases import bits_equal

    import reshard_ext as rx
    from reshard_ext import Layout, Mesh, Shard

    sl = Layout((8, 6), torch.float32, Mesh([0, 1]), [Shard(0)])
    dl = Layout((8, 6), torch.float32, Mesh(list(range(world))), [Shard(1, stride=1)] if 6 % world == 0 else [Shard(0)])
    g = torch.randn(8, 6, generator=torch.Generator().manual_seed(7))  # the same logical tensor on every rank
    src = {"w": (sl.local_part(g, rank), sl)} if rank in sl.mesh else {}
    old = torch.zeros(dl.local_shape(rank))
    p = rx.plan(src, {"w": (old, dl)})
    rx.execute(p)
    assert bits_equal(old, dl.local_part(g, rank))
    # the engine frees and reallocates its weights: rebind, no replanning
    new = torch.full(dl.local_shape(rank), float("nan"))
    keep = old.clone()
    p.rebind(dst={"w": (new, dl)})
    if src:
        src["w"][0].mul_(2)
    rx.execute(p)
    assert bits_equal(new, dl.local_part(g * 2, rank)) and bits_equal(old, keep)
    errors = []
    for bad in ({"w": (new, Layout((8, 6), torch.float32, Mesh(list(range(world))), [Shard(0)]))},  # other layout
                {"w": (torch.zeros(1, 1), dl)},                                                       # wrong shape
                {"v": (new, dl)}):                                                                    # other name
        try:
            p.rebind(dst=bad)
        except rx.ReshardError as e:
            errors.append(str(e))
    return errors


def test_rebind_swaps_tensors_without_replanning():
    for errors in run_ranks(2, _rebind):
        assert len(errors) == 3, errors


def _nan_payloads(rank, world):
    import torch

    import reshard_ext as rx
    from reshard_ext import Layout, Mesh, Replicate

    # signalling and quiet NaNs with payloads, infinities, a subnormal, -0
    bits = torch.tensor([0x7F81, 0xFF90, 0x7FC1, 0x7F80, 0x0001, 0x8000], dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).reshape(1, 6)
    s = Layout((1, 6), torch.bfloat16, Mesh([0]), [Replicate()])
    d = Layout((1, 6), torch.float32, Mesh([0, 1]), [Replicate()])  # rank 0: local copy, rank 1: over gloo
    out = torch.zeros(1, 6)
    rx.execute(rx.plan({"x": (x, s)} if rank == 0 else {}, {"x": (out, d)}))
    return torch.equal(out.view(torch.int32), x.to(torch.float32).view(torch.int32))


def test_casts_keep_nan_payloads_like_torch():
    assert all(run_ranks(2, _nan_payloads))


def _agreed_registration(rank, world, votes):
    import torch
    import torch.distributed as dist

    import reshard_ext.planning as planning
    from reshard_ext import Layout, Mesh, Shard

    saved = planning._registration_vote
    planning._registration_vote = lambda device, options: votes[rank]
    try:
        sl = Layout((8, 4), torch.float32, Mesh(list(range(world))), [Shard(0)])
        src = {"w": (torch.zeros(sl.local_shape(rank)), sl)}
        return planning.plan_collective(src, {}, dist.group.WORLD, None).register
    finally:
        planning._registration_vote = saved


@pytest.mark.parametrize("votes", [(True, True), (True, False), (False, True)])
def test_registration_needs_every_rank(votes):
    """NCCL registration is used only when every rank votes for it (a transfer
    registered at one end only is undefined in NCCL)."""
    assert run_ranks(2, _agreed_registration, votes) == [all(votes)] * 2
