#!/usr/bin/env bash
# The moerun Debian package, end to end: cpack packages the already built tree (it does not
# rebuild it), `dpkg -i` installs it, and then, from a temporary folder with nothing of the build
# tree on PATH, the installed files alone are run: moerun --version, moerun forward on the shipped
# DeepSeek-V3 fixture against its golden output, moectl/moebench --help, a project outside the tree
# that find_package(moerun)s the client library and sends the golden input to an installed
# `moerun serve` of the unit's /etc/moerun/moerun.yaml, and systemd-analyze verify of the unit.
# The package is purged at the end, even on failure. Last, `cmake --install --prefix` into a
# temporary folder is checked file by file, and the consumer is built against that prefix too.
#   sudo tests/deploy/package.sh [BUILD_DIR]      (default: build; ctest: package_deb)
# Needs root (dpkg -i), dpkg-dev (dpkg-shlibdeps), and a built BUILD_DIR (moerun moectl moebench).
set -euo pipefail

src=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$(cd "${1:-$src/build}" && pwd)
py=/usr/bin/python3
tensors="$src/tests/deploy/package_tensors.py"
fixture=share/moerun/tests/data/hf-moe/deepseek_v3

die() { echo "package.sh: $*" >&2; exit 1; }
[[ $(id -u) == 0 ]] || die "needs root (dpkg -i); run it as root"
command -v dpkg-shlibdeps >/dev/null || die "dpkg-shlibdeps not found (apt-get install dpkg-dev)"
[[ -f $build/CPackConfig.cmake ]] || die "$build has no CPackConfig.cmake (configure it with cmake first)"
for b in moerun moectl moebench; do
  [[ -x $build/bin/$b ]] || die "$build/bin/$b is not built (cmake --build $build --target $b)"
done
if dpkg-query -W -f '${Status}' moerun 2>/dev/null | grep -q 'installed'; then
  die "a package moerun is already installed ($(dpkg-query -W -f '${Version}' moerun)): remove it first (dpkg -r moerun); this test installs and purges its own"
fi

tmp=$(mktemp -d /tmp/moerun-package.XXXXXX)
installed=0
serve_pid=
cleanup() {
  local rc=$?
  if [[ -n $serve_pid ]]; then kill "$serve_pid" 2>/dev/null || true; wait "$serve_pid" 2>/dev/null || true; fi
  if [[ $installed == 1 ]]; then dpkg --purge moerun >"$tmp/purge.log" 2>&1 || cat "$tmp/purge.log" >&2; fi
  rm -rf "$tmp"
  exit $rc
}
trap cleanup EXIT

echo "== the client library (the binaries are packaged as built)"
cmake --build "$build" --target moerun_client >/dev/null

echo "== cpack"
(cd "$build" && cpack -G DEB -B "$tmp/cpack" >"$tmp/cpack.log" 2>&1) || { cat "$tmp/cpack.log" >&2; die "cpack failed"; }
version=$(sed -n 's/^set(CPACK_PACKAGE_VERSION "\(.*\)")$/\1/p' "$build/CPackConfig.cmake")
arch=$(dpkg --print-architecture)
deb="$tmp/cpack/moerun_${version}_${arch}.deb"
[[ -f $deb ]] || { ls -l "$tmp/cpack" >&2; die "no $deb"; }
dpkg-deb -f "$deb" Package Version Architecture Depends
depends=$(dpkg-deb -f "$deb" Depends)
for lib in libprotobuf libyaml-cpp libspdlog libfmt; do
  [[ $depends == *"$lib"* ]] || die "Depends does not list $lib: $depends"
done
dpkg-deb -c "$deb" | awk '{print $6}' | sort >"$tmp/deb-files"
for f in ./usr/bin/moerun ./usr/bin/moectl ./usr/bin/moebench ./usr/lib/libmoerun_client.a \
  ./usr/lib/cmake/moerun/moerunConfig.cmake ./usr/lib/cmake/moerun/moerunConfigVersion.cmake \
  ./usr/include/moerun/runtime/serving/serve_client.h ./usr/include/moerun/moerun/v1/serving.pb.h \
  ./usr/share/moerun/configs/tiny.yaml ./usr/lib/systemd/system/moerun.service \
  ./usr/$fixture/golden.safetensors ./usr/share/doc/moerun/PACKAGES.md; do
  grep -qx "$f" "$tmp/deb-files" || die "the package lacks $f"
done
echo "$(wc -l <"$tmp/deb-files") entries in $(basename "$deb")"

echo "== dpkg -i"
installed=1
dpkg -i "$deb"
[[ -f /etc/moerun/moerun.yaml && -f /etc/moerun/moerun.env ]] || die "postinst did not make /etc/moerun"

# From here on: the installed files only.
cd "$tmp"
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
unset LD_LIBRARY_PATH PYTHONPATH CMAKE_PREFIX_PATH
[[ $(command -v moerun) == /usr/bin/moerun ]] || die "moerun on PATH is $(command -v moerun)"
for b in moerun moectl moebench; do
  if readelf -d "/usr/bin/$b" | grep -Eq 'RUNPATH|RPATH'; then die "/usr/bin/$b has an RPATH"; fi
