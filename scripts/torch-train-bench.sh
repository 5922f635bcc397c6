#!/usr/bin/env bash
# PyTorch training throughput per policy (bench/torch_train_bench.py: dear's DeAR, WFBP and
# bucketed policies against torch DDP over Gloo, interleaved in one job), for each rank count,
# on TCP loopback or on rate-shaped emulated hosts.
#
#   scripts/torch-train-bench.sh [options] [-- bench options...]
#     --build DIR       build with tools/dear-run and the Python package (default: build)
#     -n "2 4"          rank counts, one job each
#     --netns RATE      one rank per emulated host (scripts/netns-cluster.sh, needs root), each
#                       host's link shaped to RATE (tbf, e.g. 1gbit) in both directions; every
#                       byte of dear's and of Gloo's traffic crosses the shaped links. The hosts
#                       are removed at the end, also on failure or interrupt.
#     --out DIR         each job's JSON (torch-train-nN-LINK.json; default: torch-train)
#     --python PY       interpreter with torch (default: /usr/bin/python3)
#     --timeout S       per job (default: 1800)
#
# Example (communication-bound: a 16.8 M-parameter MLP at 2 samples per rank, 1 Gb/s links):
#   scripts/torch-train-bench.sh --build build --netns 1gbit -n "2 4" -- --model mlp --batch 2
#
# Without --netns the ranks run under dear-run on loopback, where nothing limits the links but
# the CPUs. dear's own link delay (DEAR_LINK_DELAY_US) is deliberately not offered: it slows
# dear's links only, not Gloo's, so it cannot give a fair ratio to DDP over Gloo.
set -euo pipefail
DEAR_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

build=$DEAR_ROOT/build
ranks="2 4"
rate=
out=torch-train
python=/usr/bin/python3
timeout=1800
usage() {
  sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=${2:?}; shift 2 ;;
    -n) ranks=${2:?}; shift 2 ;;
    --netns) rate=${2:?}; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    --python) python=${2:?}; shift 2 ;;
    --timeout) timeout=${2:?}; shift 2 ;;
    --) shift; break ;;
    -h | --help) usage ;;
    *) printf 'torch-train-bench: unknown option %s\n' "$1" >&2; usage ;;
  esac
done
build=$(cd "$build" && pwd)
run=$build/tools/dear-run
if [ ! -x "$run" ] || [ ! -d "$build/python/dear" ]; then
  printf 'torch-train-bench: %s lacks tools/dear-run or python/dear; build the targets dear-run and dear_python\n' "$build" >&2
  exit 1
fi
bench=$DEAR_ROOT/bench/torch_train_bench.py
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH=$build/python${PYTHONPATH:+:$PYTHONPATH}

netns_script=$DEAR_ROOT/scripts/netns-cluster.sh
export DEAR_NETNS_PREFIX=${DEAR_NETNS_PREFIX:-dear-torch}
tmp=$(mktemp -d)
cleanup() {
  if [ -n "$rate" ]; then bash "$netns_script" down >/dev/null 2>&1 || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

link=loopback
if [ -n "$rate" ]; then
  link=$rate
  read -r -a rank_list <<<"$ranks"
  max_ranks=$(printf '%s\n' "${rank_list[@]}" | sort -n | tail -1)
  bash "$netns_script" up "$max_ranks" --rate "$rate" >"$tmp/netns.log" 2>&1 || {
    printf 'torch-train-bench: cannot build %s emulated hosts:\n' "$max_ranks" >&2
    cat "$tmp/netns.log" >&2
    exit 1
  }
fi

# launch N cmd...: N ranks of cmd, rank-prefixed output on stdout; non-zero if any failed.
launch() {
  local n=$1
  shift
  if [ -z "$rate" ]; then
    # Gloo on loopback too, whatever the host name resolves to.
    "$run" -n "$n" --timeout "$timeout" --env GLOO_SOCKET_IFNAME=lo -- "$@"
    return
  fi
  # Rank 0 listens on host 0 (dear's rendezvous and torch's store); a fresh secret, as
  # dear-run's. Gloo is told to use the emulated host's interface, not the host name.
  local secret port r rc=0 pids=() host0
  secret=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
  port=$((20000 + RANDOM % 20000))
  host0=$(bash "$netns_script" addr 0)
  for ((r = 0; r < n; r++)); do
    DEAR_UNIQUE_ID="$host0:$port:$secret" DEAR_RANK=$r DEAR_WORLD_SIZE=$n DEAR_LOCAL_RANK=0 \
      DEAR_LOCAL_SIZE=1 MASTER_ADDR=$host0 GLOO_SOCKET_IFNAME=eth0 \
      timeout "$timeout" bash "$netns_script" exec "$r" "$@" >"$tmp/rank$r.log" 2>&1 &
    pids+=($!)
  done
  for r in "${!pids[@]}"; do wait "${pids[$r]}" || rc=1; done
  for ((r = 0; r < n; r++)); do sed "s/^/[$r] /" "$tmp/rank$r.log"; done
  return $rc
}

printf 'torch-train-bench: ranks %s over %s, %d cores\n' "$ranks" \
  "${rate:+emulated hosts at }$link" "$(nproc)" >&2
jsons=()
for n in $ranks; do
  json=$out/torch-train-n$n-$link.json
  rm -f "$json"
  launch "$n" "$python" "$bench" --link "$link" --json "$json" "$@"
  jsons+=("$json")
done

# One Markdown table of all jobs: medians over rounds, (min-max) for the spread.
"$python" - "${jsons[@]}" <<'PY'
import json, sys
print("\n| model | policy | ranks | link | samples/s median (min-max) | ratio to DDP/Gloo median (min-max) |")
print("| --- | --- | --- | --- | --- | --- |")
for path in sys.argv[1:]:
    for r in json.load(open(path))["rows"]:
        s, q = r["samples_per_s"], r.get("ratio_to_ddp_gloo")
        ratio = f"{r['median_ratio']:.2f} ({min(q):.2f}-{max(q):.2f})" if q else "-"
        print(f"| {r['model']} | {r['policy']} | {r['ranks']} | {r['link']} | "
              f"{r['median_samples_per_s']:.2f} ({min(s):.2f}-{max(s):.2f}) | {ratio} |")
PY
