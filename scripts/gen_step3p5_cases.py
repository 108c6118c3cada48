#!/usr/bin/env python3
"""Step-3.5-Flash router switches: golden MoE layers for every combination (tests/data/step3p5-switches).

Writes the cases (weights, input, the 16 configs) and checks the stored goldens. The goldens'
outputs are NOT this script's: scripts/step3p5_authors_goldens.py computes them by executing the
authors' own modeling_step3p5.py and overwrites the outputs written here. This script is our
second, independent implementation: the authors' HF-hub `modeling_step3p5.py`
(docs/reference-semantics.md, section 6) re-implemented in float64, step by step as
`Step3p5MoEMLP.forward` and `Step3p5MLP.forward` compute it, for the four switches of config.json:

  use_moe_router_bias    true: router_bias_func; false: by moe_router_activation
  moe_router_activation  "sigmoid": sigmoid_routing_function; "softmax": F.softmax + topk
  norm_expert_weight     never read by the modeling code (both routing functions get
                         renormalize=True; the softmax branch never renormalises)
  need_fp32_gate         true: x.float() @ W.float().T; false: self.gate(x), the nn.Linear in the
                         model's dtype: in a bfloat16 model its output (the logits) is bfloat16

and moe_router_scaling_factor (x the routing weights on every branch). As for the shared fixtures
(tests/data/hf-moe/README.md), the math runs in float64 on the weights as stored; the one rounding
kept is the one a switch asks for: the bf16 logits of need_fp32_gate false in a bf16 model. The
weights are stored as BF16 (torch_dtype bfloat16; router_bias F32, as the model keeps it) and the
input holds bf16 values, as a bf16 model's hidden state does. Tokens whose choice of experts
hangs on a near tie (between the k-th and the next expert, or a logit next to a bf16 rounding
midpoint) are drawn again, so that float32 code must make the same choices.

All 16 cases share one model.safetensors (each case folder links to it) and one input.

  scripts/gen_step3p5_cases.py            write tests/data/step3p5-switches/ (then run
                                          scripts/step3p5_authors_goldens.py for the outputs)
  scripts/gen_step3p5_cases.py --check    only check the generator against tests/data/hf-moe/step3p5
                                          (relative error <= 1e-6), which it also does first
  scripts/gen_step3p5_cases.py --check-goldens
                                          and check it against the 16 stored goldens (the authors'
                                          code's outputs), relative error <= 1e-6 each
Needs numpy (Debian: python3-numpy).
"""

import argparse
import itertools
import json
import os
import struct
import sys

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SHARED_FIXTURE = os.path.join(ROOT, "tests", "data", "hf-moe", "step3p5")
OUT_DIR = os.path.join(ROOT, "tests", "data", "step3p5-switches")

HIDDEN, EXPERTS, TOP_K, INTER, SHARED = 64, 16, 4, 48, 40
TOKENS = 16
SCALE = 3.0
LIMIT, LIMIT_SHARED = 1.5, 2.0
P = "model.layers.0."


# ---- safetensors ---------------------------------------------------------------------------


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = data[8 + n + a : 8 + n + b]
        if info["dtype"] == "F32":
            v = np.frombuffer(raw, dtype="<f4").astype(np.float64)
        elif info["dtype"] == "BF16":
            v = bf16_bits_to_f64(np.frombuffer(raw, dtype="<u2"))
        else:
            raise ValueError(f"{path}: {name}: dtype {info['dtype']}")
        out[name] = v.reshape(info["shape"])
    return out


