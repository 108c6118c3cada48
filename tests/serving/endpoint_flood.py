# endpoint_flood.py KIND PORT SECONDS: holds a flood of one kind against a loopback port until
# SECONDS pass, reconnecting what the server closes; prints how many connections it opened.
#   header   200 serving connections that each send only a header announcing 64 MiB
#   silent   up to 4200 serving connections that send nothing (the cap is 4096)
#   http     600 keep-alive HTTP connections that got one /metrics answer each (the cap is 512)
#   control  silent and wrong-token control connections from 127.0.0.2, 200 open at a time
#   brute    control-token brute force: 48 connections from 127.0.0.3..6 sending requests with
#            wrong tokens as fast as answers come, reconnecting; counts the tries whose token was
#            checked ("wrong token") and those refused unchecked during a cool-down
#   trickle  300 serving connections that each send a valid frame 1 byte per second
#   pipeline one serving connection that pipelines 64-token requests as fast as the server reads
#            them and never reads an answer
#   deadline 8 serving connections, each keeping 32 one-token requests in flight whose own
#            deadline is 1 ms (FLOOD_MODEL: the model folder, for its hidden size)
#   utf8     4 control connections sending requests whose token is not UTF-8, as fast as the
#            answers come
# brute, pipeline, deadline and utf8 print one more line, "result: {json}", for the table's
# checks column. FLOOD_TLS=1: deadline and utf8 speak TLS (unverified, as an attacker would);
# the other kinds stay plain TCP, which against a TLS endpoint is a stalled or bad handshake.
import json, os, random, socket, ssl, struct, sys, threading, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
from raw_frames import fields, infer_request, read_exact, varint
kind, port, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
end = time.time() + secs
socks = []
TLS = os.environ.get("FLOOD_TLS") == "1"
def conn(src=None):
    s = socket.socket()
    if src: s.bind((src, 0))
    s.connect(("127.0.0.1", port))
    return s
def tls_conn():
    """A connection for the kinds that speak the protocol: TLS when the job has it."""
    s = conn()
    if not TLS:
        return s
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx.wrap_socket(s)
def read_frame(s):
    n = struct.unpack(">I", read_exact(s, 4))[0]
    return fields(read_exact(s, n))
opened = 0
def answered_flood(workers, session):
    """`workers` threads, each on a connection of its own (tls_conn, opened again when the server
    closes it) that session(s, w, answered) drives until the end, calling answered(code) per answer;
    prints the "result:" line with the answers by code."""
    codes, lock = {}, threading.Lock()
    def answered(code):
        with lock: codes[code] = codes.get(code, 0) + 1
    def worker(w):
        global opened
        while time.time() < end:
            try:
                s = tls_conn(); s.settimeout(10)
            except OSError:
                time.sleep(0.1); continue
            with lock: opened += 1
            try:
                session(s, w, answered)
            except (OSError, EOFError):
                pass
            s.close()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    for t in threads: t.start()
    for t in threads: t.join()
    print("result: " + json.dumps({"answers": sum(codes.values()),
                                   "codes": {str(k): v for k, v in sorted(codes.items())}}),
          file=sys.stderr)
if kind == "header":      # 200 connections announcing 64 MiB, nothing more; reconnect when closed
    while time.time() < end:
        socks = [s for s in socks if s.fileno() >= 0]
        while len(socks) < 200:
            s = conn(); s.sendall(struct.pack(">I", 64 << 20)); socks.append(s); opened += 1
        time.sleep(0.2)
        for s in list(socks):
            s.setblocking(False)
            try:
                if s.recv(4096) == b"": s.close()
            except BlockingIOError: pass
            except OSError: s.close()
elif kind == "silent":    # up to 4200 silent connections, reopened as they are closed
    while time.time() < end:
        keep = []
        for s in socks:
            s.setblocking(False)
            try:
                d = s.recv(4096)
                if d == b"": s.close(); continue
            except BlockingIOError: pass
            except OSError: s.close(); continue
            keep.append(s)
        socks = keep
        while len(socks) < 4200 and time.time() < end:
            try: socks.append(conn()); opened += 1
            except OSError: break
        time.sleep(0.2)
