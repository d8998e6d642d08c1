"""The direct transport (DESIGN section 4, "Direct path").

On one host, a sender writes each box straight from its source tensor into the receiver's
destination tensor through a CUDA IPC mapping of the receiver's memory: no staging at
either end, no pack, no unpack. Large boxes with contiguous rows go through the copy
engines (batched calls), the rest through one launch of the box kernel; same-rank copies
run beside them (on a rank without NCCL pairs: a copy engine for large ones, the kernel
for the rest, issued before the host waits for the receivers). A sender-side codec's boxes
(rx.MXFP8(where="sender"), ...) are the exception: the box kernel quantizes them into a
local staging ring, chunk by chunk, and the copy engines carry each chunk into the peer
while the next one is quantized (rx.Tuning.direct_staging_bytes; core/direct.h).
Completion reaches the receiver on the GPU (csrc/comm/direct_exec.h has the protocol).

A pair of ranks goes direct when both are on one host in different processes, both are
willing (`rx.Options.direct_ipc`), each can map the other's signal words, and the sender
can map every destination the receiver exposes to it. Every other pair moves its bytes
over NCCL in the same plan (torch point-to-point where the NCCL transport is not built).
The choice is made collectively when the plan binds, so every rank agrees on it.

Contract: destinations are idle during `execute` from the receiver's current stream's
point of view (nothing reads or writes them until execute returns), as with every
transport; a sender writes into them as soon as the receiver's stream reaches execute.

`plan.rebind` is local, as with every transport. A rank that rebinds its sources rebuilds
its own writes. A rank whose destinations that direct senders write into changed exports
them at once (memory CUDA IPC cannot share raises there, and the plan keeps its tensors)
and, at its next execute, flags that in its headers and sends the new exports to its
direct senders over the channel; each maps them and rebuilds its writes before any of
them, and answers. A sender that cannot map them refuses the pair at both ends (no data
moves with it, each raises naming the tensors; a pair moves to NCCL only with every rank
agreeing: `plan.rebind(collective=True)` on every rank rebuilds the plan, as after a failed
direct execute). A receiver with several direct peers then tells each whether it takes part,
so that none waits for it (a third message, in that execute only). Executes after the first
pay nothing more.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import _C, groups
from ..collectives import all_gather_objects
from ..errors import ReshardError
from ..options import Options, env_default
from . import nccl_lib
from .channel import REMAP_TAG, Session, channel_of, exchange_headers
from .outcome import SEE_RANK

_log = logging.getLogger("reshard_ext")

Pair = tuple[int, int]  # (lower rank, higher rank)
_UNREAD_STAGING = 1 << 44  # staging base of the verify tables: their read passes never touch it
_SEND, _RECV = 0, 1  # parts of a digest reader (send, recv, copy src, copy dst)


def pair(a: int, b: int) -> Pair:
    return (a, b) if a < b else (b, a)


def host_identity() -> str:
    """Which host this process runs on: hostname and boot id (containers that share a
    hostname but not a kernel get different ids)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class RankInfo:
    """What a rank tells the others when a plan first binds."""

    host: str
    pid: int
    pci: str                       # PCI bus id of its GPU ("" if unknown)
    flags: tuple | None = None  # IPC export of its signal words; None: it takes no direct pair
    page: str = ""                 # path of its shared page
    why: str = ""                  # why it takes no direct pair
    groups: int = 1                # rx.Tuning.direct_verify_groups (every rank must agree)


def stage_slot_bytes(ring: int, max_batch_bytes: int | None, other_staging: int, slots: int = _C.STAGE_SLOTS) -> int:
    """Bytes of one slot of the ring a sender's codec boxes are staged in (core/direct.h,
    plan_staging): the ring of `ring` bytes (rx.Tuning.direct_staging_bytes), within
    max_batch_bytes beside the `other_staging` bytes of the NCCL pairs' batches, in
    `slots` aligned slots (RESHARD_EXT_DIRECT_STAGING_SLOTS); 0: nothing is staged."""
    if max_batch_bytes is not None:
        ring = min(ring, max(0, max_batch_bytes - other_staging))
    return ring // slots // _C.STAGE_ALIGN * _C.STAGE_ALIGN


def staging_shape() -> tuple[int, int]:
    """(slots, copy streams) of the staging ring (RESHARD_EXT_DIRECT_STAGING_SLOTS / _STREAMS)."""
    return int(env_default("RESHARD_EXT_DIRECT_STAGING_SLOTS")), int(env_default("RESHARD_EXT_DIRECT_STAGING_STREAMS"))


