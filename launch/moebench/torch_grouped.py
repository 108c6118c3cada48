#!/usr/bin/env python3
"""The "torch grouped" baseline of ANCHORS.md: one MoE layer in PyTorch on one CUDA GPU.

gate linear (fp32 by default) -> softmax -> top-k (renormalised) -> sort the (token, expert)
pairs by expert -> torch._grouped_mm for gate_up and for down, with int32 cumulative offsets ->
SwiGLU -> weighted index_add combine (+ a shared expert, dense, when --shared-inter > 0).
Random weights; CUDA-event timings, median of repetitions after warm-up.

    python3 bench/torch_grouped.py --hidden 2048 --inter 768 --experts 128 --top-k 8 \
        --tokens 1,16,128,1024,8192 --dtype bf16 --min-time 0.5 [--check]

Prints exactly one JSON object on its last stdout line, and exits 0 on success:
    {"ok": true, "ms": {"1": 0.48, ...}, "min_ms": {...}, "reps": {...}, "torch_version": ...,
     "device": ..., "what": ..., "check": {...}}
or, when PyTorch, CUDA or torch._grouped_mm is missing or anything fails, exits 1 with
    {"ok": false, "error": "why"}
moebench layer --device cuda starts it and reads that line (speedup_vs_torch_grouped).
"""

import argparse
import json
import sys
import time


def emit(obj, code):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()
    sys.exit(code)


def fail(why):
    emit({"ok": False, "error": why}, 1)


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Time the torch._grouped_mm MoE layer of ANCHORS.md (JSON on stdout)")
    p.add_argument("--hidden", type=int, required=True, help="H")
    p.add_argument("--inter", type=int, required=True, help="expert intermediate size I")
    p.add_argument("--experts", type=int, required=True, help="routed experts E")
    p.add_argument("--top-k", type=int, required=True, help="experts per token k")
    p.add_argument("--shared-inter", type=int, default=0,
                   help="a dense shared expert of this intermediate size (0: none)")
    p.add_argument("--tokens", default="1,16,128,1024,8192", help="comma-separated token counts")
    p.add_argument("--dtype", choices=["bf16", "f16"], default="bf16",
                   help="activations and expert weights")
    p.add_argument("--gate-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the gate linear's type")
    p.add_argument("--min-time", type=float, default=1.0, help="seconds per token count")
    p.add_argument("--max-reps", type=int, default=200, help="repetitions per token count, at most")
    p.add_argument("--warmup", type=int, default=3, help="untimed forwards per token count")
    p.add_argument("--device-index", type=int, default=0, help="CUDA device ordinal")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--check", action="store_true",
                   help="first compare a small case against a plain loop over tokens")
    a = p.parse_args(argv)
    try:
        a.token_list = [int(t) for t in a.tokens.split(",") if t.strip()]
    except ValueError:
        p.error("--tokens must be comma-separated integers")
    if not a.token_list or min(a.token_list) < 1:
        p.error("--tokens must be positive")
    for name in ("hidden", "inter", "experts", "top_k"):
        if getattr(a, name) < 1:
            p.error("--%s must be positive" % name.replace("_", "-"))
    if a.top_k > a.experts:
        p.error("--top-k must not exceed --experts")
    if a.shared_inter < 0 or a.min_time < 0 or a.max_reps < 1 or a.warmup < 0:
        p.error("--shared-inter, --min-time, --warmup must be >= 0 and --max-reps >= 1")
    # torch._grouped_mm wants 16-byte aligned rows: multiples of 8 bf16/f16 elements.
    for name, v in (("hidden", a.hidden), ("inter", a.inter)):
        if v % 8 != 0:
            p.error("--%s must be a multiple of 8 (torch._grouped_mm's 16-byte alignment)" % name)
    return a


def import_torch():
    """torch, or exit with the reason it cannot serve as the baseline."""
    try:
        import torch  # noqa: PLC0415
    except Exception as e:  # ImportError, or a broken install
        fail("PyTorch is not importable by %s: %s" % (sys.executable, e))
    missing = []
    if not hasattr(torch, "_grouped_mm"):
        missing.append("torch %s has no torch._grouped_mm (PyTorch >= 2.8 has it)"
                       % torch.__version__)
    if not torch.cuda.is_available():
        missing.append("torch %s sees no CUDA device (torch.version.cuda=%s)"
                       % (torch.__version__, torch.version.cuda))
    if missing:
        fail("; ".join(missing))
    return torch


