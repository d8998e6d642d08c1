"""The transform interface: what goes on the wire for a tensor and how it is written back.

A transform rewrites plan entries before planning, so the core planner and transports
never learn about it (DESIGN section 5):

- ``rewrite_src(name, tensor, layout)`` on the ranks holding a source piece may replace
  the entry by wire entries (e.g. ``name + "::mx.data"`` in float8 and
  ``name + "::mx.scale"`` in uint8) and return a ``before`` step that fills them from the
  source at the start of every ``execute`` (sender-side conversion);
- ``rewrite_dst(name, target, layout)`` on the ranks holding a destination piece replaces
  the entry by the entries the wire lands in (the same names the source side produced,
  or the plain name for a receiver-side conversion into a staging tensor) and returns an
  ``after`` step that writes the final buffers once every byte has arrived.

Both rewrites must derive the same wire names and global layouts from (name, layout)
alone, since sender and receiver apply them independently. ``after`` runs once all
batches of the refit are in, so a transform always sees whole tensors.

An entry's tensor may be a ``Piece`` instead: the transform then binds it itself when
the plan binds (``Piece.ref``), e.g. to fuse a conversion into the box kernels. What a
rank binds never changes the plan, so each rank may choose on its own.

A rewrite may also return a ``Prepass``: a step that the ranks run *together* at the start
of every execute, before any ``before`` step and before data moves, e.g. reducing partial
amaxes among the source ranks that share a quantization block (reshard_ext/codecs/amax.py).

Deferred pre-pass work (rx.Tuning.direct_prep_overlap): a source-side ``Prepass`` item whose
step needs no other rank may tell the source bytes it reads (``region``); the direct
transport may then *defer* it: instead of the pre-pass and the ``before`` steps, it runs the
item's ``run_deferred`` followed by the same rewrite's ``before``, on a side stream, tensor
by tensor in the order its staged boxes read the tensors, each box waiting only for its own
tensor's work (csrc/core/direct.h, prep_schedule). Such a ``before`` therefore must depend
on nothing but its item's result and its own tensors, and write only what its rewrite's
entries read; it runs exactly once per execute either way.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _C
from .layout import Layout


class Piece:
    """A local piece that a transform binds itself instead of a plain tensor.

    The planner checks `shape`, `dtype` and `device` against the layout as it does a
    tensor's. When the plan binds, it calls `ref(whole)` for the kernels' `_C.TensorRef`
    (TensorRef in csrc/core/exec_tables.h: a codec of csrc/kernels/codecs/ runs in the
    boxes of the piece; reshard_ext/codecs/ holds the codecs' Python side); the plan adds
    the piece's shape and name.
    `group` > 0 (destinations only) asks whether every box into the piece reads the
    piece's `dtype` and keeps `group`-element blocks of the last dim whole; `whole` is
    the answer (always False for group 0).
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, group: int = 0):
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = device
        self.group = group

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def ref(self, whole: bool) -> _C.TensorRef:
        raise NotImplementedError

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The caller's tensors behind the piece: rx.execute checks that their storages
        were not replaced or resized since binding."""
        return ()


class Prepass:
    """One entry's part in a step every rank of the plan runs together at the start of each
    execute (and of rx.verify), before the transforms' `before` steps and before any data
    moves. The plan gathers a side's items in entry order and hands all items of one class to
    `run_all` in one call, so that they share their messages. Every rank runs it, also one
    that failed a check of its own (`problem` set), so that the ranks it talks to learn of it
    at once rather than after the timeout. What a rank exchanges must follow from the layouts
    alone, as both ends derive it independently."""

    @classmethod
    def run_all(cls, items: list[Prepass], channel: Any, session: Any, problem: str) -> str:
        """Runs the step for `items` (this rank's, all of this class) over the group's host
        channel (transports/channel.py) within `session`'s deadline; returns "" or why this
        rank cannot go on (the plan then moves no data on it and tells its peers)."""
        raise NotImplementedError

    def region(self) -> tuple[int, int] | None:
        """(address, bytes) of the source memory this item's step reads, where the step needs no
        other rank (exchanges nothing) and may run alone, deferred (the module doc); None: it
        runs only in the pre-pass."""
        return None

    def run_deferred(self) -> None:
        """This item's step alone, on the current stream (only where `region` is not None)."""
        raise NotImplementedError


@dataclass
class Rewrite:
    entries: dict[str, tuple[torch.Tensor | Piece, Layout]] = field(default_factory=dict)
    before: Callable[[], None] | None = None
    after: Callable[[], None] | None = None
    prepass: Prepass | None = None


class Transform:
    """Base class: transforms nothing. Subclasses override the two rewrites."""

    def rewrite_src(self, name: str, tensor: torch.Tensor, layout: Layout) -> Rewrite | None:
        return None

    def rewrite_dst(self, name: str, target: Any, layout: Layout) -> Rewrite | None:
        return None

    def cache_key(self) -> tuple:
        """What distinguishes two transforms for plan caching."""
        return (type(self).__name__,)

    def last_dim_grain(self, name: str) -> int | None:
        """For planning: when the boxes of dst `name` (a name as planned, after the
        rewrites) carry a codec whose blocks must stay whole, that codec's grain
        (reshard_ext.codecs.traits(...).grain): the planner cuts the tensor's last dim only
        on multiples of it. None keeps the plain cut (_C.PLAIN_GRAIN). Both ends must
        answer alike, from the name alone."""
        return None

    def receiver_codec(self, name: str) -> _C.ReceiverCodec | None:
        """For verify digests: when the receiver of dst `name` converts it with a codec
        after it lands, a `_C.ReceiverCodec(digest, grain, dtype)` (rx_box.digest of a copy
        into it: RX_DIGEST_CODEC with the codec's id and flags, the codec's block along the
        last dim, the rx dtype code it reads), so that sender and receiver both digest the
        converted bytes; None otherwise. Both ends must answer alike."""
        return None


def name_selector(params: Iterable[str] | Callable[[str], bool]) -> tuple[Callable[[str], bool], Any]:
    """(predicate, its part of a cache key) of a transform's `params`: an iterable of names,
    or a predicate name -> bool (keyed by identity)."""
    if callable(params):
        return params, ("callable", id(params))
    names = frozenset(params)
    return names.__contains__, names
