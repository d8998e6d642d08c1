"""GPU transports: the CUDA box kernel over device-resident descriptor tables, with the
bytes carried by the C++ NCCL communicator (pipelined on a side stream) or, for
comparison, by torch.distributed point-to-point."""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from .. import _C
from ..errors import ReshardError
from .channel import Session, channel_of, exchange_headers
from .p2p import P2PExchange

_ALIGN = 256
# Only really large ops go direct: NCCL runs the p2p ops of a group one after another
# per peer, so thousands of mid-size messages cost more than packing them (measured on
# 2x H200: 6,435 expert tensors of 3 MB took 65 ms as messages, 20 ms as one).
DIRECT_BYTES = int(os.environ.get("RESHARD_EXT_CUDA_DIRECT_BYTES", 64 << 20))
# Default batch size on GPUs when rx.plan gets max_batch_bytes=None: several batches
# let pack k+1 and unpack k-1 hide behind the transfer of k.
DEFAULT_BATCH_BYTES = int(os.environ.get("RESHARD_EXT_CUDA_BATCH_BYTES", 512 << 20))
# RESHARD_EXT_TRACE=1: every execute records CUDA events around each pack, transfer,
# copy and unpack and logs the timeline (synchronising at the end: diagnostics only).
TRACE = os.environ.get("RESHARD_EXT_TRACE", "0") not in ("", "0")
# Same-rank copies in one slice per batch (default) or all at once before the first
# unpack (RESHARD_EXT_CUDA_SPLIT_COPIES=0; kept to measure the difference).
SPLIT_COPIES = os.environ.get("RESHARD_EXT_CUDA_SPLIT_COPIES", "1") not in ("", "0")
# Caps the grid of the pack/unpack/copy launches of a rank that both sends and receives:
# at full width they take HBM bandwidth and SM slots in bursts from NCCL's send and
# receive kernels. Default: half as many blocks as the GPU has SMs. 2x H200, registered,
# A/B in one run: TP2->TP1 0.92 -> 0.96 of the NCCL ceiling, MoE EP2->EP1 0.91 either
# way; a one-way (non-collocated) rank lost with it (0.94 -> 0.92), so it is left
# uncapped, as is a plan without transfers. A rank whose same-rank copies outweigh its
# transfers by more than 10% gets three quarters of the SMs: its kernels, not the link,
# set the pace at half (4x H200, one run: MoE EP2->EP1, copies 1.3x the transfers, 0.88
# at 66 blocks, 0.92-0.93 at 99, 0.82 at 132; TP2->TP1, equal bytes, 0.94-0.95 at 66,
# 0.91-0.92 at 99). RESHARD_EXT_CUDA_MAX_BLOCKS=N: N blocks for every plan with transfers
# (0: uncapped, one warp per tile).
_MAX_BLOCKS_ENV = os.environ.get("RESHARD_EXT_CUDA_MAX_BLOCKS", "")
# The staging buffers and direct-message tensors are registered with NCCL
# (ncclCommRegister), so intra-node transfers move straight between them instead of
# through NCCL's FIFOs: two fewer HBM passes per byte, which the packs, unpacks and
# copies running beside each transfer need (2x H200, TP2->TP1 collocated: 0.76 -> 0.90
# of the NCCL ceiling). Every rank registers by the same rule (a transfer must be
# registered at both ends or neither: rx.plan agrees on it). RESHARD_EXT_NCCL_REGISTER=0
# turns it off.
REGISTER = os.environ.get("RESHARD_EXT_NCCL_REGISTER", "1") not in ("", "0")

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


def registration_vote() -> bool:
    """This rank's vote on NCCL buffer registration; `rx.plan` registers only when every
    rank of the group votes yes, since a transfer registered at one end only is
    undefined in NCCL. torch allocates with cudaMalloc, which NCCL registers (cudaIpc
    handles) only with NCCL_LEGACY_CUDA_REGISTER=1: set here unless the user set it,
    before NCCL first reads it (at its first registered transfer)."""
    if not REGISTER:
        return False
    return os.environ.setdefault("NCCL_LEGACY_CUDA_REGISTER", "1") == "1"


