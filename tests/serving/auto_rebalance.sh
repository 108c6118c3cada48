#!/usr/bin/env bash
# The automatic mode: `moerun serve` (4 ranks as threads, a skewed preset) with
#   rebalance: {auto: true, interval_s: 3, min_gain: 0.1, min_assignments: 2000}
# under moebench serve --verify: the router plans on its window by itself, migrates (trigger
# "auto") while every answer stays bitwise right, and once balanced skips the next plans (their
# predicted gain is below min_gain).
#
#   auto_rebalance.sh MOERUN MOECTL MOEBENCH
set -uo pipefail
[[ $# -ge 3 ]] || { echo "usage: auto_rebalance.sh MOERUN MOECTL MOEBENCH" >&2; exit 2; }
MOERUN=$(realpath "$1")
MOECTL=$(realpath "$2")
MOEBENCH=$(realpath "$3")
WORK=$(mktemp -d /tmp/moerun-autorebalance.XXXXXX)
source "$(dirname "$0")/ports.sh"
cleanup() {
  [[ -f "$WORK/pid" ]] && kill -KILL "$(cat "$WORK/pid")" 2>/dev/null
  [[ -n "${SERVE_PID:-}" ]] && kill -KILL "$SERVE_PID" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; tail -30 "$WORK/serve.log" >&2; exit 1; }
printf 'auto-test-token-%s\n' "$RANDOM$RANDOM" >"$WORK/token"
chmod 600 "$WORK/token"
write_config() {
  cat >"$WORK/serve.yaml" <<EOC
preset: {name: qwen3-30b-a3b, seed: 5, experts: 32, dtype: bf16, gate_skew: 1.0}
transport: inproc
ranks: 4
threads: 1
serving:
  listen: 127.0.0.1:$PORT
  control_listen: 127.0.0.1:$((PORT + 100))
  metrics_listen: 127.0.0.1:$((PORT + 200))
  token_file: $WORK/token
  load_window_s: 3
rebalance: {auto: true, interval_s: 3, min_gain: 0.1, min_assignments: 2000, redundant: 1}
EOC
}
rm -f "$WORK/pid"
start_serving write_config "$MOERUN" serve --config "$WORK/serve.yaml" --ready-file "$WORK/ready" \
  --pid-file "$WORK/pid" || fail "serve did not get ready"
"$MOEBENCH" serve --target "127.0.0.1:$PORT" --concurrency 2 --duration 14 \
  --tokens-per-request 16 --verify --preset qwen3-30b-a3b --seed 5 --experts 32 \
  --weights-dtype bf16 --gate-skew 1.0 --json >"$WORK/bench.json" 2>"$WORK/bench.log" ||
  fail "moebench saw failed or wrong answers: $(tail -3 "$WORK/bench.log")"
"$MOECTL" --target "127.0.0.1:$((PORT + 100))" --token-file "$WORK/token" placement progress \
  --json >"$WORK/progress.json" || fail "moectl placement progress"
kill -TERM "$(cat "$WORK/pid")"
for _ in $(seq 1 60); do kill -0 "$(cat "$WORK/pid")" 2>/dev/null || break; sleep 0.5; done
python3 - "$WORK" <<'PY' || fail "the automatic mode did not do its job"
import json, sys
w = sys.argv[1]
m = json.load(open(f"{w}/progress.json"))
b = json.load(open(f"{w}/bench.json"))
log = open(f"{w}/serve.log").read()
print(json.dumps({"state": m["state"], "trigger": m.get("trigger"), "note": m.get("note"),
                  "migration_s": m.get("elapsed_s"), "requests": b.get("ok"),
                  "verified": b.get("verified"),
                  "skipped_after": "automatic rebalance skipped" in log}))
ok = (m["state"] == "done" and m.get("trigger") == "auto" and b.get("error_count", 1) == 0
      and b.get("verified", -1) == b.get("ok", -2) and b.get("ok", 0) > 0
      and "automatic rebalance skipped" in log)
sys.exit(0 if ok else 1)
PY
echo PASS
