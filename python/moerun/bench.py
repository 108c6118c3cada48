"""Throughput and latency of the Python client against `moebench serve`, on the same job.

    python3 -m moerun.bench --target 127.0.0.1:7000 --hidden 64 --tokens-per-request 16
    python3 -m moerun.bench --serve tests/data/hf-moe/qwen3_moe      # starts a local 4-rank job

Both run closed loops with the same number of connections (--concurrency, one request in flight
each), the same request size and dtype, for the same time, one after the other on the same job:
first moebench serve (C++), then the Python client (one thread and one moerun.Client per
connection; sockets release the GIL while they wait). It prints a JSON report:
requests_per_s and latency_ms (p50, p90, p99, max) of each, and speedup_vs_moebench = Python's
requests/s / moebench's (higher is better; the goal is >= 0.8 at 16 tokens/request).
Exit code 0 on success, 1 if a request failed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Dict, List

import numpy as np

import moerun
from moerun.job import LocalJob, find_binary


def percentiles(ms: List[float]) -> Dict[str, float]:
    if not ms:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    a = np.sort(np.asarray(ms))

    def q(p):
        return float(a[min(len(a) - 1, int(p * len(a)))])

    return {"p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "max": float(a[-1])}


def python_loop(targets, hidden, tokens, dtype, concurrency, duration, warmup, inputs, layer):
    """Closed loop, one thread and connection per slot. Returns the report's 'python' block."""
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((tokens, hidden), dtype=np.float32) for _ in range(inputs)]
    lat: List[List[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    first_error: List[str] = []
    start = time.monotonic()
    t_measure = start + warmup
    t_end = t_measure + duration

    def worker(i):
        try:
            c = moerun.Client(targets, timeout=30.0)
        except moerun.MoerunError as e:
            errors[i] += 1
            first_error.append(str(e))
            return
        with c:
            n = i
            while True:
                t0 = time.monotonic()
                if t0 >= t_end:
                    break
                try:
                    c.infer(xs[n % inputs], layer=layer, dtype=dtype)
                except moerun.MoerunError as e:
                    errors[i] += 1
                    if not first_error:
                        first_error.append(str(e))
                    continue
                t1 = time.monotonic()
                if t0 >= t_measure:
                    lat[i].append((t1 - t0) * 1e3)
                n += concurrency

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    all_ms = [x for per in lat for x in per]
    return {
        "requests": len(all_ms),
        "errors": sum(errors),
        "first_error": first_error[0] if first_error else None,
        "requests_per_s": len(all_ms) / duration,
        "tokens_per_s": len(all_ms) * tokens / duration,
        "latency_ms": percentiles(all_ms),
    }


def moebench_loop(moebench, targets, hidden, tokens, dtype, concurrency, duration, warmup, layer):
    cmd = [moebench, "serve", "--target", ",".join(targets), "--concurrency", str(concurrency),
           "--duration", str(duration), "--warmup", str(warmup), "--tokens-per-request",
           str(tokens), "--hidden", str(hidden), "--dtype", dtype or "f32", "--json"]
    if layer is not None:
        cmd += ["--layer", str(layer)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + warmup + 120)
    if r.returncode != 0:
        raise RuntimeError(f"moebench serve failed ({r.returncode}): {r.stderr[-2000:]}")
    rep = json.loads(r.stdout)
    return {
        "requests": rep["ok"],
        "errors": rep["error_count"],
        "requests_per_s": rep["requests_per_s"],
        "tokens_per_s": rep["tokens_per_s"],
        "latency_ms": {k: rep["latency_ms"][k] for k in ("p50", "p90", "p99", "max")},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m moerun.bench",
                                description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--target", help="HOST:PORT (or several, comma-separated) of a running job")
    g.add_argument("--serve", metavar="MODEL_DIR", help="start a local job for this checkpoint")
    p.add_argument("--ranks", type=int, default=4, help="--serve: ranks")
    p.add_argument("--transport", default="mpi", help="--serve: mpi, ucx or inproc")
    p.add_argument("--hidden", type=int, help="hidden size (default with --serve: the model's)")
    p.add_argument("--layer", type=int, default=None)
    p.add_argument("--tokens-per-request", type=int, default=16)
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--inputs", type=int, default=64)
    p.add_argument("--moebench", help="moebench binary (default: build/bin/moebench)")
    p.add_argument("--no-moebench", action="store_true", help="only the Python client")
    a = p.parse_args(argv)
    if a.tokens_per_request < 1 or a.concurrency < 1 or a.duration <= 0 or a.inputs < 1:
        p.error("--tokens-per-request, --concurrency, --inputs must be >= 1 and --duration > 0")
    hidden = a.hidden
    if a.serve:
        with open(os.path.join(a.serve, "config.json"), encoding="utf-8") as f:
            hidden = hidden or int(json.load(f)["hidden_size"])
    if not hidden:
        p.error("--hidden is required with --target")
    dtype = None if a.dtype == "f32" else "bf16"
    job = None
    try:
        if a.serve:
            job = LocalJob(a.serve, ranks=a.ranks, transport=a.transport).start()
            targets = job.targets
        else:
            targets = [t for t in a.target.split(",") if t]
        report = {"bench": "python_client", "targets": targets, "hidden": hidden,
                  "tokens_per_request": a.tokens_per_request, "dtype": a.dtype,
                  "concurrency": a.concurrency, "duration_s": a.duration}
        if not a.no_moebench:
            moebench = a.moebench or find_binary("moebench")
            report["moebench"] = moebench_loop(moebench, targets, hidden, a.tokens_per_request,
                                               a.dtype, a.concurrency, a.duration, a.warmup,
                                               a.layer)
        report["python"] = python_loop(targets, hidden, a.tokens_per_request, dtype,
                                       a.concurrency, a.duration, a.warmup, a.inputs, a.layer)
        if "moebench" in report and report["moebench"]["requests_per_s"] > 0:
            report["speedup_vs_moebench"] = (report["python"]["requests_per_s"] /
                                             report["moebench"]["requests_per_s"])
    finally:
        if job is not None:
            job.stop()
    print(json.dumps(report, indent=2))
    failed = report["python"]["errors"] or report.get("moebench", {}).get("errors", 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
