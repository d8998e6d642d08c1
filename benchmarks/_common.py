"""Timing, ceilings and small helpers shared by the benchmarks."""
from __future__ import annotations

import socket
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_size(s: str) -> int:
    """Bytes of "512", "64K", "1.5M" or "1G"."""
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1].upper()]) if s[-1].upper() in mult else int(s)


def cuda_time(fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
    """Median seconds of fn over iters (CUDA events; ranks lined up by a barrier when a
    process group exists)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        if dist.is_initialized():
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return statistics.median(out)


def peer_bytes(plan: Any) -> dict[tuple[str, int], int]:
    """{("send" | "recv", peer): bytes} this rank's plan moves to and from each peer, on the
    wire of a staged transport (whichever transport the plan uses)."""
    rank_plan = plan._agreement.rank_plan
    out: dict[tuple[str, int], int] = {}
    for kind, ops in (("send", rank_plan.sends()), ("recv", rank_plan.recvs())):
        for op in ops:
            out[(kind, op.peer)] = out.get((kind, op.peer), 0) + op.nbytes
    return out


def _comm_of(plan: Any) -> Any:
    tr = plan.transport
    comm = getattr(tr, "comm", None) or getattr(getattr(tr, "inner", None), "comm", None)
    if comm is None and plan.backend == "direct":  # a plan of direct pairs only has none of its own
        from reshard_ext.transports import nccl_lib

        comm = nccl_lib.communicator(plan.group) if nccl_lib.available() else None
    return comm


def nccl_ceiling(plan: Any, iters: int, register: bool = False) -> float:
    """Seconds for one NCCL send and one receive per peer of exactly the bytes `plan`
    moves between the same peers (no pack, no unpack, one group): the link's ceiling.
    register: between buffers registered with ncclCommRegister (torch's memory needs
    NCCL_LEGACY_CUDA_REGISTER=1). 0 when the plan moves nothing or has no NCCL
    communicator."""
    comm = _comm_of(plan)
    if comm is None or not (plan.bytes_sent or plan.bytes_received):
        return 0.0
    per_peer = peer_bytes(plan)
    scratch = {k: torch.empty(n, dtype=torch.uint8, device="cuda") for k, n in per_peer.items()}
    sends = [(p, t.data_ptr(), t.numel()) for (k, p), t in scratch.items() if k == "send"]
    recvs = [(p, t.data_ptr(), t.numel()) for (k, p), t in scratch.items() if k == "recv"]
    handles = [comm.register_buffer(t.data_ptr(), t.numel()) for t in scratch.values()] if register else []
    try:
        return cuda_time(lambda: comm.exchange(sends, recvs, torch.cuda.current_stream().cuda_stream, 0), iters)
    finally:
        for h in handles:
            comm.deregister_buffer(h)


def hbm_per_byte(plan: Any) -> float:
    """HBM bytes this rank's GPU reads and writes per byte landing in its destinations, from
    the plan (0 for a plan without tables, e.g. a relay's two phases): a same-rank copy
    reads and writes each byte (2); a byte sent is read once at the source and a byte
    received written once at the destination (direct writes, and NCCL messages from / into
    the tensors themselves); a staged byte is also written into and read back from a
    staging buffer at its end (2 more). NCCL's own FIFOs (unregistered transfers) are not
    counted."""
    tables = getattr(plan, "tables", None)
    if tables is None:
        return 0.0
    tr = plan.transport
    inner = getattr(tr, "inner", None) or tr
    bufs = inner.staging_ranges() if hasattr(inner, "staging_ranges") else []
    staged = 0
    for b in range(tables.num_batches):
        sends, recvs = tables.messages(b)
        staged += sum(m.bytes for m in sends + recvs if any(lo <= m.ptr < hi for lo, hi in bufs))
    local = tables.copy_total
    delivered = local + plan.bytes_received
    touched = 2 * local + plan.bytes_sent + plan.bytes_received + 2 * staged
    return touched / delivered if delivered else 0.0


def d2d_time(nbytes: int, iters: int) -> float:
    """Seconds for a device-to-device copy of nbytes (0 for none)."""
    if nbytes <= 0:
        return 0.0
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return cuda_time(lambda: b.copy_(a), iters)


def peer_copy_ceiling(plan: Any, iters: int, local_bytes: int = 0) -> float:
    """Seconds for copy-engine peer copies of the bytes `plan` sends to each peer, every
    rank at once (both ways at once where the refit moves both ways): each process copies
    from its GPU into a buffer it allocates on the peer's GPU (torch's cross-device copy_,
    cudaMemcpyPeerAsync), as the direct transport's copy engines do. 0 on every rank when
    some rank's peer GPU is not visible to it (another host, CUDA_VISIBLE_DEVICES).
    local_bytes > 0: a D2D copy of that many bytes runs at the same time on a second stream
    (the whole work of a collocated refit: its wire bytes and its same-rank bytes at once)."""
    import socket

    world = dist.get_world_size(plan.group)
    where: list = [None] * world
    dist.all_gather_object(where, (socket.gethostname(), torch.cuda.current_device()), group=plan.group)
    sends = {peer: n for (kind, peer), n in peer_bytes(plan).items() if kind == "send" and n > 0}
    me = where[dist.get_rank(plan.group)]
    ok = all(where[p][0] == me[0] and where[p][1] < torch.cuda.device_count() for p in sends)
    votes: list = [None] * world
    dist.all_gather_object(votes, ok, group=plan.group)
    if not all(votes):  # every rank times the copies, or none does (cuda_time lines them up)
        return 0.0
    bufs = [(torch.empty(n, dtype=torch.uint8, device="cuda"),
             torch.empty(n, dtype=torch.uint8, device=torch.device("cuda", where[p][1]))) for p, n in sends.items()]
    local = [torch.empty(local_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)] if local_bytes > 0 else []
    side = torch.cuda.Stream()

    def copy() -> None:
        if local:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                local[1].copy_(local[0])
        for src, dst in bufs:
            dst.copy_(src, non_blocking=True)
        if local:
            torch.cuda.current_stream().wait_stream(side)

    try:
        return cuda_time(copy, iters)
    finally:
        bufs.clear()  # free the peer buffers now, not when the closure goes
        local.clear()
