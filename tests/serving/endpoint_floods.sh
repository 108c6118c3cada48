#!/usr/bin/env bash
# Cheap denial of service against a real `moerun serve` (the tiny model, 4 ranks as threads):
# each attack of endpoint_flood.py (header-only frames announcing 64 MiB, 4200 silent serving
# connections, 600 keep-alive HTTP connections, silent and wrong-token control connections from
# another address, a control-token brute force from 4 other addresses, expert updates naming
# files outside the allowed folder, 300 connections trickling a frame 1 byte a second, one
# connection pipelining 16 KiB requests without reading) runs while moebench serve --verify loads
# the router on new connections: at least 90% of its requests answered OK and none wrong,
# `moectl status` (from 127.0.0.1) and /health/ready answered during the attack, and the serve
# process's resident memory (VmRSS) at most 32 MiB above what it was before the attack once its
# connections are gone (the router's own steady state is ~20 MiB; a flood that left buffers or
# per-connection state behind shows as growth). Per kind:
#   brute     wrong tokens checked (not refused unchecked during a cool-down) at most what the
#             back-off allows: per address 6 free tries, then one per cool-down (250 ms doubling
#             to 8 s): <= 4 addresses x (11 + seconds/8); at most 2 + seconds/10 router log lines
#             about wrong tokens during the attack
#   files     every update of a file outside the folder (absolute, "..", links out of it, dangling
#             or not) refused; each answer names the path asked for; a missing and a present file
#             outside get the same answer; no 8-byte run of a target's first line (nor its first
#             8 bytes as a number) in any answer, the updates' status or the log (the one file
#             inside, not safetensors, may be taken and fail: its error must not echo it either)
#   trickle   runs 4 s longer: past the frame timeout, the server has closed trickling connections
#   deadline  requests whose own deadline is 1 ms (the field is the client's), 8 connections x 32
#             in flight: /health/ready polled every 100 ms answers 200 throughout, `moectl
#             status` says ready, and the log grows by at most 3 + seconds/10 lines (a client's
#             deadline decides only its own answer, never a rank's health)
#   utf8      control requests whose token is not UTF-8, 4 connections as fast as answered: each
#             answered MALFORMED_FRAME, readiness as above, the log grows by at most 3 +
#             seconds/10 lines (the protobuf library's own line goes through our logger, one per
#             10 s with the count)
# Every row also polls /health/ready every 100 ms during the attack (the table's "ready polls":
# 200s of polls) and counts the log's growth in lines; the verified client, moectl and readiness
# rows must hold for every attack but http, whose 600 connections fill the HTTP endpoint's cap.
# Prints one table. MOERUN_FULL=1: every attack 30 s instead of 10.
#
#   endpoint_floods.sh MOERUN MOECTL MOEBENCH DATA_DIR [tls]
# tls: the same job with TLS on its serving and control endpoints (a self-signed certificate made
# here); the attacks none, deadline, utf8 (over TLS), silent and header (plain TCP against TLS:
# stalled and bad handshakes).
set -uo pipefail
[[ $# -ge 4 ]] || { echo "usage: endpoint_floods.sh MOERUN MOECTL MOEBENCH DATA_DIR [tls]" >&2; exit 2; }
MOERUN=$(realpath "$1")
MOECTL=$(realpath "$2")
MOEBENCH=$(realpath "$3")
DATA=$(realpath "$4")
TLS=0
[[ "${5:-}" == tls ]] && TLS=1
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d /tmp/moerun-floods.XXXXXX)
source "$HERE/ports.sh"
FLOOD_PID=""
POLL_PID=""
cleanup() {
  [[ -n "$FLOOD_PID" ]] && kill -KILL "$FLOOD_PID" 2>/dev/null
  [[ -n "$POLL_PID" ]] && kill -KILL "$POLL_PID" 2>/dev/null
  [[ -n "${SERVE_PID:-}" ]] && kill -KILL "$SERVE_PID" 2>/dev/null
  [[ -n "${KEEP:-}" ]] || rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; tail -30 "$WORK/serve.log" >&2; exit 1; }
ulimit -n 16384 2>/dev/null
[[ $(ulimit -n) -ge 12000 ]] || { echo "SKIP: needs 12000 file descriptors" >&2; exit 77; }
printf 'flood-test-token-%s\n' "$RANDOM$RANDOM" >"$WORK/token"
chmod 600 "$WORK/token"
SECS=10
[[ "${MOERUN_FULL:-0}" == 1 ]] && SECS=30
# The files attack: the allowed folder, secrets beside it, links out of it, and one file inside
# whose content is not safetensors (its error must not echo it).
mkdir -p "$WORK/allowed"
printf 'moerun-outside-secret-%s%s\n' "$RANDOM" "$(date +%N)" >"$WORK/secret.txt"
printf 'INSIDE%s-garbage-%s\n' "$RANDOM" "$(date +%N)" >"$WORK/allowed/garbage.safetensors"
ln -s "$WORK/secret.txt" "$WORK/allowed/link-out.safetensors"
ln -s "$WORK/gone.txt" "$WORK/allowed/link-gone.safetensors"
ln -s "$WORK" "$WORK/allowed/dir-out"
FILES="/etc/shadow
/etc/moerun-no-such-file-$RANDOM
/proc/self/environ
$WORK/allowed/../secret.txt
$WORK/allowed/../no-such-file.txt
$WORK/allowed/link-out.safetensors
$WORK/allowed/link-gone.safetensors
$WORK/allowed/dir-out/secret.txt
$WORK/allowed/garbage.safetensors
secret.txt"
TLS_YAML=""
CLIENT_TLS=()
if [[ $TLS == 1 ]]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -keyout "$WORK/server.key" -out "$WORK/server.crt" -subj /CN=localhost \
    -addext subjectAltName=IP:127.0.0.1,DNS:localhost 2>"$WORK/openssl.err" ||
    { cat "$WORK/openssl.err" >&2; exit 1; }
  chmod 600 "$WORK/server.key"
  TLS_YAML="  tls: {cert_file: $WORK/server.crt, key_file: $WORK/server.key}"
  CLIENT_TLS=(--tls-ca-file "$WORK/server.crt")
  export FLOOD_RSS_BOUND_MIB=48  # endpoint_flood_check.py says why
fi
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
$TLS_YAML
files:
  allow: [$WORK/allowed]
EOC
}
start_serving write_config "$MOERUN" serve --config "$WORK/serve.yaml" --ready-file "$WORK/ready" ||
  fail "serve did not get ready"
