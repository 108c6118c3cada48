#!/usr/bin/env bash
# Installs the Debian 12 packages moerun needs to build, test and benchmark.
# Idempotent: packages already present are skipped, so it is cheap to re-run.
#   scripts/install-deps.sh          build + run dependencies
#   scripts/install-deps.sh --test   plus what the test suite needs (clang for libFuzzer/sanitizers)
set -euo pipefail

want=(
  build-essential cmake ninja-build pkg-config git
  libspdlog-dev libfmt-dev nlohmann-json3-dev libcli11-dev libyaml-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev
  libopenmpi-dev openmpi-bin libucx-dev
  libboost-dev libboost-system-dev libprotobuf-dev protobuf-compiler
  # TLS on the serving and control endpoints (Boost.Asio's SSL over OpenSSL); openssl makes certs.
  libssl-dev openssl
  # The Python package (python/moerun): protobuf classes, numpy, PyTorch, the pybind11 module.
  python3 python3-dev python3-protobuf python3-numpy python3-torch pybind11-dev
  python3-setuptools
)
if [[ "${1:-}" == "--test" ]]; then
  want+=(clang libclang-rt-14-dev clang-format iproute2 prometheus curl python3-pytest
    python3-venv python3-pip
    slurm-wlm file nodejs)
  # tests/deploy/k8s_validate.sh: npm (unless node brings it) and the Kubernetes schemas from npm,
  # installed on the way out (also when apt has nothing to do).
  command -v npm >/dev/null || want+=(npm)
  k8s_schemas() {
    [[ $? -eq 0 ]] || return 0
    NODE_PATH=$(npm root -g) node -e 'require("kubernetes-models/v1");
      require("@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1")' 2>/dev/null && return 0
    echo "install-deps: npm install -g kubernetes-models @kubernetes-models/prometheus-operator"
    $([[ $(id -u) -eq 0 ]] || echo sudo) npm install -g --no-fund --no-audit --loglevel=error \
      kubernetes-models@4.5.1 @kubernetes-models/prometheus-operator@4.4.4 ||
      echo "install-deps: warning: npm install failed (no registry?): k8s_manifests will skip the schemas"
  }
  trap k8s_schemas EXIT
fi

missing=()
for p in "${want[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#want[@]} packages present"
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
