#!/usr/bin/env bash
# Emulated hosts for multi-host studies on one machine: N network namespaces, each with one
# rate-shaped link to a switch (a Linux bridge in a namespace of its own).
#
#   netns-cluster.sh up N [--rate 10gbit] [--delay-us D]   build hosts 0..N-1
#   netns-cluster.sh exec I cmd [args...]                  run cmd on host I
#   netns-cluster.sh addr I                                print host I's address
#   netns-cluster.sh status                                list the hosts
#   netns-cluster.sh down                                  remove everything `up` made
#
# Host I is namespace <prefix>-hI with interface eth0 at 10.77.0.(I+1)/24; the switch is
# namespace <prefix>-br. Nothing is created in the namespace the script runs in, so the test
# addresses exist only inside these namespaces. Both directions of each host link are shaped
# with a token bucket (tbf) at --rate (e.g. 10gbit, or 100gbit for a 100 Gb/s-class profile).
#
# Delay: these kernels have no netem qdisc, so --delay-us is not put on the wire; it is
# recorded, and `exec` passes it to dear as DEAR_LINK_DELAY_US (the link delay decorator),
# unless the caller set that variable already.
#
# Environment: DEAR_NETNS_PREFIX (default "dear") names the namespaces, so that separate
# clusters (e.g. concurrent tests) do not collide.
#
# Needs root, iproute2 (ip, tc) and a kernel that allows network namespaces, veth and bridge
# links. Exit status 0 on success; 1 on failure; 2 for a bad command line; 77 when this
# machine cannot build namespaces (not root, no iproute2, or the kernel or sandbox forbids
# it), with the reason on stderr, so that tests can skip.
set -euo pipefail

prefix=${DEAR_NETNS_PREFIX:-dear}
subnet=10.77.0
state_dir=${DEAR_NETNS_STATE_DIR:-/run/dear-netns}
state_file=$state_dir/$prefix.env
readonly kUnsupported=77

log() { printf 'netns-cluster: %s\n' "$*" >&2; }
die() {
  log "$*"
  exit 1
}
usage() {
  sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
unsupported() {
  log "cannot build emulated hosts here: $*"
  exit "$kUnsupported"
}

host_ns() { printf '%s-h%d' "$prefix" "$1"; }
bridge_ns() { printf '%s-br' "$prefix"; }
host_addr() { printf '%s.%d' "$subnet" $(($1 + 1)); }

# The namespaces of this prefix that exist now, one a line.
our_namespaces() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${prefix}-(br|h[0-9]+)\$" || true
}

# Root, iproute2, and a kernel that lets us make a namespace: checked by doing it.
check_support() {
  [ "$(id -u)" = 0 ] || unsupported "needs root (network namespaces and tc)"
  command -v ip >/dev/null && command -v tc >/dev/null ||
    unsupported "iproute2 (ip, tc) is not installed: apt-get install -y iproute2"
  local probe="${prefix}-probe$$" err
  if ! err=$(ip netns add "$probe" 2>&1); then
    unsupported "'ip netns add' failed: $err"
  fi
  ip netns delete "$probe" 2>/dev/null || true
}

# "10gbit" -> bytes per second (tc's units: bit, kbit, mbit, gbit, tbit; decimal).
rate_bytes() {
  local text=$1 num unit mult
  [[ $text =~ ^([0-9]+)(bit|kbit|mbit|gbit|tbit)$ ]] || return 1
  num=${BASH_REMATCH[1]}
  unit=${BASH_REMATCH[2]}
  case $unit in
    bit) mult=1 ;;
    kbit) mult=1000 ;;
    mbit) mult=1000000 ;;
    gbit) mult=1000000000 ;;
    tbit) mult=1000000000000 ;;
  esac
  echo $((num * mult / 8))
}

# tbf on DEV in namespace NS at RATE. The bucket must hold what the rate delivers in a few
# timer ticks, or the shaper cannot reach the rate; 4 ms worth, at least 64 KiB.
shape() {
  local ns=$1 dev=$2 rate=$3 bytes burst
  bytes=$(rate_bytes "$rate")
  burst=$((bytes / 250))
  [ "$burst" -ge 65536 ] || burst=65536
  ip netns exec "$ns" tc qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" \
    latency 20ms
}

