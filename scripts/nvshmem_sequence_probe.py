"""Issue #37 item 5: why an NVSHMEM plan's first execute does not complete after an "auto"
and an "nccl" plan in the same processes (2 GPUs, non-collocated TP1 -> TP1: rank 0 holds
the source GPT, rank 1 the destination; the collocated case and each backend alone work).

Each variant is a sequence of backends run in a fresh pair of processes (NVSHMEM has one
world per process): every plan is made and executed twice with a short timeout, as in
tests/test_outcome_gpu.py. Where an execute fails, the ranks read, without touching the
caller's stream (an NVSHMEM stream wait may block it for good):
  - nvshmem_ptr(region, pe) for every PE: 0 means NVSHMEM did not map that PE here, so a
    put to it goes through the proxy thread (no network transport on one host: it never lands);
  - the region's signal words, on a stream of their own: per sender, how many of its
    messages landed here (the "data" words), and per receiver how many batches it unpacked;
  - whether the caller's stream drained (a sender's drains only after its puts ran);
  - each rank's region geometry (it must be the same on every rank: puts name offsets).
The parent prints one verdict per variant (diagnose()); each rank's log ($OUT/probe/),
with NVSHMEM's INFO lines and the Python stacks of a rank still stuck at the deadline,
backs it up.

    python scripts/nvshmem_sequence_probe.py            # the default variants, at most --budget s
    python scripts/nvshmem_sequence_probe.py --variants "auto,nccl,nvshmem" --timeout 20
    python scripts/nvshmem_sequence_probe.py --variants "auto,nccl,nvshmem@NVSHMEM_DISABLE_CUDA_VMM=1"

A variant is "backend,backend,...[@VAR=value[,VAR=value]]"; variants are separated by ";".
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import datetime
import faulthandler
import os
import queue
import signal
import socket
import sys
import time
import traceback
from typing import Any

# The report's sequence first, then NVSHMEM alone (the control) and the two halves of it.
DEFAULT_VARIANTS = "auto,nccl,nvshmem;nvshmem;auto,nvshmem;nccl,nvshmem"
KNOWN = ("auto", "nccl", "direct", "nvshmem", "torch")


def parse_variants(text: str) -> list[tuple[list[str], dict[str, str]]]:
    """[(backends, extra environment)] of a --variants text (see the module doc)."""
    out = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        seq, _, env_text = part.partition("@")
        backends = [b.strip() for b in seq.split(",") if b.strip()]
        bad = [b for b in backends if b not in KNOWN]
        if not backends or bad:
            raise ValueError(f"variant {part!r}: backends must be among {KNOWN}, got {backends}")
        env = {}
        for item in (i.strip() for i in env_text.split(",") if i.strip()):
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise ValueError(f"variant {part!r}: {item!r} is not VAR=value")
            env[key] = value
        out.append((backends, env))
    return out


# --- the verdict (pure: tests/test_nvshmem.py checks it on the CPU) -----------------------

def diagnose(reports: list[dict[str, Any] | None]) -> list[str]:
    """One line per finding from the ranks' reports of one variant (dicts, see _worker):
    each has "steps" (per executed plan step: backend, ok, error) and, where an NVSHMEM
    execute failed, "nvshmem" (the probe after the failure). A rank that sent nothing back
    is None."""
    lines: list[str] = []
    missing = [r for r, rep in enumerate(reports) if rep is None]
    if missing:
        lines.append(f"ranks {missing} reported nothing (killed at the deadline: a host-side hang; see their "
                     f"stacks in the log)")
    stuck = [(r, rep["stage"]) for r, rep in enumerate(reports) if rep is not None and not rep.get("finished")]
    for r, stage in stuck:
        lines.append(f"rank {r} never finished (last stage: {stage}): a host-side hang there; see its stacks")
    for r, rep in enumerate(reports):
        if rep is not None and rep.get("error"):
            lines.append(f"rank {r} raised outside an execute: {rep['error'].strip().splitlines()[-1][:200]}")
    failed = [(r, s) for r, rep in enumerate(reports) if rep is not None for s in rep["steps"] if not s["ok"]]
    if not failed and not missing and not stuck and not any(rep is not None and rep.get("error") for rep in reports):
        return ["every execute of the sequence landed bit for bit: this variant does not hang"]
    for r, s in failed:
        lines.append(f"rank {r}: {s['backend']} execute #{s['step'] + 1} failed after {s['took']:.1f} s: "
                     f"{(s['error'] or 'wrong data').splitlines()[0][:200]}")
    probes = {r: rep["nvshmem"] for r, rep in enumerate(reports) if rep is not None and rep.get("nvshmem")}
    if not probes:
        return lines
    geometry = {r: tuple(p["geometry"]) for r, p in probes.items()}
    if len(set(geometry.values())) > 1:
        lines.append(f"H2 CONFIRMED: the ranks' regions differ (slots, slot bytes, signal offset): {geometry}; "
                     f"a put names an offset of the receiver's region, so data and signals land elsewhere")
    for r, p in probes.items():
        unmapped = [pe for pe in p["sends_to"] if not p["mapped"].get(pe)]
        if unmapped:
            lines.append(f"H1 CONFIRMED: rank {r}'s NVSHMEM does not map PEs {unmapped} it puts to "
                         f"(nvshmem_ptr is 0): its puts go through the proxy, which cannot deliver them on one host")
    for r, p in probes.items():
        if p["sends_to"] and not p["stream_idle"]:
            lines.append(f"H3: sender rank {r}'s caller stream never drained (its pack, or the puts it waits for on "
                         f"the side stream, never ran): GPU work of this process blocks the transfer")
    for r, p in probes.items():
        for pe, want in p["expected_from"].items():
            got = p["data_words"][int(pe)] if p["data_words"] is not None else None
            senders_done = all(probes[s]["stream_idle"] for s in probes if int(pe) == probes[s]["pe"])
            if got is None:
                lines.append(f"rank {r}: its signal words could not be read (the read timed out)")
            elif got < want and senders_done:
                lines.append(f"H2: receiver rank {r} counts {got} of {want} messages from PE {pe}, though the "
                             f"sender's stream drained (its puts ran): the data and signals went to another address")
            elif got < want:
                lines.append(f"receiver rank {r} counts {got} of {want} messages from PE {pe}: they were never "
                             f"put (see the sender's lines)")
            elif not p["stream_idle"]:
                lines.append(f"H4: receiver rank {r} holds all {want} signals from PE {pe}, yet its caller stream "
                             f"is still blocked in the stream wait (cuStreamWaitValue64 does not see the word)")
            else:
                lines.append(f"rank {r}: all {want} messages from PE {pe} landed and its stream drained: the GPU "
                             f"work completed; the failure is on the host (see the error and the stacks)")
    return lines


# --- the ranks ----------------------------------------------------------------------------

class _DeviceWords:
    """A __cuda_array_interface__ over int64 words at a raw device address (no stream: no sync)."""

    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<i8", "data": (ptr, False), "version": 2}


class _Reader:
    """Reads device words on a stream of its own with a bounded wait: the caller's stream may
    be blocked by a stream wait for good. Its pinned buffer and stream are made up front (a
    pinned allocation after the failure could wait for the device)."""

    def __init__(self, n: int = 64):
        import torch

        self.stream = torch.cuda.Stream()
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=True)
        self.event = torch.cuda.Event()

    def read(self, ptr: int, n: int, timeout_s: float = 5.0) -> list[int] | None:
        import torch

        dev = torch.as_tensor(_DeviceWords(ptr, n), device="cuda")
        with torch.cuda.stream(self.stream):
            self.host[:n].copy_(dev, non_blocking=True)
            self.event.record(self.stream)
        deadline = time.monotonic() + timeout_s
        while not self.event.query():
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        return [int(v) for v in self.host[:n].tolist()]


def _nvshmem_lib() -> Any:
    from reshard_ext import _C

    lib = ctypes.CDLL(str(_C.nvshmem_library_path()))  # the copy the extension loaded: the same state
    lib.nvshmem_ptr.restype = ctypes.c_void_p
    lib.nvshmem_ptr.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.nvshmemx_init_status.restype = ctypes.c_int
    return lib


def _nvshmem_probe(plan: Any, reader: _Reader, executes: int) -> dict[str, Any]:
    """What the NVSHMEM plan's ranks hold after a failed execute (see the module doc)."""
    import torch

    t = plan.transport
    base, slots, stride, _ = t._layout
    npes = len(t.pe_of)
    signals = base + t.staging_bytes  # the signal words follow the slots (NvshmemTransport.bind_plan)
    lib = _nvshmem_lib()
    tables = plan.tables
    sends_to: dict[int, int] = {}
    expected: dict[int, int] = {}
    for b in range(tables.num_batches):
        out, inc = tables.messages(b)
        for m in out:
            if m.bytes > 0:
                sends_to[t.pe_of[m.peer]] = sends_to.get(t.pe_of[m.peer], 0) + 1
        for m in inc:
            if m.bytes > 0:
                expected[t.pe_of[m.peer]] = expected.get(t.pe_of[m.peer], 0) + executes
    words = reader.read(signals, 2 * npes)
    return {
        "pe": int(lib.nvshmem_my_pe()),
        "init_status": int(lib.nvshmemx_init_status()),
        "mapped": {pe: bool(lib.nvshmem_ptr(ctypes.c_void_p(base), pe)) for pe in range(npes)},
        "geometry": (slots, stride, t.staging_bytes),
        "region": base,
        "sends_to": sends_to,
        "expected_from": expected,
        "data_words": None if words is None else words[:npes],
        "free_words": None if words is None else words[npes:],
        "stream_idle": bool(torch.cuda.current_stream().query()),
        "batches": tables.num_batches,
    }


