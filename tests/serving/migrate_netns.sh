#!/usr/bin/env bash
# Online expert migration under a cluster-like bottleneck, on one machine:
#
#   switch namespace: a Linux bridge; four namespace "hosts" on it by veth pairs:
#     router host  (rank 0, the router; moebench and moectl run here too)   link not limited
#     expert hosts (ranks 1, 2, 3, one each)   link limited by tbf to LINK_MBIT, both directions
#                  (egress of the host's end and of the switch's port)
#   mpirun (rsh agent = enter the namespace, as tests/multihost/netns_golden.sh) runs
#   `moerun serve` over the mpi transport (btl tcp,self on the subnet) with a skewed preset
#   (qwen3-30b-a3b, 32 experts, bf16, gate_skew 1.0) on the linear placement: the hot experts
#   sit on rank 1, whose link is the bottleneck.
# Why 50 Mbit/s: each batch is a round trip (rows out, results back, ~55 KB per token each way
# on rank 1's link under the skew). On 2 cores the job computes only ~300-450 tokens/s, which
# needs ~100 Mbit/s on the hot link unlimited: at 100-200 Mbit/s the CPU, not the link, is the
# bottleneck and balancing gains ~1.3x or nothing. At 50 Mbit/s the hot link is busy ~90% of the
# time (~22 Mbit/s each way, in turns): balanced load measured 1.7-2.3x the tokens/s.
#
# Phases (each moebench serve --verify, 4 connections x 32 tokens):
#   1. steady: DURATION s of load -> tokens/s, latency; moectl status -> window balancedness
#      (load_window_s = DURATION); moectl placement plan --redundant 1 (the dry run: predicted)
#   2. migration, MIGRATE_MODE=online (default): a longer moebench in the background; after
#      ~2 s `moectl rebalance --redundant 1 --wait --json` (or placement plan --out + placement
#      apply --wait when rebalance is not there); the final MigrationStatus; moebench must end
#      with 0 errors, every answer verified; its latency max is the worst latency during the
#      migration.
#      MIGRATE_MODE=restart: the job is stopped and started again with the planned placement
#      (migration_s: the downtime, stop to ready).
#   3. after: DURATION s of load again; moectl status -> window balancedness after.
# Prints one JSON line (balancedness before/predicted/after, tokens/s before/after, speedup,
# migration seconds and bytes, latencies steady and during, errors, verified, link rate).
# Exit 0 when: balancedness after >= 0.9, no errors and every answer verified in every phase,
# migration state "done" (online); balancedness before > 0.5 only warns. 77: no root/netns
# (or, online, a moectl without rebalance/placement apply). 1: failure.
#
#   migrate_netns.sh MOERUN MOECTL MOEBENCH [DURATION_S]
# Environment: MIGRATE_MODE=online|restart, MIGRATE_LINK_MBIT (default 50; 0: no limit), MIGRATE_BENCH_S
# (the moebench of phase 2, default max(2 x DURATION, 16)), KEEP_WORK=1 (keep the logs).
set -uo pipefail
usage() { echo "usage: migrate_netns.sh MOERUN MOECTL MOEBENCH [DURATION_S]" >&2; exit 2; }
[[ $# -ge 3 && $# -le 4 ]] || usage
MOERUN_SRC=$(realpath -m "$1")
MOECTL_SRC=$(realpath -m "$2")
MOEBENCH_SRC=$(realpath -m "$3")
DURATION=${4:-8}
MODE=${MIGRATE_MODE:-online}
LINK_MBIT=${MIGRATE_LINK_MBIT:-50}
INPUTS=${MIGRATE_INPUTS:-16}  # distinct requests: moebench computes each answer before the load
TBF_LATENCY_MS=${MIGRATE_TBF_LATENCY_MS:-50}
TBF_BURST=${MIGRATE_TBF_BURST:-256kb}
MIG_BENCH_S=${MIGRATE_BENCH_S:-$((2 * DURATION > 16 ? 2 * DURATION : 16))}
[[ $MODE == online || $MODE == restart ]] || { echo "MIGRATE_MODE must be online or restart" >&2; exit 2; }
[[ $DURATION =~ ^[0-9]+$ && $DURATION -ge 2 ]] || usage
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
unset OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_RANK PMIX_RANK PMI_RANK 2>/dev/null
T_START=$SECONDS

skip() { echo "SKIP: $*"; exit 77; }
[[ $(id -u) -eq 0 ]] || skip "needs root (network namespaces)"
for tool in ip tc unshare mpirun timeout python3; do
  command -v "$tool" >/dev/null || skip "$tool is not installed"
done

WORK=$(mktemp -d /tmp/moerun-mignetns.XXXXXX)
SUFFIX=$(printf '%04x%02x' $((RANDOM)) $(($$ % 256)))
TAG="migrate-netns-$SUFFIX-$$"
SW="moe-sw-$SUFFIX"
HOSTS=("moe-r-$SUFFIX" "moe-e1-$SUFFIX" "moe-e2-$SUFFIX" "moe-e3-$SUFFIX")
NET=$((RANDOM % 250 + 1))
SUBNET="10.232.$NET.0/24"
IPS=("10.232.$NET.1" "10.232.$NET.2" "10.232.$NET.3" "10.232.$NET.4")
R=${HOSTS[0]}
RIP=${IPS[0]}
SERVE_PORT=5700 CONTROL_PORT=5800 METRICS_PORT=9700  # the namespaces are ours: fixed ports
MADE_NS=()
MPI_PID=""
BENCH_PID=""
FG_PID=""
# A long command in the background, waited for: a signal's trap runs at once, not at its end.
run_fg() {
  "$@" &
  FG_PID=$!
  wait "$FG_PID"
  local rc=$?
  FG_PID=""
  return $rc
}

# shellcheck disable=SC2317  # (called by the trap)
cleanup() {
  local rc=$? p ns
  disown -a 2>/dev/null  # no "Killed" job notices for what is killed here
  for p in $FG_PID $BENCH_PID $MPI_PID; do kill -KILL "$p" 2>/dev/null; done
  for ns in "${MADE_NS[@]}"; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -CONT "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
  done
  for p in /proc/[0-9]*; do
    [[ "${p#/proc/}" == "$$" ]] && continue
    grep -qzx "MOERUN_TEST_TAG=$TAG" "$p/environ" 2>/dev/null && kill -KILL "${p#/proc/}" 2>/dev/null
  done
  sleep 0.3
  for ns in "${MADE_NS[@]}"; do ip netns del "$ns" 2>/dev/null; done
  if [[ -n ${KEEP_WORK:-} ]]; then echo "work folder kept: $WORK" >&2; else rm -rf "$WORK"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT; trap 'exit 143' TERM; trap 'exit 129' HUP

fail() {
  echo "FAIL: $*"
  if [[ -f $WORK/serve.log ]]; then echo "--- serve log (tail):"; tail -25 "$WORK/serve.log" | sed 's/^/    | /'; fi
  exit 1
}
log() { printf '[%4d s] %s\n' $((SECONDS - T_START)) "$*"; }

# The binaries are rebuilt by others now and then: wait until they are there and run, then use
# private copies so that a rebuild during the run changes nothing.
mkdir -p "$WORK/bin"
for try in $(seq 1 10); do
  ok=1
  for b in "$MOERUN_SRC" "$MOECTL_SRC" "$MOEBENCH_SRC"; do
    if [[ -x $b ]] && cp "$b" "$WORK/bin/" 2>/dev/null && "$WORK/bin/$(basename "$b")" --help >/dev/null 2>&1; then
      :
    else
      ok=0
    fi
  done
  [[ $ok == 1 ]] && break
  [[ $try == 10 ]] && fail "the binaries are missing or do not run: $MOERUN_SRC $MOECTL_SRC $MOEBENCH_SRC"
  echo "binaries missing or busy, waiting 30 s" >&2
  sleep 30
done
MOERUN="$WORK/bin/$(basename "$MOERUN_SRC")"
MOECTL="$WORK/bin/$(basename "$MOECTL_SRC")"
MOEBENCH="$WORK/bin/$(basename "$MOEBENCH_SRC")"

# Online: which moectl commands are there?
APPLY=""
if [[ $MODE == online ]]; then
  if "$MOECTL" rebalance --help 2>&1 | grep -q -- "--wait"; then
    APPLY=rebalance
  elif "$MOECTL" placement apply --help 2>&1 | grep -q -- "--wait"; then
    APPLY=apply
  else
    skip "moectl has neither 'rebalance --wait' nor 'placement apply --wait' (MIGRATE_MODE=restart runs the restart variant)"
  fi
fi

# ---- the hosts: namespaces on a bridge, the expert hosts' links rate-limited ----
ip netns add "$SW" 2>"$WORK/netns.err" || skip "ip netns is unusable here: $(cat "$WORK/netns.err")"
MADE_NS+=("$SW")
for h in "${HOSTS[@]}"; do
  ip netns add "$h" || fail "cannot add namespace $h"
  MADE_NS+=("$h")
done
ip -n "$SW" link add br0 type bridge 2>"$WORK/br.err" || skip "cannot make a bridge: $(cat "$WORK/br.err")"
ip -n "$SW" link set lo up
ip -n "$SW" link set br0 up
for i in 0 1 2 3; do
  h=${HOSTS[$i]}
  # Made directly in the two namespaces: nothing ever lands in the root namespace.
  ip link add eth0 netns "$h" type veth peer name "p$i" netns "$SW" 2>"$WORK/veth.err" ||
    skip "cannot make a veth pair: $(cat "$WORK/veth.err")"
  ip -n "$SW" link set "p$i" master br0 || fail "cannot attach p$i to the bridge"
  ip -n "$SW" link set "p$i" up
  ip -n "$h" addr add "${IPS[$i]}/24" dev eth0
  ip -n "$h" link set lo up
  ip -n "$h" link set eth0 up
  if [[ $i -gt 0 && $LINK_MBIT != 0 ]]; then
    # Both directions of the expert host's link: its egress and the switch port's egress.
    for where in "$h eth0" "$SW p$i"; do
      read -r ns dev <<<"$where"
      tc -n "$ns" qdisc replace dev "$dev" root tbf rate "${LINK_MBIT}mbit" burst "$TBF_BURST" \
        latency "${TBF_LATENCY_MS}ms" 2>"$WORK/tc.err" || skip "tc tbf is unusable here: $(cat "$WORK/tc.err")"
    done
  fi
done

# Reachability and the link's real rate: 1.5 s of TCP from the router host to expert host 1.
cat >"$WORK/sink.py" <<'EOF'
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.time()
    n += len(b)
    if time.time() - t0 > 1.5: break
dt = time.time() - t0
print("%.1f" % (n * 8 / dt / 1e6), flush=True)
EOF
timeout 20 ip netns exec "${HOSTS[1]}" python3 "$WORK/sink.py" "${IPS[1]}" >"$WORK/sink.out" 2>&1 &
SINK=$!
for _ in $(seq 50); do [[ -s "$WORK/sink.out" ]] && break; sleep 0.1; done
timeout 10 ip netns exec "$R" python3 -c "
import socket, sys
c = socket.create_connection(('${IPS[1]}', int(open('$WORK/sink.out').readline())), timeout=5)
buf = b'x' * (1 << 16)
try:
    while True: c.sendall(buf)
except OSError: pass" 2>/dev/null
wait "$SINK" || fail "the router host cannot reach expert host 1 over TCP: $(cat "$WORK/sink.out")"
LINK_MEASURED=$(sed -n 2p "$WORK/sink.out")
log "hosts: router $R ($RIP), experts ${HOSTS[*]:1} (${IPS[*]:1}) on a bridge in $SW; expert links ${LINK_MBIT} mbit/s each way (tbf), measured ${LINK_MEASURED} Mbit/s"

# ---- the job ----
AGENT="$WORK/nsexec.sh"
cat >"$AGENT" <<'EOF'
#!/bin/bash
# Open MPI calls: AGENT [options] HOST COMMAND...; options are ignored here.
while [[ $# -gt 0 && "$1" == -* ]]; do shift; done
host="$1"; shift
exec ip netns exec "$host" unshare --uts /bin/bash -c "hostname $host; $*"
EOF
chmod +x "$AGENT"
printf 'migrate-test-token-%s\n' "$RANDOM$RANDOM$RANDOM" >"$WORK/token"
chmod 600 "$WORK/token"

config() {  # config PLACEMENT
  cat <<EOC
preset: {name: qwen3-30b-a3b, seed: 5, experts: 32, dtype: bf16, gate_skew: 1.0}
transport: mpi
routers: 1
placement: $1
threads: 1
serving:
  listen: $RIP:$SERVE_PORT
  control_listen: $RIP:$CONTROL_PORT
  metrics_listen: 0.0.0.0:$METRICS_PORT
  token_file: $WORK/token
  load_window_s: $DURATION
  probe_deadline_ms: 10000
EOC
}
# (metrics: every rank listens at port + rank on its own host: 0.0.0.0 is its own namespace.
# Probes: a batch takes ~2 s over the limited link on 2 loaded cores; the default 2 s deadline
# for the health probes then calls a busy rank "not answering" and fails its requests.)

start_serve() {  # start_serve NAME PLACEMENT
  config "$2" >"$WORK/$1.yaml"
  rm -f "$WORK/ready" "$WORK/pid"
  local host_list="${HOSTS[0]}:1,${HOSTS[1]}:1,${HOSTS[2]}:1,${HOSTS[3]}:1"
  MOERUN_TEST_TAG=$TAG timeout -k 5 1800 ip netns exec "$R" unshare --uts /bin/bash -c "hostname $R; exec mpirun \
    --allow-run-as-root --oversubscribe --bind-to none --mca plm_rsh_agent '$AGENT' \
    --host $host_list -np 4 --map-by slot --display-map \
    --mca oob_tcp_if_include $SUBNET --mca btl_tcp_if_include $SUBNET --mca btl tcp,self \
    --mca mpi_yield_when_idle 1 -x MOERUN_TEST_TAG \
    '$MOERUN' serve --config '$WORK/$1.yaml' --transport mpi --ready-file '$WORK/ready' \
    --pid-file '$WORK/pid'" >>"$WORK/serve.log" 2>&1 &
  MPI_PID=$!
  for _ in $(seq 1 1200); do
    [[ -f $WORK/ready ]] && break
    kill -0 "$MPI_PID" 2>/dev/null || fail "serve ($1) exited before it was ready"
    sleep 0.1
  done
  [[ -f $WORK/ready ]] || fail "serve ($1) was not ready within 120 s"
}

stop_serve() {
  local pid
  pid=$(cat "$WORK/pid" 2>/dev/null)
  [[ -n $pid ]] && ip netns exec "$R" kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 300); do kill -0 "$MPI_PID" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$MPI_PID" 2>/dev/null; then
    echo "warning: the job did not end within 30 s of SIGTERM; killed" >&2
    kill -KILL "$MPI_PID" 2>/dev/null
  fi
  wait "$MPI_PID" 2>/dev/null
  MPI_PID=""
}

ctl() { ip netns exec "$R" "$MOECTL" --target "$RIP:$CONTROL_PORT" --token-file "$WORK/token" "$@"; }

# Bytes through each expert host's switch port (tx: to the host, rx: from it).
link_bytes() {
  ip -n "$SW" -j -s link show >"$WORK/links.$1.json"
  date +%s.%N >"$WORK/links.$1.t"
}

bench() {  # bench NAME SECONDS: moebench serve --verify from the router host -> NAME.json
  link_bytes "$1.start"
  run_fg ip netns exec "$R" "$MOEBENCH" serve --target "$RIP:$SERVE_PORT" --concurrency 4 \
    --duration "$2" --tokens-per-request 32 --verify --preset qwen3-30b-a3b --seed 5 --experts 32 \
    --weights-dtype bf16 --gate-skew 1.0 --inputs "$INPUTS" --json >"$WORK/$1.json" 2>"$WORK/$1.bench.log"
  local rc=$?
  link_bytes "$1.end"
  return $rc
}

summary() {  # summary NAME: one line of a moebench report
  python3 - "$WORK" "$1" <<'PY'
import json, sys
w, n = sys.argv[1], sys.argv[2]
b = json.load(open(f"{w}/{n}.json"))
def rate(port):  # Mbit/s to and from the host over the measured seconds (warmup included)
    def get(tag):
        for l in json.load(open(f"{w}/links.{n}.{tag}.json")):
            if l["ifname"] == port:
                return l["stats64"]["tx"]["bytes"], l["stats64"]["rx"]["bytes"]
    t = b["wall_s"] + b["warmup_s"]  # (moebench first computes its answers: the link is idle)
    (a, b_), (c, d) = get("start"), get("end")
    return (c - a) * 8 / t / 1e6, (d - b_) * 8 / t / 1e6
rates = {i: rate("p%d" % i) for i in (1, 2, 3)}
json.dump({"hot_link_mbit": max(max(v) for v in rates.values())}, open(f"{w}/{n}.links.json", "w"))
lat = b["latency_ms"]
print(f"{n}: {b['tokens_per_s']:.0f} tokens/s, {b['ok']} ok, {b['error_count']} errors, "
      f"{b['verified']} verified; latency ms p50 {lat['p50']:.0f} p99 {lat['p99']:.0f} "
      f"max {lat['max']:.0f}; expert links Mbit/s to/from host: "
      + ", ".join("rank %d %.0f/%.0f" % (i, *rates[i]) for i in (1, 2, 3)))
PY
}

window() {  # window NAME: moectl status (after a pause: the router refreshes its window)
  sleep 1.5
  ctl status --json >"$WORK/$1.status" 2>"$WORK/$1.status.err" || fail "moectl status failed: $(cat "$WORK/$1.status.err")"
  python3 -c "
import json, sys
s = json.load(open('$WORK/$1.status'))
l = s['layers'][0]
print('$1: window %.0f s: %s assignments, balancedness %.3f; placement v%s' % (
    l.get('window_s', 0), l.get('window_assignments', 0), l.get('window_balancedness', 0),
    s.get('placement_version', '?')))"
}

# ---- 1. steady ----
start_serve before linear
# One rank per host, rank i on host i: mpirun's map, and moectl status once every rank has
# reported its host (the health probes bring them in).
for i in 0 1 2 3; do
  grep -Eq "Data for node: ${HOSTS[$i]}[[:space:]].*Num procs: 1" "$WORK/serve.log" ||
    fail "the job map has no single rank on ${HOSTS[$i]}"
done
for _ in $(seq 1 20); do
  ctl status --json >"$WORK/status0.json" 2>&1 || fail "moectl status failed: $(cat "$WORK/status0.json")"
  python3 -c "
import json, sys
sys.exit(0 if all(r.get('host') for r in json.load(open('$WORK/status0.json'))['ranks']) else 1)" && break
  sleep 0.5
done
python3 - "$WORK/status0.json" "${HOSTS[@]}" <<'PY' || fail "the ranks are not where they should be"
import json, sys
s = json.load(open(sys.argv[1]))
want = sys.argv[2:]
got = {r["rank"]: r.get("host", "") for r in s["ranks"]}
ok = len(got) == 4 and all(got.get(i) in (h, "") for i, h in enumerate(want))
print("ranks:", ", ".join(f"{r['rank']} {r.get('role', '?')} on {r.get('host', '?')}"
                         for r in sorted(s["ranks"], key=lambda x: x["rank"])))
sys.exit(0 if ok else 1)
PY
log "serve ready (linear placement)"
bench before "$DURATION" || fail "moebench (steady) failed: $(tail -3 "$WORK/before.bench.log")"
summary before
window before
ctl placement plan --redundant 1 --json --out "$WORK/plan.placement.json" >"$WORK/plan.json" \
  2>"$WORK/plan.err" || fail "moectl placement plan failed: $(cat "$WORK/plan.err")"

# ---- 2. migration ----
MIG_T0=$EPOCHREALTIME
if [[ $MODE == online ]]; then
  log "migration ($APPLY) under load: moebench for $MIG_BENCH_S s"
  ( bench during "$MIG_BENCH_S"; echo $? >"$WORK/during.rc" ) &
  BENCH_PID=$!
  # moebench first makes the weights and its answers; the migration starts ~2 s into the load.
  for _ in $(seq 1 1200); do
    grep -q "closed loop, 4 connections" "$WORK/during.bench.log" 2>/dev/null && break
    kill -0 "$BENCH_PID" 2>/dev/null || break
    sleep 0.1
  done
  sleep 2
  MIG_T0=$EPOCHREALTIME
  if [[ $APPLY == rebalance ]]; then
    run_fg timeout 600 ip netns exec "$R" "$MOECTL" --target "$RIP:$CONTROL_PORT" --token-file "$WORK/token" \
      --timeout-ms 600000 rebalance --redundant 1 --wait --json >"$WORK/migration.out" 2>"$WORK/migration.err"
  else
    ctl placement plan --redundant 1 --out "$WORK/apply.placement.json" >/dev/null 2>"$WORK/migration.err" &&
      run_fg timeout 600 ip netns exec "$R" "$MOECTL" --target "$RIP:$CONTROL_PORT" --token-file "$WORK/token" \
        --timeout-ms 600000 placement apply "$WORK/apply.placement.json" --wait --json \
        >"$WORK/migration.out" 2>>"$WORK/migration.err"
  fi
  MIG_RC=$?
  MIG_T1=$EPOCHREALTIME
  wait "$BENCH_PID"
  BENCH_PID=""
  [[ $MIG_RC == 0 ]] || fail "moectl $APPLY failed (exit $MIG_RC): $(tail -5 "$WORK/migration.err") $(tail -c 600 "$WORK/migration.out")"
  [[ $(cat "$WORK/during.rc") == 0 ]] || echo "moebench during the migration exited $(cat "$WORK/during.rc"): $(tail -3 "$WORK/during.bench.log")"
  [[ -s $WORK/during.json ]] || fail "moebench during the migration wrote no report"
  summary during
  python3 - "$WORK" "$MIG_T0" "$MIG_T1" <<'PY' || fail "cannot read the MigrationStatus JSON: $(tail -c 600 "$WORK/migration.out")"
import json, re, sys
w, t0, t1 = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
text = open(f"{w}/migration.out").read()
m = None
try:
    m = json.loads(text)
except ValueError:
    for line in reversed(text.splitlines()):  # progress lines, then the final status
        try:
            m = json.loads(line); break
        except ValueError:
            pass
def snake(x):  # protobuf JSON may come in lowerCamelCase
    if isinstance(x, dict):
        return {re.sub(r"([A-Z])", lambda c: "_" + c.group(1).lower(), k): snake(v) for k, v in x.items()}
    return [snake(v) for v in x] if isinstance(x, list) else x
m = snake(m)
if isinstance(m, dict) and "migration" in m: m = m["migration"]
if not isinstance(m, dict) or "state" not in m: sys.exit(1)
json.dump(m, open(f"{w}/migration.json", "w"))
lay = ", ".join(f"L{l.get('layer', 0)} {l.get('state')} {l.get('experts_to_load', 0)} copies "
                f"{int(l.get('bytes_loaded', 0)) / 2**20:.1f} MiB {l.get('seconds', 0):.2f} s"
                for l in m.get("layers", []))
print(f"migration: {m['state']} in {m.get('elapsed_s', 0):.2f} s (moectl {t1 - t0:.2f} s), "
      f"{int(m.get('bytes_loaded', 0)) / 2**20:.1f} MiB loaded; {lay}"
      + (f"; error: {m['error']}" if m.get("error") else ""))
PY
  MIG_END_BENCH=$(python3 -c "import json; print(json.load(open('$WORK/during.json'))['wall_s'])")
  awk -v m="$MIG_T1" -v t="$MIG_T0" -v b="$MIG_END_BENCH" 'BEGIN { exit !(m - t + 2 > b + 1) }' &&
    echo "warning: the migration outlasted the moebench run ($MIG_BENCH_S s): raise MIGRATE_BENCH_S"
else
  log "migration by restart with the planned placement"
  stop_serve
  start_serve after "$WORK/plan.placement.json"
  MIG_T1=$EPOCHREALTIME
  log "serve ready (planned placement), downtime $(awk -v a="$MIG_T0" -v b="$MIG_T1" 'BEGIN { printf "%.1f", b - a }') s"
fi
echo "$MIG_T0 $MIG_T1" >"$WORK/migration.t"

# ---- 3. after ----
bench after "$DURATION" || fail "moebench (after) failed: $(tail -3 "$WORK/after.bench.log")"
summary after
window after
stop_serve

python3 - "$WORK" "$MODE" "$LINK_MBIT" "${LINK_MEASURED:-0}" <<'PY'
import json, os, sys
w, mode, link, measured = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
def load(n):
    return json.load(open(f"{w}/{n}"))
def win(n):
    return load(f"{n}.status")["layers"][0]["window_balancedness"]
b, a = load("before.json"), load("after.json")
plan = load("plan.json")["layers"][0]
t0, t1 = map(float, open(f"{w}/migration.t").read().split())
def ok(x):
    return x.get("error_count", 1) == 0 and x.get("verified", -1) == x.get("ok", -2) and x.get("ok", 0) > 0
def lat(x):
    return {"p99": round(x["latency_ms"]["p99"], 1), "max": round(x["latency_ms"]["max"], 1)}
out = {"mode": mode,
       "balancedness_before": round(win("before"), 3),
       "predicted": round(plan["balancedness_after"], 3),
       "balancedness_after": round(win("after"), 3),
       "tokens_per_s_before": round(b["tokens_per_s"], 1),
       "tokens_per_s_after": round(a["tokens_per_s"], 1)}
out["speedup"] = round(a["tokens_per_s"] / b["tokens_per_s"], 2) if b["tokens_per_s"] else 0
phases = [b, a]
state = "done"
if mode == "online":
    m, d = load("migration.json"), load("during.json")
    phases.append(d)
    state = m.get("state")
    mp = (m.get("plan") or {}).get("layers") or []
    if mp and "balancedness_after" in mp[0]:
        out["predicted"] = round(mp[0]["balancedness_after"], 3)
    out["migration_s"] = round(float(m.get("elapsed_s", t1 - t0)), 2)
    out["migration_bytes"] = int(m.get("bytes_loaded", 0))
    out["migration_state"] = state
    out["migration_layers"] = [{"layer": l.get("layer", 0), "seconds": round(float(l.get("seconds", 0)), 2),
                                "bytes_loaded": int(l.get("bytes_loaded", 0))} for l in m.get("layers", [])]
    out["tokens_per_s_during"] = round(d["tokens_per_s"], 1)
    out["latency_ms_steady"], out["latency_ms_during"] = lat(b), lat(d)
    out["errors_during"] = d.get("error_count", -1)
else:
    out["migration_s"] = round(t1 - t0, 2)  # downtime: stop to ready
    out["migration_bytes"] = int(plan.get("bytes_to_move", 0))
    out["migration_state"] = "restart"
    out["latency_ms_steady"], out["latency_ms_during"] = lat(b), None
    out["errors_during"] = None
out["verified"] = all(ok(x) for x in phases)
out["hot_link_mbit"] = {k: round(load(f"{k}.links.json")["hot_link_mbit"], 1)
                        for k in ("before", "during", "after") if os.path.exists(f"{w}/{k}.links.json")}
out["link_mbit"] = link
out["link_mbit_measured"] = measured
print(json.dumps(out))
bad = []
if out["balancedness_after"] < 0.9: bad.append(f"balancedness after {out['balancedness_after']} < 0.9")
if not out["verified"]: bad.append("errors or unverified answers")
if state != "done" and mode == "online": bad.append(f"migration state {state}")
if out["balancedness_before"] > 0.5:
    print(f"warning: balancedness before {out['balancedness_before']} > 0.5 (the skew is milder than planned)")
if out["speedup"] < 1.2:
    print(f"warning: speedup {out['speedup']}: little gain: is the expert link the bottleneck? (MIGRATE_LINK_MBIT)")
for x in bad: print("FAIL:", x)
sys.exit(1 if bad else 0)
PY
RC=$?
log "migrate_netns ($MODE): $([[ $RC == 0 ]] && echo PASS || echo FAIL)"
exit $RC
