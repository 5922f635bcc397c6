#!/usr/bin/env bash
# Runs dear-bench, Open MPI (mpi-bench) and Gloo (gloo-bench) one after another on the same
# sizes and rank count, then prints one merged table per collective: time and busbw per
# library and dear's ratio to the best peer. All three print the same nccl-tests rows through
# bench/report.h; this script only launches them and joins their --json files.
#
#   scripts/compare-peers.sh [--build DIR] [-n RANKS] [-b MIN] [-e MAX] [--iters N] [--min-time MS]
#                            [--only dear,mpi,gloo] [--fabric] [--out DIR] [--extra-dear "ARGS"]
#                            [--bind best|spread|none] [--tcp-cc same|system|own]
#
# Each library's column is its out-of-place result, or in-place where it has no out-of-place
# form (Gloo's all_reduce and reduce_scatter); such cells are marked with '*'.
#
# --fabric adds the RDMA-protocol rows: dear over libfabric's shm provider against Open MPI
# over its shared-memory BTL (vader), and dear over libfabric's tcp;ofi_rxm against dear's own
# TCP link, each with its ratio column.
set -euo pipefail

prog=$(basename "$0")

usage() {
  cat <<EOF
usage: $prog [options]

Runs dear-bench, mpi-bench and gloo-bench on the same sweep and prints merged tables.

  --build DIR          build directory holding tools/, bench/ and bench/peers/ (default ./build)
  -n, --nranks N       ranks per run (default 4)
  -b, --minbytes SIZE  smallest size, K/M/G suffixes allowed (default 8)
  -e, --maxbytes SIZE  largest size (default 64M)
  --iters N            timed iterations per size (default: the benchmarks' 20)
  --min-time MS        run more iterations where --iters would take less than MS
                       milliseconds, so small sizes are not a handful of samples (default 100;
                       0: exactly --iters)
  --warmup N           warm-up iterations per size (default: the benchmarks' 5)
  --collectives LIST   comma-separated (default all_reduce,reduce_scatter,all_gather)
  --only LIST          libraries to run, comma-separated from dear,mpi,gloo and the --fabric
                       ones (dear-ipc, dear-shm, dear-rxm, mpi-vader) (default dear,mpi,gloo)
  --fabric             also run dear-ipc (dear-bench --transport shm: dear's own shared-memory
                       rings), dear-shm (dear-bench --transport fabric, provider shm),
                       dear-rxm (provider tcp;ofi_rxm) and mpi-vader (btl vader,self)
  --gloo-algo ALGO     Gloo all_reduce algorithm (default: gloo-bench's ring_chunked)
  --out DIR            keep JSON and log files in DIR (default: a temporary directory)
  --extra-dear "ARGS"  extra arguments for dear-bench, word-split
  --timeout SEC        give up on one run after SEC seconds (default 1800; needs timeout(1))
  --rounds N           run the whole sequence of libraries N times, alternating, and give each
                       cell the median of its N times (default 1); this machine's speed
                       drifts within minutes, and alternating rounds spread it over every
                       library alike; each target line then also gives its ratio in every
                       round alone (dear's run against the peers' runs of that round)
  --plain-malloc       run every library with glibc's default malloc settings (by default
                       every run gets GLIBC_TUNABLES=glibc.malloc.hugetlb=1, see below)
  --bind MODE          where the ranks run: best (default: dear where dear-run puts them
                       by default, --bind auto; every peer run both bound as dear-run --bind
                       spread binds and unbound, its faster result kept per size), best-all
                       (every library, dear included, run both ways, the faster kept), spread
                       (every library bound so), or none (every library unbound)
  --tcp-cc MODE        TCP congestion control: same (default: every library on the one dear
                       picks for loopback, cubic, by setting the system default for the run
                       and restoring it after; needs root), system (every library, dear
                       included, on the system default) or own (each as it ships: dear on
                       its own choice, the peers on the system default)
  -h, --help           this text

Every library runs with the same environment. By default that includes
GLIBC_TUNABLES=glibc.malloc.hugetlb=1: malloc then asks for transparent huge pages on the
memory it maps. Open MPI allocates temporary buffers in each reduce_scatter and large
all_reduce; on a virtual machine where a first touch of a 4 KiB page costs ~15 us, those
page faults, not the network, set its time (a 1 MiB reduce_scatter 17.9 ms instead of 1.2 ms).
--plain-malloc shows the libraries under the default settings instead.

Bound ranks (--bind): rank i of dear, Open MPI and Gloo alike runs on the CPUs dear-run
--bind spread gives rank i (round robin over the CPUs when the ranks outnumber them, as mpirun
--bind-to core does); Open MPI's and Gloo's ranks are bound through taskset. With --bind best
a peer's cell is the faster of its bound and unbound runs, marked '~' where the unbound one
was faster: binding helps some libraries and slows others down, and each peer gets its better
placement. That also gives each peer the faster of two runs where dear has one, which at a
size whose time is mostly noise (the 8 B all_reduce on an oversubscribed host) favours the
peers; --bind best-all runs dear both ways too, so every library has the same two chances.

Sizes are fp32 sum, step factor 2. Set MPIRUN to use another mpirun.
EOF
}

die() {
  echo "$prog: error: $*" >&2
  exit 1
}

build=./build
nranks=4
minbytes=8
maxbytes=64M
iters=""
min_time=100
warmup=""
collectives=all_reduce,reduce_scatter,all_gather
only=dear,mpi,gloo
gloo_algo=""
out=""
extra_dear=""
run_timeout=1800
plain_malloc=0
bind=best
tcp_cc=same
rounds=1

need_value() {
  [[ $# -ge 2 && -n $2 ]] || die "option $1 needs a value (see --help)"
}

while [[ $# -gt 0 ]]; do
  case $1 in
    --build) need_value "$@"; build=$2; shift 2 ;;
    -n|--nranks) need_value "$@"; nranks=$2; shift 2 ;;
    -b|--minbytes) need_value "$@"; minbytes=$2; shift 2 ;;
    -e|--maxbytes) need_value "$@"; maxbytes=$2; shift 2 ;;
    --iters) need_value "$@"; iters=$2; shift 2 ;;
    --min-time) need_value "$@"; min_time=$2; shift 2 ;;
    --warmup) need_value "$@"; warmup=$2; shift 2 ;;
    --collectives) need_value "$@"; collectives=$2; shift 2 ;;
    --only) need_value "$@"; only=$2; shift 2 ;;
    --fabric) only="$only,dear-ipc,dear-shm,dear-rxm,mpi-vader"; shift ;;
    --gloo-algo) need_value "$@"; gloo_algo=$2; shift 2 ;;
    --out) need_value "$@"; out=$2; shift 2 ;;
    --extra-dear) [[ $# -ge 2 ]] || die "option $1 needs a value"; extra_dear=$2; shift 2 ;;
    --timeout) need_value "$@"; run_timeout=$2; shift 2 ;;
    --plain-malloc) plain_malloc=1; shift ;;
    --bind) need_value "$@"; bind=$2; shift 2 ;;
    --tcp-cc) need_value "$@"; tcp_cc=$2; shift 2 ;;
    --rounds) need_value "$@"; rounds=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

