"""swap_model_weights: refit a destination model from a source model (DESIGN section 5).

Either side may be None on a rank (source-only, destination-only and idle ranks), an
nn.Module (or a list of virtual-pipeline chunks), or ready plan entries
``{name: (tensor, layout)}`` (e.g. merged targets built with ``rx.merged``).

Plans are cached by what determines them: the layouts (names, global shapes, dtypes,
meshes, placements) of both sides, the group's ranks, backend, batch bound and
transform -- never by object identity or parallel sizes, so a changed model replans
and a re-created model with the same layouts reuses the plan (rebinding its tensors).

Ranks never diverge: a rank that failed to describe its model makes every rank raise, and
the plan is reused only if every rank hit the same cached plan; otherwise all ranks plan
again together. In groups of at most HEADER_AGREEMENT_RANKS ranks that agreement rides in
the cached plan's execute (the swap round): a rank that hit its cache executes with its
plan generation in the headers, which then go to every rank of the group; a rank that
missed sends a REPLAN header from outside any execute. Every rank reads every header, so
all see the same thing: any REPLAN or generation mismatch and no rank moves data, and all
take the slow path together (one 4-integer all-reduce, then plan or rebind, then
execute). Larger groups make that all-reduce first on every call. A warm call does no
metadata exchange and no planning.
"""
from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _C, adapters, groups, torch_shim
from .adapters import Entries, NameMap, apply_name_map
from .adapters import megatron as megatron_adapter
from .engines.entries import EngineEntries
from .errors import ReshardError
from .execution import Plan
from .fp8block import FP8Block
from .layout import Layout
from .options import Options
from .planning import STATS
from .transforms import Transform
from .transports.channel import SwapReplan

log = logging.getLogger("reshard_ext")

ModelLike = nn.Module | list | tuple | Mapping[str, tuple[torch.Tensor, Layout]] | None
Adapter = Callable[..., Entries]


@dataclass
class _Cached:
    plan: Any
    generation: int
    bound: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)  # "side:name:i" -> (ptr, strides)
    # The entries dicts last bound: a warm call that reuses both (memoized descriptions,
    # fingerprints unchanged) skips comparing every tensor's pointer and strides.
    entries: tuple = ()


_PLANS: dict[tuple, _Cached] = {}
_GENERATIONS: dict[tuple, Any] = {}  # group key -> counter; ranks of a group plan together


@atexit.register
def _release_at_exit() -> None:
    """Drops cached plans (they hold process groups and tensors) while the interpreter is
    whole, and yields the GIL once: a torch gloo worker thread releases its last work's
    tensors on its own, and one that does so during interpreter finalization cannot take
    the GIL, so Python ends the thread inside a noexcept frame and the process aborts
    ("terminate called without an active exception"; backtrace in the closing note of
    this fix). A short sleep lets such a release finish first."""
    _PLANS.clear()
    _DESCRIBED.clear()
    _GROUP_KEYS.clear()
    if STATS["exchanges"]:
        time.sleep(0.05)


def clear_caches(communicators: bool = True) -> None:
    """Drops every cached plan and model description, and the NCCL communicators. Collective
    when communicators exist: their destruction is (every rank of each group must call it;
    on one rank alone NCCL's finalize, then its abort, wait for the other ranks of the host).
    communicators=False keeps them and is local: this rank's next swap plans again, and
    every rank with it."""
    _PLANS.clear()
    _DESCRIBED.clear()
    _GROUP_KEYS.clear()
    if communicators:
        from .transports import nccl_lib

        nccl_lib.clear_communicators()


# Megatron and transformers descriptions of the last models seen: (side, group, offset, kind,
# names) -> (model ids, head,
# snapshot, entries, signature). A warm swap re-checks only what the description depends on
# (the snapshot) instead of describing the model again.
_DESCRIBED: dict[tuple, tuple[tuple, tuple, Any, Entries, _Signature]] = {}


# The tensor attributes the Megatron adapter reads (reshard_ext/adapters/megatron.py).
_TENSOR_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "partition_sizes", "allreduce")


_SHIM = ("data_ptr", "dim", "sizes", "strides", "dtype", "device_type", "device_index")


