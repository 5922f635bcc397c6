#!/usr/bin/env bash
# Proves each way into an installed dear, from the installed copy only (not the build tree):
#   1. cmake --install into a temporary prefix; every public header compiles with only that
#      prefix's include directory;
#   2. examples/consumer built with find_package(dear) (shared, and static where libdear.a was
#      installed) and with pkg-config, each run on 2 ranks with the prefix's dear-run;
#   3. cpack -G DEB, the package installed (as root; skipped otherwise, saying so), the consumer
#      built against /usr and run, the package removed again;
#   4. pip install ./python into a fresh virtual environment, `import dear` from another
#      directory with no PYTHONPATH, and a 2-rank all_reduce checked element by element.
# Exits non-zero on the first failure. Called by scripts/test.sh after the test pass.
#
#   ./scripts/install-check.sh [BUILD_DIR]     # default build/test
set -euo pipefail
DEAR_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/lib.sh
. "$DEAR_ROOT/scripts/lib.sh"
build=$(cd "${1:-$DEAR_ROOT/build/test}" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
consumer_src=$DEAR_ROOT/examples/consumer

dear_log "install-check: cmake --install into $prefix"
cmake --install "$build" --prefix "$prefix" >"$work/install.log"
libdir=$(dirname "$(find "$prefix" -name 'libdear.so' -print -quit)")
[ -n "$libdir" ] && [ -f "$prefix/include/dear/version.h" ] || {
  dear_log "install-check: the installed tree lacks libdear.so or dear/version.h"
  exit 1
}

headers=$(cd "$prefix/include" && find dear -name '*.h' | sort)
dear_log "install-check: $(echo "$headers" | wc -l) public headers, each alone with -I$prefix/include"
for h in $headers; do
  echo "#include <$h>" | c++ -std=c++20 -fsyntax-only -I"$prefix/include" -x c++ - || {
    dear_log "install-check: installed header $h does not compile on its own"
    exit 1
  }
done

# run_consumer NAME PROGRAM [DEAR_RUN]: 2 ranks; each rank checks its result and exits non-zero
# on any wrong element.
run_consumer() {
  local name=$1 program=$2 run=${3:-$prefix/bin/dear-run}
  dear_log "install-check: $name on 2 ranks"
  "$run" -n 2 --timeout 120 "$program"
}

configure_consumer() {
  local dir=$1
  shift
  cmake -S "$consumer_src" -B "$dir" -DCMAKE_BUILD_TYPE=Release "$@" >"$dir.log" 2>&1 &&
    cmake --build "$dir" >>"$dir.log" 2>&1 || {
    cat "$dir.log" >&2
    return 1
  }
}

configure_consumer "$work/cmake" -DCMAKE_PREFIX_PATH="$prefix"
run_consumer "find_package consumer" "$work/cmake/consumer"
if [ -f "$libdir/libdear.a" ]; then
  configure_consumer "$work/cmake-static" -DCMAKE_PREFIX_PATH="$prefix" -DDEAR_CONSUMER_STATIC=ON
  if ldd "$work/cmake-static/consumer" | grep -q libdear; then
    dear_log "install-check: the static consumer links libdear.so"
    exit 1
  fi
  run_consumer "find_package consumer (dear::dear_static)" "$work/cmake-static/consumer"
fi

cp -r "$consumer_src" "$work/pc"
PKG_CONFIG_PATH="$libdir/pkgconfig" make -s -C "$work/pc" consumer-pc
run_consumer "pkg-config consumer" "$work/pc/consumer-pc"

if [ "$(id -u)" = 0 ] && command -v dpkg >/dev/null; then
  if dpkg-query -W dear >/dev/null 2>&1; then
    dear_log "install-check: a dear package is already installed; the .deb check is skipped"
  else
    dear_log "install-check: cpack -G DEB"
    (cd "$build" && cpack -G DEB -B "$work/deb" >"$work/cpack.log" 2>&1) || {
      cat "$work/cpack.log" >&2
      exit 1
    }
    deb=$(find "$work/deb" -maxdepth 1 -name 'dear_*.deb' -print -quit)
    dpkg-deb --field "$deb" Package Version Depends | sed 's/^/[dear]   /' >&2
    dpkg -i "$deb" >/dev/null
    remove_deb() { dpkg -r dear >/dev/null; }
    trap 'remove_deb; rm -rf "$work"' EXIT
    configure_consumer "$work/cmake-deb"
    run_consumer "consumer against the .deb" "$work/cmake-deb/consumer" /usr/bin/dear-run
    remove_deb
    trap 'rm -rf "$work"' EXIT
  fi
else
  dear_log "install-check: .deb check skipped (needs root and dpkg to install the package)"
fi

python=${DEAR_TORCH_PYTHON:-/usr/bin/python3}
if [ -d "$build/python/dear" ]; then
  dear_log "install-check: pip install ./python into a virtual environment"
  # --system-site-packages: the environment sees Debian's torch and numpy.
  "$python" -m venv --system-site-packages "$work/venv"
  DEAR_BUILD_DIR=$build "$work/venv/bin/python" -m pip install --no-build-isolation --no-deps \
    --no-index -q "$DEAR_ROOT/python" 2>&1 | grep -v "pip as the 'root' user" >&2 || true
  cat >"$work/check.py" <<'PY'
import os, sys
import torch
import dear
assert "PYTHONPATH" not in os.environ
dear.init()
r, n = dear.rank(), dear.size()
t = torch.arange(1000, dtype=torch.float32) * (r + 1)
dear.all_reduce(t)
want = torch.arange(1000, dtype=torch.float32) * (n * (n + 1) // 2)
wrong = int((t != want).sum())
print(f"rank {r} of {n}: dear from {os.path.dirname(dear.__file__)}, {wrong} wrong")
dear.shutdown()
sys.exit(1 if wrong else 0)
PY
  (cd "$work" && env -u PYTHONPATH "$prefix/bin/dear-run" -n 2 --timeout 120 \
    "$work/venv/bin/python" "$work/check.py")
else
  dear_log "install-check: pip check skipped (this build has no Python package: $build/python/dear)"
fi
dear_log "install-check: every way in works from the installed copy"
