"""The NVSHMEM transport's CPU-checkable parts: what is missing is said on every rank
before data moves, where the library is looked for, and how ranks agree on a symmetric
region. The refits themselves run in test_refit_gpu.py and test_mxfp8_refit.py."""
from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import reshard_ext as rx
from reshard_ext.layout import Layout, Mesh, Replicate, Shard
from reshard_ext.transports import nvshmem_lib as _nvshmem


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
