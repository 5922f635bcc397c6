#!/usr/bin/env bash
# Latency study: dear-bench over TCP loopback with an emulated one-way link delay (dear-run
# --link-delay), swept over rank counts, link delays, algorithms and message sizes. Writes one
# CSV: the sweep's parameters (delay_us, algo) followed by dear-bench's own CSV columns.
#
#   scripts/latency-study.sh [options]
#     --build DIR       build with tools/dear-run and bench/dear-bench (default: build)
#     --ranks "2 4 8"   rank counts
#     --delays "0 25 100"  one-way link delays in microseconds
#     --algos "auto ring gather_reduce"  all_reduce algorithms (dear-bench --algo)
#     --collective C    all_reduce (default), reduce_scatter, all_gather or broadcast
#     -b 8 -e 1M -f 8   smallest size, largest size, step factor (dear-bench's)
#     -n 20 -w 5        timed and warm-up iterations per size
#     --out FILE        CSV to write (default: latency-study.csv)
#
# A progress line on stderr says which point runs. Every point is checked (dear-bench -c 1);
# the script fails if any result was wrong. Rank counts above the machine's cores oversubscribe
# it: the times then measure the scheduler as much as the network, so note the core count
# (printed at the start) next to the results.
set -euo pipefail
DEAR_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

build=$DEAR_ROOT/build
ranks="2 4 8"
delays="0 25 100"
algos="auto ring gather_reduce"
collective=all_reduce
min=8
max=1M
factor=8
iters=20
warmup=5
out=latency-study.csv

usage() {
  sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2 ;;
    --ranks) ranks=$2 ;;
    --delays) delays=$2 ;;
    --algos) algos=$2 ;;
    --collective) collective=$2 ;;
    -b) min=$2 ;;
    -e) max=$2 ;;
    -f) factor=$2 ;;
    -n) iters=$2 ;;
    -w) warmup=$2 ;;
    --out) out=$2 ;;
    -h | --help) usage ;;
    *)
      printf 'latency-study: unknown option %s\n' "$1" >&2
      usage
      ;;
  esac
  shift 2 || usage
done
run=$build/tools/dear-run
bench=$build/bench/dear-bench
for tool in "$run" "$bench"; do
  [ -x "$tool" ] || {
    printf 'latency-study: %s is missing; build first (cmake --build %s)\n' "$tool" "$build" >&2
    exit 1
  }
done
# The algorithm applies to all_reduce only.
[ "$collective" = all_reduce ] || algos=auto

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

read -r -a rank_list <<<"$ranks"
read -r -a delay_list <<<"$delays"
read -r -a algo_list <<<"$algos"
total=$((${#rank_list[@]} * ${#delay_list[@]} * ${#algo_list[@]}))
printf 'latency-study: %d points of %s, %s..%s x%s, on %d cores -> %s\n' \
  "$total" "$collective" "$min" "$max" "$factor" "$(nproc)" "$out" >&2

header_written=0
point=0
wrong=0
: >"$out"
for n in "${rank_list[@]}"; do
  for d in "${delay_list[@]}"; do
    for a in "${algo_list[@]}"; do
      point=$((point + 1))
      printf '\r\033[K[%d/%d] ranks=%s delay=%sus algo=%s' "$point" "$total" "$n" "$d" "$a" >&2
      csv=$tmp/point.csv
      rm -f "$csv"
      if ! "$run" -n "$n" --link-delay "${d}us" --timeout 600 -- "$bench" "$collective" \
        -b "$min" -e "$max" -f "$factor" -n "$iters" -w "$warmup" -c 1 --algo "$a" \
        --csv "$csv" >"$tmp/point.log" 2>&1; then
        printf '\nlatency-study: ranks=%s delay=%sus algo=%s failed:\n' "$n" "$d" "$a" >&2
        tail -20 "$tmp/point.log" >&2
        exit 1
      fi
      if [ "$header_written" = 0 ]; then
        printf 'delay_us,algo,%s\n' "$(head -1 "$csv")" >>"$out"
        header_written=1
      fi
      tail -n +2 "$csv" | sed "s/^/$d,$a,/" >>"$out"
      # #wrong columns (oop_wrong, ip_wrong) must be 0 on every row.
      if tail -n +2 "$csv" | awk -F, '{ if ($15 != 0 || $21 != 0) bad = 1 } END { exit !bad }'
      then
        wrong=1
      fi
    done
  done
done
printf '\r\033[Klatency-study: wrote %d rows to %s\n' "$(($(wc -l <"$out") - 1))" "$out" >&2
if [ "$wrong" = 1 ]; then
  printf 'latency-study: some results were wrong (#wrong > 0); see %s\n' "$out" >&2
  exit 1
fi
