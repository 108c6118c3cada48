"""RemoteMoE against a 4-rank `moerun serve` (under mpirun) and LocalMoE / moerun.Layer in-process
give outputs bitwise equal to `moerun forward`, on every shipped fixture; the example's generated
tokens are the same both ways. Models with several MoE layers (examples/python/hf_decoder.py's
Hugging Face-shaped ones): their MoE blocks written by save_moe_checkpoint and read by moerun,
every block replaced by replace_moe_blocks (a job serving `layers: all`) and by
replace_moe_blocks_local, bitwise the same logits."""

import copy
import json
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


# --- several MoE layers: find_moe_blocks, save_moe_checkpoint, replace_moe_blocks(_local) -------

sys.path.insert(0, os.path.join(ROOT, "examples", "python"))
import hf_decoder  # noqa: E402  (Hugging Face-shaped Qwen3-MoE and Mixtral models)


def small_model(family="qwen3_moe", seed=0, **changes):
    """An HF-shaped model, smaller than the example's (3 decoder layers, hidden 64)."""
    cfg = {**hf_decoder.CONFIGS[family], "hidden_size": 64, "num_hidden_layers": 3,
           "vocab_size": 128, **changes}
    torch.manual_seed(seed)
    return hf_decoder.MODELS[family](hf_decoder.Config(**cfg), seed).eval()


def logits(model, ids=(1, 2, 3, 4, 5)):
    with torch.no_grad():
        return model(torch.tensor([list(ids)]))


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_save_moe_checkpoint_writes_the_moe_blocks_only(tmp_path):
    model = small_model(mlp_only_layers=[1])  # layer 1 dense: no MoE block, nothing written
    blocks = mtorch.find_moe_blocks(model)
    assert [(b.name, b.layer, b.cls) for b in blocks] == [
        ("model.layers.0.mlp", 0, "Qwen3MoeSparseMoeBlock"),
        ("model.layers.2.mlp", 2, "Qwen3MoeSparseMoeBlock")]
    ckpt = str(tmp_path / "ckpt")
    names = mtorch.save_moe_checkpoint(model, ckpt)
    state = model.state_dict()
    written = safetensors_io.read_tensors(os.path.join(ckpt, "model.safetensors"))
    assert sorted(written) == sorted(names)
    assert all(n.startswith(("model.layers.0.mlp.", "model.layers.2.mlp.")) for n in names)
    assert len(names) == 2 * (1 + 3 * model.config.num_experts)
    for n in names:
        assert np.array_equal(written[n].view(np.uint32), state[n].numpy().view(np.uint32)), n
    with open(os.path.join(ckpt, "config.json")) as f:
        assert json.load(f) == model.config.to_dict()
    # moerun reads it: the MoE layers are 0 and 2, and each computes what the block computes.
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(3))
    for b in blocks:
        layer = moerun.Layer(ckpt, b.layer)
        want = model.get_submodule(b.name)(x)[0]
        got = torch.from_numpy(layer.forward(x.numpy()))
        assert rel(got, want) < 1e-5, b.name
    with pytest.raises(ValueError, match="layer 1 is a dense layer, not an MoE layer"):
        moerun.Layer(ckpt, 1)


def test_save_moe_checkpoint_bf16_blocks(tmp_path):
    model = small_model("mixtral")
    for b in mtorch.find_moe_blocks(model):
        model.get_submodule(b.name).to(torch.bfloat16)
    ckpt = str(tmp_path / "ckpt")
    mtorch.save_moe_checkpoint(model, ckpt)
    with open(os.path.join(ckpt, "model.safetensors"), "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    gate = header["model.layers.2.block_sparse_moe.gate.weight"]
    assert gate["dtype"] == "BF16" and gate["shape"] == [8, 64]
    # The same layer in float32 with the bf16 values: moerun computes it from the BF16 weights.
    block = model.get_submodule("model.layers.2.block_sparse_moe").float()
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(4))
    got = torch.from_numpy(moerun.Layer(ckpt, 2).forward(x.numpy()))
    assert rel(got, block(x)[0]) < 1e-5


