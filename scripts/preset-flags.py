#!/usr/bin/env python3
"""The moebench layer flags that build the same layer as a `moerun serve` config's preset.

    scripts/preset-flags.py CONFIG   ->  --preset NAME --seed S [--experts E] [--intermediate I]
                                         [--weights-dtype D] --layer L

Reads the config's `preset:` (a name, a flow mapping `{name: ..., seed: ...}` or a block mapping)
and the first of its `layers:` (a flow list; `all` or none: the preset's first MoE layer, left to
moebench). Only the keys moebench needs are read; the server reads the config strictly itself.
Exit 2 when the config has no preset (a checkpoint config: use --model).
"""
import re
import sys


def parse_scalar(v):
    v = v.strip().split("#", 1)[0].strip()
    return v.strip("'\"")


def preset_of(lines):
    for i, line in enumerate(lines):
        m = re.match(r"^preset:\s*(.*)$", line)
        if not m:
            continue
        rest = m.group(1).split("#", 1)[0].strip()
        if rest.startswith("{"):
            body = rest.strip("{}")
            return dict((k.strip(), parse_scalar(v))
                        for k, v in (kv.split(":", 1) for kv in body.split(",") if ":" in kv))
        if rest:
            return {"name": parse_scalar(rest)}
        out = {}
        for sub in lines[i + 1:]:
            if not sub.startswith((" ", "\t")) or not sub.strip():
                if sub.strip():
                    break
                continue
            if ":" in sub:
                k, v = sub.split(":", 1)
                out[k.strip()] = parse_scalar(v)
        return out
    return None


def first_layer(lines):
    for line in lines:
        m = re.match(r"^layers:\s*\[([^\]]*)\]", line)
        if m and m.group(1).strip():
            return m.group(1).split(",")[0].strip()
    return None


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: preset-flags.py CONFIG")
    lines = open(sys.argv[1]).read().splitlines()
    p = preset_of(lines)
    if not p or "name" not in p:
        print(f"preset-flags: {sys.argv[1]} has no preset (use --model DIR)", file=sys.stderr)
        sys.exit(2)
    flags = ["--preset", p["name"], "--seed", p.get("seed", "1")]
    for key, flag in (("experts", "--experts"), ("intermediate", "--intermediate"),
                      ("dtype", "--weights-dtype")):
        if key in p:
            flags += [flag, p[key]]
    layer = first_layer(lines)
    if layer is not None:
        flags += ["--layer", layer]
    print(" ".join(flags))


if __name__ == "__main__":
    main()
