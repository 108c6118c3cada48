#!/usr/bin/env bash
# `moebench serve` against two builds of `moerun serve` in one run: the same config, the same
# client binary (this build's moebench), the same machine, rounds alternating A B B A so that a
# drift of the machine falls on both. Prints one JSON object: each build's requests/s and p50
# latency per round, their medians, and speedup_vs_base = new req/s / base req/s (higher is
# better: the base's time per request over ours). Paired too: each round's ratio (its two new
# runs' req/s over its two base runs', which ran beside them), their geometric mean and a 90%
# bootstrap interval of it over the rounds (fixed seed), so that a loss can be told from the
# machine's noise: run the base against itself (BASE_BIN_DIR twice) to see that noise.
#   scripts/serve-compare.sh BASE_BIN_DIR [NEW_BIN_DIR] [SECONDS] [ROUNDS] [CONFIG] [DTYPE] [TOKENS]
#                            [CONNECTIONS] [TRANSPORT]
# BASE_BIN_DIR holds the other build's moerun (for example the previous commit's build/bin).
# Defaults: build/bin, 5 s, 3 rounds (6 runs per build), configs/tiny.yaml, f32, 16 tokens,
# 4 connections, the config's transport (ucx under mpirun unless it names one). A preset config
# is verified against the same preset (its name, seed, experts, intermediate and dtype).
# BASE_CONFIG=FILE (environment) serves the base build with another config of the same model
# (for example the old batcher with max_wait_us 0 against the shipped config). p99 is reported
# beside p50. INPUTS=N: distinct request inputs (default 64; fewer for large requests: each is
# computed once by the local layer before the run).
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: scripts/serve-compare.sh BASE_BIN_DIR [NEW_BIN_DIR] [SECONDS] [ROUNDS] [CONFIG] [DTYPE] [TOKENS]}
new=${2:-build/bin}
seconds=${3:-5}
rounds=${4:-3}
config=${5:-configs/tiny.yaml}
base_config=${BASE_CONFIG:-$config}
dtype=${6:-f32}
tokens=${7:-16}
connections=${8:-4}
transport=${9:-}
model=$(sed -n 's/^model: *//p' "$config" | sed 's/ *#.*//')
if [[ -n $model ]]; then
  layer_flags=(--model "$(dirname "$config")/$model")
else
  # A preset: moebench builds the same layer from the config's preset keys.
  read -r -a layer_flags < <(python3 scripts/preset-flags.py "$config")
fi
transport_flag=()
[[ -n $transport ]] && transport_flag=(--transport "$transport")
for b in "$base" "$new"; do
  [[ -x $b/moerun ]] || { echo "serve-compare: no moerun in $b" >&2; exit 2; }
done
[[ -x $new/moebench ]] || { echo "serve-compare: no moebench in $new" >&2; exit 2; }
if [[ $(id -u) == 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
work=$(mktemp -d /tmp/moerun-compare.XXXXXX)
mpi_pid=""
stop_serve() {
  if [[ -n $mpi_pid ]] && kill -0 "$mpi_pid" 2>/dev/null; then
    kill -TERM "$(cat "$work/pid" 2>/dev/null)" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$mpi_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$mpi_pid" 2>/dev/null || true
    wait "$mpi_pid" 2>/dev/null || true
  fi
  mpi_pid=""
}
trap 'stop_serve; rm -rf "$work"' EXIT

# One run: serve with build $1 (4 ranks under mpirun), drive it for $seconds, append
# "req_s p50_ms" to $work/$2.
run() {
  local bin=$1 label=$2 port=$((5700 + RANDOM % 2000)) cfg=$config
  [[ $label == base ]] && cfg=$base_config
  rm -f "$work/ready" "$work/pid"
  mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np 4 \
    "$bin/moerun" serve --config "$cfg" "${transport_flag[@]}" --listen "127.0.0.1:$port" \
    --metrics-listen "127.0.0.1:$((port + 3000))" --ready-file "$work/ready" \
    --pid-file "$work/pid" >"$work/serve-$label.log" 2>&1 &
  mpi_pid=$!
  for _ in $(seq 600); do
    [[ -f $work/ready ]] && break
    kill -0 "$mpi_pid" 2>/dev/null || { cat "$work/serve-$label.log" >&2; exit 1; }
    sleep 0.1
  done
  [[ -f $work/ready ]] || { echo "serve-compare: $bin/moerun did not start" >&2; exit 1; }
  "$new/moebench" serve --target "127.0.0.1:$port" --concurrency "$connections" \
    --duration "$seconds" --tokens-per-request "$tokens" --dtype "$dtype" --verify \
    "${layer_flags[@]}" --inputs "${INPUTS:-64}" --json \
    >"$work/bench.json" 2>"$work/bench.log"
  stop_serve
  python3 - "$work/bench.json" >>"$work/$label" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
if r["error_count"] or r["verified"] != r["ok"]:
    sys.exit("serve-compare: errors or unverified answers: %s" % json.dumps(r["errors"]))
print(r["requests_per_s"], r["latency_ms"]["p50"], r["latency_ms"]["p99"])
EOF
}

for _ in $(seq "$rounds"); do
  run "$base" base
  run "$new" new
  run "$new" new
  run "$base" base
done
python3 - "$work/base" "$work/new" "$base" "$new" "$config" "$dtype" "$tokens" "$seconds" \
  "$connections" "${transport:-default}" "$base_config" <<'EOF'
import json, statistics, sys
def read(p):
    rows = [tuple(map(float, l.split())) for l in open(p) if l.strip()]
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
b_rps, b_p50, b_p99 = read(sys.argv[1])
n_rps, n_p50, n_p99 = read(sys.argv[2])
out = {
    "bench": "serve-compare", "config": sys.argv[5], "dtype": sys.argv[6],
    "tokens_per_request": int(sys.argv[7]), "concurrency": int(sys.argv[9]),
    "transport": sys.argv[10], "seconds_per_run": float(sys.argv[8]),
    "base": {"bin": sys.argv[3], "config": sys.argv[11], "requests_per_s": b_rps, "p50_ms": b_p50,
             "p99_ms": b_p99, "median_requests_per_s": statistics.median(b_rps),
             "median_p50_ms": statistics.median(b_p50), "median_p99_ms": statistics.median(b_p99)},
    "new": {"bin": sys.argv[4], "requests_per_s": n_rps, "p50_ms": n_p50, "p99_ms": n_p99,
            "median_requests_per_s": statistics.median(n_rps),
            "median_p50_ms": statistics.median(n_p50), "median_p99_ms": statistics.median(n_p99)},
}
out["speedup_vs_base"] = out["new"]["median_requests_per_s"] / out["base"]["median_requests_per_s"]
# Rounds ran A B B A: runs 2i and 2i+1 of each build belong to round i.
import math, random
logs = [math.log((n_rps[2 * i] + n_rps[2 * i + 1]) / (b_rps[2 * i] + b_rps[2 * i + 1]))
        for i in range(len(b_rps) // 2)]
rng = random.Random(1)
means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(4000))
out["paired"] = {
    "round_speedups": [math.exp(l) for l in logs],
    "speedup_vs_base": math.exp(statistics.fmean(logs)),
    "interval_90": [math.exp(means[len(means) // 20]), math.exp(means[-len(means) // 20 - 1])],
}
print(json.dumps(out, indent=2))
EOF
