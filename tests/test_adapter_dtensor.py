"""DTensor adapter: layouts agree with DTensor's own placement semantics; a refit between
two DTensor layouts (FSDP-style strided -> TP) is bit exact."""
from __future__ import annotations

from typing import Any

import torch
from _dist import run_ranks


def _layouts_and_refit(rank: int, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    import reshard_ext as rx
    from reshard_ext.adapters import dtensor

    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    ok = []
    for placements in ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Shard(1)]):
        dt = distribute_tensor(full, mesh, placements)
        ok.append(torch.equal(dtensor.layout_of(dt).local_part(full, rank), dt.to_local()))
    # FSDP2 over a TP-sharded dim: DTensor's own _StridedShard semantics define the global.
    local = torch.randn(2, 6, generator=torch.Generator().manual_seed(rank))
    strided = DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=2), Shard(0)], run_check=False)
    glob = strided.full_tensor()
    ok.append(torch.equal(dtensor.layout_of(strided).local_part(glob, rank), local))
    # Refit: strided source -> a TP-style destination [Replicate, Shard(1)].
    dst = distribute_tensor(torch.zeros(8, 6), mesh, [Replicate(), Shard(1)])
    rx.execute(rx.plan(src=dtensor.entries({"w": strided}), dst=dtensor.entries({"w": dst})))
    ok.append(torch.equal(dst.full_tensor(), glob))
    return ok


def test_dtensor_layouts_and_refit() -> None:
    for ok in run_ranks(4, _layouts_and_refit):
        assert all(ok), ok
