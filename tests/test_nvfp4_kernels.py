"""The NVFP4 kernels (whole-piece amax, quantize, per-tensor scale; csrc/kernels/codecs/nvfp4*)
against torchao's reference (tests/_nvfp4_ref.py), byte for byte: the CPU twin here, the
CUDA kernels on a GPU (against the twin and torchao alike)."""
from __future__ import annotations

import pytest
import torch
from _nvfp4_ref import CASES, NVFP4Tensor, make_case, per_tensor_amax_to_scale, ref_nvfp4

import reshard_ext as rx
from reshard_ext import _C
from reshard_ext.codecs import nvfp4 as nv
from reshard_ext.layout import code_of

HAVE_GPU = torch.cuda.is_available() and hasattr(_C, "nvfp4_quantize_cuda")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU")])]
SHAPES = [(1, 16), (3, 48), (130, 64), (257, 320), (2, 5, 96)]


def amax_cell(x: torch.Tensor) -> torch.Tensor:
    """The whole tensor's amax as the pre-pass holds it: one int32 of FP32 bits, computed
    by the amax kernel (csrc/kernels/codecs/amax.h) over a per-tensor grid."""
    x = x.reshape(-1, x.shape[-1])
    cell = torch.zeros(1, dtype=torch.int32, device=x.device)
    zeros = [torch.zeros(n, dtype=torch.int32, device=x.device) for n in x.shape]
    args = (x.data_ptr(), code_of(x.dtype), x.shape[0], x.shape[1], x.stride(0), zeros[0].data_ptr(),
            zeros[1].data_ptr(), int(_C.AMAX_NAN_PROPAGATE), cell.data_ptr())
    if x.is_cuda:
        _C.amax_partial_cuda(*args, torch.cuda.current_stream().cuda_stream)
    else:
        _C.amax_partial_cpu(*args)
    return cell


