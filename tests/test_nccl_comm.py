"""The NCCL transport on GPUs: grouped byte exchanges bit for bit, errors instead of hangs."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import reshard_ext as rx
from reshard_ext import _C
from reshard_ext.transports import nccl_lib as _nccl

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_nccl = pytest.mark.skipif(not _nccl.available(), reason="built without NCCL")
needs_1 = pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")
needs_2 = pytest.mark.skipif(NGPU < 2, reason="needs 2 CUDA GPUs")
pytestmark = [pytest.mark.gpu, needs_nccl]

GUARD = 64  # bytes after every receive region that must stay untouched


def _payload(seed: int, src: int, dst: int, k: int, n: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + src * 1009 + dst * 101 + k)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


def _sizes(seed: int, src: int, dst: int) -> list[int]:
    """Entries from src to dst: several per peer, zero-size ones among them."""
    g = torch.Generator().manual_seed(seed * 7 + src * 3 + dst)
    pool = [0, 1, 3, 4096, 65_537, (1 << 20) + 5, 0, 12_345]
    count = 1 + int(torch.randint(0, len(pool), (1,), generator=g))
    idx = torch.randperm(len(pool), generator=g)[:count].tolist()
    return [pool[i] for i in idx]


def _exchange_ranks(rank: int, world: int, seed: int, pairs: list[tuple[int, int]], on_side: bool) -> list[str]:
    """Every (src, dst) in `pairs` moves _sizes(seed, src, dst) payloads; returns problems."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm = _nccl.communicator(dist.group.WORLD)
    assert _nccl.communicator(dist.group.WORLD) is comm  # cached
    sends, recvs, keep, checks, fills = [], [], [], [], []
    for src, dst in pairs:
        for k, n in enumerate(_sizes(seed, src, dst)):
            if src == rank:
                t = torch.zeros(n, dtype=torch.uint8, device=device)
                keep.append(t)
                fills.append((t, _payload(seed, src, dst, k, n, device)))
                sends.append((dst, t.data_ptr() if n else 0, n))
            if dst == rank:
                buf = torch.full((n + GUARD,), 0xA5, dtype=torch.uint8, device=device)
                keep.append(buf)
                recvs.append((src, buf.data_ptr(), n))
                checks.append((src, k, n, buf))
    torch.cuda.current_stream().synchronize()
    # The payloads are written on the caller's stream right before the exchange: the
    # transfer must order after that work, and the checks below after the transfer.
    torch.cuda._sleep(2_000_000)
    for t, p in fills:
        t.copy_(p)
    _nccl.exchange(comm, sends, recvs, on_side_stream=on_side)
    problems = []
    for src, k, n, buf in checks:
        want = _payload(seed, src, rank, k, n, device)
        if not torch.equal(buf[:n], want):
            problems.append(f"rank {rank}: entry {k} from {src} ({n} bytes) differs")
        if not bool((buf[n:] == 0xA5).all()):
            problems.append(f"rank {rank}: entry {k} from {src} wrote past its {n} bytes")
    comm.wait(60.0)
    assert comm.poll()
    return problems


ALL_PAIRS = [(0, 1), (1, 0)]


