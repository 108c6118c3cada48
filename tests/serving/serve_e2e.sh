#!/usr/bin/env bash
# moerun serve under mpirun, as users meet it: 4 ranks on configs/tiny.yaml with the network
# front end. Checks, in order:
#   1. /health/live on every rank, /health/ready on the router, /metrics in the text format;
#   2. moectl without the token is refused (and counted); with it, status shows every rank;
#      placement export writes the placement JSON;
#   3. moebench serve --verify: every answer bitwise equal to the layer computed locally;
#   4. an expert rank frozen with kill -STOP: /health/ready turns 503 and requests fail with a
#      clear error within their deadline; after kill -CONT it is ready again and answers verify;
#   5. SIGTERM to rank 0 drains and the job exits 0.
# Everything it starts is killed on exit, also on failure.
#   serve_e2e.sh MOERUN_BIN MOECTL_BIN MOEBENCH_BIN DATA_DIR [SOAK_SECONDS]
set -uo pipefail
MOERUN=$(realpath "${1:?usage: serve_e2e.sh MOERUN MOECTL MOEBENCH DATA_DIR [SOAK_S]}")
MOECTL=$(realpath "$2")
MOEBENCH=$(realpath "$3")
DATA=$(realpath "$4")
SOAK=${5:-0}
CONFIGS=$(cd "$DATA/../../configs" && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

WORK=$(mktemp -d /tmp/moerun-e2e.XXXXXX)
TAG="e2e-$$-$RANDOM$RANDOM"
MPI_PID=""
# shellcheck source=../lib/mpi_job.sh
source "$(dirname "$0")/../lib/mpi_job.sh"
trap cleanup_job EXIT
trap 'exit 130' INT; trap 'exit 143' TERM
fail() { echo "FAIL: $*"; echo "--- serve log (tail):"; tail -40 "$WORK/log"; exit 1; }

# Free ports: 12 consecutive ones.
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
pick_base() {
  local b i ok
  for _ in $(seq 50); do
    b=$((20000 + RANDOM % 12000))  # below the kernel's ephemeral range (32768..60999)
    ok=1
    for i in $(seq 0 11); do port_free $((b + i)) || ok=0; done
    [[ $ok == 1 ]] && { echo "$b"; return; }
  done
  echo 0
}
SERVE=$(pick_base)  # 12 free ports: serving, metrics, control, 4 each
[[ $SERVE != 0 ]] || fail "no free ports"
METRICS=$((SERVE + 4)); CONTROL=$((SERVE + 8))
TARGET=127.0.0.1:$SERVE
umask 077
echo "e2e-token-$RANDOM$RANDOM$RANDOM" >"$WORK/token"

http_code() { curl -s -o "$WORK/body" -w '%{http_code}' --max-time 5 "$1"; }

MOERUN_TEST_TAG=$TAG timeout 600 mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \
  -np 4 -x MOERUN_TEST_TAG "$MOERUN" serve --config "$CONFIGS/tiny.yaml" \
  --transport "${MOERUN_TEST_TRANSPORT:-mpi}" \
  --listen "127.0.0.1:$SERVE" --metrics-listen "127.0.0.1:$METRICS" \
  --control-listen "127.0.0.1:$CONTROL" --token-file "$WORK/token" \
  --ready-file "$WORK/ready" >"$WORK/log" 2>&1 &
MPI_PID=$!
for _ in $(seq 600); do
  [[ -f $WORK/ready ]] && break
  kill -0 "$MPI_PID" 2>/dev/null || fail "serve exited before it was ready"
  sleep 0.1
done
[[ -f $WORK/ready ]] || fail "serve was not ready within 60 s"

# 1. Health and metrics.
for r in 0 1 2 3; do
  [[ $(http_code "http://127.0.0.1:$((METRICS + r))/health/live") == 200 ]] ||
    fail "rank $r /health/live is not 200"
  [[ $(http_code "http://127.0.0.1:$((METRICS + r))/metrics") == 200 ]] ||
    fail "rank $r /metrics is not 200"
  grep -q "^# TYPE moerun_process_resident_memory_bytes gauge" "$WORK/body" ||
    fail "rank $r /metrics lacks the resident memory gauge"
done
[[ $(http_code "http://127.0.0.1:$METRICS/health/ready") == 200 ]] ||
  fail "router /health/ready is not 200 once ready: $(cat "$WORK/body")"
echo "PASS health and metrics on every rank"

# 2. moectl.
if "$MOECTL" --target "127.0.0.1:$CONTROL" status >"$WORK/out" 2>&1; then
  fail "moectl without a token was not refused"
fi
grep -q "unauthenticated" "$WORK/out" || fail "moectl refusal unclear: $(cat "$WORK/out")"
echo "wrong" >"$WORK/wrong"
if "$MOECTL" --target "127.0.0.1:$CONTROL" --token-file "$WORK/wrong" status >"$WORK/out" 2>&1; then
  fail "moectl with a wrong token was not refused"
fi
MOERUN_TOKEN_FILE="$WORK/token" "$MOECTL" --target "127.0.0.1:$CONTROL" status >"$WORK/out" 2>&1 ||
  fail "moectl status failed: $(cat "$WORK/out")"
cat "$WORK/out"
for r in 0 1 2 3; do
  grep -Eq "^$r +(router|expert) " "$WORK/out" || fail "moectl status does not show rank $r"
done
"$MOECTL" --target "127.0.0.1:$CONTROL" --token-file "$WORK/token" placement export \
  "$WORK/placement.json" || fail "placement export failed"
grep -q '"moerun-placement-v1"' "$WORK/placement.json" || fail "exported placement is not v1 JSON"
http_code "http://127.0.0.1:$METRICS/metrics" >/dev/null
grep -q '^moerun_control_auth_failures_total 2$' "$WORK/body" ||
  fail "refused control requests not counted: $(grep auth_failures "$WORK/body")"
echo "PASS moectl: refused without the token, status shows every rank, placement export"

# 3. Verified load.
verify() {  # seconds -> runs moebench serve --verify, prints its table
  "$MOEBENCH" serve --target "$TARGET" --concurrency 4 --duration "$1" --tokens-per-request 8 \
    --warmup 0.5 --verify --model "$DATA/hf-moe/deepseek_v3" --json >"$WORK/bench.json" \
    2>"$WORK/bench.err"
}
verify 3 || fail "moebench serve --verify failed: $(cat "$WORK/bench.err")"
cat "$WORK/bench.err"
echo "PASS moebench serve --verify"

# 4. A frozen expert rank.
pid2=$(rank_pid 2)
[[ -n $pid2 ]] || fail "cannot find expert rank 2"
kill -STOP "$pid2"
t0=$SECONDS
code=200
while (( SECONDS - t0 < 15 )); do
  code=$(http_code "http://127.0.0.1:$METRICS/health/ready")
  [[ $code == 503 ]] && break
  sleep 0.2
done
[[ $code == 503 ]] || fail "/health/ready stayed $code with rank 2 stopped"
grep -q "rank(s) 2 not answering" "$WORK/body" || fail "503 body does not name rank 2: $(cat "$WORK/body")"
echo "ready -> 503 $(( SECONDS - t0 )) s after SIGSTOP: $(cat "$WORK/body")"
"$MOEBENCH" serve --target "$TARGET" --concurrency 2 --duration 2 --tokens-per-request 8 \
  --warmup 0 --deadline-ms 1500 --hidden 64 --json >"$WORK/frozen.json" 2>"$WORK/frozen.err"
grep -Eq '"(unavailable|deadline_exceeded)": *[1-9]' "$WORK/frozen.json" ||
  fail "requests during the freeze did not fail clearly: $(cat "$WORK/frozen.json")"
python3 - "$WORK/frozen.json" <<'P' || fail "a request outlived its deadline during the freeze"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["requests"] > 0
# Every request, answered or failed, ends by its 1500 ms deadline: the server says why (an
# error reply), the client never has to give up on it (it would at 6500 ms, a client_timeout).
# moebench times the failed requests too (failed_latency_ms); the bound is 3x the deadline, a
# margin a loaded machine does not close, and below the client's own limit.
f = r["failed_latency_ms"]
assert f["count"] == r["error_count"] > 0, r
assert r["errors"].get("client_timeout", 0) == 0, r
assert max(f["max"], r["latency_ms"]["max"]) <= 3 * 1500, r
print(f"frozen: {r['error_count']} failed, slowest failure {f['max']:.0f} ms; "
      f"{r['ok']} answered, slowest {r['latency_ms']['max']:.0f} ms")
P
kill -CONT "$pid2"
t0=$SECONDS
while (( SECONDS - t0 < 30 )); do
  code=$(http_code "http://127.0.0.1:$METRICS/health/ready")
  [[ $code == 200 ]] && break
  sleep 0.2
done
[[ $code == 200 ]] || fail "/health/ready did not recover after SIGCONT ($code)"
echo "ready -> 200 $(( SECONDS - t0 )) s after SIGCONT"
verify 2 || fail "answers after recovery did not verify: $(cat "$WORK/bench.err")"
echo "PASS frozen expert rank: 503, clear errors within the deadline, recovery"

# Optional soak: verified load for SOAK seconds; resident memory at 10 s and at the end.
if (( SOAK > 0 )); then
  rss() {
    for r in 0 1 2 3; do
      curl -s --max-time 5 "http://127.0.0.1:$((METRICS + r))/metrics" |
        awk '/^moerun_process_resident_memory_bytes /{print $2}'
    done | paste -sd' '
  }
  verify "$SOAK" &
  bench=$!
  sleep 10
  early=$(rss)
  wait "$bench" || fail "soak: moebench serve --verify failed: $(cat "$WORK/bench.err")"
  late=$(rss)
  cat "$WORK/bench.err"
  echo "soak: resident bytes per rank at 10 s: $early; at the end: $late"
  python3 - "$early" "$late" <<'P' || fail "soak: a rank's resident memory grew more than 5 %"
import sys
a = [float(v) for v in sys.argv[1].split()]
b = [float(v) for v in sys.argv[2].split()]
assert len(a) == len(b) == 4
for r, (x, y) in enumerate(zip(a, b)):
    print(f"rank {r}: {x/2**20:.1f} MiB -> {y/2**20:.1f} MiB ({100*(y-x)/x:+.2f} %)")
    assert abs(y - x) <= 0.05 * x
P
  echo "PASS soak ${SOAK} s"
fi

# 5. Drain on SIGTERM to rank 0.
pid0=$(rank_pid 0)
[[ -n $pid0 ]] || fail "cannot find rank 0"
kill -TERM "$pid0"
for _ in $(seq 300); do kill -0 "$MPI_PID" 2>/dev/null || break; sleep 0.1; done
kill -0 "$MPI_PID" 2>/dev/null && fail "the job did not stop within 30 s of SIGTERM"
wait "$MPI_PID"
rc=$?
MPI_PID=""
[[ $rc == 0 ]] || fail "the job exited $rc after SIGTERM"
grep -q "shut down cleanly" "$WORK/log" || fail "no clean shutdown line"
echo "PASS SIGTERM: drained, exit 0"
