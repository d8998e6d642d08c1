"""A CPU stand-in for the direct transport's device (transports/direct.py CudaDevice), so
the transport's collective setup, its fallbacks and its data path run over real gloo
process groups on machines without GPUs:
  - "CUDA IPC" is a file in /dev/shm mapped by both processes (torch.from_file(shared=True));
    tensors not made by `shared_poison` cannot be exported, like memory from a cuMem pool;
  - the per-execute steps exchange gloo messages for the ready and done signals and run
    the boxes with the CPU twin (copy-engine copies as row memmoves), a sender's staged codec
    boxes through the staging script's emulation (_direct_sim.StagedRun);
  - the pairs that are not direct use the CPU (gloo) transport.
"""
from __future__ import annotations

import datetime
import math
import os
import uuid
from typing import Any

import torch
import torch.distributed as dist

from reshard_ext import _C
from reshard_ext.errors import ReshardError
from reshard_ext.transports.cpu import CpuTransport

_SHARED: dict[str, torch.Tensor] = {}  # path -> its tensor (bytes), in this process
_READY, _DONE = 71, 72  # gloo tags of the two signals
STAGING_POLICY: str | int = "pack"  # the order the staged codec boxes run in (_direct_sim.StagedRun)


def shared_poison(shape: tuple, dtype: torch.dtype, device: Any = "cpu") -> torch.Tensor:
    """A poisoned tensor whose memory another process can map (the stand-in for cudaMalloc
    memory; _cases.run_case's alloc)."""
    from _cases import poison

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return poison(shape, dtype, "cpu")
    path = f"/dev/shm/rx-direct-test-{os.getpid()}-{uuid.uuid4().hex}"
    raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    _SHARED[path] = raw
    return raw.view(dtype).view(shape).copy_(poison(shape, dtype, "cpu"))


def release_shared() -> None:
    for path in list(_SHARED):
        os.unlink(path)
        del _SHARED[path]


class _Signals:
    def __init__(self, refuse: set[int]):
        self.refuse = refuse
        self.flags_export = (b"flags", 0, 64)
        self.page_path = ""

    def attach(self, peer: int, flags: Any, page: str) -> str:
        return "refused by the test" if peer in self.refuse else ""

    def unlink_page(self) -> None:
        pass


class _Mapping:
    def __init__(self, handle: bytes):
        path = handle.decode()
        self.ok = os.path.exists(path)
        self.why = "" if self.ok else f"{path} is gone"
        self.tensor = torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8) \
            if self.ok else None
        self.base = self.tensor.data_ptr() if self.ok else 0


