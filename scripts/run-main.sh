#!/usr/bin/env bash
# The README's first command: installs the dependencies, builds moerun, and runs the main job:
# one MoE layer (DeepSeek-V3's routing and shared expert, small shapes) over a shipped input,
# checked against the output of DeepSeek-V3's reference implementation; then the runtime as a
# service and from Python. It builds only what it runs (the three binaries and the Python
# module, not the test tree: scripts/test.sh builds that), and says at each phase what it does
# and how long the phase took.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
phase_at=$SECONDS
phase() {
  if [[ -n "${phase_name:-}" ]]; then
    printf '==== %s: done in %d s ====\n' "$phase_name" $((SECONDS - phase_at))
  fi
  phase_name=$1
  phase_at=$SECONDS
  [[ -n "$phase_name" ]] && printf '\n==== %s (at %d s) ====\n' "$phase_name" $((SECONDS - started))
  return 0
}
trap 'rc=$?; [[ $rc -ne 0 ]] && printf "\n==== %s failed (exit %d) after %d s ====\n" "${phase_name:-run-main}" $rc $((SECONDS - started))' EXIT

phase "install: the Debian packages moerun builds and runs with (scripts/install-deps.sh)"
scripts/install-deps.sh
phase "configure and build: moerun, moebench, moectl and the Python module (no tests)"
scripts/build.sh -DMOERUN_BUILD_TESTS=OFF
phase "run: one MoE layer against DeepSeek-V3's reference output (moerun forward --check)"
model=tests/data/hf-moe/deepseek_v3
build/bin/moerun forward --model "$model" --input "$model/golden.safetensors" \
  --output build/forward-output.safetensors --check "$model/golden.safetensors"
phase "serve: 4 ranks under mpirun, verified load, moectl status, clean shutdown (scripts/serve-demo.sh)"
scripts/serve-demo.sh 5
# From Python: `import moerun` for the system's python3, then a small PyTorch decoder whose MoE
# layer is served by a local 4-rank job, and the same tokens with the layer in-process.
phase "python: a PyTorch decoder whose MoE layer a 4-rank job serves (examples/python/tiny_decoder.py)"
scripts/install-python-path.sh
/usr/bin/python3 examples/python/tiny_decoder.py --new-tokens 8
phase ""
printf '\n==== run-main: everything done in %d s ====\n' $((SECONDS - started))