[[ $nranks =~ ^[1-9][0-9]*$ ]] || die "-n must be a positive whole number, got '$nranks'"
[[ $run_timeout =~ ^[1-9][0-9]*$ ]] || die "--timeout must be a positive number of seconds"
[[ -z $iters || $iters =~ ^[1-9][0-9]*$ ]] || die "--iters must be a positive number"
[[ $min_time =~ ^[0-9]+$ ]] || die "--min-time must be a whole number of milliseconds"
[[ $rounds =~ ^[1-9][0-9]*$ ]] || die "--rounds must be a positive whole number, got '$rounds'"
[[ $tcp_cc == same || $tcp_cc == system || $tcp_cc == own ]] ||
  die "--tcp-cc must be same, system or own, got '$tcp_cc'"
case $bind in
  best | best-all) dear_place=auto peer_places=(spread none) ;;
  spread) dear_place=spread peer_places=(spread) ;;
  none) dear_place=none peer_places=(none) ;;
  *) die "--bind must be best, best-all, spread or none, got '$bind'" ;;
esac
[[ -z $warmup || $warmup =~ ^[0-9]+$ ]] || die "--warmup must be a number"
command -v python3 >/dev/null || die "python3 is needed to merge the results"

run_dear=0 run_mpi=0 run_gloo=0 run_dear_ipc=0 run_dear_shm=0 run_dear_rxm=0 run_mpi_vader=0
IFS=, read -r -a only_list <<<"$only"
for lib in "${only_list[@]}"; do
  case $lib in
    dear) run_dear=1 ;;
    mpi) run_mpi=1 ;;
    gloo) run_gloo=1 ;;
    dear-ipc) run_dear_ipc=1 ;;
    dear-shm) run_dear_shm=1 ;;
    dear-rxm) run_dear_rxm=1 ;;
    mpi-vader) run_mpi_vader=1 ;;
    *) die "--only: unknown library '$lib' (choose from dear,mpi,gloo,dear-ipc,dear-shm,dear-rxm,mpi-vader)" ;;
  esac
done
IFS=, read -r -a coll_list <<<"$collectives"
for coll in "${coll_list[@]}"; do
  case $coll in
    all_reduce|reduce_scatter|all_gather|broadcast|reduce|gather|scatter|all_to_all|send_recv|ping_pong) ;;
    *) die "--collectives: unknown collective '$coll'" ;;
  esac
done

[[ -d $build ]] || die "build directory '$build' does not exist (pass --build DIR)"
build=$(cd "$build" && pwd)
dear_run=$build/tools/dear-run
dear_bench=$build/bench/dear-bench
mpi_bench=$build/bench/peers/mpi-bench
gloo_bench=$build/bench/peers/gloo-bench
mpirun=${MPIRUN:-mpirun}

