#!/usr/bin/env bash
# ncu over the quantizing lanes of one format (formats_kernel_bench's rows): where a lane's
# time goes (throughput, occupancy, warp stalls). One GPU; needs a CUDA build (gpu_check.sh build).
#   scripts/ncu_lanes.sh [format] [kernel regex] [launches]
set -uo pipefail
cd "$(dirname "$0")/.."
fmt="${1:-nvfp4}" kern="${2:-copy_boxes|amax|quantize}" count="${3:-12}"
export PYTHONPATH="$PWD"
timeout 400 ncu --target-processes all -k "regex:$kern" -c "$count" \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  python3 benchmarks/formats_kernel_bench.py --formats "$fmt" --iters 1 2>&1
