#!/usr/bin/env bash
# The full soak of issue 8: 4 ranks (threads of one process, over TCP loopback) run 20,000
# random operations (collective, 0 - 8 MiB, dtype, op, priority, 12 in flight), every element
# checked against the independent reference. Reports wrong elements, resident-memory growth
# after warm-up (the first fifth of the operations; target < 5%) and descriptor growth, and
# fails when any is off target. CI runs the short version (ctest -R Soak).
#
#   ./scripts/soak.sh                      # 20,000 operations up to 8 MiB
#   ./scripts/soak.sh 5000 1048576 [SEED]  # operations, largest bytes, seed
set -euo pipefail
DEAR_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/lib.sh
. "$DEAR_ROOT/scripts/lib.sh"

ops=${1:-20000}
max_bytes=${2:-$((8 << 20))}
seed=${3:-20240601}
build=${DEAR_SOAK_BUILD:-$DEAR_ROOT/build/soak}
dear_install "${DEAR_BUILD_PACKAGES[@]}"

mkdir -p "$build"
cmake -S "$DEAR_ROOT" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDEAR_BUILD_BENCH=OFF \
  -DDEAR_BUILD_PEERS=OFF >"$build/configure.log" 2>&1 ||
  { cat "$build/configure.log" >&2; exit 1; }
cmake --build "$build" -j "$(nproc)" --target test_soak

dear_log "soak: $ops operations up to $max_bytes bytes, seed $seed"
log="$build/soak.log"
set +e
DEAR_SOAK_OPS=$ops DEAR_SOAK_MAX_BYTES=$max_bytes DEAR_SOAK_SEED=$seed DEAR_SOAK_RSS_LIMIT_PCT=5 \
  "$build/tests/test_soak" --gtest_filter='Soak.RandomOperationsAreExactAndLeakNothing' >"$log" 2>&1
rc=$?
set -e
grep '^soak:' "$log" || tail -n 40 "$log" >&2
if [ $rc -ne 0 ]; then
  grep -E 'Failure|Expected|Which is|descriptors|resident|element' "$log" >&2 || true
  dear_log "soak FAILED (log: $log)"
  exit $rc
fi
dear_log "soak passed"
