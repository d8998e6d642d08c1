"""The simulator's prediction against refits measured on 2 and 4 GPUs (refit_bench.py).

For each refit_bench case it predicts the refit time with `simulate` (the real plan, the
link model) and prints it beside the time measured on the GPU machine (RESULTS.md,
2x and 4x H200, NVLink NV18 - the same link as H100's). The link model for these cards:
NVLink 360 GB/s per direction (FACTS: NCCL 364, copy engines 391 on H100; the H200 runs'
NCCL ceilings imply 362-370) and same-rank copies at 2,130 GB/s (the D2D ceiling measured
in the same runs: 8.03 GB in 3.77 ms).

    python benchmarks/simulate_validate.py [--measured FILE.json]

--measured: a JSON object {"case@gpus": [low_ms, high_ms]} replacing the built-in
measurements (e.g. after a new GPU run).
"""
from __future__ import annotations

import argparse
import json

from refit_bench import _cases

from reshard_ext.simulate import LinkModel, simulate
from reshard_ext.synthetic import LLAMA3_8B, Parallel

H200 = LinkModel(gpus_per_node=8, nvlink_gbps=360.0, network_gbps=50.0, copy_gbps=2130.0)

# case@gpus -> (refit ms low, high, where it was measured: RESULTS.md runs, 2026-11-26)
MEASURED = {
    "tp2-tp1@2": (23.06, 23.11, "2x H200, .device/4 (cap by default)"),
    "moe-ep2-ep1@2": (21.89, 21.90, "2x H200, .device/4"),
    "noncolo-tp1-tp1@2": (47.26, 47.26, "2x H200, .device/4"),
    "tp1-tp2@2": (4.04, 4.06, "2x H200, .device/5"),
    "tp2-tp1@4": (23.40, 23.47, "4x H200, .device/7 (final code)"),
    "moe-ep2-ep1@4": (21.53, 21.64, "4x H200, .device/7"),
    "noncolo-tp2-tp2dp@4": (23.30, 23.38, "4x H200, .device/7"),
    "tp1-tp2@4": (4.03, 4.05, "4x H200, .device/7"),
}
# refit_bench --case relay-1to3 (rank 0 -> three TP1 replicas on ranks 1-3): not measured yet
RELAY_1TO3 = (LLAMA3_8B, Parallel(tp=1), Parallel(tp=1, dp=3, offset=1), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measured", help="JSON {case@gpus: [low_ms, high_ms]} to compare with instead")
    args = ap.parse_args()
    measured = MEASURED
    if args.measured:
        with open(args.measured) as f:
            measured = {k: (lo, hi, "") for k, (lo, hi) in json.load(f).items()}
    print(f"{'case':22} {'GPUs':>4} {'predicted ms':>12} {'relays ms':>9} {'measured ms':>13} {'measured/predicted':>18}"
          f"  bound by")
    rows = []
    for key in measured:
        name, gpus = key.split("@")[0], int(key.split("@")[1])
        if name in _cases(gpus):
            rows.append((name, gpus, *_cases(gpus)[name][:3]))
    rows.append(("relay-1to3", 4, *RELAY_1TO3[:3]))
    for name, gpus, model, src, dst in rows:
        rep = simulate(model, src, dst, H200, model_name=name)
        direct, relay = rep["prediction"]["without_relays"], rep["prediction"]["with_relays"]
        busiest = direct["phases"][0]["busiest"]
        lo, hi, _ = measured.get(f"{name}@{gpus}", (0.0, 0.0, ""))
        ratio = f"{lo / direct['seconds'] / 1e3:.2f}-{hi / direct['seconds'] / 1e3:.2f}" if lo else "-"
        shown = f"{lo:.2f}-{hi:.2f}" if lo else "not yet"
        print(f"{name:22} {gpus:4d} {1e3 * direct['seconds']:12.2f} {1e3 * relay['seconds']:9.2f} {shown:>13} "
              f"{ratio:>18}  rank {busiest['rank']} {busiest['port']}")


if __name__ == "__main__":
    main()
