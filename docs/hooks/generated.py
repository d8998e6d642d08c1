"""MkDocs hook: the pages whose facts live in the code or in the measurements, generated at
every build so they cannot drift.

- reference/knobs.md: `<!-- knobs: Options -->`, `<!-- knobs: Tuning -->` and
  `<!-- knobs: deprecated -->` become the tables of reshard_ext/options.py's KNOBS (every
  RESHARD_EXT_* variable, its default and meaning) by the rx.Options or rx.Tuning field that
  each one is the default of (found in the field's `resolved_*` method), and the deprecated
  variables with their replacements.
- benchmarks.md: `<!-- results -->` becomes benchmarks/RESULTS.md as it stands, and
  `<!-- plot: NAME -->` a figure drawn from one of its tables (PLOTS below).

Neither needs the compiled extension: options.py is loaded on its own (it imports only
errors.py's exception, stubbed here), so the site builds without a build of reshard_ext.
"""
from __future__ import annotations

import importlib.util
import inspect
import io
import re
import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"


# --- knobs ---------------------------------------------------------------------------------

def _options_module() -> types.ModuleType:
    """reshard_ext/options.py under a private package name, its one import stubbed."""
    pkg = types.ModuleType("_rx_docs")
    pkg.__path__ = []
    errors = types.ModuleType("_rx_docs.errors")
    errors.ReshardError = type("ReshardError", (Exception,), {})  # type: ignore[attr-defined]
    sys.modules.update({"_rx_docs": pkg, "_rx_docs.errors": errors})
    spec = importlib.util.spec_from_file_location("_rx_docs.options", ROOT / "reshard_ext" / "options.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _default(value: Any) -> str:
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 20} MiB"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _fields_of(options: types.ModuleType) -> dict[str, tuple[str, str]]:
    """variable -> (the class, rx.Options or rx.Tuning, and the field it is the default of),
    found in the field's `resolved_*` method."""
    found: dict[str, tuple[str, str]] = {}
    for cls in (options.Options, options.Tuning):
        for field in cls.__dataclass_fields__:
            method = getattr(options.Options, f"resolved_{field}", None)
            for env in re.findall(r"RESHARD_EXT_\w+", inspect.getsource(method) if method else ""):
                if not options.KNOBS[env].deprecated_by:
                    found.setdefault(env, (cls.__name__, field))
    return found


def knobs_table(kind: str) -> str:
    """The table of `kind`: "Options" (the fields a user sets), "Tuning" (the expert fields and
    the variables of no field) or "deprecated" (variables still read for one release)."""
    options = _options_module()
    if kind == "deprecated":
        rows = ["| deprecated variable | use instead | what it still sets |", "|---|---|---|"]
        rows += [f"| `{env}` | `{knob.deprecated_by}` | {knob.doc.replace('|', '/')} |"
                 for env, knob in options.KNOBS.items() if knob.deprecated_by]
        return "\n".join(rows)
    fields = _fields_of(options)
    rows = [f"| `rx.{kind}` field | variable | default | meaning |", "|---|---|---|---|"]
    for env, knob in options.KNOBS.items():
        owner, field = fields.get(env, ("Tuning", ""))
        if owner == kind and not knob.deprecated_by:
            rows.append(f"| {f'`{field}`' if field else '–'} | `{env}` | {_default(knob.default)} | "
                        f"{knob.doc.replace('|', '/')} |")
    return "\n".join(rows)


# --- benchmarks ----------------------------------------------------------------------------

def results_section(heading: str) -> str:
    """The text of the RESULTS.md section whose heading starts with `heading`."""
    text = RESULTS.read_text()
    m = re.search(rf"^(#+) {re.escape(heading)}.*$", text, re.M)
    if not m:
        raise ValueError(f"benchmarks/RESULTS.md has no heading starting with {heading!r} "
                         "(docs/hooks/generated.py PLOTS draws a figure from it: update PLOTS)")
    level = len(m.group(1))
    end = re.search(rf"^#{{1,{level}}} ", text[m.end():], re.M)
    return text[m.end(): m.end() + end.start() if end else len(text)]


def first_table(section: str) -> list[list[str]]:
    """The rows (header first, no separator row) of the first Markdown table in `section`."""
    block: list[list[str]] = []
    for line in section.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):
                block.append(cells)
        elif block:
            break
    return block


_NUMBER = re.compile(r"\d[\d,]*\.?\d*")


def numbers(cell: str) -> list[float]:
    return [float(x.replace(",", "")) for x in _NUMBER.findall(cell.replace("*", ""))]


