"""moerun.Layer (the compiled moerun._layer) computes what `moerun forward` computes, bit for bit,
on every checkpoint fixture of tests/data/hf-moe, and keeps moerun's promises in Python: batch
invariance, the same bits on every ISA and thread count, the GIL released while it computes, and
errors as the right Python exceptions.

    PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_layer.py

The moerun binary: $MOERUN_BIN, else <repo>/build/bin/moerun.
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "data", "hf-moe")
sys.path.insert(0, HERE)
for p in (os.path.join(ROOT, "build", "python"), os.path.join(ROOT, "python")):
    if p not in sys.path:  # after PYTHONPATH's entries: a build named there wins
        sys.path.append(p)

import safetensors_io  # noqa: E402

import moerun  # noqa: E402
from moerun import _layer  # noqa: E402

MOERUN_BIN = os.environ.get("MOERUN_BIN") or os.path.join(ROOT, "build", "bin", "moerun")
NAMES = sorted(d for d in os.listdir(FIXTURES)
               if os.path.isfile(os.path.join(FIXTURES, d, "golden.safetensors")))
ISAS = _layer.build_info()["isa"]


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_bitwise(got, want):
    assert got.dtype == np.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    diff = np.flatnonzero(bits(got) != bits(want))
    assert diff.size == 0, f"{diff.size} of {want.size} values differ, first at {diff[0]}"


def golden(name):
    return safetensors_io.read_tensors(os.path.join(FIXTURES, name, "golden.safetensors"))


def run_forward(args, **kw):
    return subprocess.run([MOERUN_BIN, "forward", *args], capture_output=True, text=True,
                          timeout=120, **kw)


_layers = {}


def layer_of(name):
    """One Layer per fixture with the default settings, shared by the tests."""
    if name not in _layers:
        _layers[name] = moerun.Layer(os.path.join(FIXTURES, name))
    return _layers[name]


def test_every_fixture_is_checked():
    assert len(NAMES) >= 10, NAMES
    assert moerun.Layer is _layer.Layer


@pytest.mark.parametrize("name", NAMES)
def test_forward_equals_moerun_forward_bitwise(name, tmp_path):
    model = os.path.join(FIXTURES, name)
    out = str(tmp_path / "out.safetensors")
    r = run_forward(["--model", model, "--input", os.path.join(model, "golden.safetensors"),
                     "--output", out])
    assert r.returncode == 0, r.stderr
    want = safetensors_io.read_tensors(out)["output"]
    g = golden(name)
    layer = layer_of(name)
    y = layer.forward(g["input"])
    assert_bitwise(y, want)
    ref = g["output"].astype(np.float64)
    rel = np.linalg.norm(y.astype(np.float64) - ref) / np.linalg.norm(ref)
    assert rel <= 1e-5, rel


@pytest.mark.parametrize("name", NAMES)
def test_properties(name):
    layer = layer_of(name)
    spec = json.load(open(os.path.join(FIXTURES, name, "config.json")))
    assert layer.hidden == spec["hidden_size"] == golden(name)["input"].shape[1]
    assert layer.family == spec["model_type"]
    assert layer.layer == 0
    assert 1 <= layer.top_k <= layer.num_experts
    assert layer.isa == _layer.build_info()["default_isa"]
    assert layer.threads >= 1  # one per core
    want_dtype = {"mixtral_f16": "f16", "qwen3_moe_bf16": "bf16", "deepseek_v3_fp8": "fp8",
                  "gpt_oss_mxfp4": "mxfp4"}.get(name, "f32")
    assert layer.weight_dtype == want_dtype
    text = repr(layer)
    assert layer.family in text and f"hidden {layer.hidden}" in text and want_dtype in text


@pytest.mark.parametrize("name", NAMES)
def test_batch_invariance(name):
    layer = layer_of(name)
    x = golden(name)["input"][:12]
    y = layer.forward(x)
    for t in range(x.shape[0]):
        assert_bitwise(layer.forward(x[t:t + 1]), y[t:t + 1])
        assert_bitwise(layer.forward(x[t]), y[t])  # 1-D: one token
    # Leading dimensions are flattened: [2, 3, H] is the rows of [6, H].
    x6 = x[:6]
    assert_bitwise(layer.forward(x6.reshape(2, 3, -1)), y[:6].reshape(2, 3, -1))
    # Strided and Fortran-ordered inputs are read as their values, not their memory.
    assert_bitwise(layer.forward(x[::2]), y[::2])
    assert_bitwise(layer.forward(np.asfortranarray(x6)), y[:6])
    # Reversed order: each token its own bits.
    assert_bitwise(layer.forward(x[::-1].copy()), y[::-1])
    assert layer.forward(x[:0]).shape == (0, layer.hidden)


@pytest.mark.parametrize("name", NAMES)
def test_every_isa_and_thread_count_bitwise(name):
    model = os.path.join(FIXTURES, name)
    x = golden(name)["input"]
    want = layer_of(name).forward(x)
    for isa in ISAS:
        layer = moerun.Layer(model, isa=isa, threads=1 if isa == "scalar" else 2)
        assert layer.isa == isa
        assert_bitwise(layer.forward(x), want)
    one = moerun.Layer(model, threads=1)
    assert one.threads == 1
    assert_bitwise(one.forward(x), want)


def test_avx512_only_where_supported():
    model = os.path.join(FIXTURES, "mixtral")
    if "avx512" in ISAS:
        assert moerun.Layer(model, isa="avx512").isa == "avx512"
    else:
        with pytest.raises(ValueError, match="supports up to"):
            moerun.Layer(model, isa="avx512")
    with pytest.raises(ValueError, match="scalar, avx2 or avx512"):
        moerun.Layer(model, isa="sse9")


def test_build_info():
    info = _layer.build_info()
    assert info["version"] == moerun.__version__
    assert info["isa"][0] == "scalar" and info["best_isa"] == info["isa"][-1]


def test_threads_compute_in_parallel_and_right():
    """Two Python threads on two Layers at once, a third running Python meanwhile: every answer is
    the one computed alone. No timing is asserted."""
    names = ["mixtral", "qwen3_moe"]
    xs = {n: np.tile(golden(n)["input"], (4, 1)) for n in names}
    want = {n: layer_of(n).forward(xs[n]) for n in names}
    layers = {n: moerun.Layer(os.path.join(FIXTURES, n)) for n in names}
    errors, ticks, stop = [], [0], threading.Event()

    def work(n):
        try:
            for _ in range(10):
                assert_bitwise(layers[n].forward(xs[n]), want[n])
        except BaseException as e:  # noqa: B902: reported below
            errors.append(e)

    def python_code():
        while not stop.is_set():
            ticks[0] += 1
            sum(range(100))

    spinner = threading.Thread(target=python_code)
    spinner.start()
    workers = [threading.Thread(target=work, args=(n,)) for n in names]
    # The same Layer from two threads: calls take turns (a mutex per Layer), answers stay right.
    workers += [threading.Thread(target=work, args=("mixtral",))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    stop.set()
    spinner.join(timeout=60)
    assert not errors, errors
    assert not any(w.is_alive() for w in workers)
    assert ticks[0] > 0


def test_gil_released_during_forward():
    """With a switch interval of an hour this thread keeps the GIL unless a call gives it up, so a
    thread waiting for the GIL counts only while forward has released it."""
    layer = layer_of("mixtral")
    x = np.tile(golden("mixtral")["input"], (32, 1))  # some milliseconds a call
    count, stop, started = [0], threading.Event(), threading.Event()

    def counter():
        started.set()
        while not stop.is_set():
            count[0] += 1
            time.sleep(0)  # gives the GIL back at once

    old = sys.getswitchinterval()
    t = threading.Thread(target=counter)
    t.start()
    started.wait()
    released = 0
    sys.setswitchinterval(3600)
    try:
        for _ in range(200):  # until the counter was woken in time (a loaded machine is slow)
            c0 = count[0]
            layer.forward(x)
            released += count[0] != c0
            if released >= 3:
                break
    finally:
        sys.setswitchinterval(old)
        stop.set()
        t.join()
    assert released > 0, "the counting thread never ran while forward computed"


def test_missing_folder(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        moerun.Layer(missing)


def test_folder_without_weights(tmp_path):
    shutil.copy(os.path.join(FIXTURES, "mixtral", "config.json"), tmp_path)
    with pytest.raises(FileNotFoundError):
        moerun.Layer(str(tmp_path))


def test_bad_config(tmp_path):
    spec = json.load(open(os.path.join(FIXTURES, "mixtral", "config.json")))
    spec["num_experts_per_tok"] = spec["num_local_experts"] + 1  # top-k above the expert count
    (tmp_path / "config.json").write_text(json.dumps(spec))
    os.symlink(os.path.join(FIXTURES, "mixtral", "model.safetensors"),
               tmp_path / "model.safetensors")
    with pytest.raises(ValueError):
        moerun.Layer(str(tmp_path))


def test_corrupt_tensors(tmp_path):
    shutil.copy(os.path.join(FIXTURES, "mixtral", "config.json"), tmp_path)
    data = open(os.path.join(FIXTURES, "mixtral", "model.safetensors"), "rb").read()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(RuntimeError, match="model.safetensors"):
        moerun.Layer(str(tmp_path))


def test_layer_that_is_not_moe(tmp_path):
    model = os.path.join(FIXTURES, "deepseek_v3")
    with pytest.raises(ValueError, match="beyond"):
        moerun.Layer(model, layer=5)
    # Two decoder layers, the first dense: layer 0 is not an MoE layer.
    spec = json.load(open(os.path.join(model, "config.json")))
    spec["num_hidden_layers"], spec["first_k_dense_replace"] = 2, 1
    (tmp_path / "config.json").write_text(json.dumps(spec))
    os.symlink(os.path.join(model, "model.safetensors"), tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="dense layer"):
        moerun.Layer(str(tmp_path), layer=0)
    with pytest.raises(ValueError):
        moerun.Layer(model, layer=-2)
    with pytest.raises(ValueError, match="threads"):
        moerun.Layer(model, threads=-1)


def test_bad_inputs():
    layer = layer_of("mixtral")
    h = layer.hidden
    with pytest.raises(ValueError, match=f"last dimension {h + 1}.*hidden size is {h}"):
        layer.forward(np.zeros((2, h + 1), np.float32))
    with pytest.raises(ValueError, match="float32.*float64"):
        layer.forward(np.zeros((2, h), np.float64))
    with pytest.raises(ValueError, match="float32"):
        layer.forward(np.zeros((2, h), np.float16))
    with pytest.raises(ValueError, match="float32"):
        layer.forward(np.zeros((2, h), np.int32))
    with pytest.raises(ValueError, match="float32"):
        layer.forward(np.zeros((2, h), ">f4"))  # float32, but not in this machine's byte order
    with pytest.raises(ValueError, match="0-d"):
        layer.forward(np.array(1.0, np.float32))
    with pytest.raises(TypeError, match="numpy"):
        layer.forward([[0.0] * h])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_rejected_as_moerun_forward_does(bad, tmp_path):
    layer = layer_of("mixtral")
    x = golden("mixtral")["input"][:4].copy()
    x[2, 5] = bad
    with pytest.raises(ValueError, match="not finite at token 2, column 5"):
        layer.forward(x)
    # moerun forward refuses the same input (InvalidArgument: exit 2), naming the token.
    inp, out = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    safetensors_io.write_tensors(inp, {"input": x})
    r = run_forward(["--model", os.path.join(FIXTURES, "mixtral"), "--input", inp,
                     "--output", out])
    assert r.returncode != 0 and "non-finite" in r.stderr and "token 2" in r.stderr, r.stderr
