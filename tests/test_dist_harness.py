"""The multi-process test harness itself (tests/_dist.py)."""
from __future__ import annotations

import socket

import _dist


def _rank(rank: int, world: int) -> int:
    return rank


def test_a_pool_whose_port_was_taken_starts_on_another(monkeypatch):
    """free_port() can hand out a port that another process binds before rank 0 listens
    (EADDRINUSE); the pool retries on a new port instead of waiting out the rendezvous."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = _dist.free_port
    monkeypatch.setattr(_dist, "free_port", lambda: next(ports, None) or real())
    try:
        pool = _dist.Pool(2, "gloo")
        try:
            assert pool.run(_rank, timeout=60) == [0, 1]
        finally:
            pool.close()
    finally:
        taken.close()


def test_shared_gpus_skip_only_the_backends_that_need_a_gpu_per_rank(monkeypatch):
    import pytest

    monkeypatch.setattr(_dist, "SHARED_GPU", True)
    for backend in ("nccl", "nvshmem", "torch"):
        with pytest.raises(pytest.skip.Exception, match="needs a GPU per rank"):
            _dist.own_gpus(backend)
    for backend in ("direct", "auto"):
        _dist.own_gpus(backend)  # runs
    monkeypatch.setattr(_dist, "SHARED_GPU", False)
    _dist.own_gpus("nccl")
