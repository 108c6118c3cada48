#!/usr/bin/env python3
"""Small helpers for the expert-parallel shell tests (standard library only).

  st_tool.py experts MODEL_DIR
      prints the number of routed experts of a Hugging Face MoE folder (config.json)
  st_tool.py placement MODEL_DIR NUM_RANKS OUT.json
      writes a moerun-placement-v1 JSON for 1 router + NUM_RANKS-1 expert ranks: every expert on
      one rank (round robin from the last rank down), every third expert replicated on a second
      rank when there are at least two expert ranks; slots in a shuffled (seeded) order
  st_tool.py input OUT.safetensors TOKENS HIDDEN [SEED]
      writes tensor "input" F32 [TOKENS, HIDDEN]: 64 distinct random rows, tiled
  st_tool.py fp8-model OUT_DIR EXPERTS HIDDEN INTER
      writes a 1-layer DeepSeek-V3 folder in the published FP8 format (random e4m3 codes, F32
      scale_inv per 128x128 block, routed and shared experts) and prints the bytes of the routed
      experts' tensors
  st_tool.py shard MODEL_DIR OUT_DIR
      writes a 3-shard checkpoint of a 1-layer fixture as a 2-layer model: shards 1 and 2 hold
      the fixture's tensors (layer 0), shard 3 a copy of the layer-0 tensors renamed to layer 1;
      model.safetensors.index.json maps every tensor to its shard; config.json says 2 layers
  st_tool.py same-tensor A.safetensors B.safetensors NAME
      exit 0 if tensor NAME has the same dtype, shape and bytes in both files (metadata ignored)
"""
import json
import os
import random
import struct
import sys

EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")


