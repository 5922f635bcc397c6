#!/usr/bin/env bash
# Checks Algorithm::kAuto's choice against measurement: for each rank count, calibrates the cost
# model on loopback (dear-bench --calibrate), then times all_reduce with every forced algorithm
# and with auto (DEAR_COST_MODEL set) over a grid of sizes, all algorithms interleaved at each
# size (dear-bench --compare), and prints a grid marking where auto is within the tolerance of
# the best forced algorithm, and the fraction of such points.
#
#   scripts/check-auto.sh [options]
#     --build DIR          build with tools/dear-run, bench/dear-bench, bench/dear-model
#                          (default: build)
#     --ranks "2 3 4 5 6 7 8"  rank counts
#     -b 8 -e 64M -f 4     smallest size, largest size, step factor
#     -n 10 -w 2           timed (at least) and warm-up iterations per algorithm and size
#     --min_time_ms 100    time each algorithm at least this long per size
#     --tolerance 10       auto passes within this many percent of the best forced algorithm
#     --forced "ring gather_reduce recursive_doubling halving_doubling tree"
#                          the forced algorithms auto is compared with (dear-bench --algo)
#     --grid-only          recompute the grid from an earlier run's --out DIR, measuring nothing
#     --out DIR            where the models, CSV and grid go (default: check-auto)
#
# A point's time is the median time per operation, the slowest rank's, with every algorithm
# (auto among them) run in interleaved rounds, so that a slow spell of the shared machine hits
# them alike. The grid cell is auto's time over the best forced one, with '*' where it is
# within the tolerance; the letter after it is what the model picked and the letter before it
# the measured winner among the forced algorithms: R ring, G gather_reduce, D
# recursive_doubling, H halving_doubling, T tree. Exits 0 whatever the fraction: it reports, it
# does not judge, because on a shared machine the spread between runs is often larger than 10%.
set -euo pipefail
DEAR_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

build=$DEAR_ROOT/build
ranks="2 3 4 5 6 7 8"
min=8
max=64M
factor=4
iters=10
warmup=2
min_time=100
tolerance=10
forced="ring gather_reduce recursive_doubling halving_doubling tree"
grid_only=0
out=check-auto

usage() {
  sed -n '2,27p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2 ;;
    --ranks) ranks=$2 ;;
    -b) min=$2 ;;
    -e) max=$2 ;;
    -f) factor=$2 ;;
    -n) iters=$2 ;;
    -w) warmup=$2 ;;
    --min_time_ms) min_time=$2 ;;
    --tolerance) tolerance=$2 ;;
    --out) out=$2 ;;
    --forced) forced=$2 ;;
    --grid-only)
      grid_only=1
      shift
      continue
      ;;
    -h | --help) usage ;;
    *)
      printf 'check-auto: unknown option %s\n' "$1" >&2
      usage
      ;;
  esac
  shift 2 || usage
done
run=$build/tools/dear-run
bench=$build/bench/dear-bench
model_tool=$build/bench/dear-model
for tool in "$run" "$bench" "$model_tool"; do
  [ -x "$tool" ] || {
    printf 'check-auto: %s is missing; build first (cmake --build %s)\n' "$tool" "$build" >&2
    exit 1
  }
done
mkdir -p "$out"
csv=$out/check-auto.csv
pred=$out/predicted.csv
start=$SECONDS
if [ "$grid_only" = 0 ]; then
printf 'check-auto: ranks %s, all_reduce %s..%s x%s, on %d cores -> %s\n' \
  "$ranks" "$min" "$max" "$factor" "$(nproc)" "$out" >&2

: >"$pred"
printf 'collective,nranks,size,algo,median_us\n' >"$csv"
for n in $ranks; do
  model=$out/model-$n.json
  printf '\r\033[K[ranks=%s] calibrating' "$n" >&2
  if ! "$run" -n "$n" --timeout 600 -- "$bench" --calibrate -e "$max" --json "$model" \
    >"$out/calibrate-$n.log" 2>&1; then
    printf '\ncheck-auto: calibration on %s ranks failed:\n' "$n" >&2
    tail -20 "$out/calibrate-$n.log" >&2
    exit 1
  fi
  "$model_tool" --model "$model" --ranks "$n" -b "$min" -e "$max" -f "$factor" |
    tail -n +2 >>"$pred"
  printf '\r\033[K[ranks=%s] timing %s auto' "$n" "$forced" >&2
  point=$out/point.csv
  rm -f "$point"
  if ! DEAR_COST_MODEL=$model "$run" -n "$n" --timeout 600 -- "$bench" all_reduce \
    -b "$min" -e "$max" -f "$factor" -n "$iters" -w "$warmup" --min_time_ms "$min_time" \
    --compare "$(printf '%s,' $forced)auto" --csv "$point" >"$out/compare-$n.log" 2>&1; then
    printf '\ncheck-auto: ranks=%s failed:\n' "$n" >&2
    tail -20 "$out/compare-$n.log" >&2
    exit 1
  fi
  tail -n +2 "$point" >>"$csv"
