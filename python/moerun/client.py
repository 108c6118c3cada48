"""A blocking client of a running ``moerun serve`` job's serving protocol.

::

    import numpy as np, moerun
    with moerun.Client("127.0.0.1:5700,127.0.0.1:5701") as c:   # a job's routers
        y = c.infer(np.zeros((16, 64), np.float32))            # same shape and kind as x
        ys = c.infer_many([x1, x2, x3])                        # pipelined on one connection

The protocol (README, "The serving protocol"): TCP, each message a frame of a 4-byte big-endian
length and one Protobuf message; the client sends ``InferRequest``, the router answers
``InferResponse`` with the request's ``id``, in any order. See :mod:`moerun.tensors` for the
inputs accepted and the copies made (none for a contiguous input in its own dtype, none for the
answer).

Failover, as the C++ ``FailoverClient``: requests go to one router at a time. When its
connection fails (refused, reset, closed: the router died or stopped) or it answers
UNAVAILABLE (draining, or an expert rank it needs is not answering) the next target takes
over and the request is sent there once more (``retries`` times in all; the MoE forward is
idempotent). Connecting tries every target once in turn. The server's other errors are raised
as they are and never retried: :class:`~moerun.errors.InvalidArgumentError`,
:class:`~moerun.errors.DeadlineExceededError`, :class:`~moerun.errors.OverloadedError`
(retryable by the caller, after a back-off), ...

Nothing blocks without a bound: every socket wait is a ``poll`` bounded by the call's
``timeout`` (only the name lookup of a host name is not: give numeric addresses where that
matters). No router reachable: :class:`~moerun.errors.UnavailableError` naming the targets
tried, at once. No answer within ``timeout``: :class:`~moerun.errors.DeadlineExceededError`
(the connection is then dropped, so that a late answer cannot be mistaken for another). Give
``deadline_ms`` below ``timeout`` to get the server's own DEADLINE_EXCEEDED answer.

TLS (a job with ``serving.tls``): ``tls_ca_file="ca.crt"`` (or ``tls=True`` for the system's
CA store, or ``tls=`` an ``ssl.SSLContext`` of your own) makes every connection speak TLS
around the same frames. The server's certificate is verified, and its name: the host of the
target (a name, or an address checked against the certificate's IP addresses), or
``tls_server_name``. A failed handshake raises :class:`~moerun.errors.UnavailableError`
("connect to HOST:PORT: TLS handshake failed: certificate verify failed (...)") whose
``__cause__`` is the ``ssl.SSLError``.

Thread-safety: one call at a time per :class:`Client` (a second thread calling at the same time
gets ``RuntimeError``); use one Client per thread, or :class:`moerun.aio.AsyncClient` for many
concurrent requests on one connection.
"""

import errno
import math
import os
import select
import socket
import ssl
import threading
import time
from collections import deque
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

from moerun import _frame
from moerun.errors import (
    DeadlineExceededError,
    FrameTooLargeError,
    InvalidArgumentError,
    MalformedFrameError,
    UnavailableError,
    error_from_code,
)
from moerun import tensors
from moerun.v1 import serving_pb2

__all__ = ["Client", "Timing", "parse_targets", "read_key_file", "tls_context"]

_OK = 0
_UNAVAILABLE = 4
_READ_SPIN = 8  # recv calls in a row while data keeps coming


class Timing(NamedTuple):
    """The server's times for one answer: ``queue_us`` waiting in the batcher, ``compute_us``
    of the batch that computed it."""

    queue_us: int
    compute_us: int


def split_host_port(target: str) -> Tuple[str, int]:
    """``"HOST:PORT"`` or ``"[IPv6]:PORT"`` -> (host, port); InvalidArgumentError otherwise."""
    t = target.strip()
    if t.startswith("["):
        end = t.find("]")
        if end < 0 or not t[end + 1:].startswith(":"):
            raise InvalidArgumentError(f"invalid address {target!r}: expected [IPv6]:PORT")
        host, port = t[1:end], t[end + 2:]
    else:
        host, sep, port = t.rpartition(":")
        if not sep or ":" in host:
            raise InvalidArgumentError(
                f"invalid address {target!r}: expected HOST:PORT (IPv6: [ADDRESS]:PORT)")
    if not host:
        raise InvalidArgumentError(f"invalid address {target!r}: empty host")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidArgumentError(f"invalid address {target!r}: port out of range 1..65535")
    return host, int(port)