done

echo "== moerun --version"
/usr/bin/moerun --version | tee version.txt
grep -q "^moerun $version " version.txt || die "moerun --version does not say $version"

echo "== moerun forward on /usr/$fixture"
moerun forward --model "/usr/$fixture" --input "/usr/$fixture/golden.safetensors" \
  --output "$tmp/out.safetensors" --ranks 2 --threads 2 \
  --check "/usr/$fixture/golden.safetensors" --tolerance 1e-5
"$py" "$tensors" check "/usr/$fixture/golden.safetensors" output "$tmp/out.safetensors" 1e-5

echo "== moectl --help, moebench --help"
moectl --help | head -3
moebench --help | head -3

echo "== find_package(moerun) from a project outside the tree"
cp -r "$src/tests/deploy/consumer" "$tmp/consumer"
cmake -S "$tmp/consumer" -B "$tmp/consumer-build" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$tmp/consumer.log" 2>&1 &&
  cmake --build "$tmp/consumer-build" >>"$tmp/consumer.log" 2>&1 || { cat "$tmp/consumer.log" >&2; die "the consumer project did not build"; }
"$tmp/consumer-build/moerun_consumer"

echo "== the consumer against moerun serve (the systemd unit's /etc/moerun/moerun.yaml)"
# Four free ports in a row for the metrics endpoints (rank r: port + r), two more for the rest.
read -r listen control metrics < <("$py" - <<'PY'
import random, socket
def free(p):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p)); return True
    except OSError:
        return False
    finally:
        s.close()
while True:
    base = random.randrange(20000, 60000)
    if all(free(base + i) for i in range(6)):
        print(base, base + 1, base + 2); break
PY
)
moerun serve --config /etc/moerun/moerun.yaml --transport inproc \
  --listen "127.0.0.1:$listen" --control-listen "127.0.0.1:$control" \
  --metrics-listen "127.0.0.1:$metrics" --ready-file "$tmp/ready" >"$tmp/serve.log" 2>&1 &
serve_pid=$!
for _ in $(seq 600); do
  [[ -f $tmp/ready ]] && break
  kill -0 "$serve_pid" 2>/dev/null || { cat "$tmp/serve.log" >&2; die "moerun serve exited"; }
  sleep 0.1
done
[[ -f $tmp/ready ]] || { cat "$tmp/serve.log" >&2; die "moerun serve was not ready in 60 s"; }
read -r tokens hidden < <("$py" "$tensors" raw "/usr/$fixture/golden.safetensors" input "$tmp/in.f32")
"$tmp/consumer-build/moerun_consumer" "127.0.0.1:$listen" "$tmp/in.f32" "$tokens" "$hidden" "$tmp/served.f32"
"$py" "$tensors" check "/usr/$fixture/golden.safetensors" output "$tmp/served.f32" 1e-5
kill "$serve_pid"; wait "$serve_pid" 2>/dev/null || true; serve_pid=

if command -v systemd-analyze >/dev/null; then
  echo "== systemd-analyze verify"
  # Its own man-page lookups (Documentation=) are not what this checks.
  # Warnings (an unknown key, a typo) fail it too, not only errors.
  SYSTEMD_LOG_LEVEL=warning systemd-analyze verify --man=no /usr/lib/systemd/system/moerun.service \
    >"$tmp/verify.log" 2>&1 || { cat "$tmp/verify.log" >&2; die "systemd-analyze verify failed"; }
  [[ ! -s $tmp/verify.log ]] || { cat "$tmp/verify.log" >&2; die "systemd-analyze verify warned"; }
fi

echo "== dpkg --purge"
dpkg --purge moerun
installed=0
[[ ! -e /usr/bin/moerun && ! -e /usr/lib/cmake/moerun && ! -e /etc/moerun ]] || die "dpkg --purge left files behind"

echo "== cmake --install --prefix"
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
(cd "$tmp/prefix" && find . -type f | sort) >"$tmp/prefix-files"
for f in bin/moerun bin/moectl bin/moebench lib/libmoerun_client.a lib/libmoerun_base.a \
  lib/libmoerun_proto.a lib/cmake/moerun/moerunTargets.cmake lib/cmake/moerun/moerunConfig.cmake \
  include/moerun/runtime/serving/serve_client.h include/moerun/base/status.h \
  include/moerun/moerun/build_info.h share/moerun/configs/tiny.yaml \
  lib/systemd/system/moerun.service share/moerun/etc/moerun.yaml share/doc/moerun/README.md; do
  grep -qx "./$f" "$tmp/prefix-files" || die "cmake --install did not install $f"
done
cmake -S "$tmp/consumer" -B "$tmp/consumer-prefix" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  >"$tmp/consumer.log" 2>&1 && cmake --build "$tmp/consumer-prefix" >>"$tmp/consumer.log" 2>&1 ||
  { cat "$tmp/consumer.log" >&2; die "the consumer did not build against the cmake --install prefix"; }
"$tmp/consumer-prefix/moerun_consumer"
echo "package.sh: all checks passed ($(wc -l <"$tmp/prefix-files") files installed by cmake --install)"
