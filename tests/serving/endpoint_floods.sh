#!/usr/bin/env bash
# Cheap denial of service against a real `moerun serve` (the tiny model, 4 ranks as threads):
# each flood of endpoint_flood.py (header-only frames announcing 64 MiB, 4200 silent serving
# connections, 600 keep-alive HTTP connections, silent and wrong-token control connections from
# another address) runs while moebench serve --verify loads the router on new connections: at
# least 90% of its requests answered OK and none wrong, `moectl status` and /health/ready answered
# during the flood. Prints one table.
#
#   endpoint_floods.sh MOERUN MOECTL MOEBENCH DATA_DIR
set -uo pipefail
[[ $# -ge 4 ]] || { echo "usage: endpoint_floods.sh MOERUN MOECTL MOEBENCH DATA_DIR" >&2; exit 2; }
MOERUN=$(realpath "$1")
MOECTL=$(realpath "$2")
MOEBENCH=$(realpath "$3")
DATA=$(realpath "$4")
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d /tmp/moerun-floods.XXXXXX)
source "$HERE/ports.sh"
FLOOD_PID=""
cleanup() {
  [[ -n "$FLOOD_PID" ]] && kill -KILL "$FLOOD_PID" 2>/dev/null
  [[ -n "${SERVE_PID:-}" ]] && kill -KILL "$SERVE_PID" 2>/dev/null
  [[ -n "${KEEP:-}" ]] || rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; tail -30 "$WORK/serve.log" >&2; exit 1; }
ulimit -n 16384 2>/dev/null
[[ $(ulimit -n) -ge 12000 ]] || { echo "SKIP: needs 12000 file descriptors" >&2; exit 77; }
printf 'flood-test-token-%s\n' "$RANDOM$RANDOM" >"$WORK/token"
chmod 600 "$WORK/token"
write_config() {
  cat >"$WORK/serve.yaml" <<EOC
model: $DATA/hf-moe/deepseek_v3
layers: [0]
ranks: 4
transport: inproc
threads: 1
placement: round_robin
serving:
  listen: 127.0.0.1:$PORT
  control_listen: 127.0.0.1:$((PORT + 100))
  metrics_listen: 127.0.0.1:$((PORT + 200))
  token_file: $WORK/token
EOC
}
start_serving write_config "$MOERUN" serve --config "$WORK/serve.yaml" --ready-file "$WORK/ready" ||
  fail "serve did not get ready"
failed=0
printf '| flood | connections opened | verified OK / sent | moectl status | /health/ready |\n'
printf '|---|---|---|---|---|\n'
for kind in none header silent http control; do
  case $kind in
    header | silent) port=$PORT ;;
    http) port=$((PORT + 200)) ;;
    control) port=$((PORT + 100)) ;;
    *) port=0 ;;
  esac
  FLOOD_PID=""
  if [[ $kind != none ]]; then
    python3 "$HERE/endpoint_flood.py" "$kind" "$port" 10 2>"$WORK/flood.$kind" &
    FLOOD_PID=$!
    sleep 2  # the flood is up
  fi
  "$MOEBENCH" serve --target "127.0.0.1:$PORT" --concurrency 4 --duration 4 --warmup 0 --verify \
    --model "$DATA/hf-moe/deepseek_v3" --json >"$WORK/bench.$kind.json" 2>"$WORK/bench.$kind.err"
  st=$("$MOECTL" --target "127.0.0.1:$((PORT + 100))" --token-file "$WORK/token" status \
    >/dev/null 2>"$WORK/ctl.$kind" && echo ok || echo FAILED)
  hr=$(curl -s -m 10 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$((PORT + 200))/health/ready")
  if [[ -n "$FLOOD_PID" ]]; then
    wait "$FLOOD_PID"
    FLOOD_PID=""
  fi
  opened=$(grep -o 'opened [0-9]*' "$WORK/flood.$kind" 2>/dev/null | cut -d' ' -f2)
  python3 - "$WORK/bench.$kind.json" "$kind" "${opened:--}" "$st" "$hr" <<'PY' || failed=1
import json, sys
path, kind, opened, st, hr = sys.argv[1:]
try:
    j = json.load(open(path))
except (OSError, ValueError):
    j = {}
ok, sent = j.get("ok", 0), j.get("requests", 0)
wrong = j.get("errors", {}).get("mismatch", 0) if isinstance(j.get("errors"), dict) else 0
print(f"| {kind} | {opened} | {ok} / {sent} | {st} | {hr} |")
good = sent > 0 and ok * 10 >= sent * 9 and wrong == 0 and st == "ok" and hr == "200"
sys.exit(0 if good else 1)
PY
done
[[ $failed == 0 ]] || fail "a flood kept the verified client, moectl or /health/ready from being answered (table above; moebench: $(tail -2 "$WORK"/bench.*.err))"
kill -TERM "$SERVE_PID"
wait "$SERVE_PID"
SERVE_PID=""
echo "endpoint floods: OK"
