"""Relay fan-out (reshard_ext/relay.py): which tensors relay, the scatter layouts, and
relayed refits over real process groups (gloo; NCCL with 4 GPUs), bit for bit against
the direct path."""
import pytest
import torch
from _cases import bits_equal, make_global, poison, run_case
from _dist import run_ranks

import reshard_ext as rx
from reshard_ext import Layout, Mesh, Replicate, Shard, relay

F32, BF16 = torch.float32, torch.bfloat16
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs4 = pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs")


def L(shape, ranks, placements, dtype=F32):
    return Layout(shape, dtype, Mesh(ranks), placements)


def _dims(src, dst, **options):
    phases = relay.plan_phases({"w": src}, {"w": dst}, rx.Options(**options))
    return {n: l.placements[-1].dim for n, l in phases.gather_src.items()}


def test_which_tensors_relay():
    one = L((24, 8), [0], [Replicate()])
    to3 = L((24, 8), [1, 2, 3], [Replicate()])
    assert _dims(one, to3) == {"w": 0}
    assert _dims(one, to3, relay=False) == {}
    # as many src holders as replicas: TP2*DP2 -> DP4 (each replica has a holder of each half)
    tp2dp2 = L((24, 8), [[0, 1], [2, 3]], [Replicate(), Shard(0)])
    assert _dims(tp2dp2, L((24, 8), [0, 1, 2, 3], [Replicate()])) == {}
    # collocated: a replica holding its whole class copies it locally, so TP2 -> DP2*TP2 on the
    # same ranks gains nothing (each holder sends its half once either way), 1 -> 4 does
    tp2_dp2 = L((16, 6), [[0, 1], [2, 3]], [Replicate(), Shard(0)])
    assert _dims(L((16, 6), [0, 1], [Shard(0)]), tp2_dp2) == {}
    assert _dims(L((16, 6), [1, 2], [Shard(0)]), tp2_dp2) == {"w": 0}
    assert _dims(one, L((24, 8), [0, 1, 2, 3], [Replicate()])) == {"w": 0}
    # 2 replicas of 1 holder: 1 + 1/2 < 2 copies' time; not when the gather moves f32 for bf16 wire bytes
    assert _dims(one, L((24, 8), [1, 2], [Replicate()])) == {"w": 0}
    assert _dims(L((24, 8), [0], [Replicate()], BF16), L((24, 8), [1, 2], [Replicate()])) == {}
    assert _dims(L((24, 8), [0], [Replicate()], BF16), to3) == {"w": 0}
    # nothing to split: one element, a scalar, an empty tensor
    assert _dims(L((1, 1), [0], [Replicate()]), L((1, 1), [1, 2, 3], [Replicate()])) == {}
    assert _dims(L((), [0], [Replicate()]), L((), [1, 2, 3], [Replicate()])) == {}
    assert _dims(L((0, 9), [0], [Replicate()]), L((0, 9), [1, 2, 3], [Replicate()])) == {}
    # the outermost dim whose shares are near even, else the most even one
    assert _dims(L((4095, 1024), [0], [Replicate()]), L((4095, 1024), [1, 2, 3, 4], [Replicate()])) == {"w": 0}
    assert _dims(L((2, 4096), [0], [Replicate()]), L((2, 4096), [1, 2, 3], [Replicate()])) == {"w": 1}
    assert _dims(L((5, 3, 7), [0], [Replicate()]), L((5, 3, 7), [1, 2, 3], [Replicate()])) == {"w": 1}


