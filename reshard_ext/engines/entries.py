"""From the engine ranks' traces to plan entries: `decide` (every rank alike, from the
gathered summaries) gives each Hugging Face tensor the layout of its traced pieces, or the
safe path; `EngineEntries` is one rank's plan entries and what it does after each refit.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..errors import ReshardError
from ..layout import Layout, Mesh, Replicate
from .layouts import infer
from .recording import Specs
from .trace import Loader, LocalTrace, _consume, loader_of

Decision = Layout | tuple[list[int], str]  # the traced pieces' layout, or (ranks taking it whole, why)
Reshape = Callable[[dict[str, tuple[torch.Tensor, Layout]], int], Mapping[str, tuple[torch.Tensor, Layout]]]


def decide(summaries: Sequence[Mapping[str, Any]], specs: Specs, rank_offset: int = 0) -> dict[str, Decision]:
    """For every Hugging Face tensor some engine rank uses (in checkpoint order): the layout
    of the pieces the ranks traced (mesh ranks: `rank_offset` + engine rank), or the safe
    path (the ranks that use it receive it whole, and why), when any rank could not trace
    it or the pieces form no layout. `summaries`: LocalTrace.summary() of engine rank i at i."""
    out: dict[str, Decision] = {}
    for name, (shape, _) in specs.items():
        used = {rank_offset + i: s[name] for i, s in enumerate(summaries) if name in s}
        if not used:
            continue
        ranks = sorted(used)
        why = next((f"rank {r}: {v}" for r, v in sorted(used.items()) if isinstance(v, str)), None)
        if why is None:
            dtypes = {v[0] for v in used.values()}
            if len(dtypes) > 1:
                why = f"it lands in parameters of dtypes {sorted(map(str, dtypes))} on different ranks"
            else:
                found = infer(shape, dtypes.pop(), {r: v[1] for r, v in used.items()})
                if isinstance(found, Layout):
                    out[name] = found
                    continue
                why = found
        out[name] = (ranks, why)
    return out


class EngineEntries(dict):
    """One engine rank's plan entries ``{hf_name: (tensor, rx.Layout)}``: views into the
    engine's own parameters for the traced tensors, whole scratch buffers for those on the
    safe path. A refit is ``rx.execute(plan)`` then `finish()` (``swap_model_weights``
    calls it). Pass it as the ``dst`` of ``rx.plan`` / ``rx.swap_model_weights``.

    Attributes: ``traced`` {name: layout}; ``safe`` {name: why}, alike on every engine
    rank; ``fills`` the constants the loader wrote (padding), repeated by `rebound`."""

    def __init__(self, model: torch.nn.Module, trace: LocalTrace, decisions: Mapping[str, Decision], rank: int,
                 load: Loader | None = None, params: Mapping[str, torch.Tensor] | None = None,
                 reshape: Reshape | None = None):
        super().__init__()
        self.model, self.trace, self.decisions, self.rank = model, trace, dict(decisions), rank
        self.load = load if load is not None else loader_of(model)
        self.params = dict(params) if params is not None else _params(model)
        self.traced: dict[str, Layout] = {n: d for n, d in decisions.items() if isinstance(d, Layout)}
        self.safe: dict[str, str] = {n: d[1] for n, d in decisions.items() if not isinstance(d, Layout)}
        self.fills = trace.fills
        self.scratch: dict[str, torch.Tensor] = {}
        self._mirrors: list[tuple[torch.Tensor, torch.Tensor]] = []
        device = next(iter(self.params.values())).device
        for name, d in decisions.items():
            if isinstance(d, Layout):
                if rank not in d.mesh:
                    continue
                piece = trace.pieces[name]
                view = piece.view.on(self.params[piece.view.param])
                self[name] = (view, d)
                self._mirrors += [(m.on(self.params[m.param]), view) for m in piece.mirrors]
            elif rank in d[0]:
                shape, dtype = trace.specs[name]
                buf = torch.empty(shape, dtype=dtype, device=device)
                self.scratch[name] = buf
                self[name] = (buf, Layout(shape, dtype, Mesh(d[0]), [Replicate()]))
        self._bound = {n: _where(p) for n, p in self.params.items()}
        self.reshape = reshape
        if reshape is not None:  # e.g. grouped-query q/k/v in their grouped shapes (adapters.hf_names)
            self.update(reshape(dict(self), rank))
        self.scale_suffix: str | None = None  # set by pair_scales, with the names it paired
        self.paired: list[str] = []

    def pair_scales(self, suffix: str = "_scale_inv") -> list[str]:
        """For engines that store block-FP8 weights (vLLM's ``weight`` + ``weight_scale_inv``
        of DeepSeek-style FP8 checkpoints): every traced tensor ``name`` whose sibling
        ``name + suffix`` is traced too becomes one ``(data, scale_inv)`` destination and the
        sibling's entry goes. Returns the paired names, alike on every engine rank: pass them
        to ``rx.FP8Block(names, where=...)``, and one execute quantizes a BF16 trainer's
        tensors into both. A sibling whose traced layout is not the 128x128 block grid of its
        tensor's pieces raises on every engine rank, naming both."""
        from ..codecs.fp8block import scale_layout

        if self.scale_suffix == suffix:  # paired already (a warm swap asks on every call)
            return list(self.paired)
        paired = []
        for name, layout in self.traced.items():
            scales = self.traced.get(name + suffix)
            if scales is None or layout.dtype not in (torch.float8_e4m3fn, torch.uint8):
                continue
            grid = scale_layout(name, layout, "convert")
            ranks = sorted(set(layout.mesh.ranks))
            if sorted(set(scales.mesh.ranks)) != ranks or any(grid.runs(r) != scales.runs(r) for r in ranks):
                raise ReshardError(f"engine: {name + suffix!r} lands as {scales!r}, not as the block grid of "
                                   f"{name!r} ({grid!r}): its scales would not match its data's blocks")
            paired.append(name)
            if name in self and not isinstance(self[name][0], tuple):  # not paired yet
                self[name] = ((self[name][0], self.pop(name + suffix)[0]), layout)
        self.scale_suffix, self.paired = suffix, paired
        return list(paired)

    def finish(self) -> None:
        """After each ``rx.execute``: copies the tensors the loader also writes elsewhere on
        this rank, then calls the engine's loader with the safe-path tensors (whole, as
        received), in checkpoint order. Then the engine's post-load step, if it has one
        (see reshard_ext.engines)."""
        moved = self.stale()
        if moved:
            raise ReshardError(f"engine rank {self.rank}: parameters {moved[:8]} were replaced since the plan bound "
                               f"them (the engine reallocated its weights): this refit wrote into the old storage; "
                               f"rebind with plan.rebind(dst=entries.rebound()) before executing")
        with torch.no_grad():
            for dst, src in self._mirrors:
                dst.copy_(src)
            if self.scratch:
                _consume(self.load(iter(list(self.scratch.items()))))

    def stale(self) -> list[str]:
        """Parameters replaced or resized since these entries were made (empty: none)."""
        now = _params(self.model)
        return [n for n, where in self._bound.items() if n not in now or _where(now[n]) != where]

    def rebound(self) -> EngineEntries:
        """The same trace on the model's current parameters (an engine that freed and
        reallocated its weights with the same shapes): for ``plan.rebind(dst=...)``. The
        loader's constant fills (padding rows) are written into the new storage."""
        params = _params(self.model)
        for name, p in self.params.items():
            q = params.get(name)
            if q is None or (tuple(q.shape), q.dtype, q.stride()) != (tuple(p.shape), p.dtype, p.stride()):
                raise ReshardError(f"engine rank {self.rank}: parameter '{name}' is gone or changed shape, dtype or "
                                   f"strides since the trace: trace the engine again")
        with torch.no_grad():
            for f in self.fills:
                f.view.on(params[f.view.param]).fill_(f.value)
        again = EngineEntries(self.model, self.trace, self.decisions, self.rank, self.load, params, self.reshape)
        if self.scale_suffix is not None:
            again.pair_scales(self.scale_suffix)
        return again

    def report(self) -> str:
        """What the trace found on this rank: traced and safe-path tensors (with why)."""
        lines = [f"engine at refit rank {self.rank}: {len(self) - len(self.scratch)} Hugging Face tensors traced "
                 f"into its parameters, {len(self.scratch)} on the safe path (received whole, then the engine's "
                 f"load_weights)"]
        lines += [f"  safe path: {n}: {why}" for n, why in self.safe.items()]
        return "\n".join(lines)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if t is not None:
            out.setdefault(name, t)
    return out


def _where(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr() if t.device.type != "meta" else 0, tuple(t.shape), t.stride(),
            t.storage_offset(), t.dtype)
