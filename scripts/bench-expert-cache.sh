#!/usr/bin/env bash
# The expert cache's figures in one run: the same preset job (skewed routing) served with every
# expert resident and then with an expert cache of each budget (a share of each expert rank's
# hosted experts), loaded by `moebench serve --verify` (every answer checked bitwise against the
# local layer). Prints one JSON object: per budget, tokens/s, p99, the cache hit rate (every expert
# rank's hits and misses from /metrics) and efficiency_vs_resident (tokens/s ÷ the resident job's).
#
#   scripts/bench-expert-cache.sh [--preset qwen3-30b-a3b] [--experts 128] [--dtype bf16]
#       [--skew 1.0] [--budgets 10,25,50,100] [--policies lfu] [--ranks 4] [--duration 10]
#       [--concurrency 4] [--tokens 1] [--spill DIR|none] [--placement round_robin] [--loaders 2]
#       [--bin build/bin]
#
# Needs mpirun, curl and python3. Every job it starts is stopped on exit, whatever happens.
set -euo pipefail

preset=qwen3-30b-a3b experts=128 dtype=bf16 skew=1.0 budgets=10,25,50,100 policies=lfu
ranks=4 duration=10 concurrency=4 tokens=1 spill="" placement=round_robin bin=build/bin loaders=2
port=5790 metrics=9790
while [ $# -gt 0 ]; do
  case "$1" in
    --preset) preset=$2; shift 2 ;;
    --experts) experts=$2; shift 2 ;;
    --dtype) dtype=$2; shift 2 ;;
    --skew) skew=$2; shift 2 ;;
    --budgets) budgets=$2; shift 2 ;;
    --policies) policies=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --concurrency) concurrency=$2; shift 2 ;;
    --tokens) tokens=$2; shift 2 ;;
    --spill) spill=$2; shift 2 ;;
    --placement) placement=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --loaders) loaders=$2; shift 2 ;;
    *) echo "bench-expert-cache.sh: unknown argument '$1' (see the comment at the top)" >&2; exit 2 ;;
  esac
done
for tool in mpirun curl python3; do
  command -v "$tool" > /dev/null || { echo "bench-expert-cache.sh: needs $tool" >&2; exit 2; }
done
work=$(mktemp -d /tmp/moerun-cache-bench.XXXXXX)
if [ -z "$spill" ]; then spill="$work"; fi
job_pid=""
cleanup() {
  if [ -n "$job_pid" ]; then kill -TERM -- -"$job_pid" 2> /dev/null || true; fi
  pkill -f "$work/job.yaml" 2> /dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

cat > "$work/job.yaml" << EOF
preset:
  name: $preset
  seed: 1
  experts: $experts
  dtype: $dtype
  gate_skew: $skew
layers: [0]
routers: 1
placement: $placement
expert_cache_loaders: $loaders
microbatch_tokens: 0
deadline_ms: 30000
batching:
  max_batch_tokens: 1024
  max_wait_us: 2000
  max_queue_tokens: 262144
serving:
  listen: 127.0.0.1:$port
  metrics_listen: 127.0.0.1:$metrics
EOF

export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1}
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}

