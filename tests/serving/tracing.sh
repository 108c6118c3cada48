#!/usr/bin/env bash
# Request traces end to end (OpenTelemetry, OTLP/HTTP): `moerun serve` under mpirun (4 ranks:
# a router and 3 expert ranks, on TRANSPORT) exports to a receiver of the test's own
# (otlp_receiver.py: it decodes the protobuf bodies with the published schema's field numbers).
#   1. `moebench serve --verify --trace-share 0.25`: every request that carried a sampled
#      traceparent arrives as one whole tree (its root the child of the client's span, every
#      other span's parent in the trace, the router's and each expert rank's spans under their
#      own resource, each expert span under the router's call to that rank), the requests
#      without one (tracing.sample 0) emit nothing; malformed traceparents are counted and
#      emit nothing; a failed request (DEADLINE_EXCEEDED) is traced without one. The server's share of each traced request's round trip is printed.
#   2. With FAULTS=1: the collector down (nothing listening), refusing (HTTP 503), slow
#      (answers after 5 s, over the exporter's 2 s timeout) and answering garbage, each beside
#      `moebench serve --verify --trace-share 1`: no failed request, the drops counted, the
#      router's resident memory flat (within 64 MiB over the phases).
# Everything it starts is killed on exit, also on failure.
#   tracing.sh MOERUN MOEBENCH DATA_DIR TRANSPORT
set -uo pipefail
MOERUN=$(realpath "${1:?usage: tracing.sh MOERUN MOEBENCH DATA_DIR TRANSPORT}")
MOEBENCH=$(realpath "$2")
DATA=$(realpath "$3")
TRANSPORT=$4
HERE=$(cd "$(dirname "$0")" && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
WORK=$(mktemp -d /tmp/moerun-tracing.XXXXXX)
TAG="tracing-$$-$RANDOM$RANDOM"
MPI_PID=""
RECV_PID=""
# shellcheck source=../lib/mpi_job.sh
source "$HERE/../lib/mpi_job.sh"
cleanup() {
  [[ -n $RECV_PID ]] && kill -KILL "$RECV_PID" 2>/dev/null
  cleanup_job
}
trap cleanup EXIT
trap 'exit 130' INT; trap 'exit 143' TERM
fail() { echo "FAIL: $*"; echo "--- serve log (tail):"; tail -30 "$WORK/log"; exit 1; }
# shellcheck source=ports.sh
source "$HERE/ports.sh"

# receiver MODE: (re)starts the collector on $RPORT (0: any; the port is then kept).
receiver() {
  [[ -n $RECV_PID ]] && { kill -KILL "$RECV_PID" 2>/dev/null; wait "$RECV_PID" 2>/dev/null; }
  rm -f "$WORK/rport"
  python3 "$HERE/otlp_receiver.py" "$WORK/rport" "$WORK/spans.jsonl" --port "${RPORT:-0}" \
    --mode "$1" --slow-s 5 &
  RECV_PID=$!
  for _ in $(seq 100); do [[ -f $WORK/rport ]] && break; sleep 0.05; done
  [[ -f $WORK/rport ]] || fail "the receiver did not start"
  RPORT=$(cat "$WORK/rport")
}
metric() {  # metric NAME{LABELS}: its value on rank 0's /metrics (0 when absent)
  curl -s --max-time 5 "http://127.0.0.1:$METRICS/metrics" |
    awk -v m="$1" '$1 == m { print $2; found = 1 } END { if (!found) print 0 }'
}
# Waits until the exporter has nothing queued and the exported and dropped counts stand still.
settle() {
  local last="" now
  for _ in $(seq 60); do
    now="$(metric moerun_trace_queue_spans) $(metric moerun_trace_spans_exported_total)"
    now="$now $(metric 'moerun_trace_spans_dropped_total{reason="export_failed"}')"
    [[ $now == "$last" && $now == 0\ * ]] && return 0
    last=$now
    sleep 1
  done
}

receiver ok
pick_port 4 || fail "no free ports"
METRICS=$((PORT + 200))
sed "s#^model: .*#model: $DATA/hf-moe/deepseek_v3#" "$DATA/../../configs/tiny.yaml" >"$WORK/c.yaml"
cat >>"$WORK/c.yaml" <<YAML
tracing:
  endpoint: http://127.0.0.1:$RPORT
  sample: 0
  queue_spans: 100000
YAML
MOERUN_TEST_TAG=$TAG timeout 600 mpirun --oversubscribe --bind-to none \
  --mca mpi_yield_when_idle 1 -np 4 -x MOERUN_TEST_TAG "$MOERUN" serve --config "$WORK/c.yaml" \
  --transport "$TRANSPORT" --listen "127.0.0.1:$PORT" --metrics-listen "127.0.0.1:$METRICS" \
  --control-listen "127.0.0.1:$((PORT + 100))" --ready-file "$WORK/ready" >"$WORK/log" 2>&1 &
MPI_PID=$!
for _ in $(seq 600); do
  [[ -f $WORK/ready ]] && break
  kill -0 "$MPI_PID" 2>/dev/null || fail "the job exited before it was ready"
  sleep 0.1
done
[[ -f $WORK/ready ]] || fail "not ready in 60 s"

bench() {  # bench NAME SHARE SECONDS: verified load, its traced requests in NAME.tp
  "$MOEBENCH" serve --target "127.0.0.1:$PORT" --verify --model "$DATA/hf-moe/deepseek_v3" \
    --duration "$3" --warmup 0.3 --tokens-per-request 64 --concurrency 2 \
    --trace-share "$2" --trace-log "$WORK/$1.tp" --json >"$WORK/$1.json" 2>"$WORK/$1.err" ||
    fail "moebench serve ($1) failed: $(tail -2 "$WORK/$1.err")"
  python3 - "$WORK/$1.json" "$1" <<'PY' || fail "requests failed while $2"
import json, sys
r = json.load(open(sys.argv[1]))
print("%s: %d requests, %d failed, %d verified" % (sys.argv[2], r["requests"], r["error_count"], r["verified"]))
sys.exit(0 if r["error_count"] == 0 and r["verified"] == r["ok"] > 0 else 1)
PY
}

# 1. Whole trees for the traced requests, nothing for the others.
bench traced 0.25 2
# Malformed traceparents (ignored: counted, nothing exported since sample is 0).
python3 - "$PORT" "$HERE/../lib" <<'PY' || fail "the requests with a malformed traceparent failed"
import socket, struct, sys
sys.path.insert(0, sys.argv[2])
from raw_frames import infer_request, read_response, varint
bad = [b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1", b"garbage",
       b"00-00000000000000000000000000000000-b7ad6b7169203331-01",
       b"00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",
       b"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"]
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=30) as s:
    for i, tp in enumerate(bad):
        frame = infer_request(900 + i, [1, 64], 1, struct.pack("<64f", *([0.25] * 64)))
        body = frame[4:] + b"\x52" + varint(len(tp)) + tp
        s.sendall(struct.pack(">I", len(body)) + body)
        f = read_response(s)
        assert f.get(2, 0) == 0, f
    # A request that fails (8192 tokens in 1 ms: DEADLINE_EXCEEDED), without a traceparent:
    # traced because it failed.
    s.sendall(infer_request(999, [8192, 64], 1, struct.pack("<f", 0.5) * (8192 * 64), 1))
    f = read_response(s)
    assert f.get(2, 0) == 2, "expected DEADLINE_EXCEEDED, got %s" % f.get(2, 0)
