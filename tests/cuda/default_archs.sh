#!/bin/sh
# A configure without CUDA flags builds sm_80 and sm_90 SASS and compute_90 PTX, nothing older
# (cmake/Backends.cmake; CUDA 13's own default, sm_75, holds only traps for the tensor-core
# kernels). Configures the project in a temporary directory (removed on any exit), builds one
# small CUDA object and reads the architectures its fatbin names; then gives the cache CMake's own
# sm_75 entry (what a build directory configured before moerun chose its default holds) and
# checks that a reconfigure replaces it.
#   default_archs.sh SOURCE_DIR CUDA_COMPILER NINJA
set -eu
src=$1 nvcc=$2 ninja=$3
tmp=$(mktemp -d "${TMPDIR:-/tmp}/moerun-default-archs.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
trap 'exit 1' INT TERM HUP
fail() {
  echo "default_archs: $*" >&2
  exit 1
}
# No CUDAARCHS either: it would win over the default (as it should), not test it.
if ! env -u CUDAARCHS cmake -S "$src" -B "$tmp" -G Ninja -DCMAKE_MAKE_PROGRAM="$ninja" \
    -DCMAKE_CUDA_COMPILER="$nvcc" -DMOERUN_WITH_CUDA=ON -DMOERUN_BUILD_TESTS=OFF \
    -DMOERUN_WITH_NCCL=OFF -DMOERUN_WITH_UCX=OFF -DMOERUN_WITH_MPI=OFF -DMOERUN_BUILD_PYTHON=OFF \
    >"$tmp/configure.log" 2>&1; then
  cat "$tmp/configure.log" >&2
  fail "the configure failed"
fi
cached=$(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$tmp/CMakeCache.txt")
[ "$cached" = "80-real;90" ] || fail "CMakeCache.txt has CMAKE_CUDA_ARCHITECTURES=$cached, not 80-real;90"
obj=runtime/layer/CMakeFiles/moerun_layer_cuda.dir/cuda/cuda_device.cu.o
if ! "$ninja" -C "$tmp" "$obj" >"$tmp/build.log" 2>&1; then
  cat "$tmp/build.log" >&2
  fail "building $obj failed"
fi
archs=$(strings "$tmp/$obj" | grep -o 'sm_[0-9]*\|compute_[0-9]*' | sort -u | tr '\n' ' ')
echo "default_archs: CMAKE_CUDA_ARCHITECTURES=$cached; cuda_device.cu.o holds: $archs"
for want in sm_80 sm_90 compute_90; do
  case " $archs " in *" $want "*) ;; *) fail "no $want in $obj" ;; esac
done
for a in $archs; do
  n=${a#*_}
  [ "$n" -ge 80 ] || fail "$obj holds $a (older than sm_80)"
done

# An old build directory: CMake's own entry (help string "CUDA architectures"), sm_75.
awk 'skip && /^\/\// { next } { skip = 0 }
     /^\/\/CUDA architectures/ { print "//CUDA architectures"; skip = 1; next }
     /^CMAKE_CUDA_ARCHITECTURES:/ { print "CMAKE_CUDA_ARCHITECTURES:STRING=75"; next }
     { print }' "$tmp/CMakeCache.txt" >"$tmp/cache.old"
mv "$tmp/cache.old" "$tmp/CMakeCache.txt"
grep -q '^CMAKE_CUDA_ARCHITECTURES:STRING=75$' "$tmp/CMakeCache.txt" || fail "could not set up the old cache"
if ! env -u CUDAARCHS cmake "$tmp" >"$tmp/reconfigure.log" 2>&1; then
  cat "$tmp/reconfigure.log" >&2
  fail "the reconfigure failed"
fi
cached=$(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$tmp/CMakeCache.txt")
[ "$cached" = "80-real;90" ] || fail "a reconfigure kept CMake's old default: CMAKE_CUDA_ARCHITECTURES=$cached"
echo "default_archs: an old cache's sm_75 default becomes $cached on reconfigure"
