#!/usr/bin/env bash
# Zero copy over ucx, measured, with a negative control that shows the copy check can fail.
#
# 1. `moerun forward --transport ucx` at 4 ranks on a qwen3-30b-a3b layer (16 experts, top-8,
#    hidden 2048) for T tokens; every rank logs its transport's counters. Asserts that the router
#    wrote exactly T x 8 rows x 8 KiB by put (each row once), that the expert ranks together wrote
#    the same back, that no rank copied a byte itself or registered on demand, and that the output
#    equals `--transport mpi`'s bitwise.
# 2. The copy check: `moebench transport --transport ucx` (4 ranks, our dispatch + combine,
#    counters over its timed rounds, summed over the ranks) reports the payload (row) bytes and
#    how many of them were copied on their way: by the transport's own code (copied_bytes; the
#    ucx transport has no such copy today, see ucx_transport_impl.h) or through UCX's bounce
#    buffers (payload_eager_bytes: row messages below MOERUN_UCX_PUT_MIN go as UCX eager
#    messages, which UCX copies). Zero copy means: both 0, every payload byte by put, nothing
#    registered on demand.
#    a. Negative control: rows of 512 B and about 2 KiB per expert rank, below put_min: the rows
#       go eagerly, the copied bytes must be > 0 and the check must FAIL.
#    b. The real case: the same shape with 256 KiB per expert rank: the check must pass (0).
#
#   ucx_zero_copy.sh MOERUN_BIN UCX_TLS MOEBENCH_BIN
set -uo pipefail
MOERUN=$(realpath "${1:?usage: ucx_zero_copy.sh MOERUN_BIN UCX_TLS MOEBENCH_BIN}")
TLS=${2:?usage: ucx_zero_copy.sh MOERUN_BIN UCX_TLS MOEBENCH_BIN}
MOEBENCH=$(realpath "${3:?usage: ucx_zero_copy.sh MOERUN_BIN UCX_TLS MOEBENCH_BIN}")
HERE=$(cd "$(dirname "$0")" && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
WORK=$(mktemp -d /tmp/moerun-zero-copy.XXXXXX)
TAG="zero-copy-$$-$RANDOM$RANDOM"
MPI_PID=""
# shellcheck source=../lib/mpi_job.sh
source "$HERE/../lib/mpi_job.sh"
trap cleanup_job EXIT
trap 'exit 130' INT; trap 'exit 143' TERM; trap 'exit 129' HUP
fail() { echo "FAIL: $*"; for f in "$WORK"/*.log; do echo "--- $f"; cat "$f"; done; exit 1; }

TOKENS=256
python3 "$HERE/st_tool.py" input "$WORK/in.safetensors" "$TOKENS" 2048 || fail "cannot write the input"
for tr in mpi ucx; do
  MOERUN_TEST_TAG=$TAG UCX_TLS=$TLS MOERUN_UCX_PROTOCOL=put timeout -k 5 120 mpirun \
    --allow-run-as-root --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np 4 \
    -x MOERUN_TEST_TAG -x UCX_TLS -x MOERUN_UCX_PROTOCOL "$MOERUN" forward --transport "$tr" \
    --preset qwen3-30b-a3b --experts 16 --input "$WORK/in.safetensors" \
    --output "$WORK/out-$tr.safetensors" >"$WORK/$tr.log" 2>&1 || fail "the $tr run failed"
done
cmp -s "$WORK/out-mpi.safetensors" "$WORK/out-ucx.safetensors" || fail "ucx output differs from mpi's"

# "[r0 router] info: ucx transport: 16.00 MiB written by put, 0.00 MiB in eager messages,
#  0 bytes copied by the transport, 2 registrations (0 on demand)"
want=$(awk -v t="$TOKENS" 'BEGIN { printf "%.2f", t * 8 * 2048 * 4 / 1048576 }')
line=$(grep "\[r0 router\] info: ucx transport:" "$WORK/ucx.log") || fail "the router logged no counters"
router=$(sed -E 's/.*: ([0-9.]+) MiB written by put.*/\1/' <<<"$line")
[[ "$router" == "$want" ]] || fail "the router wrote $router MiB by put, not $want (each row once)"
experts=$(grep "\[r[123] expert\] info: ucx transport:" "$WORK/ucx.log" |
  sed -E 's/.*: ([0-9.]+) MiB written by put.*/\1/' | awk '{ s += $1 } END { printf "%.2f", s }')
awk -v a="$experts" -v b="$want" 'BEGIN { exit !(a - b < 0.02 && b - a < 0.02) }' ||
  fail "the expert ranks wrote $experts MiB by put, not $want"
n=$(grep -c "ucx transport: .* 0 bytes copied by the transport, [0-9]* registrations (0 on demand)" "$WORK/ucx.log")
[[ "$n" == 4 ]] || fail "not every rank reports 0 bytes copied and no on-demand registration"
echo "$line"
echo "forward: router $router MiB by put = $TOKENS tokens x 8 rows x 8 KiB, experts $experts MiB back, 0 bytes copied by the transport on all 4 ranks, output equal to mpi's"

# The copy check on one `moebench transport --json` report: prints what it saw; exit 0 when zero
# copy holds, 1 when it does not, 2 when the report cannot be read.
zero_copy_check() {
  python3 - "$1" <<'PY'
import json, sys
try:
    zc = json.load(open(sys.argv[1]))["zero_copy"]
    payload, put = zc["payload_bytes"], zc["put_bytes"]
    copied = zc["copied_bytes"] + zc["payload_eager_bytes"]
    on_demand = zc["on_demand_registrations_during_timing"]
except (OSError, ValueError, KeyError, TypeError) as e:
    print(f"no zero_copy report: {e!r}")
    sys.exit(2)
print(f"payload {payload} bytes: {put} by put, {copied} copied on their way "
      f"({zc['copied_bytes']} by the transport's code, {zc['payload_eager_bytes']} through UCX's "
      f"bounce buffers), {on_demand} registrations on demand")
sys.exit(0 if payload > 0 and copied == 0 and put == payload and on_demand == 0 else 1)
PY
}
# The copied bytes of a report (the control's must be > 0: the check fails for that reason).
copied_of() {
  python3 -c 'import json, sys; z = json.load(open(sys.argv[1]))["zero_copy"]
print(z["copied_bytes"] + z["payload_eager_bytes"])' "$1"
}
bench() {  # bench NAME BYTES_PER_PEER
  MOERUN_TEST_TAG=$TAG UCX_TLS=$TLS MOERUN_UCX_PROTOCOL=put timeout -k 5 120 mpirun \
    --allow-run-as-root --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np 4 \
    -x MOERUN_TEST_TAG -x UCX_TLS -x MOERUN_UCX_PROTOCOL "$MOEBENCH" transport --transport ucx \
    --hidden 128 --bytes-per-peer "$2" --iters 3 --no-layer --json \
    >"$WORK/bench-$1.json" 2>"$WORK/bench-$1.log" || fail "moebench transport ($1) failed"
}

bench control 2048
control=$(zero_copy_check "$WORK/bench-control.json"); rc=$?
echo "control (rows below put_min): $control"
[[ $rc == 1 ]] || fail "the copy check did not fail on the control (exit $rc): it cannot tell"
copies=$(copied_of "$WORK/bench-control.json") || fail "cannot read the control's report"
((copies > 0)) || fail "the control failed the check, but not by copied bytes ($copies)"

bench real 262144
real=$(zero_copy_check "$WORK/bench-real.json"); rc=$?
echo "real (rows by put): $real"
[[ $rc == 0 ]] || fail "zero copy does not hold (check exit $rc)"
echo "PASS ucx zero copy ($TLS): forward wrote every row once by put with output equal to mpi's; the copy check failed on the control ($copies payload bytes copied) and saw 0 copied on the real case"
