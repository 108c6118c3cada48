#!/usr/bin/env bash
# Makes `import moerun` work for the system's Python without installing anything: writes
# moerun.pth into its site-packages, listing this checkout's python/ (the sources) and
# build/python (what the CMake build makes: moerun.v1, moerun._layer). Rebuilding updates both
# in place; nothing needs to be run again.
#   scripts/install-python-path.sh [--python PY] [--build DIR] [--remove]
# PY: /usr/bin/python3 where it exists (else python3); DIR: build. Writing the .pth file needs
# write access to site-packages (root on Debian: /usr/local/lib/python3.X/dist-packages).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=/usr/bin/python3
[[ -x $py ]] || py=python3
build=$repo/build
remove=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --python) py=$2; shift 2 ;;
    --build) build=$(cd "$2" && pwd); shift 2 ;;
    --remove) remove=1; shift ;;
    -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install-python-path: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
site=$("$py" -c 'import site; print(site.getsitepackages()[0])')
pth=$site/moerun.pth
if [[ $remove == 1 ]]; then
  rm -f "$pth"
  echo "install-python-path: removed $pth"
  exit 0
fi
mkdir -p "$site" 2>/dev/null || true
if [[ ! -w $site ]]; then
  echo "install-python-path: cannot write to $site (run it as root, or use a venv and" \
       "pip install ./python)" >&2
  exit 1
fi
printf '%s\n%s\n' "$repo/python" "$build/python" >"$pth"
echo "install-python-path: $pth -> $repo/python, $build/python"
if ! compgen -G "$build/python/moerun/_layer*.so" >/dev/null; then
  echo "install-python-path: note: $build/python/moerun has no _layer module yet (build moerun" \
       "first: scripts/build.sh); moerun.Layer needs it" >&2
fi