SCATTER_CASES = {
    "1to3": (L((10, 7), [0], [Replicate()]), L((10, 7), [1, 2, 3], [Replicate()])),
    "2repl_dims": (L((8, 6), [3], [Replicate()]), L((8, 6), [[0, 1], [2, 3]], [Replicate(), Replicate()])),
    "repl_first": (L((16, 6), [1, 2], [Shard(0)]), L((16, 6), [[0, 1], [2, 3]], [Replicate(), Shard(0)])),
    "strided": (L((16, 4), [2], [Replicate()]), L((16, 4), [[0, 1], [2, 3]], [Shard(0, stride=2), Replicate()])),
    "blocks": (L((24, 4), [1], [Replicate()]),
               L((24, 4), [[0, 1], [2, 3]], [Shard(0, blocks=(16, 4, 4)), Replicate()])),
    "3d_mesh": (L((12, 5), [0], [Replicate()]),
                L((12, 5), [[[1, 2], [3, 4]], [[5, 6], [7, 8]]], [Replicate(), Shard(1), Replicate()])),
}


@pytest.mark.parametrize("case", sorted(SCATTER_CASES))
def test_scatter_piece_is_a_contiguous_share_of_the_dst_piece(case):
    src, dst = SCATTER_CASES[case]
    phases = relay.plan_phases({"w": src}, {"w": dst})
    assert phases.relayed == ["w"]
    scatter = phases.scatter_dst["w"]
    dim = scatter.placements[-1].dim
    g = torch.arange(torch.Size(dst.shape).numel(), dtype=F32).reshape(dst.shape)
    for r in dst.mesh.ranks:
        piece = dst.local_part(g, r)
        view = relay.share(piece, dst, dim, r)
        assert view.untyped_storage().data_ptr() == piece.untyped_storage().data_ptr()  # a view, not a copy
        assert bits_equal(view.contiguous(), scatter.local_part(g, r)), r
    # the replicas of a class share its piece out exactly once
    assert sorted(scatter.mesh.ranks) == sorted(dst.mesh.ranks)
    total = sum(torch.Size(scatter.local_shape(r)).numel() for r in scatter.mesh.ranks)
    assert total == g.numel()


def test_phase_bytes_from_the_layouts():
    src, dst = L((30, 8), [0], [Replicate()]), L((30, 8), [1, 2, 3], [Replicate()])
    phases = relay.plan_phases({"w": src}, {"w": dst})
    scatter = rx.local_plan({"w": src}, phases.scatter_dst, 0)
    assert sum(op.nbytes for op in scatter.sends) == 30 * 8 * 4  # once, not three times
    for r in (1, 2, 3):
        gather = rx.local_plan(phases.gather_src, phases.gather_dst, r)
        assert sum(op.nbytes for op in gather.recvs if op.peer != r) == 20 * 8 * 4
        assert [op.peer for op in gather.recvs if op.peer == r] == [r]  # its own share: a self-copy


# --- over process groups --------------------------------------------------------------

EGRESS = {  # name -> (shape, src dtype, dst dtype, relays)
    "a": ((24, 8), F32, F32, True),
    "b.uneven": ((10, 7), F32, F32, True),
    "c.cast": ((12, 5), BF16, F32, True),
    "d.tiny": ((1, 1), F32, F32, False),
}


