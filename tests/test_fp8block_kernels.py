"""Blockwise FP8 kernels (csrc/kernels/codecs/fp8block*, the C++ twin) against references
written here in torch: DeepSeek-V3's / DeepGEMM's per_block_cast_to_fp8 (scales="fp32") and
Transformer Engine's power-of-two rule (scales="pow2"), byte for byte, over partial blocks,
BF16 and FP32 sources, NaN / Inf / -0.0 / all-zero / tiny / subnormal / huge blocks."""
from __future__ import annotations

import math

import pytest
import torch

import reshard_ext as rx
from reshard_ext import Layout, Mesh, Replicate
from reshard_ext.codecs.amax import AmaxPiece
from reshard_ext.codecs.fp8block import BlockScales, block_of, scale_shape

BF16, F32 = torch.bfloat16, torch.float32
E4M3 = torch.float8_e4m3fn


def _padded_blocks(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    m, n = x.shape
    pm, pn = -(-m // 128) * 128, -(-n // 128) * 128
    padded = torch.zeros((pm, pn), dtype=x.dtype)
    padded[:m, :n] = x
    return padded.view(pm // 128, 128, pn // 128, 128), m, n


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """torch's float8_e4m3fn cast, saturating: torch 2.13 saturates Inf and overflow to 448
    itself, older versions (2.11) make them NaN; both keep NaN's sign."""
    return x.float().clamp(-448.0, 448.0).to(E4M3)


def ref_deepseek_2d(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's per_block_cast_to_fp8 (DeepSeek-V3's weight format), as it is written."""
    x_view, m, n = _padded_blocks(x)
    x_amax = x_view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    x_scaled = to_e4m3(x_view * (448.0 / x_amax))
    data = x_scaled.reshape(x_view.size(0) * 128, -1)[:m, :n].contiguous()
    return data.view(torch.uint8), (x_amax / 448.0).view(x_view.size(0), x_view.size(2))


def ref_te_pow2_2d(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformer Engine's blockwise FP8 with its default power-of-two scales (amax epsilon
    0), from its rule: amax by fmaxf (NaN ignored); scale = 1 for amax 0 or Inf, else
    448 / amax (true division), the input type's max where that overflows, truncated to its
    exponent bits; scale_inv = 1 / scale; data = E4M3(x * scale), NaN as 0x7f."""
    x_view, m, n = _padded_blocks(x)
    a = x_view.float().abs()
    amax = torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(dim=(1, 3), keepdim=True)
    scale = torch.div(torch.full_like(amax, 448.0), amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(x.dtype).max), scale)
    scale = (scale.view(torch.int32) & -(1 << 23)).view(F32)  # 0xFF800000: sign and exponent
    scale = torch.where((amax == 0) | torch.isinf(amax), torch.ones_like(scale), scale)
    scale_inv = torch.div(torch.ones_like(scale), scale)
    q = to_e4m3(x_view.float() * scale).view(torch.uint8)
    q = torch.where(torch.isnan(x_view.float()), torch.full_like(q, 0x7F), q)
    data = q.reshape(x_view.size(0) * 128, -1)[:m, :n].contiguous()
    return data, scale_inv.view(x_view.size(0), x_view.size(2))


def ref_fp8block(x: torch.Tensor, scales: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(data uint8, scale_inv float32) of a tensor of 2+ dims: blocks over the last two dims,
    each leading index on its own (vLLM's stacked experts)."""
    fn = ref_deepseek_2d if scales == "fp32" else ref_te_pow2_2d
    lead = x.shape[:-2]
    flat = x.reshape(-1, *x.shape[-2:])
    outs = [fn(flat[i]) for i in range(flat.shape[0])]
    data = torch.stack([d for d, _ in outs]).reshape(x.shape)
    scale = torch.stack([s for _, s in outs]).reshape(scale_shape(tuple(x.shape)))
    assert scale.shape[:-2] == lead
    return data, scale


def _bits(values, dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).to(torch.int16 if dtype == BF16 else torch.int32).view(dtype)


def special_case(shape, dtype, seed: int) -> torch.Tensor:
    """Random blocks of varied magnitudes, and special ones, in this order over the first
    leading index's blocks (as many as there are): all zero (with a -0.0), NaN (+ and -),
    Inf (+ and -, with -0.0 and negatives), tiny (below the 1e-4 clamp); a subnormal block
    in the second leading index, a huge row in the last, and values on rounding ties."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape[-2], shape[-1]
    x = torch.randn(shape, generator=g)
    scale = torch.exp2(torch.randint(-20, 20, (math.prod(shape[:-2]) or 1, -(-rows // 128), -(-cols // 128)),
                                     generator=g).float())
    scale = scale.repeat_interleave(128, 1)[:, :rows].repeat_interleave(128, 2)[:, :, :cols].reshape(shape)
    x = (x * scale).to(dtype)
    flat = x.reshape(-1, rows, cols)
    first = flat[0]
    blocks = [first[i:i + 128, j:j + 128] for i in range(0, rows, 128) for j in range(0, cols, 128)]
    nan_neg = torch.tensor([-float("nan")]).to(dtype) if dtype == F32 else _bits([0xFFC0], BF16)
    for kind, b in zip(("zero", "nan", "inf", "tiny"), blocks if len(blocks) > 1 else []):
        r, c = b.shape
        if kind == "zero":
            b.zero_()
            b[r // 2, c // 2] = -0.0
        elif kind == "nan":
            b[r // 3, c // 3] = float("nan")
            b[-1, -1] = nan_neg[0]
        elif kind == "inf":
            b[0, 0] = float("inf")
            b[r // 2, c - 1] = -float("inf")
            b[r - 1, 0] = -0.0
        else:
            b.copy_(torch.randn(b.shape, generator=g).to(dtype) * 1e-6)
    if flat.shape[0] > 1 and rows >= 128 and cols >= 128:
        sub = torch.randn(128, 128, generator=g) * (1e-39 if dtype == F32 else 1e-38)  # subnormal
        flat[1][:128, :128] = sub.to(dtype)
        flat[-1][-1, :] = torch.finfo(dtype).max / 2  # huge
    if cols > 384 and rows >= 2:
        # ties: 448 / amax = 1 with amax 448: x.5 quanta of E4M3 around 1.0 (1 + 1/16)
        first[:2, 384:386] = torch.tensor([[448.0, 1.0625], [1.1875, -2.125]]).to(dtype)
    return x


def quantize_whole(x: torch.Tensor, scales: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The codec's kernels on one rank's whole tensor (on its device): amax pre-pass, scales,
    quantize; the results on the CPU."""
    layout = Layout(tuple(x.shape), x.dtype, Mesh([0]), [Replicate()])
    amax = AmaxPiece("x", layout, x, 0, block_of(x.dim()), "propagate" if scales == "fp32" else "ignore")
    amax.partial()
    bs = BlockScales(amax, scales)
    bs.update()
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    bs.quantize(data.view(-1))
    return data.cpu(), bs.scale_inv.view(scale_shape(tuple(x.shape))).cpu()


def assert_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    g, w = got.contiguous().view(torch.uint8).flatten(), want.contiguous().view(torch.uint8).flatten()
    assert g.shape == w.shape, (what, g.shape, w.shape)
    bad = (g != w).nonzero().flatten()
    assert bad.numel() == 0, (f"{what}: {bad.numel()} bytes differ, first at {bad[:8].tolist()}: "
                              f"got {g[bad[:8]].tolist()} want {w[bad[:8]].tolist()}")


SHAPES = [(256, 512), (328, 428), (200, 300), (128, 16), (3, 200, 256), (2, 130, 400), (1, 1)]


@pytest.mark.parametrize("scales", ["fp32", "pow2"])
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("shape", SHAPES)
def test_whole_tensor_matches_reference(shape, dtype, scales):
    x = special_case(shape, dtype, seed=sum(shape) + (dtype == F32))
    data, scale = quantize_whole(x, scales)
    want_d, want_s = ref_fp8block(x, scales)
    assert_bytes(scale, want_s, f"scale_inv {shape} {dtype} {scales}")
    assert_bytes(data, want_d, f"data {shape} {dtype} {scales}")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and rx.build_info()["cuda"]),
                    reason="needs a GPU and reshard_ext built with CUDA")
@pytest.mark.parametrize("scales", ["fp32", "pow2"])
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("shape", SHAPES)
def test_whole_tensor_on_cuda_matches_reference(shape, dtype, scales):
    """The CUDA amax, scales and quantize kernels: the CPU reference's bytes."""
    x = special_case(shape, dtype, seed=sum(shape) + (dtype == F32))
    data, scale = quantize_whole(x.cuda(), scales)
    want_d, want_s = ref_fp8block(x, scales)
    assert_bytes(scale, want_s, f"cuda scale_inv {shape} {dtype} {scales}")
    assert_bytes(data, want_d, f"cuda data {shape} {dtype} {scales}")


needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and rx.build_info()["cuda"]),
                                reason="needs a GPU and reshard_ext built with CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_e4m3_cast_of_every_bf16_and_many_fp32(dtype, device):
    """The codec's cast under scale 1 (pow2, an Inf block) against torch's float8_e4m3fn cast:
    every BF16 pattern, 2^20 random FP32 patterns; NaN as 0x7f."""
    if dtype == BF16:
        x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(BF16)
    else:
        g = torch.Generator().manual_seed(5)
        x = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 20,), generator=g, dtype=torch.int64)
        x = x.to(torch.int32).view(F32)
    x = torch.cat([x, torch.tensor([float("inf")], dtype=dtype)])  # the block's amax: Inf, its scale 1
    rows = x.numel() // 128
    x = x[: rows * 128].reshape(rows, 128) if x.numel() % 128 == 0 else torch.cat(
        [x, torch.zeros(128 - x.numel() % 128, dtype=dtype)]).reshape(-1, 128)
    x[:, 0] = float("inf")  # every block (128 rows) holds an Inf: scale 1
    data, scale = quantize_whole(x.to(device), "pow2")
    assert torch.all(scale == 1.0)
    want = to_e4m3(x).view(torch.uint8)
    want = torch.where(torch.isnan(x.float()), torch.full_like(want, 0x7F), want)
    assert_bytes(data, want, f"cast {dtype}")


