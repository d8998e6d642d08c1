#!/usr/bin/env bash
# Incremental developer build: compiles _C with CMake+ninja into build/dev-<cuda> and
# drops it next to the Python sources, so `PYTHONPATH=. pytest` runs the working tree.
# Usage: scripts/dev_build.sh [OFF|AUTO|ON]   (RESHARD_EXT_CUDA; default OFF here)
set -euo pipefail
cd "$(dirname "$0")/.."
cuda="${1:-OFF}"
py="${PYTHON:-python3}"
build="build/dev-${cuda,,}${RX_BUILD_SUFFIX:-}"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DRESHARD_EXT_CUDA="$cuda" \
  -DPython_EXECUTABLE="$(command -v "$py")" \
  -Dpybind11_DIR="$("$py" -m pybind11 --cmakedir)" \
  -DSKBUILD_PROJECT_VERSION=dev ${RX_CMAKE_ARGS:-} >/dev/null
ninja -C "$build" _C
cp "$build"/_C*.so reshard_ext/
