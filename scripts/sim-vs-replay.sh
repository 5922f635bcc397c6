#!/usr/bin/env bash
# Validates the simulator against measured runs: for each rank count, dear-train replays a
# (scaled) model profile with every policy on real collectives over loopback, calibrating the
# ring step's alpha and beta on the same ranks first; dear-sim then simulates the same scaled
# profile with that network model on dear's interleaving engine, charging the optimizer at the
# rate the replay measured (dear-sim --optimizer-us-per-mparam). One table: policy, ranks,
# measured and simulated iteration time, and the simulator's error.
#
#   scripts/sim-vs-replay.sh [--build DIR] [-n "2 4"] [--model resnet50] [--time-scale 0.1]
#                            [--param-scale 0.1] [--iters 15] [--warmup 3] [--out DIR]
set -euo pipefail

prog=$(basename "$0")
build=./build
ranks="2 4"
model=resnet50
time_scale=0.1
param_scale=0.1
iters=15
warmup=3
compute=sleep
algo=ring
engine=interleaved
out=""
policies=all

usage() {
  cat <<USAGE
usage: $prog [options]

  --build DIR          build directory holding tools/dear-run and scheduler/dear-{train,sim}
                       (default ./build)
  -n, --ranks LIST     rank counts, space-separated (default "2 4"; "2 4 8" takes longer)
  --model NAME         profile name or file (default resnet50)
  --time-scale X       compute times multiplied by X (default 0.1)
  --param-scale X      tensor sizes multiplied by X (default 0.1)
  --iters N            timed iterations per policy (default 15)
  --warmup N           warm-up iterations per policy (default 3)
  --policies LIST      comma-separated, or all (default all)
  --compute MODE       dear-train compute replay: sleep or busy (default sleep)
  --algo ALGO          dear-train all_reduce algorithm; ring is what the simulator models
                       (default ring)
  --engine ENGINE      dear-sim engine: interleaved (dear's, default), policy or serial
  --out DIR            keep the JSON files in DIR (default: a temporary directory)
  -h, --help           this text
USAGE
}

while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2; shift 2 ;;
    -n | --ranks) ranks=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --time-scale) time_scale=$2; shift 2 ;;
    --param-scale) param_scale=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --policies) policies=$2; shift 2 ;;
    --compute) compute=$2; shift 2 ;;
    --algo) algo=$2; shift 2 ;;
    --engine) engine=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "$prog: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

run=$build/tools/dear-run
train=$build/scheduler/dear-train
sim=$build/scheduler/dear-sim
for b in "$run" "$train" "$sim"; do
  [ -x "$b" ] || { echo "$prog: $b not found; build it (--build DIR)" >&2; exit 1; }
done
command -v jq >/dev/null || { echo "$prog: needs jq" >&2; exit 1; }
if [ -z "$out" ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out"

rows=()
opt_rates=()
for n in $ranks; do
  echo "[$prog] $n ranks: dear-train --policy $policies ($iters timed iterations each)" >&2
  "$run" -n "$n" --timeout 1200 -- "$train" --model "$model" --policy "$policies" \
    --time-scale "$time_scale" --param-scale "$param_scale" --iterations "$iters" \
    --warmup "$warmup" --compute "$compute" --algo "$algo" --calibrate \
    --json "$out/train-$n.json" >"$out/train-$n.log" 2>&1 || {
    cat "$out/train-$n.log" >&2
    exit 1
  }
  alpha=$(jq -r .net.alpha_us "$out/train-$n.json")
  gap=$(jq -r .net.gap_us "$out/train-$n.json")
  overhead=$(jq -r '.net.op_overhead_us // 0' "$out/train-$n.json")
  wake=$(jq -r '.net.wake_us // 0' "$out/train-$n.json")
  gbps=$(jq -r .net.gbps "$out/train-$n.json")
  slice=$(jq -r .net.slice_bytes "$out/train-$n.json")
  names=$(jq -r '.policies | keys_unsorted | join(",")' "$out/train-$n.json")
  # The replay's optimizer rate, from the policy that applies it to every parameter on every
  # rank (dear, else the first measured): microseconds per million parameters per iteration.
  first=${names%%,*}
  opt=$(jq -r --arg p "$first" '(.policies.dear // .policies[$p]).optimizer_ms * 1000 /
    (.params / 1e6)' "$out/train-$n.json")
  opt_rates+=("$opt")
  echo "[$prog] $n ranks: measured alpha $alpha us, $gbps Gb/s, overhead $overhead us per operation, wake-up $wake us, optimizer $opt us/Mparam; dear-sim" >&2
  "$sim" --model "$model" --workers "$n" --time-scale "$time_scale" \
    --param-scale "$param_scale" --alpha-us "$alpha" --gap-us "$gap" --gbps "$gbps" \
    --slice-bytes "$slice" --engine "$engine" --optimizer-us-per-mparam "$opt" \
    --op-overhead-us "$overhead" --wake-us "$wake" \
    --policies "$names" --json >"$out/sim-$n.json"
  for p in ${names//,/ }; do
    m=$(jq -r ".policies[\"$p\"].iter_ms_p50" "$out/train-$n.json")
    s=$(jq -r ".policies[\"$p\"].iter_ms" "$out/sim-$n.json")
    rows+=("$p $n $alpha $wake $gbps $m $s")
  done
done

compute_ms=$(jq -r .compute_ms "$out/train-${ranks%% *}.json")
params=$(jq -r .params "$out/train-${ranks%% *}.json")
printf '\n%s x%s time, x%s params (%s parameters, compute %.2f ms/iteration), %s compute,\n' \
  "$model" "$time_scale" "$param_scale" "$params" "$compute_ms" "$compute"
printf 'all_reduce %s; dear-sim engine %s; measured = median of %s iterations;\n' \
  "$algo" "$engine" "$iters"
printf 'optimizer charged in the simulator at the replay'"'"'s measured rate (us per M parameters): %s\n\n' \
  "${opt_rates[*]}"
printf '%-14s %5s %9s %8s %8s %12s %12s %9s\n' policy ranks alpha_us wake_us Gb/s measured_ms \
  simulated_ms error
worst=0
within=0
for row in "${rows[@]}"; do
  read -r p n a w g m s <<<"$row"
  err=$(awk -v m="$m" -v s="$s" 'BEGIN { printf "%+.1f", (s - m) / m * 100 }')
  printf '%-14s %5s %9.1f %8.1f %8.2f %12.2f %12.2f %8s%%\n' "$p" "$n" "$a" "$w" "$g" "$m" "$s" \
    "$err"
  worst=$(awk -v w="$worst" -v e="$err" 'BEGIN { e = e < 0 ? -e : e; print (e > w ? e : w) }')
  within=$((within + $(awk -v e="$err" 'BEGIN { print (e <= 15 && e >= -15) ? 1 : 0 }')))
done
printf '\nwithin 15%%: %d of %d points; largest |error|: %s%% (target 15%%)\n' "$within" \
  "${#rows[@]}" "$worst"