class _Exec:
    """The ready / write / done steps of DirectExec, with gloo messages as the signals (a
    landing execute: one more per landing group, tag _DONE + 1 + group)."""

    def __init__(self, boxes: Any, local: Any, options: Any, receivers: list[int], senders: list[int],
                 timeout: float, box_groups: list[int], groups: int, stageable: list[int], slot_bytes: int,
                 ordinals: list[int]):
        import numpy as np
        from _direct_sim import StagedRun

        from reshard_ext.transports.direct import staging_shape

        self.timeout = datetime.timedelta(seconds=timeout)
        # the staged codec boxes, for a plain and a landing execute (each run builds a fresh one)
        every, every_group = boxes, list(box_groups)
        slots, streams = staging_shape()
        self.staged = lambda landing, prep=None: StagedRun(every, every_group, stageable, slot_bytes,
                                                           groups if landing else 0, policy=STAGING_POLICY,
                                                           ordinals=list(ordinals), slots=slots, streams=streams,
                                                           prep=prep)
        probe = self.staged(False)
        self.plan = probe.plan
        self.gates: list[int] = []  # set_prep's (prep_schedule)
        self.work: list = []  # this execute's deferred work (FakeDevice.prep)
        self.staging_bytes, self.num_staged_chunks = probe.plan.ring_bytes, probe.plan.num_chunks
        self.num_staged_boxes = len(box_groups) - len(probe.rest)
        self.staged_boxes = [b for c in range(probe.plan.num_chunks) for b in probe.chunks[c][5]]
        boxes = probe.rest_boxes(boxes)
        box_groups = [box_groups[i] for i in probe.rest]
        self.engine, self.kernel = _C.split_engines(boxes, options.resolved_direct_engine_bytes())
        self.streams = _C.spread_engines(self.engine, options.resolved_direct_engine_streams())
        records = np.frombuffer(boxes, dtype=np.uint8).reshape(-1, _C.BOX_BYTES)
        where = np.asarray(box_groups, dtype=np.int64)
        # per landing group: (copy-engine copies, kernel boxes), as DirectExec cuts them
        self.groups = [_C.split_engines(records[where == k].copy(), options.resolved_direct_engine_bytes())
                       for k in range(groups)] if len(probe.rest) + self.num_staged_boxes else []
        self.local_engine, self.local_kernel = _C.split_engines(local, options.resolved_direct_local_engine_bytes())
        self.receivers, self.senders = receivers, senders
        self.token = torch.zeros(1)
        self.posted: list = []  # landing signals sent and not waited for yet
        self.num_engine_copies, self.num_kernel_boxes = len(self.engine), len(self.kernel)
        self.num_local_engine_copies = len(self.local_engine)
        self.num_local_kernel_boxes = len(self.local_kernel)

    def _post(self, to: list[int], frm: list[int], tag: int) -> list:
        return ([(p, dist.isend(self.token, p, tag=tag)) for p in to] +
                [(p, dist.irecv(torch.zeros(1), p, tag=tag)) for p in frm])

    def _wait(self, reqs: list) -> None:
        for p, r in reqs:
            try:
                r.wait(self.timeout)
            except RuntimeError as e:  # bounded by the direct timeout, as DirectExec's waits
                raise ReshardError(f"rank {dist.get_rank()}: rank {p} did not signal within "
                                   f"{self.timeout.total_seconds():g} s (fake device: {e})") from None

    def _signal(self, to: list[int], frm: list[int], tag: int) -> None:
        self._wait(self._post(to, frm, tag))

    def set_prep(self, regions: list) -> list[int]:
        order, self.gates = self.plan.prep_schedule(regions)
        self.num_prep = len(order)
        return order

    def begin(self, stream: int, landing: bool = False, stage_digests: int = 0, prep: bool = False) -> None:
        import ctypes
        import functools

        from _direct_sim import run_engine

        from reshard_ext.transports.direct import run_deferred

        work = ([functools.partial(run_deferred, step) for step in self.work], self.gates) if prep else None
        self.work = []

        def local() -> None:
            run_engine(self.local_engine)
            _C.copy_boxes_cpu(self.local_kernel)

        if work is None:
            local()  # the same-rank copies go first, as on the GPU (after the deferred work: its start waits for it)
        self._signal(self.senders, self.receivers, _READY)  # my destinations are free; wait for theirs
        if landing and self.groups:
            run = self.staged(True, work)
            signals = run.run()
            for k, (engine, kernel) in enumerate(self.groups):
                if self.num_staged_chunks:  # the signal waits for the deferred work: the group's other writes follow
                    assert next(signals) == k, "staged signals out of order"
                if k == 0 and work is not None:
                    local()
                run_engine(engine)
                _C.copy_boxes_cpu(kernel)
                self.posted += self._post(self.receivers, [], _DONE + 1 + k)  # waited for in end()
            assert next(signals, None) is None, "a staged signal past the last landing group"
            if stage_digests and run.digests.size:  # what DirectExec adds into the caller's zeroed buffer
                ctypes.memmove(stage_digests, run.digests.ctypes.data, run.digests.nbytes)
            return
        self.staged(False, work).run_all()  # the packs, gated by the deferred work
        if work is not None:
            local()
        for part in self.streams:
            run_engine(part)
        _C.copy_boxes_cpu(self.kernel)

    def wait_landed(self, stream: int, k: int) -> None:
        self._wait(self._post([], self.senders, _DONE + 1 + k))

    def end(self, stream: int, wait: bool = True) -> None:
        """The CPU has no stream to queue on: the wait for the senders is done now either way."""
        posted, self.posted = self.posted, []
        self._wait(posted + self._post(self.receivers, self.senders, _DONE))

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        """The fake's waits are gloo's, bounded by the direct timeout: nothing to stop early."""

    def rearm(self) -> None:
        pass


