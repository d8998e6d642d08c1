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


def info_rows() -> list[tuple[str, str]]:
    """(what, value) rows of `info`: what was built, what this process can load and use."""
    import torch

    from . import build_info
    from .transports import nccl_lib, nvshmem_lib

    built = build_info()
    cuda_ok = torch.cuda.is_available()
    devices = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if cuda_ok else ""
    nccl_runtime = nccl_lib.runtime_status() if built["nccl"] else "not built"
    nccl_usable = built["nccl"] and cuda_ok and not nccl_runtime.startswith("not")
    transports = ["cpu (C++ kernels; shared-memory rings within a host, gloo between hosts)"]
    if built["cuda"] and cuda_ok:
        transports.append("torch (CUDA kernels, torch.distributed p2p)")
    if nccl_usable:
        transports.append("nccl (CUDA kernels, C++ NCCL)")
    nvshmem_runtime = nvshmem_lib.runtime_status() if built["nvshmem"] else "not built"
    if built["nvshmem"] and cuda_ok and not nvshmem_runtime.startswith("not"):
        transports.append("nvshmem (CUDA kernels, NVSHMEM put-with-signal)")
    unusable = []
    if built["cuda"] and not cuda_ok:
        unusable.append("CUDA transports: torch sees no GPU")
    if nvshmem_runtime.startswith("not"):
        unusable.append(f"nvshmem: libnvshmem_host {nvshmem_runtime}")
    return [
        ("reshard_ext", str(built["version"])),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
        ("CUDA kernels (build)",
         f"yes, arch {built['cuda_arch']}, cudart {built['cudart']}" if built["cuda"] else "no"),
        ("CUDA devices (run time)", devices or "none"),
        ("NCCL transport (build)", f"yes, nccl.h {built['nccl_headers']}" if built["nccl"] else "no"),
        ("NCCL library (run time)", nccl_runtime),
        ("NVSHMEM transport (build)", "yes, host API (no headers or device library)" if built["nvshmem"] else "no"),
        ("NVSHMEM library (run time)", nvshmem_runtime),
        ("transports available", "; ".join(transports)),
        ("not available", "; ".join(unusable)),
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
