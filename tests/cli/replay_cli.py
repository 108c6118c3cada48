#!/usr/bin/python3
"""`moebench replay` on the recorded routing copied to tests/data/routing, as a user runs it, with
small settings (8 expert ranks on 2 nodes, 2 routers a node, one planner run):

  - the JSON report: one result per trace x ranks x policy, each with its configuration; window
    balancedness in (0, 1] with min <= mean; per-batch figures for the token-level
    traces only (null for window counts): imbalance >= 0 with p50 <= p95 <= max <= ranks - 1,
    the most experts a rank computes <= its slots, shares in [0, 1], 1 <= nodes per token <= nodes;
    a batch size no stream fills says so; eplb-hierarchical where groups % nodes != 0 is "not
    applicable", not an error;
  - the table on stderr names every trace;
  - bad input (a missing file, a cross-layer pair file, bad numbers, slots or nodes that do not
    divide) ends with exit 2 and one line.

  /usr/bin/python3 tests/cli/replay_cli.py MOEBENCH ROUTING_DIR   (ctest: cli_moebench_replay)
"""

import json
import os
import subprocess
import sys

MOEBENCH, DATA = sys.argv[1], sys.argv[2]
DEEPSEEK = os.path.join(DATA, "deepseek-r1", "prefill_in1024.json")
QWEN_NPY = os.path.join(DATA, "qwen3-30b-a3b", "batch_8_topk_ids_layers48_x_tokens_x_top8.npy")
QWEN_CSV = os.path.join(DATA, "qwen3-30b-a3b", "batch_8_counts_48x128.csv")
MIXTRAL = os.path.join(DATA, "mixtral-8x7b", "gsm8k_2_routing.jsonl")
OLMOE = os.path.join(DATA, "olmoe", "olmoe-1b-7b", "expert_counts", "arxiv.json")
CROSS = os.path.join(DATA, "olmoe", "mixtral-8x7b-domains", "expert_counts_crosslayer", "arxiv.json")
TOKEN_LEVEL = {QWEN_NPY, MIXTRAL}

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def run(args):
    p = subprocess.run([MOEBENCH, "replay"] + args, stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=100)
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


def in_unit(v):
    return isinstance(v, (int, float)) and 0.0 <= v <= 1.0


# --- the main run ---
traces = [DEEPSEEK, QWEN_NPY, QWEN_CSV, MIXTRAL, OLMOE]
policies = ["default", "eplb-global", "eplb-hierarchical", "node-aware"]
args = []
for t in traces:
    args += ["--trace", t]
args += ["--ranks", "8", "--redundant", "8", "--nodes", "2", "--routers-per-node", "2",
         "--groups", "8", "--batch", "32,256", "--policies", ",".join(policies),
         "--timing-runs", "1", "--plan-fraction", "0.5", "--json"]
code, out, err = run(args)
if code != 0:
    sys.exit(f"FAIL: moebench replay exited {code}:\n{err}")
report = json.loads(out)
check(report["bench"] == "replay", "bench name")
results = report["results"]
check(len(results) == len(traces) * len(policies),
      f"{len(results)} results, expected {len(traces) * len(policies)}")
