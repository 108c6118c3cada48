#!/usr/bin/env bash
# Checks the Kubernetes manifests in deploy/k8s/base and deploy/k8s/overlays (ctest k8s_manifests):
#   1. every object against the official schemas (npm kubernetes-models and
#      @kubernetes-models/prometheus-operator, run by node; the MPIJob's pod templates as core/v1
#      PodTemplateSpecs and, when the mpi-operator's CRD is at hand, the whole MPIJob against its
#      openAPIV3Schema with unknown fields rejected), and moerun's own invariants
#      (tests/deploy/k8s_validate.py: probes, ports, token, image, -np);
#   2. that both checks fail on broken copies (a wrong probe path, a port that is a string);
#   3. with a moerun binary: the ConfigMap's serve config run for real (inproc, 2 ranks, the
#      launcher's own `sh -c` line, the shipped small model), the readiness probe's path and
#      port answering 200, /health/live and /metrics, and moectl reading the token file.
# Usage: bash tests/deploy/k8s_validate.sh [MOERUN_BIN [MOECTL_BIN]]
#   MOERUN_MPIJOB_CRD=FILE   the mpi-operator's kubeflow.org_mpijobs.yaml (default: fetched from
#                            GitHub, v0.6.0; "none": do not fetch)
#   MOERUN_K8S_REQUIRE_CRD=1 fail when the CRD cannot be had (scripts/full.sh)
# Needs node, /usr/bin/python3 with yaml, and the npm packages (scripts/install-deps.sh --test).
set -euo pipefail
cd "$(dirname "$0")/../.."
moerun=${1:-}
moectl=${2:-}
dir=deploy/k8s/base
tmp=$(mktemp -d)
pid=""
cleanup() {
  if [[ -n "$pid" ]]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT

if [[ -z "${NODE_PATH:-}" ]]; then
  NODE_PATH=$(npm root -g 2>/dev/null || echo /usr/local/lib/node_modules):/usr/local/lib/node_modules:/usr/lib/node_modules
fi
export NODE_PATH
command -v node >/dev/null || { echo "k8s_validate: node not found (scripts/install-deps.sh --test)"; exit 1; }
# The schemas come from npm (install-deps --test installs them). Without them (no registry
# reachable when the dependencies were installed) the invariants and the run are still checked,
# and the test ends as skipped (77), not passed.
schemas=1
if ! node -e 'require("kubernetes-models/v1");
    require("@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1")' 2>/dev/null; then
  schemas=0
  echo "SKIP (schemas): the npm packages kubernetes-models and @kubernetes-models/prometheus-operator"
  echo "  are not installed (scripts/install-deps.sh --test installs them); checking the rest"
fi

crd_yaml=""
case "${MOERUN_MPIJOB_CRD:-}" in
  none) ;;
  "")
    url=https://raw.githubusercontent.com/kubeflow/mpi-operator/v0.6.0/manifests/base/kubeflow.org_mpijobs.yaml
    if curl -fsSL --connect-timeout 5 --max-time 30 -o "$tmp/crd.yaml" "$url" 2>/dev/null; then
      crd_yaml=$tmp/crd.yaml
    else
      echo "k8s_validate: could not fetch $url"
    fi ;;
  *) crd_yaml=$MOERUN_MPIJOB_CRD ;;
esac
if [[ -z "$crd_yaml" && "${MOERUN_K8S_REQUIRE_CRD:-0}" == 1 ]]; then
  echo "k8s_validate: MOERUN_K8S_REQUIRE_CRD=1 and no MPIJob CRD"; exit 1
fi

validate() { # DIR: the own invariants, then the schemas
  local d=$1 rc=0
  if [[ -n "$crd_yaml" ]]; then
    /usr/bin/python3 tests/deploy/k8s_validate.py "$d" "$tmp/objects.json" "$crd_yaml" "$tmp/crd.json" || rc=1
    ((schemas == 0)) || node tests/deploy/k8s_validate.js "$tmp/objects.json" "$tmp/crd.json" || rc=1
  else
    /usr/bin/python3 tests/deploy/k8s_validate.py "$d" "$tmp/objects.json" || rc=1
    ((schemas == 0)) || node tests/deploy/k8s_validate.js "$tmp/objects.json" || rc=1
  fi
  return $rc
}

