"""The package's sources, tests and benchmarks pass ruff, and the package passes mypy, as
configured in pyproject.toml (the test extra installs both, so CI runs these; a bare
environment skips them)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if not (ROOT / "pyproject.toml").exists() or not (ROOT / "reshard_ext").is_dir():
    pytest.skip("needs the source tree (pyproject.toml and reshard_ext/ beside tests/)", allow_module_level=True)


def _run(tool: str, *args: str) -> None:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (pip install '.[test]' installs it)")
    r = subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{tool} {' '.join(args)} found problems:\n{r.stdout}{r.stderr}"


def test_ruff() -> None:
    _run("ruff", "check", "--no-cache", "reshard_ext", "tests", "benchmarks", "examples")


def test_mypy() -> None:
    _run("mypy", "reshard_ext")
