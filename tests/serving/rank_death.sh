#!/usr/bin/env bash
# An expert rank dies while `moerun serve` answers verified load, and nothing is lost:
# `mpirun --enable-recovery -np 5` (1 router, 4 expert ranks, ucx in PEER error mode) on the
# tiny fixture model, `moebench serve --verify` (closed loop, 4 connections) throughout, and
#   1. replicas:  every expert on two ranks; `kill -9` of expert rank 2 mid-run: its experts are
#                 answered by their other copies at once;
#   2. orphans:   no replicas (round robin); `kill -9` of rank 2: its experts are re-placed on the
#                 survivors (router 0's "recovery" migration loads them from the checkpoint) and
#                 the batches that need them wait for the load;
#   3. frozen:    no replicas; `kill -STOP` of rank 2 for longer than the deadline: declared dead
#                 after it, handled as 2.; then `kill -CONT`: its late answers are discarded and
#                 nothing it sends changes an answer.
# Each case asserts: 0 failed requests, every answer bitwise right, /health/ready 200, moectl
# status "health: degraded" with rank 2 "dead", moerun_ranks_dead 1 and the retry counters; and
# prints one line of figures: death -> detection -> re-dispatch -> re-placed -> full throughput
# (the first second after the death with at least 80% of the answers per second before it), the
# p99 latency over the 3 s after the death, and the steady p99 before it.
#
#   rank_death.sh MOERUN MOECTL MOEBENCH DATA_DIR [CASES]
#
# CASES: a comma list of replicas,orphans,frozen (default all). Exit 0 on success, 1 on failure,
# 77 (skip) without mpirun, python3, curl or the ucx transport.
set -uo pipefail
[[ $# -ge 4 ]] || { echo "usage: rank_death.sh MOERUN MOECTL MOEBENCH DATA_DIR [CASES]" >&2; exit 2; }
MOERUN=$(realpath "$1")
MOECTL=$(realpath "$2")
MOEBENCH=$(realpath "$3")
DATA=$(realpath "$4")
CASES=${5:-replicas,orphans,frozen}
HERE=$(cd "$(dirname "$0")" && pwd)
for tool in mpirun python3 curl; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool is not installed"; exit 77; }
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export UCX_TLS=${UCX_TLS:-sm,self} MOERUN_UCX_PUT_MIN=${MOERUN_UCX_PUT_MIN:-256}
WORK=$(mktemp -d /tmp/moerun-death.XXXXXX)
TAG="death-$$-$RANDOM$RANDOM"
export MOERUN_TEST_TAG=$TAG
MPI_PID=""
SERVE_PID=""
BENCH_PID=""
source "$HERE/ports.sh"
# shellcheck source=../lib/mpi_job.sh
source "$HERE/../lib/mpi_job.sh"
cleanup() {
  [[ -n "$BENCH_PID" ]] && kill -KILL "$BENCH_PID" 2>/dev/null
  MPI_PID=$SERVE_PID
  cleanup_job
}
trap cleanup EXIT
trap 'exit 130' INT; trap 'exit 143' TERM
fail() {
  echo "FAIL ($CASE): $*" >&2
  echo "--- serve log (tail)" >&2
  tail -60 "$WORK/serve.log" >&2
  exit 1
}
MODEL=$DATA/hf-moe/deepseek_v3
[[ -f $MODEL/config.json ]] || { echo "no fixture model at $MODEL" >&2; exit 1; }
EXPERTS=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['n_routed_experts'])" \
  "$MODEL/config.json")
printf 'death-test-token-%s\n' "$RANDOM$RANDOM" >"$WORK/token"
chmod 600 "$WORK/token"

# Every expert e on expert rank 1 + e % 4 and on the next one.
python3 - "$WORK/replicas.json" "$EXPERTS" <<'PY'
import json, sys
path, n = sys.argv[1], int(sys.argv[2])
slots = []
for e in range(n):
    slots.append([1 + e % 4, e])
    slots.append([1 + (e + 1) % 4, e])
json.dump({"format": "moerun-placement-v1", "version": 1, "num_experts": n, "num_ranks": 5,
           "num_routers": 1, "layers": {"*": slots}}, open(path, "w"))
PY

write_config() {
  cat >"$WORK/serve.yaml" <<EOC
model: $MODEL
layers: [0]
transport: ucx
routers: 1
placement: $PLACEMENT
threads: 1
microbatch_tokens: 16
deadline_ms: 2000
batching: {max_batch_tokens: 64, max_wait_us: 300}
serving:
  listen: 127.0.0.1:$PORT
  control_listen: 127.0.0.1:$((PORT + 100))
  metrics_listen: 127.0.0.1:$((PORT + 200))
  token_file: $WORK/token
  probe_interval_ms: 200
  probe_deadline_ms: 1000
EOC
}

now() { date +%s.%N; }
# The Unix time of the first serve-log line matching $1 (its [HH:MM:SS.mmm] stamp, today, UTC).
log_time() {
  python3 - "$WORK/serve.log" "$1" <<'PY'
import re, sys, datetime
pat = re.compile(sys.argv[2])
for line in open(sys.argv[1], errors="replace"):
    if pat.search(line):
        m = re.match(r"\[(\d\d):(\d\d):(\d\d)\.(\d\d\d)\]", line)
        if not m:
            continue
        d = datetime.datetime.now(datetime.timezone.utc).replace(
            hour=int(m[1]), minute=int(m[2]), second=int(m[3]), microsecond=int(m[4]) * 1000)
        print(f"{d.timestamp():.3f}")
        break
PY
}

run_case() {
  CASE=$1
  case $CASE in
    replicas) PLACEMENT=$WORK/replicas.json ;;
    orphans | frozen) PLACEMENT=round_robin ;;
    *) echo "unknown case $CASE" >&2; exit 2 ;;
  esac
  start_serving write_config mpirun --enable-recovery --oversubscribe --bind-to none \
    --mca mpi_yield_when_idle 1 -np 5 "$MOERUN" serve --config "$WORK/serve.yaml" \
    --ready-file "$WORK/ready" || fail "serve did not get ready"
  local ctl=(--target "127.0.0.1:$((PORT + 100))" --token-file "$WORK/token")
  "$MOEBENCH" serve --target "127.0.0.1:$PORT" --duration 14 --warmup 1 --concurrency 4 \
    --tokens-per-request 8 --model "$MODEL" --verify --json >"$WORK/bench.json" \
    2>"$WORK/bench.log" &
  BENCH_PID=$!
  sleep 5
  local pid
  pid=$(rank_pid 2)
  [[ -n "$pid" && $(wc -w <<<"$pid") -eq 1 ]] || fail "cannot find expert rank 2's process ($pid)"
  local t_death
  t_death=$(now)
  if [[ $CASE == frozen ]]; then
    kill -STOP "$pid" || fail "kill -STOP"
    sleep 4  # twice the deadline
    kill -CONT "$pid"
  else
    kill -KILL "$pid" || fail "kill -9"
  fi
  wait "$BENCH_PID"
  local bench_rc=$?
  BENCH_PID=""
  [[ $bench_rc -eq 0 ]] || fail "moebench serve failed (exit $bench_rc): $(tail -5 "$WORK/bench.log")"
  "$MOECTL" "${ctl[@]}" status >"$WORK/status.txt" || fail "moectl status"
  "$MOECTL" "${ctl[@]}" status --json >"$WORK/status.json" || fail "moectl status --json"
  local ready
  ready=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "http://127.0.0.1:$((PORT + 200))/health/ready")
  curl -s --max-time 5 "http://127.0.0.1:$((PORT + 200))/metrics" >"$WORK/metrics.txt"
  [[ $ready == 200 ]] || fail "/health/ready is $ready after the death"
  grep -q "^health: degraded: 1 expert rank dead" "$WORK/status.txt" ||
    fail "moectl status does not say degraded: $(head -3 "$WORK/status.txt")"
  grep -Eq '^moerun_ranks_dead(\{[^}]*\})? 1$' "$WORK/metrics.txt" ||
    fail "moerun_ranks_dead is not 1: $(grep ranks_dead "$WORK/metrics.txt")"
  local t_detect t_redispatch t_replaced
  t_detect=$(log_time "rank 2 is dead")
  t_redispatch=$(log_time "dispatching tokens .* again")
  t_replaced=$(log_time "migration [0-9]+ done")
  [[ -n "$t_detect" ]] || fail "the router never declared rank 2 dead"
  python3 - "$WORK/bench.json" "$WORK/status.json" "$WORK/metrics.txt" "$CASE" "$t_death" \
    "$t_detect" "${t_redispatch:-}" "${t_replaced:-}" <<'PY' || fail "checks failed"
