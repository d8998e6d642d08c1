"""Typed knobs and the environment variables that are their defaults: `rx.Options`, the few
a user sets, and `rx.Tuning` (`rx.Options(tuning=...)`), the expert ones with measured defaults.

Every `RESHARD_EXT_*` variable is declared here, once, with its type, default, check and
meaning; nothing else in the package reads the environment. A variable is read and
validated the first time a default is needed (a bad value raises `ReshardError` naming
it), cached for the process, and logged at INFO when set (a deprecated one: a warning
naming its replacement). `rx.plan(options=...)` and `rx.swap_model_weights(options=...)`
take an `Options`; fields left as None fall back to these defaults.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import inspect
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .errors import ReshardError

_log = logging.getLogger("reshard_ext")


@dataclass(frozen=True)
class Knob:
    """One environment variable: its parser (which raises ValueError with the reason) and meaning.
    deprecated_by: the variable that replaces this one; this one is still read for one release
    (unset, it reads as None) and, when set, logged once as a warning naming its replacement."""

    env: str
    default: Any
    parse: Callable[[str], Any]
    doc: str
    deprecated_by: str = ""


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError("expected 0 or 1")


MAX_VERIFY_GROUPS = 255  # the landing groups a direct signal word can count (csrc/core/direct.h)


def _count(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
        t = text.strip().lower().removesuffix("ib").removesuffix("b")
        scale = units.get(t[-1:], 1)
        number = t[:-1] if scale != 1 else t
        try:
            value = int(number) * scale
        except ValueError:
            raise ValueError("expected an integer (optionally with a K, M or G suffix)") from None
        if value < lo:
            raise ValueError(f"expected at least {lo}")
        if hi is not None and value > hi:
            raise ValueError(f"expected at most {hi}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("expected a number of seconds, e.g. 600 or 2.5") from None
    if not value > 0 or value == float("inf"):
        raise ValueError("expected a finite number of seconds > 0")
    return value


def _blocks(text: str) -> int | None:
    return None if text.strip().lower() in ("", "auto") else _count(0)(text)


def _streams(text: str) -> int | None:
    return None if text.strip().lower() in ("", "auto") else _count(1)(text)


KNOBS: dict[str, Knob] = {
    k.env: k
    for k in (
        Knob("RESHARD_EXT_CUDA_BATCH_BYTES", 512 << 20, _count(1),
             "the batch size on GPUs when rx.plan has no max_batch_bytes (that argument is the plan's cap on a "
             "rank's staging memory; this is a size, not a cap: bigger is faster and takes more staging memory)"),
        Knob("RESHARD_EXT_CUDA_DIRECT_BYTES", 64 << 20, _count(0),
             "GPU ops at least this big go straight from/into their tensor when contiguous"),
        Knob("RESHARD_EXT_CPU_DIRECT_BYTES", 1 << 20, _count(0), "the same for the CPU (gloo) transport"),
        Knob("RESHARD_EXT_HOST_MAILBOX", True, _flag,
             "execute headers between processes of one host go through shared memory (0: over gloo, as between "
             "hosts; a pair uses shared memory only where both ranks allow it)"),
        Knob("RESHARD_EXT_HOST_RING", True, _flag,
             "the CPU transport's data between processes of one host goes through shared-memory rings (0: over "
             "gloo; a pair uses the rings only where both ranks allow it)"),
        Knob("RESHARD_EXT_TIMEOUT", 600.0, _seconds,
             "seconds before a missing or stuck peer makes a plan exchange or a transfer raise, on every "
             "transport (gloo / torch point-to-point, NCCL, direct, NVSHMEM); rx.execute(timeout=) overrides it "
             "per call"),
        Knob("RESHARD_EXT_P2P_TIMEOUT", None, _seconds,
             "the timeout of plan exchanges and gloo / torch point-to-point transfers alone",
             deprecated_by="RESHARD_EXT_TIMEOUT"),
        Knob("RESHARD_EXT_NCCL_TIMEOUT", None, _seconds,
             "the timeout of NCCL transfers alone", deprecated_by="RESHARD_EXT_TIMEOUT"),
        Knob("RESHARD_EXT_NCCL_REGISTER", True, _flag,
             "0: no NCCL buffer registration (transfers go through NCCL's FIFOs)"),
        Knob("RESHARD_EXT_SKIP_NCCL_CHECK", False, _flag,
             "1 skips the check that the extension runs torch's libnccl"),
        Knob("RESHARD_EXT_CUDA_SPLIT_COPIES", True, _flag,
             "GPU same-rank copies run in one slice per batch, under the transfers (0: all before the first unpack)"),
        Knob("RESHARD_EXT_CUDA_MAX_BLOCKS", None, _blocks,
             "grid cap of the kernels beside transfers (auto: by workload, verified executes uncapped; 0: no cap; "
             "N: N blocks)"),
        Knob("RESHARD_EXT_BATCH_TAPER", True, _flag,
             "with 3+ batches the first and last carry half a share (every rank must set it alike)"),
        Knob("RESHARD_EXT_RELAY", True, _flag,
             "where more receivers need a piece than ranks hold it, receivers relay it to each other "
             "(0: every receiver pulls from the sources; every rank must set it alike)"),
        Knob("RESHARD_EXT_RELAY_STAGES", 0, _count(0),
             "stages of a relayed refit: each moves one group's scatter with the previous group's forwarding "
             "(0: auto, one per two batches of the relayed bytes, 1 to 8; 1: scatter, then forward; "
             "alike on every rank)"),
        Knob("RESHARD_EXT_DIRECT_TIMEOUT", None, _seconds,
             "the timeout of direct (peer-mapped) refits alone", deprecated_by="RESHARD_EXT_TIMEOUT"),
        Knob("RESHARD_EXT_NVSHMEM_TIMEOUT", None, _seconds,
             "the timeout of NVSHMEM refits alone", deprecated_by="RESHARD_EXT_TIMEOUT"),
        Knob("RESHARD_EXT_DIRECT_ENGINE_BYTES", 1 << 20, _count(0),
             "direct boxes at least this big with contiguous rows go through the copy engines (0: the kernel only)"),
        Knob("RESHARD_EXT_DIRECT_ENGINE_BATCH", True, _flag,
             "direct copy-engine copies go in one batched call per stream (CUDA 12.8+; 0: one call per copy)"),
        Knob("RESHARD_EXT_DIRECT_ENGINE_STREAMS", None, _streams,
             "streams (copy engines) the direct copy-engine copies are spread over, large copies cut to balance them "
             "(auto: one per 100 copies, 4 to 32; N: N streams)"),
        Knob("RESHARD_EXT_DIRECT_VERIFY_GROUPS", 8, _count(1, MAX_VERIFY_GROUPS),
             "a verified direct execute lands in this many groups, each half the one before, each digested by its "
             "receiver while the next ones move (1 to 255; the same on every rank)"),
        Knob("RESHARD_EXT_DIRECT_STAGING_BYTES", 256 << 20, _count(0),
             "a sender's codec boxes on the direct path (rx.MXFP8(where='sender') and the like) are quantized into "
             "a local ring of this many bytes and carried by the copy engines, chunk by chunk (within "
             "max_batch_bytes; 0: the box kernel stores them into the peer)"),
        Knob("RESHARD_EXT_DIRECT_STAGING_SLOTS", 4, _count(1, 64),
             "slots of that ring (a chunk fills one): the box kernel quantizes up to slots - streams chunks ahead "
             "of the copy engines"),
        Knob("RESHARD_EXT_DIRECT_STAGING_STREAMS", 2, _count(1, 16),
             "copy-engine streams carrying that ring's chunks (chunk c on stream c % streams)"),
        Knob("RESHARD_EXT_DIRECT_PREP_OVERLAP", False, _flag,
             "1: on the direct path, the amax pre-pass of a sender-side codec (rx.FP8Block, rx.NVFP4) runs per "
             "tensor on a side stream while the staged chunks of the tensors before it already move, where a "
             "tensor's blocks are whole on its source rank (0: every amax before the first byte moves)"),
        Knob("RESHARD_EXT_DIRECT_LOCAL_ENGINE_BYTES", 0, _count(0),
             "beside direct writes, same-rank copies at least this big with contiguous rows go through a copy "
             "engine (0: the box kernel only); ranks with NCCL pairs keep theirs under the NCCL batches"),
        Knob("RESHARD_EXT_DIRECT_LOCAL_BLOCKS", None, _blocks,
             "grid cap of the same-rank copy kernel beside direct writes (auto: half the SMs; 0: no cap; N: N blocks)"),
        Knob("RESHARD_EXT_DIRECT_IPC", True, _flag,
             "0: this rank maps no peer memory, so every pair it is in uses NCCL (backend 'direct' or 'auto')"),
        Knob("RESHARD_EXT_AUTO_DIRECT", None, _flag,
             "backend 'auto' on CUDA writes straight into peers' tensors where it can (the direct transport: "
             "same host, CUDA IPC), NCCL elsewhere; unset: so except in the stages of a relayed plan, which "
             "run on NCCL; 1: there too; 0 on any rank: NCCL for every pair"),
        Knob("RESHARD_EXT_CHECK_STORAGE", True, _flag,
             "0 skips the per-execute check that no bound tensor's storage was replaced or resized"),
        Knob("RESHARD_EXT_CHECK_THREADS", 4, _count(1),
             "threads that run the storage check of a plan with thousands of bound tensors at once (the "
             "caller and helpers that sleep between executes; 1: the caller alone)"),
        Knob("RESHARD_EXT_TRACE", False, _flag,
             "1: every GPU execute logs a CUDA-event timeline of its steps (synchronises: diagnostics only)"),
    )
}

# The transports whose timeouts had a variable of their own (deprecated; the rest read RESHARD_EXT_P2P_TIMEOUT).
DEPRECATED_TIMEOUTS = {"nccl": "RESHARD_EXT_NCCL_TIMEOUT", "direct": "RESHARD_EXT_DIRECT_TIMEOUT",
                       "nvshmem": "RESHARD_EXT_NVSHMEM_TIMEOUT"}

_CACHE: dict[str, Any] = {}
# Inside rx.plan's first exchange: a bad variable reads as its default (rx.plan has already
# put its error into that exchange, so every rank raises it there, not this rank alone).
_STAND_IN: contextvars.ContextVar[bool] = contextvars.ContextVar("reshard_ext_stand_in", default=False)


def env_default(name: str) -> Any:
    """The value of knob `name` from the environment (or its default), read and checked once."""
    if name in _CACHE:
        return _CACHE[name]
    knob = KNOBS[name]
    raw = os.environ.get(name)
    if raw is None:
        value = knob.default
    else:
        try:
            value = knob.parse(raw)
        except ValueError as e:
            if _STAND_IN.get():
                return knob.default
            raise ReshardError(f"environment variable {name}={raw!r} is invalid: {e} ({knob.doc})") from None
        if knob.deprecated_by:
            _log.warning("reshard_ext: %s=%s is deprecated and will be removed in the next release: set %s "
                         "instead", name, raw, knob.deprecated_by)
        else:
            _log.info("reshard_ext: %s=%s (from the environment)", name, raw)
    _CACHE[name] = value
    return value


def environment_problems() -> list[str]:
    """What is wrong with this process's RESHARD_EXT_* variables (each read once)."""
    problems = []
    for name in KNOBS:
        try:
            env_default(name)
        except ReshardError as e:
            problems.append(str(e))
    return problems


