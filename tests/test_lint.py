"""The package's sources, tests and benchmarks pass ruff, and the package passes mypy, as
configured in pyproject.toml (the test extra installs both, so CI runs these; a bare
environment skips them); a user's script passes mypy --strict against the package's types."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if not (ROOT / "pyproject.toml").exists() or not (ROOT / "reshard_ext").is_dir():
    pytest.skip("needs the source tree (pyproject.toml and reshard_ext/ beside tests/)", allow_module_level=True)


def _run(tool: str, *args: str, cwd: Path = ROOT) -> None:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (pip install '.[test]' installs it)")
    r = subprocess.run([sys.executable, "-m", tool, *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{tool} {' '.join(args)} found problems:\n{r.stdout}{r.stderr}"


def test_ruff() -> None:
    _run("ruff", "check", "--no-cache", "reshard_ext", "tests", "benchmarks", "examples")


def test_mypy() -> None:
    _run("mypy", "reshard_ext")


USER_SCRIPT = """
import torch
from torch import nn

import reshard_ext as rx


def refit(src: nn.Module, dst: nn.Module, step: int) -> rx.Plan:
    plan = rx.swap_model_weights(src, dst, None, "auto", verify=True, version=step, timeout=30.0)
    version: int | None = plan.version
    sent: int = plan.bytes_sent
    prepared: rx.Plan = rx.prepare_swap_model_weights(src, dst, backend="nccl", options=rx.Options(timeout=5.0))
    rx.execute(prepared, verify=True, version=version)
    print(repr(plan), sent)
    return plan
"""


def test_a_users_script_passes_mypy_strict(tmp_path: Path) -> None:
    """swap_model_weights' keyword arguments and the Plan it returns are typed (no Any)."""
    script = tmp_path / "refit_step.py"
    script.write_text(USER_SCRIPT)
    _run("mypy", "--strict", "--follow-imports=silent", "--cache-dir", str(tmp_path / ".mypy_cache"), str(script),
         cwd=ROOT)
