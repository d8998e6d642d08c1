"""ExecTables pieces the transports rely on, checked without a process group."""
import numpy as np
import pytest
import torch

import reshard_ext as rx
from reshard_ext import Layout, Mesh, Replicate, _C
from reshard_ext.layout import code_of, dtype_of

from _boxes import BOX


def _boxes(blob: bytes) -> list[bytes]:
    """One bytes record per rx_box (comparable for equality)."""
    assert len(blob) % BOX.itemsize == 0
    return [blob[i : i + BOX.itemsize] for i in range(0, len(blob), BOX.itemsize)]


def _nbytes(record: bytes) -> int:
    box = np.frombuffer(record, dtype=BOX)[0]
    n = torch.empty((), dtype=dtype_of(int(box["dst_dtype"]))).element_size()
    return n * int(np.prod(box["shape"][: int(box["ndim"])]))


def test_copies_split_keeps_order_and_balances_bytes():
    # 40 tensors of mixed sizes, all copied on rank 0 (src and dst both live there).
    sizes = [(i % 7 + 1) * 1000 for i in range(40)]
    mesh = Mesh([0])
    layouts = {f"t{i}": Layout((n,), torch.float32, mesh, [Replicate()]) for i, n in enumerate(sizes)}
    rp = rx.local_plan(layouts, layouts, rank=0)
    tables = _C.ExecTables(rp._c)
    src = {n: torch.randn(s) for n, s in zip(layouts, sizes)}
    dst = {n: torch.empty(s) for n, s in zip(layouts, sizes)}
    names = sorted(layouts)  # the planner's table order

    def refs(tensors, used):
        return [(tensors[names[i]].data_ptr(), list(tensors[names[i]].stride()), code_of(torch.float32)) for i in used]

    staging = torch.empty(16, dtype=torch.uint8)  # unused: nothing travels
    tables.bind(refs(src, tables.src_used), refs(dst, tables.dst_used), [staging.data_ptr()], [staging.data_ptr()])
    whole = _boxes(tables.copy_boxes())
    assert len(whole) == 40
    for parts in (1, 3, 7, 64):
        split = [_boxes(b) for b in tables.copy_boxes_split(parts)]
        assert len(split) == parts
        assert [b for part in split for b in part] == whole  # every box once, in order
        per = [sum(map(_nbytes, part)) for part in split]
        biggest = max(map(_nbytes, whole))
        if parts <= len(whole):
            # a batch's share each (tapered: half shares at the ends from 3 parts on),
            # off by at most one box
            share = [1.0] * parts if parts < 3 else [0.5] + [1.0] * (parts - 2) + [0.5]
            want = [sum(per) * w / sum(share) for w in share]
            assert all(abs(p - w) <= biggest for p, w in zip(per, want)), (per, want)


def _codec_tables(shape, dtype):
    """ExecTables of a rank-0 plan copying one tensor onto itself (one same-rank copy)."""
    layouts = {"w": Layout(shape, dtype, Mesh([0]), [Replicate()])}
    tables = _C.ExecTables(rx.local_plan(layouts, layouts, rank=0)._c)
    return tables, torch.empty(16, dtype=torch.uint8)


def test_codec_refs_bind_params_and_grain():
    """A codec on a TensorRef reaches the kernels through the generic fields alone: a dst
    codec's side buffer, the box's element offset and the ref's argument become the box's
    params (MXFP8: scales where the 2-D layout puts them), and a src grain reads whole
    blocks per coordinate (MXFP8 scales alone). Both equal the whole-tensor quantize."""
    from reshard_ext.codecs.mxfp8 import codec
    from reshard_ext.mxfp8 import quantize

    torch.manual_seed(0)
    x = (torch.randn(4, 64) * 100).to(torch.bfloat16)
    want_data, want_scale = torch.empty(4, 64, dtype=torch.uint8), torch.empty(4, 2, dtype=torch.uint8)
    quantize(x, want_data, want_scale, "2d", "floor")

    tables, staging = _codec_tables((4, 64), torch.bfloat16)
    data, scale = torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)
    src = [(x.data_ptr(), list(x.stride()), code_of(torch.bfloat16))]
    dst = [(data.data_ptr(), list(data.stride()), code_of(torch.uint8), codec(int(_C.BOX_MX_DATA), "floor"),
            scale.data_ptr(), 64, 1)]
    tables.bind(src, dst, [staging.data_ptr()], [staging.data_ptr()])
    tables.run_copies_cpu()
    assert torch.equal(data, want_data) and torch.equal(scale, want_scale)

    tables, staging = _codec_tables((4, 2), torch.uint8)
    got = torch.zeros(4, 2, dtype=torch.uint8)
    src = [(x.data_ptr(), list(x.stride()), code_of(torch.bfloat16), codec(int(_C.BOX_MX_SCALE), "floor"), 0, 0,
            int(_C.MX_BLOCK))]
    tables.bind(src, [(got.data_ptr(), list(got.stride()), code_of(torch.uint8))], [staging.data_ptr()],
                [staging.data_ptr()])
    tables.run_copies_cpu()
    assert torch.equal(got, want_scale)


def test_codec_boxes_are_checked_at_bind():
    """Core builds codec boxes without reading the codec's fields; the codec's checks run
    when the plan binds, before any box is used (here: MXFP8 data rows of 48 elements are
    not whole blocks), and nothing is written."""
    from reshard_ext.codecs.mxfp8 import codec

    tables, staging = _codec_tables((4, 64), torch.bfloat16)
    x = torch.ones(4, 64, dtype=torch.bfloat16)
    data, scale = torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)
    src = [(x.data_ptr(), list(x.stride()), code_of(torch.bfloat16))]
    dst = [(data.data_ptr(), list(data.stride()), code_of(torch.uint8), codec(int(_C.BOX_MX_DATA), "ceil"),
            scale.data_ptr(), 48, 1)]
    with pytest.raises(_C.InternalError, match="bad box for codec"):
        tables.bind(src, dst, [staging.data_ptr()], [staging.data_ptr()])
    assert not data.any() and not scale.any()
