"""Recording stand-ins for Hugging Face tensors, and the dispatch mode that follows them
through an engine's ``load_weights``.

A `HFWeight` holds no data: two meta tensors say what it is. ``geom`` has the shape and
strides the real tensor would have at this step of the loader (so the loader's own checks
and views behave as with real data); ``prov`` is a strided view of a flat meta base of the
Hugging Face tensor's element count, so that its storage offset and strides are the affine
map from this tensor's elements to the Hugging Face tensor's (row-major) elements. Every
view op applies to both; a copy that keeps values (``clone``, ``contiguous``, an exact
widening cast, a device move) keeps ``prov``. Any other op still yields a correctly shaped
HFWeight, with ``prov`` None and the reason kept: the loader runs on, and whatever that
value lands in is known to be untraced.

`Recorder` sees every aten op while the loader runs (a TorchDispatchMode):
- ``param_region.copy_(hf_weight)`` into a parameter or buffer of the model is a `Landing`
  (written nowhere; the refit writes it later);
- a copy into any other tensor, an in-place change of a weight, a write from a weight by
  any other op (``index_put_``, ``add_``), a loader step that changes or reads a
  parameter region after a weight landed there, or two weights landing on the same
  elements mark the weights involved as untraced (the safe path), with the reason;
- an op that needs the data (``.item()``, a comparison read in Python, an op meta tensors
  cannot run) raises `NeedsData`, which the tracing driver turns into the safe path for the
  weights involved;
- the loader's own writes of constants into parameters (``fill_(0)`` of a padded
  vocabulary's rows) run for real and are recorded as `Fill`.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import ReshardError
from .boxes import Region, View, locate

aten = torch.ops.aten
Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]  # Hugging Face name -> (global shape, dtype)

# Ops that copy values unchanged (a dtype change is checked separately: only exact ones keep the trace).
_VALUE_COPIES = {aten.clone.default, aten._to_copy.default, aten.lift_fresh_copy.default, aten.contiguous.default}
# Ops whose result depends on a weight's shape and dtype only: they run for real.
_SHAPE_ONLY = {aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
               aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
               aten.new_empty_strided.default}
# Writes of one constant: recorded so a rebind can repeat them on new storage.
_FILLS = {aten.fill_.Scalar, aten.zero_.default}


class NeedsData(Exception):
    """A loader step that reads a traced weight's values (it cannot run without data)."""

    def __init__(self, sources: frozenset[str], what: str):
        super().__init__(what)
        self.sources = sources
        self.what = what


