#!/usr/bin/env bash
# The GPU check, on one machine with an NVIDIA GPU (made for one H200 and 16 cores), from the
# repository root, in at most 8 minutes (BUDGET_S: every step has a cap, and the caps add up to
# at most the budget; the script refuses to start otherwise). The steps and their caps are the
# table STEPS below:
#   probe       nvidia-smi: the GPU, its memory and driver;
#   configure   BUILD as it is configured (its cache is reused: nothing passed to cmake, so nothing
#               is rebuilt for a changed option), or a fresh one: Ninja, Release,
#               MOERUN_WITH_CUDA=ON, CMAKE_CUDA_ARCHITECTURES=90, MOERUN_WERROR=OFF;
#   build       ninja, only the targets the steps run: moerun, moebench and the GPU test binaries;
#   resources   scripts/check_cuda_resources.py: no kernel with a stack frame or register spills;
#   gpu tests   every test labelled gpu, each test binary run once (tests/gpu/gpu_tests.py; gtest
#               XML in OUT): the CUDA layer against the CPU layer (tests/gpu/cuda_*_test.cc, on
#               layers with several and partial tiles: tests/cuda/gpu_layer_util.h), NCCL;
#   forward     moerun forward on the GPU, qwen3-30b-a3b (32 experts, bf16, 256 tokens): exact
#               math bitwise the CPU layer, tensor cores within 1e-2 of it; then 2 to 4 processes
#               under mpirun sharing the GPU write the one-process bytes
#               (tests/gpu/ranks_bitwise.sh); then FP8 and MXFP4 (tests/gpu/forward_quant.sh:
#               the fixtures and presets, exact math bitwise the CPU, tensor cores within 1e-2);
#   moebench    moebench layer --device cuda --anchors (the shapes of ANCHORS.md, with the floor
#               and torch._grouped_mm when PyTorch has it), last;
# and prints a table. Logs, gtest XML and the benchmark's JSON go to OUT.
#
#   bash tests/gpu/run.sh              # OUT=build/gpu-check, BUILD=build, JOBS=nproc
#   bash tests/gpu/run.sh --dry-run    # what needs no GPU: configure, build, the step list with
#                                      # its caps, the resource check, the GPU tests' commands
#   OUT=/tmp/gc BUILD=build-gpu bash tests/gpu/run.sh
# Exit code 0 when every step run passed, 1 otherwise, 2 for a bad call or a step table over the
# budget.
set -uo pipefail

DRY=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY=1 ;;
  -h | --help)
    sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
    ;;
  *)
    echo "usage: tests/gpu/run.sh [--dry-run]" >&2
    exit 2
    ;;
esac

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
ROOT=$(pwd)
BUILD=${BUILD:-build}
OUT=${OUT:-$BUILD/gpu-check}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 16)}
MIN_TIME=${MIN_TIME:-0.3}  # moebench: seconds per measurement
BUDGET_S=480               # all steps together (8 minutes)

# The steps, in order: name | cap in seconds | dry (run by --dry-run too) or gpu | what.
STEPS='
probe                 |   5 | gpu | nvidia-smi: the GPU, its memory and driver
configure             |  20 | dry | BUILD as configured, or fresh (Ninja, Release, CUDA on, sm_90)
build                 | 150 | dry | ninja: moerun, moebench and the GPU test binaries only
cuda resources        |  25 | dry | scripts/check_cuda_resources.py: no stack frame, no spills
gpu tests             |  75 | gpu | each GPU test binary once (gtest XML in OUT)
forward bf16 cpu      |  20 | gpu | moerun forward --device cpu: the reference
forward bf16 exact    |  10 | gpu | --device cuda --math exact: bitwise the CPU
forward bf16 tc       |  10 | gpu | --device cuda --math tensor-core: within 1e-2 of the CPU
forward bf16 np 2-4   |  45 | gpu | mpirun -np 2,3,4 sharing the GPU: the 1-process bytes
forward fp8/mxfp4     |  45 | gpu | fixtures and presets: exact bitwise the CPU, tc within 1e-2
moebench --anchors    |  75 | gpu | moebench layer --device cuda --anchors
'
STEP_NAMES=()
declare -A STEP_CAP STEP_MODE STEP_WHAT
while IFS='|' read -r name cap mode what; do
  name=$(echo "$name" | xargs)
  [[ -z "$name" ]] && continue
  STEP_NAMES+=("$name")
  STEP_CAP[$name]=$(echo "$cap" | xargs)
  STEP_MODE[$name]=$(echo "$mode" | xargs)
  STEP_WHAT[$name]=$(echo "$what" | xargs)
