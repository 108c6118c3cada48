#!/usr/bin/env bash
# The Grafana dashboard's queries against a real Prometheus scraping a job that rebalances:
#   1. `mpirun -np 4 moerun serve` (1 router, 3 expert ranks, a skewed preset) and a real
#      `prometheus` scraping its 4 metrics endpoints every second;
#   2. `moebench serve --verify` keeps it busy while `moectl rebalance --redundant 1 --wait`
#      migrates, then `moectl expert update --canary 50` puts new weights beside expert 0 and
#      `moectl expert promote` makes them the expert's;
#   3. tests/deploy/grafana_queries.py evaluates every panel target of
#      deploy/grafana/moerun-dashboard.json (and its variables) over the test's window and fails
#      naming each panel whose query returned no data.
# Exit 0 on success, 1 on failure, 77 (skip) without mpirun or prometheus.
#
#   grafana_queries.sh MOERUN MOECTL MOEBENCH [DASHBOARD]
#
# KEEP_WORK=1 keeps the work folder (logs, Prometheus' data) for a look afterwards.
set -euo pipefail
[[ $# -ge 3 ]] || { echo "usage: grafana_queries.sh MOERUN MOECTL MOEBENCH [DASHBOARD]" >&2; exit 2; }
MOERUN=$(realpath "$1")
MOECTL=$(realpath "$2")
MOEBENCH=$(realpath "$3")
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
DASHBOARD=$(realpath "${4:-$ROOT/deploy/grafana/moerun-dashboard.json}")
PY=/usr/bin/python3
[[ -x $PY ]] || PY=python3
command -v mpirun >/dev/null || { echo "SKIP: mpirun is not installed"; exit 77; }
command -v prometheus >/dev/null || { echo "SKIP: prometheus is not installed"; exit 77; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
WORK=$(mktemp -d /tmp/moerun-grafana.XXXXXX)
# ports.sh (pick_port, start_serving) calls `python3`: Debian's, whatever PATH says.
mkdir -p "$WORK/bin" && ln -s "$PY" "$WORK/bin/python3" && export PATH="$WORK/bin:$PATH"
source "$ROOT/tests/serving/ports.sh"
SERVE_PID="" PROM_PID="" BENCH_PID=""
stop_pid() {  # stop_pid PID: TERM, up to 10 s, then KILL
  [[ -n "$1" ]] || return 0
  kill -TERM "$1" 2>/dev/null || return 0
  for _ in $(seq 1 20); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL "$1" 2>/dev/null || true
}
cleanup() {
  set +e
  stop_pid "$BENCH_PID"
  stop_pid "$SERVE_PID"
  # Ranks mpirun left behind: only this test's (their command line names its work folder).
  for p in $(pgrep -f "$WORK/serve.yaml"); do kill -KILL "$p" 2>/dev/null; done
  stop_pid "$PROM_PID"
  if [[ -n "${KEEP_WORK:-}" ]]; then echo "work folder kept: $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in serve.log prometheus.log bench.log; do
    [[ -f "$WORK/$f" ]] && { echo "--- $f (tail)" >&2; tail -25 "$WORK/$f" >&2; }
  done
  exit 1
}

printf 'grafana-test-token-%s\n' "$RANDOM$RANDOM" >"$WORK/token"
chmod 600 "$WORK/token"
write_config() {
  cat >"$WORK/serve.yaml" <<EOC
preset: {name: qwen3-30b-a3b, seed: 5, experts: 32, dtype: bf16, gate_skew: 1.0}
transport: mpi
routers: 1
placement: linear
threads: 1
files: {allow: [$WORK]}  # expert update files (a preset has no folder of its own)
serving:
  listen: 127.0.0.1:$PORT
  control_listen: 127.0.0.1:$((PORT + 100))
  metrics_listen: 127.0.0.1:$((PORT + 200))
  token_file: $WORK/token
  load_window_s: 4
rebalance:
  throttle_mib_s: 20
EOC
}
start_serving write_config mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np 4 \
  "$MOERUN" serve --config "$WORK/serve.yaml" --ready-file "$WORK/ready" ||
  fail "serve did not get ready"
CTL=(--target "127.0.0.1:$((PORT + 100))" --token-file "$WORK/token")

# Prometheus on a free port, scraping every rank each second.
PROM_PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
JOB="moerun-grafana-test"
cat >"$WORK/prom.yml" <<EOC
global: {scrape_interval: 1s, evaluation_interval: 1s}
scrape_configs:
  - job_name: $JOB
    static_configs:
      - targets: ['127.0.0.1:$((PORT + 200))', '127.0.0.1:$((PORT + 201))',
                  '127.0.0.1:$((PORT + 202))', '127.0.0.1:$((PORT + 203))']
EOC
prometheus --config.file="$WORK/prom.yml" --storage.tsdb.path="$WORK/tsdb" \
  --web.listen-address="127.0.0.1:$PROM_PORT" >"$WORK/prometheus.log" 2>&1 &
PROM_PID=$!
PROM="http://127.0.0.1:$PROM_PORT"
up=0
for _ in $(seq 1 60); do
  if curl -sf "$PROM/api/v1/query?query=sum(up%7Bjob%3D%22$JOB%22%7D)" 2>/dev/null |
    grep -q '"value":\[[0-9.]*,"4"\]'; then
    up=1
    break
  fi
  kill -0 "$PROM_PID" 2>/dev/null || fail "prometheus exited"
  sleep 0.5
done
[[ $up -eq 1 ]] || fail "prometheus does not see the 4 ranks up"
# The new weights for expert 0 of the served layer, for the canary below.
"$MOECTL" "${CTL[@]}" status --json >"$WORK/status.json" || fail "moectl status"
LAYER=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['layers'][0]['layer'])" \
  "$WORK/status.json")
"$PY" "$ROOT/tests/serving/make_expert_file.py" --family qwen3 --layer "$LAYER" --expert 0 \
  --hidden 2048 --inter 768 --dtype bf16 --seed 9 "$WORK/expert0.safetensors" ||
  fail "make_expert_file.py"
START=$(date +%s.%N)

BENCH=(--concurrency 2 --tokens-per-request 16 --json)
VERIFY=(--verify --preset qwen3-30b-a3b --seed 5 --experts 32 --weights-dtype bf16 --gate-skew 1.0)
bench_ok() {  # bench_ok NAME VERIFIED(0|1): requests answered, none failed (all verified if 1)
  "$PY" -c 'import json,sys; b=json.load(open(sys.argv[1])); print(sys.argv[2] + ":", "ok", b.get("ok"),
  "errors", b.get("error_count"), "verified", b.get("verified"))
sys.exit(0 if b.get("ok", 0) > 0 and b.get("error_count", 1) == 0 and
         (sys.argv[3] == "0" or b.get("verified", -1) == b["ok"]) else 1)' "$WORK/$1.json" "$1" "$2"
}

# Verified load (every answer bitwise right) while a migration moves experts.
"$MOEBENCH" serve --target "127.0.0.1:$PORT" --duration 14 "${VERIFY[@]}" "${BENCH[@]}" \
  >"$WORK/migrate.json" 2>"$WORK/bench.log" &
BENCH_PID=$!
# The plan needs load in the window (4 s): wait for the bench's traffic (it first generates its
# reference weights, seconds on a loaded machine) rather than for a fixed time.
loaded=0
for _ in $(seq 1 120); do
  n=$(curl -sf "http://127.0.0.1:$((PORT + 200))/metrics" 2>/dev/null |
    awk '/^moerun_window_assignments[{ ]/ { s += $NF } END { printf "%d", s }')
  if [[ ${n:-0} -ge 1000 ]]; then
    loaded=1
    break
  fi
  kill -0 "$BENCH_PID" 2>/dev/null || fail "moebench ended before loading the router"
  sleep 0.5
done
[[ $loaded -eq 1 ]] || fail "no load measured by the router 60 s after moebench started"
"$MOECTL" "${CTL[@]}" rebalance --redundant 1 --wait --json >"$WORK/migration.json" \
  2>"$WORK/migration.err" || fail "moectl rebalance: $(cat "$WORK/migration.err")"
"$PY" -c 'import json,sys; m=json.load(open(sys.argv[1])); print("migration", m["state"],
  m.get("bytes_loaded", 0), "of", m.get("bytes_to_move", 0), "bytes in", m.get("elapsed_s"), "s")
