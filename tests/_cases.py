"""The layout matrix every transport must pass: case id -> {name: (shape, src dtype,
src layout, dst dtype, dst layout)} for a given world size. Built inside the workers
(layouts hold C++ objects and are not pickled), identical on every rank."""
from __future__ import annotations

from collections.abc import Callable

import torch

import reshard_ext as rx
from reshard_ext import Layout, Mesh, Replicate, Shard

F32, BF16, F16, I64 = torch.float32, torch.bfloat16, torch.float16, torch.int64
Spec = dict[str, tuple[tuple[int, ...], torch.dtype, Layout, torch.dtype, Layout]]


def _same(shape, dtype, a: Layout, b: Layout, name_prefix=""):
    return (shape, dtype, a, dtype, b)


def tp(ranks, dim, stride=1, blocks=None) -> list:
    return [Mesh(ranks), [Shard(dim, stride, blocks)]]


def L(shape, dtype, mesh, placements) -> Layout:
    return Layout(shape, dtype, mesh if isinstance(mesh, Mesh) else Mesh(mesh), placements)


def case_tp(world: int) -> Spec:
    """TP 1<->2<->4(<->8): column/row parallel, stride 2 (fused gate/up)."""
    out: Spec = {}
    sizes = [n for n in (1, 2, 4, 8) if n <= world]
    for a in sizes:
        for b in sizes:
            for dim, stride in ((0, 1), (1, 1), (0, 2)):
                shape = (32, 48)
                src = L(shape, F32, list(range(a)), [Shard(dim, stride)])
                # dst on the last b ranks so that some boxes are remote
                dst = L(shape, F32, list(range(world - b, world)), [Shard(dim, stride)])
                out[f"tp{a}->{b}.d{dim}.s{stride}"] = (shape, F32, src, F32, dst)
    return out


def case_uneven_blocks(world: int) -> Spec:
    n = min(world, 4)
    ranks = list(range(n))
    return {
        "uneven.rows": ((10, 7), F32, L((10, 7), F32, ranks, [Shard(0)]), F32,
                        L((10, 7), F32, ranks[::-1], [Shard(1)])),
        "uneven.to_one": ((13, 3), F32, L((13, 3), F32, ranks, [Shard(0)]), F32,
                          L((13, 3), F32, [ranks[-1]], [Replicate()])),
        "blocks.qkv": (
            (48, 16), BF16,
            L((48, 16), BF16, ranks[:2], [Shard(0, blocks=(32, 8, 8))]), BF16,
            L((48, 16), BF16, ranks, [Shard(0, blocks=(32, 8, 8))]),
        ),
        "blocks.strided": (
            (64, 4), F32,
            L((64, 4), F32, ranks[:2], [Shard(0, stride=2, blocks=(32, 32))]), F32,
            L((64, 4), F32, ranks, [Shard(0)]),
        ),
    }


def case_meshes(world: int) -> Spec:
    assert world >= 4
    m2 = Mesh([[0, 1], [2, 3]])
    m3 = Mesh([[[0], [1]], [[2], [3]]])  # 2x2x1
    return {
        "nested.2d": ((16, 12), F32, L((16, 12), F32, m2, [Shard(0), Shard(0)]), F32,
                      L((16, 12), F32, m2, [Shard(1), Replicate()])),
        "nested.2d.both": ((8, 12), F32, L((8, 12), F32, m2, [Shard(0), Shard(1)]), F32,
                           L((8, 12), F32, m2, [Shard(1), Shard(0)])),
        "nested.3d": (
            (8, 6, 4), F32,
            L((8, 6, 4), F32, m3, [Shard(0), Shard(2), Replicate()]), F32,
            L((8, 6, 4), F32, Mesh([0, 1, 2, 3]), [Shard(1, stride=1)]) if 6 % 4 == 0
            else L((8, 6, 4), F32, [3, 2, 1, 0], [Shard(0)]),
        ),
        "dp.replicas": ((16, 8), F32, L((16, 8), F32, m2, [Replicate(), Shard(0)]), F32,
                        L((16, 8), F32, [0, 1, 2, 3], [Shard(0)])),
        "dp.to_dp": ((16, 8), F32, L((16, 8), F32, m2, [Replicate(), Shard(1)]), F32,
                     L((16, 8), F32, Mesh([[0, 2], [1, 3]]), [Replicate(), Shard(0)])),
    }


