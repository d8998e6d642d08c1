"""Layouts (DESIGN section 1): Mesh, Replicate, Shard, Layout.

Thin descriptions; the geometry (runs, pieces, validation) is computed in C++ (_C.Layout).
"""
from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import _C
from .errors import ReshardError

Runs = list[tuple[int, int]]  # (global_start, length) in local order

# torch dtype <-> rx dtype code, from the C++ table (_C.dtype_info: code, torch name, ...);
# types this torch lacks (older float8 / uint variants) are simply absent.
_CODES: dict[torch.dtype, int] = {getattr(torch, name): code for code, name, *_ in _C.dtype_info()
                                  if isinstance(getattr(torch, name, None), torch.dtype)}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


def code_of(dtype: torch.dtype) -> int:
    """The rx dtype code of a torch dtype (ReshardError for one reshard_ext does not move)."""
    try:
        return _CODES[dtype]
    except KeyError:
        raise ReshardError(f"dtype {dtype} is not supported by reshard_ext") from None


def dtype_of(code: int) -> torch.dtype:
    return _DTYPES[code]


def _fixed(value: Any, what: str, bits: int = 64) -> int:
    """`value` as an int of the C++ core's width: a value it cannot hold is a
    ReshardError here, not a TypeError (or a wraparound) in the bindings."""
    try:
        v = operator.index(value)
    except TypeError:
        raise ReshardError(f"{what} must be an integer, got {value!r}") from None
    if not -(1 << (bits - 1)) <= v < 1 << (bits - 1):
        raise ReshardError(f"{what} {v} does not fit a {bits}-bit integer")
    return v