down() {
  local ns left
  for ns in $(our_namespaces); do
    # Deleting a namespace destroys the interfaces in it, the veth pairs included.
    ip netns delete "$ns" 2>/dev/null || log "could not delete namespace $ns"
  done
  rm -f "$state_file"
  left=$(our_namespaces)
  [ -z "$left" ] || die "namespaces left behind: $left"
}

up() {
  local n=${1:-}
  shift || true
  [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 250 ] || {
    log "up: N must be a number from 1 to 250"
    usage
  }
  local rate=10gbit delay_us=0
  while [ $# -gt 0 ]; do
    case $1 in
      --rate)
        rate=${2:-}
        shift 2 || usage
        ;;
      --delay-us)
        delay_us=${2:-}
        shift 2 || usage
        ;;
      *)
        log "up: unknown option $1"
        usage
        ;;
    esac
  done
  rate_bytes "$rate" >/dev/null || {
    log "up: --rate $rate: expected a number with bit, kbit, mbit, gbit or tbit"
    usage
  }
  [[ $delay_us =~ ^[0-9]+$ ]] || {
    log "up: --delay-us $delay_us: expected whole microseconds"
    usage
  }
  check_support
  [ -z "$(our_namespaces)" ] ||
    die "a cluster named '$prefix' exists already; run '$0 down' first (or set DEAR_NETNS_PREFIX)"

  # A half-built cluster is torn down again, whatever step failed.
  trap 'rc=$?; if [ $rc -ne 0 ]; then log "up failed; removing what was built"; down; fi' EXIT
  trap 'exit 130' INT TERM

  local br i host
  br=$(bridge_ns)
  ip netns add "$br"
  ip -n "$br" link set lo up
  ip -n "$br" link add br0 type bridge
  ip -n "$br" link set br0 up
  for ((i = 0; i < n; i++)); do
    host=$(host_ns "$i")
    ip netns add "$host"
    ip -n "$host" link set lo up
    # One end stays on the switch as port pI, the other becomes the host's eth0.
    ip -n "$br" link add "p$i" type veth peer name eth0 netns "$host"
    ip -n "$br" link set "p$i" master br0 up
    ip -n "$host" addr add "$(host_addr "$i")/24" dev eth0
    ip -n "$host" link set eth0 up
    # Egress of each end: the host's sends, and what the switch delivers to the host.
    shape "$host" eth0 "$rate"
    shape "$br" "p$i" "$rate"
  done
  mkdir -p "$state_dir"
  printf 'hosts=%d\nrate=%s\ndelay_us=%d\n' "$n" "$rate" "$delay_us" >"$state_file"
  trap - EXIT INT TERM
  log "up: $n hosts ${prefix}-h0..$((n - 1)) at $(host_addr 0)..$(host_addr $((n - 1)))," \
    "rate $rate per link, link delay ${delay_us} us (DEAR_LINK_DELAY_US)"
}

read_state() {
  [ -f "$state_file" ] || die "no cluster named '$prefix' is up (run '$0 up N' first)"
  # shellcheck disable=SC1090
  . "$state_file"
}

run_on() {
  local i=${1:-}
  shift || true
  read_state
  [[ $i =~ ^[0-9]+$ ]] && [ "$i" -lt "$hosts" ] || die "exec: host must be 0..$((hosts - 1))"
  [ $# -gt 0 ] || usage
  local env=()
  if [ "$delay_us" -gt 0 ] && [ -z "${DEAR_LINK_DELAY_US:-}" ]; then
    env=(DEAR_LINK_DELAY_US="$delay_us")
  fi
  exec ip netns exec "$(host_ns "$i")" env "${env[@]}" "$@"
}

status() {
  local ns
  if [ -f "$state_file" ]; then cat "$state_file"; fi
  for ns in $(our_namespaces); do
    printf '%s:' "$ns"
    ip -n "$ns" -brief addr show 2>/dev/null | awk '$1 != "lo" {printf " %s %s", $1, $3}'
    echo
  done
}

cmd=${1:-}
shift || true
case $cmd in
  up) up "$@" ;;
  down)
    [ "$(id -u)" = 0 ] || unsupported "needs root (network namespaces and tc)"
    down
    ;;
  exec) run_on "$@" ;;
  addr)
    [[ ${1:-} =~ ^[0-9]+$ ]] || usage
    host_addr "$1"
    echo
    ;;
  status) status ;;
  *) usage ;;
esac
