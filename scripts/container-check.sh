#!/usr/bin/env bash
# The CPU container image, built and run on this machine with Debian 12's podman (part of
# scripts/full.sh, not of CI: it builds moerun once more inside the image, ~15 minutes on 2 cores):
#   1. base images: podman has no registry to pull debian:12 from here, so when it lacks one the
#      script makes it: `debootstrap --variant=minbase bookworm` (from the Debian mirror),
#      imported as debian:12 and debian:12-slim
#   2. `podman build -f deploy/Dockerfile -t moerun:check .` (its builder runs install-deps.sh and
#      build.sh inside, then cpack; the runtime stage installs the .deb)
#   3. `podman run`: moerun --version; the main job (moerun forward --check against DeepSeek-V3's
#      reference output, from the files the package ships); a 4-rank `moerun serve` under mpirun
#      in the container (the host's network) answered from outside by this machine's
#      build/bin/moebench serve --verify, every answer checked bitwise
#   4. deploy/Dockerfile.cuda as far as it goes without its base image (nvidia/cuda is not
#      reachable): its instructions parse, every FROM names the CUDA_VERSION argument, and its
#      CUDA_ARCHS default is CMake's (cmake/Backends.cmake)
# Needs root, podman, runc and debootstrap (apt-get install podman buildah runc debootstrap) and a
# built build/bin/moebench. Prints each step's output and time; exit 0 when every step passed.
#   scripts/container-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
step() { printf '\n==== %s (at %d s) ====\n' "$*" $((SECONDS - started)); }
fail() { echo "container-check: FAIL: $*" >&2; exit 1; }
for t in podman runc debootstrap python3 curl; do
  command -v "$t" >/dev/null || fail "$t is not installed (apt-get install podman buildah runc debootstrap)"
done
[[ -x build/bin/moebench ]] || fail "build/bin/moebench is missing: run scripts/build.sh first"
# This VM's podman: the vfs storage driver, runc (crun refuses its hybrid cgroups), the host's
# network (no bridge or overlay), and resource limits below the VM's hard ones (podman's
# defaults are above them: "setrlimit RLIMIT_NOFILE: Operation not permitted").
PODMAN=(podman --storage-driver vfs --runtime "$(command -v runc || echo runc)")
LIMITS=(--ulimit nofile=4096:4096 --ulimit nproc=4096:4096)
WORK=$(mktemp -d /tmp/moerun-container.XXXXXX)
NAME=moerun-check-$$
cleanup() {
  "${PODMAN[@]}" rm -f "$NAME" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

step "4. deploy/Dockerfile.cuda without its base image"
python3 - deploy/Dockerfile.cuda cmake/Backends.cmake <<'PY'
import re, sys
text = open(sys.argv[1]).read()
known = {"FROM", "ARG", "RUN", "COPY", "WORKDIR", "USER", "EXPOSE", "ENTRYPOINT", "CMD", "ENV",
         "LABEL", "ADD", "VOLUME", "HEALTHCHECK", "SHELL", "STOPSIGNAL", "ONBUILD"}
lines, cur = [], ""
for raw in text.split("\n"):
    if not cur and (not raw.strip() or raw.lstrip().startswith("#")):
        continue
    cur += raw.rstrip("\\")
    if raw.endswith("\\"):
        cur += " "
        continue
    lines.append(cur.strip()); cur = ""
assert not cur, "a continued line runs off the end"
bad = [l for l in lines if l.split()[0].upper() not in known]
assert not bad, f"unknown instructions: {bad}"
froms = [l for l in lines if l.upper().startswith("FROM ")]
assert froms and all("${CUDA_VERSION}" in l for l in froms), f"FROM without CUDA_VERSION: {froms}"
assert any(l.startswith("ARG CUDA_VERSION=") for l in lines), "no CUDA_VERSION default"
archs = [re.search(r'CUDA_ARCHS="([^"]+)"', l).group(1) for l in lines if l.startswith("ARG CUDA_ARCHS=")]
cmake = re.search(r'set\(_moerun_cuda_archs "([^"]+)"\)', open(sys.argv[2]).read()).group(1)
assert archs == [cmake], f"CUDA_ARCHS default {archs} is not CMake's {cmake}"
print(f"{len(lines)} instructions, {len(froms)} stages on nvidia/cuda:${{CUDA_VERSION}}, "
      f"CUDA_ARCHS {archs[0]} = CMake's default")
PY

step "1. base images debian:12 and debian:12-slim"
if "${PODMAN[@]}" image exists debian:12 && "${PODMAN[@]}" image exists debian:12-slim; then
  echo "present"
else
  debootstrap --variant=minbase bookworm "$WORK/rootfs" http://deb.debian.org/debian \
    >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; fail "debootstrap"; }
  # The mirror the image's apt-get uses (debootstrap's own sources line).
  echo "deb http://deb.debian.org/debian bookworm main" >"$WORK/rootfs/etc/apt/sources.list"
  tar -C "$WORK/rootfs" -c . | "${PODMAN[@]}" import - debian:12
  "${PODMAN[@]}" tag debian:12 debian:12-slim
  rm -rf "$WORK/rootfs"
fi

step "2. podman build -f deploy/Dockerfile -t moerun:check ."
"${PODMAN[@]}" build --network host "${LIMITS[@]}" -f deploy/Dockerfile -t moerun:check . 2>&1 | tail -25
"${PODMAN[@]}" image exists moerun:check || fail "the image was not built"

step "3a. podman run moerun:check --version"
"${PODMAN[@]}" run --rm --network host "${LIMITS[@]}" moerun:check --version

step "3b. the main job in the container: moerun forward --check"
M=/usr/share/moerun/tests/data/hf-moe/deepseek_v3
"${PODMAN[@]}" run --rm --network host "${LIMITS[@]}" moerun:check forward --model "$M" \
  --input "$M/golden.safetensors" --output /tmp/out.safetensors --check "$M/golden.safetensors"

step "3c. a 4-rank moerun serve in the container, moebench serve --verify from outside"
PORT=$((20000 + RANDOM % 9000))
"${PODMAN[@]}" run -d --name "$NAME" --network host "${LIMITS[@]}" --entrypoint mpirun moerun:check \
  --enable-recovery --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np 4 \
  moerun serve --config /usr/share/moerun/configs/tiny.yaml --listen "127.0.0.1:$PORT" \
  --metrics-listen "127.0.0.1:$((PORT + 1000))" >/dev/null
for _ in $(seq 240); do
  code=$(curl -s -m 2 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$((PORT + 1000))/health/ready" || true)
  [[ $code == 200 ]] && break
  "${PODMAN[@]}" container exists "$NAME" || break
  sleep 0.5
done
[[ ${code:-} == 200 ]] || { "${PODMAN[@]}" logs "$NAME" 2>&1 | tail -20; fail "the job in the container did not get ready"; }
"${PODMAN[@]}" logs "$NAME" 2>&1 | grep -E "outlive|serving .* layer" | head -3
build/bin/moebench serve --target "127.0.0.1:$PORT" --concurrency 4 --tokens-per-request 16 \
  --duration 5 --verify --model tests/data/hf-moe/deepseek_v3 2>&1 | grep -E "verified|error" ||
  fail "moebench serve --verify against the container"
"${PODMAN[@]}" stop -t 20 "$NAME" >/dev/null
printf '\ncontainer-check: OK in %d s\n' $((SECONDS - started))
