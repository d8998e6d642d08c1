#!/usr/bin/env bash
# Backtraces of crashes on the GPU machine (cuda-gdb debugs host code too).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/rx_out}"; mkdir -p "$OUT"
scripts/dev_build.sh ON > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH="$PWD"
gcc --version | head -1; python3 -c "import pybind11; print('pybind11', pybind11.__version__)"
echo "== bad tables under cuda-gdb"
(cd tests && timeout 120 cuda-gdb -q -batch -ex run -ex bt --args python3 -m pytest -q -p no:warnings -x test_cuda_kernels.py -k bad_tables 2>&1 | grep -v "^\[New Thread\|^\[Thread\|Detaching\|^warning" | tail -40)
echo "== noncolo refit, rank 0 under cuda-gdb"
export MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 WORLD_SIZE=2
(RANK=1 LOCAL_RANK=1 timeout 150 python3 -X faulthandler benchmarks/refit_bench.py --case noncolo-tp1-tp1 --no-baseline --iters 1 > "$OUT/rank1.log" 2>&1 &)
RANK=0 LOCAL_RANK=0 timeout 150 cuda-gdb -q -batch -ex run -ex bt --args python3 benchmarks/refit_bench.py --case noncolo-tp1-tp1 --no-baseline --iters 1 2>&1 \
  | grep -v "^\[New Thread\|^\[Thread\|Detaching\|^warning" | tail -45
sleep 2; echo "== rank 1 log"; tail -25 "$OUT/rank1.log"
