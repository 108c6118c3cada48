#!/usr/bin/env python3
"""The test command's summary (scripts/test.sh): per step, tests run / passed / failed / skipped,
and the name and reason of every skip; a skip not listed in tests/allowed_skips.txt fails it.

Each step adds its results to a ledger (one JSON object per line), then `report` prints them:

  test_summary.py LEDGER ctest STEP JUNIT_XML        ctest's --output-junit file
  test_summary.py LEDGER gtest STEP JSON [--log LOG]...   --gtest_output=json files (LOG: the
                                                     binary's output, for the skips' reasons)
  test_summary.py LEDGER command STEP RC [NAME]      one command, its exit code
  test_summary.py LEDGER report [--allow FILE]       the table, the ten slowest tests (ctest's
                                                     times) and the skips; exit 1 on a failure or
                                                     a skip that FILE does not allow

A test counts as skipped when ctest says so (SKIP_RETURN_CODE, gtest's "[  SKIPPED ]" for
discovered tests), and also when it passed but some of what it ran skipped: a gtest binary run as
one ctest test that printed "[  SKIPPED ]", or a script or pytest run that printed "SKIP: ..."
lines and still exited 0. A passing test that skipped part of its work is not a pass.
MOERUN_ALLOW_SKIPS=1 reports unlisted skips without failing (for machines other than the one the
README documents).
"""

import fnmatch
import json
import os
import re
import sys
import xml.etree.ElementTree as ET

GTEST_SKIPPED = re.compile(r"^\[  SKIPPED \] (\S+)", re.M)
SKIP_LINE = re.compile(r"^SKIP\b[:(]?\s*(.*)$", re.M)


def gtest_skip_reasons(out):
    """{gtest name: reason} from gtest output: the lines between "...: Skipped" and "[  SKIPPED ]"."""
    reasons = {}
    lines = out.splitlines()
    for i, line in enumerate(lines):
        m = GTEST_SKIPPED.match(line)
        # (gtest's closing list repeats each name under "[  SKIPPED ] N tests, listed below:")
        if not m or m.group(1) in reasons or "listed below" in line:
            continue
        why = []
        for j in range(i - 1, max(i - 12, -1), -1):
            if lines[j].endswith(": Skipped") or lines[j].startswith("[ RUN"):
                break
            why.insert(0, lines[j].strip())
        reasons[m.group(1)] = " ".join(w for w in why if w) or "(no reason given)"
    return reasons


def skips_in_output(name, out):
    """[(name, reason)] of what a test's output says it skipped (empty: nothing)."""
    found = [(f"{name}: {g}", why) for g, why in gtest_skip_reasons(out).items()]
    if not found:
        found = [(name, m.group(1).strip() or "(no reason given)") for m in SKIP_LINE.finditer(out)]
    return found


def from_junit(path, times=None):
    """(run, passed, failed, [(name, reason)]) from ctest's JUnit file; `times` (a list) gets
    each test's (seconds, name)."""
    root = ET.parse(path).getroot()
    run = passed = failed = 0
    skips = []
    for case in root.iter("testcase"):
        name = case.get("name")
        status = case.get("status")
        if times is not None:
            try:
                times.append((float(case.get("time") or 0), name))
            except ValueError:
                pass
        out = case.findtext("system-out") or ""
        run += 1
        if status == "fail" or case.find("failure") is not None:
            failed += 1
            continue
        said = case.find("skipped")
        if status in ("notrun", "disabled") or said is not None:
            got = skips_in_output(name, out)
            if not got:
                got = [(name, (said.get("message") if said is not None else None) or status)]
            skips.append((name, "; ".join(r for _, r in got)))
            continue
        inner = skips_in_output(name, out)
        if inner:
            skips.extend(inner)
        else:
            passed += 1
    # (a test with inner skips counts once among the skipped, once per inner skip in the list)
    skipped_tests = run - passed - failed
    return run, passed, failed, skipped_tests, skips


def from_gtest(args):
    """Counts from --gtest_output=json files, each optionally followed by "--log FILE": the
    binary's text output, where gtest writes a skip's reason (its JSON has none)."""
    pairs = []
    for a in args:
        if pairs and pairs[-1][1] == "--log":
            pairs[-1] = (pairs[-1][0], a)
        elif a == "--log":
            pairs[-1] = (pairs[-1][0], "--log")
        else:
            pairs.append((a, None))
    run = passed = failed = 0
    skips = []
    for p, log in pairs:
        doc = json.load(open(p))
        reasons = gtest_skip_reasons(open(log, errors="replace").read()) if log else {}
        for suite in doc.get("testsuites", []):
            for t in suite.get("testsuite", []):
                if t.get("status") == "NOTRUN":
                    continue
                run += 1
                name = f"{suite['name']}.{t['name']}"
                if t.get("failures"):
                    failed += 1
                elif t.get("result") == "SKIPPED":
                    skips.append((name, reasons.get(name, "(no reason given)")))
                else:
                    passed += 1
    return run, passed, failed, len(skips), skips


