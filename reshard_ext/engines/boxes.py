"""Geometry of a traced copy: which box of a Hugging Face tensor lands in which strided
region of an engine parameter, in the form plan entries take (a view of the parameter
with one dim per Hugging Face dim, holding the box's elements in order).

A loader's slice of a Hugging Face tensor reaches the copy as an affine map (storage
offset and strides over the tensor's row-major elements), after any chain of narrow,
chunk, split, select, view, reshape, transpose, permute, expand of size-1 dims and
indexing by slices. `locate` turns that map into per-dim runs of the Hugging Face tensor
and the matching strides of the destination; a map that is no box (steps, broadcasts,
reversed or overlapping elements, a reshape that interleaves dims) says why instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Box = tuple[tuple[tuple[int, int], ...], ...]  # per dim: runs (start, length) in local order


@dataclass(frozen=True)
class Region:
    """A strided element region of a storage (offset and strides in elements)."""

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int

    @classmethod
    def of(cls, t: torch.Tensor) -> Region:
        """The region `t` covers of its storage."""
        return cls(int(t.storage_offset()), tuple(t.shape), t.stride(), t.element_size())

    def span(self) -> tuple[int, int]:
        """[lo, hi) in bytes of the storage: every element lies within (empty: lo == hi)."""
        if any(n == 0 for n in self.sizes):
            return self.offset * self.itemsize, self.offset * self.itemsize
        lo = self.offset + sum((n - 1) * s for n, s in zip(self.sizes, self.strides) if s < 0)
        hi = self.offset + sum((n - 1) * s for n, s in zip(self.sizes, self.strides) if s > 0) + 1
        return lo * self.itemsize, hi * self.itemsize


@dataclass(frozen=True)
class View:
    """A strided view of parameter `param`: storage offset relative to the parameter's own."""

    param: str
    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def of(cls, name: str, param: torch.Tensor, t: torch.Tensor) -> View:
        """`t`, a view of parameter `param` (named `name`), as a View."""
        return cls(name, int(t.storage_offset() - param.storage_offset()), tuple(t.shape), t.stride())

    def reshaped(self, sizes: tuple[int, ...], strides: tuple[int, ...]) -> View:
        """The same first element with other sizes and strides."""
        return View(self.param, self.offset, sizes, strides)

    def on(self, param: torch.Tensor) -> torch.Tensor:
        """This view of `param` (the parameter as it is now: after a rebind, new storage)."""
        return param.detach().as_strided(self.sizes, self.strides, param.storage_offset() + self.offset)


