#!/usr/bin/env bash
# Sets up, builds, and runs every test with ctest (extra arguments go to ctest).
#
# scripts/test.sh --sanitize [ctest args]: AddressSanitizer (with leak detection) +
# UndefinedBehaviorSanitizer run of the threads-as-ranks unit tests of comm/ and cp/ (test_comm,
# test_cp): configures its own build directory (build-asan, or HP_ASAN_BUILD_DIR) with
# HP_SANITIZE=address,undefined, builds only those two suites and what they link, and runs them.
# LibTorch is not instrumented; it needs no suppressions here (no false container-overflow or
# leak reports from it in these suites).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

if [ "${1:-}" = "--sanitize" ]; then
  shift
  BUILD_DIR=${HP_ASAN_BUILD_DIR:-build-asan}
  SUITES=(test_comm test_cp)
  HP_BUILD_DIR=$BUILD_DIR HP_CMAKE_ARGS="-DHP_SANITIZE=address,undefined ${HP_CMAKE_ARGS:-}" \
    scripts/build.sh "${SUITES[@]}"
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
  labels="^($(IFS='|'; echo "${SUITES[*]}"))\$"
  ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${HP_TEST_JOBS:-2}" -L "$labels" "$@"
  exit 0
fi

scripts/build.sh
BUILD_DIR=${HP_BUILD_DIR:-build}
# Two test processes at a time: most tests run ranks as threads with one intra-op thread each.
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${HP_TEST_JOBS:-2}" "$@"