@needs_2
@pytest.mark.parametrize("on_side", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exchange_both_ways(seed: int, on_side: bool) -> None:
    for problems in run_ranks(2, _exchange_ranks, seed, ALL_PAIRS, on_side, backend="nccl", timeout=120):
        assert problems == []


@needs_2
def test_exchange_one_way_and_self() -> None:
    # Rank 0 only sends to 1 (and to itself); rank 1 only receives: an idle direction.
    for problems in run_ranks(2, _exchange_ranks, 5, [(0, 1), (0, 0)], True, backend="nccl", timeout=120):
        assert problems == []


@needs_2
def test_exchange_nothing() -> None:
    for problems in run_ranks(2, _exchange_ranks, 6, [], True, backend="nccl", timeout=120):
        assert problems == []


# --- errors instead of hangs -------------------------------------------------------------

def _fresh_comm(rank: int, world: int, timeout: float) -> _C.NcclComm:
    """A communicator outside the cache, so breaking it leaves the cached one alone."""
    box = [_C.nccl_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    comm = _C.NcclComm(rank, world, box[0], torch.cuda.current_device(), timeout)
    comm.wait_ready(60.0)
    return comm


def _one_way(comm: _C.NcclComm, peer: int, n: int) -> list[torch.Tensor]:
    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.ones(n, dtype=torch.uint8, device=device)
    b = torch.zeros(n, dtype=torch.uint8, device=device)
    comm.exchange([(peer, a.data_ptr(), n)], [(peer, b.data_ptr(), n)], torch.cuda.current_stream().cuda_stream,
                  comm.side_stream)
    return [a, b]


def _send_expecting_failure(comm, nbytes: int, timeout: float) -> str:
    """Sends to rank 1 and waits; the error message, or "no error"."""
    try:
        buffers = _one_way(comm, 1, nbytes)  # noqa: F841  (alive until the wait ends)
        comm.wait(timeout)
        return "no error"
    except rx.ReshardError as e:
        return str(e)


def _peer_never_posts(rank: int, world: int, timeout: float) -> str:
    comm = _fresh_comm(rank, world, timeout)
    if rank == 1:
        time.sleep(timeout + 5)  # alive, but never posts its half
        comm.abort()
        dist.barrier()
        return "idle"
    t0 = time.monotonic()
    msg = _send_expecting_failure(comm, 1 << 20, timeout)
    elapsed = time.monotonic() - t0
    assert not comm.usable
    with pytest.raises(rx.ReshardError, match="unusable"):
        _one_way(comm, 1, 16)
    torch.cuda.synchronize()  # the abort freed the GPU: nothing is left spinning
    dist.barrier()
    return f"{msg}|{elapsed:.1f}"


@needs_2
def test_peer_that_never_posts_raises() -> None:
    timeout = 5.0
    out = run_ranks(2, _peer_never_posts, timeout, backend="nccl", timeout=120)
    msg, elapsed = out[0].rsplit("|", 1)
    assert "no error" not in msg
    assert "rank 0 of 2" in msg and "[1]" in msg and "aborted" in msg, msg
    assert float(elapsed) < 60  # bounded, not a hang (timing only as a hang guard)
    assert out[1] == "idle"


def _peer_aborts(rank: int, world: int, timeout: float) -> str:
    comm = _fresh_comm(rank, world, timeout)
    if rank == 1:
        comm.abort()
        comm.abort()  # idempotent
        with pytest.raises(rx.ReshardError, match="aborted"):
            comm.poll()
        dist.barrier()
        return "aborted"
    dist.barrier()  # rank 1 has aborted
    msg = _send_expecting_failure(comm, 1 << 16, timeout)
    torch.cuda.synchronize()
    return msg


@needs_2
def test_peer_that_aborted_raises() -> None:
    out = run_ranks(2, _peer_aborts, 10.0, backend="nccl", timeout=120)
    assert out[1] == "aborted"
    assert "no error" not in out[0] and "rank 0 of 2" in out[0], out[0]


@needs_2
def test_cached_communicator_still_works_after_errors() -> None:
    for problems in run_ranks(2, _exchange_ranks, 9, ALL_PAIRS, True, backend="nccl", timeout=120):
        assert problems == []


# --- one GPU: world of one, self send/recv, the library check ------------------------------

@needs_1
def test_world_of_one_self_exchange() -> None:
    torch.cuda.set_device(0)
    comm = _C.NcclComm(0, 1, _C.nccl_unique_id(), 0, 60.0)
    comm.wait_ready(60.0)
    device = torch.device("cuda", 0)
    src = [_payload(3, 0, 0, k, n, device) for k, n in enumerate([5, 0, 1 << 20])]
    dst = [torch.zeros(t.numel(), dtype=torch.uint8, device=device) for t in src]
    comm.exchange([(0, t.data_ptr(), t.numel()) for t in src], [(0, t.data_ptr(), t.numel()) for t in dst],
                  torch.cuda.current_stream().cuda_stream, comm.side_stream)
    for a, b in zip(src, dst):
        assert torch.equal(a, b)
    comm.wait(60.0)
    with pytest.raises(rx.InternalError, match="peer 1 is not in a group of 1"):
        comm.exchange([(1, src[0].data_ptr(), 5)], [], torch.cuda.current_stream().cuda_stream, 0)
    comm.close(10.0)
    assert not comm.usable


@needs_1
def test_stream_wait_orders_streams() -> None:
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(1 << 22, device="cuda")
    a.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(a):
        torch.cuda._sleep(10_000_000)  # keep `a` busy so a missing wait would show
        x.fill_(1.0)
    _C.stream_wait(b.cuda_stream, a.cuda_stream)
    with torch.cuda.stream(b):
        y = x.sum()
    b.synchronize()
    assert y.item() == float(x.numel())


@needs_1
def test_nccl_library_matches_torch() -> None:
    _nccl._LIB_CHECKED = False
    _nccl.check_nccl_library()
