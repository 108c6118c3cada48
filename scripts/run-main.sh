#!/usr/bin/env bash
# The README's first command: installs the dependencies, builds moerun, and runs the main job:
# one MoE layer (DeepSeek-V3's routing and shared expert, small shapes) over a shipped input,
# checked against the output of DeepSeek-V3's reference implementation.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
model=tests/data/hf-moe/deepseek_v3
build/bin/moerun forward --model "$model" --input "$model/golden.safetensors" \
  --output build/forward-output.safetensors --check "$model/golden.safetensors"
# The runtime as a service: 4 ranks under mpirun, verified load, moectl status, clean shutdown.
scripts/serve-demo.sh 5
# From Python: `import moerun` for the system's python3, then a small PyTorch decoder whose MoE
# layer is served by a local 4-rank job, and the same tokens with the layer in-process.
scripts/install-python-path.sh
/usr/bin/python3 examples/python/tiny_decoder.py --new-tokens 8
