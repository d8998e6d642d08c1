"""torch dtype <-> rx dtype codes (csrc/kernels/api.h, enum rx_dtype)."""
from __future__ import annotations

import torch

from .errors import ReshardError

_CODES: dict[torch.dtype, int] = {
    torch.uint8: 0,
    torch.int8: 1,
    torch.int16: 2,
    torch.int32: 3,
    torch.int64: 4,
    torch.float16: 5,
    torch.bfloat16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bool: 9,
}
for _name, _code in (("float8_e4m3fn", 10), ("float8_e5m2", 11), ("float8_e8m0fnu", 12),
                     ("uint16", 13), ("uint32", 14), ("uint64", 15)):
    if hasattr(torch, _name):
        _CODES[getattr(torch, _name)] = _code
_DTYPES = {v: k for k, v in _CODES.items()}


def code_of(dtype: torch.dtype) -> int:
    try:
        return _CODES[dtype]
    except KeyError:
        raise ReshardError(f"dtype {dtype} is not supported by reshard_ext") from None


def dtype_of(code: int) -> torch.dtype:
    return _DTYPES[code]
