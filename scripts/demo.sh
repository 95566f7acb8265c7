#!/usr/bin/env bash
# Sets up, builds, and runs the main job. Until hp-train exists, the main job is the comm
# benchmark on 4 local rank processes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
BUILD_DIR=${HP_BUILD_DIR:-build}
"$BUILD_DIR/tools/hp-bench" comm --nproc 4 "$@"
