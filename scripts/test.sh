#!/usr/bin/env bash
# Sets up, builds, and runs every test with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
BUILD_DIR=${HP_BUILD_DIR:-build}
# Two test processes at a time: most tests run ranks as threads with one intra-op thread each.
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${HP_TEST_JOBS:-2}" "$@"
