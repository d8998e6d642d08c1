#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests (+ compute-sanitizer on the kernels),
# benchmarks. Logs go to $OUT (the device tool brings them back).
#   scripts/gpu_check.sh [build] [tests] [tests4] [sanitize] [bench] [pack] [bench4] [bench-big] [mx] [trace] [exp] [exp4] [next] [megatron] [direct] [relay] [verify]
#   (default: build tests sanitize bench mx). `direct` builds nothing: the direct transport's
#   tests (2 and 4 GPUs), compute-sanitizer over one 2-GPU case, and refit_bench nccl vs direct. `megatron` needs megatron-core wheels carried
#   in .whl/ (see benchmarks/RESULTS.md); it installs them into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/rx_out}"
mkdir -p "$OUT"
stages="${*:-build tests sanitize bench mx}"
has() { [[ " $stages " == *" $1 "* ]]; }
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
step() { echo; echo "== $* ($(date +%T))"; }

step "machine"
nvidia-smi -L
nvidia-smi topo -m 2>/dev/null | head -8
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"

if has build; then
  step "build (CUDA on, sm_90)"
  rm -rf build/dev-on  # a fresh configure: cached toolchain state has bitten before
  if ! RX_CMAKE_ARGS="-DCMAKE_MODULE_LINKER_FLAGS=-Wl,-Map=$OUT/link.map" scripts/dev_build.sh ON > "$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"; exit 1
  fi
  echo "archives that supplied code to _C:"; grep -oE "[^ (]+\.a\([^)]+\)" "$OUT/link.map" | sed 's/(.*//' | sort | uniq -c | sort -rn | head -8
  ninja -C build/dev-on -t commands _C | tail -1 | tr ' ' '\n' | grep -E "cudart|cudadevrt|stdc" | tr '\n' ' '; echo
  PYTHONPATH=. python3 -m reshard_ext info
  echo "std:: symbols exported by _C (0-30 expected; thousands = a static libstdc++ copy): $(nm -D -C --defined-only reshard_ext/_C*.so | grep -c 'std::')"
  ldd reshard_ext/_C*.so | grep -E "cudart|nccl|stdc"
fi
export PYTHONPATH="$PWD"

if has tests; then
  step "GPU tests"
  (cd tests && timeout 520 python3 -m pytest -q -p no:warnings -rs --durations=15 \
      test_cuda_kernels.py test_nccl_comm.py test_nccl_lib.py test_refit_gpu.py test_mxfp8_kernels.py test_mxfp8_boxes.py test_mxfp8_refit.py \
      test_verify.py test_relay.py test_direct.py test_package.py -k "not mypy" \
      2>&1 | tee "$OUT/tests.log" | tail -25)
fi

if has tests4 && [ "$ngpu" -ge 4 ]; then
  step "GPU refit tests (the 4-GPU matrix)"
  (cd tests && timeout 300 python3 -m pytest -q -p no:warnings test_refit_gpu.py 2>&1 | tee "$OUT/tests4.log" | tail -3)
fi

if has sanitize; then
  step "compute-sanitizer memcheck: kernel tests"
  (cd tests && timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
      python3 -m pytest -q -p no:warnings -x test_cuda_kernels.py test_mxfp8_boxes.py -k "not big and not cpu and not emulated" \
      2>&1 | tee "$OUT/sanitizer.log" | tail -8)
fi

if has bench; then
  step "pack/unpack kernel benchmark"
  timeout 240 python3 benchmarks/pack_bench.py 2>&1 | tee "$OUT/pack_bench.log" | tail -30
  if [ "$ngpu" -ge 2 ]; then
    for c in tp2-tp1 tp1-tp2 noncolo-tp1-tp1 moe-ep2-ep1; do
      step "refit_bench $c"
      timeout 240 torchrun --standalone --nproc-per-node 2 benchmarks/refit_bench.py --case "$c" 2>&1 \
        | grep -v "^W\|^\[W" | tee -a "$OUT/refit_bench.log" | tail -8
    done
    if [ "$ngpu" -ge 4 ]; then
      step "refit_bench noncolo-tp2-tp2dp (4 GPUs)"
      timeout 240 torchrun --standalone --nproc-per-node 4 benchmarks/refit_bench.py --case noncolo-tp2-tp2dp 2>&1 \
        | grep -v "^W\|^\[W" | tee -a "$OUT/refit_bench.log" | tail -10
    fi
    step "host overhead, 10,000 tensors"
    timeout 240 torchrun --standalone --nproc-per-node 2 benchmarks/host_overhead.py 2>&1 | grep host_overhead | tee -a "$OUT/refit_bench.log"
  fi
fi

