#!/usr/bin/env bash
# moerun at many ranks on one machine: `mpirun -np NP --oversubscribe` jobs of the tiny fixture
# model (tests/data/hf-moe/deepseek_v3: 32 experts, top-4), NP/16 routers (at least 1) and the
# rest expert ranks, over each transport named:
#   1. forward: `moerun forward` under mpirun writes a file identical (cmp) to one process's
#      (round robin placement, microbatches of 16 tokens);
#   2. serve:   `moerun serve` under `moebench serve --verify` (closed loop, 2 connections per
#      router, every router a target) for DURATION s: 0 failed requests, every answer bitwise
#      right; then SIGTERM to router 0: every rank drains and the job exits 0.
# Prints one line per case and transport with the figures: start-up (mpirun to "ready", and
# the part before the first rank's first log line: MPI's and the transport's start), the
# resident memory per rank while serving (mean and max of VmRSS over the NP processes), and the
# served rate and latency. JSON lines go to $MOERUN_SCALE_SUMMARY when set.
#
#   scale_ranks.sh MOERUN MOEBENCH DATA_DIR NP [TRANSPORTS] [DURATION]
#
# TRANSPORTS: a comma list of mpi,ucx (default mpi,ucx; ucx only where the build has it).
# Exit 0 on success, 1 on failure, 77 (skip) without mpirun or python3.
set -uo pipefail
[[ $# -ge 4 ]] || { echo "usage: scale_ranks.sh MOERUN MOEBENCH DATA_DIR NP [TRANSPORTS] [DURATION]" >&2; exit 2; }
MOERUN=$(realpath "$1")
MOEBENCH=$(realpath "$2")
DATA=$(realpath "$3")
NP=$4
TRANSPORTS=${5:-mpi,ucx}
DURATION=${6:-6}
for tool in mpirun python3; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool is not installed"; exit 77; }
done
[[ $NP =~ ^[0-9]+$ && $NP -ge 3 ]] || { echo "NP must be a number >= 3" >&2; exit 2; }
ROUTERS=$(( NP / 16 > 0 ? NP / 16 : 1 ))
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The one-process reference must not think it was started by an MPI launcher.
unset OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_RANK PMIX_RANK PMI_RANK 2>/dev/null
WORK=$(mktemp -d /tmp/moerun-scale.XXXXXX)
TAG="scale-$$-$RANDOM$RANDOM"
export MOERUN_TEST_TAG=$TAG
MPI_PID=""
BENCH_PID=""
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../lib/mpi_job.sh
source "$HERE/../lib/mpi_job.sh"
# shellcheck source=../serving/ports.sh
source "$HERE/../serving/ports.sh"
cleanup() {
  local rc=$?
  [[ -n "$BENCH_PID" ]] && kill -KILL "$BENCH_PID" 2>/dev/null
  cleanup_job
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT; trap 'exit 143' TERM
CASE=""
fail() {
  echo "FAIL ($CASE): $*" >&2
  [[ -f $WORK/log ]] && grep -v "info: \(rank\|expert rank\|router rank\)" "$WORK/log" | tail -40 >&2
  exit 1
}
MODEL=$DATA/hf-moe/deepseek_v3
[[ -f $MODEL/config.json ]] || { echo "no fixture model at $MODEL" >&2; exit 1; }
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$NP")

# 1. forward, bitwise.
"$MOERUN" forward --model "$MODEL" --input "$MODEL/golden.safetensors" --output "$WORK/ref.st" \
  --threads 1 >"$WORK/ref.log" 2>&1 || { CASE=reference; cp "$WORK/ref.log" "$WORK/log"; fail "one process"; }

summary() { [[ -n "${MOERUN_SCALE_SUMMARY:-}" ]] && echo "$1" >>"$MOERUN_SCALE_SUMMARY"; return 0; }

IFS=, read -ra transports <<<"$TRANSPORTS"
for t in "${transports[@]}"; do
  CASE="forward $t np $NP"
  rm -f "$WORK/out.st"
  t0=$EPOCHREALTIME
  timeout -k 5 240 "${MPIRUN[@]}" "$MOERUN" forward --model "$MODEL" --input "$MODEL/golden.safetensors" \
    --output "$WORK/out.st" --transport "$t" --threads 1 --routers "$ROUTERS" --placement round_robin \
    --microbatch-tokens 16 >"$WORK/log" 2>&1 || fail "mpirun exited with $?"
  t1=$EPOCHREALTIME
  cmp -s "$WORK/ref.st" "$WORK/out.st" || fail "the output differs from one process's"
  grep -q "$NP ranks ($ROUTERS router, $((NP - ROUTERS)) expert) over $t" "$WORK/log" ||
    fail "the summary line does not name $NP ranks over $t: $(tail -1 "$WORK/log")"
  printf 'forward %s np %d (%d routers): bitwise equal to one process; %.1f s under mpirun\n' \
    "$t" "$NP" "$ROUTERS" "$(bc <<<"$t1 - $t0")"
  summary "{\"case\": \"forward\", \"transport\": \"$t\", \"np\": $NP, \"routers\": $ROUTERS, \"bitwise\": true, \"wall_s\": $(bc <<<"$t1 - $t0")}"
done

# 2. serve under verified load.
printf 'scale-test-token-%s\n' "$RANDOM$RANDOM" >"$WORK/token"
chmod 600 "$WORK/token"
for t in "${transports[@]}"; do
  CASE="serve $t np $NP"
  # Serving PORT..PORT+ROUTERS-1, control PORT+100, HTTP PORT+200+rank.
  pick_port "$NP" || fail "no free block of ports"
  cat >"$WORK/serve.yaml" <<EOC
model: $MODEL
layers: [0]
transport: $t
routers: $ROUTERS
placement: round_robin
threads: 1
microbatch_tokens: 16
deadline_ms: 60000
batching: {max_batch_tokens: 64, max_wait_us: 300}
serving:
  listen: 127.0.0.1:$PORT
  control_listen: 127.0.0.1:$((PORT + 100))
  metrics_listen: 127.0.0.1:$((PORT + 200))
  token_file: $WORK/token
  probe_interval_ms: 1000
  probe_deadline_ms: 30000
EOC
  rm -f "$WORK/ready"
  t0=$EPOCHREALTIME
  "${MPIRUN[@]}" "$MOERUN" serve --config "$WORK/serve.yaml" --ready-file "$WORK/ready" >"$WORK/log" 2>&1 &
  MPI_PID=$!
  for _ in $(seq 2400); do
    [[ -f $WORK/ready ]] && break
    kill -0 "$MPI_PID" 2>/dev/null || fail "the job ended before it was ready"
    sleep 0.1
  done
  [[ -f $WORK/ready ]] || fail "not ready within 240 s"
  t_ready=$EPOCHREALTIME
  targets=""
  for ((r = 0; r < ROUTERS; ++r)); do targets+="${targets:+,}127.0.0.1:$((PORT + r))"; done
  "$MOEBENCH" serve --target "$targets" --duration "$DURATION" --warmup 1 \
    --concurrency $((2 * ROUTERS)) --tokens-per-request 8 --model "$MODEL" --verify --json \
    >"$WORK/bench.json" 2>"$WORK/bench.log" &
  BENCH_PID=$!
  sleep $(( DURATION / 2 + 1 ))
  # Resident memory of every rank's process, mid-run.
  rss=()
  for p in $(tagged_pids); do
    grep -qz "OMPI_COMM_WORLD_RANK=" "/proc/$p/environ" 2>/dev/null || continue
    grep -qz mpirun "/proc/$p/cmdline" 2>/dev/null && continue
    rss+=("$(awk '/^VmRSS:/ {print $2}' "/proc/$p/status" 2>/dev/null)")
  done
  [[ ${#rss[@]} -eq $NP ]] || fail "found ${#rss[@]} rank processes, not $NP"
  wait "$BENCH_PID"
  bench_rc=$?
  BENCH_PID=""
  [[ $bench_rc -eq 0 ]] || fail "moebench serve exited with $bench_rc: $(tail -3 "$WORK/bench.log")"
  # SIGTERM to router 0 (as a service manager would): it drains, tells the other routers, and
  # the job ends with exit 0.
  r0=$(rank_pid 0)
  [[ -n "$r0" ]] || fail "cannot find router 0's process"
  kill -TERM "$r0"
  t_stop=$SECONDS
  while kill -0 "$MPI_PID" 2>/dev/null; do
    (( SECONDS - t_stop > 90 )) && fail "the job did not end 90 s after SIGTERM"
    sleep 0.2
  done
  wait "$MPI_PID"
  job_rc=$?
  MPI_PID=""
  [[ $job_rc -eq 0 ]] || fail "the job exited with $job_rc after SIGTERM"
  python3 - "$WORK/bench.json" "$WORK/log" "$t" "$NP" "$ROUTERS" "$t0" "$t_ready" \
    "${MOERUN_SCALE_SUMMARY:-}" "${rss[@]}" <<'PY' || fail "checks failed"
import datetime, json, re, sys
bench = json.load(open(sys.argv[1]))
log = open(sys.argv[2], errors="replace").read().splitlines()
t, np_, routers = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
t0, t_ready, out = float(sys.argv[6]), float(sys.argv[7]), sys.argv[8]
rss_mib = [int(k) / 1024 for k in sys.argv[9:]]
def check(cond, what):
    if not cond:
        print("check failed:", what, file=sys.stderr)
        sys.exit(1)
check(bench["error_count"] == 0 and bench["warmup"]["errors"] == 0, f"failed requests: {bench['errors']}")
check(bench["ok"] > 0 and bench["verified"] == bench["ok"], f"verified {bench['verified']} of {bench['ok']}")
stopped = sum(1 for l in log if re.search(r"router \d+ stopping", l))
check(stopped == routers, f"{stopped} of {routers} routers logged their stop")
# The first log line of any rank: what came before it is MPI's start and the transport's.
first = None
for l in log:
    m = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3})\]", l)
    if m:
        ts = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S.%f").timestamp()
        first = ts if first is None else min(first, ts)
ready = t_ready - t0
before = (first - t0) if first is not None else float("nan")
lat = bench["latency_ms"]
line = (f"serve {t} np {np_} ({routers} routers, {np_ - routers} expert ranks): {bench['ok']} answers, "
        f"0 failed, all verified; ready {ready:.1f} s after mpirun ({before:.1f} s before the first "
        f"log line); resident memory per rank {sum(rss_mib) / len(rss_mib):.1f} MiB mean, "
        f"{max(rss_mib):.1f} MiB max; {bench['requests_per_s']:.0f} req/s, p50 {lat['p50']:.1f} ms, "
        f"p99 {lat['p99']:.1f} ms")
print(line)
if out:
    with open(out, "a") as f:
        f.write(json.dumps({"case": "serve", "transport": t, "np": np_, "routers": routers,
                            "answers": bench["ok"], "failed": 0, "ready_s": ready,
                            "before_first_log_s": before,
                            "rss_mib_mean": sum(rss_mib) / len(rss_mib), "rss_mib_max": max(rss_mib),
                            "requests_per_s": bench["requests_per_s"], "p50_ms": lat["p50"],
                            "p99_ms": lat["p99"]}) + "\n")
PY
done
echo "PASS scale_ranks np $NP ($TRANSPORTS)"
exit 0