def _one_to_three(rank, world, device="cpu", backend="auto", stages=None):
    """Rank 0 holds every tensor, ranks 1-3 are replicas. Relay on and off in the same
    run, three refits each with the sources changed in place (the last after the relayed
    plan's destinations are rebound to new tensors); returns rank 0's bytes."""
    src, dst_on, dst_off, glob, sl_of = {}, {}, {}, {}, {}
    for i, (name, (shape, sdt, ddt, _)) in enumerate(sorted(EGRESS.items())):
        sl, dl = L(shape, [0], [Replicate()], sdt), L(shape, [1, 2, 3], [Replicate()], ddt)
        glob[name], sl_of[name] = make_global(shape, sdt, seed=10 + i), sl
        if rank == 0:
            src[name] = (glob[name].clone().to(device), sl)
        if rank in dl.mesh:
            dst_on[name] = (poison(dl.local_shape(rank), ddt, device), dl)
            dst_off[name] = (poison(dl.local_shape(rank), ddt, device), dl)
    wrong = []
    on = rx.plan(src, dst_on, backend=backend, options=rx.Options(relay=True, tuning=rx.Tuning(relay_stages=stages)))
    if stages:
        assert len(on.phases) == min(stages, 3) + 1  # G groups of the 3 relayed tensors, plus the last forwarding
    off = rx.plan(src, dst_off, backend=backend, options=rx.Options(relay=False))
    assert type(off) is rx.Plan and off.relayed_tensors == 0
    assert on.relayed_tensors == sum(r for *_, r in EGRESS.values())
    for step in range(3):
        if step == 2:
            dst_on = {n: (poison(t.shape, t.dtype, device), dl) for n, (t, dl) in dst_on.items()}
            on.rebind(dst=dst_on)
        rx.execute(on)
        rx.execute(off)
        if device == "cuda":
            torch.cuda.synchronize()
        for name, (t, dl) in dst_on.items():
            want = glob[name].to(dl.dtype)  # every replica holds the whole tensor
            # noted, not asserted here: a rank that stops early would leave rank 0 waiting
            wrong += [(rank, step, name, key) for key, got in (("on", t), ("off", dst_off[name][0]))
                      if not bits_equal(got.cpu(), want)]
        for i, name in enumerate(sorted(EGRESS)):  # an optimizer step, in place
            glob[name] = make_global(glob[name].shape, glob[name].dtype, seed=100 * step + i)
            if name in src:
                src[name][0].copy_(glob[name])
    return on.bytes_sent, off.bytes_sent, wrong


def _wire_bytes(shape, sdt, ddt):
    return torch.Size(shape).numel() * min(torch.empty((), dtype=d).element_size() for d in (sdt, ddt))


def _check_egress(results):
    assert [w for *_, wrong in results for w in wrong] == []  # (rank, refit, tensor, relay) not bit for bit
    on, off, _ = results[0]
    wire = {n: _wire_bytes(s, a, b) for n, (s, a, b, _) in EGRESS.items()}
    assert off == 3 * sum(wire.values())
    assert on == sum(wire[n] * (1 if relays else 3) for n, (*_, relays) in EGRESS.items())


def test_one_source_three_replicas_relay_on_and_off():
    _check_egress(run_ranks(4, _one_to_three))


@pytest.mark.parametrize("stages", [1, 2, 3, 8])
def test_one_source_three_replicas_staged(stages):
    _check_egress(run_ranks(4, _one_to_three, "cpu", "auto", stages))


def test_relay_matrix_cases_smaller_batches():
    run_ranks(4, run_case, "relay", "cpu", 1024)  # max_batch_bytes bounds staging (send + receive) hard


def _num_stages(plan):
    return len(getattr(plan, "phases", ()))


def test_relay_matrix_cases_staged():
    options = rx.Options(tuning=rx.Tuning(relay_stages=4))
    stages = run_ranks(4, run_case, "relay", "cpu", 1024, "auto", options, _num_stages)
    assert stages == [5] * 4  # 4 groups of the relayed tensors, then the last forwarding


def test_stage_groups_cut_by_bytes_in_order():
    sizes = [("a", 100), ("b", 1), ("c", 1), ("d", 50), ("e", 50), ("f", 1)]
    assert relay.stage_groups(sizes, 1) == [["a", "b", "c", "d", "e", "f"]]
    assert relay.stage_groups(sizes, 2) == [["a", "b", "c"], ["d", "e", "f"]]
    assert relay.stage_groups(sizes, 3) == [["a"], ["b", "c", "d"], ["e", "f"]]
    assert relay.stage_groups(sizes[:2], 8) == [["a"], ["b"]]  # no empty group
    assert relay.stage_groups([("a", 0), ("b", 0), ("c", 0)], 2) == [["a"], ["b", "c"]]
    for g in range(1, 8):
        groups = relay.stage_groups(sizes, g)
        assert [n for grp in groups for n in grp] == [n for n, _ in sizes] and all(groups)
        assert len(groups) == min(g, len(sizes))
    assert relay.auto_stages(0, 512) == 1 and relay.auto_stages(10 * 1024, 512) == relay.MAX_AUTO_STAGES
    assert relay.auto_stages(8 * 512, 512) == 4
    assert relay.gather_names({"w": 0, "v": 1}, {"w", "v", "w#gather"}) == {"w": "w#gather#", "v": "v#gather"}


