#!/usr/bin/env bash
# Expert parallelism is bitwise invisible: for the golden fixtures, `moerun forward` under mpirun
# (np 2, 3, 4; placement linear, round_robin and a JSON placement with replicas; microbatching off
# and --microbatch-tokens 8), and with --transport inproc --ranks 4, writes a file identical (cmp)
# to the one-process run's.
#
#   golden_ranks.sh MOERUN_BIN DATA_DIR [--full]      (or MOERUN_FULL=1)
#
# MOERUN_TEST_TRANSPORT=ucx runs the mpirun cases over the ucx transport (UCX_TLS and
# MOERUN_UCX_PUT_MIN as set in the environment) instead of mpi.
#
# Default (CI, ~45 s on 2 cores): on deepseek_v3, gpt_oss, step3p5, qwen2_moe and the quantized
# deepseek_v3_fp8 and gpt_oss_mxfp4 np 1 and every np x placement (microbatching alternating: each pair runs with and without it across the
# fixtures); every other fixture once (np 4, JSON, microbatch 8); inproc --ranks 4 per fixture.
# --full: every fixture in DATA_DIR/hf-moe, the whole matrix (np x placement x microbatch), and
# inproc --ranks 4 with every placement and microbatch setting (~2 minutes).
set -uo pipefail

usage() { echo "usage: golden_ranks.sh MOERUN_BIN DATA_DIR [--full]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
MOERUN=$(realpath "$1")
DATA=$(realpath "$2")
shift 2
FULL=${MOERUN_FULL:-0}
TRANSPORT=${MOERUN_TEST_TRANSPORT:-mpi}
for a in "$@"; do
  case "$a" in
    --full) FULL=1 ;;
    *) usage ;;
  esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The one-process reference must not think it was started by an MPI launcher.
unset OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_RANK PMIX_RANK PMI_RANK 2>/dev/null

WORK=$(mktemp -d /tmp/moerun-golden-ranks.XXXXXX)
TAG="golden-ranks-$$-$RANDOM$RANDOM"
export MOERUN_TEST_TAG=$TAG  # every process started here carries it: cleanup finds them by it

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

PASSED=0
FAILED=0
FAILURES=()

# run_case NAME KIND ARGS...: KIND mpi:NP or inproc:RANKS; ARGS go to `moerun forward`.
run_case() {
  local fixture=$1 kind=$2 placement=$3 mb=$4 label=$5
  local model="$DATA/hf-moe/$fixture"
  local out="$WORK/$fixture/out.safetensors"
  local log="$WORK/$fixture/log"
  local ref="$WORK/$fixture/ref.safetensors"
  local -a cmd=("$MOERUN" forward --model "$model" --input "$model/golden.safetensors"
                --output "$out" --placement "$placement")
  [[ "$mb" != off ]] && cmd+=(--microbatch-tokens "$mb")
  local how
  rm -f "$out"
  local t0=$EPOCHREALTIME rc
  case "$kind" in
    mpi:*)
      local np=${kind#mpi:}
      how="mpirun -np $np $TRANSPORT"
      timeout -k 5 90 mpirun --allow-run-as-root --oversubscribe --mca mpi_yield_when_idle 1 \
        -np "$np" "${cmd[@]}" --transport "$TRANSPORT" >"$log" 2>&1
      rc=$? ;;
    inproc:*)
      local ranks=${kind#inproc:}
      how="inproc --ranks $ranks"
      timeout -k 5 90 "${cmd[@]}" --transport inproc --ranks "$ranks" >"$log" 2>&1
      rc=$? ;;
  esac
  local secs
  secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }')
  local desc
  desc=$(printf '%-15s %-18s placement %-28s microbatch %-3s' "$fixture" "$how" "$label" "$mb")
  local why=""
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    why="timed out (hang?)"
  elif [[ $rc -ne 0 ]]; then
    why="exit $rc"
  elif [[ ! -f "$out" ]]; then
    why="no output file"
  elif ! cmp -s "$ref" "$out"; then
    why="output differs from the 1-process run ($(cmp "$ref" "$out" 2>&1 | head -1))"
  fi
  if [[ -z "$why" ]]; then
    echo "PASS $desc ${secs} s"
    PASSED=$((PASSED + 1))
  else
    echo "FAIL $desc ${secs} s: $why"
    sed 's/^/    | /' "$log" | tail -40
    FAILED=$((FAILED + 1))
    FAILURES+=("$desc: $why")
  fi
}

# reference FIXTURE: the one-process output (also checked against the golden file).
reference() {
  local fixture=$1 model="$DATA/hf-moe/$1"
  mkdir -p "$WORK/$fixture"
  if ! timeout -k 5 60 "$MOERUN" forward --model "$model" --input "$model/golden.safetensors" \
      --output "$WORK/$fixture/ref.safetensors" --check "$model/golden.safetensors" \
      >"$WORK/$fixture/ref.log" 2>&1; then
    echo "FAIL $fixture: the 1-process run failed"
    sed 's/^/    | /' "$WORK/$fixture/ref.log"
    FAILED=$((FAILED + 1))
    FAILURES+=("$fixture: 1-process reference run failed")
    return 1
  fi
  echo "ref  $(printf '%-15s' "$fixture") 1 process: $(grep -o 'rel err.*' "$WORK/$fixture/ref.log")"
}

