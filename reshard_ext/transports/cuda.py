"""GPU transports: the CUDA box kernel over device-resident descriptor tables, with the
bytes carried by the C++ NCCL communicator (pipelined on a side stream) or, for
comparison, by torch.distributed point-to-point."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .. import _C
from ..errors import ReshardError
from ..options import Options, set_process_env_default
from . import nccl_lib
from .channel import Session, channel_of, exchange_headers
from .digests import DeviceDigests, fold_into
from .p2p import P2PExchange

_ALIGN = 256

_log = logging.getLogger("reshard_ext")


def timeline_text(rows: list[tuple[str, int, float, float]]) -> str:
    """The executor's trace rows (kind, batch, begin ms, end ms) as the log shows them."""
    if not rows:
        return ""
    lines = [f"{kind + ' ' + str(batch):>12}: {begin:8.3f} -> {end:8.3f} ms" for kind, batch, begin, end in rows]
    return "execute timeline (CUDA events):\n" + "\n".join(lines)


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


def _max_blocks(send_bytes: int, recv_bytes: int, copy_bytes: int, override: int | None = None) -> int:
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


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU builds of torch


def current_stream_handle() -> int:
    """The caller's current CUDA stream as an integer, with one call into torch per execute
    (torch.cuda.current_stream() builds a Stream object through several Python layers)."""
    if _RAW_STREAM is None:
        return int(torch.cuda.current_stream().cuda_stream)
    return int(_RAW_STREAM(torch._C._cuda_getDevice()))