def _worker(rank: int, world: int, port: int, backends: list[str], env: dict[str, str], timeout_s: float,
            log_path: str, out: Any) -> None:
    os.environ.update(env)
    log = open(log_path, "w", buffering=1)  # noqa: SIM115 - the process's stdout and stderr until it exits
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)  # the parent's "where are you?"
    report: dict[str, Any] = {"rank": rank, "steps": [], "stage": "start", "finished": False}

    def say(stage: str) -> None:
        report["stage"] = stage
        print(f"[probe rank {rank}] {stage}", flush=True)
        out.put((rank, copy.deepcopy(report)))

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    cpu = dist.new_group(backend="gloo")  # the ranks meet here after a failure: never the caller's stream
    from reshard_ext.synthetic import GPT_335M, Parallel, model_layouts

    reader = _Reader()
    src_l = model_layouts(GPT_335M, Parallel(tp=1, offset=0))
    dst_l = model_layouts(GPT_335M, Parallel(tp=1, offset=1))
    gen = torch.Generator(device="cuda").manual_seed(7)
    want = {n: torch.randn(lay.shape, generator=gen, device="cuda").to(lay.dtype) for n, lay in sorted(src_l.items())}
    src = {n: (t, src_l[n]) for n, t in want.items()} if rank == 0 else {}
    dst = {n: (torch.full(lay.shape, float("nan"), device="cuda", dtype=lay.dtype), lay)
           for n, lay in dst_l.items()} if rank == 1 else {}
    try:
        _sequence(backends, timeout_s, log, report, say, src, dst, want, reader)
    except Exception:  # noqa: BLE001 - a plan that raised: the report says where
        report["error"] = traceback.format_exc()
    report["finished"] = True
    say("done")
    try:  # both ranks probed before either exits (an exit frees its memory under the peer)
        dist.monitored_barrier(group=cpu, timeout=datetime.timedelta(seconds=30))
    except Exception:  # noqa: BLE001
        pass
    out.close()
    out.join_thread()  # the queue's feeder thread sends what was put before the exit below
    log.flush()
    os._exit(0)  # no atexit: NVSHMEM's and NCCL's finalizers may wait on a blocked stream


