"""The bound-storage check alone (reshard_ext/watch.py, csrc/python/bind_watch.cc): a change
to any one of many bound tensors is found, wherever it sits in the C++ loop (which reads
ahead of itself) and through the Tensor.data_ptr fallback."""
from __future__ import annotations

import pytest
import torch

from reshard_ext import _C, watch

N = 41  # several times the C++ loop's prefetch distance, not a multiple of it
POSITIONS = [0, 1, 7, 8, 9, 16, 20, N - 9, N - 8, N - 2, N - 1]


def _tensors() -> list[torch.Tensor]:
    return [torch.nn.Parameter(torch.full((3 + i % 5,), float(i)), requires_grad=False) if i % 3 == 0
            else torch.arange(8.0 + i)[i % 4:] for i in range(N)]


def _change(t: torch.Tensor, how: str) -> None:
    if how == "data":
        t.data = t.data.clone()
    elif how == "grow":
        t.resize_(4096)
    else:  # as FSDP frees parameters
        t.untyped_storage().resize_(0)


@pytest.mark.parametrize("how", ["data", "grow", "free_storage"])
def test_data_ptr_watch_finds_a_change_at_any_position(how):
    if not watch.DATA_PTR_FN:
        pytest.skip("this torch exports no C data_ptr reader")
    for pos in POSITIONS:
        ts = _tensors()
        w = _C.DataPtrWatch(watch.DATA_PTR_FN, ts)
        assert len(w) == N and list(w.ptrs) == [t.data_ptr() for t in ts]
        assert w.changed() == []
        _change(ts[pos], how)
        assert w.changed() == [pos], (how, pos)


def test_data_ptr_watch_finds_every_change():
    if not watch.DATA_PTR_FN:
        pytest.skip("this torch exports no C data_ptr reader")
    ts = _tensors()
    w = _C.DataPtrWatch(watch.DATA_PTR_FN, ts)
    for i, pos in enumerate(POSITIONS):
        _change(ts[pos], ("data", "grow", "free_storage")[i % 3])
    assert w.changed() == POSITIONS


def test_data_ptr_watch_refuses_what_is_not_a_tensor():
    if not watch.DATA_PTR_FN:
        pytest.skip("this torch exports no C data_ptr reader")
    with pytest.raises(TypeError, match="item 1"):
        _C.DataPtrWatch(watch.DATA_PTR_FN, [torch.zeros(2), object()])


@pytest.mark.parametrize("fast", [True, False], ids=["c_data_ptr", "tensor_data_ptr"])
@pytest.mark.parametrize("how", ["data", "grow", "free_storage"])
def test_watch_names_the_changed_tensor_at_any_position(fast, how, monkeypatch):
    if fast and not watch.DATA_PTR_FN:
        pytest.skip("this torch exports no C data_ptr reader")
    if not fast:
        monkeypatch.setattr(watch, "DATA_PTR_FN", 0)
    for pos in POSITIONS:
        ts = _tensors()
        w = watch.Watch({"src": {f"s{i}": (t, None) for i, t in enumerate(ts[:N // 2])},
                         "dst": {f"d{i}": (t, None) for i, t in enumerate(ts[N // 2:])}})
        assert (w.fast is not None) == fast and (not w.slow) == fast
        assert w.changed(0) == ""
        _change(ts[pos], how)
        name = f"src tensor 's{pos}'" if pos < N // 2 else f"dst tensor 'd{pos - N // 2}'"
        message = w.changed(0)
        assert name in message and message.count("tensor '") == 1, (how, pos, message)


class _OwnDataPtr(torch.Tensor):
    """A subclass may define its own data_ptr: read through Python, beside the C++ loop."""


def test_watch_reads_subclasses_through_python_beside_the_fast_path():
    if not watch.DATA_PTR_FN:
        pytest.skip("this torch exports no C data_ptr reader")
    ts = _tensors()
    ts[5] = torch.zeros(6).as_subclass(_OwnDataPtr)
    w = watch.Watch({"src": {f"s{i}": (t, None) for i, t in enumerate(ts)}, "dst": {}})
    assert w.fast is not None and len(w.fast) == N - 1 and w.slow == [5]
    ts[5].data = torch.zeros(6)
    ts[30].data = torch.zeros(2)
    message = w.changed(0)
    assert "src tensor 's5'" in message and "src tensor 's30'" in message and message.count("tensor '") == 2
