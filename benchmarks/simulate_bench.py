"""`simulate` on every preset at 2,048 ranks (issue 16: under a minute each on the CI
machine, PNG written), on one core. Each preset runs in its own process, the way a user
runs the CLI, with its default specs and DP filling 2,048 GPUs.

    python benchmarks/simulate_bench.py [--gpus 2048] [--presets deepseek-v3,kimi-k2] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from reshard_ext.model_config import PRESETS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2048, help="GPUs per side (collocated: the world size)")
    ap.add_argument("--presets", default=",".join(PRESETS), help="comma-separated preset names")
    ap.add_argument("--out", help="folder for the PNGs (default: a temporary one)")
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="simulate_bench_")
    os.makedirs(out, exist_ok=True)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, children too
    print(f"{'preset':16} {'ranks':>6} {'wall s':>7} {'cpu s':>6} {'plan s':>7} {'peak MB':>8} "
          f"{'no relays s':>11} {'relays s':>9}  png")
    for name in args.presets.split(","):
        png = os.path.join(out, f"{name}.png")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "reshard_ext.simulate", "--model", name, "--gpus", str(args.gpus),
                              "--json", "--no-progress", "--plot", png], check=True, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        rep = json.loads(res.stdout)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        pred = rep["prediction"]
        print(f"{name:16} {rep['world']:6d} {wall:7.1f} {cpu:6.1f} {rep['planning']['seconds']:7.1f} "
              f"{after.ru_maxrss / 1024:8.0f} {pred['without_relays']['seconds']:11.3f} "
              f"{pred['with_relays']['seconds']:9.3f}  {os.path.getsize(png) > 0 and png}")


if __name__ == "__main__":
    main()