for r in results:
    name = f"{os.path.basename(r['trace'])} {r['policy']}"
    check(r["trace"] in traces, f"{name}: unknown trace")
    check(r["ranks"] == 8 and r["redundant"] == 8 and r["nodes"] == 2, f"{name}: configuration")
    check(r["slots"] == r["experts"] + 8, f"{name}: slots")
    check(r["applicable"] is True, f"{name}: not applicable ({r.get('note')})")
    token_level = r["trace"] in TOKEN_LEVEL
    check(r["format"] == ("tokens" if token_level else "window"), f"{name}: format")
    check(r["planned_on"].startswith("the first 0.5") == token_level, f"{name}: planned_on")
    w = r["window_balancedness"]
    check(0 < w["min"] <= w["mean"] <= 1 + 1e-12, f"{name}: window balancedness {w}")
    check(r["planner_ms_per_layer"] >= 0, f"{name}: planner ms")
    if not token_level:
        check(r["batches"] is None, f"{name}: window counts have no batches")
        continue
    check([b["batch_tokens"] for b in r["batches"]] == [32, 256], f"{name}: batch sizes")
    for b in r["batches"]:
        bn = f"{name} B={b['batch_tokens']}"
        check(b["tokens_judged"] + b["tokens_left_out"] > 0, f"{bn}: no tokens")
        if b["batches"] == 0:
            check("no full batch" in b.get("note", ""), f"{bn}: no batch and no note")
            check(r["trace"] == MIXTRAL and b["batch_tokens"] == 256, f"{bn}: unexpected no batch")
            continue
        i = b["imbalance"]
        check(0 <= i["p50"] <= i["p95"] <= i["max"] <= 7 + 1e-9, f"{bn}: imbalance {i}")
        check(0 <= i["mean"] <= i["max"] + 1e-12, f"{bn}: imbalance mean {i}")
        e = b["max_rank_experts"]
        check(1 <= e["mean"] <= e["max"] <= r["slots"] // 8, f"{bn}: experts {e}")
        for k, v in b["off_node_share"].items():
            check(in_unit(v), f"{bn}: off-node share {k} = {v}")
        check(1 <= b["nodes_per_token"] <= 2, f"{bn}: nodes per token {b['nodes_per_token']}")
        check(0 <= b["off_node_copies_per_token"] <= b["nodes_per_token"],
              f"{bn}: off-node copies per token {b['off_node_copies_per_token']}")
for t in traces:
    check(os.path.basename(t)[-20:] in err, f"the table lacks {t}")

# --- a policy that does not apply ---
code, out, err = run(["--trace", QWEN_CSV, "--ranks", "8", "--nodes", "2", "--groups", "1",
                      "--policies", "eplb-hierarchical,eplb-global", "--timing-runs", "1",
                      "--json"])
check(code == 0, f"not-applicable run exited {code}: {err}")
if code == 0:
    rs = json.loads(out)["results"]
    check(rs[0]["applicable"] is False and "groups" in rs[0]["note"], f"hierarchical: {rs[0]}")
    check(rs[1]["applicable"] is True, "eplb-global applies")
    check("not applicable" in err, "the table says not applicable")

# --- bad input: exit 2, one line ---
BAD = [
    (["--trace", os.path.join(DATA, "no-such-file.npy")], "no-such-file.npy"),
    (["--trace", CROSS], "cross-layer"),
    (["--trace", QWEN_CSV, "--ranks", "8,x"], "--ranks"),
    (["--trace", QWEN_CSV, "--ranks", "7"], "do not divide over 7 ranks"),
    (["--trace", QWEN_CSV, "--ranks", "8", "--nodes", "3"], "--nodes"),
    (["--trace", QWEN_CSV, "--ranks", "8,16", "--redundant", "1,2,3"], "--redundant"),
    (["--trace", QWEN_CSV, "--policies", "best"], "--policies"),
    (["--trace", QWEN_CSV, "--plan-fraction", "1.5"], "--plan-fraction"),
    (["--trace", QWEN_CSV, "--batch", "0"], "--batch"),
    (["--trace", MIXTRAL, "--experts", "4"], "has 4 experts"),
]
for bad, fragment in BAD:
    code, out, err = run(bad)
    text = (out + err).strip("\n")
    if code != 2 or "\n" in text or fragment not in text:
        failures.append(f"{' '.join(bad)}: exit {code}, expected 2 and one line naming "
                        f"'{fragment}'; got {text!r}")

if failures:
    print("FAIL:\n  " + "\n  ".join(failures))
    sys.exit(1)
print(f"ok: moebench replay: {len(results)} results checked, {len(BAD)} bad inputs refused")
