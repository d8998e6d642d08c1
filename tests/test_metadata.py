"""The plan-time metadata blobs: every layout survives encode -> decode exactly, valid or
not (an invalid one must reach every rank to be reported there), and blobs stay small."""
from __future__ import annotations

import random

import torch

from reshard_ext import _C
from reshard_ext.layout import Layout, Mesh, Replicate, Shard
from reshard_ext.planning import reporter_of
from reshard_ext.synthetic import DEEPSEEK_V3, Parallel, model_layouts


def _cases() -> list[tuple[int, str, Layout]]:
    rng = random.Random(0)
    big = Mesh.arange(64, 32)  # 2,048 ranks in progression
    shuffled = list(range(1000))
    rng.shuffle(shuffled)
    layouts = [
        Layout((6, 4), torch.float32, Mesh([[0, 1], [2, 3]]), [Replicate(), Shard(0, blocks=(2, 4))]),
        Layout((4096, 1024), torch.bfloat16, big, [Replicate(), Shard(1)]),
        Layout((8, 12), torch.float16, Mesh([5, 3, 9]), [Shard(1, stride=2)]),
        Layout((), torch.int64, Mesh([7]), [Replicate()]),
        Layout((0, 3), torch.uint8, Mesh(shuffled), [Shard(0)]),
        Layout((2**40, 3), torch.float64, Mesh([1, 2]), [Shard(0)]),
        Layout((10,), torch.float32, Mesh([[0, 1]]), [Shard(0), Shard(0)]),
        Layout((1000, 8), torch.bfloat16, Mesh([[0, 1, 2], [3, 4, 5]]), [Replicate(), Shard(0, sizes=(512, 488, 0))]),
        # invalid: the error must come out the same on the other side
        Layout((5,), torch.float32, Mesh([0, 1]), [Shard(0, stride=2)]),
        Layout((6,), torch.float32, Mesh([0, 1]), [Shard(0, blocks=(1, 2))]),
        Layout((9, 4), torch.float32, Mesh([0, 1]), [Shard(0, sizes=(8, 2))]),
    ]
    names = ["decoder.layers.10.mlp.experts.linear_fc1.weight7", "decoder.layers.10.mlp.experts.linear_fc1.weight71",
             "decoder.layers.1.x", "a", "", "é.ü", "decoder.layers.10.mlp"]
    out = []
    for i, layout in enumerate(layouts):
        out.append((i % 2, names[i % len(names)] + f".{i}", layout))
        out.append((1 - i % 2, names[(i + 3) % len(names)], layout))
    return out


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] == b[1] and a[2].same_as(b[2]) and a[2].error == b[2].error


def test_round_trip():
    entries = _cases()
    blob = _C.encode_entries([(s, n, lay._c) for s, n, lay in entries])
    back = _C.decode_entries([blob])
    assert len(back) == len(entries)
    want = sorted(((s, n, lay._c) for s, n, lay in entries), key=lambda e: (e[1], e[0]))
    got = sorted(back, key=lambda e: (e[1], e[0]))
    assert all(_same(a, b) for a, b in zip(want, got))
    assert any(lay.error for _, _, lay in got) and all(
        a[2].error == b[2].error for a, b in zip(want, got))


def test_several_blobs_share_meshes_and_layouts():
    entries = _cases()
    blobs = [_C.encode_entries([(s, n, lay._c) for s, n, lay in entries[i::3]]) for i in range(3)] + [b""]
    back = _C.decode_entries(blobs)
    assert sorted((s, n) for s, n, _ in back) == sorted((s, n) for s, n, _ in entries)
    by_key = {(s, n): lay for s, n, lay in back}
    for s, n, lay in entries:
        assert by_key[(s, n)].same_as(lay._c)


def test_corrupt_blob_is_an_error():
    blob = _C.encode_entries([(s, n, lay._c) for s, n, lay in _cases()])
    for bad in (blob[:-1], blob[:7], blob + b"\x00", b"XXXX" + blob[4:]):
        try:
            _C.decode_entries([bad])
        except Exception as e:  # noqa: BLE001 - any clear error, never a crash or a silent result
            assert "metadata" in str(e)
        else:
            raise AssertionError("a corrupt blob decoded")


def test_deepseek_blob_sizes():
    """DeepSeek-V3 (30,000 tensors) over 2,048 ranks: the largest blob a rank sends,
    which sets what every rank receives (all_gather_object pads to it)."""
    src = model_layouts(DEEPSEEK_V3, Parallel(pp=16, dp=64, ep=64))
    dst = model_layouts(DEEPSEEK_V3, Parallel(tp=32, dp=32, ep=32, offset=1024))
    per_rank: dict[int, list] = {}
    for side, table in ((0, src), (1, dst)):
        for name, layout in table.items():
            per_rank.setdefault(reporter_of(name, layout), []).append((side, name, layout._c))
    blobs = [_C.encode_entries(v) for v in per_rank.values()]
    back = _C.decode_entries(blobs)
    assert len(back) == len(src) + len(dst)
    assert max(len(b) for b in blobs) < 2500
