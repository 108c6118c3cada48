#!/usr/bin/python3
"""Every binary and every subcommand keeps the command-line promise: a bad flag, a missing
required flag and a bad value each end with exit 2 and one line saying what is wrong.

The command tree is read from the binaries' own --help (so a new subcommand or option is tested
the day it lands); VALID below gives, for every command, a command line that parses (it is never
run as it is: each case adds one mistake to it). A command found in --help but missing from VALID
fails the test, so the table cannot fall behind.

  /usr/bin/python3 tests/cli/every_command.py BIN_DIR FIXTURE_DIR   (ctest: cli_every_command)
"""

import os
import re
import subprocess
import sys
import tempfile

BIN_DIR, FIXTURE = sys.argv[1], sys.argv[2]
TMP = tempfile.mkdtemp(prefix="moerun-cli-")
INPUT = os.path.join(FIXTURE, "golden.safetensors")
OUT = os.path.join(TMP, "out.safetensors")
LOADS = os.path.join(TMP, "loads.json")
with open(LOADS, "w") as f:
    f.write('{"format": "moerun-loads-v1", "layers": {"0": [1, 2, 3, 4]}}\n')

# For each command path: arguments that make a command line that parses. The cases put their
# one mistake after them (or, at a binary's root, before them: the root's own options).
VALID = {
    ("moerun",): ["forward", "--model", FIXTURE, "--input", INPUT, "--output", OUT],
    ("moerun", "forward"): ["--model", FIXTURE, "--input", INPUT, "--output", OUT],
    ("moerun", "serve"): ["--config", os.path.join(TMP, "c.yaml")],
    ("moebench",): ["sgemm", "--shapes", "1x1x1"],
    ("moebench", "layer"): ["--preset", "mixtral-8x7b"],
    ("moebench", "transport"): ["--tokens", "8"],
    ("moebench", "serve"): ["--target", "127.0.0.1:1", "--hidden", "8"],
    ("moebench", "decode"): ["--target", "127.0.0.1:1", "--hidden", "8", "--layers", "0"],
    ("moebench", "sgemm"): ["--shapes", "1x1x1"],
    ("moebench", "replay"): ["--trace", os.path.join(TMP, "t.npy")],
    ("moebench", "cache-replay"): ["--trace", os.path.join(TMP, "t.npy")],
    ("moebench", "calibrate"): ["--quick"],
    ("moebench", "model"): ["--profile", os.path.join(TMP, "p.json"), "--preset", "mixtral-8x7b",
                            "--ranks", "3"],
    ("moectl",): ["status"],
    ("moectl", "status"): [],
    ("moectl", "stats"): [],
    ("moectl", "placement"): ["show"],
    ("moectl", "placement", "show"): [],
    ("moectl", "placement", "export"): [os.path.join(TMP, "p.json")],
    ("moectl", "placement", "plan"): [],
    ("moectl", "placement", "apply"): ["--plan"],
    ("moectl", "placement", "import"): [os.path.join(TMP, "p.json")],
    ("moectl", "placement", "progress"): [],
    ("moectl", "rebalance"): [],
    ("moectl", "retire"): ["3"],
    ("moectl", "expert"): ["status"],
    ("moectl", "expert", "update"): ["--layer", "0", "--expert", "0", "--from", INPUT],
    ("moectl", "expert", "status"): [],
    ("moectl", "expert", "promote"): ["--layer", "0", "--expert", "0"],
    ("moectl", "expert", "rollback"): ["--layer", "0", "--expert", "0"],
}

# Checks the commands make themselves (not visible in --help): (argv, fragment, parse_time).
# parse_time: checked while parsing, so the line ends in "(see --help)" like CLI11's own.
MANUAL = [
    (["moebench", "serve", "--target", "127.0.0.1:1"], "--hidden", True),
    (["moebench", "serve"], "--target", True),
    (["moebench", "decode", "--target", "127.0.0.1:1"], "--hidden", True),
    (["moebench", "decode"], "--target", True),
    (["moerun", "forward", "--model", FIXTURE, "--preset", "mixtral-8x7b", "--input", INPUT,
      "--output", OUT], "excludes", True),
    (["moerun"], "subcommand", True),
    (["moebench"], "subcommand", True),
    (["moectl"], "subcommand", True),
    (["moectl", "placement"], "subcommand", True),
    (["moectl", "expert"], "subcommand", True),
    (["moectl", "placement", "apply"], "FILE", True),
    (["moectl", "placement", "plan", "--loads", LOADS], "--ranks", False),
]
# Values that parse as text but that the commands refuse, each on the command's valid line.
for path, flag, value in [
        (("moerun", "forward"), "--device", "tpu"),
        (("moerun", "forward"), "--isa", "sse2"),
        (("moerun", "forward"), "--transport", "tcp"),
        (("moerun", "forward"), "--placement", "no-such-placement.json"),
        (("moerun", "forward"), "--threads", "-3"),
        (("moerun", "forward"), "--ranks", "0"),
        (("moerun", "forward"), "--deadline-ms", "0"),
        (("moerun", "forward"), "--math", "fast"),
        (("moebench", "layer"), "--isa", "sse2"),
        (("moebench", "layer"), "--tokens", "1,x"),
        (("moebench", "layer"), "--gate-skew", "-1"),
        (("moebench", "transport"), "--transport", "tcp"),
        (("moebench", "transport"), "--routers", "0"),
        (("moebench", "serve"), "--dtype", "f64"),
        (("moebench", "serve"), "--concurrency", "0"),
        (("moebench", "serve"), "--duration", "-1"),
        (("moebench", "decode"), "--pingpong", "2"),
        (("moebench", "decode"), "--sequences", "0"),
        (("moebench", "decode"), "--layers", "3-1"),
        (("moebench", "decode"), "--dtype", "f64")]:
    MANUAL.append((list(path) + VALID[path] + [flag, value], flag, True))
