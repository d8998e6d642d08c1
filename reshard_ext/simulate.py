"""`python -m reshard_ext simulate`: what a refit will cost, before buying the cluster time.

It builds the model's layouts on both sides (a preset or a Hugging Face config.json, the
parallel specs), plans every rank with the real C++ planner (no process group, one
core), and predicts the transfer time from a link model:

- each GPU has an NVLink port (to GPUs of its node) and a network port (to other
  nodes), each with a bandwidth per direction, and copies same-rank bytes at an HBM copy
  rate; ports work in parallel and never slow each other;
- a phase lasts as long as its busiest port (bytes / bandwidth); the refit lasts the sum
  of its phases. Latency, pack/unpack kernels and contention for HBM are not modelled,
  so the prediction is the time the links need at best.

"Without relays": every receiver pulls its bytes from a source rank (rx.Options(relay=False)).
"With relays" models what rx.plan's relay fan-out does (reshard_ext/relay.py) from the
planner's fan-out sets (relay_phases), without building the relay plans: bytes that several
receivers need from the same sender go out once, scattered over those receivers, then each
forwards its part to the others; in one stage, and pipelined in G stages as rx.plan runs it.

Entry points: `add_arguments(parser)` and `run(args)` (the CLI), `simulate(...)` (a
dict report), `plan_all_ranks(...)` (the planner's per-rank numbers).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from . import _C
from .cli_args import count, positive_number
from .errors import ReshardError
from .model_config import PRESETS, describe_parallel, load_model, make_parallel, parse_spec
from .options import Options
from .synthetic import ModelShape, Parallel, model_layouts

GB = 1e9
DEFAULT_BATCH_MB = 512  # rx.plan's default on GPUs (transports/cuda.py DEFAULT_BATCH_BYTES)
PORTS = ("nvlink_out", "nvlink_in", "network_out", "network_in", "copy")
NVL_OUT, NVL_IN, NET_OUT, NET_IN, COPY = range(len(PORTS))
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class LinkModel:
    """Bandwidths per GPU, per direction, in GB/s (1e9 bytes)."""

    gpus_per_node: int = 8
    nvlink_gbps: float = 360.0   # H100 NV18 through NVSwitch, as measured (benchmarks/RESULTS.md)
    network_gbps: float = 50.0   # one 400 Gb/s NIC per GPU (InfiniBand / RoCE)
    copy_gbps: float = 1500.0    # same-rank copy on H100: the measured D2D ceiling (benchmarks/RESULTS.md)

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def bandwidth(self, port: int) -> float:
        return (self.nvlink_gbps, self.nvlink_gbps, self.network_gbps, self.network_gbps, self.copy_gbps)[port] * GB


@dataclass
class Phase:
    """Bytes per rank and port ([world][len(PORTS)]) moved in one phase."""

    name: str
    load: list[list[float]]

    def busiest(self, link: LinkModel) -> tuple[float, int, int]:
        """(seconds, rank, port) of the port that finishes last."""
        best = (0.0, -1, -1)
        for r, ports in enumerate(self.load):
            for p, b in enumerate(ports):
                t = b / link.bandwidth(p)
                if t > best[0]:
                    best = (t, r, p)
        return best

    def seconds(self, link: LinkModel) -> float:
        return self.busiest(link)[0]


@dataclass
class PlannedRanks:
    """What the planner computed for every rank (bytes are wire bytes)."""

    world: int
    batches: int          # agreed over all ranks, as rx.plan does
    sent: list[int]       # to other ranks
    received: list[int]
    copied: list[int]     # same-rank copies
    staging: list[int]    # bytes of staging buffers the GPU transport allocates
    ops: list[int]        # sends + receives + copies before batching
    # Every (sender, receiver) pair: flow_src[i] sends flow_bytes[i] to flow_dst[i].
    flow_src: list[int] = field(default_factory=list)
    flow_dst: list[int] = field(default_factory=list)
    flow_bytes: list[int] = field(default_factory=list)
    # Sends grouped by the boxes they carry: fan_sender[i] sends the same fan_bytes[i]
    # to each of fan_size[i] receivers, listed in order in fan_receivers.
    fan_sender: list[int] = field(default_factory=list)
    fan_bytes: list[int] = field(default_factory=list)
    fan_size: list[int] = field(default_factory=list)
    fan_receivers: list[int] = field(default_factory=list)
    seconds: float = 0.0  # planning time


class Progress:
    """A one-line progress bar on stderr (redrawn in place on a terminal, every 10% otherwise)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.enabled = total, label, enabled and total > 0
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self.last_draw, self.last_tenth = 0.0, -1

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        tenth = 10 * done // self.total
        if self.tty and (now - self.last_draw > 0.1 or done == self.total):
            width = 30
            fill = width * done // self.total
            sys.stderr.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} "
                             f"{now - self.start:.1f} s")
            sys.stderr.flush()
            self.last_draw = now
        elif not self.tty and self.total >= 100 and tenth != self.last_tenth:
            sys.stderr.write(f"{self.label}: {done}/{self.total} ({now - self.start:.1f} s)\n")
            self.last_tenth = tenth

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _staging(batch_bytes: list[tuple[int, int]]) -> int:
    """Staging the GPU transport allocates: the largest batch's send and receive buffers,
    twice when batches pipeline (transports/cuda.py bind)."""
    nbuf = 2 if len(batch_bytes) > 1 else 1
    return nbuf * (max(s for s, _ in batch_bytes) + max(r for _, r in batch_bytes))


