# endpoint_flood_check.py KIND WORK OPENED MOECTL HEALTH RSS_BEFORE RSS_AFTER LOG_AT LOG_END SECS PID
# One row of endpoint_floods.sh's table and its checks (the header there says what each asserts).
# Reads WORK/bench.KIND.json (moebench --json), WORK/flood.KIND (the attack's stderr, with its
# "result: {json}" line), WORK/serve.log bytes LOG_AT..LOG_END (the log during the attack),
# WORK/ready.KIND (the /health/ready codes polled every 100 ms during the attack).
# Prints the row, then one line per failed check; exits 1 if any failed.
import json, struct, sys

kind, work, opened, st, hr = sys.argv[1:6]
rss_before, rss_after, log_at, log_end, secs, pid = (int(a) for a in sys.argv[6:12])
# The TLS job: 4,200 stalled handshakes raise the allocator's high-water mark once (OpenSSL's
# per-connection state; +36 MiB the first time, then -4 and -2 MiB for the same flood twice
# more: not a leak), so its bound is higher.
import os
RSS_BOUND_MIB = int(os.environ.get("FLOOD_RSS_BOUND_MIB", "32"))

try:
    j = json.load(open(f"{work}/bench.{kind}.json"))
except (OSError, ValueError):
    j = {}
ok, sent = j.get("ok", 0), j.get("requests", 0)
wrong = j.get("errors", {}).get("mismatch", 0) if isinstance(j.get("errors"), dict) else 0
problems = []
if not (sent > 0 and ok * 10 >= sent * 9):
    problems.append(f"the verified client got {ok} of {sent} answered OK (goal: 90%)")
if wrong:
    problems.append(f"{wrong} wrong answers")
if st != "ok":
    problems.append(f"moectl status during the attack: {st}")
if hr != "200":
    problems.append(f"/health/ready answered {hr}")
growth = (rss_after - rss_before) / 1024
if growth > RSS_BOUND_MIB:
    problems.append(f"the router's RSS grew by {growth:.1f} MiB (bound {RSS_BOUND_MIB} MiB)")

result = {}
try:
    for line in open(f"{work}/flood.{kind}", errors="replace"):
        if line.startswith("result: "):
            result = json.loads(line[len("result: "):])
except OSError:
    pass
with open(f"{work}/serve.log", "rb") as f:
    f.seek(log_at)
    log = f.read(log_end - log_at)
log_lines = log.count(b"\n")
try:
    polls = [l.strip() for l in open(f"{work}/ready.{kind}") if l.strip()]
except OSError:
    polls = []
ready_ok = sum(1 for p in polls if p == "200")
# The http attack fills the HTTP endpoint's connection cap: its polls may be turned away.
if kind != "http" and (not polls or ready_ok != len(polls)):
    bad = sorted(set(p for p in polls if p != "200"))
    problems.append(f"/health/ready answered 200 to {ready_ok} of {len(polls)} polls (others: {bad})")
LOG_BOUND = 3 + secs // 10
# Metrics label sets: no series after the attack that was not there before (no label value
# from a peer's input). The files attack holds the token: an expert update it starts (the one
# file inside the folder) adds that layer's and expert's update series, as an operator's would
# (bounded by the model's layers x experts).
def series(path):
    try:
        return {l.rsplit(" ", 1)[0] for l in open(path) if l.strip() and not l.startswith("#")}
    except OSError:
        return set()
before, after = series(f"{work}/metrics.before.{kind}"), series(f"{work}/metrics.after.{kind}")
if not before:
    problems.append("/metrics could not be read before the attack")
elif after - before and kind != "files":
    problems.append(f"new metric series after the attack: {sorted(after - before)[:5]}")

