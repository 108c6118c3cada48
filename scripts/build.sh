#!/usr/bin/env bash
# Configures and builds moerun (Release) into build/; binaries land in build/bin/.
#   scripts/build.sh [extra cmake -D options]
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
cmake --preset release "$@" >/dev/null
cmake --build build -j "$jobs"
