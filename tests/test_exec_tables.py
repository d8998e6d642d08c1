"""ExecTables pieces the transports rely on, checked without a process group."""
import pickle

import numpy as np
import pytest
import torch
from _boxes import BOX

import reshard_ext as rx
from reshard_ext import _C, Layout, Mesh, Replicate
from reshard_ext.layout import code_of, dtype_of


def _boxes(table) -> list[bytes]:
    """One bytes record per rx_box of a _C.BoxTable (comparable for equality)."""
    blob = bytes(table)
    assert len(blob) == len(table) * BOX.itemsize
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
        return [_C.TensorRef(tensors[names[i]].data_ptr(), tensors[names[i]].stride(), code_of(torch.float32))
                for i in used]

    staging = torch.empty(16, dtype=torch.uint8)  # unused: nothing travels
    bound = refs(src, tables.src_used), refs(dst, tables.dst_used)
    tables.bind(*bound, [staging.data_ptr()], [staging.data_ptr()])
    assert bound == (refs(src, tables.src_used), refs(dst, tables.dst_used))  # bind copies, never moves from them
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
    src = [_C.TensorRef(x.data_ptr(), x.stride(), code_of(torch.bfloat16))]
    dst = [_C.TensorRef(data.data_ptr(), data.stride(), code_of(torch.uint8), codec=codec(int(_C.BOX_MX_DATA), "floor"),
                        side=scale.data_ptr(), arg=64)]
    tables.bind(src, dst, [staging.data_ptr()], [staging.data_ptr()])
    tables.run_copies_cpu()
    assert torch.equal(data, want_data) and torch.equal(scale, want_scale)

    tables, staging = _codec_tables((4, 2), torch.uint8)
    got = torch.zeros(4, 2, dtype=torch.uint8)
    src = [_C.TensorRef(x.data_ptr(), x.stride(), code_of(torch.bfloat16), codec=codec(int(_C.BOX_MX_SCALE), "floor"),
                        grain=int(_C.MX_BLOCK))]
    tables.bind(src, [_C.TensorRef(got.data_ptr(), got.stride(), code_of(torch.uint8))], [staging.data_ptr()],
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
    src = [_C.TensorRef(x.data_ptr(), x.stride(), code_of(torch.bfloat16))]
    dst = [_C.TensorRef(data.data_ptr(), data.stride(), code_of(torch.uint8), codec=codec(int(_C.BOX_MX_DATA), "ceil"),
                        side=scale.data_ptr(), arg=48)]
    with pytest.raises(_C.InternalError, match="bad box for codec"):
        tables.bind(src, dst, [staging.data_ptr()], [staging.data_ptr()])
    assert not data.any() and not scale.any()


def test_tensor_ref_fields_repr_eq_and_pickle():
    """A TensorRef keeps what it was given, compares by value, survives pickling (the direct
    transport sends receivers' refs to their senders) and replace() makes a checked copy."""
    ref = _C.TensorRef(0x1000, (8, 1), code_of(torch.bfloat16), codec=3, side=0x2000, arg=8, grain=2,
                       shape=torch.Size([4, 8]), name="w")
    assert (ref.ptr, ref.strides, ref.dtype, ref.codec, ref.side, ref.arg, ref.grain, ref.shape, ref.name) == \
        (0x1000, [8, 1], code_of(torch.bfloat16), 3, 0x2000, 8, 2, [4, 8], "w")
    assert repr(ref) == "TensorRef(0x1000, [8, 1], 6 (bfloat16), codec=0x3, side=0x2000, arg=8, grain=2, " \
                        "shape=[4, 8], name='w')"
    assert pickle.loads(pickle.dumps(ref)) == ref
    moved = ref.replace(ptr=0x5000, side=0x6000)
    assert (moved.ptr, moved.side) == (0x5000, 0x6000) and moved != ref
    assert moved.replace(ptr=0x1000, side=0x2000) == ref
    plain = _C.TensorRef(ptr=16, strides=[], dtype=code_of(torch.float32))
    assert (plain.codec, plain.side, plain.arg, plain.grain, plain.shape, plain.name) == (0, 0, 0, 1, [], "")
    assert repr(plain) == "TensorRef(0x10, [], 7 (float32))"
    assert _C.PeerPiece(2, 5, ref).ref == ref
    many = _C.TensorRef.many([16, 32], [(), (1,)], [7, 6], [(), (3,)], ["a", "b"])
    assert many == [_C.TensorRef(16, [], 7, [], "a"), _C.TensorRef(32, [1], 6, [3], "b")]
    m = _C.Message(1, 0x40, 8)
    assert (m.peer, m.ptr, m.bytes, m.own) == (1, 0x40, 8, False) and m == _C.Message(1, 0x40, 8)
    assert m != _C.Message(1, 0x40, 8, own=True) and repr(m) == "Message(peer=1, ptr=0x40, bytes=8)"


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype=99), "TensorRef of 'w': unknown dtype code 99"),
    (dict(dtype=-1), "unknown dtype code -1"),
    (dict(strides=[1]), "TensorRef of 'w': 1 strides for a shape of 2 dims"),
    (dict(shape=[4, -1]), "negative extent -1"),
    (dict(codec=3, grain=0), "grain must be >= 1, got 0"),
    (dict(grain=32), "side, arg and grain are a codec's fields, but codec is 0"),
    (dict(side=0x100), "codec's fields"),
])
def test_tensor_ref_rejects_bad_fields(kwargs, match):
    fields = dict(ptr=0x1000, strides=[8, 1], dtype=code_of(torch.float32), shape=[4, 8], name="w") | kwargs
    with pytest.raises(rx.ReshardError, match=match):
        _C.TensorRef(**fields)


