#!/usr/bin/env bash
# moerun serve comes up with every rank loaded, and SIGTERM to the router rank drains and shuts
# the job down with exit 0: as threads (inproc) and under mpirun. A bad config is a clear error.
#   serve_lifecycle.sh MOERUN_BIN DATA_DIR
set -uo pipefail
bin=$1
data=$2
configs=$(cd "$data/../../configs" && pwd)
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; [[ -f $work/log ]] && tail -30 "$work/log"; exit 1; }
# shellcheck source=../lib/mpi_job.sh
source "$(dirname "$0")/../lib/mpi_job.sh"  # wait_exit_within

wait_ready() {  # pid
  for _ in $(seq 300); do
    [[ -f $work/ready ]] && return 0
    kill -0 "$1" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

# 1. inproc: configs/tiny.yaml runs 4 ranks as threads.
rm -f "$work/ready"
"$bin" serve --config "$configs/tiny.yaml" --ready-file "$work/ready" \
  --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 >"$work/log" 2>&1 &
pid=$!
pids+=("$pid")
wait_ready "$pid" || fail "inproc serve never became ready"
grep -q "all 4 ranks ready" "$work/log" || fail "no 'all 4 ranks ready' line"
kill -TERM "$pid"
wait_exit_within "$pid" 30
rc=$?
[[ $rc -eq 0 ]] || fail "inproc serve exited $rc after SIGTERM"
grep -q "shut down cleanly" "$work/log" || fail "no clean shutdown line"
echo "PASS inproc serve: ready, SIGTERM, exit 0"

# 2. mpirun -np 3: SIGTERM to the router rank.
rm -f "$work/ready"
timeout 120 mpirun --oversubscribe --mca mpi_yield_when_idle 1 -np 3 -x MOERUN_SERVE_TEST=$$ \
  "$bin" serve --config "$configs/tiny.yaml" --ready-file "$work/ready" \
  --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 >"$work/log" 2>&1 &
pid=$!
pids+=("$pid")
wait_ready "$pid" || fail "mpirun serve never became ready"
router=""
for p in $(pgrep -f "serve --config"); do
  if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "MOERUN_SERVE_TEST=$$" &&
     tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=0"; then
    router=$p
  fi
done
[[ -n $router ]] || fail "could not find the router rank's process"
kill -TERM "$router"
wait_exit_within "$pid" 30
rc=$?
[[ $rc -eq 0 ]] || fail "mpirun serve exited $rc after SIGTERM to the router"
grep -q "shut down cleanly" "$work/log" || fail "no clean shutdown line under mpirun"
echo "PASS mpirun serve: ready, SIGTERM to rank 0, exit 0"

# 3. Bad configs: a clear error and a non-zero exit.
printf 'model: x\ncolour: red\n' >"$work/bad.yaml"
"$bin" serve --config "$work/bad.yaml" >"$work/log" 2>&1
rc=$?
[[ $rc -ne 0 ]] || fail "a config with an unknown key was accepted"
grep -q 'unknown key "colour"' "$work/log" || fail "the error does not name the key"
printf 'preset: qwen3-30b-a3b\nranks: 1\n' >"$work/one.yaml"
"$bin" serve --config "$work/one.yaml" >"$work/log" 2>&1
rc=$?
[[ $rc -ne 0 ]] || fail "serve with 1 rank was accepted"
grep -q "at least 2 ranks" "$work/log" || fail "the 1-rank error is unclear"
echo "PASS bad configs refused"
