#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (build-fuzz/) and runs each on a copy of its seed
# corpus: the safetensors header parser for the given seconds (default 60), the serving
# protocol's frame decoder for the second argument's (default: the same). A crash leaves its input
# in build-fuzz/crashes/.
#   scripts/fuzz.sh [seconds] [frame_seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
frame_seconds=${2:-$seconds}
jobs=$(nproc 2>/dev/null || echo 2)
cmake --preset fuzz >/dev/null
cmake --build build-fuzz -j "$jobs" --target safetensors_header_fuzzer frame_fuzzer
mkdir -p build-fuzz/crashes
work=build-fuzz/corpus/safetensors_header
mkdir -p "$work"
cp -n tests/fuzz/corpus/safetensors_header/* "$work"/ 2>/dev/null || true
build-fuzz/bin/safetensors_header_fuzzer -max_total_time="$seconds" -max_len=65536 \
  -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix=build-fuzz/crashes/ "$work"
work=build-fuzz/corpus/frame
mkdir -p "$work"
cp -n tests/fuzz/corpus/frame/* "$work"/ 2>/dev/null || true
build-fuzz/bin/frame_fuzzer -max_total_time="$frame_seconds" -max_len=65536 \
  -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix=build-fuzz/crashes/ "$work"