def read_allow(path):
    """[(step pattern or None, name pattern, reason)] from the allow file: "[STEP] NAME REASON"
    lines ("[STEP] " optional: the rule then holds in the steps STEP matches), # comments."""
    rules = []
    for line in open(path, encoding="utf-8"):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(?:\[([^\]]+)\]\s+)?(\S+)\s+(.+)$", line)
        if not m:
            sys.exit(f"test_summary: {path}: '{line}' has no reason")
        rules.append(m.groups())
    return rules


def allowed(step, name, rules):
    """The reason a rule gives for skipping `name` in `step`, or None."""
    base = name.split(": ", 1)[0]
    for step_pattern, pattern, reason in rules:
        if step_pattern and not fnmatch.fnmatchcase(step, step_pattern):
            continue
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(base, pattern):
            return reason
    return None


def report(ledger, allow_path):
    rows = [json.loads(l) for l in open(ledger)] if os.path.exists(ledger) else []
    rules = read_allow(allow_path) if allow_path else []
    print("\n==== summary ====")
    print(f"{'step':<58} {'run':>6} {'passed':>7} {'failed':>7} {'skipped':>8}")
    totals = [0, 0, 0, 0]
    for r in rows:
        print(f"{r['step'][:58]:<58} {r['run']:>6} {r['passed']:>7} {r['failed']:>7} "
              f"{r['skipped']:>8}")
        for i, k in enumerate(("run", "passed", "failed", "skipped")):
            totals[i] += r[k]
    print(f"{'all':<58} {totals[0]:>6} {totals[1]:>7} {totals[2]:>7} {totals[3]:>8}")
    slowest = sorted(((t, n, r["step"]) for r in rows for t, n in r.get("slowest", [])),
                     reverse=True)[:10]
    if slowest:
        print("\nthe ten slowest tests (s):")
        for t, n, step in slowest:
            print(f"  {t:8.1f}  {n}  ({step[:40]})")
    bad = []
    skips = [(r["step"], n, why) for r in rows for n, why in r["skips"]]
    if skips:
        print(f"\nskips ({len(skips)}):")
    for step, name, why in skips:
        ok = allowed(step, name, rules)
        print(f"  {'allowed' if ok else 'NOT ALLOWED'}: {name}: {why}"
              + (f"  [{ok}]" if ok else ""))
        if not ok:
            bad.append(name)
    failed = totals[2]
    if failed:
        print(f"\n{failed} failed")
    if bad:
        listed = allow_path or "the allow file"
        if os.environ.get("MOERUN_ALLOW_SKIPS") == "1":
            print(f"\n{len(bad)} skip(s) not in {listed}: allowed by MOERUN_ALLOW_SKIPS=1")
            bad = []
        else:
            print(f"\n{len(bad)} skip(s) not in {listed}: on the machine the README documents "
                  "nothing else may skip (MOERUN_ALLOW_SKIPS=1 on another machine)")
    if failed or bad:
        return 1
    print("\nall tests passed; every skip is listed, with its reason, in " + (allow_path or "-"))
    return 0


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    ledger, what = argv[1], argv[2]
    if what == "report":
        allow = argv[4] if len(argv) > 4 and argv[3] == "--allow" else None
        return report(ledger, allow)
    step = argv[3]
    times = []
    if what == "ctest":
        run, passed, failed, skipped, skips = from_junit(argv[4], times)
    elif what == "gtest":
        run, passed, failed, skipped, skips = from_gtest(argv[4:])
    elif what == "command":
        rc = int(argv[4])
        name = argv[5] if len(argv) > 5 else step
        run, passed, failed, skipped = 1, int(rc == 0), int(rc not in (0, 77)), int(rc == 77)
        skips = [(name, "exit code 77")] if rc == 77 else []
    else:
        sys.exit(f"test_summary: unknown kind '{what}'\n" + __doc__)
    with open(ledger, "a") as f:
        f.write(json.dumps({"step": step, "run": run, "passed": passed, "failed": failed,
                            "skipped": skipped, "skips": skips,
                            "slowest": [[t, n] for t, n in sorted(times, reverse=True)[:10]]})
                + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
