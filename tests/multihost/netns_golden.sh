#!/usr/bin/env bash
# Two "hosts" on one machine (network namespaces joined by a veth pair, each with its own
# hostname): `mpirun --host H1:2,H2:2 -np 4 moerun forward ...` over TCP between them writes the
# same file (cmp) as one process, for the golden fixtures.
#
#   netns_golden.sh MOERUN_BIN DATA_DIR [--full]      (or MOERUN_FULL=1)
#
# Default: each fixture once (deepseek_v3 with a JSON placement with replicas and microbatch 8,
# gpt_oss round_robin, ...), every placement and microbatch setting covered. --full: every
# fixture with linear, round_robin and JSON placements, microbatching off and on.
# Exit 77 (skipped) without root or network namespaces.
# MOERUN_TEST_TRANSPORT=ucx runs the ranks over the ucx transport with UCX_TLS=tcp,self on the
# veth devices (rows go by put: MOERUN_UCX_PUT_MIN=256) instead of mpi.
set -uo pipefail

usage() { echo "usage: netns_golden.sh MOERUN_BIN DATA_DIR [--full]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
MOERUN=$(realpath "$1")
DATA=$(realpath "$2")
shift 2
FULL=${MOERUN_FULL:-0}
TRANSPORT=${MOERUN_TEST_TRANSPORT:-mpi}
for a in "$@"; do
  case "$a" in
    --full) FULL=1 ;;
    *) usage ;;
  esac
