#!/usr/bin/env bash
# Latency study: dear-bench over TCP loopback (or emulated hosts, --netns) with an emulated
# one-way link delay (the link delay decorator, DEAR_LINK_DELAY_US), swept over rank counts,
# link delays, algorithms and message sizes. Writes one CSV: the sweep's parameters (delay_us,
# algo) followed by dear-bench's own CSV columns.
#
#   scripts/latency-study.sh [options]
#     --build DIR       build with tools/dear-run and bench/dear-bench (default: build)
#     --ranks "2 4 8"   rank counts
#     --delays "0 25 100"  one-way link delays in microseconds
#     --algos "auto ring gather_reduce recursive_doubling halving_doubling tree"
#                       all_reduce algorithms (dear-bench --algo)
#     --collective C    all_reduce (default), reduce_scatter, all_gather or broadcast
#     -b 8 -e 1M -f 8   smallest size, largest size, step factor (dear-bench's)
#     -n 20 -w 5        timed and warm-up iterations per size
#     --min_time_ms 50  time at least this long per size (small sizes get more iterations)
#     --netns           run each rank on its own emulated host (scripts/netns-cluster.sh,
#                       needs root) instead of on loopback; the hosts are removed at the end
#     --rate 10gbit     --netns: each host link's rate (tbf)
#     --out FILE        CSV to write (default: latency-study.csv)
#     --plots DIR       calibrate the cost model for every rank count and delay before its
#                       sweep (dear-bench --calibrate: DIR/model-nN-dD.json; auto then runs
#                       with DEAR_COST_MODEL set to it) and write (default: the CSV's name
#                       with -plots):
#                       - DIR/predicted.csv: the model's time for every schedule and auto's
#                         choice at the measured points (dear-model);
#                       - DIR/model-error.txt: model against measurement, each point's
#                         relative error and the median absolute relative error;
#                       - DIR/modelled-to-1024.csv: the model alone, 2..--model-ranks ranks,
#                         from each delay's calibration at the largest measured rank count;
#                       - with gnuplot, per delay: time-vs-ranks-delayD.png (measured points of
#                         every algorithm, the model's lines of every schedule) and
#                         modelled-to-1024-delayD.png (model only, marked as such)
#     --model-ranks 1024  how far the modelled-only curves go
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
algos="auto ring gather_reduce recursive_doubling halving_doubling tree"
collective=all_reduce
min=8
max=1M
factor=8
iters=20
warmup=5
min_time=50
out=latency-study.csv
plots=
no_plots=0
netns=0
rate=10gbit
model_ranks=1024

usage() {
  sed -n '2,40p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
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
    --min_time_ms) min_time=$2 ;;
    --out) out=$2 ;;
    --plots) plots=$2 ;;
    --rate) rate=$2 ;;
    --model-ranks) model_ranks=$2 ;;
    --netns)
      netns=1
      shift
      continue
      ;;
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
netns_script=$DEAR_ROOT/scripts/netns-cluster.sh
export DEAR_NETNS_PREFIX=${DEAR_NETNS_PREFIX:-dear-study}
cleanup() {
  [ "$netns" = 1 ] && bash "$netns_script" down >/dev/null 2>&1
  rm -rf "$tmp"
}
trap cleanup EXIT