import json, sys, re
bench = json.load(open(sys.argv[1]))
status = json.load(open(sys.argv[2]))
metrics = open(sys.argv[3]).read()
case, t_death, t_detect = sys.argv[4], float(sys.argv[5]), float(sys.argv[6])
t_redispatch = float(sys.argv[7]) if sys.argv[7] else None
t_replaced = float(sys.argv[8]) if sys.argv[8] else None
def check(cond, what):
    if not cond:
        print("check failed:", what, file=sys.stderr)
        sys.exit(1)
check(bench["error_count"] == 0 and bench["warmup"]["errors"] == 0,
      f"failed requests: {bench['errors']}")
check(bench["ok"] > 0 and bench["verified"] == bench["ok"],
      f"verified {bench['verified']} of {bench['ok']}")
ranks = {r["rank"]: r for r in status["ranks"]}
check(ranks[2]["state"] == "dead", f"rank 2 is {ranks[2]['state']}")
check(status.get("ranks_dead") == 1 and status.get("health") == "degraded", "status fields")
placement_rank2 = [e for l in ranks[2].get("layers", []) for e in l.get("experts", [])]
check(not placement_rank2, f"rank 2 still holds experts {placement_rank2}")
replaced = int(status.get("experts_replaced", 0))
if case == "replicas":
    check(replaced == 0, f"{replaced} experts re-placed although every expert had a replica")
