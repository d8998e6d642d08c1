"""Global amaxes over block grids: the pre-pass of the codecs whose scales depend on blocks
that several ranks' pieces share (csrc/kernels/codecs/amax.h says what a grid holds).

A codec that quantizes a tensor piece by piece with one scale per block of the *global*
tensor needs every block's amax over the whole block: blockwise FP8 (128x128 blocks, which a
TP shard of 64 rows cuts), NVFP4's per-tensor scale (one "block" as large as the tensor,
which every shard cuts). An `AmaxPiece` is one rank's piece of such a tensor. At the start of
every execute (a transforms.Prepass, so before any data moves and before the codecs' `before`
steps) each rank max-reduces |x| of its piece into the cells of the global grid its elements
fall in (one kernel: the C++ twin or CUDA), and where pieces cut blocks the ranks of the
tensor's mesh exchange their partial grids over the group's host channel and reduce them with
MAX. Afterwards every rank that holds a piece of a cut tensor holds the global amax of every
cell of the tensor; where no piece cuts a block nothing travels (a rank's own cells are whole).
The codec then reads `AmaxPiece.amax`.

Who sends what follows from the layout alone, alike at both ends: each distinct piece (its
replicas hold the same one) reaches every rank of the mesh that holds another piece, from one
of its replicas (replica r % n for receiver r, spreading the sends), as the values of the
cells it touches, one message per pair for all tensors. A rank that failed a check of its
own still takes part (with a failed status and zeros), so its partners fail at once too.

A cell is the FP32 bit pattern of the amax held in an int32: non-negative values and NaNs
have the sign bit clear, so the integer order is the float order and any reduction order
gives the same bits. NaN elements: `nan="propagate"` (the block's amax is NaN, as torch.amax
gives it: DeepSeek's and torchao's references) or "ignore" (fmaxf: Transformer Engine).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import _C
from ..errors import ReshardError
from ..layout import Layout, code_of
from ..transforms import Prepass
from . import rows_view, stream_of

NAN_MODES = {"propagate": int(_C.AMAX_NAN_PROPAGATE), "ignore": int(_C.AMAX_NAN_IGNORE)}
READS = (torch.bfloat16, torch.float16, torch.float32)
# gloo tags of the exchange: above the data messages' (transports/channel.py data_tag)
_TAG_BASE = (1 << 30) + 2


@dataclass(frozen=True, eq=False)
class PieceCells:
    """One distinct piece of a layout on its block grid."""

    ranks: tuple[int, ...]  # the ranks that hold it (replicas), ascending
    cells: np.ndarray       # int64: the flat cells it touches, ascending
    rowmap: np.ndarray      # int32 per local row (every dim but the last, flattened): its cell offset
    colmap: np.ndarray      # int32 per local column: its cell offset


@dataclass(frozen=True, eq=False)
class BlockGrid:
    """A layout's global block grid and its pieces' cells (csrc/kernels/codecs/amax.h)."""

    shape: tuple[int, ...]
    block: tuple[int, ...]
    grid: tuple[int, ...]   # cells per dim
    pieces: tuple[PieceCells, ...]
    piece_of: dict[int, int]  # rank -> index into pieces
    cut: bool  # some piece holds a block only in part (its owner must reduce with the others)

    @property
    def numel(self) -> int:
        return math.prod(self.grid)

    def senders(self, rank: int) -> list[tuple[int, np.ndarray]]:
        """(sender, cells) of every other distinct non-empty piece, as `rank` receives them."""
        mine = self.piece_of[rank]
        return [(p.ranks[rank % len(p.ranks)], p.cells) for i, p in enumerate(self.pieces)
                if i != mine and p.cells.size]

    def receivers(self, rank: int) -> list[int]:
        """The ranks `rank` sends its piece's cells to: those of other pieces that pick it."""
        i = self.piece_of[rank]
        mine = self.pieces[i]
        if not mine.cells.size:
            return []
        return [q for q, j in sorted(self.piece_of.items()) if j != i and mine.ranks[q % len(mine.ranks)] == rank]


