#!/usr/bin/env python3
"""A Hugging Face-shaped MoE decoder in plain PyTorch, with every MoE layer served by moerun.

The model is laid out as transformers' modeling code lays out Qwen3-MoE (or Mixtral): the same
module names (`model.embed_tokens`, `model.layers.N.self_attn.q_proj`, `model.layers.N.mlp.gate`,
`model.layers.N.mlp.experts.E.gate_proj`, ..., `lm_head`) and class names
(`Qwen3MoeForCausalLM`, `Qwen3MoeDecoderLayer`, `Qwen3MoeSparseMoeBlock`, ...), built from a
config.json-style dict (a scaled-down Qwen3-30B-A3B by default: 4 decoder layers, each MoE) with
random weights from a seed; no transformers and no hub needed. The script

1. writes the MoE blocks' weights as a checkpoint folder (config.json + model.safetensors with
   the family's tensor names: moerun.torch.save_moe_checkpoint),
2. starts `mpirun -np 4 moerun serve` on it with `layers: all` (or uses your job: --target),
3. replaces every MoE block by a RemoteMoE (moerun.torch.replace_moe_blocks) and generates
   tokens greedily (prefill, then one token at a time with a KV cache),
4. does it again in process, every MoE block a LocalMoE (moerun.Layer), and once more with the
   model's own PyTorch MoE blocks (the reference: same math, other rounding),

and compares: the job's answers are bitwise those of the in-process layers, so the tokens and
every step's logits must be the same. The PyTorch blocks' run is reported beside them (its
logits' relative difference at the first step, and its tokens), not compared bit for bit.

    python3 examples/python/hf_decoder.py                        # qwen3_moe, both ways compared
    python3 examples/python/hf_decoder.py --family mixtral --new-tokens 32 --bench
    python3 examples/python/hf_decoder.py --config my_config.json  # a config.json of your own
    python3 examples/python/hf_decoder.py --save /tmp/hfd        # checkpoint + serve.yaml only
    mpirun --oversubscribe --bind-to none -np 4 build/bin/moerun serve \\
        --config /tmp/hfd/serve.yaml &                             # your job serving it
    python3 examples/python/hf_decoder.py --target 127.0.0.1:5700  # that job, same seed

Exit code 0 when the job's tokens and logits equal the in-process ones, 1 when they differ, 2 on
bad arguments (including a --target that cannot be reached or does not serve every MoE layer of
the model, and a config moerun does not serve), 3 when the local job could not be started (no
mpirun, no moerun binary or compiled moerun.Layer) or the job failed while generating.
"""

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Dict, List, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "build", "python")]

import moerun  # noqa: E402
import moerun.job  # noqa: E402
import moerun.torch as mtorch  # noqa: E402

# Scaled-down configs of the published models, with their keys (Qwen/Qwen3-30B-A3B,
# mistralai/Mixtral-8x7B-v0.1): small enough that a 4-rank job on 2 cores serves them in seconds.
CONFIGS: Dict[str, Dict] = {
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": None,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_jitter_noise": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
}

ACT2FN = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


class Config(SimpleNamespace):
    """A config.json as attributes, like transformers' PretrainedConfig (to_dict() for the
    checkpoint's config.json)."""

    def to_dict(self) -> Dict:
        return dict(vars(self))


