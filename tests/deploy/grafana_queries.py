#!/usr/bin/env python3
"""Evaluates every query of a Grafana dashboard against a real Prometheus.

    grafana_queries.py --dashboard deploy/grafana/moerun-dashboard.json \
        --prometheus http://127.0.0.1:9090 --job JOB --start UNIX_S --end UNIX_S

Resolves the dashboard's query variables first (`label_values(METRIC{...}, LABEL)` through the
label values API; a variable must have at least one value, the `job` variable must list --job),
then runs every panel target's `expr` as a range query over [start, end] at a 1 s step, with
$job set to --job, every other variable to its first value, $__rate_interval to 4 s (four scrapes
of 1 s), $__interval to 1 s and $__range to the window. Prints one line per target (panel,
refId, series, finite points). Each --expect EXPR (PromQL, e.g. a comparison that filters)
must return at least one sample as an instant query at --end. Exits 1 naming each panel whose target returned no finite
point (or that Prometheus refused), 2 on bad arguments. Standard library only.
"""

import argparse
import json
import math
import re
import sys
import urllib.error
import urllib.parse
import urllib.request


def api(base, path, params):
    url = base.rstrip("/") + path + "?" + urllib.parse.urlencode(params, doseq=True)
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:  # a bad query: Prometheus says why in the body
        try:
            body = json.load(e)
        except ValueError:
            return None, f"HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return None, str(e)
    if body.get("status") != "success":
        return None, body.get("error", "status " + str(body.get("status")))
    return body["data"], None


def substitute(expr, values):
    # Longest names first, so that $__rate_interval is not taken for $__range's prefix etc.
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    return expr


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dashboard", required=True)
    ap.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    ap.add_argument("--job", required=True, help="the scrape job's name ($job)")
    ap.add_argument("--start", type=float, required=True)
    ap.add_argument("--end", type=float, required=True)
    ap.add_argument("--expect", action="append", default=[], metavar="EXPR",
                    help="PromQL that must return a sample at --end (repeatable)")
    a = ap.parse_args()
    if not a.end > a.start:
        print("error: --end must be after --start", file=sys.stderr)
        return 2
    try:
        with open(a.dashboard) as f:
            dash = json.load(f)
    except (OSError, ValueError) as e:
        print(f"error: cannot read the dashboard {a.dashboard}: {e}", file=sys.stderr)
        return 2

    failed = []
    values = {"__rate_interval": "4s", "__interval": "1s",
              "__range": f"{int(math.ceil(a.end - a.start))}s", "job": a.job}
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        q = var.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        m = re.fullmatch(r"\s*label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*", q or "")
        if not m:
            failed.append(f"variable {var['name']}: not a label_values(metric, label) query: {q}")
            continue
        match = substitute(m.group(1), values)
        data, err = api(a.prometheus, f"/api/v1/label/{m.group(2)}/values",
                        {"match[]": match, "start": a.start, "end": a.end})
        got = data or []
        print(f"variable {var['name']}: {q} -> {got}" + (f" ({err})" if err else ""))
        if not got:
            failed.append(f"variable {var['name']}: no values")
        elif var["name"] == "job":
            if a.job not in got:
                failed.append(f"variable job: {a.job} is not among {got}")
        else:
            values.setdefault(var["name"], sorted(got, key=lambda v: (len(v), v))[0])

    targets = 0
    for panel in dash.get("panels", []):
        for t in panel.get("targets", []):
            if t.get("hide"):
                continue
            targets += 1
            expr = substitute(t["expr"], values)
            left = re.findall(r"\$\{?[a-zA-Z_]+", expr)
            title = f"panel {panel.get('id')} \"{panel.get('title')}\" {t.get('refId')}"
            if left:
                failed.append(f"{title}: unknown variables {left}")
                continue
            data, err = api(a.prometheus, "/api/v1/query_range",
                            {"query": expr, "start": a.start, "end": a.end, "step": "1"})
            series = (data or {}).get("result", [])
            points = sum(1 for s in series for _, v in s.get("values", [])
                         if math.isfinite(float(v)))
            last = [s["values"][-1][1] for s in series if s.get("values")][:4]
            print(f"{title}: {len(series)} series, {points} finite points, last {last}"
                  f"{' ERROR ' + err if err else ''}\n    {expr}")
            if err:
                failed.append(f"{title}: Prometheus refused the query: {err}")
            elif points == 0:
                failed.append(f"{title}: no data ({expr})")
    for expr in a.expect:
        data, err = api(a.prometheus, "/api/v1/query", {"query": expr, "time": a.end})
        got = [r.get("value", [0, ""])[1] for r in (data or {}).get("result", [])]
        print(f"expect {expr}: {got}" + (f" ERROR {err}" if err else ""))
        if not got:
            failed.append(f"expected a sample: {expr}" + (f" ({err})" if err else ""))
    if targets == 0:
        failed.append("the dashboard has no panel targets")
    for f in failed:
        print("FAIL: " + f, file=sys.stderr)
    print(f"{targets} targets, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
