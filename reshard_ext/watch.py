"""The storages a plan bound, checked before every execute (DESIGN section 2): a tensor whose
storage was replaced (`param.data = ...`, `set_`) or resized (`resize_`, FSDP-style
`untyped_storage().resize_(0)`) since binding would make the kernels read or write memory
it no longer owns. See benchmarks/host_overhead.py for its cost."""
from __future__ import annotations

import ctypes
import logging
import operator
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch

from . import _C, torch_shim
from .transforms import Piece

log = logging.getLogger("reshard_ext")

_PTR = torch.Tensor.data_ptr
_NBYTES = operator.attrgetter("nbytes")
_FAST_TYPES = (torch.Tensor, torch.nn.Parameter)  # exact types: a subclass may define its own data_ptr


def _torch_data_ptr_fn() -> int:
    """The address of torch's C shim function aoti_torch_get_data_ptr, or 0 where this torch
    has none or it reads other pointers than Tensor.data_ptr (probed)."""
    try:
        fn = torch_shim.function("get_data_ptr")
        base = torch.arange(12.0)
        probe = [base[1:], base.view(3, 4).t(), torch.empty(0),
                 torch.nn.Parameter(torch.empty(3, dtype=torch.bfloat16), requires_grad=False)]
        if list(_C.DataPtrWatch(fn, probe).ptrs) == [_PTR(t) for t in probe]:
            return fn
    except Exception as e:  # noqa: BLE001 - any failure means: use Tensor.data_ptr
        log.debug("bound-storage check: torch's C shim is unusable (%s: %s)", type(e).__name__, e)
        return 0
    log.debug("bound-storage check: torch's C shim reads other pointers than Tensor.data_ptr")
    return 0


DATA_PTR_FN = _torch_data_ptr_fn()  # 0: Tensor.data_ptr per tensor (tests set it to 0 to run that path)

_IMPL_WORDS, _STORAGE_WORDS = 24, 8  # how far into a TensorImpl / StorageImpl offsets are looked for


def _offset(probes: list[torch.Tensor], addr: Callable[[torch.Tensor], int], words: int,
            value: Callable[[torch.Tensor], int]) -> int | None:
    """The lowest byte offset, past the object's first word, that holds `value(t)` at
    `addr(t)` in every probe; None if there is none."""
    common: set[int] | None = None
    for t in probes:
        row = (ctypes.c_uint64 * words).from_address(addr(t))
        found = {8 * i for i in range(1, words) if row[i] == value(t) & (2**64 - 1)}
        common = found if common is None else common & found
    return min(common) if common else None


def _proven(fn: int, layout: tuple[int, int, int, int]) -> bool:
    """Whether a DataPtrWatch with `layout` reports exactly the tensors whose data_ptr moved,
    for every kind of change the check exists for and for changes that keep data_ptr."""
    changes: list[Callable[[torch.Tensor], Any]] = [
        lambda t: None,
        lambda t: setattr(t, "data", t.data.clone()),
        lambda t: setattr(t, "data", t.data[1:]),  # same storage, another offset and numel
        lambda t: t.set_(t.untyped_storage(), 0, t.shape, t.stride()),  # another offset alone
        lambda t: t.resize_(4096),  # a new allocation
        lambda t: t.untyped_storage().resize_(0),  # freed, as FSDP frees parameters
        lambda t: t.resize_(0),  # empty: data_ptr is null
        lambda t: t.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride()),  # nothing moves
        lambda t: setattr(t, "data", t.data.view(t.shape)),  # a new view of the same bytes
    ]
    # CPU tensors only: the layout is the same on every device, and a CUDA probe at import
    # would make a CUDA context on whatever device is current
    ts = [torch.arange(6.0 + i)[1:] for i in range(3 * len(changes))]
    ts += [torch.nn.Parameter(torch.zeros(5), requires_grad=False)]
    before = [_PTR(t) for t in ts]
    w = _C.DataPtrWatch(fn, ts, layout)
    for i, t in enumerate(ts):
        changes[i % len(changes)](t)
    truth = [i for i, t in enumerate(ts) if _PTR(t) != before[i]]
    return bool(w.raw) and w.changed() == truth and w.changed() == truth


