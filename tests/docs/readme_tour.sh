#!/usr/bin/env bash
# Runs the README's "five-minute tour" exactly as written (the sh block between the
# <!-- tour:begin --> and <!-- tour:end --> markers), from the repository root, in a network
# namespace of its own (so the tour's default ports cannot collide with other tests), with
# every command's failure failing the test. Cleans up the tour's job and files, also on failure.
#
#   bash tests/docs/readme_tour.sh SOURCE_DIR BIN_DIR    (ctest: readme_tour)
set -euo pipefail
src=$(cd "$1" && pwd)
bin=$(cd "$2" && pwd)
readme=$src/README.md
work=$(mktemp -d /tmp/moerun-tour.XXXXXX)
cleanup() {
  if [[ -f /tmp/tour.pid ]]; then kill -KILL "$(cat /tmp/tour.pid)" 2>/dev/null || true; fi
  rm -rf "$work" /tmp/tour.token /tmp/tour.ready /tmp/tour.pid /tmp/tour-serve.log \
    /tmp/tour-out.safetensors
}
trap cleanup EXIT

# The block, without its fences.
awk '/<!-- tour:begin -->/{on=1; next} /<!-- tour:end -->/{on=0} on' "$readme" |
  sed '/^```/d' >"$work/tour.sh"
lines=$(grep -cv '^\s*\(#.*\)\?$' "$work/tour.sh" || true)
if ((lines < 5)); then
  echo "FAIL: README.md has no tour block between the markers (found $lines commands)"
  exit 1
fi
# The tour's PATH line names build/bin under the repository root; a build elsewhere is put first.
export PATH=$bin:$PATH
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
cd "$src"
set +e
unshare --net bash -c 'ip link set lo up && PATH='"$bin"':$PATH exec bash -euo pipefail -x "$0"' \
  "$work/tour.sh" >"$work/out.log" 2>&1
rc=$?
set -e
cat "$work/out.log"
if ((rc != 0)); then
  echo "--- the job's log"
  cat /tmp/tour-serve.log 2>/dev/null || true
  echo "FAIL: the README's tour exited $rc"
  exit 1
fi
for want in "within 1e-05" "verified .* bitwise" "moerun_placement_version" "ready"; do
  if ! grep -q -- "$want" "$work/out.log"; then
    echo "FAIL: the tour's output lacks '$want'"
    exit 1
  fi
done
grep -q "shut down cleanly" /tmp/tour-serve.log || {
  cat /tmp/tour-serve.log
  echo "FAIL: the job did not drain and shut down cleanly"
  exit 1
}
echo "PASS: the README's tour ran as written ($lines commands)"