class Layer:
    """Random weights of one MoE layer on the device, nn.Linear layout ([out][in])."""

    def __init__(self, torch, a, device, dtype):
        self.torch = torch
        self.k = a.top_k
        self.inter = a.inter
        self.gate_fp32 = a.gate_dtype == "fp32"
        g = torch.Generator(device=device)
        g.manual_seed(a.seed)
        h, i, e = a.hidden, a.inter, a.experts

        def rand(shape, fan_in, dt):
            w = torch.randn(shape, generator=g, device=device, dtype=dt)
            return w.mul_(fan_in ** -0.5)

        self.wg = rand((e, h), h, torch.float32 if self.gate_fp32 else dtype)
        # Expert e: rows [0, I) of w13[e] are the gate projection, [I, 2I) the up projection.
        self.w13 = rand((e, 2 * i, h), h, dtype)
        self.w2 = rand((e, h, i), i, dtype)
        self.shared = None
        if a.shared_inter > 0:
            s = a.shared_inter
            self.shared = (rand((2 * s, h), h, dtype), rand((h, s), s, dtype))
        # torch._grouped_mm(A [M][K], B [G][K][N], offs) with B a transposed view of [G][N][K].
        self.w13_t = self.w13.transpose(-2, -1)
        self.w2_t = self.w2.transpose(-2, -1)

    def forward(self, x):
        torch = self.torch
        F = torch.nn.functional
        t = x.shape[0]
        e = self.w13.shape[0]
        logits = F.linear(x.float() if self.gate_fp32 else x, self.wg)
        probs = logits.float().softmax(dim=-1)
        topw, topi = probs.topk(self.k, dim=-1)
        topw = topw / topw.sum(dim=-1, keepdim=True)
        flat = topi.reshape(-1)
        order = flat.argsort(stable=True)  # sort the (token, expert) pairs by expert
        token_of = order // self.k
        counts = torch.bincount(flat, minlength=e)
        offs = counts.cumsum(0).to(torch.int32)
        rows = x.index_select(0, token_of)
        h = torch._grouped_mm(rows, self.w13_t, offs=offs)
        act = F.silu(h[:, :self.inter]) * h[:, self.inter:]
        y = torch._grouped_mm(act, self.w2_t, offs=offs)
        y = y * topw.reshape(-1).index_select(0, order).unsqueeze(1).to(y.dtype)
        out = torch.zeros((t, x.shape[1]), device=x.device, dtype=y.dtype)
        out.index_add_(0, token_of, y)
        if self.shared is not None:
            w13s, w2s = self.shared
            hs = F.linear(x, w13s)
            s = w2s.shape[1]
            out = out + F.linear(F.silu(hs[:, :s]) * hs[:, s:], w2s)
        return out

    def reference(self, x):
        """A plain loop over tokens and their experts, in fp32."""
        torch = self.torch
        F = torch.nn.functional
        xf = x.float()
        probs = F.linear(xf, self.wg.float()).softmax(dim=-1)
        topw, topi = probs.topk(self.k, dim=-1)
        topw = topw / topw.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(xf)
        for t in range(x.shape[0]):
            for j in range(self.k):
                e = int(topi[t, j])
                w13 = self.w13[e].float()
                hh = w13 @ xf[t]
                a = F.silu(hh[:self.inter]) * hh[self.inter:]
                out[t] += topw[t, j] * (self.w2[e].float() @ a)
        if self.shared is not None:
            w13s, w2s = (w.float() for w in self.shared)
            s = w2s.shape[1]
            hs = xf @ w13s.t()
            out += (F.silu(hs[:, :s]) * hs[:, s:]) @ w2s.t()
        return out


def check(torch, dtype, device):
    """A small case (some experts get no rows) against the loop; returns the report or fails."""
    small = argparse.Namespace(hidden=64, inter=32, experts=6, top_k=2, shared_inter=16,
                               gate_dtype="fp32", seed=7)
    layer = Layer(torch, small, device, dtype)
    g = torch.Generator(device=device)
    g.manual_seed(3)
    x = torch.randn((5, 64), generator=g, device=device, dtype=dtype)
    got = layer.forward(x).float()
    want = layer.reference(x)
    rel = float((got - want).norm() / want.norm().clamp_min(1e-30))
    report = {"tokens": 5, "hidden": 64, "experts": 6, "top_k": 2, "rel_err": rel}
    if not rel <= 3e-2:
        fail("--check: torch._grouped_mm path differs from the loop: relative error %.3g" % rel)
    return report


def main(argv):
    a = parse_args(argv)
    torch = import_torch()
    try:
        if a.device_index >= torch.cuda.device_count():
            fail("--device-index %d: torch sees %d CUDA device(s)"
                 % (a.device_index, torch.cuda.device_count()))
        device = torch.device("cuda", a.device_index)
        torch.cuda.set_device(device)
        dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
        result = {
            "ok": True,
            "torch_version": torch.__version__,
            "device": torch.cuda.get_device_name(device),
            "what": "gate linear (%s) + softmax/top-k + sort by expert + torch._grouped_mm "
                    "gate_up/down + SwiGLU + weighted index_add%s, %s, CUDA events, median"
                    % (a.gate_dtype, " + dense shared expert" if a.shared_inter else "", a.dtype),
        }
        with torch.inference_mode():
            if a.check:
                result["check"] = check(torch, dtype, device)
            layer = Layer(torch, a, device, dtype)
            ms, min_ms, reps = {}, {}, {}
            g = torch.Generator(device=device)
            for t in a.token_list:
                g.manual_seed(a.seed * 1000003 + t)
                x = torch.randn((t, a.hidden), generator=g, device=device, dtype=dtype)
                for _ in range(max(a.warmup, 1)):
                    layer.forward(x)
                torch.cuda.synchronize()
                times = []
                start = time.monotonic()
                while len(times) < a.max_reps:
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record()
                    layer.forward(x)
                    e1.record()
                    e1.synchronize()
                    times.append(e0.elapsed_time(e1))
                    if len(times) >= 3 and time.monotonic() - start >= a.min_time:
                        break
                times.sort()
                ms[str(t)] = times[len(times) // 2]
                min_ms[str(t)] = times[0]
                reps[str(t)] = len(times)
                del x
        result.update({"ms": ms, "min_ms": min_ms, "reps": reps})
    except SystemExit:
        raise
    except Exception as e:  # out of memory, a kernel's refusal, ...
        fail("%s: %s" % (type(e).__name__, e))
    emit(result, 0)


if __name__ == "__main__":
    main(sys.argv[1:])