def num_experts(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    for k in EXPERT_KEYS:
        if isinstance(cfg.get(k), int) and cfg[k] > 0:
            return cfg[k]
    raise SystemExit(f"{model_dir}/config.json: no expert count ({', '.join(EXPERT_KEYS)})")


def write_placement(model_dir, ranks, out):
    e_count = num_experts(model_dir)
    hosts = list(range(1, ranks))
    if not hosts:
        raise SystemExit("placement: need at least 2 ranks")
    slots = []
    for e in range(e_count):
        primary = hosts[-1 - (e % len(hosts))]
        slots.append([primary, e])
        if len(hosts) >= 2 and e % 3 == 0:
            second = hosts[(hosts.index(primary) + 1) % len(hosts)]
            slots.append([second, e])
    random.Random(1234 + ranks * 100 + e_count).shuffle(slots)
    doc = {"format": "moerun-placement-v1", "version": 3, "num_experts": e_count,
           "num_ranks": ranks, "num_routers": 1, "layers": {"*": slots}}
    with open(out, "w") as f:
        json.dump(doc, f)
    replicated = sum(1 for e in range(e_count) if sum(1 for s in slots if s[1] == e) > 1)
    print(f"{len(slots)} slots, {replicated} replicated experts")


def write_safetensors(path, tensors, meta=None):
    """tensors: list of (name, dtype, shape, bytes)."""
    header = {}
    off = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
    if meta:
        header["__metadata__"] = meta
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _, _, _, data in tensors:
            f.write(data)


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", None)
    base = 8 + n
    out = []
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        a, b = info["data_offsets"]
        out.append((name, info["dtype"], info["shape"], blob[base + a:base + b]))
    return out, meta


def write_input(out, tokens, hidden, seed):
    rng = random.Random(seed)
    distinct = min(tokens, 64)
    rows = [struct.pack(f"<{hidden}f", *[rng.gauss(0.0, 1.0) for _ in range(hidden)])
            for _ in range(distinct)]
    data = b"".join(rows[t % distinct] for t in range(tokens))
    write_safetensors(out, [("input", "F32", [tokens, hidden], data)])


def write_fp8_model(out_dir, experts, hidden, inter, seed=5):
    """A DeepSeek-V3 layer in the published FP8 format (e4m3 codes, F32 scale_inv per 128x128
    block) with random codes: for measuring what FP8 experts cost in memory. Prints the bytes of
    the routed experts' tensors (codes and scales)."""
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(seed)
    no_nan = bytes(range(256)).replace(b"\x7f", b"\x7e").replace(b"\xff", b"\xfe")
    tensors, expert_bytes = [], 0
    L = "model.layers.0.mlp."

    def fp8(name, rows, cols):
        codes = os.urandom(rows * cols).translate(no_nan)
        shape = [(rows + 127) // 128, (cols + 127) // 128]
        scales = struct.pack(f"<{shape[0] * shape[1]}f",
                             *[rng.uniform(1e-3, 4e-3) for _ in range(shape[0] * shape[1])])
        tensors.append((name, "F8_E4M3", [rows, cols], codes))
        tensors.append((name + "_scale_inv", "F32", shape, scales))
        return len(codes) + len(scales)

    for e in range(experts):
        for proj, rows, cols in (("gate_proj", inter, hidden), ("up_proj", inter, hidden),
                                 ("down_proj", hidden, inter)):
            expert_bytes += fp8(f"{L}experts.{e}.{proj}.weight", rows, cols)
    for proj, rows, cols in (("gate_proj", inter, hidden), ("up_proj", inter, hidden),
                             ("down_proj", hidden, inter)):
        fp8(f"{L}shared_experts.{proj}.weight", rows, cols)
    gate = struct.pack(f"<{experts * hidden}f",
                       *[rng.gauss(0.0, 0.05) for _ in range(experts * hidden)])
    tensors.append((L + "gate.weight", "F32", [experts, hidden], gate))
    tensors.append((L + "gate.e_score_correction_bias", "F32", [experts],
                    struct.pack(f"<{experts}f", *[0.0] * experts)))
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, {"format": "pt"})
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
              "hidden_size": hidden, "moe_intermediate_size": inter, "intermediate_size": 4 * inter,
              "n_routed_experts": experts, "num_experts_per_tok": 8, "n_group": 8,
              "topk_group": 4, "n_shared_experts": 1, "norm_topk_prob": True,
              "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
              "first_k_dense_replace": 0, "moe_layer_freq": 1, "num_hidden_layers": 1,
              "torch_dtype": "bfloat16",
              "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                      "quant_method": "fp8", "weight_block_size": [128, 128]}}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(expert_bytes)


def write_shards(model_dir, out_dir):
    tensors, _ = read_safetensors(os.path.join(model_dir, "model.safetensors"))
    prefix = "model.layers.0."
    layer0 = [t for t in tensors if t[0].startswith(prefix)]
    if not layer0:
        raise SystemExit("shard: no layer-0 tensors")
    half = (len(tensors) + 1) // 2
    shards = [tensors[:half], tensors[half:],
              [("model.layers.1." + n[len(prefix):], d, s, b) for n, d, s, b in layer0]]
    names = [f"model-{i + 1:05d}-of-00003.safetensors" for i in range(3)]
    weight_map = {}
    os.makedirs(out_dir, exist_ok=True)
    for name, shard in zip(names, shards):
        write_safetensors(os.path.join(out_dir, name), shard, {"format": "pt"})
        for t in shard:
            weight_map[t[0]] = name
    total = sum(len(t[3]) for s in shards for t in s)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 2
    for key in ("mlp_only_layers",):
        if key in cfg:
            cfg[key] = []
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    print(" ".join(names))


def same_tensor(a, b, name):
    ta = {t[0]: t for t in read_safetensors(a)[0]}
    tb = {t[0]: t for t in read_safetensors(b)[0]}
    if name not in ta or name not in tb:
        print(f"tensor '{name}' missing in {a if name not in ta else b}")
        return 1
    (_, da, sa, ba), (_, db, sb, bb) = ta[name], tb[name]
    if (da, sa) != (db, sb):
        print(f"'{name}': {da}{sa} vs {db}{sb}")
        return 1
    if ba != bb:
        first = next(i for i in range(len(ba)) if ba[i] != bb[i])
        print(f"'{name}': bytes differ from byte {first} on")
        return 1
    print(f"'{name}' {da}{sa}: bitwise identical")
    return 0


def main(argv):
    if len(argv) < 2:
        raise SystemExit(__doc__)
    cmd = argv[1]
    if cmd == "experts" and len(argv) == 3:
        print(num_experts(argv[2]))
    elif cmd == "placement" and len(argv) == 5:
        write_placement(argv[2], int(argv[3]), argv[4])
    elif cmd == "input" and len(argv) in (5, 6):
        write_input(argv[2], int(argv[3]), int(argv[4]), int(argv[5]) if len(argv) == 6 else 7)
    elif cmd == "fp8-model" and len(argv) == 6:
        write_fp8_model(argv[2], int(argv[3]), int(argv[4]), int(argv[5]))
    elif cmd == "shard" and len(argv) == 4:
        write_shards(argv[2], argv[3])
    elif cmd == "same-tensor" and len(argv) == 5:
        sys.exit(same_tensor(argv[2], argv[3], argv[4]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
