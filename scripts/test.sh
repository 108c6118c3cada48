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
#
# It ends with one summary (scripts/test_summary.py): per step, tests run / passed / failed /
# skipped, and every skip with its reason. On the machine the README documents every backend the
# install script installs is required (MPI, UCX, the Python module: configured ON, so a missing
# one fails the configure by name), and a skip fails the command unless tests/allowed_skips.txt
# lists it with its reason (tests that need a GPU). MOERUN_ALLOW_SKIPS=1 lets other machines
# report their skips without failing.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
fuzz_seconds=${MOERUN_FUZZ_SECONDS:-30}
started=$SECONDS
step() { printf '\n==== %s (at %d s) ====\n' "$*" $((SECONDS - started)); }
# The summary's ledger: each step adds its counts; the report ends the command, also on a failure.
ledger=$(mktemp /tmp/moerun-tests.XXXXXX)
record() { python3 scripts/test_summary.py "$ledger" "$@"; }
# Runs one command as a step of the summary: its exit code counted, the command's own failure kept.
counted() {
  local name=$1 rc=0
  shift
  "$@" || rc=$?
  record command "$name" "$rc"
  return "$rc"
}
summary() {
  local rc=$?
  python3 scripts/test_summary.py "$ledger" report --allow tests/allowed_skips.txt || rc=1
  rm -f "$ledger"
  echo "(in $((SECONDS - started)) s)"
  exit "$rc"
}
trap summary EXIT

step "dependencies"
scripts/install-deps.sh --test

step "house rules: includes between folders, CMake links, folder graph (docs/DESIGN.md)"
counted "house rules (scripts/check_layers.py)" python3 scripts/check_layers.py

step "release build + all tests"
# Where nvcc is installed the CUDA backend must build (ON, not AUTO): it is never skipped silently.
cuda_flag=()
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  # One architecture (sm_90, the H200's) keeps the compile check within CI's time; the kernels'
  # sm_80 paths are the same code (the default build makes both).
  cuda_flag=(-DMOERUN_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
  echo "nvcc found: building the CUDA backend (MOERUN_WITH_CUDA=ON, sm_90)"
fi
# What scripts/install-deps.sh installs is required: MPI, UCX, the Python module and the packages
# its tests import (python/CMakeLists.txt). A machine without one fails here, naming it.
required=(-DMOERUN_WITH_MPI=ON -DMOERUN_WITH_UCX=ON -DMOERUN_BUILD_PYTHON=ON)
counted "configure (MPI, UCX, Python required${cuda_flag:+; CUDA})" \
  cmake --preset release "${required[@]}" "${cuda_flag[@]}" >/dev/null
counted "release build" cmake --build build -j "$jobs"

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
trap 'kill -- -"$bg_pid" 2>/dev/null || true; summary' EXIT
# (--test-output-size-passed: the whole output of a passing test, in which the summary looks for
# the skips inside it: a gtest binary run as one test, a script's "SKIP: ..." lines)
ctest_rc=0
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 600 \
  --output-junit "$PWD/build/ctest-junit.xml" --test-output-size-passed 1048576 || ctest_rc=$?
record ctest "ctest: every test of the release build" build/ctest-junit.xml
((ctest_rc == 0)) || exit "$ctest_rc"

# The GPU check's steps that need no GPU, on the release build (already built: nothing is
# rebuilt): its step table within the 8-minute budget, the build of its targets, the CUDA
# resource check, the GPU tests' commands.
if ((${#cuda_flag[@]})); then
  step "GPU check, dry run (tests/gpu/run.sh --dry-run)"
  counted "GPU check, dry run" env BUILD=build OUT=build/gpu-check-dry tests/gpu/run.sh --dry-run
fi

step "sanitizer build (address, undefined) + unit tests"
if ! wait "$bg_pid"; then
  tail -50 "$bg_log"
  echo "the sanitizer or fuzzer build failed (above)" >&2
  record command "sanitizer and fuzzer builds" 1
  exit 1
fi
trap summary EXIT
rm -f "$bg_log"
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
asan_json=()
for b in "${asan_bins[@]}"; do
  echo "-- $b"
  # (the whole output in a log, for the reasons of skips; failures are printed from it)
  rc=0
  build-asan/bin/"$b" --gtest_output=json:build-asan/"$b".json >build-asan/"$b".log 2>&1 || rc=$?
  grep -E '^\[  (PASSED|FAILED|SKIPPED) \]|Failure$|ERROR: AddressSanitizer|runtime error' \
    build-asan/"$b".log | head -40 || true
  if ((rc != 0)); then
    tail -60 build-asan/"$b".log
    if [[ -f build-asan/"$b".json ]]; then
      record gtest "sanitizer (address, undefined): $b" build-asan/"$b".json --log build-asan/"$b".log
    else  # (it ended before gtest wrote its report: a crash)
      record command "sanitizer: $b" "$rc"
    fi
    exit "$rc"
  fi
  asan_json+=(build-asan/"$b".json --log build-asan/"$b".log)
done
record gtest "sanitizer (address, undefined): unit tests" "${asan_json[@]}"
counted "sanitizer: safetensors header corpus replay" \
  build-asan/bin/moerun_fuzz_replay tests/fuzz/corpus/safetensors_header
counted "sanitizer: frame corpus replay" \
  build-asan/bin/moerun_fuzz_replay_frame tests/fuzz/corpus/frame
unset ASAN_OPTIONS UBSAN_OPTIONS

step "libFuzzer: safetensors header parser and serving frames, ${fuzz_seconds}s each"
counted "libFuzzer, ${fuzz_seconds} s per target" scripts/fuzz.sh "$fuzz_seconds"

step "format check"
counted "format check (clang-format)" scripts/format.sh --check
