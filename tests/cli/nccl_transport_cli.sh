#!/usr/bin/env bash
# `--transport nccl` refused before anything starts, as a user meets it: without a GPU (this
# machine), without mpirun/srun, or with a bad transport name, `moerun forward` and `moerun serve`
# (flag or config `transport: nccl`) end with exit 2 and one line saying why; under
# `mpirun -np 2` every rank says it once and mpirun exits 2. On a machine with a GPU the lines
# differ (no launcher, or fewer GPUs than ranks), but each is still one line and exit 2.
#
#   nccl_transport_cli.sh MOERUN HF_MODEL_DIR [MPIRUN]
set -uo pipefail
[[ $# -ge 2 ]] || { echo "usage: nccl_transport_cli.sh MOERUN HF_MODEL_DIR [MPIRUN]" >&2; exit 2; }
MOERUN=$(realpath "$1")
MODEL=$(realpath "$2")
MPIRUN=${3:-}
WORK=$(mktemp -d /tmp/moerun-nccl-cli.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
HAVE_GPU=0
[[ -e /dev/nvidia0 ]] && HAVE_GPU=1

# expect_one_line NAME RC OUTPUT_FILE PATTERN...: exit 2, one non-empty line, every pattern in it.
expect_one_line() {
  local name=$1 rc=$2 out=$3
  shift 3
  [[ $rc -eq 2 ]] || { cat "$out" >&2; fail "$name: exit $rc, want 2"; }
  local lines
  lines=$(grep -c . "$out")
  [[ $lines -eq 1 ]] || { cat "$out" >&2; fail "$name: $lines lines, want 1"; }
  for p in "$@"; do
    grep -qF -- "$p" "$out" || { cat "$out" >&2; fail "$name: no '$p' in the line"; }
  done
  echo "ok: $name: $(cat "$out")"
}

FORWARD=(forward --preset qwen3-30b-a3b --input "$WORK/x.safetensors" --output "$WORK/y.safetensors")
# (The input does not exist: the refusal must come before any file is read.)
WHY=("--transport nccl")
if ! "$MOERUN" --version | grep -q ' nccl=1 '; then
  WHY+=("no 'nccl' transport")  # a build without NCCL says so, by name, before looking for a GPU
elif [[ $HAVE_GPU -eq 0 ]]; then
  WHY+=("no usable GPU")
fi

env -u OMPI_COMM_WORLD_RANK -u PMIX_RANK "$MOERUN" "${FORWARD[@]}" --transport nccl \
  >"$WORK/out" 2>&1
expect_one_line "forward --transport nccl" $? "$WORK/out" "${WHY[@]}"

"$MOERUN" "${FORWARD[@]}" --transport nccx >"$WORK/out" 2>&1
expect_one_line "forward --transport nccx" $? "$WORK/out" "mpi, ucx, nccl or inproc" "nccx"

printf 'model: %s\ntransport: nccl\n' "$MODEL" >"$WORK/nccl.yaml"
timeout 120 "$MOERUN" serve --config "$WORK/nccl.yaml" >"$WORK/out" 2>&1
expect_one_line "serve, config transport: nccl" $? "$WORK/out" "${WHY[@]}"

printf 'model: %s\n' "$MODEL" >"$WORK/plain.yaml"
timeout 120 "$MOERUN" serve --config "$WORK/plain.yaml" --transport nccl >"$WORK/out" 2>&1
expect_one_line "serve --transport nccl" $? "$WORK/out" "${WHY[@]}"

if [[ -n "$MPIRUN" && $HAVE_GPU -eq 0 ]]; then
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 "$MPIRUN" \
    --allow-run-as-root --oversubscribe -np 2 "$MOERUN" "${FORWARD[@]}" --transport nccl \
    >"$WORK/out" 2>&1
  rc=$?
  [[ $rc -eq 2 ]] || { cat "$WORK/out" >&2; fail "mpirun -np 2: exit $rc, want 2"; }
  n=$(grep -c '^moerun: --transport nccl needs one GPU per rank' "$WORK/out")
  [[ $n -eq 2 ]] || { cat "$WORK/out" >&2; fail "mpirun -np 2: $n ranks said why, want 2"; }
  echo "ok: mpirun -np 2 forward --transport nccl: exit 2, both ranks said why"
fi
echo "PASS"