sys.exit(0 if m["state"] == "done" and int(m.get("bytes_loaded", 0)) > 0 else 1)' "$WORK/migration.json" ||
  fail "the migration did not load anything"
wait "$BENCH_PID" || fail "moebench failed or saw wrong answers during the migration"
BENCH_PID=""
bench_ok migrate 1 || fail "moebench saw errors during the migration"

# Load under the canary (its answers differ by design: not verified), update, promote.
"$MOEBENCH" serve --target "127.0.0.1:$PORT" --duration 12 --hidden 2048 "${BENCH[@]}" \
  >"$WORK/canary.json" 2>"$WORK/bench.log" &
BENCH_PID=$!
"$MOECTL" "${CTL[@]}" expert update --layer "$LAYER" --expert 0 \
  --from "$WORK/expert0.safetensors" --canary 50 --wait >"$WORK/update.txt" 2>&1 ||
  fail "moectl expert update: $(cat "$WORK/update.txt")"
sleep 4  # the canary serves; router 0 counts its rows once a second
"$MOECTL" "${CTL[@]}" expert promote --layer "$LAYER" --expert 0 >"$WORK/promote.txt" 2>&1 ||
  fail "moectl expert promote: $(cat "$WORK/promote.txt")"
promoted=0
for _ in $(seq 1 50); do
  "$MOECTL" "${CTL[@]}" expert status --layer "$LAYER" --expert 0 --json >"$WORK/expert.json" ||
    fail "moectl expert status"
  if grep -q '"promoted"' "$WORK/expert.json"; then promoted=1; break; fi
  sleep 0.2
