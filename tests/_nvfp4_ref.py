"""torchao's NVFP4 reference (torchao 0.18, a [test] extra), as the tests compare with it:
NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(max |x|)) on the CPU,
over the whole logical tensor flattened to [M, K] (its 2-D path; for 3-D inputs with
2-D scales the bytes are the same, test_nvfp4_kernels checks it), and input cases."""
from __future__ import annotations

import logging
import zlib

import pytest
import torch

_logging = logging.getLogger("torchao")
_logging.setLevel(logging.ERROR)  # its optional CUDA extensions fail to load on CPU machines
_nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor", reason="the NVFP4 reference is torchao's")
NVFP4Tensor, per_tensor_amax_to_scale = _nv.NVFP4Tensor, _nv.per_tensor_amax_to_scale


def ref_nvfp4(x: torch.Tensor, layout: str = "2d") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data [M, K/2] uint8, scale uint8 ([M, K/16] or the flat swizzled buffer), the
    per-tensor scale as one int32 of its bits) of the whole BF16 tensor x [..., K]."""
    x = x.cpu().reshape(-1, x.shape[-1])
    pts = per_tensor_amax_to_scale(torch.max(torch.abs(x)))
    t = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts, is_swizzled_scales=layout == "swizzled")
    scale = t.scale.view(torch.uint8)
    scale = scale.reshape(-1) if layout == "swizzled" else scale
    return t.qdata.view(torch.uint8), scale, pts.view(torch.int32).view(1)


CASES = ["normal", "wide", "bits", "tiny", "zero_blocks", "inf", "nan", "all_zero", "huge"]


def make_case(kind: str, shape: tuple[int, ...], seed: int | str = 0) -> torch.Tensor:
    """A BF16 tensor of `shape` ([..., K], K a multiple of 16) of one kind:
    normal: N(0, 1); wide: rows scaled over 2^-30..2^30; bits: random finite bit
    patterns (subnormals, every exponent); tiny: around 2^-128 (the per-tensor scale
    and block scales go subnormal); zero_blocks: whole blocks of +0 and of -0.0 among
    normal values; inf: +-Inf in a few blocks; nan: a NaN (every block becomes NaN);
    all_zero: +0 and -0 only; huge: near the BF16 maximum with a tiny block."""
    if isinstance(seed, str):
        seed = zlib.crc32(seed.encode()) % 100003
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    rows = n // shape[-1]
    x = torch.randn(n, generator=g)
    if kind == "wide":
        x = (x.view(rows, -1) * torch.exp2(torch.randint(-30, 31, (rows, 1), generator=g).float())).view(-1)
    elif kind == "bits":
        b = torch.randint(0, 1 << 16, (n,), generator=g, dtype=torch.int32)
        b = torch.where((b & 0x7F80) == 0x7F80, b & 0xBFFF, b)  # no Inf/NaN exponent
        return b.to(torch.int16).view(torch.bfloat16).view(shape)
    elif kind == "tiny":
        x = x * 2.0 ** -128
    elif kind == "huge":
        x = x * 1e38
    x = x.to(torch.bfloat16)
    blocks = x.view(-1, 16)
    pick = torch.randint(0, blocks.shape[0], (4,), generator=g)
    if kind == "zero_blocks":
        blocks[pick[:2]] = 0.0
        blocks[pick[2:]] = -0.0
        blocks[pick[3], 5] = 1.0  # a block of -0 but one value
    elif kind == "inf":
        blocks[pick[0], 3] = float("inf")
        blocks[pick[1], 0] = -float("inf")
    elif kind == "nan":
        blocks[pick[0], 7] = float("nan")
    elif kind == "all_zero":
        x.zero_()
        x.view(-1)[torch.randint(0, n, (n // 3,), generator=g)] = -0.0
    elif kind == "huge":
        blocks[pick[0]] = 1e-30
    return x.view(shape)
