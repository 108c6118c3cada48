#!/usr/bin/env python3
"""The house rules, checked against the code (part of scripts/test.sh).

The rules live in docs/DESIGN.md, in the table between the markers `layers:begin` and
`layers:end`: one row per folder, bottom to top, with the folders its files may include. This
script reads that table and fails (exit 1, one line per fault) when:
  - the table itself lets a folder include one listed at or above it (an arrow pointing up),
  - a file of ours includes a folder its row does not allow, or includes tests/,
  - a vendor header (CUDA, NCCL, UCX, MPI) appears outside the folders that own that vendor,
  - a folder's CMake library does not link exactly the libraries of the folders its files
    include (what a library links is what its code needs, no more, no less),
  - folders include each other once grouped at any depth (runtime/ and launch/ as wholes, then
    their subfolders),
  - docs/dependencies.md (the folder graph generated from the includes) is not up to date.

  scripts/check_layers.py            check
  scripts/check_layers.py --write    regenerate docs/dependencies.md, then check
"""

import os
import re
import subprocess
import sys
from collections import defaultdict

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DESIGN = os.path.join(ROOT, "docs", "DESIGN.md")
GRAPH = os.path.join(ROOT, "docs", "dependencies.md")
SOURCE_EXT = (".h", ".cc", ".cu", ".cuh")

# Vendor headers and the folders allowed to include them.
VENDORS = [
    (re.compile(r"^(cuda|cuda_runtime|cuda_bf16|cuda_fp16|mma|cublas|curand)[\w.]*\.h$|^cuda/"),
     ("experts/cuda", "router/cuda", "runtime/layer/cuda", "transport/nccl", "transport/ucx")),
    (re.compile(r"^nccl\.h$"), ("transport/nccl",)),
    # (launch/moebench/baselines: moebench's own raw-UCX and raw-MPI baselines, in moebench's
    # library only.)
    (re.compile(r"^(ucp|uct|ucs)/"), ("transport/ucx", "launch/moebench/baselines")),
    (re.compile(r"^mpi\.h$"), ("transport/mpi", "launch/moebench/baselines")),
]
# Libraries that are not folders of ours (flags, object libraries, vendor wrappers).
NOT_FOLDERS = {"moerun_flags", "moerun_isa_kernels", "moerun_openblas"}


def fail_usage(msg):
    print("check_layers: " + msg, file=sys.stderr)
    sys.exit(2)


def read_rules():
    """[(folder, [allowed folders], library)] bottom to top, from docs/DESIGN.md."""
    try:
        text = open(DESIGN, encoding="utf-8").read()
    except OSError as e:
        fail_usage(f"cannot read {DESIGN}: {e}")
    m = re.search(r"<!-- layers:begin -->(.*?)<!-- layers:end -->", text, re.S)
    if not m:
        fail_usage("docs/DESIGN.md has no <!-- layers:begin --> ... <!-- layers:end --> table")
    rules = []
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        folder = cells[0].strip("`")
        allowed = [] if cells[1] in ("", "-", "—", "nothing") else [
            a.strip().strip("`") for a in cells[1].split(",")]
        library = cells[2].strip("`")
        rules.append((folder, allowed, library))
    if not rules:
        fail_usage("the layers table in docs/DESIGN.md has no rows")
    return rules


def unit_of(path, folders):
    """The rule folder a repository path belongs to (longest matching prefix), or None."""
    best = None
    for f in folders:
        if path == f or path.startswith(f + "/"):
            if best is None or len(f) > len(best):
                best = f
    return best


def include_target(inc):
    """The repository path an include names ("moerun/..." are generated headers)."""
    if inc.startswith("moerun/v1/"):
        return "runtime/proto/" + inc
    if inc == "moerun/build_info.h":
        return "base/build_info.h"  # generated from cmake/build_info.h.in: ground floor
    return inc


def source_files():
    out = subprocess.check_output(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                                  cwd=ROOT, text=True).split("\n")
    return [f for f in out if f.endswith(SOURCE_EXT)]


def scan(files, folders):
    """Edges (from unit, to unit) -> count, and the faults of single includes."""
    edges = defaultdict(int)
    faults = []
    quoted = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
    angled = re.compile(r"^\s*#\s*include\s+<([^>]+)>")
    for f in files:
        src = unit_of(f, folders)
        in_tests = f.startswith("tests/")
        for n, line in enumerate(open(os.path.join(ROOT, f), encoding="utf-8", errors="replace"), 1):
            m = quoted.match(line)
            if m:
                target = include_target(m.group(1))
                if target.startswith("tests/"):
                    if not in_tests:
                        faults.append(f"{f}:{n}: includes {m.group(1)}: only tests/ may include tests/")
                    continue
                dst = unit_of(target, folders)
                if dst is None:
                    if not os.path.exists(os.path.join(ROOT, target)):
                        continue  # a system header in quotes, or a generated file of a backend
                    faults.append(f"{f}:{n}: includes {m.group(1)}, in no folder of the table")
                    continue
                if in_tests:
                    continue
                if src is None:
                    faults.append(f"{f}: is in no folder of the layers table (docs/DESIGN.md)")
                    break
                if dst != src:
                    edges[(src, dst)] += 1
                continue
            m = angled.match(line)
            if m and not in_tests:
                for pattern, owners in VENDORS:
                    if pattern.search(m.group(1)) and not any(
                            f.startswith(o + "/") for o in owners):
                        faults.append(f"{f}:{n}: vendor header <{m.group(1)}> outside "
                                      f"{', '.join(owners)}")
    return edges, faults


