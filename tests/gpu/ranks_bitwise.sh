#!/usr/bin/env bash
# Deterministic mode across processes on one GPU: `moerun forward --device cuda` writes the same
# bytes with 1 process (the whole layer on the GPU) and under mpirun -np 2, 3, 4 (the router's
# gate and combine on its CPU, every expert rank's experts on the shared GPU, rows moved
# host-staged over mpi: NCCL refuses ranks that share a GPU). Exact math must also equal
# --device cpu bit for bit.
#
#   ranks_bitwise.sh MOERUN_BIN OUT_DIR
#
# MOERUN_GPU_CHECK_DEVICE=cpu runs the same cases on the CPU (a dry run of this script).
# Prints one line per case ("PASS ..."/"FAIL ...") and exits non-zero on any failure.
set -uo pipefail
[[ $# -eq 2 ]] || { echo "usage: ranks_bitwise.sh MOERUN_BIN OUT_DIR" >&2; exit 2; }
MOERUN=$(realpath "$1")
OUT=$2
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
ST="$HERE/../mpi/st_tool.py"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPI=(mpirun --oversubscribe --bind-to none -np)
FAILED=0
DEVICE=${MOERUN_GPU_CHECK_DEVICE:-cuda}

same() { python3 "$ST" same-tensor "$1" "$2" output; }
check() {  # label, file A, file B
  if same "$2" "$3"; then echo "PASS $1"; else echo "FAIL $1"; FAILED=$((FAILED + 1)); fi
}

# case NAME PRESET_ARGS... -- MATH HIDDEN
run() {
  local name=$1 math=$2 hidden=$3
  shift 3
  local dir="$OUT/$name-$math"
  mkdir -p "$dir"
  python3 "$ST" input "$dir/in.safetensors" 256 "$hidden" 5
  local common=(forward "$@" --input "$dir/in.safetensors" --device "$DEVICE" --math "$math")
  if ! timeout 120 "$MOERUN" "${common[@]}" --output "$dir/np1.safetensors" >"$dir/np1.log" 2>&1; then
    echo "FAIL $name $math np1 (see $dir/np1.log)"; tail -3 "$dir/np1.log"; FAILED=$((FAILED + 1)); return
  fi
  for np in 2 3 4; do
    if timeout 180 "${MPI[@]}" "$np" "$MOERUN" "${common[@]}" --output "$dir/np$np.safetensors" \
        >"$dir/np$np.log" 2>&1; then
      check "$name $math np$np == np1" "$dir/np1.safetensors" "$dir/np$np.safetensors"
    else
      echo "FAIL $name $math np$np (see $dir/np$np.log)"; tail -3 "$dir/np$np.log"
      FAILED=$((FAILED + 1))
    fi
  done
  if [[ $math == exact ]]; then
    timeout 300 "$MOERUN" forward "$@" --input "$dir/in.safetensors" --device cpu \
      --output "$dir/cpu.safetensors" >"$dir/cpu.log" 2>&1
    check "$name exact == cpu" "$dir/np1.safetensors" "$dir/cpu.safetensors"
  fi
}

run qwen3 tensor-core 2048 --preset qwen3-30b-a3b --experts 32 --dtype bf16
run qwen3 exact 2048 --preset qwen3-30b-a3b --experts 32 --dtype bf16

echo "ranks_bitwise: $FAILED failure(s)"
[[ $FAILED -eq 0 ]]
