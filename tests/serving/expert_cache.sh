#!/usr/bin/env bash
# The expert cache end to end: `moerun serve` (4 ranks as threads, a skewed preset, round robin)
# whose expert ranks each hold ~25% of the experts they host, under moebench serve --verify:
# every answer bitwise right; moectl status shows each expert rank's cache (budget, resident
# set, hits and misses); /metrics has the moerun_expert_cache_* series; resident bytes stay within
# the budget; experts evicted and needed again were read back from the spill file
# (moerun_expert_cache_spill_reads_total > 0), so the bitwise answers cover spill reads too.
# Then the bad configs: a budget smaller than one expert, pinned experts over the
# budget, an unknown policy, each a clear one-line error and exit 2.
#
#   expert_cache.sh MOERUN MOECTL MOEBENCH
set -uo pipefail
[[ $# -ge 3 ]] || { echo "usage: expert_cache.sh MOERUN MOECTL MOEBENCH" >&2; exit 2; }
MOERUN=$(realpath "$1")
MOECTL=$(realpath "$2")
MOEBENCH=$(realpath "$3")
WORK=$(mktemp -d /tmp/moerun-expert-cache.XXXXXX)
source "$(dirname "$0")/ports.sh"
cleanup() {
  [[ -f "$WORK/pid" ]] && kill -KILL "$(cat "$WORK/pid")" 2>/dev/null
  [[ -n "${SERVE_PID:-}" ]] && kill -KILL "$SERVE_PID" 2>/dev/null
  [[ -n "${KEEP:-}" ]] || rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; tail -30 "$WORK/serve.log" >&2; exit 1; }
printf 'cache-test-token-%s\n' "$RANDOM$RANDOM" >"$WORK/token"
chmod 600 "$WORK/token"
mkdir -p "$WORK/spill"
# qwen3-30b-a3b's shape, 32 experts in bf16 (9 MiB each): ~11 per expert rank; 24 MiB holds 2.
write_config() {
  cat >"$WORK/serve.yaml" <<EOC
preset: {name: qwen3-30b-a3b, seed: 3, experts: 32, dtype: bf16, gate_skew: 1.0}
transport: inproc
ranks: 4
threads: 1
placement: round_robin
expert_cache_mib: 24
expert_cache_pinned: [0]
expert_cache_spill_dir: $WORK/spill
serving:
  listen: 127.0.0.1:$PORT
  control_listen: 127.0.0.1:$((PORT + 100))
  metrics_listen: 127.0.0.1:$((PORT + 200))
  token_file: $WORK/token
EOC
}
rm -f "$WORK/pid"
start_serving write_config "$MOERUN" serve --config "$WORK/serve.yaml" --ready-file "$WORK/ready" \
  --pid-file "$WORK/pid" || fail "serve did not get ready"
"$MOEBENCH" serve --target "127.0.0.1:$PORT" --concurrency 2 --duration 4 \
  --tokens-per-request 2 --verify --preset qwen3-30b-a3b --seed 3 --experts 32 \
  --weights-dtype bf16 --gate-skew 1.0 --json >"$WORK/bench.json" 2>"$WORK/bench.log" ||
  fail "moebench saw failed or wrong answers: $(tail -3 "$WORK/bench.log")"
sleep 1.5  # a probe round: the routers' view of the expert ranks' counters
"$MOECTL" --target "127.0.0.1:$((PORT + 100))" --token-file "$WORK/token" status --json \
  >"$WORK/status.json" || fail "moectl status --json"
"$MOECTL" --target "127.0.0.1:$((PORT + 100))" --token-file "$WORK/token" status \
  >"$WORK/status.txt" || fail "moectl status"
grep -q "expert cache:" "$WORK/status.txt" || fail "moectl status shows no expert cache"
# The planner knows each rank's cache: the plan reports the predicted hit rate before and after.
"$MOECTL" --target "127.0.0.1:$((PORT + 100))" --token-file "$WORK/token" placement plan --redundant 1 --json \
  >"$WORK/plan.json" || fail "moectl placement plan --json"
for r in 1 2 3; do
  curl -s "http://127.0.0.1:$((PORT + 200 + r))/metrics" >"$WORK/metrics.$r" ||
    fail "metrics of rank $r"
done
kill -TERM "$(cat "$WORK/pid")"
for _ in $(seq 1 60); do kill -0 "$(cat "$WORK/pid")" 2>/dev/null || break; sleep 0.5; done
[[ -z "$(ls -A "$WORK/spill")" ]] || fail "the spill file was left behind: $(ls "$WORK/spill")"
python3 - "$WORK" <<'PY' || fail "the expert cache did not behave"
import json, sys
w = sys.argv[1]
b = json.load(open(f"{w}/bench.json"))
s = json.load(open(f"{w}/status.json"))
assert b["error_count"] == 0 and b["verified"] == b["ok"] > 0, b
caches = {r["rank"]: r["cache"] for r in s["ranks"] if "cache" in r}
assert sorted(caches) == [1, 2, 3], caches
budget = 24 << 20
for rank, c in caches.items():
    assert int(c["budget_bytes"]) == budget, c
    assert int(c.get("hits", 0)) + int(c.get("misses", 0)) > 0, c
    assert c.get("hosted_experts", 0) >= 10, c
    assert 1 <= c.get("resident_experts", 0) <= 3, c
p = json.load(open(f"{w}/plan.json"))
for l in p["layers"]:
    # 2 of ~11 hosted experts resident: both well under 1 (1 would mean no cache was seen)
    assert 0 < l["hit_rate_before"] < 1 and 0 < l["hit_rate_after"] < 1, l
series = {}
for r in (1, 2, 3):
    for line in open(f"{w}/metrics.{r}"):
        if line.startswith("moerun_expert_cache_"):
            name, value = line.rsplit(" ", 1)
            series.setdefault(name.split("{")[0], []).append(float(value))
for name in ("moerun_expert_cache_hits_total", "moerun_expert_cache_misses_total",
             "moerun_expert_cache_evictions_total", "moerun_expert_cache_loaded_bytes_total",
             "moerun_expert_cache_resident_bytes", "moerun_expert_cache_wait_seconds_count",
             "moerun_expert_cache_spill_reads_total"):
    assert name in series and len(series[name]) == 3, (name, series.get(name))
assert sum(series["moerun_expert_cache_misses_total"]) > 0, series
# The default policy, adaptive: each rank says which of cycle, lru and lfu it follows (one of 3).
f = series.get("moerun_expert_cache_following", [])
assert len(f) == 9 and sum(f) == 3 and all(v in (0, 1) for v in f), f
# Evicted experts came back from the spill file (each is loaded from the preset once, then read).
assert sum(series["moerun_expert_cache_spill_reads_total"]) > 0, series
assert all(v <= budget for v in series["moerun_expert_cache_resident_bytes"]), series
hits = sum(series["moerun_expert_cache_hits_total"])
misses = sum(series["moerun_expert_cache_misses_total"])
print(json.dumps({"verified": b["verified"], "tokens_per_s": round(b["tokens_per_s"], 1),
                  "plan_hit_rate": [p["layers"][0]["hit_rate_before"], p["layers"][0]["hit_rate_after"]],
                  "hit_rate": round(hits / (hits + misses), 3), "misses": misses,
                  "spill_reads": sum(series["moerun_expert_cache_spill_reads_total"])}))
PY

# Loads slower than half the expert-parallel deadline (expert_cache_load_mib_s: 64 MiB/s, a 9 MiB
# expert in 0.14 s, and a microbatch misses several per rank; the ranks wait 0.25 s, then answer
# "still loading"): the router sends those microbatches again, every answer is right, no rank
# is declared dead.
slow_config() {
  write_config
  printf '%s\n' "deadline_ms: 500" "expert_cache_load_mib_s: ${LOAD_MIB_S}" >>"$WORK/serve.yaml"
}
serve_slow() {
  rm -f "$WORK/pid" "$WORK/ready"
  start_serving slow_config "$MOERUN" serve --config "$WORK/serve.yaml" --ready-file "$WORK/ready" \
    --pid-file "$WORK/pid" || fail "serve (slow loads) did not get ready"
}
stop_serving() {
  kill -TERM "$(cat "$WORK/pid")"
  for _ in $(seq 1 60); do kill -0 "$(cat "$WORK/pid")" 2>/dev/null || break; sleep 0.5; done
}
bench() {  # bench OUT.json EXTRA-FLAGS...
  local out=$1
  shift
  "$MOEBENCH" serve --target "127.0.0.1:$PORT" --concurrency 2 --duration 4 \
    --tokens-per-request 2 --verify --preset qwen3-30b-a3b --seed 3 --experts 32 \
    --weights-dtype bf16 --gate-skew 1.0 --json "$@" >"$out" 2>"$out.log"
}
LOAD_MIB_S=64
serve_slow
bench "$WORK/slow.json" || fail "slow loads: moebench saw failed or wrong answers: $(tail -3 "$WORK/slow.json.log")"
curl -s "http://127.0.0.1:$((PORT + 200))/metrics" >"$WORK/metrics.slow" || fail "metrics (slow loads)"
stop_serving
grep -q "sent again to" "$WORK/serve.log" || fail "slow loads: no microbatch was sent again"
python3 - "$WORK" <<'PY' || fail "slow loads: not answered as they should"
import json, sys
w = sys.argv[1]
b = json.load(open(f"{w}/slow.json"))
assert b["error_count"] == 0 and b["verified"] == b["ok"] > 0, b
m = {}
for line in open(f"{w}/metrics.slow"):
    if not line.startswith("#") and " " in line:
        name, value = line.rsplit(" ", 1)
        m[name.split("{")[0]] = float(value)
assert m.get("moerun_microbatches_resent_for_loads_total", 0) > 0, m.get("moerun_microbatches_resent_for_loads_total")
assert m.get("moerun_ranks_dead", -1) == 0, m.get("moerun_ranks_dead")
print(json.dumps({"slow_loads": {"verified": b["verified"], "tokens_per_s": round(b["tokens_per_s"], 1),
                  "resent": m["moerun_microbatches_resent_for_loads_total"]}}))
PY
# Loads far slower than the requests' deadline (0.5 MiB/s: 18 s an expert, a 1.5 s deadline):
# the requests that miss fail with the rank's reason; no wrong answer, no rank dead, and the job
# still serves (and stops) as it should.
LOAD_MIB_S=0.5
serve_slow
bench "$WORK/late.json" --deadline-ms 1500
grep -q "is still loading" "$WORK/late.json.log" ||
  fail "too slow loads: moebench did not report the rank's reason: $(tail -3 "$WORK/late.json.log")"
curl -s "http://127.0.0.1:$((PORT + 200))/metrics" >"$WORK/metrics.late" || fail "metrics (too slow)"
grep -Eq "^moerun_ranks_dead(\{[^}]*\})? 0$" "$WORK/metrics.late" ||
  fail "too slow loads: a rank was declared dead: $(grep ranks_dead "$WORK/metrics.late")"
python3 - "$WORK/late.json" <<'PY' || fail "too slow loads: wrong answers or no error"
import json, sys
b = json.load(open(sys.argv[1]))
assert b["error_count"] > 0 and b["verified"] == b["ok"], b
PY
stop_serving
kill -0 "$(cat "$WORK/pid")" 2>/dev/null && fail "too slow loads: the job did not stop on SIGTERM"

# Bad configs: one line, exit 2, nothing served.
bad() {  # bad WHAT EXPECTED-TEXT KEY-LINES...
  local what=$1 want=$2
  shift 2
  printf '%s\n' "preset: {name: qwen3-30b-a3b, seed: 3, experts: 32, dtype: bf16}" \
    "transport: inproc" "ranks: 4" "threads: 1" "startup_timeout_s: 5" "$@" \
    "serving: {listen: 127.0.0.1:0, metrics_listen: 127.0.0.1:0}" >"$WORK/bad.yaml"
  timeout 60 "$MOERUN" serve --config "$WORK/bad.yaml" >"$WORK/bad.log" 2>&1
  local rc=$?
  [[ $rc -eq 2 ]] || fail "$what: exit $rc, not 2: $(tail -3 "$WORK/bad.log")"
  grep -q "$want" "$WORK/bad.log" || fail "$what: no '$want' in: $(tail -3 "$WORK/bad.log")"
}
bad "a budget smaller than one expert" "smaller than one expert" "expert_cache_mib: 4"
bad "pinned experts over the budget" "pinned experts" "expert_cache_mib: 10" \
  "expert_cache_pinned: [0, 3, 6, 9]"
bad "an unknown policy" "expert_cache_policy" "expert_cache_mib: 24" "expert_cache_policy: fifo"
bad "a pinned expert that is not one" "not an expert of the model" "expert_cache_mib: 24" \
  "expert_cache_pinned: [99]"
printf '%s\n' "preset: {name: qwen3-30b-a3b, seed: 3, experts: 32, dtype: bf16}" \
  "transport: inproc" "ranks: 4" "expert_cache_mib: 24" >"$WORK/cuda.yaml"
timeout 60 "$MOERUN" serve --config "$WORK/cuda.yaml" --device cuda >"$WORK/bad.log" 2>&1
rc=$?
[[ $rc -eq 2 ]] && grep -q "not available with --device cuda" "$WORK/bad.log" ||
  fail "a cache with --device cuda: exit $rc: $(tail -3 "$WORK/bad.log")"
echo "expert cache: OK"
