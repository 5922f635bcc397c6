#!/usr/bin/env bash
# dear-bench's transport flags end to end (tests/report.cmake):
#   dear_bench_transport_flags.sh DEAR_RUN DEAR_BENCH PYTHON [fabric]
# - --fabric-provider and --ib-device are refused, on every rank that gets to say it, where the
#   run's transport is another one (exit status 2, the flag and the transport named);
# - with "fabric": --fabric-provider reaches the library. A provider that does not exist fails
#   the job naming it; shm runs a checked sweep with 0 wrong elements and the JSON's meta names
#   it. Where libfabric offers no shm, says so (the test is then skipped).
set -uo pipefail
run=$1 bench=$2 python=$3 fabric=${4:-}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

fail() {
  echo "FAIL: $*"
  exit 1
}

# expect_refused TRANSPORT FLAG VALUE WANTS
expect_refused() {
  local out rc
  out=$("$run" -n 2 "$bench" all_reduce -b 8 -e 8 --transport "$1" "$2" "$3" 2>&1)
  rc=$?
  [ "$rc" = 2 ] || fail "--transport $1 $2 $3: exit status $rc, not 2: $out"
  grep -q "dear-bench: rank [01]: $2 '$3' applies to --transport $4, and this run's transport is $1" \
    <<<"$out" || fail "--transport $1 $2 $3: no rank said why: $out"
}
expect_refused tcp --fabric-provider shm fabric
expect_refused tcp --ib-device mlx5_0 verbs
[ "$fabric" = fabric ] || exit 0
expect_refused fabric --ib-device mlx5_0 verbs

if out=$("$run" -n 2 "$bench" all_reduce -b 8 -e 8 --transport fabric \
  --fabric-provider no-such-provider 2>&1); then
  fail "a provider that does not exist ran: $out"
fi
grep -q "provider 'no-such-provider' is not available" <<<"$out" ||
  fail "the unknown provider was not named: $out"

if ! out=$("$run" -n 2 "$bench" all_gather -b 1K -e 64K -f 8 -n 2 -w 1 -c 1 --transport fabric \
  --fabric-provider shm --json "$dir/r.json" 2>&1); then
  if grep -q "provider 'shm' is not available" <<<"$out"; then
    echo "libfabric provider shm is not available here"
    exit 0
  fi
  fail "the shm run failed: $out"
fi
"$python" - "$dir/r.json" <<'EOF' || fail "the shm run's JSON"
import json
import sys

d = json.load(open(sys.argv[1]))
if d["meta"].get("fabric_provider") != "shm":
    sys.exit(f"meta names provider {d['meta'].get('fabric_provider')!r}, not 'shm'")
rows = d["rows"]
if [r["count"] * 4 for r in rows] != [1024, 8192, 65536]:
    sys.exit(f"rows {[r['count'] for r in rows]}, not 1K, 8K and 64K of floats")
for r in rows:
    for p in ("oop", "ip"):
        if r[p]["wrong"] != 0:
            sys.exit(f"{r['count']} elements, {p}: {r[p]['wrong']} wrong")
print(f"shm: {len(rows)} sizes, 0 wrong")
EOF
