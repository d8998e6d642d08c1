"""One answer on every rank on 2 GPUs, for each GPU backend (NCCL, direct, NVSHMEM): a
failure on one rank raises on both soon, naming it; a killed rank is named within seconds;
plan.version is the same on both; the next refit works (direct and NVSHMEM, whose failed
plan is unusable by design, after rx.plan again). And issue #37's NVSHMEM report: three
plans of one GPT model, non-collocated TP1 -> TP1, built and executed in one process with
backend "auto", then "nccl", then "nvshmem"."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from _dist import close_pool, gpus_for, own_gpus, run_ranks
from test_outcome import _try as _timed

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs2 = pytest.mark.skipif(not gpus_for(2), reason="needs 2 GPUs")
BACKENDS = ["nccl", "direct", "nvshmem"]
LONG = 60.0
FAST = 5.0


def _pair(rank: int, backend: str, seed: int = 0):
    """Every rank sends to and receives from the other: (plan, destination, expected)."""
    import reshard_ext as rx

    shape = (4096, 512)
    src_l = rx.Layout(shape, torch.bfloat16, rx.Mesh([0, 1]), [rx.Shard(0)])
    dst_l = rx.Layout(shape, torch.bfloat16, rx.Mesh([0, 1]), [rx.Shard(1)])
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    dst = torch.zeros(dst_l.local_shape(rank), dtype=torch.bfloat16, device="cuda")
    p = rx.plan({"w": (src_l.local_part(g, rank).cuda(), src_l)}, {"w": (dst, dst_l)}, backend=backend)
    return p, dst, dst_l.local_part(g, rank).cuda()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    torch.cuda.synchronize()
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def _one_fails(rank: int, world: int, backend: str, case: str):
    import reshard_ext as rx

    p, out, want = _pair(rank, backend, seed=1)
    rx.execute(p, version=0)
    kwargs: dict = {"version": 1, "timeout": LONG}
    if case == "version" and rank == 1:
        kwargs["version"] = 2
    elif case == "verify" and rank == 1:
        kwargs["verify"] = True
    elif case == "abort" and rank == 0:
        threading.Timer(0.2, p.abort).start()
    if case == "abort" and rank == 1:
        time.sleep(1.0)  # late: rank 0 aborts while it waits
    error, took = _timed(rx.execute, p, **kwargs)
    version = p.version
    q = p if backend == "nccl" else _pair(rank, backend, seed=1)[0]  # direct, NVSHMEM: plan again after a failure
    out = out if q is p else q._entries["dst"]["w"][0]
    again, _ = _timed(rx.execute, q, version=7, timeout=LONG)
    return error, took, version, again, q.version, _same(out, want)


@needs2
@pytest.mark.gpu
@pytest.mark.parametrize("case", ["version", "verify", "abort"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failure_raises_on_both_gpus_soon_2gpu(backend: str, case: str) -> None:
    own_gpus(backend)
    for rank, (error, took, version, again, last, ok) in enumerate(
            run_ranks(2, _one_fails, backend, case, backend="nccl", timeout=300)):
        assert error is not None and took < FAST + 1.0, (rank, took, error)
        assert version is None and again is None and last == 7 and ok, (rank, version, again)


def _killed(rank: int, world: int, backend: str):
    import reshard_ext as rx

    p, _, _ = _pair(rank, backend, seed=2)
    rx.execute(p)
    if rank == 1:  # dies inside the execute, after the headers: rank 0 waits for its data
        from reshard_ext.transports import cuda, direct

        for module in (cuda, direct):
            real = module.exchange_headers
            module.exchange_headers = lambda *a, _real=real, **k: (_real(*a, **k), time.sleep(30))[0]
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    return _timed(rx.execute, p, timeout=LONG)


@needs2
@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_killed_rank_is_named_within_seconds_2gpu(backend: str) -> None:
    own_gpus(backend)
    error, took = run_ranks(2, _killed, backend, backend="nccl", timeout=300, dies=(1,))[0]
    assert error is not None and "rank 1: its process exited" in error and took < 0.5 + FAST, (took, error)


# --- issue #37: NVSHMEM after "auto" and "nccl", non-collocated TP1 -> TP1 ---------------------

def _three_backends(rank: int, world: int, batch_bytes: int | None, keep: bool):
    """Rank 0 holds the source GPT model, rank 1 the destination; one plan per backend,
    built and executed in this order in this process; each execute bounded (a hang raises)."""
    import reshard_ext as rx
    from reshard_ext.synthetic import GPT_335M, Parallel, model_layouts

    src_l = model_layouts(GPT_335M, Parallel(tp=1, offset=0))
    dst_l = model_layouts(GPT_335M, Parallel(tp=1, offset=1))

    def weights(seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        return {n: torch.randn(l.shape, generator=gen, device="cuda", dtype=torch.float32).to(l.dtype)
                for n, l in sorted(src_l.items())}

    want = weights(7)  # both ranks make the same tensors
    src = {n: (t, src_l[n]) for n, t in want.items()} if rank == 0 else {}
    dst = {n: (torch.full(l.shape, float("nan"), device="cuda", dtype=l.dtype), l) for n, l in dst_l.items()} \
        if rank == 1 else {}
    options = rx.Options(tuning=rx.Tuning(batch_bytes=batch_bytes)) if batch_bytes else None
    kept, report = [], []
    for backend in ("auto", "nccl", "nvshmem"):
        p = rx.plan(src, dst, backend=backend, options=options)
        for step in range(2):
            for t, _ in dst.values():
                t.fill_(float("nan"))
            error, took = _timed(rx.execute, p, timeout=120)
            if error is not None:  # a failed NVSHMEM execute may leave this rank's stream blocked for good:
                # no synchronize (it would wait past every timeout); the pool is dropped after
                report.append((backend, p.backend, p.num_batches, step, round(took, 3), False, error))
                return report
            torch.cuda.synchronize()
            ok = all(torch.equal(t.view(torch.int16), want[n].view(torch.int16)) for n, (t, _) in dst.items())
            report.append((backend, p.backend, p.num_batches, step, round(took, 3), ok, error))
        if keep:
            kept.append(p)  # every plan alive, as the report's process had them
        del p
    return report


@needs2
@pytest.mark.gpu
@pytest.mark.parametrize("batch_bytes", [None, 64 << 20], ids=["default_batches", "many_batches"])
@pytest.mark.parametrize("keep", [True, False], ids=["plans_kept", "plans_dropped"])
def test_nvshmem_after_auto_and_nccl_non_collocated_2gpu(batch_bytes: int | None, keep: bool) -> None:
    own_gpus("nvshmem")
    # Fresh processes, as the report's: NVSHMEM (one world per process) then starts after the
    # auto and nccl plans, not in an earlier test of the pool.
    close_pool(2, "nccl")
    reports = run_ranks(2, _three_backends, batch_bytes, keep, backend="nccl", timeout=600)
    if not all(row[5] for report in reports for row in report):
        close_pool(2, "nccl")  # its ranks' streams may be blocked: later tests get fresh processes
    for rank, report in enumerate(reports):
        for backend, used, batches, step, took, ok, error in report:
            assert ok, (rank, backend, used, batches, step, took, error)


def _nvshmem_setup_fails(rank: int, world: int):
    """Rank 1's NVSHMEM plan cannot set up its signal words (its constructor raises): both
    ranks raise in rx.plan, before any rank enters nvshmem_barrier_all (which cannot time out)."""
    from reshard_ext import _C

    real = _C.NvshmemExchange
    if rank == 1:
        def broken(*args, **kwargs):
            raise RuntimeError("cudaMalloc of the signal words failed (injected)")

        _C.NvshmemExchange = broken
    t0 = time.monotonic()
    try:
        _pair(rank, "nvshmem")
        return None, time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - rank 1 raises its own error as it is
        return f"{type(e).__name__}: {e}", time.monotonic() - t0
    finally:
        _C.NvshmemExchange = real


@needs2
@pytest.mark.gpu
def test_an_nvshmem_plan_that_fails_to_set_up_on_one_rank_raises_on_both_2gpu() -> None:
    own_gpus("nvshmem")
    for rank, (error, took) in enumerate(run_ranks(2, _nvshmem_setup_fails, backend="nccl", timeout=300)):
        assert error is not None and took < FAST, (rank, took, error)
        assert ("injected" if rank == 1 else "rank 1 failed to set up its part of the NVSHMEM plan") in error, error


def _nan_refit_cuda(rank: int, world: int, dtype: torch.dtype, backend: str):
    from test_outcome import _NANS

    import reshard_ext as rx

    bits = torch.tensor(_NANS * 4, dtype=torch.int64).to(torch.int32)
    values = torch.cat([bits.view(torch.float32), torch.tensor([1.5, -0.0, float("inf"), 3e38] * 8)]).view(16, 4)
    src_l = rx.Layout(values.shape, torch.float32, rx.Mesh([0, 1]), [rx.Shard(0)])
    dst_l = rx.Layout(values.shape, dtype, rx.Mesh([0, 1]), [rx.Shard(1)])
    out = torch.zeros(dst_l.local_shape(rank), dtype=dtype, device="cuda")
    p = rx.plan({"w": (src_l.local_part(values, rank).cuda(), src_l)}, {"w": (out, dst_l)}, backend=backend)
    rx.execute(p, verify=True)
    want = dst_l.local_part(values, rank).cuda().to(dtype)  # Tensor.to on the GPU: the refit's promise there
    torch.cuda.synchronize()
    return torch.equal(out.view(torch.int16), want.view(torch.int16))


@needs2
@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nan_payloads_cast_as_tensor_to_on_the_gpu_2gpu(dtype: torch.dtype, backend: str) -> None:
    own_gpus(backend)
    assert all(run_ranks(2, _nan_refit_cuda, dtype, backend, backend="nccl"))