else:
    check(replaced > 0, "no expert was re-placed")
    check(status["migration"]["trigger"] == "recovery" and status["migration"]["state"] == "done",
          f"recovery migration: {status['migration']}")
m = re.search(r"^moerun_experts_replaced_total(\{[^}]*\})? (\d+)", metrics, re.M)
check(m and int(m.group(2)) == replaced, "moerun_experts_replaced_total")
retried = int(status.get("microbatches_retried", 0))
# The timeline, relative to the death.
t0 = bench["measure_start_unix_s"]
tl = bench["timeline"]
death_s = t_death - t0
before = [b["ok"] for b in tl if b["t_s"] + 1 <= death_s]
rate = sum(before) / max(1, len(before))
full = None
for b in tl:
    if b["t_s"] >= death_s and b["ok"] >= 0.8 * rate:
        full = b["t_s"] + 1 - death_s  # by the end of that second
        break
after = [b for b in tl if death_s <= b["t_s"] < death_s + 3]
p99_after = max((b["p99_ms"] for b in after), default=0)
max_after = max((b["max_ms"] for b in after), default=0)
p99_before = max((b["p99_ms"] for b in tl if b["t_s"] + 1 <= death_s and b["t_s"] >= 1), default=0)
fmt = lambda t: "-" if t is None else f"{t - t_death:.2f} s"
print(f"{case}: {bench['ok']} answers, 0 failed, all verified; death -> detected {fmt(t_detect)}, "
      f"re-dispatch {fmt(t_redispatch)}, re-placed {fmt(t_replaced)}, full throughput "
      f"{'-' if full is None else f'{full:.1f} s'} ({rate:.0f} answers/s before); p99 {p99_before:.1f} ms "
      f"before, {p99_after:.1f} ms over the 3 s after (slowest {max_after:.0f} ms); {retried} microbatches re-dispatched, "
      f"{replaced} experts re-placed")
json.dump({"case": case, "answers": bench["ok"], "failed": 0,
           "detect_s": t_detect - t_death,
           "redispatch_s": None if t_redispatch is None else t_redispatch - t_death,
           "replaced_s": None if t_replaced is None else t_replaced - t_death,
           "full_throughput_s": full, "answers_per_s_before": rate, "p99_ms_before": p99_before,
           "p99_ms_after": p99_after, "max_ms_after": max_after, "microbatches_retried": retried,
           "experts_replaced": replaced}, open(sys.argv[1] + ".summary", "w"))
PY
  cat "$WORK/bench.json.summary" >>"$WORK/summaries"
  echo >>"$WORK/summaries"
  # Stop: SIGTERM to mpirun; the survivors drain and exit.
  kill -TERM "$SERVE_PID" 2>/dev/null
  local t=$SECONDS
  while kill -0 "$SERVE_PID" 2>/dev/null; do
    (( SECONDS - t > 40 )) && fail "the job did not end 40 s after SIGTERM"
    sleep 0.2
  done
  wait "$SERVE_PID" 2>/dev/null
  SERVE_PID=""
  grep -q "router 0 stopping" "$WORK/serve.log" || fail "router 0 did not stop cleanly"
  cp "$WORK/serve.log" "$WORK/serve-$CASE.log"
}

IFS=, read -ra list <<<"$CASES"
for c in "${list[@]}"; do run_case "$c"; done
echo "PASS rank_death ($CASES)"
[[ -n "${MOERUN_DEATH_SUMMARY:-}" ]] && cp "$WORK/summaries" "$MOERUN_DEATH_SUMMARY"
exit 0
