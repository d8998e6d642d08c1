"""`python -m reshard_ext`: an argparse command line that behaves like one."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import reshard_ext as rx


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reshard_ext", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_the_subcommands() -> None:
    for flag in ("--help", "-h"):
        r = _cli(flag)
        assert r.returncode == 0, r.stderr
        for sub in ("info", "demo"):
            assert sub in r.stdout
        assert "--version" in r.stdout


def test_no_subcommand_prints_help() -> None:
    r = _cli()
    assert r.returncode == 0 and "usage:" in r.stdout


def test_version() -> None:
    r = _cli("--version")
    assert r.returncode == 0
    assert r.stdout.strip() == f"reshard_ext {rx.__version__}"


def test_unknown_subcommand_is_a_usage_error() -> None:
    r = _cli("frobnicate")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_info_table_and_json() -> None:
    r = _cli("info")
    assert r.returncode == 0, r.stderr
    for row in ("reshard_ext", "torch", "CUDA kernels (build)", "NCCL transport (build)", "NCCL library (run time)",
                "transports available"):
        assert row in r.stdout, r.stdout
    r = _cli("info", "--json")
    rows = json.loads(r.stdout)
    assert rows["reshard_ext"] == rx.__version__
    assert "cpu" in rows["transports available"]
    built = rx.build_info()
    assert rows["NCCL transport (build)"].startswith("yes" if built["nccl"] else "no")


def test_demo_help() -> None:
    r = _cli("demo", "--help")
    assert r.returncode == 0 and "--timeout" in r.stdout


def test_demo_fails_fast_with_the_workers_error() -> None:
    # A worker that dies must end the demo with its error, not after the (long) timeout.
    r = _cli("demo", "--fail-rank", "2", "--timeout", "3000", timeout=240)
    assert r.returncode == 1
    assert "rank 2" in r.stderr and "injected failure on rank 2" in r.stderr, r.stderr


def test_info_and_build_info_name_every_transport() -> None:
    from reshard_ext.execution import BACKENDS

    transports = [b for b in BACKENDS if b != "auto"]
    built = rx.build_info()
    assert "cpu" in built["transports"] and set(built["transports"]) <= set(transports), built
    assert ("direct" in built["transports"]) == built["cuda"]
    assert ("nccl" in built["transports"]) == built["nccl"]
    assert bool(built["cuda_skipped"]) != built["cuda"], built
    from reshard_ext.__main__ import transport_status

    status = transport_status()
    assert sorted(status) == sorted(transports)
    rows = json.loads(_cli("info", "--json").stdout)
    for name, why in status.items():  # each one named, in the row that matches its status
        row = rows["not available" if why else "transports available"]
        assert re.search(rf"(^|[ ;,]){name}\b", row), (name, rows)
    assert "backend='auto' uses" in rows


def test_info_on_a_machine_without_cuda_suggests_no_cuda_backend() -> None:
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("this machine has CUDA")
    rows = json.loads(_cli("info", "--json").stdout)
    assert rows["transports available"].split(" (")[0] == "cpu" and rows["transports available"].count(" (") == 1
    assert rows["backend='auto' uses"] == "cpu"
    # the CUDA transports are named once, with the one reason, not each with a library to install
    assert rows["not available"].startswith("direct, nccl, nvshmem, torch: "), rows["not available"]
    assert "libnvshmem" not in rows["not available"] and "libnccl" not in rows["not available"]


def test_demo_rejects_bad_timeouts() -> None:
    for value in ("nan", "-1", "0", "inf", "soon"):
        r = _cli("demo", "--timeout", value)
        assert r.returncode == 2 and "argument --timeout" in r.stderr and "Traceback" not in r.stderr, r.stderr