def test_stage_entries_scatter_one_group_beside_the_previous_forwarding():
    names = ["a", "b", "c"]
    dl, sl = L((6, 2), [1, 2, 3], [Replicate()]), L((6, 2), [0], [Replicate()])
    st = relay.Staging({n: 0 for n in names}, [["a"], ["b", "c"]], {n: f"{n}#gather" for n in names})
    dst = {n: (torch.zeros(6, 2), dl) for n in names + ["x"]}
    stages = st.entries({n: (torch.ones(6, 2), sl) for n in names + ["x"]}, dst, 2)
    assert [(sorted(s), sorted(d)) for s, d in stages] == [
        (["a"], ["a"]), (["a#gather", "b", "c"], ["a#gather", "b", "c"]), (["b#gather", "c#gather", "x"],) * 2]
    view, layout = stages[0][1]["a"]
    assert layout == relay.scatter_layout(dl, 0) and tuple(view.shape) == (2, 2)
    assert stages[1][0]["a#gather"][0] is view and stages[1][1]["a#gather"][0] is dst["a"][0]


def _stages_disagree(rank, world):
    src = {"w": (torch.randn(6, 4), L((6, 4), [0], [Replicate()]))} if rank == 0 else {}
    dst = {"w": (torch.zeros(6, 4), L((6, 4), [1, 2, 3], [Replicate()]))} if rank else {}
    try:
        rx.plan(src, dst, options=rx.Options(tuning=rx.Tuning(relay_stages=2 if rank == 1 else 0)))
    except rx.ReshardError as e:
        return str(e)
    return None


def test_relay_stages_must_agree_on_every_rank():
    for msg in run_ranks(4, _stages_disagree):
        assert msg is not None and "relay_stages" in msg, msg


def test_relay_stages_option_is_checked():
    with pytest.raises(rx.ReshardError, match="relay_stages"):
        rx.Options(tuning=rx.Tuning(relay_stages=-1))


def _gather_drops_self_copies(rank, world):
    src = {"w": (torch.randn(24, 8), L((24, 8), [0], [Replicate()]))} if rank == 0 else {}
    dst = {"w": (torch.zeros(24, 8), L((24, 8), [1, 2, 3], [Replicate()]))} if rank else {}
    p = rx.plan(src, dst)
    gather = p.phases[1]
    # the planner gives each replica its own share as a same-rank copy; binding drops it
    return gather.num_ops[2], len(gather.tables.copy_boxes()), gather.bytes_received


def test_gather_drops_the_copy_of_a_replica_onto_itself():
    results = run_ranks(4, _gather_drops_self_copies)
    assert results[0] == (0, 0, 0)
    for copies, bound, received in results[1:]:
        assert (copies, bound, received) == (1, 0, 16 * 8 * 4)


def _options_disagree(rank, world):
    src = {"w": (torch.randn(6, 4), L((6, 4), [0], [Replicate()]))} if rank == 0 else {}
    dst = {"w": (torch.zeros(6, 4), L((6, 4), [1, 2, 3], [Replicate()]))} if rank else {}
    try:
        rx.plan(src, dst, options=rx.Options(relay=rank != 2))
    except rx.ReshardError as e:
        return str(e)
    return None


def test_relay_option_must_agree_on_every_rank():
    for msg in run_ranks(4, _options_disagree):
        assert msg is not None and "relay" in msg and "[2]" in msg, msg