done <<<"$STEPS"
CAP_SUM=0
for name in "${STEP_NAMES[@]}"; do CAP_SUM=$((CAP_SUM + STEP_CAP[$name])); done

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# Nothing of an earlier run may stand in for this one's results.
rm -rf "$OUT/gtest" "$OUT/forward" "$OUT/layer.json" "$OUT/layer.log"
START=$SECONDS
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

{
  echo "gpu-check$( ((DRY)) && echo ' --dry-run'): $BUILD, logs in $OUT"
  printf '  %-22s %5s  %-4s %s\n' step "cap s" mode what
  for name in "${STEP_NAMES[@]}"; do
    printf '  %-22s %5d  %-4s %s\n' "$name" "${STEP_CAP[$name]}" "${STEP_MODE[$name]}" \
      "${STEP_WHAT[$name]}"
  done
  echo "  caps: $CAP_SUM s in all (budget $BUDGET_S s)"
} | tee "$OUT/steps-planned.txt" >&2
if ((CAP_SUM > BUDGET_S)); then
  echo "gpu-check: the steps' caps add up to $CAP_SUM s, over the $BUDGET_S s budget" >&2
  exit 2
fi

RESULTS="$OUT/steps.tsv"  # step \t ok|FAIL|skipped|not run \t seconds \t cap \t note
: >"$RESULTS"
FAILED=0

# record NAME STATUS SECONDS NOTE
record() {
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${STEP_CAP[$1]}" "$4" >>"$RESULTS"
  [[ "$2" == FAIL ]] && FAILED=1
  printf '[gpu-check %3ds] %-22s %s %s\n' "$((SECONDS - START))" "$1" "$2" "$4" >&2
}

# run_step NAME LOG CMD...: CMD under timeout (the step's cap, or what is left of the budget),
# stdout and stderr to LOG. Sets STEP_RC, STEP_S and STEP_NOTE. The caps are the GPU machine's
# (16 cores): a dry run, on any machine, gives its steps an hour.
run_step() {
  local name=$1 log=$2 t0=$SECONDS limit left
  shift 2
  [[ -n "${STEP_CAP[$name]:-}" ]] || { echo "gpu-check: no step '$name' in STEPS" >&2; exit 2; }
  limit=${STEP_CAP[$name]}
  left=$((BUDGET_S - (SECONDS - START)))
  ((left < limit)) && limit=$left
  ((limit < 4)) && limit=4
  ((DRY)) && limit=3600
  # The kill after TERM comes within the cap.
  timeout -k 2 "$((limit - 2))" "$@" >"$log" 2>&1
  STEP_RC=$?
  STEP_S=$((SECONDS - t0))
  if ((STEP_RC == 124 || STEP_RC == 137)); then
    STEP_NOTE="timed out after ${limit} s (log: $log)"
  else
    STEP_NOTE="exit $STEP_RC (log: $log)"
  fi
}

# not_run NAME: a GPU step in a dry run.
not_run() { record "$1" "not run" 0 "${2:-dry run: needs the GPU}"; }

# --- probe ---------------------------------------------------------------------------------------
if ((DRY)); then
  not_run probe
  echo "dry run (no GPU used)" >"$OUT/gpu.txt"
