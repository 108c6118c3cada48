#!/usr/bin/env bash
# Never an OK answer with non-finite values, end to end: a real `moerun serve` (the golden
# deepseek_v3 layer, 4 ranks as threads) gets, pipelined on one connection, an ordinary request of
# 240 tokens, one whose values reach 1e20 in F32 and in BF16 (the experts overflow), and another
# ordinary one: the first is dispatched at once, and the others, queued while it is computed,
# join its batch as its next microbatch (continuous batching, a 200 ms growth window). The huge ones are
# answered INVALID_ARGUMENT naming the cause; the ordinary ones OK, bitwise what `moerun forward`
# writes for the same rows; then `moerun forward` itself refuses the huge rows (exit 2, nothing
# written).
#
#   nonfinite_serve.sh MOERUN DATA_DIR
set -uo pipefail
[[ $# -eq 2 ]] || { echo "usage: nonfinite_serve.sh MOERUN DATA_DIR" >&2; exit 2; }
MOERUN=$(realpath "$1")
MODEL=$(realpath "$2")/hf-moe/deepseek_v3
WORK=$(mktemp -d /tmp/moerun-nonfinite.XXXXXX)
source "$(dirname "$0")/ports.sh"
LIB=$(cd "$(dirname "$0")/../lib" && pwd)  # raw_frames.py
cleanup() {
  [[ -n "${SERVE_PID:-}" ]] && kill -KILL "$SERVE_PID" 2>/dev/null
  [[ -n "${KEEP:-}" ]] || rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; tail -20 "$WORK/serve.log" >&2; exit 1; }

# io.py write ROWS SCALE FILE | io.py compare-and-ask PORT ...: rows as F32 safetensors, and the
# client (stdlib only).
cat >"$WORK/io.py" <<'PY'
import json, math, random, socket, struct, sys

from raw_frames import infer_request, read_response

HIDDEN = 64

def rows(seed, n, scale):
    r = random.Random(seed)
    v = [r.uniform(-1, 1) * scale for _ in range(n * HIDDEN)]
    if scale > 1:
        v[0] = scale
    return struct.unpack("<%df" % len(v), struct.pack("<%df" % len(v), *v))  # as F32

def write_safetensors(path, name, values, n):
    data = struct.pack("<%df" % len(values), *values)
    header = json.dumps({name: {"dtype": "F32", "shape": [n, HIDDEN], "data_offsets": [0, len(data)]}})
    header += " " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode() + data)

def read_safetensors(path, name):
    with open(path, "rb") as f:
        b = f.read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])[name]
    lo, hi = h["data_offsets"]
    return b[8 + n + lo:8 + n + hi]

def bf16(values):  # round to nearest even, as the server's decoder expects bf16 bits
    out = bytearray()
    for u in struct.unpack("<%dI" % len(values), struct.pack("<%df" % len(values), *values)):
        out += struct.pack("<H", ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)
    return bytes(out)

def request(rid, values, n, dtype):
    data = struct.pack("<%df" % len(values), *values) if dtype == 1 else bf16(values)
    return infer_request(rid, [n, HIDDEN], dtype, data)

cmd, work = sys.argv[1], sys.argv[2]
# id -> (seed, tokens, scale, dtype)
REQUESTS = {1: (11, 240, 1.0, 1), 2: (12, 2, 1e20, 1), 3: (13, 2, 1e20, 2), 4: (14, 4, 1.0, 1)}
if cmd == "write":
    for rid, (seed, n, scale, _) in REQUESTS.items():
        write_safetensors("%s/x%d.safetensors" % (work, rid), "input", rows(seed, n, scale), n)
    sys.exit(0)
port = int(sys.argv[3])
bad = 0
with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
    s.sendall(b"".join(request(rid, rows(seed, n, scale), n, dt)
                       for rid, (seed, n, scale, dt) in REQUESTS.items()))
    for _ in REQUESTS:
        f = read_response(s)
        rid, code, msg = f.get(1, 0), f.get(2, 0), f.get(3, b"").decode()
        scale = REQUESTS[rid][2]
        if scale > 1:
            ok = code == 1 and "output is not finite for this input (|x| up to 1e+20)" in msg
            print("id %d (|x| 1e20, %s): code %d: %s" % (rid, "F32" if REQUESTS[rid][3] == 1 else "BF16", code, msg))
        else:
            want = read_safetensors("%s/y%d.safetensors" % (work, rid), "output")
            ok = code == 0 and f.get(6, b"") == want
            print("id %d: code %d, %d bytes, bitwise as moerun forward: %s" % (rid, code, len(f.get(6, b"")), ok))
        bad += not ok
sys.exit(1 if bad else 0)
PY

PYTHONPATH="$LIB" python3 "$WORK/io.py" write "$WORK" || fail "cannot write the inputs"
for i in 1 4; do
  "$MOERUN" forward --model "$MODEL" --input "$WORK/x$i.safetensors" --output "$WORK/y$i.safetensors" \
    --threads 1 >"$WORK/forward$i.log" 2>&1 || { cat "$WORK/forward$i.log"; fail "moerun forward $i"; }
done
"$MOERUN" forward --model "$MODEL" --input "$WORK/x2.safetensors" --output "$WORK/y2.safetensors" \
  --threads 1 >"$WORK/forward2.log" 2>&1
rc=$?
[[ $rc == 2 && ! -e $WORK/y2.safetensors ]] || fail "moerun forward on |x| 1e20: exit $rc (want 2, nothing written)"
grep -q "output is not finite at token 0" "$WORK/forward2.log" || fail "forward's error: $(cat "$WORK/forward2.log")"
echo "moerun forward on |x| 1e20: exit 2, nothing written"

write_config() {
  cat >"$WORK/serve.yaml" <<EOC
model: $MODEL
transport: inproc
ranks: 4
threads: 1
placement: round_robin
batching: {max_batch_tokens: 256, max_wait_us: 200000}
serving:
  listen: 127.0.0.1:$PORT
  metrics_listen: 127.0.0.1:$((PORT + 200))
EOC
}
start_serving write_config "$MOERUN" serve --config "$WORK/serve.yaml" --ready-file "$WORK/ready" ||
  fail "serve did not get ready"
PYTHONPATH="$LIB" python3 "$WORK/io.py" ask "$WORK" "$PORT" || fail "answers (above)"
kill -TERM "$SERVE_PID"
wait "$SERVE_PID" || fail "serve did not shut down cleanly"
grep -q "1 batches, 4 requests" "$WORK/serve.log" || fail "the four requests were not one batch: $(grep 'batches' "$WORK/serve.log")"
SERVE_PID=
echo "PASS nonfinite_serve: huge inputs refused (F32, BF16) in one batch with ordinary requests answered bitwise"
