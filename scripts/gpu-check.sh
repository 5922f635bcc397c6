#!/usr/bin/env bash
# GPU check for a machine with one NVIDIA GPU, in about eight minutes:
#   1. build the CUDA parts (kernels for sm_80, sm_90 and PTX) and the verbs back-end,
#   2. report the RDMA devices (ibv_devinfo); where there is one, scripts/verbs-check.sh (two
#      processes on one HCA over RC loopback) and the GPUDirect tests,
#   3. run the GPU tests (kernels vs the CPU kernels for every dtype x op, collectives on
#      device buffers with 1-4 ranks as threads sharing the GPU, device-resident and staged,
#      stream ordering),
#   4. the kernel benchmark, every dtype x op, next to cudaMemcpy device-to-device,
#   5. dear-bench all_reduce with 2 and 4 ranks (processes) sharing the GPU, checked: host and
#      device buffers side by side (busbw), and the engine thread's CPU seconds for each; a
#      1 GiB device all_reduce's landing memory (pinned), and the same sweep staged; all_to_all
#      and scatter on 2 ranks, host and device buffers (small ones in the engine, larger ones
#      staged in pieces), checked,
#   6. compute-sanitizer memcheck on the 2-rank device-resident collectives,
#   7. with --sanitize, all GPU tests again under compute-sanitizer (memcheck, then racecheck).
# Exits non-zero at the first failure, and at once when no GPU is usable.
# Usage: scripts/gpu-check.sh [--no-build] [--sanitize] [build-dir]   (default: build-gpu)
#   --no-build  use the programs already in build-dir (built elsewhere with -DDEAR_CUDA=ON), for
#               a GPU node without the build's dependencies: a folder made by
#               scripts/gpu-bundle.sh, whose lib/ is put on LD_LIBRARY_PATH here, or a build
#               tree (then set LD_LIBRARY_PATH for its shared libraries yourself).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build-gpu"
do_build=1
sanitize=0
for arg in "$@"; do
  case "$arg" in
    --no-build) do_build=0 ;;
    --sanitize) sanitize=1 ;;
    -*) echo "gpu-check: unknown option '$arg'" >&2; exit 2 ;;
    *) build="$arg" ;;
  esac
done
step() { printf '\n==== %s\n' "$*"; }
fail() { printf '\ngpu-check: FAILED: %s\n' "$*" >&2; exit 1; }

step "GPU present?"
command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found: no NVIDIA driver on this machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  || fail "nvidia-smi cannot talk to a GPU"
if [ "$do_build" = 1 ]; then
  nvcc="${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
  [ -x "$nvcc" ] || fail "no CUDA toolkit (nvcc) found; set CUDACXX"
  step "build (CUDA required) in $build"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDEAR_CUDA=ON \
    -DDEAR_BUILD_PYTHON=OFF -DDEAR_BUILD_PEERS=OFF -DCMAKE_CUDA_COMPILER="$nvcc" >/dev/null \
    || fail "configure (is the CUDA toolkit complete?)"
  timeout 240 cmake --build "$build" -j"$(nproc)" --target test_cuda test_staging \
    cuda-reduce-bench dear-bench dear-run || fail "build"
  timeout 120 cmake --build "$build" -j"$(nproc)" --target test_nccl_comm >/dev/null 2>&1 || true
else
  for p in tests/test_cuda tests/test_staging bench/cuda-reduce-bench bench/dear-bench \
           tools/dear-run; do
    [ -x "$build/$p" ] || fail "--no-build: $build/$p is missing"
  done
  # A folder made by scripts/gpu-bundle.sh carries the libraries the node may lack.
  if [ -d "$build/lib" ]; then
    export LD_LIBRARY_PATH="$build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi

step "RDMA devices (ibv_devinfo)"
if command -v ibv_devinfo >/dev/null 2>&1 && ibv_devinfo -l 2>/dev/null | grep -qv "^0 HCAs"; then
  ibv_devinfo 2>&1 | grep -E "hca_id|state|link_layer|active_mtu" || true
  if ibv_devinfo 2>/dev/null | grep -q "PORT_ACTIVE"; then
    step "verbs on this host (scripts/verbs-check.sh, RC loopback) and GPUDirect RDMA"
    timeout 300 "$root/scripts/verbs-check.sh" --local-only -b 8 -e 64M || fail "verbs-check"
    timeout 60 "$build/tests/test_cuda" --gtest_brief=1 \
      --gtest_filter='*DmaBuf*:*GpuDirect*' || fail "GPUDirect tests"
  else
    echo "no active RDMA port: verbs and GPUDirect not run"
  fi