failed=0
rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$SERVE_PID/status"; }
# /health/ready every 100 ms until killed: one status code a line.
poll_ready() {
  while :; do
    curl -s -m 2 -o /dev/null -w '%{http_code}\n' "http://127.0.0.1:$((PORT + 200))/health/ready"
    sleep 0.1
  done
}
printf '| attack | connections opened | verified OK / sent | moectl status | /health/ready | ready polls (200 / all) | log lines | router RSS growth | checks |\n'
printf '|---|---|---|---|---|---|---|---|---|\n'
kinds="none header silent http control brute files trickle pipeline deadline utf8"
[[ $TLS == 1 ]] && kinds="none deadline utf8 silent header"
kinds=${FLOOD_KINDS:-$kinds}  # a subset, by hand: FLOOD_KINDS="none deadline"
for kind in $kinds; do
  case $kind in
    header | silent | trickle | pipeline | deadline) port=$PORT ;;
    http) port=$((PORT + 200)) ;;
    control | brute | files | utf8) port=$((PORT + 100)) ;;
    *) port=0 ;;
  esac
  FLOOD_PID=""
  secs=$SECS
  [[ $kind == trickle ]] && secs=$((SECS + 4))  # past the frame timeout (10 s): closed by then
  rss_before=$(rss_kib)
  log_at=$(stat -c %s "$WORK/serve.log")
  curl -s -m 10 "http://127.0.0.1:$((PORT + 200))/metrics" >"$WORK/metrics.before.$kind"
  poll_ready >"$WORK/ready.$kind" 2>/dev/null &
  POLL_PID=$!
  if [[ $kind != none ]]; then
    FLOOD_TOKEN=$(head -1 "$WORK/token") FLOOD_FILES="$FILES" FLOOD_TLS=$TLS \
      FLOOD_MODEL="$DATA/hf-moe/deepseek_v3" \
      python3 "$HERE/endpoint_flood.py" "$kind" "$port" "$secs" 2>"$WORK/flood.$kind" &
    FLOOD_PID=$!
    sleep 2  # the flood is up
  fi
  "$MOEBENCH" serve --target "127.0.0.1:$PORT" "${CLIENT_TLS[@]}" --concurrency 4 \
    --duration $((SECS - 6)) --warmup 0 --verify \
    --model "$DATA/hf-moe/deepseek_v3" --json >"$WORK/bench.$kind.json" 2>"$WORK/bench.$kind.err"
  if "$MOECTL" --target "127.0.0.1:$((PORT + 100))" "${CLIENT_TLS[@]}" --token-file "$WORK/token" \
    status >"$WORK/ctl.$kind" 2>&1; then
    grep -q "NOT READY" "$WORK/ctl.$kind" && st="NOT READY" || st=ok
  else
    st=FAILED
  fi
  hr=$(curl -s -m 10 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$((PORT + 200))/health/ready")
  if [[ -n "$FLOOD_PID" ]]; then
    wait "$FLOOD_PID"
    FLOOD_PID=""
  fi
  kill -KILL "$POLL_PID" 2>/dev/null
  wait "$POLL_PID" 2>/dev/null
  POLL_PID=""
  log_end=$(stat -c %s "$WORK/serve.log")  # the attack's log lines: log_at..log_end
  sleep 1  # the server has seen its connections close
  curl -s -m 10 "http://127.0.0.1:$((PORT + 200))/metrics" >"$WORK/metrics.after.$kind"
  rss_after=$(rss_kib)
  opened=$(grep -o 'opened [0-9]*' "$WORK/flood.$kind" 2>/dev/null | cut -d' ' -f2)
  python3 "$HERE/endpoint_flood_check.py" "$kind" "$WORK" "${opened:--}" "$st" "$hr" \
    "$rss_before" "$rss_after" "$log_at" "$log_end" "$secs" "$SERVE_PID" || failed=1
done
# A control request over the control endpoint's 1 MiB frame limit: moectl says which limit
# (before sending: a refusal that arrives while it writes could be lost with the connection).
python3 -c "import sys; sys.stdout.write('{' + ' ' * (2 << 20) + '}')" >"$WORK/big.json"
if "$MOECTL" --target "127.0.0.1:$((PORT + 100))" "${CLIENT_TLS[@]}" --token-file "$WORK/token" \
  placement apply "$WORK/big.json" >"$WORK/big.out" 2>&1; then
  echo "FAIL: a 2 MiB control request was not refused" >&2
  failed=1
elif ! grep -q "over the control endpoint's limit of 1048576 bytes" "$WORK/big.out"; then
  echo "FAIL: moectl did not name the control frame limit: $(cat "$WORK/big.out")" >&2
  failed=1
fi
[[ $failed == 0 ]] || fail "an attack kept the verified client, moectl or /health/ready from being answered, left memory behind or leaked (table and reasons above; moebench: $(tail -q -n 2 "$WORK"/bench.*.err))"
kill -TERM "$SERVE_PID"
wait "$SERVE_PID"
SERVE_PID=""
echo "endpoint floods: OK"
