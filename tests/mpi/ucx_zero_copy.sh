#!/usr/bin/env bash
# Zero copy over ucx, measured: `moerun forward --transport ucx` at 4 ranks on a qwen3-30b-a3b
# layer (16 experts, top-8, hidden 2048) for T tokens; every rank logs its transport's counters.
# Asserts that the router wrote exactly T x 8 rows x 8 KiB by put (each row once), that the
# expert ranks together wrote the same back, that the transport copied 0 bytes and registered
# nothing on demand, and that the output equals `--transport mpi`'s bitwise.
#
#   ucx_zero_copy.sh MOERUN_BIN UCX_TLS
set -uo pipefail
MOERUN=$(realpath "${1:?usage: ucx_zero_copy.sh MOERUN_BIN UCX_TLS}")
TLS=${2:?usage: ucx_zero_copy.sh MOERUN_BIN UCX_TLS}
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
echo "PASS ucx zero copy ($TLS): router $router MiB by put = $TOKENS tokens x 8 rows x 8 KiB, experts $experts MiB back, 0 bytes copied by the transport on all 4 ranks, output equal to mpi's"