if ((run_dear || run_dear_ipc || run_dear_shm || run_dear_rxm)); then
  [[ -x $dear_bench ]] || die "dear-bench not found at $dear_bench; build it \
(cmake --build $build --target dear-bench dear-run) or leave dear out with --only mpi,gloo"
  [[ -x $dear_run ]] || die "dear-run not found at $dear_run; build it \
(cmake --build $build --target dear-run) or leave dear out with --only mpi,gloo"
fi
if ((run_mpi || run_mpi_vader)); then
  [[ -x $mpi_bench ]] || die "mpi-bench not found at $mpi_bench (it is built only when CMake \
finds MPI; install libopenmpi-dev and reconfigure) or leave it out with --only"
  command -v "$mpirun" >/dev/null || die "'$mpirun' not found; install openmpi-bin or set MPIRUN"
fi
if ((run_gloo)); then
  [[ -x $gloo_bench ]] || die "gloo-bench not found at $gloo_bench (it is built only when \
CMake finds Gloo; install libgloo-dev and reconfigure) or leave it out with --only"
fi

[[ -x $dear_run ]] || die "dear-run not found at $dear_run; build it \
(cmake --build $build --target dear-run): every library's ranks are placed as it places dear's"
if [[ $bind != none ]]; then
  command -v taskset >/dev/null || die "--bind $bind needs taskset (apt-get install util-linux)"
  # Rank i's CPU list, as dear-run --bind spread sets it (its dry run prints them).
  mapfile -t rank_cpus < <("$dear_run" -n "$nranks" --bind spread --dry-run true |
    sed -n 's/.*  # CPUs \([0-9,-]*\)$/\1/p')
  ((${#rank_cpus[@]} == nranks)) || die "could not read the ranks' CPUs from dear-run --dry-run"
fi

if [[ -n $out ]]; then
  mkdir -p "$out" || die "cannot create --out directory '$out'"
  out=$(cd "$out" && pwd)
  keep_out=1
else
  out=$(mktemp -d "${TMPDIR:-/tmp}/dear-compare.XXXXXX")
  keep_out=0
fi
gloo_stores=()
restore_cc() { :; }
cleanup() {
  local d
  restore_cc
  for d in "${gloo_stores[@]+"${gloo_stores[@]}"}"; do rm -rf "$d"; done
  if ((keep_out == 0)); then rm -rf "$out"; fi
}
trap cleanup EXIT

if ((plain_malloc == 0)); then
  export GLIBC_TUNABLES=${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.malloc.hugetlb=1
fi

with_timeout=()
if command -v timeout >/dev/null; then with_timeout=(timeout "$run_timeout"); fi

# TCP congestion control. dear picks an unpaced one (cubic) for its loopback connections by
# itself (DEAR_TCP_CONGESTION=auto, see the README); --tcp-cc same gives the peers the same by
# making it the system default for the run, --tcp-cc system runs dear on the system's too.
cc_file=/proc/sys/net/ipv4/tcp_congestion_control
cc_system=$(cat "$cc_file" 2>/dev/null || echo unknown)
cc_note="every library on the system default, $cc_system (--tcp-cc system)"
if [[ $tcp_cc == system ]]; then
  export DEAR_TCP_CONGESTION=system
elif [[ $tcp_cc == own ]]; then
  unset DEAR_TCP_CONGESTION
  cc_note="each library as it ships: dear on cubic or reno over loopback, the peers (and iperf3) on the system default, $cc_system (--tcp-cc own)"
elif [[ $cc_system == cubic ]]; then
  cc_note="every library on cubic, the system default"
elif [[ -w $cc_file ]] && echo cubic >"$cc_file" 2>/dev/null; then
  cc_note="every library on cubic, the system default for this run ($cc_system before, restored after)"
  restore_cc() { echo "$cc_system" >"$cc_file" 2>/dev/null || true; }
else
  echo "$prog: warning: cannot make cubic the system's congestion control (not root?): the peers run on $cc_system, dear on cubic or reno over loopback" >&2
  cc_note="dear on cubic or reno over loopback, the peers on the system default, $cc_system (not equal: run as root)"
fi

# Bound, Open MPI's ranks start through this wrapper, which binds each to its CPUs (rank_cpus)
# before the benchmark starts; mpirun itself binds nothing (--bind-to none). The peers' run
# functions place their ranks as $place says (spread or none).
mpi_wrapper=$out/bind-mpi-rank.sh
place=$dear_place
if [[ $bind != none ]]; then
  {
    echo '#!/bin/sh'
    echo '# Runs "$@" on the CPUs of Open MPI rank $OMPI_COMM_WORLD_RANK (compare-peers --bind).'
    echo "cpus=\$(printf '%s\\n' ${rank_cpus[*]} | sed -n \"\$((OMPI_COMM_WORLD_RANK + 1))p\")"
    echo 'exec taskset -c "$cpus" "$@"'
  } >"$mpi_wrapper"
  chmod +x "$mpi_wrapper"
fi

common=(-b "$minbytes" -e "$maxbytes" -f 2 -d float -o sum)
[[ -n $iters ]] && common+=(-n "$iters")
[[ -n $warmup ]] && common+=(-w "$warmup")
common+=(--min_time_ms "$min_time")

# A peer that exits non-zero after writing its results (it counted wrong elements: a peer's
# own bug, as Gloo's halving-doubling reduce-scatter shows at some sizes; or a rank failed at
# teardown) is reported with the first error line of its logs (every rank's) and kept in the
# table, with any wrong counts noted; without results it stops the script.
peer_failed() {
  local what=$1 log=$2 json=$3
  if [[ -s $json ]]; then
    local why
    why=$(grep -h -i -E "error|fail|closed|abort|wrong" "$log" "${log%.log}".rank*.log \
      2>/dev/null | grep -v -E "^#|#wrong" | head -n1 || true)
    echo "$prog: warning: $what exited non-zero after writing its results (${why:-its logs say no more}); its rows are kept, any wrong-element counts in the table notes" >&2
    return 0
  fi
  fail_run "$what" "$log"
}

# Reports a failed run with the end of its log, then stops the script.
fail_run() {
  local what=$1 log=$2
  echo "$prog: error: $what failed; last lines of $log:" >&2
  tail -n 20 "$log" >&2 || true
  if ((keep_out == 0)); then echo "(pass --out DIR to keep the logs)" >&2; fi
  exit 1
}

run_dear_bench() {
  local coll=$1 json=$2 log=$3
  shift 3  # then: extra dear-bench arguments (the --fabric rows' transport)
  local -a extra=("$@")
  # Word-splitting is the documented behaviour of --extra-dear.
  # shellcheck disable=SC2206
  [[ -n $extra_dear ]] && extra+=($extra_dear)
  "${with_timeout[@]}" "$dear_run" -n "$nranks" --bind "$place" "$dear_bench" "$coll" "${common[@]}" \
    --json "$json" "${extra[@]+"${extra[@]}"}" >"$log" 2>&1 || fail_run "dear-bench $coll" "$log"
}

run_dear-ipc_bench() {
  run_dear_bench "$@" --transport shm
}

run_dear-shm_bench() {
  DEAR_FABRIC_PROVIDER=shm run_dear_bench "$@" --transport fabric
}

run_dear-rxm_bench() {
  DEAR_FABRIC_PROVIDER='tcp;ofi_rxm' run_dear_bench "$@" --transport fabric
}

run_mpi-vader_bench() {
  local coll=$1 json=$2 log=$3
  local -a wrap=()
  [[ $place == spread ]] && wrap=("$mpi_wrapper")
  # Shared memory between the ranks of this host (Open MPI's vader BTL), the peer of dear over
  # libfabric's shm provider.
  "${with_timeout[@]}" "$mpirun" --allow-run-as-root --oversubscribe -np "$nranks" \
    --bind-to none --mca pml ob1 --mca btl vader,self \
    "${wrap[@]+"${wrap[@]}"}" "$mpi_bench" "$coll" "${common[@]}" --json "$json" >"$log" 2>&1 ||
    peer_failed "mpi-bench (vader) $coll" "$log" "$json"
}

run_mpi_bench() {
  local coll=$1 json=$2 log=$3
  local -a wrap=()
  [[ $place == spread ]] && wrap=("$mpi_wrapper")
  # TCP over loopback only (no shared memory), so MPI crosses the same wire as dear and Gloo;
  # ob1 is the PML that honours the btl list.
  OMPI_MCA_btl_vader_single_copy_mechanism=none \
    "${with_timeout[@]}" "$mpirun" --allow-run-as-root --oversubscribe -np "$nranks" \
    --bind-to none --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo \
    "${wrap[@]+"${wrap[@]}"}" "$mpi_bench" "$coll" "${common[@]}" --json "$json" >"$log" 2>&1 ||
    peer_failed "mpi-bench $coll" "$log" "$json"
}

run_gloo_bench() {
  local coll=$1 json=$2 log=$3
  local store rank rc=0
  store=$(mktemp -d "${TMPDIR:-/tmp}/dear-gloo-store.XXXXXX")
  gloo_stores+=("$store")
  local -a algo=() pids=()
  [[ -n $gloo_algo ]] && algo=(--algo "$gloo_algo")
  for ((rank = 0; rank < nranks; rank++)); do
    local rank_log=$log
    ((rank == 0)) || rank_log=${log%.log}.rank$rank.log
    local -a gloo_bind=()
    [[ $place == spread ]] && gloo_bind=(taskset -c "${rank_cpus[rank]}")
    DEAR_RANK=$rank DEAR_WORLD_SIZE=$nranks DEAR_GLOO_PREFIX=compare \
      "${with_timeout[@]}" "${gloo_bind[@]+"${gloo_bind[@]}"}" "$gloo_bench" "$coll" "${common[@]}" --store "$store" \
      "${algo[@]+"${algo[@]}"}" --json "$json" >"$rank_log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
  rm -rf "$store"
  ((rc == 0)) || peer_failed "gloo-bench $coll (exit status $rc)" "$log" "$json"
}

loopback_ceiling() {
  if ! command -v iperf3 >/dev/null; then
    echo "# loopback TCP ceiling: not measured (iperf3 is not installed: apt-get install iperf3)"
    return 0
  fi
  # Two client/server pairs at once: iperf3 runs all of -P's streams on one thread, so one
  # process with -P 2 measures a single core, not the machine.
  local base=$((20000 + RANDOM % 20000)) i servers=() clients=() files=()
  for i in 0 1; do
    iperf3 -s -1 -p $((base + i)) >/dev/null 2>&1 &
    servers+=($!)
  done
  sleep 0.5
  for i in 0 1; do
    files+=("$out/iperf3.$i.json")
    iperf3 -c 127.0.0.1 -p $((base + i)) -t 3 -J >"${files[i]}" 2>/dev/null &
    clients+=($!)
  done
  for i in "${clients[@]}" "${servers[@]}"; do wait "$i" 2>/dev/null || true; done
  local gbps
  gbps=$(python3 - "${files[@]}" <<'PY' || true
import json, sys
total = 0.0
try:
    for path in sys.argv[1:]:
        with open(path) as f:
            total += json.load(f)["end"]["sum_received"]["bits_per_second"] / 8e9
    print("%.2f" % total)
except Exception:
    pass
PY
)
  [[ -n $gbps ]] && echo "# loopback TCP ceiling (iperf3, two processes with one stream each, in total): $gbps GB/s"
  ceiling_gbps=$gbps
  return 0
}

# The bytes an all_reduce must move, streamed around a ring of plain sockets by the same number
# of ranks with no library on top (dear-tcp-ring): what the transport alone costs. A reference,
# not a bound: nothing waits and nothing is reduced there, but a library's own scheduling of
# its sockets can still beat it.
# all_gather and reduce_scatter move the same bytes: (N-1)/N of the buffer per rank.
# ring_refs collects "kind:size:us" for the target checks.
ring_reference() {
  local tcp_ring=$build/bench/dear-tcp-ring
  if [[ ! -x $tcp_ring || ! -x $dear_run ]] || ((nranks < 2)); then
    return 0
  fi
  local streams=("all-reduce 1M" "all-reduce $maxbytes") stream kind size us
  if [[ " ${coll_list[*]} " == *" all_gather "* || " ${coll_list[*]} " == *" reduce_scatter "* ]]; then
    streams+=("all-gather $maxbytes")
  fi
  for stream in "${streams[@]}"; do
    read -r kind size <<<"$stream"
    local errs
    errs=$(mktemp)
    # A size the ring cannot stream (too few bytes per rank) leaves no reference for that size;
    # it never ends the script before the tables.
    us=$("$dear_run" -n "$nranks" --bind "$dear_place" "$tcp_ring" "--$kind" "$size" \
      --iters 20 --warmup 3 \
      --rounds 3 2>"$errs" | sed -n 's/^\[0\] median \([0-9.]*\) us per iteration.*/\1/p') || true
    if [[ -z $us ]]; then
      echo "# plain-socket ring (dear-tcp-ring): no ${kind/-/_} reference at $size: $(grep -m1 -o 'dear-tcp-ring: rank 0: .*' "$errs" || echo 'it printed no time')"
      rm -f "$errs"
      continue
    fi
    rm -f "$errs"
    if [[ $kind == all-reduce ]]; then
      echo "# plain-socket ring (dear-tcp-ring): the bytes of a $size all_reduce streamed in $us us"
    else
      echo "# plain-socket ring (dear-tcp-ring): the bytes of a $size all_gather or reduce_scatter streamed in $us us"
    fi
    ring_refs+=("$kind:$size:$us")
  done
  return 0
}

echo "# compare-peers: $nranks ranks, $minbytes..$maxbytes B, float sum, results in $out" >&2
# The libraries this invocation runs: only their files are merged, so results an earlier run
# left in the same --out directory never appear as columns of this one.
ran_libs=()
ceiling_gbps=""
ring_refs=()
for round in $(seq 1 "$rounds"); do
# Round 1 writes LIB-COLL[.unbound].json, round k > 1 LIB-COLL[.unbound].rk.json.
rsuffix=""
((round > 1)) && rsuffix=.r$round
((rounds > 1)) && echo "# round $round of $rounds" >&2
for coll in "${coll_list[@]}"; do
  for lib in dear mpi gloo dear-ipc dear-shm dear-rxm mpi-vader; do
    case $lib in
      dear) ((run_dear)) || continue ;;
      mpi) ((run_mpi)) || continue ;;
      gloo) ((run_gloo)) || continue ;;
      dear-ipc) ((run_dear_ipc)) || continue ;;
      dear-shm) ((run_dear_shm)) || continue ;;
      dear-rxm) ((run_dear_rxm)) || continue ;;
      mpi-vader) ((run_mpi_vader)) || continue ;;
    esac
    places=("$dear_place")
    [[ $lib == dear* && $bind != best-all ]] || places=("${peer_places[@]}")
    ((round == 1)) && rm -f "$out/$lib-$coll".json "$out/$lib-$coll".*.json
    for place in "${places[@]}"; do
      # The first placement writes the library's file; an unbound run under --bind best or
      # best-all its own (.unbound).
      suffix=""
      [[ $place != "${places[0]}" ]] && suffix=.unbound
      json=$out/$lib-$coll$suffix$rsuffix.json
      log=$out/$lib-$coll$suffix$rsuffix.log
      start=$SECONDS
      echo "# running $lib $coll${suffix:+ (unbound)} ..." >&2
      "run_${lib}_bench" "$coll" "$json" "$log"
      [[ -s $json ]] || fail_run "$lib $coll (no JSON written)" "$log"
      echo "#   done in $((SECONDS - start)) s" >&2
    done
    place=$dear_place
    [[ " ${ran_libs[*]-} " == *" $lib "* ]] || ran_libs+=("$lib")
  done
