"""The GPU executor's data path on the CPU: every rank's executor (csrc/comm/executor.h)
runs in its own thread over host memory, its launches through the kernels' CPU twins and
its transfers through an in-process fabric that matches messages per pair in post order,
as NCCL does. Refits land bit for bit through the pipelined schedule (staging double
buffered, direct messages, copy slices), and verified ones, moved in rounds, digest
exactly what rx.verify reads afterwards."""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from reshard_ext import _C, Layout, Mesh, Replicate, Shard
from reshard_ext.errors import ReshardError
from reshard_ext.execution import _refs
from reshard_ext.options import Options
from reshard_ext.planning import _plan_rank, _table
from reshard_ext.transports.digests import DeviceDigests, lanes


def _layouts(world: int) -> tuple[dict, dict]:
    mesh = Mesh(list(range(world)))
    src = {"x": Layout((96, 40), torch.float32, mesh, [Shard(0)]),
           "y": Layout((24, 64), torch.float32, mesh, [Shard(1)]),
           "z": Layout((1000,), torch.float32, mesh, [Replicate()])}
    dst = {"x": Layout((96, 40), torch.float32, mesh, [Replicate()]),
           "y": Layout((24, 64), torch.float32, mesh, [Shard(0)]),
           "z": Layout((1000,), torch.float32, mesh, [Shard(0)])}
    return src, dst


class Rank:
    """One rank's bound tables, tensors, staging and executor."""

    def __init__(self, rank: int, plan: Any, layouts: tuple[dict, dict], full: dict, direct_bytes: int, sliced: bool,
                 fabric: Any, rounds: bool) -> None:
        self.rank = rank
        self.tables = _C.ExecTables(plan)
        src_l, dst_l = layouts
        src_t, dst_t = _table(src_l), _table(dst_l)
        self.src = {n: (lay.local_part(full[n], rank).clone(), lay) for n, lay in src_l.items()}
        self.dst = {n: (torch.full(lay.local_shape(rank), float("nan")), lay) for n, lay in dst_l.items()}
        self.want = {n: lay.local_part(full[n], rank) for n, lay in dst_l.items()}
        t = self.tables
        nbuf = 2 if t.num_batches > 1 else 1
        self.staging = [torch.empty(max(1, t.send_buffer_bytes), dtype=torch.uint8) for _ in range(nbuf)]
        self.staging += [torch.empty(max(1, t.recv_buffer_bytes), dtype=torch.uint8) for _ in range(nbuf)]
        src = _refs([src_t.name(i) for i in t.src_used], self.src)
        dst = _refs([dst_t.name(i) for i in t.dst_used], self.dst)
        t.bind(src, dst, [b.data_ptr() for b in self.staging[:nbuf]], [b.data_ptr() for b in self.staging[nbuf:]],
               direct_bytes)
        self.ex = _C.Executor.host()
        self.ex.set_transport(fabric.transport(rank, rounds, 20.0))
        self.ex.prepare(t, sliced, 0, [(b.data_ptr(), b.numel()) for b in self.staging[nbuf:]])
        self.digests = np.zeros(0, dtype=np.uint64)

    def run(self, verify: bool, good: list[int], writes: bool = True) -> None:
        if verify and not self.ex.verify_built:
            self.digests = np.zeros(max(self.ex.build_verify(), 1), dtype=np.uint64)
            self.ex.set_digests(self.digests.ctypes.data)
        self.ex.begin(1, verify, False)
        self.ex.pack_first()
        self.ex.run(good, writes, 20.0)


def _ranks(direct_bytes: int, max_batch_bytes: int | None, sliced: bool = True, rounds: bool = True,
           world: int = 2) -> list[Rank]:
    layouts = _layouts(world)
    g = torch.Generator().manual_seed(3)
    full = {n: torch.randn(lay.shape, generator=g) for n, lay in layouts[0].items()}
    src_t, dst_t = _table(layouts[0]), _table(layouts[1])
    planned = [_plan_rank(src_t, dst_t, r, max_batch_bytes, 2, 16, Options()) for r in range(world)]
    k = max(wanted for _, wanted in planned)
    fabric = _C.HostFabric(world)
    out = []
    for r, (p, _) in enumerate(planned):
        p.assign_batches(k)
        out.append(Rank(r, p, layouts, full, direct_bytes, sliced, fabric, rounds))
    return out


