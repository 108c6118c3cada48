#!/usr/bin/env bash
# FP8 experts stay FP8 in memory: a 128-expert DeepSeek-V3 layer in the published FP8 format
# (288 MiB of routed-expert tensors) under `mpirun -np 3` (1 router, 2 expert ranks of 64 experts
# each); every expert rank's resident memory grows by at most 1.1 x the checkpoint bytes of its
# experts (codes and scales) while it loads, and by at least half of them (the experts are in
# memory: a resident size that did not move would mean it was not measured), as its own log line
# reports ("resident X MiB before loading, Y MiB after", read from /proc/self/statm once the
# checkpoint is unmapped). A rank that could not read its resident memory logs "resident memory
# unknown" instead of numbers: that fails the test, as does a resident size of 0.
#
#   fp8_memory.sh MOERUN_BIN
set -uo pipefail
[[ $# -eq 1 ]] || { echo "usage: fp8_memory.sh MOERUN_BIN" >&2; exit 2; }
MOERUN=$(realpath "$1")
HERE=$(cd "$(dirname "$0")" && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
unset OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_RANK PMIX_RANK PMI_RANK 2>/dev/null
WORK=$(mktemp -d /tmp/moerun-fp8-memory.XXXXXX)
TAG="fp8-memory-$$-$RANDOM$RANDOM"
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
trap 'exit 130' INT; trap 'exit 143' TERM

EXPERT_BYTES=$(python3 "$HERE/st_tool.py" fp8-model "$WORK/model" 128 1024 768) || exit 1
python3 "$HERE/st_tool.py" input "$WORK/x.safetensors" 16 1024 || exit 1
timeout -k 5 120 mpirun --allow-run-as-root --oversubscribe --mca mpi_yield_when_idle 1 -np 3 \
  "$MOERUN" forward --model "$WORK/model" --input "$WORK/x.safetensors" \
  --output "$WORK/out.safetensors" >"$WORK/log" 2>&1
rc=$?
if [[ $rc -ne 0 ]]; then
  echo "FAIL: mpirun exited $rc"; sed 's/^/    | /' "$WORK/log" | tail -30; exit 1
fi
# Each expert rank holds half the routed experts.
python3 - "$WORK/log" "$EXPERT_BYTES" <<'PY'
import re, sys
log, total = open(sys.argv[1]).read(), int(sys.argv[2])
per_rank = total / 2 / 2**20
unknown = re.findall(r"\[r\d+ expert\].*resident memory unknown.*", log)
if unknown:
    sys.exit("FAIL: an expert rank could not read its resident memory:\n" + "\n".join(unknown))
lines = re.findall(r"\[r(\d+) expert\].*experts held as (\S+), ([\d.]+) MiB; resident ([\d.]+) MiB "
                   r"before loading, ([\d.]+) MiB after", log)
if len(lines) != 2:
    sys.exit("FAIL: expected 2 expert ranks' load lines, found %d:\n%s" % (len(lines), log))
bad = 0
for rank, held, packed, before, after in lines:
    grew = float(after) - float(before)
    ratio = grew / per_rank
    ok = held == "fp8" and float(before) > 0 and 0.5 <= ratio <= 1.1
    bad += not ok
    print("%s rank %s: held as %s, %.1f MiB of FP8 experts in the checkpoint, resident %.1f -> "
          "%.1f MiB (+%.1f MiB = %.3f x the checkpoint bytes; packed %s MiB)"
          % ("PASS" if ok else "FAIL", rank, held, per_rank, float(before), float(after), grew,
             ratio, packed))
sys.exit(1 if bad else 0)
PY