else
  run_step probe "$OUT/nvidia-smi.txt" nvidia-smi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    >"$OUT/gpu.txt" 2>/dev/null || echo "nvidia-smi failed" >"$OUT/gpu.txt"
  if ((STEP_RC == 0)); then
    record probe ok "$STEP_S" "$(head -1 "$OUT/gpu.txt")"
  else
    record probe FAIL "$STEP_S" "$STEP_NOTE"
  fi
fi

# --- configure -----------------------------------------------------------------------------------
# A configured BUILD is used as it is (ninja re-runs cmake itself when a CMakeLists.txt changed);
# it must be a Ninja build with the CUDA backend for sm_90. A fresh one gets the flags below.
BIN="$BUILD/bin"
[[ "$BUILD" != /* ]] && BIN="$ROOT/$BUILD/bin"
configure_check() {  # prints why BUILD does not fit, or nothing
  local cache=$BUILD/CMakeCache.txt info=$BUILD/generated/moerun/build_info.h gen arch
  gen=$(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' "$cache")
  arch=$(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$cache")
  if [[ "$gen" != Ninja ]]; then
    echo "$BUILD is configured for '$gen', not Ninja"
  elif ! grep -qs '^#define MOERUN_HAVE_CUDA 1' "$info"; then
    echo "$BUILD is configured without the CUDA backend ($info)"
  elif ! [[ ";$arch;" =~ \;(90|90-real|90-virtual|native|all|all-major)\; ]]; then
    echo "$BUILD builds CUDA for '$arch', not sm_90"
  fi
}
t0=$SECONDS
if [[ -f "$BUILD/CMakeCache.txt" && -f "$BUILD/build.ninja" ]]; then
  why=$(configure_check)
  if [[ -z "$why" ]]; then
    record configure ok "$((SECONDS - t0))" "reused $BUILD: $(sed -n \
      's/^CMAKE_BUILD_TYPE:STRING=//p' "$BUILD/CMakeCache.txt"), CUDA $(sed -n \
      's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$BUILD/CMakeCache.txt")"
    CONFIGURED=1
  else
    record configure FAIL "$((SECONDS - t0))" "$why: use another BUILD= (a fresh one is configured)"
    CONFIGURED=0
  fi
else
  CMAKE_ARGS=(-S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOERUN_BUILD_TESTS=ON
    -DMOERUN_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DMOERUN_WERROR=OFF)
  if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    CMAKE_ARGS+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
  fi
  run_step configure "$OUT/configure.log" cmake "${CMAKE_ARGS[@]}"
  if ((STEP_RC == 0)) && [[ -z "$(configure_check)" ]]; then
    record configure ok "$STEP_S" "fresh: $(grep -o 'moerun backends:.*' "$OUT/configure.log" |
      tail -1)"
    CONFIGURED=1
  else
    record configure FAIL "$STEP_S" "$STEP_NOTE $(configure_check)"
    tail -30 "$OUT/configure.log" >&2
    CONFIGURED=0
  fi
fi

# --- build: only what the steps run --------------------------------------------------------------
# The GPU test binaries: those of tests/gpu (the nccl one where this build has NCCL) and every
# one that a test labelled gpu registered with add_test runs (an mpirun line: known from the
# configured build); tests/gpu/gpu_tests.py checks after the build that none is missing.
TARGETS=(moerun moebench moerun_gpu_layer_tests)
OPTIONAL_TARGETS=(moerun_gpu_nccl_tests)
BUILT=0
if ((CONFIGURED)); then
  for t in "${OPTIONAL_TARGETS[@]}" $(python3 tests/gpu/gpu_tests.py --build "$BUILD" --needed); do
    [[ " ${TARGETS[*]} " == *" $t "* ]] && continue
    ninja -C "$BUILD" -t query "$t" >/dev/null 2>&1 && TARGETS+=("$t")
  done
  run_step build "$OUT/build.log" ninja -C "$BUILD" -j"$JOBS" "${TARGETS[@]}"
  if ((STEP_RC == 0)); then
    record build ok "$STEP_S" "ninja -j$JOBS ${TARGETS[*]}: $(grep -c '^\[' "$OUT/build.log") edges"
    BUILT=1
  else
    record build FAIL "$STEP_S" "$STEP_NOTE"
    echo "---- build errors ----" >&2
    grep -E -A12 '^FAILED:|error:' "$OUT/build.log" | head -60 >&2
  fi
else
  record build skipped 0 "not configured"
fi

# --- CUDA kernel resources -----------------------------------------------------------------------
if ((BUILT)); then
  if [[ -f scripts/check_cuda_resources.py ]]; then
    run_step "cuda resources" "$OUT/cuda-resources.log" \
      python3 scripts/check_cuda_resources.py --build "$BUILD" --table
    if ((STEP_RC == 0)); then
      record "cuda resources" ok "$STEP_S" "no stack frame, no spills (table: $OUT/cuda-resources.log)"
    else
      record "cuda resources" FAIL "$STEP_S" "$STEP_NOTE"
      tail -15 "$OUT/cuda-resources.log" >&2
    fi
  else
    record "cuda resources" FAIL 0 "scripts/check_cuda_resources.py is missing"
  fi
else
  record "cuda resources" skipped 0 "the build failed"
fi

# --- the GPU test binaries, each once ------------------------------------------------------------
GT=(python3 tests/gpu/gpu_tests.py --build "$BUILD" --out "$OUT/gtest" --targets "${TARGETS[*]}")
if ((!BUILT)); then
  record "gpu tests" skipped 0 "the build failed"
elif ((DRY)); then
  # The commands it would run (and a failure when one needs a binary not built above).
  if "${GT[@]}" --list >"$OUT/gpu-tests-plan.txt" 2>&1; then
    not_run "gpu tests" "dry run: $(tail -1 "$OUT/gpu-tests-plan.txt")"
    sed 's/^/    /' "$OUT/gpu-tests-plan.txt" >&2
  else
    record "gpu tests" FAIL 0 "$(tail -1 "$OUT/gpu-tests-plan.txt")"
  fi
else
  run_step "gpu tests" "$OUT/gpu-tests.log" "${GT[@]}" --timeout "${STEP_CAP[gpu tests]}"
  note=$(tail -1 "$OUT/gpu-tests.log")
  if ((STEP_RC == 0)); then
    record "gpu tests" ok "$STEP_S" "$note"
  else
    record "gpu tests" FAIL "$STEP_S" "$note; $STEP_NOTE"
  fi
fi

# --- moerun forward on the GPU: bf16 in 1 process, then 2-4 processes, then FP8 and MXFP4 --------
F="$OUT/forward"  # (emptied above: ranks_bitwise.sh uses the outputs it finds there)
mkdir -p "$F"
FWD=(--preset qwen3-30b-a3b --experts 32 --dtype bf16 --input "$F/in.safetensors")
same_bits() {  # same_bits A B LOG: tensor "output" of A and B has the same bytes
  python3 tests/mpi/st_tool.py same-tensor "$1" "$2" output >>"$3" 2>&1
}
rel_err() {  # the "rel err vs FILE X (within T)" part of moerun forward's line, FILE left out
  grep -o 'rel err vs [^|]*' "$1" | sed 's#vs [^ ]* #vs cpu #' | tail -1
}
if ((DRY)); then
  for s in "forward bf16 cpu" "forward bf16 exact" "forward bf16 tc" "forward bf16 np 2-4" \
    "forward fp8/mxfp4"; do
    not_run "$s"
  done
elif ((!BUILT)); then
  for s in "forward bf16 cpu" "forward bf16 exact" "forward bf16 tc" "forward bf16 np 2-4" \
    "forward fp8/mxfp4"; do
    record "$s" skipped 0 "the build failed"
  done
else
  python3 tests/mpi/st_tool.py input "$F/in.safetensors" 256 2048 5 >"$F/input.log" 2>&1
  run_step "forward bf16 cpu" "$F/cpu.log" \
    "$BIN/moerun" forward --device cpu "${FWD[@]}" --output "$F/cpu.safetensors"
  if ((STEP_RC == 0)); then
    record "forward bf16 cpu" ok "$STEP_S" "qwen3-30b-a3b, 32 experts, bf16, 256 tokens"
    # Exact math: bitwise the CPU layer.
    run_step "forward bf16 exact" "$F/np1-exact.log" \
      "$BIN/moerun" forward --device cuda --math exact "${FWD[@]}" \
      --output "$F/np1-exact.safetensors" --check "$F/cpu.safetensors" --tolerance 1e-5
    if ((STEP_RC != 0)); then
      record "forward bf16 exact" FAIL "$STEP_S" "$STEP_NOTE"
      tail -3 "$F/np1-exact.log" >&2
    elif same_bits "$F/cpu.safetensors" "$F/np1-exact.safetensors" "$F/np1-exact.log"; then
      record "forward bf16 exact" ok "$STEP_S" "same bits as the cpu layer"
    else
      record "forward bf16 exact" FAIL "$STEP_S" "$(rel_err "$F/np1-exact.log"); bits differ from cpu"
    fi
    # Tensor cores (bf16): within 1e-2 of the CPU layer.
    run_step "forward bf16 tc" "$F/np1-tensor-core.log" \
      "$BIN/moerun" forward --device cuda --math tensor-core "${FWD[@]}" \
      --output "$F/np1-tensor-core.safetensors" --check "$F/cpu.safetensors" --tolerance 1e-2
    if ((STEP_RC == 0)); then
      record "forward bf16 tc" ok "$STEP_S" "$(rel_err "$F/np1-tensor-core.log")"
    else
      record "forward bf16 tc" FAIL "$STEP_S" "$STEP_NOTE"
      tail -3 "$F/np1-tensor-core.log" >&2
    fi
  else
    record "forward bf16 cpu" FAIL "$STEP_S" "$STEP_NOTE"
    tail -3 "$F/cpu.log" >&2
    record "forward bf16 exact" skipped 0 "no cpu reference"
    record "forward bf16 tc" skipped 0 "no cpu reference"
  fi
  # 1 router + 1 to 3 expert ranks, all on GPU 0, rows host-staged over the mpi transport (NCCL
  # refuses two ranks on one GPU): the bytes of the one-process runs above (made again where a
  # step above failed).
  run_step "forward bf16 np 2-4" "$F/ranks.log" bash tests/gpu/ranks_bitwise.sh "$BIN/moerun" "$F"
  note="$(grep -c '^PASS' "$F/ranks.log") checks identical"
  if ((STEP_RC == 0)); then
    record "forward bf16 np 2-4" ok "$STEP_S" "$note"
  else
    record "forward bf16 np 2-4" FAIL "$STEP_S" \
      "$(grep '^FAIL' "$F/ranks.log" | head -2 | cut -c1-100 | tr '\n' ';') $STEP_NOTE"
  fi
  # FP8 and MXFP4: the fixtures and presets.
  run_step "forward fp8/mxfp4" "$F/quant.log" bash tests/gpu/forward_quant.sh "$BIN/moerun" \
    "$F/quant" "$F/in.safetensors"
  if ((STEP_RC == 0)); then
    record "forward fp8/mxfp4" ok "$STEP_S" "$(grep -c '^PASS' "$F/quant.log") checks passed"
  else
    record "forward fp8/mxfp4" FAIL "$STEP_S" \
      "$(grep '^FAIL' "$F/quant.log" | head -2 | cut -c1-100 | tr '\n' ';') $STEP_NOTE"
  fi
fi

# --- moebench layer --device cuda at the ANCHORS.md shapes (last) --------------------------------
if ((DRY)); then
  not_run "moebench --anchors"
elif ((!BUILT)); then
  record "moebench --anchors" skipped 0 "the build failed"
else
  run_step "moebench --anchors" "$OUT/layer.log" bash -c \
    "exec \"\$0\" layer --device cuda --anchors --min-time \"\$1\" --json >\"\$2\"" \
    "$BIN/moebench" "$MIN_TIME" "$OUT/layer.json"
  if ((STEP_RC == 0)); then
    record "moebench --anchors" ok "$STEP_S" "JSON: $OUT/layer.json"
  else
    record "moebench --anchors" FAIL "$STEP_S" "$STEP_NOTE"
    tail -5 "$OUT/layer.log" >&2
  fi
fi

# --- the table -----------------------------------------------------------------------------------
python3 - "$RESULTS" "$OUT/layer.json" "$OUT/layer.log" "$OUT/gtest/summary.json" "$OUT/gpu.txt" \
  "$((SECONDS - START))" "$CAP_SUM" "$BUDGET_S" <<'PY'
import json, os, re, sys

steps_file, layer_json, layer_log, gtest_json, gpu_txt, total, cap_sum, budget = sys.argv[1:9]
gpu = open(gpu_txt).read().strip() if os.path.exists(gpu_txt) else "?"
print()
print(f"GPU check: {gpu} | {total} s in all (caps {cap_sum} s, budget {budget} s) | "
      f"logs in {os.path.dirname(steps_file)}")
print()
print(f"{'step':22} {'result':8} {'s':>4} {'cap':>4}  note")
for line in open(steps_file):
    name, status, secs, cap, note = (line.rstrip("\n").split("\t") + [""] * 5)[:5]
    print(f"{name:22} {status:8} {secs:>4} {cap:>4}  {note}")

if os.path.exists(gtest_json):
    s = json.load(open(gtest_json))
    print()
    print(f"GPU tests: {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped "
          f"(NCCL: {s['nccl_passed']} passed, {s['nccl_failed']} failed)")

def fmt(v, spec):
    width = int(re.match(r"\d+", spec).group(0))
    return format(v, spec) if isinstance(v, (int, float)) else "-".rjust(width)

rows = []
try:
    doc = json.load(open(layer_json))
    for s in doc.get("shapes", [doc]):
        name = s.get("model", "?").replace("preset:", "")
        for r in s.get("results", []):
            rows.append((name, r.get("tokens"), r.get("ms"), r.get("torch_grouped_ms"),
                         r.get("floor_ms"), r.get("x_floor"), r.get("speedup_vs_torch_grouped")))
        if s.get("torch") is None and s.get("torch_reason"):
            print(f"torch grouped for {name}: n/a ({s['torch_reason']})")
except (OSError, ValueError):
    # No JSON (moebench was stopped): the one-line summaries on its stderr.
    pat = re.compile(r"layer cuda preset:(\S+) T=(\d+): ([\d.]+) ms.*?floor ([\d.]+) ms.*?x_floor "
                     r"([\d.]+) \| (?:torch grouped ([\d.]+) ms -> speedup ([\d.]+))?")
    if os.path.exists(layer_log):
        for m in pat.finditer(open(layer_log).read()):
            g = m.groups()
            f = lambda v: float(v) if v else None
            rows.append((g[0], int(g[1]), f(g[2]), f(g[5]), f(g[3]), f(g[4]), f(g[6])))
    if rows:
        print("(moebench gave no JSON: figures from its stderr summaries)")
if rows:
    print()
    print(f"{'shape':15} {'tokens':>6} {'ours ms':>9} {'torch grouped ms':>17} {'floor ms':>9} "
          f"{'x_floor':>8} {'speedup_vs_torch_grouped':>25}")
    for name, t, ms, tms, fl, xf, sp in rows:
        print(f"{name:15} {t:>6} {fmt(ms, '9.3f')} {fmt(tms, '17.3f')} {fmt(fl, '9.3f')} "
              f"{fmt(xf, '8.2f')} {fmt(sp, '25.2f')}")
PY

echo
if ((FAILED)); then
  echo "gpu-check$( ((DRY)) && echo ' --dry-run'): FAILED (see $OUT)"
  exit 1
fi
if ((DRY)); then
  echo "gpu-check --dry-run: configure, build and resource check passed; caps $CAP_SUM s <= $BUDGET_S s"
else
  echo "gpu-check: all steps passed"
fi
exit 0
