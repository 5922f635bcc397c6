#!/usr/bin/env bash
# Hardware check of the ibverbs transport, for a user with InfiniBand or RoCE machines. The
# transport is compiled everywhere but has only run where this script has been run; it is the
# way to validate it:
#   1. an RDMA device with an active port is present (ibv_devinfo),
#   2. build with DEAR_VERBS=ON,
#   3. test_verbs on this host: its device tests must run, not skip,
#   4. dear-bench over verbs with every result checked (-c 1), 2 ranks on this host, and
#      where a GPU is present GPUDirect RDMA (test_cuda's dma-buf and device-window tests),
#   5. the same on 2 or more nodes, one rank per node: under Slurm (srun, inside an
#      allocation of 2+ nodes) or with Open MPI's mpirun and --hosts.
# Exits non-zero at the first failure.
#
#   scripts/verbs-check.sh [--build DIR] [--hosts h1,h2,...] [--device mlx5_0[:PORT]]
#                          [--gid-index N] [-b MIN] [-e MAX] [--skip-local] [--local-only]
#   --local-only  stop after this host's checks (steps 1-4), for a single machine
#
# Ranks on other nodes must see the same build directory (a shared file system) or the same
# path. The bootstrap uses TCP between the nodes (MASTER_ADDR = the first node, MASTER_PORT);
# DEAR_SOCKET_IFNAME picks the interface it advertises. DEAR_SECRET is generated here, since
# neither launcher carries one.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build-verbs-check"
hosts=""
device=""
gid_index=""
minbytes=8
maxbytes=256M
skip_local=0
local_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --hosts) hosts="$2"; shift 2 ;;
    --device) device="$2"; shift 2 ;;
    --gid-index) gid_index="$2"; shift 2 ;;
    -b) minbytes="$2"; shift 2 ;;
    -e) maxbytes="$2"; shift 2 ;;
    --skip-local) skip_local=1; shift ;;
    --local-only) local_only=1; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "verbs-check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

step() { printf '\n==== %s\n' "$*"; }
fail() { printf '\nverbs-check: FAILED: %s\n' "$*" >&2; exit 1; }

export DEAR_TRANSPORT=verbs
[ -n "$device" ] && export DEAR_IB_DEVICE="$device"
[ -n "$gid_index" ] && export DEAR_IB_GID_INDEX="$gid_index"

step "RDMA device present?"
command -v ibv_devinfo >/dev/null 2>&1 || fail "ibv_devinfo not found (install rdma-core / ibverbs-utils)"
ibv_devinfo ${device:+-d "${device%%:*}"} | grep -E "hca_id|state|link_layer|active_mtu" \
  || fail "ibv_devinfo lists no device"
ibv_devinfo ${device:+-d "${device%%:*}"} | grep -q "PORT_ACTIVE" || fail "no active port"

step "build (DEAR_VERBS=ON) in $build"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DDEAR_VERBS=ON -DDEAR_WERROR=ON \
  -DDEAR_BUILD_PYTHON=OFF -DDEAR_BUILD_PEERS=OFF >/dev/null || fail "configure (is libibverbs-dev installed?)"
cmake --build "$build" -j"$(nproc)" --target test_verbs dear-bench dear-run || fail "build"

bench_sweep() {  # bench_sweep LAUNCH...: the checked sweep of the three collectives
  for coll in all_reduce reduce_scatter all_gather; do
    "$@" "$build/bench/dear-bench" "$coll" --transport verbs -b "$minbytes" -e "$maxbytes" -f 4 \
      -c 1 -n 10 -w 2 || fail "dear-bench $coll over verbs (launched with: $1)"
  done
}

if [ "$skip_local" = 0 ]; then
  step "test_verbs (device tests must run)"
  out="$(timeout 300 "$build/tests/test_verbs" 2>&1)" || { echo "$out"; fail "test_verbs"; }
  echo "$out" | tail -n 4
  if echo "$out" | grep -q "SKIPPED \]"; then
    echo "$out" | grep -m1 -A1 "Skipped"
    fail "device tests skipped"
  fi

  step "dear-bench over verbs, 2 ranks on this host, checked"
  bench_sweep timeout 600 "$build/tools/dear-run" -n 2 --

  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    step "GPUDirect RDMA on this host (a GPU is present): dma-buf export, device windows, flush"
    cmake --build "$build" -j"$(nproc)" --target test_cuda \
      || fail "build test_cuda (is the CUDA toolkit installed?)"
    out="$(timeout 300 "$build/tests/test_cuda" \
      --gtest_filter='Gpu.DeviceMemoryIsExportedAsADmaBuf:Gpu.GpuDirectWritesLandInDeviceMemory' 2>&1)" \
      || { echo "$out"; fail "GPUDirect RDMA"; }
    echo "$out" | tail -n 4
    echo "$out" | grep -A1 "SKIPPED \]" || true
  fi
fi

step "dear-bench over verbs across nodes, one rank per node, checked"
DEAR_SECRET="$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
export DEAR_SECRET
export MASTER_PORT="${MASTER_PORT:-29517}"
if [ "$local_only" = 1 ]; then
  printf '\nverbs-check: PASSED on this host only (--local-only)\n'
  exit 0
fi
if [ -n "${SLURM_JOB_ID:-}" ] && command -v srun >/dev/null 2>&1 && [ -z "$hosts" ]; then
  nodes="${SLURM_JOB_NUM_NODES:-1}"
  [ "$nodes" -ge 2 ] || fail "the Slurm allocation has $nodes node(s); ask for 2 or more (salloc -N2)"
  export MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)}"
  echo "srun on $nodes nodes, rendezvous at $MASTER_ADDR:$MASTER_PORT"
  bench_sweep srun -N "$nodes" --ntasks-per-node=1 --export=ALL
elif [ -n "$hosts" ]; then
  command -v "${MPIRUN:-mpirun}" >/dev/null 2>&1 || fail "--hosts needs Open MPI's mpirun (or MPIRUN)"
  n="$(echo "$hosts" | tr ',' '\n' | grep -c .)"
  [ "$n" -ge 2 ] || fail "--hosts lists $n host(s); give 2 or more"
  export MASTER_ADDR="${MASTER_ADDR:-${hosts%%,*}}"
  echo "mpirun on $hosts, rendezvous at $MASTER_ADDR:$MASTER_PORT"
  fwd=(-x DEAR_TRANSPORT -x DEAR_SECRET -x MASTER_ADDR -x MASTER_PORT)
  for v in DEAR_IB_DEVICE DEAR_IB_GID_INDEX DEAR_SOCKET_IFNAME DEAR_CHANNELS; do
    [ -n "${!v:-}" ] && fwd+=(-x "$v")
  done
  bench_sweep "${MPIRUN:-mpirun}" -np "$n" -H "$hosts" --map-by node "${fwd[@]}"
else
  fail "no nodes to run on: run inside a Slurm allocation of 2+ nodes, or pass --hosts h1,h2"
fi

printf '\nverbs-check: PASSED (devices: %s)\n' "$(ibv_devices | awk 'NR>2{print $1}' | paste -sd, -)"
