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
#     --plots DIR       calibrate the cost model for every rank count and delay before its
#                       sweep (dear-bench --calibrate: DIR/model-nN-dD.json; auto then runs
#                       with DEAR_COST_MODEL set to it), write the model's predictions
#                       (DIR/predicted.csv) and, with gnuplot, one PNG per delay: time against
#                       rank count for each size, measured ring / gather_reduce / auto points
#                       and the model's lines (default: the CSV's name with -plots)
#     --no-plots        neither calibrate nor plot (auto uses the size threshold)
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
plots=
no_plots=0

usage() {
  sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
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
    --plots) plots=$2 ;;
    --no-plots)
      no_plots=1
      shift
      continue
      ;;
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
model_tool=$build/bench/dear-model
[ -n "$plots" ] || plots=${out%.csv}-plots
tools=("$run" "$bench")
[ "$no_plots" = 1 ] || tools+=("$model_tool")
for tool in "${tools[@]}"; do
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
mkdir -p "$(dirname "$out")"
: >"$out"
pred=$plots/predicted.csv
if [ "$no_plots" = 0 ]; then
  mkdir -p "$plots"
  printf 'delay_us,nranks,size,algo,predicted_us,auto_choice\n' >"$pred"
fi
for n in "${rank_list[@]}"; do
  for d in "${delay_list[@]}"; do
    # The cost model of these ranks and this delay, for auto and for the plots' lines.
    model_env=()
    if [ "$no_plots" = 0 ]; then
      printf '\r\033[K[%d/%d] ranks=%s delay=%sus calibrating' "$point" "$total" "$n" "$d" >&2
      model=$plots/model-n$n-d$d.json
      if ! "$run" -n "$n" --link-delay "${d}us" --timeout 600 -- "$bench" --calibrate \
        --json "$model" >"$tmp/calibrate.log" 2>&1; then
        printf '\nlatency-study: calibration ranks=%s delay=%sus failed:\n' "$n" "$d" >&2
        tail -20 "$tmp/calibrate.log" >&2
        exit 1
      fi
      "$model_tool" --model "$model" --ranks "$n" -b "$min" -e "$max" -f "$factor" |
        tail -n +2 | sed "s/^/$d,/" >>"$pred"
      model_env=("DEAR_COST_MODEL=$model")
    fi
    for a in "${algo_list[@]}"; do
      point=$((point + 1))
      printf '\r\033[K[%d/%d] ranks=%s delay=%sus algo=%s' "$point" "$total" "$n" "$d" "$a" >&2
      csv=$tmp/point.csv
      rm -f "$csv"
      if ! env "${model_env[@]}" "$run" -n "$n" --link-delay "${d}us" --timeout 600 -- \
        "$bench" "$collective" \
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

[ "$no_plots" = 1 ] && exit 0
printf 'latency-study: cost models and their predictions in %s\n' "$plots" >&2

if ! command -v gnuplot >/dev/null; then
  # shellcheck source=lib.sh
  . "$DEAR_ROOT/scripts/lib.sh"
  printf 'latency-study: gnuplot not found, so no PNGs (install %s); the CSV and JSON are written\n' \
    "${DEAR_STUDY_PACKAGES[*]}" >&2
  exit 0
fi
# One data file per (delay, size, algorithm): "ranks time_us", measured and predicted. Study
# CSV: delay_us(1),algo(2),library,collective,nranks(5),size(6),...,oop_time_us(12).
dat=$tmp/plot
mkdir -p "$dat"
awk -F, -v dir="$dat" 'NR > 1 { f = dir "/m-" $1 "-" $6 "-" $2 ".dat"; print $5, $12 >> f }' "$out"
awk -F, -v dir="$dat" 'NR > 1 { f = dir "/p-" $1 "-" $3 "-" $4 ".dat"; print $2, $5 >> f }' "$pred"
for f in "$dat"/*.dat; do sort -n -o "$f" "$f"; done
sizes=$(awk -F, 'NR > 1 { print $6 }' "$out" | sort -n -u)
nsizes=$(printf '%s\n' "$sizes" | wc -l)
cols=$(((nsizes + 1) / 2))
[ "$cols" -ge 1 ] || cols=1
declare -A color=([ring]="#1b9e77" [gather_reduce]="#d95f02" [auto]="#7570b3")
for d in "${delay_list[@]}"; do
  png=$plots/time-vs-ranks-delay$d.png
  {
    printf 'set terminal pngcairo size %d,900 font ",9" noenhanced\n' $((cols * 420))
    printf 'set output "%s"\n' "$png"
    printf 'set multiplot layout 2,%d title "%s, link delay %s us: measured points, cost-model lines"\n' \
      "$cols" "$collective" "$d"
    printf 'set logscale y\nset xlabel "ranks"\nset ylabel "time (us)"\nset key top left\n'
    printf 'set xtics 1\n'
    for size in $sizes; do
      printf 'set title "%s bytes"\n' "$size"
      plot=()
      for a in "${algo_list[@]}"; do
        m=$dat/m-$d-$size-$a.dat
        [ -s "$m" ] && plot+=("\"$m\" using 1:2 with points pt 7 lc rgb \"${color[$a]}\" title \"$a\"")
      done
      for a in ring gather_reduce; do
        p=$dat/p-$d-$size-$a.dat
        [ -s "$p" ] && plot+=("\"$p\" using 1:2 with lines dt 2 lc rgb \"${color[$a]}\" title \"model $a\"")
      done
      (IFS=,; printf 'plot %s\n' "${plot[*]}")
    done
    printf 'unset multiplot\n'
  } >"$tmp/plot.gp"
  gnuplot "$tmp/plot.gp"
done
printf 'latency-study: plots in %s\n' "$plots" >&2
