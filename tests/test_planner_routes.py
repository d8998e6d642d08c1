"""The planner's choice of source replica, computed once per pair of meshes (the route
cache), and its batch cut floor: the same plans whatever objects the layouts share."""
from __future__ import annotations

import torch

from reshard_ext import _C
from reshard_ext import layout as layout_module
from reshard_ext.layout import Layout, Mesh, Replicate, Shard


def _table(entries: dict) -> _C.LayoutTable:
    return _C.LayoutTable(list(entries.items()))


def _plan_dump(src: dict, dst: dict, world: int, mbb: int = 0) -> list:
    st, dt = _table(src), _table(dst)
    out = []
    for rank in range(world):
        p = _C.plan_rank(st, dt, rank, mbb)
        p.assign_batches(max(1, p.wanted_batches()))
        out.append((p.sends(), p.recvs(), p.copies(), p.digests()))
    return out


def _layouts(shared: bool) -> tuple[dict, dict]:
    """Tensors on the same meshes with different placements: one mesh object for all of
    them, or a fresh one per tensor (the Python layer interns meshes; clearing its cache
    makes each layout build its own)."""
    r, s0, s1 = Replicate(), Shard(0), Shard(1)
    src, dst = {}, {}
    for i in range(6):
        if not shared:
            layout_module._cpp_mesh.cache_clear()
        src[f"t{i}"] = Layout((8, 12), torch.float32, Mesh.arange(2, 2),
                              [[r, s0], [r, r], [s0, s1], [r, s1], [s0, r], [r, r]][i])._c
        dst[f"t{i}"] = Layout((8, 12), torch.float32, Mesh.arange(3, 2, start=1), [[r, s0], [r, r], [s1, r]][i % 3])._c
    return src, dst


def test_plans_do_not_depend_on_shared_mesh_objects():
    shared, fresh = _layouts(shared=True), _layouts(shared=False)
    assert shared[0]["t0"].describe() == fresh[0]["t0"].describe()
    a = _plan_dump(*shared, world=7)
    b = _plan_dump(*fresh, world=7)
    assert a == b
    assert any(s or r for s, r, _, _ in a)


def test_fewer_receivers_than_holders_spread_by_name():
    """Three holders (ranks 0-2) and five replicas (ranks 0-4): the two replicas outside
    the holders take each tensor from a holder chosen by the tensor's name, so over many
    tensors every holder serves them."""
    src_mesh, dst_mesh = Mesh([0, 1, 2]), Mesh([0, 1, 2, 3, 4])
    src = {f"w{i}": Layout((4, 4), torch.float32, src_mesh, [Replicate()])._c for i in range(24)}
    dst = {f"w{i}": Layout((4, 4), torch.float32, dst_mesh, [Replicate()])._c for i in range(24)}
    served: dict[int, set] = {}
    for rank, (sends, _, copies, _) in enumerate(_plan_dump(src, dst, 5)):
        served[rank] = {op.peer for op in sends}
        if rank < 3:
            assert len(copies) == 24  # a holder copies its own replica
    assert all(served[h] & {3, 4} for h in range(3)), served
    assert not served[3] and not served[4]


def test_small_pairs_are_not_cut_into_many_boxes():
    """With many batches, a big pair is cut near its per-batch share, but a pair of a few
    KB stays whole (no cut below 1 MiB or max_batch_bytes / 8)."""
    big_src = Layout((4096, 1024), torch.float32, Mesh([0]), [Replicate()])._c  # 16 MiB
    big_dst = Layout((4096, 1024), torch.float32, Mesh([1]), [Replicate()])._c
    small_src = Layout((64, 16), torch.float32, Mesh([0]), [Replicate()])._c  # 4 KiB
    small_dst = Layout((64, 16), torch.float32, Mesh([2]), [Replicate()])._c
    st, dt = _table({"big": big_src, "small": small_src}), _table({"big": big_dst, "small": small_dst})
    p = _C.plan_rank(st, dt, 0, 1 << 20)
    k = p.wanted_batches()
    assert k >= 16
    p.assign_batches(k)
    per_peer: dict[int, int] = {}
    for op in p.sends():
        per_peer[op.peer] = per_peer.get(op.peer, 0) + 1
    assert per_peer[2] == 1
    assert per_peer[1] >= k
