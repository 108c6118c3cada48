"""The serving protocol's frames by hand, standard library only, for the shell tests' clients
(they run where the Python package or protobuf may be missing, e.g. inside a network namespace).

A frame is a 4-byte big-endian length, then an InferRequest / InferResponse message
(runtime/proto/moerun/v1/serving.proto): request fields 1 id, 3 dtype (1 F32, 2 BF16), 4 shape
(packed), 5 data, 6 deadline_ms; response fields 1 id, 2 error code, 3 message, 6 data.
"""
import struct


def varint(v):
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def infer_request(rid, shape, dtype, data, deadline_ms=0):
    """One whole frame: an InferRequest of `shape` (a list of ints) with `data`'s bytes, and
    its own deadline (field 6) when `deadline_ms` is given."""
    packed = b"".join(varint(d) for d in shape)
    body = (b"\x08" + varint(rid) + b"\x18" + varint(dtype) + b"\x22" + varint(len(packed)) +
            packed + b"\x2a" + varint(len(data)) + data)
    if deadline_ms:
        body += b"\x30" + varint(deadline_ms)
    return struct.pack(">I", len(body)) + body


def read_exact(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise EOFError("the server closed the connection")
        b += c
    return b


def decode(body):
    """A message's fields in order, as (number, wire type, value): varints and fixed64/fixed32
    as ints, length-delimited ones as bytes. Any other wire type is a ValueError."""
    out, i = [], 0

    def rv():
        nonlocal i
        v = sh = 0
        while True:
            c = body[i]
            i += 1
            v |= (c & 0x7F) << sh
            sh += 7
            if c < 0x80:
                return v

    while i < len(body):
        tag = rv()
        f, w = tag >> 3, tag & 7
        if w == 0:
            out.append((f, w, rv()))
        elif w == 1:
            out.append((f, w, struct.unpack("<Q", body[i:i + 8])[0]))
            i += 8
        elif w == 5:
            out.append((f, w, struct.unpack("<I", body[i:i + 4])[0]))
            i += 4
        elif w == 2:
            n = rv()
            out.append((f, w, bytes(body[i:i + n])))
            i += n
        else:
            raise ValueError("wire type %d" % w)
    return out


def fields(body):
    """A message's fields by number (the last of a repeated one), as decode() reads them."""
    return {f: v for f, _, v in decode(body)}


def read_response(s):
    """The next frame from socket `s`, as fields()."""
    return fields(read_exact(s, struct.unpack(">I", read_exact(s, 4))[0]))
