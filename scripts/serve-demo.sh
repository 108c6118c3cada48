#!/usr/bin/env bash
# Starts `moerun serve` under mpirun (4 ranks on this machine's CPUs, the shipped small model in
# configs/tiny.yaml), drives it with `moebench serve --verify` for a few seconds (every answer
# checked bitwise against the layer computed locally), prints the table and `moectl status`, then
# stops the job with SIGTERM to rank 0 (drain, exit 0). Everything it starts is stopped on exit.
#   scripts/serve-demo.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-5}
bin=build/bin
work=$(mktemp -d /tmp/moerun-demo.XXXXXX)
mpi_pid=""
cleanup() {
  if [[ -n $mpi_pid ]] && kill -0 "$mpi_pid" 2>/dev/null; then
    kill -TERM "$(cat "$work/pid" 2>/dev/null)" 2>/dev/null || true
    sleep 3
    kill -KILL "$mpi_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
if [[ $(id -u) == 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
(umask 077 && head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/token")
# --enable-recovery: an expert rank's death does not end the job (rank 0 logs at start whether
# this job outlives one, and why).
mpirun --enable-recovery --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np 4 \
  "$bin/moerun" serve --config configs/tiny.yaml --listen 127.0.0.1:5700 \
  --metrics-listen 127.0.0.1:9700 --control-listen 127.0.0.1:5800 --token-file "$work/token" \
  --ready-file "$work/ready" --pid-file "$work/pid" >"$work/serve.log" 2>&1 &
mpi_pid=$!
for _ in $(seq 600); do
  [[ -f $work/ready ]] && break
  if ! kill -0 "$mpi_pid" 2>/dev/null; then cat "$work/serve.log"; exit 1; fi
  sleep 0.1
done
[[ -f $work/ready ]] || { cat "$work/serve.log"; echo "serve did not become ready"; exit 1; }
grep -E "ready [0-9.]+ s after start|serving " "$work/serve.log" || true
"$bin/moebench" serve --target 127.0.0.1:5700 --concurrency 4 --duration "$seconds" \
  --tokens-per-request 16 --verify --model tests/data/hf-moe/deepseek_v3 --json \
  >"$work/bench.json"
"$bin/moectl" --target 127.0.0.1:5800 --token-file "$work/token" status
kill -TERM "$(cat "$work/pid")"
wait "$mpi_pid"
rc=$?
mpi_pid=""
grep -q "shut down cleanly" "$work/serve.log" && echo "moerun serve: drained and shut down cleanly"
exit $rc
