"""PyTorch modules that put a model's MoE layer on moerun.

    model = AutoModelForCausalLM.from_pretrained(...)        # attention etc. stay in PyTorch
    client = moerun.Client("127.0.0.1:7000")                 # a running `moerun serve`
    moerun.torch.replace_moe_blocks(model, client)           # every MoE block -> RemoteMoE

    moerun.torch.save_moe_checkpoint(model, "ckpt")          # its MoE blocks, for `moerun serve`
    moerun.torch.replace_moe_blocks_local(model, "ckpt")     # every MoE block -> LocalMoE

`RemoteMoE` sends its input to a running job for one model layer and returns the job's answer;
`LocalMoE` computes the same layer in this process with `moerun.Layer` (the same bits). Both take
`[..., hidden]` tensors of any leading shape, float32 (bfloat16 too for RemoteMoE: sent as BF16
and answered in BF16), and return a tensor of the input's shape, dtype and device.

They are for inference: the answer is not differentiable (autograd does not see the remote layer;
the output does not require grad). Hugging Face MoE blocks of some families return a tuple
(hidden states, router logits); the replacement returns (output, None) for those, since the
gate runs on the job (a model asked for its router logits, e.g. for an auxiliary loss, gets None).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional

import torch
from torch import nn

# Hugging Face MoE block classes by family, and whether their forward returns a tuple
# (hidden_states, router_logits) in the transformers releases that have them as modules. A block
# whose class is not listed can still be replaced by naming it in `classes`.
HF_MOE_BLOCKS: Dict[str, bool] = {
    "MixtralSparseMoeBlock": True,
    "Qwen2MoeSparseMoeBlock": True,
    "Qwen3MoeSparseMoeBlock": True,
    "DeepseekV3MoE": False,
    "GptOssMLP": True,
    "Step3p5MoEMLP": False,
}

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _check_input(x: torch.Tensor, hidden: Optional[int], who: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{who}: expected [..., hidden], got a 0-d tensor")
    if hidden is not None and x.shape[-1] != hidden:
        raise ValueError(f"{who}: expected the last dimension {hidden}, got shape {tuple(x.shape)}")


class RemoteMoE(nn.Module):
    """A model's MoE block computed by a running moerun job.

    client: a moerun.Client (or anything with its `infer`), shared by every RemoteMoE of a model.
    layer: the model layer the job serves for this block (None: the job's only or first layer).
    hidden_size: checked before sending when given (the job checks it anyway).
    returns_tuple: return (output, None) like the Hugging Face blocks that return router logits.
    deadline_ms: sent with each request (0: the job's default).
    """

    def __init__(self, client, layer: Optional[int] = None, *, hidden_size: Optional[int] = None,
                 returns_tuple: bool = False, deadline_ms: int = 0):
        super().__init__()
        self.client = client
        self.layer = layer
        self.hidden_size = hidden_size
        self.returns_tuple = returns_tuple
        self.deadline_ms = deadline_ms

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        _check_input(hidden_states, self.hidden_size, "RemoteMoE")
        x = hidden_states.detach()
        device = x.device
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()  # f16 and others are sent as F32 and answered in the input's dtype
        y = self.client.infer(x, layer=self.layer, deadline_ms=self.deadline_ms)
        y = y.to(device=device, dtype=hidden_states.dtype)
        return (y, None) if self.returns_tuple else y

    def extra_repr(self) -> str:
        return f"layer={self.layer}, hidden_size={self.hidden_size}"


class LocalMoE(nn.Module):
    """The same MoE layer computed in this process by moerun's CPU kernels (moerun.Layer).

    layer: a moerun.Layer, or a checkpoint folder to load one from (with `layer_index`).
    Output bits equal a job's answer for the same layer (batch-invariant kernels).
    """

    def __init__(self, layer, layer_index: int = -1, *, threads: int = 0,
                 returns_tuple: bool = False):
        super().__init__()
        if isinstance(layer, str):
            from moerun import Layer

            layer = Layer(layer, layer_index, threads)
        self.moe = layer
        self.returns_tuple = returns_tuple

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        _check_input(hidden_states, self.moe.hidden, "LocalMoE")
        x = hidden_states.detach().to("cpu", torch.float32).contiguous()
        y = torch.from_numpy(self.moe.forward(x.numpy()))
        y = y.to(device=hidden_states.device, dtype=hidden_states.dtype)
        return (y, None) if self.returns_tuple else y


def layer_index_of(name: str) -> Optional[int]:
    """The decoder layer a module's qualified name belongs to ("model.layers.3.mlp" -> 3)."""
    m = _LAYER_INDEX.search(name)
    return int(m.group(1)) if m else None


class MoeBlock(NamedTuple):
    """One MoE block of a model, as find_moe_blocks finds it."""

    name: str              # qualified module name, e.g. "model.layers.3.mlp"
    layer: Optional[int]   # its decoder layer (3), None when the name has no "layers.N"
    returns_tuple: bool    # its forward returns (hidden_states, router_logits)
    cls: str               # its class name, e.g. "Qwen3MoeSparseMoeBlock"


def find_moe_blocks(model: nn.Module, *, layers: Optional[Iterable[int]] = None,
                    classes: Optional[Dict[str, bool]] = None) -> List[MoeBlock]:
    """The model's MoE blocks, in module order: modules whose class is in HF_MOE_BLOCKS or in
    `classes` (name -> returns_tuple), limited to the decoder layers in `layers` when given.

    A model with several MoE blocks must name them by decoder layer ("...layers.N..."): a block
    whose layer cannot be told is a ValueError, since its requests would go to the job's first
    layer. Blocks inside a block (a MoE block nested in another) are not listed twice."""
    known = dict(HF_MOE_BLOCKS)
    if classes:
        known.update(classes)
    wanted = set(layers) if layers is not None else None
    found: List[MoeBlock] = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls not in known or not name:
            continue
        if any(name.startswith(b.name + ".") for b in found):
            continue
        idx = layer_index_of(name)
        if wanted is not None and idx not in wanted:
            continue
        found.append(MoeBlock(name, idx, known[cls], cls))
    unnamed = [b.name for b in found if b.layer is None]
    if unnamed and len(found) > 1:
        raise ValueError(f"{len(found)} MoE blocks, but {', '.join(unnamed)} has no decoder layer "
                         "index in its name (\"...layers.N...\"): each would be sent to the "
                         "job's first layer; replace them one by one with RemoteMoE(client, N)")
    seen: Dict[int, str] = {}
    for b in found:
        if b.layer is not None and b.layer in seen:
            raise ValueError(f"{seen[b.layer]} and {b.name} are both MoE blocks of decoder layer "
                             f"{b.layer}; a job serves one MoE layer per decoder layer")
        if b.layer is not None:
            seen[b.layer] = b.name
    return found


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


def replace_moe_blocks(model: nn.Module, client, *, layers: Optional[Iterable[int]] = None,
                       classes: Optional[Dict[str, bool]] = None,
                       deadline_ms: int = 0) -> List[str]:
    """Replaces the model's MoE blocks (HF_MOE_BLOCKS, plus `classes`: name -> returns_tuple) by
    RemoteMoE modules calling `client` for their decoder layer; `layers` limits it to those layer
    indices (the ones the job serves). Returns the qualified names replaced. The model's hidden
    size, when its config has one, is checked on every call. A layer the job does not serve is
    answered InvalidArgumentError ("layer N is not served (served: ...)") at the first call."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    targets = find_moe_blocks(model, layers=layers, classes=classes)
    for b in targets:
        _replace(model, b.name, RemoteMoE(client, b.layer, hidden_size=hidden,
                                          returns_tuple=b.returns_tuple, deadline_ms=deadline_ms))
    return [b.name for b in targets]


def replace_moe_blocks_local(model: nn.Module, checkpoint: str, *,
                             layers: Optional[Iterable[int]] = None,
                             classes: Optional[Dict[str, bool]] = None,
                             threads: int = 0) -> List[str]:
    """Replaces the model's MoE blocks, as replace_moe_blocks finds them, by LocalMoE modules
    computing their decoder layer of `checkpoint` (a folder moerun reads) in this process: the
    same bits a job serving that folder answers. `threads`: per layer (0: one per core). A block
    without a layer index in its name (the model's only one) gets the checkpoint's first MoE
    layer. Raises what moerun.Layer raises (FileNotFoundError, ValueError: e.g. a decoder layer
    that is not an MoE layer of the checkpoint)."""
    targets = find_moe_blocks(model, layers=layers, classes=classes)
    for b in targets:
        local = LocalMoE(checkpoint, -1 if b.layer is None else b.layer, threads=threads,
                         returns_tuple=b.returns_tuple)
        _replace(model, b.name, local)
    return [b.name for b in targets]


def _config_dict(config: Any) -> Dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):  # a transformers PretrainedConfig
        return dict(config.to_dict())
    if hasattr(config, "__dict__"):
        return {k: v for k, v in vars(config).items() if not k.startswith("_")}
    raise TypeError(f"config: expected a dict or a config object, got {type(config).__name__}")


def _tensor_bits(name: str, t: torch.Tensor):
    """(numpy array, safetensors dtype code or None) of a parameter, as it is stored."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype in (torch.float32, torch.float16):
        return t.numpy(), None
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy(), "BF16"
    raise ValueError(f"{name}: {t.dtype} tensors are not written (float32, float16, bfloat16)")


def save_moe_checkpoint(model: nn.Module, folder: str, config: Any = None, *,
                        classes: Optional[Dict[str, bool]] = None) -> List[str]:
    """Writes the model's MoE blocks (as find_moe_blocks finds them) as a checkpoint folder that
    `moerun serve` (`model: FOLDER`, `layers: all`), `moerun forward` and moerun.Layer read:
    `config.json` (`config`, a dict or a transformers-style config object; default model.config)
    and `model.safetensors` with every parameter and buffer of those blocks under its qualified
    name, in its dtype (float32, float16, bfloat16). Returns the tensor names written.

    The names are the state dict's, so they are the family's checkpoint names when the blocks
    are laid out as the published checkpoints are (e.g. `model.layers.N.mlp.experts.E.gate_proj
    .weight` for Qwen3-MoE, `model.layers.N.block_sparse_moe.experts.E.w1.weight` for Mixtral).
    The files are renamed into place, so a job serving the folder's previous files keeps them."""
    cfg = _config_dict(model.config if config is None else config)
    if not cfg.get("model_type"):
        raise ValueError("config has no \"model_type\" (moerun tells the family by it)")
    blocks = find_moe_blocks(model, classes=classes)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no MoE block (classes: "
                         f"{', '.join(sorted({**HF_MOE_BLOCKS, **(classes or {})}))})")
    from moerun import safetensors_io

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        raise ValueError(f"{index} exists, and moerun would read the shards it names instead of "
                         "model.safetensors: write into another folder")
    tensors: Dict[str, Any] = {}
    dtypes: Dict[str, str] = {}
    for b in blocks:
        block = model.get_submodule(b.name)
        for key, t in block.state_dict().items():
            name = f"{b.name}.{key}"
            tensors[name], code = _tensor_bits(name, t)
            if code:
                dtypes[name] = code
    os.makedirs(folder, exist_ok=True)
    safetensors_io.write_tensors(os.path.join(folder, "model.safetensors"), tensors,
                                 metadata={"format": "pt",
                                           "producer": "moerun.torch.save_moe_checkpoint"},
                                 dtypes=dtypes)
    path = os.path.join(folder, "config.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return list(tensors)
