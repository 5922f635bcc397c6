#!/usr/bin/env bash
# Every collective dear-bench offers, end to end on 4 ranks (tests/report.cmake):
#   dear_bench_collectives.sh DEAR_RUN DEAR_BENCH
# - each one runs a checked sweep (8 B to 64 KiB, both placements where it has them, a root
#   other than 0 where it takes one) and reports 0 wrong elements;
# - ping_pong on an odd number of ranks is refused on the rank that says it, naming why.
set -uo pipefail
run=$1 bench=$2

fail() {
  echo "FAIL: $*"
  exit 1
}

colls=$("$bench" --help 2>&1 | sed -n 's/^ *collective TEXT *//p')
[ -n "$colls" ] || fail "dear-bench --help lists no collectives"
checked=0
for c in ${colls//|/ }; do
  out=$("$run" -n 4 "$bench" "$c" -b 8 -e 64K -f 16 -n 2 -w 1 -c 1 -r 2 2>&1) ||
    fail "$c: exit status $?: $out"
  grep -q "Out of bounds values : 0 OK" <<<"$out" || fail "$c: wrong elements or no check: $out"
  rows=$(grep -cE '^\[0\] +[0-9]+ +[0-9]+ ' <<<"$out")
  [ "$rows" = 4 ] || fail "$c: $rows size rows, not 4 (8 B, 128 B, 2 KiB, 32 KiB): $out"
  checked=$((checked + 1))
done
[ "$checked" -ge 10 ] || fail "only $checked collectives ran"

if out=$("$run" -n 3 "$bench" ping_pong -b 8 -e 8 2>&1); then
  fail "ping_pong ran on 3 ranks: $out"
fi
grep -q "ping_pong pairs rank 2k with rank 2k+1, so it needs an even number of ranks, got 3" \
  <<<"$out" || fail "ping_pong on 3 ranks was not refused with its reason: $out"
echo "$checked collectives checked"