done
[[ $promoted -eq 1 ]] || fail "the update was not promoted: $(cat "$WORK/expert.json")"
echo "layer $LAYER expert 0: updated, canary 50%, promoted"
wait "$BENCH_PID" || fail "moebench failed under the canary"
BENCH_PID=""
bench_ok canary 0 || fail "moebench saw errors under the canary"
sleep 3  # the last scrapes
END=$(date +%s.%N)

# Prometheus saw what happened: the migration running, a new placement version, all its bytes
# loaded, the 50 % canary (set and measured, +-5 points), one promoted update.
W=$("$PY" -c 'import math,sys; print(math.ceil(float(sys.argv[2]) - float(sys.argv[1])))' "$START" "$END")
S="job=\"$JOB\""
"$PY" "$HERE/grafana_queries.py" --dashboard "$DASHBOARD" --prometheus "$PROM" --job "$JOB" \
  --start "$START" --end "$END" \
  --expect "max_over_time(moerun_migration_running{$S}[${W}s]) == 1" \
  --expect "max(moerun_placement_version{$S}) - min(min_over_time(moerun_placement_version{$S}[${W}s])) >= 1" \
  --expect "moerun_migration_bytes_loaded{$S} == moerun_migration_bytes_to_move{$S} > 0" \
  --expect "max_over_time(moerun_expert_update_canary_share{$S}[${W}s]) == 0.5" \
  --expect "abs(moerun_expert_update_canary_rows{$S} / moerun_expert_update_rows{$S} - 0.5) < 0.05" \
  --expect "moerun_expert_updates_total{$S,result=\"promoted\"} == 1" ||
  fail "dashboard queries without data, or figures that do not hold (above)"
echo PASS
