#!/usr/bin/env python3
"""A small decoder model in plain PyTorch whose MoE layer runs on moerun.

Embedding, one decoder block (RMSNorm, causal multi-head self-attention, RMSNorm, MoE), a final
norm and a head; the MoE block's weights are a shipped checkpoint's (tests/data/hf-moe/*), the
rest is seeded random. It generates tokens greedily, twice: with the MoE layer served by a local
`mpirun -np 4 moerun serve` job (RemoteMoE; the script starts and stops the job, or uses yours
with --target) and computed in this process (LocalMoE, moerun.Layer). The tokens must be the
same: the job's answers are bitwise those of the in-process layer.

    python3 examples/python/tiny_decoder.py                          # both ways, compared
    python3 examples/python/tiny_decoder.py --model tests/data/hf-moe/mixtral --new-tokens 32
    python3 examples/python/tiny_decoder.py --target 127.0.0.1:7000  # your job for the model
    python3 examples/python/tiny_decoder.py --bench                  # tokens/s of each way

Exit code 0 when the two token sequences agree, 1 when they differ, 2 on bad arguments.
"""

import argparse
import json
import math
import os
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "build", "python")]

import moerun  # noqa: E402
import moerun.job  # noqa: E402
import moerun.torch as mtorch  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):  # [batch, seq, dim], causal
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [b, heads, t, hd]
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, t, d))


class DecoderBlock(nn.Module):
    def __init__(self, dim, heads, moe):
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = RMSNorm(dim)
        self.mlp = moe  # the MoE block: RemoteMoE or LocalMoE

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    def __init__(self, vocab, dim, heads, moe, seed=0):
        super().__init__()
        torch.manual_seed(seed)  # the same non-MoE weights every time
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([DecoderBlock(dim, heads, moe)])
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):  # [batch, seq] -> logits [batch, seq, vocab]
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    @torch.no_grad()
    def generate(self, prompt, new_tokens):
        ids = torch.tensor([prompt], dtype=torch.long)
        for _ in range(new_tokens):
            nxt = self(ids)[:, -1].argmax(-1, keepdim=True)  # greedy
            ids = torch.cat([ids, nxt], dim=1)
        return ids[0].tolist()


def run(model, prompt, new_tokens, bench):
    t0 = time.perf_counter()
    tokens = model.generate(prompt, new_tokens)
    secs = time.perf_counter() - t0
    return tokens, (new_tokens / secs if bench else None)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "tests", "data", "hf-moe", "qwen3_moe"),
                   help="checkpoint folder of the MoE layer (config.json + safetensors)")
    p.add_argument("--layer", type=int, default=0, help="its MoE layer index")
    p.add_argument("--target", help="HOST:PORT of a running job serving --model "
                   "(default: start a local mpirun job)")
    p.add_argument("--ranks", type=int, default=4, help="ranks of the local job")
    p.add_argument("--transport", default="mpi", help="of the local job: mpi, ucx or inproc")
    p.add_argument("--prompt", default="1,2,3,4", help="comma-separated token ids")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--bench", action="store_true", help="also report tokens/s of each way")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    a = p.parse_args(argv)
    try:
        prompt = [int(t) for t in a.prompt.split(",") if t.strip()]
    except ValueError:
        p.error(f"--prompt: not comma-separated integers: {a.prompt!r}")
    if not prompt or any(t < 0 or t >= a.vocab for t in prompt):
        p.error(f"--prompt: token ids must be in [0, {a.vocab})")
    if a.new_tokens < 1:
        p.error("--new-tokens must be at least 1")
    cfg = os.path.join(a.model, "config.json")
    if not os.path.isfile(cfg):
        p.error(f"--model: {cfg} not found")
    with open(cfg, encoding="utf-8") as f:
        dim = int(json.load(f)["hidden_size"])
    if dim % a.heads:
        p.error(f"--heads {a.heads} does not divide the hidden size {dim}")

    local = TinyDecoder(a.vocab, dim, a.heads, mtorch.LocalMoE(a.model, a.layer))
    local_tokens, local_tps = run(local, prompt, a.new_tokens, a.bench)

    job = None
    try:
        target = a.target
        if not target:
            job = moerun.job.LocalJob(a.model, ranks=a.ranks, layers=[a.layer],
                                      transport=a.transport).start()
            target = job.target
        with moerun.Client(target) as client:
            remote = TinyDecoder(a.vocab, dim, a.heads,
                                 mtorch.RemoteMoE(client, a.layer, hidden_size=dim))
            remote_tokens, remote_tps = run(remote, prompt, a.new_tokens, a.bench)
    finally:
        if job is not None:
            job.stop()

    same = remote_tokens == local_tokens
    report = {"model": a.model, "hidden": dim, "prompt": prompt, "new_tokens": a.new_tokens,
              "remote_tokens": remote_tokens, "local_tokens": local_tokens, "identical": same}
    if a.bench:
        report.update({"remote_tokens_per_s": remote_tps, "local_tokens_per_s": local_tps})
    if a.json:
        print(json.dumps(report))
    else:
        print(f"served by the job ({target}): {remote_tokens}")
        print(f"in-process (moerun.Layer):  {local_tokens}")
        if a.bench:
            print(f"tokens/s: job {remote_tps:.1f}, in-process {local_tps:.1f}")
        print("identical" if same else "DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