def _shim_abi(names: tuple[str, ...] = _SHIM) -> Any:
    """_C.TensorAbi over torch's C shim functions aoti_torch_get_<name>."""
    return _C.TensorAbi((*(torch_shim.function(f"get_{n}") for n in names), torch.Tensor, nn.Parameter))


def _reads_like_python(abi: Any) -> bool:
    """Whether `abi` reads probe tensors (strided, offset, 0-d, empty, several dtypes, a
    Parameter, a CUDA one where there is CUDA) exactly as their Python attributes do."""
    base = torch.arange(40, dtype=torch.float64).view(5, 8)
    probes = [base, base[1:, ::3], base.t(), torch.zeros((), dtype=torch.bfloat16), torch.empty(0, 3),
              nn.Parameter(torch.zeros(3, 2, dtype=torch.int32), requires_grad=False), torch.zeros(2, 1, 4)[:, 0]]
    if torch.cuda.is_available():
        probes.append(torch.zeros(3, 4, device="cuda")[:, 1:])
    for t in probes:
        got = abi.read(t)
        if got is None:
            return False
        ptr, dev, idx, dtype, n, *rest = got
        index = t.device.index if t.device.index is not None else -1
        if ((ptr, dev, idx, n, tuple(rest[:n]), tuple(rest[n:])) !=
                (t.data_ptr(), int(t.is_cuda), index, t.dim(), tuple(t.shape), t.stride())
                or dtype != torch_shim.dtype_code(t.dtype)):
            return False
    return True


@functools.cache
def _tensor_abi() -> Any:
    """torch's C shim for the fingerprint's tensor reads, or None (Python reads) where this
    torch lacks it or it reads anything but what Python reads."""
    try:
        abi = _shim_abi()
        if _reads_like_python(abi):
            return abi
        log.debug("swap fingerprint: torch's C shim reads other tensor metadata than Python")
    except Exception as e:  # noqa: BLE001 - any failure means: read tensors through Python
        log.debug("swap fingerprint: torch's C shim is unusable (%s: %s)", type(e).__name__, e)
    return None


def _head(cores: list[nn.Module]) -> tuple:
    return tuple((c, getattr(c, "pg_collection", None), getattr(c, "config", None),
                  getattr(getattr(c, "config", None), "num_moe_experts", None),
                  getattr(c, "share_embeddings_and_output_weights", None)) for c in cores)


def _fingerprint(chunks: list[nn.Module]) -> tuple:
    """Everything the Megatron and transformers adapters read: per chunk its core module,
    process groups, config, expert count and tying (held, so ids cannot be reused), and the exact bytes of its
    module tree (names, layer numbers, non-persistent buffer names) and of every parameter
    and buffer (object, data_ptr, shape, strides, dtype, parallel attributes). Equal
    fingerprints give equal descriptions, so a changed model is described (and planned)
    again. The tree walk is C++ (_C.model_fingerprint)."""
    cores = [megatron_adapter.unwrap(c) for c in chunks]
    return _head(cores), _C.model_fingerprint(cores, _TENSOR_ATTRS, _tensor_abi())


def _snapshot(cores: list[nn.Module]) -> Any:
    """_fingerprint's bytes as a _C.ModelSnapshot, whose unchanged() a warm swap calls instead
    of walking the trees again: one version compare per dict the walk read, and a re-read of
    each tensor's metadata and each list or set value."""
    return _C.model_snapshot(cores, _TENSOR_ATTRS, _tensor_abi())


@functools.cache
def _snapshots_work() -> bool:
    """Whether this Python's dict versions move as ModelSnapshot.unchanged() needs (3.14 has none)."""
    m = nn.Linear(2, 2)
    changes = (lambda: setattr(m, "layer_number", 1), lambda: m._parameters.__setitem__("bias", None),
               lambda: setattr(m.weight, "partition_dim", 0), lambda: m._modules.__setitem__("x", nn.Module()))
    for change in changes:
        snap = _snapshot([m])
        if not snap.unchanged():
            return False
        change()
        if snap.unchanged():
            return False
    return True


def _kind(model: ModelLike, adapter: Adapter | None) -> str | None:
    """The adapter kind of a module side (adapters.pick); None for entries, None or an explicit adapter."""
    if model is None or isinstance(model, Mapping) or adapter is not None:
        return None
    return adapters.pick(model)


