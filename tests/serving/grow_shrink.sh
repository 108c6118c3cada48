#!/usr/bin/env bash
# Grow and shrink the expert ranks of a running `moerun serve` under verified load, and nothing
# is lost: `mpirun --enable-recovery -np 5` (1 router, expert ranks 1-4) over ucx with
# `spare_expert_ranks: 2` (ranks 5 and 6: slots with no process), `moebench serve --verify`
# (closed loop, 4 connections) throughout, and
#   refusals: moectl retire of a router, of an unknown rank, of a spare slot;
#   grow:     two processes outside mpirun, `moerun serve --join`, take the spare slots 5 and 6;
#             `moectl rebalance --redundant 4` gives them experts (6 expert ranks), and both
#             serve rows;
#   shrink:   `moectl retire` of joined rank 5, then of launched ranks 1 and 2 (3 expert ranks
#             left: 3, 4, 6): each one's experts are re-placed first (a migration), then it is
#             sent its shutdown; joined rank 5 exits 0 at once (an mpirun rank stops serving and
#             exits with the job: MPI_Finalize waits for the others).
# Asserts: 0 failed requests, every answer bitwise right, moectl status (spare / live / retired,
# health ok, no rank dead), moerun_ranks_retired / moerun_ranks_spare; prints one line of
# figures: join -> serving its experts (the joiner's start to the rebalance done), and the p99
# of moebench's per-second timeline before the events and during each.
#
#   grow_shrink.sh MOERUN MOECTL MOEBENCH DATA_DIR
#
# Exit 0 on success, 1 on failure, 77 (skip) without mpirun, python3 or curl.
set -uo pipefail
[[ $# -ge 4 ]] || { echo "usage: grow_shrink.sh MOERUN MOECTL MOEBENCH DATA_DIR" >&2; exit 2; }
MOERUN=$(realpath "$1")
MOECTL=$(realpath "$2")
MOEBENCH=$(realpath "$3")
DATA=$(realpath "$4")
HERE=$(cd "$(dirname "$0")" && pwd)
for tool in mpirun python3 curl; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool is not installed"; exit 77; }
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export UCX_TLS=${UCX_TLS:-sm,self} MOERUN_UCX_PUT_MIN=${MOERUN_UCX_PUT_MIN:-256}
WORK=$(mktemp -d /tmp/moerun-grow.XXXXXX)
TAG="grow-$$-$RANDOM$RANDOM"
export MOERUN_TEST_TAG=$TAG
MPI_PID=""
SERVE_PID=""
BENCH_PID=""
JOIN_PIDS=()
source "$HERE/ports.sh"
# shellcheck source=../lib/mpi_job.sh
source "$HERE/../lib/mpi_job.sh"
cleanup() {
  local rc=$? p
  [[ -n "$BENCH_PID" ]] && kill -KILL "$BENCH_PID" 2>/dev/null
  for p in "${JOIN_PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  MPI_PID=$SERVE_PID
  cleanup_job
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT; trap 'exit 143' TERM
fail() {
  echo "FAIL: $*" >&2
  echo "--- serve log (tail)" >&2
  tail -60 "$WORK/serve.log" >&2
  local f
  for f in "$WORK"/join-*.log; do
    [[ -f $f ]] || continue
    echo "--- $f (tail)" >&2
    tail -15 "$f" >&2
  done
  exit 1
}
MODEL=$DATA/hf-moe/deepseek_v3
[[ -f $MODEL/config.json ]] || { echo "no fixture model at $MODEL" >&2; exit 1; }
printf 'grow-test-token-%s\n' "$RANDOM$RANDOM" >"$WORK/token"
chmod 600 "$WORK/token"

write_config() {
  cat >"$WORK/serve.yaml" <<EOC
model: $MODEL
layers: [0]
transport: ucx
routers: 1
spare_expert_ranks: 2
placement: round_robin
threads: 1
microbatch_tokens: 16
deadline_ms: 10000
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

start_serving write_config mpirun --enable-recovery --oversubscribe --bind-to none \
  --mca mpi_yield_when_idle 1 -np 5 "$MOERUN" serve --config "$WORK/serve.yaml" \
  --ready-file "$WORK/ready" || fail "serve did not get ready"
CTL=(--target "127.0.0.1:$((PORT + 100))" --token-file "$WORK/token")
METRICS="http://127.0.0.1:$((PORT + 200))/metrics"

# Before any load: the spare slots, and what cannot be retired.
"$MOECTL" "${CTL[@]}" status --json >"$WORK/status-start.json" || fail "moectl status"
expect_refusal() {  # RANK WORDS
  local out rc
  out=$("$MOECTL" "${CTL[@]}" retire "$1" 2>&1)
  rc=$?
  [[ $rc -ne 0 && $out == *"$2"* ]] || fail "moectl retire $1: exit $rc: $out"
}
expect_refusal 0 "rank 0 is a router"
expect_refusal 9 "no rank 9 in this job"
expect_refusal 5 "rank 5 is a spare slot"

"$MOEBENCH" serve --target "127.0.0.1:$PORT" --duration 36 --warmup 1 --concurrency 4 \
  --tokens-per-request 8 --model "$MODEL" --verify --json >"$WORK/bench.json" \
  2>"$WORK/bench.log" &
BENCH_PID=$!
t_load=$SECONDS
batches=0
until [[ $batches -ge 50 ]]; do
  (( SECONDS - t_load > 60 )) && fail "router 0 ran no 50 batches in 60 s of moebench"
  kill -0 "$BENCH_PID" 2>/dev/null || fail "moebench ended early: $(tail -3 "$WORK/bench.log")"
  sleep 0.2
  batches=$(curl -s --max-time 2 "$METRICS" | awk '$1 ~ /^moerun_batches_total($|\{)/ {print int($2); exit}')
  batches=${batches:-0}
done
sleep 3  # the steady p99 before the events

# Grow: two joiners take the spare slots.
t_join=$(now)
for i in 1 2; do
  "$MOERUN" serve --config "$WORK/serve.yaml" --join "127.0.0.1:$((PORT + 100))" \
    --token-file "$WORK/token" >"$WORK/join-$i.log" 2>&1 &
  JOIN_PIDS+=($!)
done
for i in 1 2; do
  wait_line "$WORK/join-$i.log" "joined the job as expert rank (5|6)" 30 ||
    fail "joiner $i did not join"
done
JOINED_5=""; JOINED_6=""
for i in 1 2; do
  if grep -q "joined the job as expert rank 5" "$WORK/join-$i.log"; then
    JOINED_5=${JOIN_PIDS[$((i - 1))]}
  else
    JOINED_6=${JOIN_PIDS[$((i - 1))]}
  fi
done
[[ -n $JOINED_5 && -n $JOINED_6 ]] || fail "the joiners did not take ranks 5 and 6"
"$MOECTL" "${CTL[@]}" --timeout-ms 60000 rebalance --redundant 4 --wait --json \
  >"$WORK/rebalance.json" 2>"$WORK/rebalance.err" ||
  fail "moectl rebalance after the joins: $(cat "$WORK/rebalance.json" "$WORK/rebalance.err")"
t_served=$(now)
sleep 2
"$MOECTL" "${CTL[@]}" status --json >"$WORK/status-grown.json" || fail "moectl status (grown)"

# Shrink: joined rank 5, then launched ranks 1 and 2.
RETIRES=()
for r in 5 1 2; do
  t0=$(now)
  "$MOECTL" "${CTL[@]}" --timeout-ms 60000 retire "$r" --wait --json >"$WORK/retire-$r.json" \
    2>"$WORK/retire-$r.err" || fail "moectl retire $r: $(cat "$WORK/retire-$r.json" "$WORK/retire-$r.err")"
  wait_line "$WORK/serve.log" "rank $r retired:" 10 || fail "rank $r was not retired"
  if [[ $r != 5 ]]; then
    # A launched rank stops serving at once (its Serve returns and logs its transport's
    # counters); its process exits with the job.
    wait_line "$WORK/serve.log" "\[r$r expert\] info: ucx transport:" 10 ||
      fail "retired rank $r did not stop serving"
  fi
  RETIRES+=("$r:$t0:$(now)")
  sleep 1.5
done
# The joined retired rank leaves at once, with exit 0.
t=$SECONDS
while kill -0 "$JOINED_5" 2>/dev/null; do
  (( SECONDS - t > 15 )) && fail "retired joined rank 5 did not exit"
  sleep 0.2
done
wait "$JOINED_5"
rc5=$?
[[ $rc5 -eq 0 ]] || fail "retired joined rank 5 exited with $rc5"
expect_refusal 5 "rank 5 is already retired"

wait "$BENCH_PID"
bench_rc=$?
BENCH_PID=""
[[ $bench_rc -eq 0 ]] || fail "moebench serve failed (exit $bench_rc): $(tail -5 "$WORK/bench.log")"
"$MOECTL" "${CTL[@]}" status >"$WORK/status.txt" || fail "moectl status"
"$MOECTL" "${CTL[@]}" status --json >"$WORK/status.json" || fail "moectl status --json"
curl -s --max-time 5 "$METRICS" >"$WORK/metrics.txt"
python3 - "$WORK" "$t_join" "$t_served" "$JOINED_6" "${RETIRES[@]}" <<'PY' || fail "checks failed"
import json, re, sys
work, t_join, t_served, pid6 = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
retires = [(int(r), float(a), float(b)) for r, a, b in (x.split(":") for x in sys.argv[5:])]
bench = json.load(open(f"{work}/bench.json"))
def check(cond, what):
    if not cond:
        print("check failed:", what, file=sys.stderr)
        sys.exit(1)
def ranks_of(path):
    return {r["rank"]: r for r in json.load(open(path))["ranks"]}
def held(st):
    return [e for l in st.get("layers", []) for e in l.get("experts", [])]
check(bench["error_count"] == 0 and bench["warmup"]["errors"] == 0,
      f"failed requests: {bench['errors']}")
check(bench["ok"] > 0 and bench["verified"] == bench["ok"],
      f"verified {bench['verified']} of {bench['ok']}")
start = ranks_of(f"{work}/status-start.json")
check([r for r, st in start.items() if st["state"] == "spare"] == [5, 6],
      f"spare slots at start: {[(r, st['state']) for r, st in start.items()]}")
check(json.load(open(f"{work}/status-start.json"))["health"] == "ok", "health at start")
grown = ranks_of(f"{work}/status-grown.json")
for r in (5, 6):
    check(held(grown[r]) and int(grown[r].get("rows_served", 0)) > 0,
          f"joined rank {r} holds {held(grown[r])}, served {grown[r].get('rows_served')}")
check(int(grown[6]["pid"]) == pid6, "rank 6 is not the second joiner")
status = json.load(open(f"{work}/status.json"))
ranks = {r["rank"]: r for r in status["ranks"]}
for r in (1, 2, 5):
    check(ranks[r]["state"] == "retired" and not held(ranks[r]), f"rank {r}: {ranks[r]}")
for r in (3, 4, 6):
    check(ranks[r]["state"] == "ready" and held(ranks[r]), f"rank {r}: {ranks[r]}")
check(status["health"] == "ok" and status.get("ranks_dead", 0) == 0, "health after the shrink")
check(status["migration"]["trigger"] == "retire" and status["migration"]["state"] == "done",
      f"last migration: {status['migration']}")
metrics = open(f"{work}/metrics.txt").read()
def gauge(name):
    m = re.search(rf"^{name}(\{{[^}}]*\}})? (\S+)", metrics, re.M)
    return float(m.group(2)) if m else None
check(gauge("moerun_ranks_retired") == 3 and gauge("moerun_ranks_spare") == 0 and
      gauge("moerun_ranks_dead") == 0,
      f"gauges: retired {gauge('moerun_ranks_retired')}, spare {gauge('moerun_ranks_spare')}")
t0 = bench["measure_start_unix_s"]
tl = bench["timeline"]
def p99(a, b):  # the worst per-second p99 of the seconds that overlap [a, b]
    v = [x["p99_ms"] for x in tl if x["t_s"] < b - t0 and x["t_s"] + 1 > a - t0]
    return max(v, default=0)
before = max((x["p99_ms"] for x in tl if x["t_s"] >= 1 and x["t_s"] + 1 <= t_join - t0), default=0)
parts = [f"grow 4 -> 6 expert ranks and shrink 6 -> 3 (retired 5 joined, 1 and 2 launched): "
         f"{bench['ok']} answers, 0 failed, all verified; join -> serving its experts "
         f"{t_served - t_join:.2f} s; p99 {before:.1f} ms before, {p99(t_join, t_served):.1f} ms "
         f"during the joins and rebalance"]
for r, a, b in retires:
    parts.append(f"{p99(a, b):.1f} ms during retire {r} ({b - a:.2f} s)")
print(", ".join(parts))
PY
# Stop: SIGTERM to mpirun; joined rank 6 ends with the job, exit 0.
kill -TERM "$SERVE_PID" 2>/dev/null
t=$SECONDS
while kill -0 "$SERVE_PID" 2>/dev/null; do
  (( SECONDS - t > 40 )) && fail "the job did not end 40 s after SIGTERM"
  sleep 0.2
done
wait "$SERVE_PID" 2>/dev/null
SERVE_PID=""
t=$SECONDS
while kill -0 "$JOINED_6" 2>/dev/null; do
  (( SECONDS - t > 20 )) && fail "joined rank 6 did not end with the job"
  sleep 0.2
done
wait "$JOINED_6"
rc6=$?
[[ $rc6 -eq 0 ]] || fail "joined rank 6 exited with $rc6"
JOIN_PIDS=()
echo "PASS grow_shrink"
exit 0
