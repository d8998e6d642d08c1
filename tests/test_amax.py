"""Global amaxes over block grids (reshard_ext/codecs/amax.py, csrc/kernels/codecs/amax*):
the partial kernel against torch, the grid geometry, and the reduction among real gloo ranks
(cut blocks, uneven and strided shards, replicas, per-tensor grids), alone and as the
pre-pass of a plan's execute."""
from __future__ import annotations

import math
import time
import zlib

import numpy as np
import pytest
import torch
from _dist import run_ranks

import reshard_ext as rx
from reshard_ext import Layout, Mesh, Replicate, Shard
from reshard_ext.codecs.amax import AmaxPiece, block_grid
from reshard_ext.transforms import Rewrite, Transform

BF16, F32 = torch.bfloat16, torch.float32
NAN_P, NAN_N = 0x7FC0, 0xFFC0  # BF16 +NaN, -NaN


def _L(shape, mesh, placements, dtype=BF16) -> Layout:
    return Layout(shape, dtype, Mesh(mesh), placements)


def ref_amax(x: torch.Tensor, block: tuple[int, ...], nan: str = "propagate",
             mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-cell max of |x| (only where `mask`) as FP32 bits in int32, written in torch
    independently: pad every dim to whole blocks, amax over each block's dims."""
    a = x.float().abs()
    if nan == "ignore":
        a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    if mask is not None:
        a = torch.where(mask, a, torch.zeros_like(a))
    grid = [-(-s // b) for s, b in zip(x.shape, block)]
    padded = torch.zeros([g * b for g, b in zip(grid, block)], dtype=F32)
    padded[tuple(slice(0, s) for s in x.shape)] = a
    view = padded.reshape([v for g, b in zip(grid, block) for v in (g, b)])
    out = view.amax(dim=tuple(range(1, 2 * len(block), 2)))
    bits = out.view(torch.int32).clone()
    bits[torch.isnan(out)] = 0x7FC00000  # a NaN cell: any NaN pattern (its payload is not the contract)
    return bits.flatten()


def canon(bits: torch.Tensor) -> torch.Tensor:
    """NaN cells as one pattern (the kernels keep the largest NaN payload they met)."""
    out = bits.clone()
    out[out > 0x7F800000] = 0x7FC00000
    return out


def sample(shape, seed: int, dtype=BF16, specials: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 8, shape, generator=g).float())).to(dtype)
    if specials and x.numel() > 8:
        flat = x.view(-1)
        bits = flat.view(torch.int16) if dtype == BF16 else None
        n = flat.numel()
        picks = torch.randint(0, n, (6,), generator=g).tolist()
        flat[picks[0]] = float("inf")
        flat[picks[1]] = float("-inf")
        flat[picks[2]] = -0.0
        if bits is not None:
            bits[picks[3]] = NAN_P
            bits[picks[4]] = NAN_N - (1 << 16)
        else:
            flat[picks[3]] = float("nan")
    return x


def piece_mask(layout: Layout, rank: int) -> torch.Tensor:
    mask = torch.zeros(layout.shape, dtype=torch.bool)
    runs = layout.runs(rank)
    idx = [torch.cat([torch.arange(s, s + n) for s, n in r]) if r else torch.zeros(0, dtype=torch.long)
           for r in runs]
    mask[torch.meshgrid(*idx, indexing="ij")] = True
    return mask


LAYOUTS = {
    # TP shards of 64 rows cut every 128-row block
    "tp4_rows": (_L((256, 384), [0, 1, 2, 3], [Shard(0)]), (128, 128)),
    # uneven (torch.chunk) shards of columns, K = 300 (a partial last block)
    "uneven_cols": (_L((130, 300), [0, 1, 2], [Shard(1)]), (128, 128)),
    # fused gate/up, stride 2: each rank holds two runs of 48 rows
    "strided": (_L((192, 256), [0, 1], [Shard(0, stride=2)]), (128, 128)),
    # DP2 x TP2: replicas of each shard (96 rows: cut)
    "dp_tp": (_L((192, 256), [[0, 1], [2, 3]], [Replicate(), Shard(0)]), (128, 128)),
    # a stacked [E, N, K] sharded over experts and rows; blocks per expert
    "experts": (_L((4, 200, 256), [[0, 1], [2, 3]], [Shard(0), Shard(1)]), (1, 128, 128)),
    # aligned: no block is cut, nothing travels
    "aligned": (_L((512, 256), [0, 1, 2, 3], [Shard(0)]), (128, 128)),
    # a per-tensor amax (NVFP4's global scale): one cell every shard shares
    "per_tensor": (_L((96, 160), [0, 1, 2, 3], [Shard(1)]), (96, 160)),
    # a mesh of two ranks in a group of four
    "two_ranks": (_L((128, 128), [3, 1], [Shard(1)]), (128, 128)),
}


@pytest.mark.parametrize("nan", ["propagate", "ignore"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16, F32])
@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_partial_kernel_matches_torch(case, dtype, nan):
    layout, block = LAYOUTS[case]
    layout = layout.with_dtype(dtype)
    x = sample(layout.shape, zlib.crc32(case.encode()), dtype)
    for rank in sorted(set(layout.mesh.ranks)):
        piece = AmaxPiece(case, layout, layout.local_part(x, rank), rank, block, nan)
        piece.partial()
        want = ref_amax(x, block, nan, piece_mask(layout, rank))
        assert torch.equal(canon(piece.grid), want), (case, rank)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and rx.build_info()["cuda"]),
                    reason="needs a GPU and reshard_ext built with CUDA")
