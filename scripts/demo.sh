#!/usr/bin/env bash
# Sets up, builds, and runs the main job: hp-train on its embedded default (the copy task)
# over 4 local ranks with CP 4 (hybrid, Ulysses degree 2, async schedule), checked against a
# single-process run of the same model and data (--validate).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
BUILD_DIR=${HP_BUILD_DIR:-build}
mkdir -p hp_runs
"$BUILD_DIR/tools/hp-train" --nproc 4 --cp 4 --cp-algo hybrid --ulysses-degree 2 \
  --schedule async --validate --metrics-json hp_runs/demo_metrics.json "$@"
echo "metrics: hp_runs/demo_metrics.json"
