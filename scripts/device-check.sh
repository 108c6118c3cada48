#!/usr/bin/env bash
# One-shot check on a machine lent with an accelerator (and, usually, a bigger CPU): builds with
# all cores, runs the GPU check (tests/gpu/run.sh), the unit and CLI tests (on that CPU's best kernel variant, e.g. AVX-512), probes
# the GPU, and benchmarks the qwen3-30b-a3b layer on 2 cores (as CI's machines) and on all cores.
# Logs and JSON go to $OUT (default build/device-check); a short table is printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/device-check}
mkdir -p "$out"
jobs=$(nproc)
log() { printf '[device-check %(%H:%M:%S)T] %s\n' -1 "$*"; }

{ lscpu; echo; nvidia-smi 2>&1 | head -15; } > "$out/machine.txt" 2>&1
log "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $jobs cores"

log "configure + build"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOERUN_WERROR=OFF \
  >"$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build build -j "$jobs" >"$out/build.log" 2>&1 || { grep -E "error" "$out/build.log" | head -30; exit 1; }
grep -c "warning:" "$out/build.log" | xargs -I{} echo "build warnings: {}" | tee "$out/warnings.txt"
grep "warning:" "$out/build.log" | sort -u | head -20 >> "$out/warnings.txt"

build/bin/moerun --version | tee "$out/version.txt"

log "GPU check (tests/gpu/run.sh): CUDA vs CPU, NCCL, moebench layer --device cuda, ranks"
OUT="$out/gpu" BUILD=build JOBS="$jobs" bash tests/gpu/run.sh 2>&1 | tail -40

log "tests"
ctest --test-dir build -j "$jobs" --timeout 600 >"$out/ctest.log" 2>&1
tail -5 "$out/ctest.log"
grep -E "Failed|\*\*\*" "$out/ctest.log" | head -20

bench() {  # name, extra args...
  local name=$1; shift
  timeout 240 "$@" --preset qwen3-30b-a3b --tokens 1,16,128,1024 --min-time 0.5 --json \
    >"$out/$name.json" 2>"$out/$name.log"
  grep '^layer' "$out/$name.log" | sed "s/^/$name: /"
}
log "benchmarks"
bench f32-2cores taskset -c 0,1 build/bin/moebench layer --threads 2 --dtype f32
bench bf16-2cores taskset -c 0,1 build/bin/moebench layer --threads 2 --dtype bf16
bench f32-all build/bin/moebench layer --dtype f32
log "done: $out"