def parse_targets(targets: Union[str, Iterable[str]]) -> List[str]:
    """``"HOST:PORT"``, ``"HOST:PORT,HOST:PORT"`` or a list of them -> the addresses, in order,
    each checked (InvalidArgumentError names the bad one)."""
    if isinstance(targets, str):
        items = targets.split(",")
    else:
        items = []
        for t in targets:
            if not isinstance(t, str):
                raise InvalidArgumentError(f"targets must be strings, not {type(t).__name__}")
            items.extend(t.split(","))
    out = []
    for t in items:
        if not t.strip():
            raise InvalidArgumentError(
                f"{targets!r}: an empty address (targets are HOST:PORT[,HOST:PORT...])")
        split_host_port(t)
        out.append(t.strip())
    if not out:
        raise InvalidArgumentError("no target address")
    return out


def _poll_ms(seconds: float) -> int:
    return max(0, int(math.ceil(seconds * 1000)))


def _wait(sock: socket.socket, read: bool, write: bool, timeout: float) -> Tuple[bool, bool]:
    """Waits until sock is readable/writable (as asked) or timeout seconds pass: (r, w).
    An error or hang-up condition reports as ready (the next call on the socket says which).
    TLS: bytes OpenSSL already decrypted count as readable (poll cannot see them)."""
    if read and _frame.tls_pending(sock):
        return True, False
    if hasattr(select, "poll"):
        p = select.poll()
        ev = (select.POLLIN if read else 0) | (select.POLLOUT if write else 0)
        p.register(sock.fileno(), ev)
        while True:
            try:
                res = p.poll(_poll_ms(timeout))
                break
            except InterruptedError:  # pragma: no cover (PEP 475 retries)
                continue
        if not res:
            return False, False
        got = res[0][1]
        bad = got & (select.POLLERR | select.POLLHUP | select.POLLNVAL)
        return bool(got & select.POLLIN or (bad and read)), bool(got & select.POLLOUT or
                                                                  (bad and write))
    r, w, x = select.select([sock] if read else [], [sock] if write else [], [sock],
                            max(0.0, timeout))
    return bool(r or (x and read)), bool(w or (x and write))


