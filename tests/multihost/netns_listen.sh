#!/usr/bin/env bash
# Safe defaults across a real network boundary: two "hosts" (network namespaces joined by a veth
# pair). `moerun serve --config configs/tiny.yaml` (ranks as threads) runs in H1:
#   1. with its default addresses: H1 itself is answered on loopback (an InferRequest, and
#      /health/live), H2 cannot connect to the serving or the HTTP port of H1's address, and
#      nothing is logged about every interface;
#   2. with --listen IP1:PORT --metrics-listen 0.0.0.0:PORT (what a job reached from other hosts
#      says): H2 is answered on both, and the log warns of the HTTP endpoint (every interface)
#      but not of the serving one (one address).
#
#   netns_listen.sh MOERUN_BIN SOURCE_DIR
#
# Exit 77 (skipped) without root or network namespaces.
set -uo pipefail

[[ $# -eq 2 ]] || { echo "usage: netns_listen.sh MOERUN_BIN SOURCE_DIR" >&2; exit 2; }
MOERUN=$(realpath "$1")
SRC=$(realpath "$2")

skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; [[ -f ${LOG:-} ]] && tail -20 "$LOG"; exit 1; }
[[ $(id -u) -eq 0 ]] || skip "needs root (network namespaces)"
for tool in ip python3 timeout; do command -v "$tool" >/dev/null || skip "$tool is not installed"; done

SUFFIX=$(printf '%04x%02x' $((RANDOM)) $(($$ % 256)))
H1="moe-l1-$SUFFIX"
H2="moe-l2-$SUFFIX"
V1="ml1-$SUFFIX"
V2="ml2-$SUFFIX"
NET=$((RANDOM % 250 + 1))
IP1="10.233.$NET.1"
IP2="10.233.$NET.2"
WORK=$(mktemp -d /tmp/moerun-netns-listen.XXXXXX)
MADE_NS=()
cleanup() {
  local ns p
  for ns in "${MADE_NS[@]}"; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
  done
  sleep 0.2
  for ns in "${MADE_NS[@]}"; do ip netns del "$ns" 2>/dev/null; done
  ip link del "$V1" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT; trap 'exit 143' TERM

ip netns add "$H1" 2>"$WORK/netns.err" || skip "ip netns is unusable here: $(cat "$WORK/netns.err")"
MADE_NS+=("$H1")
ip netns add "$H2" || fail "cannot add a second namespace"
MADE_NS+=("$H2")
ip link add "$V1" type veth peer name "$V2" 2>"$WORK/veth.err" ||
  skip "cannot make a veth pair: $(cat "$WORK/veth.err")"
ip link set "$V1" netns "$H1" && ip link set "$V2" netns "$H2" &&
  ip -n "$H1" addr add "$IP1/24" dev "$V1" && ip -n "$H2" addr add "$IP2/24" dev "$V2" &&
  ip -n "$H1" link set lo up && ip -n "$H1" link set "$V1" up &&
  ip -n "$H2" link set lo up && ip -n "$H2" link set "$V2" up || fail "cannot set up the veth pair"

# The client: `probe.py HOST SERVE_PORT HTTP_PORT` prints "serve ok|refused|..." and
# "http ok|refused|...": an InferRequest of 2 tokens (hidden 64, F32) answered OK with 2 x 64
# values, and GET /health/live answered 200.
cat >"$WORK/probe.py" <<'PY'
import socket, struct, sys

from raw_frames import infer_request, read_response

host, serve_port, http_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def serve():
    data = struct.pack("<128f", *([0.5] * 128))
    with socket.create_connection((host, serve_port), timeout=5) as s:
        s.sendall(infer_request(7, [2, 64], 1, data))
        f = read_response(s)
    if f.get(2, 0) != 0:
        return "error %d %s" % (f[2], f.get(3, b"").decode())
    return "ok" if f.get(1) == 7 and len(f.get(6, b"")) == 128 * 4 else "bad answer"

def http():
    with socket.create_connection((host, http_port), timeout=5) as s:
        s.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = b""
        while True:
            c = s.recv(4096)
            if not c:
                break
            reply += c
    return "ok" if reply.startswith(b"HTTP/1.1 200") else "status " + reply[:12].decode()

for name, fn in (("serve", serve), ("http", http)):
    try:
        print(name, fn())
    except ConnectionRefusedError:
        print(name, "refused")
    except Exception as e:  # noqa: BLE001  (any other outcome is reported as is)
        print(name, type(e).__name__, e)
PY

# Starts moerun serve in H1 with extra flags; waits for its ready file.
start() {
  LOG="$WORK/serve-$1.log"
  shift
  rm -f "$WORK/ready"
  ip netns exec "$H1" "$MOERUN" serve --config "$SRC/configs/tiny.yaml" --ready-file "$WORK/ready" \
    --pid-file "$WORK/pid" "$@" >"$LOG" 2>&1 &
  SERVE=$!
  for _ in $(seq 600); do
    [[ -f $WORK/ready ]] && return 0
    kill -0 "$SERVE" 2>/dev/null || fail "moerun serve exited before it was ready"
    sleep 0.1
  done
  fail "moerun serve not ready in 60 s"
}
stop() {
  kill -TERM "$SERVE" 2>/dev/null
  wait "$SERVE" || fail "moerun serve did not shut down cleanly"
}
probe() {  # probe NAMESPACE HOST SERVE_PORT HTTP_PORT EXPECTED
  local got
  got=$(PYTHONPATH="$SRC/tests/lib" timeout 20 ip netns exec "$1" python3 "$WORK/probe.py" "$2" "$3" "$4" 2>&1 | tr '\n' ' ')
  [[ $got == "$5 " ]] || fail "from $1 to $2:$3/$4: expected '$5', got '$got'"
  echo "  from $1 to $2 (serving $3, http $4): $got"
}

echo "hosts: $H1 ($IP1), $H2 ($IP2)"
echo "1. default addresses"
start default
probe "$H1" 127.0.0.1 5700 9700 "serve ok http ok"
probe "$H2" "$IP1" 5700 9700 "serve refused http refused"
probe "$H1" "$IP1" 5700 9700 "serve refused http refused"
grep -q "every network interface" "$LOG" && fail "a warning about every interface with the defaults"
stop

echo "2. --listen $IP1:5710 --metrics-listen 0.0.0.0:9710"
start named --listen "$IP1:5710" --metrics-listen 0.0.0.0:9710
probe "$H2" "$IP1" 5710 9710 "serve ok http ok"
probe "$H1" 127.0.0.1 5710 9710 "serve refused http ok"
grep -q "the HTTP endpoint (/metrics, /health) listens on every network interface (0.0.0.0:9710)" \
  "$LOG" || fail "no warning for the HTTP endpoint on 0.0.0.0"
grep -q "the serving endpoint listens on every" "$LOG" && fail "a warning for the serving endpoint on one address"
stop
echo "PASS netns_listen: loopback by default (refused from another host), named addresses reached, warnings as expected"
