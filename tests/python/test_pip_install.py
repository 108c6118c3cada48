"""`pip install ./python` works offline in a user's venv (made with --system-site-packages, for
numpy, protobuf, setuptools and wheel): the package, the protobuf classes protoc makes, and the
compiled moerun._layer of the CMake build; without that build, moerun.Layer raises ImportError.

Copies python/ and runtime/proto/ to a temporary folder first, so that pip's in-tree build writes
nothing into the repository. Skipped where venv/ensurepip (python3-venv) is missing.
"""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
BUILD = os.path.abspath(os.environ.get("MOERUN_BUILD_DIR") or os.path.join(ROOT, "build"))

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("venv", "ensurepip", "setuptools", "wheel")),
    reason="needs venv, ensurepip, setuptools and wheel (python3-venv, python3-setuptools, "
           "python3-wheel)")

# Only the venv's moerun: a checkout that a moerun.pth of the system's site-packages puts on
# sys.path (scripts/install-python-path.sh) would otherwise join the package (extend_path).
CHECK = """
import os, sys
sys.path = [p for p in sys.path
            if p.startswith(sys.prefix) or not os.path.isdir(os.path.join(p, "moerun"))]
import moerun, moerun.v1.serving_pb2, moerun.v1.control_pb2
for f in [moerun.__file__, moerun.v1.serving_pb2.__file__] + list(moerun.__path__):
    assert f.startswith(sys.prefix), (f, sys.prefix)
r = moerun.v1.serving_pb2.InferRequest()
print("layer:", moerun.Layer.__module__)
try:
    moerun.Layer(os.environ["MODEL"])
    import moerun._layer
    assert moerun._layer.__file__.startswith(sys.prefix), moerun._layer.__file__
    print("loaded")
except ImportError as e:
    print("ImportError:", e)
"""


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1", **extra)
    return env


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
    return r


def test_pip_install_into_a_venv(tmp_path):
    src = tmp_path / "repo"
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    shutil.copytree(os.path.join(ROOT, "python"), src / "python", ignore=ignore)
    shutil.copytree(os.path.join(ROOT, "runtime", "proto"), src / "runtime" / "proto")
    venv = tmp_path / "venv"
    r = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "ensurepip" in (r.stdout + r.stderr):
        pytest.skip("python3 -m venv cannot install pip here: " + r.stderr.strip()[-200:])
    assert r.returncode == 0, r.stderr
    py = str(venv / "bin" / "python")
    model = os.path.join(ROOT, "tests", "data", "hf-moe", "mixtral")
    have_layer = any(f.startswith("_layer") and f.endswith(".so")
                     for f in os.listdir(os.path.join(BUILD, "python", "moerun"))
                     ) if os.path.isdir(os.path.join(BUILD, "python", "moerun")) else False

    install = [py, "-m", "pip", "install", "-q", "--no-build-isolation", str(src / "python")]
    run(install, env=clean_env(MOERUN_BUILD_DIR=BUILD), cwd=str(tmp_path))
    r = run([py, "-c", CHECK], env=clean_env(MODEL=model), cwd=str(tmp_path))
    if have_layer:
        assert "layer: moerun._layer" in r.stdout and "loaded" in r.stdout, r.stdout
    else:
        assert "ImportError" in r.stdout, r.stdout

    # Without a build (protoc makes moerun.v1): installs, and moerun.Layer says what is missing.
    if shutil.which("protoc"):
        empty = tmp_path / "no-build"
        empty.mkdir()
        run(install + ["--force-reinstall", "--no-deps"], env=clean_env(MOERUN_BUILD_DIR=str(empty)),
            cwd=str(tmp_path))
        r = run([py, "-c", CHECK], env=clean_env(MODEL=model), cwd=str(tmp_path))
        assert "ImportError: moerun.Layer needs the compiled module" in r.stdout, r.stdout