class HFWeight(torch.Tensor):
    """A stand-in for one Hugging Face tensor (or a value derived from some), carrying only
    shapes and provenance. See the module docstring."""

    _geom: torch.Tensor
    _prov: torch.Tensor | None
    _sources: frozenset[str]
    _why: str

    @staticmethod
    def __new__(cls, geom: torch.Tensor, prov: torch.Tensor | None, sources: frozenset[str], why: str,
                device: torch.device) -> HFWeight:
        t = torch.Tensor._make_wrapper_subclass(cls, geom.shape, strides=geom.stride(),
                                                storage_offset=geom.storage_offset(), dtype=geom.dtype,
                                                device=device, requires_grad=False)
        t._geom, t._prov, t._sources, t._why = geom, prov, sources, why
        return t

    @classmethod
    def fresh(cls, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> HFWeight:
        """The stand-in the loader receives for Hugging Face tensor `name`."""
        geom = torch.empty(shape, dtype=dtype, device="meta")
        prov = torch.empty(math.prod(shape), dtype=dtype, device="meta").as_strided(shape, geom.stride(), 0)
        return cls(geom, prov, frozenset((name,)), "", device)

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise ReshardError(f"a traced Hugging Face weight ({func}) was used after the trace of the engine's "
                           f"load_weights ended: the loader kept it; reshard_ext cannot trace such a loader")

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # the default reads data
        kept = "traced" if self._prov is not None else f"untraced: {self._why}"
        return f"HFWeight({', '.join(sorted(self._sources))}, shape={tuple(self.shape)}, {self.dtype}, {kept})"


def _retyped(prov: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`prov`'s element map with another element type (a cast keeps positions)."""
    if prov.dtype == dtype:
        return prov
    base = torch.empty(prov.untyped_storage().nbytes() // prov.element_size(), dtype=dtype, device="meta")
    return base.as_strided(prov.shape, prov.stride(), prov.storage_offset())


def exact_cast(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether every value of dtype `a` is exactly a value of `b` (so a cast to `b` and on
    to the parameter's dtype equals the direct cast reshard_ext makes)."""
    if a == b:
        return True
    if a.is_floating_point and b.is_floating_point:
        fa, fb = torch.finfo(a), torch.finfo(b)
        return fb.bits >= fa.bits and fb.max >= fa.max and fb.eps <= fa.eps and fb.smallest_normal <= fa.smallest_normal
    if a.is_floating_point or b.is_floating_point or a.is_complex or b.is_complex or torch.bool in (a, b):
        return False
    ia, ib = torch.iinfo(a), torch.iinfo(b)
    return ib.min <= ia.min and ib.max >= ia.max


@dataclass(frozen=True)
class Landing:
    """One traced copy: `box` of Hugging Face tensor `name` (a run per dim) fills `view`."""

    name: str
    box: tuple[tuple[tuple[int, int], ...], ...]
    view: View


@dataclass(frozen=True)
class Fill:
    """A constant the loader wrote into a parameter region (e.g. padded vocabulary rows)."""

    view: View
    value: Any


@dataclass(frozen=True)
class Write:
    """A loader step that wrote an element range [lo, hi) (bytes) of a parameter's storage.
    kind: "landing" (a traced copy of `names`), "untraced" (values of `names` the trace
    lost), "loader" (the loader's own write of values of no traced weight: a fill, or
    anything while it handles a weight fed as a real tensor, then `names` is that weight)."""

    seq: int
    lo: int
    hi: int
    names: frozenset[str]
    kind: str


class Targets:
    """The model's parameters and buffers, found from any view of their storage."""

    def __init__(self, model: torch.nn.Module):
        self.by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self.named: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            if t is None or id(t) in seen or t.numel() == 0 or t.device.type == "meta":
                continue
            seen.add(id(t))
            self.named[name] = t
            self.by_storage.setdefault(t.untyped_storage().data_ptr(), []).append((name, t))

    def snapshot(self) -> dict[str, tuple]:
        """What must not change while a loader is traced (a loader that replaces a
        parameter writes where the trace cannot follow)."""
        return {n: _where(t) for n, t in self.named.items()}

    def owner(self, t: torch.Tensor) -> tuple[str, torch.Tensor] | str:
        """The parameter or buffer whose elements the view `t` lies in, or why there is none."""
        found = self.by_storage.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if not found:
            return "a tensor that is not a parameter or buffer of the model (a temporary)"
        lo, hi = Region.of(t).span()
        for name, p in found:
            plo, phi = Region.of(p).span()
            if p.dtype == t.dtype and plo <= lo and hi <= phi:
                return name, p
        return f"a view of parameter '{found[0][0]}' of another dtype or across parameters"


def _where(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device)


class Recorder(TorchDispatchMode):
    """The dispatch mode of one trace (see the module docstring). `specs`: the Hugging
    Face tensors fed to the loader, name -> (shape, dtype)."""

    def __init__(self, targets: Targets, specs: Specs, feed: Feed):
        super().__init__()
        self.targets, self.specs, self.feed, self.device = targets, specs, feed, feed.device
        self.landings: list[Landing] = []
        self.fills: list[Fill] = []
        self.untraced: dict[str, str] = {}  # weight name -> why
        self.writes: dict[int, list[Write]] = {}  # storage -> writes, in loader order
        self._seq = 0

    # -- bookkeeping ----------------------------------------------------------------------

    def untrace(self, names: frozenset[str], why: str) -> None:
        """Sends weights `names` to the safe path (the first reason given stays)."""
        for n in sorted(names):
            self.untraced.setdefault(n, why)

    def _write(self, t: torch.Tensor, names: frozenset[str], kind: str) -> None:
        lo, hi = Region.of(t).span()
        self._seq += 1
        self.writes.setdefault(t.untyped_storage().data_ptr(), []).append(Write(self._seq, lo, hi, names, kind))

    # -- dispatch -------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        weights = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, HFWeight)]
        self._reads(func, args, kwargs)
        if not weights:
            self._watch(func, args, kwargs)
            return func(*args, **kwargs)
        sources = frozenset().union(*(w._sources for w in weights))
        if func is aten.copy_.default:
            return self._copy(args[0], args[1], sources)
        written = _mutated(func, args, kwargs)
        if written:
            for t in written:
                if isinstance(t, HFWeight):
                    self.untrace(t._sources | sources, f"the loader changes the weight in place ({func})")
                else:
                    self._write(t, sources, "untraced")
                    self.untrace(sources, f"written into a tensor by {func}, which reshard_ext does not trace")
            return args[0]
        if func in _SHAPE_ONLY:
            return func(*_real_like(args), **_real_like(kwargs))
        if func in _VALUE_COPIES:
            return self._value_copy(func, args, kwargs, sources)
        if func.is_view and func is not aten.view.dtype:
            return self._view(func, args, kwargs, sources)
        if func is aten._unsafe_view.default:  # reshape's view after a copy
            return self._view(aten.view.default, args, kwargs, sources)
        return self._compute(func, args, kwargs, sources)

    def _reads(self, func: Any, args: Any, kwargs: Any) -> None:
        """A step that reads parameter elements a weight landed in reads what the trace never
        wrote there (the refit writes them later): that weight takes the safe path, whose
        loader call redoes the step with its values."""
        if func.is_view:  # views read no data
            return
        written = {id(t) for t in _mutated(func, args, kwargs)}
        for t in pytree.tree_leaves((args, kwargs)):
            if (not isinstance(t, torch.Tensor) or isinstance(t, HFWeight) or id(t) in written or not t.numel()
                    or t.device.type == "meta"):
                continue
            ws = self.writes.get(t.untyped_storage().data_ptr())
            if not ws:
                continue
            lo, hi = Region.of(t).span()
            for w in ws:
                if w.kind == "landing" and w.lo < hi and lo < w.hi:
                    self.untrace(w.names, f"the loader reads back the elements it copied it into ({func})")

    def _watch(self, func: Any, args: Any, kwargs: Any) -> None:
        """A loader step on real tensors only: writes into parameters are noted."""
        for t in _mutated(func, args, kwargs):
            if isinstance(t, torch.Tensor) and t.numel() and t.device.type != "meta":
                owner = self.targets.owner(t)
                if isinstance(owner, str):
                    continue
                real = self.feed.real_now
                self._write(t, frozenset((real,)) if real else frozenset(), "loader")
                if func in _FILLS and not real:
                    value = 0 if func is aten.zero_.default else args[1]
                    self.fills.append(Fill(View.of(owner[0], owner[1], t), value))

    def _copy(self, dst: Any, src: Any, sources: frozenset[str]) -> Any:
        if isinstance(dst, HFWeight):
            self.untrace(sources, "the loader copies into the weight it was given")
            return dst
        if not isinstance(src, HFWeight) or dst.numel() == 0:  # nothing of a weight lands
            return dst
        owner = self.targets.owner(dst)
        if isinstance(owner, str):
            self.untrace(sources, f"copied into {owner}")
            return dst
        pname, param = owner
        prov, why = src._prov, src._why
        if prov is not None:
            why = _cast_problem(src.dtype, dst.dtype)
            if not why and tuple(prov.shape) != tuple(dst.shape):
                try:
                    prov = prov.expand(dst.shape)
                except RuntimeError as e:
                    why = f"shapes {tuple(src.shape)} and {tuple(dst.shape)} do not match ({e})"
        if prov is not None and not why:
            (name,) = src._sources
            found = locate(self.specs[name][0], int(prov.storage_offset()), tuple(prov.shape), prov.stride(),
                           tuple(dst.stride()))
            if isinstance(found, str):
                why = found
            else:
                box, sizes, strides = found
                view = View.of(pname, param, dst).reshaped(sizes, strides)
                self._write(dst, sources, "landing")
                self.landings.append(Landing(name, box, view))
                return dst
        self._write(dst, sources, "untraced")
        self.untrace(sources, f"{why} (into parameter '{pname}')")
        return dst

    def _needs(self, sources: frozenset[str], what: str) -> NeedsData:
        # Kept here too: a loader that catches the exception must not hide the step.
        self.untrace(sources, f"the loader reads its values: {what}")
        return NeedsData(sources, what)

    def _value_copy(self, func: Any, args: Any, kwargs: Any, sources: frozenset[str]) -> Any:
        src = args[0]
        geom = func(src._geom, *args[1:], **_metas(kwargs, device=True))
        prov, why = src._prov, src._why
        if prov is not None:
            why = "" if exact_cast(src.dtype, geom.dtype) else \
                f"the loader casts {src.dtype} to {geom.dtype} (not exact) before the copy"
            prov = _retyped(prov, geom.dtype) if not why else None
        return HFWeight(geom, prov, sources, why, _device(kwargs, src.device))

    def _view(self, func: Any, args: Any, kwargs: Any, sources: frozenset[str]) -> Any:
        geom = func(*_metas(args), **_metas(kwargs))  # raises as the real view would
        provs: Any = None
        why = ""
        if any(w._prov is None for w in pytree.tree_leaves(args) if isinstance(w, HFWeight)):
            why = next(w._why for w in pytree.tree_leaves(args) if isinstance(w, HFWeight) and w._prov is None)
        else:
            try:
                provs = func(*_metas(args, prov=True), **_metas(kwargs))
            except RuntimeError as e:
                why = f"{func} of a copied slice is not a view of the weight ({e})"
        device = next(w.device for w in pytree.tree_leaves(args) if isinstance(w, HFWeight))
        if isinstance(geom, torch.Tensor):
            return HFWeight(geom, provs, sources, why, device)
        provs = provs if provs is not None else [None] * len(geom)
        return type(geom)(HFWeight(g, p, sources, why, device) for g, p in zip(geom, provs))

    def _compute(self, func: Any, args: Any, kwargs: Any, sources: frozenset[str]) -> Any:
        try:
            out = func(*_metas(args), **_metas(kwargs, device=True))
        except Exception as e:  # noqa: BLE001 - meta tensors cannot run it: it reads data
            raise self._needs(sources, f"{func} needs the weight's values ({type(e).__name__}: {e})") from None
        device = next(w.device for w in pytree.tree_leaves(args) if isinstance(w, HFWeight))
        why = f"computed by {func}"
        if not any(isinstance(o, torch.Tensor) for o in pytree.tree_leaves(out)):
            raise self._needs(sources, f"{func} returns values of the weight to Python")
        return pytree.tree_map(lambda o: HFWeight(o, None, sources, why, device)
                               if isinstance(o, torch.Tensor) else o, out)


def _device(kwargs: Any, default: torch.device) -> torch.device:
    d = kwargs.get("device")
    return torch.device(d) if d is not None else default


_CONVERTIBLE = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


def _cast_problem(src: torch.dtype, dst: torch.dtype) -> str:
    if src != dst and not {src, dst} <= _CONVERTIBLE:
        return f"the copy casts {src} to {dst}; reshard_ext converts only among float16, bfloat16, float32, float64"
    return ""


def _metas(tree: Any, prov: bool = False, device: bool = False) -> Any:
    """`tree` with HFWeights as their meta geometry (or provenance), real tensors as meta
    tensors of their shape and strides, and (device=True) a device keyword as meta."""
    def meta(x: Any) -> Any:
        if isinstance(x, HFWeight):
            return x._prov if prov else x._geom
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        return x

    out = pytree.tree_map(meta, tree)
    if device and isinstance(out, dict) and out.get("device") is not None:
        out = dict(out, device="meta")
    return out


def _real_like(tree: Any) -> Any:
    return pytree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device=x.device)
                           if isinstance(x, HFWeight) else x, tree)


def _mutated(func: Any, args: Any, kwargs: Any) -> list[Any]:
    """The arguments `func` writes into (its schema's mutable inputs)."""
    out: list[Any] = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            out.extend(t for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor))
    return out


class Feed:
    """The (name, tensor) items given to the loader: an HFWeight each, except the weights
    in `real`, given as zero tensors (a loader step needs their values; their landings are
    not traced, and the engine's loader takes them after every refit). Remembers the item
    the loader took last."""

    def __init__(self, specs: Specs, real: set[str], device: torch.device):
        self.specs, self.real, self.device = specs, real, device
        self.last: str | None = None

    @property
    def real_now(self) -> str | None:
        """The weight the loader took last, if it was given as a real tensor."""
        return self.last if self.last in self.real else None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, (shape, dtype) in self.specs.items():
            self.last = name
            if name in self.real:
                yield name, torch.zeros(shape, dtype=dtype, device=self.device)
            else:
                yield name, HFWeight.fresh(name, shape, dtype, self.device)
