#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests (+ compute-sanitizer on the kernels),
# benchmarks. Logs go to $OUT (the device tool brings them back).
#   scripts/gpu_check.sh [build] [kernels] [tests] [autonccl] [tests4] [sanitize] [bench] [pack] [bench4] [megatron] [direct] [dsanitize] [streams] [relay] [verify] [smoke] [nvshmem] [host] [steps] [gpustreams] [ab] [mxdirect] [engines] [formats] [docs] [outcome] [nvprobe] [shared]
#   (default: build tests sanitize bench), run in the order given. The stages reproduce benchmarks/RESULTS.md's tables (each
#   table names its stage or command). `direct` builds nothing: the direct transport's tests (2 and
#   4 GPUs), compute-sanitizer over one 2-GPU case, and refit_bench nccl vs direct. `megatron` needs
#   megatron-core wheels carried in .whl/ (see benchmarks/RESULTS.md); it installs them into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/rx_out}"
mkdir -p "$OUT"
stages="${*:-build tests sanitize bench}"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
step() { echo; echo "== $* ($(date +%T))"; }
gpus() { [ "$ngpu" -ge "$1" ] || { echo "($2: skipped, needs $1 GPUs)"; return 1; }; }

step "machine"
nvidia-smi -L
nvidia-smi topo -m 2>/dev/null | head -8
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"

stage_build() {
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
}
export PYTHONPATH="$PWD"
# torchao, the NVFP4 tests' reference, where its wheel is carried in .whl/ (the image has none)
if ls .whl/torchao-*.whl > /dev/null 2>&1 && ! python3 -c "import torchao" 2> /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-ao .whl/torchao-*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site-ao"
fi

stage_smoke() {
  step "GPU smoke: one case per backend (2 GPUs), then the trust tests"
  (cd tests && timeout 400 python3 -m pytest -q -p no:warnings -rs -x \
      "test_refit_gpu.py::test_matrix_2gpu" -k "tp and None and not uneven" test_trust_gpu.py \
      2>&1 | tee "$OUT/smoke.log" | tail -15)
  (cd tests && timeout 200 python3 -m pytest -q -p no:warnings -rs test_direct.py -k "small_boxes and 2gpu" \
      2>&1 | tee -a "$OUT/smoke.log" | tail -6)
}

stage_kernels() {
  step "GPU kernel tests: box copy, MXFP8 kernels, boxes and refits, verify (a short call)"
  (cd tests && timeout "${RX_KERNELS_TIMEOUT:-300}" python3 -m pytest -q -p no:warnings -rs \
      test_cuda_kernels.py test_mxfp8_kernels.py test_mxfp8_boxes.py test_mxfp8_refit.py test_verify.py \
      test_nvfp4_kernels.py test_nvfp4_boxes.py test_nvfp4_refit.py test_fp8block_kernels.py test_fp8block_boxes.py \
      test_fp8block_refit.py test_amax.py 2>&1 | tee "$OUT/kernels.log" | tail -12)
}

gpu_tests() {  # $1: log name; every test file with GPU tests (the 2-GPU ones; 4-GPU ones skip below 4)
  (cd tests && RX_TEST_DUMP_AFTER="${RX_TEST_DUMP_AFTER:-240}" timeout "${RX_TESTS_TIMEOUT:-520}" python3 -m pytest -q \
      -p no:warnings -rs --durations=15 \
      test_cuda_kernels.py test_nccl_comm.py test_nccl_lib.py test_refit_gpu.py test_mxfp8_kernels.py test_mxfp8_boxes.py \
      test_mxfp8_refit.py test_verify.py test_relay.py test_direct.py test_package.py test_trust_gpu.py test_swap.py \
      test_swap_fingerprint.py test_swap_round.py test_watch.py test_cuda_pipeline.py test_message_cuts.py test_nvshmem.py test_nvshmem_probe.py \
      test_nvfp4_kernels.py test_nvfp4_boxes.py test_nvfp4_refit.py test_fp8block_kernels.py test_fp8block_boxes.py \
      test_fp8block_refit.py test_amax.py test_outcome_gpu.py test_connect_gpu.py test_engine_trace.py -k "not mypy" 2>&1 | tee "$OUT/$1.log" | grep -v "^\[rank\|^frame\|^Exception raised" | tail -25)
}

