# Shared by the scripts: dependency installation and the build. Source it; do not run it.

# Debian packages the build and tests need. The peers (Open MPI, Gloo) are built whenever they
# are present, so they are installed too: compare-peers needs them and CI compiles them.
# iproute2: the network-namespace test (`ip netns`); jq: the scripts that read dear-sim's and
# dear-train's JSON (paper-table, sim-vs-replay) and their tests. libibverbs-dev (rdma-core's
# headers and library) builds the verbs back-end; the test build asks for it (-DDEAR_VERBS=ON)
# so that a machine without it fails to configure instead of silently leaving verbs out.
DEAR_BUILD_PACKAGES=(build-essential cmake ninja-build pkg-config libasio-dev libcli11-dev
  nlohmann-json3-dev libgtest-dev libgmock-dev libbenchmark-dev libssl-dev iproute2 libfabric-dev
  libibverbs-dev jq)
DEAR_PEER_PACKAGES=(libopenmpi-dev openmpi-bin libgloo-dev)
# The Python package and its tests (Debian's interpreter with its PyTorch); pip, setuptools,
# wheel and venv install the package from python/ (scripts/install-check.sh).
DEAR_PYTHON_PACKAGES=(pybind11-dev python3-dev python3-torch python3-numpy python3-pip
  python3-setuptools python3-wheel python3-venv)
# Plots of the studies (scripts/latency-study.sh); without them the studies write CSV/JSON only.
DEAR_STUDY_PACKAGES=(gnuplot-nox)

dear_log() { printf '[dear] %s\n' "$*" >&2; }

# Installs the named Debian packages that are missing (needs root, as on a fresh machine).
dear_install() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ]; then
    dear_log "missing packages: ${missing[*]}; install them (apt-get install) or run as root"
    return 1
  fi
  dear_log "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# dear_build DIR [cmake args...]: configures (Ninja) and builds everything into DIR.
dear_build() {
  local dir=$1
  shift
  cmake -S "$DEAR_ROOT" -B "$dir" -G Ninja "$@" >"$dir.configure.log" 2>&1 || {
    cat "$dir.configure.log" >&2
    return 1
  }
  cmake --build "$dir" -j "$(nproc)"
}