def _sequence(backends: list[str], timeout_s: float, log: Any, report: dict[str, Any], say: Any,
              src: dict, dst: dict, want: dict, reader: _Reader) -> None:
    """Plans and executes (twice) each backend of the variant; stops at the first failure
    after probing it."""
    import torch

    import reshard_ext as rx

    kept = []
    for backend in backends:
        say(f"rx.plan backend={backend}")
        p = rx.plan(src, dst, backend=backend)
        kept.append(p)  # every plan alive, as in the report's process
        say(f"planned backend={backend}: {p!r}")
        for step in range(2):
            for t, _ in dst.values():
                t.fill_(float("nan"))
            say(f"rx.execute backend={backend} #{step + 1}")
            faulthandler.dump_traceback_later(timeout_s + 15, file=log)  # a wait that ignores the timeout
            t0, error = time.monotonic(), None
            try:
                rx.execute(p, timeout=timeout_s)
            except Exception as e:  # noqa: BLE001 - the report is what this probe is for
                error = f"{type(e).__name__}: {e}"
            faulthandler.cancel_dump_traceback_later()
            took = time.monotonic() - t0
            ok = False
            if error is None:
                torch.cuda.synchronize()
                ok = all(torch.equal(t.view(torch.int16), want[n].view(torch.int16)) for n, (t, _) in dst.items())
            report["steps"].append({"backend": backend, "step": step, "ok": ok, "took": took, "error": error})
            if error is not None:
                if p.backend == "nvshmem":
                    report["nvshmem"] = _nvshmem_probe(p, reader, step + 1)
                report["legacy_stream_idle"] = bool(torch.cuda.current_stream().query())
                return


