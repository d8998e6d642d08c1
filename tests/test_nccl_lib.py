"""The NCCL transport's CPU-checkable parts: import, clear errors, the libnccl check."""
from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from _dist import run_ranks

import reshard_ext as rx
from reshard_ext import _C, options
from reshard_ext.transports import nccl_lib as _nccl

HAS_NCCL = _nccl.available()
HAS_LIBNCCL = HAS_NCCL and not _nccl.runtime_status().startswith("not found")
needs_libnccl = pytest.mark.skipif(not HAS_LIBNCCL, reason="no libnccl.so.2 at run time")


@pytest.fixture(autouse=True)
def _fresh_environment():
    options.reload_environment()
    yield
    options.reload_environment()


def test_imports_without_cuda() -> None:
    assert _nccl.available() == rx.build_info()["nccl"]
    assert options.default_timeout("nccl") > 0


@pytest.mark.skipif(not HAS_NCCL or HAS_LIBNCCL, reason="checks the error where libnccl is missing")
def test_missing_libnccl_is_a_clear_error() -> None:
    # Built with NCCL (e.g. an isolated pip build beside a CPU-only torch): importing works,
    # and using the transport says what is missing.
    with pytest.raises(rx.ReshardError, match="(?s)found no libnccl.so.2.*nvidia-nccl-cu"):
        _nccl.load_library()
    assert _nccl.runtime_status().startswith("not found")


def test_communicator_without_nccl_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_nccl, "available", lambda: False)
    monkeypatch.setattr(_nccl, "_LIB_CHECKED", False)  # an earlier test may have passed the check
    with pytest.raises(rx.ReshardError, match="built without the NCCL transport.*nvidia-nccl-cu"):
        _nccl.communicator()
    with pytest.raises(rx.ReshardError, match="built without the NCCL transport"):
        _nccl.check_nccl_library()


def _communicator_error(rank: int, world: int) -> str:
    try:
        _nccl.communicator(dist.group.WORLD)
    except rx.ReshardError as e:
        return str(e)
    return "no error"


def test_communicator_on_gloo_cpu_group_raises() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only refusal")
    msgs = run_ranks(2, _communicator_error)
    for m in msgs:
        assert ("built without the NCCL transport" in m) or ("needs a CUDA device" in m), m


# --- the libnccl check, with fake paths ----------------------------------------------------

MAPS = """\
7f0000000000-7f0000001000 r--p 00000000 08:01 123 /venv/site-packages/nvidia/nccl/lib/libnccl.so.2
7f0000001000-7f0000002000 r-xp 00001000 08:01 123 /venv/site-packages/nvidia/nccl/lib/libnccl.so.2
7f0000003000-7f0000004000 r-xp 00000000 08:01 124 /opt/nccl/lib/libnccl-net.so
7f0000005000-7f0000006000 rw-p 00000000 00:00 0
7f0000007000-7f0000008000 r-xp 00000000 08:01 125 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000009000-7f000000a000 r-xp 00000000 08:01 126 /opt/my nccl/lib/libnccl.so.2.21.5
"""


def test_mapped_nccl_paths_parses_maps() -> None:
    assert _nccl.mapped_nccl_paths(MAPS) == [
        "/venv/site-packages/nvidia/nccl/lib/libnccl.so.2",
        "/opt/my nccl/lib/libnccl.so.2.21.5",  # a space in the path survives; plugins do not count
    ]
    assert _nccl.mapped_nccl_paths("") == []


def test_same_file_and_version_is_fine() -> None:
    lib = "/venv/site-packages/nvidia/nccl/lib/libnccl.so.2"
    assert _nccl.nccl_mismatch(lib, (2, 27, 3), (2, 27, 3), [lib]) is None
    assert _nccl.nccl_mismatch(lib, (2, 27, 3), None, [lib]) is None  # torch without NCCL
    assert _nccl.nccl_mismatch(lib, (2, 27, 3), (2, 27, 3), []) is None  # torch links NCCL statically


def test_version_mismatch_is_explained() -> None:
    lib = "/venv/site-packages/nvidia/nccl/lib/libnccl.so.2"
    msg = _nccl.nccl_mismatch(lib, (2, 32, 3), (2, 27, 5), [lib])
    assert msg is not None
    assert "2.27.5" in msg and "2.32.3" in msg and lib in msg
    assert "nvidia-nccl-cu" in msg and "NCCL_HOME" in msg and "RESHARD_EXT_SKIP_NCCL_CHECK" in msg


def test_second_library_is_explained() -> None:
    ours = "/venv/site-packages/nvidia/nccl/lib/libnccl.so.2"
    torch_lib = "/usr/lib/libnccl.so.2"
    msg = _nccl.nccl_mismatch(ours, (2, 27, 3), (2, 27, 3), [ours, torch_lib])
    assert msg is not None and "two libnccl files" in msg and torch_lib in msg and ours in msg


def test_symlinked_paths_are_the_same_file(tmp_path) -> None:
    real = tmp_path / "libnccl.so.2.27.3"
    real.write_bytes(b"")
    link = tmp_path / "libnccl.so.2"
    os.symlink(real, link)
    assert _nccl.nccl_mismatch(str(link), (2, 27, 3), (2, 27, 3), [str(real)]) is None


def test_skip_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESHARD_EXT_SKIP_NCCL_CHECK", "1")
    monkeypatch.setattr(_nccl, "available", lambda: False)
    _nccl.check_nccl_library()  # skipped: no error even without the transport


# --- with the NCCL transport compiled in (no GPU needed) -----------------------------------

@needs_libnccl
def test_library_introspection() -> None:
    major, minor, patch = _C.nccl_version()
    assert major >= 2 and 0 <= minor < 100 and 0 <= patch < 100
    path = _C.nccl_library_path()
    assert os.path.basename(path).startswith("libnccl.so") and os.path.exists(path)
    with open("/proc/self/maps") as f:
        mapped = _nccl.mapped_nccl_paths(f.read())
    assert os.path.realpath(path) in {os.path.realpath(p) for p in mapped}


@needs_libnccl
def test_check_passes_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_nccl, "_LIB_CHECKED", False)
    monkeypatch.delenv("RESHARD_EXT_SKIP_NCCL_CHECK", raising=False)
    _nccl.check_nccl_library()  # this process's torch must use the extension's libnccl (or none)


@needs_libnccl
def test_unique_id_bytes() -> None:
    a, b = _C.nccl_unique_id(), _C.nccl_unique_id()
    assert isinstance(a, bytes) and len(a) == 128 and a != b


@needs_libnccl
def test_bad_rank_is_a_user_error() -> None:
    with pytest.raises(rx.ReshardError, match="rank 2 is not in a group of 2"):
        _C.NcclComm(2, 2, _C.nccl_unique_id(), 0)
