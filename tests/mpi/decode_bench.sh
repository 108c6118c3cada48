#!/usr/bin/env bash
# moebench decode against a real `moerun serve` job under mpirun: 3 ranks (a router and two expert
# ranks) serving 4 layers of the qwen3-30b-a3b preset scaled to 8 experts of intermediate size 64
# (ready in seconds), over $MOERUN_TEST_TRANSPORT (default mpi). Checks, in order:
#   1. --verify with S=6 in 2 ping-pong micro-batches, attention and --parts: exit 0; the JSON's
#      layers are the 4 the job serves (of the preset's 48), every answer verified, the counts
#      add up (steps x layers x micro-batches), the lone requests measured;
#   2. the negative control: another preset seed, so every answer differs: exit 3;
#   3. bad input against the job: a layer it does not serve, requests over its max_request_tokens
#      (S=16 in one micro-batch; S=16 in 2 micro-batches is fine): exit 2 naming them;
#   3b. moebench serve --floor on the same job (the floor's parts, both expert ranks probed) and
#      its refusal with 2 connections;
#   4. the router frozen (kill -STOP) in the middle of a run: exit 1 once the deadline passed,
#      naming the step, the layer and the micro-batch; resumed, it serves again;
#   5. the router killed (kill -9) in the middle of a run: exit 1 within seconds, naming the step,
#      the layer and the micro-batch; then, the job gone: exit 1 naming the target.
# Everything it starts is killed on exit, also on failure.
#   decode_bench.sh MOERUN_BIN MOEBENCH_BIN
set -uo pipefail
MOERUN=$(realpath "${1:?usage: decode_bench.sh MOERUN MOEBENCH}")
MOEBENCH=$(realpath "${2:?usage: decode_bench.sh MOERUN MOEBENCH}")
TRANSPORT=${MOERUN_TEST_TRANSPORT:-mpi}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

WORK=$(mktemp -d /tmp/moerun-decode.XXXXXX)
TAG="decode-$$-$RANDOM$RANDOM"
MPI_PID=""
BENCH_PID=""
# shellcheck source=../lib/mpi_job.sh
source "$(dirname "$0")/../lib/mpi_job.sh"
# shellcheck source=../serving/ports.sh
source "$(dirname "$0")/../serving/ports.sh"
cleanup() {
  [[ -n $BENCH_PID ]] && kill -KILL "$BENCH_PID" 2>/dev/null
  cleanup_job
}
trap cleanup EXIT
trap 'exit 130' INT; trap 'exit 143' TERM
fail() {
  echo "FAIL: $*"
  for f in bench.err serve.log; do
    [[ -f $WORK/$f ]] && { echo "--- $f (tail):"; tail -30 "$WORK/$f"; }
  done
  exit 1
}

write_config() {
  cat >"$WORK/decode.yaml" <<EOF
preset: {name: qwen3-30b-a3b, seed: 1, experts: 8, intermediate: 64, dtype: f32}
layers: [0, 1, 2, 3]
routers: 1
placement: linear
deadline_ms: 10000
batching: {max_batch_tokens: 64, max_wait_us: 0}
serving: {listen: 127.0.0.1:$PORT, metrics_listen: 127.0.0.1:$((PORT + 200)),
          max_request_tokens: 8}
EOF
}
start_serving write_config env MOERUN_TEST_TAG="$TAG" timeout 300 mpirun --oversubscribe \
  --bind-to none --mca mpi_yield_when_idle 1 -np 3 -x MOERUN_TEST_TAG "$MOERUN" serve \
  --config "$WORK/decode.yaml" --transport "$TRANSPORT" --ready-file "$WORK/ready" ||
  fail "serve did not get ready"
MPI_PID=$SERVE_PID
TARGET=127.0.0.1:$PORT
MODEL=(--preset qwen3-30b-a3b --experts 8 --intermediate 64)

# 1. Verified decode: S=6 in two micro-batches of 3, every layer the job serves.
"$MOEBENCH" decode --target "$TARGET" --sequences 6 --pingpong 2 --steps 4 --warmup 1 \
  --attention-us 300 --parts --verify "${MODEL[@]}" --threads 1 --json \
  >"$WORK/bench.json" 2>"$WORK/bench.err" || fail "moebench decode --verify exited $?"
python3 - "$WORK/bench.json" <<'PY' || fail "the JSON report is not as expected"
import json, sys
r = json.load(open(sys.argv[1]))
def check(cond, what):
    if not cond:
        sys.exit(f"{what}: {json.dumps(r)[:2000]}")
