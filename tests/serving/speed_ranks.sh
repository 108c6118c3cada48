#!/usr/bin/env bash
# Ranks of different speed, live: `mpirun -np 3 moerun serve` (1 router; expert rank 1 computes on
# 1 thread, expert rank 2 on 2: `rank_threads: {2: 2}`), 16 experts of a skewed preset, linear
# placement (8 experts each).
#   1. A verified load (`moebench serve --verify`); moectl status must show each expert rank's
#      measured speed (rows per second computing) and slots.
#   2. `moectl placement plan --speed-measured`: the plan names both ranks' speeds and its
#      balancedness is in time; `moectl rebalance --speed-measured --wait` applies it with a
#      verified load running beside the migration.
#   3. The same load again.
#   4. Bad input: a speed of 0 (moectl refuses it), a rank that is not a live expert rank, the EPLB
#      policy with speeds, --speed-measured beside --rank-speed: each refused with its reason, and
#      the placement's version does not move.
# Every moebench run must end with 0 failed requests and every answer bitwise right. Prints one JSON
# line: per phase, each expert rank's busy seconds and rows in the phase, busy max ÷ mean, the
# throughput (8-token requests, 2 at a time; 2-token ones with SLOW=isa) and the latency one lone request sees (1 token, 1 at
# a time); the figures are printed, not asserted (no timing assertions in tests).
# Exit 0 on success, 1 on failure, 77 (skip) without mpirun.
#
# How rank 1 is made slow: SLOW=cpu:SHARE (root, cgroup v1 or v2: rank 1 gets SHARE of one core,
# e.g. 0.3, a weaker host's; skipped where no cgroup can be made), SLOW=isa (it computes with the
# scalar kernels, about 80 times slower than AVX2 here: the planner then gives it nothing), or
# SLOW=auto (the default: cpu:0.3 where this shell may make a cgroup, else isa).
#
#   speed_ranks.sh MOERUN MOECTL MOEBENCH [mpi|ucx] [PHASE_SECONDS]
set -uo pipefail
[[ $# -ge 3 ]] || { echo "usage: speed_ranks.sh MOERUN MOECTL MOEBENCH [mpi|ucx] [PHASE_SECONDS]" >&2; exit 2; }
MOERUN=$(realpath "$1")
MOECTL=$(realpath "$2")
MOEBENCH=$(realpath "$3")
TRANSPORT=${4:-mpi}
PHASE_S=${5:-8}
SLOW=${SLOW:-auto}
if [[ $SLOW == auto ]]; then  # a cgroup made and removed again: cpu:0.3; else isa
  SLOW=isa
  probe=/sys/fs/cgroup/moerun-probe-$$
  [[ -d /sys/fs/cgroup/cpu ]] && probe=/sys/fs/cgroup/cpu/moerun-probe-$$
  if mkdir "$probe" 2>/dev/null; then
    rmdir "$probe" && SLOW=cpu:0.3
  fi
fi
export SLOW
# Tokens per request of the loads: few where rank 1 computes on the scalar kernels (a request of
# 16 tokens there takes seconds before the rebalance).
TOKENS=8
[[ $SLOW == isa ]] && TOKENS=2
HERE=$(cd "$(dirname "$0")" && pwd)
command -v mpirun >/dev/null || { echo "SKIP: mpirun is not installed"; exit 77; }
command -v python3 >/dev/null || { echo "SKIP: python3 is not installed"; exit 77; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
WORK=$(mktemp -d /tmp/moerun-speed.XXXXXX)
# shellcheck source=ports.sh
source "$HERE/ports.sh"
SERVE_PID=""
BENCH_PID=""
CGROUP=""
cleanup() {
  [[ -n "$BENCH_PID" ]] && kill -KILL "$BENCH_PID" 2>/dev/null
  if [[ -n "$SERVE_PID" ]]; then
    kill -TERM "$SERVE_PID" 2>/dev/null
    for _ in $(seq 1 20); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$SERVE_PID" 2>/dev/null
  fi
  pkill -KILL -f "$WORK/serve.yaml" 2>/dev/null
  if [[ -n "$CGROUP" ]]; then
    for _ in $(seq 1 20); do rmdir "$CGROUP" 2>/dev/null && break; sleep 0.2; done
  fi
  if [[ -n ${KEEP_WORK:-} ]]; then echo "work folder kept: $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  echo "--- serve log (tail)" >&2
  tail -30 "$WORK/serve.log" >&2
  exit 1
}
printf 'speed-test-token-%s\n' "$RANDOM$RANDOM" >"$WORK/token"
chmod 600 "$WORK/token"
write_config() {
  cat >"$WORK/serve.yaml" <<EOC
preset: {name: qwen3-30b-a3b, seed: 5, experts: 16, dtype: bf16, gate_skew: 1.0}
transport: $TRANSPORT
routers: 1
placement: linear
threads: 1
rank_threads: {2: 2}
$([[ $SLOW == isa ]] && echo "rank_isa: {1: scalar}")
serving:
  listen: 127.0.0.1:$PORT
  control_listen: 127.0.0.1:$((PORT + 100))
  metrics_listen: 127.0.0.1:$((PORT + 200))
  token_file: $WORK/token
  load_window_s: 60
EOC
}
start_serving write_config mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np 3 \
  "$MOERUN" serve --config "$WORK/serve.yaml" --ready-file "$WORK/ready" --pid-file "$WORK/pid" ||
  fail "serve did not get ready"
CTL=(--target "127.0.0.1:$((PORT + 100))" --token-file "$WORK/token")

BENCH_N=0
bench_start() {  # bench_start SECONDS CONCURRENCY TOKENS: a verified load, in the background
  BENCH_N=$((BENCH_N + 1))
  "$MOEBENCH" serve --target "127.0.0.1:$PORT" --duration "$1" --concurrency "$2" --tokens-per-request "$3" \
    --preset qwen3-30b-a3b --seed 5 --experts 16 --weights-dtype bf16 --gate-skew 1.0 --verify \
    --json >"$WORK/bench.$BENCH_N.json" 2>"$WORK/bench.$BENCH_N.log" &
  BENCH_PID=$!
}
bench_check() {  # bench_check WHAT [may-be-empty]: 0 failed and every answer bitwise right
  wait "$BENCH_PID"
  local rc=$?
  BENCH_PID=""
  python3 - "$WORK/bench.$BENCH_N.json" "$rc" "$1" "${2:-}" <<'PY' || fail "moebench during $1: failed or wrong answers ($(tail -3 "$WORK/bench.$BENCH_N.log"))"
import json, sys
b = json.load(open(sys.argv[1]))
print(f"  moebench during {sys.argv[3]}: {b['ok']} ok, {b['error_count']} failed, {b['verified']} verified")
# A load beside a migration on a rank held to a share of a core may see no answer within its
# window (the rank loads its new experts on that share too): no failure, no wrong answer.
empty_ok = sys.argv[4] == "may-be-empty" and b["ok"] == 0 and b["error_count"] == 0
assert empty_ok or (int(sys.argv[2]) == 0 and b["error_count"] == 0 and b["ok"] > 0), b
assert b["verified"] == b["ok"], b
PY
}
status() {  # status FILE: moectl status --json
  "$MOECTL" "${CTL[@]}" status --json >"$1" 2>"$WORK/status.err" || fail "moectl status: $(cat "$WORK/status.err")"
}
version() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['placement_version'])" "$1"; }

# Status once the expert ranks have finished what they were given: their busy seconds (reported
# between microbatches) the same on two reads 1 s apart (at most 60 s).
settled() {  # settled FILE
  local prev="" now
  for _ in $(seq 1 60); do
    status "$1"
    now=$(python3 -c "import json,sys; print([r.get('busy_s', 0) for r in json.load(open(sys.argv[1]))['ranks'] if r['role'] == 'expert'])" "$1")
    [[ $now == "$prev" ]] && return 0
    prev=$now
    sleep 1
  done
  fail "the expert ranks did not settle: busy seconds $now"
}

# A phase: the throughput load, then a lone request's; the status before the load and once the
# ranks have computed all it gave them.
phase() {  # phase NAME
  settled "$WORK/$1.a.json"
  bench_start "$PHASE_S" 2 "$TOKENS"
  bench_check "$1 (throughput)"
  cp "$WORK/bench.$BENCH_N.json" "$WORK/$1.tput.json"
  settled "$WORK/$1.b.json"
  bench_start 3 1 1
  bench_check "$1 (a lone request)"
  cp "$WORK/bench.$BENCH_N.json" "$WORK/$1.lone.json"
}

# SLOW=cpu:SHARE: rank 1's process in a cgroup of SHARE of one core.
if [[ $SLOW == cpu:* ]]; then
  share=${SLOW#cpu:}
  pid1=$("$MOECTL" "${CTL[@]}" status --json | python3 -c "import json,sys; print([r['pid'] for r in json.load(sys.stdin)['ranks'] if r['rank'] == 1][0])")
  quota=$(python3 -c "print(int(100000 * float('$share')))")
  if [[ -d /sys/fs/cgroup/cpu ]]; then  # v1
    CGROUP=/sys/fs/cgroup/cpu/moerun-speed-$$
    mkdir "$CGROUP" && echo 100000 >"$CGROUP/cpu.cfs_period_us" && echo "$quota" >"$CGROUP/cpu.cfs_quota_us" ||
      { echo "SKIP: no cgroup for SLOW=$SLOW"; exit 77; }
  else  # v2
    CGROUP=/sys/fs/cgroup/moerun-speed-$$
    mkdir "$CGROUP" && echo "$quota 100000" >"$CGROUP/cpu.max" || { echo "SKIP: no cgroup for SLOW=$SLOW"; exit 77; }
  fi
  echo "$pid1" >"$CGROUP/cgroup.procs" || fail "rank 1 (pid $pid1) could not join $CGROUP"
  echo "  rank 1 (pid $pid1) limited to $share of a core ($CGROUP)"
fi

bench_start 4 2 "$TOKENS"
bench_check "warm-up"
phase before
# moectl status shows each expert rank's speed and slots.
python3 - "$WORK/before.b.json" <<'PY' || fail "moectl status lacks the expert ranks' speed or slots"
import json, sys
s = json.load(open(sys.argv[1]))
ex = [r for r in s["ranks"] if r["role"] == "expert"]
assert len(ex) == 2, ex
for r in ex:
    assert float(r.get("speed", 0)) > 0 and float(r.get("busy_s", 0)) > 0, r
    assert int(r.get("slots", 0)) == 8, r  # linear: 8 of the 16 experts each
print("  status: " + ", ".join(f"rank {r['rank']} speed {float(r['speed']):.0f} rows/s, {r['slots']} slots" for r in ex))
PY
"$MOECTL" "${CTL[@]}" status >"$WORK/status.txt" 2>&1 || fail "moectl status (text)"
grep -q "speed" "$WORK/status.txt" || fail "moectl status prints no speed column"

# The plan with the measured speeds: both named, balancedness in time.
"$MOECTL" "${CTL[@]}" placement plan --speed-measured --json >"$WORK/plan.json" 2>"$WORK/plan.err" ||
  fail "placement plan --speed-measured: $(cat "$WORK/plan.err")"
python3 - "$WORK/plan.json" <<'PY' || fail "the plan does not name the measured speeds"
import json, sys
p = json.load(open(sys.argv[1]))
sp = p.get("rank_speed", {})
assert sorted(int(k) for k in sp) == [1, 2], p
print("  plan: speeds " + ", ".join(f"{k}: {float(v):.0f}" for k, v in sorted(sp.items())) +
      ", balancedness in time " + ", ".join(f"{l['balancedness_before']:.3f} -> {l['balancedness_after']:.3f}" for l in p["layers"]))
PY

# Bad input: refused with the reason, nothing moved.
V0=$(version "$WORK/before.b.json")
refused() {  # refused WHAT PATTERN MOECTL-ARGS...
  local what=$1 pattern=$2
  shift 2
  if "$MOECTL" "${CTL[@]}" "$@" >"$WORK/bad.out" 2>&1; then fail "$what was accepted"; fi
  grep -qi -- "$pattern" "$WORK/bad.out" || fail "$what: refused without the reason: $(cat "$WORK/bad.out")"
  echo "  refused ($what): $(head -1 "$WORK/bad.out")"
}
refused "a speed of 0" "finite speed above 0" rebalance --rank-speed 1:0 --wait
refused "a rank that is not a live expert rank" "not a live expert rank" rebalance --rank-speed 0:2 --wait
refused "eplb-global with speeds" "balances load, not time" rebalance --policy eplb-global --speed-measured --wait
refused "--speed-measured beside --rank-speed" "excludes" rebalance --speed-measured --rank-speed 1:2 --wait
status "$WORK/after-bad.json"
[[ $(version "$WORK/after-bad.json") == "$V0" ]] || fail "a refused rebalance moved the placement"

# The speed-weighted rebalance, a verified load beside its migration.
bench_start 10 2 "$TOKENS"
sleep 1
"$MOECTL" "${CTL[@]}" rebalance --speed-measured --min-gain -1 --wait --json >"$WORK/rebalance.json" \
  2>"$WORK/rebalance.err" || fail "rebalance --speed-measured: $(cat "$WORK/rebalance.err")"
bench_check "the speed-weighted rebalance" may-be-empty
state=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('state'))" "$WORK/rebalance.json")
[[ $state == done ]] || fail "rebalance --speed-measured: state $state ($(cat "$WORK/rebalance.json"))"

phase after
python3 - "$WORK" <<'PY' || fail "the phases' report"
import json, os, sys
w = sys.argv[1]
def ranks(f):
    return {r["rank"]: r for r in json.load(open(os.path.join(w, f)))["ranks"] if r["role"] == "expert"}
out = {"test": "speed_ranks", "rank_threads": {"1": 1, "2": 2}, "slow": os.environ.get("SLOW", "isa")}
for ph in ("before", "after"):
    a, b = ranks(ph + ".a.json"), ranks(ph + ".b.json")
    busy = {r: float(b[r].get("busy_s", 0)) - float(a[r].get("busy_s", 0)) for r in b}
    rows = {r: int(b[r].get("rows_served", 0)) - int(a[r].get("rows_served", 0)) for r in b}
    mean = sum(busy.values()) / len(busy)
    t = json.load(open(os.path.join(w, ph + ".tput.json")))
    lone = json.load(open(os.path.join(w, ph + ".lone.json")))
    out[ph] = {"busy_s": {str(r): round(v, 3) for r, v in sorted(busy.items())},
               "rows": {str(r): v for r, v in sorted(rows.items())},
               "slots": {str(r): int(b[r].get("slots", 0)) for r in sorted(b)},
               "busy_max_over_mean": round(max(busy.values()) / mean, 3) if mean > 0 else None,
               "tokens_per_s": round(t["tokens_per_s"], 1),
               "lone_request_p50_ms": lone["latency_ms"]["p50"]}
out["speedup_vs_before_tokens_per_s"] = round(out["after"]["tokens_per_s"] / out["before"]["tokens_per_s"], 3)
print(json.dumps(out))
PY
echo "PASS: ranks of 1 and 2 threads, planned and rebalanced by measured speed, every answer bitwise right"
