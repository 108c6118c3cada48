#!/usr/bin/env bash
# Ranks that know their node, and a node-local rebalance, live: two namespace "hosts" (each its
# own network namespace and hostname, joined by a veth pair), one job over them on the ucx
# transport (UCX_TLS=tcp,self on the veth pair):
#
#   mpirun --host H1:3,H2:3 -np 6 --map-by node: ranks 0, 2, 4 on H1 and 1, 3, 5 on H2
#   routers 0 (H1) and 1 (H2); expert ranks 2, 4 (H1) and 3, 5 (H2): interleaved, so the
#   planner must order the ranks by their real nodes. No `nodes:` map: the ranks learn their
#   nodes from the host names they gather at the start barrier.
#   dispatch: {prefer_node: true}: each router takes a copy on its own node where one exists.
#
# Phases (each: one `moebench serve --verify` per router, from that router's host, at once):
#   1. before: the linear placement (every expert once): about half of each router's rows go to
#      the other node (moerun_dispatch_bytes_total{to="other_node"} / {to="all"} on both routers).
#   2. `moectl rebalance --policy node-local --redundant R --wait` while both load generators
#      run: they must end with 0 failed, every answer verified.
#   3. after: the same load; the share of bytes off the node must fall (to at most MAX_AFTER of
#      the share before), and moectl status names each rank's node (its host's name).
# Prints one JSON line: off-node shares (per row and per (token, node)) before and after, tokens/s
# and lone-request latency are not measured here (the veth pair is not a network to time).
# Exit 0 on success, 77 without root / namespaces / ucx, 1 on failure.
#
#   node_local_netns.sh MOERUN MOECTL MOEBENCH [DURATION_S]
# Environment: NODE_LOCAL_REDUNDANT (default 16), KEEP_WORK=1 (keep the logs).
set -uo pipefail
usage() { echo "usage: node_local_netns.sh MOERUN MOECTL MOEBENCH [DURATION_S]" >&2; exit 2; }
[[ $# -ge 3 && $# -le 4 ]] || usage
MOERUN=$(realpath -m "$1")
MOECTL=$(realpath -m "$2")
MOEBENCH=$(realpath -m "$3")
DURATION=${4:-4}
REDUNDANT=${NODE_LOCAL_REDUNDANT:-16}
MAX_AFTER=0.5  # the off-node share after ÷ before must be at most this
[[ $DURATION =~ ^[0-9]+$ && $DURATION -ge 2 ]] || usage
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
unset OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_RANK PMIX_RANK PMI_RANK 2>/dev/null

skip() { echo "SKIP: $*"; exit 77; }
[[ $(id -u) -eq 0 ]] || skip "needs root (network namespaces)"
for tool in ip unshare mpirun timeout python3 curl; do
  command -v "$tool" >/dev/null || skip "$tool is not installed"
done
for b in "$MOERUN" "$MOECTL" "$MOEBENCH"; do [[ -x $b ]] || { echo "FAIL: $b is missing"; exit 1; }; done
"$MOERUN" serve --help 2>&1 | grep -q -- "--transport" || { echo "FAIL: $MOERUN serve does not run"; exit 1; }

SUFFIX=$(printf '%04x%02x' $((RANDOM)) $(($$ % 256)))
H1="moe-n1-$SUFFIX"
H2="moe-n2-$SUFFIX"
V1="mn1-$SUFFIX"
V2="mn2-$SUFFIX"
NET=$((RANDOM % 250 + 1))
SUBNET="10.233.$NET.0/24"
IP1="10.233.$NET.1"
IP2="10.233.$NET.2"
WORK=$(mktemp -d /tmp/moerun-nodelocal.XXXXXX)
TAG="node-local-$SUFFIX-$$"
SERVE_PORT=5720 CONTROL_PORT=5820 METRICS_PORT=9720  # the namespaces are ours: fixed ports
MADE_NS=()
MPI_PID=""
BG_PIDS=()

HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../lib/mpi_job.sh
source "$HERE/../lib/mpi_job.sh"  # tagged_pids, cleanup_job

# shellcheck disable=SC2317  # (called by the trap)
cleanup() {
  local rc=$? p ns
  disown -a 2>/dev/null
  for p in "${BG_PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  for ns in "${MADE_NS[@]}"; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
  done
  cleanup_job
  for ns in "${MADE_NS[@]}"; do ip netns del "$ns" 2>/dev/null; done
  ip link del "$V1" 2>/dev/null
  ip link del "$V2" 2>/dev/null
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT; trap 'exit 143' TERM; trap 'exit 129' HUP

fail() {
  echo "FAIL: $*"
  if [[ -f $WORK/serve.log ]]; then echo "--- serve log (tail):"; tail -30 "$WORK/serve.log" | sed 's/^/    | /'; fi
  exit 1
}
log() { printf '[%4d s] %s\n' "$SECONDS" "$*"; }

# ---- the two hosts ----
ip netns add "$H1" 2>"$WORK/netns.err" || skip "ip netns is unusable here: $(cat "$WORK/netns.err")"
MADE_NS+=("$H1")
ip netns add "$H2" || fail "cannot add a second namespace"
MADE_NS+=("$H2")
ip link add "$V1" type veth peer name "$V2" 2>"$WORK/veth.err" || skip "cannot make a veth pair: $(cat "$WORK/veth.err")"
ip link set "$V1" netns "$H1" && ip link set "$V2" netns "$H2" || fail "cannot move the veth ends"
ip -n "$H1" addr add "$IP1/24" dev "$V1"
ip -n "$H2" addr add "$IP2/24" dev "$V2"
for pair in "$H1:$V1" "$H2:$V2"; do
  ip -n "${pair%%:*}" link set lo up
  ip -n "${pair%%:*}" link set "${pair#*:}" up
done
log "hosts: $H1 ($IP1) and $H2 ($IP2) on $SUBNET"

AGENT="$HERE/../lib/nsexec.sh"
printf 'node-local-token-%s\n' "$RANDOM$RANDOM$RANDOM" >"$WORK/token"
chmod 600 "$WORK/token"

PRESET=(--preset qwen3-30b-a3b --seed 5 --experts 16 --weights-dtype bf16 --gate-skew 1.0)
cat >"$WORK/job.yaml" <<EOC
preset: {name: qwen3-30b-a3b, seed: 5, experts: 16, dtype: bf16, gate_skew: 1.0}
transport: ucx
routers: 2
placement: linear
threads: 1
dispatch: {prefer_node: true, spill: 1.0}
serving:
  listen: 0.0.0.0:$SERVE_PORT
  control_listen: 0.0.0.0:$CONTROL_PORT
  metrics_listen: 0.0.0.0:$METRICS_PORT
  token_file: $WORK/token
  load_window_s: $DURATION
  probe_deadline_ms: 10000
EOC

export UCX_TLS=tcp,self UCX_NET_DEVICES="$V1,$V2"
MOERUN_TEST_TAG=$TAG timeout -k 5 900 ip netns exec "$H1" unshare --uts /bin/bash -c "hostname $H1; exec mpirun \
  --allow-run-as-root --oversubscribe --bind-to none --mca plm_rsh_agent '$AGENT' \
  --host $H1:3,$H2:3 -np 6 --map-by node --display-map \
  --mca oob_tcp_if_include $SUBNET --mca btl_tcp_if_include $SUBNET --mca btl tcp,self \
  --mca mpi_yield_when_idle 1 -x MOERUN_TEST_TAG -x UCX_TLS -x UCX_NET_DEVICES \
  '$MOERUN' serve --config '$WORK/job.yaml' --ready-file '$WORK/ready' --pid-file '$WORK/pid'" \
  >>"$WORK/serve.log" 2>&1 &
MPI_PID=$!
for _ in $(seq 1 1200); do
  [[ -f $WORK/ready ]] && break
  kill -0 "$MPI_PID" 2>/dev/null || fail "serve exited before it was ready"
  sleep 0.1
done
[[ -f $WORK/ready ]] || fail "serve was not ready within 120 s"
grep -q "ucx" "$WORK/serve.log" || fail "the job did not say it runs over ucx"
log "job ready: routers 0 ($H1), 1 ($H2); expert ranks 2, 4 ($H1), 3, 5 ($H2)"

ctl() { ip netns exec "$H1" "$MOECTL" --target "$IP1:$CONTROL_PORT" --token-file "$WORK/token" "$@"; }

# The dispatch byte counters of router R (metrics port + R on its own host).
bytes() {  # bytes NAME: both routers' counters -> NAME.bytes (JSON)
  local r host ip
  for r in 0 1; do
    if [[ $r == 0 ]]; then host=$H1 ip=$IP1; else host=$H2 ip=$IP2; fi
    ip netns exec "$host" curl -sf "http://$ip:$((METRICS_PORT + r))/metrics" >"$WORK/$1.metrics.$r" ||
      fail "router $r's /metrics did not answer"
  done
  python3 - "$WORK" "$1" >"$WORK/$1.bytes" <<'PY' || fail "no moerun_dispatch_bytes_total in /metrics"
import json, re, sys
w, n = sys.argv[1], sys.argv[2]
out = {}
for r in (0, 1):
    for line in open(f"{w}/{n}.metrics.{r}"):
        m = re.match(r'moerun_dispatch_bytes_total\{(.*)\} (\S+)', line)
        if m:
            labels = dict(kv.split("=") for kv in m.group(1).split(","))
            key = labels["to"].strip('"') + "/" + labels["per"].strip('"')
            out[key] = out.get(key, 0) + float(m.group(2))
assert {"all/row", "other_node/row", "other_node/token_node"} <= set(out), out
print(json.dumps(out))
PY
}

BENCH_N=0
bench_start() {  # bench_start NAME SECONDS: one moebench serve --verify per router, in the background
  local r host ip
  for r in 0 1; do
    if [[ $r == 0 ]]; then host=$H1 ip=$IP1; else host=$H2 ip=$IP2; fi
    MOERUN_TEST_TAG=$TAG ip netns exec "$host" "$MOEBENCH" serve --target "$ip:$((SERVE_PORT + r))" \
      --concurrency 2 --duration "$2" --tokens-per-request 16 --verify "${PRESET[@]}" --inputs 16 \
      --seed-inputs $((r + 1)) --json >"$WORK/$1.$r.json" 2>"$WORK/$1.$r.log" &
    BG_PIDS+=($!)
  done
}
bench_wait() {  # bench_wait NAME: both must end with 0 failed, every answer verified
  local p rc=0
  for p in "${BG_PIDS[@]}"; do wait "$p" || rc=1; done
  BG_PIDS=()
  python3 - "$WORK" "$1" <<'PY' || fail "$1: moebench failed (logs: $(tail -3 "$WORK/$1".*.log))"
import json, sys
w, n = sys.argv[1], sys.argv[2]
for r in (0, 1):
    b = json.load(open(f"{w}/{n}.{r}.json"))
    print(f"{n}: router {r}: {b['ok']} ok, {b['error_count']} failed, {b['verified']} verified, "
          f"{b['tokens_per_s']:.0f} tokens/s")
    assert b["error_count"] == 0 and b["ok"] > 0 and b["verified"] == b["ok"], b
PY
  [[ $rc == 0 ]] || fail "$1: a moebench exited non-zero"
}

share() {  # share A B: the off-node shares between two counter snapshots -> JSON
  python3 - "$WORK/$1.bytes" "$WORK/$2.bytes" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
d = {k: b[k] - a[k] for k in b}
print(json.dumps({"bytes": d["all/row"], "off_node_share_rows": d["other_node/row"] / d["all/row"],
                  "off_node_share_token_nodes": d["other_node/token_node"] / d["all/row"]}))
PY
}

# ---- 1. before ----
bytes b0
bench_start before "$DURATION"
bench_wait before
bytes b1
BEFORE=$(share b0 b1)
log "before (linear): $BEFORE"

# ---- moectl status: every rank's node is its host ----
ctl status --json >"$WORK/status.json" 2>"$WORK/status.err" || fail "moectl status: $(cat "$WORK/status.err")"
python3 - "$WORK/status.json" "$H1" "$H2" <<'PY' || fail "moectl status does not name the ranks' nodes"
import json, sys
s = json.load(open(sys.argv[1]))
want = {0: sys.argv[2], 1: sys.argv[3], 2: sys.argv[2], 3: sys.argv[3], 4: sys.argv[2], 5: sys.argv[3]}
got = {r["rank"]: r.get("node", "") for r in s["ranks"]}
print("nodes:", got)
assert got == want, (got, want)
PY
ctl status >"$WORK/status.txt" 2>&1
grep -q "node" "$WORK/status.txt" || fail "moectl status prints no node column"

# ---- 2. the node-local rebalance, under load ----
bench_start during $((DURATION * 3))
sleep 1.5
ctl rebalance --policy node-local --redundant "$REDUNDANT" --wait --json >"$WORK/rebalance.json" 2>"$WORK/rebalance.err" ||
  fail "moectl rebalance failed: $(cat "$WORK/rebalance.err" "$WORK/rebalance.json")"
bench_wait during
log "rebalanced: $(python3 -c "import json; m = json.load(open('$WORK/rebalance.json')); print(m)" 2>/dev/null)"

# ---- 3. after ----
bytes a0
bench_start after "$DURATION"
bench_wait after
bytes a1
AFTER=$(share a0 a1)
log "after (node-local, $REDUNDANT redundant): $AFTER"

python3 - "$BEFORE" "$AFTER" "$MAX_AFTER" "$REDUNDANT" <<'PY' || fail "the off-node bytes did not fall enough"
import json, sys
b, a, limit, red = json.loads(sys.argv[1]), json.loads(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
out = {"test": "node_local_netns", "redundant": red, "before": b, "after": a,
       "after_over_before_rows": a["off_node_share_rows"] / b["off_node_share_rows"],
       "after_over_before_token_nodes":
           a["off_node_share_token_nodes"] / max(b["off_node_share_token_nodes"], 1e-12)}
print(json.dumps(out))
assert b["off_node_share_rows"] > 0.2, "before: too few rows left the node to show anything"
assert out["after_over_before_rows"] <= limit, out
PY
echo "PASS: node-local rebalance cut the off-node bytes; every answer verified"
