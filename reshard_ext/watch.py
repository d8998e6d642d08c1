"""The storages a plan bound, checked before every execute (DESIGN section 2): a tensor whose
storage was replaced (`param.data = ...`, `set_`) or resized (`resize_`, FSDP-style
`untyped_storage().resize_(0)`) since binding would make the kernels read or write memory
it no longer owns. See benchmarks/host_overhead.py for its cost."""
from __future__ import annotations

import logging
import operator
import weakref
from typing import Any

import torch

from . import _C
from .transforms import Piece

log = logging.getLogger("reshard_ext")

_PTR = torch.Tensor.data_ptr
_NBYTES = operator.attrgetter("nbytes")
_FAST_TYPES = (torch.Tensor, torch.nn.Parameter)  # exact types: a subclass may define its own data_ptr


def _torch_data_ptr_fn() -> int:
    """The address of torch's C function `void* (PyObject* tensor)` that reads a tensor's
    data_ptr (exported for Inductor's C++ wrappers), or 0 where this torch has none or it
    reads other pointers than Tensor.data_ptr."""
    try:
        fn = int(torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr)  # type: ignore[attr-defined]
        probe = [torch.empty(4)[1:], torch.nn.Parameter(torch.empty(3), requires_grad=False)]
        if list(_C.DataPtrWatch(fn, probe).ptrs) == [_PTR(t) for t in probe]:
            return fn
    except Exception as e:  # noqa: BLE001 - any failure means: use Tensor.data_ptr
        log.debug("bound-storage check: torch's C data_ptr reader is unusable (%s: %s)", type(e).__name__, e)
        return 0
    log.debug("bound-storage check: torch's C data_ptr reader reads other pointers than Tensor.data_ptr")
    return 0


DATA_PTR_FN = _torch_data_ptr_fn()  # 0: Tensor.data_ptr per tensor (tests set it to 0 to run that path)
log.debug("bound-storage check: %s", "one C++ loop over torch's C data_ptr reader" if DATA_PTR_FN else
          "Tensor.data_ptr per tensor")


class Watch:
    """Every bound tensor's data_ptr at binding, compared before each execute; plus whether
    a bound storage was freed. Why data_ptr is enough for memory safety: reallocating,
    resizing or replacing a storage moves the pointer (the old allocation is still live while
    the new one is made), except when the old storage is freed first and a new one happens to
    start at the same address, which the freed signal (a weakref callback per storage, no
    per-execute cost) catches; a tensor resize_ that keeps the pointer stays inside memory
    its storage owns."""

    def __init__(self, entries: dict[str, dict]):
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
        self.fast = _C.DataPtrWatch(DATA_PTR_FN, [self.tensors[i] for i in fast]) if fast else None
        self._fast_index = fast
        fast_set = set(fast)
        self.slow = [i for i in range(len(self.tensors)) if i not in fast_set]
        self._slow_tensors = [self.tensors[i] for i in self.slow]
        self._slow_ptrs = [self.ptrs[i] for i in self.slow]

    def changed(self, rank: int) -> str:
        """"" when every bound tensor still has its storage, else what changed."""
        bad = [self._fast_index[i] for i in self.fast.changed()] if self.fast is not None else []
        if self.slow and list(map(_PTR, self._slow_tensors)) != self._slow_ptrs:
            bad += [i for i, t, p in zip(self.slow, self._slow_tensors, self._slow_ptrs) if _PTR(t) != p]
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
        return (f"rx.execute on rank {rank}: bound tensors were replaced or resized since rx.plan / plan.rebind{more}; "
                f"call plan.rebind(...) with the current tensors:\n  " + "\n  ".join(lines))
