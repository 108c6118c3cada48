"""Framing of the serving and control protocols (runtime/serving/frame.h), without copying tensors.

Every message on the TCP stream is a 4-byte unsigned big-endian length, then that many bytes of
one Protobuf message.

Sending: :func:`infer_request_parts` serializes an ``InferRequest`` without its ``data`` field
with Protobuf, then appends field 5's tag (0x2A) and length by hand; the tensor's own buffer is
the frame's last part, sent by ``socket.sendmsg`` (a gather write) as it is.

Receiving: :class:`FrameReader` is fed by ``recv_into`` (``get_buffer``, then ``update``).
Small frames go through a reused staging buffer (several answers per ``recv``); a large frame's
body is received directly into a buffer of its own, placed so that the ``data`` field's bytes
(top-level field 6 of an ``InferResponse``, found by scanning the wire format) start 64-byte
aligned. :func:`parse_infer_response` parses everything but ``data`` with Protobuf and returns the
data as a writable ``numpy.uint8`` view of the frame's buffer: no copy. A length prefix over the
limit raises :class:`~moerun.errors.FrameTooLargeError` before any of the body is buffered.

TLS: the same frames inside an ``ssl.SSLSocket`` (non-blocking). :func:`send_some` and
:func:`recv_some` take either kind of socket; over TLS a write is one ``send`` of at most
``_TLS_CHUNK`` bytes (small parts gathered into one record) and OpenSSL's "want read/write"
becomes :class:`TlsWouldBlock` (a ``BlockingIOError``).

Internal: used by moerun.client, moerun.aio and moerun.ctl.
"""

import socket
import ssl
import struct
from typing import List, Optional, Sequence, Tuple

import numpy as np

from moerun.errors import FrameTooLargeError, MalformedFrameError

HEADER = struct.Struct(">I")
HEADER_BYTES = 4
DEFAULT_MAX_FRAME_BYTES = 64 << 20  # the server's default (serving.max_frame_bytes)
MAX_WIRE_FRAME = (1 << 32) - 1      # what a 4-byte length can say

_ALIGN = 64                 # the data field's start in a received frame's buffer
_STAGE_BYTES = 64 << 10     # the staging buffer of small frames
_PREFIX_WANT = 4096         # bytes of a large frame looked at to find its data field
_DATA_TAG = 0x2A            # InferRequest.data: field 5, wire type 2
_RESPONSE_DATA_FIELD = 6    # InferResponse.data
_IOV_MAX = 512              # parts per sendmsg call (IOV_MAX is 1024 on Linux)
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)
_TLS_GATHER = 16 << 10      # TLS: parts smaller than this are gathered into one write
_TLS_CHUNK = 256 << 10      # TLS: bytes per write (a slice of a part: no copy)


def encode_varint(n: int) -> bytes:
    """Protobuf's base-128 varint of n >= 0."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_frame(message) -> bytes:
    """Header + serialized message (control requests, small messages)."""
    body = message.SerializeToString()
    if len(body) > MAX_WIRE_FRAME:
        raise FrameTooLargeError(f"a message of {len(body)} bytes does not fit in one frame")
    return HEADER.pack(len(body)) + body


def infer_request_parts(request, data: Optional[memoryview]) -> Tuple[List, int]:
    """The frame of ``request`` (an InferRequest whose ``data`` is left empty) with ``data``
    (a byte memoryview of the tensor) as field 5: ``(parts, frame_bytes)``. ``parts`` is
    ``[header + message + tag + length, data]``: the tensor's bytes are not copied."""
    head = request.SerializeToString()
    n = 0 if data is None else data.nbytes
    tail = bytes((_DATA_TAG,)) + encode_varint(n) if n else b""
    size = len(head) + len(tail) + n
    if size > MAX_WIRE_FRAME:
        raise FrameTooLargeError(
            f"a request of {size} bytes does not fit in one frame (at most {MAX_WIRE_FRAME})")
    first = HEADER.pack(size) + head + tail
    return ([first, data] if n else [first]), HEADER_BYTES + size


