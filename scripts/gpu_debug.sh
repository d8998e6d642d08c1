#!/usr/bin/env bash
# Crash hunt on the GPU machine: the same kernel test built with static and shared
# cudart, link facts, and a 2-GPU refit with faulthandler.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/rx_out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD"
for cudart in static shared; do
  echo "== cudart $cudart"
  RX_BUILD_SUFFIX=-$cudart RX_CMAKE_ARGS="-DRESHARD_EXT_CUDART=$cudart" scripts/dev_build.sh ON > "$OUT/build-$cudart.log" 2>&1 \
    || { tail -20 "$OUT/build-$cudart.log"; continue; }
  so=$(ls reshard_ext/_C*.so)
  ldd "$so" | grep -E "stdc|cudart|nccl"
  echo "exported std:: symbols: $(nm -D -C --defined-only "$so" | grep -c 'std::')"
  nm -D -C --defined-only "$so" | grep -E "codecvt|_M_insert|locale" | head -5
  (cd tests && timeout 120 python3 -X faulthandler -m pytest -q -p no:warnings test_cuda_kernels.py -k "bad_tables" 2>&1 | tail -3)
  timeout 60 python3 -c "
import torch, reshard_ext as rx
from reshard_ext import *
try:
    rx.local_plan({'w': Layout((8,4), torch.float32, Mesh([0,1]), [Shard(0, stride=3)])}, {'w': Layout((8,4), torch.float32, Mesh([0]), [Replicate()])}, 0)
except rx.ReshardError as e: print('format ok:', str(e)[:60])
" 2>&1 | tail -2
done
echo "== noncolo refit with the shared build"
timeout 150 torchrun --standalone --nproc-per-node 2 benchmarks/refit_bench.py --case noncolo-tp1-tp1 --iters 3 2>&1 | grep -v "^W\|^\[W" | tail -12