stage_shared() {
  # The 2- and 4-rank GPU cases with the ranks sharing this machine's GPUs (formats, prep
  # overlap, outcome, verify): the direct transport's correctness where fewer GPUs are lent,
  # never its speed; cases whose backend needs a GPU per rank skip (tests/_dist.py).
  step "multi-rank direct cases, ranks sharing $ngpu GPU(s) (RX_TEST_SHARED_GPU=1)"
  (cd tests && RX_TEST_SHARED_GPU=1 RX_TEST_DUMP_AFTER=150 timeout "${RX_SHARED_TIMEOUT:-420}" python3 -m pytest -q \
      -p no:warnings -rs --durations=10 test_prep_overlap.py test_outcome_gpu.py test_fp8block_refit.py test_direct.py \
      test_nvfp4_refit.py test_mxfp8_refit.py test_verify.py \
      -k "${RX_SHARED_K:-2gpu or 4gpu or two_gpus or matrix_cuda or staging_ring}" \
      2>&1 | tee "$OUT/shared.log" | grep -v "^\[rank\|^frame\|^Exception raised" | tail -40)
  step "outcome_cost --device cuda --world 2 --backend direct --share-gpu (the exchange's host cost)"
  RESHARD_EXT_TIMEOUT=60 timeout 150 python3 benchmarks/outcome_cost.py --device cuda --world 2 --backend direct \
    --share-gpu --blocks 10 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/outcome_cost.log" | tail -6
}

stage_tests() {
  step "GPU tests"
  gpu_tests tests
}

stage_autonccl() {
  # backend="auto" as NCCL for every pair (the default is the direct transport)
  step "GPU tests with RESHARD_EXT_AUTO_DIRECT=0"
  RESHARD_EXT_AUTO_DIRECT=0 gpu_tests tests_autonccl
}

stage_tests4() {
  gpus 4 tests4 || return 0
  step "GPU refit tests (the 4-GPU matrix)"
  (cd tests && timeout 300 python3 -m pytest -q -p no:warnings test_refit_gpu.py 2>&1 | tee "$OUT/tests4.log" | tail -3)
}

