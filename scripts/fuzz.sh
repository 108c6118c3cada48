#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (build-fuzz/) and runs each for the given seconds
# (default 60) on a copy of its seed corpus. A crash leaves its input in build-fuzz/crashes/.
#   scripts/fuzz.sh [seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
jobs=$(nproc 2>/dev/null || echo 2)
cmake --preset fuzz >/dev/null
cmake --build build-fuzz -j "$jobs" --target safetensors_header_fuzzer
work=build-fuzz/corpus/safetensors_header
mkdir -p "$work" build-fuzz/crashes
cp -n tests/fuzz/corpus/safetensors_header/* "$work"/ 2>/dev/null || true
build-fuzz/bin/safetensors_header_fuzzer -max_total_time="$seconds" -max_len=65536 \
  -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix=build-fuzz/crashes/ "$work"