def check_rules(rules):
    faults = []
    order = {f: i for i, (f, _, _) in enumerate(rules)}
    for i, (f, allowed, _) in enumerate(rules):
        for a in allowed:
            if a not in order:
                faults.append(f"docs/DESIGN.md: `{f}` may include `{a}`, which is not a row")
            elif order[a] >= i:
                faults.append(f"docs/DESIGN.md: `{f}` may include `{a}`, listed at or above it "
                              "(an arrow pointing up)")
    return faults


def check_mutual(edges):
    """Folders that include each other once grouped at any depth (runtime/ and launch/ as a
    whole, then their subfolders, ...): the layering must hold for the groups too."""
    faults = []
    for depth in (1, 2, 3):
        group = lambda f: "/".join(f.split("/")[:depth])
        grouped = {(group(s), group(d)) for (s, d) in edges if group(s) != group(d)}
        for a, b in sorted(grouped):
            if a < b and (b, a) in grouped:
                faults.append(f"{a} and {b} include each other (folders grouped {depth} deep)")
    return faults


def check_edges(rules, edges):
    allowed = {f: set(a) for f, a, _ in rules}
    faults = []
    for (src, dst), n in sorted(edges.items()):
        if dst not in allowed[src]:
            faults.append(f"{src} includes {dst} ({n} include(s)); docs/DESIGN.md allows "
                          f"{src} only: {', '.join(sorted(allowed[src])) or 'nothing'}")
    return faults


def cmake_links():
    """library -> set of moerun_* libraries it links, from every CMakeLists.txt outside tests/."""
    links = defaultdict(set)
    call = re.compile(r"target_link_libraries\s*\(\s*([\w-]+)([^)]*)\)", re.S)
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel = os.path.relpath(dirpath, ROOT)
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "build")) and
                       not (rel == "." and d == "tests")]
        if "CMakeLists.txt" not in filenames:
            continue
        text = open(os.path.join(dirpath, "CMakeLists.txt"), encoding="utf-8").read()
        text = re.sub(r"#.*", "", text)
        for m in call.finditer(text):
            deps = set(re.findall(r"\bmoerun_\w+", m.group(2))) - NOT_FOLDERS
            links[m.group(1)] |= deps
    return links


def check_cmake(rules, edges):
    lib_of = {f: lib for f, _, lib in rules}
    folders_of = defaultdict(set)
    for f, _, lib in rules:
        folders_of[lib].add(f)
    links = cmake_links()
    faults = []
    for lib, folders in sorted(folders_of.items()):
        if lib in ("", "-", "—"):
            continue
        want = {lib_of[d] for (s, d) in edges if s in folders} - {lib, "", "-", "—"}
        have = links.get(lib, set()) - {lib}
        if lib not in links and not want:
            continue
        for extra in sorted(have - want):
            faults.append(f"CMake: {lib} links {extra}, but no file of "
                          f"{', '.join(sorted(folders))} includes its folder")
        for missing in sorted(want - have):
            faults.append(f"CMake: {lib} does not link {missing}, whose folder "
                          f"{', '.join(sorted(folders))} includes")
    return faults


def render_graph(rules, edges):
    order = [f for f, _, _ in rules]
    used = sorted({s for s, _ in edges} | {d for _, d in edges}, key=order.index)
    ident = {f: re.sub(r"\W", "_", f) for f in order}
    lines = [
        "# Folder dependencies",
        "",
        "Generated by `scripts/check_layers.py --write` from the `#include` lines of every source",
        "file outside `tests/`; `scripts/test.sh` fails when this file is out of date. An arrow",
        "`a --> b` means files of `a` include headers of `b` (the number: how many includes). The",
        "folders are drawn bottom to top in the order of the layers table in",
        "[DESIGN.md](DESIGN.md): every arrow points down, and no two folders include each other.",
        "",
        "```mermaid",
        "flowchart BT",
    ]
    for f in used:
        lines.append(f'  {ident[f]}["{f}"]')
    for (s, d) in sorted(edges, key=lambda e: (order.index(e[0]), order.index(e[1]))):
        lines.append(f"  {ident[s]} -->|{edges[(s, d)]}| {ident[d]}")
    lines += ["```", "", "The same graph as a list (folder: the folders it includes).", ""]
    for f in reversed(used):
        deps = sorted((d for (s, d) in edges if s == f), key=order.index, reverse=True)
        lines.append(f"- `{f}`: " + (", ".join(f"`{d}`" for d in deps) if deps else "nothing"))
    return "\n".join(lines) + "\n"


def main():
    write = "--write" in sys.argv[1:]
    unknown = [a for a in sys.argv[1:] if a != "--write"]
    if unknown:
        fail_usage("unknown argument " + unknown[0] + " (use --write or nothing)")
    rules = read_rules()
    folders = [f for f, _, _ in rules]
    edges, faults = scan(source_files(), folders)
    faults += check_rules(rules)
    faults += check_edges(rules, edges)
    faults += check_mutual(edges)
    faults += check_cmake(rules, edges)
    mutual = sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges})
    for a, b in mutual:
        faults.append(f"{a} and {b} include each other")
    graph = render_graph(rules, edges)
    if write:
        with open(GRAPH, "w", encoding="utf-8") as f:
            f.write(graph)
    else:
        try:
            current = open(GRAPH, encoding="utf-8").read()
        except OSError:
            current = ""
        if current != graph:
            faults.append("docs/dependencies.md is not up to date with the includes: run "
                          "scripts/check_layers.py --write and commit it")
    for f in faults:
        print(f)
    if faults:
        print(f"check_layers: {len(faults)} fault(s)", file=sys.stderr)
        return 1
    print(f"check_layers: {len(folders)} folders, {len(edges)} folder dependencies, all pointing "
          "down; CMake links match the includes; docs/dependencies.md up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