stage_sanitize() {
  step "compute-sanitizer memcheck: kernel tests"
  (cd tests && timeout "${RX_SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 \
      python3 -m pytest -q -p no:warnings -x test_cuda_kernels.py test_mxfp8_boxes.py test_nvfp4_boxes.py test_nvfp4_kernels.py \
      test_fp8block_boxes.py test_fp8block_kernels.py test_amax.py \
      -k "not big and not cpu and not emulated" \
      2>&1 | tee "$OUT/sanitizer.log" | tail -8)
}

stage_bench() {
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
}

stage_pack() {
  step "pack_bench, cold L2 (buffer sets rotated past the L2), checked against torch slicing"
  timeout 240 python3 benchmarks/pack_bench.py --check 2>&1 | tee "$OUT/pack_cold.log" | tail -16
  step "local_copy_bench: an all-local refit's same-rank boxes in one launch, by warps per tile"
  timeout 120 python3 benchmarks/local_copy_bench.py 2>&1 | tee "$OUT/local_copy.log" | tail -12
}

stage_bench4() {
  gpus 4 bench4 || return 0
  for c in tp2-tp1 tp1-tp2 moe-ep2-ep1 noncolo-tp2-tp2dp; do
    step "refit_bench $c on 4 GPUs"
    timeout 240 torchrun --standalone --nproc-per-node 4 benchmarks/refit_bench.py --case "$c" 2>&1 \
      | grep -v "^W\|^\[W" | tee -a "$OUT/refit_bench4.log" | tail -10
  done
}

stage_megatron() {
  step "megatron-core from .whl/"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="$PWD:/tmp/site"
  python3 -c "import megatron.core as m; print('megatron-core', m.__version__)"
  [ -n "${RX_SKIP_MEGATRON_TESTS:-}" ] || (cd tests && timeout 300 python3 -m pytest -q -p no:warnings -rs test_megatron_real.py 2>&1 | tee "$OUT/megatron_tests.log" | tail -12)
  # the tiny Llama / Qwen3-MoE / DeepSeek-V3 refit into transformers models, bf16 on 1, 2 and 4 GPUs (the
  # transformers of the machine's image); one "bf16 logits" line per case with the measured agreement
  [ -n "${RX_SKIP_MEGATRON_TESTS:-}" ] || (cd tests && timeout 400 python3 -m pytest -q -s -p no:warnings -rs \
      test_megatron_hf_gpu.py 2>&1 | tee "$OUT/megatron_hf_gpu.log" | grep -E "^bf16 logits|passed|failed|SKIP|^E " | tail -24)
  gpus 2 "megatron_compare" || return 0
  # RX_MEGATRON_TREES=".ab/base ." runs the comparison in a base tree too (A/B; `ab` explains .ab/base)
  for tree in ${RX_MEGATRON_TREES:-.}; do
    [ "$tree" = . ] || [ -f "$tree"/reshard_ext/_C*.so ] || (cd "$tree" && rm -rf build/dev-on && scripts/dev_build.sh ON > "$OUT/ab_build.log" 2>&1) \
      || { tail -20 "$OUT/ab_build.log"; continue; }
    for c in ${RX_MEGATRON_CASES:-tp2-tp1 tp1-tp2}; do
      for b in ${RX_MEGATRON_BACKENDS:-auto}; do  # e.g. "auto nccl": the default (direct) and NCCL, same machine
        step "megatron_compare --case $c --backend $b ($tree)"
        (cd "$tree" && PYTHONPATH="$PWD:/tmp/site" timeout 300 torchrun --standalone --nproc-per-node 2 \
          benchmarks/megatron_compare.py --case "$c" --backend "$b" 2>&1 | grep -v "^W\|^\[W\|Warning\|warn" \
          | tee -a "$OUT/megatron_compare.log" | tail -8)
      done
    done
  done
}

stage_direct() {
  gpus 2 direct || return 0
  step "direct transport: tests"
  (cd tests && timeout 560 python3 -m pytest -q -p no:warnings -rs --durations=10 test_direct.py \
      2>&1 | tee "$OUT/direct_tests.log" | tail -25)
  stage_dsanitize
  export RESHARD_EXT_TIMEOUT=120
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
}
stage_dsanitize() {
  gpus 2 dsanitize || return 0
  step "direct transport: compute-sanitizer memcheck (2 GPUs, every process)"
  (cd tests && timeout "${RX_DSANITIZE_TIMEOUT:-400}" compute-sanitizer --tool memcheck --target-processes all \
      --error-exitcode 9 python3 -m pytest -q -p no:warnings -x test_direct.py -k "${RX_DSANITIZE_K:-test_matrix_2gpu and tp and None}" \
      2>&1 | tee "$OUT/direct_sanitizer.log" | grep -E "ERROR SUMMARY|passed|failed|error" | tail -8)
}

stage_streams() {
  gpus 2 streams || return 0
  # direct_engine_streams A/B, same run: how many copy engines the direct peer copies use
  # (RX_VARIANTS: other rx.Options variants of the direct transport, refit_bench --variants)
  local variants="${RX_VARIANTS:-direct_engine_streams=1;direct_engine_streams=2;direct_engine_streams=4;direct_engine_streams=8}"
  for c in ${RX_STREAMS_CASES:-tp2-tp1 moe-ep2-ep1 noncolo-tp1-tp1}; do
    step "direct: refit_bench $c, variants $variants"
    RESHARD_EXT_TIMEOUT=120 timeout 300 torchrun --standalone --nproc-per-node 2 benchmarks/refit_bench.py \
      --case "$c" --backend direct --no-baseline --variants "$variants" \
      2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/streams.log" | tail -4
  done
}

stage_relay() {
  # backend auto as by default (relayed stages on NCCL, the plain plan direct) and with
  # RESHARD_EXT_AUTO_DIRECT=1 (every plan on the direct transport), same machine
  gpus 4 relay || return 0
  for direct in ${RX_RELAY_AUTO_DIRECT:-default 1}; do
    for g in ${RX_RELAY_STAGES:-0 4}; do
      step "relay: refit_bench relay-1to3 (one source, three replicas), relay off / 1 stage / --relay-stages $g, RESHARD_EXT_AUTO_DIRECT=$direct"
      ( [ "$direct" = default ] || export RESHARD_EXT_AUTO_DIRECT=$direct
        exec timeout 300 torchrun --standalone --nproc-per-node 4 benchmarks/refit_bench.py \
          --case relay-1to3 --iters 10 --relay-stages "$g" ) 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/relay_bench.log" | tail -10
    done
  done
}

stage_nvshmem() {
  gpus 2 nvshmem || return 0
  export RESHARD_EXT_TIMEOUT=120
  for n in 2 4; do
    [ "$ngpu" -ge $n ] || continue
    for c in tp2-tp1 moe-ep2-ep1; do
      step "refit_bench $c, nccl vs direct vs nvshmem on $n GPUs"
      timeout 300 torchrun --standalone --nproc-per-node $n benchmarks/refit_bench.py --case "$c" --backend nccl,direct,nvshmem \
        --no-baseline 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/backends_bench.log" | tail -16
    done
  done
}

stage_host() {
  gpus 2 host || return 0
  step "host time: execute of a 10,000-tensor plan, warm swap vs execute, 1,000 executes / plans"
  timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/host_overhead.py --phases 2>&1 | grep -v "^W\|^\[W" \
    | tee -a "$OUT/host.log" | tail -8
  RESHARD_EXT_CHECK_THREADS=8 timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/host_overhead.py 2>&1 \
    | grep -v "^W\|^\[W" | tee -a "$OUT/host.log" | tail -6
  RESHARD_EXT_CHECK_THREADS=1 timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/host_overhead.py 2>&1 \
    | grep -v "^W\|^\[W" | tee -a "$OUT/host.log" | tail -6
  timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/host_overhead.py --tensor-data-ptr 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/host.log" | tail -6
  [ -z "${RX_HOST_PROFILE:-}" ] || timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/host_overhead.py --profile \
    --iters 200 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/host.log" | tail -40
  timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/swap_overhead.py 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/host.log" | tail -8
  timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/churn_bench.py 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/host.log" | tail -8
}

stage_steps() {
  gpus 2 steps || return 0
  step "the steps of a direct execute (CUDA events and host clock from the call)"
  timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/execute_steps.py tp2-tp1 moe-ep2-ep1 2>&1 \
    | grep "^\[" | sort | tee -a "$OUT/steps.log"
}

stage_gpustreams() {
  gpus 2 gpustreams || return 0
  step "each stream's work in a plain and a verified execute (torch.profiler), and the verify check's tail"
  timeout 300 torchrun --standalone --nproc-per-node 2 benchmarks/gpu_streams.py --backend direct,nccl --profile \
    tp2-tp1 moe-ep2-ep1 2>&1 | grep -v "^W\|^\[W\|UserWarning\|warn(" | tee -a "$OUT/gpu_streams.log" | grep "^\[" | sort
}

stage_verify() {
  gpus 2 verify || return 0
  # the verify=True column is the first backend's (RX_VERIFY_BACKENDS=direct,nccl: the direct one);
  # RX_VERIFY_VARIANTS: refit_bench --variants, e.g. ";max_blocks=66;max_blocks=99" (a grid-cap A/B);
  # RX_VERIFY_ARGS: more refit_bench arguments (e.g. "--iters 10")
  for c in ${RX_VERIFY_CASES:-tp2-tp1 moe-ep2-ep1}; do
    step "verify: refit_bench $c with a verify=True column"
    timeout 300 torchrun --standalone --nproc-per-node 2 benchmarks/refit_bench.py --case "$c" \
      --backend "${RX_VERIFY_BACKENDS:-nccl,direct}" --verify --no-baseline --variants "${RX_VERIFY_VARIANTS:-}" ${RX_VERIFY_ARGS:-} 2>&1 \
      | grep -v "^W\|^\[W" | tee -a "$OUT/verify_bench.log" | tail -8
  done
  step "verify: the check's round trip issued to a GPU gone idle, queued, and host sleeps"
  timeout 120 torchrun --standalone --nproc-per-node 2 benchmarks/idle_latency.py 2>&1 | grep -v "^W\|^\[W" \
    | tee -a "$OUT/verify_bench.log" | tail -8
}
stage_formats() {
  # every low-precision format against BF16 in the same run (benchmarks/_formats.py lists them):
  # the quantizing kernels against a D2D copy of the bytes they read, then refits collocated
  # (swap) and non-collocated (split: the link is the bottleneck), sender and receiver side.
  step "formats: quantize and pack kernels against D2D of their source bytes (1 GPU)"
  timeout 240 python3 benchmarks/formats_kernel_bench.py --kernels 2>&1 | tee -a "$OUT/formats.log" | grep -v "^\[\|arn" | tail -80
  gpus 2 formats || return 0
  for n in 2 4; do
    [ "$ngpu" -ge $n ] || continue
    for placement in split swap; do
      step "formats: formats_bench --placement $placement on $n GPUs (BF16 and every format, 2 rounds)"
      timeout 300 torchrun --standalone --nproc-per-node $n benchmarks/formats_bench.py --placement "$placement" \
        --rounds 2 --layers 8 --hidden 4096 --ffn 14336 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/formats.log" | tail -12
    done
  done
}

stage_ab() {
  # A/B against a base tree in .ab/base (`git archive REV | tar -x -C .ab/base`; ignored: the device
  # call carries it): builds it, then runs each benchmark base / this tree alternately, same machine.
  # RX_AB_BACKENDS (default nccl,direct,nvshmem), RX_AB_ARGS (more refit_bench arguments, e.g.
  # "--verify --iters 10"), RX_AB_HOST=0 (no host-time rows).
  gpus 2 ab || return 0
  [ -d .ab/base ] || { echo "(ab: no .ab/base tree)"; return 0; }
  step "A/B: build the base tree"
  (cd .ab/base && rm -rf build/dev-on && scripts/dev_build.sh ON > "$OUT/ab_build.log" 2>&1) || { tail -20 "$OUT/ab_build.log"; return 0; }
  # the deprecated names: a base tree older than RESHARD_EXT_TIMEOUT reads only these
  export RESHARD_EXT_DIRECT_TIMEOUT=120 RESHARD_EXT_NCCL_TIMEOUT=120 RESHARD_EXT_NVSHMEM_TIMEOUT=120
  for round in 1 2; do
    for tree in .ab/base .; do
      for c in ${RX_AB_CASES:-tp2-tp1 moe-ep2-ep1}; do
        step "A/B round $round, $tree: refit_bench $c (${RX_AB_BACKENDS:-nccl,direct,nvshmem} ${RX_AB_ARGS:-})"
        # shellcheck disable=SC2086  # RX_AB_ARGS: several arguments
        (cd "$tree" && PYTHONPATH="$PWD" timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/refit_bench.py \
          --case "$c" --backend "${RX_AB_BACKENDS:-nccl,direct,nvshmem}" --no-baseline ${RX_AB_ARGS:-} 2>&1 \
          | grep -v "^W\|^\[W\|^link =" | tail -4) | tee -a "$OUT/ab.log"
      done
      [ "${RX_AB_HOST:-1}" = 0 ] && continue
      step "A/B round $round, $tree: host time, 10,000 tensors"
      (cd "$tree" && PYTHONPATH="$PWD" timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/host_overhead.py 2>&1 \
        | grep host_overhead) | tee -a "$OUT/ab.log"
    done
  done
}
stage_mxdirect() {
  # issue 38 item 6: a sender-side quantized refit against the BF16 refit of the same model, same run,
  # on the direct backend, non-collocated TP1->TP1 (the link is the bottleneck): the "time ratio"
  # column (target <= 0.6 for MXFP8 and FP8Block). Sweeps (each a refit_bench run per codec):
  #   RX_STAGING_BYTES  ring sizes (RESHARD_EXT_DIRECT_STAGING_BYTES; 0 = the box kernel stores the codec
  #                     boxes into the peer, as before the staging ring); default "256M"
  #   RX_STAGING_SLOTS  slots of the ring (RESHARD_EXT_DIRECT_STAGING_SLOTS); default "4"
  #   RX_STAGING_STREAMS copy streams carrying the chunks (RESHARD_EXT_DIRECT_STAGING_STREAMS); default "2"
  #   RX_CODECS         "mxfp8 fp8block"
  # The first combination also prints each rank's --timeline (the staged chunks' packs, digests and
  # copies, and a summary: link idle time, copy streams waiting for packs, packs waiting for slots),
  # plain and verified.
  #   RX_MXDIRECT_TESTS=0 skips the correctness tests and the sanitizer (a sweep after a first full run)
  #   RX_PREP_CODECS    codecs of the deferred pre-pass A/B (direct_prep_overlap off/on); default "fp8block nvfp4"
  gpus 2 mxdirect || return 0
  [ "${RX_MXDIRECT_TESTS:-1}" = 0 ] || mxdirect_tests
  mxdirect_bench
}
mxdirect_tests() {
  step "mxdirect: correctness of codec boxes over the direct transport (2 GPUs)"
  (cd tests && timeout 400 python3 -m pytest -q -p no:warnings -rs test_mxfp8_refit.py -k "cuda and (direct or staging)" \
      2>&1 | tee "$OUT/mxdirect_tests.log" | tail -4)
  (cd tests && timeout 200 python3 -m pytest -q -p no:warnings -rs test_direct.py -k "staged or staging or mxfp8" \
      2>&1 | tee -a "$OUT/mxdirect_tests.log" | tail -4)
  (cd tests && timeout 300 python3 -m pytest -q -p no:warnings -rs test_fp8block_refit.py -k "direct or cuda" \
      2>&1 | tee -a "$OUT/mxdirect_tests.log" | tail -4)
  (cd tests && timeout 300 python3 -m pytest -q -p no:warnings -rs test_prep_overlap.py \
      2>&1 | tee -a "$OUT/mxdirect_tests.log" | tail -4)
  # API errors are not ours: NCCL probes its kernels during torch's eager init (cudaErrorNoKernelImageForDevice);
  # only memory errors count.
  (cd tests && timeout 300 compute-sanitizer --tool memcheck --report-api-errors no --target-processes all \
      --error-exitcode 9 python3 -m pytest -q -p no:warnings -x test_mxfp8_refit.py \
      -k "(test_refit_matrix_cuda and sender and 2d and direct) or (staging_ring and 2d)" \
      2>&1 | tee "$OUT/mxdirect_sanitizer.log" | grep -E "ERROR SUMMARY|passed|failed|error" | tail -4)
}
mxdirect_bench() {
  export RESHARD_EXT_TIMEOUT=120
  local first=1
  for codec in ${RX_CODECS:-mxfp8 fp8block}; do
    for bytes in ${RX_STAGING_BYTES:-256M}; do
      for slots in ${RX_STAGING_SLOTS:-4}; do
        for streams in ${RX_STAGING_STREAMS:-2}; do
          extra=""
          [ "$first" = 1 ] && [ "${RX_MXDIRECT_TIMELINE:-1}" = 1 ] && extra="--timeline --verify"
          step "mxdirect: refit_bench noncolo-tp1-tp1, direct, $codec sender side, staging $bytes, $slots slots, $streams streams $extra"
          RESHARD_EXT_DIRECT_STAGING_BYTES=$bytes RESHARD_EXT_DIRECT_STAGING_SLOTS=$slots \
          RESHARD_EXT_DIRECT_STAGING_STREAMS=$streams timeout 400 torchrun --standalone --nproc-per-node 2 \
            benchmarks/refit_bench.py --case noncolo-tp1-tp1 --backend direct --no-baseline --mxfp8 sender \
            --codec "$codec" $extra ${RX_MXDIRECT_ARGS:-} 2>&1 | grep -v "^W\|^\[W" > "$OUT/mxdirect_run.log"
          cat "$OUT/mxdirect_run.log" >> "$OUT/mxdirect.log"
          grep -E -A4 "^-- (MXFP8|FP8BLOCK)|^-- rank" "$OUT/mxdirect_run.log" | grep -vE "^ +(chunk|engine|pack|kernel|local|signal|start|host|end|wait)" | head -60
          first=0
        done
      done
    done
  done
  # the deferred pre-pass (RESHARD_EXT_DIRECT_PREP_OVERLAP, default off): off and on in one run per codec, same
  # tensors; each variant's table has its time ratio, the log each variant's timeline (its "prep" rows: the amaxes
  # per tensor on the prep stream, under the first chunks' copies)
  for codec in ${RX_PREP_CODECS:-fp8block nvfp4}; do
    step "mxdirect: deferred pre-pass A/B, $codec sender side (direct_prep_overlap=0;direct_prep_overlap=1)"
    timeout 400 torchrun --standalone --nproc-per-node 2 benchmarks/refit_bench.py --case noncolo-tp1-tp1 \
      --backend direct --no-baseline --mxfp8 sender --codec "$codec" --timeline \
      --variants "direct_prep_overlap=0;direct_prep_overlap=1" ${RX_MXDIRECT_ARGS:-} 2>&1 | grep -v "^W\|^\[W" \
      > "$OUT/mxdirect_prep_run.log"
    cat "$OUT/mxdirect_prep_run.log" >> "$OUT/mxdirect.log"
    grep -E -A4 "^-- (FP8BLOCK|NVFP4)" "$OUT/mxdirect_prep_run.log" | head -24
  done
  [ "${RX_MXDIRECT_TESTS:-1}" = 0 ] && return 0
  step "mxdirect: MXFP8 receiver side on direct (the sender's kernel stores quantized bytes into the peer)"
  timeout 300 torchrun --standalone --nproc-per-node 2 benchmarks/refit_bench.py --case noncolo-tp1-tp1 --backend direct \
    --no-baseline --mxfp8 receiver 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/mxdirect.log" | tail -6
}
stage_engines() {
  # issue 36: rx.connect across separately launched jobs (1+1 and 2+2 GPUs), the traced engine on GPUs,
  # and engine_refit_bench: reshard_ext through the traced record against gather + broadcast +
  # load_weights (the engines' own path), non-collocated 2 trainers -> a TP2 engine
  gpus 2 engines || return 0
  step "engines: rx.connect on GPUs, traced engine refits"
  (cd tests && timeout 400 python3 -m pytest -q -p no:warnings -rs test_connect_gpu.py test_engine_trace.py -k "gpu" \
      2>&1 | tee "$OUT/engines_tests.log" | tail -8)
  gpus 4 engine_bench || return 0
  for tp in ${RX_ENGINE_TPS:-2}; do
    step "engine_refit_bench: 2 trainers -> TP$tp engine (4 GPUs)"
    timeout 300 torchrun --standalone --nproc-per-node 4 benchmarks/engine_refit_bench.py --trainers 2 --engine-tp "$tp" \
      ${RX_ENGINE_ARGS:-} 2>&1 | grep -v "^W\|^\[W" | tee -a "$OUT/engine_bench.log" | tail -20
  done
}
stage_outcome() {
  # issue 37 on GPUs: every rank raises (SIGKILL, a rank that raised first, the NVSHMEM auto -> nccl ->
  # nvshmem sequence), then what the outcome exchange costs per execute on each backend (<= 50 us)
  gpus 2 outcome || return 0
  step "outcome: one answer on every rank, GPU cases"
  (cd tests && timeout 400 python3 -m pytest -q -p no:warnings -rs --durations=8 test_outcome_gpu.py \
      2>&1 | tee "$OUT/outcome_tests.log" | grep -v "^\[rank\|^frame\|^Exception raised" | tail -14)
  for b in ${RX_OUTCOME_BACKENDS:-nccl direct nvshmem}; do
    step "outcome_cost --device cuda --world 2 --backend $b"
    RESHARD_EXT_TIMEOUT=60 timeout 200 python3 benchmarks/outcome_cost.py --device cuda --world 2 --backend "$b" 2>&1 \
      | grep -v "^W\|^\[W" | tee -a "$OUT/outcome_cost.log" | tail -6
  done
}
stage_nvprobe() {
  # issue 37 item 5: which step of the NVSHMEM plan's first execute does not complete after auto and nccl plans
  # (scripts/nvshmem_sequence_probe.py: its verdicts, then each rank's log under $OUT/probe/)
  gpus 2 nvprobe || return 0
  step "nvshmem_sequence_probe (2 GPUs, <= 3 min)"
  timeout 200 python3 scripts/nvshmem_sequence_probe.py ${RX_PROBE_ARGS:-} 2>&1 | tee "$OUT/nvprobe.log" | tail -60
}
stage_docs() {
  # the code blocks of README.md and docs/ marked GPU-only (`# GPU: torchrun --nproc-per-node N`)
  step "docs: the GPU-only code blocks of README.md and docs/"
  (cd tests && RX_DOCS_GPU_ONLY=1 timeout 300 python3 -m pytest -q -p no:warnings -rs test_docs.py -k page_code_runs \
      2>&1 | tee "$OUT/docs.log" | tail -8)
}
for s in $stages; do
  declare -F "stage_$s" > /dev/null || { echo "unknown stage: $s" >&2; exit 2; }
done
for s in $stages; do "stage_$s"; done  # in the order given: a call that runs out of time loses the last ones
step "done"