@pytest.mark.parametrize("nan", ["propagate", "ignore"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16, F32])
@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_partial_kernel_on_cuda(case, dtype, nan):
    layout, block = LAYOUTS[case]
    layout = layout.with_dtype(dtype)
    x = sample(layout.shape, zlib.crc32(case.encode()), dtype)
    for rank in sorted(set(layout.mesh.ranks)):
        piece = AmaxPiece(case, layout, layout.local_part(x, rank).cuda(), rank, block, nan)
        piece.partial()
        assert torch.equal(canon(piece.grid.cpu()), ref_amax(x, block, nan, piece_mask(layout, rank))), (case, rank)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and rx.build_info()["cuda"]),
                    reason="needs a GPU and reshard_ext built with CUDA")
@pytest.mark.parametrize("nan", ["propagate", "ignore"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16, F32])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_partial_kernel_large_on_cuda(per_tensor, dtype, nan):
    """A piece larger than one sweep of the kernel's grid (its units advance by the grid's
    stride), read through a column slice (a row stride wider than its 4100 columns: the last
    unit of each row is 4 columns wide, the last segment 15 rows tall), and the same with
    maps that are not 16-byte aligned."""
    from reshard_ext import _C
    from reshard_ext.codecs import rows_view, stream_of
    from reshard_ext.layout import code_of

    x = sample((4111, 4104), 11, dtype)
    for k, v in enumerate((3.0, -7.5, 1e4)):  # a few large values far apart, one per cell region
        x[k * 1500 + 7, k * 1300 + 5] = v
    view = x.cuda()[:, :4100]
    shape = tuple(view.shape)
    block = shape if per_tensor else (128, 128)
    piece = AmaxPiece("big", _L(shape, [0], [Replicate()], dtype), view, 0, block, nan)
    piece.partial()
    want = ref_amax(x[:, :4100], block, nan)
    assert torch.equal(canon(piece.grid.cpu()), want)
    rows, cols, row_stride = rows_view(view)
    assert row_stride == 4104
    maps = [torch.zeros(m.numel() + 1, dtype=torch.int32, device="cuda") for m in (piece.rowmap, piece.colmap)]
    maps[0][1:], maps[1][1:] = piece.rowmap, piece.colmap
    grid = torch.zeros_like(piece.grid)
    _C.amax_partial_cuda(view.data_ptr(), code_of(dtype), rows, cols, row_stride, maps[0][1:].data_ptr(),
                         maps[1][1:].data_ptr(), piece.nan, grid.data_ptr(), stream_of(view))
    assert torch.equal(canon(grid.cpu()), want)


def test_partial_kernel_reads_strided_pieces():
    """A piece whose rows do not flatten (a transposed view) goes through a contiguous copy."""
    layout = _L((64, 256), [0], [Replicate()])
    x = sample((256, 64), 7).t()
    piece = AmaxPiece("t", layout, x, 0, (32, 128))
    piece.partial()
    assert torch.equal(canon(piece.grid), ref_amax(x, (32, 128)))


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_geometry_pairs_agree(case):
    """Every rank receives every other distinct non-empty piece exactly once, from a rank
    that sends it; a tensor is cut exactly when some block has elements on two pieces."""
    layout, block = LAYOUTS[case]
    grid = block_grid(case, layout, block)
    ranks = sorted(set(layout.mesh.ranks))
    owners = torch.zeros(grid.numel, dtype=torch.int64)
    for p in grid.pieces:
        owners[torch.from_numpy(p.cells.copy())] += 1
    assert grid.cut == bool((owners > 1).any()), case
    for r in ranks:
        got = grid.senders(r)
        others = [p for i, p in enumerate(grid.pieces) if i != grid.piece_of[r] and p.cells.size]
        assert len(got) == len(others)
        for sender, cells in got:
            assert r in grid.receivers(sender)
            assert any(cells is p.cells and sender in p.ranks for p in others)
        for q in grid.receivers(r):
            assert any(s == r for s, _ in grid.senders(q))


