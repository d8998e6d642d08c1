"""GPU transports: the CUDA box kernel over device-resident descriptor tables, with the
bytes carried by the C++ NCCL communicator (pipelined on a side stream) or, for
comparison, by torch.distributed point-to-point."""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from .. import _C
from ..errors import ReshardError
from ..options import Options, set_process_env_default
from .channel import Session, channel_of, exchange_headers
from .p2p import P2PExchange

_ALIGN = 256
# A verified NCCL execute moves a batch with direct receives in this many rounds
# (ExecTables::round_messages), so that the digest of what landed in a round runs under
# the next round's transfer and only the last round's is serial. Every rank must use
# the same number.
VERIFY_ROUNDS = 8

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


class _Digests:
    """Verify digests of one binding on the GPU (reshard_ext/verification.py): one device
    buffer with a uint64 per box of the tables that digest, zeroed per execute, and where
    each box's digest goes: (send or recv op) of each slot."""

    def __init__(self, parts: list[tuple[Any, str, Any]]):
        # parts: (DeviceBoxTable, "send" | "recv" | "copy_src" | "copy_dst", the op of each box)
        self.tables = [t for t, _, _ in parts]
        self.offsets, total = [], 0
        for t, _, _ in parts:
            self.offsets.append(total)
            total += t.num_boxes
        self.buf = torch.zeros(max(total, 1), dtype=torch.int64, device=torch.cuda.current_device())
        self.where: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for (t, kind, ops), off in zip(parts, self.offsets):
            ops = np.arange(t.num_boxes) if ops is None else np.asarray(ops, dtype=np.int64)
            slots = np.arange(off, off + t.num_boxes)
            old = self.where.get(kind, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
            self.where[kind] = (np.concatenate((old[0], slots)), np.concatenate((old[1], ops)))

    def args(self, i: int, pass_: int) -> tuple:
        """launch() arguments of part i: its digest slots and the pass."""
        return (self.buf.data_ptr() + 8 * self.offsets[i], pass_)

    def collect(self, kinds: tuple[str, ...], sizes: dict[str, int]) -> tuple[np.ndarray, ...]:
        """Waits for the digests (the current stream) and returns one uint64 array per kind,
        indexed by op."""
        host = self.buf.cpu().numpy().view(np.uint64)
        out = []
        for kind in kinds:
            a = np.zeros(sizes[kind], dtype=np.uint64)
            slots, ops = self.where.get(kind, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
            a[ops] = host[slots]
            out.append(a)
        return tuple(out)


def make_cuda_transport(backend: str, group: Any, options: Options, register: bool = False) -> CudaTransport:
    if not torch.cuda.is_available():
        raise ReshardError(f"backend {backend!r} needs CUDA, which torch does not see")
    if not _C._build_info["cuda"]:
        raise ReshardError("reshard_ext was built without CUDA kernels (RESHARD_EXT_CUDA=OFF or no nvcc at build time)")
    if backend == "nccl":
        from .. import _nccl

        comm = _nccl.communicator(group, options.resolved_timeout("nccl"))
        return CudaTransport(group, comm, options, register)
    return CudaTransport(group, None, options)


def _staged(ptr: int, buffers: list[torch.Tensor]) -> bool:
    return any(b.data_ptr() <= ptr < b.data_ptr() + b.numel() for b in buffers)


class CudaTransport:
    """Per batch: pack (one launch) -> exchange (one send/recv per peer) -> unpack (one
    launch, cast fused). With the NCCL communicator the exchange of batch k runs on a
    side stream while the caller's stream packs k+1 and unpacks k-1 (double-buffered
    staging); the caller's stream waits for the last transfer before its unpack."""

    def __init__(self, group: Any, comm: Any | None, options: Options, register: bool = False):
        self.group = group
        # Execute headers travel on the group's host channel, so that ranks agree on the
        # plan before any NCCL call (a mismatched NCCL send/recv cannot be taken back).
        self.channel = channel_of(group)
        self.peers: list[int] = []
        self.staging_bytes = 0
        self.nccl_timeout = options.resolved_timeout("nccl")
        self.comm: Any = comm  # None: torch.distributed p2p (self.p2p) moves the data
        self.nccl = comm is not None  # an NCCL communicator (rebuilt after a failure); NvshmemTransport's is not
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
        self.staging_bytes = nbuf * (tables.send_buffer_bytes + tables.recv_buffer_bytes)
        return [t.data_ptr() for t in self.send], [t.data_ptr() for t in self.recv]

    def staging_ranges(self) -> list[tuple[int, int]]:
        """[begin, end) device addresses of this rank's staging buffers."""
        return [(t.data_ptr(), t.data_ptr() + t.numel()) for t in self.send + self.recv]

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
        self._blob = _upload(host)
        self._verify: _Digests | None = None  # built by the first verified execute
        self._verify_rounds: list[list[Any] | None] = []  # per batch, its direct receives' tables per round
        self._round_messages: list[list[Any]] | None = None  # per batch and round, (sends, recvs)
        self._read: _Digests | None = None    # ... and by the first rx.verify
        nc = len(copy_parts)
        # A plan that moves nothing between ranks runs its copies alone, uncapped, with no
        # NCCL call or host wait (decided here, once, not per execute).
        self._moves = tables.send_total > 0 or tables.recv_total > 0
        if self.comm is not None and self._moves:
            self.max_blocks = _max_blocks(tables.send_total, tables.recv_total, tables.copy_total,
                                          self.max_blocks_override)
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

    def _verified(self, tables: Any) -> _Digests:
        """The digest state of verified executes: per batch the pack, the direct sends (no
        pack box: their sources are read), the unpack and the direct receives (their
        destinations are read once they landed)."""
        if self._verify is None:
            parts, rounds = [], []
            for b in range(tables.num_batches):
                direct = [_C.DeviceBoxTable(tables.direct_send_boxes(b)),
                          _C.DeviceBoxTable(tables.direct_recv_boxes(b))]
                parts += [(self._pack[b], "send", tables.pack_ops(b)), (direct[0], "send", tables.direct_sends(b)),
                          (self._unpack[b], "recv", tables.unpack_ops(b)), (direct[1], "recv", tables.direct_recvs(b))]
                # NCCL, with direct receives: their pieces per round, adding into part 4b+3's slots
                cut = self.nccl and len(tables.direct_recvs(b)) > 0
                rounds.append([_C.DeviceBoxTable(tables.direct_recv_round_boxes(b, r, VERIFY_ROUNDS))
                               for r in range(VERIFY_ROUNDS)] if cut else None)
            self._verify_blob = _upload([t for t, kind, _ in parts[1::2]] + [t for per in rounds if per for t in per])
            self._verify = _Digests(parts)
            self._verify_rounds = rounds
            # Every batch, whether this rank receives directly or not: both ends of a pair
            # must cut alike (a batch without large ops stays one exchange, in round 0).
            self._round_messages = [[tables.round_messages(b, r, VERIFY_ROUNDS) for r in range(VERIFY_ROUNDS)]
                                    for b in range(tables.num_batches)] if self.nccl else None
        return self._verify

    def abort(self) -> None:
        """Stops this rank's NCCL work at once (plan.abort(), from any thread): the
        communicator is aborted, and the next execute builds a new one."""
        if self.comm is not None:
            self.comm.abort()

    def _agree(self, tables: Any, session: Session, pack0: Any) -> tuple[set[int], bool]:
        """The header exchange (unless the caller made it: the direct transport); (peers to
        move data with, whether this rank writes its destinations). Rebuilds the NCCL
        communicator where an end of a pair needs it."""
        from .. import _nccl

        if session.verdict is None:
            self.channel.drain(session)
            if self.nccl:
                session.epoch = _nccl.epoch(self.group)
                session.comm_unusable = not self.comm.usable
            ok = session.status == 0
            exchange_headers(self.channel, self.peers, session, tables.num_batches, pack0 if ok else None)
        elif session.status == 0:
            pack0()
        verdict = session.verdict
        assert verdict is not None  # exchange_headers set it
        if self.nccl and (verdict.rebuild or session.comm_unusable):
            # Collective over the group: every rank whose communicator failed, and every
            # rank a peer of which says so, builds the next one together.
            self._registered = []  # the old communicator's registrations went with it
            self.comm = _nccl.communicator(self.group, self.nccl_timeout, fresh=True)
            if self.register:
                self._register()
        ok = session.status == 0
        good = set(self.peers) - set(verdict.bad) if ok else set()
        return good, ok and not verdict.bad

    def run(self, tables: Any, session: Session, verify: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
        """verify: the pack and unpack launches also digest every op; the ops that travel as
        direct messages are digested beside the transfer (sources once it is posted,
        destinations round by round as they land); returns (send, recv) digests."""
        main = torch.cuda.current_stream()
        s = main.cuda_stream
        k = len(self._pack)
        timeline = _Timeline() if self.trace else None
        step = timeline.step if timeline else _untraced
        v = self._verified(tables) if verify else None
        if v is not None:
            v.buf.zero_()

        def pack(b: int, cap: int = 0) -> None:
            if v is None:
                self._pack[b].launch(s, cap)
                return
            self._pack[b].launch(s, cap, *v.args(4 * b, _C.PASS_COPY))

        def digest_direct_sends(b: int, cap: int = 0) -> None:
            if v is not None:  # direct messages have no pack: their sources are read (read-only)
                v.tables[4 * b + 1].launch(s, cap, *v.args(4 * b + 1, _C.PASS_SRC))

        def unpack(b: int, cap: int = 0) -> None:
            if v is None:
                self._unpack[b].launch(s, cap)
                return
            self._unpack[b].launch(s, cap, *v.args(4 * b + 2, _C.PASS_COPY))
            if not rounds(b):  # else digest_direct_recvs read them round by round
                v.tables[4 * b + 3].launch(s, cap, *v.args(4 * b + 3, _C.PASS_DST))

        def rounds(b: int) -> bool:
            """Batch b's direct receives are digested round by round as they land."""
            return v is not None and self._round_messages is not None and self._verify_rounds[b] is not None

        if not self.peers:  # only same-rank copies: nobody to agree with (the direct transport's may disagree)
            self._raise(session)
            for i, c in enumerate(self._copy):
                step("copy", i, main, lambda c=c: c.launch(s))
            return self._finish(timeline, tables, v)
        if self.comm is None:  # torch.distributed p2p: no overlap
            p2p = self.p2p
            assert p2p is not None  # made where there is no communicator
            good, writes = self._agree(tables, session, lambda: step("pack", 0, main, lambda: pack(0)))
            group_of = {p2p.global_rank(p) for p in good}
            if writes:
                for i, c in enumerate(self._copy):  # after the first pack: it may read what they write
                    step("copy", i, main, lambda c=c: c.launch(s))
            for b in range(k if good else 0):
                if b > 0:
                    step("pack", b, main, lambda b=b: pack(b))
                digest_direct_sends(b)
                if session.abort.is_set():
                    raise ReshardError("rx.execute was aborted (plan.abort()) between batches")
                p2p.run([op for op in self._p2p_ops[b] if op.peer in group_of], session.timeout)
                if writes:
                    step("unpack", b, main, lambda b=b: unpack(b))
            result = self._finish(timeline, tables, v)
            self._raise(session)
            return result
        side = self.side
        assert side is not None  # made with the communicator
        cap = self.max_blocks
        done: list[torch.cuda.Event] = []
        scratch: list[torch.Tensor] = []
        good, writes = self._agree(tables, session, lambda: step("pack", 0, main, lambda: pack(0, cap)))
        comm = self.comm
        landed: list[list[torch.cuda.Event]] = []  # verify rounds: per batch, the end of each round

        def messages(b: int, r: int | None = None) -> tuple[list, list]:
            if r is None:
                sends, recvs = self._messages[b]
            else:
                assert self._round_messages is not None
                sends, recvs = self._round_messages[b][r]
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
                step("pack", b, main, lambda: pack(b, cap))
            side.wait_stream(main)  # the pack of b, and the unpack of b-2 (frees recv buffer b % 2)
            landed.append([])
            if v is not None and self._round_messages is not None:
                for r in range(VERIFY_ROUNDS):
                    sends, recvs = messages(b, r)
                    if sends or recvs:
                        step(f"transfer r{r}", b, side,
                             lambda sends=sends, recvs=recvs: self._transfer(b, side, sends, recvs))
                    landed[b].append(side.record_event())
                done.append(landed[b][-1])
            else:
                sends, recvs = messages(b)
                step("transfer", b, side, lambda: self._transfer(b, side, sends, recvs))
                done.append(side.record_event())
            if v is not None:  # once the transfer is posted: direct sources are hashed beside NCCL's reads
                step("digest", b, main, lambda: digest_direct_sends(b, cap))

        def digest_direct_recvs(b: int) -> None:
            # Each round's pieces as soon as they landed, under the next round's transfer;
            # only the last round of the last batch runs alone, so at full width.
            per_round = self._verify_rounds[b]
            assert v is not None and per_round is not None
            for r, t in enumerate(per_round):
                main.wait_event(landed[b][r])
                c = 0 if b + 1 == k and r + 1 == VERIFY_ROUNDS else cap
                step(f"digest r{r}", b, main, lambda t=t, c=c: t.launch(s, c, *v.args(4 * b + 3, _C.PASS_DST)))

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
                    if writes and rounds(b):
                        digest_direct_recvs(b)
                    self._landed(b, main, done[b])
                    if writes:
                        step("unpack", b, main, lambda b=b: unpack(b, cap))
                    self._unpacked(b, main)
                # A dead peer or a lost message raises here (bounded by the execute's
                # timeout) instead of hanging the next sync.
                self._drain(main, side, session.timeout)
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
        result = self._finish(timeline, tables, v)
        self._raise(session)
        return result

    def _raise(self, session: Session) -> None:
        if session.status != 0:
            raise ReshardError(session.error)
        if session.verdict is not None and session.verdict.bad:
            raise ReshardError(session.verdict.message(self.channel.rank) + "\n  (this rank wrote no destination)")

    # The steps of the pipelined run that differ between transports (NvshmemTransport).
    def _transfer(self, b: int, side: torch.cuda.Stream, sends: list, recvs: list) -> None:
        self.comm.exchange(sends, recvs, side.cuda_stream, 0)

    def _landed(self, b: int, main: torch.cuda.Stream, done: torch.cuda.Event) -> None:
        main.wait_event(done)

    def _unpacked(self, b: int, main: torch.cuda.Stream) -> None:
        pass

    def _drain(self, main: torch.cuda.Stream, side: torch.cuda.Stream, timeout: float) -> None:
        self.comm.wait(timeout)

    def read_digests(self, tables: Any) -> tuple[np.ndarray, ...]:
        """rx.verify: one launch per side reads every op's source (what it would send) and
        destination (what it holds), moving nothing."""
        if self._read is None:
            copies = _C.DeviceBoxTable(tables.copy_boxes())
            parts = [(_C.DeviceBoxTable(tables.send_boxes()), "send", None),
                     (_C.DeviceBoxTable(tables.recv_boxes()), "recv", None), (copies, "copy_src", None),
                     (copies, "copy_dst", None)]
            self._read_blob = _upload([t for t, *_ in parts[:3]])
            self._read = _Digests(parts)
        r = self._read
        r.buf.zero_()
        s = torch.cuda.current_stream().cuda_stream
        for i, pass_ in enumerate((_C.PASS_SRC, _C.PASS_DST, _C.PASS_SRC, _C.PASS_DST)):
            r.tables[i].launch(s, 0, *r.args(i, pass_))
        sends, recvs, copies_n = tables.num_ops
        return r.collect(("send", "recv", "copy_src", "copy_dst"),
                         {"send": sends, "recv": recvs, "copy_src": copies_n, "copy_dst": copies_n})

    def _finish(self, timeline: _Timeline | None, tables: Any, v: _Digests | None) -> Any:
        if timeline is not None:
            self.last_timeline = timeline.report()
        if v is None:
            return None
        sends, recvs, _ = tables.num_ops
        return v.collect(("send", "recv"), {"send": sends, "recv": recvs})