else
  echo "no RDMA device (or no ibv_devinfo): verbs and GPUDirect not run"
fi

step "GPU tests (must run, not skip)"
out="$(timeout 300 "$build/tests/test_cuda" --gtest_brief=1 2>&1)" || { echo "$out"; fail "test_cuda"; }
echo "$out" | tail -n 5
echo "$out" | grep -E "landing slots" || true
# The dma-buf and GPUDirect tests skip, with their reason, on a host without an RDMA path.
if echo "$out" | grep "SKIPPED" | grep -qvE "DmaBuf|GpuDirect"; then
  echo "$out" | grep -m1 -i "no CUDA device"; fail "GPU tests skipped"
fi
timeout 60 "$build/tests/test_staging" --gtest_brief=1 || fail "test_staging"

step "scheduler on NCCL (one rank per GPU; skipped where NCCL was not found)"
if [ -x "$build/tests/test_nccl_comm" ]; then
  timeout 120 "$build/tests/test_nccl_comm" --gtest_brief=1 || fail "test_nccl_comm"
else
  echo "test_nccl_comm not built (no NCCL in this toolkit)"
fi

step "kernel throughput vs cudaMemcpy D2D (GB/s = memory traffic; compare the columns)"
timeout 90 "$build/bench/cuda-reduce-bench" --benchmark_min_time=0.05 \
  --benchmark_filter='(memcpy_d2d|reduce/.*)/268435456' || fail "cuda-reduce-bench"

# One sweep, three ways: host buffers, device buffers (resident), device buffers staged.
# Prints busbw (out of place) per size side by side, and each run's engine CPU seconds.
sweep() {  # sweep N OUT [dear-bench args...]
  sweep_of all_reduce 8 "$@"
}
sweep_of() {  # sweep_of COLLECTIVE MINBYTES N OUT [dear-bench args...]
  local coll=$1 min=$2 n=$3 out=$4
  shift 4
  timeout 150 "$build/tools/dear-run" -n "$n" --no-prefix -- "$build/bench/dear-bench" "$coll" \
    -b "$min" -e 64M -f 8 -n 5 -w 2 -c 1 "$@" >"$out" 2>&1 || { cat "$out"; return 1; }
}
rows() { awk '$1 ~ /^[0-9]+$/ && NF >= 9 { print $1, $8, $9 }' "$1"; }
cpu() { awk '/engine: cpu/ { s += $6 } END { printf "%.3f", s }' "$1"; }
tmp="$(mktemp -d)"
for n in 2 4; do
  step "all_reduce, $n ranks sharing the GPU, every result checked: host vs device buffers"
  sweep "$n" "$tmp/host$n" || fail "dear-bench host buffers, $n ranks"
  sweep "$n" "$tmp/dev$n" --device cuda || fail "dear-bench device buffers, $n ranks"
  DEAR_CUDA_STAGING=1 sweep "$n" "$tmp/staged$n" --device cuda \
    || fail "dear-bench device buffers staged, $n ranks"
  printf '%12s %12s %12s %12s %8s\n' size host_busbw dev_busbw staged_busbw dev/host
  join <(rows "$tmp/host$n" | sort -k1,1) <(rows "$tmp/dev$n" | sort -k1,1) \
    | join - <(rows "$tmp/staged$n" | sort -k1,1) | sort -n \
    | awk '{ if ($3 != 0 || $5 != 0 || $7 != 0) { print "wrong elements at " $1; bad = 1 }
             printf "%12s %12s %12s %12s %8.2f\n", $1, $2, $4, $6, ($2 > 0 ? $4 / $2 : 0) }
           END { exit bad }' || fail "wrong elements"
  printf 'engine thread CPU seconds, all ranks, whole sweep: host %s, device %s, staged %s\n' \
    "$(cpu "$tmp/host$n")" "$(cpu "$tmp/dev$n")" "$(cpu "$tmp/staged$n")"
done

