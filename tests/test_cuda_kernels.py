"""The CUDA box copy against the CPU twin and torch, bit for bit.

Two backends run the same checks:
  emulated: the kernel's own per-lane code run on the host over CPU tensors (any CUDA
            build; no GPU needed), so the index math and casts are tested on CI;
  cuda:     the real kernel on a GPU (skipped without one).
Outputs are poisoned with random bytes first; the whole dst buffer must equal the CPU
twin's, so bytes outside the boxes must stay untouched too.
"""
from __future__ import annotations

import random

import pytest
import torch
from _boxes import FLOATS, Spec, itemsize, nan_free_bytes, random_specs, specs_table, table, view

from reshard_ext import _C
from reshard_ext.layout import code_of

HAVE_KERNEL = hasattr(_C, "DeviceBoxTable")
HAVE_GPU = HAVE_KERNEL and torch.cuda.is_available()
BACKENDS = [
    pytest.param("emulated", marks=pytest.mark.skipif(not HAVE_KERNEL, reason="built without CUDA")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU")]),
]
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def run_kernel(backend: str, specs: list[Spec], src: torch.Tensor, dst: torch.Tensor, tile_bytes: int = 0,
               stream: torch.cuda.Stream | None = None, max_blocks: int = 0, flat: bool = True,
               warp_shift: int = -1) -> torch.Tensor:
    """Copies specs from src into a copy of dst (CPU uint8 buffers); returns it on the CPU.
    flat=False: every tile takes the kernel's general path (reads its box record).
    warp_shift >= 0: 1 << warp_shift warps share each tile (else the table's choice)."""
    if backend == "emulated":
        out = dst.clone()
        _C.DeviceBoxTable(specs_table(specs, src, out), tile_bytes, flat).run_emulated(warp_shift=warp_shift)
        return out
    s_dev, out = src.cuda(), dst.cuda()
    tbl = _C.DeviceBoxTable(specs_table(specs, s_dev, out), tile_bytes, flat)
    blob = torch.empty(max(tbl.nbytes, 1), dtype=torch.uint8, device="cuda")
    stream = stream or torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    tbl.upload(blob.data_ptr(), stream.cuda_stream)
    tbl.launch(stream.cuda_stream, max_blocks, warp_shift=warp_shift)
    stream.synchronize()
    return out.cpu()


def run_twin(specs: list[Spec], src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    out = dst.clone()
    _C.copy_boxes_cpu(specs_table(specs, src, out))
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal bits, or both NaN (NaN payloads may differ between routes)."""
    eq = a.contiguous().view(BITS[a.element_size()]) == b.contiguous().view(BITS[b.element_size()])
    if a.is_floating_point():
        eq |= a.isnan() & b.isnan()
    return eq


def check_against_torch(specs: list[Spec], src: torch.Tensor, out: torch.Tensor, limit: int = 300) -> None:
    """Each dst box equals torch's slice of the src box, converted with Tensor.to."""
    rng = random.Random(0)
    picked = specs if len(specs) <= limit else rng.sample(specs, limit)
    for s in picked:
        got = view(out, s.dst_off, s.shape, s.dst_stride, s.dst_dtype)
        want = view(src, s.src_off, s.shape, s.src_stride, s.src_dtype).to(s.dst_dtype)
        assert bool(same_bits(got, want).all()), s


def buffers(specs_src_bytes: int, specs_dst_bytes: int, casts: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    if casts:
        src = nan_free_bytes(specs_src_bytes, gen)
    else:
        src = torch.randint(0, 256, (specs_src_bytes,), dtype=torch.uint8, generator=gen)
    poison = torch.randint(0, 256, (specs_dst_bytes,), dtype=torch.uint8, generator=gen)
    return src, poison


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("count", [1, 7, 64, 1000, 10_000])
@pytest.mark.parametrize("casts", [False, True])
@pytest.mark.parametrize("tile_bytes", [0, 512])
def test_random_boxes_match_twin_and_torch(backend: str, count: int, casts: bool, tile_bytes: int) -> None:
    seed = count * 4 + casts * 2 + (tile_bytes > 0)
    max_elems = max(16, min(1 << 18, 4_000_000 // count))
    specs, sb, db = random_specs(seed, count, max_elems, casts, big=(3 << 20) + 2 if count in (1, 64) else None)
    src, poison = buffers(sb, db, casts, seed)
    want = run_twin(specs, src, poison)
    got = run_kernel(backend, specs, src, poison, tile_bytes)
    assert not torch.equal(want, poison) or all(0 in s.shape for s in specs)
    assert torch.equal(got, want)
    check_against_torch(specs, src, got)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("count", [7, 1000])
def test_general_path_alone_matches_twin(backend: str, count: int) -> None:
    """Flat tiles cleared (DeviceBoxTable(flat=False)): the boxes a flat tile would take
    go through the general walk, which must give the same bytes."""
    specs, sb, db = random_specs(count, count, max(16, 4_000_000 // count), False, big=None)
    src, poison = buffers(sb, db, False, count)
    want = run_twin(specs, src, poison)
    assert torch.equal(run_kernel(backend, specs, src, poison, 512, flat=False), want)
    assert torch.equal(run_kernel(backend, specs, src, poison, 512), want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("casts", [False, True])
@pytest.mark.parametrize("flat", [True, False])
def test_warps_sharing_a_tile_copy_all_of_it(backend: str, casts: bool, flat: bool) -> None:
    """An uncapped launch puts 1 << warp_shift warps on each tile, each copying its share
    of the tile's items: with every share count, over tiles of every length (shares left
    empty, tiles shorter than one warp pass), each box lands whole and nothing else is
    written."""
    seed = 211 + casts * 2 + flat
    specs, sb, db = random_specs(seed, 300, 20_000, casts)
    src, poison = buffers(sb, db, casts, seed)
    want = run_twin(specs, src, poison)
    for shift in range(6):
        assert torch.equal(run_kernel(backend, specs, src, poison, 8192, flat=flat, warp_shift=shift), want), shift


@pytest.mark.skipif(not HAVE_KERNEL, reason="built without CUDA")
@pytest.mark.parametrize(("box_bytes", "tile_bytes", "shift"),
                         [(64 << 10, 64 << 10, 5), (1 << 20, 64 << 10, 5), (4 << 10, 4 << 10, 1),
                          (6 << 10, 8 << 10, 1), (8 << 10, 8 << 10, 2), (3 << 10, 4 << 10, 0), (512, 0, 0)])
def test_warps_per_tile_give_each_about_2_kib(box_bytes: int, tile_bytes: int, shift: int) -> None:
    """The table puts as many warps on its tiles as keep each warp's share at about
    2 KiB (at most 32): the largest tile decides."""
    src, dst = torch.zeros(box_bytes, dtype=torch.uint8), torch.zeros(box_bytes, dtype=torch.uint8)
    u8 = code_of(torch.uint8)
    boxes = table([(src.data_ptr(), dst.data_ptr(), [box_bytes], [1], [1], u8, u8),
                   (src.data_ptr(), dst.data_ptr(), [16], [1], [1], u8, u8)])
    assert _C.DeviceBoxTable(boxes, tile_bytes).warp_shift == shift


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU")
@pytest.mark.parametrize("max_blocks", [1, 3, 100])
@pytest.mark.parametrize("casts", [False, True])
def test_capped_grid_strides_over_every_tile(max_blocks: int, casts: bool) -> None:
    """With the grid capped below one warp per tile, warps loop over the tiles: every
    tile (of differently shaped boxes, so the warp's shared geometry changes between
    tiles) must still land exactly once."""
    seed = 101 + max_blocks + casts
    specs, sb, db = random_specs(seed, 1000, 4000, casts)
    src, poison = buffers(sb, db, casts, seed)
    want = run_twin(specs, src, poison)
    got = run_kernel("cuda", specs, src, poison, tile_bytes=512, max_blocks=max_blocks)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_casts_match_twin_and_torch(backend: str) -> None:
    specs, sb, db = random_specs(11, 500, 4096, casts=True, copies=False)
    src, poison = buffers(sb, db, True, 11)
    got = run_kernel(backend, specs, src, poison)
    assert torch.equal(got, run_twin(specs, src, poison))
    check_against_torch(specs, src, got)


def special_values() -> torch.Tensor:
    v = [0.0, -0.0, 1.0, -1.5, float("inf"), float("-inf"), float("nan"), 65504.0, 65519.996, 65520.0, -65536.0,
         1e-8, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -14, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -9, 1 + 2.0 ** -11,
         3.4028234663852886e38, 3.4028235677973366e38, 1e39, 1e-40, 1e-45, 1e-310, 5e-324, 2.0 ** -126,
         2.0 ** -133, 1.00390625, 1.01171875, -3.0e-39]
    g = torch.Generator().manual_seed(5)
    rnd = (torch.randn(2000, generator=g, dtype=torch.float64)
           * torch.pow(10.0, torch.randint(-45, 45, (2000,), generator=g)))
    return torch.cat([torch.tensor(v, dtype=torch.float64), rnd])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sd", FLOATS)
@pytest.mark.parametrize("dd", FLOATS)
def test_cast_special_values(backend: str, sd: torch.dtype, dd: torch.dtype) -> None:
    """Rounding ties, overflow to inf, subnormals, signed zeros, inf and NaN, for every
    pair of float types, contiguous and strided."""
    vals = special_values().to(sd)
    n = vals.numel()
    ses, des = itemsize(sd), itemsize(dd)
    src = torch.zeros(n * ses + 64, dtype=torch.uint8)
    view(src, 16, (n,), (1,), sd).copy_(vals)
    off2 = (n * des + 15) // 16 * 16
    m = n // 2
    poison = torch.randint(0, 256, (off2 + 2 * m * des + 64,), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(1))
    specs = [Spec((n,), 16, (1,), sd, 0, (1,), dd),  # contiguous
             Spec((m, 2), 16, (2, 1), sd, off2, (1, m), dd)]  # a transpose on the dst side
    got = run_kernel(backend, specs, src, poison)
    twin = run_twin(specs, src, poison)
    for s in specs:
        a = view(got, s.dst_off, s.shape, s.dst_stride, dd)
        assert bool(same_bits(a, view(twin, s.dst_off, s.shape, s.dst_stride, dd)).all()), (sd, dd)
        want = view(src, s.src_off, s.shape, s.src_stride, sd).to(dd)
        assert bool(same_bits(a, want).all()), (sd, dd)
    untouched = torch.ones_like(poison, dtype=torch.bool)
    untouched[:n * des] = False
    untouched[off2:off2 + 2 * m * des] = False
    assert torch.equal(got[untouched], poison[untouched])
    nan_at = int(torch.nonzero(vals.isnan())[0])
    assert bool(view(got, 0, (n,), (1,), dd)[nan_at].isnan())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("es", [1, 2, 4, 8])
def test_every_alignment_of_a_contiguous_box(backend: str, es: int) -> None:
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.int64}[es]
    specs = []
    s_off = d_off = 0
    for ms in range(0, 16, es):
        for md in range(0, 16, es):
            for nbytes in (es, 16, 30, 48, 64 + es, 1000, 4096 + 3 * es):
                n = max(1, nbytes // es)
                s_off = (s_off + 15) // 16 * 16 + ms
                d_off = (d_off + 15) // 16 * 16 + md
                specs.append(Spec((n,), s_off, (1,), dtype, d_off, (1,), dtype))
                s_off += n * es
                d_off += n * es
    src, poison = buffers(s_off + 64, d_off + 64, False, es)
    got = run_kernel(backend, specs, src, poison, tile_bytes=256)
    assert torch.equal(got, run_twin(specs, src, poison))
    check_against_torch(specs, src, got, limit=10_000)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_of_every_width(backend: str) -> None:
    """2-D boxes whose rows are 1..40 bf16 elements: every unit width and carries of the
    odometer across many short rows."""
    specs = []
    s_off = d_off = 0
    for cols in range(1, 41):
        for rows in (1, 3, 33, 100):
            ld = cols + (cols % 3)
            s_off = (s_off + 15) // 16 * 16
            d_off = (d_off + 15) // 16 * 16
            specs.append(Spec((rows, cols), s_off, (ld, 1), torch.bfloat16, d_off, (cols, 1), torch.bfloat16))
            s_off += rows * ld * 2
            d_off += rows * cols * 2
    src, poison = buffers(s_off + 64, d_off + 64, False, 3)
    for tile_bytes in (0, 64, 1000):
        got = run_kernel(backend, specs, src, poison, tile_bytes=tile_bytes)
        assert torch.equal(got, run_twin(specs, src, poison))
        check_against_torch(specs, src, got, limit=10_000)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp_column_slices_pack_and_unpack(backend: str) -> None:
    """Pack the TP column slices of a [rows, cols] bf16 weight into staging and unpack
    them into a second weight: the result equals torch slicing."""
    rows, cols, tp = 96, 256, 4
    w = cols // tp
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    src = weight.view(-1).view(torch.uint8).clone()
    stage = torch.full((rows * cols * 2,), 0xA5, dtype=torch.uint8)
    pack = [Spec((rows, w), r * w * 2, (cols, 1), torch.bfloat16, r * rows * w * 2, (w, 1), torch.bfloat16)
            for r in range(tp)]
    staged = run_kernel(backend, pack, src, stage)
    for r in range(tp):
        assert torch.equal(view(staged, r * rows * w * 2, (rows, w), (w, 1), torch.bfloat16),
                           weight[:, r * w:(r + 1) * w])
    unpack = [Spec((rows, w), r * rows * w * 2, (w, 1), torch.bfloat16, r * w * 2, (cols, 1), torch.bfloat16)
              for r in range(tp)]
    back = run_kernel(backend, unpack, staged, torch.zeros_like(src))
    assert torch.equal(back, src)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_table_and_empty_boxes(backend: str) -> None:
    src, poison = buffers(256, 256, False, 4)
    specs = [Spec((0, 4), 0, (4, 1), torch.float32, 0, (4, 1), torch.float32),
             Spec((3, 0), 0, (4, 1), torch.float16, 16, (4, 1), torch.float32)]
    assert torch.equal(run_kernel(backend, specs, src, poison), poison)
    assert torch.equal(run_kernel(backend, [], src, poison), poison)
    assert _C.DeviceBoxTable(table([])).num_tiles == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU")
def test_replay_rereads_sources_on_a_side_stream() -> None:
    """Upload once, launch every step: each launch copies the sources' current values,
    ordered on the stream it is given."""
    specs, sb, db = random_specs(21, 200, 2048, casts=True)
    src, poison = buffers(sb, db, True, 21)
    s_dev, out = src.cuda(), poison.cuda()
    tbl = _C.DeviceBoxTable(specs_table(specs, s_dev, out))
    blob = torch.empty(tbl.nbytes, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tbl.upload(blob.data_ptr(), side.cuda_stream)
        for step in range(3):
            fresh = nan_free_bytes(sb, torch.Generator().manual_seed(100 + step))
            s_dev.copy_(fresh.cuda(), non_blocking=True)  # in place, as an optimizer does
            tbl.launch(side.cuda_stream)
            got = out.cpu()  # on the side stream: ordered after the launch
            assert torch.equal(got, run_twin(specs, fresh, poison)), step
    side.synchronize()


@pytest.mark.skipif(not HAVE_KERNEL, reason="built without CUDA")
def test_bad_tables_raise() -> None:
    f32 = code_of(torch.float32)
    with pytest.raises(RuntimeError):
        _C.DeviceBoxTable(b"\0" * 7)
    with pytest.raises(RuntimeError):  # int -> float is no exact cast
        _C.DeviceBoxTable(table([(1 << 40, 1 << 41, (4,), (1,), (1,), code_of(torch.int32), f32)]))
    tbl = _C.DeviceBoxTable(table([(1 << 40, 1 << 41, (4,), (1,), (1,), f32, f32)]))
    with pytest.raises(RuntimeError):
        tbl.launch(0)  # before upload
    with pytest.raises(RuntimeError):
        tbl.upload(8, 0)  # misaligned device memory
    with pytest.raises(RuntimeError, match="warp_shift 6 is out of range"):
        tbl.run_emulated(warp_shift=6)  # more warps per tile than a launch may put there
