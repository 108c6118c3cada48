#!/usr/bin/env bash
# A joiner with less memory gets what fits, the rest goes elsewhere: `mpirun --enable-recovery
# -np 4 moerun serve` over ucx (1 router, expert ranks 1-3, `spare_expert_ranks: 1`: rank 4 a slot
# with no process), 16 experts of a Qwen3 preset (9 MiB each in BF16), `moebench serve --verify`
# throughout, and
#   1. `moerun serve --join ... --expert-memory-mib 20` takes rank 4: its memory holds 2 experts;
#      moectl status shows its capacity (slots column "0/2");
#   2. `moectl rebalance --redundant 2 --wait` (18 slots: 5, 5, 4, 4 evenly): rank 4 gets the 2
#      that fit, ranks 1-3 share the other 16 (6, 5, 5);
#   3. `--rank-slots 4:3` is refused ("its memory holds 2"), and a --redundant the ranks cannot
#      hold in all is refused, nothing moved.
# Asserts 0 failed requests and every answer bitwise right.
#
#   small_joiner.sh MOERUN MOECTL MOEBENCH
#
# Exit 0 on success, 1 on failure, 77 (skip) without mpirun or python3.
set -uo pipefail
[[ $# -ge 3 ]] || { echo "usage: small_joiner.sh MOERUN MOECTL MOEBENCH" >&2; exit 2; }
MOERUN=$(realpath "$1")
MOECTL=$(realpath "$2")
MOEBENCH=$(realpath "$3")
HERE=$(cd "$(dirname "$0")" && pwd)
for tool in mpirun python3; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool is not installed"; exit 77; }
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export UCX_TLS=${UCX_TLS:-sm,self} MOERUN_UCX_PUT_MIN=${MOERUN_UCX_PUT_MIN:-256}
WORK=$(mktemp -d /tmp/moerun-small-joiner.XXXXXX)
TAG="small-joiner-$$-$RANDOM$RANDOM"
export MOERUN_TEST_TAG=$TAG
MPI_PID=""
SERVE_PID=""
BENCH_PID=""
JOIN_PID=""
source "$HERE/ports.sh"
# shellcheck source=../lib/mpi_job.sh
source "$HERE/../lib/mpi_job.sh"
cleanup() {
  local rc=$?
  [[ -n "$BENCH_PID" ]] && kill -KILL "$BENCH_PID" 2>/dev/null
  [[ -n "$JOIN_PID" ]] && kill -KILL "$JOIN_PID" 2>/dev/null
  MPI_PID=$SERVE_PID
  cleanup_job
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT; trap 'exit 143' TERM
fail() {
  echo "FAIL: $*" >&2
  echo "--- serve log (tail)" >&2
  tail -40 "$WORK/serve.log" >&2
  [[ -f $WORK/join.log ]] && { echo "--- join log (tail)" >&2; tail -15 "$WORK/join.log" >&2; }
  exit 1
}
printf 'small-joiner-token-%s\n' "$RANDOM$RANDOM" >"$WORK/token"
chmod 600 "$WORK/token"
write_config() {
  cat >"$WORK/serve.yaml" <<EOC
preset: {name: qwen3-30b-a3b, seed: 5, experts: 16, dtype: bf16, gate_skew: 1.0}
transport: ucx
routers: 1
spare_expert_ranks: 1
placement: linear
threads: 1
deadline_ms: 10000
serving:
  listen: 127.0.0.1:$PORT
  control_listen: 127.0.0.1:$((PORT + 100))
  metrics_listen: 127.0.0.1:$((PORT + 200))
  token_file: $WORK/token
  probe_interval_ms: 200
  probe_deadline_ms: 1000
EOC
}
start_serving write_config mpirun --enable-recovery --oversubscribe --bind-to none \
  --mca mpi_yield_when_idle 1 -np 4 "$MOERUN" serve --config "$WORK/serve.yaml" \
  --ready-file "$WORK/ready" || fail "serve did not get ready"
CTL=(--target "127.0.0.1:$((PORT + 100))" --token-file "$WORK/token")

"$MOEBENCH" serve --target "127.0.0.1:$PORT" --duration 30 --concurrency 2 --tokens-per-request 8 \
  --preset qwen3-30b-a3b --seed 5 --experts 16 --weights-dtype bf16 --gate-skew 1.0 --verify \
  --json >"$WORK/bench.json" 2>"$WORK/bench.log" &
BENCH_PID=$!
sleep 2

# 1. The joiner, its memory for 2 experts.
"$MOERUN" serve --config "$WORK/serve.yaml" --join "127.0.0.1:$((PORT + 100))" \
  --token-file "$WORK/token" --expert-memory-mib 20 >"$WORK/join.log" 2>&1 &
JOIN_PID=$!
wait_line "$WORK/join.log" "joined the job as expert rank 4" 30 || fail "the joiner did not take rank 4"
held() {  # "rank:slots/capacity ..." of the expert ranks, from moectl status
  "$MOECTL" "${CTL[@]}" status --json >"$WORK/status.json" 2>"$WORK/status.err" ||
    fail "moectl status: $(cat "$WORK/status.err")"
  python3 -c "
import json, sys
s = json.load(open(sys.argv[1]))
print(' '.join(f\"{r['rank']}:{sum(len(l.get('experts', [])) for l in r.get('layers', []))}/{r.get('capacity_slots', 0)}\"
               for r in s['ranks'] if r['role'] == 'expert'))" "$WORK/status.json"
}
t=$SECONDS
until [[ $(held) == *"4:0/2"* ]]; do
  (( SECONDS - t > 15 )) && fail "moectl status does not show rank 4's capacity of 2: $(held)"
  sleep 0.5
done
"$MOECTL" "${CTL[@]}" status | grep -E "^4 " | grep -q " 0/2 " || fail "moectl status (text) lacks rank 4's 0/2 slots"
echo "  joined: $(held)"

# 2. The rebalance: rank 4 gets what fits, the others the rest.
"$MOECTL" "${CTL[@]}" --timeout-ms 60000 rebalance --redundant 2 --min-gain -1 --wait --json \
  >"$WORK/rebalance.json" 2>"$WORK/rebalance.err" ||
  fail "moectl rebalance --redundant 2: $(cat "$WORK/rebalance.json" "$WORK/rebalance.err")"
state=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('state'))" "$WORK/rebalance.json")
[[ $state == done ]] || fail "rebalance --redundant 2: state $state"
got=$(held)
[[ $got == "1:6/0 2:5/0 3:5/0 4:2/2" ]] || fail "after the rebalance: $got, not 1:6 2:5 3:5 4:2 (of 2)"
echo "  rebalanced (--redundant 2): $got"

# 3. Refusals, nothing moved.
version() { "$MOECTL" "${CTL[@]}" status --json | python3 -c "import json,sys; print(json.load(sys.stdin)['placement_version'])"; }
v=$(version)
refused() {  # WHAT PATTERN ARGS...
  local what=$1 pattern=$2
  shift 2
  if "$MOECTL" "${CTL[@]}" rebalance "$@" --wait >"$WORK/bad.out" 2>&1; then fail "$what was accepted"; fi
  grep -q -- "$pattern" "$WORK/bad.out" || fail "$what: refused without the reason: $(cat "$WORK/bad.out")"
  echo "  refused ($what): $(head -1 "$WORK/bad.out")"
}
refused "--rank-slots above rank 4's memory" "its memory holds 2" --redundant 2 --rank-slots 4:3
refused "more slots than the ranks hold" "the live expert ranks hold 50" --redundant 40
[[ $(version) == "$v" ]] || fail "a refused rebalance moved the placement"
[[ $(held) == "$got" ]] || fail "a refused rebalance changed the slots: $(held)"

wait "$BENCH_PID"
rc=$?
BENCH_PID=""
python3 - "$WORK/bench.json" "$rc" <<'PY' || fail "moebench: failed requests or wrong answers ($(tail -3 "$WORK/bench.log"))"
import json, sys
b = json.load(open(sys.argv[1]))
print(f"  moebench throughout: {b['ok']} ok, {b['error_count']} failed, {b['verified']} verified")
assert int(sys.argv[2]) == 0 and b["error_count"] == 0 and b["ok"] > 0 and b["verified"] == b["ok"], b
PY
echo "PASS: a joiner of 2 experts' memory got 2 slots, the rest went to the others, every answer bitwise right"