def test_save_moe_checkpoint_errors(tmp_path):
    model = small_model()
    with pytest.raises(ValueError, match="model_type"):
        mtorch.save_moe_checkpoint(model, str(tmp_path / "a"), {"hidden_size": 64})
    with pytest.raises(ValueError, match="has no MoE block"):
        mtorch.save_moe_checkpoint(torch.nn.Linear(2, 2), str(tmp_path / "b"),
                                   {"model_type": "qwen3_moe"})
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="index.json exists"):
        mtorch.save_moe_checkpoint(model, str(tmp_path / "c"))


def test_find_moe_blocks_needs_a_layer_per_block():
    Qwen3MoeSparseMoeBlock = type("Qwen3MoeSparseMoeBlock", (torch.nn.Module,), {})
    two = torch.nn.Module()
    two.a, two.b = Qwen3MoeSparseMoeBlock(), Qwen3MoeSparseMoeBlock()
    with pytest.raises(ValueError, match="no decoder layer index"):
        mtorch.find_moe_blocks(two)
    one = torch.nn.Module()
    one.moe = Qwen3MoeSparseMoeBlock()
    one.moe.inner = Qwen3MoeSparseMoeBlock()  # a block inside a block: listed once
    assert [(b.name, b.layer) for b in mtorch.find_moe_blocks(one)] == [("moe", None)]
    same = torch.nn.Module()
    same.layers = torch.nn.ModuleList([torch.nn.Module()])
    same.layers[0].mlp, same.layers[0].moe = Qwen3MoeSparseMoeBlock(), Qwen3MoeSparseMoeBlock()
    with pytest.raises(ValueError, match="both MoE blocks of decoder layer 0"):
        mtorch.find_moe_blocks(same)
    model = small_model()
    assert [b.layer for b in mtorch.find_moe_blocks(model, layers=[2, 0])] == [0, 2]


def test_local_job_layers():
    with pytest.raises(ValueError, match="\"all\""):
        moerun.job.LocalJob(FIXTURES, layers="every")
    assert moerun.job.LocalJob(FIXTURES, layers="all").layers == "all"
    assert moerun.job.LocalJob(FIXTURES, layers=(2, 0)).layers == [2, 0]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_replace_every_moe_layer_remote_and_local(family, tmp_path):
    """Every MoE layer of a 3-layer model on a 4-rank job (`layers: all`): the logits are those
    of every layer in process, bit for bit, and those of the PyTorch blocks up to rounding; a
    block of a layer the job does not serve is told so at its first call."""
    model = small_model(family)
    ckpt = str(tmp_path / "ckpt")
    mtorch.save_moe_checkpoint(model, ckpt)
    want = logits(model)
    local = copy.deepcopy(model)
    names = mtorch.replace_moe_blocks_local(local, ckpt)
    attr = "mlp" if family == "qwen3_moe" else "block_sparse_moe"
    assert names == [f"model.layers.{i}.{attr}" for i in range(3)]
    assert all(isinstance(local.get_submodule(n), mtorch.LocalMoE) for n in names)
    y_local = logits(local)
    assert rel(y_local, want) < 1e-5
    with moerun.job.LocalJob(ckpt, ranks=4, layers="all") as job, \
            moerun.Client(job.target) as client:
        remote = copy.deepcopy(model)
        assert mtorch.replace_moe_blocks(remote, client) == names
        assert [remote.get_submodule(n).layer for n in names] == [0, 1, 2]
        y_remote = logits(remote)
        assert np.array_equal(y_remote.numpy().view(np.uint32), y_local.numpy().view(np.uint32))
        # One layer remote, the others PyTorch's.
        mixed = copy.deepcopy(model)
        assert mtorch.replace_moe_blocks(mixed, client, layers=[1]) == [names[1]]
        assert rel(logits(mixed), want) < 1e-5
        # A model with a fourth MoE layer, which the job does not serve.
        bigger = small_model(family, num_hidden_layers=4)
        mtorch.replace_moe_blocks(bigger, client)
        with pytest.raises(moerun.InvalidArgumentError, match="layer 3 is not served"):
            logits(bigger)