def write_safetensors(path, tensors, metadata):
    """tensors: name -> (dtype "F32" | "BF16", float64 array holding values exact in that dtype)."""
    header = {"__metadata__": metadata}
    blobs, offset = [], 0
    for name in sorted(tensors):
        dtype, v = tensors[name]
        if dtype == "F32":
            raw = v.astype("<f4").tobytes()
            assert np.array_equal(v.astype(np.float32).astype(np.float64), v)
        else:
            bits = f64_to_bf16_bits(v)
            assert np.array_equal(bf16_bits_to_f64(bits), v), name
            raw = bits.astype("<u2").tobytes()
        header[name] = {"dtype": dtype, "shape": list(v.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


# ---- bfloat16 ------------------------------------------------------------------------------


def f64_to_bf16_bits(v):
    """Round to float32, then to bfloat16, both to nearest even (torch's .to(torch.bfloat16))."""
    u = np.asarray(v, dtype=np.float64).astype(np.float32).view(np.uint32).astype(np.uint64)
    assert not np.isnan(np.asarray(v)).any()
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_bits_to_f64(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def round_bf16(v):
    return bf16_bits_to_f64(f64_to_bf16_bits(v))


def near_bf16_midpoint(v, margin):
    """Whether moving v by up to margin can change its bf16 rounding, per element."""
    return round_bf16(v - margin) != round_bf16(v + margin)


# ---- the authors' block, in float64 --------------------------------------------------------


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def silu(v):
    return v * sigmoid(v)


def topk(v, k):
    """torch.topk(v, k, dim=1) with sorted=True; ties to the lower index (torch leaves it open)."""
    idx = np.argsort(-v, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(v, idx, axis=1), idx


def router_bias_func(gating_output, router_bias, k, renormalize):
    gate_prob = sigmoid(gating_output)
    gate_prob_with_bias = gate_prob + router_bias[None, :]
    _, indices = topk(gate_prob_with_bias, k)
    topk_prob = np.take_along_axis(gate_prob, indices, axis=1)
    expert_topk_weight = topk_prob
    if renormalize:
        expert_topk_weight = expert_topk_weight / (np.sum(expert_topk_weight, axis=-1, keepdims=True) + 1e-20)
    return expert_topk_weight, indices


def sigmoid_routing_function(gating_output, k, renormalize):
    gate_prob = sigmoid(gating_output)
    gate_prob = gate_prob / gate_prob.sum(axis=-1, keepdims=True)
    topk_prob, indices = topk(gate_prob, k)
    expert_topk_weight = topk_prob
    if renormalize:
        expert_topk_weight = expert_topk_weight / np.sum(expert_topk_weight, axis=-1, keepdims=True)
    return expert_topk_weight, indices


def softmax(v):
    e = np.exp(v - v.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def router_logits(cfg, w, x):
    if cfg["need_fp32_gate"]:
        return x @ w[P + "moe.gate.weight"].T  # torch.matmul(x.float(), gate.weight.t().float())
    logits = x @ w[P + "moe.gate.weight"].T  # self.gate(x): nn.Linear in the model's dtype
    if cfg.get("torch_dtype") == "bfloat16":
        logits = round_bf16(logits)
    elif cfg.get("torch_dtype") not in (None, "float32"):
        raise ValueError(f"torch_dtype {cfg['torch_dtype']}")
    return logits


def route(cfg, w, x):
    """Step3p5MoEMLP.forward up to the weights: (routing_weights, selected_experts, logits)."""
    logits = router_logits(cfg, w, x)
    k = cfg["moe_top_k"]
    if cfg["use_moe_router_bias"]:
        weights, experts = router_bias_func(logits, w[P + "moe.router_bias"], k, renormalize=True)
    elif cfg["moe_router_activation"] == "sigmoid":
        weights, experts = sigmoid_routing_function(logits, k, renormalize=True)
    else:
        weights = softmax(logits)  # F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, experts = topk(weights, k)
    weights = weights * cfg.get("moe_router_scaling_factor", 1.0)
    return weights, experts, logits


def limit_of(limits):
    return limits[0] if limits and limits[0] is not None and limits[0] != 0 else None


def mlp(x, gate_w, up_w, down_w, limit):
    """Step3p5MLP.forward and Step3p5MoEMLP.get_expert_output (the same math)."""
    up = x @ up_w.T
    gate = silu(x @ gate_w.T)
    if limit is not None:
        gate = np.minimum(gate, limit)
        up = np.clip(up, -limit, limit)
    return (gate * up) @ down_w.T


def forward(cfg, w, x):
    """Step3p5DecoderLayer's MoE part: moe_output + share_output."""
    weights, experts, _ = route(cfg, w, x)
    limit = limit_of(cfg.get("swiglu_limits"))
    final = np.zeros_like(x)
    for e in range(cfg["moe_num_experts"]):
        top_x, idx = np.nonzero(experts == e)
        if len(top_x) == 0:
            continue
        out = mlp(x[top_x], w[P + "moe.gate_proj.weight"][e], w[P + "moe.up_proj.weight"][e],
                  w[P + "moe.down_proj.weight"][e], limit)
        np.add.at(final, top_x, out * weights[top_x, idx, None])
    share = mlp(x, w[P + "share_expert.gate_proj.weight"], w[P + "share_expert.up_proj.weight"],
                w[P + "share_expert.down_proj.weight"], limit_of(cfg.get("swiglu_limits_shared")))
    return final + share


def rel_err(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# ---- the cases -----------------------------------------------------------------------------


def check_shared_fixture():
    cfg = json.load(open(os.path.join(SHARED_FIXTURE, "config.json")))
    w = read_safetensors(os.path.join(SHARED_FIXTURE, "model.safetensors"))
    g = read_safetensors(os.path.join(SHARED_FIXTURE, "golden.safetensors"))
    err = rel_err(forward(cfg, w, g["input"]), g["output"])
    print(f"generator vs tests/data/hf-moe/step3p5/golden.safetensors: relative error {err:.3g}")
    if err > 1e-6:
        sys.exit("the generator does not reproduce the shared fixture")


def case_name(bias, act, norm, fp32):
    return "bias{}_{}_norm{}_fp32gate{}".format(int(bias), act, int(norm), int(fp32))


def case_config(bias, act, norm, fp32):
    return {
        "architectures": ["Step3p5ForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": 256,
        "model_type": "step3p5",
        "moe_intermediate_size": INTER,
        "moe_layers_enum": "0",
        "moe_num_experts": EXPERTS,
        "moe_router_activation": act,
        "moe_router_scaling_factor": SCALE,
        "moe_top_k": TOP_K,
        "need_fp32_gate": fp32,
        "norm_expert_weight": norm,
        "num_hidden_layers": 1,
        "share_expert_dim": SHARED,
        "swiglu_limits": [LIMIT],
        "swiglu_limits_shared": [LIMIT_SHARED],
        "torch_dtype": "bfloat16",
        "use_moe_router_bias": bias,
    }


def all_cases():
    return list(itertools.product([False, True], ["sigmoid", "softmax"], [False, True], [False, True]))


def make_weights(rng):
    def bf16(*shape, std):
        return round_bf16(rng.normal(0.0, std, size=shape))

    return {
        P + "moe.gate.weight": ("BF16", bf16(EXPERTS, HIDDEN, std=0.125)),
        P + "moe.router_bias": ("F32", rng.normal(0.0, 0.25, size=EXPERTS).astype(np.float32).astype(np.float64)),
        P + "moe.gate_proj.weight": ("BF16", bf16(EXPERTS, INTER, HIDDEN, std=0.125)),
        P + "moe.up_proj.weight": ("BF16", bf16(EXPERTS, INTER, HIDDEN, std=0.125)),
        P + "moe.down_proj.weight": ("BF16", bf16(EXPERTS, HIDDEN, INTER, std=0.14)),
        P + "share_expert.gate_proj.weight": ("BF16", bf16(SHARED, HIDDEN, std=0.125)),
        P + "share_expert.up_proj.weight": ("BF16", bf16(SHARED, HIDDEN, std=0.125)),
        P + "share_expert.down_proj.weight": ("BF16", bf16(HIDDEN, SHARED, std=0.16)),
    }


def token_is_clear(cfgs, w, x):
    """No choice of this token's experts hangs on float rounding, in any case."""
    gate = w[P + "moe.gate.weight"]
    magnitude = np.abs(x) @ np.abs(gate).T  # bounds a float32 dot product's error, / 64 eps
    if np.any(near_bf16_midpoint(x @ gate.T, 8e-6 * magnitude)):
        return False
    for cfg in cfgs:
        logits = router_logits(cfg, w, x)
        if cfg["use_moe_router_bias"]:
            score = sigmoid(logits) + w[P + "moe.router_bias"][None, :]
        elif cfg["moe_router_activation"] == "sigmoid":
            score = sigmoid(logits)
        else:
            score = logits
        s = -np.sort(-score, axis=1)
        if s[0, TOP_K - 1] - s[0, TOP_K] <= 1e-4:
            return False
    return True


def write_cases():
    rng = np.random.default_rng(20250301)
    tensors = make_weights(rng)
    w = {k: v for k, (_, v) in tensors.items()}
    cfgs = [case_config(*c) for c in all_cases()]
    rows = []
    while len(rows) < TOKENS:
        x = round_bf16(rng.normal(0.0, 2.0, size=(1, HIDDEN)))
        if token_is_clear(cfgs, w, x):
            rows.append(x)
    x = np.concatenate(rows)

    os.makedirs(OUT_DIR, exist_ok=True)
    write_safetensors(os.path.join(OUT_DIR, "model.safetensors"), tensors, {"format": "pt"})
    meta = {"reference": "our float64 re-implementation of modeling_step3p5.py Step3p5MoEMLP + Step3p5MLP "
                         "(provisional: scripts/step3p5_authors_goldens.py replaces the output)",
            "math": "float64 (logits rounded to bf16 where need_fp32_gate is false), stored as float32",
            "generator": "scripts/gen_step3p5_cases.py"}
    outputs = {}
    for case, cfg in zip(all_cases(), cfgs):
        name = case_name(*case)
        d = os.path.join(OUT_DIR, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")
        link = os.path.join(d, "model.safetensors")
        if os.path.lexists(link):
            os.remove(link)
        os.symlink("../model.safetensors", link)
        out = forward(cfg, w, x)
        outputs[name] = out
        write_safetensors(os.path.join(d, "golden.safetensors"),
                          {"input": ("F32", x), "output": ("F32", out.astype(np.float32).astype(np.float64))}, meta)
        # How far a float32 gate is from the bf16 logits this case asks for (or the reverse).
        other = dict(cfg, need_fp32_gate=not cfg["need_fp32_gate"])
        print(f"{name}: |output| {np.linalg.norm(out):.4g}, "
              f"vs need_fp32_gate={str(other['need_fp32_gate']).lower()}: {rel_err(forward(other, w, x), out):.3g}")
    # norm_expert_weight is not read: its two values must give the same output.
    for bias, act, fp32 in itertools.product([False, True], ["sigmoid", "softmax"], [False, True]):
        a, b = outputs[case_name(bias, act, False, fp32)], outputs[case_name(bias, act, True, fp32)]
        assert np.array_equal(a, b)
    print(f"wrote {len(cfgs)} cases to {os.path.relpath(OUT_DIR, ROOT)}; now replace their outputs by the "
          "authors' code's: scripts/step3p5_authors_goldens.py --authors PATH/modeling_step3p5.py")


def check_goldens():
    """This re-implementation against every stored golden (computed by the authors' code)."""
    w = read_safetensors(os.path.join(OUT_DIR, "model.safetensors"))
    names = sorted(d for d in os.listdir(OUT_DIR) if os.path.isdir(os.path.join(OUT_DIR, d)))
    if len(names) != 16:
        sys.exit(f"expected 16 case folders in {OUT_DIR}, found {len(names)}")
    worst = 0.0
    for name in names:
        cfg = json.load(open(os.path.join(OUT_DIR, name, "config.json")))
        g = read_safetensors(os.path.join(OUT_DIR, name, "golden.safetensors"))
        err = rel_err(forward(cfg, w, g["input"]), g["output"])
        worst = max(worst, err)
        print(f"{name}: relative error {err:.3g}")
    if worst > 1e-6:
        sys.exit(f"the re-implementation disagrees with the stored goldens (worst {worst:.3g})")
    print(f"all {len(names)} goldens reproduced, worst relative error {worst:.3g}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only check against the shared fixture")
    ap.add_argument("--check-goldens", action="store_true", help="and against the 16 stored goldens")
    args = ap.parse_args()
    check_shared_fixture()
    if args.check_goldens:
        check_goldens()
    elif not args.check:
        write_cases()


if __name__ == "__main__":
    main()