checks = ""
if kind == "brute":
    addresses = result.get("addresses", 4)
    bound = addresses * (11 + secs // 8)
    checked = result.get("checked", -1)
    lines = [l for l in log.split(b"\n") if b"control:" in l and b"token" in l]
    log_bound = 2 + secs // 10
    checks = (f"{result.get('tries', 0)} tries, {checked} checked (bound {bound}; max "
              f"{result.get('max_checked_per_s', 0)}/s), {len(lines)} log lines")
    if checked < 0 or checked > bound:
        problems.append(f"{checked} wrong tokens were checked: the back-off allows {bound}")
    if result.get("tries", 0) < 10 * addresses:
        problems.append("the brute force barely ran (fewer tries than the free ones)")
    if len(lines) > log_bound:
        problems.append(f"{len(lines)} log lines about wrong tokens (bound {log_bound})")
elif kind == "files":
    answers = result.get("answers", [])
    texts = [a["message"].encode() for a in answers] + [result.get("status", "").encode(),
                                                        bytes.fromhex(result.get("status_raw", "")),
                                                        log]
    # What may not leak: each readable target's first line (its 8-byte runs), and its first 8
    # bytes as the integer an old error printed.
    targets = {f"{work}/secret.txt", f"{work}/allowed/garbage.safetensors", "/etc/shadow",
               f"/proc/{pid}/environ"}
    leaks = []
    for t in sorted(targets):
        try:
            with open(t, "rb") as f:
                first = f.read(4096).split(b"\n")[0].split(b"\0")[0][:200]
        except OSError:
            continue
        runs = {first[i:i + 8] for i in range(max(0, len(first) - 7))} if len(first) >= 8 else set()
        numbers = set()
        if len(first) >= 8:
            for fmt in ("<Q", ">Q", "<q", ">q"):
                n = struct.unpack(fmt, first[:8])[0]
                numbers |= {str(n).encode(), f"{n:x}".encode()}
        for text in texts:
            for r in runs:
                if r in text and not any(r in a["path"].encode() for a in answers):
                    leaks.append(f"{t}: {r!r}")
            for n in numbers:
                if len(n) >= 6 and n in text:
                    leaks.append(f"{t}: its first 8 bytes as {n.decode()}")
    inside = [a for a in answers if a["path"].endswith("/allowed/garbage.safetensors")]
    outside = [a for a in answers if a not in inside]
    refused = sum(1 for a in outside if a["code"] != 0)
    unnamed = [a["path"] for a in outside if a["path"] not in a["message"]]
    by_path = {a["path"]: a["message"].replace(a["path"], "PATH") for a in answers}
    # Pairs of a present and a missing file outside: the same answer but for the path.
    def find(pred):
        return next((a for a in by_path if pred(a)), None)
    same = [(find(lambda a: a == "/etc/shadow"),
             find(lambda a: a.startswith("/etc/moerun-no-such"))),
            (find(lambda a: a.endswith("/../secret.txt")),
             find(lambda a: a.endswith("/../no-such-file.txt"))),
            (find(lambda a: a.endswith("/link-out.safetensors")),
             find(lambda a: a.endswith("/link-gone.safetensors")))]
    checks = (f"{refused}/{len(outside)} outside refused x {result.get('rounds', 0)} rounds, "
              f"{len(set(leaks))} leaks")
    rounds = result.get("rounds", 0)
    if not outside or refused != len(outside) or result.get("accepted", 1) > rounds * len(inside):
        problems.append(f"an update outside the allowed folder was accepted: {outside}")
    if unnamed:
        problems.append(f"answers that do not name the path: {unnamed}")
    for p, q in same:
        if p is None or q is None or by_path[p] != by_path[q]:
            problems.append(f"a missing and a present file outside differ: {by_path.get(p)!r} "
                            f"vs {by_path.get(q)!r}")
    if leaks:
        problems.append(f"content leaked: {sorted(set(leaks))[:5]}")
    for a in answers:
        print(f"    files: {a['path']} -> {a['message']}", file=sys.stderr)
elif kind in ("deadline", "utf8"):
    codes = result.get("codes", {})
    checks = f"{result.get('answers', 0)} answered {codes}"
    if result.get("answers", 0) < 10:
        problems.append("the attack barely ran (fewer than 10 answers)")
    if kind == "utf8" and set(codes) - {"6"}:
        problems.append(f"answers other than MALFORMED_FRAME (6): {codes}")
    if log_lines > LOG_BOUND:
        problems.append(f"the log grew by {log_lines} lines during the attack (bound {LOG_BOUND}):"
                        f" {log[-600:]!r}")
elif kind == "trickle":
    checks = f"{result.get('closed_by_server', '?')} closed by the server"
elif kind == "pipeline":
    checks = f"{result.get('requests_sent', '?')} requests ({result.get('mib_sent', '?')} MiB) sent"

print(f"| {kind} | {opened} | {ok} / {sent} | {st} | {hr} | {ready_ok} / {len(polls)} | "
      f"{log_lines} | {growth:+.1f} MiB | {checks} |")
for p in problems:
    print(f"    FAIL {kind}: {p}", file=sys.stderr)
sys.exit(1 if problems else 0)
