"""The codec table (csrc/kernels/codecs/registry.h) and the planner's per-tensor cut grain
that a codec's transform asks for (Transform.last_dim_grain)."""
from __future__ import annotations

import sys

import pytest
import torch
from _dist import run_ranks

import reshard_ext as rx
from reshard_ext import _C, Layout, Mesh, Replicate, Shard, codecs, planning
from reshard_ext.codecs.mxfp8 import BLOCK, GRAIN
from reshard_ext.mxfp8 import DATA_SUFFIX, MXFP8, SCALE_SUFFIX, data_layout, scale_layout
from reshard_ext.transforms import Transform

BF16 = torch.bfloat16


def test_codec_table():
    ids = [t.id for t in codecs.TRAITS.values()]
    assert len(ids) == len(set(ids)) and _C.BOX_COPY not in ids
    data, scales = codecs.traits("mxfp8"), codecs.traits("mxfp8_scales")
    assert (data.id, scales.id) == (_C.BOX_MX_DATA, _C.BOX_MX_SCALE)
    assert data.grain == data.item_elems == BLOCK == GRAIN and data.item_bytes == 2 * BLOCK and data.digest
    assert scales.grain == scales.item_elems == 1 and not scales.digest
    # The receiver digest's codec id is the data codec's (RX_DIGEST_CODEC | id << 16).
    assert _C.DIGEST_MX == _C.DIGEST_CODEC | data.id << 16


def _last_dim_cuts(plan, dst_t, name: str) -> set[tuple[int, int]]:
    """(start, size) along the last dim of every send and receive of `name`."""
    c = plan._c
    return {(op.global_start[-1], op.size[-1]) for ops in (c.sends(), c.recvs())
            for op in ops if dst_t.name(op.dst_name) == name}


def _tables(world_layouts):
    src = {n: s for n, (s, _) in world_layouts.items()}
    dst = {n: d for n, (_, d) in world_layouts.items()}
    return src, dst, planning._table(dst)


def _moves():
    # Rows of 1024 elements moved from rank 0 to rank 1: a small batch bound cuts the rows.
    lay = {n: (Layout((4, 1024), BF16, Mesh([0]), [Replicate()]), Layout((4, 1024), BF16, Mesh([1]), [Replicate()]))
           for n in ("w", "v")}
    return _tables(lay)


@pytest.mark.parametrize("rank", [0, 1])
def test_cut_grain_per_tensor(rank):
    src, dst, dst_t = _moves()
    plain = planning.local_plan(src, dst, rank, max_batch_bytes=400)
    coarse = planning.local_plan(src, dst, rank, max_batch_bytes=400, grains={"w": 128})
    for name in ("w", "v"):
        cuts = _last_dim_cuts(plain, dst_t, name)
        assert len(cuts) > 1 and all(s % _C.PLAIN_GRAIN == 0 and n % _C.PLAIN_GRAIN == 0 for s, n in cuts)
        assert any(s % 128 or n % 128 for s, n in cuts)  # the plain grain alone cuts finer than 128
    w = _last_dim_cuts(coarse, dst_t, "w")
    assert len(w) > 1 and all(s % 128 == 0 and n % 128 == 0 for s, n in w)
    assert _last_dim_cuts(coarse, dst_t, "v") == _last_dim_cuts(plain, dst_t, "v")  # other tensors: plain cuts


def test_cut_grain_checked():
    src, dst, _ = _moves()
    with pytest.raises(rx.ReshardError, match="cut grain"):
        planning.local_plan(src, dst, 0, max_batch_bytes=400, grains={"w": 0})


def test_mxfp8_grain_by_name():
    receiver, sender = MXFP8(["w"]), MXFP8(["w"], where="sender")
    assert receiver.last_dim_grain("w") == GRAIN and receiver.last_dim_grain("v") is None
    assert sender.last_dim_grain("w" + DATA_SUFFIX) == GRAIN
    assert sender.last_dim_grain("w" + SCALE_SUFFIX) is None  # a scale is a whole block already
    assert sender.last_dim_grain("w") is None and sender.last_dim_grain("v" + DATA_SUFFIX) is None
    assert Transform().last_dim_grain("w") is None


@pytest.mark.parametrize("where", ["receiver", "sender"])
def test_mxfp8_plans_unchanged_by_grains(where):
    """The MXFP8 grain is the plain one: planning an MXFP8 refit with the transform's
    grains gives the very ops, batches and digests it gave before grains existed."""
    sys.path.insert(0, "tests")
    from test_mxfp8_refit import cases

    specs = cases(4, where)
    transform = MXFP8(sorted(specs), where=where)
    src, dst = {}, {}
    for n, (sl, dl) in specs.items():
        if where == "receiver":
            src[n], dst[n] = sl, dl.with_dtype(BF16)
        else:
            src[n + DATA_SUFFIX], dst[n + DATA_SUFFIX] = data_layout(sl), data_layout(dl)
            src[n + SCALE_SUFFIX], dst[n + SCALE_SUFFIX] = scale_layout(n, sl), scale_layout(n, dl)
    grains = {n: g for n in dst if (g := transform.last_dim_grain(n)) is not None}
    assert grains
    for rank in range(4):
        for limit, batches in ((1000, 3), (4096, 5), (1 << 20, None)):
            a = planning.local_plan(src, dst, rank, limit, batches)._c
            b = planning.local_plan(src, dst, rank, limit, batches, grains=grains)._c
            assert (a.sends(), a.recvs(), a.copies(), a.digests()) == (b.sends(), b.recvs(), b.copies(), b.digests())


class _Coarse(Transform):
    """Rewrites nothing; asks a 128-element cut grain for "w" (as a blockwise codec would)."""

    def last_dim_grain(self, name: str) -> int | None:
        return 128 if name == "w" else None


class _FailsOnRankOne(Transform):
    def last_dim_grain(self, name: str) -> int | None:
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError("no grain here")
        return None


def _entries(rank: int):
    lay_src = Layout((4, 1024), BF16, Mesh([0]), [Replicate()])
    lay_dst = Layout((4, 1024), BF16, Mesh([1]), [Shard(0)])
    src = {"w": (torch.zeros(4, 1024, dtype=BF16), lay_src)} if rank == 0 else {}
    dst = {"w": (torch.zeros(4, 1024, dtype=BF16), lay_dst)} if rank == 1 else {}
    return src, dst


def _plan_worker(rank: int, world: int) -> set:
    plan = rx.plan(*_entries(rank), transform=_Coarse(), max_batch_bytes=1200)
    rp = plan._agreement.rank_plan
    return {(op.global_start[-1], op.size[-1]) for ops in (rp.sends(), rp.recvs()) for op in ops}


def test_plan_passes_transform_grain():
    """rx.plan cuts a tensor by the grain its transform names, on both ends alike."""
    sent, received = run_ranks(2, _plan_worker)
    assert sent == received and len(sent) > 1
    assert all(s % 128 == 0 and n % 128 == 0 for s, n in sent)


def _failing_worker(rank: int, world: int) -> str:
    try:
        rx.plan(*_entries(rank), transform=_FailsOnRankOne(), max_batch_bytes=1200)
    except rx.ReshardError as e:
        return str(e)
    return ""


def test_grain_failure_on_one_rank_raises_everywhere():
    """A transform's last_dim_grain failing on one rank is a ReshardError on every rank, not a hang."""
    for message in run_ranks(2, _failing_worker):
        assert "rank 1: the transform's last_dim_grain failed" in message and "no grain here" in message
