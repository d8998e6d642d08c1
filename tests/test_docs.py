"""The documentation site: `mkdocs build --strict` passes (broken links, missing pages and
unresolved API references fail it), and every code block in docs/ and in README.md runs.

How a block runs, by its first line or the comment right above its fence:
- ```python: the page's plain blocks run in order as one script, in a fresh interpreter;
- ```python starting with `# torchrun --nproc-per-node N`: alone, under torchrun with N
  CPU processes (gloo); `# GPU: torchrun --nproc-per-node N`: the same with N GPUs, and
  only where there are (skipped on CPU);
- ```console: each `$ ` line runs in a shell;
- `<!-- not run: why -->` above a fence: shown only (say why: e.g. .ci/run runs it).
README.md follows the same rules (its indented Quick-start `$ ` lines are .ci/run's, not fenced).
Every block runs from a temporary folder, so the installed package is what they import.

GPU-only blocks (`# GPU: torchrun ...`) skip where there are too few GPUs; with
RX_DOCS_GPU_ONLY=1 only they run, and one that lacks its GPUs fails (scripts/gpu_check.sh docs).
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
pytestmark = pytest.mark.skipif(not (DOCS / "index.md").exists(), reason="no docs/ beside these tests")

_FENCE = re.compile(r"(?:^<!-- (not run: [^>]*) -->\n)?^```(\w+)[^\n]*\n(.*?)^```", re.M | re.S)
_TORCHRUN = re.compile(r"^# (GPU: )?torchrun --nproc-per-node (\d+)")


@dataclass
class Block:
    page: str
    index: int
    lang: str
    code: str
    skip: str | None  # the "not run: why" note


def _pages() -> list[tuple[str, Path]]:
    pages = [(str(path.relative_to(DOCS)), path) for path in sorted(DOCS.rglob("*.md"))]
    return pages + [("README.md", ROOT / "README.md")] if (ROOT / "README.md").exists() else pages


def blocks() -> list[Block]:
    out = []
    for page, path in _pages():
        for i, m in enumerate(_FENCE.finditer(path.read_text())):
            out.append(Block(page, i, m.group(2), m.group(3), m.group(1)))
    return out


GPU_ONLY = os.environ.get("RX_DOCS_GPU_ONLY") == "1"


def _run(args: list[str], cwd: Path, timeout: float = 600) -> None:
    # PYTHONPATH=. (a developer's in-place build) must still mean this checkout from `cwd`
    path = os.pathsep.join(os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    env = {**os.environ, "PYTHONPATH": path} if path else None
    r = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"{' '.join(args)}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_every_block_is_runnable_or_says_why_not() -> None:
    for b in blocks():
        assert b.lang in ("python", "console"), f"{b.page} block {b.index}: a ```{b.lang} block cannot be run"
        assert b.skip is None or len(b.skip) > len("not run: ") + 5, f"{b.page} block {b.index}: say why not"


PAGES = sorted({b.page for b in blocks()})


@pytest.mark.parametrize("page", PAGES)
def test_page_code_runs(page: str, tmp_path: Path) -> None:
    page_blocks = [b for b in blocks() if b.page == page and not b.skip]
    if GPU_ONLY:
        page_blocks = [b for b in page_blocks if (m := _TORCHRUN.match(b.code)) and m.group(1)]
        if not page_blocks:
            pytest.skip("no GPU-only block on this page")
    script = [b.code for b in page_blocks if b.lang == "python" and not _TORCHRUN.match(b.code)]
    if script:
        (tmp_path / "page.py").write_text("\n".join(script))
        _run([sys.executable, "page.py"], tmp_path)
    for b in page_blocks:
        m = _TORCHRUN.match(b.code)
        if b.lang == "python" and m:
            nproc = int(m.group(2))
            if m.group(1):
                import torch

                if torch.cuda.device_count() < nproc:
                    assert not GPU_ONLY, f"{page} block {b.index} needs {nproc} GPUs"
                    continue  # GPU-only: runs where the GPUs are (scripts/gpu_check.sh docs runs them)
            name = f"block{b.index}.py"
            (tmp_path / name).write_text(b.code)
            _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                  "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), name], tmp_path)
        elif b.lang == "console":
            for line in b.code.splitlines():
                if line.startswith("$ "):
                    command = line[2:].replace("python ", f"{sys.executable} ", 1)
                    _run(["bash", "-c", command], tmp_path)


def test_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    knobs = (tmp_path / "site" / "reference" / "knobs" / "index.html").read_text()
    from reshard_ext.options import KNOBS

    for env_name in KNOBS:  # the generated table has every variable
        assert f"<code>{env_name}</code>" in knobs, env_name
    assert all((tmp_path / "site" / "img" / f"{n}.png").stat().st_size > 0
               for n in ("refit_vs_ceiling", "predictor", "simulate_presets"))