check(r["bench"] == "decode", "bench")
check(r["layers"] == [0, 1, 2, 3], "the layers the job serves")
check(r["sequences"] == 6 and r["pingpong"] == 2 and r["microbatches"] == [3, 3], "split")
check(r["steps"] == 4 and r["failed_steps"] == 0 and r["tokens"] == 24, "steps and tokens")
check(r["ok"] == 4 * 4 * 2 and r["requests"] == r["ok"], "one answer per step, layer, micro-batch")
check(r["verify"] and r["verified"] == r["ok"], "every answer verified")
check(r["errors"] == {} and r["error_count"] == 0 and r["stopped"] is None, "no error")
check(r["warmup"]["steps"] == 1 and r["warmup"]["errors"] == 0, "warm-up")
check(r["tokens_per_s"] > 0 and r["wall_s"] > 0, "throughput")
check(r["tpot_ms"]["count"] == 4 and r["tpot_ms"]["p50"] > 0, "time per token")
check(r["layer_round_trip_ms"]["count"] == 32, "round trips")
check(r["tpot_ms"]["p50"] >= r["layer_round_trip_ms"]["p50"], "a step holds its layers")
check(r["lone"]["round_trip_ms"]["count"] == 8 and r["lone"]["step_ms"] > 0, "lone requests")
check(r["attention_sleep_ms"]["count"] == 32, "attention slept before every layer")
check(r["parts_requested"], "--parts")
p = r["parts"]  # the server fills InferResponse.timing: every answer carries it
check(p is not None and p["answers"] == r["ok"], "parts in every answer")
for part in ("wait", "server", "network_and_client"):  # (a part 0 in every answer is left out)
    check(p["p50_us"].get(part, 0) > 0, "the part " + part)
check(p["p50_us"]["server"] <= r["layer_round_trip_ms"]["max"] * 1000, "server time in the trip")
check(sorted(p["ranks_p50_us"]) == ["1", "2"], "both expert ranks' parts")
check(3 <= p["batch_tokens_p50"] <= 6, "a batch holds one or both micro-batches")
PY
grep -q "verified 32/32 bitwise" "$WORK/bench.err" || fail "no verified count in the summary"
grep -q "a lone request p50" "$WORK/bench.err" || fail "no lone latency beside the throughput"
echo "PASS decode --verify S=6 --pingpong 2 over $TRANSPORT: $(grep -o '[0-9.]* tokens/s' \
  "$WORK/bench.err" | head -1)"

# 2. The negative control: other weights, so every answer differs.
"$MOEBENCH" decode --target "$TARGET" --sequences 2 --steps 1 --warmup 0 --verify \
  --preset qwen3-30b-a3b --experts 8 --intermediate 64 --seed 2 --threads 1 \
  >/dev/null 2>"$WORK/bench.err"
rc=$?
[[ $rc == 3 ]] || fail "another seed: exit $rc, not 3"
grep -q "differs from the local layer at token" "$WORK/bench.err" || fail "no mismatch named"
echo "PASS a different model: exit 3, the mismatch named"

# 3. Bad input the job refuses: exit 2, naming it.
"$MOEBENCH" decode --target "$TARGET" --layers 0,9 --steps 1 "${MODEL[@]}" \
  >/dev/null 2>"$WORK/bench.err"
rc=$?
[[ $rc == 2 ]] || fail "a layer not served: exit $rc, not 2"
grep -q "refuses layer 9" "$WORK/bench.err" && grep -q "is not served" "$WORK/bench.err" ||
  fail "the layer not served is not named"
"$MOEBENCH" decode --target "$TARGET" --sequences 16 --steps 1 "${MODEL[@]}" \
  >/dev/null 2>"$WORK/bench.err"
rc=$?
[[ $rc == 2 ]] || fail "S=16 over max_request_tokens 8: exit $rc, not 2"
grep -q "tokens must be in \[1, 8\]" "$WORK/bench.err" || fail "the size refusal is not quoted"
"$MOEBENCH" decode --target "$TARGET" --sequences 16 --pingpong 2 --steps 1 --warmup 0 \
  "${MODEL[@]}" >/dev/null 2>"$WORK/bench.err" || fail "S=16 in 2 micro-batches of 8 failed"
echo "PASS refusals: a layer not served, requests over max_request_tokens (exit 2)"

# 3b. The floor of a lone request (moebench serve --floor) on the same job: its parts are there,
#     both expert ranks answered the transport probe, and every answer was checked.
"$MOEBENCH" serve --target "$TARGET" --concurrency 1 --duration 1 --warmup 0.2 --layer 0 \
  --verify "${MODEL[@]}" --threads 1 --floor --json >"$WORK/floor.json" 2>"$WORK/bench.err" ||
  fail "moebench serve --floor exited $?"
python3 - "$WORK/floor.json" <<'PY' || fail "the floor report is not as expected"
import json, sys
r = json.load(open(sys.argv[1]))
f = r["floor"]
def check(cond, what):
    if not cond:
        sys.exit(f"{what}: {json.dumps(f)[:2000]}")
