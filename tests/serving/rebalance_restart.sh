#!/usr/bin/env bash
# The planner on real traffic, applied by a restart (online migration is not there yet):
#   1. moerun serve (4 ranks as threads) with a skewed preset (qwen3-30b-a3b, 32 experts, bf16,
#      gate_skew 1.0) on the linear placement; moebench serve --verify for DURATION seconds;
#      moectl status: the window's balancedness;
#   2. moectl placement plan --redundant 1 --out PLAN.json (the dry run);
#   3. moerun serve again with that placement; the same load; the window's balancedness.
# Prints a JSON line: balancedness before/planned/after, tokens/s before and after, and
# whether every answer was verified bitwise.
#
#   rebalance_restart.sh MOERUN MOECTL MOEBENCH [DURATION_S]
set -uo pipefail
[[ $# -ge 3 ]] || { echo "usage: rebalance_restart.sh MOERUN MOECTL MOEBENCH [DURATION_S]" >&2; exit 2; }
MOERUN=$(realpath "$1")
MOECTL=$(realpath "$2")
MOEBENCH=$(realpath "$3")
DURATION=${4:-8}
WORK=$(mktemp -d /tmp/moerun-rebalance.XXXXXX)
PORT=$((20000 + RANDOM % 20000))
cleanup() {
  [[ -f "$WORK/pid" ]] && kill -KILL "$(cat "$WORK/pid")" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
printf 'rebalance-test-token-%s\n' "$RANDOM$RANDOM" >"$WORK/token"
chmod 600 "$WORK/token"

config() {  # config PLACEMENT
  cat <<EOC
preset: {name: qwen3-30b-a3b, seed: 5, experts: 32, dtype: bf16, gate_skew: 1.0}
transport: inproc
ranks: 4
routers: 1
placement: $1
threads: 1
serving:
  listen: 127.0.0.1:$PORT
  control_listen: 127.0.0.1:$((PORT + 100))
  metrics_listen: 127.0.0.1:$((PORT + 200))
  token_file: $WORK/token
  load_window_s: $DURATION
EOC
}

# run NAME PLACEMENT: serve, load, status; leaves NAME.json (moebench) and NAME.status
run() {
  local name=$1
  config "$2" >"$WORK/$name.yaml"
  rm -f "$WORK/ready"
  "$MOERUN" serve --config "$WORK/$name.yaml" --ready-file "$WORK/ready" --pid-file "$WORK/pid" \
    >"$WORK/$name.log" 2>&1 &
  for _ in $(seq 1 240); do [[ -f "$WORK/ready" ]] && break; sleep 0.5; done
  [[ -f "$WORK/ready" ]] || { echo "serve did not get ready:" >&2; tail -5 "$WORK/$name.log" >&2; exit 1; }
  "$MOEBENCH" serve --target "127.0.0.1:$PORT" --concurrency 4 --duration "$DURATION" \
    --tokens-per-request 32 --verify --preset qwen3-30b-a3b --seed 5 --experts 32 \
    --weights-dtype bf16 \
    --gate-skew 1.0 --json >"$WORK/$name.json" 2>"$WORK/$name.bench.log" ||
    { echo "moebench failed:" >&2; tail -5 "$WORK/$name.bench.log" >&2; exit 1; }
  sleep 1.5  # the router refreshes its window between batches and when idle
  "$MOECTL" --target "127.0.0.1:$((PORT + 100))" --token-file "$WORK/token" status --json \
    >"$WORK/$name.status"
  if [[ $name == before ]]; then
    "$MOECTL" --target "127.0.0.1:$((PORT + 100))" --token-file "$WORK/token" placement plan \
      --redundant 1 --json --out "$WORK/plan.placement.json" >"$WORK/plan.json" 2>/dev/null ||
      { echo "placement plan failed" >&2; exit 1; }
  fi
  kill -TERM "$(cat "$WORK/pid")"
  for _ in $(seq 1 60); do kill -0 "$(cat "$WORK/pid")" 2>/dev/null || break; sleep 0.5; done
  rm -f "$WORK/pid"
}

run before linear
run after "$WORK/plan.placement.json"
python3 - "$WORK" <<'PY'
import json, sys
w = sys.argv[1]
def status(n):
    return json.load(open(f"{w}/{n}.status"))["layers"][0]["window_balancedness"]
def bench(n):
    return json.load(open(f"{w}/{n}.json"))
b, a = bench("before"), bench("after")
plan = json.load(open(f"{w}/plan.json"))["layers"][0]
out = {
    "balancedness_before": round(status("before"), 3),
    "balancedness_planned": round(plan["balancedness_after"], 3),
    "balancedness_after": round(status("after"), 3),
    "copies_loaded": plan["experts_to_load"],
    "bytes_to_move": int(plan["bytes_to_move"]),
    "tokens_per_s_before": round(b.get("tokens_per_s", 0), 1),
    "tokens_per_s_after": round(a.get("tokens_per_s", 0), 1),
    "requests": [b.get("ok", 0), a.get("ok", 0)],
    "verified": all(x.get("error_count", 1) == 0 and x.get("verified", -1) == x.get("ok", -2)
                    and x.get("ok", 0) > 0 for x in (b, a)),
}
print(json.dumps(out))
sys.exit(0 if out["verified"] else 1)
PY
