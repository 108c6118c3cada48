#!/usr/bin/env bash
# One-shot check on a machine lent with an accelerator (and, usually, a bigger CPU): the GPU check
# (tests/gpu/run.sh: configure, build of what it runs, the CUDA-vs-CPU tests, NCCL, moerun
# forward on the GPU in bf16, FP8 and MXFP4 against the CPU, moebench --anchors; 8 minutes at
# most), then builds the rest with all cores and runs the block-scaled (FP8, MXFP4) unit checks
# and moebench bf16/fp8/mxfp4 on the GPU, the unit and CLI tests (on that CPU's best kernel
# variant, e.g. AVX-512), and benchmarks the qwen3-30b-a3b layer on 2 cores (as CI's machines) and
# on all cores. Logs and JSON go to $OUT (default build/device-check); short tables on stdout.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-build/device-check}
mkdir -p "$out"
jobs=$(nproc)
log() { printf '[device-check %(%H:%M:%S)T] %s\n' -1 "$*"; }

{ lscpu; echo; nvidia-smi 2>&1 | head -15; } > "$out/machine.txt" 2>&1
log "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $jobs cores"

# It configures build/ when it is not (Ninja, Release, CUDA on, sm_90, warnings not errors) and
# builds only what it runs.
log "GPU check (tests/gpu/run.sh): configure, build, CUDA vs CPU, NCCL, forward, moebench"
OUT="$out/gpu" BUILD=build JOBS="$jobs" bash tests/gpu/run.sh 2>"$out/gpu-check.log" | tail -45

log "build the rest"
cmake --build build -j "$jobs" >"$out/build.log" 2>&1 || { grep -E "error" "$out/build.log" | head -30; exit 1; }
grep -c "warning:" "$out/build.log" | xargs -I{} echo "build warnings: {}" | tee "$out/warnings.txt"
grep "warning:" "$out/build.log" | sort -u | head -20 >> "$out/warnings.txt"

build/bin/moerun --version | tee "$out/version.txt"

# Block-scaled experts (FP8 e4m3, MXFP4): the host-side layout and math unit tests, and
# moebench's CUDA layer for bf16, fp8 and mxfp4 on the same experts (the GPU tests and moerun
# forward on the FP8/MXFP4 fixtures and presets are run.sh's). One line per step in
# $out/quant/steps.tsv, a table.
log "quantized experts (FP8, MXFP4): unit tests, moebench on the GPU"
q="$out/quant"
mkdir -p "$q"
: >"$q/steps.tsv"
qrecord() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$q/steps.tsv"; }
slug() { echo "$1" | tr -c 'A-Za-z0-9._\n-' '-'; }  # file names: no spaces
gtest_note() {  # the summary of a gtest log: passed, failed, skipped
  local p f s
  p=$(grep -o '^\[  PASSED  \] [0-9]*' "$1" | grep -o '[0-9]*$')
  f=$(grep -o '^\[  FAILED  \] [0-9]*' "$1" | grep -o '[0-9]*$')
  s=$(grep -o '^\[  SKIPPED \] [0-9]*' "$1" | grep -o '[0-9]*$')
  echo "${p:-0} passed, ${f:-0} failed, ${s:-0} skipped"
}
qtest() {  # name, binary, filter
  local name=$1 bin=$2 filter=$3 rc f
  f=$q/$(slug "$name")
  timeout 300 "build/bin/$bin" --gtest_filter="$filter" --gtest_output="xml:$f.xml" >"$f.log" 2>&1
  rc=$?
  qrecord "$name" "$([[ $rc == 0 ]] && echo ok || echo FAIL)" "$(gtest_note "$f.log") (exit $rc)"
}
qtest "unit: layout, sizes, math" moerun_unit_tests 'CudaQuant*:CudaPlan*'
grep -E '^[a-z0-9-]+ +expert' "$q/$(slug "unit: layout, sizes, math").log" >"$q/device-bytes.txt"
timeout 240 build/bin/moebench layer --device cuda --preset qwen3-30b-a3b --experts 32 \
  --dtype bf16,fp8,mxfp4 --tokens 1,16,128,1024 --min-time 0.3 --no-torch --json \
  >"$q/moebench.json" 2>"$q/moebench.log"
rc=$?
qrecord "moebench cuda bf16,fp8,mxfp4" "$([[ $rc == 0 ]] && echo ok || echo FAIL)" \
  "exit $rc (JSON: $q/moebench.json)"
python3 - "$q/steps.tsv" "$q/moebench.json" <<'PY'
import json, sys
print(f"\n{'quantized step':36} {'result':7} note")
for line in open(sys.argv[1]):
    name, status, note = (line.rstrip("\n").split("\t") + ["", ""])[:3]
    print(f"{name:36} {status:7} {note}")
try:
    doc = json.load(open(sys.argv[2]))
except (OSError, ValueError):
    sys.exit(0)
print(f"\n{'weights':8} {'device MB':>10} {'B/weight':>9} " + " ".join(
    f"{'T=' + str(r['tokens']) + ' ms':>12}" for r in doc["shapes"][0]["results"]))
for s in doc.get("shapes", [doc]):
    print(f"{s.get('weight_dtype', '?'):8} {s.get('device_weight_bytes', 0) / 1e6:10.1f} "
          f"{s.get('device_bytes_per_weight', 0):9.4f} " +
          " ".join(f"{r['ms']:12.3f}" for r in s["results"]))
PY
cat "$q/device-bytes.txt" 2>/dev/null

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