done
MPI_TOOLS=$(cd "$(dirname "$0")/../mpi" && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
unset OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_RANK PMIX_RANK PMI_RANK 2>/dev/null

skip() { echo "SKIP: $*"; exit 77; }
[[ $(id -u) -eq 0 ]] || skip "needs root (network namespaces)"
for tool in ip unshare mpirun timeout python3; do
  command -v "$tool" >/dev/null || skip "$tool is not installed"
done

SUFFIX=$(printf '%04x%02x' $((RANDOM)) $(($$ % 256)))
H1="moe-h1-$SUFFIX"
H2="moe-h2-$SUFFIX"
V1="mv1-$SUFFIX"   # interface names: at most 15 characters
V2="mv2-$SUFFIX"
NET=$((RANDOM % 250 + 1))
SUBNET="10.231.$NET.0/24"
IP1="10.231.$NET.1"
IP2="10.231.$NET.2"
WORK=$(mktemp -d /tmp/moerun-netns.XXXXXX)
TAG="netns-golden-$SUFFIX-$$"
export MOERUN_TEST_TAG=$TAG
MADE_NS=()

cleanup() {
  local p ns
  # Processes of this run, wherever they are (mpirun, orted, ranks, agents).
  for ns in "${MADE_NS[@]}"; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
  done
  for p in /proc/[0-9]*; do
    [[ "${p#/proc/}" == "$$" ]] && continue
    grep -qzx "MOERUN_TEST_TAG=$TAG" "$p/environ" 2>/dev/null && kill -KILL "${p#/proc/}" 2>/dev/null
  done
  sleep 0.2
  for ns in "${MADE_NS[@]}"; do ip netns del "$ns" 2>/dev/null; done
  # A veth end still in this namespace (a failure before it was moved) goes with its peer.
  ip link del "$V1" 2>/dev/null
  ip link del "$V2" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT; trap 'exit 143' TERM; trap 'exit 129' HUP
KEEP_LOG=${KEEP_LOG:-}  # set: print every run's full mpirun output

# Can we make namespaces at all?
ip netns add "$H1" 2>"$WORK/netns.err" || skip "ip netns is unusable here: $(cat "$WORK/netns.err")"
MADE_NS+=("$H1")
ip netns add "$H2" || { echo "FAIL: cannot add a second namespace"; exit 1; }
MADE_NS+=("$H2")
if ! ip link add "$V1" type veth peer name "$V2" 2>"$WORK/veth.err"; then
  skip "cannot make a veth pair: $(cat "$WORK/veth.err")"
fi
set -e
ip link set "$V1" netns "$H1"
ip link set "$V2" netns "$H2"
ip -n "$H1" addr add "$IP1/24" dev "$V1"
ip -n "$H2" addr add "$IP2/24" dev "$V2"
for pair in "$H1:$V1" "$H2:$V2"; do
  ip -n "${pair%%:*}" link set lo up
  ip -n "${pair%%:*}" link set "${pair#*:}" up
done
set +e
# TCP from H1 to H2 (no ping here: a listener in H2, a connection from H1).
timeout 10 ip netns exec "$H2" python3 -c "
import socket, sys
s = socket.socket(); s.bind(('$IP2', 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.sendall(b'ok'); c.close()" >"$WORK/port" 2>&1 &
LISTENER=$!
for _ in $(seq 50); do [[ -s "$WORK/port" ]] && break; sleep 0.1; done
if ! timeout 10 ip netns exec "$H1" python3 -c "
import socket; c = socket.create_connection(('$IP2', int(open('$WORK/port').read())), timeout=5)
assert c.recv(2) == b'ok'" 2>"$WORK/tcp.err"; then
  echo "FAIL: $H1 cannot reach $H2 ($IP2) over TCP: $(cat "$WORK/port" "$WORK/tcp.err")"; exit 1
fi
wait "$LISTENER"
echo "hosts: $H1 ($IP1) and $H2 ($IP2) on $SUBNET; transport $TRANSPORT"
UCX_ENV=""
if [[ "$TRANSPORT" == ucx ]]; then
  # Between namespaces UCX would pick shared memory (same kernel): TCP on the veth pair only.
  export UCX_TLS=tcp,self UCX_NET_DEVICES="$V1,$V2" MOERUN_UCX_PUT_MIN=256 MOERUN_UCX_PROTOCOL=put
  UCX_ENV="-x UCX_TLS -x UCX_NET_DEVICES -x MOERUN_UCX_PUT_MIN -x MOERUN_UCX_PROTOCOL"
fi

# The rsh agent: "ssh" to a namespace host = enter its namespace with its own hostname.
AGENT="$WORK/nsexec.sh"
cat >"$AGENT" <<'EOF'
#!/bin/bash
# Open MPI calls: AGENT [options] HOST COMMAND...; options (-x, -o ...) are ignored here.
while [[ $# -gt 0 && "$1" == -* ]]; do shift; done
host="$1"; shift
echo "$host" >>"$(dirname "$0")/agent.log"
exec ip netns exec "$host" unshare --uts /bin/bash -c "hostname $host; $*"
EOF
chmod +x "$AGENT"

# The one-process references.
ref_for() {
  local fixture=$1 model="$DATA/hf-moe/$1"
  mkdir -p "$WORK/$fixture"
  [[ -f "$WORK/$fixture/ref.safetensors" ]] && return 0
  timeout -k 5 60 "$MOERUN" forward --model "$model" --input "$model/golden.safetensors" \
    --output "$WORK/$fixture/ref.safetensors" >"$WORK/$fixture/ref.log" 2>&1
}

PASSED=0
FAILED=0
FAILURES=()
run_case() {
  local fixture=$1 placement=$2 mb=$3
  local model="$DATA/hf-moe/$fixture" label=$placement
  local out="$WORK/$fixture/out.safetensors" log="$WORK/$fixture/log"
  if ! ref_for "$fixture"; then
    echo "FAIL $fixture: the 1-process run failed"; sed 's/^/    | /' "$WORK/$fixture/ref.log"
    FAILED=$((FAILED + 1)); FAILURES+=("$fixture reference"); return
  fi
  if [[ "$placement" == json ]]; then
    local note
    note=$(python3 "$MPI_TOOLS/st_tool.py" placement "$model" 4 "$WORK/$fixture/placement.json") ||
      { echo "FAIL $fixture: cannot write a placement"; FAILED=$((FAILED + 1)); return; }
    placement="$WORK/$fixture/placement.json"
    label="json($note)"
  fi
  local args="forward --model '$model' --input '$model/golden.safetensors' --output '$out' --placement '$placement'"
  [[ "$mb" != off ]] && args+=" --microbatch-tokens $mb"
  rm -f "$out"
  local t0=$EPOCHREALTIME
  timeout -k 5 120 ip netns exec "$H1" unshare --uts /bin/bash -c "hostname $H1; exec mpirun \
    --allow-run-as-root --oversubscribe --mca plm_rsh_agent '$AGENT' --host $H1:2,$H2:2 -np 4 \
    --mca oob_tcp_if_include $SUBNET --mca btl_tcp_if_include $SUBNET --mca btl tcp,self \
    --mca mpi_yield_when_idle 1 --display-map --tag-output $UCX_ENV '$MOERUN' $args \
    --transport $TRANSPORT" >"$log" 2>&1
  local rc=$?
  local secs
  secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }')
  local desc
  desc=$(printf '%-15s 4 ranks on 2 hosts (%s)  placement %-28s microbatch %-3s' "$fixture" "$TRANSPORT" "$label" "$mb")
  local why=""
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then why="timed out (hang?)"
  elif [[ $rc -ne 0 ]]; then why="exit $rc"
  elif [[ ! -f "$out" ]]; then why="no output file"
  elif ! cmp -s "$WORK/$fixture/ref.safetensors" "$out"; then
    why="output differs from the 1-process run ($(cmp "$WORK/$fixture/ref.safetensors" "$out" 2>&1 | head -1))"
  fi
  # Both hosts must really have run two ranks each, H2's started through the agent.
  if [[ -z "$why" ]]; then
    local h
    for h in "$H1" "$H2"; do
      grep -Eq "Data for node: ${h}[[:space:]].*Num procs: 2" "$log" || why="the job map has no 2 ranks on $h"
    done
    grep -qx "$H2" "$WORK/agent.log" 2>/dev/null || why="the rsh agent was not used to start $H2"
    if [[ "$TRANSPORT" == ucx ]] && ! grep -q "ucx: UCX .* UCX_TLS=tcp,self" "$log"; then
      why="the job did not run over ucx with UCX_TLS=tcp,self"
    fi
    rm -f "$WORK/agent.log"
  fi
  if [[ -z "$why" ]]; then
    [[ -n "$KEEP_LOG" ]] && cat "$log"
    echo "PASS $desc ${secs} s"
    PASSED=$((PASSED + 1))
  else
    echo "FAIL $desc ${secs} s: $why"
    sed 's/^/    | /' "$log" | tail -40
    FAILED=$((FAILED + 1)); FAILURES+=("$desc: $why")
  fi
}

START=$SECONDS
if [[ "$FULL" == 1 ]]; then
  for dir in "$DATA"/hf-moe/*/; do
    fixture=$(basename "$dir")
    [[ -f "$dir/config.json" && -f "$dir/golden.safetensors" ]] || continue
    for placement in linear round_robin json; do
      for mb in off 8; do run_case "$fixture" "$placement" "$mb"; done
    done
  done
else
  # Every fixture once; each placement and microbatch setting on several fixtures.
  run_case deepseek_v3 json 8
  run_case gpt_oss round_robin off
  run_case qwen2_moe linear 8
  run_case step3p5 json off
  run_case qwen3_moe round_robin 8
  run_case mixtral linear off
  for extra in "mixtral_f16 json 8" "qwen3_moe_bf16 round_robin off"; do
    read -r fixture placement mb <<<"$extra"
    [[ -d "$DATA/hf-moe/$fixture" ]] && run_case "$fixture" "$placement" "$mb"
  done
fi
# The transport conformance suite across the two hosts (MOERUN_TEST_CONFORMANCE: its binary).
if [[ -n "${MOERUN_TEST_CONFORMANCE:-}" ]]; then
  CONF=$(realpath "$MOERUN_TEST_CONFORMANCE")
  t0=$SECONDS
  timeout -k 5 240 ip netns exec "$H1" unshare --uts /bin/bash -c "hostname $H1; exec mpirun \
    --allow-run-as-root --oversubscribe --mca plm_rsh_agent '$AGENT' --host $H1:2,$H2:2 -np 4 \
    --mca oob_tcp_if_include $SUBNET --mca btl_tcp_if_include $SUBNET --mca btl tcp,self \
    --mca mpi_yield_when_idle 1 $UCX_ENV '$CONF' --gtest_filter='$TRANSPORT/*'" \
    >"$WORK/conformance.log" 2>&1
  rc=$?
  if [[ $rc -eq 0 ]] && grep -q "PASSED" "$WORK/conformance.log"; then
    echo "PASS transport conformance ($TRANSPORT) across 2 hosts: $(grep -o '[0-9]* tests\?\.' "$WORK/conformance.log" | head -1) in $((SECONDS - t0)) s"
    PASSED=$((PASSED + 1))
  else
    echo "FAIL transport conformance ($TRANSPORT) across 2 hosts: exit $rc"
    grep -v "UCX  WARN  unexpected tag-receive" "$WORK/conformance.log" | grep -A12 "Failure" |
      sed 's/^/    | /' | head -80
    FAILED=$((FAILED + 1)); FAILURES+=("conformance across hosts")
  fi
fi
echo "netns_golden: $PASSED passed, $FAILED failed in $((SECONDS - START)) s"
if [[ $FAILED -ne 0 ]]; then
  printf '  failed: %s\n' "${FAILURES[@]}"
  exit 1
fi
exit 0