if has pack; then
  # The kernels against D2D with the L2 cold (the default) and warm; flat tiles A/B at 16 and 64 MiB
  step "pack_bench, cold L2 (buffer sets rotated past the L2), checked against torch slicing"
  timeout 240 python3 benchmarks/pack_bench.py --check 2>&1 | tee "$OUT/pack_cold.log" | tail -16
  step "pack_bench, warm L2 (one buffer set, the old method)"
  timeout 120 python3 benchmarks/pack_bench.py --cache warm --sizes 16M,256M 2>&1 | tee "$OUT/pack_warm.log" | tail -10
  for args in "--no-flat" "" "--no-flat" ""; do
    step "pack_bench 16 MiB, cold, A/B flat tiles [$args]"
    timeout 60 python3 benchmarks/pack_bench.py --sizes 16M,64M $args 2>&1 | tee -a "$OUT/pack_ab.log" | tail -9
  done
fi

if has bench4 && [ "$ngpu" -ge 4 ]; then
  for c in tp2-tp1 tp1-tp2 moe-ep2-ep1 noncolo-tp2-tp2dp; do
    step "refit_bench $c on 4 GPUs"
    timeout 240 torchrun --standalone --nproc-per-node 4 benchmarks/refit_bench.py --case "$c" 2>&1 \
      | grep -v "^W\|^\[W" | tee -a "$OUT/refit_bench4.log" | tail -10
  done
fi

if has exp && [ "$ngpu" -ge 2 ]; then
  # A/B of the transport's knobs on the collocated cases, each with its ceilings of the same run
  export RESHARD_EXT_NCCL_TIMEOUT=90
  for c in tp2-tp1 moe-ep2-ep1; do
    for knobs in "" "RESHARD_EXT_NCCL_REGISTER=1" "RESHARD_EXT_CUDA_MAX_BLOCKS=33" "RESHARD_EXT_CUDA_MAX_BLOCKS=66" \
                 "RESHARD_EXT_NCCL_REGISTER=1 RESHARD_EXT_CUDA_MAX_BLOCKS=66"; do
      step "exp $c [$knobs]"
      env $knobs timeout 150 torchrun --standalone --nproc-per-node 2 benchmarks/refit_bench.py --case "$c" \
        --no-baseline --transfers-only 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/exp.log" | tail -5
    done
  done
fi

if has exp4 && [ "$ngpu" -ge 4 ]; then
  export RESHARD_EXT_NCCL_TIMEOUT=90
  for c in tp2-tp1 moe-ep2-ep1; do
    for knobs in "" "RESHARD_EXT_CUDA_MAX_BLOCKS=66"; do
      step "exp4 $c [$knobs]"
      env $knobs timeout 150 torchrun --standalone --nproc-per-node 4 benchmarks/refit_bench.py --case "$c" \
        --no-baseline --transfers-only 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/exp4.log" | tail -7
    done
  done
  step "exp4 tp2-tp1 timeline"
  timeout 150 torchrun --standalone --nproc-per-node 4 benchmarks/refit_bench.py --case tp2-tp1 --no-baseline --trace \
    2>&1 | grep -v "^W\|^\[W" > "$OUT/trace4.log"; tail -3 "$OUT/trace4.log"
fi

if has next && [ "$ngpu" -ge 2 ]; then
  # A/B of the default grid cap (half the SMs) against uncapped kernels, on every case that
  # transfers, with 4 GPUs when there are 4; one timeline of TP2->TP1.
  export RESHARD_EXT_NCCL_TIMEOUT=90
  n4=$(( ngpu >= 4 ? 4 : 2 ))
  for c in ${NEXT_CASES:-tp2-tp1 moe-ep2-ep1 noncolo-tp2-tp2dp noncolo-tp1-tp1}; do
    for knobs in "" "RESHARD_EXT_CUDA_MAX_BLOCKS=0"; do
      step "next: $c on $n4 GPUs [$knobs]"
      env $knobs timeout 150 torchrun --standalone --nproc-per-node $n4 benchmarks/refit_bench.py \
        --case "$c" --no-baseline --transfers-only 2>&1 | grep -E "^ +[0-9] |^== |alone|skipped" | tee -a "$OUT/next.log"
    done
  done
  for c in tp2-tp1 moe-ep2-ep1; do
    step "next: $c on $n4 GPUs, timeline"
    timeout 150 torchrun --standalone --nproc-per-node $n4 benchmarks/refit_bench.py --case $c --no-baseline --trace \
      2>&1 | grep -v "^W\|^\[W" > "$OUT/trace_next_$c.log"; grep -E "^ +[0-9] " "$OUT/trace_next_$c.log"
  done
fi

if has bench-big; then
  for c in tp2-tp1 noncolo-tp1-tp1; do
    step "refit_bench $c, batched 1 GiB"
    timeout 240 torchrun --standalone --nproc-per-node 2 benchmarks/refit_bench.py --case "$c" --max-batch-mb 1024 2>&1 \
      | grep -v "^W\|^\[W" | tee -a "$OUT/refit_bench.log" | tail -6
  done
fi

if has mx; then
  step "MXFP8 quantize kernel"
  timeout 120 python3 benchmarks/mxfp8_kernel_bench.py 2>&1 | tee -a "$OUT/mxfp8_bench.log" | tail -4
