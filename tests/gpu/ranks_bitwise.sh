#!/usr/bin/env bash
# Deterministic mode across processes on one GPU: `moerun forward --device cuda` writes the same
# bytes with 1 process (the whole layer on the GPU) and under mpirun (the router's gate and
# combine on its CPU, every expert rank's experts on the shared GPU, rows moved host-staged over
# mpi: NCCL refuses ranks that share a GPU): tensor cores at 2, 3 and 4 processes, exact math at 4
# (1 router + 3 expert ranks: 32 experts split unevenly). Exact math must also equal --device cpu
# bit for bit. qwen3-30b-a3b, 32 experts, bf16, 256 tokens.
#
#   ranks_bitwise.sh MOERUN_BIN DIR
#
# DIR may already hold what tests/gpu/run.sh's one-process steps wrote: in.safetensors (the
# input), cpu.safetensors, np1-exact.safetensors, np1-tensor-core.safetensors; those are used as
# they are, the missing ones are made. RANKS_CASES="tensor-core:2,3,4 exact:4" chooses the cases.
# MOERUN_GPU_CHECK_DEVICE=cpu runs the same cases on the CPU (a dry run of this script).
# Prints one line per check ("PASS ..."/"FAIL ...") and exits non-zero on any failure.
set -uo pipefail
[[ $# -eq 2 ]] || { echo "usage: ranks_bitwise.sh MOERUN_BIN DIR" >&2; exit 2; }
MOERUN=$(realpath "$1")
DIR=$2
mkdir -p "$DIR"
HERE=$(cd "$(dirname "$0")" && pwd)
ST="$HERE/../mpi/st_tool.py"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPI=(mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np)
FAILED=0
DEVICE=${MOERUN_GPU_CHECK_DEVICE:-cuda}
CASES=${RANKS_CASES:-tensor-core:2,3,4 exact:4}
MODEL=(--preset qwen3-30b-a3b --experts 32 --dtype bf16 --input "$DIR/in.safetensors")

fail() { echo "FAIL $*"; FAILED=$((FAILED + 1)); }
check() {  # label, file A, file B
  if python3 "$ST" same-tensor "$2" "$3" output >>"$DIR/same-tensor.log" 2>&1; then
    echo "PASS $1"
  else
    fail "$1 (see $DIR/same-tensor.log)"
  fi
}
forward() {  # out file, log, timeout, launcher and args...
  local out=$1 log=$2 limit=$3
  shift 3
  if [[ -s "$out" ]]; then return 0; fi
  timeout "$limit" "$@" --output "$out" >"$log" 2>&1 && return 0
  fail "$(basename "$out" .safetensors) (see $log)"
  tail -3 "$log"
  rm -f "$out"
  return 1
}

[[ -s "$DIR/in.safetensors" ]] || python3 "$ST" input "$DIR/in.safetensors" 256 2048 5
for c in $CASES; do
  math=${c%%:*}
  nps=${c#*:}
  math_args=(--device "$DEVICE")
  [[ $DEVICE == cuda ]] && math_args+=(--math "$math")
  forward "$DIR/np1-$math.safetensors" "$DIR/np1-$math.log" 120 \
    "$MOERUN" forward "${MODEL[@]}" "${math_args[@]}" || continue
  for np in ${nps//,/ }; do
    forward "$DIR/np$np-$math.safetensors" "$DIR/np$np-$math.log" 120 \
      "${MPI[@]}" "$np" "$MOERUN" forward "${MODEL[@]}" "${math_args[@]}" &&
      check "$math np$np == np1" "$DIR/np1-$math.safetensors" "$DIR/np$np-$math.safetensors"
  done
  if [[ $math == exact ]]; then
    forward "$DIR/cpu.safetensors" "$DIR/cpu.log" 300 "$MOERUN" forward "${MODEL[@]}" \
      --device cpu &&
      check "exact np1 == cpu" "$DIR/np1-$math.safetensors" "$DIR/cpu.safetensors"
  fi
done

echo "ranks_bitwise: $FAILED failure(s)"
[[ $FAILED -eq 0 ]]