def _run_all(ranks: list[Rank], verify: bool, good: list[int] | None = None, writes: bool = True) -> None:
    """Runs `ranks` (or those in `good`, each moving data with the others of `good`) in threads."""
    errors: list[BaseException] = []
    good = [r.rank for r in ranks] if good is None else good

    def go(r: Rank) -> None:
        try:
            r.run(verify, [p for p in good if p != r.rank], writes)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r,)) for r in ranks if r.rank in good]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("direct_bytes", [0, 512])
@pytest.mark.parametrize("max_batch_bytes", [None, 12000])
@pytest.mark.parametrize("sliced", [True, False])
def test_pipelined_refit_lands_bit_for_bit(direct_bytes: int, max_batch_bytes: int | None, sliced: bool) -> None:
    ranks = _ranks(direct_bytes, max_batch_bytes, sliced)
    if max_batch_bytes:
        assert ranks[0].tables.num_batches > 2  # both staging buffers reused
    if direct_bytes:
        assert any(r.tables.direct_recvs(b) for r in ranks for b in range(r.tables.num_batches))
    for _ in range(2):  # a second execute reuses everything
        for r in ranks:
            for t, _ in r.dst.values():
                t.fill_(float("nan"))
        _run_all(ranks, verify=False)
        for r in ranks:
            for n, (t, _) in r.dst.items():
                assert torch.equal(t.view(torch.int32), r.want[n].view(torch.int32)), (r.rank, n)


@pytest.mark.parametrize("direct_bytes", [0, 512])
@pytest.mark.parametrize("max_batch_bytes", [None, 12000])
@pytest.mark.parametrize("rounds", [False, True])
def test_verified_refit_digests_what_verify_reads(direct_bytes: int, max_batch_bytes: int | None, rounds: bool) -> None:
    """Pack, direct sends, unpack and direct receives (whole, or round by round as NCCL
    moves them) add up to the digests rx.verify reads from the sources and the destinations."""
    ranks = _ranks(direct_bytes, max_batch_bytes, rounds=rounds)
    _run_all(ranks, verify=True)
    for r in ranks:
        send, recv = r.ex.collect(r.digests)
        sends, recvs, copies = r.tables.num_ops
        want = [np.zeros(n, dtype=np.uint64) for n in (sends, recvs, copies, copies)]
        r.tables.read_digests_cpu(*want)
        assert send.tolist() == want[0].tolist() and recv.tolist() == want[1].tolist(), r.rank
        assert send.all() and recv.all()
        # the device check's lane sums (DeviceDigests: raw slots weighted by digest_signs)
        raw = torch.from_numpy(r.digests.view(np.int64))
        signed = DeviceDigests(raw, torch.from_numpy(r.ex.digest_signs()), lambda: (np.zeros(0, np.uint64),) * 2)
        signed = signed.lane_difference()
        assert (signed.numpy() % 2**32).tolist() == ((lanes(send) - lanes(recv)) % 2**32).tolist(), r.rank
        for n, (t, _) in r.dst.items():
            assert torch.equal(t.view(torch.int32), r.want[n].view(torch.int32)), (r.rank, n)


@pytest.mark.parametrize("verify", [False, True])
def test_degraded_ranks_move_with_agreeing_peers_and_write_nothing(verify: bool) -> None:
    """Rank 2 refused the execute: ranks 0 and 1 still move their pair's batches (so both
    complete), but what arrives lands in staging or scratch memory, never in a tensor."""
    ranks = _ranks(256, 12000, world=3)
    assert any(r.tables.direct_recvs(b) for r in ranks[:2] for b in range(r.tables.num_batches))
    _run_all(ranks, verify, good=[0, 1], writes=False)
    for r in ranks[:2]:
        for n, (t, _) in r.dst.items():
            assert t.isnan().all(), (r.rank, n)


def test_a_missing_peer_times_out_instead_of_hanging() -> None:
    ranks = _ranks(0, None)
    ranks[0].ex.set_transport(_C.HostFabric(2).transport(0, True, 0.2))
    with pytest.raises(ReshardError, match="got no message from rank 1 within 0.2 s"):
        ranks[0].run(False, [1])