def varied_blocks(dtype, blocks: int, seed: int) -> torch.Tensor:
    """[128, 128 * blocks]: each block random bit patterns (every mantissa and sign) with
    exponents in a window of 24 below a per-block top, the tops spread over the whole range
    (subnormals to near the max), so the factors cover the FP32 and power-of-two ranges."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 1 << 31, (128, blocks, 128), generator=g, dtype=torch.int64)
    if dtype == BF16:
        top = torch.randint(1, 255, (1, blocks, 1), generator=g)
        exp = (top - torch.randint(0, 24, (128, blocks, 128), generator=g)).clamp(0, 254)
        raw = (bits & 0x807F) | (exp << 7)
        x = raw.to(torch.int32).to(torch.int16).view(BF16)
    else:
        top = torch.randint(1, 255, (1, blocks, 1), generator=g)
        exp = (top - torch.randint(0, 24, (128, blocks, 128), generator=g)).clamp(0, 254)
        raw = (bits & 0x807FFFFF) | (exp << 23)
        x = raw.to(torch.int32).view(F32)
    return x.reshape(128, blocks * 128)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scales", ["fp32", "pow2"])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_cuda_varied_factors_match_cpu_twin(dtype, scales):
    """The CUDA kernels' hardware E4M3 conversion against the CPU twin's integer rounding,
    over 512 blocks whose factors span the ranges, plus unaligned and odd-width views (the
    element-at-a-time path)."""
    x = varied_blocks(dtype, 512, seed=7 + (dtype == F32))
    xc = x.cuda()
    for cut in (slice(None), slice(8, 8 + 128 * 40), slice(3, 3 + 1000), slice(5, None)):
        got_d, got_s = quantize_whole(xc[:100, cut] if cut.start == 5 else xc[:, cut], scales)
        want_d, want_s = quantize_whole(x[:100, cut] if cut.start == 5 else x[:, cut], scales)
        what = f"{dtype} {scales} columns {cut}"
        assert_bytes(got_s, want_s, f"scale_inv {what}")
        assert_bytes(got_d, want_d, f"data {what}")


def test_reference_conventions_differ():
    """The two conventions are not one: a test that used the wrong one would fail."""
    x = special_case((256, 512), BF16, 1)
    d1, s1 = quantize_whole(x, "fp32")
    d2, s2 = quantize_whole(x, "pow2")
    assert not torch.equal(s1, s2) and not torch.equal(d1, d2)
    # DeepSeek's data divides by reciprocal(amax) * 448, not 448 / amax: the rounding is visible
    xs = torch.rand(1 << 16) * 100 + 1e-3
    assert not torch.equal((448.0 / xs).view(torch.int32), torch.div(torch.full_like(xs, 448.0), xs).view(torch.int32))