def _describe(model: ModelLike, side: str, group: Any, rank_offset: int, adapter: Adapter | None,
              kind: str | None = None, names: Any = None) -> tuple[Entries, _Signature]:
    """(entries, layout signature) of one side: `kind` from _kind, `names` the Hugging
    Face names a Megatron model is described under (adapters.hf_naming)."""
    if model is None:
        return {}, _signature({})
    if isinstance(model, Mapping):
        entries = model if isinstance(model, EngineEntries) else dict(model)
        return entries, _signature(entries)
    if adapter is not None:
        entries = adapter(model, group=group, rank_offset=rank_offset)
        return entries, _signature(entries)
    kind = kind or adapters.pick(model)
    # DTensor: new local tensors on every call, nothing to memoize; an engine's adapter
    # remembers its trace per model itself.
    if kind in (adapters.DTENSOR, adapters.ENGINE):
        entries = adapters.describe(model, kind, side=side, group=group, rank_offset=rank_offset)
        return entries, _signature(entries)
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    memo_key = (side, _group_key(group), rank_offset, kind, names)
    ids = tuple(id(c) for c in chunks)
    cores = [megatron_adapter.unwrap(c) for c in chunks]
    head = _head(cores)
    memo = _DESCRIBED.get(memo_key)
    if memo is not None and (memo[0] != ids or memo[1] != head):
        memo = None  # other chunks
    if memo is not None and _snapshots_work() and memo[2].unchanged():  # the same parameter objects
        STATS["describe_reused"] += 1
        return memo[3], memo[4]
    snap = _snapshot(cores)
    if memo is not None and snap.fingerprint == memo[2].fingerprint:  # e.g. a dict rewritten with the same items
        STATS["describe_reused"] += 1
        _DESCRIBED[memo_key] = (ids, head, snap, memo[3], memo[4])
        return memo[3], memo[4]
    entries = adapters.describe(model, kind, side=side, group=group, rank_offset=rank_offset, names=names)
    sig = _signature(entries)
    _DESCRIBED[memo_key] = (ids, head, snap, entries, sig)
    return entries, sig


# process group -> (its key: backend and ranks, this rank in it); held: none of them ever changes
_GROUP_KEYS: dict[Any, tuple[tuple, int]] = {}


def _group_info(group: Any) -> tuple[tuple, int]:
    g = groups.resolve(group)
    info = _GROUP_KEYS.get(g)
    if info is None:
        info = _GROUP_KEYS[g] = ((groups.backend(g), groups.key(g)), groups.rank(g))
    return info


def _group_key(group: Any) -> tuple:
    return _group_info(group)[0]


def _forget_group(group: groups.Standalone) -> None:
    """Drops the cached plans and descriptions of a standalone group that closes."""
    _GROUP_KEYS.pop(group.process_group, None)
    # keys: _PLANS (group key, ...), _DESCRIBED (side, group key, offset), _GENERATIONS group key,
    # where a group key is (backend, groups.key)
    for cache, of in ((_PLANS, lambda k: k[0]), (_DESCRIBED, lambda k: k[1]), (_GENERATIONS, lambda k: k)):
        for key in [k for k in cache if of(k)[1] == group.key]:
            del cache[key]


groups.on_close(_forget_group)


class _Signature:
    """The sorted (name, layout) pairs of one side, as part of a plan-cache key. Python
    does not cache a tuple's hash: hashing the raw pairs on every warm lookup cost
    ~3 ms for a 389-tensor GPT (two sides, a Python-level Layout.__hash__ each). Hashed
    once here; equal when identical (the memoized description) or equal pairs."""

    __slots__ = ("pairs", "_hash")

    def __init__(self, pairs: tuple) -> None:
        self.pairs = pairs
        self._hash = hash(pairs)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, _Signature) and self._hash == other._hash
                                 and self.pairs == other.pairs)


def _signature(entries: Entries) -> _Signature:
    return _Signature(tuple(sorted((name, layout) for name, (_, layout) in entries.items())))


