#!/usr/bin/env bash
# A frozen expert rank must fail the job within its deadline, naming the rank, never hang.
#
#   frozen_rank.sh MOERUN_BIN [DATA_DIR]
#
# MOERUN_TEST_TRANSPORT=ucx runs the job over the ucx transport (default mpi).
# MOERUN_TEST_SIGNAL=KILL kills rank 2 (kill -9) instead of stopping it, under
# `mpirun --enable-recovery` so that the job lives on and the router itself must notice: the
# output must name rank 2 and the run must end within the deadline's bound as well.
#
# Starts `mpirun -np 3 moerun forward --preset qwen3-30b-a3b --experts 16 ... --deadline-ms 3000`
# on an input that takes several seconds, waits for "all 3 ranks ready", then SIGSTOPs expert
# rank 2 (found through OMPI_COMM_WORLD_RANK=2 and a tag unique to this run in its environment).
# Asserts: mpirun exits non-zero within 30 s of the STOP, and its output names rank 2 and the
# deadline. If the run ended before the STOP landed, retries once with a 4x bigger input, then
# fails loudly.
set -uo pipefail

MOERUN=${1:?usage: frozen_rank.sh MOERUN_BIN [DATA_DIR]}
MOERUN=$(realpath "$MOERUN")
HERE=$(cd "$(dirname "$0")" && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

TRANSPORT=${MOERUN_TEST_TRANSPORT:-mpi}
SIGNAL=${MOERUN_TEST_SIGNAL:-STOP}
[[ "$SIGNAL" == STOP || "$SIGNAL" == KILL ]] || { echo "MOERUN_TEST_SIGNAL must be STOP or KILL"; exit 2; }
RECOVERY=()
[[ "$SIGNAL" == KILL ]] && RECOVERY=(--enable-recovery)
WORK=$(mktemp -d /tmp/moerun-frozen.XXXXXX)
TAG="frozen-$$-$RANDOM$RANDOM"
MPI_PID=""

# shellcheck source=../lib/mpi_job.sh
source "$HERE/../lib/mpi_job.sh"
trap cleanup_job EXIT
trap 'exit 130' INT; trap 'exit 143' TERM; trap 'exit 129' HUP

fail() { echo "FAIL: $*"; [[ -f "$WORK/log" ]] && { echo "--- mpirun output:"; cat "$WORK/log"; }; exit 1; }

# One attempt: 0 = the freeze was exercised and checked, 2 = the run ended before the STOP.
attempt() {
  local tokens=$1
  rm -f "$WORK/log" "$WORK/out.safetensors"
  python3 "$HERE/st_tool.py" input "$WORK/in.safetensors" "$tokens" 2048 || fail "cannot write the input"
  MOERUN_TEST_TAG=$TAG timeout -k 5 110 mpirun --allow-run-as-root --oversubscribe \
    "${RECOVERY[@]}" --mca mpi_yield_when_idle 1 -np 3 "$MOERUN" forward --transport "$TRANSPORT" \
    --preset qwen3-30b-a3b --experts 16 \
    --input "$WORK/in.safetensors" --output "$WORK/out.safetensors" --microbatch-tokens 64 \
    --deadline-ms 3000 >"$WORK/log" 2>&1 &
  MPI_PID=$!

  # Ready?
  local t0=$SECONDS
  until grep -q "all 3 ranks ready" "$WORK/log" 2>/dev/null; do
    if ! kill -0 "$MPI_PID" 2>/dev/null; then
      wait "$MPI_PID"; local rc=$?; MPI_PID=""
      fail "mpirun ended (exit $rc) before the ranks were ready"
    fi
    (( SECONDS - t0 > 60 )) && fail "the ranks were not ready after 60 s"
    sleep 0.1
  done
  local pid
  pid=$(rank_pid 2)
  if [[ -z "$pid" ]]; then
    if ! kill -0 "$MPI_PID" 2>/dev/null; then wait "$MPI_PID"; MPI_PID=""; return 2; fi
    fail "could not find expert rank 2's process"
  fi
  [[ $(wc -w <<<"$pid") -eq 1 ]] || fail "more than one rank-2 process: $pid"
  # Let a few microbatches flow first, so that the freeze hits a running exchange.
  sleep 0.5
  kill "-$SIGNAL" "$pid" 2>/dev/null || { wait "$MPI_PID"; MPI_PID=""; return 2; }
  local stopped_at=$SECONDS stopped_rt=$EPOCHREALTIME
  echo "sent SIG$SIGNAL to expert rank 2 (pid $pid, $TRANSPORT) $(( SECONDS - t0 )) s after start"
  if grep -q "^moerun forward:" "$WORK/log"; then
    # The output line was already written: the STOP came too late to matter.
    kill -CONT "$pid" 2>/dev/null
    wait "$MPI_PID"; MPI_PID=""; return 2
  fi

  local resumed=""
  while kill -0 "$MPI_PID" 2>/dev/null; do
    if [[ -z "$resumed" ]] && grep -q "^moerun forward:" "$WORK/log"; then
      # Rank 2 had already answered everything: let it finish, and retry bigger.
      kill -CONT "$pid" 2>/dev/null; resumed=1
    fi
    if (( SECONDS - stopped_at > 30 )); then
      # Where each process of the job is (state, kernel wait channel), to tell which one hangs.
      echo "--- the job's processes 30 s after the signal:"
      for p in $(tagged_pids); do
        ps -o pid=,stat=,wchan:32=,args= -p "$p" 2>/dev/null | cut -c1-160
        tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -E '^OMPI_COMM_WORLD_RANK=' | sed 's/^/    /'
      done
      fail "mpirun still running 30 s after rank 2 was stopped (hang)"
    fi
    sleep 0.2
  done
  wait "$MPI_PID"; local rc=$?; MPI_PID=""
  local took
  took=$(awk -v a="$stopped_rt" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  if grep -q "^moerun forward:" "$WORK/log"; then
    echo "--- note: the run completed although rank 2 was stopped"
    cat "$WORK/log"; return 2
  fi
  # (mpirun --enable-recovery may exit 0 after MPI_Abort: then the router's error line counts.)
  if [[ "$SIGNAL" == STOP ]]; then
    [[ $rc -ne 0 ]] || fail "mpirun exited 0 although rank 2 was stopped"
  else
    grep -q "\[r0 router\] error: .*rank 2" "$WORK/log" || fail "the router reported no error naming rank 2"
  fi
  [[ $rc -ne 124 && $rc -ne 137 ]] || fail "mpirun had to be killed by timeout (exit $rc)"
  grep -Eiq "rank 2([^0-9]|$)" "$WORK/log" || fail "the output does not name rank 2"
  if [[ "$SIGNAL" == STOP ]]; then
    grep -iq "deadline" "$WORK/log" || fail "the output does not mention the deadline"
  fi
  # The deadline is 3 s: the error must come within it (plus the job's teardown). The bound is
  # 4x the deadline, a margin a loaded machine does not close; a job that hung would take the
  # whole timeout.
  awk -v t="$took" 'BEGIN { exit !(t < 12) }' || fail "the job took ${took} s to end after SIG$SIGNAL"
  echo "--- mpirun output:"; cat "$WORK/log"
  echo "PASS frozen_rank ($TRANSPORT, SIG$SIGNAL): $tokens tokens, mpirun exit $rc ${took} s after the signal; rank 2 named"
  return 0
}

# FROZEN_TOKENS: the input sizes to try, in order (default: 16384, then 65536).
for tokens in ${FROZEN_TOKENS:-16384 65536}; do
  attempt "$tokens"; rc=$?
  [[ $rc -eq 0 ]] && exit 0
  echo "the run with $tokens tokens ended before the freeze could matter; trying a bigger input"
done
fail "could not exercise the freeze: every run finished before rank 2 was stopped"