def ratio(cell: str) -> tuple[float, float] | None:
    """(low, high) of the ratio in parentheses, as in '21.29 (**0.97**)' or '(0.96–0.97; 1.03)'."""
    m = re.search(r"\(([^)]*)\)", cell)
    if not m:
        return None
    found = numbers(m.group(1).split(";")[0])
    return (found[0], found[-1]) if found else None


def _bars(title: str, labels: list[str], series: dict[str, list[tuple[float, float] | None]], xlabel: str,
          line: float | None = None) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(series)
    height = 0.8 / max(n, 1)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.5 * len(labels) * max(n, 1) ** 0.5), constrained_layout=True)
    for k, (name, values) in enumerate(series.items()):
        ys = [i + (k - (n - 1) / 2) * height for i in range(len(labels))]
        mids = [(v[0] + v[1]) / 2 if v else float("nan") for v in values]
        errs = [[(v[1] - v[0]) / 2 if v else 0 for v in values]] * 2
        spread = any(e for e in errs[0])  # a range measured: its span as an error bar
        ax.barh(ys, mids, height=height, xerr=errs if spread else None, label=name, capsize=2)
    if line is not None:
        ax.axvline(line, color="black", lw=0.8, ls="--")
    ax.set_yticks(range(len(labels)), [textwrap.fill(label, 38) for label in labels], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.ticklabel_format(axis="x", useOffset=False, style="plain")
    ax.set_title(textwrap.fill(title, 70), fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out.getvalue()


def plot_refit_vs_ceiling() -> bytes:
    rows = first_table(results_section("GPU refit against the physical floor"))
    header, body = rows[0], rows[1:]
    series = {col.replace("`", ""): [ratio(r[i]) for r in body] for i, col in enumerate(header[1:], 1)}
    return _bars("GPU refit time against the link ceiling (higher is better; 1 = the links' speed)",
                 [r[0] for r in body], series, "fraction of the ceiling measured in the same run", line=1.0)


def plot_predictor() -> bytes:
    rows = first_table(results_section("The predictor against measured refits"))
    header, body = rows[0], rows[1:]
    # the ratios of the last column, in the order of the measured columns before it
    cols = [c.removesuffix(" ms") for c in header if c.endswith(" ms") and not c.startswith("predicted")]
    series: dict[str, list[tuple[float, float] | None]] = {c: [] for c in cols}
    for r in body:
        parts = [p.strip() for p in r[-1].split(",")]
        parts += [""] * (len(cols) - len(parts))  # a row measured on fewer cards
        for c, p in zip(cols, parts):
            found = numbers(p)
            series[c].append((found[0], found[-1]) if found else None)
    return _bars("measured refit time / simulate's prediction (1 = as predicted; links bound every case)",
                 [r[0] for r in body], series, "measured / predicted", line=1.0)


def plot_simulate_presets() -> bytes:
    rows = first_table(results_section("`simulate` on every preset"))
    header, body = rows[0], rows[1:]
    col = {h: i for i, h in enumerate(header)}
    series = {"no relays": [], "relays (modelled)": []}  # type: dict[str, list[tuple[float, float] | None]]
    for r in body:
        for name, key in (("no relays", "no relays s"), ("relays (modelled)", "relays (modelled) s")):
            v = numbers(r[col[key]])[0]
            series[name].append((v, v))
    return _bars("simulate: predicted refit time of each preset at 2,048 GPUs", [r[0] for r in body], series,
                 "predicted seconds (links only)")


PLOTS: dict[str, Callable[[], bytes]] = {
    "refit_vs_ceiling": plot_refit_vs_ceiling,
    "predictor": plot_predictor,
    "simulate_presets": plot_simulate_presets,
}


# --- MkDocs events -------------------------------------------------------------------------

def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for name, draw in PLOTS.items():
        files.append(File.generated(config, f"img/{name}.png", content=draw()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    for kind in ("Options", "Tuning", "deprecated"):
        if f"<!-- knobs: {kind} -->" in markdown:
            markdown = markdown.replace(f"<!-- knobs: {kind} -->", knobs_table(kind))
    if "<!-- results -->" in markdown:
        results = RESULTS.read_text().split("\n", 1)[1]  # without its "# Results" title
        markdown = markdown.replace("<!-- results -->", re.sub(r"^(#+) ", r"#\1 ", results, flags=re.M))
    for name in re.findall(r"<!-- plot: (\w+) -->", markdown):
        if name not in PLOTS:
            raise ValueError(f"{page.file.src_uri}: no plot named {name!r} (docs/hooks/generated.py PLOTS)")
        markdown = markdown.replace(f"<!-- plot: {name} -->", f"![{name}](img/{name}.png)")
    return markdown
