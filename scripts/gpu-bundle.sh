#!/usr/bin/env bash
# Gathers what scripts/gpu-check.sh --no-build runs into one folder that can be copied to a GPU
# node which lacks the build's dependencies (a CUDA image without libfabric, Google Benchmark,
# GoogleTest or a compiler for this project): the programs, stripped of their debug information,
# in the build tree's layout, and in lib/ the shared libraries they load, except the C and C++
# runtimes every Linux machine has and the CUDA driver the node brings. gpu-check.sh --no-build
# puts that lib/ on LD_LIBRARY_PATH itself.
#
#   scripts/gpu-bundle.sh [--build DIR] [--out DIR] [--max-mib N]
#   --build DIR    a build with CUDA (-DDEAR_CUDA=ON) that has built the programs below
#                  (default build/test, the tree scripts/test.sh builds)
#   --out DIR      the folder to fill, emptied first (default build-gpu-bundle)
#   --max-mib N    fail when the folder is larger (default 64)
#
# Then, on the GPU node, from a copy of this repository holding the folder:
#   scripts/gpu-check.sh --no-build build-gpu-bundle
# Exits non-zero when a program is missing, a library cannot be found, or the folder is too big.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build/test"
out="$root/build-gpu-bundle"
max_mib=64
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --max-mib) max_mib="$2"; shift 2 ;;
    *) echo "gpu-bundle: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
fail() { echo "gpu-bundle: $*" >&2; exit 1; }

# What gpu-check.sh --no-build needs; test_nccl_comm is taken where the build has it.
programs=(tests/test_cuda tests/test_staging bench/cuda-reduce-bench bench/dear-bench tools/dear-run)
optional=(tests/test_nccl_comm)
for p in "${programs[@]}"; do
  [ -x "$build/$p" ] || fail "$build/$p is missing: build it with CUDA first (scripts/test.sh, or cmake -DDEAR_CUDA=ON and the targets test_cuda test_staging cuda-reduce-bench dear-bench dear-run)"
done
for p in "${optional[@]}"; do
  [ -x "$build/$p" ] && programs+=("$p")
done

rm -rf "$out"
mkdir -p "$out/lib"
for p in "${programs[@]}"; do
  mkdir -p "$out/$(dirname "$p")"
  strip --strip-debug -o "$out/$p" "$build/$p"
done

# Every machine has these (glibc, the GCC runtime); the CUDA driver and NCCL come with the node.
keep_out='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libresolv|libgcc_s|libstdc\+\+|libcuda|libnvidia-.*|libnccl)\.so'
missing=""
for p in "${programs[@]}"; do
  while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    if [ "$path" = "not" ]; then missing+=" $name"; continue; fi
    [[ "$name" =~ $keep_out ]] && continue
    [ -e "$out/lib/$name" ] || cp -L "$path" "$out/lib/$name"
  done < <(ldd "$build/$p")
done
[ -z "$missing" ] || fail "libraries not found here:$missing"

# The bundle must load from itself alone, apart from what was left out above.
for p in "${programs[@]}"; do
  unresolved="$(LD_LIBRARY_PATH="$out/lib" ldd "$out/$p" | awk '$3 == "not" && $1 !~ /^libnccl/ { print $1 }')"
  [ -z "$unresolved" ] || fail "$p: cannot load $unresolved from the bundle"
done

size_kib="$(du -sk "$out" | cut -f1)"
echo "gpu-bundle: ${#programs[@]} programs and $(find "$out/lib" -type f | wc -l) libraries in $out, $((size_kib / 1024)) MiB:"
(cd "$out" && find . -type f -printf '  %P %s\n' | sort)
[ "$size_kib" -le $((max_mib * 1024)) ] || fail "$out is $((size_kib / 1024)) MiB, over --max-mib $max_mib"
echo "gpu-bundle: on the GPU node: scripts/gpu-check.sh --no-build $(realpath --relative-to="$root" "$out" 2>/dev/null || echo "$out")"
