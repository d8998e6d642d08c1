"""GPU transports: the CUDA box kernel over device-resident descriptor tables, with the
bytes carried by the C++ NCCL communicator (pipelined on a side stream) or, for
comparison, by torch.distributed point-to-point."""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from .. import _C
from ..errors import ReshardError
from ..options import Options, set_process_env_default
from .p2p import P2PExchange

_ALIGN = 256

_log = logging.getLogger("reshard_ext")


class _Timeline:
    """CUDA events around the steps of one execute; `report` waits for them and logs
    when each step started and ended on its stream, relative to the first."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, int, Any, Any]] = []

    def step(self, kind: str, batch: int, stream: torch.cuda.Stream, fn: Any) -> None:
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        fn()
        end.record(stream)
        self.marks.append((kind, batch, begin, end))

    def report(self) -> str:
        if not self.marks:
            return ""
        self.marks[-1][3].synchronize()
        t0 = self.marks[0][2]
        lines = [f"{kind + ' ' + str(batch):>12}: {t0.elapsed_time(b):8.3f} -> {t0.elapsed_time(e):8.3f} ms"
                 for kind, batch, b, e in self.marks]
        text = "execute timeline (CUDA events):\n" + "\n".join(lines)
        _log.info(text)
        return text


def _untraced(kind: str, batch: int, stream: Any, fn: Any) -> None:
    fn()


def registration_vote(options: Options) -> bool:
    """This rank's vote on NCCL buffer registration (staging buffers and direct-message
    tensors registered, so intra-node transfers move straight between them instead of
    through NCCL's FIFOs, leaving HBM to the kernels beside them). `rx.plan` registers
    only when every rank of the group votes yes, since a transfer registered at one end
    only is undefined in NCCL. torch allocates with cudaMalloc, which NCCL registers
    (cudaIpc handles) only with NCCL_LEGACY_CUDA_REGISTER=1: set here unless the user set
    it, before NCCL first reads it (at its first registered transfer)."""
    if not options.resolved_nccl_register():
        return False
    return set_process_env_default("NCCL_LEGACY_CUDA_REGISTER", "1") == "1"


def _max_blocks(send_bytes: int, recv_bytes: int, copy_bytes: int, override: Optional[int] = None) -> int:
    """Grid cap of the kernels beside transfers: at full width they take HBM bandwidth and
    SM slots in bursts from NCCL's kernels. Half the SMs on ranks that send and receive,
    three quarters where same-rank copies outweigh the transfers by >10% (the kernels then
    set the pace); one-way ranks and plans without transfers stay uncapped (RESULTS.md)."""
    if override is not None:
        return override
    if not (send_bytes and recv_bytes):
        return 0
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return sms * 3 // 4 if copy_bytes * 10 > max(send_bytes, recv_bytes) * 11 else sms // 2


def make_cuda_transport(backend: str, group: Any, options: Options, register: bool = False) -> "CudaTransport":
    if not torch.cuda.is_available():
        raise ReshardError(f"backend {backend!r} needs CUDA, which torch does not see")
    if not _C._build_info["cuda"]:
        raise ReshardError("reshard_ext was built without CUDA kernels (RESHARD_EXT_CUDA=OFF or no nvcc at build time)")
    if backend == "nccl":
        from .. import _nccl

        comm = _nccl.communicator(group, options.resolved_timeout("nccl"))
        return CudaTransport(group, comm, options, register)
    return CudaTransport(group, None, options)


class CudaTransport:
    """Per batch: pack (one launch) -> exchange (one send/recv per peer) -> unpack (one
    launch, cast fused). With the NCCL communicator the exchange of batch k runs on a
    side stream while the caller's stream packs k+1 and unpacks k-1 (double-buffered
    staging); the caller's stream waits for the last transfer before its unpack."""

    def __init__(self, group: Any, comm: Optional[Any], options: Options, register: bool = False):
        self.comm = comm
        self.trace = options.resolved_trace()
        self.split_copies = options.resolved_split_copies()
        self.max_blocks_override = options.resolved_max_blocks()
        # NCCL buffer registration, as agreed by every rank at plan time (registration_vote)
        self.register = register and comm is not None
        # With NCCL, an op of >= direct_bytes whose box is one contiguous run is sent from
        # / received into the tensor itself: no pack or unpack pass over its bytes (a
        # refit is link-bound and those passes are serial with the transfer). torch p2p
        # needs tensors for its messages, so it stages everything.
        # (Ops below it are packed: NCCL runs a group's p2p ops one after another per peer,
        # so thousands of mid-size messages cost more than packing them.)
        self.direct_bytes = options.resolved_direct_bytes("cuda") if comm is not None else 0
        self.p2p = None if comm is not None else P2PExchange(group, options.resolved_timeout("torch"))
        # High priority: the transfer is the critical path; packs and unpacks on the
        # caller's stream fill the SMs NCCL leaves idle instead of delaying its kernels.
        self.side = torch.cuda.Stream(priority=-1) if comm is not None else None
        self.send: list[torch.Tensor] = []
        self.recv: list[torch.Tensor] = []
        self.last_timeline = ""
        self.max_blocks = 0  # set per plan in prepare
        self._registered: list[int] = []  # NCCL registration handles of the bound buffers

    def bind(self, tables: Any) -> tuple[list[int], list[int]]:
        nbuf = 2 if (tables.num_batches > 1 and self.comm is not None) else 1
        dev = torch.cuda.current_device()
        self.send = [torch.empty(max(1, tables.send_buffer_bytes), dtype=torch.uint8, device=dev) for _ in range(nbuf)]
        self.recv = [torch.empty(max(1, tables.recv_buffer_bytes), dtype=torch.uint8, device=dev) for _ in range(nbuf)]
        return [t.data_ptr() for t in self.send], [t.data_ptr() for t in self.recv]

    def prepare(self, tables: Any) -> None:
        """Builds the device tables once (at plan/rebind time); execute only launches."""
        nb = tables.num_batches
        # With a side stream the local copies go in one slice per batch, between the pack
        # of the next batch and the unpack of this one (see run).
        sliced = self.split_copies and self.comm is not None and nb > 1
        copy_parts = tables.copy_boxes_split(nb) if sliced else [tables.copy_boxes()]
        host = [_C.DeviceBoxTable(part) for part in copy_parts]
        host += [_C.DeviceBoxTable(tables.pack_boxes(b)) for b in range(tables.num_batches)]
        host += [_C.DeviceBoxTable(tables.unpack_boxes(b)) for b in range(tables.num_batches)]
        offsets, total = [], 0
        for t in host:
            offsets.append(total)
            total += (t.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self._blob = torch.empty(max(total, 1), dtype=torch.uint8, device=torch.cuda.current_device())
        stream = torch.cuda.current_stream().cuda_stream
        for t, off in zip(host, offsets):
            t.upload(self._blob.data_ptr() + off, stream)
        # execute may run on another stream than this one: finish the uploads here, at
        # plan time, rather than order every later launch after them.
        torch.cuda.current_stream().synchronize()
        nc = len(copy_parts)
        # A plan that moves nothing between ranks runs its copies alone, uncapped, with no
        # NCCL call or host wait (decided here, once, not per execute).
        self._moves = tables.send_total > 0 or tables.recv_total > 0
        if self.comm is not None and self._moves:
            self.max_blocks = _max_blocks(tables.send_total, tables.recv_total, tables.copy_total,
                                          self.max_blocks_override)
        self._copy, self._pack, self._unpack = host[:nc], host[nc : nc + nb], host[nc + nb :]
        self._messages = [tables.messages(b) for b in range(nb)]
        if self.register:
            self._register()
        if self.p2p is not None:
            self._p2p_ops = [self.p2p.views(m, self.send + self.recv) for m in self._messages]

    def _register(self) -> None:
        """Registers every buffer a message of this plan lives in: the staging buffers
        whole, direct messages by their own range (they point into the bound tensors,
        which the plan keeps alive). Drops the registrations of an earlier binding."""
        self.deregister()
        staging = [(t.data_ptr(), t.numel()) for t in self.send + self.recv]
        ranges = set(staging)
        for sends, recvs in self._messages:
            for _, ptr, n in sends + recvs:
                if n > 0 and not any(a <= ptr and ptr + n <= a + m for a, m in staging):
                    ranges.add((ptr, n))
        self._registered = [self.comm.register_buffer(p, n) for p, n in sorted(ranges)]

    def deregister(self) -> None:
        handles, self._registered = self._registered, []
        for h in handles:
            self.comm.deregister_buffer(h)

    def __del__(self) -> None:
        try:
            if self._registered and self.comm is not None and self.comm.usable:
                self.deregister()
        except Exception:  # noqa: BLE001 - interpreter shutdown or a failed communicator
            pass

    def transfers(self, b: int) -> tuple[list, list]:
        """(sends, recvs) of batch b as (peer, device ptr, bytes)."""
        return self._messages[b]

    def run(self, tables: Any) -> None:
        main = torch.cuda.current_stream()
        s = main.cuda_stream
        k = len(self._pack)
        timeline = _Timeline() if self.trace else None
        step = timeline.step if timeline else _untraced
        if self.comm is None or not self._moves:  # torch p2p, or only same-rank copies
            for i, c in enumerate(self._copy):
                step("copy", i, main, lambda c=c: c.launch(s))
            for b in range(k if self.p2p is not None else 0):  # torch.distributed p2p: no overlap
                step("pack", b, main, lambda b=b: self._pack[b].launch(s))
                self.p2p.run(self._p2p_ops[b])
                step("unpack", b, main, lambda b=b: self._unpack[b].launch(s))
            self._finish(timeline)
            return
        side = self.side
        cap = self.max_blocks
        done: list[torch.cuda.Event] = []

        def post(b: int) -> None:
            step("pack", b, main, lambda: self._pack[b].launch(s, cap))
            side.wait_stream(main)  # the pack of b, and the unpack of b-2 (frees recv buffer b % 2)
            sends, recvs = self._messages[b]
            step("transfer", b, side, lambda: self.comm.exchange(sends, recvs, side.cuda_stream, 0))
            done.append(side.record_event())

        post(0)
        for b in range(k):
            if b + 1 < k:
                post(b + 1)  # overlaps the transfer of b
            # This batch's slice of the same-rank copies runs under transfer b, after the
            # pack of b + 1 so that it never holds back the next transfer; one big copy up
            # front would leave the link idle.
            if b < len(self._copy):
                step("copy", b, main, lambda b=b: self._copy[b].launch(s, cap))
            main.wait_event(done[b])
            step("unpack", b, main, lambda b=b: self._unpack[b].launch(s, cap))
        # A dead peer or a lost message raises here (bounded by the communicator's
        # timeout, rx.Options.timeout) instead of hanging the next sync.
        self.comm.wait(self.comm.timeout)
        self._finish(timeline)

    def _finish(self, timeline: Optional[_Timeline]) -> None:
        if timeline is not None:
            self.last_timeline = timeline.report()
