#!/usr/bin/env bash
# `moectl placement plan --loads ... --plot FILE.svg` offline, as a user runs it: the SVG is
# well-formed XML (xml.etree), has one bar per (expert rank, current|plan) per layer, the bars
# carry the per-rank loads (each layer's total is conserved; the plan's busiest rank carries no
# more than the current one's), and titles say the balancedness. Bad --plot paths (a missing
# folder, a folder) end with exit 2 and one line, for moectl and for moebench serve and layer.
# moebench layer --plot on a small preset layer: one line per weight type, a point per token
# count.
#
#   plot_cli.sh MOECTL MOEBENCH
set -euo pipefail
[[ $# -eq 2 ]] || { echo "usage: plot_cli.sh MOECTL MOEBENCH" >&2; exit 2; }
MOECTL=$(realpath "$1")
MOEBENCH=$(realpath "$2")
PY=/usr/bin/python3
WORK=$(mktemp -d /tmp/moerun-plot-cli.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# 3 layers x 32 experts, skewed (a few hot experts), and one layer with no load at all.
"$PY" - "$WORK/loads.json" <<'PY'
import json, sys
layers = {}
for l in range(3):
    layers[str(l)] = [int(4000 / (1 + ((e * 7 + l * 5) % 32)) ** 1.2) for e in range(32)]
layers["3"] = [0] * 32
json.dump({"layers": layers}, open(sys.argv[1], "w"))
PY

check_svg() {  # check_svg FILE LAYERS EXPERT_RANKS
  "$PY" - "$1" "$2" "$3" "$WORK/loads.json" <<'PY'
import json, sys, xml.etree.ElementTree as ET
path, layers, ranks, loads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
root = ET.parse(path).getroot()  # raises on malformed XML
ns = "{http://www.w3.org/2000/svg}"
assert root.tag == ns + "svg", root.tag
panels = [g for g in root.iter(ns + "g") if g.get("class") == "panel"]
assert len(panels) == layers, f"{len(panels)} panels, expected {layers}"
loads = json.load(open(loads))["layers"]
for i, p in enumerate(panels):
    bars = [r for r in p.iter(ns + "rect") if r.get("class") == "bar"]
    assert len(bars) == 2 * ranks, f"layer {i}: {len(bars)} bars, expected {2 * ranks}"
    before = [float(b.get("data-value")) for b in bars if b.get("data-series") == "0"]
    after = [float(b.get("data-value")) for b in bars if b.get("data-series") == "1"]
    total = sum(loads[str(i)])
    assert abs(sum(before) - total) <= 1e-6 * max(total, 1), (sum(before), total)
    assert abs(sum(after) - total) <= 1e-6 * max(total, 1), (sum(after), total)
    assert max(after) <= max(before) + 1e-9, (max(after), max(before))
    # Taller bar, larger value.
    hv = sorted((float(b.get("data-value")), float(b.get("height"))) for b in bars)
    assert all(h1 <= h2 + 1e-6 for (_, h1), (_, h2) in zip(hv, hv[1:])), "heights not monotonic"
    title = "".join(t.text or "" for t in p.iter(ns + "text") if t.get("class") == "panel-title")
    assert f"layer {i}: balancedness" in title, title
titles = [t.text for t in root.iter(ns + "text") if t.get("class") == "title"]
subs = [t.text for t in root.iter(ns + "text") if t.get("class") == "subtitle"]
assert titles and subs and "mean balancedness" in subs[0], (titles, subs)
legend = [t.text for t in root.iter(ns + "text") if t.get("class") == "legend"]
assert legend == ["current placement", "plan (predicted)"], legend
print(f"ok: {path}: {layers} panels x {2 * ranks} bars")
PY
}

# 1 router + 4 expert ranks; 8 expert ranks with 8 redundant slots.
"$MOECTL" placement plan --loads "$WORK/loads.json" --ranks 5 --plot "$WORK/a.svg" \
  >"$WORK/a.out" 2>"$WORK/a.err" || fail "plan --plot: $(cat "$WORK/a.err")"
grep -q "plot written to $WORK/a.svg" "$WORK/a.err" || fail "no 'plot written' line"
grep -q "^layer" "$WORK/a.out" || fail "the plan itself was not printed"
check_svg "$WORK/a.svg" 4 4 || fail "a.svg"
"$MOECTL" placement plan --loads "$WORK/loads.json" --ranks 9 --redundant 8 --json \
  --plot "$WORK/b.svg" >"$WORK/b.json" 2>"$WORK/b.err" || fail "plan --json --plot"
"$PY" -c "import json,sys; json.load(open(sys.argv[1]))" "$WORK/b.json" || fail "--json broken"
check_svg "$WORK/b.svg" 4 8 || fail "b.svg"

# moebench layer --plot (a small preset layer, two weight types, three token counts): one line
# per weight type in each chart, a point per token count, the tokens' axis in decades.
"$MOEBENCH" layer --preset qwen3-30b-a3b --experts 8 --dtype f32,bf16 --tokens 1,4,16 \
  --min-time 0.02 --no-sgemm --threads 1 --plot "$WORK/layer.svg" >/dev/null 2>"$WORK/layer.err" ||
  fail "moebench layer --plot: $(tail -3 "$WORK/layer.err")"
"$PY" - "$WORK/layer.svg" <<'PY' || fail "layer.svg"
import sys, xml.etree.ElementTree as ET
ns = "{http://www.w3.org/2000/svg}"
root = ET.parse(sys.argv[1]).getroot()
charts = [g for g in root.iter(ns + "g") if g.get("class") == "chart"]
assert len(charts) == 2, len(charts)
for c in charts:
    lines = [l for l in c.iter(ns + "polyline") if l.get("class") == "line"]
    assert len(lines) == 2, len(lines)
    assert all(l.get("data-points") == "3" for l in lines), [l.get("data-points") for l in lines]
    legend = sorted(t.text for t in c.iter(ns + "text") if t.get("class") == "legend")
    assert legend == ["moerun BF16", "moerun F32"], legend
    ticks = [t.text for t in c.iter(ns + "text") if t.text in ("1", "10", "100")]
    assert {"1", "10", "100"} <= set(ticks), ticks
print(f"ok: {sys.argv[1]}: 2 charts x 2 lines x 3 points")
PY

# Bad paths: exit 2, one line on stderr, nothing written.
expect_bad() {  # expect_bad WHAT COMMAND...
  local what=$1 rc=0
  shift
  "$@" >"$WORK/bad.out" 2>"$WORK/bad.err" || rc=$?
  [[ $rc -eq 2 ]] || fail "$what: exit $rc, expected 2: $(cat "$WORK/bad.err")"
  [[ $(wc -l <"$WORK/bad.err") -eq 1 ]] || fail "$what: not one line: $(cat "$WORK/bad.err")"
  grep -q -- "--plot" "$WORK/bad.err" || fail "$what: the error does not name --plot"
  echo "ok: $what: $(cat "$WORK/bad.err")"
}
expect_bad "moectl, missing folder" "$MOECTL" placement plan --loads "$WORK/loads.json" \
  --ranks 5 --plot "$WORK/nope/x.svg"
expect_bad "moectl, a folder" "$MOECTL" placement plan --loads "$WORK/loads.json" --ranks 5 \
  --plot "$WORK"
[[ ! -e "$WORK/nope" ]] || fail "a folder was created"
expect_bad "moebench layer, missing folder" "$MOEBENCH" layer --preset qwen3-30b-a3b \
  --plot "$WORK/nope/x.svg"
expect_bad "moebench serve, missing folder" "$MOEBENCH" serve --target 127.0.0.1:1 --hidden 8 \
  --duration 1 --plot "$WORK/nope/x.svg"
echo "PASS"