elif kind == "http":      # 600 keep-alive connections that each got one answer, reopened
    req = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    while time.time() < end:
        socks = [s for s in socks if s.fileno() >= 0]
        while len(socks) < 600 and time.time() < end:
            try:
                s = conn(); s.sendall(req); s.settimeout(2); s.recv(65536); socks.append(s); opened += 1
            except OSError: pass
        time.sleep(0.5)
        for s in list(socks):
            s.setblocking(False)
            try:
                if s.recv(65536) == b"": s.close()
            except BlockingIOError: pass
            except OSError: s.close()
elif kind == "control":   # silent and wrong-token connections from 127.0.0.2, reconnecting
    body = bytes([0x0a, 5]) + b"wrong" + bytes([0x12, 0])  # token field 1, then an empty command
    frame = struct.pack(">I", len(body)) + body
    i = 0
    while time.time() < end:
        try:
            s = conn("127.0.0.2")
            if i % 2: s.sendall(frame)
            socks.append(s); opened += 1
        except OSError: pass
        if len(socks) > 200: socks.pop(0).close()
        i += 1
        time.sleep(0.002)
elif kind == "brute":     # wrong tokens as fast as the server answers, from 4 other addresses
    import selectors
    sel = selectors.DefaultSelector()
    addrs = ["127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6"]
    tries = checked = cooled = closed = 0
    per_second = {}
    def frame():
        tok = b"guess-%08x" % random.getrandbits(32)
        body = b"\x0a" + varint(len(tok)) + tok + b"\x12\x00"  # token, then an empty status
        return struct.pack(">I", len(body)) + body
    def start(src):
        global opened, tries
        try:
            s = conn(src)
        except OSError:
            return
        s.setblocking(False)
        opened += 1
        try:
            s.send(frame()); tries += 1
        except OSError:
            s.close(); return
        sel.register(s, selectors.EVENT_READ, [src, b""])
    for i in range(48):
        start(addrs[i % len(addrs)])
    t0 = time.time()
    while time.time() < end:
        for key, _ in sel.select(timeout=0.2):
            s, st = key.fileobj, key.data
            try:
                d = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                d = b""
            if not d:
                sel.unregister(s); s.close(); closed += 1
                start(st[0]); continue
            st[1] += d
            while len(st[1]) >= 4 and len(st[1]) >= 4 + struct.unpack(">I", st[1][:4])[0]:
                n = struct.unpack(">I", st[1][:4])[0]
                msg = fields(st[1][4:4 + n]).get(2, b"")
                st[1] = st[1][4 + n:]
                if msg == b"wrong token":
                    checked += 1
                    sec = int(time.time() - t0)
                    per_second[sec] = per_second.get(sec, 0) + 1
                else:
                    cooled += 1
                try:
                    s.send(frame()); tries += 1
                except OSError:
                    pass
    print("result: " + json.dumps({"tries": tries, "checked": checked, "cooled": cooled,
                                   "closed": closed, "addresses": len(addrs), "secs": secs,
                                   "max_checked_per_s": max(per_second.values(), default=0)}),
          file=sys.stderr)