class TlsWouldBlock(BlockingIOError):
    """A TLS write that could not finish: call :func:`send_some` again with the same parts
    (OpenSSL requires the same bytes; some of them may be on the wire already, so the frame
    counts as started). ``want_read``: OpenSSL must read first (a renegotiation), not write."""

    def __init__(self, want_read: bool):
        super().__init__("TLS write would block")
        self.want_read = want_read


def _bytes_view(part) -> memoryview:
    mv = memoryview(part)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _advance(parts: List, n: int) -> List:
    """The parts after the first n bytes (the first one cut where the write stopped)."""
    i = 0
    while i < len(parts):
        size = memoryview(parts[i]).nbytes
        if n < size:
            break
        n -= size
        i += 1
    rest = parts[i:]
    if rest and n:
        rest[0] = _bytes_view(rest[0])[n:]
    return rest


def send_some(sock: socket.socket, parts: List) -> List:
    """One ``sendmsg`` of ``parts`` (a list of byte buffers) on a non-blocking socket: returns
    the parts still to send (the first one cut where the write stopped). Raises
    ``BlockingIOError`` when nothing could be written (:class:`TlsWouldBlock` over TLS),
    ``OSError`` when the connection broke."""
    if isinstance(sock, ssl.SSLSocket):
        return _send_some_tls(sock, parts)
    n = sock.sendmsg(parts[:_IOV_MAX], (), _SEND_FLAGS)
    return _advance(parts, n)


def _send_some_tls(sock: ssl.SSLSocket, parts: List) -> List:
    # The bytes of one write are a function of `parts` alone, so that a retry after
    # TlsWouldBlock passes the same ones.
    first = _bytes_view(parts[0])
    if first.nbytes >= _TLS_GATHER or len(parts) == 1:
        chunk = first[:_TLS_CHUNK]
    else:
        pieces, size = [], 0
        for p in parts:
            mv = _bytes_view(p)[:_TLS_GATHER - size]
            pieces.append(mv)
            size += mv.nbytes
            if size >= _TLS_GATHER:
                break
        chunk = b"".join(pieces)
    if not len(chunk):
        return _advance(parts, 0)  # empty parts only: nothing to write
    try:
        n = sock.send(chunk)
    except ssl.SSLWantWriteError:
        raise TlsWouldBlock(False) from None
    except ssl.SSLWantReadError:
        raise TlsWouldBlock(True) from None
    return _advance(parts, n)


def recv_some(sock: socket.socket, buf: memoryview) -> int:
    """``sock.recv_into(buf)``; over TLS OpenSSL's "want read/write" raises
    ``BlockingIOError`` as a plain socket's EAGAIN does (bytes OpenSSL already holds come
    first: see :func:`tls_pending`)."""
    try:
        return sock.recv_into(buf)
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
        raise BlockingIOError("TLS read would block") from None


def tls_pending(sock: socket.socket) -> bool:
    """Whether OpenSSL holds decrypted bytes of sock not read yet (poll would not see them)."""
    return isinstance(sock, ssl.SSLSocket) and sock.pending() > 0


