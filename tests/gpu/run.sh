#!/usr/bin/env bash
# The GPU check, on one machine with an NVIDIA GPU (made for one H200, 16 cores), from the
# repository root, in well under 5 minutes:
#   1. configure and build (Release, CUDA on, sm_90) with ninja;
#   2. ctest -L gpu: the CUDA-vs-CPU tests and the one-rank NCCL self send/recv;
#   3. moebench layer --device cuda --anchors: the shapes and token counts of ANCHORS.md, with the
#      floor and torch._grouped_mm (when PyTorch has it) timed in the same run;
#   4. moerun forward on the GPU: one process (exact math: bitwise the CPU layer; tensor cores:
#      within 1e-2 of it), then 2 and 4 processes under mpirun sharing the GPU (host-staged mpi
#      transport: NCCL refuses two ranks on one GPU), within 1e-2 of the CPU layer, 4 processes
#      bitwise equal to 2; and tests/gpu/ranks_bitwise.sh: 1 to 4 processes write the same bytes
#      (tensor cores and exact math), exact math the CPU's;
# and prints a short table. Every step runs under `timeout`; logs and the JSON go to $OUT.
#
#   bash tests/gpu/run.sh                  # OUT=build/gpu-check, BUILD=build
#   OUT=/tmp/gc JOBS=8 bash tests/gpu/run.sh
# Exit code 0 when every step passed, 1 otherwise.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
ROOT=$(pwd)
OUT=${OUT:-build/gpu-check}
BUILD=${BUILD:-build}
JOBS=${JOBS:-16}
BUDGET_S=${BUDGET_S:-290}  # all steps together; each step gets at most what is left
MIN_TIME=${MIN_TIME:-0.3}  # moebench: seconds per measurement
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$SECONDS
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

RESULTS="$OUT/steps.tsv"  # step \t ok|FAIL|skipped \t seconds \t note
: >"$RESULTS"
FAILED=0

# record NAME STATUS SECONDS NOTE
record() {
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$RESULTS"
  [[ "$2" == FAIL ]] && FAILED=1
  printf '[gpu-check %3ds] %-28s %s %s\n' "$((SECONDS - START))" "$1" "$2" "$4" >&2
}

# The timeout for a step: its cap, or what is left of the budget (at least 5 s).
cap() {
  local left=$((BUDGET_S - (SECONDS - START)))
  ((left < 5)) && left=5
  ((left < $1)) && echo "$left" || echo "$1"
}

# run_step NAME CAP_S LOG CMD...: runs CMD under timeout with stdout+stderr to LOG.
run_step() {
  local name=$1 limit log=$3 t0=$SECONDS rc
  limit=$(cap "$2")
  shift 3
  timeout -k 5 "$limit" "$@" >"$log" 2>&1
  rc=$?
  STEP_RC=$rc
  STEP_S=$((SECONDS - t0))
  if ((rc == 124 || rc == 137)); then
    STEP_NOTE="timed out after ${limit} s"
  else
    STEP_NOTE="exit $rc"
  fi
}

timeout 10 nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  >"$OUT/gpu.txt" 2>/dev/null || echo "nvidia-smi failed" >"$OUT/gpu.txt"

# --- 1. configure + build -----------------------------------------------------------------------
CMAKE_ARGS=(-S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOERUN_WITH_CUDA=ON
            -DMOERUN_WERROR=OFF -DCMAKE_CUDA_ARCHITECTURES=90)
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  CMAKE_ARGS+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
fi
run_step configure 90 "$OUT/configure.log" cmake "${CMAKE_ARGS[@]}"
if ((STEP_RC == 0)); then
  record configure ok "$STEP_S" "$(grep -o 'moerun backends:.*' "$OUT/configure.log" | tail -1)"
  run_step build 200 "$OUT/build.log" ninja -C "$BUILD" -j"$JOBS"
  if ((STEP_RC == 0)); then
    record build ok "$STEP_S" "ninja -j$JOBS"
  else
    record build FAIL "$STEP_S" "$STEP_NOTE (log: $OUT/build.log)"
    echo "---- build errors ----" >&2
    grep -E -A12 '^FAILED:|error:' "$OUT/build.log" | head -60 >&2
  fi
else
  record configure FAIL "$STEP_S" "$STEP_NOTE (log: $OUT/configure.log)"
  tail -30 "$OUT/configure.log" >&2
  STEP_RC=1
