#!/usr/bin/env bash
# Configures and builds hyperparallel with Ninja (+ ccache when present) into build/.
# Arguments, if any, are the targets to build (default: everything).
#   HP_BUILD_DIR   build directory (default build)
#   HP_JOBS        parallel jobs (default: all cores)
#   HP_CMAKE_ARGS  extra arguments for the first configure of a build directory
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${HP_BUILD_DIR:-build}
JOBS=${HP_JOBS:-$(nproc)}
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${HP_CMAKE_ARGS:-}
fi
targets=()
for t in "$@"; do
  targets+=(--target "$t")
done
cmake --build "$BUILD_DIR" -j "$JOBS" ${targets[@]+"${targets[@]}"}