def staged_send_rows(staged_ops: Sequence[int], box_ops: Sequence[int],
                     direct_sends: Sequence[int]) -> tuple[list, list]:
    """How a verified execute folds its staged boxes' digests into the plan's send digests
    (digests.fold_into): (rows, ops). staged_ops: the direct send op of each staged box, in
    the executor's staged order; box_ops: that of every direct box (ExecTables.direct_ops);
    direct_sends: the plan's send op index of each direct send op. An op every box of which
    is staged is digested from the ring (ops lists it, by send index); any other op's staged
    pieces are dropped (row len(ops)) and the op is read from its source as a whole."""
    boxes_of: dict[int, int] = {}
    for op in box_ops:
        boxes_of[op] = boxes_of.get(op, 0) + 1
    staged_of: dict[int, int] = {}
    for op in staged_ops:
        staged_of[op] = staged_of.get(op, 0) + 1
    whole = sorted(op for op, n in staged_of.items() if n == boxes_of[op])
    row = {op: i for i, op in enumerate(whole)}
    return [row.get(op, len(whole)) for op in staged_ops], [direct_sends[op] for op in whole]


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """[begin, end) runs of ascending indices."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _union(spans: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def direct_timeline_text(rows: Sequence[tuple[str, int, float, float]], streams: int | None = None) -> str:
    """DirectExec.timeline's rows (kind, index, begin ms, end ms) as the log shows them: a
    summary (the execute's span; the link's busy and idle time between its first and last
    write; the staged chunks' packs, the copy streams' waits for them and the pack stream's
    waits for a free slot), then each step, a staged chunk's pack, digest and copy on one line."""
    if not rows:
        return ""
    streams = streams or staging_shape()[1]
    span = max(e for *_, e in rows)
    by: dict[str, dict[int, tuple[float, float]]] = {}
    for kind, i, b, e in rows:
        by.setdefault(kind, {})[i] = (b, e)
    pack, copy, digest = by.get("pack", {}), by.get("copy", {}), by.get("digest", {})
    writes = [(b, e) for kind, _, b, e in rows if kind in ("copy", "kernel", "kernel group") or
              kind.startswith("engine")]
    lines = [f"direct execute timeline (CUDA events): span {span:.3f} ms"]
    if writes:
        first, last = min(b for b, _ in writes), max(e for _, e in writes)
        busy = _union(writes)
        lines.append(f"  writes (copy engines, kernels): first {first:.3f} ms, last end {last:.3f} ms; busy "
                     f"{busy:.3f} ms, idle between {last - first - busy:.3f} ms; before the first {first:.3f} ms, "
                     f"after the last {span - last:.3f} ms")
    if pack:
        n = len(pack)
        busy_p = sum(e - b for b, e in pack.values())
        # a copy stream free (chunk c - streams out) before chunk c was packed waited for that pack
        waited = sum(copy[c][0] - copy[c - streams][1] for c in copy
                     if c >= streams and c - streams in copy and c in pack and pack[c][1] > copy[c - streams][1])
        # the pack stream idle between chunks: waiting for a slot to be copied out
        slot_wait = sum(max(0.0, pack[c][0] - (digest.get(c - 1) or pack[c - 1])[1]) for c in pack if c - 1 in pack)
        busy_c = _union(list(copy.values()))
        lines.append(f"  staged: {n} chunks; packs {busy_p:.3f} ms in all ({busy_p / n:.3f} ms each), digests "
                     f"{sum(e - b for b, e in digest.values()):.3f} ms; copies busy {busy_c:.3f} ms; copy streams "
                     f"waited {waited:.3f} ms for packs; the pack stream waited {slot_wait:.3f} ms for free slots")
    for kind, i, b, e in rows:
        if kind in ("pack", "copy", "digest"):
            continue
        lines.append(f"  {kind + ' ' + str(i):>24}: {b:8.3f} -> {e:8.3f} ms")
    for c in sorted(pack):
        cells = [f"pack {pack[c][0]:8.3f} -> {pack[c][1]:8.3f}"]
        if c in digest:
            cells.append(f"digest {digest[c][0]:8.3f} -> {digest[c][1]:8.3f}")
        if c in copy:
            cells.append(f"copy (stream {c % streams}) {copy[c][0]:8.3f} -> {copy[c][1]:8.3f}")
        lines.append(f"  {'chunk ' + str(c):>24}: " + ", ".join(cells) + " ms")
    return "\n".join(lines)


def candidate_pairs(infos: Sequence[RankInfo]) -> set[Pair]:
    """Pairs that may go direct, from every rank's RankInfo alone (so every rank computes
    the same set): same host, different processes, both set up."""
    out = set()
    for a, x in enumerate(infos):
        for b in range(a + 1, len(infos)):
            y = infos[b]
            if x.flags is not None and y.flags is not None and x.host == y.host and x.pid != y.pid:
                out.add((a, b))
    return out


def peers_of(pairs: Iterable[Pair], rank: int) -> list[int]:
    return sorted({b if a == rank else a for a, b in pairs if rank in (a, b)})