PY
settle
[[ $(metric moerun_trace_bad_traceparent_total) == 5 ]] ||
  fail "bad traceparents counted: $(metric moerun_trace_bad_traceparent_total), expected 5"
python3 - "$WORK/spans.jsonl" "$WORK/traced.tp" <<'PY' || fail "the traces are not whole"
import collections, json, statistics, sys
spans = [json.loads(l) for l in open(sys.argv[1])]
sent = {}
for line in open(sys.argv[2]):
    tp, rtt_us, code = line.split()
    _, trace, parent, flags = tp.split("-")
    sent[trace] = (parent, int(rtt_us))
by = collections.defaultdict(list)
for s in spans:
    by[s["trace_id"]].append(s)
failed = [t for t, ss in by.items() for s in ss
          if s["name"] == "moerun.request" and s["attributes"]["moerun.trace.kept"] == "failed"]
assert len(failed) == 1, "%d failed requests traced, expected 1" % len(failed)
root = [s for s in by[failed[0]] if s["name"] == "moerun.request"][0]
assert root["status_code"] == 2 and root["attributes"]["moerun.code"] == 2, root
assert root["parent_span_id"] == "" and "deadline" in root["status_message"], root
del by[failed[0]]
assert set(by) == set(sent), "traces %d, traced requests %d, in both %d" % (
    len(by), len(sent), len(set(by) & set(sent)))