@functools.lru_cache(maxsize=4096)
def _block_grid(layout: Layout, block: tuple[int, ...]) -> BlockGrid | str:
    if layout.error:
        return f"invalid layout: {layout.error}"
    pieces: list[PieceCells] = []
    by_runs: dict[Any, int] = {}
    piece_of: dict[int, int] = {}
    aligned = True
    grid: tuple[int, ...] = ()
    for rank in sorted(set(layout.mesh.ranks)):
        runs = layout.runs(rank)
        assert runs is not None  # a rank of the mesh
        key = tuple(tuple(map(tuple, r)) for r in runs)
        if key in by_runs:
            i = by_runs[key]
            p = pieces[i]
            pieces[i] = PieceCells(p.ranks + (rank,), p.cells, p.rowmap, p.colmap)
            piece_of[rank] = i
            continue
        got = _C.amax_piece_grid([list(map(tuple, r)) for r in runs], list(layout.shape), list(block))
        if isinstance(got, str):
            return got
        cells_per_dim, rowmap, colmap, cells, ok = got
        grid = tuple(cells_per_dim)
        aligned = aligned and ok
        by_runs[key] = piece_of[rank] = len(pieces)
        pieces.append(PieceCells((rank,), np.frombuffer(cells, dtype=np.int64), np.frombuffer(rowmap, dtype=np.int32),
                                 np.frombuffer(colmap, dtype=np.int32)))
    return BlockGrid(layout.shape, block, grid, tuple(pieces), piece_of, not aligned)


def block_grid(name: str, layout: Layout, block: Sequence[int]) -> BlockGrid:
    """The block grid of `name`'s layout, blocks of `block` (one size per dim), or
    ReshardError naming the tensor."""
    got = _block_grid(layout, tuple(int(b) for b in block))
    if isinstance(got, str):
        raise ReshardError(f"tensor {name!r} ({layout!r}): no block grid of {tuple(block)}: {got}")
    return got


def _tag(session: Any) -> int:
    return _TAG_BASE + (session.plan_id * 0x85EBCA6B + session.seq) % (1 << 29)