if command -v kubectl >/dev/null; then  # the overlays as kustomize itself renders them, to compare
  for o in deploy/k8s/overlays/*/; do
    n=$(basename "$o")
    kubectl kustomize "$o" >"$tmp/rendered-$n.yaml"
    export "K8S_RENDERED_${n^^}=$tmp/rendered-$n.yaml"
  done
  kubectl kustomize deploy/k8s >/dev/null
  echo "kubectl kustomize: deploy/k8s and its overlays build"
fi
echo "==== the manifests in $dir and the overlays ===="
validate "$dir"

echo "==== broken copies must fail ===="
mkdir "$tmp/bad1" "$tmp/bad2"
cp "$dir"/*.yaml "$tmp/bad1/"; cp "$dir"/*.yaml "$tmp/bad2/"  # (no overlays next to them)
sed -i 's|path: /health/ready|path: /healthz|' "$tmp/bad1/mpijob.yaml"
sed -i 's|containerPort: 5800|containerPort: "5800"|' "$tmp/bad2/mpijob.yaml"
broken=(bad1 bad2)
((schemas == 1)) || broken=(bad1)  # bad2 breaks a type only the schemas know
for b in "${broken[@]}"; do
  if validate "$tmp/$b" >"$tmp/$b.log" 2>&1; then
    echo "FAIL: the broken copy $b passed"; cat "$tmp/$b.log"; exit 1
  fi
  grep '^FAIL' "$tmp/$b.log" | head -3 | sed "s/^/  $b caught: /"
done

if [[ -z "$moerun" ]]; then
  echo "k8s_validate: no moerun binary given: the serve config was not run"
  exit 0
fi
moerun=$(realpath "$moerun")
moectl=$(realpath "${moectl:-$(dirname "$moerun")/moectl}")

echo "==== the ConfigMap's serve config, run by the launcher's command line ===="
# Free ports: serving, control, metrics base and base + 1 (rank 1).
read -r p_serve p_control p_metrics < <(/usr/bin/python3 - <<'PY'
import socket
def free(n=1):
    while True:
        s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close()
        ok = True
        for q in range(p, p + n):
            t = socket.socket()
            try: t.bind(("127.0.0.1", q))
            except OSError: ok = False
            t.close()
        if ok: return p
print(free(), free(), free(2))
PY
)
/usr/bin/python3 - "$dir" "$tmp" "$PWD" "$p_serve" "$p_control" <<'PY'
import sys, yaml, re
d, tmp, repo, ps, pc = sys.argv[1:]
cm = yaml.safe_load(open(f"{d}/configmap.yaml"))
cfg = yaml.safe_load(cm["data"]["serve.yaml"])
# Only what differs between a pod and this machine: the model's place (the image's copy of the
# shipped model is the repository's tests/data), the rank count, one host's ports and files.
assert cfg["model"].startswith("/usr/share/moerun/"), cfg["model"]
cfg["model"] = repo + "/" + cfg["model"][len("/usr/share/moerun/"):]
cfg["transport"] = "inproc"
cfg["ranks"] = 2
s = cfg["serving"]
s["listen"] = f"127.0.0.1:{ps}"
s["control_listen"] = f"127.0.0.1:{pc}"
s["token_file"] = f"{tmp}/token"
yaml.safe_dump(cfg, open(f"{tmp}/serve.yaml", "w"))
job = yaml.safe_load(open(f"{d}/mpijob.yaml"))
script = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"][-1]
port = int(re.search(r"metrics_listen: \S+:(\d+)", cm["data"]["serve.yaml"]).group(1))
open(f"{tmp}/script", "w").write(script.replace("/etc/moerun/serve.yaml", f"{tmp}/serve.yaml"))
open(f"{tmp}/probe", "w").write(str(port))
env = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["env"]
open(f"{tmp}/device", "w").write(next(e["value"] for e in env if e["name"] == "MOERUN_DEVICE"))
PY
manifest_port=$(cat "$tmp/probe")
# The token file. The Secret volume gives mode 0440 (root's file, the pod's fsGroup), which moerun
# accepts only there (owned by root, read by a non-root member of its group: ReadTokenFile); this
# test's own file is owned by whoever runs it, so it is 0600.
head -c 24 /dev/urandom | base64 | tr -d '/+=' >"$tmp/token"
chmod 0600 "$tmp/token"
mkdir "$tmp/bin"; ln -s "$moerun" "$tmp/bin/moerun"
# OMPI_COMM_WORLD_RANK as the rank that makes 9700 - rank the free port here (rank 0 of the
# inproc job then listens there, rank 1 on the next port).
echo "script: $(cat "$tmp/script")"
(cd "$tmp" && PATH="$tmp/bin:$PATH" MOERUN_DEVICE=$(cat "$tmp/device") OMPI_COMM_WORLD_RANK=$((manifest_port - p_metrics)) \
  exec sh -c "$(cat "$tmp/script")") >"$tmp/serve.log" 2>&1 &
pid=$!
ready=""
for _ in $(seq 1 300); do
  if ! kill -0 "$pid" 2>/dev/null; then echo "FAIL: moerun serve exited"; tail -20 "$tmp/serve.log"; exit 1; fi
  code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$p_metrics/health/ready" || true)
  if [[ "$code" == 200 ]]; then ready=1; break; fi
  sleep 0.2
done
[[ -n "$ready" ]] || { echo "FAIL: /health/ready on the metrics port never answered 200"; tail -20 "$tmp/serve.log"; exit 1; }
echo "rank 0: GET /health/ready on the probe's port ($manifest_port in the pod, $p_metrics here): 200"
for r in 0 1; do
  port=$((p_metrics + r))
  [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health/live") == 200 ]] \
    || { echo "FAIL: rank $r /health/live"; exit 1; }
  curl -s -o "$tmp/metrics" "http://127.0.0.1:$port/metrics" || true
  grep -q '^moerun_' "$tmp/metrics" || { echo "FAIL: rank $r /metrics"; exit 1; }
  echo "rank $r: /health/live 200, /metrics has moerun_ series (port $port)"
done
"$moectl" --target "127.0.0.1:$p_control" --token-file "$tmp/token" status >"$tmp/status.txt" \
  || { echo "FAIL: moectl status with the token file"; cat "$tmp/status.txt"; exit 1; }
head -3 "$tmp/status.txt"
if ((schemas == 0)); then
  echo "k8s_validate: every check but the schemas passed; skipped: the schemas (see above)"
  exit 77
fi
echo "k8s_validate: all checks passed"