def _max_blocks(send_bytes: int, recv_bytes: int, copy_bytes: int) -> int:
    if _MAX_BLOCKS_ENV:
        return int(_MAX_BLOCKS_ENV)
    if not (send_bytes and recv_bytes):
        return 0
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return sms * 3 // 4 if copy_bytes * 10 > max(send_bytes, recv_bytes) * 11 else sms // 2


def make_cuda_transport(backend: str, group: Any, register: bool = False) -> "CudaTransport":
    if not torch.cuda.is_available():
        raise ReshardError(f"backend {backend!r} needs CUDA, which torch does not see")
    if not _C._build_info["cuda"]:
        raise ReshardError("reshard_ext was built without CUDA kernels (RESHARD_EXT_CUDA=OFF or no nvcc at build time)")
    if backend == "nccl":
        from .. import _nccl

        return CudaTransport(group, _nccl.communicator(group), register)
    return CudaTransport(group, None)


def _staged(ptr: int, buffers: list[torch.Tensor]) -> bool:
    return any(b.data_ptr() <= ptr < b.data_ptr() + b.numel() for b in buffers)


class CudaTransport:
    """Per batch: pack (one launch) -> exchange (one send/recv per peer) -> unpack (one
    launch, cast fused). With the NCCL communicator the exchange of batch k runs on a
    side stream while the caller's stream packs k+1 and unpacks k-1 (double-buffered
    staging); the caller's stream waits for the last transfer before its unpack."""

    def __init__(self, group: Any, comm: Optional[Any], register: bool = False):
        self.group = group
        # Execute headers travel on the group's host channel, so that ranks agree on the
        # plan before any NCCL call (a mismatched NCCL send/recv cannot be taken back).
        self.channel = channel_of(group)
        self.peers: list[int] = []
        self.staging_bytes = 0
        self.comm = comm
        # NCCL buffer registration, as agreed by every rank at plan time (registration_vote)
        self.register = register and comm is not None
        # With NCCL, an op of >= DIRECT_BYTES whose box is one contiguous run is sent from
        # / received into the tensor itself: no pack or unpack pass over its bytes (a
        # refit is link-bound and those passes are serial with the transfer). torch p2p
        # needs tensors for its messages, so it stages everything.
        self.direct_bytes = DIRECT_BYTES if comm is not None else 0
        self.p2p = None if comm is not None else P2PExchange(group)
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
        self.staging_bytes = nbuf * (tables.send_buffer_bytes + tables.recv_buffer_bytes)
        return [t.data_ptr() for t in self.send], [t.data_ptr() for t in self.recv]

    def prepare(self, tables: Any) -> None:
        """Builds the device tables once (at plan/rebind time); execute only launches."""
        nb = tables.num_batches
        # With a side stream the local copies go in one slice per batch, between the pack
        # of the next batch and the unpack of this one (see run).
        sliced = SPLIT_COPIES and self.comm is not None and nb > 1
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
            self.max_blocks = _max_blocks(tables.send_total, tables.recv_total, tables.copy_total)
        self._copy, self._pack, self._unpack = host[:nc], host[nc : nc + nb], host[nc + nb :]
        self._messages = [tables.messages(b) for b in range(nb)]
        self.peers = sorted({peer for sends, recvs in self._messages for peer, _, _ in sends + recvs})
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

    def abort(self) -> None:
        """Stops this rank's NCCL work at once (plan.abort(), from any thread): the
        communicator is aborted, and the next execute builds a new one."""
        if self.comm is not None:
            self.comm.abort()

    def _agree(self, tables: Any, session: Session, pack0: Any) -> tuple[set[int], bool]:
        """The header exchange; (peers to move data with, whether this rank writes its
        destinations). Rebuilds the NCCL communicator where an end of a pair needs it."""
        from .. import _nccl

        self.channel.drain(session)
        if self.comm is not None:
            session.epoch = _nccl.epoch(self.group)
            session.comm_unusable = not self.comm.usable
        ok = session.status == 0
        verdict = exchange_headers(self.channel, self.peers, session, tables.num_batches, pack0 if ok else None)
        if self.comm is not None and (verdict.rebuild or session.comm_unusable):
            # Collective over the group: every rank whose communicator failed, and every
            # rank a peer of which says so, builds the next one together.
            self.comm = _nccl.communicator(self.group, fresh=True)
            if self.register:
                self._register()
        good = set(self.peers) - set(verdict.bad) if ok else set()
        return good, ok and not verdict.bad

    def run(self, tables: Any, session: Session) -> None:
        main = torch.cuda.current_stream()
        s = main.cuda_stream
        k = len(self._pack)
        timeline = _Timeline() if TRACE else None
        step = timeline.step if timeline else _untraced
        if not self.peers:  # only same-rank copies: nobody to agree with
            for i, c in enumerate(self._copy):
                step("copy", i, main, lambda c=c: c.launch(s))
            self._finish(timeline)
            return
        if self.comm is None:  # torch.distributed p2p: no overlap
            good, writes = self._agree(tables, session, lambda: step("pack", 0, main, lambda: self._pack[0].launch(s)))
            group_of = {self.p2p.global_rank(p) for p in good}
            if writes:
                for i, c in enumerate(self._copy):  # after the first pack: it may read what they write
                    step("copy", i, main, lambda c=c: c.launch(s))
            for b in range(k if good else 0):
                if b > 0:
                    step("pack", b, main, lambda b=b: self._pack[b].launch(s))
                self.p2p.run([op for op in self._p2p_ops[b] if op.peer in group_of], session.timeout)
                if writes:
                    step("unpack", b, main, lambda b=b: self._unpack[b].launch(s))
            self._finish(timeline)
            self._raise(session)
            return
        side = self.side
        cap = self.max_blocks
        done: list[torch.cuda.Event] = []
        scratch: list[torch.Tensor] = []
        good, writes = self._agree(tables, session, lambda: step("pack", 0, main, lambda: self._pack[0].launch(s, cap)))
        comm = self.comm

        def messages(b: int) -> tuple[list, list]:
            sends, recvs = self._messages[b]
            if good == set(self.peers) and writes:
                return sends, recvs
            # Degraded: data still flows with the peers that agreed (they complete), but
            # what arrives for this rank lands in scratch memory, not in its tensors.
            staging = self.recv

            def land(ptr: int, n: int) -> int:
                if _staged(ptr, staging):
                    return ptr
                scratch.append(torch.empty(n, dtype=torch.uint8, device=main.device))
                return scratch[-1].data_ptr()

            return ([m for m in sends if m[0] in good],
                    [(p, land(ptr, n), n) for p, ptr, n in recvs if p in good])

        def post(b: int) -> None:
            if b > 0:
                step("pack", b, main, lambda: self._pack[b].launch(s, cap))
            side.wait_stream(main)  # the pack of b, and the unpack of b-2 (frees recv buffer b % 2)
            sends, recvs = messages(b)
            step("transfer", b, side, lambda: comm.exchange(sends, recvs, side.cuda_stream, 0))
            done.append(side.record_event())

        saved = comm.timeout
        comm.timeout = session.timeout  # bounds the posting waits of this execute
        try:
            if good:
                post(0)
                for b in range(k):
                    if b + 1 < k:
                        post(b + 1)  # overlaps the transfer of b
                    # This batch's slice of the same-rank copies runs under transfer b, after the
                    # pack of b + 1 so that it never holds back the next transfer; one big copy up
                    # front would leave the link idle.
                    if writes and b < len(self._copy):
                        step("copy", b, main, lambda b=b: self._copy[b].launch(s, cap))
                    main.wait_event(done[b])
                    if writes:
                        step("unpack", b, main, lambda b=b: self._unpack[b].launch(s, cap))
                # A dead peer or a lost message raises here (bounded by the execute's
                # timeout) instead of hanging the next sync.
                comm.wait(session.timeout)
        except ReshardError as e:
            if session.abort.is_set():
                raise ReshardError("rx.execute was aborted (plan.abort()) during the NCCL transfers; "
                                   "the communicator is rebuilt by the next execute") from e
            raise
        finally:
            if comm.usable:
                comm.timeout = saved
        if scratch:
            main.synchronize()  # the scratch buffers must outlive the transfers into them
        self._finish(timeline)
        self._raise(session)

    def _raise(self, session: Session) -> None:
        if session.status != 0:
            raise ReshardError(session.error)
        if session.verdict is not None and session.verdict.bad:
            raise ReshardError(session.verdict.message(self.channel.rank) + "\n  (this rank wrote no destination)")

    def _finish(self, timeline: Optional[_Timeline]) -> None:
        if timeline is not None:
            self.last_timeline = timeline.report()
