#!/usr/bin/env python3
"""Checks `moebench model` against measured runs on this machine.

1. Calibrates: `moebench calibrate` alone (kernels F32 and BF16, gate, combine), then the
   transports and the expert ranks' kernels at once at 3 and 9 ranks (mpirun over mpi and ucx,
   and inproc threads).
2. Measures held-back configurations (other rank counts, transports, batch sizes, microbatching
   on and off, skewed routing, a weight type) with `moerun serve` + `moebench serve`: closed loop
   with 4 connections of T/4 tokens and max_batch_tokens = T, so every batch is T tokens and the
   served tokens/s is the steady per-layer throughput (`moerun forward` times one cold forward,
   which is not the steady time); and open-loop points at an offered rate for p50.
3. Runs `moebench model` for each and prints the table with predicted_over_measured.
The preset is Qwen3-30B-A3B's layer shape with 16 experts (F32: 18 MiB per expert), so that the
whole check runs in a few minutes on a small machine.

  scripts/model-check.py [--bin build/bin] [--quick] [--markdown]
  scripts/model-check.py --profile P.json --measured M.json   (the model again, same measurements)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MPI = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
       "--mca", "mpi_yield_when_idle", "1"]
PRESET = "qwen3-30b-a3b"
EXPERTS = 16
HIDDEN = 2048
# The transports (and the expert ranks computing at once) are calibrated at these rank counts;
# the checks run at 3, 5 and 9 ranks (5: between them).
CALIBRATED_RANKS = (3, 9)
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")

# name, ranks, transport, tokens per batch, microbatch tokens, gate skew, dtype
CLOSED = [
    ("np3 mpi T256", 3, "mpi", 256, 0, 0.0, "f32"),
    ("np5 mpi T256", 5, "mpi", 256, 0, 0.0, "f32"),
    ("np9 mpi T256", 9, "mpi", 256, 0, 0.0, "f32"),
    ("np5 mpi T64", 5, "mpi", 64, 0, 0.0, "f32"),
    ("np5 mpi T512", 5, "mpi", 512, 0, 0.0, "f32"),
    ("np5 mpi T512 mb128", 5, "mpi", 512, 128, 0.0, "f32"),
    ("np5 ucx T256", 5, "ucx", 256, 0, 0.0, "f32"),
    ("np9 ucx T512", 9, "ucx", 512, 0, 0.0, "f32"),
    ("np5 mpi T256 skew1.2", 5, "mpi", 256, 0, 1.2, "f32"),
    ("np9 mpi T512 skew1.2", 9, "mpi", 512, 0, 1.2, "f32"),
    ("np5 mpi T256 bf16", 5, "mpi", 256, 0, 0.0, "bf16"),
    ("inproc5 T256", 5, "inproc", 256, 0, 0.0, "f32"),
    ("inproc5 T512 mb128", 5, "inproc", 512, 128, 0.0, "f32"),
]
# name, ranks, transport, rate (requests/s), tokens per request
OPEN = [
    ("np3 mpi 20 req/s x16", 3, "mpi", 20, 16),
    ("np5 mpi 40 req/s x16", 5, "mpi", 40, 16),
    ("np5 ucx 10 req/s x16", 5, "ucx", 10, 16),
]
OPEN_BATCH, OPEN_WAIT_US = 256, 2000


def run(cmd, **kw):
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, **kw)


def calibrate(bindir, profile, quick):
    q = ["--quick"] if quick else []
    b = os.path.join(bindir, "moebench")
    steps = [[b, "calibrate", "--dtypes", "f32,bf16", "--out", profile] + q]
    for n in CALIBRATED_RANKS:
        for tr in ("mpi", "ucx"):
            steps.append(MPI + ["-np", str(n), b, "calibrate", "--transport", tr, "--out",
                                profile] + q)
        steps.append([b, "calibrate", "--transport", "inproc", "--ranks", str(n), "--out",
                      profile] + q)
    for cmd in steps:
        r = run(cmd, timeout=600)
        if r.returncode != 0:
            sys.exit("calibrate failed: " + " ".join(cmd) + "\n" + r.stderr[-2000:])


def serve(bindir, work, ranks, transport, tokens_batch, wait_us, mb, skew, dtype, bench_args,
          port):
    """Starts `moerun serve`, runs `moebench serve` with bench_args, stops the job: its JSON."""
    cfg = os.path.join(work, "serve.yaml")
    with open(cfg, "w") as f:
        f.write(f"preset:\n  name: {PRESET}\n  seed: 1\n  experts: {EXPERTS}\n"
                f"  dtype: {dtype}\n  gate_skew: {skew}\nlayers: [0]\n"
                f"transport: {transport}\nranks: {ranks}\nrouters: 1\nplacement: linear\n"
                f"microbatch_tokens: {mb}\ndeadline_ms: 60000\nbatching:\n"
                f"  max_batch_tokens: {tokens_batch}\n  max_wait_us: {wait_us}\n"
                f"  max_queue_tokens: 262144\n")
    ready, pid = os.path.join(work, "ready"), os.path.join(work, "pid")
    for p in (ready, pid):
        if os.path.exists(p):
            os.remove(p)
    cmd = [os.path.join(bindir, "moerun"), "serve", "--config", cfg, "--listen",
           f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{port + 1}", "--ready-file", ready,
           "--pid-file", pid]
    if transport != "inproc":
        cmd = MPI + ["-np", str(ranks)] + cmd
    log = open(os.path.join(work, "serve.log"), "w")
    job = subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(1200):
            if os.path.exists(ready) or job.poll() is not None:
                break
            time.sleep(0.1)
        if not os.path.exists(ready):
            sys.exit("moerun serve did not become ready; see " + log.name)
        r = run([os.path.join(bindir, "moebench"), "serve", "--target", f"127.0.0.1:{port}",
                 "--hidden", str(HIDDEN), "--json"] + bench_args, timeout=300)
        if r.returncode != 0:
            print("moebench serve failed:\n" + r.stderr[-600:], file=sys.stderr)
            return None
        return json.loads(r.stdout)
    finally:
        try:
            with open(pid) as f:
                os.kill(int(f.read().strip()), 15)
            job.wait(timeout=30)
        except Exception:
            job.kill()
            job.wait()
        log.close()


def model(bindir, profile, ranks, transport, tokens, mb, skew, dtype, extra=()):
    cmd = [os.path.join(bindir, "moebench"), "model", "--profile", profile, "--preset", PRESET,
           "--experts", str(EXPERTS), "--dtype", dtype, "--ranks", str(ranks), "--transport",
           transport, "--tokens", str(tokens), "--microbatch-tokens", str(mb)]
    if skew > 0:
        cmd += ["--gate-skew", str(skew)]
    r = run(cmd + list(extra), timeout=120)
    if r.returncode != 0:
        sys.exit("moebench model failed: " + " ".join(cmd) + "\n" + r.stderr)
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default="build/bin")
    ap.add_argument("--quick", action="store_true", help="quick calibration, shorter runs")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per served point")
    ap.add_argument("--profile", help="use this profile instead of calibrating")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--measured", help="a measured.json of an earlier run: only run the model")
    a = ap.parse_args()
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    work = tempfile.mkdtemp(prefix="moerun-model-check.")
    profile = a.profile or os.path.join(work, "profile.json")
    if not a.profile:
        calibrate(a.bin, profile, a.quick)
    rows = []
    port = 5900
    dur = ["--duration", str(a.duration), "--warmup", "2"]
    # Measured values by point name: from --measured (then nothing is run but the model), or
    # measured now and saved beside the profile.
    saved = {}
    if a.measured:
        with open(a.measured) as f:
            saved = json.load(f)

    def measure(name, *args):
        if a.measured:
            return saved.get(name)
        saved[name] = serve(*args)
        with open(os.path.join(work, "measured.json"), "w") as f:
            json.dump(saved, f)
        return saved[name]

    for name, ranks, tr, tokens, mb, skew, dtype in CLOSED:
        port += 2
        m = measure(name, a.bin, work, ranks, tr, tokens, 50000, mb, skew, dtype,
                    ["--concurrency", "4", "--tokens-per-request", str(tokens // 4)] + dur, port)
        p = model(a.bin, profile, ranks, tr, tokens, mb, skew, dtype)
        rows.append((name, "tokens/s", p["prediction"]["tokens_per_s"],
                     m["tokens_per_s"] if m else 0.0))
        print(f"{name}: predicted {rows[-1][2]:.0f} tokens/s, measured {rows[-1][3]:.0f}",
              file=sys.stderr)
    for name, ranks, tr, rate, tpr in OPEN:
        port += 2
        m = measure(name, a.bin, work, ranks, tr, OPEN_BATCH, OPEN_WAIT_US, 0, 0.0, "f32",
                    ["--concurrency", "16", "--rate", str(rate), "--tokens-per-request",
                     str(tpr)] + dur, port)
        p = model(a.bin, profile, ranks, tr, tpr, 0, 0.0, "f32",
                  ["--rate", str(rate), "--tokens-per-request", str(tpr), "--max-batch-tokens",
                   str(OPEN_BATCH), "--max-wait-us", str(OPEN_WAIT_US)])
        s = p["served"]
        pred = s["p50_ms"] if s["p50_ms"] is not None else float("inf")
        rows.append((name, "p50 ms", pred, m["latency_ms"]["p50"] if m else 0.0))
        print(f"{name}: predicted p50 {pred:.1f} ms, measured {rows[-1][3]:.1f}", file=sys.stderr)
    within = 0
    if a.markdown:
        print("| configuration | quantity | predicted | measured | predicted_over_measured |")
        print("|---|---|---|---|---|")
    for name, what, pred, meas in rows:
        ratio = pred / meas if meas > 0 else float("nan")  # nan: no measurement
        within += abs(ratio - 1) <= 0.2
        if a.markdown:
            print(f"| {name} | {what} | {pred:.1f} | {meas:.1f} | {ratio:.2f} |")
        else:
            print(f"{name:28s} {what:9s} predicted {pred:10.1f} measured {meas:10.1f} "
                  f"predicted_over_measured {ratio:5.2f}")
    print(f"\n{within} of {len(rows)} within +-20 % (profile: {profile}; measured: "
          f"{a.measured or os.path.join(work, 'measured.json')})")


if __name__ == "__main__":
    main()
