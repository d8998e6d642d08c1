"""Is there an NVIDIA driver on this machine? Decides what RESHARD_EXT_CUDA=AUTO builds.

The CUDA kernels take minutes to compile and are of no use where no driver can run them,
so AUTO builds them only where nvcc is found *and* a driver is: libcuda.so.1 loads, or
the kernel module answers (/proc/driver/nvidia/version, /dev/nvidiactl). A build
container that compiles for GPU machines without a GPU of its own says
RESHARD_EXT_CUDA=ON instead. One implementation, used by the build backend (which
fetches the NCCL header wheel only for a CUDA build) and by CMake (cmake/cuda.cmake runs
this file and reads its one line: "yes <why>" or "no <why>").
"""
from __future__ import annotations

import ctypes
import os
import sys

_KERNEL_MODULE_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl")


def driver_found() -> tuple[bool, str]:
    """(found, why): whether an NVIDIA driver is on this machine, and how that was decided."""
    # The loader's own search, as the CUDA runtime does it: the toolkit's link stub
    # (stubs/libcuda.so) has no .so.1 name, so a toolkit alone does not count.
    library = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        ctypes.CDLL(library)
        return True, f"{library} loads"
    except OSError:
        pass
    for path in _KERNEL_MODULE_FILES:
        if os.path.exists(path):
            return True, f"{path} exists"
    return False, f"{library} does not load and no NVIDIA kernel module answers"


if __name__ == "__main__":
    found, why = driver_found()
    print(f"{'yes' if found else 'no'} {why}")