def _rebind_and_failure(rank, world):
    sl, dl = L((9, 4), [0], [Replicate()]), L((9, 4), [1, 2, 3], [Replicate()])
    g = make_global((9, 4), F32, seed=3)
    src = {"w": (g.clone(), sl)} if rank == 0 else {}
    old = torch.zeros(9, 4)
    p = rx.plan(src, {"w": (old, dl)} if rank else {})
    rx.execute(p)
    new = poison((9, 4), F32, "cpu")
    if rank:
        keep = old.clone()
        p.rebind(dst={"w": (new, dl)})
        errors = []
        for bad in ({"w": (torch.zeros(3, 4), dl)}, {"w": (new, L((9, 4), [1, 2, 3], [Shard(0)]))}):
            try:
                p.rebind(dst=bad)
            except rx.ReshardError as e:
                errors.append(str(e))
        assert len(errors) == 2, errors
    else:
        p.rebind(src={"w": (2 * g, sl)})
    rx.execute(p)
    if rank:
        assert bits_equal(new, 2 * g) and bits_equal(old, keep)
    # a failing scatter raises out of execute before the gather runs
    ran = []
    p.phases[0]._run = lambda *args: (_ for _ in ()).throw(rx.ReshardError("scatter failed"))
    p.phases[1]._run = lambda *args: ran.append(1)
    try:
        rx.execute(p, version=5)
    except rx.ReshardError:
        return ran if p.version is None else "version set"
    return "no error"


def test_rebind_and_a_failing_scatter():
    assert run_ranks(4, _rebind_and_failure) == [[]] * 4


@needs4
@pytest.mark.parametrize("max_batch_bytes", [None, 4096])
def test_relay_matrix_4gpu(max_batch_bytes):
    run_ranks(4, run_case, "relay", "cuda", max_batch_bytes, "nccl", backend="nccl")


@needs4
@pytest.mark.parametrize("backend", ["nccl", "torch"])
def test_one_source_three_replicas_4gpu(backend):
    _check_egress(run_ranks(4, _one_to_three, "cuda", backend, backend="nccl"))


def _auto_backends(rank, world):
    """backend "auto" with relay on and off: (the relayed plan's stage backends, the plain plan's)."""
    sl, dl = L((64, 32), [0], [Replicate()]), L((64, 32), [1, 2, 3], [Replicate()])
    g = make_global((64, 32), F32, seed=3)
    dst = lambda: {"w": (torch.zeros(64, 32, device="cuda"), dl)} if rank else {}  # noqa: E731
    src = {"w": (g.cuda(), sl)} if rank == 0 else {}
    on = rx.plan(src, dst(), options=rx.Options(relay=True))
    off = rx.plan(src, dst(), options=rx.Options(relay=False))
    return [p.backend for p in on.phases], off.backend


@needs4
def test_auto_runs_the_stages_of_a_relayed_plan_on_nccl_4gpu():
    """Unless rx.Options.auto_direct says otherwise: NCCL's staged fan-out beats the
    direct transport's copy engines there (benchmarks/RESULTS.md, relay)."""
    for stages, plain in run_ranks(4, _auto_backends, backend="nccl"):
        assert set(stages) == {"nccl"} and plain == "direct", (stages, plain)


def _relay_version_and_watch(rank, world):
    """A relayed refit (two plans) is one execute: one version, and a replaced destination
    on one rank raises on every rank before either phase moves data."""
    sl, dl = L((9, 4), [0], [Replicate()]), L((9, 4), [1, 2, 3], [Replicate()])
    g = make_global((9, 4), F32, seed=5)
    out = torch.zeros(9, 4)
    dst = {"w": (out, dl)} if rank else {}
    p = rx.plan({"w": (g.clone(), sl)} if rank == 0 else {}, dst)
    rx.execute(p, version=4)
    got = [len(p.phases), p.version]
    if rank == 2:
        out.data = torch.zeros(9, 4)  # the bound tensor now points elsewhere
    try:
        rx.execute(p, version=5)
        got.append("no error")
    except rx.ReshardError as e:
        got.append(str(e))
    return got + [p.version]


def test_relayed_refit_is_one_version_and_checks_both_phases():
    for rank, (phases, first, error, last) in enumerate(run_ranks(4, _relay_version_and_watch)):
        assert phases == 2 and first == 4 and last is None, (rank, phases, first, last)
        assert error != "no error", rank
        if rank == 2:
            assert "replaced or resized" in error, error