elif kind == "files":     # expert updates naming files outside the allowed folder, in rounds
    # FLOOD_TOKEN: the control token; FLOOD_FILES: the paths to ask for, one a line. Every answer
    # must be a refusal; the checks of what it says are the caller's (the first round's answers).
    token = os.environ["FLOOD_TOKEN"].encode()
    paths = [p for p in os.environ["FLOOD_FILES"].split("\n") if p]
    def control(s, command):
        body = b"\x0a" + varint(len(token)) + token + command
        s.sendall(struct.pack(">I", len(body)) + body)
        n = struct.unpack(">I", read_exact(s, 4))[0]
        return fields(read_exact(s, n))
    answers, rounds, accepted = [], 0, 0
    while time.time() < end:
        s = conn(); opened += 1
        s.settimeout(10)
        for p in paths:
            f = p.encode()
            update = b"\x08\x00\x10\x00\x1a" + varint(len(f)) + f  # layer 0, expert 0, file
            r = control(s, b"\x42" + varint(len(update)) + update)
            if r.get(1, 0) == 0: accepted += 1
            if rounds == 0:
                answers.append({"path": p, "code": r.get(1, 0),
                                "message": r.get(2, b"").decode("utf-8", "replace")})
        s.close()
        rounds += 1
        time.sleep(0.2)
    # What the expert updates' status says afterwards (an update that started and failed).
    s = conn(); s.settimeout(10)
    action = b"\x0a\x06status" + b"\x18" + varint(2**64 - 1)  # every expert (-1)
    r = control(s, b"\x4a" + varint(len(action)) + action)
    s.close()
    print("result: " + json.dumps({"rounds": rounds, "accepted": accepted, "answers": answers,
                                   "status": r.get(2, b"").decode("utf-8", "replace"),
                                   "status_raw": r.get(8, b"").hex()}), file=sys.stderr)
elif kind == "trickle":   # every second, one more byte of a valid frame on each connection
    frame = infer_request(1, [1, 64], 1, bytes(256))
    closed = 0
    while time.time() < end:
        keep = []
        for s, at in socks:
            try:
                s.send(frame[at:at + 1])
                keep.append((s, at + 1))
            except OSError:
                s.close(); closed += 1
        socks = keep
        while len(socks) < 300 and time.time() < end:
            try: socks.append((conn(), 0)); opened += 1
            except OSError: break
        time.sleep(1)
    print("result: " + json.dumps({"closed_by_server": closed}), file=sys.stderr)
elif kind == "pipeline":  # requests of 64 tokens (16 KiB each), never an answer read
    import select
    frame = infer_request(1, [64, 64], 1, struct.pack("<f", 0.5) * (64 * 64))
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    s.connect(("127.0.0.1", port))
    s.setblocking(False)
    opened = 1
    sent_bytes = 0
    while time.time() < end:
        if not select.select([], [s], [], 0.2)[1]:
            continue  # the server stopped reading: it holds what it owes, and no more
        try:
            sent_bytes += s.send(frame[sent_bytes % len(frame):])
        except BlockingIOError:
            continue
        except OSError:
            break
    print("result: " + json.dumps({"requests_sent": sent_bytes // len(frame),
                                   "mib_sent": round(sent_bytes / 2**20, 1)}), file=sys.stderr)
elif kind == "deadline":  # one-token requests with a 1 ms deadline of their own, pipelined
    hidden = json.load(open(os.path.join(os.environ["FLOOD_MODEL"], "config.json")))["hidden_size"]
    data = struct.pack("<f", 0.25) * hidden
    next_id = {}
    def pipelined(s, w, answered):
        rid = next_id.get(w, w << 40)
        window = 0
        try:
            while time.time() < end:
                while window < 32:
                    rid += 1
                    s.sendall(infer_request(rid, [1, hidden], 1, data, deadline_ms=1))
                    window += 1
                answered(read_frame(s).get(2, 0))  # InferResponse.code
                window -= 1
        finally:
            next_id[w] = rid
    answered_flood(8, pipelined)
elif kind == "utf8":      # control requests whose token field is not UTF-8
    tok = b"\xff\xfe\xc3\x28-not-utf8-" + bytes(range(0x80, 0xa0))
    body = b"\x0a" + varint(len(tok)) + tok + b"\x12\x00"  # token, then an empty status
    frame = struct.pack(">I", len(body)) + body
    def one_at_a_time(s, w, answered):
        while time.time() < end:
            s.sendall(frame)
            answered(read_frame(s).get(1, 0))  # ControlResponse.code
    answered_flood(4, one_at_a_time)
print(f"{kind}: opened {opened}", file=sys.stderr)