# One job: $1 = cache MiB (0: resident), $2 = policy; writes $work/run.json.
run_job() {
  local mib=$1 policy=$2 extra=()
  rm -f "$work/ready"
  if [ "$mib" -gt 0 ]; then
    extra=(--expert-cache-mib "$mib" --expert-cache-policy "$policy")
    if [ "$spill" != none ]; then extra+=(--expert-cache-spill-dir "$spill"); fi
  fi
  setsid mpirun -np "$ranks" --oversubscribe --bind-to none \
    "$bin/moerun" serve --config "$work/job.yaml" --ready-file "$work/ready" "${extra[@]}" \
    > "$work/serve.log" 2>&1 &
  job_pid=$!
  for _ in $(seq 1 1200); do
    [ -f "$work/ready" ] && break
    kill -0 "$job_pid" 2> /dev/null || { tail -20 "$work/serve.log" >&2; return 1; }
    sleep 0.1
  done
  [ -f "$work/ready" ] || { echo "the job did not get ready" >&2; tail -20 "$work/serve.log" >&2; return 1; }
  "$bin/moebench" serve --target "127.0.0.1:$port" --concurrency "$concurrency" \
    --duration "$duration" --tokens-per-request "$tokens" --verify --preset "$preset" \
    --experts "$experts" --weights-dtype "$dtype" --gate-skew "$skew" --json \
    > "$work/bench.json" 2> "$work/bench.err" || { cat "$work/bench.err" >&2; return 1; }
  : > "$work/metrics.txt"
  for r in $(seq 1 $((ranks - 1))); do
    curl -s "http://127.0.0.1:$((metrics + r))/metrics" >> "$work/metrics.txt" || true
  done
  kill -TERM -- -"$job_pid" 2> /dev/null || true
  wait "$job_pid" 2> /dev/null || true
  pkill -f "$work/job.yaml" 2> /dev/null || true
  job_pid=""
  python3 - "$work" "$mib" "$policy" << 'EOF'
import json, sys
work, mib, policy = sys.argv[1], int(sys.argv[2]), sys.argv[3]
b = json.load(open(f"{work}/bench.json"))
m = {}
for line in open(f"{work}/metrics.txt"):
    if line.startswith("moerun_expert_cache_") and "{" not in line:
        k, v = line.split()
        m[k] = m.get(k, 0) + float(v)
hits, misses = m.get("moerun_expert_cache_hits_total", 0), m.get("moerun_expert_cache_misses_total", 0)
out = {"cache_mib": mib, "policy": policy if mib else "resident",
       "tokens_per_s": b["tokens_per_s"], "p99_ms": b["latency_ms"]["p99"],
       "verified": b.get("verified", 0), "errors": b["error_count"],
       "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
       "hits": hits, "misses": misses,
       "evictions": m.get("moerun_expert_cache_evictions_total", 0),
       "resident_mib": m.get("moerun_expert_cache_resident_bytes", 0) / 2**20,
       "hosted_experts": m.get("moerun_expert_cache_hosted_experts", 0),
       "waits": m.get("moerun_expert_cache_wait_seconds_count", 0),
       "mean_wait_ms": 1e3 * m.get("moerun_expert_cache_wait_seconds_sum", 0)
                       / max(1, m.get("moerun_expert_cache_wait_seconds_count", 0))}
json.dump(out, open(f"{work}/run.json", "w"))
EOF
}

# Bytes of one expert as held: from the resident job's log ("N expert slot(s), X MiB").
run_job 0 lfu
cp "$work/run.json" "$work/resident.json"
per_rank_mib=$(grep -o 'expert rank [0-9]*: [0-9]* layer(s), [0-9]* expert slot(s), [0-9.]* MiB' \
  "$work/serve.log" | head -1 | awk '{print $(NF-1)}')
results=("$(cat "$work/resident.json")")
IFS=, read -r -a budget_list <<< "$budgets"
IFS=, read -r -a policy_list <<< "$policies"
for pol in "${policy_list[@]}"; do
  for pct in "${budget_list[@]}"; do
    mib=$(python3 -c "import math; print(max(1, math.ceil($per_rank_mib * $pct / 100)))")
    run_job "$mib" "$pol"
    results+=("$(python3 -c "import json; r=json.load(open('$work/run.json')); r['budget_pct']=$pct; print(json.dumps(r))")")
  done
done
printf '%s\n' "${results[@]}" | python3 -c "
import json, sys
rows = [json.loads(l) for l in sys.stdin if l.strip()]
base = rows[0]['tokens_per_s']
for r in rows: r['efficiency_vs_resident'] = r['tokens_per_s'] / base if base else 0
print(json.dumps({'bench': 'expert_cache', 'preset': '$preset', 'experts': $experts,
                  'dtype': '$dtype', 'gate_skew': $skew, 'ranks': $ranks,
                  'placement': '$placement', 'concurrency': $concurrency,
                  'tokens_per_request': $tokens, 'per_rank_mib': $per_rank_mib,
                  'spill': '$spill' != 'none', 'runs': rows}, indent=1))"
