#!/usr/bin/env bash
# The plots of docs/plots.md from a real job: docs/images/rebalance-plan.svg (moectl placement plan
# --plot on the job's load window) and docs/images/moebench-serve.svg (moebench serve --plot over a
# run with a rebalance in it). The job: mpirun -np 5 moerun serve, 1 router + 4 expert ranks, the
# qwen3-30b-a3b preset (32 experts, bf16, gate_skew 1.0) serving layers 0-3 on the linear
# placement. Skewed traffic on each layer, then the plan's plot, then 24 s of moebench serve on
# layer 0 with `moectl rebalance --redundant 4 --wait` 9 s in. About 1.5 minutes on 2 cores.
#
#   scripts/plots-demo.sh [BIN_DIR (default build/bin)] [OUT_DIR (default docs/images)]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=$(realpath "${1:-$ROOT/build/bin}")
OUTDIR=$(realpath -m "${2:-$ROOT/docs/images}")
mkdir -p "$OUTDIR"
command -v mpirun >/dev/null || { echo "plots-demo: mpirun is not installed" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
WORK=$(mktemp -d /tmp/moerun-plots.XXXXXX)
source "$ROOT/tests/serving/ports.sh"
SERVE_PID=""
cleanup() {
  if [[ -n "$SERVE_PID" ]]; then
    kill -TERM "$SERVE_PID" 2>/dev/null || true
    for _ in $(seq 1 20); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$SERVE_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
printf 'plots-token-%s\n' "$RANDOM$RANDOM" >"$WORK/token"; chmod 600 "$WORK/token"
write_config() {
  cat >"$WORK/serve.yaml" <<EOC
preset: {name: qwen3-30b-a3b, seed: 5, experts: 32, dtype: bf16, gate_skew: 1.0}
transport: mpi
routers: 1
placement: linear
threads: 1
layers: [0, 1, 2, 3]
serving:
  listen: 127.0.0.1:$PORT
  control_listen: 127.0.0.1:$((PORT + 100))
  metrics_listen: 127.0.0.1:$((PORT + 200))
  token_file: $WORK/token
  load_window_s: 120
EOC
}
# (start_serving and pick_port, from tests/serving/ports.sh, are not written for set -e.)
set +e
start_serving write_config mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np 5 \
  "$B/moerun" serve --config "$WORK/serve.yaml" --ready-file "$WORK/ready" || { tail -30 "$WORK/serve.log"; exit 1; }
set -e
CTL=(--target "127.0.0.1:$((PORT + 100))" --token-file "$WORK/token")
BENCH=(--target "127.0.0.1:$PORT" --concurrency 2 --tokens-per-request 16 --hidden 2048 --warmup 1)
for l in 1 2 3; do
  "$B/moebench" serve "${BENCH[@]}" --layer $l --duration 4 --json >"$WORK/warm$l.json" 2>"$WORK/warm$l.log"
done
"$B/moebench" serve "${BENCH[@]}" --layer 0 --duration 6 --json >"$WORK/warm0.json" 2>"$WORK/warm0.log"
"$B/moectl" "${CTL[@]}" placement plan --redundant 4 --plot "$OUTDIR/rebalance-plan.svg" | tee "$WORK/plan.txt"
# The run the serve plot shows: layer 0, a rebalance 8 s in.
"$B/moebench" serve "${BENCH[@]}" --layer 0 --duration 24 --json --plot "$OUTDIR/moebench-serve.svg" \
  >"$WORK/serve.json" 2>"$WORK/serve-bench.log" & BP=$!
sleep 9
"$B/moectl" "${CTL[@]}" rebalance --redundant 4 --wait >"$WORK/rebalance.txt" 2>&1 || cat "$WORK/rebalance.txt"
wait $BP || { cat "$WORK/serve-bench.log"; exit 1; }
cat "$WORK/serve-bench.log" "$WORK/rebalance.txt"
"$B/moectl" "${CTL[@]}" status
