"""The CUDA objects compile wherever nvcc is (CPU CI included), with no register spills.

Builds only the CUDA objects (kernels/*.cu, comm/) of a tree configured with
RESHARD_EXT_CUDA=ON (NCCL auto), so a CUDA-only compile error shows up without a GPU, and
reads ptxas -v's registers and spills of the box kernels. Where the package was just
installed with those objects (.ci/run: SKBUILD_BUILD_DIR keeps the install's build tree,
.ci/compile_log each CUDA compile's output beside its object), those objects and their
ptxas output are checked instead of compiling the same sources a second time; a tree
older than any source, or without the logs, is not used. The host runs of the box
kernels' lanes (boxes_emulated.cu: no device code, the slowest object to compile) are
left to the package build.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("cmake") is None
                                or shutil.which("ninja") is None, reason="needs nvcc, cmake and ninja")


def _cuda_objects(build: Path) -> list[str]:
    """The CUDA and comm objects alone: the library targets would also build core (their link order)."""
    targets = subprocess.run(["ninja", "-C", str(build), "-t", "targets", "all"], capture_output=True, text=True,
                             check=True).stdout
    return [o for o in re.findall(r"^(CMakeFiles/(?:rx_kernels\.dir/\S+\.cu|rx_comm\.dir/\S+)\.o):", targets, re.M)
            if not o.endswith("boxes_emulated.cu.o")]


def _installed_build() -> tuple[list[str], str] | None:
    """The CUDA objects the package install built (.ci/run keeps them) and their compile
    output, or None where there is no such build, it predates a source, or it has no ptxas -v log."""
    kept = os.environ.get("SKBUILD_BUILD_DIR")
    build = Path(kept or ".")
    if not kept or not (build / "build.ninja").is_file():
        return None
    objects = _cuda_objects(build)
    if not any(o.endswith(".cu.o") for o in objects):  # a build without CUDA
        return None
    sources = [ROOT / "CMakeLists.txt", *(ROOT / "cmake").rglob("*"), *(ROOT / "csrc").rglob("*")]
    newest = max(p.stat().st_mtime for p in sources if p.is_file())
    log = ""
    for o in objects:
        made = [build / o, *([build / f"{o}.log"] if o.endswith(".cu.o") else [])]
        if not all(p.is_file() and p.stat().st_mtime >= newest for p in made):
            return None
        if o.endswith(".cu.o"):
            log += made[1].read_text()
    return (objects, log) if "ptxas info" in log else None


def _fresh_build(tmp_path: Path) -> tuple[list[str], str]:
    pybind_dir = subprocess.run([sys.executable, "-m", "pybind11", "--cmakedir"], capture_output=True, text=True,
                                check=True).stdout.strip()
    configure = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(tmp_path), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
         "-DRESHARD_EXT_CUDA=ON", f"-DPython_EXECUTABLE={sys.executable}", f"-Dpybind11_DIR={pybind_dir}",
         "-DSKBUILD_PROJECT_VERSION=test", "-DCMAKE_CUDA_FLAGS=-Xptxas=-v"],
        capture_output=True, text=True, timeout=300)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    objects = _cuda_objects(tmp_path)
    build = subprocess.run(["ninja", "-C", str(tmp_path), *objects], capture_output=True, text=True, timeout=600)
    log = build.stdout + build.stderr
    assert build.returncode == 0, log
    return objects, log


def test_cuda_objects_build_without_spills(tmp_path: Path) -> None:
    objects, log = _installed_build() or _fresh_build(tmp_path)
    assert any(o.endswith("copy_boxes.cu.o") for o in objects), objects
    assert any(o.endswith("digest_boxes.cu.o") for o in objects), objects
    # ptxas, per entry: "Compiling entry function '<mangled name>'", then "N bytes spill
    # stores, M bytes spill loads" and "Used R registers". copy_boxes_kernel<false> is the
    # one-pass kernel (64 registers: 32 warps per SM), <true> the capped-grid one; the
    # digest_boxes_kernel<pass> instances (verify) must not spill either, except the copy
    # pass (<1>, RX_PASS_COPY): three blocks per SM at 80 registers, a little spilled, made
    # verified NCCL refits faster than two blocks without spills (digest_boxes.cuh). Its
    # spills stay within what that measurement had.
    entries = re.findall(r"Compiling entry function '([^']*(?:copy|digest)_boxes_kernel[^']*)'[^\n]*\n"
                         r"(?:[^\n]*\n)*?[^\n]*?(\d+) bytes spill stores, (\d+) bytes spill loads\n"
                         r"[^\n]*Used (\d+) registers", log)
    assert len(entries) >= 5, log
    for name, stores, loads, regs in entries:
        if "digest_boxes_kernelILi1E" in name:
            assert int(stores) <= 640 and int(loads) <= 1536 and int(regs) <= 80, f"{name} spills more\n{log}"
            continue
        assert (stores, loads) == ("0", "0"), f"{name} spills\n{log}"
        if "ILb0E" in name:
            assert int(regs) <= 64, f"{name} uses {regs} registers\n{log}"
