"""torch's C shim (AOTInductor's stable C ABI: aoti_torch_get_<what>(handle, out)), which
libtorch exports. The C++ loops that read many tensors per call (the bound-storage check,
the swap fingerprint) call it through function addresses found here: no torch headers or
link (DESIGN section 3). A handle is an at::Tensor*, i.e. the address of a TensorImpl
pointer (Tensor._cdata); callers probe the shim against Python's reads before using it."""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import torch


@functools.cache
def library() -> Any:
    return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))


def function(name: str) -> int:
    """The address of the shim's aoti_torch_<name> (AttributeError where this torch lacks it)."""
    return int(ctypes.cast(getattr(library(), f"aoti_torch_{name}"), ctypes.c_void_p).value or 0)


def dtype_code(dtype: torch.dtype) -> int:
    """The shim's code of `dtype` (its exported aoti_torch_dtype_<name>)."""
    fn = getattr(library(), f"aoti_torch_dtype_{str(dtype).removeprefix('torch.')}")
    fn.restype = ctypes.c_int32
    return int(fn())