def _discover() -> tuple[int, int, int, int] | None:
    """Where a TensorImpl keeps its storage, storage offset and numel and a StorageImpl its
    data pointer, as found on probe tensors (not yet proven), or None."""
    # over a foreign buffer: its storage's deleter context differs from its data pointer
    base = torch.frombuffer(bytearray(1600), dtype=torch.float32)
    probes = [base[o:o + a * b].view(a, b) for a, b, o in ((3, 5, 7), (4, 6, 11), (2, 9, 13))]
    impl, storage = (lambda t: t._cdata), (lambda t: t.untyped_storage()._cdata)
    found = [_offset(probes, impl, _IMPL_WORDS, storage),
             _offset(probes, impl, _IMPL_WORDS, lambda t: int(t.storage_offset())),
             _offset(probes, impl, _IMPL_WORDS, lambda t: int(t.numel())),
             _offset(probes, storage, _STORAGE_WORDS, lambda t: t.untyped_storage().data_ptr())]
    if None in found:
        log.debug("bound-storage check: no raw layout found on the probes (%s)", found)
        return None
    return cast(tuple[int, int, int, int], tuple(found))


def _raw_layout(fn: int) -> tuple[int, int, int, int] | None:
    """The discovered raw layout once proven (_proven), else None (the shim alone)."""
    if not fn:
        return None
    try:
        layout = _discover()
        if layout is None or _proven(fn, layout):
            return layout
        log.debug("bound-storage check: raw layout %s failed its proof", layout)
    except Exception as e:  # noqa: BLE001 - any failure means: the shim for every tensor
        log.debug("bound-storage check: raw layout unusable (%s: %s)", type(e).__name__, e)
    return None


RAW_LAYOUT = _raw_layout(DATA_PTR_FN)  # None: a shim call per tensor
log.debug("bound-storage check: %s", ("one C++ loop over raw words, torch's C shim where one moved" if RAW_LAYOUT else
          "one C++ loop over torch's C shim") if DATA_PTR_FN else "Tensor.data_ptr per tensor")


class Watch:
    """Every bound tensor's data_ptr at binding, compared before each execute; plus whether
    a bound storage was freed. Why data_ptr is enough for memory safety: reallocating,
    resizing or replacing a storage moves the pointer (the old allocation is still live while
    the new one is made), except when the old storage is freed first and a new one happens to
    start at the same address, which the freed signal (a weakref callback per storage, no
    per-execute cost) catches. A tensor resize_ that keeps the pointer changes its numel,
    which is compared too (where the raw layout is read, and for the tensors read through
    Python): the plan would write past the tensor."""

    def __init__(self, entries: dict[str, dict], threads: int = 1):
        self.where: list[tuple[str, str]] = []
        self.tensors: list[torch.Tensor] = []
        for side in ("src", "dst"):
            for name, (t, _) in entries[side].items():
                for x in t.tensors() if isinstance(t, Piece) else (t,):
                    self.where.append((side, name))
                    self.tensors.append(x)
        self.ptrs = list(map(_PTR, self.tensors))
        self.sizes = list(map(_NBYTES, self.tensors))
        self.freed: list[Any] = []  # a bound storage died (its weakrefs, appended by their callbacks)
        self._refs = [weakref.ref(x.untyped_storage(), self.freed.append) for x in self.tensors]
        fast = [i for i, x in enumerate(self.tensors) if type(x) in _FAST_TYPES] if DATA_PTR_FN else []
        self.fast = _C.DataPtrWatch(DATA_PTR_FN, [self.tensors[i] for i in fast], RAW_LAYOUT, threads) if fast else None
        self._fast_index = fast
        fast_set = set(fast)
        self.slow = [i for i in range(len(self.tensors)) if i not in fast_set]
        self._slow_tensors = [self.tensors[i] for i in self.slow]
        self._slow_ptrs = [self.ptrs[i] for i in self.slow]
        self._slow_numels = [self.tensors[i].numel() for i in self.slow]

    def changed(self, rank: int) -> str:
        """"" when every bound tensor still has its storage and size, else what changed (one line)."""
        bad = [self._fast_index[i] for i in self.fast.changed()] if self.fast is not None else []
        if self.slow and (list(map(_PTR, self._slow_tensors)) != self._slow_ptrs
                          or [t.numel() for t in self._slow_tensors] != self._slow_numels):
            bad += [i for i, t, p, n in zip(self.slow, self._slow_tensors, self._slow_ptrs, self._slow_numels)
                    if _PTR(t) != p or t.numel() != n]
        if self.freed:
            bad += [i for i, r in enumerate(self._refs) if r() is None]
        if not bad:
            return ""
        bad = sorted(set(bad))
        lines = []
        for i in bad[:5]:
            t = self.tensors[i]
            freed = ", its storage freed" if self._refs[i]() is None else ""
            lines.append(f"{self.where[i][0]} tensor '{self.where[i][1]}': data_ptr {self.ptrs[i]:#x} -> "
                         f"{_PTR(t):#x}, {self.sizes[i]} -> {t.nbytes} bytes{freed}")
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        return (f"bound tensors were replaced or resized since rx.plan / plan.rebind{more}; call plan.rebind(...) "
                f"with the current tensors: " + "; ".join(lines))
