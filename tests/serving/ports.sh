# Sourced by the serving test scripts: pick_port sets PORT to a base whose ports PORT+0..9,
# PORT+100..109 and PORT+200..209 (serving, control, metrics of up to 10 ranks) are free now,
# below the kernel's ephemeral range (32768+), so that other tests' outgoing connections do not
# take them meanwhile.
pick_port() {
  local try
  for try in $(seq 1 50); do
    PORT=$((10000 + RANDOM % 20000))
    if python3 - "$PORT" <<'PY'; then return 0; fi
import socket, sys
base = int(sys.argv[1])
held = []
try:
    for off in list(range(10)) + list(range(100, 110)) + list(range(200, 210)):
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