def head_dim(config: Config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# --- the modules, as transformers' modeling_qwen3_moe.py / modeling_mixtral.py lay them out ----


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        dim = head_dim(config)
        base = float(getattr(config, "rope_theta", None)
                     or (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 1e4))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    b, kv_heads, t, hd = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(b, kv_heads, n_rep, t, hd)
    return hidden_states.reshape(b, kv_heads * n_rep, t, hd)


class KVCache:
    """The keys and values of the tokens so far, per decoder layer (transformers' DynamicCache)."""

    def __init__(self):
        self.keys: List[torch.Tensor] = []
        self.values: List[torch.Tensor] = []

    def get_seq_length(self) -> int:
        return self.keys[0].shape[-2] if self.keys else 0

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int):
        if layer_idx == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], k], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], v], dim=-2)
        return self.keys[layer_idx], self.values[layer_idx]


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings (eager); Qwen3 adds q_norm/k_norm."""

    qk_norm = False

    def __init__(self, config: Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim(config)
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        bias = bool(getattr(config, "attention_bias", False))
        h, hd = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, config.num_attention_heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * hd, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, h, bias=bias)
        if self.qk_norm:
            self.q_norm = RMSNorm(hd, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache: KVCache):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape)
        k = self.k_proj(hidden_states).view(hidden_shape)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *position_embeddings)
        k, v = cache.update(k, v, self.layer_idx)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        weights = (q @ k.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (weights @ v).transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights


class Qwen3MoeMLP(nn.Module):
    def __init__(self, config: Config, intermediate_size: int):
        super().__init__()
        h = config.hidden_size
        self.gate_proj = nn.Linear(h, intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, h, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        h, inter = config.hidden_size, config.intermediate_size
        self.w1 = nn.Linear(h, inter, bias=False)  # gate
        self.w2 = nn.Linear(inter, h, bias=False)  # down
        self.w3 = nn.Linear(h, inter, bias=False)  # up
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class SparseMoeBlock(nn.Module):
    """softmax -> top-k (-> renormalise) -> the chosen experts, weighted; returns
    (hidden_states, router_logits) as the transformers 4.x blocks do."""

    norm_topk_prob = True

    def forward(self, hidden_states: torch.Tensor):
        batch, seq, hidden = hidden_states.shape
        x = hidden_states.view(-1, hidden)
        router_logits = self.gate(x)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(x.dtype)
        out = torch.zeros_like(x)
        expert_mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[e])
            if top_x.numel() == 0:
                continue
            y = self.experts[e](x[top_x]) * routing_weights[top_x, idx, None]
            out.index_add_(0, top_x, y.to(x.dtype))
        return out.view(batch, seq, hidden), router_logits


class Qwen3MoeSparseMoeBlock(SparseMoeBlock):
    def __init__(self, config: Config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList([Qwen3MoeMLP(config, config.moe_intermediate_size)
                                      for _ in range(self.num_experts)])


class MixtralSparseMoeBlock(SparseMoeBlock):
    def __init__(self, config: Config):
        super().__init__()
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList([MixtralBlockSparseTop2MLP(config)
                                      for _ in range(self.num_experts)])


class DecoderLayer(nn.Module):
    def __init__(self, config: Config, layer_idx: int):
        super().__init__()
        self.self_attn = self.attention_class(config, layer_idx)
        self.input_layernorm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(config.hidden_size,
                                                        eps=config.rms_norm_eps)

    def feed_forward(self, hidden_states):
        raise NotImplementedError  # each family names its block

    def forward(self, hidden_states, position_embeddings, attention_mask, cache: KVCache):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states, position_embeddings, attention_mask,
                                          cache)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.feed_forward(self.post_attention_layernorm(hidden_states))
        if isinstance(hidden_states, tuple):  # (hidden_states, router_logits)
            hidden_states, _router_logits = hidden_states
        return residual + hidden_states


class Qwen3MoeRMSNorm(RMSNorm):
    pass


class Qwen3MoeRotaryEmbedding(RotaryEmbedding):
    pass


class Qwen3MoeAttention(Attention):
    qk_norm = True


class Qwen3MoeDecoderLayer(DecoderLayer):
    attention_class, norm_class = Qwen3MoeAttention, Qwen3MoeRMSNorm

    def __init__(self, config: Config, layer_idx: int):
        super().__init__(config, layer_idx)
        if (layer_idx not in (config.mlp_only_layers or []) and config.num_experts > 0
                and (layer_idx + 1) % config.decoder_sparse_step == 0):
            self.mlp = Qwen3MoeSparseMoeBlock(config)
        else:
            self.mlp = Qwen3MoeMLP(config, config.intermediate_size)

    def feed_forward(self, hidden_states):
        return self.mlp(hidden_states)


class MixtralRMSNorm(RMSNorm):
    pass


class MixtralRotaryEmbedding(RotaryEmbedding):
    pass


class MixtralAttention(Attention):
    pass


class MixtralDecoderLayer(DecoderLayer):
    attention_class, norm_class = MixtralAttention, MixtralRMSNorm

    def __init__(self, config: Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.block_sparse_moe = MixtralSparseMoeBlock(config)

    def feed_forward(self, hidden_states):
        return self.block_sparse_moe(hidden_states)


class MoeModel(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([self.layer_class(config, i)
                                     for i in range(config.num_hidden_layers)])
        self.norm = self.layer_class.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = self.rotary_class(config)

    def forward(self, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        past = cache.get_seq_length()
        seq = input_ids.shape[1]
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(past, past + seq).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        mask = None
        if seq > 1:  # causal over the cached tokens and these
            mask = torch.full((seq, past + seq), torch.finfo(hidden_states.dtype).min)
            mask = torch.triu(mask, diagonal=past + 1)[None, None]
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, mask, cache)
        return self.norm(hidden_states)


class Qwen3MoeModel(MoeModel):
    layer_class, rotary_class = Qwen3MoeDecoderLayer, Qwen3MoeRotaryEmbedding


class MixtralModel(MoeModel):
    layer_class, rotary_class = MixtralDecoderLayer, MixtralRotaryEmbedding


class Generation(NamedTuple):
    tokens: List[int]      # the prompt, then the new tokens
    logits: torch.Tensor   # [new tokens, vocab]: the logits each new token was chosen from
    ttft: float            # seconds to the first new token (the prefill)
    total: float           # seconds for all of them


class MoeForCausalLM(nn.Module):
    def __init__(self, config: Config, seed: int = 0):
        super().__init__()
        self.config = config
        self.model = self.model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """transformers' _init_weights, from a seeded generator: linear and embedding weights
        normal(0, initializer_range), biases zero, norms one."""
        g = torch.Generator().manual_seed(seed)
        std = float(getattr(self.config, "initializer_range", 0.02))
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std, generator=g)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def forward(self, input_ids: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        return self.lm_head(self.model(input_ids, cache if cache is not None else KVCache()))

    @torch.no_grad()
    def generate(self, prompt: List[int], new_tokens: int) -> Generation:
        """Greedy: the prompt in one pass (prefill), then one token at a time (KV cache)."""
        cache = KVCache()
        tokens = list(prompt)
        logits = []
        step = torch.tensor([prompt], dtype=torch.long)
        t0 = time.perf_counter()
        ttft = 0.0
        for i in range(new_tokens):
            last = self(step, cache)[0, -1]
            token = int(last.argmax())
            if i == 0:
                ttft = time.perf_counter() - t0
            tokens.append(token)
            logits.append(last.clone())
            step = torch.tensor([[token]], dtype=torch.long)
        return Generation(tokens, torch.stack(logits), ttft, time.perf_counter() - t0)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    model_class = Qwen3MoeModel


class MixtralForCausalLM(MoeForCausalLM):
    model_class = MixtralModel


MODELS = {"qwen3_moe": Qwen3MoeForCausalLM, "mixtral": MixtralForCausalLM}
# The keys each family's modules read (config.json's names).
REQUIRED = {
    "qwen3_moe": ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "hidden_act", "rms_norm_eps", "num_experts", "num_experts_per_tok",
                  "norm_topk_prob", "decoder_sparse_step"],
    "mixtral": ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "hidden_act", "rms_norm_eps",
                "num_local_experts", "num_experts_per_tok"],
}


# --- the script ------------------------------------------------------------------------------


class UsageError(Exception):
    """A bad argument (exit 2)."""


def load_config(family: str, path: Optional[str]) -> Config:
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise UsageError(f"--config: {e}") from e
        if not isinstance(d, dict):
            raise UsageError(f"--config: {path} is not a JSON object")
    else:
        d = copy.deepcopy(CONFIGS[family])
    kind = d.get("model_type")
    if kind not in MODELS:
        raise UsageError(f"--config: model_type {kind!r} is not one this example builds "
                         f"({', '.join(MODELS)})")
    missing = [k for k in REQUIRED[kind] if d.get(k) is None]
    if missing:
        raise UsageError(f"--config: {kind} needs {', '.join(missing)}")
    d.setdefault("mlp_only_layers", [])
    c = Config(**d)
    if c.hidden_act not in ACT2FN:
        raise UsageError(f"--config: hidden_act {c.hidden_act!r} is not one of "
                         f"{', '.join(ACT2FN)}")
    if c.num_attention_heads % c.num_key_value_heads:
        raise UsageError("--config: num_key_value_heads must divide num_attention_heads")
    if head_dim(c) % 2:
        raise UsageError("--config: the head dimension must be even (rotary embeddings)")
    return c


def check_served(model: nn.Module, names: List[str], target: str) -> None:
    """One zero row through every remote block: a job that cannot be reached, does not serve a
    layer or has another hidden size is told here, naming the layer, not in the middle of a
    generation."""
    hidden = model.config.hidden_size
    for name in names:
        block = model.get_submodule(name)
        try:
            block(torch.zeros(1, 1, hidden))
        except moerun.UnavailableError as e:
            raise UsageError(f"--target {target}: {e.message}") from e
        except moerun.MoerunError as e:
            raise UsageError(f"the job at {target} cannot serve {name} (model layer "
                             f"{block.layer}): {e.message}") from e


def check_moerun_reads(ckpt: str, layer: int) -> None:
    """moerun.Layer loads an MoE layer of the checkpoint: a config that PyTorch builds but moerun
    does not serve (e.g. hidden_act gelu) is told here, before a job is started on it."""
    try:
        moerun.Layer(ckpt, layer, 1)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise UsageError(f"--config: moerun does not serve this model: {e}") from e


def write_serve_yaml(folder: str) -> str:
    path = os.path.join(folder, "serve.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write("# moerun serve for examples/python/hf_decoder.py's checkpoint: every MoE layer\n"
                "model: .\n"
                "layers: all\n"
                "routers: 1\n"
                "placement: round_robin\n"
                "batching:\n"
                "  max_wait_us: 0   # one sequence: a request never waits for company\n")
    return path


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(b.double().norm(), 1e-300))


def speed(g: Generation, n: int) -> Dict[str, float]:
    tpot = (g.total - g.ttft) / (n - 1) if n > 1 else float("nan")
    return {"tokens_per_s": n / g.total, "ttft_ms": 1e3 * g.ttft, "ms_per_output_token": 1e3 * tpot}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=sorted(CONFIGS), default="qwen3_moe",
                   help="the built-in scaled-down config (default qwen3_moe)")
    p.add_argument("--config", help="a config.json of your own instead (model_type qwen3_moe "
                   "or mixtral)")
    p.add_argument("--seed", type=int, default=0, help="of the random weights")
    p.add_argument("--target", help="HOST:PORT[,HOST:PORT...] of a running job serving this "
                   "model's checkpoint (--save; same --family/--config/--seed); default: "
                   "start a local job")
    p.add_argument("--ranks", type=int, default=4, help="ranks of the local job (default 4)")
    p.add_argument("--transport", default="mpi", choices=["mpi", "ucx", "inproc"],
                   help="of the local job (default mpi, under mpirun)")
    p.add_argument("--prompt", default="1,2,3,4", help="comma-separated token ids")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--save", metavar="DIR", help="write the checkpoint and a serve.yaml into "
                   "DIR, print how to serve it, and exit")
    p.add_argument("--bench", action="store_true",
                   help="also report tokens/s, the first token's time and the time per output "
                   "token of each way")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    return p, p.parse_args(argv)


def main(argv=None) -> int:
    p, a = parse_args(argv)
    try:
        return run(a)
    except UsageError as e:
        p.print_usage(sys.stderr)
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # moerun.Layer without the compiled moerun._layer
        print(f"{p.prog}: {e}", file=sys.stderr)
        return 3


def run(a) -> int:
    config = load_config(a.family, a.config)
    try:
        prompt = [int(t) for t in a.prompt.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--prompt: not comma-separated integers: {a.prompt!r}")
    if not prompt or any(t < 0 or t >= config.vocab_size for t in prompt):
        raise UsageError(f"--prompt: token ids must be in [0, {config.vocab_size})")
    if a.new_tokens < 1:
        raise UsageError("--new-tokens must be at least 1")
    if len(prompt) + a.new_tokens > config.max_position_embeddings:
        raise UsageError(f"--prompt and --new-tokens exceed max_position_embeddings "
                         f"{config.max_position_embeddings}")
    if a.ranks < 2:
        raise UsageError("--ranks must be at least 2 (a router and an expert rank)")

    torch.manual_seed(a.seed)  # nn.Linear's own initialisation, overwritten by init_weights
    model = MODELS[config.model_type](config, a.seed).eval()
    blocks = mtorch.find_moe_blocks(model)
    if not blocks:
        raise UsageError("--config: no decoder layer is an MoE layer")
    moe_layers = [b.layer for b in blocks]

    if a.save:
        try:
            mtorch.save_moe_checkpoint(model, a.save)
        except (OSError, ValueError) as e:
            raise UsageError(f"--save {a.save}: {e}") from e
        check_moerun_reads(a.save, moe_layers[0])
        yaml = write_serve_yaml(a.save)
        try:
            binary = moerun.job.find_binary("moerun")
        except FileNotFoundError:
            binary = "moerun"
        print(f"wrote {a.save}: config.json, model.safetensors ({len(blocks)} MoE layers), "
              f"serve.yaml. Serve it and run against it:\n"
              f"  mpirun --oversubscribe --bind-to none -np 4 "
              f"{binary} serve --config {yaml} --listen 127.0.0.1:5700\n"
              f"  {sys.executable} {os.path.relpath(__file__)} --target 127.0.0.1:5700"
              + (f" --family {a.family}" if not a.config and a.family != "qwen3_moe" else "")
              + (f" --config {a.config}" if a.config else "")
              + (f" --seed {a.seed}" if a.seed else ""))
        return 0

    work = tempfile.mkdtemp(prefix="hf_decoder.")
    try:
        ckpt = os.path.join(work, "checkpoint")
        mtorch.save_moe_checkpoint(model, ckpt)
        check_moerun_reads(ckpt, moe_layers[0])
        return compare(a, config, model, ckpt, prompt, moe_layers)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compare(a, config: Config, model: nn.Module, ckpt: str, prompt: List[int],
            moe_layers: List[int]) -> int:
    remote = copy.deepcopy(model)
    local = copy.deepcopy(model)
    warm = min(2, a.new_tokens)

    # 1. Every MoE layer served by the job.
    job = None
    target = a.target
    try:
        if not target:
            try:
                job = moerun.job.LocalJob(ckpt, ranks=a.ranks, transport=a.transport,
                                          layers="all", batching={"max_wait_us": 0}).start()
            except RuntimeError as e:
                print(f"the local job did not start: {e}", file=sys.stderr)
                return 3
            target = job.target
        with moerun.Client(target) as client:
            names = mtorch.replace_moe_blocks(remote, client)
            check_served(remote, names, target)
            if a.bench:
                remote.generate(prompt, warm)
            try:
                g_remote = remote.generate(prompt, a.new_tokens)
            except moerun.MoerunError as e:
                print(f"the job at {target} failed while generating: {e}", file=sys.stderr)
                return 3
    finally:
        if job is not None:
            job.stop()

    # 2. Every MoE layer in this process (moerun.Layer), the job stopped: its ranks idle no more.
    mtorch.replace_moe_blocks_local(local, ckpt)
    if a.bench:
        local.generate(prompt, warm)
    g_local = local.generate(prompt, a.new_tokens)

    # 3. The model's own PyTorch MoE blocks: the reference, other rounding.
    if a.bench:
        model.generate(prompt, warm)
    g_torch = model.generate(prompt, a.new_tokens)

    same_tokens = g_remote.tokens == g_local.tokens
    same_logits = torch.equal(g_remote.logits.view(torch.int32), g_local.logits.view(torch.int32))
    ok = same_tokens and same_logits
    n = a.new_tokens
    report = {
        "model_type": config.model_type, "decoder_layers": config.num_hidden_layers,
        "moe_layers": moe_layers, "hidden": config.hidden_size, "seed": a.seed,
        "target": target, "local_job": job is not None, "prompt": prompt, "new_tokens": n,
        "remote_tokens": g_remote.tokens, "local_tokens": g_local.tokens,
        "torch_tokens": g_torch.tokens, "identical": ok, "tokens_identical": same_tokens,
        "logits_identical": same_logits,
        "torch_first_logits_rel_err": rel_err(g_local.logits[0], g_torch.logits[0]),
    }
    if a.bench:
        report.update({"remote": speed(g_remote, n), "local": speed(g_local, n),
                       "torch": speed(g_torch, n)})
    if a.json:
        print(json.dumps(report))
        return 0 if ok else 1

    experts = getattr(config, "num_experts", None) or config.num_local_experts
    where = (f"a local {a.ranks}-rank {a.transport} job" if job is not None else "the job")
    print(f"{type(model).__name__}: {config.num_hidden_layers} decoder layers, MoE layers "
          f"{moe_layers} ({experts} experts, top-{config.num_experts_per_tok}, hidden "
          f"{config.hidden_size}), seed {a.seed}; served by {where} at {target}")
    print(f"served by the job:          {g_remote.tokens}")
    print(f"in-process (moerun.Layer):  {g_local.tokens}")
    agree = "same tokens" if g_torch.tokens == g_local.tokens else "other tokens"
    print(f"PyTorch MoE blocks:         {g_torch.tokens} (reference: {agree}, first logits' "
          f"relative difference {report['torch_first_logits_rel_err']:.1e})")
    if a.bench:
        for label, key in (("job", "remote"), ("in-process", "local"), ("PyTorch", "torch")):
            s = report[key]
            print(f"{label:>11}: {s['tokens_per_s']:7.1f} tokens/s, first token "
                  f"{s['ttft_ms']:.2f} ms, {s['ms_per_output_token']:.2f} ms per output token")
    if ok:
        print(f"identical: {n} tokens, and every step's logits bit for bit")
    else:
        what = "tokens" if not same_tokens else "logits (the tokens agree)"
        hint = "" if job is not None else (" (does the job serve this model's checkpoint: the "
                                           "same --family/--config/--seed as its --save?)")
        print(f"DIFFERENT: the job's {what} differ from the in-process ones{hint}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
