#!/usr/bin/env python3
"""Step-3.5 router-switch goldens from the authors' own modeling_step3p5.py, executed (not re-written).

tests/data/step3p5-switches holds one MoE layer (weights, input) and 16 configs, one per
combination of the router switches (README there). This script computes each case's golden output
by running stepfun-ai's HF-hub `modeling_step3p5.py` itself: it reads that file (which the
repository does not ship: pass its path), takes the definitions of the MoE block out of it with
`ast` (Step3p5MLP, sigmoid_routing_function, MoELinear, Step3p5MoEMLP; everything else in the file
needs transformers and is not executed), executes their text with torch, builds the block for each
case's config.json, loads the case's weights into it and calls its forward:

  output = Step3p5MoEMLP(config, swiglu_limit).forward(x) + Step3p5MLP(config, share_expert_dim,
           swiglu_limit_shared).forward(x)            (Step3p5DecoderLayer: moe_output + share_output)

What the harness supplies, and nothing else:
  * ACT2FN["silu"] = torch.nn.SiLU() (transformers' ACT2FN maps "silu" to the same function);
  * the config, as a namespace of config.json's keys;
  * the two swiglu limits, chosen as Step3p5DecoderLayer.__init__ chooses them (limits[layer] unless
    0 or None);
  * the arithmetic precision: the block runs in float32 on the stored values (the BF16 weights and
    the bf16-valued input are exact in float32), as moerun's contract is; so the outputs are
    float32 results, not bf16 ones. The one place where a bf16 model's dtype changes what the code
    computes is the switch need_fp32_gate=false: the authors' forward then calls `self.gate(x)`, an
    nn.Linear in the model's dtype. For those cases `self.gate` is replaced by that nn.Linear in
    bfloat16 (its weight the stored bf16 gate weight), fed the bf16 input, so that the logits come
    out in bfloat16 exactly as the bf16 model's do; the routing functions then cast them to float.

  scripts/step3p5_authors_goldens.py --authors PATH           rewrite each case's golden `output`
  scripts/step3p5_authors_goldens.py --authors PATH --check   only compare with the stored goldens

Both print the sha256 of each definition used (the README records those of the run that wrote the
goldens) and the relative error against scripts/gen_step3p5_cases.py's float64 re-implementation
(ours), which must stay below 1e-6: the two implementations, ours and the authors', agree.
Needs torch and numpy (Debian: python3-torch, python3-numpy; /usr/bin/python3 on Debian).
"""

import argparse
import ast
import hashlib
import json
import os
import struct
import sys
import types

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_step3p5_cases as ours  # noqa: E402  (the float64 re-implementation, for the cross-check)

CASES = ours.OUT_DIR
P = ours.P
WANTED = ["Step3p5MLP", "sigmoid_routing_function", "MoELinear", "Step3p5MoEMLP"]


def load_authors_block(path):
    """Executes the wanted top-level definitions of the authors' file; returns (namespace, info)."""
    text = open(path, encoding="utf-8").read()
    tree = ast.parse(text)
    found, info = {}, []
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in WANTED:
            src = ast.get_source_segment(text, node)
            found[node.name] = src
            info.append((node.name, node.lineno, node.end_lineno, hashlib.sha256(src.encode()).hexdigest()))
    missing = [n for n in WANTED if n not in found]
    if missing:
        sys.exit(f"{path}: no top-level definition of {', '.join(missing)}: not the authors' modeling_step3p5.py?")
    ns = {"torch": torch, "nn": nn, "F": F, "ACT2FN": {"silu": nn.SiLU()}}
    for name in WANTED:  # in dependency order: Step3p5MoEMLP refers to the others
        exec(compile(found[name], f"{path}:{name}", "exec"), ns)
    return ns, info


def read_tensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        a, b = h["data_offsets"]
        dtype = {"F32": torch.float32, "BF16": torch.bfloat16}[h["dtype"]]
        out[name] = torch.frombuffer(bytearray(data[8 + n + a : 8 + n + b]), dtype=dtype).reshape(h["shape"])
    return out, header.get("__metadata__", {})


def limit_at(limits, layer):
    """Step3p5DecoderLayer.__init__: limits[layer] unless the list is empty or the value 0 / None."""
    if limits and limits[layer] is not None and limits[layer] != 0:
        return limits[layer]
    return None