def byte_view(array: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes as a flat memoryview (no copy)."""
    mv = memoryview(array)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


# --- scanning the wire format ----------------------------------------------------------------

class _Incomplete(Exception):
    pass


def _varint(mv, i: int, end: int) -> Tuple[int, int]:
    value = 0
    shift = 0
    while True:
        if i >= end:
            raise _Incomplete
        b = mv[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise MalformedFrameError("bad frame from the server: a varint of over 10 bytes")


def _skip(mv, i: int, end: int, wire: int) -> int:
    if wire == 0:
        return _varint(mv, i, end)[1]
    if wire == 1:
        return i + 8
    if wire == 2:
        n, i = _varint(mv, i, end)
        return i + n
    if wire == 5:
        return i + 4
    raise MalformedFrameError(f"bad frame from the server: wire type {wire}")


def find_field(mv, start: int, end: int, field: int, complete: bool):
    try:
        return _find_field(mv, start, end, field, complete)
    except MalformedFrameError:
        return None  # not a valid message: Protobuf's parse of the whole says so


def _find_field(mv, start: int, end: int, field: int, complete: bool):
    """Scans the top-level fields of the message in mv[start:end] for the length-delimited
    ``field``. Returns ``(tag_start, value_start, value_end)`` (absolute offsets), ``None`` when
    the message has no such field, or ``"more"`` when ``complete`` is false and the bytes end
    before the field was found. Offsets may lie beyond ``end`` when the field is cut."""
    i = start
    try:
        while i < end:
            tag_start = i
            key, i = _varint(mv, i, end)
            num, wire = key >> 3, key & 7
            if num == field and wire == 2:
                n, i = _varint(mv, i, end)
                return tag_start, i, i + n
            i = _skip(mv, i, end, wire)
        return None if complete else "more"
    except _Incomplete:
        if complete:
            return None  # a truncated message: Protobuf's parse says so
        return "more"


# --- receiving --------------------------------------------------------------------------------

class Frame:
    """One received frame: ``buf[base:base + size]`` is its body; ``span`` the data field
    (tag_start, value_start, value_end relative to the body) when known, else ``None``
    (``scanned`` says whether the whole body was looked at)."""

    __slots__ = ("buf", "base", "size", "span", "scanned")

    def __init__(self, buf: np.ndarray, base: int, size: int, span, scanned: bool):
        self.buf = buf
        self.base = base
        self.size = size
        self.span = span
        self.scanned = scanned

    def body(self) -> np.ndarray:
        return self.buf[self.base:self.base + self.size]

    def tobytes(self) -> bytes:
        return self.buf[self.base:self.base + self.size].tobytes()


def _alloc(size: int, data_offset: Optional[int]) -> Tuple[np.ndarray, int]:
    buf = np.empty(size + _ALIGN, np.uint8)
    addr = buf.ctypes.data + (data_offset or 0)
    return buf, (-addr) % _ALIGN


class _Partial:
    __slots__ = ("frame", "mv", "pos", "end")

    def __init__(self, frame: Frame, have: int):
        self.frame = frame
        self.mv = memoryview(frame.buf)
        self.pos = frame.base + have
        self.end = frame.base + frame.size


class FrameReader:
    """Cuts a received byte stream into frames. Use::

        n = sock.recv_into(reader.get_buffer())   # n == 0: the peer closed the connection
        for frame in reader.update(n): ...

    ``find_data``: locate the InferResponse data field (for zero-copy answers). A length
    prefix over ``max_frame_bytes`` raises FrameTooLargeError, then and on every later call.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, find_data: bool = True,
                 peer: str = "the server"):
        self.max_frame_bytes = int(max_frame_bytes)
        self._find = find_data
        self._peer = peer
        self._stage = bytearray(_STAGE_BYTES)
        self._smv = memoryview(self._stage)
        self._lo = 0
        self._hi = 0
        self._cur: Optional[_Partial] = None
        self._error: Optional[Exception] = None

    @property
    def buffered(self) -> int:
        """Bytes of frames not complete yet."""
        if self._cur is not None:
            return self._cur.pos - self._cur.frame.base + HEADER_BYTES
        return self._hi - self._lo

    def get_buffer(self) -> memoryview:
        """Where the next ``recv_into`` should write (never empty)."""
        if self._error is not None:
            raise self._error
        cur = self._cur
        if cur is not None:
            return cur.mv[cur.pos:cur.end]
        if self._lo and len(self._stage) - self._hi < _PREFIX_WANT:
            n = self._hi - self._lo
            self._stage[:n] = self._stage[self._lo:self._hi]
            self._lo, self._hi = 0, n
        return self._smv[self._hi:]

    def update(self, n: int) -> List[Frame]:
        """``n`` bytes were written into the last ``get_buffer()``: returns the frames now
        complete, in stream order."""
        if self._error is not None:
            raise self._error
        cur = self._cur
        if cur is not None:
            cur.pos += n
            if cur.pos < cur.end:
                return []
            self._cur = None
            return [cur.frame]
        self._hi += n
        return self._drain()

    def _drain(self) -> List[Frame]:
        out: List[Frame] = []
        stage, smv = self._stage, self._smv
        while True:
            lo, hi = self._lo, self._hi
            if hi - lo < HEADER_BYTES:
                break
            size = HEADER.unpack_from(stage, lo)[0]
            if size > self.max_frame_bytes:
                self._error = FrameTooLargeError(
                    f"bad frame from {self._peer}: a frame of {size} bytes is over the limit "
                    f"of {self.max_frame_bytes} (max_frame_bytes)")
                raise self._error
            body = lo + HEADER_BYTES
            have = min(hi - body, size)
            if have == size:  # whole: copied out of the staging buffer
                span = find_field(smv, body, body + size, _RESPONSE_DATA_FIELD, True) \
                    if self._find else None
                rel = None if span is None else tuple(s - body for s in span)
                buf, base = _alloc(size, None if rel is None else rel[1])
                buf[base:base + size] = np.frombuffer(stage, np.uint8, size, body)
                out.append(Frame(buf, base, size, rel, True))
                self._lo = body + size
                continue
            if HEADER_BYTES + size <= len(stage):  # small: wait for the rest in the stage
                if lo + HEADER_BYTES + size > len(stage):
                    n = hi - lo
                    stage[:n] = stage[lo:hi]
                    self._lo, self._hi = 0, n
                break
            # Large: received into a buffer of its own, aligned on its data field when found.
            span = find_field(smv, body, body + have, _RESPONSE_DATA_FIELD, False) \
                if self._find else None
            if span == "more" and have < _PREFIX_WANT:
                break
            rel = tuple(s - body for s in span) if isinstance(span, tuple) else None
            buf, base = _alloc(size, None if rel is None else rel[1])
            buf[base:base + have] = np.frombuffer(stage, np.uint8, have, body)
            frame = Frame(buf, base, size, rel, False)
            self._cur = _Partial(frame, have)
            self._lo = self._hi = 0
            break
        if self._lo == self._hi:
            self._lo = self._hi = 0
        return out