fi
if has mx && [ "$ngpu" -ge 2 ]; then
  for m in none receiver sender; do
    step "mxfp8_bench $m"
    timeout 200 python3 benchmarks/mxfp8_bench.py --world 2 --mxfp8 "$m" --layers 8 --hidden 4096 --ffn 14336 2>&1 \
      | tee -a "$OUT/mxfp8_bench.log" | tail -4
  done
fi
if has trace && [ "$ngpu" -ge 2 ]; then
  for split in 1 0; do
    step "refit_bench tp2-tp1, timeline, RESHARD_EXT_CUDA_SPLIT_COPIES=$split"
    RESHARD_EXT_CUDA_SPLIT_COPIES=$split timeout 240 torchrun --standalone --nproc-per-node 2 benchmarks/refit_bench.py \
      --case tp2-tp1 --no-baseline --trace --transfers-only 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/trace.log" | tail -45
  done
  for m in "receiver --scale-layout swizzled" "receiver --scale-layout 2d" "sender --scale-layout swizzled"; do
    step "refit_bench tp2-tp1 --mxfp8 $m"
    timeout 240 torchrun --standalone --nproc-per-node 2 benchmarks/refit_bench.py --case tp2-tp1 --no-baseline \
      --mxfp8 $m 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/refit_mxfp8.log" | tail -4
  done
fi

if has megatron && [ "$ngpu" -ge 2 ]; then
  step "megatron-core from .whl/"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="$PWD:/tmp/site"
  python3 -c "import megatron.core as m; print('megatron-core', m.__version__)"
  [ -n "${RX_SKIP_MEGATRON_TESTS:-}" ] || (cd tests && timeout 300 python3 -m pytest -q -p no:warnings -rs test_megatron_real.py 2>&1 | tee "$OUT/megatron_tests.log" | tail -12)
  for args in "--case tp2-tp1" "--case tp1-tp2"; do
    step "megatron_compare $args"
    timeout 300 torchrun --standalone --nproc-per-node 2 benchmarks/megatron_compare.py $args 2>&1 \
      | grep -v "^W\|^\[W\|Warning\|warn" | tee -a "$OUT/megatron_compare.log" | tail -8
  done
fi
if has direct && [ "$ngpu" -ge 2 ]; then
  step "direct transport: tests"
  (cd tests && timeout 560 python3 -m pytest -q -p no:warnings -rs --durations=10 test_direct.py \
      2>&1 | tee "$OUT/direct_tests.log" | tail -25)
  step "direct transport: compute-sanitizer memcheck (2 GPUs, every process)"
  (cd tests && timeout 400 compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 \
      python3 -m pytest -q -p no:warnings -x test_direct.py -k "test_matrix_2gpu and tp and None" \
      2>&1 | tee "$OUT/direct_sanitizer.log" | grep -E "ERROR SUMMARY|passed|failed|error" | tail -8)
  export RESHARD_EXT_DIRECT_TIMEOUT=120 RESHARD_EXT_NCCL_TIMEOUT=120
  for c in tp2-tp1 tp1-tp2 noncolo-tp1-tp1 moe-ep2-ep1; do
    step "direct: refit_bench $c, nccl vs direct on 2 GPUs"
    timeout 300 torchrun --standalone --nproc-per-node 2 benchmarks/refit_bench.py --case "$c" --backend nccl,direct \
      --no-baseline 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/direct_bench.log" | tail -14
  done
  step "direct: refit_bench tp2-tp1, direct with the kernel only (no copy engines)"
  RESHARD_EXT_DIRECT_ENGINE_BYTES=0 timeout 300 torchrun --standalone --nproc-per-node 2 benchmarks/refit_bench.py \
    --case tp2-tp1 --backend direct --no-baseline 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/direct_bench.log" | tail -6
  if [ "$ngpu" -ge 4 ]; then
    for c in tp2-tp1 noncolo-tp2-tp2dp; do
      step "direct: refit_bench $c, nccl vs direct on 4 GPUs"
      timeout 300 torchrun --standalone --nproc-per-node 4 benchmarks/refit_bench.py --case "$c" --backend nccl,direct \
        --no-baseline 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/direct_bench.log" | tail -16
    done
  fi
fi
if has relay && [ "$ngpu" -ge 4 ]; then
  for g in 0 4; do
    step "relay: refit_bench relay-1to3 (one source, three replicas), relay off / 1 stage / --relay-stages $g"
    timeout 300 torchrun --standalone --nproc-per-node 4 benchmarks/refit_bench.py --case relay-1to3 --iters 10 \
        --relay-stages "$g" 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/relay_bench.log" | tail -10
  done
fi

if has verify && [ "$ngpu" -ge 2 ]; then
  for c in tp2-tp1 moe-ep2-ep1; do
    step "verify: refit_bench $c with a verify=True column"
    timeout 300 torchrun --standalone --nproc-per-node 2 benchmarks/refit_bench.py --case "$c" --verify --no-baseline 2>&1 \
      | grep -v "^W\|^\[W" | tee -a "$OUT/verify_bench.log" | tail -8
  done
fi
step "done"