class Bf16Linear(nn.Module):
    """The router nn.Linear of a bfloat16 model: bf16 input (the hidden state), bf16 weight, bf16 out."""

    def __init__(self, weight):
        super().__init__()
        self.weight = nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)

    def forward(self, x):
        return F.linear(x.to(torch.bfloat16), self.weight)


def run_case(ns, case_dir, w, x):
    cfg_json = json.load(open(os.path.join(case_dir, "config.json")))
    cfg = types.SimpleNamespace(**cfg_json)
    layer = int(cfg.moe_layers_enum.strip().split(",")[0])
    moe = ns["Step3p5MoEMLP"](cfg, swiglu_limit=limit_at(cfg.swiglu_limits, layer))
    share = ns["Step3p5MLP"](cfg, intermediate_size=cfg.share_expert_dim,
                             swiglu_limit=limit_at(cfg.swiglu_limits_shared, layer))
    pre = f"model.layers.{layer}."
    with torch.no_grad():
        moe.gate.weight.copy_(w[pre + "moe.gate.weight"].float())
        for proj in ("gate_proj", "up_proj", "down_proj"):
            getattr(moe, proj).weight.copy_(w[pre + f"moe.{proj}.weight"].float())
            getattr(share, proj).weight.copy_(w[pre + f"share_expert.{proj}.weight"].float())
        if cfg.use_moe_router_bias:
            moe.router_bias.copy_(w[pre + "moe.router_bias"].float())
    if not cfg.need_fp32_gate:
        if cfg.torch_dtype != "bfloat16":
            sys.exit(f"{case_dir}: need_fp32_gate false is only handled in a bfloat16 model")
        moe.gate = Bf16Linear(w[pre + "moe.gate.weight"])
    with torch.no_grad():
        h = x.reshape(1, -1, x.shape[-1])  # the authors' forward takes [batch, seq, hidden]
        out = moe(h) + share(h)
    return out.reshape(x.shape), cfg_json


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def write_golden(path, x, out, meta):
    ours.write_safetensors(path, {"input": ("F32", x.astype(np.float64)), "output": ("F32", out.astype(np.float64))}, meta)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--authors", required=True, help="path of stepfun-ai's modeling_step3p5.py")
    ap.add_argument("--check", action="store_true", help="compare with the stored goldens, write nothing")
    args = ap.parse_args()
    torch.manual_seed(0)  # the modules' init draws are overwritten by the stored weights anyway
    ns, info = load_authors_block(args.authors)
    for name, a, b, digest in info:
        print(f"{os.path.basename(args.authors)}:{a}-{b} {name} sha256 {digest}")
    w, _ = read_tensors(os.path.join(CASES, "model.safetensors"))
    w64 = {k: v.double().numpy() for k, v in w.items()}
    worst_ours = worst_stored = 0.0
    names = sorted(d for d in os.listdir(CASES) if os.path.isdir(os.path.join(CASES, d)))
    if len(names) != 16:
        sys.exit(f"expected 16 case folders in {CASES}, found {len(names)}")
    for name in names:
        d = os.path.join(CASES, name)
        g, meta = read_tensors(os.path.join(d, "golden.safetensors"))
        x = g["input"]
        out, cfg = run_case(ns, d, w, x)
        got = out.numpy()
        e_ours = rel_err(got.astype(np.float64), ours.forward(cfg, w64, x.double().numpy()))
        e_stored = rel_err(got.astype(np.float64), g["output"].double().numpy())
        worst_ours, worst_stored = max(worst_ours, e_ours), max(worst_stored, e_stored)
        print(f"{name}: vs our float64 re-implementation {e_ours:.3g}, vs the stored golden {e_stored:.3g}")
        if not args.check:
            meta = {"reference": "stepfun-ai modeling_step3p5.py Step3p5MoEMLP.forward + Step3p5MLP.forward, executed",
                    "authors_code_sha256": ";".join(f"{n}={h}" for n, _, _, h in info),
                    "math": "torch float32 on the stored values; bf16 router nn.Linear where need_fp32_gate is false",
                    "generator": "scripts/step3p5_authors_goldens.py"}
            write_golden(os.path.join(d, "golden.safetensors"), x.numpy(), got, meta)
    print(f"worst: vs ours {worst_ours:.3g}, vs stored {worst_stored:.3g}")
    if worst_ours > 1e-6:
        sys.exit("the authors' code and our float64 re-implementation disagree")
    if args.check and worst_stored > 1e-6:
        sys.exit("the stored goldens are not what the authors' code computes")


if __name__ == "__main__":
    main()
