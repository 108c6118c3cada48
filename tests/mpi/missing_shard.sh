#!/usr/bin/env bash
# A sharded checkpoint whose index names a shard that is gone: the layers that do not need it run
# (under mpirun, bitwise as one process on the original fixture); the layer that needs it fails
# cleanly, naming the missing file.
#
#   missing_shard.sh MOERUN_BIN DATA_DIR
#
# From DATA_DIR/hf-moe/qwen3_moe: a 2-layer model in 3 shards (shards 1 and 2: the fixture's
# layer-0 tensors; shard 3: a copy of them renamed to layer 1), then shard 3 is deleted.
set -uo pipefail

[[ $# -eq 2 ]] || { echo "usage: missing_shard.sh MOERUN_BIN DATA_DIR" >&2; exit 2; }
MOERUN=$(realpath "$1")
DATA=$(realpath "$2")
HERE=$(cd "$(dirname "$0")" && pwd)
FIXTURE="$DATA/hf-moe/qwen3_moe"
GOLDEN="$FIXTURE/golden.safetensors"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
unset OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_RANK PMIX_RANK PMI_RANK 2>/dev/null

WORK=$(mktemp -d /tmp/moerun-missing-shard.XXXXXX)
TAG="missing-shard-$$-$RANDOM$RANDOM"
export MOERUN_TEST_TAG=$TAG
cleanup() {
  local p
  for p in /proc/[0-9]*; do
    [[ "${p#/proc/}" == "$$" ]] && continue
    grep -qzx "MOERUN_TEST_TAG=$TAG" "$p/environ" 2>/dev/null && kill -KILL "${p#/proc/}" 2>/dev/null
  done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT; trap 'exit 143' TERM; trap 'exit 129' HUP

fail() {
  echo "FAIL: $*"
  [[ -n "${LOG:-}" && -f "${LOG:-}" ]] && { echo "--- output:"; cat "$LOG"; }
  exit 1
}
mpi() {
  timeout -k 5 90 mpirun --allow-run-as-root --oversubscribe --mca mpi_yield_when_idle 1 -np 3 "$@"
}

CK="$WORK/ckpt"
shards=$(python3 "$HERE/st_tool.py" shard "$FIXTURE" "$CK") || fail "cannot build the sharded checkpoint"
read -r _ _ SHARD3 <<<"$shards"
[[ -f "$CK/$SHARD3" ]] || fail "no third shard written"
grep -q "\"model.layers.1.mlp.gate.weight\": \"$SHARD3\"" "$CK/model.safetensors.index.json" ||
  fail "the index does not map layer 1 to $SHARD3"
rm -f "$CK/$SHARD3"
echo "checkpoint: $shards (deleted: $SHARD3)"

# The reference: one process on the original fixture.
LOG="$WORK/ref.log"
timeout -k 5 60 "$MOERUN" forward --model "$FIXTURE" --input "$GOLDEN" --output "$WORK/ref.safetensors" \
  >"$LOG" 2>&1 || fail "the 1-process run on the original fixture failed"

# Layer 0 needs only shards 1 and 2: one process, then 3 ranks.
LOG="$WORK/one.log"
timeout -k 5 60 "$MOERUN" forward --model "$CK" --layer 0 --input "$GOLDEN" \
  --output "$WORK/one.safetensors" --check "$GOLDEN" >"$LOG" 2>&1 ||
  fail "layer 0 in one process (exit $?)"
LOG="$WORK/l0.log"
mpi "$MOERUN" forward --model "$CK" --layer 0 --input "$GOLDEN" --output "$WORK/l0.safetensors" \
  --check "$GOLDEN" >"$LOG" 2>&1
rc=$?
[[ $rc -eq 0 ]] || fail "mpirun -np 3 --layer 0 exited $rc"
grep -q "within" "$LOG" || fail "--check did not report a pass"
cmp -s "$WORK/one.safetensors" "$WORK/l0.safetensors" ||
  fail "3 ranks and 1 process on the sharded checkpoint differ: $(cmp "$WORK/one.safetensors" "$WORK/l0.safetensors" 2>&1)"
same=$(python3 "$HERE/st_tool.py" same-tensor "$WORK/ref.safetensors" "$WORK/l0.safetensors" output) ||
  fail "3 ranks on the sharded checkpoint vs 1 process on the fixture: $same"
echo "PASS layer 0 (shard $SHARD3 missing), mpirun -np 3: $(grep -o 'rel err.*' "$LOG"); output $same as the 1-process run on the fixture"

# Layer 1 lives in the deleted shard: every way of running it must fail and name the file.
check_fails() {
  local what=$1; shift
  LOG="$WORK/l1-$what.log"
  local t0=$SECONDS
  "$@" >"$LOG" 2>&1
  local rc=$?
  [[ $rc -ne 124 && $rc -ne 137 ]] || fail "--layer 1 ($what) hung (killed by timeout)"
  [[ $rc -ne 0 ]] || fail "--layer 1 ($what) exited 0 although $SHARD3 is missing"
  grep -q "$SHARD3" "$LOG" || fail "--layer 1 ($what): the message does not name $SHARD3"
  [[ ! -s "$WORK/l1.safetensors" ]] || fail "--layer 1 ($what) wrote an output"
  sed "s/^/    | /" "$LOG"
  echo "PASS layer 1 ($what) fails cleanly in $((SECONDS - t0)) s, exit $rc: $(grep -m1 "$SHARD3" "$LOG")"
}
check_fails "1 process" timeout -k 5 60 "$MOERUN" forward --model "$CK" --layer 1 --input "$GOLDEN" \
  --output "$WORK/l1.safetensors"
check_fails "mpirun -np 3" mpi "$MOERUN" forward --model "$CK" --layer 1 --input "$GOLDEN" \
  --output "$WORK/l1.safetensors" --check "$GOLDEN"
echo "missing_shard: all checks passed"
