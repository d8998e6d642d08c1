"""Tracing an engine's ``load_weights`` once on one rank: `trace_loader` runs the loader
over recording stand-ins of the Hugging Face tensors and returns a `LocalTrace`: per
tensor, the piece this rank's parameters take (a box and the view holding it), or why it
takes the safe path.

A loader step that needs a weight's values makes the driver start the trace again with
that weight given as a real zero tensor (so the step runs, and later weights are still
fed in order: a loader that holds one weight back for another keeps working); the
engine's loader takes that weight, with its real values, after every refit. A loader that
raises for a weight given as a real tensor raises here: it would at the refit too.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..errors import ReshardError
from .boxes import Piece, join
from .recording import Feed, Fill, NeedsData, Recorder, Specs, Targets, Write

log = logging.getLogger("reshard_ext")

Loader = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


@dataclass
class LocalTrace:
    """One engine rank's trace, before the ranks agree (`summary` is what they exchange)."""

    specs: Specs
    pieces: dict[str, Piece]            # Hugging Face name -> what this rank's parameters take
    dtypes: dict[str, torch.dtype]      # the dtype of the parameter each piece lands in
    untraced: dict[str, str]            # Hugging Face name -> why it takes the safe path here
    fills: list[Fill] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """{name: (dtype, box) | why} for every tensor this rank's loader uses."""
        out: dict[str, Any] = {n: (self.dtypes[n], p.box) for n, p in self.pieces.items()}
        out.update(self.untraced)
        return out


def loader_of(model: torch.nn.Module) -> Loader:
    """The model's own loader (typed: nn.Module's __getattr__ says Tensor | Module)."""
    return cast(Loader, model.load_weights)


def _consume(result: Any) -> None:
    """A loader written as a generator does its work as it is iterated."""
    if result is not None and hasattr(result, "__next__"):
        for _ in result:
            pass


def trace_loader(model: torch.nn.Module, specs: Specs, load: Loader | None = None) -> LocalTrace:
    """Traces `load` (default ``model.load_weights``) over stand-ins of the Hugging Face
    tensors `specs` (name -> (shape, dtype), in checkpoint order) against `model`'s real
    parameters. Writes into parameters only what the loader writes of its own (constant
    fills such as padded vocabulary rows; zeros-derived values of weights given as real
    tensors, which the first refit's safe path overwrites)."""
    load = load if load is not None else loader_of(model)
    targets = Targets(model)
    if not targets.named:
        raise ReshardError(f"{type(model).__name__} has no parameters or buffers to trace its load_weights into")
    device = next(iter(targets.named.values())).device
    before = targets.snapshot()
    real: dict[str, str] = {}  # weights given as real tensors -> why
    for _ in range(len(specs) + 1):
        feed = Feed(specs, set(real), device)
        rec = Recorder(targets, specs, feed)
        try:
            with torch.no_grad(), rec:
                _consume(load(iter(feed)))
        except NeedsData as e:
            for n in sorted(e.sources):
                real.setdefault(n, f"the loader reads its values: {e.what}")
            continue
        except Exception as e:  # noqa: BLE001 - any loader step the stand-ins do not support
            culprit = feed.last
            if culprit is None or culprit in real:
                raise ReshardError(f"{type(model).__name__}.load_weights raised for Hugging Face tensor "
                                   f"'{culprit}' given as a real tensor of shape {list(specs[culprit][0])} "
                                   f"({type(e).__name__}: {e}): the checkpoint's names or shapes do not match the "
                                   f"engine" if culprit else f"{type(model).__name__}.load_weights raised before "
                                   f"taking any weight: {type(e).__name__}: {e}") from e
            real[culprit] = f"the loader raised {type(e).__name__} on the traced stand-in: {e}"
            log.info("engine trace: '%s' takes the safe path: %s", culprit, real[culprit])
            continue
        break
    else:  # every retry gives one more weight as a real tensor: unreachable
        raise ReshardError("tracing load_weights did not settle")
    after = Targets(model).snapshot()
    moved = [n for n in before if before[n] != after.get(n)]
    if moved:
        raise ReshardError(f"{type(model).__name__}.load_weights replaced or resized parameters {moved[:8]} while "
                           f"traced: reshard_ext writes into the parameters the loader writes into, and this loader "
                           f"makes new ones; refit such an engine by calling its load_weights with whole tensors")
    untraced = {**rec.untraced, **real}
    untraced.update(conflicts(rec.writes, set(untraced)))
    pieces: dict[str, Piece] = {}
    dtypes: dict[str, torch.dtype] = {}
    landed: dict[str, list] = {}
    for landing in rec.landings:
        landed.setdefault(landing.name, []).append((landing.box, landing.view))
    for name, parts in landed.items():
        if name in untraced:
            continue
        piece = join(parts)
        if isinstance(piece, str):
            untraced[name] = piece
            continue
        pieces[name] = piece
        dtypes[name] = targets.named[piece.view.param].dtype
    ordered = {n: untraced[n] for n in specs if n in untraced}
    return LocalTrace(specs, pieces, dtypes, ordered, rec.fills)


def conflicts(writes: dict[int, list[Write]], untraced: set[str]) -> dict[str, str]:
    """Weights whose landings another loader step overlaps, so that writing every landing
    at once (the refit) and the safe path after it cannot give what the loader's order
    gives: a landing that a later step writes over, or a landing over what a weight on the
    safe path wrote earlier (the safe path runs after the refit). To a fixed point: a
    weight sent to the safe path makes its landings safe-path writes too."""
    found: dict[str, str] = {}

    def kind(w: Write) -> str:
        if not w.names:
            return "loader"
        if w.kind != "landing" or w.names & (untraced | set(found)):
            return "safe"
        return "landing"

    changed = True
    while changed:
        changed = False
        for ws in writes.values():
            order = sorted(ws, key=lambda w: w.lo)
            for i, a in enumerate(order):
                for b in order[i + 1:]:
                    if b.lo >= a.hi:
                        break
                    if b.hi <= b.lo or a.hi <= a.lo:
                        continue
                    first, then = (a, b) if a.seq < b.seq else (b, a)
                    k1, k2 = kind(first), kind(then)
                    hit: frozenset[str] = frozenset()
                    if k1 == "landing" and first.names != then.names:
                        hit = first.names | (then.names if k2 == "landing" else frozenset())
                    elif k1 == "safe" and k2 == "landing":
                        hit = then.names
                    for n in sorted(hit - untraced - set(found)):
                        other = ", ".join(sorted((first.names | then.names) - {n})) or "the loader's own write"
                        found[n] = f"it lands on elements that {other} also writes; the loader's order decides"
                        changed = True
    return found