@contextlib.contextmanager
def defaults_for_bad_environment() -> Iterator[None]:
    """Within the block a bad variable reads as its default (see _STAND_IN)."""
    token = _STAND_IN.set(True)
    try:
        yield
    finally:
        _STAND_IN.reset(token)


def reload_environment() -> None:
    """Forgets the cached environment values (tests, or a process that changes its environment)."""
    _CACHE.clear()


_Check = tuple[type, Callable[[Any], bool], str]


def _check_fields(owner: str, obj: Any, checks: dict[str, _Check]) -> None:
    """Raises ReshardError naming the first field (of rx.Options or rx.Tuning) of the wrong type or range."""
    for name, (kind, ok, what) in checks.items():
        value = getattr(obj, name)
        if value is None:
            continue
        typed = isinstance(value, kind) or (kind is float and isinstance(value, int))
        if isinstance(value, bool) and kind is not bool:
            typed = False
        if not typed or not ok(value):
            raise ReshardError(f"{owner}({name}={value!r}): expected {what}")


_BOOL: _Check = (bool, lambda v: True, "a bool")
_AT_LEAST_0: _Check = (int, lambda v: v >= 0, "an integer >= 0")


@dataclass(frozen=True, kw_only=True)
class Tuning:
    """Expert knobs: most users never set them. Their defaults were measured (benchmarks/RESULTS.md
    has the runs); pass one as `rx.Options(tuning=rx.Tuning(...))` only to reproduce or beat a
    measurement on your hardware. None: the environment variable's value, else its default
    (docs/reference/knobs.md lists them).

    - batch_bytes: the batch size on GPUs when the plan has no `max_batch_bytes`
      (RESHARD_EXT_CUDA_BATCH_BYTES). Not a bound: `rx.plan(max_batch_bytes=...)` is the
      plan's cap on a rank's staging memory, and where it is given this knob is not used.
    - direct_bytes: ops at least this big are their own message, straight from/into a
      contiguous tensor (RESHARD_EXT_CUDA_DIRECT_BYTES on GPUs, RESHARD_EXT_CPU_DIRECT_BYTES on
      CPUs; alike on every rank, rx.plan checks).
    - nccl_register: NCCL buffer registration (RESHARD_EXT_NCCL_REGISTER; every rank votes).
    - max_blocks: grid cap beside transfers, 0 for none (RESHARD_EXT_CUDA_MAX_BLOCKS; None: by workload,
      and none in verified executes, whose hashing kernels would otherwise set the pace).
    - split_copies: same-rank copies sliced under the transfers (RESHARD_EXT_CUDA_SPLIT_COPIES).
    - batch_taper: half-size first and last batches (RESHARD_EXT_BATCH_TAPER; alike on every rank).
    - relay_stages: stages of a relayed refit, 0 = auto (RESHARD_EXT_RELAY_STAGES; alike on every
      rank, rx.plan checks): the relayed tensors split into groups by bytes, and stage s moves
      group s from the sources together with group s - 1 among the replicas.
    - direct_engine_bytes: direct boxes at least this big with contiguous rows of >= 512 B
      go through the copy engines, the others through the box kernel; 0: kernel only
      (RESHARD_EXT_DIRECT_ENGINE_BYTES).
    - direct_engine_batch: the copy-engine copies of a direct execute go in one batched
      call per stream where CUDA has it (RESHARD_EXT_DIRECT_ENGINE_BATCH).
    - direct_engine_streams: streams the direct copy-engine copies are spread over, in
      parts of about equal bytes (RESHARD_EXT_DIRECT_ENGINE_STREAMS; None: one per 100
      copies, 4 to 32, _C.auto_engine_streams).
    - direct_verify_groups: a verified direct execute's senders write and signal each pair's
      ops in this many groups, each half the size of the one before, and the receiver digests
      group k while the next ones move; a group's copies spread over the streams its own
      copy count calls for, at most direct_engine_streams (1 to 255, the same on every rank:
      plan raises otherwise; RESHARD_EXT_DIRECT_VERIFY_GROUPS).
    - direct_staging_bytes: a sender's codec boxes (a conversion on the sending side, such as
      rx.MXFP8(where="sender")) go through a local staging ring of at most this many bytes on
      the direct path: the box kernel quantizes a chunk into a slot while the copy engines carry
      the chunk before it into the peer, so the link runs at the copy engines' rate; within
      max_batch_bytes where the plan has one; 0: the box kernel stores them into the peer
      (RESHARD_EXT_DIRECT_STAGING_BYTES).
    - direct_prep_overlap: on the direct path, a sender-side codec's amax pre-pass and scales
      (rx.FP8Block, rx.NVFP4 with where="sender") run per tensor on a side stream, in the order
      the staged chunks read the tensors, each chunk waiting only for its own tensors' work, so
      the link starts after the first tensor's amax instead of every tensor's; tensors whose
      blocks a source shard cuts (their amaxes are reduced among ranks) keep the pre-pass
      (RESHARD_EXT_DIRECT_PREP_OVERLAP; default off until measured).
    - direct_local_engine_bytes: on a rank whose peers are all direct, same-rank copies at
      least this big with contiguous rows of >= 512 B run on a copy engine beside the direct
      writes, the others in the box kernel; 0: kernel only (RESHARD_EXT_DIRECT_LOCAL_ENGINE_BYTES).
    - direct_local_blocks: grid cap of that same-rank kernel, 0 for none (RESHARD_EXT_DIRECT_LOCAL_BLOCKS;
      None: half the SMs, so the copy engines' peer writes keep their share of HBM).
    - check_threads: threads that run the storage check (rx.Options.check_storage) at once on
      plans with >= 4,096 bound pieces: the caller and helper threads asleep between executes
      (RESHARD_EXT_CHECK_THREADS, default 4 but at most this process's share of the cores; 1:
      the caller alone).
    - host_ring: the CPU transport's data between processes of one host goes through
      shared-memory rings, not gloo (RESHARD_EXT_HOST_RING; used only where every rank
      says so: rx.plan takes the vote).
    """

    batch_bytes: int | None = None
    direct_bytes: int | None = None
    nccl_register: bool | None = None
    max_blocks: int | None = None
    split_copies: bool | None = None
    batch_taper: bool | None = None
    relay_stages: int | None = None
    direct_engine_bytes: int | None = None
    direct_engine_batch: bool | None = None
    direct_engine_streams: int | None = None
    direct_verify_groups: int | None = None
    direct_staging_bytes: int | None = None
    direct_prep_overlap: bool | None = None
    direct_local_engine_bytes: int | None = None
    direct_local_blocks: int | None = None
    check_threads: int | None = None
    host_ring: bool | None = None

    def __post_init__(self) -> None:
        _check_fields("rx.Tuning", self, {
            "batch_bytes": (int, lambda v: v >= 1, "an integer >= 1"),
            "direct_bytes": _AT_LEAST_0,
            "nccl_register": _BOOL,
            "max_blocks": _AT_LEAST_0,
            "split_copies": _BOOL,
            "batch_taper": _BOOL,
            "relay_stages": (int, lambda v: v >= 0, "an integer >= 0 (0: auto)"),
            "direct_engine_bytes": _AT_LEAST_0,
            "direct_engine_batch": _BOOL,
            "direct_engine_streams": (int, lambda v: v >= 1, "an integer >= 1"),
            "direct_verify_groups": (int, lambda v: 1 <= v <= MAX_VERIFY_GROUPS,
                                     f"an integer from 1 to {MAX_VERIFY_GROUPS}"),
            "direct_staging_bytes": _AT_LEAST_0,
            "direct_prep_overlap": _BOOL,
            "direct_local_engine_bytes": _AT_LEAST_0,
            "direct_local_blocks": _AT_LEAST_0,
            "check_threads": (int, lambda v: 1 <= v <= 64, "an integer from 1 to 64"),
            "host_ring": _BOOL,
        })

    def replace(self, **changes: Any) -> Tuning:
        return dataclasses.replace(self, **changes)


