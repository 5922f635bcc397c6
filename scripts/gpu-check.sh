#!/usr/bin/env bash
# GPU check for a machine with one NVIDIA GPU, in about five minutes:
#   1. build the CUDA parts (kernels for sm_80, sm_90 and PTX),
#   2. run the GPU tests (kernels vs the CPU kernels for every dtype x op, collectives on
#      device buffers with 1-4 ranks as threads sharing the GPU, stream ordering),
#   3. the kernel benchmark next to cudaMemcpy device-to-device,
#   4. dear-bench on device buffers with 2 and 4 ranks (processes) sharing the GPU, checked.
#   5. with --sanitize, the GPU tests again under compute-sanitizer (memcheck, then racecheck).
# Exits non-zero at the first failure, and at once when no GPU is usable.
# Usage: scripts/gpu-check.sh [--no-build] [--sanitize] [build-dir]   (default: build-gpu)
#   --no-build  use the programs already in build-dir (built elsewhere with -DDEAR_CUDA=ON), for
#               a GPU node without the build's dependencies; set LD_LIBRARY_PATH for their
#               shared libraries yourself.
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
  timeout 180 cmake --build "$build" -j"$(nproc)" --target test_cuda test_staging \
    cuda-reduce-bench dear-bench dear-run || fail "build"
  timeout 120 cmake --build "$build" -j"$(nproc)" --target test_nccl_comm >/dev/null 2>&1 || true
else
  for p in tests/test_cuda tests/test_staging bench/cuda-reduce-bench bench/dear-bench \
           tools/dear-run; do
    [ -x "$build/$p" ] || fail "--no-build: $build/$p is missing"
  done
fi

step "GPU tests (must run, not skip)"
out="$(timeout 120 "$build/tests/test_cuda" --gtest_brief=1 2>&1)" || { echo "$out"; fail "test_cuda"; }
echo "$out" | tail -n 5
if echo "$out" | grep -q "SKIPPED"; then echo "$out" | grep -m1 -i "no CUDA device"; fail "GPU tests skipped"; fi
timeout 60 "$build/tests/test_staging" --gtest_brief=1 || fail "test_staging"

step "scheduler on NCCL (one rank per GPU; skipped where NCCL was not found)"
if [ -x "$build/tests/test_nccl_comm" ]; then
  timeout 120 "$build/tests/test_nccl_comm" --gtest_brief=1 || fail "test_nccl_comm"
else
  echo "test_nccl_comm not built (no NCCL in this toolkit)"
fi

step "kernel throughput vs cudaMemcpy D2D (GB/s = memory traffic; compare the columns)"
timeout 90 "$build/bench/cuda-reduce-bench" --benchmark_min_time=0.05 \
  --benchmark_filter='(memcpy_d2d|reduce/(float|half|bfloat16|int8)/(sum|avg))/268435456' \
  || fail "cuda-reduce-bench"

for n in 2 4; do
  step "dear-bench all_reduce on device buffers, $n ranks sharing the GPU (-c 1: checked)"
  timeout 120 "$build/tools/dear-run" -n "$n" -- "$build/bench/dear-bench" all_reduce \
    -b 8 -e 64M -f 4 -n 5 -w 2 -c 1 --device cuda || fail "dear-bench with $n ranks"
done

if [ "$sanitize" = 1 ]; then
  command -v compute-sanitizer >/dev/null 2>&1 || fail "--sanitize: compute-sanitizer not found"
  for tool in memcheck racecheck; do
    step "GPU tests under compute-sanitizer --tool $tool"
    timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 3 \
      "$build/tests/test_cuda" --gtest_brief=1 || fail "compute-sanitizer $tool"
  done
fi

printf '\ngpu-check: OK\n'
