#!/bin/sh
# No silent empty kernels: compiled for an architecture below its minimum (compute_75: no bf16/f16
# wmma fragments), every MmaGemm kernel's body must trap, never return with nothing written.
#   mma_traps.sh NVCC SOURCE_DIR GENERATED_INCLUDE_DIR
set -eu
nvcc=$1 src=$2 gen=$3
tmp=$(mktemp -d "${TMPDIR:-/tmp}/moerun-mma-traps.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
trap 'exit 1' INT TERM HUP
"$nvcc" -I"$src" -I"$gen" -O3 -DNDEBUG -std=c++20 --fmad=false -arch=compute_75 -ptx \
  "$src/experts/cuda/ffn_kernels.cu" -o "$tmp/ffn.ptx"
# One line per entry: its name, then whether its body holds a trap.
awk '/\.entry / { name = $0; sub(/.*\.entry /, "", name); sub(/\(.*/, "", name); body = 0; trap = 0 }
     name != "" && /^\{/ { body = 1 }
     body && /trap;/ { trap = 1 }
     body && /^\}/ { print name, trap; name = ""; body = 0 }' "$tmp/ffn.ptx" >"$tmp/entries"
mma=$(grep -c 'MmaGemm' "$tmp/entries" || true)
bad=$(grep 'MmaGemm' "$tmp/entries" | grep -c ' 0$' || true)
echo "mma_traps: $mma MmaGemm entries in compute_75 PTX, $bad without a trap"
[ "$mma" -ge 10 ] || { echo "mma_traps: expected 10 MmaGemm entries" >&2; exit 1; }
[ "$bad" -eq 0 ] || { grep 'MmaGemm' "$tmp/entries" | grep ' 0$' >&2; exit 1; }
