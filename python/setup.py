"""`pip install ./python`: the package moerun (python/moerun) with the parts the build makes.

    cmake --build build                         # makes build/python/moerun/_layer*.so
    pip install --no-build-isolation ./python   # offline, in a venv made with --system-site-packages

build_py adds to the sources:
  - moerun.v1 (serving_pb2, control_pb2): protoc (on PATH, or $PROTOC) run on ../runtime/proto; without
    protoc, the classes a CMake build made are copied instead; with neither, the install fails
    and says why.
  - moerun._layer: the compiled layer, copied from $MOERUN_BUILD_DIR/python/moerun (default
    ../build), if a build for this Python is there. Without it the package installs without the
    compiled layer, and moerun.Layer raises ImportError saying so.
The metadata is in pyproject.toml.
"""

import functools
import glob
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PROTO_DIR = os.path.join(REPO, "runtime", "proto")
PROTOS = ["moerun/v1/serving.proto", "moerun/v1/control.proto"]


def build_dir():
    return os.path.abspath(os.environ.get("MOERUN_BUILD_DIR") or os.path.join(REPO, "build"))


@functools.lru_cache(maxsize=None)
def prebuilt_layer():
    """The compiled moerun._layer for this interpreter, or None (with a note why)."""
    folder = os.path.join(build_dir(), "python", "moerun")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    exact = os.path.join(folder, "_layer" + suffix)
    if os.path.isfile(exact):
        return exact
    others = sorted(glob.glob(os.path.join(folder, "_layer*.so")))
    if others:
        print(f"moerun setup: {', '.join(others)} is not built for this Python (wants _layer"
              f"{suffix}); installing without moerun.Layer", file=sys.stderr)
    else:
        print(f"moerun setup: no {exact} (build moerun with CMake first, or set "
              "MOERUN_BUILD_DIR); installing without moerun.Layer", file=sys.stderr)
    return None


class BuildPy(build_py):
    """build_py, plus moerun.v1 from protoc and the prebuilt moerun._layer."""

    def run(self):
        super().run()
        self.make_protos(os.path.join(self.build_lib, "moerun", "v1"))
        layer = prebuilt_layer()
        if layer:
            self.copy_file(layer, os.path.join(self.build_lib, "moerun", os.path.basename(layer)))

    def make_protos(self, out):
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "__init__.py"), "w", encoding="utf-8"):
            pass
        protoc = os.environ.get("PROTOC") or shutil.which("protoc")
        if protoc and os.path.isdir(PROTO_DIR):
            subprocess.run([protoc, "-I", PROTO_DIR, f"--python_out={self.build_lib}",
                            *(os.path.join(PROTO_DIR, p) for p in PROTOS)], check=True)
            return
        made = os.path.join(build_dir(), "python", "moerun", "v1")
        names = [os.path.basename(p).replace(".proto", "_pb2.py") for p in PROTOS]
        if all(os.path.isfile(os.path.join(made, n)) for n in names):
            print(f"moerun setup: no protoc; copying the protobuf classes from {made}",
                  file=sys.stderr)
            for n in names:
                self.copy_file(os.path.join(made, n), os.path.join(out, n))
            return
        why = (f"there is no {PROTO_DIR} (install from the repository's python/ folder)"
               if protoc else "protoc is not on PATH (apt install protobuf-compiler, or set PROTOC)")
        raise SystemExit(f"moerun setup: {why}, and no CMake build made the protobuf classes "
                         f"({made}): moerun.v1 cannot be made")


class MaybeBinaryDistribution(Distribution):
    """A wheel for this platform when it holds the compiled layer, a pure one otherwise."""

    def has_ext_modules(self):
        return prebuilt_layer() is not None


# The egg-info goes under build/, not next to the package: python/ is on sys.path where
# scripts/install-python-path.sh set it up, and a stray moerun.egg-info there would pass for an
# installed moerun. (Run as a script only: pip's backend runs it as __main__, and python/ being on
# sys.path must not make `import setup` build anything.)
if __name__ == "__main__":
    os.makedirs(os.path.join(HERE, "build"), exist_ok=True)
    setup(cmdclass={"build_py": BuildPy}, distclass=MaybeBinaryDistribution,
          options={"egg_info": {"egg_base": os.path.join(HERE, "build")}})