def _run_variant(index: int, backends: list[str], env: dict[str, str], args: argparse.Namespace,
                 limit_s: float) -> list[dict[str, Any] | None]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    outq = ctx.Queue()
    logs = [os.path.join(args.out, f"v{index}_rank{r}.log") for r in range(2)]
    base_env = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_DEBUG": "INFO", **env}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    procs = [ctx.Process(target=_worker, args=(r, 2, port, backends, base_env, args.timeout, logs[r], outq))
             for r in range(2)]
    for p in procs:
        p.start()
    latest: list[dict[str, Any] | None] = [None, None]
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not all(x is not None and x["finished"] for x in latest):
        try:
            rank, rep = outq.get(timeout=0.5)
            latest[rank] = rep
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                break
    for r, p in enumerate(procs):
        done = latest[r] is not None and latest[r]["finished"]  # type: ignore[index]
        if p.is_alive() and p.pid is not None and not done:
            os.kill(p.pid, signal.SIGUSR1)  # faulthandler: the stuck rank's stacks into its log
    time.sleep(1.0)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    while True:  # reports that came in meanwhile
        try:
            rank, rep = outq.get_nowait()
            latest[rank] = rep
        except queue.Empty:
            break
    return latest


def _log_excerpt(path: str, lines: int = 12) -> str:
    """The NVSHMEM warnings and transport lines, and the last stack dump, of a rank's log."""
    try:
        with open(path, errors="replace") as f:
            text = f.read().splitlines()
    except OSError:
        return "  (no log)"
    keys = ("WARN", "ERROR", "P2P", "transport", "VMM", "memops", "proxy", "mapped", "NCCL library")
    picked = [s for s in text if "NVSHMEM" in s and any(k in s for k in keys)][-lines:]
    stack_at = max((i for i, s in enumerate(text) if s.startswith(("Thread 0x", "Current thread"))), default=-1)
    stack = text[stack_at:stack_at + 25] if stack_at >= 0 else []
    return "\n".join("  | " + s[:220] for s in picked + (["  -- stacks:"] if stack else []) + stack)


def main() -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # reshard_ext, for the ranks
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--timeout", type=float, default=20.0, help="rx.execute(timeout=) of every execute")
    ap.add_argument("--variant-limit", type=float, default=75.0, help="seconds a variant may take in all")
    ap.add_argument("--budget", type=float, default=170.0, help="seconds for every variant together")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp/rx_out"), "probe"))
    args = ap.parse_args()
    variants = parse_variants(args.variants)
    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()
    for i, (backends, env) in enumerate(variants):
        left = args.budget - (time.monotonic() - start)
        name = ",".join(backends) + ("@" + ",".join(f"{k}={v}" for k, v in env.items()) if env else "")
        if left < 20:
            print(f"\n== variant {i}: {name}: skipped (budget spent)")
            continue
        t0 = time.monotonic()
        reports = _run_variant(i, backends, env, args, min(args.variant_limit, left))
        print(f"\n== variant {i}: {name} ({time.monotonic() - t0:.0f} s)")
        for line in diagnose(reports):
            print("  " + line)
        for r, rep in enumerate(reports):
            if rep is not None and rep.get("nvshmem"):
                print(f"  rank {r} probe: {rep['nvshmem']}")
        if any(rep is None or not rep.get("finished") or any(not s["ok"] for s in rep["steps"]) for rep in reports):
            for r in range(2):
                print(f"  rank {r} log ({os.path.join(args.out, f'v{i}_rank{r}.log')}):")
                print(_log_excerpt(os.path.join(args.out, f"v{i}_rank{r}.log")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
