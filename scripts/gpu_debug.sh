#!/usr/bin/env bash
# Crash hunt on the GPU machine: where a static libstdc++ comes from, then the fix.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/rx_out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD"
env | grep -iE "^(LDFLAGS|CFLAGS|CXXFLAGS|CPPFLAGS|CUDAFLAGS|NVCC_|CMAKE_)" || echo "(no flag variables)"
scripts/dev_build.sh ON > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
ninja -C build/dev-on -t commands _C | tail -1 | tr ' ' '\n' | grep -E "^-|\.a$|\.so" | sort -u | head -40
so=$(ls reshard_ext/_C*.so)
ldd "$so" | grep -E "stdc|cudart|nccl"
echo "exported std:: symbols: $(nm -D -C --defined-only "$so" | grep -c 'std::')"
for a in $(ninja -C build/dev-on -t commands _C | tail -1 | tr ' ' '\n' | grep -E "\.a$"); do
  echo "$a: $(nm -C "$a" 2>/dev/null | grep -c ' T std::')"; done
(cd tests && timeout 120 python3 -X faulthandler -m pytest -q -p no:warnings test_cuda_kernels.py -k "bad_tables" 2>&1 | tail -2)
