"""The bound-storage check alone (reshard_ext/watch.py, csrc/python/bind_watch.cc): a change
to any one of many bound tensors is found, wherever it sits in the C++ loop (which reads
ahead of itself), with the raw words compared first or torch's shim alone, and through the
Tensor.data_ptr fallback; the raw layout is proven before use, and a wrong one fails its proof."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

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
    elif how == "offset":  # same storage, the view moved
        t.data = t.data[1:]
    elif how == "shift":  # same storage, another offset (and numel where the offset was 0)
        off = t.storage_offset()
        t.set_(t.untyped_storage(), off - 1 if off else 1, (t.numel() if off else t.numel() - 1,), (1,))
    elif how == "empty":  # same storage; an empty tensor's data_ptr is null
        t.resize_(0)
    else:  # as FSDP frees parameters
        t.untyped_storage().resize_(0)


def _layout(raw: bool):
    """The raw layout as discovered, unproven: a loop that compares the words wrongly fails
    these tests rather than only its proof (which would make the check fall back silently)."""
    if not watch.DATA_PTR_FN:
        pytest.skip("this torch exports no C data_ptr reader")
    layout = watch._discover() if raw else None
    if raw and layout is None:
        pytest.skip("no raw layout found on this torch")
    return layout


def test_the_raw_layout_is_proven_where_it_is_found():
    if watch._discover() is not None:
        assert watch.RAW_LAYOUT == watch._discover()


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "shim"])
@pytest.mark.parametrize("how", ["data", "grow", "free_storage", "offset", "shift", "empty"])
def test_data_ptr_watch_finds_a_change_at_any_position(how, raw):
    layout = _layout(raw)
    for pos in POSITIONS:
        ts = _tensors()
        w = _C.DataPtrWatch(watch.DATA_PTR_FN, ts, layout)
        assert w.raw == raw
        assert len(w) == N and list(w.ptrs) == [t.data_ptr() for t in ts]
        assert w.changed() == []
        _change(ts[pos], how)
        assert w.changed() == [pos], (how, pos)


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "shim"])
def test_data_ptr_watch_finds_every_change(raw):
    layout = _layout(raw)
    ts = _tensors()
    w = _C.DataPtrWatch(watch.DATA_PTR_FN, ts, layout)
    hows = ("data", "grow", "free_storage", "offset", "shift", "empty")
    for i, pos in enumerate(POSITIONS):
        _change(ts[pos], hows[i % len(hows)])
    assert w.changed() == POSITIONS
    assert w.changed() == POSITIONS  # and again: a changed tensor stays changed


def test_raw_words_that_move_without_the_data_ptr_are_not_a_change():
    layout = _layout(True)
    ts = _tensors()
    w = _C.DataPtrWatch(watch.DATA_PTR_FN, ts, layout)
    for pos in POSITIONS:  # a new storage object over the same memory: the raw words move, data_ptr does not
        t = ts[pos]
        t.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        t.data = t.data.view(t.shape)
    assert w.changed() == []
    ts[3].data = ts[3].data.clone()
    assert w.changed() == [3]


def test_a_wrong_raw_layout_fails_its_proof():
    layout = _layout(True)
    assert watch._proven(watch.DATA_PTR_FN, layout)
    for k in range(3):  # each TensorImpl word pointed one word off
        wrong = tuple(off + 8 if i == k else off for i, off in enumerate(layout))
        assert not watch._proven(watch.DATA_PTR_FN, wrong), wrong
    # The StorageImpl word after the data pointer (its deleter context) moves with it in every
    # change a proof can make; the discovery tells them apart on a foreign buffer's storage.
    t = torch.frombuffer(bytearray(64), dtype=torch.float32)
    row = (ctypes.c_uint64 * 8).from_address(t.untyped_storage()._cdata)
    assert row[layout[3] // 8] == t.data_ptr() and row[layout[3] // 8 + 1] != t.data_ptr()


def test_data_ptr_watch_refuses_what_is_not_a_tensor():
    if not watch.DATA_PTR_FN:
        pytest.skip("this torch exports no C data_ptr reader")
    with pytest.raises(TypeError, match="item 1"):
        _C.DataPtrWatch(watch.DATA_PTR_FN, [torch.zeros(2), object()])
    with pytest.raises(Exception, match="TensorImpl offset"):  # offsets outside a TensorImpl are refused
        _C.DataPtrWatch(watch.DATA_PTR_FN, [torch.zeros(2)], (16, 4096, 8, 16))


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


BIG = 5000  # above the size where helper threads share the check


CHUNK = 512  # tensors a thread takes at a time (bind_watch.cc kChunk)


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "shim"])
@pytest.mark.parametrize("threads", [2, 4, 7])
def test_a_threaded_check_finds_changes_at_its_chunks_edges(raw, threads):
    layout = _layout(raw)
    ts = [torch.arange(4.0 + i % 3)[i % 2:] for i in range(BIG)]
    w = _C.DataPtrWatch(watch.DATA_PTR_FN, ts, layout, threads)
    assert w.changed() == []
    edges = sorted({min(max(c * CHUNK + d, 0), BIG - 1) for c in range(BIG // CHUNK + 2) for d in (-1, 0, 1)})
    hows = ("data", "grow", "free_storage", "offset", "shift", "empty")
    for i, pos in enumerate(edges):
        _change(ts[pos], hows[i % len(hows)])
    assert w.changed() == edges
    assert w.changed() == edges


def test_threaded_checks_back_to_back_and_from_two_threads():
    # Runs follow each other faster than helpers wake, and two plans may check at once.
    import threading

    if not watch.DATA_PTR_FN:
        pytest.skip("this torch exports no C data_ptr reader")
    layout = watch._discover()
    sets = [[torch.zeros(2) for _ in range(BIG)] for _ in range(2)]
    watches = [_C.DataPtrWatch(watch.DATA_PTR_FN, ts, layout, 4) for ts in sets]
    sets[1][777].data = torch.zeros(3)
    want = [[], [777]]
    errors: list[str] = []

    def check(k: int) -> None:
        for _ in range(150):
            got = watches[k].changed()
            if got != want[k]:
                errors.append(f"watch {k}: {got}")

    threads = [threading.Thread(target=check, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_threaded_check_works_in_a_forked_child():
    if not watch.DATA_PTR_FN or not hasattr(os, "fork"):
        pytest.skip("no C data_ptr reader, or no fork")
    ts = [torch.zeros(2) for _ in range(BIG)]
    w = _C.DataPtrWatch(watch.DATA_PTR_FN, ts, watch.RAW_LAYOUT, 4)
    assert w.changed() == []  # the parent's helper threads exist now; a child has none of them
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            ts[4321].data = torch.zeros(3)
            os.write(write, repr(w.changed()).encode())
        finally:
            os._exit(0)
    os.close(write)
    got = os.read(read, 1000).decode()
    os.waitpid(pid, 0)
    assert got == "[4321]"
    assert w.changed() == []


def test_threads_are_checked():
    if not watch.DATA_PTR_FN:
        pytest.skip("this torch exports no C data_ptr reader")
    for bad in (0, 65):
        with pytest.raises(Exception, match="threads must be 1..64"):
            _C.DataPtrWatch(watch.DATA_PTR_FN, [torch.zeros(2)], None, bad)


def test_importing_the_package_makes_no_cuda_context(tmp_path):
    # The storage check's probes run at import: on CUDA tensors they would make a context on
    # whatever device is current, before the caller picked its own.
    import reshard_ext

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(reshard_ext.__file__))))
    code = "import reshard_ext, torch; print(torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_the_helper_pool_grows_to_the_most_threads_asked(tmp_path):
    if not watch.DATA_PTR_FN or not os.path.isdir("/proc/self/task"):
        pytest.skip("no C data_ptr reader, or no /proc")
    import reshard_ext

    code = """
import os, torch
from reshard_ext import _C, watch
ts = [torch.zeros(2) for _ in range(5000)]
tasks = lambda: len(os.listdir("/proc/self/task"))
counts = [tasks()]
for threads in (3, 2, 6):
    assert _C.DataPtrWatch(watch.DATA_PTR_FN, ts, watch.RAW_LAYOUT, threads).changed() == []
    counts.append(tasks())
print([c - counts[0] for c in counts[1:]])
"""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(reshard_ext.__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[2, 2, 5]"  # helpers: 2 for 3 threads, none more for 2, 3 more for 6
