#!/usr/bin/env bash
# Fuzzes what dear reads from the network: the handshake parsers and the TCP channel's receive
# state machine. Builds the libFuzzer harnesses of tests/fuzz with clang, AddressSanitizer and
# UBSan in their own build directory, then runs each for SECONDS (default 60) from the seed
# corpus in tests/fuzz/corpus/<harness>. Fails on any crash, sanitizer report or broken
# invariant; the reproducer is left in the build directory's artifacts/.
#
#   ./scripts/fuzz.sh            # 60 s per harness
#   ./scripts/fuzz.sh 10         # a quick pass
#   DEAR_FUZZ_BUILD=dir DEAR_FUZZ_JOBS=2 ./scripts/fuzz.sh
set -euo pipefail
DEAR_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/lib.sh
. "$DEAR_ROOT/scripts/lib.sh"

seconds=${1:-60}
build=${DEAR_FUZZ_BUILD:-$DEAR_ROOT/build/fuzz}
harnesses=(handshake frames)
dear_install "${DEAR_BUILD_PACKAGES[@]}" clang
command -v clang++ >/dev/null || { dear_log "clang++ is needed for libFuzzer"; exit 1; }

mkdir -p "$build"
dear_log "building the fuzz harnesses in $build"
cmake -S "$DEAR_ROOT" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDEAR_FUZZ=ON -DDEAR_SANITIZE=address,undefined \
  -DCMAKE_CXX_FLAGS=-fsanitize=fuzzer-no-link -DDEAR_CUDA=OFF -DDEAR_BUILD_BENCH=OFF \
  -DDEAR_BUILD_PEERS=OFF -DDEAR_BUILD_PYTHON=OFF >"$build/configure.log" 2>&1 ||
  { cat "$build/configure.log" >&2; exit 1; }
cmake --build "$build" -j "$(nproc)" --target "${harnesses[@]/#/fuzz_}"

status=0
for h in "${harnesses[@]}"; do
  # The corpus grows in the build directory; the seeds in the repo stay as they are.
  work="$build/corpus/$h"
  mkdir -p "$work" "$build/artifacts"
  dear_log "fuzzing $h for ${seconds}s"
  if ! ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$build/tests/fuzz/fuzz_$h" -max_total_time="$seconds" -max_len=65536 -timeout=10 \
      -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$build/artifacts/$h-" \
      "$work" "$DEAR_ROOT/tests/fuzz/corpus/$h" >"$build/$h.log" 2>&1; then
    tail -n 40 "$build/$h.log" >&2
    dear_log "FAILED: fuzz_$h (log: $build/$h.log)"
    status=1
  else
    grep -E "stat::number_of_executed_units|cov:" "$build/$h.log" | tail -n 2 >&2 || true
    dear_log "fuzz_$h: no crash in ${seconds}s"
  fi
done
exit $status