def _upload(host: list) -> torch.Tensor:
    """Uploads DeviceBoxTables into one device buffer (returned: it owns their memory)."""
    offsets, total = [], 0
    for t in host:
        offsets.append(total)
        total += (t.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    blob = torch.empty(max(total, 1), dtype=torch.uint8, device=torch.cuda.current_device())
    stream = torch.cuda.current_stream().cuda_stream
    for t, off in zip(host, offsets):
        t.upload(blob.data_ptr() + off, stream)
    # execute may run on another stream than this one: finish the uploads here, at plan
    # time, rather than order every later launch after them.
    torch.cuda.current_stream().synchronize()
    return blob


_READ_PASSES = (_C.PASS_SRC, _C.PASS_DST, _C.PASS_SRC, _C.PASS_DST)  # what DigestReader's parts read


class DigestReader:
    """Read passes over bound tables (rx.verify; the direct transport's verified executes):
    one launch per part reads every op's source (what it would send) and destination (what
    it holds) into one device buffer of a uint64 per box, on the current stream, moving
    nothing. Each part's boxes are its ops in order."""

    def __init__(self, tables: Any):
        copies = _C.DeviceBoxTable(tables.copy_boxes())
        # (send, recv, copy_src, copy_dst) digests, in that order
        self.parts = [_C.DeviceBoxTable(tables.send_boxes()), _C.DeviceBoxTable(tables.recv_boxes()), copies, copies]
        self._blob = _upload(self.parts[:3])
        self.offsets, total = [], 0
        for t in self.parts:
            self.offsets.append(total)
            total += t.num_boxes
        self.buf = torch.zeros(max(total, 1), dtype=torch.int64, device=torch.cuda.current_device())
        sends, recvs, copies_n = tables.num_ops
        self._sizes = (sends, recvs, copies_n, copies_n)
        self._boxes = (tables.send_boxes(), tables.recv_boxes())  # what add_runs cuts up
        self._groups: list[list[tuple[Any, int, int]]] = []  # per add_runs: (table, digest address, pass)
        self._group_blobs: list[torch.Tensor] = []
        self.signs = torch.zeros_like(self.buf)  # +1 send boxes, -1 receive boxes: the check's lane sums
        self.signs[self.offsets[0]:self.offsets[0] + self.parts[0].num_boxes] = 1
        self.signs[self.offsets[1]:self.offsets[1] + self.parts[1].num_boxes] = -1

    def add_runs(self, part: int, runs: Sequence[tuple[int, int]]) -> int:
        """Prepares a group of [begin, end) runs of boxes of `part` (send or recv) to read
        with launch_group; returns its number. Uploads now (it synchronises the stream), so
        call it before the execute, not while one is queued."""
        records = np.frombuffer(self._boxes[part], dtype=np.uint8).reshape(-1, _C.BOX_BYTES)
        tables = [_C.DeviceBoxTable(records[a:b]) for a, b in runs]
        self._group_blobs.append(_upload(tables))
        base = self.buf.data_ptr() + 8 * self.offsets[part]
        self._groups.append([(t, base + 8 * a, _READ_PASSES[part]) for t, (a, _) in zip(tables, runs)])
        return len(self._groups) - 1

    def start(self) -> None:
        """Zeroes the digests on the current stream: the passes add into them."""
        self.buf.zero_()

    def fold(self, part: int, per_box: torch.Tensor, rows: torch.Tensor, ops: torch.Tensor) -> None:
        """Adds digests of pieces of `part`'s ops (digests.fold_into) on the current stream."""
        at = self.offsets[part]
        fold_into(self.buf[at:at + self.parts[part].num_boxes], per_box, rows, ops)

    def launch(self, parts: Sequence[int]) -> None:
        """Launches the read passes of `parts` (indices into send, recv, copy src, copy dst)
        on the current stream."""
        s = current_stream_handle()
        for k in parts:
            self.parts[k].launch(s, 0, self.buf.data_ptr() + 8 * self.offsets[k], _READ_PASSES[k])

    def launch_group(self, group: int) -> None:
        """Launches the read passes of one add_runs group on the current stream."""
        s = current_stream_handle()
        for table, digests, read in self._groups[group]:
            table.launch(s, 0, digests, read)

    def collect(self) -> tuple[np.ndarray, ...]:
        """The digests of every part, one uint64 array each indexed by op (waits for them;
        a part not launched since the last start reads 0)."""
        host = self.buf.cpu().numpy().view(np.uint64)
        out = []
        for t, off, n in zip(self.parts, self.offsets, self._sizes):
            a = np.zeros(n, dtype=np.uint64)
            a[:t.num_boxes] = host[off:off + t.num_boxes]
            out.append(a)
        return tuple(out)

    def digests(self, settle: Callable[[], None]) -> DeviceDigests:
        """The (send, recv) digests for verification.check, left on the GPU (queues nothing);
        settle: the host wait for the refit that wrote them."""
        def host() -> tuple[np.ndarray, np.ndarray]:
            send, recv = self.collect()[:2]
            return send, recv

        return DeviceDigests(self.buf, self.signs, host, settle)

    def read(self) -> tuple[np.ndarray, ...]:
        self.start()
        self.launch(range(4))
        return self.collect()


def make_cuda_transport(backend: str, group: Any, options: Options, register: bool = False) -> CudaTransport:
    if not torch.cuda.is_available():
        raise ReshardError(f"backend {backend!r} needs CUDA, which torch does not see")
    if not _C._build_info["cuda"]:
        raise ReshardError("reshard_ext was built without CUDA kernels (RESHARD_EXT_CUDA=OFF or no nvcc at build time)")
    if backend == "nccl":
        comm = nccl_lib.communicator(group, options.resolved_timeout("nccl"))
        return CudaTransport(group, comm, options, register)
    return CudaTransport(group, None, options)


class CudaTransport:
    """Per batch: pack (one launch) -> exchange (one send/recv per peer) -> unpack (one
    launch, cast fused). With the NCCL communicator (or NVSHMEM) the C++ executor
    (csrc/comm/executor.h) runs the batches pipelined: the exchange of batch k on a side
    stream while the caller's stream packs k+1 and unpacks k-1 (double-buffered staging)."""

    def __init__(self, group: Any, comm: Any | None, options: Options, register: bool = False,
                 nccl: bool | None = None):
        self.group = group
        # Execute headers travel on the group's host channel, so that ranks agree on the
        # plan before any NCCL call (a mismatched NCCL send/recv cannot be taken back).
        self.channel = channel_of(group)
        self.peers: list[int] = []
        self.staging_bytes = 0
        self.nccl_timeout = options.resolved_timeout("nccl")
        self.comm: Any = comm  # None: torch.distributed p2p (self.p2p) moves the data
        # an NCCL communicator (rebuilt after a failure); NvshmemTransport's is not
        self.nccl = comm is not None if nccl is None else nccl
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
        # Owns the device tables, the side stream and the pipelined schedule of every execute.
        self.executor = _C.Executor.cuda(torch.cuda.current_device())
        if self.nccl:
            self.executor.set_transport(_C.nccl_transport(comm))
        self.send: list[torch.Tensor] = []
        self.recv: list[torch.Tensor] = []
        self.last_timeline = ""
        self.max_blocks = 0  # set per plan in prepare
        self._registered: list[int] = []  # NCCL registration handles of the bound buffers
        self._read: DigestReader | None = None

    def bind(self, tables: Any) -> tuple[list[int], list[int]]:
        nbuf = 2 if (tables.num_batches > 1 and self.comm is not None) else 1
        dev = torch.cuda.current_device()
        self.send = [torch.empty(max(1, tables.send_buffer_bytes), dtype=torch.uint8, device=dev) for _ in range(nbuf)]
        self.recv = [torch.empty(max(1, tables.recv_buffer_bytes), dtype=torch.uint8, device=dev) for _ in range(nbuf)]
        self.staging_bytes = nbuf * (tables.send_buffer_bytes + tables.recv_buffer_bytes)
        return [t.data_ptr() for t in self.send], [t.data_ptr() for t in self.recv]

    def staging_ranges(self) -> list[tuple[int, int]]:
        """[begin, end) device addresses of this rank's staging buffers."""
        return [(t.data_ptr(), t.data_ptr() + t.numel()) for t in self.send + self.recv]

    def prepare(self, tables: Any) -> None:
        """Builds the device tables once (at plan/rebind time); execute only launches."""
        nb = tables.num_batches
        # With a side stream the local copies go in one slice per batch, between the pack
        # of the next batch and the unpack of this one (the executor's run).
        sliced = self.split_copies and self.comm is not None and nb > 1
        # A plan that moves nothing between ranks runs its copies alone, uncapped, with no
        # NCCL call or host wait (it has no peers).
        moves = tables.send_total > 0 or tables.recv_total > 0
        self.max_blocks = (_max_blocks(tables.send_total, tables.recv_total, tables.copy_total,
                                       self.max_blocks_override) if self.comm is not None and moves else 0)
        ex = self.executor
        ex.prepare(tables, sliced, self.max_blocks, [(t.data_ptr(), t.numel()) for t in self.recv])
        # auto: a verified execute's hashing kernels uncapped (capped, they would set the
        # pace); its same-rank copies keep max_blocks (the executor's run)
        ex.verify_max_blocks = self.max_blocks if self.max_blocks_override is not None else 0
        self._blob = self._upload_pending()
        self._verify_blob: torch.Tensor | None = None  # with the digest buffer, made by the first verified execute
        self._digests: torch.Tensor | None = None
        self._signs: torch.Tensor | None = None  # DeviceDigests.signs of _digests
        self._read = None  # ... and by the first rx.verify
        self._tables = tables
        self.peers = list(ex.peers)
        if self.register:
            self._register()
        if self.p2p is not None:
            self._p2p_ops = [self.p2p.views(tables.messages(b), self.send + self.recv) for b in range(nb)]

    def _upload_pending(self) -> torch.Tensor:
        """Device memory for the executor's tables built since its last upload, uploaded
        (returned: it owns their memory)."""
        blob = torch.empty(max(self.executor.pending_bytes, 1), dtype=torch.uint8, device=torch.cuda.current_device())
        self.executor.upload(blob.data_ptr(), torch.cuda.current_stream().cuda_stream)
        return blob

    def _register(self) -> None:
        """Registers every buffer a message of this plan lives in: the staging buffers
        whole, direct messages by their own range (they point into the bound tensors,
        which the plan keeps alive). Drops the registrations of an earlier binding."""
        self.deregister()
        staging = self.staging_ranges()
        ranges = {(lo, hi - lo) for lo, hi in staging}
        for b in range(self._tables.num_batches):
            sends, recvs = self._tables.messages(b)
            for m in sends + recvs:
                if m.bytes > 0 and not any(lo <= m.ptr and m.ptr + m.bytes <= hi for lo, hi in staging):
                    ranges.add((m.ptr, m.bytes))
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

    def transfers(self, b: int) -> tuple[list[_C.Message], list[_C.Message]]:
        """(sends, recvs) of batch b (ExecTables.messages)."""
        return self._tables.messages(b)

    def _verified(self) -> None:
        """The digest tables of verified executes (built by the first one) and the digest
        buffer, zeroed by each verified execute."""
        ex = self.executor
        if ex.verify_built:
            return
        slots = ex.build_verify()
        self._verify_blob = self._upload_pending()
        self._digests = torch.zeros(max(slots, 1), dtype=torch.int64, device=torch.cuda.current_device())
        signs = np.zeros(self._digests.numel(), dtype=np.int64)  # the buffer has >= 1 slot
        signs[:slots] = ex.digest_signs()
        self._signs = torch.from_numpy(signs).to(self._digests.device)
        ex.set_digests(self._digests.data_ptr())

    def abort(self) -> None:
        """Stops this rank's NCCL work at once (plan.abort(), from any thread): the
        communicator is aborted, and the next execute builds a new one."""
        if self.comm is not None:
            self.comm.abort()

    def _agree(self, tables: Any, session: Session, pack0: Any) -> tuple[set[int], bool]:
        """The header exchange (unless the caller made it: the direct transport); (peers to
        move data with, whether this rank writes its destinations). Rebuilds the NCCL
        communicator where an end of a pair needs it."""
        if session.verdict is None:
            self.channel.drain(session)
            if self.nccl:
                session.epoch = nccl_lib.epoch(self.group, self.channel.key)
                session.comm_unusable = not self.comm.usable
            ok = session.status == 0
            exchange_headers(self.channel, self.peers, session, tables.num_batches, pack0 if ok else None)
        elif session.status == 0:
            pack0()
        verdict = session.verdict
        assert verdict is not None  # exchange_headers set it
        if self.nccl and not verdict.replan and (verdict.rebuild or session.comm_unusable):
            # Collective over the group: every rank whose communicator failed, and every
            # rank a peer of which says so, builds the next one together (not in a swap
            # round that every rank leaves for the slow path: the next execute does).
            self._registered = []  # the old communicator's registrations went with it
            self.comm = nccl_lib.communicator(self.group, self.nccl_timeout, fresh=True)
            self.executor.set_transport(_C.nccl_transport(self.comm))
            if self.register:
                self._register()
        ok = session.status == 0
        good = set(self.peers) - set(verdict.bad) if ok else set()
        return good, ok and not verdict.bad

    def run(self, tables: Any, session: Session, verify: bool = False) -> DeviceDigests | None:
        """verify: the pack and unpack launches also digest every op; the ops that travel as
        direct messages are digested beside the transfer (sources once it is posted,
        destinations round by round as they land); returns the (send, recv) digests."""
        ex = self.executor
        if verify:
            self._verified()
        ex.begin(current_stream_handle(), verify, self.trace)
        if not self.peers:  # only same-rank copies: nobody to agree with (the direct transport's may disagree)
            self._raise(session)
            for i in range(ex.num_copy_slices):
                ex.copy(i)
            return self._finish(verify)
        good, writes = self._agree(tables, session, ex.pack_first)
        if self.comm is None:  # torch.distributed p2p: no overlap
            p2p = self.p2p
            assert p2p is not None  # made where there is no communicator
            group_of = {p2p.global_rank(p) for p in good}
            if writes:
                for i in range(ex.num_copy_slices):  # after the first pack: it may read what they write
                    ex.copy(i)
            for b in range(ex.num_batches if good else 0):
                if b > 0:
                    ex.pack(b)
                ex.digest_direct_sends(b)
                if session.abort.is_set():
                    raise ReshardError(session.stopped("between batches"))
                p2p.run([op for op in self._p2p_ops[b] if op.peer in group_of], session.timeout)
                if writes:
                    ex.unpack(b)
            result = self._finish(verify)
            self._raise(session)
            return result
        comm = self.comm
        saved = comm.timeout
        if saved != session.timeout:  # usually the plan's timeout already
            comm.timeout = session.timeout  # bounds the posting waits of this execute

        def drained(wait: Callable[[], None]) -> None:
            try:
                wait()
            except ReshardError as e:
                if session.abort.is_set():
                    raise ReshardError(session.stopped("the NCCL transfers ran (the next execute rebuilds the "
                                                       "communicator)")) from e
                raise

        try:
            # verified: the host waits for the transfers once the check's GPU work is queued
            # behind them (DeviceDigests.settle); queued after that wait, it would start on
            # an idle GPU
            drained(lambda: ex.run(sorted(good), writes, session.timeout, defer_drain=verify and writes))
        finally:
            if saved != session.timeout and comm.usable:
                comm.timeout = saved
        result = self._finish(verify, lambda: drained(ex.drain))
        self._raise(session)
        return result

    def _raise(self, session: Session) -> None:
        if session.status != 0:
            raise ReshardError(session.error)
        if session.verdict is not None and session.verdict.bad:
            raise ReshardError(session.verdict.message(self.channel.rank) + "\n  (this rank wrote no destination)")

    def read_digests(self, tables: Any) -> tuple[np.ndarray, ...]:
        """rx.verify: one launch per side reads every op's source (what it would send) and
        destination (what it holds), moving nothing."""
        if self._read is None:
            self._read = DigestReader(tables)
        return self._read.read()

    def _finish(self, verify: bool, settle: Callable[[], None] = lambda: None) -> Any:
        if self.trace:
            self.last_timeline = timeline_text(self.executor.timeline())
            if self.last_timeline:
                _log.info(self.last_timeline)
        if not verify:
            return None
        digests = self._digests
        assert digests is not None and self._signs is not None  # made by _verified

        def host() -> tuple[np.ndarray, np.ndarray]:
            return self.executor.collect(digests.cpu().numpy().view(np.uint64))

        # left on the GPU: the check's lane sums queue behind the last unpack
        return DeviceDigests(digests, self._signs, host, settle)