# placement_for FIXTURE NP: echoes "PATH LABEL" for a JSON placement with replicas.
placement_for() {
  local fixture=$1 np=$2 file="$WORK/$1/placement-$2.json" note
  note=$(python3 "$HERE/st_tool.py" placement "$DATA/hf-moe/$fixture" "$np" "$file") || return 1
  echo "$file json($note)"
}

# case_of FIXTURE KIND PLACEMENT MB: resolves "json" to a generated file, then runs.
case_of() {
  local fixture=$1 kind=$2 placement=$3 mb=$4 ranks
  ranks=${kind#*:}
  if [[ "$placement" == json ]]; then
    local p
    if ! p=$(placement_for "$fixture" "$ranks"); then
      echo "FAIL $fixture: cannot write a placement for $ranks ranks"
      FAILED=$((FAILED + 1)); FAILURES+=("$fixture placement $ranks"); return
    fi
    run_case "$fixture" "$kind" "${p%% *}" "$mb" "${p#* }"
  else
    run_case "$fixture" "$kind" "$placement" "$mb" "$placement"
  fi
}

START=$SECONDS
if [[ "$FULL" == 1 ]]; then
  echo "golden_ranks: full matrix over $TRANSPORT"
  for dir in "$DATA"/hf-moe/*/; do
    fixture=$(basename "$dir")
    [[ -f "$dir/config.json" && -f "$dir/golden.safetensors" ]] || continue
    reference "$fixture" || continue
    case_of "$fixture" mpi:1 linear off
    for np in 2 3 4; do
      for placement in linear round_robin json; do
        for mb in off 8; do case_of "$fixture" "mpi:$np" "$placement" "$mb"; done
      done
    done
    for placement in linear round_robin json; do
      for mb in off 8; do case_of "$fixture" inproc:4 "$placement" "$mb"; done
    done
  done
else
  echo "golden_ranks: CI subset over $TRANSPORT (--full or MOERUN_FULL=1 for the whole matrix)"
  # The four main fixtures: every np x placement, microbatching alternating so that each
  # (np, placement) pair runs both with and without it across the fixtures; the other fixtures
  # once (np 4, JSON placement with replicas, microbatch 8); inproc --ranks 4 for each fixture.
  MAIN=(deepseek_v3 gpt_oss step3p5 qwen2_moe deepseek_v3_fp8 gpt_oss_mxfp4)
  PLACEMENTS=(linear round_robin json)
  SUBSET=()
  i=0
  for fixture in "${MAIN[@]}"; do
    SUBSET+=("$fixture 1 linear off")  # one rank under mpirun: the router hosts every expert
    for np in 2 3 4; do
      for j in 0 1 2; do
        mb=off; (( (i + np + j) % 2 )) && mb=8
        SUBSET+=("$fixture $np ${PLACEMENTS[$j]} $mb")
      done
    done
    i=$((i + 1))
  done
  INPROC=("deepseek_v3 json off" "gpt_oss round_robin 8" "step3p5 linear off" "qwen2_moe json 8"
          "deepseek_v3_fp8 round_robin 8" "gpt_oss_mxfp4 json off")
  for dir in "$DATA"/hf-moe/*/; do
    fixture=$(basename "$dir")
    [[ " ${MAIN[*]} " == *" $fixture "* ]] && continue
    [[ -f "$dir/config.json" && -f "$dir/golden.safetensors" ]] || continue
    SUBSET+=("$fixture 4 json 8")
    INPROC+=("$fixture round_robin off")
  done
  declare -A HAVE_REF=()
  for c in "${SUBSET[@]}"; do
    read -r fixture np placement mb <<<"$c"
    if [[ -z "${HAVE_REF[$fixture]:-}" ]]; then
      reference "$fixture" || { HAVE_REF[$fixture]=bad; continue; }
      HAVE_REF[$fixture]=ok
    fi
    [[ "${HAVE_REF[$fixture]}" == ok ]] || continue
    case_of "$fixture" "mpi:$np" "$placement" "$mb"
  done
  for c in "${INPROC[@]}"; do
    read -r fixture placement mb <<<"$c"
    [[ "${HAVE_REF[$fixture]:-}" == ok ]] || continue
    case_of "$fixture" inproc:4 "$placement" "$mb"
  done
fi

echo "golden_ranks: $PASSED passed, $FAILED failed in $((SECONDS - START)) s"
if [[ $FAILED -ne 0 ]]; then
  printf '  failed: %s\n' "${FAILURES[@]}"
  exit 1
fi
[[ $PASSED -gt 0 ]] || { echo "golden_ranks: no case ran (no fixtures in $DATA/hf-moe?)"; exit 1; }
exit 0