class FakeDevice:
    def __init__(self, refuse: set[int] = frozenset()):
        self.refuse = set(refuse)

    def signals(self, rank: int, world: int, timeout_s: float) -> Any:
        return _Signals(self.refuse)

    def pci_bus_id(self) -> str:
        return ""

    def can_reach(self, pci_bus_id: str) -> bool:
        return True

    def export(self, ptr: int) -> Any:
        for path, t in _SHARED.items():
            base = t.data_ptr()
            if base <= ptr < base + t.numel():
                return (path.encode(), ptr - base, t.numel())
        return f"address {ptr:#x} is not in shared memory"

    def open(self, handle: bytes) -> Any:
        return _Mapping(handle)

    def executor(self, signals: Any, boxes: Any, local: Any, options: Any, receivers: list[int],
                 senders: list[int], timeout: float, box_groups: list[int], groups: int, stageable: list[int],
                 slot_bytes: int, ordinals: list[int]) -> tuple[Any, Any]:
        return _Exec(boxes, local, options, receivers, senders, timeout, box_groups, groups, stageable,
                     slot_bytes, ordinals), None

    def transport(self, group: Any, options: Any, register: bool, nccl: bool) -> Any:
        return CpuTransport(group, options)

    def stream(self) -> int:
        return 0

    def fork(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def join(self) -> None:
        pass

    def digest_reader(self, tables: Any) -> Any:
        return _CpuReader(tables)

    def prep(self, ex: Any, work: list) -> None:
        """The deferred work runs inside the executor's staging emulation (_Exec.begin)."""
        ex.work = list(work)


class _CpuReader:
    """The CPU twin's read passes (CpuTransport.read_digests) over bound tables."""

    def __init__(self, tables: Any):
        self.tables = tables
        self.parts: dict[int, Any] = {}
        self.groups: list[tuple[int, list]] = []

    def read(self) -> tuple:
        import numpy as np

        out = tuple(np.zeros(n, dtype=np.uint64) for n in self.tables.num_ops)
        copy_dst = np.zeros_like(out[2])
        self.tables.read_digests_cpu(*out, copy_dst)
        return out + (copy_dst,)

    def start(self) -> None:
        self.parts = {}

    def launch(self, parts) -> None:
        """Reads `parts` now (the CPU has no stream to queue them on)."""
        now = self.read()
        self.parts.update({k: now[k] for k in parts})

    def add_runs(self, part: int, runs: list) -> int:
        self.groups.append((part, list(runs)))
        return len(self.groups) - 1

    def launch_group(self, group: int) -> None:
        """Reads the group's runs now: what landed so far (a run read too early differs)."""
        import numpy as np

        part, runs = self.groups[group]
        now = self.read()[part]
        into = self.parts.setdefault(part, np.zeros_like(now))
        for a, b in runs:
            into[a:b] = now[a:b]

    def fold(self, part: int, per_box: Any, rows: Any, ops: Any) -> None:
        """digests.fold_into on the part's digests as read so far."""
        import numpy as np
        import torch

        from reshard_ext.transports.digests import fold_into

        into = self.parts.setdefault(part, np.zeros(self.tables.num_ops[part], dtype=np.uint64))
        fold_into(torch.from_numpy(into.view(np.int64)), per_box, rows, ops)

    def collect(self) -> tuple:
        import numpy as np

        out = tuple(self.parts.get(k, np.zeros_like(a)) for k, a in enumerate(self.read()))
        self.parts = {}
        return out

    def digests(self, settle: Any) -> Any:
        """As the GPU reader: the (send, recv) digests in one buffer the check sums in place."""
        import numpy as np
        import torch

        from reshard_ext.transports.digests import DeviceDigests

        send, recv = self.collect()[:2]
        buf = torch.from_numpy(np.concatenate((send, recv)).view(np.int64))
        signs = torch.cat((torch.ones(send.size, dtype=torch.int64), -torch.ones(recv.size, dtype=torch.int64)))
        return DeviceDigests(buf, signs, lambda: (send, recv), settle)


def use_fake_device(refuse: set[int] = frozenset()) -> None:
    """Makes backend="direct" build the direct transport on FakeDevice in this process."""
    from reshard_ext import execution
    from reshard_ext.transports.direct import DirectTransport

    original = getattr(execution._make_transport, "__wrapped__", execution._make_transport)

    def make(backend, device, group, options, register=False):
        if backend == "direct":
            return "direct", DirectTransport(group, options, register, FakeDevice(refuse))
        return original(backend, device, group, options, register)

    make.__wrapped__ = original  # type: ignore[attr-defined]
    execution._make_transport = make
