"""Command line: `python -m reshard_ext {info,demo,simulate}` (also installed as `reshard-ext`)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
from collections.abc import Sequence
from typing import Any

from .cli_args import positive_number


def _package_version() -> str:
    from . import _C

    return str(_C._build_info["version"])


TRANSPORT_WORDS = {  # every transport `info` names, in the order it names them
    "cpu": "C++ kernels; shared-memory rings within a host, gloo between hosts",
    "direct": "CUDA IPC writes straight into peers' tensors on one host, other pairs over nccl",
    "nccl": "CUDA kernels, C++ NCCL send/recv",
    "nvshmem": "CUDA kernels, NVSHMEM put-with-signal (experimental)",
    "torch": "CUDA kernels, torch.distributed point-to-point (for comparison)",
}


def transport_status() -> dict[str, str]:
    """Every transport -> '' where this process can use it, else why not."""
    import torch

    from . import build_info
    from .transports import nccl_lib, nvshmem_lib

    built = build_info()
    no_cuda = str(built.get("cuda_skipped") or "built without CUDA")  # why this build has no CUDA kernels
    gpu = "" if torch.cuda.is_available() else "torch sees no GPU"
    status = {"cpu": ""}
    for name in ("direct", "nccl", "nvshmem", "torch"):
        if name in built["transports"]:
            status[name] = gpu
        else:  # a CUDA build leaves out only the NCCL transport, where nccl.h was not found
            status[name] = "not built (no nccl.h at build time)" if built["cuda"] else no_cuda
    if not status["nccl"]:
        nccl = nccl_lib.runtime_status()
        status["nccl"] = f"libnccl {nccl}" if nccl.startswith("not") else ""
    if not status["nvshmem"]:
        nvshmem = nvshmem_lib.runtime_status()
        status["nvshmem"] = f"libnvshmem_host {nvshmem}" if nvshmem.startswith("not") else ""
    return status


def _auto_choice(status: dict[str, str]) -> str:
    """What backend="auto" picks here (execution._make_transport)."""
    if status["torch"]:  # no CUDA here: nothing to say about CUDA tensors
        return "cpu"
    from .options import Options

    if not status["direct"] and Options().resolved_auto_direct():
        cuda = "direct (pairs on one host; other pairs nccl)" if not status["nccl"] else "direct (pairs on one host)"
    else:
        cuda = "nccl" if not status["nccl"] else "torch"
    return f"cpu for CPU tensors, {cuda} for CUDA tensors"


def info_rows() -> list[tuple[str, str]]:
    """(what, value) rows of `info`: what was built, what this process can load and use."""
    import torch

    from . import build_info
    from .transports import nccl_lib, nvshmem_lib

    built = build_info()
    cuda_ok = torch.cuda.is_available()
    devices = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if cuda_ok else ""
    status = transport_status()
    available = [f"{name} ({TRANSPORT_WORDS[name]})" for name, why in status.items() if not why]
    # Grouped by reason: on a machine without CUDA that is one line naming them all, not a
    # list of libraries to go and install.
    reasons: dict[str, list[str]] = {}
    for name, why in status.items():
        if why:
            reasons.setdefault(why, []).append(name)
    return [
        ("reshard_ext", str(built["version"])),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
        ("CUDA kernels (build)",
         f"yes, arch {built['cuda_arch']}, cudart {built['cudart']}" if built["cuda"]
         else f"no: {built.get('cuda_skipped') or 'built without CUDA'}"),
        ("CUDA devices (run time)", devices or "none"),
        ("NCCL transport (build)", f"yes, nccl.h {built['nccl_headers']}" if built["nccl"] else "no"),
        ("NCCL library (run time)", nccl_lib.runtime_status()),
        ("NVSHMEM transport (build)", "yes, host API (no headers or device library)" if built["nvshmem"] else "no"),
        ("NVSHMEM library (run time)", nvshmem_lib.runtime_status()),
        ("transports available", "; ".join(available)),
        ("not available", "; ".join(f"{', '.join(names)}: {why}" for why, names in reasons.items())),
        ("backend='auto' uses", _auto_choice(status)),
    ]


def _info(args: argparse.Namespace) -> int:
    rows = info_rows()
    if args.json:
        print(json.dumps(dict(rows), indent=2))
        return 0
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import main as demo

    return demo(world=args.world, timeout_s=args.timeout, fail_rank=args.fail_rank)


def _simulator() -> Any | None:
    if importlib.util.find_spec(f"{__package__}.simulate") is None:
        return None
    return importlib.import_module(f"{__package__}.simulate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m reshard_ext",
        description="reshard_ext: move model weights between parallel layouts (training -> inference refit).")
    parser.add_argument("--version", action="version", version=f"reshard_ext {_package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{info,demo,simulate}")

    p = sub.add_parser("info", help="what was built and what this machine can run",
                       description="Version, torch, CUDA arch, NCCL found at build and loaded at run time, "
                                   "and the transports this process can use.")
    p.add_argument("--json", action="store_true", help="print the rows as a JSON object")
    p.set_defaults(func=_info)

    p = sub.add_parser("demo", help="a self-checking refit on local CPU processes",
                       description="Refits a Llama-shaped model from TP2 x PP2 to TP4 on local CPU processes "
                                   "(gloo) and checks every destination element. Exits non-zero on any mismatch, "
                                   "and within seconds with a worker's error if one fails.")
    p.add_argument("--world", type=int, default=4, choices=[4], help="number of processes (the demo's layouts need 4)")
    p.add_argument("--timeout", type=positive_number, default=300.0,
                   help="seconds before the demo gives up (default 300)")
    p.add_argument("--fail-rank", type=int, default=-1, help=argparse.SUPPRESS)  # fault injection for tests
    p.set_defaults(func=_demo)

    sim = _simulator()
    if sim is not None:
        p = sub.add_parser("simulate", help="plan a real model between two parallel specs, no GPUs needed",
                           description=(sim.__doc__ or "").strip().splitlines()[0] if sim.__doc__ else None,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        sim.add_arguments(p)
        p.set_defaults(func=sim.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    from .errors import ReshardError

    try:
        return int(args.func(args))
    except ReshardError as e:
        print(f"reshard_ext: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
