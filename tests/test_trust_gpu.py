"""The guarantees of tests/test_trust.py on 2 GPUs (NCCL transport): versions, plan
mismatches, timeouts, abort in the middle of the NCCL transfers (the communicator is
rebuilt by the next execute), replaced storage, and no GPU memory growth."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from _cases import bits_equal
from _dist import run_ranks

import reshard_ext as rx
from reshard_ext import Layout, Mesh, Shard

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 2 or not rx.build_info().get("nccl"), reason="needs 2 GPUs and NCCL")
BF16 = torch.bfloat16


def _plan(rank: int, world: int, seed: int = 0, rows: int = 256, cols: int = 512, max_batch_bytes=None,
          backend: str = "nccl"):
    """Rows to columns: every rank sends to and receives from every other one."""
    shape = (rows * world, cols * world)
    src_l = Layout(shape, BF16, Mesh(list(range(world))), [Shard(0)])
    dst_l = Layout(shape, BF16, Mesh(list(range(world))), [Shard(1)])
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(BF16)
    dst = torch.zeros(dst_l.local_shape(rank), dtype=BF16, device="cuda")
    p = rx.plan({"w": (src_l.local_part(g, rank).cuda(), src_l)}, {"w": (dst, dst_l)}, max_batch_bytes=max_batch_bytes,
                backend=backend)
    return p, dst, dst_l.local_part(g, rank)


def _ok(out: torch.Tensor, want: torch.Tensor) -> bool:
    torch.cuda.synchronize()
    return bits_equal(out.cpu(), want)


def _try(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
        torch.cuda.synchronize()
        return None
    except rx.ReshardError as e:
        return str(e)


def _versions_and_orders(rank: int, world: int, backend: str = "nccl"):
    a, out_a, want_a = _plan(rank, world, seed=1, backend=backend)
    b, out_b, want_b = _plan(rank, world, seed=2, rows=64, backend=backend)
    rx.execute(a, version=3)
    v = a.version
    version_error = _try(rx.execute, a, version=4 + rank)
    order_errors = [_try(rx.execute, a if rank == 0 else b), _try(rx.execute, b if rank == 0 else a)]
    rx.execute(a, version=5)
    rx.execute(b)
    return v, version_error, order_errors, a.version, _ok(out_a, want_a) and _ok(out_b, want_b)


@pytest.mark.parametrize("backend", ["nccl", "direct"])
def test_versions_and_plan_mismatches_2gpu(backend):
    """The headers guard the direct backend too: no rank writes into a peer that disagrees."""
    for v, version_error, order_errors, last, ok in run_ranks(2, _versions_and_orders, backend, backend="nccl"):
        assert v == 3 and last == 5 and ok
        assert "version" in version_error
        assert all(e is not None and "ranks 0 and 1 ran different plans" in e for e in order_errors)


def _abort_mid_transfer(rank: int, world: int):
    from reshard_ext.transports import cuda as cuda_transport

    p, out, want = _plan(rank, world, seed=3, rows=1024, cols=1024)
    rx.execute(p)
    if rank == 1:  # agrees on the headers, then holds back its NCCL half for a while
        agree = cuda_transport.CudaTransport._agree
        cuda_transport.CudaTransport._agree = lambda self, *a: (agree(self, *a), time.sleep(2.0))[0]
    else:
        threading.Timer(0.8, p.abort).start()  # rank 0 waits in NCCL by then
    out.zero_()  # what an execute that completes must have written whole
    t0 = time.monotonic()
    error = _try(rx.execute, p, version=7, timeout=4)
    elapsed = time.monotonic() - t0
    if rank == 1:
        cuda_transport.CudaTransport._agree = agree
    version = (p.version, error is None and _ok(out, want))
    rx.execute(p, version=8)  # the communicator is rebuilt; the same plan runs again
    return error, elapsed, version, p.version, _ok(out, want)


def test_abort_during_nccl_transfers_and_rebuild_2gpu():
    results = run_ranks(2, _abort_mid_transfer, backend="nccl")
    error, elapsed, _, _, _ = results[0]
    assert error is not None and "aborted" in error and elapsed < 3.0, (error, elapsed)  # abort at 0.8 s
    # Rank 1 hears of the abort (rank 0's alarm) while it holds back its half: it raises too,
    # as soon as it looks (one answer on every rank).
    peer_error, peer_elapsed, peer_version, _, _ = results[1]
    assert peer_error is not None and "rank 0: rx.execute was aborted" in peer_error and peer_elapsed < 5, results[1]
    assert peer_version == (None, False), results[1]
    assert results[0][2] == (None, False)
    for _, _, _, last, ok in results:
        assert last == 8 and ok


def test_timeout_per_call_2gpu():
    from test_trust import _timeout_per_call

    results = run_ranks(2, _timeout_per_call, "cuda", backend="nccl")
    assert "rank 1 sent no execute header within 1.5 s" in results[0][0] and results[0][1] < 10
    assert all(version == 2 and ok for *_, version, ok in results)


def _replaced(rank: int, world: int):
    p, out, want = _plan(rank, world, seed=5)
    src = p._entries["src"]["w"]
    if rank == 1:
        src[0].data = src[0].data.clone()  # a new storage under the bound tensor
    error = _try(rx.execute, p)
    untouched = not out.any().item()
    p.rebind(src={"w": src})
    rx.execute(p)
    return error, untouched, _ok(out, want)


def test_replaced_storage_2gpu():
    results = run_ranks(2, _replaced, backend="nccl")
    for error, _, _ in results:  # one answer on both ranks, naming rank 1 and what changed
        assert "rank 1: bound tensors were replaced or resized" in error, error
    assert all(untouched and ok for _, untouched, ok in results)


def _staging_bound(rank: int, world: int):
    p, out, want = _plan(rank, world, seed=6, max_batch_bytes=1 << 18)
    rx.execute(p)
    return p.staging_bytes, p.num_batches, _ok(out, want)


def test_max_batch_bytes_bounds_pipelined_staging_2gpu():
    for staging, batches, ok in run_ranks(2, _staging_bound, backend="nccl"):
        assert ok and batches > 1 and staging <= 1 << 18  # 256 KiB each way per rank: several batches


def _churn(rank: int, world: int, n: int):
    p, out, want = _plan(rank, world, seed=7, rows=64, cols=64)
    for _ in range(20):
        rx.execute(p)
        _plan(rank, world, seed=8, rows=16, cols=16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    ok = True
    for i in range(n):
        rx.execute(p, version=i)
        q, o, w = _plan(rank, world, seed=8, rows=16, cols=16)
        rx.execute(q)
        ok = ok and _ok(o, w)
        del q, o
    torch.cuda.synchronize()
    return base, torch.cuda.memory_allocated(), ok and _ok(out, want)


def test_executes_and_plans_do_not_grow_gpu_memory_2gpu():
    for base, end, ok in run_ranks(2, _churn, 200, backend="nccl", timeout=600):
        assert ok and end - base < (1 << 20), (base, end)