def tls_context(tls: Union[None, bool, ssl.SSLContext] = None,
                ca_file: Optional[str] = None) -> Optional[ssl.SSLContext]:
    """The ``ssl.SSLContext`` of the ``tls``/``tls_ca_file`` options: None (plain TCP) when
    neither is given; ``tls`` itself when it is a context; else a default context (TLS 1.2 or
    newer, certificate and name verified) with ``ca_file``'s CA certificates, or the system's
    without one. InvalidArgumentError for a CA file that cannot be read."""
    if isinstance(tls, ssl.SSLContext):
        if ca_file is not None:
            raise InvalidArgumentError("give tls as an ssl.SSLContext or tls_ca_file, not both")
        return tls
    if tls not in (None, True, False):
        raise InvalidArgumentError(
            f"tls must be None, True, False or an ssl.SSLContext, not {type(tls).__name__}")
    if not tls and ca_file is None:
        return None
    if tls is False:
        raise InvalidArgumentError("tls_ca_file implies tls: do not give tls=False with it")
    try:
        ctx = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise InvalidArgumentError(
            f"tls_ca_file {ca_file}: {getattr(e, 'strerror', None) or e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def tls_handshake_error(target: str, e: BaseException) -> UnavailableError:
    """The UnavailableError of a failed handshake: "connect to T: TLS handshake failed:
    certificate verify failed (self-signed certificate)" (raise it ``from e``)."""
    if isinstance(e, ssl.SSLCertVerificationError):
        why = f"certificate verify failed ({e.verify_message})"
    elif isinstance(e, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        why = "the server closed the connection"
    elif isinstance(e, ssl.SSLError):
        why = e.reason.lower().replace("_", " ") if e.reason else str(e)
    elif isinstance(e, OSError):
        why = f"the server closed the connection ({e.strerror or e})"
    else:
        why = str(e)
    return UnavailableError(f"connect to {target}: TLS handshake failed: {why}")


def wrap_tls(sock: socket.socket, context: ssl.SSLContext, target: str,
             server_name: Optional[str]) -> ssl.SSLSocket:
    """The socket wrapped for a client handshake (not done yet), checking the server as
    ``server_name`` or the target's host; the socket is closed if it cannot be wrapped."""
    host, _ = split_host_port(target)
    try:
        return context.wrap_socket(sock, server_hostname=server_name or host,
                                   do_handshake_on_connect=False)
    except (ValueError, OSError) as e:
        sock.close()
        raise tls_handshake_error(target, e) from e


def tls_handshake(sock: socket.socket, context: ssl.SSLContext, target: str,
                  server_name: Optional[str], timeout: float) -> ssl.SSLSocket:
    """Wraps a connected non-blocking socket in TLS and does the handshake within ``timeout``
    seconds, verifying the server as ``server_name`` or the target's host. The socket is
    closed on failure: :func:`tls_handshake_error`, whose ``__cause__`` is the
    ``ssl.SSLError`` (or the OSError)."""
    tsock = wrap_tls(sock, context, target, server_name)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                tsock.do_handshake()
                return tsock
            except ssl.SSLWantReadError:
                ready, _ = _wait(tsock, True, False, deadline - time.monotonic())
            except ssl.SSLWantWriteError:
                _, ready = _wait(tsock, False, True, deadline - time.monotonic())
            if not ready:
                raise UnavailableError(
                    f"connect to {target}: TLS handshake failed: no answer within {timeout:g} s")
    except OSError as e:  # ssl.SSLError included
        tsock.close()
        raise tls_handshake_error(target, e) from e
    except BaseException:
        tsock.close()
        raise


def connect_socket(target: str, timeout: float, tls: Optional[ssl.SSLContext] = None,
                   tls_server_name: Optional[str] = None) -> socket.socket:
    """A non-blocking TCP socket connected to ``target`` (TCP_NODELAY on), trying every address
    the name resolves to within ``timeout`` seconds each. Raises UnavailableError (unknown
    host, refused, unreachable, no answer in time) naming the target. With ``tls`` (a
    context): an ``ssl.SSLSocket`` after its handshake (:func:`tls_handshake`, within
    ``timeout`` more)."""
    host, port = split_host_port(target)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UnavailableError(f"connect to {target}: cannot resolve {host!r}: {e}") from None
    last = f"connect to {target}: no address"
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            rc = sock.connect_ex(addr)
            if rc in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
                _, w = _wait(sock, False, True, timeout)
                if not w:
                    raise TimeoutError(f"no answer within {timeout:g} s")
                rc = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if rc != 0:
                raise OSError(rc, os.strerror(rc))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            sock.close()
            why = e.strerror or str(e)
            last = f"connect to {target} ({addr[0]}:{addr[1]}): {why}"
            continue
        # The server answered: a failed handshake is its answer (no other address is tried).
        return tls_handshake(sock, tls, target, tls_server_name, timeout) if tls else sock
    raise UnavailableError(last)


class _Call:
    __slots__ = ("index", "id", "prep", "head", "attempts", "result", "done")

    def __init__(self, index: int, rid: int, prep: tensors.Prepared, head: serving_pb2.InferRequest):
        self.index = index
        self.id = rid
        self.prep = prep
        self.head = head
        self.attempts = 0  # times its frame was (started to be) sent
        self.result: Any = None
        self.done = False


def request_head(rid: int, prep: tensors.Prepared, layer: Optional[int],
                 deadline_ms: int, key: str = "",
                 traceparent: str = "") -> serving_pb2.InferRequest:
    """The InferRequest of one call, all but its data (sent from the input's own buffer);
    ``key``: the serving key, when the server requires one; ``traceparent``: a W3C trace
    context (the server's spans for the request become its children)."""
    head = serving_pb2.InferRequest(id=rid, dtype=prep.wire_dtype, shape=[prep.tokens, prep.hidden],
                                    deadline_ms=int(deadline_ms))
    if layer is not None:
        head.layer = int(layer)
    if key:
        head.key = key.encode("utf-8")
    if traceparent:
        head.traceparent = traceparent.encode("ascii")
    return head


def read_key_file(path: str) -> str:
    """The serving key in ``path``, read as the server reads its ``serving.key_file`` and as
    the control token is read (:func:`moerun.ctl.read_token_file`: the first line, blanks
    stripped; InvalidArgumentError if its group or others may read or write it, empty or
    unreadable)."""
    from moerun.ctl import read_token_file  # moerun.ctl imports this module
    try:
        return read_token_file(path)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"key_file: {e}") from None


def check_request_size(head: serving_pb2.InferRequest, prep: tensors.Prepared,
                       max_frame_bytes: int) -> None:
    """FrameTooLargeError, before anything is sent, for a request over max_frame_bytes."""
    _, size = _frame.infer_request_parts(head, _frame.byte_view(prep.payload))
    if size - _frame.HEADER_BYTES > max_frame_bytes:
        raise FrameTooLargeError(
            f"request {head.id}: a frame of {size - _frame.HEADER_BYTES} bytes is over "
            f"max_frame_bytes {max_frame_bytes} (not sent: its answer would be as large)",
            request_id=head.id)


class ClientOptions:
    """What the blocking and the asyncio client share: their options, checked, the targets and
    the server's timing of the last answer."""

    def __init__(self, targets: Union[str, Sequence[str]], *, timeout: float = 30.0,
                 connect_timeout: float = 5.0, max_frame_bytes: int = _frame.DEFAULT_MAX_FRAME_BYTES,
                 retries: int = 1, key: Optional[str] = None, key_file: Optional[str] = None,
                 tls: Union[None, bool, ssl.SSLContext] = None, tls_ca_file: Optional[str] = None,
                 tls_server_name: Optional[str] = None):
        self._targets = parse_targets(targets)
        if tls_server_name is not None and (not isinstance(tls_server_name, str) or
                                            not tls_server_name):
            raise InvalidArgumentError("tls_server_name must be a non-empty string")
        self._tls = tls_context(tls, tls_ca_file)
        if tls_server_name is not None and self._tls is None:
            raise InvalidArgumentError("tls_server_name needs tls (or tls_ca_file)")
        self._tls_server_name = tls_server_name
        if key is not None and key_file is not None:
            raise InvalidArgumentError("give key or key_file, not both")
        if key_file is not None:
            key = read_key_file(key_file)
        if key is not None and (not isinstance(key, str) or not key):
            raise InvalidArgumentError("key must be a non-empty string")
        self._key = key or ""
        if not timeout > 0 or not connect_timeout > 0:
            raise InvalidArgumentError("timeout and connect_timeout must be > 0 seconds")
        if not 0 < int(max_frame_bytes) <= _frame.MAX_WIRE_FRAME:
            raise InvalidArgumentError(f"max_frame_bytes must be in 1..{_frame.MAX_WIRE_FRAME}")
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.max_frame_bytes = int(max_frame_bytes)
        self.retries = max(0, int(retries))
        self._current = 0
        self._next_id = 1
        self._closed = False
        self._last_timing: Optional[Timing] = None
        self.failovers = 0  # moves to another target
        self.retried = 0    # requests sent again

    @property
    def targets(self) -> List[str]:
        """The router addresses, in the order they are tried."""
        return list(self._targets)

    @property
    def target(self) -> str:
        """The router requests go to now (connected or next to be tried)."""
        return self._targets[self._current]

    @property
    def last_timing(self) -> Optional[Timing]:
        """The server's :class:`Timing` (queue_us, compute_us) of the last answer received
        (``None`` before the first)."""
        return self._last_timing


class _Conn:
    """One connection: what is being sent (``out``: [call, parts, started]), what is in
    flight, and ids whose answers are to be dropped (the call that sent them gave up)."""

    def __init__(self, sock: socket.socket, target: str, max_frame_bytes: int):
        self.sock = sock
        self.target = target
        self.reader = _frame.FrameReader(max_frame_bytes, True, target)
        self.out: deque = deque()
        self.inflight: Dict[int, _Call] = {}
        self.abandoned: set = set()
        self.retiring = False  # no new requests: move to the next target once drained
        self.send_failed = False  # a send broke: read what the server said, then fail over
        self.broken: Optional[str] = None
        self.write_wants_read = False  # TLS: the last write must read first (renegotiation)

    @property
    def partial(self) -> bool:
        return bool(self.out) and self.out[0][2]

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:  # pragma: no cover
            pass


class _Lost(Exception):
    """The connection broke (refused, reset, closed): failover material."""


class Client(ClientOptions):
    """A blocking client of one job's routers (see the module's documentation).

    ``targets``: ``"HOST:PORT"``, ``"HOST:PORT,HOST:PORT"`` or a list: several routers of one
    job (router *i* listens on the serving port + *i*), tried in turn. ``timeout``: seconds a
    call may take in all (connecting, sending, waiting, failing over). ``connect_timeout``:
    seconds per connection attempt. ``max_frame_bytes``: the largest frame accepted from the
    server, and sent (64 MiB, the server's default). ``retries``: times one request is sent
    again after its connection broke or its router answered UNAVAILABLE. ``key`` (or
    ``key_file``, read as the server reads its ``serving.key_file``: chmod 600): the serving
    key sent in every request, for a job that requires one (without it, or with a wrong one,
    every call raises :class:`~moerun.errors.UnauthenticatedError`). ``tls_ca_file`` (implies
    ``tls=True``; ``tls=True`` alone: the system's CA store; or ``tls=`` an ``ssl.SSLContext``)
    and ``tls_server_name``: TLS, for a job with ``serving.tls`` (see the module's
    documentation). The connection is made by the first call (or :meth:`connect`).
    """

    def __init__(self, targets: Union[str, Sequence[str]], **options):
        super().__init__(targets, **options)
        self._conn: Optional[_Conn] = None
        self._busy = threading.Lock()

    # --- public ------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether a connection is open."""
        return self._conn is not None

    def connect(self, timeout: Optional[float] = None) -> "Client":
        """Connects now (else the first call does) to the current target or, failing that,
        the next ones in turn. Raises UnavailableError naming every target tried."""
        with self._enter():
            if self._conn is None:
                self._open(time.monotonic() + (self.timeout if timeout is None else timeout))
        return self

    def infer(self, x: Any, *, layer: Optional[int] = None, dtype: Optional[str] = None,
              deadline_ms: int = 0, timeout: Optional[float] = None,
              traceparent: str = "") -> Any:
        """The MoE layer's output for ``x`` (numpy array or torch tensor ``[..., hidden]``,
        float32 or bfloat16; see :mod:`moerun.tensors`): same kind, dtype and shape as ``x``.

        ``layer``: the model layer (default: the server's first served layer). ``dtype``:
        ``"bf16"`` or ``"f32"`` to send in that type (converted, and the answer converted back).
        ``deadline_ms``: the server's deadline for this request from its receipt (0: the
        server's default). ``timeout``: seconds this call may take (default: the client's).
        ``traceparent``: a W3C trace context ("00-<32 hex>-<16 hex>-<2 hex>"): a server with
        tracing on makes its spans for the request children of that span, and exports them when
        its flags say sampled (see docs/operator-guide.md, "Traces").

        Raises: InvalidArgumentError (bad input: the server's message, e.g. a wrong hidden size
        or NaN), DeadlineExceededError, OverloadedError, UnavailableError (no router reachable,
        or unavailable after the retries), FrameTooLargeError, MalformedFrameError, ...
        """
        return self.infer_many([x], layer=layer, dtype=dtype, deadline_ms=deadline_ms,
                               timeout=timeout, traceparent=traceparent)[0]

    def infer_many(self, xs: Sequence[Any], *, layer: Optional[int] = None,
                   dtype: Optional[str] = None, deadline_ms: int = 0,
                   timeout: Optional[float] = None, traceparent: str = "") -> List[Any]:
        """The outputs for several inputs, in their order: all are sent at once on one
        connection (pipelined, while answers are being read) and the answers matched by id,
        whatever order they come in. The options are :meth:`infer`'s; ``timeout`` bounds the
        whole call. The first error raises (the other answers are then dropped)."""
        xs = list(xs)
        if not xs:
            return []
        wait = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + wait
        calls = []
        for i, x in enumerate(xs):
            prep = tensors.prepare(x, dtype)
            calls.append(_Call(i, 0, prep, request_head(0, prep, layer, deadline_ms, self._key,
                                                        traceparent)))
        with self._enter():
            for c in calls:
                c.id = self._next_id
                self._next_id += 1
                c.head.id = c.id
                check_request_size(c.head, c.prep, self.max_frame_bytes)
            self._run(calls, deadline, wait)
        return [c.result for c in calls]

    def close(self) -> None:
        """Closes the connection (a later call reconnects)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"Client({','.join(self._targets)!r}, connected={self.connected})"

    # --- internals ---------------------------------------------------------------------------

    class _Guard:
        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            if not self.lock.acquire(blocking=False):
                raise RuntimeError("moerun.Client is used by one call at a time: use one Client "
                                   "per thread (or moerun.AsyncClient)")

        def __exit__(self, *exc):
            self.lock.release()

    def _enter(self):
        return Client._Guard(self._busy)

    def _advance(self) -> None:
        if len(self._targets) > 1:
            self._current = (self._current + 1) % len(self._targets)
            self.failovers += 1

    def _open(self, deadline: float) -> _Conn:
        """Connects to the current target, else the next ones, each tried once."""
        tried, last = [], None
        n = len(self._targets)
        for k in range(n):
            if k:
                self._advance()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            t = self._targets[self._current]
            tried.append(t)
            try:
                sock = connect_socket(t, min(self.connect_timeout, left), self._tls,
                                      self._tls_server_name)
            except UnavailableError as e:
                last = e
                continue
            self._conn = _Conn(sock, t, self.max_frame_bytes)
            return self._conn
        if last is None:
            raise DeadlineExceededError(f"no connection to {', '.join(self._targets)} in time")
        if n == 1:
            raise UnavailableError(last.message) from last.__cause__
        raise UnavailableError(
            f"no router answers (tried {', '.join(tried)}): {last.message}") from last.__cause__

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _run(self, calls: List[_Call], deadline: float, wait: float) -> None:
        queue = deque(calls)
        left = len(calls)
        ok = False
        try:
            while left:
                conn = self._conn
                if conn is not None and conn.retiring and not conn.inflight and not conn.out:
                    self._drop()
                    self._advance()
                    conn = None
                if conn is None:
                    conn = self._open(deadline)
                if queue and not conn.retiring:
                    for c in queue:
                        parts, _ = _frame.infer_request_parts(
                            c.head, _frame.byte_view(c.prep.payload))
                        conn.out.append([c, parts, False])
                    queue.clear()
                try:
                    if conn.out:
                        self._flush(conn)
                    if left and self._pump(conn, queue, deadline):
                        left = sum(1 for c in calls if not c.done)
                except _Lost as e:
                    self._failover(conn, queue, str(e))
                    continue
                if left and time.monotonic() >= deadline:
                    pending = [c.id for c in calls if not c.done]
                    self._drop()  # a late answer must not be taken for another's
                    raise DeadlineExceededError(
                        f"{conn.target}: no answer within {wait:g} s (request(s) "
                        f"{', '.join(map(str, pending[:8]))}{' ...' if len(pending) > 8 else ''})")
            ok = True
        finally:
            if not ok:
                self._give_up()

    def _give_up(self) -> None:
        """After an error or a timeout: answers still due on the connection are dropped."""
        conn = self._conn
        if conn is None:
            return
        if conn.partial or conn.broken or conn.send_failed:
            self._drop()  # out of step with the server
            return
        # Keep the connection; the answers still due are dropped when they come.
        conn.abandoned.update(conn.inflight)
        conn.inflight.clear()
        conn.out.clear()
        if len(conn.abandoned) > 4096:
            self._drop()

    def _flush(self, conn: _Conn) -> None:
        """Sends what it can without waiting."""
        while conn.out and not conn.send_failed:
            item = conn.out[0]
            call, parts = item[0], item[1]
            try:
                rest = _frame.send_some(conn.sock, parts)
            except BlockingIOError as e:
                if isinstance(e, _frame.TlsWouldBlock):
                    conn.write_wants_read = e.want_read
                    if not item[2]:
                        # OpenSSL may have put some of it on the wire: it counts as sent.
                        item[2] = True
                        call.attempts += 1
                        if call.attempts > 1:
                            self.retried += 1
                return
            except OSError:
                # The server closed: it may have said why first (FRAME_TOO_LARGE, too many
                # connections) or answered requests in flight. _pump reads on until the end.
                conn.send_failed = True
                if not item[2]:  # counted as sent: a server that always resets runs it out
                    item[2] = True
                    call.attempts += 1
                return
            if not item[2]:  # its first bytes are out: it counts as sent
                item[2] = True
                call.attempts += 1
                if call.attempts > 1:
                    self.retried += 1
            if rest:
                item[1] = rest
                continue
            conn.out.popleft()
            conn.inflight[call.id] = call

    def _pump(self, conn: _Conn, queue: deque, deadline: float) -> bool:
        """Waits (bounded by deadline) for answers or room to send; handles what comes.
        True when a call finished."""
        r, w = _wait(conn.sock, True, bool(conn.out) and not conn.send_failed and
                     not conn.write_wants_read, deadline - time.monotonic())
        done = False
        if r:
            w = w or conn.write_wants_read  # what the write waited for has come
            conn.write_wants_read = False
            for _ in range(_READ_SPIN):
                buf = conn.reader.get_buffer()
                try:
                    n = _frame.recv_some(conn.sock, buf)
                except BlockingIOError:
                    break
                except OSError as e:
                    conn.broken = f"connection closed by the server ({e.strerror or e})"
                    raise _Lost(conn.broken) from None
                if n == 0:
                    part = conn.reader.buffered
                    conn.broken = "connection closed by the server" + (
                        f" in the middle of a frame ({part} bytes of it received)" if part else "")
                    raise _Lost(conn.broken)
                try:
                    frames = conn.reader.update(n)
                except FrameTooLargeError:
                    conn.broken = "a frame over the limit"  # the stream is lost
                    raise
                for f in frames:
                    done = self._answer(conn, f, queue) or done
                if n < len(buf):
                    break
        if w and conn.out:
            self._flush(conn)
        return done

    def _answer(self, conn: _Conn, frame: _frame.Frame, queue: deque) -> bool:
        resp = serving_pb2.InferResponse()
        data = _frame.parse_infer_response(frame, resp)
        call = conn.inflight.pop(resp.id, None)
        if call is None:
            if resp.id in conn.abandoned:
                conn.abandoned.discard(resp.id)
                return False
            conn.broken = "answer without a request"
            if resp.code != _OK:  # about the connection (id 0): malformed, too large, ...
                raise error_from_code(resp.code, resp.message)
            raise MalformedFrameError(
                f"{conn.target}: an answer for id {resp.id}, which no request in flight has")
        if resp.code == _OK:
            call.result = call.prep.restore(data, resp.dtype, resp.shape)
            call.done = True
            self._last_timing = Timing(resp.queue_us, resp.compute_us)
            return True
        if (resp.code == _UNAVAILABLE and len(self._targets) > 1 and
                call.attempts <= self.retries):
            # This router cannot serve it (draining, a rank not answering): the next one may.
            self._retire(conn, queue)
            queue.append(call)
            return False
        raise error_from_code(resp.code, resp.message, request_id=resp.id)

    def _retire(self, conn: _Conn, queue: deque) -> None:
        conn.retiring = True
        keep = deque()
        for item in conn.out:
            if item[2]:
                keep.append(item)  # being sent: finish it
            else:
                queue.append(item[0])
        conn.out = keep

    def _failover(self, conn: _Conn, queue: deque, why: str) -> None:
        """The connection broke: requests sent on it go again (up to retries) elsewhere."""
        again = list(conn.inflight.values()) + [item[0] for item in conn.out]
        self._drop()
        self._advance()
        for c in sorted(again, key=lambda c: c.index):
            if c.attempts > self.retries:
                raise UnavailableError(
                    f"{conn.target}: {why} (request {c.id} sent {c.attempts} time(s))",
                    request_id=c.id)
            queue.append(c)