def parse_infer_response(frame: Frame, message) -> Optional[np.ndarray]:
    """Parses ``frame`` into ``message`` (an empty InferResponse) except its data field, which
    is returned as a writable uint8 view of the frame's buffer (``None`` when absent)."""
    body = frame.body()
    span = frame.span
    if span is None and not frame.scanned:
        bmv = memoryview(body)
        span = find_field(bmv, 0, frame.size, _RESPONSE_DATA_FIELD, True)
    try:
        if span is None:
            message.ParseFromString(body.tobytes())
            return None
        ts, vs, ve = span
        if ve > frame.size:
            raise MalformedFrameError(
                f"bad frame from the server: its data field ends at byte {ve} of {frame.size}")
        tail = body[ve:]
        if len(tail) and find_field(memoryview(tail), 0, len(tail), _RESPONSE_DATA_FIELD,
                                    True) is not None:
            # The field repeated (the last one counts): parse it all, with a copy.
            message.ParseFromString(body.tobytes())
            return np.frombuffer(bytearray(message.data), np.uint8)
        message.ParseFromString(body[:ts].tobytes() + tail.tobytes())
        return body[vs:ve]
    except MalformedFrameError:
        raise
    except Exception as e:  # google.protobuf.message.DecodeError
        raise MalformedFrameError(
            f"bad frame from the server: {frame.size} bytes that are not a valid "
            f"{message.DESCRIPTOR.name}: {e}") from None


def parse_message(frame: Frame, message) -> None:
    """Parses a whole frame into ``message`` (ControlResponse, ...)."""
    try:
        message.ParseFromString(frame.tobytes())
    except Exception as e:
        raise MalformedFrameError(
            f"bad frame from the server: {frame.size} bytes that are not a valid "
            f"{message.DESCRIPTOR.name}: {e}") from None


def parts_bytes(parts: Sequence) -> int:
    return sum(memoryview(p).nbytes for p in parts)