def _bindings(src: Entries, dst: Entries) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Where each bound tensor lives; a pair entry ((data, scale), layout) counts both."""
    return {
        f"{side}:{name}:{i}": (x.data_ptr(), tuple(x.stride()))
        for side, entries in (("src", src), ("dst", dst))
        for name, (t, _) in entries.items()
        for i, x in enumerate(t if isinstance(t, (tuple, list)) else (t,))
    }


_AGREE_STREAMS: dict[int, Any] = {}

# Groups of at most this many ranks carry a warm swap's agreement in its execute's headers
# (every rank to every rank, beside the first pack); larger ones all-reduce it first
# (log-depth), as the all-to-all would cost O(ranks) messages per rank.
HEADER_AGREEMENT_RANKS = 8


def _agree_stream(device: int) -> Any:
    if device not in _AGREE_STREAMS:
        _AGREE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _AGREE_STREAMS[device]


def _agree(group: Any, failed: bool, generation: int, timeout_s: float | None = None) -> tuple[int, bool]:
    """One all-reduce: (first failed rank + 1 or 0, whether every rank holds `generation`).
    timeout_s: wait at most that long (ReshardError), polling."""
    g = groups.resolve(group)
    (backend, _), rank = _group_info(g)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    # MAX of (-(rank+1) if failed) finds the first failed rank; MAX of v and -v checks all equal.
    values = [-(rank + 1) if failed else -(2**62), generation, -generation]
    if device.type == "cuda":
        # On a stream of its own: the host waits for the other ranks, not for the work
        # the caller queued before the swap (an optimizer step), so the refit's launches
        # are queued while that work still runs.
        with torch.cuda.stream(_agree_stream(device.index)):
            t = torch.tensor(values, dtype=torch.int64, device=device)
            _all_reduce_max(t, g, timeout_s)
            worst, gen_max, neg_gen_min = t.tolist()  # one device sync, not three
    else:
        t = torch.tensor(values, dtype=torch.int64)
        _all_reduce_max(t, g, timeout_s)
        worst, gen_max, neg_gen_min = t.tolist()
    first_failed = 0 if worst == -(2**62) else -worst
    return first_failed, generation >= 0 and gen_max == generation == -neg_gen_min


def _all_reduce_max(t: torch.Tensor, group: Any, timeout_s: float | None) -> None:
    if timeout_s is None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    else:
        from .collectives import wait

        wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True),
             "rx.swap_model_weights (agreeing after a swap round)", timeout_s)


@dataclass
class _Lookup:
    """This rank's side of a swap, found without communicating: its description of both
    models, the plan-cache key and entry, and whether the entry's tensors must be rebound."""

    error: BaseException | None
    src: Entries
    dst: Entries
    key: tuple
    cached: _Cached | None
    bound: dict[str, tuple[int, tuple[int, ...]]] | None  # None: the very entries the plan last bound
    rebinding: bool

    @property
    def clean(self) -> bool:
        """Whether this rank can run the cached plan as it is (if every rank can)."""
        return self.error is None and self.cached is not None and not self.rebinding


def _lookup(src_model: ModelLike, dst_model: ModelLike, backend: str, group: Any, src_rank_offset: int,
            dst_rank_offset: int, name_map: NameMap | None, max_batch_bytes: int | None,
            transform: Transform | None, adapter: Adapter | None, options: Options | None,
            hf_names: Any = None) -> _Lookup:
    error: BaseException | None = None
    src: Entries = {}
    dst: Entries = {}
    key: tuple = ()
    try:
        src_kind, dst_kind = _kind(src_model, adapter), _kind(dst_model, adapter)
        src_names = adapters.hf_naming(src_model, src_kind, dst_model, dst_kind, hf_names)
        dst_names = adapters.hf_naming(dst_model, dst_kind, src_model, src_kind, hf_names)
        src, src_sig = _describe(src_model, "src", group, src_rank_offset, adapter, src_kind, src_names)
        if name_map is not None:
            src = apply_name_map(src, name_map)
            src_sig = _signature(src)
        dst, dst_sig = _describe(dst_model, "dst", group, dst_rank_offset, adapter, dst_kind, dst_names)
        if (isinstance(dst, EngineEntries) and isinstance(transform, FP8Block) and dst.scale_suffix is None
                and dst.pair_scales()):
            dst_sig = _signature(dst)  # a block-FP8 engine: its weights and scales as (data, scale_inv) pairs
        key = (
            _group_key(group), backend, max_batch_bytes,
            transform.cache_key() if transform is not None else None,
            options, src_sig, dst_sig,
        )
    except Exception as e:  # reported to every rank (a swap round, then _agree), so no rank is left waiting
        error = e
    cached = _PLANS.get(key) if error is None else None
    same = cached is not None and len(cached.entries) == 2 and cached.entries[0] is src and cached.entries[1] is dst
    bound = _bindings(src, dst) if cached is not None and not same else None
    rebinding = bound is not None and cached is not None and bound != cached.bound
    return _Lookup(error, src, dst, key, cached, bound, rebinding)