MANUAL.append((["moerun", "forward", "--preset", "mixtral-8x7b", "--input", INPUT, "--output", OUT,
                "--dtype", "int3"], "--dtype", True))

NUMERIC = ("INT", "UINT", "FLOAT", "NUMBER")


def run(argv):
    env = dict(os.environ, MOERUN_TOKEN_FILE="")
    p = subprocess.run([os.path.join(BIN_DIR, argv[0])] + argv[1:], stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=60)
    return p.returncode, p.stdout.decode(errors="replace")


def parse_help(path):
    """(subcommands, options, positionals) of one command, from its --help."""
    code, text = run(list(path) + ["--help"])
    if code != 0:
        raise SystemExit(f"FAIL {' '.join(path)} --help exited {code}:\n{text}")
    section, subs, opts, pos = None, [], [], []
    for line in text.splitlines():
        if re.match(r"^\S.*:$", line):
            section = line[:-1]
            continue
        m = re.match(r"^  (\S+)(?:\s+(.*))?$", line)
        if not m:
            continue  # a description's continuation line, or blank
        name, rest = m.group(1), m.group(2) or ""
        if section == "Subcommands":
            subs.append(name)
        elif section == "Options" and name.startswith("-"):
            flag = name.split(",")[-1].split("{")[0]
            if flag in ("--help", "--version"):
                continue
            opts.append((flag, rest))
        elif section == "Positionals":
            pos.append((name, rest))
    return subs, opts, pos


def bad_value(spec):
    """A value this option's type refuses, or None when any text is accepted."""
    typ = spec.split()[0] if spec else ""
    if typ.startswith("TEXT:{"):
        return "no-such-choice"
    if ">= 0" in spec:
        return "-1"
    m = re.search(r"in \[(-?[\d.]+) - (-?[\d.]+)\]", spec)
    if m:
        return str(int(float(m.group(2))) + 1)
    if any(typ.startswith(t) for t in NUMERIC):
        return "not-a-number"
    if typ.startswith("TEXT:N"):
        return "x"
    return None


def needs(spec):
    m = re.search(r"Needs: ((?:--?\S+\s?)+)", spec)
    return m.group(1).split() if m else []


def excludes(spec):
    m = re.search(r"Excludes: ((?:\S+\s?)+?)(?:\s{2}|$|Needs:)", spec)
    return m.group(1).split() if m else []


def needed_value(flag, spec):
    """The arguments after an option another one needs: a value when it takes one."""
    if not spec or not re.match(r"^(TEXT|INT|UINT|FLOAT)", spec):
        return []
    return [LOADS] if flag == "--loads" else ["1"]


def without(args, flag, takes_value=True):
    out, i = [], 0
    while i < len(args):
        if args[i] == flag:
            i += 2 if takes_value else 1
            continue
        out.append(args[i])
        i += 1
    return out


failures, cases = [], 0


def expect_bad(argv, fragment, what, parse_time=True):
    global cases
    cases += 1
    code, out = run(argv)
    text = out.strip("\n")
    binary = argv[0]
    problems = []
    if code != 2:
        problems.append(f"exit {code}, not 2")
    if "\n" in text:
        problems.append("more than one line")
    if not text.startswith(binary + ": "):
        problems.append(f"does not start with '{binary}: '")
    elif parse_time and not text.endswith("(see --help)"):
        problems.append(f"not '{binary}: ... (see --help)'")
    if fragment and fragment.lower() not in text.lower():
        problems.append(f"does not name '{fragment}'")
    if problems:
        failures.append(f"{what}: {' '.join(argv[1:])}\n    {'; '.join(problems)}\n    got: {out!r}")


def argv_for(path, mistake):
    base = VALID[path]
    if len(path) == 1:
        return [path[0]] + mistake + base
    return list(path) + base + mistake


def visit(path):
    if path not in VALID:
        failures.append(f"{' '.join(path)}: a command in --help that VALID does not know (add it)")
        return
    subs, opts, pos = parse_help(path)
    for s in subs:
        visit(path + (s,))
    valid = VALID[path] if len(path) > 1 else []
    # A bad flag.
    expect_bad(argv_for(path, ["--no-such-flag"]), "--no-such-flag", "bad flag")
    # Each required option and positional, left out.
    for flag, spec in opts:
        if "REQUIRED" in spec:
            expect_bad(list(path) + without(valid, flag), flag, "missing required flag")
    for name, spec in pos:
        if "REQUIRED" in spec:
            # The positionals of VALID: paths, and bare numbers (moectl retire RANK).
            rest = [a for a in valid if not a.startswith(TMP) and a != INPUT and not a.isdigit()]
            expect_bad(list(path) + rest, name, "missing required positional")
    # Each option whose type refuses some value, given one.
    for flag, spec in opts:
        value = bad_value(spec)
        if value is None:
            continue
        extra = [flag, value]
        for n in needs(spec):
            if n not in valid:
                extra += [n] + needed_value(n, dict(opts).get(n, ""))
        if len(path) == 1:
            args = [path[0]] + extra + VALID[path]
        else:
            rest = without(valid, flag)
            for x in excludes(spec):
                rest = without(rest, x)
            args = list(path) + rest + extra
        expect_bad(args, flag, f"bad value {value!r}")


for binary in ("moerun", "moebench", "moectl"):
    visit((binary,))
for argv, fragment, parse_time in MANUAL:
    expect_bad(argv, fragment, "checked by the command", parse_time)

for f in failures:
    print("FAIL " + f)
print(f"{cases} bad command lines, {len(failures)} failed")
sys.exit(1 if failures else 0)