def _contiguous(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def locate(shape: tuple[int, ...], offset: int, sizes: tuple[int, ...], strides: tuple[int, ...],
           dst_strides: tuple[int, ...]) -> tuple[Box, tuple[int, ...], tuple[int, ...]] | str:
    """The box of a Hugging Face tensor of `shape` that the affine map (`offset`, `sizes`,
    `strides`; no size 0) reads, and the sizes and strides (one per Hugging Face dim) of the view of a
    destination with strides `dst_strides` (over `sizes`) that holds it; or why the map is
    no box.

    Each dim of the map is cut into atoms that stay within one Hugging Face dim (a
    flattened dim spans several); the atoms of a Hugging Face dim must then join into one
    contiguous run, in the source and in the destination alike."""
    nd = len(shape)
    cont = _contiguous(shape)
    atoms: list[list[tuple[int, int, int]]] = [[] for _ in range(nd)]  # per HF dim: (n, stride, dst stride)
    if any(n == 0 for n in sizes):
        return "an empty slice"
    for n, s, rs in zip(sizes, strides, dst_strides):
        if n == 1:
            continue
        while True:
            d = _dim_of(s, shape, cont)
            if d is None:
                return f"the loader reads with stride {s} {'(a broadcast)' if s == 0 else ''}".rstrip() + \
                       f", not along a dim of the {list(shape)} weight"
            if s % cont[d]:
                return f"the loader reads with stride {s} across dims of the {list(shape)} weight"
            q = s // cont[d]
            if n * q <= shape[d]:
                atoms[d].append((n, s, rs))
                break
            if shape[d] % q or n % (shape[d] // q):
                if q > 1:
                    return f"the loader takes every {q}th element of dim {d} of the {list(shape)} weight"
                return f"the loader's slice of the {list(shape)} weight wraps around dim {d}"
            inner = shape[d] // q
            atoms[d].append((inner, s, rs))
            n, s, rs = n // inner, s * inner, rs * inner
    lens, view_strides = [], []
    for d in range(nd):
        run = sorted(atoms[d], key=lambda a: -a[1])
        while len(run) > 1:
            (na, sa, ra), (nb, sb, rb) = run[0], run[1]
            if not (sa == sb * nb and ra == rb * nb):
                return (f"the loader's slice of the {list(shape)} weight steps through dim {d} or takes it "
                        f"in another order than the destination holds it")
            run[:2] = [(na * nb, sb, rb)]
        if run and run[0][1] != cont[d]:
            return f"the loader takes every {run[0][1] // cont[d]}th element of dim {d} of the {list(shape)} weight"
        lens.append(run[0][0] if run else 1)
        view_strides.append(run[0][2] if run else 1)
    starts = [offset // cont[0]] + [(offset // cont[d]) % shape[d] for d in range(1, nd)] if nd else []
    for d in range(nd):
        if starts[d] + lens[d] > shape[d]:
            return f"the loader's slice runs past dim {d} of the {list(shape)} weight"
    box = tuple(((st, n),) for st, n in zip(starts, lens))
    return box, tuple(lens), tuple(view_strides)


def _dim_of(s: int, shape: tuple[int, ...], cont: list[int]) -> int | None:
    """The Hugging Face dim that a step of `s` elements moves along (None: none does)."""
    for d in range(len(shape) - 1, -1, -1):
        if cont[d] <= s and (d == 0 or s < cont[d - 1]) and shape[d] > 1:
            return d
    return None


@dataclass(frozen=True)
class Piece:
    """What one rank holds of one Hugging Face tensor: `box` (runs per dim, in the local
    order of `view`), the parameter view holding it, and `mirrors`: other views the loader
    filled with the same box (copied from `view` after each refit)."""

    box: Box
    view: View
    mirrors: tuple[View, ...] = ()


def _joined(runs: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for start, n in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((start, n))
    return tuple(out)


def _follows(a: tuple[Box, View], b: tuple[Box, View], d: int) -> bool:
    """Whether `b` continues `a` along dim `d` (of the box and of the view) and equals it
    along every other dim: then the two are one piece with more runs along `d`."""
    (ba, va), (bb, vb) = a, b
    return (va.param == vb.param and va.strides == vb.strides
            and all(va.sizes[e] == vb.sizes[e] and ba[e] == bb[e] for e in range(len(ba)) if e != d)
            and vb.offset == va.offset + va.sizes[d] * va.strides[d])


def join(landings: list[tuple[Box, View]]) -> Piece | str:
    """One rank's landings of one Hugging Face tensor as a single piece (concatenating
    slices that continue each other along a dim, as a fused gate/up row block from a fused
    checkpoint tensor), or why they are not one."""
    parts = list(dict.fromkeys(landings))  # the same copy twice lands once
    merged = True
    while merged and len(parts) > 1:
        merged = False
        for i, a in enumerate(parts):
            for j, b in enumerate(parts):
                d = next((d for d in range(len(a[0])) if i != j and _follows(a, b, d)), None)
                if d is None:
                    continue
                box = tuple(_joined(a[0][e] + b[0][e]) if e == d else a[0][e] for e in range(len(a[0])))
                sizes = tuple(a[1].sizes[e] + b[1].sizes[e] if e == d else a[1].sizes[e] for e in range(len(box)))
                parts[i] = (box, a[1].reshaped(sizes, a[1].strides))
                del parts[j]
                merged = True
                break
            if merged:
                break
    boxes = list(dict.fromkeys(box for box, _ in parts))
    if len(boxes) > 1:
        params = sorted({v.param for _, v in parts})
        return f"its slices land in {len(parts)} separate regions of {params} on this rank, which one view cannot hold"
    views = [v for _, v in parts]
    return Piece(boxes[0], views[0], tuple(views[1:]))
