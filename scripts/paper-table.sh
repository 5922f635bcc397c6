#!/usr/bin/env bash
# The paper-scale table from the simulator: every policy of dear-sim on the five shipped model
# profiles and both network models at 64 workers, as one Markdown table per network:
# throughput (samples/s) of every policy, plain DeAR's speedup over the best of the baselines
# the paper compares with (WFBP, DDP-style buckets, ByteScheduler-style, MG-WFBP), our
# variants' speedup over plain DeAR, and every policy's efficiency against the ideal-overlap
# bound. The paper (arXiv 2302.12445) reports up to 1.83x over the best prior method on 64 GPUs
# over 10 Gb/s Ethernet and 1.15x over 100 Gb/s InfiniBand. These are modelled numbers, not
# measurements.
#
#   scripts/paper-table.sh [--build DIR] [--workers 64] [--nets "10gbe 100gib"]
#                          [--models "resnet50 densenet201 inceptionv4 bert_base bert_large"]
#                          [--optimizer-us-per-mparam X] [--out DIR]
set -euo pipefail

prog=$(basename "$0")
build=./build
workers=64
nets="10gbe 100gib"
models="resnet50 densenet201 inceptionv4 bert_base bert_large"
optimizer=0
out=""

usage() {
  sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2 ;;
    --workers) workers=$2 ;;
    --nets) nets=$2 ;;
    --models) models=$2 ;;
    --optimizer-us-per-mparam) optimizer=$2 ;;
    --out) out=$2 ;;
    -h | --help) usage ;;
    *)
      printf '%s: unknown option %s\n' "$prog" "$1" >&2
      usage
      ;;
  esac
  shift 2 || usage
done
sim=$build/scheduler/dear-sim
[ -x "$sim" ] || { printf '%s: %s not found; build it (--build DIR)\n' "$prog" "$sim" >&2; exit 1; }
command -v jq >/dev/null || { printf '%s: needs jq\n' "$prog" >&2; exit 1; }
if [ -z "$out" ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out"

baselines="wfbp ddp bytescheduler mgwfbp"
ours="dear_prio dear_eager dear_shard dear_auto dear_plus"
for net in $nets; do
  printf '\n### %s workers, %s (modelled; optimizer %s us per M parameters)\n\n' "$workers" \
    "$net" "$optimizer"
  header=""
  for m in $models; do
    json=$out/$m-$net.json
    printf '\r\033[K[%s] %s %s' "$prog" "$net" "$m" >&2
    "$sim" --model "$m" --workers "$workers" --net "$net" \
      --optimizer-us-per-mparam "$optimizer" --json >"$json"
    if [ -z "$header" ]; then
      header=$(jq -r '.policies | keys_unsorted | join(" ")' "$json")
      printf '| model | bound ms |'
      for p in $header; do printf ' %s |' "$p"; done
      printf ' dear / best baseline | best of ours / dear |\n|---|---|'
      for p in $header; do printf -- '---|'; done
      printf -- '---|---|\n'
    fi
    # Per policy: samples/s (efficiency against the bound); then the speedups.
    jq -r --arg base "$baselines" --arg ours "$ours" '
      . as $r
      | ($base | split(" ")) as $b | ($ours | split(" ")) as $o
      | ([$b[] | $r.policies[.].iter_ms // empty] | min) as $best_base
      | ([$o[] | $r.policies[.].iter_ms // empty] | min) as $best_ours
      | ([$o[] | select($r.policies[.].iter_ms == $best_ours)] | first) as $which
      | "| \(.model) | \(.bound_ms | . * 10 | round / 10) |"
        + ([.policies | to_entries[] | " \(.value.samples_per_s | round) (\(.value.efficiency
            * 100 | round)%) |"] | join(""))
        + " \($best_base / .policies.dear.iter_ms | . * 100 | round / 100)x |"
        + " \(.policies.dear.iter_ms / $best_ours | . * 100 | round / 100)x (\($which)) |"
    ' "$json"
  done
  printf '\r\033[K' >&2
done
printf '\nCells: samples/s (efficiency against the ideal-overlap bound). "dear / best baseline" is\n'
printf 'the best baseline'"'"'s iteration time over plain DeAR'"'"'s (> 1: DeAR is faster); "best of\n'
printf 'ours / dear" is plain DeAR'"'"'s over the fastest of %s.\n' "$ours"