done
done

loopback_ceiling
ring_reference
case $bind in
  best) echo "# binding: dear as dear-run places it by default (--bind auto: bound only when every rank can have a CPU of its own); each peer the faster of bound (rank i on CPUs ${rank_cpus[*]}) and unbound ('~': unbound) (--bind best)" ;;
  best-all) echo "# binding: every library, dear included, the faster of bound (rank i on CPUs ${rank_cpus[*]}) and unbound ('~': unbound) (--bind best-all)" ;;
  spread) echo "# binding: every library's rank i on CPUs ${rank_cpus[*]} (--bind spread)" ;;
  none) echo "# binding: none (--bind none)" ;;
esac
echo "# congestion control: $cc_note"
if ((plain_malloc)); then
  echo "# malloc: glibc defaults for every library (--plain-malloc)"
else
  echo "# malloc: GLIBC_TUNABLES=$GLIBC_TUNABLES for every library (--plain-malloc to leave it out)"
fi

((rounds > 1)) && echo "# rounds: $rounds, the libraries alternating; each cell is the median of its rounds' times (busbw from that time)"
python3 - "$out" "${ran_libs[*]}" "$ceiling_gbps" "${ring_refs[*]-}" "$rounds" "${coll_list[@]}" <<'PY'
import json
import os
import sys