def case_pp_experts(world: int) -> Spec:
    assert world >= 4
    out: Spec = {}
    # PP2 x TP2 -> TP4: stage s holds layers of its own ranks, global layer names.
    for layer in range(4):
        stage = layer // 2
        shape = (16, 8)
        out[f"decoder.layers.{layer}.mlp.fc1.weight"] = (
            shape, F32, L(shape, F32, [2 * stage, 2 * stage + 1], [Shard(0)]), F32,
            L(shape, F32, [0, 1, 2, 3], [Shard(0)]))
    # per-expert tensors: EP4 (expert e on rank e % 4) -> EP2 on ranks 0,1
    for e in range(8):
        shape = (6, 4)
        out[f"decoder.layers.0.mlp.experts.weight{e}"] = (
            shape, BF16, L(shape, BF16, [e % 4], [Replicate()]), BF16, L(shape, BF16, [e % 2], [Replicate()]))
    # stacked experts [E, H, I]: EP4 -> EP2 x TP2 (expert dim over mesh dim 0, I over dim 1)
    shape = (8, 6, 4)
    out["decoder.layers.1.mlp.experts.w"] = (
        shape, BF16, L(shape, BF16, [0, 1, 2, 3], [Shard(0)]), BF16,
        L(shape, BF16, Mesh([[0, 1], [2, 3]]), [Shard(0), Shard(2)]))
    return out


def case_placement(world: int) -> Spec:
    assert world >= 4
    return {
        # non-collocated: disjoint rank sets
        "noncolo": ((12, 8), F32, L((12, 8), F32, [0, 1], [Shard(0)]), F32, L((12, 8), F32, [2, 3], [Shard(1)])),
        # ranks 2 and 3 idle for this tensor on both sides
        "idle": ((5, 3), F32, L((5, 3), F32, [0], [Replicate()]), F32, L((5, 3), F32, [1], [Replicate()])),
        # zero-size pieces and zero-size tensors
        "zero.piece": ((3, 4), F32, L((3, 4), F32, [0, 1, 2, 3], [Shard(0)]), F32,
                       L((3, 4), F32, [3, 2, 1, 0], [Shard(1)])),
        "zero.tensor": ((0, 5), F32, L((0, 5), F32, [0, 1], [Shard(0)]), F32, L((0, 5), F32, [2, 3], [Shard(0)])),
        "scalar": ((), F32, L((), F32, [0], [Replicate()]), F32, L((), F32, [0, 1, 2, 3], [Replicate()])),
    }


def case_casts(world: int) -> Spec:
    r = list(range(min(world, 4)))
    return {
        "cast.f32_bf16": ((16, 6), F32, L((16, 6), F32, r[:2], [Shard(0)]), BF16,
                          L((16, 6), BF16, r, [Shard(1, stride=1)] if 6 % len(r) == 0 else [Shard(0)])),
        "cast.bf16_f32": ((16, 6), BF16, L((16, 6), BF16, r, [Shard(0)]), F32, L((16, 6), F32, r[:1], [Replicate()])),
        "cast.f16_f32": ((8, 8), F16, L((8, 8), F16, r[:2], [Shard(1)]), F32, L((8, 8), F32, r, [Shard(0)])),
        "cast.f32_f16": ((8, 8), F32, L((8, 8), F32, r, [Shard(0)]), F16, L((8, 8), F16, r[:2], [Shard(1)])),
        "cast.f64_bf16": ((8, 4), torch.float64, L((8, 4), torch.float64, r[:1], [Replicate()]), BF16,
                          L((8, 4), BF16, r, [Shard(0)])),
        "int.same": ((8, 5), I64, L((8, 5), I64, r[:2], [Shard(0)]), I64, L((8, 5), I64, r, [Shard(0)])),
        "int8.same": ((8, 5), torch.int8, L((8, 5), torch.int8, r[:2], [Shard(0)]), torch.int8,
                      L((8, 5), torch.int8, r[::-1], [Shard(0)])),
    }


