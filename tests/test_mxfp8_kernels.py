"""MXFP8 quantize kernels against a reference written from the OCP MX v1.0 spec.

The reference works in float64 with explicit E4M3 round-to-nearest-even and saturation;
it shares no code with the C++ kernels. Policy it encodes (and the kernels follow):
amax over finite elements only; "floor" scale 2^(floor(log2 amax) - 8) (OCP, emax of
E4M3 = 8), "ceil" scale 2^ceil(log2(amax / 448)); biased E8M0 clamped to [0, 254]; all-
zero (or all non-finite) blocks get biased 0; elements saturate to +-448 (Inf too), NaN
-> 0x7f with the input's sign, zero keeps its sign (-0 -> 0x80).
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch

from reshard_ext import _C
from reshard_ext.mxfp8 import quantize, scale_numel, swizzle, swizzled_size

ROUNDINGS = ("ceil", "floor")
LAYOUTS = ("2d", "swizzled")


# ---- reference ---------------------------------------------------------------------

def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) for finite a > 0, exact (frexp: a = m 2^e, m in [0.5, 1))."""
    _, e = torch.frexp(a)
    return (e - 1).double()

needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and hasattr(_C, "mxfp8_quantize_cuda")),
                                reason="needs a GPU and reshard_ext built with CUDA")



def _ceil_log2(a: torch.Tensor) -> torch.Tensor:
    m, e = torch.frexp(a)
    return torch.where(m == 0.5, e - 1, e).double()


