#!/usr/bin/python3
"""Every relative link in the user documentation (README.md, docs/, deploy/) names a file of the
repository, and every #anchor a heading of the page it points to (GitHub's slugs).

  /usr/bin/python3 tests/docs/check_links.py SOURCE_DIR     (ctest: docs_links)
"""
import os
import re
import sys

root = os.path.abspath(sys.argv[1])
pages = [os.path.join(root, "README.md")]
for top in ("docs", "deploy"):
    for d, _, files in os.walk(os.path.join(root, top)):
        pages += [os.path.join(d, f) for f in files if f.endswith(".md")]


def strip_code(text):
    return re.sub(r"```.*?```", "", text, flags=re.S)


def slugs(path):
    out = set()
    counts = {}
    for line in strip_code(open(path, encoding="utf-8").read()).splitlines():
        m = re.match(r"^#{1,6} (.*)$", line)
        if not m:
            continue
        s = m.group(1).strip().lower()
        s = re.sub(r"[^\w\- ]", "", s).replace(" ", "-")
        n = counts.get(s, 0)
        counts[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


bad, links = [], 0
for page in pages:
    text = strip_code(open(page, encoding="utf-8").read())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        links += 1
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        rel = os.path.relpath(page, root)
        if not os.path.exists(dest):
            bad.append(f"{rel}: ({target}): no such file")
        elif anchor and dest.endswith(".md") and anchor not in slugs(dest):
            bad.append(f"{rel}: ({target}): no heading '#{anchor}' in {os.path.relpath(dest, root)}")
for b in bad:
    print("FAIL " + b)
print(f"{len(pages)} pages, {links} relative links, {len(bad)} broken")
sys.exit(1 if bad else 0)