class AmaxPiece(Prepass):
    """This rank's piece `tensor` of tensor `name` (layout `layout`), whose global amax per
    block of `block` (one size per dim: 1 for a dim not blocked, the extent for a whole dim)
    the codec needs. After the pre-pass, `amax` holds it for every cell this piece touches
    (every cell of the tensor where pieces cut blocks). The tensor is re-read every execute."""

    def __init__(self, name: str, layout: Layout, tensor: torch.Tensor, rank: int, block: Sequence[int],
                 nan: str = "propagate"):
        if nan not in NAN_MODES:
            raise ReshardError(f"amax of {name!r}: nan must be one of {sorted(NAN_MODES)}, got {nan!r}")
        if tensor.dtype not in READS:
            raise ReshardError(f"amax of {name!r}: its source must be one of {READS}, got {tensor.dtype}")
        self.grid_of = block_grid(name, layout, block)
        if rank not in self.grid_of.piece_of or tuple(tensor.shape) != layout.local_shape(rank):
            raise ReshardError(f"amax of {name!r} on rank {rank}: the piece of shape {tuple(tensor.shape)} is not "
                               f"this rank's piece of {layout!r}")
        piece = self.grid_of.pieces[self.grid_of.piece_of[rank]]
        self.name, self.rank, self.tensor, self.nan = name, rank, tensor, NAN_MODES[nan]
        dev = tensor.device
        self.cells = piece.cells
        self.rowmap = torch.from_numpy(piece.rowmap.copy()).to(dev)
        self.colmap = torch.from_numpy(piece.colmap.copy()).to(dev)
        self.grid = torch.zeros(self.grid_of.numel, dtype=torch.int32, device=dev)
        self.senders = self.grid_of.senders(rank) if self.grid_of.cut else []
        self.receivers = self.grid_of.receivers(rank) if self.grid_of.cut else []
        # a piece whose rows do not flatten is read through a contiguous copy
        self._stage = None if rows_view(tensor) else torch.empty(tensor.shape, dtype=tensor.dtype, device=dev)

    @property
    def source(self) -> torch.Tensor:
        """What `partial` read: the piece, or its contiguous copy where its rows do not flatten."""
        return self.tensor if self._stage is None else self._stage

    @property
    def amax(self) -> torch.Tensor:
        """The amax per cell as float32, shaped as the grid (a view of `grid`)."""
        return self.grid.view(torch.float32).view(self.grid_of.grid)

    def partial(self) -> None:
        """This piece's partial amaxes into `grid` (zeros elsewhere)."""
        src = self.tensor
        if self._stage is not None:
            self._stage.copy_(src)
            src = self._stage
        self.grid.zero_()
        view = rows_view(src)
        assert view is not None  # contiguous or flattenable
        rows, cols, row_stride = view
        if rows * cols == 0:
            return
        args = (src.data_ptr(), code_of(src.dtype), rows, cols, row_stride, self.rowmap.data_ptr(),
                self.colmap.data_ptr(), self.nan, self.grid.data_ptr())
        if src.is_cuda:
            if not hasattr(_C, "amax_partial_cuda"):
                raise ReshardError("amaxes of CUDA tensors need reshard_ext built with CUDA")
            _C.amax_partial_cuda(*args, stream_of(src))
        else:
            _C.amax_partial_cpu(*args)

    def region(self) -> tuple[int, int] | None:
        # a piece whose blocks are whole here exchanges nothing: its partial amaxes are the amaxes
        if self.senders or self.receivers:
            return None
        t = self.tensor
        if t.numel() == 0:
            return (t.data_ptr(), 0)
        span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
        return (t.data_ptr(), span * t.element_size())

    def run_deferred(self) -> None:
        self.partial()

    @classmethod
    def run_all(cls, items: list[Prepass], channel: Any, session: Any, problem: str) -> str:
        pieces = [it for it in items if isinstance(it, AmaxPiece)]
        if not problem:
            for it in pieces:
                it.partial()
        talk = [it for it in pieces if it.senders or it.receivers]
        if not talk:
            return problem
        host = _host_grids(talk, bool(problem))
        status = 1 if problem else 0
        sends: dict[int, list[np.ndarray]] = {}
        recvs: dict[int, list[tuple[int, np.ndarray]]] = {}
        for i, it in enumerate(talk):
            for q in it.receivers:
                sends.setdefault(q, []).append(host[i][it.cells])
            for p, cells in it.senders:
                recvs.setdefault(p, []).append((i, cells))
        ops: list[tuple[str, int, torch.Tensor]] = []
        for q, parts in sorted(sends.items()):
            n = sum(part.size for part in parts)
            ops.append(("send", q, torch.from_numpy(np.concatenate([np.array([status, n], np.int32)] + parts))))
        landed = {p: torch.zeros(2 + sum(c.size for _, c in parts), dtype=torch.int32) for p, parts in recvs.items()}
        ops += [("recv", p, t) for p, t in sorted(landed.items())]
        names = ", ".join(repr(it.name) for it in talk[:4]) + (f" and {len(talk) - 4} more" if len(talk) > 4 else "")
        rank = channel.rank
        try:
            task = channel.submit(functools.partial(channel.exchange, ops, _tag(session), session, retry_closed=True))
            errors = channel.wait(task, session, f"reducing the amaxes of {names}")
        except ReshardError as e:
            return problem or f"rank {rank}: {e}"
        if errors:
            listed = "; ".join(f"rank {p}: {why}" for p, why in sorted(errors.items()))
            return problem or f"rank {rank}: the amax reduction of {names} failed with {listed}"
        if problem:
            return problem
        failed = sorted(p for p, t in landed.items() if int(t[0]) != 0)
        if failed:
            return (f"rank {rank}: ranks {failed} failed a check of their own before the amax reduction of {names}, "
                    f"so no data moves")
        for p, incoming in recvs.items():
            got = landed[p].numpy()
            want = got.size - 2
            if int(got[1]) != want:
                return (f"rank {rank}: rank {p} sent {int(got[1])} amaxes of {names} where {want} were due: the "
                        f"ranks disagree on the tensors or their layouts")
            at = 2
            for i, cells in incoming:
                host[i][cells] = np.maximum(host[i][cells], got[at:at + cells.size])
                at += cells.size
        _upload(talk, host)
        return ""

    @classmethod
    def reduce(cls, items: list[AmaxPiece], group: Any, timeout_s: float | None = None) -> None:
        """The pre-pass outside an execute's start, e.g. in an `after` step over destination
        pieces that just landed (every rank of the group that holds one calls it)."""
        import threading
        import time

        from ..options import default_timeout
        from ..transports.channel import Session, channel_of

        limit = default_timeout("gloo") if timeout_s is None else timeout_s
        session = Session(0, 0, None, 0, time.monotonic() + limit, limit, threading.Event())
        why = cls.run_all(list(items), channel_of(group), session, "")
        if why:
            raise ReshardError(why)


def _host_grids(talk: list[AmaxPiece], zeros: bool) -> list[np.ndarray]:
    """Host arrays of the grids that travel: the CPU grids themselves; a copy of the CUDA ones."""
    if zeros:
        return [np.zeros(it.grid_of.numel, dtype=np.int32) for it in talk]
    if all(not it.grid.is_cuda for it in talk):
        return [it.grid.numpy() for it in talk]
    flat = torch.cat([it.grid for it in talk]).cpu().numpy()
    return np.split(flat, np.cumsum([it.grid.numel() for it in talk])[:-1])


def _upload(talk: list[AmaxPiece], host: list[np.ndarray]) -> None:
    """The reduced host grids back into the CUDA grids (the CPU ones are the host arrays)."""
    cuda = [(it, h) for it, h in zip(talk, host) if it.grid.is_cuda]
    if not cuda:
        return
    flat = torch.from_numpy(np.concatenate([h for _, h in cuda])).to(cuda[0][0].grid.device)
    at = 0
    for it, _ in cuda:
        n = it.grid.numel()
        it.grid.copy_(flat[at:at + n])
        at += n
