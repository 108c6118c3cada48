#!/usr/bin/env python3
"""The sizing table of docs/performance-model.md: `moebench model` with a user's figures for
H200 nodes (none of it ran on a GPU), for DeepSeek-V3 FP8 and Qwen3-235B-A22B (BF16 and FP8).

For each model and node count: memory per GPU for the MoE layers' weights, and at a few batch
sizes the per-layer time, the MoE layers' time per batch and tokens/s; then, for a few targets
(tokens/s through all MoE layers at a bound on the MoE layers' time per batch), the fewest
nodes that meet them.

  scripts/model-sizing.py [--bin build/bin] [--markdown]
"""
import argparse
import json
import os
import subprocess
import sys

# H200 SXM, 8 per node: HBM3e 4.8 TB/s; dense 989 TFLOP/s BF16, 1979 FP8; NVLink 900 GB/s per
# GPU (450 GB/s each way); 8 x 400 Gb/s InfiniBand a node (50 GB/s per GPU each way).
FIGURES = ["--device-gbps", "4800", "--link-gbps", "450", "--link-us", "3", "--net-gbps", "50",
           "--net-us", "6", "--kernel-us", "10", "--ranks-per-node", "8"]
TFLOPS = {"bf16": "989", "fp8": "1979"}
HBM_GIB = 141 * 1e9 / 2**30
MODELS = [
    ("DeepSeek-V3 FP8", ["--preset", "deepseek-v3", "--dtype", "fp8"], "fp8"),
    ("Qwen3-235B-A22B BF16", ["--preset", "qwen3-30b-a3b", "--hidden", "4096", "--inter", "1536",
                              "--moe-layers", "94", "--dtype", "bf16"], "bf16"),
    ("Qwen3-235B-A22B FP8", ["--preset", "qwen3-30b-a3b", "--hidden", "4096", "--inter", "1536",
                             "--moe-layers", "94", "--dtype", "fp8"], "fp8"),
]
NODES = [1, 2, 4, 8]
TOKENS_PER_GPU = [16, 128, 1024, 4096]
# (tokens/s through all MoE layers, bound on the MoE layers' ms per batch)
TARGETS = [(10000, 30), (30000, 50), (60000, 300), (100000, 1000)]


def model(bindir, args, nodes, tokens, dtype):
    cmd = [os.path.join(bindir, "moebench"), "model"] + args + FIGURES + [
        "--device-tflops", TFLOPS[dtype], "--nodes", str(nodes), "--tokens", str(tokens)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        sys.exit("moebench model failed: " + " ".join(cmd) + "\n" + r.stderr)
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default="build/bin")
    a = ap.parse_args()
    print("| model | nodes x 8 | GiB/GPU (MoE weights) | tokens/GPU | layer ms | "
          "MoE layers ms | tokens/s | of which expert ms |")
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for name, args, dtype in MODELS:
        for nodes in NODES:
            for per_gpu in TOKENS_PER_GPU:
                j = model(a.bin, args, nodes, per_gpu * 8 * nodes, dtype)
                p = j["prediction"]
                gib = j["memory"]["max_gib_all_moe_layers"]
                results[(name, nodes, per_gpu)] = (p["moe_layers_ms"],
                                                   p["moe_layers_tokens_per_s"], gib)
                print(f"| {name} | {nodes} | {gib:.0f} | {per_gpu} | {p['layer_ms']:.3f} | "
                      f"{p['moe_layers_ms']:.1f} | {p['moe_layers_tokens_per_s']:.0f} | "
                      f"{p['expert_ms']:.3f} |")
    print()
    print("| model | target tokens/s | MoE layers ms at most | fewest nodes | at tokens/GPU | "
          "predicted tokens/s | MoE layers ms |")
    print("|---|---|---|---|---|---|---|")
    for name, _, _ in MODELS:
        for rate, bound in TARGETS:
            best = None
            for nodes in NODES:
                for per_gpu in TOKENS_PER_GPU:
                    ms, tps, gib = results[(name, nodes, per_gpu)]
                    # Weights must leave room on the GPU (here: at most 70 % of its HBM for the
                    # MoE weights and buffers, the rest for attention, KV cache, activations).
                    if gib <= 0.7 * HBM_GIB and tps >= rate and ms <= bound:
                        best = (nodes, per_gpu, tps, ms)
                        break
                if best:
                    break
            if best:
                print(f"| {name} | {rate} | {bound} | {best[0]} | {best[1]} | {best[2]:.0f} | "
                      f"{best[3]:.1f} |")
            else:
                print(f"| {name} | {rate} | {bound} | more than {NODES[-1]} | | | |")


if __name__ == "__main__":
    main()
