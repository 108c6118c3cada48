#!/usr/bin/env bash
# Block-scaled experts (FP8 e4m3, MXFP4) in `moerun forward --device cuda` against the CPU layer:
#   - the fixtures tests/data/hf-moe/deepseek_v3_fp8 and gpt_oss_mxfp4 (the published formats
#     through the checkpoint loader): the CPU within 1e-5 of their golden output, exact math
#     bitwise the CPU's, tensor cores (bf16) within 1e-2 of the golden output;
#   - presets qwen3-30b-a3b, 32 experts, fp8 and mxfp4 (quantized by the host), 256 tokens:
#     exact math bitwise the CPU's, tensor cores within 1e-2 of it.
#
#   forward_quant.sh MOERUN_BIN DIR [INPUT.safetensors]
#
# INPUT: the presets' input ([256][2048] F32, tensor "input"; made in DIR when not given).
# MOERUN_GPU_CHECK_DEVICE=cpu runs the same cases on the CPU (a dry run of this script).
# Prints one line per check ("PASS ..."/"FAIL ...") and exits non-zero on any failure.
set -uo pipefail
[[ $# -eq 2 || $# -eq 3 ]] || { echo "usage: forward_quant.sh MOERUN_BIN DIR [INPUT]" >&2; exit 2; }
MOERUN=$(realpath "$1")
DIR=$2
INPUT=${3:-$DIR/in.safetensors}
mkdir -p "$DIR"
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
ST="$ROOT/tests/mpi/st_tool.py"
FAILED=0
DEVICE=${MOERUN_GPU_CHECK_DEVICE:-cuda}

fail() { echo "FAIL $*"; FAILED=$((FAILED + 1)); }
# run NAME TOLERANCE MOERUN_FORWARD_ARGS...: moerun forward with --check (in the args) within
# TOLERANCE; writes DIR/NAME.safetensors. Returns non-zero when it failed.
run() {
  local name=$1 tol=$2 log="$DIR/$1.log" note
  shift 2
  if ! timeout 120 "$MOERUN" forward "$@" --output "$DIR/$name.safetensors" --tolerance "$tol" \
    >"$log" 2>&1; then
    fail "$name: $(tail -1 "$log" | cut -c1-160) (see $log)"
    return 1
  fi
  note=$(grep -o 'rel err vs [^|]*' "$log" | sed 's#vs [^ ]*/#vs #' | tail -1)
  echo "PASS $name: ${note:-ran}"
}
same_as_cpu() {  # NAME: NAME's output has the bits of NAME's cpu run
  if python3 "$ST" same-tensor "$DIR/$2.safetensors" "$DIR/$1.safetensors" output \
    >>"$DIR/$1.log" 2>&1; then
    echo "PASS $1: same bits as $2"
  else
    fail "$1: bits differ from $2"
  fi
}
cuda() {  # the device arguments of a math
  if [[ $DEVICE == cuda ]]; then echo "--device cuda --math $1"; else echo "--device cpu"; fi
}

for fx in deepseek_v3_fp8 gpt_oss_mxfp4; do
  dir=$ROOT/tests/data/hf-moe/$fx
  if [[ ! -f $dir/config.json ]]; then
    fail "$fx: $dir is missing"
    continue
  fi
  io=(--model "$dir" --input "$dir/golden.safetensors" --check "$dir/golden.safetensors")
  run "$fx-cpu" 1e-5 "${io[@]}" --device cpu || continue
  # shellcheck disable=SC2046
  run "$fx-exact" 1e-5 "${io[@]}" $(cuda exact) && same_as_cpu "$fx-exact" "$fx-cpu"
  # shellcheck disable=SC2046
  run "$fx-tensor-core" 1e-2 "${io[@]}" $(cuda tensor-core)
done

[[ -s $INPUT ]] || python3 "$ST" input "$INPUT" 256 2048 5
for dt in fp8 mxfp4; do
  pre=(--preset qwen3-30b-a3b --experts 32 --dtype "$dt" --input "$INPUT")
  run "preset-$dt-cpu" 1e-5 "${pre[@]}" --device cpu || continue
  ref=(--check "$DIR/preset-$dt-cpu.safetensors")
  # shellcheck disable=SC2046
  run "preset-$dt-exact" 1e-5 "${pre[@]}" "${ref[@]}" $(cuda exact) &&
    same_as_cpu "preset-$dt-exact" "preset-$dt-cpu"
  # shellcheck disable=SC2046
  run "preset-$dt-tensor-core" 1e-2 "${pre[@]}" "${ref[@]}" $(cuda tensor-core)
done

echo "forward_quant: $FAILED failure(s)"
[[ $FAILED -eq 0 ]]
