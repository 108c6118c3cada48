# endpoint_flood.py KIND PORT SECONDS: holds a flood of one kind against a loopback port until
# SECONDS pass, reconnecting what the server closes; prints how many connections it opened.
#   header   200 serving connections that each send only a header announcing 64 MiB
#   silent   up to 4200 serving connections that send nothing (the cap is 4096)
#   http     600 keep-alive HTTP connections that got one /metrics answer each (the cap is 512)
#   control  silent and wrong-token control connections from 127.0.0.2, 200 open at a time
import socket, struct, sys, time
kind, port, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
end = time.time() + secs
socks = []
def conn(src=None):
    s = socket.socket()
    if src: s.bind((src, 0))
    s.connect(("127.0.0.1", port))
    return s
opened = 0
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
print(f"{kind}: opened {opened}", file=sys.stderr)
