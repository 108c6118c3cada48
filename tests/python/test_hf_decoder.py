"""examples/python/hf_decoder.py: a Hugging Face-shaped MoE decoder (random weights from a seed)
with every MoE layer served by a 4-rank `moerun serve` job under mpirun generates the same
tokens, and every step's logits bit for bit, as with the layers in process (moerun.Layer); its
logits are those of the model's own PyTorch MoE blocks up to float rounding. Its exit codes: 0
the same, 1 different (a job serving another seed's weights), 2 bad arguments (a --target that
is unreachable or does not serve every MoE layer among them).

    PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_hf_decoder.py
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import moerun.job  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
EXAMPLE = os.path.join(ROOT, "examples", "python", "hf_decoder.py")
PROMPT = [1, 2, 3, 4]
NEW = 8


@pytest.fixture(scope="module")
def mpirun(needs_build):
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found")


def example(*args, timeout=300):
    return subprocess.run([sys.executable, EXAMPLE, *args], capture_output=True, text=True,
                          timeout=timeout)


def report(r):
    assert r.stdout.strip(), r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family,layers", [("qwen3_moe", 4), ("mixtral", 4)])
def test_every_moe_layer_remote_same_tokens_as_in_process(mpirun, family, layers):
    r = example("--family", family, "--new-tokens", str(NEW), "--json", "--bench")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = report(r)
    assert rep["model_type"] == family and rep["local_job"], rep
    assert rep["moe_layers"] == list(range(layers)), rep  # every decoder layer, each remote
    assert rep["identical"] and rep["tokens_identical"] and rep["logits_identical"], rep
    assert rep["remote_tokens"] == rep["local_tokens"], rep
    assert rep["remote_tokens"][:len(PROMPT)] == PROMPT and len(rep["remote_tokens"]) == 4 + NEW
    # moerun's layers compute what the model's own PyTorch blocks compute (float32 rounding).
    assert rep["torch_first_logits_rel_err"] < 1e-5, rep
    for way in ("remote", "local", "torch"):
        assert set(rep[way]) == {"tokens_per_s", "ttft_ms", "ms_per_output_token"}, rep


@pytest.fixture(scope="module")
def saved(mpirun, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hf_decoder") / "ckpt")
    r = example("--save", folder)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "serve.yaml" in r.stdout and "--target" in r.stdout, r.stdout
    return folder


def test_save_writes_a_checkpoint_moerun_serves(saved):
    with open(os.path.join(saved, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "qwen3_moe" and cfg["num_hidden_layers"] == 4
    from moerun.safetensors_io import read_tensors

    names = set(read_tensors(os.path.join(saved, "model.safetensors")))
    experts = cfg["num_experts"]
    assert len(names) == 4 * (1 + 3 * experts), len(names)  # gate + 3 matrices an expert
    assert "model.layers.3.mlp.experts.0.gate_proj.weight" in names
    assert not any("self_attn" in n or "embed" in n for n in names)
    with open(os.path.join(saved, "serve.yaml")) as f:
        yaml = f.read()
    assert "layers: all" in yaml and "model: ." in yaml


def test_target_a_job_of_the_saved_checkpoint(saved):
    """--target: the same seed's job agrees (0); another seed's weights give other answers (1)."""
    with moerun.job.LocalJob(saved, ranks=4, layers="all", batching={"max_wait_us": 0}) as job:
        r = example("--target", job.target, "--new-tokens", str(NEW), "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        rep = report(r)
        assert rep["identical"] and not rep["local_job"] and rep["target"] == job.target, rep
        r = example("--target", job.target, "--new-tokens", str(NEW), "--seed", "1")
        assert r.returncode == 1, r.stdout + r.stderr
        assert "DIFFERENT" in r.stdout and "--seed" in r.stdout, r.stdout


def test_target_that_does_not_serve_every_layer(saved):
    with moerun.job.LocalJob(saved, ranks=4, layers=[0, 1, 2]) as job:
        r = example("--target", job.target, "--new-tokens", "2")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "model.layers.3.mlp" in r.stderr and "layer 3 is not served" in r.stderr, r.stderr


# The argument checks, in this process (the script's main(); a subprocess each would spend
# seconds importing torch again).
sys.path.insert(0, os.path.dirname(EXAMPLE))
import hf_decoder  # noqa: E402


def main_exit_code(args, capsys):
    try:
        code = hf_decoder.main(list(args))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--new-tokens", "0"], "--new-tokens must be at least 1"),
    (["--prompt", "1,x"], "--prompt: not comma-separated integers"),
    (["--prompt", "1,512"], "--prompt: token ids must be in [0, 512)"),
    (["--family", "llama"], "invalid choice"),
    (["--config", "/nonexistent/config.json"], "--config: [Errno 2]"),
    (["--ranks", "1"], "--ranks must be at least 2"),
])
def test_bad_arguments_exit_2(needs_build, capsys, args, message):
    code, err = main_exit_code(args, capsys)
    assert code == 2 and message in err, err


def test_config_of_another_family_exits_2(needs_build, capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "deepseek_v3", "hidden_size": 64}))
    code, err = main_exit_code(["--config", str(cfg)], capsys)
    assert code == 2 and "model_type 'deepseek_v3'" in err, err
    cfg.write_text(json.dumps({"model_type": "mixtral", "hidden_size": 64}))
    code, err = main_exit_code(["--config", str(cfg)], capsys)
    assert code == 2 and "mixtral needs vocab_size" in err, err


def test_unreachable_target_exits_2(needs_build, capsys):
    port = moerun.job.free_port()  # nothing listens there
    code, err = main_exit_code(["--target", f"127.0.0.1:{port}", "--new-tokens", "2"], capsys)
    assert code == 2 and f"--target 127.0.0.1:{port}: " in err, err


def test_config_moerun_does_not_serve_exits_2(needs_build, capsys, tmp_path):
    """PyTorch builds it (gelu experts), moerun refuses it: told before any job starts."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**hf_decoder.CONFIGS["qwen3_moe"], "hidden_act": "gelu"}))
    code, err = main_exit_code(["--config", str(cfg)], capsys)
    assert code == 2, err
    assert "moerun does not serve this model" in err and "hidden_act" in err, err


def test_save_into_a_folder_of_shards_exits_2(needs_build, capsys, tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    code, err = main_exit_code(["--save", str(tmp_path)], capsys)
    assert code == 2 and "index.json exists" in err, err


def test_no_mpirun_exits_3(needs_build, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # the local job's launcher is not there
    code, err = main_exit_code(["--new-tokens", "2"], capsys)
    assert code == 3 and "the local job did not start: mpirun not found" in err, err
