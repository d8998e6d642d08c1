"""Shard(dim, sizes=...): an uneven contiguous split (an inference engine's padded
vocabulary), with its pieces, its errors, and a real refit into it."""
from __future__ import annotations

import pytest
import torch
from _cases import bits_equal
from _dist import run_ranks

import reshard_ext as rx
from reshard_ext import Layout, Mesh, Replicate, Shard

F32 = torch.float32


def test_pieces_follow_the_sizes_in_mesh_order():
    layout = Layout((40, 3), F32, Mesh([[0, 1, 2, 3], [4, 5, 6, 7]]), [Replicate(), Shard(0, sizes=(16, 16, 8, 0))])
    assert layout.error == ""
    assert [layout.runs(r)[0] for r in range(4)] == [[(0, 16)], [(16, 16)], [(32, 8)], []]
    assert layout.runs(6) == layout.runs(2) and layout.local_shape(7) == (0, 3)
    g = torch.arange(120.0).reshape(40, 3)
    assert bits_equal(layout.local_part(g, 2), g[32:40])
    assert repr(layout.placements[1]) == "Shard(0, sizes=(16, 16, 8, 0))"


def test_sizes_nest_under_an_earlier_split():
    # Each half of dim 1 (a mesh dim of 2) is split unevenly by the next mesh dim.
    layout = Layout((2, 10), F32, Mesh([[0, 1], [2, 3]]), [Shard(1), Shard(1, sizes=(4, 1))])
    assert [layout.runs(r)[1] for r in range(4)] == [[(0, 4)], [(4, 1)], [(5, 4)], [(9, 1)]]


@pytest.mark.parametrize("placement, message", [
    (Shard(0, sizes=(6, 3)), "shard sizes sum to 9 but dim 0 has length 8"),
    (Shard(0, sizes=(8,)), "gives 1 sizes for a mesh dim of 2"),
    (Shard(0, sizes=(9, -1)), "negative shard size -1"),
    (Shard(0, stride=2, sizes=(4, 4)), "cannot be combined with stride or blocks"),
])
def test_invalid_sizes_say_why(placement, message):
    assert message in Layout((8, 4), F32, Mesh([0, 1]), [placement]).error


def test_sizes_must_be_integers():
    with pytest.raises(rx.ReshardError, match="sizes must be a sequence of integers"):
        Shard(0, sizes=(1.5, 2))


def _refit_into_sizes(rank: int, world: int) -> bool:
    g = torch.arange(1000 * 4, dtype=F32).reshape(1000, 4)
    src_l = Layout(g.shape, F32, Mesh([0, 1]), [Shard(1)])
    dst_l = Layout(g.shape, F32, Mesh([1, 0, 2]), [Shard(0, sizes=(512, 488, 0))])
    dst = torch.full(dst_l.local_shape(rank), -1.0)
    rx.execute(rx.plan({"e": (src_l.local_part(g, rank), src_l)} if rank in src_l.mesh else {},
                       {"e": (dst, dst_l)}))
    return bits_equal(dst, dst_l.local_part(g, rank))


def test_refit_into_an_uneven_split():
    assert all(run_ranks(3, _refit_into_sizes))
