#!/usr/bin/env bash
# Configures and builds hyperparallel with Ninja (+ ccache when present) into build/.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${HP_BUILD_DIR:-build}
JOBS=${HP_JOBS:-$(nproc)}
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${HP_CMAKE_ARGS:-}
fi
cmake --build "$BUILD_DIR" -j "$JOBS"