# all_to_all and scatter keep their exchanges in host memory: small device operations run in
# the engine in host memory, larger ones are staged in pipelined pieces (docs/cuda.md).
for coll in all_to_all scatter; do
  step "$coll, 2 ranks, every result checked: host vs device buffers (small in the engine, larger staged)"
  sweep_of "$coll" 8 2 "$tmp/h-$coll" || fail "dear-bench $coll host buffers"
  sweep_of "$coll" 8 2 "$tmp/d-$coll" --device cuda || fail "dear-bench $coll device buffers"
  printf '%12s %12s %12s %8s\n' size host_busbw dev_busbw dev/host
  join <(rows "$tmp/h-$coll" | sort -k1,1) <(rows "$tmp/d-$coll" | sort -k1,1) | sort -n \
    | awk '{ if ($3 != 0 || $5 != 0) { print "wrong elements at " $1; bad = 1 }
             printf "%12s %12s %12s %8.2f\n", $1, $2, $4, ($2 > 0 ? $4 / $2 : 0) }
           END { exit bad }' || fail "wrong elements"
done

# The shm transport (shared-memory rings) carries device operations through landing slots as
# TCP does.
step "all_reduce, 4 ranks over the shm transport, every result checked: host vs device buffers"
sweep 4 "$tmp/shm-host" --transport shm || fail "dear-bench host buffers over shm"
sweep 4 "$tmp/shm-dev" --transport shm --device cuda || fail "dear-bench device buffers over shm"
printf '%12s %12s %12s %8s\n' size host_busbw dev_busbw dev/host
join <(rows "$tmp/shm-host" | sort -k1,1) <(rows "$tmp/shm-dev" | sort -k1,1) | sort -n \
  | awk '{ if ($3 != 0 || $5 != 0) { print "wrong elements at " $1; bad = 1 }
           printf "%12s %12s %12s %8.2f\n", $1, $2, $4, ($2 > 0 ? $4 / $2 : 0) }
         END { exit bad }' || fail "wrong elements over shm"

# libfabric's write data path with FI_HMEM (where the provider offers it with CUDA memory):
# device operations' messages written straight into device windows, no pinned memory on the
# way ("device-window messages" > 0 on the engine lines); without it, landing slots as over TCP.
step "all_reduce, 2 ranks over libfabric (write path, FI_HMEM where offered): host vs device buffers"
for prov in "tcp;ofi_rxm" shm; do
  sweep 2 "$tmp/fi-host" --transport fabric --fabric-provider "$prov" \
    || fail "dear-bench host buffers over fabric $prov"
  DEAR_FABRIC_HMEM=on sweep 2 "$tmp/fi-dev" --transport fabric --fabric-provider "$prov" \
    --device cuda || fail "dear-bench device buffers over fabric $prov"
  echo "provider $prov:"
  grep "engine:" "$tmp/fi-dev" || true
  join <(rows "$tmp/fi-host" | sort -k1,1) <(rows "$tmp/fi-dev" | sort -k1,1) | sort -n \
    | awk '{ if ($3 != 0 || $5 != 0) { print "wrong elements at " $1; bad = 1 }
             printf "%12s %12s %12s %8.2f\n", $1, $2, $4, ($2 > 0 ? $4 / $2 : 0) }
           END { exit bad }' || fail "wrong elements over fabric $prov"
done

step "1 GiB device all_reduce, 2 ranks: pinned landing memory held (bounded by the slots)"
timeout 120 "$build/tools/dear-run" -n 2 --no-prefix -- "$build/bench/dear-bench" all_reduce \
  -b 1G -e 1G -n 1 -w 0 -c 1 --device cuda >"$tmp/gib" 2>&1 || { cat "$tmp/gib"; fail "1 GiB"; }
grep -E "^ +[0-9]|engine:" "$tmp/gib"

if command -v compute-sanitizer >/dev/null 2>&1; then
  step "compute-sanitizer memcheck, 2-rank device-resident collectives"
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 "$build/tests/test_cuda" \
    --gtest_brief=1 --gtest_filter='*2ranks_resident*:*ResidentConcurrent*' \
    || fail "compute-sanitizer memcheck (resident)"
else
  echo "compute-sanitizer not found: memcheck not run"
fi

if [ "$sanitize" = 1 ]; then
  command -v compute-sanitizer >/dev/null 2>&1 || fail "--sanitize: compute-sanitizer not found"
  for tool in memcheck racecheck; do
    step "GPU tests under compute-sanitizer --tool $tool"
    timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 3 \
      "$build/tests/test_cuda" --gtest_brief=1 || fail "compute-sanitizer $tool"
  done
fi

printf '\ngpu-check: OK\n'