check(r["error_count"] == 0 and r["verified"] == r["ok"] > 0, "the run's answers")
check(f["rounds"] >= 20 and f["round_trip_ms"]["count"] == f["rounds"], "rounds")
check(sorted(f["transport_by_rank_p50_ms"]) == ["1", "2"], "both expert ranks probed")
check(f["transport_pingpong_ms"]["count"] == 2 * f["rounds"], "a round trip per rank per round")
check(all(f[k]["p50"] > 0 for k in ("client_pingpong_ms", "transport_pingpong_ms", "layer_ms")),
      "every part of the floor measured")
check(abs(f["floor_ms"] - f["client_pingpong_ms"]["p50"] - f["transport_pingpong_ms"]["p50"]
          - f["layer_p50_used_ms"]) < 1e-9, "the floor is the sum")
check(abs(f["x_floor"] * f["floor_ms"] - f["round_trip_ms"]["p50"]) < 1e-9, "x_floor")
for part in ("queue", "gate", "dispatch", "wait", "combine", "reply", "server"):
    check(part in f["parts_p50_ms"], "the request's part " + part)
check(f["parts_p50_ms"]["server"] <= f["round_trip_ms"]["p99"], "server time inside the trip")
PY
grep -q "x_floor" "$WORK/bench.err" || fail "no x_floor in the summary"
echo "PASS serve --floor over $TRANSPORT: $(grep -o 'x_floor [0-9.]*' "$WORK/bench.err")"
"$MOEBENCH" serve --target "$TARGET" --concurrency 2 --duration 1 --verify "${MODEL[@]}" \
  --floor >/dev/null 2>"$WORK/bench.err"
rc=$?
[[ $rc == 2 ]] && grep -q "concurrency 1" "$WORK/bench.err" ||
  fail "--floor with 2 connections: exit $rc, not 2 naming --concurrency 1"
echo "PASS --floor refused with 2 connections"

# Starts a decode run in the background (BENCH_PID; its JSON in run.json, stderr in bench.err),
# waits until it runs, then sends signal $1 to the router rank (ROUTER); the rest are its flags.
signal_router_mid_run() {
  local sig=$1
  shift
  "$MOEBENCH" decode --target "$TARGET" --sequences 4 --pingpong 2 --duration 60 --warmup 0 \
    "${MODEL[@]}" "$@" >"$WORK/run.json" 2>"$WORK/bench.err" &
  BENCH_PID=$!
  for _ in $(seq 100); do
    grep -q "micro-batches" "$WORK/bench.err" && break
    sleep 0.1
  done
  sleep 0.5
  ROUTER=$(rank_pid 0)
  [[ -n $ROUTER ]] || fail "cannot find the router rank"
  kill "-$sig" "$ROUTER"
}
# Waits (30 s at most) for that run to end: its exit status in RC (124: still running), the
# seconds it took in WAITED.
wait_bench() {
  local t0=$SECONDS
  wait_exit_within "$BENCH_PID" 30
  RC=$?
  WAITED=$((SECONDS - t0))
  [[ $RC == 124 ]] || BENCH_PID=""
}

# 4. The router frozen (kill -STOP) in the middle of a run: no answer within the deadline stops
# the run (exit 1, naming it); once it resumes, the job serves again.
signal_router_mid_run STOP --deadline-ms 300
wait_bench
kill -CONT "$ROUTER"
[[ $RC == 1 ]] || fail "router frozen: exit $RC, not 1 (124: still running after 30 s)"
grep -q "stopped: step [0-9]*, layer [0-9], micro-batch [01].*deadline exceeded" "$WORK/bench.err" ||
  fail "the missed deadline's step, layer and micro-batch are not named"
echo "PASS router frozen mid-run: exit 1 after $WAITED s (deadline 300 ms + 5 s)"
"$MOEBENCH" decode --target "$TARGET" --sequences 2 --steps 2 --warmup 0 "${MODEL[@]}" \
  >/dev/null 2>"$WORK/bench.err" || fail "the job does not serve once the router resumed"

# 5. The router dies in the middle of a run.
signal_router_mid_run KILL --json
wait_bench
[[ $RC == 1 ]] || fail "router killed: exit $RC, not 1 (124: still running after 30 s)"
grep -q "stopped: step [0-9]*, layer [0-9], micro-batch [01]" "$WORK/bench.err" ||
  fail "the lost connection's step, layer and micro-batch are not named"
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); sys.exit(r["stopped"] is None)' \
  "$WORK/run.json" || fail "the JSON does not say why the run stopped"
echo "PASS router killed mid-run: exit 1 after $WAITED s: $(grep -o 'stopped: .*' \
  "$WORK/bench.err" | head -1)"
wait_exit_within "$MPI_PID" 10
"$MOEBENCH" decode --target "$TARGET" --steps 1 "${MODEL[@]}" >/dev/null 2>"$WORK/bench.err"
rc=$?
[[ $rc == 1 ]] || fail "no job: exit $rc, not 1"
grep -q "$TARGET" "$WORK/bench.err" || fail "no job: the target is not named"
echo "PASS the job gone: exit 1 naming $TARGET"