def test_bad_blocks_are_user_errors():
    with pytest.raises(rx.ReshardError, match="'w'"):
        block_grid("w", _L((8, 8), [0], [Replicate()]), (0, 8))
    with pytest.raises(rx.ReshardError, match="'w'"):
        AmaxPiece("w", _L((8, 8), [0], [Replicate()], torch.int32), torch.zeros(8, 8, dtype=torch.int32), 0, (8, 8))


def _reduce_worker(rank: int, world: int, case: str, nan: str) -> int:
    layout, block = LAYOUTS[case]
    x = sample(layout.shape, zlib.crc32(case.encode()) + 1)
    want = ref_amax(x, block, nan)
    pieces = []
    if rank in layout.mesh:
        pieces.append(AmaxPiece(case, layout, layout.local_part(x, rank), rank, block, nan))
    # every rank of the group calls it; one without a piece of a cut tensor has nobody to talk to
    AmaxPiece.reduce(pieces, torch.distributed.group.WORLD)
    for p in pieces:
        cells = torch.arange(p.grid_of.numel) if p.grid_of.cut else torch.from_numpy(p.cells.copy())
        assert torch.equal(canon(p.grid)[cells], want[cells]), (case, rank)
        return len(p.senders) + len(p.receivers)
    return 0


@pytest.mark.parametrize("nan", ["propagate", "ignore"])
def test_reduction_among_ranks(nan):
    for case, (layout, block) in sorted(LAYOUTS.items()):
        talked = run_ranks(4, _reduce_worker, case, nan)
        assert (sum(talked) > 0) == block_grid(case, layout, block).cut, (case, talked)
    assert not block_grid("aligned", *LAYOUTS["aligned"]).cut


class _Probe(Transform):
    """A transform that only reads: each source gets an AmaxPiece pre-pass and a `before`
    step that records its amax (what a codec would quantize with)."""

    def __init__(self, block, seen: dict):
        self.block, self.seen = block, seen

    def rewrite_src(self, name, tensor, layout):
        rank = torch.distributed.get_rank()
        piece = AmaxPiece(name, layout, tensor, rank, self.block)

        def before() -> None:
            self.seen[name] = piece.grid.clone()

        return Rewrite(entries={name: (tensor, layout)}, before=before, prepass=piece)


def _plan_worker(rank: int, world: int, bad_rank: int) -> tuple[str, float]:
    sl = _L((256, 256), [0, 1, 2, 3], [Shard(0)])   # cut: 64 rows per rank
    dl = _L((256, 256), [3, 2, 1, 0], [Shard(1)])
    x = sample(sl.shape, 3, specials=False)
    seen: dict = {}
    src_t = sl.local_part(x, rank)
    out = torch.empty(dl.local_shape(rank), dtype=BF16)
    plan = rx.plan({"w": (src_t, sl)}, {"w": (out, dl)}, transform=_Probe((128, 128), seen))
    for step in range(2):
        x = sample(sl.shape, 10 + step, specials=False)
        src_t.copy_(sl.local_part(x, rank))
        rx.execute(plan)
        assert torch.equal(canon(seen["w"]), ref_amax(x, (128, 128))), step
        assert torch.equal(out, dl.local_part(x, rank))
    if bad_rank < 0:
        return "", 0.0
    t0 = time.monotonic()
    try:
        # a version only this rank gets wrong: its own check fails, it tells its partners in the pre-pass
        rx.execute(plan, version="bad" if rank == bad_rank else 3, timeout=60)  # type: ignore[arg-type]
    except rx.ReshardError as e:
        return str(e), time.monotonic() - t0
    return "", time.monotonic() - t0


def test_prepass_runs_in_every_execute():
    run_ranks(4, _plan_worker, -1)


def test_a_failed_rank_fails_its_partners_at_once():
    got = run_ranks(4, _plan_worker, 2)
    for rank, (msg, took) in enumerate(got):
        assert msg, f"rank {rank} did not raise"
        assert took < 30, f"rank {rank} waited {took:.1f} s"
        if rank == 2:
            assert "version must be" in msg
    assert any("rank 2" in msg or "ranks [2]" in msg for msg, _ in got), got


def test_reduction_is_bitwise_in_any_order():
    """Integer max of FP32 patterns equals float max, NaN above Inf: numpy's reduction
    gives the torch answer."""
    vals = torch.tensor([0.0, 1.5, float("inf"), 3.0, float("nan")]).view(torch.int32).numpy()
    assert np.maximum.reduce(vals[:4]) == np.float32(np.inf).view(np.int32)
    assert np.maximum.reduce(vals) > np.float32(np.inf).view(np.int32)
    assert math.isnan(np.maximum.reduce(vals).view(np.float32))