fi
BUILT=$STEP_RC
BIN="$ROOT/$BUILD/bin"
[[ "$BUILD" == /* ]] && BIN="$BUILD/bin"

if ((BUILT == 0)); then
  # --- 2. GPU tests (CUDA vs CPU, NCCL one-rank self send/recv) -------------------------------
  run_step "ctest -L gpu" 90 "$OUT/ctest.log" \
    ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 60 \
    --output-junit "$OUT/ctest-gpu.xml"
  summary=$(grep -E 'tests passed, [0-9]+ tests? failed out of' "$OUT/ctest.log" | tail -1)
  if ((STEP_RC == 0)) && [[ -n "$summary" ]]; then
    record "ctest -L gpu" ok "$STEP_S" "$summary"
  elif grep -q 'No tests were found' "$OUT/ctest.log"; then
    record "ctest -L gpu" FAIL "$STEP_S" "no test has the label gpu"
  else
    record "ctest -L gpu" FAIL "$STEP_S" "${summary:-$STEP_NOTE} (log: $OUT/ctest.log)"
  fi

  # --- 3. moebench layer --device cuda at the ANCHORS.md shapes ------------------------------
  t0=$SECONDS
  timeout -k 5 "$(cap 150)" "$BIN/moebench" layer --device cuda --anchors --min-time "$MIN_TIME" \
    --json >"$OUT/layer.json" 2>"$OUT/layer.log"
  rc=$?
  if ((rc == 0)); then
    record "moebench layer --anchors" ok "$((SECONDS - t0))" "JSON: $OUT/layer.json"
  else
    record "moebench layer --anchors" FAIL "$((SECONDS - t0))" "exit $rc (log: $OUT/layer.log)"
    tail -5 "$OUT/layer.log" >&2
  fi

  # --- 4. moerun forward on the GPU: 1 process, then 2 and 4 sharing it ----------------------
  FWD=(--preset qwen3-30b-a3b --experts 32 --dtype bf16 --input "$OUT/in256.safetensors")
  python3 tests/mpi/st_tool.py input "$OUT/in256.safetensors" 256 2048 1 >"$OUT/input.log" 2>&1
  same_bits() {  # same_bits A B LOG: tensor "output" of A and B has the same bytes
    python3 tests/mpi/st_tool.py same-tensor "$1" "$2" output >>"$3" 2>&1
  }
  rel_err() {  # the "rel err vs FILE X (within T)" part of moerun forward's line, FILE left out
    grep -o 'rel err vs [^|]*' "$1" | sed 's#vs [^ ]* #vs cpu #' | tail -1
  }
  run_step "forward cpu reference" 60 "$OUT/forward-cpu.log" \
    "$BIN/moerun" forward --device cpu "${FWD[@]}" --output "$OUT/ref.safetensors"
  if ((STEP_RC == 0)); then
    record "forward cpu reference" ok "$STEP_S" "qwen3-30b-a3b, 32 experts, bf16, 256 tokens"
    # Exact math: bitwise the CPU layer.
    name="forward cuda exact, 1 proc"
    run_step "$name" 60 "$OUT/forward-gpu-exact.log" \
      "$BIN/moerun" forward --device cuda --math exact "${FWD[@]}" \
      --output "$OUT/gpu-exact.safetensors" --check "$OUT/ref.safetensors" --tolerance 1e-5
    if ((STEP_RC != 0)); then
      record "$name" FAIL "$STEP_S" "$STEP_NOTE (log: $OUT/forward-gpu-exact.log)"
      tail -3 "$OUT/forward-gpu-exact.log" >&2
    elif same_bits "$OUT/ref.safetensors" "$OUT/gpu-exact.safetensors" \
      "$OUT/forward-gpu-exact.log"; then
      record "$name" ok "$STEP_S" "same bits as the cpu layer"
    else
      record "$name" FAIL "$STEP_S" "$(rel_err "$OUT/forward-gpu-exact.log"); bits differ from cpu"
    fi
    # Tensor cores (bf16): within 1e-2 of the CPU layer.
    name="forward cuda, 1 proc"
    run_step "$name" 60 "$OUT/forward-gpu1.log" \
      "$BIN/moerun" forward --device cuda --math tensor-core "${FWD[@]}" \
      --output "$OUT/gpu1.safetensors" --check "$OUT/ref.safetensors" --tolerance 1e-2
    if ((STEP_RC == 0)); then
      record "$name" ok "$STEP_S" "$(rel_err "$OUT/forward-gpu1.log")"
    else
      record "$name" FAIL "$STEP_S" "$STEP_NOTE (log: $OUT/forward-gpu1.log)"
      tail -3 "$OUT/forward-gpu1.log" >&2
    fi
    # 1 router + 1 or 3 expert ranks, every expert rank on GPU 0 (the local rank modulo the one
    # GPU), rows host-staged over the mpi transport (NCCL refuses two ranks on one GPU).
    for np in 2 4; do
      name="forward cuda, mpirun -np $np"
      log="$OUT/forward-gpu-np$np.log"
      run_step "$name" 60 "$log" \
        mpirun --allow-run-as-root --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \
        -np "$np" "$BIN/moerun" forward --device cuda --math tensor-core --transport mpi \
        "${FWD[@]}" --output "$OUT/gpu-np$np.safetensors" --check "$OUT/ref.safetensors" \
        --tolerance 1e-2
      if ((STEP_RC != 0)); then
        record "$name" FAIL "$STEP_S" "$STEP_NOTE (log: $log)"
        tail -3 "$log" >&2
        continue
      fi
      note=$(rel_err "$log")
      # Rank-count invariance: 4 processes give the bits of 2 (the router's gate and combine on
      # the CPU, the experts on the GPU in both). Against the one-process run (gate and combine
      # on the GPU) the bits are reported, not required.
      status=ok
      if [[ $np == 4 && -f "$OUT/gpu-np2.safetensors" ]]; then
        if same_bits "$OUT/gpu-np2.safetensors" "$OUT/gpu-np4.safetensors" "$log"; then
          note+="; same bits as -np 2"
        else
          note+="; bits differ from -np 2"
          status=FAIL
        fi
      fi
      if [[ -f "$OUT/gpu1.safetensors" ]]; then
        if same_bits "$OUT/gpu1.safetensors" "$OUT/gpu-np$np.safetensors" "$log"; then
          note+="; same bits as 1 proc"
        else
          note+="; not the bits of 1 proc"
        fi
      fi
      record "$name" "$status" "$STEP_S" "$note"
    done
    # Deterministic mode across 1-4 processes: the same bytes (tests/gpu/ranks_bitwise.sh).
    name="forward cuda, np 1-4 bitwise"
    run_step "$name" 120 "$OUT/ranks-bitwise.log" bash tests/gpu/ranks_bitwise.sh "$BIN/moerun" \
      "$OUT/ranks-bitwise"
    if ((STEP_RC == 0)); then
      record "$name" ok "$STEP_S" "$(grep -c '^PASS' "$OUT/ranks-bitwise.log") cases identical"
    else
      record "$name" FAIL "$STEP_S" "$(grep '^FAIL' "$OUT/ranks-bitwise.log" | head -2 | tr '\n' ';')"
    fi
  else
    record "forward cpu reference" FAIL "$STEP_S" "$STEP_NOTE (log: $OUT/forward-cpu.log)"
    tail -3 "$OUT/forward-cpu.log" >&2
  fi
else
  for s in "ctest -L gpu" "moebench layer --anchors" "forward cuda"; do
    record "$s" skipped 0 "the build failed"
  done
  FAILED=1
fi

# --- the table ----------------------------------------------------------------------------------
python3 - "$RESULTS" "$OUT/layer.json" "$OUT/layer.log" "$OUT/ctest.log" "$OUT/gpu.txt" \
  "$((SECONDS - START))" <<'PY'
import json, os, re, sys

steps_file, layer_json, layer_log, ctest_log, gpu_txt, total = sys.argv[1:7]
gpu = open(gpu_txt).read().strip() if os.path.exists(gpu_txt) else "?"
print()
print(f"GPU check: {gpu} | {total} s in all | logs in {os.path.dirname(steps_file)}")
print()
print(f"{'step':30} {'result':7} {'s':>4}  note")
for line in open(steps_file):
    name, status, secs, note = (line.rstrip("\n").split("\t") + ["", "", "", ""])[:4]
    print(f"{name:30} {status:7} {secs:>4}  {note}")

# Test counts from ctest's log: passed / failed, and the NCCL tests among them.
if os.path.exists(ctest_log):
    passed = failed = nccl_p = nccl_f = 0
    for m in re.finditer(r"Test\s+#\d+: (\S+) \.+\**\s*(Passed|\*\*\*Failed|Failed|\*\*\*Timeout"
                         r"|\*\*\*Exception|Not Run|\*\*\*Skipped)", open(ctest_log).read()):
        name, res = m.group(1), m.group(2)
        ok = res == "Passed"
        skipped = "Skipped" in res or res == "Not Run"
        if skipped:
            continue
        passed += ok
        failed += not ok
        if "nccl" in name.lower():
            nccl_p += ok
            nccl_f += not ok
    print()
    print(f"GPU tests: {passed} passed, {failed} failed (NCCL: {nccl_p} passed, {nccl_f} failed)")

def fmt(v, spec):
    width = int(re.match(r"\d+", spec).group(0))
    return format(v, spec) if isinstance(v, (int, float)) else "-".rjust(width)

rows = []
try:
    doc = json.load(open(layer_json))
    shapes = doc.get("shapes", [doc])
    for s in shapes:
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
print()
print(f"{'shape':15} {'tokens':>6} {'ours ms':>9} {'torch grouped ms':>17} {'floor ms':>9} "
      f"{'x_floor':>8} {'speedup_vs_torch_grouped':>25}")
for name, t, ms, tms, fl, xf, sp in rows:
    print(f"{name:15} {t:>6} {fmt(ms, '9.3f')} {fmt(tms, '17.3f')} {fmt(fl, '9.3f')} "
          f"{fmt(xf, '8.2f')} {fmt(sp, '25.2f')}")
if not rows:
    print("(no layer timings)")
PY

echo
if ((FAILED)); then
  echo "gpu-check: FAILED (see $OUT)"
  exit 1
fi
echo "gpu-check: all steps passed"
exit 0