out_dir, ran, ceiling, refs = sys.argv[1], sys.argv[2].split(), sys.argv[3], sys.argv[4].split()
rounds, collectives = int(sys.argv[5]), sys.argv[6:]
ceiling = float(ceiling) if ceiling else None
# The plain-socket ring's time for a collective's bytes: {(collective, size): us}.
STREAMED = {}
for ref in refs:
    kind, size, us = ref.split(":")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
    size = int(size[:-1] if scale > 1 else size) * scale
    colls = ["all_reduce"] if kind == "all-reduce" else ["all_gather", "reduce_scatter"]
    for c in colls:
        STREAMED[(c, size)] = float(us)
LIBS = [lib for lib in ["dear", "mpi", "gloo", "dear-ipc", "dear-shm", "dear-rxm", "mpi-vader"] if lib in ran]
TCP_PEERS = ["mpi", "gloo"]
# The --fabric rows' ratio columns: (numerator, denominator, title).
PAIRS = [("dear-ipc", "mpi-vader", "ipc/vader"), ("dear-shm", "mpi-vader", "shm/vader"),
         ("dear-rxm", "dear", "rxm/tcp")]


def load_one(name):
    path = os.path.join(out_dir, name + ".json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def median_of(results):
    """One round's result whose time is the median of results' (the lower middle one for an
    even count), its busbw and algbw kept as measured with that time; wrong elements summed
    over every round."""
    results = sorted(results, key=lambda r: r["time_us"])
    mid = dict(results[(len(results) - 1) // 2])
    wrong = [r["wrong"] for r in results if isinstance(r.get("wrong"), int) and r["wrong"] > 0]
    if wrong:
        mid["wrong"] = sum(wrong)
    return mid


def load(lib, coll):
    """The library's document for coll (or coll.unbound); with --rounds, each row's out- and
    in-place results the median of the rounds'."""
    docs = [load_one(f"{lib}-{coll}" + (f".r{k}" if k > 1 else "")) for k in range(1, rounds + 1)]
    docs = [d for d in docs if d is not None]
    if len(docs) <= 1:
        return docs[0] if docs else None
    rows = {}
    for d in docs:
        for row in d.get("rows", []):
            rows.setdefault(row["size"], []).append(row)
    merged = []
    for size in sorted(rows):
        row = dict(rows[size][0])
        for form in ("oop", "ip"):
            got = [r[form] for r in rows[size] if r.get(form)]
            if got:
                row[form] = median_of(got)
        merged.append(row)
    doc = dict(docs[0])
    doc["rows"] = merged
    return doc


def pick(row):
    """Out-of-place when the library has it, else in-place (marked)."""
    if row.get("oop"):
        return row["oop"], ""
    if row.get("ip"):
        return row["ip"], "*"
    return None, ""


def merge_unbound(doc, lib, coll):
    """--bind best: a peer's bound run (doc) and its unbound one, row by row, the faster kept
    (its cell marked '~' where the unbound run was faster)."""
    other = load(lib, coll + ".unbound")
    if doc is None or other is None:
        return doc
    by_size = {row["size"]: row for row in other.get("rows", [])}
    rows = []
    for row in doc.get("rows", []):
        alt = by_size.get(row["size"])
        mine, _ = pick(row)
        theirs, _ = pick(alt) if alt else (None, "")
        if mine is not None and theirs is not None and theirs["time_us"] < mine["time_us"]:
            alt = dict(alt)
            alt["unbound"] = True
            row = alt
        rows.append(row)
    doc = dict(doc)
    doc["rows"] = rows
    return doc


def round_result(lib, coll, size, k):
    """lib's result at size in round k alone (the faster of its bound and unbound runs where
    --bind best ran both), or None."""
    best = None
    for variant in (coll, coll + ".unbound"):
        doc = load_one(f"{lib}-{variant}" + (f".r{k}" if k > 1 else ""))
        for row in (doc or {}).get("rows", []):
            res, _ = pick(row) if row["size"] == size else (None, "")
            if res is not None and (best is None or res["time_us"] < best["time_us"]):
                best = res
    return best


def round_ratios(coll, size, lib, peers, kind):
    """A target's ratio in each round on its own: dear's run against the peers' runs of the same
    round, which ran minutes apart at most where the medians of the table may come from
    different rounds. [] with a single round."""
    ratios = []
    for k in range(1, rounds + 1) if rounds > 1 else []:
        mine = round_result(lib, coll, size, k)
        theirs = [r for r in (round_result(p, coll, size, k) for p in peers) if r is not None]
        if mine is None or not theirs:
            continue
        if kind == "time":
            ratios.append(mine["time_us"] / min(r["time_us"] for r in theirs))
        elif max(r["busbw"] for r in theirs) > 0:
            ratios.append(mine["busbw"] / max(r["busbw"] for r in theirs))
    return ratios


def by_round(ratios, want, kind):
    """'; by round: 1.42 1.18 1.51 (met in 2 of 3)' for the target line, or ''."""
    if not ratios:
        return ""
    met = sum(1 for r in ratios if (r <= want if kind == "time" else r >= want))
    return (f"; by round: {' '.join(f'{r:.2f}' for r in ratios)} "
            f"(met in {met} of {len(ratios)})")


def fmt_time(us):
    return f"{us:.0f}" if us >= 10000 else f"{us:.1f}" if us >= 100 else f"{us:.2f}"


MIB = 1024 * 1024
# The performance targets (docs/benchmarks.md): (collective, size, dear's column, peers, ratio, busbw or
# time). A busbw target asks dear's busbw >= ratio x the best listed peer's; a time target asks
# dear's time <= ratio x the best peer's.
TARGETS = [
    ("all_reduce", 64 * MIB, "dear", ["mpi", "gloo"], 1.3, "busbw"),
    ("all_reduce", 1 * MIB, "dear", ["mpi", "gloo"], 1.3, "busbw"),
    ("reduce_scatter", 64 * MIB, "dear", ["mpi"], 1.3, "busbw"),
    ("all_gather", 64 * MIB, "dear", ["mpi"], 1.3, "busbw"),
    ("all_reduce", 8, "dear", ["mpi"], 1.0, "time"),
    ("all_reduce", 64 * MIB, "dear-ipc", ["mpi-vader"], 1.5, "busbw"),
    ("all_reduce", 8, "dear-ipc", ["mpi-vader"], 1.0, "time"),
    ("all_reduce", 2048, "dear-ipc", ["mpi-vader"], 1.0, "time"),
    ("all_reduce", 64 * MIB, "dear-shm", ["mpi-vader"], 1.5, "busbw"),
    ("all_reduce", 64 * MIB, "dear-rxm", ["dear"], 1.0, "busbw"),
]
# Columns that run over TCP loopback, where the ceiling bounds busbw.
LOOPBACK = {"dear", "mpi", "gloo"}


def target_lines(by_coll, nranks):
    """One line per target this run covers: the ratio, and whether it was met. A busbw target
    over loopback that was not met is checked against the loopback ceiling measured in this
    run: every byte a ring (or any bandwidth-optimal) collective moves crosses loopback once,
    so the ranks together push nranks x busbw through it, and busbw cannot exceed
    ceiling / nranks."""
    lines = []
    for coll, size, lib, peers, want, kind in TARGETS:
        results = by_coll.get(coll, {})
        mine = results.get((lib, size))
        theirs = [(p, results[(p, size)][0]) for p in peers if (p, size) in results]
        if mine is None or not theirs:
            continue
        mine = mine[0]
        name = f"{coll} {size // MIB} MiB" if size >= MIB else f"{coll} {size} B"
        if kind == "time":
            peer, best = min(theirs, key=lambda t: t[1]["time_us"])
            ratio = mine["time_us"] / best["time_us"]
            ok = ratio <= want
            lines.append(f"# target {name} time, {lib} <= {want:g} x {peer}: "
                         f"{fmt_time(mine['time_us'])} / {fmt_time(best['time_us'])} us = "
                         f"{ratio:.2f}, {'met' if ok else 'not met'}"
                         + by_round(round_ratios(coll, size, lib, peers, kind), want, kind))
            continue
        peer, best = max(theirs, key=lambda t: t[1]["busbw"])
        if best["busbw"] <= 0:
            continue
        ratio = mine["busbw"] / best["busbw"]
        line = (f"# target {name} busbw, {lib} >= {want:g} x {peer}: {mine['busbw']:.3f} / "
                f"{best['busbw']:.3f} GB/s = {ratio:.2f}, ")
        if ratio >= want:
            line += "met"
        elif ceiling and lib in LOOPBACK and isinstance(nranks, int) and nranks > 1:
            bound = ceiling / nranks
            need = want * best["busbw"]
            # The ceiling is a bound only if no library went past it in this run.
            pushed = max((res[0]["busbw"] * nranks, name_, size_)
                         for (name_, size_), res in results.items() if name_ in LOOPBACK)
            if pushed[0] > ceiling:
                line += (f"not met; the loopback ceiling measured in this run "
                         f"({ceiling:.2f} GB/s) bounds nothing: {pushed[1]} pushed "
                         f"{pushed[0]:.2f} GB/s through loopback (busbw x {nranks} ranks) "
                         f"at {pushed[2]} B")
            elif need > bound:
                line += (f"not met, out of reach in this run: it needs busbw {need:.3f} GB/s, "
                         f"above the loopback bound {bound:.3f} (ceiling {ceiling:.2f} GB/s / "
                         f"{nranks} ranks)")
            else:
                line += (f"not met: it needs busbw {need:.3f} GB/s, within the loopback bound "
                         f"{bound:.3f} (ceiling {ceiling:.2f} GB/s / {nranks} ranks)")
        else:
            line += "not met"
        streamed = STREAMED.get((coll, size))
        if ratio < want and streamed and lib in LOOPBACK:
            # The time dear would need, against a ring of plain sockets moving the same bytes
            # with nothing on top: a reference, not a bound.
            need_us = best["time_us"] / want
            line += (f"; it needs {fmt_time(need_us)} us, {need_us / streamed:.2f} x the "
                     f"{fmt_time(streamed)} us a plain-socket ring took to stream its bytes")
        lines.append(line + by_round(round_ratios(coll, size, lib, peers, kind), want, kind))
    return lines


by_coll = {}
run_nranks = None
for coll in collectives:
    docs = {lib: merge_unbound(load(lib, coll), lib, coll) for lib in LIBS}
    docs = {lib: d for lib, d in docs.items() if d is not None}
    if not docs:
        continue
    results = {}
    sizes = set()
    notes = []
    for lib, doc in docs.items():
        skipped = doc.get("meta", {}).get("skipped")
        if skipped:
            notes.append(f"{lib}: skipped: {skipped}")
        algo = doc.get("meta", {}).get("algorithm")
        if algo:
            notes.append(f"{lib}: algorithm {algo}")
        for row in doc.get("rows", []):
            sizes.add(row["size"])
            res, mark = pick(row)
            if row.get("unbound"):
                mark += "~"
            if res is not None:
                results[(lib, row["size"])] = (res, mark)
            if res is not None and res.get("wrong"):
                notes.append(f"{lib}: {res['wrong']} wrong elements at {row['size']} B")
    libs = [lib for lib in LIBS if lib in docs]
    peers = [lib for lib in libs if lib in TCP_PEERS]
    with_ratio = "dear" in docs and peers
    pairs = [p for p in PAIRS if p[0] in docs and p[1] in docs]

    nranks = next(iter(docs.values())).get("nranks", "?")
    by_coll[coll] = results
    run_nranks = nranks
    print(f"\n# {coll}, {nranks} ranks, float sum; time(us) and busbw(GB/s); "
          "* = in-place (no out-of-place form)")
    head = f"{'size(B)':>12}"
    for lib in libs:
        head += f"  {lib + ' time':>13} {lib + ' busbw':>11}"
    if with_ratio:
        head += f"  {'dear/best':>9}"
    for _, _, title in pairs:
        head += f"  {title:>9}"
    print(head)
    for size in sorted(sizes):
        line = f"{size:>12}"
        best_peer = None
        for lib in libs:
            cell = results.get((lib, size))
            if cell is None:
                line += f"  {'N/A':>13} {'N/A':>11}"
                continue
            res, mark = cell
            line += f"  {fmt_time(res['time_us']) + mark:>13} {res['busbw']:>11.3f}"
            if lib in TCP_PEERS and (best_peer is None or res["busbw"] > best_peer):
                best_peer = res["busbw"]
        if with_ratio:
            dear = results.get(("dear", size))
            if dear and best_peer and best_peer > 0 and size > 0:
                line += f"  {dear[0]['busbw'] / best_peer:>9.2f}"
            else:
                line += f"  {'-':>9}"
        for num, den, _ in pairs:
            a, b = results.get((num, size)), results.get((den, size))
            if a and b and b[0]["busbw"] > 0 and size > 0:
                line += f"  {a[0]['busbw'] / b[0]['busbw']:>9.2f}"
            else:
                line += f"  {'-':>9}"
        print(line)
    if with_ratio:
        # Latency: the smallest size every library ran with at least one element.
        common = [s for s in sorted(sizes) if s > 0 and all((lib, s) in results for lib in libs)]
        if common:
            s = common[0]
            dear_t = results[("dear", s)][0]["time_us"]
            best = min(results[(lib, s)][0]["time_us"] for lib in peers)
            print(f"# time ratio at {s} B: dear {fmt_time(dear_t)} us / best peer "
                  f"{fmt_time(best)} us = {dear_t / best:.2f}")
    for note in notes:
        print(f"# {note}")
lines = target_lines(by_coll, run_nranks)
if lines:
    print("\n# performance targets (docs/benchmarks.md, \"Comparing with Open MPI and Gloo\"), this run:")
    for line in lines:
        print(line)
PY