def case_two(world: int) -> Spec:
    """The matrix's kinds on two ranks (for 2-GPU machines)."""
    return {
        "dp.replicas": ((16, 8), F32, L((16, 8), F32, [[0], [1]], [Replicate(), Shard(0)]), F32,
                        L((16, 8), F32, [0, 1], [Shard(0)])),
        "nested.2d": ((8, 12), F32, L((8, 12), F32, [[0, 1]], [Shard(0), Shard(1)]), F32,
                      L((8, 12), F32, [[1], [0]], [Shard(1), Shard(0)])),
        "noncolo": ((12, 8), BF16, L((12, 8), BF16, [0], [Replicate()]), BF16, L((12, 8), BF16, [1], [Replicate()])),
        "pp.layers.0": ((16, 8), F32, L((16, 8), F32, [0], [Replicate()]), F32, L((16, 8), F32, [0, 1], [Shard(0)])),
        "pp.layers.1": ((16, 8), F32, L((16, 8), F32, [1], [Replicate()]), F32, L((16, 8), F32, [0, 1], [Shard(1)])),
        "experts.weight0": ((6, 4), BF16, L((6, 4), BF16, [0], [Replicate()]), BF16,
                            L((6, 4), BF16, [1], [Replicate()])),
        "experts.weight1": ((6, 4), BF16, L((6, 4), BF16, [1], [Replicate()]), BF16,
                            L((6, 4), BF16, [0], [Replicate()])),
        "experts.stacked": ((4, 6, 4), BF16, L((4, 6, 4), BF16, [0, 1], [Shard(0)]), BF16,
                            L((4, 6, 4), BF16, [1, 0], [Shard(2)])),
        "zero.piece": ((1, 4), F32, L((1, 4), F32, [0, 1], [Shard(0)]), F32, L((1, 4), F32, [1, 0], [Shard(0)])),
        "scalar": ((), F32, L((), F32, [1], [Replicate()]), F32, L((), F32, [0, 1], [Replicate()])),
        "strided.qkv": ((48, 16), BF16, L((48, 16), BF16, [0, 1], [Shard(0, blocks=(32, 8, 8))]), F32,
                        L((48, 16), F32, [0], [Replicate()])),
    }


def case_relay(world: int) -> Spec:
    """More dst replicas of a piece than src ranks holding it: relayed by default
    (reshard_ext/relay.py), collocated and not; tensors that cannot split stay direct."""
    assert world >= 4

    def one(shape: tuple[int, ...], dt: torch.dtype = F32, r: tuple[int, ...] = (0,)) -> Layout:
        return L(shape, dt, list(r), [Replicate()])

    def three(shape: tuple[int, ...], dt: torch.dtype = F32) -> Layout:
        return L(shape, dt, [1, 2, 3], [Replicate()])

    m2 = Mesh([[0, 1], [2, 3]])
    return {
        "relay.1to3": ((24, 8), F32, one((24, 8)), F32, three((24, 8))),
        "relay.1to3.uneven": ((10, 7), F32, one((10, 7)), F32, three((10, 7))),
        "relay.1to3.cast": ((12, 5), BF16, one((12, 5), BF16), F32, three((12, 5))),
        "relay.1to3.f32_bf16": ((12, 5), F32, one((12, 5)), BF16, three((12, 5), BF16)),
        "relay.1to3.int": ((9, 4), I64, one((9, 4), I64), I64, three((9, 4), I64)),
        "relay.1to3.3d": ((2, 3, 6), F32, one((2, 3, 6)), F32, three((2, 3, 6))),
        "relay.1to3.tiny": ((1, 1), F32, one((1, 1)), F32, three((1, 1))),
        "relay.1to3.scalar": ((), F32, one(()), F32, three(())),
        "relay.colo.1to4": ((16, 4), F32, one((16, 4)), F32, L((16, 4), F32, [0, 1, 2, 3], [Replicate()])),
        "relay.colo.2repl_dims": ((8, 6), F32, one((8, 6), r=(3,)), F32,
                                  L((8, 6), F32, m2, [Replicate(), Replicate()])),
        "relay.colo.tp2_dp2": ((16, 6), F32, L((16, 6), F32, [1, 2], [Shard(0)]), F32,
                               L((16, 6), F32, m2, [Replicate(), Shard(0)])),
        "relay.colo.strided": ((16, 4), F32, one((16, 4), r=(2,)), F32,
                               L((16, 4), F32, m2, [Shard(0, stride=2), Replicate()])),
        "relay.colo.blocks": ((24, 4), BF16, one((24, 4), BF16, r=(1,)), BF16,
                              L((24, 4), BF16, m2, [Shard(0, blocks=(16, 4, 4)), Replicate()])),
    }


