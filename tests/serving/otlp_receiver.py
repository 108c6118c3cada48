#!/usr/bin/env python3
"""An OpenTelemetry OTLP/HTTP trace receiver for the tests, standard library only: it decodes
each `POST /v1/traces` body (application/x-protobuf) with the field numbers of the published
schema (opentelemetry-proto: collector/trace/v1 ExportTraceServiceRequest, trace/v1
ResourceSpans, ScopeSpans, Span, Status; common/v1 KeyValue, AnyValue; resource/v1 Resource),
by the tests' own decoder of the protobuf wire format (tests/lib/raw_frames.py, not moerun's
generated classes), and appends one JSON line per span to OUT.

  otlp_receiver.py PORT_FILE OUT [--port P] [--mode ok|sink|refuse|slow|garbage] [--slow-s S]

The port it listens on (127.0.0.1; --port, else chosen by the kernel) is written to PORT_FILE
once it listens. Modes: ok (200 and an empty ExportTraceServiceResponse), sink (200 without
decoding: a collector that keeps up with anything), and for the collector faults refuse (503
every time), slow (answers after --slow-s seconds), garbage (not HTTP at all: random bytes,
then the connection is closed). Every request's outcome is counted in OUT + ".posts".
"""
import http.server
import json
import os
import socketserver
import struct
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
from raw_frames import decode  # noqa: E402  (the protobuf wire format, by hand)


def any_value(b):  # AnyValue: 1 string, 2 bool, 3 int, 4 double
    for f, w, v in decode(b):
        if f == 1:
            return v.decode()
        if f == 2:
            return bool(v)
        if f == 3:
            return v - (1 << 64) if v >= 1 << 63 else v
        if f == 4:
            return struct.unpack("<d", struct.pack("<Q", v))[0]
    return None


def key_values(items):  # KeyValue: 1 key, 2 value
    out = {}
    for b in items:
        kv = decode(b)
        key = next(v.decode() for f, _, v in kv if f == 1)
        val = next((any_value(v) for f, _, v in kv if f == 2), None)
        out[key] = val
    return out


def spans_of(body):
    """ExportTraceServiceRequest -> span dicts with their resource's attributes."""
    spans = []
    for f, _, rs in decode(body):
        if f != 1:  # resource_spans
            continue
        fields = decode(rs)
        resource = {}
        for g, _, v in fields:
            if g == 1:  # Resource: 1 attributes
                resource = key_values([a for h, _, a in decode(v) if h == 1])
        for g, _, ss in fields:
            if g != 2:  # scope_spans
                continue
            for h, _, sb in decode(ss):
                if h != 2:  # spans
                    continue
                s = decode(sb)
                one = lambda n, d=None: next((v for k, _, v in s if k == n), d)
                status = decode(one(15, b""))
                spans.append({
                    "trace_id": one(1, b"").hex(), "span_id": one(2, b"").hex(),
                    "parent_span_id": one(4, b"").hex(), "name": one(5, b"").decode(),
                    "kind": one(6, 0), "start": one(7, 0), "end": one(8, 0),
                    "flags": one(16, 0),
                    "attributes": key_values([v for k, _, v in s if k == 9]),
                    "status_code": next((v for k, _, v in status if k == 3), 0),
                    "status_message": next((v.decode() for k, _, v in status if k == 2), ""),
                    "resource": resource,
                })
    return spans


def main():
    port_file, out = sys.argv[1], sys.argv[2]
    mode = "ok"
    slow_s = 5.0
    port = 0
    args = sys.argv[3:]
    while args:
        a = args.pop(0)
        if a == "--mode":
            mode = args.pop(0)
        elif a == "--slow-s":
            slow_s = float(args.pop(0))
        elif a == "--port":
            port = int(args.pop(0))
        else:
            sys.exit("unknown argument " + a)
    lock = threading.Lock()

    def count(what):
        with lock, open(out + ".posts", "a") as f:
            f.write(what + "\n")

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if mode == "garbage":
                count("garbage")
                self.wfile.write(os.urandom(512))
                self.close_connection = True
                return
            if mode == "refuse":
                count("refused")
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if mode == "sink":
                count("sink %d" % len(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if mode == "slow":
                count("slow")
                time.sleep(slow_s)
            ok = self.path == "/v1/traces" and \
                self.headers.get("Content-Type") == "application/x-protobuf"
            try:
                spans = spans_of(body) if ok else []
            except Exception as e:  # a body our decoder cannot read is the test's failure
                count("undecodable %s" % e)
                ok = False
            if ok:
                with lock, open(out, "a") as f:
                    for s in spans:
                        f.write(json.dumps(s) + "\n")
                count("ok %d" % len(spans))
            self.send_response(200 if ok else 400)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True

    srv = Server(("127.0.0.1", port), Handler)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(srv.server_address[1]))
    os.rename(port_file + ".tmp", port_file)
    srv.serve_forever()


if __name__ == "__main__":
    main()
