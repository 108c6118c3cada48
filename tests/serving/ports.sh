# Sourced by the serving test scripts: pick_port [N] sets PORT to a base whose ports
# PORT+0..N-1, PORT+100..PORT+99+N and PORT+200..PORT+199+N (serving, control, metrics of up to
# N ranks; N from 1 to 100, default 10) are free now, below the kernel's ephemeral range (32768+),
# so that other tests' outgoing connections do not take them meanwhile.
pick_port() {
  local try n=${1:-10}
  for try in $(seq 1 50); do
    PORT=$((10000 + RANDOM % 20000))
    if python3 - "$PORT" "$n" <<'PY'; then return 0; fi
import socket, sys
base, n = int(sys.argv[1]), int(sys.argv[2])
held = []
try:
    for off in list(range(n)) + list(range(100, 100 + n)) + list(range(200, 200 + n)):
        s = socket.socket()
        s.bind(("127.0.0.1", base + off))
        held.append(s)
except OSError:
    sys.exit(1)
PY
  done
  echo "no free port block found" >&2
  return 1
}

# start_serving WRITE_CONFIG COMMAND...: picks ports, calls WRITE_CONFIG (it writes the config
# with $PORT), starts COMMAND in the background (output in $WORK/serve.log, pid in SERVE_PID)
# and waits for $WORK/ready; a start that lost a port to another test meanwhile is retried on
# other ports (3 attempts). Returns 1 (the log says why) if it does not get ready.
start_serving() {
  local write_config=$1 attempt
  shift
  for attempt in 1 2 3; do
    pick_port || return 1
    "$write_config"
    rm -f "$WORK/ready"
    "$@" >"$WORK/serve.log" 2>&1 &
    SERVE_PID=$!
    for _ in $(seq 1 240); do
      [[ -f "$WORK/ready" ]] && return 0
      grep -q "Address already in use" "$WORK/serve.log" && break
      kill -0 "$SERVE_PID" 2>/dev/null || break
      sleep 0.5
    done
    [[ -f "$WORK/ready" ]] && return 0
    kill -TERM "$SERVE_PID" 2>/dev/null
    for _ in $(seq 1 20); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$SERVE_PID" 2>/dev/null
    wait "$SERVE_PID" 2>/dev/null
    SERVE_PID=""
    grep -q "Address already in use" "$WORK/serve.log" || return 1
    echo "ports taken meanwhile (attempt $attempt): trying others" >&2
  done
  return 1
}
