#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs dear-bench with 4 local ranks over
# TCP loopback for all_reduce, reduce_scatter and all_gather from 8 B to 64 MiB, checking
# every result (#wrong must be 0).
#
#   ./scripts/demo.sh                       # defaults: -n 4, 8 B .. 64 MiB, factor 2
#   ./scripts/demo.sh -n 8 -e 16M           # -n ranks; other flags go to dear-bench
set -euo pipefail
DEAR_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/lib.sh
. "$DEAR_ROOT/scripts/lib.sh"

ranks=4
if [ "${1:-}" = "-n" ]; then
  ranks=$2
  shift 2
fi

dear_install "${DEAR_BUILD_PACKAGES[@]}"
build=${DEAR_DEMO_BUILD:-$DEAR_ROOT/build/release}
mkdir -p "$(dirname "$build")"
dear_log "building in $build"
dear_build "$build" -DCMAKE_BUILD_TYPE=Release -DDEAR_BUILD_TESTS=OFF -DDEAR_BUILD_PEERS=OFF >/dev/null

status=0
for coll in all_reduce reduce_scatter all_gather; do
  dear_log "$coll on $ranks ranks over TCP loopback"
  "$build/tools/dear-run" -n "$ranks" "$build/bench/dear-bench" "$coll" \
    -b 8 -e 64M -f 2 -c 1 "$@" || status=1
done
exit $status