def ref_e4m3(y: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn) bytes of float64 y: RNE, saturate to +-448, NaN -> 0x7f|sign."""
    a = y.abs()
    a = torch.where(torch.isinf(a), torch.full_like(a, 448.0), a)
    safe = torch.where((a > 0) & ~torch.isnan(a), a, torch.ones_like(a))
    e = torch.where(a > 0, _floor_log2(safe), torch.full_like(a, -6.0)).clamp(min=-6.0)
    quantum = torch.exp2(e - 3.0)            # 3 mantissa bits; subnormal quantum 2^-9
    v = (torch.round(a / quantum) * quantum).clamp(max=448.0)   # torch.round: half to even
    v = torch.where(torch.isnan(a), torch.zeros_like(v), v)
    bits = torch.copysign(v, y).to(torch.float8_e4m3fn).view(torch.uint8)  # exact: v representable
    nan_bits = torch.where(torch.signbit(y), 0xFF, 0x7F).to(torch.uint8)
    return torch.where(torch.isnan(y), nan_bits, bits)


def ref_mxfp8(x: torch.Tensor, rounding: str = "ceil", scale_layout: str = "2d") -> tuple[torch.Tensor, torch.Tensor]:
    """Reference quantizer: bf16 [..., K] -> (data uint8 [..., K], scale uint8)."""
    assert x.dtype == torch.bfloat16
    k = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    ks = (k + 31) // 32
    v = x.reshape(rows, k).double()
    v = torch.nn.functional.pad(v, (0, ks * 32 - k))          # zero padding: amax unchanged
    blocks = v.view(rows, ks, 32)
    mag = blocks.abs()
    amax = torch.where(torch.isfinite(mag), mag, torch.zeros_like(mag)).amax(-1)
    pos = amax > 0
    safe = torch.where(pos, amax, torch.ones_like(amax))
    if rounding == "floor":
        e = _floor_log2(safe) - 8.0
    else:
        e = _ceil_log2(safe / 448.0)    # amax/448 is a power of two only when exact
    biased = torch.where(pos, (e + 127.0).clamp(0.0, 254.0), torch.zeros_like(e))
    y = blocks / torch.exp2(biased - 127.0).unsqueeze(-1)
    y = y.reshape(rows, ks * 32)[:, :k]
    data = ref_e4m3(y).reshape(x.shape)
    scale = biased.to(torch.uint8)
    if scale_layout == "swizzled":
        scale = ref_swizzle(scale)
    else:
        scale = scale.reshape(tuple(x.shape[:-1]) + (ks,))
    return data, scale


def ref_swizzle(scale2d: torch.Tensor) -> torch.Tensor:
    """128x4 tiles in row-major tile order; inside a tile (r, c) -> (r%32)*16 + (r//32)*4 + c.
    Padding 0; any dtype (positions too: see test_mxfp8_boxes)."""
    rows, cols = scale2d.shape
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = torch.zeros(rp, cp, dtype=scale2d.dtype)
    padded[:rows, :cols] = scale2d
    t = padded.view(rp // 128, 128, cp // 4, 4).permute(0, 2, 1, 3)        # tiles [R, C, 128, 4]
    t = t.reshape(rp // 128, cp // 4, 4, 32, 4).permute(0, 1, 3, 2, 4)     # r = 32*i + j -> [j, i, c]
    return t.reshape(-1).contiguous()


# ---- inputs ------------------------------------------------------------------------

def _bf16(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float64).to(torch.bfloat16)


def make_case(name: str, rows: int = 64, cols: int = 256, seed: int = 0) -> torch.Tensor:
    if cols % 32:  # ragged last block: draw whole blocks, keep the first `cols` columns
        return make_case(name, rows, cols + 32 - cols % 32, seed)[:, :cols].contiguous()
    g = torch.Generator().manual_seed(seed)
    if name == "normal":
        return torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    if name == "wide":
        e = torch.randint(-134, 128, (rows, cols), generator=g).double()
        s = torch.randint(0, 2, (rows, cols), generator=g).double() * 2 - 1
        m = 1 + torch.rand(rows, cols, generator=g, dtype=torch.float64)
        return (s * m * torch.exp2(e)).to(torch.bfloat16)
    if name == "bits":  # every bf16 pattern may appear: NaN, Inf, subnormals, -0
        bits = torch.randint(0, 1 << 16, (rows, cols), generator=g, dtype=torch.int32)
        return bits.to(torch.int16).view(torch.bfloat16)
    if name == "zeros":
        x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
        x.view(rows, -1, 32)[::2, ::3] = 0.0
        x.view(rows, -1, 32)[1::2, 1::3] = -0.0
        return x
    if name == "boundary":  # block amax at and around 448 * 2^k
        x = (torch.rand(rows, cols, generator=g) * 0.9).to(torch.bfloat16).view(rows, -1, 32)
        k = torch.randint(-20, 20, (rows, x.shape[1]), generator=g).double()
        factor = torch.tensor([448.0, 448.0 * (1 + 2 ** -7), 448.0 - 2.0, 256.0, 512.0 - 2.0, 224.0])
        pick = factor[torch.randint(0, len(factor), (rows, x.shape[1]), generator=g)]
        big = (pick * torch.exp2(k)).to(torch.bfloat16)
        x = x * big.unsqueeze(-1) / 448.0  # most elements scaled along
        x[..., 5] = big
        x[..., 7] = -big
        return x.reshape(rows, cols).to(torch.bfloat16)
    if name == "subnormal":  # one large element per block, the rest far below: E4M3 subnormals
        x = torch.randn(rows, cols, generator=g).double() * 2.0 ** -8
        x.view(rows, -1, 32)[..., 0] = 448.0
        return x.to(torch.bfloat16)
    if name == "ties":  # E4M3 rounding ties at scale 2^0 (amax 256 -> both rules give 2^0)
        mant = torch.tensor([1 + 1 / 16, 1 + 3 / 16, 1 + 5 / 16, 1 + 15 / 16, 1 + 1 / 32, 1 + 3 / 32])
        exps = torch.randint(-9, 8, (rows, cols), generator=g).double()
        x = mant[torch.randint(0, len(mant), (rows, cols), generator=g)].double() * torch.exp2(exps)
        x = x * (torch.randint(0, 2, (rows, cols), generator=g) * 2 - 1)
        x.view(rows, -1, 32)[..., 3] = 256.0
        return x.to(torch.bfloat16)
    if name == "nonfinite":
        x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
        x.view(-1)[::37] = float("nan")
        x.view(-1)[5::53] = float("inf")
        x.view(-1)[11::59] = float("-inf")
        x.view(-1)[13::61] = -float("nan")
        x.view(rows, -1, 32)[0, 0] = float("nan")  # an all-NaN block
        return x
    raise ValueError(name)


CASES = ("normal", "wide", "bits", "zeros", "boundary", "subnormal", "ties", "nonfinite")


def kernel(x: torch.Tensor, rounding: str, scale_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    data = torch.full(x.shape, 0xAB, dtype=torch.uint8, device=x.device)
    scale = torch.full((scale_numel(tuple(x.shape), scale_layout),), 0xCD, dtype=torch.uint8, device=x.device)
    quantize(x, data, scale, scale_layout, rounding)
    if scale_layout == "2d":
        scale = scale.view(tuple(x.shape[:-1]) + ((k + 31) // 32,))
    return data, scale


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.cpu().reshape(-1), want.cpu().reshape(-1)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.numel()} bytes differ, first at {bad[0].item()}: " \
                             f"got {got[bad[0]].item():#04x} want {want[bad[0]].item():#04x}"


# ---- tests -------------------------------------------------------------------------

def test_reference_hand_values():
    ones = _bf16([[1.0] * 32])
    for r in ROUNDINGS:
        d, s = ref_mxfp8(ones, r)
        assert s.item() == 119 and set(d.view(-1).tolist()) == {0x78}  # 1 = 256 * 2^-8
    x = _bf16([[480.0] + [1.0] * 31])
    d, s = ref_mxfp8(x, "floor")
    assert s.item() == 127 and d[0, 0].item() == 0x7E           # 480 saturates to 448
    d, s = ref_mxfp8(x, "ceil")
    assert s.item() == 128 and d[0, 0].item() == 0x77           # 240 = 1.875 * 2^7
    x = _bf16([[448.0] + [2.0 ** -9] * 30 + [-(2.0 ** -10)]])
    d, s = ref_mxfp8(x, "ceil")
    assert s.item() == 127 and d[0, 1].item() == 0x01 and d[0, 31].item() == 0x80   # subnormal; tie -> -0
    z = torch.zeros(1, 32, dtype=torch.bfloat16)
    for r in ROUNDINGS:
        d, s = ref_mxfp8(z, r)
        assert s.item() == 0 and d.sum().item() == 0


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("scale_layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_cpu_kernel_matches_reference(case, rounding, scale_layout):
    x = make_case(case, rows=130, cols=288, seed=zlib.crc32(case.encode()) % 1000)
    got_d, got_s = kernel(x, rounding, scale_layout)
    want_d, want_s = ref_mxfp8(x, rounding, scale_layout)
    assert_bytes_equal(got_d, want_d, f"data {case}")
    assert_bytes_equal(got_s, want_s, f"scale {case}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_exhaustive_bf16_elements(rounding, device):
    """Every BF16 bit pattern as an element, under blocks whose amax sets many scales (on
    CUDA: the hardware E4M3 conversion of finite values against the reference's rounding)."""
    allbits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = allbits[: (allbits.numel() // 31) * 31].view(-1, 31)
    amax = make_case("wide", rows=x.shape[0], cols=1, seed=3).abs()
    x = torch.cat([x, amax], dim=1)  # 32 per row: one block each
    for layout in LAYOUTS:
        got_d, got_s = kernel(x.to(device), rounding, layout)
        want_d, want_s = ref_mxfp8(x, rounding, layout)
        assert_bytes_equal(got_d, want_d, "data")
        assert_bytes_equal(got_s, want_s, "scale")


@pytest.mark.parametrize("shape", [(3, 80), (2, 5, 96), (1, 31), (7, 1), (0, 64), (129, 64), (4, 0)])
@pytest.mark.parametrize("scale_layout", LAYOUTS)
def test_shapes_partial_blocks(shape, scale_layout):
    x = make_case("wide", rows=math.prod(shape[:-1]) or 1, cols=max(shape[-1], 1), seed=7)
    x = x[: math.prod(shape[:-1]), : shape[-1]].reshape(shape)
    for r in ROUNDINGS:
        got_d, got_s = kernel(x, r, scale_layout)
        want_d, want_s = ref_mxfp8(x, r, scale_layout)
        assert_bytes_equal(got_d, want_d, "data")
        assert_bytes_equal(got_s, want_s, "scale")


def test_strided_rows():
    wide = make_case("normal", rows=40, cols=200, seed=2)
    x = wide[:, 8:168]  # row stride 200, not contiguous
    got_d, got_s = kernel(x, "ceil", "2d")
    want_d, want_s = ref_mxfp8(x.contiguous(), "ceil", "2d")
    assert_bytes_equal(got_d, want_d, "data")
    assert_bytes_equal(got_s, want_s, "scale")


def test_swizzle_layout():
    rows, scols = 257, 9
    s2d = torch.randint(0, 255, (rows, scols), dtype=torch.uint8)
    want = ref_swizzle(s2d)
    assert want.numel() == swizzled_size(rows, scols) == 384 * 12
    # the documented formula, element by element
    for r, c in [(0, 0), (1, 0), (31, 3), (32, 0), (127, 3), (128, 0), (200, 5), (256, 8)]:
        off = _C.mxfp8_swizzled_offset(r, c, scols)
        tile = (r // 128) * 3 + c // 4
        assert off == tile * 512 + (r % 128 % 32) * 16 + (r % 128 // 32) * 4 + c % 4
        assert want[off].item() == s2d[r, c].item()
    out = torch.full((swizzled_size(rows, scols),), 0xEE, dtype=torch.uint8)
    swizzle(s2d, out)
    assert_bytes_equal(out, want, "swizzle")
    # the offset function is a bijection onto the padded buffer
    offs = {_C.mxfp8_swizzled_offset(r, c, 8) for r in range(256) for c in range(8)}
    assert offs == set(range(256 * 8))


def test_scale_runs():
    assert _C.mxfp8_scale_runs([(0, 64), (128, 32)], 256) == [(0, 2), (4, 1)]
    assert _C.mxfp8_scale_runs([(64, 40)], 104) == [(2, 2)]      # partial final block
    assert _C.mxfp8_scale_runs([(0, 32), (32, 32)], 64) == [(0, 2)]  # merged
    assert "boundary" in _C.mxfp8_scale_runs([(16, 32)], 64)
    assert "whole" in _C.mxfp8_scale_runs([(0, 48)], 96)
    assert "whole" in _C.mxfp8_scale_runs([(64, 40), (0, 32)], 104)  # partial block not last


def test_torchao_reference():
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    to_mx = getattr(mx, "to_mx", None)
    if to_mx is None:
        pytest.skip("torchao without to_mx")
    try:  # the enum moved between torchao releases
        from torchao.prototype.mx_formats.config import ScaleCalculationMode  # type: ignore
    except ImportError:
        from torchao.prototype.mx_formats.constants import ScaleCalculationMode  # type: ignore

    x = make_case("normal", rows=64, cols=256, seed=11)
    for rounding, mode in (("floor", "FLOOR"), ("ceil", "RCEIL")):
        if not hasattr(ScaleCalculationMode, mode):
            continue
        try:
            scale, data = to_mx(x, torch.float8_e4m3fn, 32, getattr(ScaleCalculationMode, mode))
        except Exception as e:  # API drift across torchao versions
            pytest.skip(f"torchao to_mx signature: {e}")
        got_d, got_s = kernel(x, rounding, "2d")
        assert_bytes_equal(got_s, scale.view(torch.uint8), f"torchao scale {mode}")
        assert_bytes_equal(got_d, data.view(torch.uint8), f"torchao data {mode}")


# ---- GPU ---------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("scale_layout", LAYOUTS)
def test_cuda_kernel_matches_cpu_twin(rounding, scale_layout):
    for case in CASES:
        for shape in [(130, 288), (257, 1024), (3, 80), (1, 8), (5, 40)]:
            x = make_case(case, rows=shape[0], cols=shape[1], seed=5)
            want_d, want_s = kernel(x, rounding, scale_layout)
            got_d, got_s = kernel(x.cuda(), rounding, scale_layout)
            assert_bytes_equal(got_d, want_d, f"cuda data {case} {shape}")
            assert_bytes_equal(got_s, want_s, f"cuda scale {case} {shape}")
    # unaligned source (scalar loads) and a strided view
    big = make_case("wide", rows=64, cols=1 + 512, seed=9).cuda()
    for x in (big[:, 1:], big[:, 1:257]):
        want_d, want_s = ref_mxfp8(x.cpu().contiguous(), rounding, scale_layout)
        got_d, got_s = kernel(x, rounding, scale_layout)
        assert_bytes_equal(got_d, want_d, "cuda unaligned data")
        assert_bytes_equal(got_s, want_s, "cuda unaligned scale")
    # large: many grid-stride iterations
    x = make_case("bits", rows=4096, cols=4096, seed=1)
    want_d, want_s = kernel(x, rounding, scale_layout)
    got_d, got_s = kernel(x.cuda(), rounding, scale_layout)
    assert_bytes_equal(got_d, want_d, "cuda large data")
    assert_bytes_equal(got_s, want_s, "cuda large scale")


@needs_cuda
def test_cuda_swizzle():
    s2d = torch.randint(0, 255, (300, 13), dtype=torch.uint8)
    out = torch.full((swizzled_size(300, 13),), 0xEE, dtype=torch.uint8, device="cuda")
    swizzle(s2d.cuda(), out)
    assert_bytes_equal(out, ref_swizzle(s2d), "cuda swizzle")
