#!/usr/bin/env bash
# The test command: installs what is missing, builds with warnings as errors, runs the whole
# suite, checks the installed library (scripts/install-check.sh), then builds the tests with
# AddressSanitizer + UBSan and runs them again.
# Exits non-zero when a test fails or when no test ran.
#
#   ./scripts/test.sh                 # everything
#   DEAR_TEST_SKIP_SANITIZE=1 ./scripts/test.sh   # skip the sanitizer pass (faster)
#   DEAR_TEST_FUZZ_SECONDS=0 ./scripts/test.sh     # skip the fuzzing pass (default 30 s each)
#   ./scripts/test.sh -L unit         # extra arguments go to ctest (both passes)
set -euo pipefail
DEAR_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/lib.sh
. "$DEAR_ROOT/scripts/lib.sh"

# clang-format: the `format` test checks every source against .clang-format.
dear_install "${DEAR_BUILD_PACKAGES[@]}" "${DEAR_PEER_PACKAGES[@]}" "${DEAR_PYTHON_PACKAGES[@]}" \
  clang-format

build=${DEAR_TEST_BUILD:-$DEAR_ROOT/build/test}
mkdir -p "$(dirname "$build")"
dear_log "building in $build (warnings are errors)"
# Line tables only (-g1): failures and sanitizer reports still name file and line, and the
# optimised build compiles in about two thirds of the time that full debug information takes.
dear_build "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DDEAR_WERROR=ON -DDEAR_VERBS=ON \
  -DDEAR_INSTALL_STATIC=ON

run_ctest() {
  local dir=$1
  shift
  # --no-tests=error: a run that finds no test fails instead of passing silently.
  (cd "$dir" && ctest --output-on-failure --no-tests=error -j "$(nproc)" --timeout 300 "$@")
}

dear_log "running the tests"
run_ctest "$build" "$@"
# The installed copy: CMake package, pkg-config, static archive, .deb and pip (about 30 s).
"$DEAR_ROOT/scripts/install-check.sh" "$build"

if [ "${DEAR_TEST_SKIP_SANITIZE:-0}" != 1 ]; then
  asan=${DEAR_TEST_ASAN_BUILD:-$DEAR_ROOT/build/asan}
  dear_log "building in $asan with AddressSanitizer + UBSan"
  dear_build "$asan" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-g1 -DDEAR_WERROR=ON -DDEAR_VERBS=ON \
    -DDEAR_SANITIZE=address,undefined \
    -DDEAR_CUDA=OFF -DDEAR_BUILD_PEERS=OFF -DDEAR_BUILD_BENCH=OFF -DDEAR_BUILD_PYTHON=OFF
  dear_log "running the tests under AddressSanitizer + UBSan"
  # The libfabric conformance suites run here on 3 ranks only: every test of every provider
  # and data path, without the 2- and 5-rank instances that the pass above has run (under the
  # sanitizers those took a third of this pass's time). The format check, which runs no
  # library code, ran above.
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
    run_ctest "$asan" -E '^fabric_.*/(2|5)ranks|^format$' "$@"
fi
# Fuzz what dear reads from the network (libFuzzer, 30 s per harness unless told otherwise;
# scripts/fuzz.sh alone runs longer).
fuzz_seconds=${DEAR_TEST_FUZZ_SECONDS:-30}
if [ "$fuzz_seconds" != 0 ]; then
  dear_log "fuzzing each harness for $fuzz_seconds s"
  "$DEAR_ROOT/scripts/fuzz.sh" "$fuzz_seconds"
fi
dear_log "all tests passed"
