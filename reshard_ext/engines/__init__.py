"""Engine parameters from the engine's own loader (DESIGN section 5, "Engines").

An inference engine (vLLM, SGLang) loads a Hugging Face checkpoint with
``model.load_weights(iterable of (hf_name, tensor))``: its loader slices each tensor for
this rank's tensor/expert parallel part, fuses q/k/v and gate/up, stacks experts and pads
the vocabulary. reshard_ext runs that loader once against recording stand-ins (no weight
data is read or copied) and records, for every region of every parameter, which slice of
which Hugging Face tensor fills it; every later refit writes those slices straight into
the parameters, each rank receiving only its own bytes.

Traced (supported) loader steps on a weight: narrow, slicing, chunk, split, unbind,
select, view, reshape (where it is a view), flatten/unflatten, transpose, permute, t,
squeeze/unsqueeze, expand of size-1 dims, contiguous/clone, ``.to`` a device or an exact
(widening) dtype, ``.data``/detach, and ``copy_`` (or ``x[...] = weight``) into a view of a
parameter or buffer, with the cast to the parameter's dtype that copy_ makes (among
float16, bfloat16, float32, float64). The loader's writes of constants into parameters
(``fill_(0)`` of padded vocabulary rows) run at trace time and are kept.

The safe path: any other step on a weight (arithmetic, ``torch.cat``, indexing by a
tensor, a lossy cast, a step that needs values such as ``.item()``, a copy into a
temporary, a write that a later loader step changes or overwrites) sends that Hugging Face
tensor to the safe path on every engine rank that uses it: the rank receives it whole into
a scratch buffer and ``EngineEntries.finish()`` calls the engine's own ``load_weights``
with it after the transfer, in checkpoint order (as NeMo-RL does for its "misc"
parameters). `EngineEntries.safe` names each such tensor and why. A loader that raises
for a weight given as a real tensor, or that replaces parameters while it loads, makes the
trace raise on every engine rank.

The engine's post-load step: after ``rx.execute(plan)`` and ``entries.finish()``, call
what the engine calls after ``load_weights`` when it reloads weights in place, e.g.
vLLM's ``process_weights_after_loading(model, model_config, device)`` for quantized
methods that repack or rescale weights after loading (it is a no-op for unquantized
bf16 models). Trace the model once its weights are loaded and post-processed, as the
engine serves it, and only where load_weights can still load into its parameters. If
the engine frees and reallocates its weights (sleep mode), ``plan.rebind(dst=
entries.rebound())`` points the plan at the new storage without tracing again.

Modules: recording (stand-ins and the dispatch mode), boxes (slices as boxes and views),
trace (the per-rank driver), layouts (one layout from the ranks' pieces), entries (plan
entries and the safe path), checkpoint (names and shapes from safetensors headers).
"""
from __future__ import annotations

from .checkpoint import read_checkpoint, specs_of
from .entries import EngineEntries, decide
from .layouts import infer
from .trace import LocalTrace, trace_loader

__all__ = ["EngineEntries", "LocalTrace", "decide", "infer", "read_checkpoint", "specs_of", "trace_loader"]
