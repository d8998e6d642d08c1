"""The simulator's prediction against refits measured on 2 and 4 GPUs (refit_bench.py).

For each refit_bench case it predicts the refit time with `simulate` (the real plan, the
link model of the card) and prints it beside the times measured on the GPU machines
(benchmarks/RESULTS.md, 2026-11-26). Link models, per GPU and direction:

- H100 (the current RESULTS tables): NVLink 360 GB/s (FACTS: NCCL 364, copy engines
  391), same-rank copies 1,500 GB/s (the D2D ceiling of the same runs: 8.03 GB in
  5.32-5.36 ms); measured with the NCCL and the direct backend;
- H200 (the previous session, NCCL only): NVLink 360 GB/s (its NCCL ceilings imply
  362-370), copies 2,130 GB/s (D2D: 8.03 GB in 3.77 ms).

    python benchmarks/simulate_validate.py [--measured FILE.json]

--measured: a JSON list of [case, gpus, card, backend, low_ms, high_ms] rows replacing
the built-in ones (card "H100" or "H200"), e.g. after a new GPU run.
"""
from __future__ import annotations

import argparse
import json

from refit_bench import _cases

from reshard_ext.simulate import LinkModel, simulate
from reshard_ext.synthetic import LLAMA3_8B, Parallel

CARDS = {
    "H100": LinkModel(gpus_per_node=8, nvlink_gbps=360.0, copy_gbps=1500.0),
    "H200": LinkModel(gpus_per_node=8, nvlink_gbps=360.0, copy_gbps=2130.0),
}
# refit_bench --case relay-1to3: rank 0 -> three TP1 replicas on ranks 1-3
RELAY_1TO3 = (LLAMA3_8B, Parallel(tp=1), Parallel(tp=1, dp=3, offset=1))

# (case, GPUs, card, backend, refit ms low, high): RESULTS.md, 2026-11-26. H100: 4x H100
# host (2-GPU rows on its GPUs 0-1), `gpu_check.sh direct` and `relay`; H200: the
# previous session's `.device/4`-`5` (2 GPUs) and `.device/7` (4 GPUs). "relay off",
# "relay on" (one stage) and "relay staged" (the default, auto stages) are the relay-1to3
# case's plans (the replicas, 2026-11-26 23:50 UTC).
MEASURED = [
    ("tp2-tp1", 2, "H100", "nccl", 26.56, 26.71), ("tp2-tp1", 2, "H100", "direct", 23.49, 23.64),
    ("tp2-tp1", 4, "H100", "nccl", 26.78, 26.87), ("tp2-tp1", 4, "H100", "direct", 23.53, 23.60),
    ("moe-ep2-ep1", 2, "H100", "nccl", 24.08, 24.19), ("moe-ep2-ep1", 2, "H100", "direct", 26.41, 26.51),
    ("noncolo-tp1-tp1", 2, "H100", "nccl", 45.48, 45.57), ("noncolo-tp1-tp1", 2, "H100", "direct", 41.34, 41.42),
    ("noncolo-tp2-tp2dp", 4, "H100", "nccl", 23.85, 23.91), ("noncolo-tp2-tp2dp", 4, "H100", "direct", 21.17, 21.20),
    ("tp1-tp2", 2, "H100", "nccl", 5.63, 5.67), ("tp1-tp2", 2, "H100", "direct", 5.63, 5.66),
    ("relay-1to3", 4, "H100", "relay off", 139.15, 139.26), ("relay-1to3", 4, "H100", "relay on", 88.81, 89.12),
    ("relay-1to3", 4, "H100", "relay staged", 64.01, 64.05),
    ("tp2-tp1", 2, "H200", "nccl", 23.06, 23.11), ("moe-ep2-ep1", 2, "H200", "nccl", 21.89, 21.90),
    ("noncolo-tp1-tp1", 2, "H200", "nccl", 47.26, 47.26), ("tp1-tp2", 2, "H200", "nccl", 4.04, 4.06),
    ("tp2-tp1", 4, "H200", "nccl", 23.40, 23.47), ("moe-ep2-ep1", 4, "H200", "nccl", 21.53, 21.64),
    ("noncolo-tp2-tp2dp", 4, "H200", "nccl", 23.30, 23.38), ("tp1-tp2", 4, "H200", "nccl", 4.03, 4.05),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measured", help="JSON list of [case, gpus, card, backend, low_ms, high_ms] rows")
    args = ap.parse_args()
    rows = MEASURED
    if args.measured:
        with open(args.measured) as f:
            rows = [tuple(r) for r in json.load(f)]
    print(f"{'case':18} {'GPUs':>4} {'card':5} {'measured with':14} {'predicted ms':>12} {'measured ms':>13} "
          f"{'measured/predicted':>18}  bound by")
    cache: dict = {}
    for name, gpus, card, backend, lo, hi in rows:
        if (name, gpus, card) not in cache:
            model, src, dst = RELAY_1TO3 if name == "relay-1to3" else _cases(gpus)[name][:3]
            cache[(name, gpus, card)] = simulate(model, src, dst, CARDS[card], model_name=name)
        pred = cache[(name, gpus, card)]["prediction"]
        schedule = pred[{"relay on": "with_relays", "relay staged": "with_relays_pipelined"}.get(backend,
                                                                                                 "without_relays")]
        t = 1e3 * schedule["seconds"]
        bound = schedule["phases"][0]["busiest"]
        print(f"{name:18} {gpus:4d} {card:5} {backend:14} {t:12.2f} {f'{lo:.2f}-{hi:.2f}':>13} "
              f"{f'{lo / t:.2f}-{hi / t:.2f}':>18}  rank {bound['rank']} {bound['port']}")


if __name__ == "__main__":
    main()
