#!/usr/bin/env bash
# The README's second command (and CI's): installs what the tests need, then runs the whole
# suite. Well under 30 minutes on 2 cores:
#   1. Release build; every test (unit, golden fixtures, batch invariance, CLI, fuzz corpus replay);
#      with nvcc, the GPU check's dry run (tests/gpu/run.sh --dry-run)
#   2. address + undefined-behaviour sanitizer build (beside step 1's tests, at nice 19); the
#      unit tests
#   3. libFuzzer (clang) on the safetensors header parser and the serving frame decoder, for
#      MOERUN_FUZZ_SECONDS each (default 30; scripts/full.sh runs 10 minutes)
#   4. clang-format check of every C++ file, and the house rules (scripts/check_layers.py: which
#      folder may include which, CMake links, the folder graph; docs/DESIGN.md)
# scripts/full.sh runs the longer matrix (long fuzzing, thread sanitizer, benchmarks).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
fuzz_seconds=${MOERUN_FUZZ_SECONDS:-30}
started=$SECONDS
step() { printf '\n==== %s (at %d s) ====\n' "$*" $((SECONDS - started)); }

step "dependencies"
scripts/install-deps.sh --test

step "house rules: includes between folders, CMake links, folder graph (docs/DESIGN.md)"
python3 scripts/check_layers.py

step "release build + all tests"
# Where nvcc is installed the CUDA backend must build (ON, not AUTO): it is never skipped silently.
cuda_flag=()
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  # One architecture (sm_90, the H200's) keeps the compile check within CI's time; the kernels'
  # sm_80 paths are the same code (the default build makes both).
  cuda_flag=(-DMOERUN_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
  echo "nvcc found: building the CUDA backend (MOERUN_WITH_CUDA=ON, sm_90)"
fi
cmake --preset release "${cuda_flag[@]}" >/dev/null
cmake --build build -j "$jobs"

# The unit-test binaries that need neither Asio nor Beast (their tests run under ASan in
# scripts/full.sh), run directly so that unbuilt targets are not counted.
asan_bins=(moerun_unit_tests moerun_router_tests moerun_transport_tests moerun_alloc_tests
  moerun_client_tests)
# The sanitizer and fuzzer builds run at the lowest CPU priority beside the release tests, many of
# which wait on sockets, timers and child processes: they take the cores those leave idle, and a
# test's process that wakes preempts them (nice 19 has 1/70 of a normal task's share).
step "all tests of the release build (ctest); sanitizer and fuzzer builds beside them at nice 19"
bg_log=$(mktemp /tmp/moerun-bg-build.XXXXXX)
# (its own process group, so that a failed run stops the whole build)
setsid nice -n 19 bash -c 'set -e; jobs=$1; shift
  cmake --preset asan >/dev/null
  cmake --build build-asan -j "$jobs" --target "$@" moerun_fuzz_replay moerun_fuzz_replay_frame
  cmake --preset fuzz >/dev/null
  cmake --build build-fuzz -j "$jobs" --target safetensors_header_fuzzer frame_fuzzer' \
  bg-build "$jobs" "${asan_bins[@]}" >"$bg_log" 2>&1 &
bg_pid=$!
trap 'kill -- -"$bg_pid" 2>/dev/null || true' EXIT
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 600

# The GPU check's steps that need no GPU, on the release build (already built: nothing is
# rebuilt): its step table within the 8-minute budget, the build of its targets, the CUDA
# resource check, the GPU tests' commands.
if ((${#cuda_flag[@]})); then
  step "GPU check, dry run (tests/gpu/run.sh --dry-run)"
  BUILD=build OUT=build/gpu-check-dry tests/gpu/run.sh --dry-run
fi

step "sanitizer build (address, undefined) + unit tests"
if ! wait "$bg_pid"; then
  tail -50 "$bg_log"
  echo "the sanitizer or fuzzer build failed (above)" >&2
  exit 1
fi
trap - EXIT
rm -f "$bg_log"
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
for b in "${asan_bins[@]}"; do
  echo "-- $b"
  build-asan/bin/"$b" --gtest_brief=1
done
build-asan/bin/moerun_fuzz_replay tests/fuzz/corpus/safetensors_header
build-asan/bin/moerun_fuzz_replay_frame tests/fuzz/corpus/frame
unset ASAN_OPTIONS UBSAN_OPTIONS

step "libFuzzer: safetensors header parser and serving frames, ${fuzz_seconds}s each"
scripts/fuzz.sh "$fuzz_seconds"

step "format check"
scripts/format.sh --check

echo
echo "all tests passed in $((SECONDS - started)) s"