def case_many_boxes(world: int) -> Spec:
    """Many small boxes beside large ones, the direct transport's paths mixed (EP -> all:
    blocks of consecutive experts per source rank, as Megatron places them, so the pieces
    a rank sends are adjacent when allocated in order): whole-tensor runs, TP column
    slices (pitched rows of >= 512 B), row slices, tiny tensors and casts."""
    ranks = list(range(world))
    out: Spec = {}
    n = 48
    for i in range(n):
        shape = (8, 64)
        out[f"experts.{i:03d}"] = (shape, F32, L(shape, F32, [i * world // n], [Replicate()]), F32,
                                   L(shape, F32, ranks, [Replicate()]))
    for i in range(40):
        out[f"tiny.{i:03d}"] = ((3,), F32, L((3,), F32, [i % world], [Replicate()]), F32,
                                L((3,), F32, ranks, [Replicate()]))
    for i in range(4):
        out[f"tp.col.{i}"] = ((16, 512), F32, L((16, 512), F32, ranks, [Shard(1)]), F32,
                              L((16, 512), F32, ranks[::-1], [Replicate()]))
        out[f"tp.row.{i}"] = ((32, 64), BF16, L((32, 64), BF16, ranks, [Shard(0)]), BF16,
                              L((32, 64), BF16, ranks, [Replicate()]))
        out[f"cast.{i}"] = ((8, 128), BF16, L((8, 128), BF16, ranks, [Shard(1)]), F32,
                            L((8, 128), F32, ranks, [Replicate()]))
    return out


CASES: dict[str, Callable[[int], Spec]] = {
    "two": case_two,
    "tp": case_tp,
    "uneven_blocks": case_uneven_blocks,
    "meshes": case_meshes,
    "pp_experts": case_pp_experts,
    "placement": case_placement,
    "casts": case_casts,
    "relay": case_relay,
    "many_boxes": case_many_boxes,
}


def make_global(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-100, 100, shape, generator=g, dtype=torch.int64).to(dtype)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def poison(shape, dtype, device) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -7, dtype=dtype, device=device)


def run_case(rank: int, world: int, case: str, device: str = "cpu", max_batch_bytes=None, backend: str = "auto",
             options=None, inspect=None, alloc=poison, group=None):
    """Refits the case twice (sources changed in place between) and checks every dst
    piece bit for bit against Layout.local_part of the logical tensor. Returns the plan's
    num_ops, or inspect(plan) when given. alloc(shape, dtype, device) makes each
    destination, filled with a value the refit must overwrite. group: the refit's group
    (default WORLD; rank and world are this rank's and its size)."""
    specs = CASES[case](world)
    src, dst, expect = {}, {}, {}
    for i, (name, (shape, sdt, sl, ddt, dl)) in enumerate(sorted(specs.items())):
        g = make_global(shape, sdt, seed=1000 + i)
        part = sl.local_part(g, rank)
        if part is not None:
            src[name] = (part.to(device), sl)
        if rank in dl.mesh:
            dst[name] = (alloc(dl.local_shape(rank), ddt, device), dl)
            expect[name] = g
    p = rx.plan(src, dst, group=group, backend=backend, max_batch_bytes=max_batch_bytes, options=options)
    for step in range(2):
        rx.execute(p)
        if device == "cuda":
            torch.cuda.synchronize()
        for name, (t, dl) in dst.items():
            want = dl.local_part(expect[name].to(dl.dtype), rank)
            assert bits_equal(t.cpu(), want), f"rank {rank} step {step}: {name} differs"
        # change the sources in place (as an optimizer step does) and refit again
        for i, (name, (shape, sdt, sl, _ddt, _dl)) in enumerate(sorted(specs.items())):
            g = make_global(shape, sdt, seed=5000 + i + 100 * step)
            if name in src:
                src[name][0].copy_(sl.local_part(g, rank).to(device))
            if name in expect:
                expect[name] = g
    return inspect(p) if inspect is not None else p.num_ops
