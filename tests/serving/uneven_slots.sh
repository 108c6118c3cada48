#!/usr/bin/env bash
# Any slot count on any number of expert ranks, live: `mpirun -np 5 moerun serve` (1 router,
# 4 expert ranks, 16 experts, a skewed preset), `moebench serve --verify` running throughout, while
#   1. `moectl rebalance --redundant R --min-gain -1 --wait` for R = 1, 2, 3, 5 (17, 18, 19, 21
#      slots on 4 ranks, none dividing: ranks of 5 and 4, or 6 and 5 slots);
#      then `--redundant 2 --rank-slots 1:2` (a small rank 1 of 2 slots; the others 6, 5, 5), and
#      counts it cannot hold refused;
#   2. `moectl retire 4` (its experts re-placed on the 3 others), then `moectl rebalance
#      --redundant 1 --wait` on 3 expert ranks (17 slots: 6, 6 and 5);
#   3. a policy that needs even counts asked for an uneven one is refused with the reason, and
#      nothing moves.
# After each migration moectl status must show every live expert rank holding the planned count
# (the fewest and the most differ by at most one). moebench must end with 0 failed requests and
# every answer bitwise right (one run beside each migration). Prints one JSON line: each plan's
# predicted balancedness and slot counts.
# Exit 0 on success, 1 on failure, 77 (skip) without mpirun.
#
#   uneven_slots.sh MOERUN MOECTL MOEBENCH [mpi|ucx]
set -uo pipefail
[[ $# -ge 3 ]] || { echo "usage: uneven_slots.sh MOERUN MOECTL MOEBENCH [mpi|ucx]" >&2; exit 2; }
MOERUN=$(realpath "$1")
MOECTL=$(realpath "$2")
MOEBENCH=$(realpath "$3")
TRANSPORT=${4:-mpi}
HERE=$(cd "$(dirname "$0")" && pwd)
command -v mpirun >/dev/null || { echo "SKIP: mpirun is not installed"; exit 77; }
command -v python3 >/dev/null || { echo "SKIP: python3 is not installed"; exit 77; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
WORK=$(mktemp -d /tmp/moerun-uneven.XXXXXX)
# shellcheck source=ports.sh
source "$HERE/ports.sh"
SERVE_PID=""
BENCH_PID=""
cleanup() {
  [[ -n "$BENCH_PID" ]] && kill -KILL "$BENCH_PID" 2>/dev/null
  if [[ -n "$SERVE_PID" ]]; then
    kill -TERM "$SERVE_PID" 2>/dev/null
    for _ in $(seq 1 20); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$SERVE_PID" 2>/dev/null
  fi
  pkill -KILL -f "$WORK/serve.yaml" 2>/dev/null
  if [[ -n ${KEEP_WORK:-} ]]; then echo "work folder kept: $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  echo "--- serve log (tail)" >&2
  tail -30 "$WORK/serve.log" >&2
  exit 1
}
printf 'uneven-test-token-%s\n' "$RANDOM$RANDOM" >"$WORK/token"
chmod 600 "$WORK/token"
write_config() {
  cat >"$WORK/serve.yaml" <<EOC
preset: {name: qwen3-30b-a3b, seed: 5, experts: 16, dtype: bf16, gate_skew: 1.0}
transport: $TRANSPORT
routers: 1
placement: linear
threads: 1
serving:
  listen: 127.0.0.1:$PORT
  control_listen: 127.0.0.1:$((PORT + 100))
  metrics_listen: 127.0.0.1:$((PORT + 200))
  token_file: $WORK/token
  load_window_s: 30
EOC
}
start_serving write_config mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np 5 \
  "$MOERUN" serve --config "$WORK/serve.yaml" --ready-file "$WORK/ready" --pid-file "$WORK/pid" ||
  fail "serve did not get ready"
CTL=(--target "127.0.0.1:$((PORT + 100))" --token-file "$WORK/token")

BENCH_N=0
bench_start() {  # a verified load for $1 seconds, in the background
  BENCH_N=$((BENCH_N + 1))
  "$MOEBENCH" serve --target "127.0.0.1:$PORT" --duration "$1" --concurrency 2 --tokens-per-request 16 \
    --preset qwen3-30b-a3b --seed 5 --experts 16 --weights-dtype bf16 --gate-skew 1.0 --verify \
    --json >"$WORK/bench.$BENCH_N.json" 2>"$WORK/bench.$BENCH_N.log" &
  BENCH_PID=$!
}
bench_check() {  # the load must end with 0 failed and every answer bitwise right
  wait "$BENCH_PID"
  local rc=$?
  BENCH_PID=""
  python3 - "$WORK/bench.$BENCH_N.json" "$rc" "$1" <<'PY' || fail "moebench during $1: failed or wrong answers ($(tail -3 "$WORK/bench.$BENCH_N.log"))"
import json, sys
b = json.load(open(sys.argv[1]))
print(f"  moebench during {sys.argv[3]}: {b['ok']} ok, {b['error_count']} failed, {b['verified']} verified")
assert int(sys.argv[2]) == 0 and b["error_count"] == 0 and b["ok"] > 0 and b["verified"] == b["ok"], b
PY
}
bench_start 3
bench_check "the start"

# The slots each live expert rank holds now (moectl status), as "rank:count,..." and min/max.
slot_counts() {
  "$MOECTL" "${CTL[@]}" status --json >"$WORK/status.json" 2>"$WORK/status.err" ||
    fail "moectl status: $(cat "$WORK/status.err")"
  python3 - "$WORK/status.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
counts = {r["rank"]: sum(len(l.get("experts", [])) for l in r.get("layers", []))
          for r in s["ranks"] if r["role"] == "expert" and r.get("state") != "retired"}
counts = {r: c for r, c in counts.items() if c > 0}
print(",".join(f"{r}:{c}" for r, c in sorted(counts.items())), min(counts.values()),
      max(counts.values()), sum(counts.values()))
PY
}

RESULTS=()
rebalance() {  # rebalance R RANKS [moectl options...]
  local r=$1 ranks=$2 held
  shift 2
  held=$(slot_counts)
  bench_start 3
  sleep 1
  "$MOECTL" "${CTL[@]}" rebalance --redundant "$r" "$@" --min-gain -1 --wait --json >"$WORK/rebalance.$r.$ranks.json" \
    2>"$WORK/rebalance.err" || fail "moectl rebalance --redundant $r on $ranks ranks: $(cat "$WORK/rebalance.err")"
  bench_check "rebalance --redundant $r on $ranks ranks"
  local state
  state=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('state'))" \
    "$WORK/rebalance.$r.$ranks.json")
  [[ $state == done || $state == skipped ]] || fail "rebalance --redundant $r: state $state"
  read -r counts lo hi total <<<"$(slot_counts)"
  if [[ $state == skipped ]]; then  # the plan gained nothing: the placement stays
    [[ "$counts $lo $hi $total" == "$held" ]] || fail "a skipped rebalance changed the placement"
  else
    [[ $total == $((16 + r)) ]] || fail "--redundant $r on $ranks ranks: $total slots held ($counts), not $((16 + r))"
    if [[ $# == 0 ]]; then
      [[ $((hi - lo)) -le 1 ]] || fail "--redundant $r on $ranks ranks: counts $counts differ by more than one"
    fi
  fi
  local predicted
  predicted=$(python3 -c "
import json, sys
p = json.load(open(sys.argv[1])).get('plan', {})
ls = p.get('layers', [])
print(sum(l['balancedness_after'] for l in ls) / max(len(ls), 1))" "$WORK/rebalance.$r.$ranks.json")
  echo "rebalance --redundant $r on $ranks expert ranks: $state, slots per rank $counts, predicted balancedness $predicted"
  RESULTS+=("{\"ranks\": $ranks, \"redundant\": $r, \"state\": \"$state\", \"slots\": \"$counts\", \"predicted\": $predicted}")
}

for r in 1 2 3 5; do rebalance "$r" 4; done
# A small rank: rank 1 may hold 2 slots (its memory), the others share the rest (6, 5, 5).
rebalance 2 4 --rank-slots 1:2
[[ "$(slot_counts)" == "1:2,2:6,3:5,4:5 2 6 18" ]] || fail "--rank-slots 1:2: slots $(slot_counts)"
# A count the rank cannot hold, or a rank that is not a live expert rank: refused, nothing moved.
before=$(slot_counts)
for bad in 1:17 9:2 0:2; do
  if "$MOECTL" "${CTL[@]}" rebalance --redundant 2 --rank-slots "$bad" --wait >"$WORK/bad.out" 2>&1; then
    fail "--rank-slots $bad was not refused"
  fi
  grep -q "rank-slots" "$WORK/bad.out" || fail "--rank-slots $bad: the refusal does not say why: $(cat "$WORK/bad.out")"
done
[[ "$(slot_counts)" == "$before" ]] || fail "a refused rebalance changed the placement"

# A policy that needs even counts: refused, nothing moved.
before=$(slot_counts)
if "$MOECTL" "${CTL[@]}" placement plan --redundant 1 --policy eplb-hierarchical >"$WORK/refused.out" 2>&1; then
  fail "an uneven eplb-hierarchical plan was not refused: $(cat "$WORK/refused.out")"
fi
grep -q "same number" "$WORK/refused.out" || fail "the refusal does not say why: $(cat "$WORK/refused.out")"
[[ "$(slot_counts)" == "$before" ]] || fail "a refused plan changed the placement"

bench_start 3
sleep 1
"$MOECTL" "${CTL[@]}" retire 4 --wait >"$WORK/retire.out" 2>&1 || fail "moectl retire 4: $(cat "$WORK/retire.out")"
bench_check "retire 4"
rebalance 1 3

echo "{\"test\": \"uneven_slots\", \"plans\": [$(IFS=,; echo "${RESULTS[*]}")]}"
echo "PASS: every redundant count on 4 and 3 expert ranks, answers bitwise right throughout"