RANKS = {"rank-1", "rank-2", "rank-3"}
ratios, experts_seen = [], set()
for trace, ss in by.items():
    ids = {s["span_id"]: s for s in ss}
    assert len(ids) == len(ss), "span ids repeat in a trace"
    roots = [s for s in ss if s["name"] == "moerun.request"]
    assert len(roots) == 1, "%d roots" % len(roots)
    root = roots[0]
    assert root["parent_span_id"] == sent[trace][0], "the root is not the client's span's child"
    assert root["kind"] == 2 and root["resource"]["service.instance.id"] == "rank-0"
    names = collections.Counter(s["name"] for s in ss)
    for n in ("moerun.queue", "moerun.reply"):
        assert names[n] == 1 and ids[[s for s in ss if s["name"] == n][0]["parent_span_id"]] is root
    assert names["moerun.microbatch"] >= 1
    for s in ss:
        if s is root:
            continue
        parent = ids.get(s["parent_span_id"])
        assert parent is not None, "%s has no parent in its trace" % s["name"]
        assert parent["start"] <= s["start"] + 1000000 or s["resource"]["moerun.role"] == "expert"
        want = {"moerun.queue": "moerun.request", "moerun.reply": "moerun.request",
                "moerun.microbatch": "moerun.request", "moerun.gate": "moerun.microbatch",
                "moerun.dispatch": "moerun.microbatch", "moerun.wait": "moerun.microbatch",
                "moerun.combine": "moerun.microbatch", "moerun.expert_rank": "moerun.microbatch",
                "moerun.expert": "moerun.expert_rank", "moerun.expert.receive": "moerun.expert",
                "moerun.expert.compute": "moerun.expert"}[s["name"]]
        assert parent["name"] == want, "%s under %s" % (s["name"], parent["name"])
        if s["name"] == "moerun.expert":
            rank = "rank-%d" % parent["attributes"]["moerun.rank"]
            assert s["resource"]["service.instance.id"] == rank and rank in RANKS
            assert s["kind"] == 2 and "moerun.clock_offset_ns" in s["attributes"]
            experts_seen.add(rank)
        if s["name"] == "moerun.expert_rank":
            assert s["kind"] == 3 and s["resource"]["service.instance.id"] == "rank-0"
    ratios.append((root["end"] - root["start"]) / 1000 / sent[trace][1])
assert experts_seen == RANKS, "expert ranks seen: %s" % sorted(experts_seen)
ratios.sort()
print("traces: %d whole, %d spans; the server's span / the client's round trip: "
      "p10 %.3f, median %.3f, p90 %.3f" % (len(by), len(spans), ratios[len(ratios) // 10],
                                         statistics.median(ratios),
                                         ratios[9 * len(ratios) // 10]))
PY

[[ ${FAULTS:-0} == 1 ]] || { echo "PASS"; exit 0; }

# 2. The collector down, refusing, slow, answering garbage: answers unaffected, drops counted.
rss=()
for mode in down refuse slow garbage; do
  before=$(metric 'moerun_trace_spans_dropped_total{reason="export_failed"}')
  if [[ $mode == down ]]; then
    kill -KILL "$RECV_PID"; wait "$RECV_PID" 2>/dev/null; RECV_PID=""
  else
    receiver "$mode"
  fi
  bench "$mode" 1 2
  settle
  after=$(metric 'moerun_trace_spans_dropped_total{reason="export_failed"}')
  echo "collector $mode: export_failed drops $before -> $after"
  python3 -c "import sys; sys.exit(0 if float('$after') > float('$before') else 1)" ||
    fail "collector $mode: no drops counted"
  rss+=("$(metric moerun_process_resident_memory_bytes)")
done
echo "router resident memory after each phase (bytes): ${rss[*]}"
python3 -c "
import sys; v = [float(x) for x in sys.argv[1:]]
sys.exit(0 if max(v) - v[0] < 64 * 2**20 else 1)" "${rss[@]}" || fail "memory grew: ${rss[*]}"
echo "PASS"