def _settle(look: _Lookup, group: Any, backend: str, max_batch_bytes: int | None, transform: Transform | None,
            options: Options | None, timeout_s: float | None = None) -> Plan:
    """The collective part of a lookup: every rank learns whether any failed, reuses the
    cached plan (rebinding it where needed) or plans again, together."""
    from . import plan as rx_plan  # the core API; imported late (package init order)

    cached, src, dst, bound, rebinding = look.cached, look.src, look.dst, look.bound, look.rebinding
    first_failed, all_hit = _agree(group, look.error is not None, cached.generation if cached else -1, timeout_s)
    if look.error is not None:
        raise look.error
    if first_failed:
        raise ReshardError(f"swap_model_weights: rank {first_failed - 1} failed to describe its models (see its error)")
    if all_hit and cached is not None:
        if rebinding:  # same layouts, new storages (a re-created model): a local rebind, on every transport
            cached.plan.rebind(src=src, dst=dst)
            cached.bound = bound if bound is not None else cached.bound
        cached.entries = (src, dst)
        return cached.plan
    plan = rx_plan(src=src, dst=dst, group=group, backend=backend, max_batch_bytes=max_batch_bytes, transform=transform,
                   options=options)
    gen = next(_GENERATIONS.setdefault(look.key[0], count()))
    _PLANS[look.key] = _Cached(plan, gen, _bindings(src, dst), (src, dst))
    return plan


def _replan_round(group: Any, options: Options | None) -> float:
    """A swap round of a rank that takes the slow path: a REPLAN header to every rank of the
    group (those that hit their cache wait for it in their execute, and leave it on reading
    it). Returns the timeout its waits used."""
    from .transports.channel import REPLAN_HERE, Session, channel_of, exchange_headers

    ch = channel_of(groups.resolve(group))
    timeout_s = (options if isinstance(options, Options) else Options()).resolved_timeout("gloo")
    session = Session(0, 0, None, 0, time.monotonic() + timeout_s, timeout_s, threading.Event(), swap=REPLAN_HERE)
    ch.enter("rx.swap_model_weights")
    try:
        ch.drain(session)
        exchange_headers(ch, [], session, 0)
    finally:
        ch.leave()
    return timeout_s


def _get_plan(
    src_model: ModelLike,
    dst_model: ModelLike,
    backend: str,
    group: Any,
    src_rank_offset: int,
    dst_rank_offset: int,
    name_map: NameMap | None,
    max_batch_bytes: int | None,
    transform: Transform | None,
    adapter: Adapter | None,
    options: Options | None = None,
    hf_names: Any = None,
) -> Plan:
    look = _lookup(src_model, dst_model, backend, group, src_rank_offset, dst_rank_offset, name_map,
                   max_batch_bytes, transform, adapter, options, hf_names)
    return _settle(look, group, backend, max_batch_bytes, transform, options)


def prepare_swap_model_weights(
    src: ModelLike,
    dst: ModelLike,
    group: Any = None,
    backend: str = "auto",
    *,
    src_rank_offset: int = 0,
    dst_rank_offset: int = 0,
    name_map: NameMap | None = None,
    max_batch_bytes: int | None = None,
    transform: Transform | None = None,
    adapter: Adapter | None = None,
    options: Options | None = None,
    hf_names: Any = None,
) -> Plan:
    """Builds (collectively) and caches the plan that `swap_model_weights` will use, and
    returns it. The arguments are swap_model_weights' (without verify, version, timeout)."""
    return _get_plan(src, dst, backend, group, src_rank_offset, dst_rank_offset,
                     name_map, max_batch_bytes, transform, adapter, options, hf_names)


