#!/usr/bin/env bash
# scripts/compare-peers.sh end to end at its smallest (tests/report.cmake):
#   compare_peers_smoke.sh BUILD_DIR
# dear and Open MPI, 2 ranks, 8 and 16 bytes, two alternating rounds. The script must exit 0
# and print the merged table and the 8 B target line, whose per-round ratios are checked
# against the JSON each run wrote: round k's dear time over the faster of Open MPI's bound and
# unbound runs of round k.
set -uo pipefail
build=$1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

fail() {
  echo "FAIL: $*"
  exit 1
}

out=$(bash "$root/scripts/compare-peers.sh" --build "$build" -n 2 -b 8 -e 16 --only dear,mpi \
  --rounds 2 --tcp-cc system --min-time 0 --iters 3 --warmup 1 --collectives all_reduce \
  --out "$dir" 2>&1)
rc=$?
echo "$out"
[ "$rc" = 0 ] || fail "compare-peers.sh exited $rc"
grep -Eq '^ +8 +[0-9.]+ +[0-9.]+ +[0-9.]+~? +[0-9.]+ +[0-9.]+$' <<<"$out" ||
  fail "no 8 B row with dear, mpi and the ratio"
line=$(grep '^# target all_reduce 8 B time, dear <= 1 x mpi: ' <<<"$out") ||
  fail "no 8 B target line"
python3 - "$dir" "$line" <<'PY' || exit 1
import json, os, re, sys

out_dir, line = sys.argv[1], sys.argv[2]
m = re.search(r"; by round: ([0-9.]+) ([0-9.]+) \(met in ([0-2]) of 2\)$", line)
if not m:
    sys.exit(f"FAIL: no per-round ratios in: {line}")


def time_at(name, size):
    path = os.path.join(out_dir, name + ".json")
    if not os.path.exists(path):
        return None
    for row in json.load(open(path))["rows"]:
        if row["size"] == size:
            res = row.get("oop") or row.get("ip")
            return res["time_us"]
    return None


want = []
for k in (1, 2):
    sfx = f".r{k}" if k > 1 else ""
    dear = time_at("dear-all_reduce" + sfx, 8)
    mpi = [t for t in (time_at("mpi-all_reduce" + sfx, 8),
                       time_at("mpi-all_reduce.unbound" + sfx, 8)) if t is not None]
    if dear is None or not mpi:
        sys.exit(f"FAIL: round {k} left no 8 B result of dear or mpi in {out_dir}")
    want.append(dear / min(mpi))
got = [float(m.group(1)), float(m.group(2))]
for k, (g, w) in enumerate(zip(got, want), 1):
    if abs(g - w) > 0.005 + 1e-9 * w:
        sys.exit(f"FAIL: round {k}: printed {g:.2f}, the JSON gives {w:.4f}")
met = sum(1 for w in want if w <= 1.0)
if int(m.group(3)) != met:
    sys.exit(f"FAIL: printed met in {m.group(3)} of 2, the JSON gives {met}")
print(f"per-round ratios match the runs' JSON: {want[0]:.4f} {want[1]:.4f}")
PY
echo "compare-peers smoke: ok"
