#!/usr/bin/env python3
"""No stack frames, no spills: every CUDA kernel of the build, as ptxas compiles it for sm_90.

A stack frame (local memory: a dynamically indexed array, a non-inlined call) or a register spill
turns a kernel's fast loads into global-memory traffic; nothing in moerun needs one. This script
compiles every .cu file the build compiles (read from the build directory's
compile_commands.json) with that file's own flags, but for sm_90 SASS only and with ptxas's
resource report (--resource-usage), in parallel, and fails (exit 1) naming each function with a
stack frame or spills above 0 bytes, unless an allow-list entry names it with a reason.

  scripts/check_cuda_resources.py [--build DIR] [--jobs N] [--table] [--allow FILE]
  scripts/check_cuda_resources.py --cu FILE... [--nvcc PATH] [--flags "..."]   (given files)

  --build DIR   the build directory (default: build); needs CMAKE_EXPORT_COMPILE_COMMANDS (on)
  --cu FILE...  check these files instead, compiled with --nvcc (default /usr/local/cuda/bin/nvcc
                or the CUDA compiler of the build) and --flags (default -O3 -std=c++20 -I<repo>)
  --jobs N      parallel nvcc processes (default: the CPU count)
  --table       print every kernel's registers, stack frame and spills, also on success
  --allow FILE  the allow-list (default scripts/cuda_resource_allowlist.txt): one entry a line,
                `REGEX -- WHY` (REGEX searched in the demangled function name; the reason is
                required); # starts a comment line
Exit: 0 clean, 1 a function has a frame or spills (or a file does not compile), 2 bad usage.
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DEFAULT_ALLOW = os.path.join(ROOT, "scripts", "cuda_resource_allowlist.txt")
ARCH = ["--generate-code=arch=compute_90,code=sm_90"]

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
PROPS = re.compile(r"Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")


def usage_error(msg):
    print("check_cuda_resources: " + msg, file=sys.stderr)
    sys.exit(2)


def read_allow(path):
    """[(compiled regex, pattern, why)]."""
    if not os.path.exists(path):
        return []
    entries = []
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        pattern, sep, why = line.partition(" -- ")
        if not sep or not why.strip() or not pattern.strip():
            usage_error(f"{path}:{n}: an entry is `REGEX -- WHY` (the reason is required)")
        try:
            entries.append((re.compile(pattern.strip()), pattern.strip(), why.strip()))
        except re.error as e:
            usage_error(f"{path}:{n}: bad regex {pattern.strip()!r}: {e}")
    return entries


# Options of a build's command line that the check replaces (output, dependency files, the
# architectures), with whether they take the next argument.
DROP_WITH_ARG = {"-o", "-MT", "-MF", "-MQ", "-gencode", "--generate-code", "-arch",
                 "--gpu-architecture", "-code", "--gpu-code", "-ccbin", "--compiler-bindir"}
DROP_PREFIX = ("-o", "--generate-code=", "-gencode=", "-arch=", "--gpu-architecture=", "-code=",
               "--gpu-code=", "-MF", "-MT", "-MQ")
DROP_ALONE = {"-c", "-MD", "-MMD", "-M", "--compile"}


def strip_command(args, src):
    """The compile arguments without the compiler, launcher, output and architectures."""
    # A compiler launcher (ccache) first.
    while args and os.path.basename(args[0]) in ("ccache", "sccache"):
        args = args[1:]
    nvcc, rest = args[0], args[1:]
    out = []
    i = 0
    while i < len(rest):
        a = rest[i]
        if a in DROP_WITH_ARG:
            i += 2
            continue
        if a in DROP_ALONE or a.startswith(DROP_PREFIX):
            i += 1
            continue
        if a == src or os.path.abspath(a) == src:
            i += 1
            continue
        out.append(a)
        i += 1
    return nvcc, out


def build_jobs(build):
    db = os.path.join(build, "compile_commands.json")
    try:
        entries = json.load(open(db, encoding="utf-8"))
    except OSError as e:
        usage_error(f"cannot read {db}: {e} (configure the build first; "
                    "CMAKE_EXPORT_COMPILE_COMMANDS is on in moerun's CMakeLists.txt)")
    jobs, seen = [], set()
    for e in entries:
        directory = e.get("directory", build)
        src = os.path.normpath(os.path.join(directory, e["file"]))
        if not src.endswith(".cu") or src in seen:
            continue
        seen.add(src)
        args = e["arguments"] if "arguments" in e else shlex.split(e["command"])
        nvcc, flags = strip_command(args, src)
        # "-x cu" stays with the flags; the file goes last.
        jobs.append((src, nvcc, flags, directory))
    if not jobs:
        usage_error(f"{db} lists no .cu file (a build without CUDA?)")
    return jobs


def compile_one(job, tmp):
    src, nvcc, flags, directory = job
    obj = os.path.join(tmp, re.sub(r"\W", "_", os.path.relpath(src, ROOT)) + ".o")
    cmd = [nvcc] + flags + ARCH + ["--resource-usage", "-c", src, "-o", obj]
    p = subprocess.run(cmd, cwd=directory, capture_output=True, text=True)
    return src, cmd, p.returncode, p.stdout + p.stderr


def parse(text):
    """{mangled name: {"kernel": bool, "regs", "stack", "spill_st", "spill_ld"}} from ptxas."""
    funcs = {}
    entry = None  # the entry function whose "Used N registers" line comes next
    current = None
    for line in text.splitlines():
        m = ENTRY.search(line)
        if m:
            entry = m.group(1)
            funcs.setdefault(entry, {"kernel": True, "regs": None, "stack": 0, "spill_st": 0,
                                     "spill_ld": 0})
            continue
        m = PROPS.search(line)
        if m:
            current = m.group(1)
            funcs.setdefault(current, {"kernel": current == entry, "regs": None, "stack": 0,
                                       "spill_st": 0, "spill_ld": 0})
            continue
        m = FRAME.search(line)
        if m and current is not None:
            f = funcs[current]
            f["stack"], f["spill_st"], f["spill_ld"] = (int(x) for x in m.groups())
            continue
        m = USED.search(line)
        if m and entry is not None:
            funcs[entry]["regs"] = int(m.group(1))
    return funcs


def demangle(names):
    if not names:
        return {}
    try:
        p = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                           check=True)
        out = p.stdout.splitlines()
        if len(out) == len(names):
            return dict(zip(names, out))
    except (OSError, subprocess.CalledProcessError):
        pass
    return {n: n for n in names}


def short(name):
    """A demangled name without the anonymous namespace's hash, for the report."""
    return re.sub(r"\(anonymous namespace\)::", "", name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=True)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--cu", nargs="+", metavar="FILE")
    ap.add_argument("--nvcc")
    ap.add_argument("--flags")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--allow", default=DEFAULT_ALLOW)
    a = ap.parse_args()
    if a.jobs < 1:
        usage_error("--jobs must be at least 1")
    allow = read_allow(a.allow)

    if a.cu:
        nvcc = a.nvcc or "/usr/local/cuda/bin/nvcc"
        flags = shlex.split(a.flags) if a.flags is not None else [
            "-O3", "-std=c++20", "-I" + ROOT]
        jobs = []
        for f in a.cu:
            src = os.path.abspath(f)
            if not os.path.exists(src):
                usage_error(f"no such file: {f}")
            jobs.append((src, nvcc, flags, os.getcwd()))
    else:
        if a.nvcc or a.flags is not None:
            usage_error("--nvcc and --flags go with --cu (a build's files use its own flags)")
        jobs = build_jobs(os.path.abspath(a.build))

    with tempfile.TemporaryDirectory(prefix="moerun-cuda-res-") as tmp:
        with ThreadPoolExecutor(max_workers=a.jobs) as pool:
            results = list(pool.map(lambda j: compile_one(j, tmp), jobs))

    failed = False
    rows = []  # (file, name, info)
    for src, cmd, rc, text in results:
        rel = os.path.relpath(src, ROOT)
        if rc != 0:
            failed = True
            print(f"{rel}: nvcc failed (exit {rc}): {shlex.join(cmd)}")
            print(text.rstrip())
            continue
        funcs = parse(text)
        if not funcs:
            if "ptxas info" not in text:
                print(f"{rel}: no ptxas report (was --resource-usage ignored?)")
                failed = True
            continue  # else a file without device code (cuda_device.cu: runtime calls only)
        names = demangle(list(funcs))
        for mangled, info in funcs.items():
            rows.append((rel, short(names[mangled]), info))

    bad = []
    for rel, name, info in rows:
        if info["stack"] == 0 and info["spill_st"] == 0 and info["spill_ld"] == 0:
            continue
        why = next((w for rx, _, w in allow if rx.search(name)), None)
        if why is None:
            bad.append((rel, name, info))
        elif a.table:
            print(f"allowed: {name} ({why})")

    if a.table:
        w = max((len(n) for _, n, _ in rows), default=6)
        w = min(w, 100)
        print(f"{'kernel':<{w}}  {'regs':>4}  {'stack':>6}  {'spill st':>8}  {'spill ld':>8}  file")
        for rel, name, info in sorted(rows, key=lambda r: (r[0], r[1])):
            regs = "-" if info["regs"] is None else str(info["regs"])
            kind = "" if info["kernel"] else " (device function)"
            shown = name if len(name) <= w else name[:w - 3] + "..."
            print(f"{shown:<{w}}  {regs:>4}  {info['stack']:>6}  {info['spill_st']:>8}  "
                  f"{info['spill_ld']:>8}  {rel}{kind}")

    for rel, name, info in bad:
        what = "kernel" if info["kernel"] else "device function"
        print(f"{rel}: {what} {name}: {info['stack']} bytes stack frame, {info['spill_st']} bytes "
              f"spill stores, {info['spill_ld']} bytes spill loads, "
              f"{'-' if info['regs'] is None else info['regs']} registers (sm_90)")
    kernels = sum(1 for _, _, i in rows if i["kernel"])
    if bad or failed:
        print(f"check_cuda_resources: {len(bad)} function(s) with a stack frame or spills"
              f"{', some files did not compile' if failed else ''} ({len(results)} files, "
              f"{kernels} kernels); allow-list: {os.path.relpath(a.allow, ROOT)}")
        return 1
    print(f"check_cuda_resources: {len(results)} files, {kernels} kernels for sm_90: no stack "
          "frame, no spills" + (f" ({len(allow)} allow-list entries)" if allow else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