def quantize(x: torch.Tensor, layout: str, device: str = "cpu", cell: torch.Tensor | None = None):
    """(data, scale, per-tensor scale bits) from the codec's kernels on `device`, into
    poisoned buffers; the amax from the amax kernel unless a cell is given."""
    x = x.to(device)
    if cell is None:
        cell = amax_cell(x.contiguous())
    cell = cell.to(device)
    rows = x.numel() // x.shape[-1]
    data = torch.full((rows, x.shape[-1] // 2), 0xA5, dtype=torch.uint8, device=device)
    scale = torch.full((nv.scale_numel(tuple(x.shape), layout),), 0x5A, dtype=torch.uint8, device=device)
    tscale = torch.full((1,), float("nan"), device=device)
    nv.quantize(x, cell, data, scale, tscale, layout)
    if layout == "2d":
        scale = scale.view(rows, -1)
    return data.cpu(), scale.cpu(), tscale.cpu().view(torch.int32)


def assert_same(got, want, what: str) -> None:
    for g, w, part in zip(got, want, ("data", "scale", "tensor scale")):
        assert g.shape == w.shape, (what, part, g.shape, w.shape)
        bad = (g != w).nonzero()
        assert bad.numel() == 0, (f"{what} {part}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}: "
                                  f"got {g[tuple(bad[0])].item():#x}, want {w[tuple(bad[0])].item():#x}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["2d", "swizzled"])
@pytest.mark.parametrize("kind", CASES)
def test_quantize_matches_torchao(device, layout, kind):
    for shape in SHAPES:
        x = make_case(kind, shape, f"{kind}{shape}")
        assert_same(quantize(x, layout, device), ref_nvfp4(x, layout), f"{kind} {shape} {layout} on {device}")


def test_special_values_as_torchao_has_them():
    """What the reference gives the special tensors, spelled out (the module doc of
    rx.NVFP4 promises these bytes): a NaN anywhere, all zeros, Inf blocks, -0.0."""
    x = make_case("normal", (4, 64), 1)
    x[2, 17] = float("nan")
    d, s, p = ref_nvfp4(x)
    assert (s == 0x7F).all() and (d == 0x33).all() and p.item() == 0x7FC00000
    d, s, p = ref_nvfp4(torch.zeros(2, 32, dtype=torch.bfloat16))
    assert (s == 0xFF).all() and (d == 0xCC).all() and p.item() == 0
    x = make_case("normal", (2, 64), 2)
    x[1, 20] = -float("inf")
    d, s, _ = ref_nvfp4(x)
    assert s[1, 1] == 0xFF and (d[1, 8:16] == 0xCC).all()
    assert (s.view(-1)[[0, 1, 2, 3, 4, 6, 7]] == 0x08).all()
    assert ((d[0] & 0x77) == 0).all()  # +-0 elsewhere
    x = make_case("normal", (1, 32), 3)
    x[0, :16] = -0.0
    d, s, _ = ref_nvfp4(x)
    assert s[0, 0] == 0x08 and (d[0, :8] == 0x88).all()
    for got, want in zip(quantize(x, "2d"), ref_nvfp4(x)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_element_ties_round_to_even_codes(device):
    """Every E2M1 rounding tie hit exactly: a tensor amax of 2688 makes the per-tensor scale
    1, a block amax of 6 its block scale 1, so its elements are their own products. Ties at
    0.25, 1.25, 2.5 and 5 round down to even codes, 0.75, 1.75 and 3.5 up (both signs),
    with neighbours one BF16 step either side, against torchao."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    vals = [6.0] + ties + [-t for t in ties] + [5.5, 6.0]
    below = torch.tensor(ties, dtype=torch.bfloat16).view(torch.int16) - 1
    above = below + 2
    x = torch.zeros(3, 32, dtype=torch.bfloat16)
    x[0, 0] = 2688.0
    x[1] = torch.tensor(vals + [0.0] * (32 - len(vals)), dtype=torch.bfloat16)
    x[2, 0], x[2, 16] = 6.0, 6.0
    x[2, 1:8], x[2, 17:24] = below.view(torch.bfloat16), above.view(torch.bfloat16)
    d, s, p = ref_nvfp4(x)
    assert p.item() == 0x3F800000 and (s[1:] == 0x38).all()  # the scales of the construction: 1.0
    codes = [(int(d[1, i // 2]) >> (4 * (i % 2))) & 0xF for i in range(1, 8)]
    assert codes == [0, 2, 2, 4, 4, 6, 6]  # 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert_same(quantize(x, "2d", device), (d, s, p), f"ties on {device}")


def test_every_bf16_value():
    """All 63,488 finite BF16 values, 16 to a block, in two orders, under per-tensor scales
    from the whole range: every element path (saturation, the 0.25/0.75 ties, subnormals)
    against torchao."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32)
    bits = bits[(bits & 0x7F80) != 0x7F80].to(torch.int16)
    g = torch.Generator().manual_seed(5)
    for order in (bits, bits[torch.randperm(bits.numel(), generator=g)]):
        x = order.view(torch.bfloat16).view(-1, 64)
        assert_same(quantize(x, "2d"), ref_nvfp4(x), "every value")
        for amax in (2.0 ** -100, 1e-3, 1.0, 3.0e4, 3.0e38):  # the same values under other tensor scales
            cell = torch.tensor([amax], dtype=torch.bfloat16).float().view(torch.int32)
            got = quantize(x, "2d", cell=cell)
            pts = per_tensor_amax_to_scale(torch.tensor(amax, dtype=torch.bfloat16))
            t = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts)
            assert_same(got, (t.qdata.view(torch.uint8), t.scale.view(torch.uint8), pts.view(torch.int32).view(1)),
                        f"every value, amax {amax}")


def test_three_dim_reference_is_the_flattened_one():
    """torchao's 3-D path (2-D scales; swizzled with M % 128 == 0) gives the bytes of its
    2-D path over [E * M, K], which is what ref_nvfp4 and the codec quantize."""
    x = make_case("wide", (3, 128, 64), 7)
    pts = per_tensor_amax_to_scale(torch.max(torch.abs(x)))
    for swz in (False, True):
        t = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts, is_swizzled_scales=swz)
        d, s, _ = ref_nvfp4(x, "swizzled" if swz else "2d")
        assert torch.equal(t.qdata.view(torch.uint8).reshape(d.shape), d)
        assert torch.equal(t.scale.view(torch.uint8).reshape(-1), s.reshape(-1))


def test_per_tensor_scale():
    """per_tensor_amax_to_scale's bits, for any NaN payload the amax cell may hold."""
    for amax in (0.0, 1.5, 3.0e38, float("inf"), float("nan"), 2.0 ** -133):
        bits = torch.tensor([amax], dtype=torch.bfloat16).float().view(torch.int32).item()
        want = per_tensor_amax_to_scale(torch.tensor(amax, dtype=torch.bfloat16)).view(torch.int32).item()
        assert _C.nvfp4_tensor_scale_bits(bits) == want, amax
    assert _C.nvfp4_tensor_scale_bits(0x7F812345) == _C.nvfp4_tensor_scale_bits(0x7FC00000) == 0x7FC00000


def test_bad_arguments_are_refused():
    x = make_case("normal", (4, 40), 0)  # K = 40: not whole 16-element blocks
    cell = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(rx.ReshardError, match="multiple of 16"):
        nv.quantize(x, cell, torch.empty(80, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8), None)
    y = make_case("normal", (4, 32), 0)
    with pytest.raises(rx.ReshardError, match="data must be"):
        nv.quantize(y, cell, torch.empty(4 * 32, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8), None)
    with pytest.raises(rx.ReshardError, match="scale must be"):
        nv.quantize(y, cell, torch.empty(64, dtype=torch.uint8), torch.empty(7, dtype=torch.uint8), None)
    with pytest.raises(rx.ReshardError, match="bfloat16"):
        nv.quantize(y.float(), cell, torch.empty(64, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8), None)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU")
def test_cuda_kernel_on_strided_and_large_inputs():
    """Rows with a stride (a column window of a wider tensor: the 16-byte loads off),
    more blocks than one grid covers, and the swizzled padding written as 0."""
    base = make_case("wide", (300, 4096 + 48), 11)
    for x in (base[:, 16:4096 + 16], base[:, :4096].contiguous(), make_case("bits", (4097, 1024), 12)):
        for layout in ("2d", "swizzled"):
            assert_same(quantize(x, layout, "cuda"), quantize(x, layout, "cpu"), f"{tuple(x.shape)} {layout}")
    x = make_case("normal", (64, 256), 13)  # data written off the 8-byte grid: byte stores
    want = quantize(x, "2d")
    cell = amax_cell(x).cuda()
    data = torch.zeros(64 * 128 + 3, dtype=torch.uint8, device="cuda")[3:]
    scale = torch.empty(64 * 16, dtype=torch.uint8, device="cuda")
    nv.quantize(x.cuda(), cell, data, scale, None)
    assert torch.equal(data.cpu().view(64, 128), want[0]) and torch.equal(scale.cpu().view(64, 16), want[1])