def test_tensor_refs_made_many_at_once_are_checked():
    with pytest.raises(rx.ReshardError, match="TensorRef of 'b': unknown dtype code 16"):
        _C.TensorRef.many([16, 32], [(), ()], [7, 16], [(), ()], ["a", "b"])
    with pytest.raises(rx.ReshardError, match="TensorRef of 'a': 2 strides for a shape of 1 dims"):
        _C.TensorRef.many([16], [(1, 1)], [7], [(3,)], ["a"])
    with pytest.raises(_C.InternalError, match="different lengths"):
        _C.TensorRef.many([16], [()], [7], [()], [])


def test_tensor_ref_copies_are_checked_and_tuples_refused():
    good = _C.TensorRef(0x1000, [8, 1], code_of(torch.float32), shape=[4, 8], name="w")
    with pytest.raises(rx.ReshardError, match="2 strides for a shape of 1 dims"):
        good.replace(shape=[4])
    with pytest.raises(rx.ReshardError, match="codec's fields"):
        good.replace(side=0x100)
    state = good.__getstate__()
    with pytest.raises(rx.ReshardError, match="grain must be >= 1"):
        _C.TensorRef.__new__(_C.TensorRef).__setstate__(state[:3] + (1, 0, 0, 0) + state[7:])
    tables, staging = _codec_tables((4, 8), torch.float32)
    x = torch.zeros(4, 8)
    with pytest.raises(TypeError):  # the tuple form is gone
        tables.bind([(x.data_ptr(), list(x.stride()), code_of(x.dtype))], [_C.TensorRef(x.data_ptr(), x.stride(), 7)],
                    [staging.data_ptr()], [staging.data_ptr()])


def test_receiver_codec_fields_and_checks():
    from reshard_ext.codecs.mxfp8 import BLOCK, ROUNDINGS, receiver_digest

    rc = receiver_digest("floor")
    want = (int(_C.DIGEST_MX) | ROUNDINGS["floor"] << 8, BLOCK, code_of(torch.bfloat16))
    assert (rc.digest, rc.grain, rc.dtype) == want
    assert rc == _C.ReceiverCodec(rc.digest, BLOCK, rc.dtype) != receiver_digest("ceil")
    with pytest.raises(rx.ReshardError, match="grain must be >= 1, got 0"):
        _C.ReceiverCodec(rc.digest, 0, rc.dtype)
    with pytest.raises(rx.ReshardError, match="unknown dtype code 42"):
        _C.ReceiverCodec(rc.digest, BLOCK, 42)


def test_a_piece_must_bind_as_a_tensor_ref():
    from reshard_ext.execution import _refs
    from reshard_ext.transforms import Piece

    class OldStyle(Piece):
        def ref(self, whole):
            return (0x1000, [1], code_of(torch.float32))

    with pytest.raises(rx.ReshardError, match="tensor 'w': OldStyle.ref returned a tuple, not a _C.TensorRef"):
        _refs(["w"], {"w": (OldStyle((4,), torch.float32, torch.device("cpu")), None)})
