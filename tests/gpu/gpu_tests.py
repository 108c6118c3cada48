#!/usr/bin/env python3
"""Runs every test labelled `gpu` of a build, each test binary once (tests/gpu/run.sh's step).

ctest would start one process per test case (gtest_discover_tests registers each case): a CUDA
context and the test layers built again for each. Here the ctest registry is only read
(`ctest --show-only=json-v1`): the gtest cases are grouped by binary and each binary runs once
(with a --gtest_filter of its gpu cases when it has other cases too), with --gtest_output=xml
into OUT; a gpu test that is not a plain gtest case (an mpirun line, a script) runs once as
registered. Standard library only.

  gpu_tests.py --build BUILD --out OUT [--targets "t1 t2 ..."] [--list] [--timeout S]
  gpu_tests.py --build BUILD --needed

--needed prints the build's targets that the gpu tests registered with add_test run (known once
BUILD is configured; gtest_discover_tests' cases are known only once their binary is built).
--targets: the targets the caller built; a gpu test whose binary is not among them is an error
(the caller's target list is missing it). --list prints the commands without running them (no
GPU needed). --timeout: seconds for all the runs together. Writes OUT/summary.json (passed,
failed, skipped, nccl_passed, nccl_failed, per command) and prints a one-line summary last.
Exit 0 when every command passed; on a machine where the tests all skipped for want of a GPU
("no usable GPU") that is a failure too.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

GTEST_EXTRA = {"--gtest_also_run_disabled_tests"}


def ctest_tests(build):
    out = subprocess.run(["ctest", "--test-dir", build, "--show-only=json-v1"], check=True,
                         capture_output=True, text=True).stdout
    tests = []
    for t in json.loads(out).get("tests", []):
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        tests.append({"name": t["name"], "command": t.get("command") or [],
                      "labels": props.get("LABELS", []), "env": props.get("ENVIRONMENT", []),
                      "cwd": props.get("WORKING_DIRECTORY")})
    return tests


def gtest_case(cmd):
    """The gtest filter of a discovered case (binary --gtest_filter=X [extras]), else None."""
    if len(cmd) < 2 or not cmd[1].startswith("--gtest_filter="):
        return None
    if any(a not in GTEST_EXTRA for a in cmd[2:]):
        return None
    return cmd[1][len("--gtest_filter="):]


def plan(tests):
    """[(label, argv, env, cwd, xml_name or None)]: each gtest binary once, other commands once."""
    by_binary, runs, seen = {}, [], set()
    for t in tests:
        f = gtest_case(t["command"])
        if f is not None:
            by_binary.setdefault(t["command"][0], []).append((f, "gpu" in t["labels"], t))
    for binary, cases in by_binary.items():
        gpu = [c for c in cases if c[1]]
        if not gpu:
            continue
        t0 = gpu[0][2]
        argv = [binary]
        if len(gpu) < len(cases):
            argv.append("--gtest_filter=" + ":".join(c[0] for c in gpu))
        runs.append((os.path.basename(binary), argv, t0["env"], t0["cwd"],
                     os.path.basename(binary)))
    for t in tests:
        if "gpu" not in t["labels"] or gtest_case(t["command"]) is not None:
            continue
        key = tuple(t["command"])
        if key in seen:
            continue
        seen.add(key)
        runs.append((t["name"], list(t["command"]), t["env"], t["cwd"], None))
    return runs


def binaries_of(argv, build):
    """The build's binaries an argv runs (the launched program of an mpirun line)."""
    bin_dir = os.path.join(os.path.realpath(build), "bin")
    return [a for a in argv if os.path.dirname(os.path.realpath(a)) == bin_dir]


def counts_from_xml(path):
    root = ET.parse(path).getroot()
    passed = failed = skipped = 0
    names_failed = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
            names_failed.append(f"{case.get('classname')}.{case.get('name')}")
        elif case.find("skipped") is not None or case.get("result") == "skipped":
            skipped += 1
        elif case.get("status", "run") == "run":
            passed += 1
    return passed, failed, skipped, names_failed


