"""PyTorch modules that put a model's MoE layer on moerun.

    model = AutoModelForCausalLM.from_pretrained(...)        # attention etc. stay in PyTorch
    client = moerun.Client("127.0.0.1:7000")                 # a running `moerun serve`
    moerun.torch.replace_moe_blocks(model, client)           # every MoE block -> RemoteMoE

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

import re
from typing import Dict, Iterable, List, Optional

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


def replace_moe_blocks(model: nn.Module, client, *, layers: Optional[Iterable[int]] = None,
                       classes: Optional[Dict[str, bool]] = None,
                       deadline_ms: int = 0) -> List[str]:
    """Replaces the model's MoE blocks (HF_MOE_BLOCKS, plus `classes`: name -> returns_tuple) by
    RemoteMoE modules calling `client` for their decoder layer; `layers` limits it to those layer
    indices (the ones the job serves). Returns the qualified names replaced. The model's hidden
    size, when its config has one, is checked on every call."""
    known = dict(HF_MOE_BLOCKS)
    if classes:
        known.update(classes)
    wanted = set(layers) if layers is not None else None
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    targets = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls not in known or not name:
            continue
        idx = layer_index_of(name)
        if wanted is not None and idx not in wanted:
            continue
        targets.append((name, idx, known[cls]))
    for name, idx, returns_tuple in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, RemoteMoE(client, idx, hidden_size=hidden, returns_tuple=returns_tuple,
                                        deadline_ms=deadline_ms))
    return [t[0] for t in targets]
