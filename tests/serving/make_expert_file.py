#!/usr/bin/env python3
"""Writes one expert's new weights as a .safetensors file, for `moectl expert update`.

    make_expert_file.py --family qwen3 --layer 3 --expert 5 --hidden 2048 --inter 768 \
        --dtype bf16 --seed 1 [--scale 0.05] OUT.safetensors

The file holds that expert's gate, up and down matrices under the names the model's checkpoints
use (the names moerun's LoadLayer resolves):

    qwen3, qwen2_moe, deepseek_v3:
        model.layers.L.mlp.experts.E.gate_proj.weight  [inter, hidden]
        model.layers.L.mlp.experts.E.up_proj.weight    [inter, hidden]
        model.layers.L.mlp.experts.E.down_proj.weight  [hidden, inter]
    mixtral:
        model.layers.L.block_sparse_moe.experts.E.w1.weight  [inter, hidden]  (gate)
        model.layers.L.block_sparse_moe.experts.E.w3.weight  [inter, hidden]  (up)
        model.layers.L.block_sparse_moe.experts.E.w2.weight  [hidden, inter]  (down)

With --dtype fp8 the file is in the published FP8 format (DeepSeek-V3, Qwen3-FP8): F8_E4M3 codes
(random, NaN codes excluded) and an F32 `<name>_scale_inv` per 128x128 block of scale / 448, so
values lie within +-scale.

Values are uniform in +-scale (before BF16 rounding, to nearest even), a pure function of the
arguments: the same arguments always give the same bytes. Pure Python 3 (no numpy), so it runs
wherever python3 does; large shapes take a while (about a second per million values). The
file is written to OUT.tmp and then renamed, so a reader never sees half a file.
"""

import argparse
import array
import json
import math
import os
import random
import sys

FAMILIES = ("qwen3", "qwen2_moe", "mixtral", "deepseek_v3")


def tensor_names(family, layer, expert):
    """(gate, up, down) names for one expert of one layer."""
    prefix = "model.layers.%d." % layer
    if family == "mixtral":
        base = prefix + "block_sparse_moe.experts.%d." % expert
        return base + "w1.weight", base + "w3.weight", base + "w2.weight"
    base = prefix + "mlp.experts.%d." % expert
    return base + "gate_proj.weight", base + "up_proj.weight", base + "down_proj.weight"


def values(rng, count, scale):
    """`count` float32 values uniform in +-scale."""
    return array.array("f", (scale * (2.0 * rng.random() - 1.0) for _ in range(count)))


def to_bytes(vals, dtype):
    """Little-endian bytes of `vals` (array('f')) as F32 or BF16 (round to nearest even)."""
    if dtype == "f32":
        out = array.array("f", vals)
    else:
        bits = array.array("I")
        bits.frombytes(vals.tobytes())
        rounded = []
        for u in bits:
            if (u & 0x7FFFFFFF) > 0x7F800000:  # NaN stays NaN
                rounded.append((u >> 16) | 0x40)
            else:
                rounded.append(((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)
        out = array.array("H", rounded)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


NO_NAN = bytes(range(256)).replace(b"\x7f", b"\x7e").replace(b"\xff", b"\xfe")


def fp8_tensors(rng, name, shape, scale):
    """(codes, scale_inv) tensors of one FP8 matrix: random e4m3 codes, 128x128 block scales."""
    codes = rng.randbytes(shape[0] * shape[1]).translate(NO_NAN)
    blocks = [(shape[0] + 127) // 128, (shape[1] + 127) // 128]
    scales = array.array("f", [scale / 448.0] * (blocks[0] * blocks[1]))
    if sys.byteorder != "little":
        scales.byteswap()
    return [(name, "F8_E4M3", shape, codes), (name + "_scale_inv", "F32", blocks, scales.tobytes())]


def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, dtype name, shape, bytes)."""
    header = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for _, _, _, data in tensors:
            f.write(data)
    os.replace(tmp, path)


def main(argv):
    p = argparse.ArgumentParser(description="Write one MoE expert's weights as .safetensors.")
    p.add_argument("--family", required=True, choices=FAMILIES)
    p.add_argument("--layer", required=True, type=int)
    p.add_argument("--expert", required=True, type=int)
    p.add_argument("--hidden", required=True, type=int)
    p.add_argument("--inter", required=True, type=int)
    p.add_argument("--dtype", required=True, choices=("bf16", "f32", "fp8"))
    p.add_argument("--seed", required=True, type=int)
    p.add_argument("--scale", type=float, default=0.05, help="values in +-scale (default 0.05)")
    p.add_argument("out", metavar="OUT.safetensors")
    a = p.parse_args(argv)
    if a.layer < 0 or a.expert < 0:
        p.error("--layer and --expert must be >= 0")
    if a.hidden <= 0 or a.inter <= 0:
        p.error("--hidden and --inter must be > 0")
    if not (math.isfinite(a.scale) and a.scale > 0):
        p.error("--scale must be a positive number")

    rng = random.Random(a.seed)
    gate, up, down = tensor_names(a.family, a.layer, a.expert)
    st_dtype = {"bf16": "BF16", "f32": "F32", "fp8": "F8_E4M3"}[a.dtype]
    tensors = []
    for name, shape in ((gate, [a.inter, a.hidden]), (up, [a.inter, a.hidden]),
                        (down, [a.hidden, a.inter])):
        if a.dtype == "fp8":
            tensors += fp8_tensors(rng, name, shape, a.scale)
            continue
        data = to_bytes(values(rng, shape[0] * shape[1], a.scale), a.dtype)
        tensors.append((name, st_dtype, shape, data))
    metadata = {"format": "pt", "family": a.family, "layer": str(a.layer),
                "expert": str(a.expert), "seed": str(a.seed), "scale": repr(a.scale)}
    try:
        write_safetensors(a.out, tensors, metadata)
    except OSError as e:
        print("make_expert_file.py: cannot write %s: %s" % (a.out, e), file=sys.stderr)
        return 1
    print("%s: %s, %s, %s (%s)" % (a.out, gate, up, down, st_dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