def plan_all_ranks(
    src_table: Any,
    dst_table: Any,
    world: int,
    max_batch_bytes: int,
    progress: Callable[[int], None] | None = None,
    seed_ranks: int = 16,
) -> PlannedRanks:
    """Plans every rank with the C++ planner and gathers its numbers.

    The batch count is the maximum any rank wants (as rx.plan agrees on it); a rank's
    staging depends on it, so each rank's staging is computed for the largest count seen
    so far (`seed_ranks` ranks, spread evenly, are planned first to find it) and the few
    ranks planned under a smaller count are planned again at the end.
    """
    t0 = time.perf_counter()
    out = PlannedRanks(world, 1, [0] * world, [0] * world, [0] * world, [0] * world, [0] * world)
    staged_at = [0] * world
    send_digest = recv_digest = 0

    def plan(rank: int) -> Any:
        p = _C.plan_rank(src_table, dst_table, rank, max_batch_bytes)
        p.taper = Options().resolved_batch_taper()
        return p

    k = 1
    for r in sorted({(i * world) // seed_ranks for i in range(seed_ranks)}):  # seed the batch count
        k = max(k, plan(r).wanted_batches())
    for r in range(world):
        p = plan(r)
        k = max(k, p.wanted_batches())
        out.sent[r], out.received[r], out.copied[r] = p.send_total(), p.recv_total(), p.copy_total()
        out.ops[r] = sum(p.num_ops)
        send_digest += p.send_digest
        recv_digest += p.recv_digest
        peers, nbytes = p.send_pairs()
        out.flow_src.extend([r] * len(peers))
        out.flow_dst.extend(peers)
        out.flow_bytes.extend(nbytes)
        sizes, nbytes, receivers = p.fanout()
        out.fan_sender.extend([r] * len(sizes))
        out.fan_size.extend(sizes)
        out.fan_bytes.extend(nbytes)
        out.fan_receivers.extend(receivers)
        out.staging[r], staged_at[r] = _staging(p.batch_bytes(k)), k
        if progress:
            progress(r + 1)
    for r in range(world):
        if staged_at[r] != k:
            out.staging[r] = _staging(plan(r).batch_bytes(k))
    if (send_digest - recv_digest) % 2**64:  # every send has its receive (rx.plan's check)
        raise ReshardError("planner disagreement: the ranks' send and receive digests differ")
    out.batches, out.seconds = k, time.perf_counter() - t0
    return out


def _port_loads(world: int, link: LinkModel, src: torch.Tensor, dst: torch.Tensor, nbytes: torch.Tensor,
                load: torch.Tensor | None = None) -> torch.Tensor:
    """[world, len(PORTS)] bytes of flows src[i] -> dst[i] of nbytes[i], added to `load`."""
    if load is None:
        load = torch.zeros(world, len(PORTS), dtype=torch.float64)
    near = src // link.gpus_per_node == dst // link.gpus_per_node
    for mask, port_out, port_in in ((near, NVL_OUT, NVL_IN), (~near, NET_OUT, NET_IN)):
        load[:, port_out].index_add_(0, src[mask], nbytes[mask])
        load[:, port_in].index_add_(0, dst[mask], nbytes[mask])
    return load


def direct_phases(planned: PlannedRanks, link: LinkModel) -> list[Phase]:
    """Without relays (rx.Options(relay=False)): every pair's bytes in one phase, same-rank
    copies beside them."""
    i64 = torch.int64
    load = _port_loads(planned.world, link, torch.tensor(planned.flow_src, dtype=i64),
                       torch.tensor(planned.flow_dst, dtype=i64), torch.tensor(planned.flow_bytes, dtype=torch.float64))
    load[:, COPY] += torch.tensor(planned.copied, dtype=torch.float64)
    return [Phase("direct", load.tolist())]


def relay_phases(planned: PlannedRanks, link: LinkModel) -> list[Phase]:
    """MODEL of the relay in one stage (rx.Tuning(relay_stages=1)), from the planner's
    fan-out sets rather than the relay plans. For each set of n receivers that get the same
    bytes B from one sender: the sender scatters B over them (B/n each, its egress 1x B),
    then each receiver forwards its part to the n-1 others (an all-gather among them).
    Bytes with one receiver go directly in the first phase, beside the same-rank copies."""
    world, gpn = planned.world, link.gpus_per_node
    n = torch.tensor(planned.fan_size, dtype=torch.int64)
    part = torch.tensor(planned.fan_bytes, dtype=torch.float64) / n.clamp(min=1)
    receiver = torch.tensor(planned.fan_receivers, dtype=torch.int64)
    group = torch.repeat_interleave(torch.arange(len(n)), n)  # the group of each receiver entry
    sender, part_r, n_r = torch.tensor(planned.fan_sender, dtype=torch.int64)[group], part[group], n[group]
    scatter = _port_loads(world, link, sender, receiver, part_r)
    scatter[:, COPY] += torch.tensor(planned.copied, dtype=torch.float64)
    # forward: each receiver sends its part to, and gets a part from, every other member
    # of its group; those on its node over NVLink, the rest over the network
    _, where, count = torch.unique(group * (world // gpn + 1) + receiver // gpn, return_inverse=True,
                                   return_counts=True)
    near = (count[where] - 1).to(torch.float64)
    far = (n_r - 1).to(torch.float64) - near
    forward = torch.zeros(world, len(PORTS), dtype=torch.float64)
    for port_out, port_in, peers in ((NVL_OUT, NVL_IN, near), (NET_OUT, NET_IN, far)):
        forward[:, port_out].index_add_(0, receiver, part_r * peers)
        forward[:, port_in].index_add_(0, receiver, part_r * peers)
    return [Phase("scatter", scatter.tolist()), Phase("forward", forward.tolist())]


def pipelined_phases(relay: list[Phase], stages: int) -> list[Phase]:
    """The relay as rx.plan runs it in `stages` groups (rx.Tuning.relay_stages): stage 0
    scatters group 0, stages 1..G-1 each scatter one group while the replicas forward the
    previous one, stage G forwards the last; groups of equal bytes assumed."""
    (scatter, forward), g = (torch.tensor(ph.load) for ph in relay), max(1, stages)
    return [Phase("scatter 1/G", (scatter / g).tolist()),
            Phase(f"{g - 1} x (scatter + forward) 1/G", ((scatter + forward) * (g - 1) / g).tolist()),
            Phase("forward 1/G", (forward / g).tolist())]


@dataclass(frozen=True)
class Reference:
    """A published measurement of a refit this simulator can reproduce."""

    label: str
    model: str
    src: Parallel
    dst: Parallel
    gpus_per_node: int
    seconds: tuple[float, float]


REFERENCES = (
    Reference(
        "NeMo-RL reshard refit, DeepSeek-V3 on H100, PP16·EP16 -> TP32·DP8 (measured)",
        "deepseek-v3", Parallel(tp=1, pp=16, dp=16, ep=16), Parallel(tp=32, dp=8, ep=32), 8, (2.39, 2.83),
    ),
)


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _phase_report(phases: list[Phase], link: LinkModel) -> dict[str, Any]:
    out = []
    for ph in phases:
        t, rank, port = ph.busiest(link)
        out.append({"name": ph.name, "seconds": t,
                    "busiest": {"rank": rank, "port": PORTS[port] if port >= 0 else None,
                                "bytes": ph.load[rank][port] if rank >= 0 else 0}})
    return {"seconds": sum(p["seconds"] for p in out), "phases": out}


def _busiest_ports(phase: Phase, link: LinkModel, top: int) -> list[dict[str, Any]]:
    ports = [(b / link.bandwidth(p), r, p, b) for r, row in enumerate(phase.load) for p, b in enumerate(row) if b]
    ports.sort(reverse=True)
    return [{"rank": r, "node": link.node(r), "port": PORTS[p], "bytes": b, "seconds": t} for t, r, p, b in ports[:top]]


def simulate(
    shape: ModelShape,
    src: Parallel,
    dst: Parallel,
    link: LinkModel = LinkModel(),
    dtype: torch.dtype = torch.bfloat16,
    max_batch_bytes: int = DEFAULT_BATCH_MB << 20,
    model_name: str = "model",
    top: int = 5,
    progress: bool = False,
    keep_phases: bool = False,
    relay_stages: int = 0,
) -> dict[str, Any]:
    """Plans every rank of the refit src -> dst of `shape` and returns the report (what
    --json prints). keep_phases: also return the Phase objects under "_phases".
    relay_stages: the pipelined relay's stages (0: as rx.plan picks them, relay.auto_stages)."""
    world = max(src.offset + src.world, dst.offset + dst.world)
    t0 = time.perf_counter()
    src_l, dst_l = model_layouts(shape, src, dtype), model_layouts(shape, dst, dtype)
    src_t = _C.LayoutTable([(n, lay._c) for n, lay in src_l.items()])
    dst_t = _C.LayoutTable([(n, lay._c) for n, lay in dst_l.items()])
    errors = _C.check_tables(src_t, dst_t, world)
    if errors:
        raise ReshardError("the layouts of these specs are not valid:\n  " + "\n  ".join(errors[:10]))
    elem = torch.empty((), dtype=dtype).element_size()
    numel = sum(math.prod(lay.shape) for lay in src_l.values())
    nbytes = sum(math.prod(lay.shape) * torch.empty((), dtype=lay.dtype).element_size() for lay in src_l.values())
    build_s = time.perf_counter() - t0

    bar = Progress(world, "planning ranks", progress)
    try:
        planned = plan_all_ranks(src_t, dst_t, world, max_batch_bytes, bar.update)
    finally:
        bar.close()
    direct, relay = direct_phases(planned, link), relay_phases(planned, link)
    from .relay import auto_stages

    stages = relay_stages or auto_stages(int(max(planned.received, default=0)), max_batch_bytes)
    pipelined = pipelined_phases(relay, stages)
    moe = bool(shape.experts)
    report: dict[str, Any] = {
        "model": {"name": model_name, "parameters": numel, "bytes": nbytes, "tensors": len(src_l),
                  "dtype": str(dtype).replace("torch.", ""), "element_bytes": elem},
        "src": {"spec": describe_parallel(src, moe), **asdict(src)},
        "dst": {"spec": describe_parallel(dst, moe), **asdict(dst)},
        "world": world,
        "collocated": src.offset == dst.offset,
        "link_model": asdict(link),
        "planning": {"ranks": world, "seconds": planned.seconds, "layouts_seconds": build_s,
                     "batches": planned.batches, "max_batch_bytes": max_batch_bytes},
        "totals": {"sent": sum(planned.sent), "received": sum(planned.received), "copied": sum(planned.copied)},
        "per_rank": {
            "sent": _spread(planned.sent), "received": _spread(planned.received),
            "copied": _spread(planned.copied), "staging": _spread(planned.staging), "ops": _spread(planned.ops),
            **{port: _spread([row[i] for row in direct[0].load]) for i, port in enumerate(PORTS)},
        },
        "busiest_ports": _busiest_ports(direct[0], link, top),
        "prediction": {
            "without_relays": _phase_report(direct, link),
            "with_relays": {**_phase_report(relay, link), "modelled": True,
                            "note": "one stage: scatter to the receivers, then forward among them"},
            "with_relays_pipelined": {**_phase_report(pipelined, link), "modelled": True, "stages": stages,
                                      "auto": not relay_stages,
                                      "note": "the same bytes in G stages: each scatters one group while the "
                                              "replicas forward the previous one"},
        },
        "ranks": {"sent": planned.sent, "received": planned.received, "copied": planned.copied,
                  "staging": planned.staging},
    }
    for key in ("with_relays", "with_relays_pipelined"):
        relayed = report["prediction"][key]
        relayed["faster"] = relayed["seconds"] < report["prediction"]["without_relays"]["seconds"]
    for ref in REFERENCES:
        if (ref.model == model_name and ref.src == src and ref.dst == dst
                and ref.gpus_per_node == link.gpus_per_node):
            report["reference"] = {"label": ref.label, "seconds": list(ref.seconds)}
    if keep_phases:
        report["_phases"] = {"without_relays": direct, "with_relays": relay}
    return report


SCHEDULES = (  # (report key, label): the three schedules the report predicts
    ("without_relays", "without relays (relay=False)"),
    ("with_relays", "with relays in one stage (relay_stages=1)"),
    ("with_relays_pipelined", "with relays in G stages"),
)


def _schedule_label(rep: dict[str, Any], key: str) -> str:
    """The words for one schedule; the pipelined one names its stage count and says whether
    it is what rx.plan picks by itself."""
    if key != "with_relays_pipelined":
        return dict(SCHEDULES)[key]
    p = rep["prediction"][key]
    return f"with relays in {p['stages']} stages" + (" (as rx.plan stages them)" if p.get("auto", True) else "")


def _gb(x: float) -> str:
    return f"{x / GB:,.2f} GB"


def format_report(rep: dict[str, Any]) -> str:
    """The human-readable table."""
    m, pr, link = rep["model"], rep["per_rank"], rep["link_model"]
    planning = rep["planning"]
    placement = "collocated" if rep["collocated"] else "separate GPUs"
    lines = [
        f"model    {m['name']}: {m['parameters'] / 1e9:,.1f} B parameters, {_gb(m['bytes'])} in {m['dtype']}, "
        + f"{m['tensors']:,} tensors",
        f"source   {rep['src']['spec']}",
        f"dest.    {rep['dst']['spec']}  ({placement}, {rep['world']} ranks)",
        f"links    {link['gpus_per_node']} GPUs per node; per GPU and direction: NVLink {link['nvlink_gbps']:g} GB/s, "
        + f"network {link['network_gbps']:g} GB/s; same-rank copies {link['copy_gbps']:g} GB/s",
        f"planning {planning['ranks']} ranks in {planning['seconds']:.1f} s (+{planning['layouts_seconds']:.1f} s "
        + f"layouts); {planning['batches']} batches of <= {planning['max_batch_bytes'] / 2**20:g} MiB",
        "",
        f"{'per rank':18} {'min':>12} {'median':>12} {'max':>12}",
    ]
    rows = [("sent", "sent"), ("received", "received"), ("copied (same rank)", "copied"),
            ("  NVLink out", "nvlink_out"), ("  NVLink in", "nvlink_in"), ("  network out", "network_out"),
            ("  network in", "network_in"), ("staging memory", "staging")]
    for label, key in rows:
        s = pr[key]
        lines.append(f"{label:18} {_gb(s['min']):>12} {_gb(s['median']):>12} {_gb(s['max']):>12}")
    ops = pr["ops"]
    lines.append(f"{'ops (boxes)':18} {ops['min']:>12,} {ops['median']:>12,.0f} {ops['max']:>12,}")
    lines += ["", "busiest ports (without relays)"]
    for b in rep["busiest_ports"]:
        lines.append(f"  rank {b['rank']:>6} (node {b['node']:>4}) {b['port']:12} {_gb(b['bytes']):>12} "
                     f"{b['seconds']:8.3f} s")
    lines += ["", "predicted transfer time (links only: no latency, kernels or HBM contention; "
              "relays modelled from the planner's fan-out)"]
    for key, _ in SCHEDULES:
        p, label = rep["prediction"][key], _schedule_label(rep, key)
        parts = ", ".join(f"{ph['name']} {ph['seconds']:.3f} s" +
                          (f" (rank {ph['busiest']['rank']} {ph['busiest']['port']})" if ph["seconds"] else "")
                          for ph in p["phases"])
        lines.append(f"  {label:48} {p['seconds']:8.3f} s   [{parts}]")
        if key != "without_relays" and not p["faster"]:
            lines.append(f"  {'':48} (not faster here: rx.plan would not relay these tensors)")
    if "reference" in rep:
        ref = rep["reference"]
        lines.append(f"  {'published: ' + ref['label']:48}\n"
                     f"  {'':48} {ref['seconds'][0]:.2f}-{ref['seconds'][1]:.2f} s")
    return "\n".join(lines)


def plot_paths(path: str) -> tuple[str, str]:
    """The two PNGs of `--plot PATH`: PATH (predicted time per schedule and phase) and
    PATH's stem + "-ports.png" (bytes per rank and port)."""
    stem = path[:-4] if path.lower().endswith(".png") else path
    return path, stem + "-ports.png"


def plot(rep: dict[str, Any], path: str) -> tuple[str, str]:
    """Two PNGs, one question each (plot_paths): how long each schedule takes and which phase
    costs what; how the bytes spread over the ranks' ports. Returns their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReshardError("--plot needs matplotlib: pip install matplotlib") from None
    time_png, ports_png = plot_paths(path)
    link = LinkModel(**rep["link_model"])
    title = f"{rep['model']['name']}: {rep['src']['spec']} -> {rep['dst']['spec']}"

    # 1. How long does the refit take? One bar per schedule, one segment per phase, a
    # colour per kind of phase (the staged relay's phases carry their group, "1/G").
    kinds = {"direct": "pull from the sources", "scatter": "scatter (sources to receivers)",
             "forward": "forward (among receivers)", "both": "scatter + forward at once"}
    colors = dict(zip(kinds, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    fig, ax = plt.subplots(figsize=(10, 3.8), constrained_layout=True)
    labels, shown = [], set()
    for i, (key, _) in enumerate(SCHEDULES):
        pred, left = rep["prediction"][key], 0.0
        for ph in pred["phases"]:
            name = ph["name"]
            kind = ("both" if "scatter" in name and "forward" in name else
                    "scatter" if "scatter" in name else "forward" if "forward" in name else "direct")
            if ph["seconds"] > 0:
                ax.barh(i, ph["seconds"], left=left, color=colors[kind], edgecolor="white",
                        label=None if kind in shown else kinds[kind])
                shown.add(kind)
            left += ph["seconds"]
        ax.annotate(f"{pred['seconds']:.3f} s", (left, i), xytext=(4, 0), textcoords="offset points", va="center")
        labels.append(_schedule_label(rep, key))
    if "reference" in rep:
        lo, hi = rep["reference"]["seconds"]
        ax.axvspan(lo, hi, color="grey", alpha=0.25, label=f"published: {rep['reference']['label']}")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()  # the table's order, top to bottom
    ax.set_xlim(0, ax.get_xlim()[1] * 1.12)  # room for the totals
    ax.set_xlabel(f"predicted seconds (links only; per GPU and direction: NVLink {link.nvlink_gbps:g} GB/s, "
                  f"network {link.network_gbps:g} GB/s)")
    ax.set_title(f"{title}\npredicted transfer time per phase", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=3, fontsize=8, frameon=False)
    fig.savefig(time_png, dpi=110)
    plt.close(fig)

    # 2. Where do the bytes go? Bytes per rank and port, without relays and with them
    # (the staged relay moves the same bytes as the one-stage one).
    from matplotlib.ticker import MaxNLocator

    phases = rep["_phases"]
    world = rep["world"]
    styles = ("-", "--", ":", "-.", (0, (5, 1, 1, 1)))  # ports that carry equal bytes stay apart
    fig, axes = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, sharey=True, constrained_layout=True)
    top = 0.0
    for ax, key in zip(axes, ("without_relays", "with_relays")):
        for p, port in enumerate(PORTS):
            series = [sum(ph.load[r][p] for ph in phases[key]) / GB for r in range(world)]
            if any(series):
                ax.plot(range(world), series, drawstyle="steps-mid", ls=styles[p], lw=1.2,
                        marker="o" if world <= 64 else None, ms=3, label=port.replace("_", " "))
                top = max(top, *series)
        ax.set_title("without relays (relay=False)" if key == "without_relays"
                     else "with relays (the default; modelled)", fontsize=10)
        ax.set_ylabel("GB")
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")  # no "+8.03" offset
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylim(0, top * 1.1 or 1.0)  # from zero, so equal loads look equal
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel("rank")
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.suptitle(f"{title}\nbytes per rank and port", fontsize=10)
    fig.savefig(ports_png, dpi=110)
    plt.close(fig)
    return time_png, ports_png


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only where there is a value to show and the help has not
    already said what the default is (a flag's False, an option the preset decides)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action) or text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `simulate` (the lead's CLI adds them to its subcommand)."""
    parser.description = (
        "Plan a refit with the real planner for every rank (no GPUs, no process group) and predict its "
        "transfer time from a link model."
    )
    parser.epilog = (
        "Model: each GPU has an NVLink port (peers on its node) and a network port (other nodes), each "
        "with a bandwidth per direction, and copies same-rank bytes at --copy-gbps. A phase lasts as long as "
        "its busiest port (bytes / bandwidth); the refit lasts the sum of its phases. Latency, pack/unpack "
        "kernels and HBM contention are not modelled. 'Without relays' is rx.Options(relay=False) (each "
        "receiver pulls from a source rank); 'with relays' models rx.plan's relay fan-out, on by default: "
        "bytes several receivers need from one sender are scattered over them, then forwarded among them "
        "(in one stage, and pipelined in --relay-stages stages as rx.plan runs it). Parallel specs: "
        "tp, pp, dp, ep (Megatron rank order: tp fastest, then dp, then pp); dp defaults to --gpus/(tp*pp); "
        "for MoE models ep defaults to tp (each replica spreads its experts over its TP ranks). "
        f"Presets: {', '.join(PRESETS)}."
    )
    parser.formatter_class = _HelpFormatter
    parser.add_argument("--model", default="deepseek-v3",
                        help="a preset name or a Hugging Face config.json (file or folder)")
    parser.add_argument("--src", help="source (training) spec, e.g. tp=1,pp=16,ep=16 (default: the preset's)")
    parser.add_argument("--dst", help="destination (inference) spec, e.g. tp=32,dp=8 (default: the preset's)")
    parser.add_argument("--gpus", type=count(1),
                        help="GPUs per side, fixing dp where a spec omits it (default: the preset's, else 8)")
    parser.add_argument("--separate", action="store_true",
                        help="destination on its own GPUs after the source's (default: collocated on the same GPUs)")
    parser.add_argument("--gpus-per-node", type=count(1), default=LinkModel.gpus_per_node,
                        help="GPUs sharing an NVLink domain")
    parser.add_argument("--nvlink-gbps", type=positive_number, default=LinkModel.nvlink_gbps,
                        help="NVLink GB/s per GPU and direction (H100/H200 NV18, measured)")
    parser.add_argument("--network-gbps", type=positive_number, default=LinkModel.network_gbps,
                        help="network GB/s per GPU and direction (50 = one 400 Gb/s NIC per GPU)")
    parser.add_argument("--copy-gbps", type=positive_number, default=LinkModel.copy_gbps,
                        help="same-rank copy GB/s per GPU (bytes copied; H100 measured; H200 ~2100)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="weight dtype on both sides")
    parser.add_argument("--batch-mb", type=count(0), default=DEFAULT_BATCH_MB,
                        help="max_batch_bytes in MiB, as rx.plan gets it (512: its GPU default; 0: one batch)")
    parser.add_argument("--relay-stages", type=count(0), default=0,
                        help="stages of the pipelined relay prediction (rx.Tuning.relay_stages; 0: as rx.plan picks)")
    parser.add_argument("--top", type=count(0), default=5, help="how many of the busiest ports to list")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    parser.add_argument("--plot", metavar="PNG",
                        help="write the predicted time per phase to this PNG, and the bytes per rank and port to "
                             "PNG's name + '-ports.png'")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    """Runs `simulate` for parsed arguments; returns the exit code."""
    try:
        name, shape, preset = load_model(args.model)
        src_spec = parse_spec(args.src if args.src is not None else (preset.src if preset else "tp=1"))
        dst_spec = parse_spec(args.dst if args.dst is not None else (preset.dst if preset else "tp=1"))
        gpus = args.gpus if args.gpus is not None else (preset.gpus if preset else 8)
        if gpus < 1 or args.gpus_per_node < 1:
            raise ReshardError("--gpus and --gpus-per-node must be >= 1")
        src = make_parallel(src_spec, shape, gpus, 0, "--src")
        dst = make_parallel(dst_spec, shape, gpus, src.world if args.separate else 0, "--dst")
        link = LinkModel(args.gpus_per_node, args.nvlink_gbps, args.network_gbps, args.copy_gbps)
        if min(link.nvlink_gbps, link.network_gbps, link.copy_gbps) <= 0:
            raise ReshardError("bandwidths must be > 0")
        if args.relay_stages < 0:
            raise ReshardError("--relay-stages must be >= 0")
        torch.set_num_threads(1)
        rep = simulate(shape, src, dst, link, _DTYPES[args.dtype], args.batch_mb << 20, name, args.top,
                       progress=not args.no_progress, keep_phases=bool(args.plot), relay_stages=args.relay_stages)
        pngs = plot(rep, args.plot) if args.plot else ()
        rep.pop("_phases", None)
    except ReshardError as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rep, indent=1) if args.json else format_report(rep))
    if pngs and not args.json:
        print(f"\nplots written to {' and '.join(pngs)}")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m reshard_ext.simulate")
    add_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
