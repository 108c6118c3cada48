#!/usr/bin/env python3
"""Sizes of the production C++ and CUDA sources: lines per .cc/.cu file and lines per function.

    scripts/check_sizes.py [--top N] [--max-file 700] [--max-function 120] [--check]

Production code is every .cc/.cu/.h/.cuh outside tests/, launch/moebench/, build*/ and examples/. A function
is found by its body: a '{' that follows a parameter list (')' then optional qualifiers, a
trailing return type or a constructor's initialiser list) at namespace or class level; lambdas and
nested blocks count towards the function that holds them. Comments, strings and character
literals are skipped. Prints the largest N files and functions; with --check, exits 1 if any
production .cc/.cu file is over --max-file lines or any function over --max-function lines.
"""
import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {"tests", "launch/moebench", "examples", ".git", "python", "deploy", "docs", "scripts"}
SOURCE = (".cc", ".cu", ".h", ".cuh")
KEYWORDS = {"if", "for", "while", "switch", "catch", "return", "sizeof", "alignof", "decltype",
            "static_assert", "noexcept", "requires", "defined"}


def production_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel = os.path.relpath(dirpath, ROOT)
        top = rel.split(os.sep)[0]
        two = "/".join(rel.split(os.sep)[:2])
        if rel != "." and (top in SKIP_DIRS or two in SKIP_DIRS or top.startswith("build") or top.startswith(".")):
            dirnames[:] = []
            continue
        for f in filenames:
            if f.endswith(SOURCE):
                yield os.path.join(rel, f) if rel != "." else f


def strip(text):
    """The text with comments, strings and character literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == 'R' and text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + " " * (j - i - 2) + c if j - i >= 2 else c)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def is_function_body(before):
    """Whether the code just before a '{' ends a function's head."""
    s = before.rstrip()
    # A constructor's initialiser list: ") : a_(x), b_{y}" -- find the parameter list's ')'.
    s = re.sub(r"\)\s*:\s*[\w:<>,\s\(\)\{\}\.\*&\[\]+\-\"]*$", ")", s) if re.search(r"\)\s*:", s) else s
    s = re.sub(r"(\s*(const|override|final|noexcept(\([^)]*\))?|mutable|volatile|&|&&|"
               r"__device__|__host__|__global__|try))*$", "", s)
    s = re.sub(r"->\s*[\w:<>,\s\*&]+$", "", s)  # a trailing return type
    if not s.endswith(")"):
        return False
    depth, i = 0, len(s) - 1
    while i >= 0:
        if s[i] == ")":
            depth += 1
        elif s[i] == "(":
            depth -= 1
            if depth == 0:
                break
        i -= 1
    m = re.search(r"([\w~]+|operator\s*\S+)\s*(<[^<>]*>)?\s*$", s[:max(i, 0)])
    return bool(m) and m.group(1) not in KEYWORDS and not s[:max(i, 0)].rstrip().endswith("]")


def functions(path):
    text = strip(open(os.path.join(ROOT, path), encoding="utf-8", errors="replace").read())
    found = []
    depth = 0
    func_depth = None
    start_line = 0
    name = ""
    last = 0  # where the current statement's text begins
    for i, c in enumerate(text):
        if c == "{":
            if func_depth is None and is_function_body(text[last:i]):
                func_depth = depth
                start_line = text.count("\n", 0, i) + 1
                head = text[last:i]
                m = re.search(r"([\w:~]+(?:operator\s*\S+)?)\s*(?:<[^<>]*>)?\s*\(", head)
                name = m.group(1) if m else "?"
            depth += 1
            last = i + 1
        elif c == "}":
            depth -= 1
            if func_depth is not None and depth == func_depth:
                end_line = text.count("\n", 0, i) + 1
                found.append((end_line - start_line + 1, name, start_line))
                func_depth = None
            last = i + 1
        elif c == ";" and func_depth is None:
            last = i + 1
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--max-file", type=int, default=700)
    ap.add_argument("--max-function", type=int, default=120)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    files, funcs = [], []
    for f in sorted(production_files()):
        lines = open(os.path.join(ROOT, f), encoding="utf-8", errors="replace").read().count("\n")
        if f.endswith((".cc", ".cu")):
            files.append((lines, f))
        for n, name, line in functions(f):
            funcs.append((n, f"{f}:{line} {name}"))
    files.sort(reverse=True)
    funcs.sort(reverse=True)
    print(f"largest production files (of {len(files)} .cc/.cu):")
    for n, f in files[:a.top]:
        print(f"  {n:5d}  {f}")
    print(f"longest functions (of {len(funcs)}):")
    for n, f in funcs[:a.top]:
        print(f"  {n:5d}  {f}")
    over_files = [x for x in files if x[0] > a.max_file]
    over_funcs = [x for x in funcs if x[0] > a.max_function]
    print(f"files over {a.max_file} lines: {len(over_files)}; functions over {a.max_function} "
          f"lines: {len(over_funcs)}")
    if a.check and (over_files or over_funcs):
        for n, f in over_files:
            print(f"  file {f}: {n} lines", file=sys.stderr)
        for n, f in over_funcs:
            print(f"  function {f}: {n} lines", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