def counts_from_log(text):
    def num(tag):
        m = re.findall(r"^\[\s*" + tag + r"\s*\] (\d+) test", text, re.M)
        return int(m[-1]) if m else 0
    return num("PASSED"), num("FAILED"), num("SKIPPED"), []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", required=True)
    ap.add_argument("--targets", default="")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--needed", action="store_true")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out")
    a = ap.parse_args()
    tests = ctest_tests(a.build)
    if a.needed:
        names = {os.path.basename(b) for t in tests if "gpu" in t["labels"]
                 for b in binaries_of(t["command"], a.build)}
        print(" ".join(sorted(names)))
        return 0
    if not a.out:
        ap.error("--out is needed")
    os.makedirs(a.out, exist_ok=True)
    runs = plan(tests)
    if not runs:
        print(f"no test of {a.build} has the label gpu")
        return 1
    targets = set(a.targets.split())
    missing = []
    for _, argv, _, _, _ in runs:
        for b in binaries_of(argv, a.build):
            name = os.path.basename(b)
            if (targets and name not in targets) or not os.path.exists(b):
                missing.append(name)
    if a.list:
        for label, argv, env, _, _ in runs:
            shown = " ".join(argv)
            print(("env " + " ".join(env) + " " if env else "") +
                  (shown if len(shown) < 160 else shown[:157] + "..."))
    if missing:
        print(f"gpu tests need binaries not built (add them to run.sh's TARGETS): "
              f"{' '.join(sorted(set(missing)))}")
        return 1
    if a.list:
        print(f"{len(runs)} commands: {', '.join(r[0] for r in runs)}")
        return 0

    deadline = time.monotonic() + a.timeout
    total = {"passed": 0, "failed": 0, "skipped": 0, "nccl_passed": 0, "nccl_failed": 0,
             "runs": []}
    ok = True
    no_gpu = 0
    for label, argv, env, cwd, xml_name in runs:
        log = os.path.join(a.out, re.sub(r"[^A-Za-z0-9_.-]", "_", label) + ".log")
        xml = os.path.join(a.out, xml_name + ".xml") if xml_name else None
        if xml:
            argv = argv + [f"--gtest_output=xml:{xml}"]
            if os.path.exists(xml):
                os.remove(xml)
        e = dict(os.environ)
        e.update(kv.split("=", 1) for kv in env if "=" in kv)
        t0 = time.monotonic()
        left = deadline - t0
        if left <= 1:
            print(f"{label}: not run (out of time)", flush=True)
            total["runs"].append({"command": label, "rc": None, "seconds": 0})
            ok = False
            continue
        with open(log, "w") as f:
            try:
                rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=e, cwd=cwd,
                                    timeout=left).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        text = re.sub(r"\x1b\[[0-9;]*m", "", open(log, errors="replace").read())  # colours
        if xml and os.path.exists(xml):
            p, fl, s, names = counts_from_xml(xml)
        else:
            p, fl, s, names = counts_from_log(text)
        if rc != 0 and fl == 0:
            fl = 1  # crashed or timed out: count it
        no_gpu += bool(re.search(r"no usable GPU|no GPU here", text))
        secs = time.monotonic() - t0
        nccl = "nccl" in label.lower()
        total["passed"] += p
        total["failed"] += fl
        total["skipped"] += s
        total["nccl_passed"] += p if nccl else 0
        total["nccl_failed"] += fl if nccl else 0
        total["runs"].append({"command": label, "rc": rc, "seconds": round(secs, 1), "passed": p,
                              "failed": fl, "skipped": s, "failed_tests": names[:20]})
        print(f"{label}: exit {rc}, {p} passed, {fl} failed, {s} skipped in {secs:.1f} s"
              + (f" (failed: {', '.join(names[:5])})" if names else ""), flush=True)
        ok = ok and rc == 0
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(total, f, indent=1)
    if no_gpu:
        print(f"{no_gpu} command(s) found no usable GPU")
        ok = False
    print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped in "
          f"{len(runs)} commands (NCCL: {total['nccl_passed']} passed, "
          f"{total['nccl_failed']} failed)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
