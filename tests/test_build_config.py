"""What RESHARD_EXT_CUDA=AUTO builds: the CUDA kernels only where nvcc and an NVIDIA driver
are found (tools/cuda_driver.py), said in one configure line; ON builds them anyway."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_LINE = "reshard_ext: no NVIDIA driver on this machine, so no CUDA kernels"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_driver_found_by_library_or_kernel_module(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = _load("cuda_driver")
    if not sys.platform.startswith("linux"):
        pytest.skip("the Linux loader and kernel module files")
    loaded: list[str] = []

    def no_library(name: str) -> None:
        loaded.append(name)
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(driver.ctypes, "CDLL", no_library)
    monkeypatch.setattr(driver.os.path, "exists", lambda path: False)
    found, why = driver.driver_found()
    assert not found and "libcuda.so.1" in why and loaded == ["libcuda.so.1"]
    monkeypatch.setattr(driver.os.path, "exists", lambda path: path == "/dev/nvidiactl")
    assert driver.driver_found() == (True, "/dev/nvidiactl exists")
    monkeypatch.setattr(driver.ctypes, "CDLL", lambda name: object())
    assert driver.driver_found() == (True, "libcuda.so.1 loads")


def test_build_backend_fetches_nccl_headers_only_for_a_cuda_build(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("scikit_build_core")
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    backend = _load("build_backend")
    monkeypatch.delenv("NCCL_HOME", raising=False)
    monkeypatch.delenv("RESHARD_EXT_NCCL", raising=False)
    monkeypatch.setattr(backend, "_nvcc", lambda: "/opt/cuda/bin/nvcc")
    monkeypatch.setattr(backend, "_cuda_major", lambda nvcc: 13)
    if not sys.platform.startswith("linux"):
        pytest.skip("the NCCL transport is built on Linux only")
    wheel = [backend.NCCL_HEADER_WHEELS[13]]
    for cuda, driver, expected in (("AUTO", False, []), ("AUTO", True, wheel), ("ON", False, wheel),
                                   ("OFF", True, [])):
        monkeypatch.setenv("RESHARD_EXT_CUDA", cuda)
        monkeypatch.setattr(backend, "driver_found", lambda driver=driver: (driver, "test"))
        assert backend.nccl_requirement() == expected, (cuda, driver)
    # a pip -C setting wins over the environment
    monkeypatch.setattr(backend, "driver_found", lambda: (False, "test"))
    assert backend.nccl_requirement({"cmake.define.RESHARD_EXT_CUDA": "on"}) == wheel


needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("ninja") is None
                                 or shutil.which("cc") is None, reason="needs cmake, ninja and a C compiler")


def _cmake(build: Path, cuda: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Configures the project (nothing compiled), NCCL off."""
    pybind_dir = subprocess.run([sys.executable, "-m", "pybind11", "--cmakedir"], capture_output=True, text=True,
                                check=True).stdout.strip()
    return subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja", f"-DRESHARD_EXT_CUDA={cuda}",
                           "-DRESHARD_EXT_NCCL=OFF", f"-DPython_EXECUTABLE={sys.executable}",
                           f"-Dpybind11_DIR={pybind_dir}", "-DSKBUILD_PROJECT_VERSION=test"],
                          capture_output=True, text=True, timeout=600, env=env)


def _configure(build: Path, cuda: str, env: dict[str, str]) -> tuple[str, str]:
    """(configure output, CMakeCache.txt) of a configure that must succeed."""
    r = _cmake(build, cuda, env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr, (build / "CMakeCache.txt").read_text()


@needs_cmake
def test_auto_builds_cuda_only_where_a_driver_is(tmp_path: Path) -> None:
    """AUTO on this machine, then again with a libcuda.so.1 the loader finds (an empty
    library: configure loads it, nothing calls it). Configure only: no CUDA compiles."""
    driver = _load("cuda_driver")
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    if not driver.driver_found()[0]:
        out, cache = _configure(tmp_path / "auto", "AUTO", env)
        assert out.count(SKIP_LINE) == 1, out
        assert "CMAKE_CUDA_COMPILER:" not in cache, "AUTO without a driver looked for nvcc"
    fake = tmp_path / "driver"
    fake.mkdir()
    (fake / "empty.c").write_text("int rx_fake_libcuda;\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(fake / "libcuda.so.1"), str(fake / "empty.c")], check=True)
    # past the driver, AUTO looks for nvcc: a compiler that cannot work (CUDACXX=false)
    # keeps this test from compiling CUDA's test programs
    out, cache = _configure(tmp_path / "driver-build", "AUTO",
                            {**env, "LD_LIBRARY_PATH": str(fake), "CUDACXX": shutil.which("false") or "/bin/false"})
    assert SKIP_LINE not in out, out
    assert "reshard_ext: no CUDA compiler found" in out, out


@needs_cmake
def test_cuda_option_is_checked(tmp_path: Path) -> None:
    r = _cmake(tmp_path, "maybe")
    assert r.returncode != 0 and "RESHARD_EXT_CUDA=MAYBE: expected AUTO, ON or OFF" in r.stdout + r.stderr
