#!/usr/bin/python3
"""Writes expected.json: the maps that DeepSeek's published eplb.py gives on the README example and
on seeded random load matrices. moerun's C++ port (router/planner.cc) must reproduce them exactly
(tests/unit/planner_test.cc). eplb.py is not part of this repository: download it from
https://github.com/deepseek-ai/EPLB (see README.md here for the version and its sha256) and pass
the folder that holds it:

Run with Debian's python3-torch:  /usr/bin/python3 tests/data/eplb/make_expected.py EPLB_DIR
The output is deterministic: running it again rewrites the same bytes.

Ties. eplb.py sorts with torch's default, unstable sort: torch 1.13 on the CPU runs std::sort over
(value, index) pairs comparing values only, so equal values (always present: the replicas of one
expert carry equal loads) come out in the order libstdc++'s introsort leaves them. The C++ port
calls the same std::sort with the same comparator, and so reproduces that order. eplb.py also picks
the hottest expert with Tensor.max(dim), whose index among equal maxima is not specified; the C++
port takes the first. Every case below is also run with Tensor.max patched to return the first
index, and a case is kept only if both runs agree (otherwise it is redrawn from the same seeded
generator; how many were redrawn is recorded), so no stored map depends on max's tie order.
"""
import json
import os
import random
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if len(sys.argv) != 2 or not os.path.isfile(os.path.join(sys.argv[1], "eplb.py")):
    sys.exit("usage: make_expected.py EPLB_DIR (the folder holding DeepSeek's eplb.py)")
sys.path.insert(0, os.path.abspath(sys.argv[1]))
import eplb  # noqa: E402

_orig_max = torch.Tensor.max


class _MaxResult:
    def __init__(self, values, indices):
        self.values, self.indices = values, indices


def _first_max(self, *args, **kwargs):
    dim = kwargs.get("dim", args[0] if args else None)
    if dim is None:
        return _orig_max(self)
    values = _orig_max(self, dim=dim).values
    n = self.size(dim)
    ar = torch.arange(n, dtype=torch.int64).view([n if d == dim % self.dim() else 1
                                                 for d in range(self.dim())])
    big = torch.full_like(ar, n)
    indices = torch.where(self == values.unsqueeze(dim), ar, big).min(dim=dim).values
    return _MaxResult(values, indices)


def run_eplb(load, num_slots, num_groups, num_nodes, num_gpus, tie_rules):
    weight = torch.tensor(load)
    if tie_rules:
        torch.Tensor.max = _first_max
    try:
        phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, num_slots, num_groups,
                                                          num_nodes, num_gpus)
    finally:
        torch.Tensor.max = _orig_max
    return phy2log.tolist(), log2phy.tolist(), logcnt.tolist()


def make_case(name, load, num_slots, num_groups, num_nodes, num_gpus, load_kind):
    got = run_eplb(load, num_slots, num_groups, num_nodes, num_gpus, tie_rules=False)
    ref = run_eplb(load, num_slots, num_groups, num_nodes, num_gpus, tie_rules=True)
    if got != ref:
        return None
    policy = "eplb-hierarchical" if num_groups % num_nodes == 0 else "eplb-global"
    return {"name": name, "policy": policy, "load_kind": load_kind, "num_slots": num_slots,
            "num_groups": num_groups, "num_nodes": num_nodes, "num_gpus": num_gpus,
            "load": load, "phy2log": got[0], "log2phy": got[1], "logcnt": got[2]}


def distinct(values):
    return len(set(values)) == len(values)


def random_load(rng, kind, layers, experts):
    load = []
    for _ in range(layers):
        while True:
            if kind == "int":
                row = rng.sample(range(1, 100000), experts)
            elif kind == "zipf":
                s = rng.choice([0.8, 1.1, 1.5])
                row = [int(1000000 / (i + 1) ** s) + rng.randrange(1000) for i in range(experts)]
                rng.shuffle(row)
            else:  # "float": distinct positive doubles
                row = [rng.uniform(0.0, 1000.0) for _ in range(experts)]
            if distinct(row):
                break
        load.append(row)
    return load


# (experts, groups, nodes, gpus, slots). Hierarchical when groups % nodes == 0, else EPLB's
# global fallback.
CONFIGS = [
    (8, 4, 2, 4, 8), (8, 2, 2, 4, 12), (12, 4, 2, 8, 16), (16, 4, 2, 4, 20),
    (16, 8, 4, 8, 24), (32, 8, 2, 8, 40), (64, 8, 4, 16, 80), (64, 16, 4, 8, 72),
    (24, 6, 3, 6, 30), (48, 8, 1, 4, 48), (8, 4, 4, 4, 8), (32, 4, 4, 16, 64),
    # global fallback: groups % nodes != 0
    (8, 1, 2, 4, 12), (12, 3, 2, 4, 16), (16, 4, 3, 6, 24), (32, 8, 3, 3, 36),
    (64, 16, 3, 6, 66), (20, 5, 2, 4, 24), (40, 5, 4, 8, 48), (64, 8, 5, 5, 80),
]
KINDS = ["int", "zipf", "int", "zipf", "float"]


def main():
    cases = []
    weight = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
              [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
    case = make_case("readme", weight, 16, 4, 2, 8, "readme")
    assert case is not None and case["policy"] == "eplb-hierarchical"
    assert case["phy2log"] == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                               [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    cases.append(case)
    rng = random.Random(20250607)
    redrawn = 0
    for i, (experts, groups, nodes, gpus, slots) in enumerate(CONFIGS):
        kind = KINDS[i % len(KINDS)]
        if kind == "float" and groups % nodes == 0 and nodes > 1:
            kind = "int"  # group sums in float32 would depend on torch's summation order
        layers = 1 + i % 3
        for _ in range(100):
            load = random_load(rng, kind, layers, experts)
            case = make_case(f"random-{i:02d}", load, slots, groups, nodes, gpus, kind)
            if case is not None:
                break
            redrawn += 1
        assert case is not None, f"case {i}: no draw without ambiguous ties"
        cases.append(case)
    out = os.path.join(HERE, "expected.json")
    with open(out, "w") as f:
        f.write('{"format": "moerun-eplb-expected-v1",\n')
        f.write(f' "torch": {json.dumps(torch.__version__)},\n')
        f.write(f' "redrawn_for_ties": {redrawn},\n')
        f.write(' "cases": [\n')
        for n, c in enumerate(cases):
            f.write("  {" + ",\n   ".join(f"{json.dumps(k)}: {json.dumps(v)}"
                                          for k, v in c.items()))
            f.write("}" + (",\n" if n + 1 < len(cases) else "\n"))
        f.write(" ]}\n")
    print(f"{out}: {len(cases)} cases ({redrawn} redrawn for ties)")


if __name__ == "__main__":
    main()