def agree(gathered: Sequence[tuple[list[str], set[Pair]]]) -> set[Pair]:
    """Raises every rank's errors on every rank, else returns the union of the pairs the
    ranks found unusable."""
    errors = [e for errs, _ in gathered for e in errs]
    if errors:
        shown = errors[:20]
        raise ReshardError("direct transport setup failed:\n  " + "\n  ".join(shown) +
                           (f"\n  ... and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""))
    return {p for _, failed in gathered for p in failed}


def _gather(group: Any, obj: Any, timeout_s: float) -> list[Any]:
    # Bounded: a rank that calls plan.rebind(collective=True) alone raises after the
    # reshard timeout instead of the process group's.
    return all_gather_objects(obj, group, "binding a plan with direct pairs (rx.plan or plan.rebind(collective=True), "
                              "collective: every rank of the group calls it)", timeout_s)


_COLLECTIVE_HINT = ("a pair moves over NCCL only with every rank agreeing: call plan.rebind(collective=True) on every "
                    "rank to rebuild the plan with it over NCCL")


def _unmappable(sender: int, receiver: int, names: Sequence[str], why: str) -> str:
    """The error of a pair whose sender cannot map the receiver's rebound destinations (alike at both ends)."""
    return (f"rank {sender} cannot map the destination tensors {sorted(set(names))} that rank {receiver} rebound "
            f"(plan.rebind) for its direct writes: {why or SEE_RANK[2:] + str(sender)}; {_COLLECTIVE_HINT}")


_NOTE_BYTES = 4096  # a remapping receiver's outcome: why it takes no part in the direct writes ("" if it does)


def _frame(raw: bytes, size: int) -> torch.Tensor:
    """A channel message: `raw` behind its length, padded to `size` bytes."""
    msg = torch.zeros(size, dtype=torch.uint8)
    msg.numpy()[:8 + len(raw)] = memoryview(len(raw).to_bytes(8, "little") + raw)
    return msg


def _unframe(msg: torch.Tensor) -> bytes:
    raw = msg.numpy().tobytes()
    return raw[8:8 + int.from_bytes(raw[:8], "little")]


def _refuse(verdict: Any, lost: dict[int, str]) -> None:
    for p, failure in lost.items():
        verdict.bad.setdefault(p, f"handing over rebound destinations failed ({failure})")


def _note(text: str) -> torch.Tensor:
    raw = text.encode()
    return _frame(raw if len(raw) <= _NOTE_BYTES - 8 else raw[:_NOTE_BYTES - 11] + b"...", _NOTE_BYTES)


def run_deferred(step: tuple[Any, Any]) -> None:
    """One deferred pre-pass item and its rewrite's before step (transforms.py)."""
    item, before = step
    item.run_deferred()
    if before is not None:
        before()


class CudaDevice:
    """What the transport asks of the machine, in one place (tests put a CPU stand-in here):
    signal words, CUDA IPC, the per-execute steps, and the transport of the other pairs."""

    def __init__(self) -> None:
        self.index = torch.cuda.current_device()
        self._side: Any = None  # fork()'s stream
        self._prep: Any = None  # prep()'s stream

    def signals(self, rank: int, world: int, timeout_s: float) -> Any:
        if not hasattr(_C, "DirectSignals"):
            raise ReshardError("reshard_ext was built without CUDA")
        return _C.DirectSignals(rank, world, self.index, timeout_s)

    def pci_bus_id(self) -> str:
        return str(_C.device_pci_bus_id(self.index))

    def can_reach(self, pci_bus_id: str) -> bool:
        return bool(pci_bus_id) and _C.peer_access(self.index, pci_bus_id) != 0

    def export(self, ptr: int) -> Any:
        return _C.ipc_export(ptr)

    def open(self, handle: bytes) -> Any:
        return _C.IpcMapping(handle)

    def executor(self, signals: Any, boxes: _C.BoxTable, local: _C.BoxTable, options: Options, receivers: list[int],
                 senders: list[int], timeout: float, box_groups: list[int], groups: int, stageable: list[int],
                 slot_bytes: int, ordinals: list[int]) -> tuple[Any, Any]:
        """(the per-execute steps, the device memory it keeps: its kernel tables and staging
        ring); box_groups: the landing group of each box, of `groups`; stageable and
        slot_bytes: the boxes it may stage and the size of a staging slot (core/direct.h);
        ordinals: each box's first verify ordinal in its op."""
        slots, streams = staging_shape()
        blocks = options.resolved_direct_local_blocks()
        if blocks is None:  # uncapped, the same-rank kernel takes HBM from the copy engines' peer writes
            blocks = torch.cuda.get_device_properties(self.index).multi_processor_count // 2
        ex = _C.DirectExec(signals, boxes, local, options.resolved_direct_engine_bytes(),
                           options.resolved_direct_local_engine_bytes(), blocks,
                           options.resolved_direct_engine_batch(), options.resolved_direct_engine_streams(),
                           receivers, senders, timeout, box_groups, groups, stageable, slot_bytes, ordinals, slots,
                           streams)
        table = torch.empty(max(1, ex.table_bytes), dtype=torch.uint8, device=self.index)
        ring = torch.empty(ex.staging_bytes, dtype=torch.uint8, device=self.index)
        ex.upload(table.data_ptr(), ring.data_ptr() if ex.staging_bytes else 0,
                  torch.cuda.current_stream().cuda_stream)
        torch.cuda.current_stream().synchronize()  # execute may run on another stream
        return ex, (table, ring)

    def transport(self, group: Any, options: Options, register: bool, nccl: bool) -> Any:
        """The transport of the pairs that are not direct (and of same-rank copies)."""
        from .cuda import CudaTransport, make_cuda_transport

        if nccl and _C._build_info["nccl"]:
            from .nccl_lib import runtime_status

            if not runtime_status().startswith("not"):
                return make_cuda_transport("nccl", group, options, register)
        return CudaTransport(group, None, options)

    def stream(self) -> int:
        from .cuda import current_stream_handle

        return current_stream_handle()

    def fork(self) -> Any:
        """A context running on a side stream that starts where the current stream is now."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.index)
        self._side.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self._side)

    def join(self) -> None:
        """The current stream waits for the side stream's work so far."""
        if self._side is not None:
            torch.cuda.current_stream().wait_stream(self._side)

    def digest_reader(self, tables: Any) -> Any:
        """Read passes over bound tables on the current stream (`.read()`: the digests)."""
        from .cuda import DigestReader

        return DigestReader(tables)

    def prep(self, ex: Any, work: Sequence[tuple[Any, Any]]) -> None:
        """Queues deferred pre-pass work (transforms.py) on the prep stream, which starts where
        the current stream is now: each (item, before) in turn, prep event k after the k-th."""
        if self._prep is None:  # high priority, as the pack it gates
            self._prep = torch.cuda.Stream(self.index, priority=-1)
        prep = self._prep
        ex.prep_start(torch.cuda.current_stream(self.index).cuda_stream, prep.cuda_stream)
        with torch.cuda.stream(prep):
            for k, step in enumerate(work):
                run_deferred(step)
                ex.prep_done(k, prep.cuda_stream)


class DirectTransport:
    """Direct pairs through DirectExec; NCCL pairs and same-rank copies through an inner
    CudaTransport. `Plan` calls `bind_plan` (collective: rx.plan, plan.rebind(collective=True))
    or `rebind_plan` (local: plan.rebind) instead of bind/prepare."""

    collective_rebind = True  # plan.rebind(collective=True) runs bind_plan on every rank

    def __init__(self, group: Any, options: Options, register: bool = False, device: Any = None):
        self.group = group
        self.options = options
        self.register = register
        self.rank = groups.rank(group)
        self.world = groups.size(group)
        self.timeout = options.resolved_timeout("direct")
        self.groups = options.resolved_direct_verify_groups()  # landing groups of a verified execute
        self.gather_timeout = options.resolved_timeout("gloo")  # rx.plan's own collectives use it too
        self.device = device if device is not None else CudaDevice()
        self.signals: Any = None
        self._why_not = ""
        if not options.resolved_direct_ipc():
            self._why_not = "rx.Options.direct_ipc (RESHARD_EXT_DIRECT_IPC) is off"
        else:
            try:
                self.signals = self.device.signals(self.rank, self.world, self.timeout)
            except Exception as e:  # noqa: BLE001 - reported below: the pairs use NCCL
                self._why_not = str(e)
        self.pairs: set[Pair] | None = None  # agreed direct pairs, once bound
        self.nccl_peers: list[int] = []         # peers this rank moves bytes with over NCCL
        self.inner: Any = None
        self.exec: Any = None
        self._memory: Any = None  # the executor's device memory (kernel tables, staging ring)
        # receiver -> (its mappings open here, its PeerPieces at them, their [base, end) ranges)
        self._mapped: dict[int, tuple[list, list, list]] = {}
        self._receivers: list[int] = []  # peers this rank writes into directly
        self._senders: list[int] = []  # peers that write into this rank directly
        self._given: dict[int, Any] = {}  # sender -> the exports of this rank's destinations it maps
        self._news: dict[int, Any] = {}  # sender -> new exports it has not mapped yet (a local rebind)
        self.staging_bytes = 0  # of the NCCL pairs' batches (none when every pair is direct)
        self.owns_copies = False  # the executor runs the same-rank copies (this rank has no NCCL pair)
        self.direct_bytes = 0  # Transport protocol; the inner transport's cut is used
        # Execute headers go to every peer, direct or NCCL, on the group's host channel.
        self.channel = channel_of(group)
        self.peers: list[int] = []
        self._broken = ""  # why the direct part cannot run again (a failed or aborted execute)
        self._plan: Any = None  # weakref to the bound plan (its whole tables are built for verify)
        self._reader: Any = None  # read passes over those tables, built by the first verify
        self._landing: list[int] = []  # the reader's groups: received ops per landing group, then the rest
        self._sends = -1  # the reader's group of the send ops read from their sources (-1: all of them)
        self._staged: Any = None  # (per staged box digests, rows, ops): digests.fold_into of the staged sends
        self._prep: list[tuple[Any, Any]] = []  # deferred (pre-pass item, before) in the order the chunks read them
        self._trace = False

    @property
    def trace(self) -> bool:
        """Diagnostics: each execute records a CUDA-event timeline of its direct steps
        (last_timeline; synchronises, as the NCCL transport's trace)."""
        return self._trace

    @trace.setter
    def trace(self, on: bool) -> None:
        self._trace = bool(on)
        if self.exec is not None and hasattr(self.exec, "set_trace"):
            self.exec.set_trace(self._trace)

    @property
    def last_timeline(self) -> str:
        """The last traced execute's direct steps (DirectExec.timeline) with a summary of the
        staged path: what the link did and what it waited for."""
        if self.exec is None or not self._trace or not hasattr(self.exec, "timeline"):
            return ""
        return direct_timeline_text(self.exec.timeline())

    @property
    def deferred(self) -> list[tuple[Any, Any]]:
        """The (pre-pass item, its rewrite's before) that this transport runs itself each execute,
        overlapped with the staged chunks (rx.Tuning.direct_prep_overlap): Plan skips them."""
        return self._prep

    @property
    def collective_bind(self) -> bool:
        """Whether Plan binds through bind_plan: the first binding agrees on the pairs."""
        return self.pairs is None

    # --- plan time ----------------------------------------------------------------------
    def _info(self) -> RankInfo:
        pci = self.device.pci_bus_id() if self.signals is not None else ""
        if self.signals is None:
            return RankInfo(host_identity(), os.getpid(), pci, why=self._why_not, groups=self.groups)
        return RankInfo(host_identity(), os.getpid(), pci, tuple(self.signals.flags_export), self.signals.page_path,
                        groups=self.groups)

    def _attach(self, infos: Sequence[RankInfo], candidates: set[Pair]) -> set[Pair]:
        """Maps the signal words of every candidate peer; returns the pairs that failed."""
        failed = set()
        for peer in peers_of(candidates, self.rank):
            info = infos[peer]
            why = ""
            if info.pci and not self.device.can_reach(info.pci):
                why = f"this GPU has no peer access to the GPU at {info.pci}"
            else:
                why = self.signals.attach(peer, info.flags, info.page)
            if why:
                _log.info("rank %d: rank %d goes over NCCL: %s", self.rank, peer, why)
                failed.add(pair(self.rank, peer))
        return failed

    def _exports(self, tables: Any, dst_refs: list[_C.TensorRef]) -> tuple[dict[int, Any], dict[Pair, str]]:
        """For each peer that writes into this rank directly, its pieces with every pointer
        as (index into a handle list, offset): {peer: (handles, [(dst_name, ref, where)])};
        and the pairs whose memory CUDA IPC cannot share, with why."""
        by_ptr: dict[int, Any] = {}

        def export(ptr: int) -> Any:
            if ptr not in by_ptr:
                by_ptr[ptr] = self.device.export(ptr)
            return by_ptr[ptr]

        out: dict[int, Any] = {}
        failed: dict[Pair, str] = {}
        dst_used = tables.dst_used
        for peer, pos in tables.direct_recv_pieces():
            if pair(self.rank, peer) in failed:
                continue
            ref = dst_refs[pos]
            ptrs = [ref.ptr] + ([ref.side] if ref.side else [])
            got = [export(p) for p in ptrs]
            bad = [g for g in got if isinstance(g, str)]
            if bad:
                _log.info("rank %d: rank %d goes over NCCL: %s", self.rank, peer, bad[0])
                failed[pair(self.rank, peer)] = f"tensor '{ref.name}' cannot be shared with rank {peer}: {bad[0]}"
                out.pop(peer, None)
                continue
            handles, pieces = out.setdefault(peer, ([], []))
            where = []
            for handle, offset, size in got:
                if handle not in handles:
                    handles.append(handle)
                where.append((handles.index(handle), offset, size))
            pieces.append((int(dst_used[pos]), ref, where))
        return out, failed

    def _map(self, peer: int, handles: list, peer_pieces: list) -> tuple[list, list, list] | str:
        """Maps what one direct receiver exposed to this rank: (the mappings, PeerPieces for
        bind_direct, mapped [base, end) ranges), or why it cannot."""
        opened = [self.device.open(h) for h in handles]
        bad = [m.why for m in opened if not m.ok]
        if bad:
            return bad[0]
        pieces: list[_C.PeerPiece] = []
        ranges: list[tuple[int, int]] = []
        for dst_name, ref, where in peer_pieces:
            # the data pointer, then a codec's side buffer (MXFP8 scales)
            addrs = [opened[i].base + offset for i, offset, _ in where]
            ranges += [(opened[i].base, opened[i].base + size) for i, _, size in where]
            mapped = ref.replace(ptr=addrs[0], side=addrs[1] if len(addrs) > 1 else None)
            pieces.append(_C.PeerPiece(peer, dst_name, mapped))
        return opened, pieces, ranges

    def _open(self, gathered_exports: Sequence[dict[int, Any]], direct: set[Pair]) -> tuple[dict, set[Pair]]:
        """Maps what each direct receiver exposed to this rank: ({receiver: _map's result},
        pairs that failed)."""
        mapped: dict[int, tuple[list, list, list]] = {}
        failed: set[Pair] = set()
        for peer in peers_of(direct, self.rank):
            got = self._map(peer, *gathered_exports[peer].get(self.rank, ([], [])))
            if isinstance(got, str):
                _log.info("rank %d: rank %d goes over NCCL: %s", self.rank, peer, got)
                failed.add(pair(self.rank, peer))
            else:
                mapped[peer] = got
        return mapped, failed

    def bind_plan(self, plan: Any, errors: Sequence[str] = ()) -> None:
        """Collective over the plan's group: agrees on the direct pairs, binds the tables,
        maps the receivers' tensors and builds the per-execute work. `errors` (this rank's
        rebind problems) are raised on every rank after the first exchange."""
        group, rank = self.group, self.rank
        failed: set[Pair] = set()
        if self.pairs is None:
            errs0 = list(errors)
            info = RankInfo(host_identity(), os.getpid(), "", why="no info", groups=self.groups)
            try:
                info = self._info()
            except Exception as e:  # noqa: BLE001 - raised on every rank by agree()
                errs0.append(f"rank {rank}: {e}")
            infos = _gather(group, (errs0, info), self.gather_timeout)
            groups = [i.groups for _, i in infos]
            differ = [] if len(set(groups)) == 1 else [
                f"rx.Tuning.direct_verify_groups must be the same on every rank; the ranks have {groups}"]
            agree([(errs, set()) for errs, _ in infos] + [(differ, set())])
            infos = [info for _, info in infos]
            self.pairs = candidate_pairs(infos)
            try:
                failed = self._attach(infos, self.pairs)
            except Exception as e:  # noqa: BLE001 - raised on every rank by agree() below
                errs0 = [f"rank {rank}: {e}"]
            else:
                errs0 = []
            first = True
        else:
            agree(_gather(group, (list(errors), set()), self.gather_timeout))
            errs0, first = [], False
        agreement = plan._agreement
        while True:
            errs, errs0 = errs0, []
            split: Any = None
            refs: tuple[list, list] = ([], [])
            exports: dict[int, Any] = {}
            try:
                split = _C.split_direct(agreement.rank_plan, agreement.src_table, peers_of(self.pairs, rank))
                plan._set_tables(_C.ExecTables(split))
                refs = plan._bound_refs()
                exports, export_failed = self._exports(plan.tables, refs[1])
                failed |= set(export_failed)
            except Exception as e:  # noqa: BLE001 - raised on every rank by agree()
                errs.append(f"rank {rank}: {e}")
            got = _gather(group, (errs, failed, exports), self.gather_timeout)
            if first and self.signals is not None:
                self.signals.unlink_page()  # every peer has mapped it by now
                first = False
            dead = agree([(e, f) for e, f, _ in got])
            mapped: dict = {}
            try:
                mapped, open_failed = self._open([x for _, _, x in got], self.pairs - dead)
            except Exception as e:  # noqa: BLE001
                errs, open_failed = [f"rank {rank}: {e}"], set()
            got2 = _gather(group, (errs, open_failed, int(split.wanted_batches()),
                                   bool(split.send_total() or split.recv_total())), self.gather_timeout)
            dead |= agree([(e, f) for e, f, _, _ in got2])
            failed = set()
            if not dead & self.pairs:
                break
            self.pairs -= dead  # fewer pairs: bind again (the split and the refs may change)
        self._finish(plan, split, refs, mapped, exports, max(k for _, _, k, _ in got2), any(n for *_, n in got2))

    def _finish(self, plan: Any, split: Any, refs: tuple[list, list], mapped: dict, exports: dict, k: int,
                nccl_anywhere: bool) -> None:
        src_refs, dst_refs = refs
        # Every rank knows nccl_anywhere alike: creating the NCCL communicator is collective.
        if self.inner is None or (nccl_anywhere and getattr(self.inner, "comm", None) is None):
            self.inner = self.device.transport(self.group, self.options, self.register, nccl_anywhere)
        split.assign_batches(k)
        tables = _C.ExecTables(split)
        plan._set_tables(tables)
        plan._bind_tables(self.inner, src_refs, dst_refs)
        self._mapped = mapped
        receivers = self._receivers = sorted(peer for peer, (_, pieces, _) in mapped.items() if pieces)
        senders = self._senders = sorted({p for p, _ in tables.direct_recv_pieces()})
        self._given, self._news = {p: exports.get(p) for p in senders}, {}
        self.nccl_peers = sorted({op.peer for op in split.sends()} | {op.peer for op in split.recvs()})
        self.staging_bytes = self.inner.staging_bytes  # of the NCCL pairs; _direct adds its staging ring
        self.peers = sorted(set(receivers) | set(senders) | set(self.inner.peers))
        self._broken = ""
        # Without NCCL pairs nothing else runs beside the direct writes: the executor takes
        # the same-rank copies too, on a copy engine or its kernel (rx.Options.direct_local_*).
        self.owns_copies = bool(receivers or senders) and not (tables.send_total or tables.recv_total)
        self._direct(plan, src_refs)

    def _direct(self, plan: Any, src_refs: list) -> None:
        """Builds this rank's per-execute direct work from its bound tables, the sources
        `src_refs` and the receivers' destinations as mapped here."""
        self.exec, self._memory, self._prep = None, None, []  # its writes may use mappings closed since
        tables = plan.tables
        slot = stage_slot_bytes(self.options.resolved_direct_staging_bytes(), getattr(plan, "max_batch_bytes", None),
                                self.inner.staging_bytes, staging_shape()[0])
        tables.bind_direct(src_refs, [p for _, pieces, _ in self._mapped.values() for p in pieces], slot)
        boxes = tables.direct_boxes()
        mapped = sorted({r for _, _, ranges in self._mapped.values() for r in ranges})
        for lo, hi in _C.dst_spans(boxes):
            if hi > lo and not any(a <= lo and hi <= b for a, b in mapped):
                raise ReshardError(f"rank {self.rank}: a direct write [{lo:#x}, {hi:#x}) falls outside every "
                                   f"mapped peer allocation (internal error)")
        self._plan, self._reader = weakref.ref(plan), None
        if self._receivers or self._senders:
            local = tables.copy_boxes() if self.owns_copies else _C.BoxTable()
            self.exec, self._memory = self.device.executor(self.signals, boxes, local, self.options, self._receivers,
                                                           self._senders, self.timeout,
                                                           tables.direct_landing_groups(self.groups), self.groups,
                                                           tables.direct_stageable(), slot, tables.direct_ordinals())
            if self._trace and hasattr(self.exec, "set_trace"):
                self.exec.set_trace(True)
            if self.exec.num_staged_chunks and self.options.resolved_direct_prep_overlap():
                self._prep = self._defer(plan)
        # of the NCCL pairs' batches, every pipelined copy, and the staging ring
        self.staging_bytes = self.inner.staging_bytes + (self.exec.staging_bytes if self.exec is not None else 0)

    def _defer(self, plan: Any) -> list[tuple[Any, Any]]:
        """The pre-pass items (with their before steps) whose sources the staged chunks read, in
        the order they read them: each execute runs them on the prep stream, each chunk's pack
        waiting for its own tensors' (core/direct.h, prep_schedule)."""
        candidates = plan.deferrable()
        order = self.exec.set_prep([item.region() for item, _ in candidates]) if candidates else []
        return [candidates[i] for i in order]

    def _prep_inline(self, session: Session, steps: list[tuple[Any, Any]]) -> None:
        """Deferred work `steps`, on the caller's stream, where this execute does not overlap it."""
        if session.status == 0:
            for step in steps:
                run_deferred(step)

    def rebind_plan(self, plan: Any) -> None:
        """plan.rebind on this rank alone (the pairs stay): binds the plan's new tensors
        here. Destinations that direct senders write into are exported now; the next
        execute hands the changed ones to those senders (_remap)."""
        src_refs, dst_refs = plan._bound_refs()
        exports, failed = self._exports(plan.tables, dst_refs)
        if failed:
            raise ReshardError(f"plan.rebind on rank {self.rank}: " + "; ".join(sorted(failed.values())) +
                               f"; {_COLLECTIVE_HINT}")
        plan._bind_tables(self.inner, src_refs, dst_refs)
        self._news = {p: exports.get(p) for p in self._senders if exports.get(p) != self._given.get(p)}
        self._direct(plan, src_refs)

    # --- diagnostics --------------------------------------------------------------------
    @property
    def direct_peers(self) -> list[int]:
        return peers_of(self.pairs or set(), self.rank)

    def summary(self) -> str:
        d, n = self.direct_peers, self.nccl_peers
        via = "NCCL" if getattr(self.inner, "comm", None) is not None else "point-to-point"
        ex = self.exec
        how = ""
        if ex is not None:
            staged = (f", {ex.num_staged_boxes} codec boxes staged in {ex.num_staged_chunks} chunks "
                      f"({ex.staging_bytes} B ring)" if ex.num_staged_boxes else "")
            how = (f" ({ex.num_engine_copies} copy-engine copies {getattr(ex, 'engine_mode', '')}, "
                   f"{ex.num_kernel_boxes} kernel boxes{staged}; same-rank here: {ex.num_local_engine_copies} "
                   f"copy-engine, {ex.num_local_kernel_boxes} kernel)")
        return f"direct with ranks {d or 'none'}{how}; {via} with ranks {n or 'none'}"

    # --- every execute ------------------------------------------------------------------
    def abort(self) -> None:
        """plan.abort() (or a peer that failed or died): stops the NCCL part and the direct
        waits at once (host and GPU); the direct part is unusable after, as after any failure."""
        if self.inner is not None:
            self.inner.abort()
        if self.exec is not None:
            self.exec.abort()

    def rearm(self) -> None:
        """Takes a stop of an earlier execute back (before this one's watch starts)."""
        if self.exec is not None:
            self.exec.rearm()

    def _digest_reader(self) -> Any:
        """Read passes of (send, recv, copy src, copy dst) digests of every op of the plan
        from the bound tensors, on the current stream: the plan's whole tables as the NCCL
        transport would stage them, bound to the same tensors (the read passes never touch
        staging, so none is allocated)."""
        if self._reader is None:
            plan = self._plan()
            whole = _C.ExecTables(plan._agreement.rank_plan)
            src, dst = plan._bound_refs(whole)
            nowhere = [_UNREAD_STAGING] * max(1, whole.num_batches)
            whole.bind(src, dst, nowhere, nowhere, 0, plan._codec_receivers)
            reader = self.device.digest_reader(whole)
            self._landing = [reader.add_runs(_RECV, runs)
                             for runs in whole.landing_runs(self._senders, self.groups)]
            self._sends, self._staged = -1, None
            staged = list(getattr(self.exec, "staged_boxes", []) or [])
            if staged:  # sends whose every box is staged are digested from the ring (DirectExec.begin)
                receivers = set(self._receivers)
                direct_sends = [i for i, op in enumerate(plan._agreement.rank_plan.sends()) if op.peer in receivers]
                box_ops = plan.tables.direct_ops()
                rows, ops = staged_send_rows([box_ops[b] for b in staged], box_ops, direct_sends)
                skip = set(ops)
                read = [i for i in range(len(plan._agreement.rank_plan.sends())) if i not in skip]
                self._sends = reader.add_runs(_SEND, _runs(read))
                device = reader.buf.device if hasattr(reader, "buf") else "cpu"
                self._staged = (torch.zeros(len(staged), dtype=torch.int64, device=device),
                                torch.tensor(rows, dtype=torch.int64, device=device),
                                torch.tensor(ops, dtype=torch.int64, device=device))
            self._reader = reader
        return self._reader

    def run(self, tables: Any, session: Session, verify: bool = False) -> Any:
        # A verified execute with direct pairs digests by read passes (the copy engines cannot
        # hash what they move): sources during the writes, destinations group by group as
        # their senders signal them landed (core/direct.h), the NCCL pairs' at the end.
        read_after = verify and self.exec is not None
        verify = verify and not read_after
        # what Plan left to this transport in this execute (it read `deferred` before calling
        # run): all of it runs, whatever a remap below makes of the executor
        skipped = self._prep
        if self._broken and session.status == 0:
            session.status, session.error = 1, self._broken
        if not self.peers and session.verdict is None:
            self._prep_inline(session, skipped)
            return self.inner.run(tables, session, verify)  # same-rank copies only: no headers to exchange
        # Headers with every peer first (the inner transport reuses the verdict): the
        # direct writes land in the peers' tensors, so every pair must agree before them.
        self.channel.drain(session)
        if getattr(self.inner, "comm", None) is not None:
            session.epoch = nccl_lib.epoch(self.group, self.channel.key)
            session.comm_unusable = not self.inner.comm.usable
        outbox = self._outbox() if session.status == 0 else {}
        if session.verdict is None:  # else Plan exchanged them (a swap round of a rank without peers)
            session.remap = max((len(m) for m in outbox.values()), default=0)
            exchange_headers(self.channel, self.peers, session, tables.num_batches)
        assert session.verdict is not None  # exchange_headers set it
        if session.status == 0:
            self._remap(session, outbox)
        if self.exec is None or session.status != 0 or session.verdict.bad:
            self._prep_inline(session, skipped)
            return self.inner.run(tables, session, verify)  # raises where headers disagree
        if session.abort.is_set():
            raise ReshardError(session.stopped("before the direct writes"))
        stream = self.device.stream()
        reader = self._digest_reader() if read_after else None
        try:
            stage_digests = 0
            if reader is not None:
                reader.start()
                if self._staged is not None:
                    self._staged[0].zero_()
                    stage_digests = self._staged[0].data_ptr()
            # after the headers and any remap: a rebuilt executor has events (and gates) of its
            # own, and overlaps only the very work Plan skipped; else that work runs here first
            overlap = bool(skipped) and self._prep == skipped
            if overlap:
                self.device.prep(self.exec, skipped)
            else:
                self._prep_inline(session, skipped)
            self.exec.begin(stream, reader is not None, stage_digests, overlap)
            if reader is not None:  # the sources stay put: read them beside the writes, after the same-rank copies
                with self.device.fork():
                    if self._sends < 0:
                        reader.launch((_SEND,))
                    else:
                        reader.launch_group(self._sends)
            digests = None if self.owns_copies else self.inner.run(tables, session, verify)
            if reader is not None:
                for k, group in enumerate(self._landing[:-1]):
                    self.exec.wait_landed(stream, k)
                    reader.launch_group(group)
                self.device.join()
            # verified: the check queues its agreement behind the last reads before the host waits (settle)
            self.exec.end(stream, reader is None)
            if reader is not None:  # after end(): the NCCL pairs' receives have landed too
                reader.launch_group(self._landing[-1])
                if self._staged is not None:  # end() waited for the staged digests
                    reader.fold(_SEND, *self._staged)
                digests = reader.digests(self._settle)
        except ReshardError as e:
            self._fail(e)
            raise
        return digests

    def _settle(self) -> None:
        """The host wait of a verified execute's end (DeviceDigests.settle)."""
        try:
            self.exec.finish()
        except ReshardError as e:
            self._fail(e)
            raise

    def _fail(self, e: ReshardError) -> None:
        # The ranks of a direct pair no longer agree on its sequence: a collective
        # rebind builds a new one.
        self._broken = (f"rank {self.rank}: the direct transport failed in an earlier execute ({e}); call "
                        f"plan.rebind(collective=True) on every rank to rebuild it")

    def _tells(self) -> bool:
        """Whether this rank, when it hands rebound destinations over, then tells each direct
        peer whether it takes part in the direct writes: not with one direct peer (its sender,
        whose own answer decides)."""
        return len(set(self._senders) | set(self._receivers)) > 1

    def _outbox(self) -> dict[int, torch.Tensor]:
        """After a local rebind of destinations that direct senders write into: a message
        for each direct sender, its new exports (None where they did not change) and whether
        an outcome follows (_tells), pickled behind their length and padded to one size (the
        headers carry it)."""
        if not self._news:
            return {}
        tells = self._tells()
        blobs = {p: pickle.dumps((self._news.get(p), tells)) for p in self._senders}
        size = 8 + max(len(b) for b in blobs.values())
        return {p: _frame(b, size) for p, b in blobs.items()}

    def _remap(self, session: Session, outbox: dict[int, torch.Tensor]) -> None:
        """After the headers, before any direct write, where a receiver flagged new
        destinations (session.remap): it sends each direct sender `outbox`; each sender maps
        what changed, rebuilds its writes and answers. A pair that fails is refused at both
        ends (verdict.bad: no data moves with it). A receiver with several direct peers then
        tells each whether it takes part in the direct writes: a rank with a refused pair
        writes and signals nothing, and its other direct peers would wait for it until the
        timeout."""
        verdict = session.verdict
        assert verdict is not None
        if not session.remap and not verdict.remaps:
            return
        agreed = (set(self._senders) | set(self._receivers)) - set(verdict.bad)
        outbox = {p: m for p, m in outbox.items() if p in agreed} if session.remap else {}
        inbox = {p: torch.empty(n, dtype=torch.uint8) for p, n in verdict.remaps.items() if p in self._receivers}
        # A remapping rank that writes here and that this rank does not write into has
        # another direct peer (its sender): it tells.
        told = {p for p in verdict.remaps if p in self._senders and p not in self._receivers}
        lost: dict[int, str] = {}
        if outbox or inbox:
            lost, tellers = self._hand_over(session, outbox, inbox)
            told |= tellers
        to = sorted(agreed - set(lost)) if session.remap and self._tells() else []
        heard = {p: torch.empty(_NOTE_BYTES, dtype=torch.uint8) for p in told if p not in lost}
        if not to and not heard:
            return
        refused = "; ".join(f"rank {p}: {why}" for p, why in sorted(verdict.bad.items()))
        note = _note(refused and f"takes no part in the direct writes of this execute ({refused})")
        late = self._exchange(session, [("send", p, note) for p in to] + [("recv", p, t) for p, t in heard.items()],
                              "telling whether rebound receivers take part")
        _refuse(verdict, late)
        for p, t in heard.items():
            if p not in late and (why := _unframe(t).decode(errors="replace")):
                verdict.bad.setdefault(p, why)

    def _exchange(self, session: Session, ops: list, what: str) -> dict[int, str]:
        ch = self.channel
        return ch.wait(ch.submit(lambda: ch.exchange(ops, REMAP_TAG, session, retry_closed=True)), session, what)

    def _hand_over(self, session: Session, outbox: dict[int, torch.Tensor],
                   inbox: dict[int, torch.Tensor]) -> tuple[dict[int, str], set[int]]:
        """_remap's new exports and answers: (the peers lost on the way, the receivers that
        said they tell their outcome)."""
        verdict = session.verdict
        assert verdict is not None
        lost = self._exchange(session, [("send", p, m) for p, m in outbox.items()] +
                              [("recv", p, m) for p, m in inbox.items()], "exchanging rebound destinations")
        got = {p: pickle.loads(_unframe(m)) for p, m in inbox.items() if p not in lost}
        answers = {p: self._remap_from(p, exports) for p, (exports, _) in got.items()}
        mapped = [p for p, why in answers.items() if why == ""]
        if mapped:
            try:
                plan = self._plan()
                self._direct(plan, plan._bound_refs(plan.tables)[0])  # onto the new mappings
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: answered, and kept until a collective rebind
                self._broken = (f"rank {self.rank}: rebuilding its direct writes onto rebound destinations failed "
                                f"({e}); call plan.rebind(collective=True) on every rank to rebuild it")
                answers.update((p, self._broken) for p in mapped)
        acks = {p: torch.zeros(1, dtype=torch.int64) for p in outbox if p not in lost}
        ops = [("send", p, torch.tensor([int(bool(why))])) for p, why in answers.items()]
        lost.update(self._exchange(session, ops + [("recv", p, a) for p, a in acks.items()],
                                   "answering rebound destinations"))
        _refuse(verdict, lost)
        for p, why in answers.items():
            if why and p not in lost:
                verdict.bad[p] = why
        for p, ack in acks.items():
            if p in lost:
                continue
            if ack.item():
                verdict.bad[p] = _unmappable(p, self.rank, [ref.name for _, ref, _ in self._news[p][1]], "")
            elif p in self._news:
                self._given[p] = self._news.pop(p)
        return lost, {p for p, (_, tells) in got.items() if tells}

    def _remap_from(self, receiver: int, exports: Any) -> str | None:
        """Maps a receiver's new exports (from its _outbox message): "" once mapped, None
        when they did not change, else why it cannot."""
        if exports is None:
            return None
        got = self._map(receiver, *exports)
        if isinstance(got, str):
            return _unmappable(self.rank, receiver, [ref.name for _, ref, _ in exports[1]], got)
        self._mapped[receiver] = got
        return ""

    def read_digests(self, tables: Any) -> tuple:
        if self.exec is not None:
            return tuple(self._digest_reader().read())
        return tuple(self.inner.read_digests(tables))