def swap_model_weights(
    src: ModelLike,
    dst: ModelLike,
    group: Any = None,
    backend: str = "auto",
    *,
    src_rank_offset: int = 0,
    dst_rank_offset: int = 0,
    name_map: NameMap | None = None,
    max_batch_bytes: int | None = None,
    transform: Transform | None = None,
    adapter: Adapter | None = None,
    options: Options | None = None,
    hf_names: Any = None,
    verify: bool = False,
    version: int | None = None,
    timeout: float | None = None,
) -> Plan:
    """Copies every destination tensor from the source model, in place, and returns the plan
    it ran. Collective over `group`; the arguments up to `backend` are rx.plan's.

    src / dst: None (this rank holds nothing of that side), plan entries ``{name: (tensor,
    rx.Layout)}``, or a module (or a list of Megatron virtual-pipeline chunks) described by
    the adapter `rx.adapters.pick` chooses: DTensor parameters -> rx.adapters.dtensor (a
    ``transformers`` model among them keeps its checkpoint names), a ``pg_collection`` ->
    rx.adapters.megatron (under Hugging Face names, rx.adapters.megatron_hf, when the other
    side is not a Megatron model or `hf_names` says so), a callable ``load_weights`` (vLLM,
    SGLang) -> rx.adapters.engine (its safe-path tensors go through the engine's own loader
    after every transfer), a ``transformers`` PreTrainedModel -> rx.adapters.hf_model; any
    other module raises saying what to pass. `adapter` (a function ``(model, *, group,
    rank_offset) -> entries``, used for both sides) overrides the choice.

    src_rank_offset, dst_rank_offset: the group rank of the side's model rank 0, where that
    model lives in another world than `group`'s numbering. name_map: renames source names
    to the destination's. max_batch_bytes, transform, options: as in `rx.plan`.
    hf_names: describe Megatron-Core models under Hugging Face checkpoint names: a family
    name such as ``"qwen3_moe"``, a HF config, an `rx.adapters.hf_names.HFNames`, True
    (family inferred from the TransformerConfig) or False (never). Default: when the other
    side on this rank is a module that is not a Megatron model. A rank that holds only the
    Megatron side cannot see the other: pass the same `hf_names` on every rank then. A
    Megatron vocabulary padded beyond the checkpoint's is cut to the vocabulary of
    `hf_names` (a HF config's ``vocab_size``, ``HFNames.vocab_size``), else of the other
    side's config (rx.adapters.megatron_hf).
    verify, version, timeout: as in `rx.execute` (one answer on every rank: it returns on
    every rank only if the refit landed on every rank). A warm call reuses the cached plan:
    no metadata exchange.
    """
    look = _lookup(src, dst, backend, group, src_rank_offset, dst_rank_offset, name_map, max_batch_bytes, transform,
                   adapter, options, hf_names)
    timeout_s = None
    if groups.size(group) <= HEADER_AGREEMENT_RANKS:
        if look.clean:
            cached = look.cached
            assert cached is not None  # clean
            if look.bound is not None:  # new entries, same tensors: the plan keeps them bound
                cached.entries = (look.src, look.dst)
            try:
                # the swap round: every rank's flags in the headers
                cached.plan.execute(verify, version, timeout, swap=cached.generation)
                _finish(look.dst)
                return cached.plan
            except SwapReplan:
                timeout_s = cached.plan.options.resolved_timeout("gloo")
        else:
            timeout_s = _replan_round(group, options)
    # Every rank is here together: the one agreement, then planning or rebinding where needed.
    plan = _settle(look, group, backend, max_batch_bytes, transform, options, timeout_s)
    plan.execute(verify, version, timeout)
    _finish(look.dst)
    return plan


def _finish(dst: Entries) -> None:
    """An engine destination's step after the transfer (its safe-path tensors through its
    own loader: reshard_ext.engines)."""
    if isinstance(dst, EngineEntries):
        dst.finish()


__all__ = ["swap_model_weights", "prepare_swap_model_weights", "clear_caches"]
