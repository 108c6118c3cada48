#!/usr/bin/python3
"""`moebench calibrate --quick` and `moebench model`, as a user runs them (small settings):

  - calibrate alone writes a profile with a kernel fit (F32), the gate and the combine; calibrate
    over inproc threads adds a transport entry to the same file (kept: the kernels);
  - model from that profile prints JSON with the parts, the layer time, tokens/s, memory per rank
    and (with --rate) the served p50/p99; the parts add up to the layer time without microbatches;
  - model from a user's figures (DeepSeek-V3 FP8 on two 8-GPU nodes) likewise;
  - --gate-skew samples the preset's gate: the first expert rank (linear placement: the hot,
    low-numbered experts) gets more rows than the last;
  - bad input ends with exit 2 and one line.

  /usr/bin/python3 tests/cli/model_cli.py MOEBENCH   (ctest: cli_moebench_model)
"""

import json
import os
import subprocess
import sys
import tempfile

MOEBENCH = sys.argv[1]
TMP = tempfile.mkdtemp(prefix="moerun-model-cli-")
PROFILE = os.path.join(TMP, "profile.json")
failures = []


def run(args):
    p = subprocess.run([MOEBENCH] + args, capture_output=True, text=True, timeout=100)
    return p.returncode, p.stdout, p.stderr


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL", what)


def ok_json(args):
    code, out, err = run(args)
    if code != 0:
        sys.exit(f"FAIL moebench {' '.join(args)} exited {code}:\n{err}")
    return json.loads(out)


# Calibrate: kernels alone, then the transport over inproc threads into the same file.
p = ok_json(["calibrate", "--quick", "--dtypes", "f32", "--out", PROFILE])
check(p["format"] == "moerun-perf-profile-v1", "profile format")
k = p["kernels"]["F32"]
check(k["fixed_ns"] >= 0 and k["row_ns"] > 0 and len(k["points"]) >= 2, "kernel fit")
check(p["gate"]["mac_ns"] >= 0 and p["gate"]["fixed_us"] >= 0, "gate fit")
check(p["combine"]["value_ns"] > 0, "combine")
check(p["machine"]["cores"] >= 1 and p["machine"]["threads"] >= 1, "machine")
p = ok_json(["calibrate", "--quick", "--transport", "inproc", "--ranks", "3", "--out", PROFILE])
check("F32" in p["kernels"], "the kernels are kept when the transport is measured")
t = p["transports"]
check(len(t) == 1 and t[0]["transport"] == "inproc" and t[0]["ranks"] == 3, "transport entry")
check(t[0]["latency_us"] >= 0 and t[0]["gbps"] > 0, "transport fit")

# The model from the profile.
base = ["model", "--profile", PROFILE, "--preset", "qwen3-30b-a3b", "--experts", "16",
        "--transport", "inproc", "--ranks", "3", "--tokens", "64"]
m = ok_json(base + ["--rate", "20", "--tokens-per-request", "4"])
pr = m["prediction"]
for f in ("gate_ms", "dispatch_ms", "expert_ms", "combine_ms", "layer_ms", "tokens_per_s"):
    check(f in pr and pr[f] > 0, f"prediction.{f} > 0")
check(abs(pr["layer_ms"] - (pr["gate_ms"] + pr["dispatch_ms"] + pr["expert_ms"] +
                            pr["combine_ms"])) < 1e-6 * pr["layer_ms"], "parts add up")
check(len(pr["expert_ms_per_rank"]) == 2 and len(m["memory"]["per_rank"]) == 3, "ranks")
check(m["memory"]["per_rank"][1]["weight_bytes_per_layer"] == 8 * 3 * 2048 * 768 * 4,
      "an expert rank holds 8 F32 experts")
s = m["served"]
check(s["p50_ms"] is not None and s["p99_ms"] >= s["p50_ms"] > 0, "served p50 <= p99")
mb = ok_json(base + ["--microbatch-tokens", "16"])
check(mb["deployment"]["microbatches"] == 4, "microbatches")

# Skewed routing, sampled from the preset's gate.
sk = ok_json(base + ["--gate-skew", "1.2"])
rows = sk["prediction"]["rows_per_rank"]
check(rows[0] > rows[-1], "skew: the hot experts' rank gets more rows")
check(abs(sum(rows) - 64 * 8) < 1e-6, "skew: every selection lands on a rank")

# The model from a user's figures: DeepSeek-V3 FP8 on two nodes of 8 devices.
g = ok_json(["model", "--preset", "deepseek-v3", "--dtype", "fp8", "--device-gbps", "4800",
             "--device-tflops", "1980", "--link-gbps", "450", "--link-us", "3", "--net-gbps",
             "50", "--net-us", "6", "--nodes", "2", "--ranks-per-node", "8", "--tokens", "8192",
             "--rate", "100", "--tokens-per-request", "32"])
check(g["experts"] == 256 and g["top_k"] == 8 and g["moe_layers"] == 58, "deepseek-v3 shape")
check(g["deployment"]["expert_ranks"] == 16 and g["deployment"]["colocated"], "16 devices")
check(g["prediction"]["tokens_per_s"] > 0 and g["memory"]["max_gib_all_moe_layers"] > 0,
      "figures: a prediction")

# Bad input: exit 2, one line.
bad = [
    ["model", "--preset", "qwen3-30b-a3b", "--ranks", "3"],  # no profile, no figures
    base + ["--tokens", "0"],
    base[:2] + [os.path.join(TMP, "missing.json")] + base[3:],
    ["model", "--profile", PROFILE, "--preset", "qwen3-30b-a3b", "--experts", "16", "--ranks",
     "3", "--transport", "ucx"],  # not calibrated
    base + ["--dtype", "bf16"],  # no BF16 kernel in the profile
    base + ["--dtype", "f64"],
    base + ["--loads", PROFILE],  # not numbers
    base + ["--ranks", "1"],
    base + ["--rate", "-1"],
    ["calibrate", "--experts", "0"],
]
for args in bad:
    code, out, err = run(args)
    lines = [line for line in err.splitlines() if line.strip()]
    check(code == 2 and len(lines) == 1, f"exit 2 and one line: {' '.join(args[:12])} "
          f"(exit {code}, {len(lines)} lines: {err.strip()[:200]})")

if failures:
    sys.exit(f"{len(failures)} failures")
print("model_cli: all checks passed")