read -r -a rank_list <<<"$ranks"
read -r -a delay_list <<<"$delays"
read -r -a algo_list <<<"$algos"
total=$((${#rank_list[@]} * ${#delay_list[@]} * ${#algo_list[@]}))
where=loopback
if [ "$netns" = 1 ]; then
  max_ranks=$(printf '%s\n' "${rank_list[@]}" | sort -n | tail -1)
  bash "$netns_script" up "$max_ranks" --rate "$rate" >"$tmp/netns.log" 2>&1 || {
    printf 'latency-study: --netns: cannot build %s emulated hosts:\n' "$max_ranks" >&2
    cat "$tmp/netns.log" >&2
    exit 1
  }
  where="$max_ranks emulated hosts at $rate"
fi
printf 'latency-study: %d points of %s, %s..%s x%s, over %s, on %d cores -> %s\n' \
  "$total" "$collective" "$min" "$max" "$factor" "$where" "$(nproc)" "$out" >&2

# launch N DELAY_US cmd...: N ranks of cmd with that link delay, on loopback (dear-run) or one
# rank per emulated host; output (rank-prefixed for dear-run) on stdout. Non-zero if any rank
# failed.
launch() {
  local n=$1 d=$2
  shift 2
  if [ "$netns" = 0 ]; then
    "$run" -n "$n" --link-delay "${d}us" --timeout 600 -- "$@"
    return
  fi
  # Rank 0 listens on host 0; the id carries a fresh secret, as dear-run's does.
  local secret port r rc=0 pids=()
  secret=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
  port=$((20000 + RANDOM % 20000))
  for ((r = 0; r < n; r++)); do
    DEAR_UNIQUE_ID="$(bash "$netns_script" addr 0):$port:$secret" DEAR_RANK=$r \
      DEAR_WORLD_SIZE=$n DEAR_LOCAL_RANK=0 DEAR_LOCAL_SIZE=1 DEAR_LINK_DELAY_US=$d \
      DEAR_TIMEOUT=600 bash "$netns_script" exec "$r" "$@" >"$tmp/rank$r.log" 2>&1 &
    pids+=($!)
  done
  for r in "${!pids[@]}"; do wait "${pids[$r]}" || rc=1; done
  for ((r = 0; r < n; r++)); do sed "s/^/[$r] /" "$tmp/rank$r.log"; done
  return $rc
}

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
      if ! launch "$n" "$d" "$bench" --calibrate -e "$max" --json "$model" >"$tmp/calibrate.log" 2>&1; then
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
      if ! (
        [ ${#model_env[@]} = 0 ] || export "${model_env[@]}"
        launch "$n" "$d" "$bench" "$collective" -b "$min" -e "$max" -f "$factor" -n "$iters" \
          -w "$warmup" --min_time_ms "$min_time" -c 1 --algo "$a" --csv "$csv"
      ) >"$tmp/point.log" 2>&1; then
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

# Model against measurement. A point's measured time is the smaller of dear-bench's
# out-of-place and in-place times (each the slowest rank's mean); auto is compared with the
# prediction of the schedule the model chose. Study CSV: delay_us(1),algo(2),library,collective,
# nranks(5),size(6),...,oop_time_us(12),...,ip_time_us(18).
errors=$plots/model-error.txt
awk -F, -v pred="$pred" '
  BEGIN {
    while ((getline line < pred) > 0) {
      split(line, f, ",")
      if (f[1] == "delay_us") continue
      key = f[1] "," f[2] "," f[3]
      t[key "," f[4]] = f[5]
      choice[key] = f[6]
    }
  }
  NR == 1 { next }
  {
    m = ($12 + 0 < $18 + 0) ? $12 + 0 : $18 + 0
    key = $1 "," $5 "," $6
    s = ($2 == "auto") ? choice[key] : $2
    if (!((key "," s) in t) || m <= 0) next
    p = t[key "," s]
    e = (p - m) / m
    a = e < 0 ? -e : e
    all[++k] = a
    by[$2, ++nb[$2]] = a
    printf "%8s %6s %10s %-19s %-19s %12.2f %12.2f %+8.1f%%\n", $1, $5, $6, $2, s, m, p, 100 * e
  }
  function median(arr, len,   i, j, x, v) {
    for (i = 1; i <= len; i++) v[i] = arr[i]
    for (i = 2; i <= len; i++) { x = v[i]; for (j = i - 1; j >= 1 && v[j] > x; j--) v[j + 1] = v[j]; v[j + 1] = x }
    return len % 2 ? v[(len + 1) / 2] : (v[len / 2] + v[len / 2 + 1]) / 2
  }
  END {
    printf "\nmedian absolute relative error of the model: %.1f%% over %d points\n", \
      k ? 100 * median(all, k) : 0, k
    for (a in nb) {
      delete one
      for (i = 1; i <= nb[a]; i++) one[i] = by[a, i]
      printf "  %-19s %.1f%% over %d points\n", a, 100 * median(one, nb[a]), nb[a]
    }
  }' "$out" >"$tmp/errors"
{
  printf '# model vs measurement: measured = min(out-of-place, in-place) time, auto against\n'
  printf '# the prediction for the schedule it chose\n'
  printf '%8s %6s %10s %-19s %-19s %12s %12s %9s\n' delay_us nranks size algo schedule \
    measured_us model_us error
  cat "$tmp/errors"
} >"$errors"
sed -n '/^median/,$p' "$errors" | sed 's/^/latency-study: /' >&2

# The model alone, to --model-ranks: for each delay, the calibration at the largest measured
# rank count (the nearest to the modelled ones).
largest=$(printf '%s\n' "${rank_list[@]}" | sort -n | tail -1)
modelled=$plots/modelled-to-$model_ranks.csv
printf 'delay_us,nranks,size,algo,predicted_us,auto_choice\n' >"$modelled"
for d in "${delay_list[@]}"; do
  "$model_tool" --model "$plots/model-n$largest-d$d.json" --ranks "2..$model_ranks" -b "$min" \
    -e "$max" -f "$factor" | tail -n +2 | sed "s/^/$d,/" >>"$modelled"
done
printf 'latency-study: modelled (not measured) times to %s ranks in %s\n' "$model_ranks" \
  "$modelled" >&2

if ! command -v gnuplot >/dev/null; then
  # shellcheck source=lib.sh
  . "$DEAR_ROOT/scripts/lib.sh"
  printf 'latency-study: gnuplot not found, so no PNGs (install %s); the CSV and JSON are written\n' \
    "${DEAR_STUDY_PACKAGES[*]}" >&2
  exit 0
fi
# One data file per (delay, size, algorithm): "ranks time_us", measured, predicted at the
# measured rank counts, and modelled to --model-ranks.
dat=$tmp/plot
mkdir -p "$dat"
awk -F, -v dir="$dat" 'NR > 1 {
    f = dir "/m-" $1 "-" $6 "-" $2 ".dat"; print $5, ($12 + 0 < $18 + 0) ? $12 : $18 >> f }' "$out"
for kind in p:"$pred" l:"$modelled"; do
  awk -F, -v dir="$dat" -v k="${kind%%:*}" 'NR > 1 {
      print $2, $5 >> (dir "/" k "-" $1 "-" $3 "-" $4 ".dat")
      if ($4 == $6) print $2, $5 >> (dir "/" k "-" $1 "-" $3 "-auto.dat")
    }' "${kind#*:}"
done
for f in "$dat"/*.dat; do sort -n -o "$f" "$f"; done
sizes=$(awk -F, 'NR > 1 { print $6 }' "$out" | sort -n -u)
nsizes=$(printf '%s\n' "$sizes" | wc -l)
cols=$(((nsizes + 1) / 2))
[ "$cols" -ge 1 ] || cols=1
schedules=(ring gather_reduce recursive_doubling halving_doubling tree)
declare -A color=([ring]="#1b9e77" [gather_reduce]="#d95f02" [auto]="#7570b3"
  [recursive_doubling]="#e7298a" [halving_doubling]="#66a61e" [tree]="#a6761d")
for d in "${delay_list[@]}"; do
  png=$plots/time-vs-ranks-delay$d.png
  {
    printf 'set terminal pngcairo size %d,900 font ",9" noenhanced\n' $((cols * 420))
    printf 'set output "%s"\n' "$png"
    printf 'set multiplot layout 2,%d title "%s over %s, link delay %s us: measured points, cost-model lines (%d cores)"\n' \
      "$cols" "$collective" "$where" "$d" "$(nproc)"
    printf 'set logscale y\nset xlabel "ranks"\nset ylabel "time (us)"\n'
    printf 'set key top left reverse Left font ",7" spacing 0.8\nset logscale x 2\n'
    for size in $sizes; do
      printf 'set title "%s bytes"\n' "$size"
      plot=()
      for a in "${algo_list[@]}"; do
        m=$dat/m-$d-$size-$a.dat
        [ -s "$m" ] && plot+=("\"$m\" using 1:2 with points pt 7 lc rgb \"${color[$a]:-black}\" title \"$a\"")
      done
      for a in "${schedules[@]}"; do
        p=$dat/p-$d-$size-$a.dat
        [ -s "$p" ] && plot+=("\"$p\" using 1:2 with lines dt 2 lc rgb \"${color[$a]}\" title \"model $a\"")
      done
      (IFS=,; printf 'plot %s\n' "${plot[*]}")
    done
    printf 'unset multiplot\n'
  } >"$tmp/plot.gp"
  gnuplot "$tmp/plot.gp"
  png=$plots/modelled-to-$model_ranks-delay$d.png
  {
    printf 'set terminal pngcairo size %d,900 font ",9" noenhanced\n' $((cols * 420))
    printf 'set output "%s"\n' "$png"
    printf 'set multiplot layout 2,%d title "MODELLED, NOT MEASURED: %s, link delay %s us, cost model calibrated on %d ranks over %s; auto = the model'"'"'s choice"\n' \
      "$cols" "$collective" "$d" "$largest" "$where"
    printf 'set logscale x 2\nset logscale y\nset xrange [2:%d]\n' "$model_ranks"
    printf 'set xlabel "ranks (modelled)"\nset ylabel "predicted time (us)"\n'
    printf 'set key top left reverse Left font ",7" spacing 0.8\n'
    for size in $sizes; do
      printf 'set title "%s bytes (model)"\n' "$size"
      plot=()
      for a in "${schedules[@]}"; do
        l=$dat/l-$d-$size-$a.dat
        [ -s "$l" ] && plot+=("\"$l\" using 1:2 with linespoints pt 6 ps 0.6 lc rgb \"${color[$a]}\" title \"model $a\"")
      done
      l=$dat/l-$d-$size-auto.dat
      [ -s "$l" ] && plot+=("\"$l\" using 1:2 with lines lw 3 dt 3 lc rgb \"${color[auto]}\" title \"model auto\"")
      (IFS=,; printf 'plot %s\n' "${plot[*]}")
    done
    printf 'unset multiplot\n'
  } >"$tmp/plot.gp"
  gnuplot "$tmp/plot.gp"
done
printf 'latency-study: plots in %s\n' "$plots" >&2