class Mesh:
    """An N-d array of group ranks (ranks of the process group passed to ``plan``)."""

    __slots__ = ("shape", "ranks", "_hash")

    def __init__(self, ranks: Any):
        if hasattr(ranks, "tolist"):
            ranks = ranks.tolist()
        shape: list[int] = []
        level = ranks
        while isinstance(level, (list, tuple)):
            shape.append(len(level))
            if not level:
                break
            level = level[0]
        flat: list[int] = []

        def walk(x: Any, depth: int) -> None:
            if depth == len(shape):
                flat.append(int(x))
                return
            if not isinstance(x, (list, tuple)) or len(x) != shape[depth]:
                raise ReshardError(f"Mesh ranks must form a regular N-d array, got {ranks!r}")
            for y in x:
                walk(y, depth + 1)

        if not shape:  # a single rank
            shape, flat = [1], [int(ranks)]
        else:
            walk(ranks, 0)
        flat = [_fixed(r, "mesh rank", 32) for r in flat]
        self.shape: tuple[int, ...] = tuple(shape)
        self.ranks: tuple[int, ...] = tuple(flat)
        self._hash = hash((self.shape, self.ranks))

    @classmethod
    def arange(cls, *shape: int, start: int = 0) -> Mesh:
        """Ranks start, start+1, ... laid out row-major in `shape`."""
        return cls(torch.arange(start, start + int(torch.tensor(shape).prod())).reshape(shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __contains__(self, rank: int) -> bool:
        return rank in self.ranks

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and self.shape == other.shape and self.ranks == other.ranks

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return str(self._cpp().describe())

    def _cpp(self) -> _C.Mesh:
        return _cpp_mesh(self.shape, self.ranks)


@functools.lru_cache(maxsize=4096)
def _cpp_mesh(shape: tuple[int, ...], ranks: tuple[int, ...]) -> _C.Mesh:
    # Interned: many layouts share one mesh, and its rank index is built once.
    return _C.Mesh(list(shape), list(ranks))


@dataclass(frozen=True)
class Replicate:
    """Every coordinate along this mesh dim holds the same data."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Shard:
    """Split tensor dim `dim` over this mesh dim.

    stride > 1: Megatron's partition_stride (P*stride chunks; rank r holds r, r+P, ...).
    blocks: packed blocks (Megatron partition_sizes); each block is split separately and
    a rank holds its share of every block, concatenated. Block sizes are of the dim as it
    stands before this mesh dim splits it.
    sizes: an uneven contiguous split, one size per coordinate of this mesh dim (zeros
    allowed), summing to the dim as it stands before this mesh dim splits it: coordinate
    c holds the sizes[c] elements after those of coordinates 0..c-1. An inference
    engine's padded vocabulary: vLLM's 1000-row embedding at TP2 pads to 1024 and splits
    as sizes=(512, 488). Not combined with stride or blocks.
    """

    dim: int
    stride: int = 1
    blocks: tuple[int, ...] | None = None
    sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # Type errors are local mistakes, raised here; a dim out of range for the tensor
        # raises where the tensor's rank is known (rx.Layout).
        if not _is_int(self.dim):
            raise ReshardError(f"Shard(dim={self.dim!r}): dim must be an integer (negative dims count from the end)")
        if not _is_int(self.stride) or self.stride < 1:
            raise ReshardError(f"Shard({self.dim}, stride={self.stride!r}): stride must be an integer >= 1")
        object.__setattr__(self, "dim", self.dim.__index__())
        object.__setattr__(self, "stride", self.stride.__index__())
        if self.blocks is not None:
            if isinstance(self.blocks, (str, bytes)) or not all(_is_int(b) for b in self.blocks):
                raise ReshardError(f"Shard({self.dim}, blocks={self.blocks!r}): blocks must be a sequence of integers")
            object.__setattr__(self, "blocks", tuple(int(b) for b in self.blocks))
        if self.sizes is not None:
            if isinstance(self.sizes, (str, bytes)) or not all(_is_int(b) for b in self.sizes):
                raise ReshardError(f"Shard({self.dim}, sizes={self.sizes!r}): sizes must be a sequence of integers")
            object.__setattr__(self, "sizes", tuple(int(b) for b in self.sizes))

    def __repr__(self) -> str:
        extra = "" if self.stride == 1 else f", stride={self.stride}"
        extra += "" if self.blocks is None else f", blocks={self.blocks}"
        extra += "" if self.sizes is None else f", sizes={self.sizes}"
        return f"Shard({self.dim}{extra})"


Placement = Replicate | Shard


def _is_int(x: Any) -> bool:
    return not isinstance(x, bool) and hasattr(x, "__index__")


def _normalized(p: Placement, ndim: int) -> Placement:
    """Shard(-k) counts from the last dim, as in torch DTensor (Layout has checked the range)."""
    if isinstance(p, Shard) and -ndim <= p.dim < 0:
        return Shard(p.dim + ndim, p.stride, p.blocks, p.sizes)
    return p


class Layout:
    """How one logical tensor of `shape` and `dtype` is spread over `mesh`."""

    __slots__ = ("shape", "dtype", "mesh", "placements", "_c", "_hash")

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, mesh: Mesh, placements: Sequence[Placement]):
        if not isinstance(mesh, Mesh):
            mesh = Mesh(mesh)
        if not isinstance(dtype, torch.dtype):
            got = f"the string {dtype!r}" if isinstance(dtype, str) else f"{dtype!r} ({type(dtype).__name__})"
            raise ReshardError(f"rx.Layout: dtype must be a torch.dtype such as torch.bfloat16, got {got}")
        self.shape: tuple[int, ...] = tuple(_fixed(s, "shape dim") for s in shape)
        self.dtype = dtype
        self.mesh = mesh
        for p in placements:
            if not isinstance(p, (Replicate, Shard)):
                raise ReshardError(f"placements must be rx.Replicate() or rx.Shard(...), got {p!r}")
            n = len(self.shape)
            if isinstance(p, Shard) and not -n <= p.dim < n:
                raise ReshardError(f"rx.Layout of shape {self.shape}: {p!r} of a {n}-d tensor (dims are {-n} to "
                                   f"{n - 1})")
        self.placements: tuple[Placement, ...] = tuple(_normalized(p, len(self.shape)) for p in placements)
        self._hash = hash((self.shape, self.dtype, self.mesh, self.placements))
        cpp_placements = [
            _C.Placement.replicate() if isinstance(p, Replicate) else
            _C.Placement(_fixed(p.dim, "Shard dim", 32), _fixed(p.stride, "Shard stride"),
                         [_fixed(b, "Shard block") for b in p.blocks or ()],
                         [_fixed(b, "Shard size") for b in p.sizes or ()])
            for p in self.placements
        ]
        # Construction never raises for semantic problems: `plan` reports them on every
        # rank together. `error` says what is wrong ("" when valid).
        self._c = _C.Layout(list(self.shape), code_of(dtype), mesh._cpp(), cpp_placements)

    @classmethod
    def _from_cpp(cls, c: _C.Layout, shape, dtype, mesh, placements) -> Layout:
        self = cls.__new__(cls)
        self.shape, self.dtype, self.mesh, self.placements = shape, dtype, mesh, placements
        self._hash = hash((shape, dtype, mesh, placements))
        self._c = c
        return self

    @property
    def error(self) -> str:
        return self._c.error

    def check(self) -> None:
        if self._c.error:
            raise ReshardError(f"invalid layout {self!r}: {self._c.error}")

    def runs(self, rank: int) -> list[Runs] | None:
        """Per-dim runs (global_start, length) of `rank`'s piece, in local order."""
        self.check()
        return self._c.piece(rank)

    def local_shape(self, rank: int) -> tuple[int, ...] | None:
        runs = self.runs(rank)
        return None if runs is None else tuple(sum(n for _, n in r) for r in runs)

    def local_part(self, global_tensor: torch.Tensor, rank: int) -> torch.Tensor | None:
        """Reference semantics: the piece of `global_tensor` that `rank` holds (a copy)."""
        runs = self.runs(rank)
        if runs is None:
            return None
        if tuple(global_tensor.shape) != self.shape:
            raise ReshardError(f"global tensor of shape {tuple(global_tensor.shape)} for layout {self!r}")
        out = global_tensor
        for d, r in enumerate(runs):
            idx = [torch.arange(s, s + n) for s, n in r]
            index = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)
            out = out.index_select(d, index.to(out.device))
        return out.contiguous()

    def with_dtype(self, dtype: torch.dtype) -> Layout:
        return Layout(self.shape, dtype, self.mesh, self.placements)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Layout)
            and self.shape == other.shape
            and self.dtype == other.dtype
            and self.mesh == other.mesh
            and self.placements == other.placements
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return str(self._c.describe())
