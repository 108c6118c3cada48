"""RemoteMoE against a 4-rank `moerun serve` (under mpirun) and LocalMoE / moerun.Layer in-process
give outputs bitwise equal to `moerun forward`, on every shipped fixture; the example's generated
tokens are the same both ways."""

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moerun  # noqa: E402
import moerun.job  # noqa: E402
import moerun.torch as mtorch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "data", "hf-moe")
sys.path.insert(0, HERE)
import safetensors_io  # noqa: E402

NAMES = sorted(d for d in os.listdir(FIXTURES)
               if os.path.isfile(os.path.join(FIXTURES, d, "golden.safetensors")))


def forward_cli(model, x, tmp_path):
    """What `moerun forward` answers for x [T, H]."""
    inp, out = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    safetensors_io.write_tensors(inp, {"input": x})
    r = subprocess.run([moerun.job.find_binary("moerun"), "forward", "--model", model, "--input",
                        inp, "--output", out], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return safetensors_io.read_tensors(out)["output"]


def test_every_fixture_is_checked():
    assert len(NAMES) >= 10, NAMES


@pytest.mark.parametrize("name", NAMES)
def test_remote_and_local_equal_forward_bitwise(name, tmp_path):
    model = os.path.join(FIXTURES, name)
    x = safetensors_io.read_tensors(os.path.join(model, "golden.safetensors"))["input"]
    want = forward_cli(model, x, tmp_path)
    hidden = x.shape[1]
    # [batch, seq, hidden] as a model hands it to its MoE block.
    xt = torch.from_numpy(np.ascontiguousarray(x)).reshape(1, x.shape[0], hidden)

    local = mtorch.LocalMoE(model)
    y_local = local(xt)
    assert y_local.shape == xt.shape and y_local.dtype == torch.float32
    assert np.array_equal(y_local.reshape(-1, hidden).numpy().view(np.uint32), want.view(np.uint32))

    with moerun.job.LocalJob(model, ranks=4) as job, moerun.Client(job.target) as client:
        remote = mtorch.RemoteMoE(client, 0, hidden_size=hidden)
        y_remote = remote(xt)
        assert y_remote.shape == xt.shape and y_remote.dtype == torch.float32
        assert np.array_equal(y_remote.reshape(-1, hidden).numpy().view(np.uint32),
                              want.view(np.uint32)), f"{name}: RemoteMoE differs from forward"
        # Row by row (other batch compositions) still the same bits.
        for t in (0, x.shape[0] - 1):
            y1 = remote(xt[:, t:t + 1])
            assert np.array_equal(y1.reshape(-1).numpy().view(np.uint32), want[t].view(np.uint32))


class _Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)


def test_replace_moe_blocks_by_hf_class_name(tmp_path):
    model_dir = os.path.join(FIXTURES, "qwen3_moe")
    x = safetensors_io.read_tensors(os.path.join(model_dir, "golden.safetensors"))["input"]
    hidden = x.shape[1]
    # A stand-in model tree with Hugging Face's names and class names.
    Qwen3MoeSparseMoeBlock = type("Qwen3MoeSparseMoeBlock", (torch.nn.Module,), {})
    layer = torch.nn.Module()
    layer.mlp = Qwen3MoeSparseMoeBlock()
    layer.self_attn = _Block(hidden)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([layer])
    model.config = type("Cfg", (), {"hidden_size": hidden})()

    class FakeClient:  # records the call; the real job is exercised above
        def infer(self, t, layer=None, deadline_ms=0):
            self.layer = layer
            return t * 2

    fc = FakeClient()
    replaced = mtorch.replace_moe_blocks(model, fc)
    assert replaced == ["model.layers.0.mlp"]
    assert isinstance(model.model.layers[0].mlp, mtorch.RemoteMoE)
    out, logits = model.model.layers[0].mlp(torch.ones(2, 3, hidden))
    assert logits is None and fc.layer == 0 and out.shape == (2, 3, hidden)
    with pytest.raises(ValueError, match=f"last dimension {hidden}"):
        model.model.layers[0].mlp(torch.ones(2, hidden + 1))
    assert mtorch.replace_moe_blocks(model, fc, layers=[5]) == []


def test_example_generates_the_same_tokens_both_ways():
    ex = os.path.join(ROOT, "examples", "python", "tiny_decoder.py")
    r = subprocess.run([sys.executable, ex, "--new-tokens", "8", "--json"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    import json

    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["identical"] and len(rep["remote_tokens"]) == 4 + 8, rep