_NO_TUNING = Tuning()


@dataclass(frozen=True, kw_only=True)
class Options:
    """The knobs of one plan a user sets. None: the environment variable's value, else its default.

    - timeout: seconds before a missing or stuck peer makes a plan exchange or a transfer
      raise, on every transport (RESHARD_EXT_TIMEOUT; rx.execute(timeout=) overrides it per call).
    - relay: relay fan-out to replicas (RESHARD_EXT_RELAY; alike on every rank, rx.plan checks).
    - auto_direct: backend "auto" uses the direct transport (direct pairs where it can, NCCL
      elsewhere) unless a rank says False (RESHARD_EXT_AUTO_DIRECT). None: the direct
      transport, except for the stages of a relayed plan (rx.Options.relay), which run on
      NCCL: its staged fan-out is faster than the copy engines' there (benchmarks/RESULTS.md).
    - direct_ipc: False makes this rank map no peer memory, so its pairs use NCCL
      (RESHARD_EXT_DIRECT_IPC).
    - check_storage: every execute first checks that no bound tensor's storage was
      replaced or resized since binding (RESHARD_EXT_CHECK_STORAGE; one data_ptr read per
      bound tensor, in C++ where torch allows).
    - trace: log a CUDA-event timeline of every GPU execute (RESHARD_EXT_TRACE).
    - tuning: the expert knobs (rx.Tuning: batch sizes, grid caps, copy-engine use), whose
      measured defaults most users keep.
    """

    timeout: float | None = None
    relay: bool | None = None
    auto_direct: bool | None = None
    direct_ipc: bool | None = None
    check_storage: bool | None = None
    trace: bool | None = None
    tuning: Tuning | None = None

    def __new__(cls, *args: Any, **fields: Any) -> Options:
        # A former field would otherwise be a bare TypeError: say where it went.
        moved = [name for name in fields if name in Tuning.__dataclass_fields__]
        if moved:
            given = ", ".join(f"{name}=..." for name in moved)
            raise ReshardError(f"rx.Options({given}): {', '.join(moved)} moved to rx.Tuning: "
                               f"rx.Options(tuning=rx.Tuning({given}))")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        _check_fields("rx.Options", self, {
            "timeout": (float, lambda v: 0 < v < float("inf"), "a finite number of seconds > 0"),
            "relay": _BOOL,
            "auto_direct": _BOOL,
            "direct_ipc": _BOOL,
            "check_storage": _BOOL,
            "trace": _BOOL,
            "tuning": (Tuning, lambda v: True, "an rx.Tuning"),
        })

    def replace(self, **changes: Any) -> Options:
        return dataclasses.replace(self, **changes)

    def with_tuning(self, **changes: Any) -> Options:
        """A copy whose rx.Tuning has `changes`."""
        return self.replace(tuning=(self.tuning or _NO_TUNING).replace(**changes))

    def _tuned(self, name: str) -> Any:
        return getattr(self.tuning or _NO_TUNING, name)

    # --- resolved values (explicit field, else the environment's default) ---------------
    def resolved_timeout(self, transport: str) -> float:
        if self.timeout is not None:
            return float(self.timeout)
        deprecated = DEPRECATED_TIMEOUTS.get(transport, "RESHARD_EXT_P2P_TIMEOUT")
        value = env_default(deprecated)  # None unless set, for one more release
        return float(value if value is not None else env_default("RESHARD_EXT_TIMEOUT"))

    def resolved_relay(self) -> bool:
        return self.relay if self.relay is not None else bool(env_default("RESHARD_EXT_RELAY"))

    def resolved_auto_direct(self, relayed: bool = False) -> bool:
        """relayed: for the stages of a relayed plan."""
        value = self.auto_direct if self.auto_direct is not None else env_default("RESHARD_EXT_AUTO_DIRECT")
        return not relayed if value is None else bool(value)

    def resolved_direct_ipc(self) -> bool:
        return self.direct_ipc if self.direct_ipc is not None else bool(env_default("RESHARD_EXT_DIRECT_IPC"))

    def resolved_check_storage(self) -> bool:
        if self.check_storage is not None:
            return self.check_storage
        return bool(env_default("RESHARD_EXT_CHECK_STORAGE"))

    def resolved_trace(self) -> bool:
        return self.trace if self.trace is not None else bool(env_default("RESHARD_EXT_TRACE"))

    # --- resolved rx.Tuning values ----------------------------------------------------------
    def resolved_batch_bytes(self) -> int:
        value = self._tuned("batch_bytes")
        return value if value is not None else int(env_default("RESHARD_EXT_CUDA_BATCH_BYTES"))

    def resolved_host_ring(self) -> bool:
        value = self._tuned("host_ring")
        return value if value is not None else bool(env_default("RESHARD_EXT_HOST_RING"))

    def resolved_direct_bytes(self, device: str) -> int:
        value = self._tuned("direct_bytes")
        if value is not None:
            return int(value)
        return int(env_default("RESHARD_EXT_CUDA_DIRECT_BYTES" if device == "cuda" else "RESHARD_EXT_CPU_DIRECT_BYTES"))

    def resolved_nccl_register(self) -> bool:
        value = self._tuned("nccl_register")
        return value if value is not None else bool(env_default("RESHARD_EXT_NCCL_REGISTER"))

    def resolved_max_blocks(self) -> int | None:
        value = self._tuned("max_blocks")
        return value if value is not None else env_default("RESHARD_EXT_CUDA_MAX_BLOCKS")

    def resolved_split_copies(self) -> bool:
        value = self._tuned("split_copies")
        return value if value is not None else bool(env_default("RESHARD_EXT_CUDA_SPLIT_COPIES"))

    def resolved_batch_taper(self) -> bool:
        value = self._tuned("batch_taper")
        return value if value is not None else bool(env_default("RESHARD_EXT_BATCH_TAPER"))

    def resolved_relay_stages(self) -> int:
        value = self._tuned("relay_stages")
        return value if value is not None else int(env_default("RESHARD_EXT_RELAY_STAGES"))

    def resolved_direct_engine_bytes(self) -> int:
        value = self._tuned("direct_engine_bytes")
        return value if value is not None else int(env_default("RESHARD_EXT_DIRECT_ENGINE_BYTES"))

    def resolved_direct_engine_batch(self) -> bool:
        value = self._tuned("direct_engine_batch")
        return value if value is not None else bool(env_default("RESHARD_EXT_DIRECT_ENGINE_BATCH"))

    def resolved_direct_engine_streams(self) -> int:
        """0: by the number of copies (_C.auto_engine_streams)."""
        value = self._tuned("direct_engine_streams")
        return value if value is not None else env_default("RESHARD_EXT_DIRECT_ENGINE_STREAMS") or 0

    def resolved_direct_verify_groups(self) -> int:
        value = self._tuned("direct_verify_groups")
        return value if value is not None else int(env_default("RESHARD_EXT_DIRECT_VERIFY_GROUPS"))

    def resolved_direct_staging_bytes(self) -> int:
        value = self._tuned("direct_staging_bytes")
        return value if value is not None else int(env_default("RESHARD_EXT_DIRECT_STAGING_BYTES"))

    def resolved_direct_prep_overlap(self) -> bool:
        value = self._tuned("direct_prep_overlap")
        return value if value is not None else bool(env_default("RESHARD_EXT_DIRECT_PREP_OVERLAP"))

    def resolved_direct_local_engine_bytes(self) -> int:
        value = self._tuned("direct_local_engine_bytes")
        return value if value is not None else int(env_default("RESHARD_EXT_DIRECT_LOCAL_ENGINE_BYTES"))

    def resolved_direct_local_blocks(self) -> int | None:
        """None: the transport's default (half the SMs)."""
        value = self._tuned("direct_local_blocks")
        return value if value is not None else env_default("RESHARD_EXT_DIRECT_LOCAL_BLOCKS")

    def resolved_check_threads(self) -> int:
        value = self._tuned("check_threads")
        if value is not None:
            return int(value)
        # a default never takes more than this process's share of the cores (torchrun's local ranks)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        local = external_env("LOCAL_WORLD_SIZE") or "1"
        share = max(1, cores // max(1, int(local))) if local.isdigit() else 1
        return max(1, min(int(env_default("RESHARD_EXT_CHECK_THREADS")), share, 64))


# help(), IDEs and inspect show the fields, not the catch-all of __new__ (which inspect prefers)
_fields_signature = inspect.signature(Options.__init__)
Options.__signature__ = _fields_signature.replace(  # type: ignore[attr-defined]
    parameters=list(_fields_signature.parameters.values())[1:])


def default_timeout(transport: str) -> float:
    """The timeout of a wait outside any plan's options (rx.Options.resolved_timeout's default)."""
    return Options().resolved_timeout(transport)


MAX_WAIT_S = 1e7  # the longest wait handed to a library (116 days): any longer timeout means "never"


def wait_time(seconds: float) -> datetime.timedelta:
    """`seconds` as the timedelta a library's wait takes: a timeout too big for one (1e18)
    waits MAX_WAIT_S instead of raising OverflowError."""
    return datetime.timedelta(seconds=min(max(float(seconds), 0.0), MAX_WAIT_S))


def skip_nccl_check() -> bool:
    return bool(env_default("RESHARD_EXT_SKIP_NCCL_CHECK"))


def external_env(name: str) -> str | None:
    """A variable of another tool (NCCL_HOME, ...), read here so the package reads the
    environment in one module."""
    return os.environ.get(name)


@contextlib.contextmanager
def scoped_external_env(name: str, value: str) -> Iterator[None]:
    """Sets a variable another library reads at construction (torch's TORCH_GLOO_LAZY_INIT)
    for the duration of the block, then restores it."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def set_process_env_default(name: str, value: str) -> str:
    """Sets a variable another library reads (NCCL's) unless the user set it; returns its value."""
    return os.environ.setdefault(name, value)


__all__ = ["Options", "Tuning", "KNOBS", "Knob", "env_default", "default_timeout", "reload_environment"]
