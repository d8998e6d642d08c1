"""The dtype table (csrc/common/dtype.h) as Python sees it: codes, sizes and float-ness agree with torch."""
from __future__ import annotations

import pytest
import torch

from reshard_ext import _C, ReshardError
from reshard_ext.layout import code_of, dtype_of

ROWS = _C.dtype_info()
CASTS = {torch.float16, torch.bfloat16, torch.float32, torch.float64}  # the types a box may convert between


def test_codes_are_dense_and_named_after_torch() -> None:
    assert [code for code, *_ in ROWS] == list(range(len(ROWS)))
    for code, name, _size, _is_float in ROWS:
        assert int(getattr(_C.DType, name)) == code
        assert isinstance(getattr(torch, name, None), torch.dtype), name


@pytest.mark.parametrize("row", ROWS, ids=[r[1] for r in ROWS])
def test_row_matches_torch(row: tuple) -> None:
    code, name, size, is_float = row
    dtype = getattr(torch, name)
    assert _C.dtype_size(code) == size == torch.empty((), dtype=dtype).element_size()
    assert is_float == (dtype in CASTS)
    assert code_of(dtype) == code and dtype_of(code) is dtype


def test_castability() -> None:
    for s, *_ in ROWS:
        for d, *_ in ROWS:
            expect = s == d or (dtype_of(s) in CASTS and dtype_of(d) in CASTS)
            assert _C.dtype_castable(s, d) == expect, (dtype_of(s), dtype_of(d))
    assert _C.dtype_size(len(ROWS)) == 0 and not _C.dtype_castable(len(ROWS), len(ROWS))


def test_unsupported_dtype_is_a_user_error() -> None:
    with pytest.raises(ReshardError, match="complex64"):
        code_of(torch.complex64)