done
printf '\r\033[Kcheck-auto: measured in %d s; calibrations:\n' $((SECONDS - start)) >&2
fi
for n in $ranks; do
  grep -E '^(\[0\] )?# (alpha|fit error)' "$out/calibrate-$n.log" | sed "s/^/  ranks=$n /" >&2
done

# The sizes each calibration timed (its own grid, plus where it refined): grid points among
# them are counted apart, since there the model was fitted on the size itself.
sampled=$out/sampled.csv
: >"$sampled"
for n in $ranks; do
  jq -r --arg n "$n" '[.schedule_samples[][] | .bytes] | unique | .[] | "\($n),\(. | floor)"' \
    "$out/model-$n.json" >>"$sampled"
done

# collective(1),nranks(2),size(3),algo(4),median_us(5)
awk -F, -v tol="$tolerance" -v pred="$pred" -v forced="$forced" -v sampled="$sampled" '
  BEGIN {
    letter["ring"] = "R"; letter["gather_reduce"] = "G"; letter["recursive_doubling"] = "D"
    letter["halving_doubling"] = "H"; letter["tree"] = "T"
    nf = split(forced, algo, " ")
    while ((getline line < pred) > 0) {
      split(line, f, ",")
      choice[f[1] "," f[2]] = (f[5] in letter) ? letter[f[5]] : "?"
    }
    while ((getline line < sampled) > 0) {
      split(line, f, ",")
      calibrated[f[1] "," f[2]] = 1
    }
  }
  NR == 1 { next }
  {
    key = $2 "," $3
    time[$4 "," key] = $5 + 0
    if (!(($2) in seen_n)) { seen_n[$2] = 1; ns[++nn] = $2 }
    if (!(($3) in seen_s)) { seen_s[$3] = 1; ss[++ns_] = $3 }
  }
  END {
    printf "\nauto / best forced all_reduce median time; * = within %s%%; measured winner, then model choice; c = a size the calibration timed\n", tol
    printf "%10s", "bytes"
    for (i = 1; i <= nn; i++) printf " %12s", "n=" ns[i]
    printf "\n"
    pass = 0; total = 0
    for (j = 1; j <= ns_; j++) {
      printf "%10s", ss[j]
      for (i = 1; i <= nn; i++) {
        key = ns[i] "," ss[j]
        a = time["auto," key]
        best = ""; win = ""
        for (k = 1; k <= nf; k++) {
          t = time[algo[k] "," key]
          if (t == "") { best = ""; break }
          if (best == "" || t < best) { best = t; win = letter[algo[k]] }
        }
        if (best == "" || a == "") { printf " %12s", "-"; continue }
        winner[key] = win
        ratio = a / best
        ok = ratio <= 1 + tol / 100
        total++; pass += ok
        if (key in calibrated) { cal_total++; cal_pass += ok }
        printf " %s %5.2f%s %s%s", win, ratio, ok ? "*" : " ", choice[key], \
          (key in calibrated) ? "c" : " "
      }
      printf "\n"
    }
    agree = 0
    for (key in winner) agree += winner[key] == choice[key]
    printf "\nauto within %s%% of the best forced algorithm: %d of %d points (%.0f%%)\n", \
      tol, pass, total, total ? 100 * pass / total : 0
    printf "model picked the measured winner: %d of %d points (%.0f%%)\n", \
      agree, total, total ? 100 * agree / total : 0
    printf "points the calibration also timed (c): %d, %d of them within %s%%; the other points: %d of %d (%.0f%%)\n", \
      cal_total, cal_pass, tol, pass - cal_pass, total - cal_total, \
      total - cal_total ? 100 * (pass - cal_pass) / (total - cal_total) : 0
  }' "$csv" | tee "$out/grid.txt"
