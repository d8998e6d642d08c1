"""Timing and ceilings shared by the GPU benchmarks (refit_bench, megatron_compare)."""
from __future__ import annotations

import statistics
from typing import Any, Callable

import torch
import torch.distributed as dist


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


def nccl_ceiling(plan: Any, iters: int, register: bool = False) -> float:
    """Seconds for one NCCL send and one receive per peer of exactly the bytes `plan`
    moves between the same peers (no pack, no unpack, one group): the link's ceiling.
    register: between buffers registered with ncclCommRegister (torch's memory needs
    NCCL_LEGACY_CUDA_REGISTER=1). 0 when the plan moves nothing or has no NCCL
    communicator."""
    tr = plan.transport
    comm = getattr(tr, "comm", None)
    if comm is None or not (plan.bytes_sent or plan.bytes_received):
        return 0.0
    per_peer: dict[tuple[str, int], int] = {}
    for b in range(plan.num_batches):
        for kind, msgs in zip(("send", "recv"), tr.transfers(b)):
            for peer, _, n in msgs:
                per_peer[(kind, peer)] = per_peer.get((kind, peer), 0) + n
    scratch = {k: torch.empty(n, dtype=torch.uint8, device="cuda") for k, n in per_peer.items()}
    sends = [(p, t.data_ptr(), t.numel()) for (k, p), t in scratch.items() if k == "send"]
    recvs = [(p, t.data_ptr(), t.numel()) for (k, p), t in scratch.items() if k == "recv"]
    handles = [comm.register_buffer(t.data_ptr(), t.numel()) for t in scratch.values()] if register else []
    try:
        return cuda_time(lambda: comm.exchange(sends, recvs, torch.cuda.current_stream().cuda_stream, 0), iters)
    finally:
        for h in handles:
            comm.deregister_buffer(h)


def d2d_time(nbytes: int, iters: int) -> float:
    """Seconds for a device-to-device copy of nbytes (0 for none)."""
    if nbytes <= 0:
        return 0.0
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return cuda_time(lambda: b.copy_(a), iters)
