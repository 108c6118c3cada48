#!/usr/bin/python3
"""`moebench cache-replay` on the recorded routing copied to tests/data/routing, as a user runs it,
with small settings (the Qwen3 batch at 4 ranks in batches of 512 tokens at a 25 % budget, the
Mixtral decode traces at 1 and 4 ranks, token by token, at 10 % and 25 %; adaptive, lfu, lru and cycle;
look-ahead 0 and 1):

  - the JSON report: one result per trace x ranks x batch x budget, each policy x look-ahead in it;
    hit rates in [0, 1] with the worst rank's <= the mean; Belady's hit rate >= every policy's at
    look-ahead 0 (it is the optimum, also rank by rank: the worst-rank gap >= 0) and gap_points
    equal to 100 x (Belady - policy) on average; hits + misses = needs, the same needs for every
    policy and Belady; compulsory <= Belady's misses; prefetched 0 at look-ahead 0 and <= misses;
    capacity = floor(budget x hosted) per rank; adaptive within 1.5 points of the best of the
    other three at every point;
  - bad input (a missing file, window counts, a budget out of range, an unknown policy) ends with
    exit 2 and one line.

  /usr/bin/python3 tests/cli/cache_replay_cli.py MOEBENCH ROUTING_DIR   (ctest: cli_moebench_cache_replay)
"""

import json
import math
import os
import subprocess
import sys

MOEBENCH, DATA = sys.argv[1], sys.argv[2]
QWEN = os.path.join(DATA, "qwen3-30b-a3b", "batch_8_topk_ids_layers48_x_tokens_x_top8.npy")
MIXTRAL = os.path.join(DATA, "mixtral-8x7b", "gsm8k_2_routing.jsonl")
COUNTS = os.path.join(DATA, "deepseek-r1", "prefill_in1024.json")
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def run(args):
    p = subprocess.run([MOEBENCH, "cache-replay"] + args, stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


POLICIES = ("adaptive", "lfu", "lru", "cycle")


def check_report(report, trace, ranks, batches, budgets, lookaheads=(0, 1)):
    results = [r for r in report["results"] if r["trace"] == trace]
    check(len(results) == len(ranks) * len(batches) * len(budgets),
          f"{trace}: {len(results)} results, expected {len(ranks) * len(batches) * len(budgets)}")
    for r in results:
        tag = f"{os.path.basename(trace)} R={r['ranks']} B={r['batch']} budget={r['budget']}"
        check(len(r["capacity"]) == r["ranks"] and len(r["hosted"]) == r["ranks"], tag + ": per rank")
        for c, h in zip(r["capacity"], r["hosted"]):
            check(c == max(1, math.floor(r["budget"] * h + 1e-9)), f"{tag}: capacity {c} of {h}")
        b = r["belady"]
        check(0 <= b["hit_rate_worst"] <= b["hit_rate"] + 1e-12 <= 1 + 1e-12, tag + ": belady rate")
        check(b["hits"] + b["misses"] == r["needs"] > 0, tag + ": belady hits + misses != needs")
        check(0 < b["compulsory"] <= b["misses"], tag + ": compulsory not in (0, misses]")
        check(b["compulsory"] == r["distinct_experts"], tag + ": compulsory != distinct experts")
        seen = set()
        for p in r["policies"]:
            ptag = f"{tag} {p['policy']} la={p['lookahead']}"
            seen.add((p["policy"], p["lookahead"]))
            check(0 <= p["hit_rate_worst"] <= p["hit_rate"] + 1e-12 <= 1 + 1e-12, ptag + ": rate")
            check(p["needs"] == r["needs"], ptag + ": needs differ from Belady's")
            check(p["hits"] + p["misses"] == p["needs"], ptag + ": hits + misses != needs")
            check(0 <= p["prefetched"] <= p["misses"], ptag + ": prefetched not in [0, misses]")
            check(abs(p["gap_points"] - 100 * (b["hit_rate"] - p["hit_rate"])) < 1e-6,
                  ptag + ": gap_points is not Belady's rate minus the policy's")
            if r["ranks"] == 1:
                check(abs(p["hit_rate"] - p["hits"] / p["needs"]) < 1e-12, ptag + ": rate != hits/needs")
            if p["lookahead"] == 0:
                check(p["hit_rate"] <= b["hit_rate"] + 1e-12, ptag + ": above Belady's optimum")
                check(p["gap_points_worst"] >= -1e-9, ptag + ": a rank above Belady's optimum")
                check(p["hits"] <= b["hits"], ptag + ": more hits than Belady")
                check(p["prefetched"] == 0, ptag + ": prefetched without look-ahead")
        check(seen == {(x, a) for x in POLICIES for a in lookaheads},
              tag + f": policies {sorted(seen)}")
        # adaptive follows whichever of the others hits most: never far under the best of them
        # (it learns which one leads over ~1,000 needs, so it can trail by a little).
        for a in lookaheads:
            rate = {p["policy"]: p["hit_rate"] for p in r["policies"] if p["lookahead"] == a}
            best = max(rate["lfu"], rate["lru"], rate["cycle"])
            check(rate["adaptive"] >= best - 0.015,
                  f"{tag} la={a}: adaptive {rate['adaptive']:.3f}, the best other {best:.3f}")


code, out, err = run(["--trace", QWEN, "--ranks", "4", "--batch", "512", "--budget", "0.25",
                      "--policies", ",".join(POLICIES), "--lookahead", "0,1", "--json"])
check(code == 0, f"qwen run exited {code}: {err[-2000:]}")
if code == 0:
    report = json.loads(out)
    check(report["bench"] == "cache-replay", "bench name")
    check_report(report, QWEN, [4], [512], [0.25])
    check("batch_8_topk_ids" in err, "the table does not name the trace")
code, out, err = run(["--trace", MIXTRAL, "--ranks", "1,4", "--batch", "1", "--budget", "0.1,0.25",
                      "--policies", ",".join(POLICIES), "--json"])
check(code == 0, f"mixtral run exited {code}: {err[-2000:]}")
if code == 0:
    check_report(json.loads(out), MIXTRAL, [1, 4], [1], [0.1, 0.25])

for args, fragment in [
        (["--trace", "/nonexistent/routing.npy"], "/nonexistent/routing.npy"),
        (["--trace", COUNTS], "prefill_in1024.json"),
        (["--trace", MIXTRAL, "--budget", "1.5"], "--budget"),
        (["--trace", MIXTRAL, "--policies", "fifo"], "fifo"),
        (["--trace", MIXTRAL, "--lookahead", "2"], "--lookahead"),
        (["--trace", MIXTRAL, "--ranks", "9"], "--ranks")]:
    code, out, err = run(args)
    text = (out + err).strip("\n")
    check(code == 2, f"{' '.join(args)}: exit {code}, not 2")
    check("\n" not in text, f"{' '.join(args)}: more than one line: {text!r}")
    check(fragment in text, f"{' '.join(args)}: does not name {fragment}: {text!r}")

if failures:
    print("FAIL:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("cache-replay: all checks passed")
