"""The NVSHMEM transport's CPU-checkable parts: what is missing is said on every rank
before data moves, where the library is looked for, and how ranks agree on a symmetric
region. The refits themselves run in test_refit_gpu.py and test_mxfp8_refit.py."""
from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import reshard_ext as rx
from reshard_ext import _nvshmem
from reshard_ext.layout import Layout, Mesh, Replicate, Shard


def test_build_info_reports_the_transport() -> None:
    info = rx.build_info()
    assert info["nvshmem"] == info["cuda"] == _nvshmem.available()
    assert info["nvshmem_library"] == _nvshmem.loaded_library()


def _refit_nvshmem(rank: int, world: int, missing_on: int):
    """A TP2 -> TP1 refit over backend 'nvshmem' on CPU tensors; returns the error text and
    whether the destination still holds its poison (nothing moved)."""
    real = _nvshmem.local_problem
    if rank == missing_on:  # this rank alone also lacks the library (restored: the worker is reused)
        _nvshmem.local_problem = lambda: "no libnvshmem_host.so.3 here (test)"  # type: ignore[assignment]
    shape = (8, 4)
    sl = Layout(shape, torch.float32, Mesh([0, 1]), [Shard(0)])
    dl = Layout(shape, torch.float32, Mesh([0, 1]), [Replicate()])
    src = {"w": (torch.ones(sl.local_shape(rank)), sl)}
    dst = torch.full(dl.local_shape(rank), -7.0)
    try:
        rx.plan(src, {"w": (dst, dl)}, backend="nvshmem")
        return "no error", True
    except rx.ReshardError as e:
        return str(e), bool((dst == -7.0).all())
    finally:
        _nvshmem.local_problem = real  # type: ignore[assignment]

@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU host's check: where CUDA runs, the CPU tensors "
                    "of this test are refused first")
@pytest.mark.parametrize("missing_on", [-1, 1])
def test_unusable_backend_raises_on_every_rank_before_data_moves(missing_on: int) -> None:
    for rank, (msg, untouched) in enumerate(run_ranks(2, _refit_nvshmem, missing_on)):
        assert untouched, rank
        assert "backend 'nvshmem' cannot run on every rank" in msg, msg
        if missing_on >= 0:
            assert f"rank {missing_on}: no libnvshmem_host.so.3 here (test)" in msg, msg
        # every rank's reason is listed, on every rank (here: no GPU, or a CPU-only build)
        assert all(f"rank {r}: " in msg for r in range(2)), msg


@pytest.mark.skipif(not _nvshmem.available() or not _nvshmem.runtime_status().startswith("not found"),
                    reason="checks the error of a CUDA build where libnvshmem_host is missing")
def test_missing_library_is_a_clear_error() -> None:
    with pytest.raises(rx.ReshardError, match="(?s)no usable libnvshmem_host.so.3.*nvidia-nvshmem-cu"):
        _nvshmem.load_library()


def test_cpu_build_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_nvshmem, "available", lambda: False)
    assert "built without CUDA" in (_nvshmem.local_problem() or "")
    assert _nvshmem.runtime_status() == "not built"
    with pytest.raises(rx.ReshardError, match="RESHARD_EXT_CUDA=ON"):
        _nvshmem.load_library()


def test_library_candidates(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    (tmp_path / "lib64").mkdir()
    lib = tmp_path / "lib64" / "libnvshmem_host.so.3"
    lib.write_bytes(b"")
    monkeypatch.setenv("NVSHMEM_HOME", str(tmp_path))
    assert _nvshmem.library_candidates()[0] == str(lib)
    monkeypatch.setenv("NVSHMEM_HOME", str(tmp_path / "nothing"))
    assert str(lib) not in _nvshmem.library_candidates()


def test_regions_are_reused_only_where_free_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    allocated: list[int] = []
    monkeypatch.setattr(_nvshmem, "_REGIONS", [])
    monkeypatch.setattr(_nvshmem._C, "nvshmem_alloc", lambda n: allocated.append(n) or 4096 * len(allocated),
                        raising=False)
    assert _nvshmem.take_region([[], []], 100) == (0, 4096)
    assert _nvshmem.take_region([[], []], 300) == (1, 8192)
    assert _nvshmem.free_regions() == []
    _nvshmem.release_region(0)
    _nvshmem.release_region(1)
    assert _nvshmem.free_regions() == [(0, 100), (1, 300)]
    # free here, still in use on the other rank: a new collective allocation
    assert _nvshmem.take_region([[(0, 100), (1, 300)], [(0, 100)]], 200) == (2, 4096 * 3)
    # free everywhere and big enough: the smallest id that fits, no allocation
    assert _nvshmem.take_region([[(0, 100), (1, 300)], [(0, 100), (1, 300)]], 50) == (0, 4096)
    assert allocated == [100, 300, 200]


def test_slot_reuse_across_senders_is_refused() -> None:
    """Rank 1's batch 2 lands in slot 0 over rank 2's batch 0 (offsets shift with who sends
    in a batch); rank 1's own previous message there was none, so nothing would hold its put
    back until rank 2's data is unpacked."""
    from reshard_ext.transports.nvshmem import check_slot_reuse

    received = {1: [(2, 0, 128)], 2: [(0, 64, 128)]}
    with pytest.raises(rx.ReshardError, match=r"rank 1's batch 2 would land in staging slot 0 over rank 2's batch 0"):
        check_slot_reuse(received, 2, 3)


@pytest.mark.parametrize("received", [
    {1: [(0, 0, 128), (2, 0, 128)], 2: [(0, 128, 128), (2, 128, 128)]},  # every sender keeps its region
    {1: [(0, 0, 128), (2, 64, 128)], 2: [(0, 128, 64)]},  # overlap with its own earlier message only
    {1: [(0, 0, 128), (1, 4096, 128), (2, 64, 128)], 2: [(1, 4160, 128)]},  # other slot
    {2: [(b, 0, 256) for b in range(8)]},  # one sender
])
def test_slot_reuse_that_flow_control_covers_is_accepted(received: dict) -> None:
    from reshard_ext.transports.nvshmem import check_slot_reuse

    check_slot_reuse(received, 2, 3)


def test_slot_reuse_waits_only_on_the_senders_previous_batch_in_the_slot() -> None:
    """Rank 1 sent in batch 0 of slot 0, rank 2 in batch 2, rank 1 again in batch 4 over rank
    2's region: rank 1 waits for its batch 0 only, not for rank 2's batch 2."""
    from reshard_ext.transports.nvshmem import check_slot_reuse

    check_slot_reuse({1: [(0, 0, 64), (4, 0, 64)], 2: [(2, 64, 64)]}, 2, 0)  # no overlap
    with pytest.raises(rx.ReshardError, match="rank 1's batch 4 .* over rank 2's batch 2"):
        check_slot_reuse({1: [(0, 0, 64), (4, 32, 64)], 2: [(2, 64, 64)]}, 2, 0)
    check_slot_reuse({1: [(0, 0, 64), (4, 32, 64)], 2: [(2, 64, 64)]}, 1, 0)  # one slot: no reuse in an execute
