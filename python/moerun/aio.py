"""An asyncio client of the serving protocol: many concurrent requests on one connection.

::

    import asyncio, moerun

    async def main(xs):
        async with moerun.AsyncClient("127.0.0.1:5700") as c:
            return await asyncio.gather(*(c.infer(x) for x in xs))   # one connection

Each :meth:`AsyncClient.infer` sends its frame (frames are written whole, one at a time, under a
lock; the tensor's bytes by ``sendmsg`` without a copy) and waits for the answer with its id: a
reader task reads the connection (``recv_into``, no copy of the answer's data) and completes
the waiting calls, whatever order the answers come in. Options, inputs, outputs, errors and
failover are those of :class:`moerun.client.Client`: a broken connection or an UNAVAILABLE
answer moves every call on it to the next target and sends it there once more (``retries``);
the server's other errors are raised and not retried (OVERLOADED: retry later, the caller's
choice). Every wait is bounded by the call's ``timeout`` (``asyncio.wait_for``). A call
cancelled or timed out while its frame was half sent closes the connection (the stream would be
out of step); the other calls on it then fail over like after a broken connection.

TLS: ``tls``, ``tls_ca_file`` and ``tls_server_name`` as :class:`moerun.client.Client` (the
handshake within ``connect_timeout``; the same verification and errors). Over TLS the reader
and the writers use the ``ssl.SSLSocket`` directly, waiting with ``add_reader``/``add_writer``.

Needs an event loop with ``add_reader``/``add_writer`` (the default selector loop on Linux and
macOS, uvloop). Not thread-safe: use a client from the loop's thread only.
"""

import asyncio
import socket
import ssl
import time
from typing import Any, Dict, List, Optional, Sequence, Union

from moerun import _frame, tensors
from moerun.client import (
    ClientOptions,
    Timing,
    check_request_size,
    request_head,
    split_host_port,
    tls_handshake_error,
    wrap_tls,
)
from moerun.errors import (
    DeadlineExceededError,
    MoerunError,
    UnavailableError,
    error_from_code,
)
from moerun.v1 import serving_pb2

__all__ = ["AsyncClient"]

_OK = 0
_UNAVAILABLE = 4
_TLS_STEP = 0.005  # seconds: a TLS read that must write first (or a write that must read) waits


async def _fd_ready(loop, fd: int, write: bool) -> None:
    """Until fd is writable (write) or readable."""
    fut = loop.create_future()

    def ready():
        if not fut.done():
            fut.set_result(None)

    (loop.add_writer if write else loop.add_reader)(fd, ready)
    try:
        await fut
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


class _Lost(Exception):
    """The connection broke: failover material."""


class _AConn:
    """One connection: a reader task completing ``pending`` futures by id; writes under a
    lock."""

    def __init__(self, loop, sock: socket.socket, target: str, max_frame_bytes: int):
        self.loop = loop
        self.sock = sock
        self.fd = sock.fileno()
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.target = target
        self.reader = _frame.FrameReader(max_frame_bytes, True, target)
        self.pending: Dict[int, asyncio.Future] = {}
        self.lock = asyncio.Lock()
        self.error: Optional[BaseException] = None
        self.retiring = False
        self.send_broken = False
        self.task = loop.create_task(self._read_loop())

    @property
    def dead(self) -> bool:
        return self.error is not None

    async def _read_loop(self) -> None:
        try:
            while True:
                buf = self.reader.get_buffer()
                n = await self._recv_into(buf)
                if n == 0:
                    part = self.reader.buffered
                    raise _Lost("connection closed by the server" + (
                        f" in the middle of a frame ({part} bytes of it received)" if part else ""))
                for f in self.reader.update(n):
                    self._dispatch(f)
                if self.retiring and not self.pending:
                    self.fail(UnavailableError(f"{self.target}: retired"))
                    return
        except asyncio.CancelledError:
            self.fail(UnavailableError(f"{self.target}: connection closed by the client"),
                      from_task=True)
            raise
        except OSError as e:
            self.fail(_Lost(f"connection closed by the server ({e.strerror or e})"),
                      from_task=True)
        except _Lost as e:
            self.fail(e, from_task=True)
        except MoerunError as e:  # a frame too large, malformed, an error about the connection
            self.fail(e, from_task=True)
        except Exception as e:  # pragma: no cover (a bug): never leave calls waiting
            self.fail(UnavailableError(f"{self.target}: reader failed: {e!r}"), from_task=True)

    async def _recv_into(self, buf) -> int:
        if not self.tls:
            return await self.loop.sock_recv_into(self.sock, buf)
        while True:
            try:
                return self.sock.recv_into(buf)  # what OpenSSL holds comes first
            except ssl.SSLWantReadError:
                await _fd_ready(self.loop, self.fd, False)
            except ssl.SSLWantWriteError:
                # The fd's writer slot may be a sender's: wait a little instead (rare: OpenSSL
                # writes while reading only for a key update or a renegotiation).
                await asyncio.sleep(_TLS_STEP)

    def _dispatch(self, frame: _frame.Frame) -> None:
        resp = serving_pb2.InferResponse()
        data = _frame.parse_infer_response(frame, resp)
        fut = self.pending.pop(resp.id, None)
        if fut is None:
            if resp.code != _OK and resp.id == 0:  # about the connection: it is closed next
                raise error_from_code(resp.code, resp.message)
            return  # a late answer to a call that gave up
        if not fut.done():
            fut.set_result((resp, data))

    def fail(self, exc: BaseException, from_task: bool = False) -> None:
        """Ends the connection: every pending call gets ``exc``."""
        if self.error is None:
            self.error = exc
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)
        if not from_task and not self.task.done():
            self.task.cancel()  # removes its reader before the socket is closed
            self.task.add_done_callback(lambda _t: self._close_sock())
        else:
            self._close_sock()

    def _close_sock(self) -> None:
        try:
            self.sock.close()
        except OSError:  # pragma: no cover
            pass

    def forget(self, rid: int) -> None:
        self.pending.pop(rid, None)
        if self.retiring and not self.pending and not self.dead:
            self.fail(UnavailableError(f"{self.target}: retired"))

    async def send(self, parts: List) -> None:
        """Writes one frame whole. Raises _Lost when the connection broke; cancelled with the
        frame half written, it closes the connection."""
        async with self.lock:
            if self.error is not None:
                raise self.error if isinstance(self.error, _Lost) else _Lost(str(self.error))
            if self.send_broken:
                return  # the reader will end the call
            started = False
            try:
                while parts:
                    try:
                        parts = _frame.send_some(self.sock, parts)
                        started = True
                        continue
                    except _frame.TlsWouldBlock as e:
                        started = True  # OpenSSL may have some of it on the wire
                        if e.want_read:  # the reader task reads; try again soon
                            await asyncio.sleep(_TLS_STEP)
                            continue
                    except BlockingIOError:
                        pass
                    except OSError:
                        # The server closed; it may have said why first (FRAME_TOO_LARGE, too
                        # many connections). The reader reads on to the end and completes the
                        # pending calls: with their answers, or _Lost.
                        self.send_broken = True
                        return
                    await self._writable()
            except asyncio.CancelledError:
                if started and parts:
                    self.fail(_Lost(f"{self.target}: a request was cancelled half sent"))
                raise

    async def _writable(self) -> None:
        await _fd_ready(self.loop, self.fd, True)

    def close(self) -> None:
        self.fail(UnavailableError(f"{self.target}: the client was closed with the call pending"))


class AsyncClient(ClientOptions):
    """An asyncio client of one job's routers: :meth:`infer` may be awaited by many tasks at
    once on its one connection. Options as :class:`moerun.client.Client`: ``targets``
    (``"HOST:PORT"``, a comma list or a list: routers of one job, tried in turn),
    ``timeout`` (seconds per call, in all), ``connect_timeout`` (per connection attempt),
    ``max_frame_bytes`` (largest frame accepted or sent), ``retries`` (times a call is sent
    again after its connection broke or its router answered UNAVAILABLE), ``key``/``key_file``,
    ``tls``/``tls_ca_file``/``tls_server_name`` (TLS, for a job with ``serving.tls``).

    Create with ``await AsyncClient.connect(targets, ...)`` or ``async with
    AsyncClient(targets) as c``; a plain ``AsyncClient(targets)`` connects on its first call.
    """

    def __init__(self, targets: Union[str, Sequence[str]], **options):
        super().__init__(targets, **options)
        self._conn: Optional[_AConn] = None
        self._connecting: Optional[asyncio.Lock] = None
        self._retired: List[_AConn] = []

    # --- public ------------------------------------------------------------------------------

    @classmethod
    async def connect(cls, targets: Union[str, Sequence[str]], **options) -> "AsyncClient":
        """A client connected now (UnavailableError naming the targets when none answers);
        ``options`` as the constructor's."""
        c = cls(targets, **options)
        await c._get_conn(time.monotonic() + c.timeout)
        return c

    async def __aenter__(self) -> "AsyncClient":
        await self._get_conn(time.monotonic() + self.timeout)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        """Whether a connection is open."""
        return self._conn is not None and not self._conn.dead

    async def infer(self, x: Any, *, layer: Optional[int] = None, dtype: Optional[str] = None,
                    deadline_ms: int = 0, timeout: Optional[float] = None,
                    traceparent: str = "") -> Any:
        """The MoE layer's output for ``x``; arguments, result and errors as
        :meth:`moerun.client.Client.infer`. Safe to await from many tasks at once."""
        prep = tensors.prepare(x, dtype)
        wait = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + wait
        rid = self._next_id
        self._next_id += 1
        head = request_head(rid, prep, layer, deadline_ms, self._key, traceparent)
        check_request_size(head, prep, self.max_frame_bytes)
        data = _frame.byte_view(prep.payload)
        attempts = 0
        while True:
            if self._closed:
                raise UnavailableError("the client is closed")
            conn = await self._get_conn(deadline)
            fut = conn.loop.create_future()
            conn.pending[rid] = fut
            attempts += 1
            if attempts > 1:
                self.retried += 1
            try:
                parts, _ = _frame.infer_request_parts(head, data)
                resp, out = await asyncio.wait_for(self._exchange(conn, parts, fut),
                                                   max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                conn.forget(rid)
                raise DeadlineExceededError(
                    f"{conn.target}: no answer within {wait:g} s (request {rid})",
                    request_id=rid) from None
            except _Lost as e:
                conn.forget(rid)
                self._lost(conn)
                if self._closed:
                    raise UnavailableError("the client was closed with the call pending") from None
                if attempts > self.retries or time.monotonic() >= deadline:
                    raise UnavailableError(f"{conn.target}: {e} (request {rid} sent {attempts} "
                                           f"time(s))", request_id=rid) from None
                continue
            except asyncio.CancelledError:
                conn.forget(rid)
                raise
            if resp.code == _OK:
                self._last_timing = Timing(resp.queue_us, resp.compute_us)
                return prep.restore(out, resp.dtype, resp.shape)
            if resp.code == _UNAVAILABLE and len(self._targets) > 1 and attempts <= self.retries:
                self._retire(conn)
                continue
            raise error_from_code(resp.code, resp.message, request_id=resp.id)

    async def infer_many(self, xs: Sequence[Any], *, layer: Optional[int] = None,
                         dtype: Optional[str] = None, deadline_ms: int = 0,
                         timeout: Optional[float] = None, traceparent: str = "") -> List[Any]:
        """:meth:`infer` of every input at once (concurrently, on the one connection; each
        call bounded by ``timeout``); the outputs in the inputs' order. The first error raises
        and cancels the other calls."""
        tasks = [asyncio.ensure_future(self.infer(x, layer=layer, dtype=dtype,
                                                  deadline_ms=deadline_ms, timeout=timeout,
                                                  traceparent=traceparent))
                 for x in xs]
        if not tasks:
            return []
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()

    async def close(self) -> None:
        """Closes the connection; calls still pending raise UnavailableError. The client cannot
        be used afterwards."""
        self._closed = True
        conns = ([self._conn] if self._conn is not None else []) + self._retired
        self._conn = None
        self._retired = []
        for c in conns:
            c.close()
        for c in conns:
            try:
                await c.task
            except (asyncio.CancelledError, Exception):
                pass

    def __repr__(self) -> str:
        return f"AsyncClient({','.join(self._targets)!r}, connected={self.connected})"

    # --- internals ---------------------------------------------------------------------------

    async def _exchange(self, conn: _AConn, parts: List, fut: asyncio.Future):
        await conn.send(parts)
        return await fut

    def _advance(self) -> None:
        if len(self._targets) > 1:
            self._current = (self._current + 1) % len(self._targets)
            self.failovers += 1

    def _lost(self, conn: _AConn) -> None:
        if self._conn is conn:
            self._conn = None
            self._advance()

    def _retire(self, conn: _AConn) -> None:
        """This router answered UNAVAILABLE: new calls go to the next one; the connection ends
        once its pending calls are answered."""
        if self._conn is conn:
            self._conn = None
            self._advance()
            conn.retiring = True
            if not conn.pending:
                conn.fail(UnavailableError(f"{conn.target}: retired"))
            else:
                self._retired.append(conn)
        self._retired = [c for c in self._retired if not c.dead]

    async def _get_conn(self, deadline: float) -> _AConn:
        conn = self._conn
        if conn is not None and not conn.dead:
            return conn
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            conn = self._conn
            if conn is not None and not conn.dead:
                return conn
            if conn is not None:  # broke with no call noticing yet
                self._conn = None
                self._advance()
            if self._closed:
                raise UnavailableError("the client is closed")
            self._conn = await self._open(deadline)
            return self._conn

    async def _open(self, deadline: float) -> _AConn:
        loop = asyncio.get_running_loop()
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
                sock = await _connect(loop, t, min(self.connect_timeout, left), self._tls,
                                      self._tls_server_name)
            except UnavailableError as e:
                last = e
                continue
            return _AConn(loop, sock, t, self.max_frame_bytes)
        if last is None:
            raise DeadlineExceededError(f"no connection to {', '.join(self._targets)} in time")
        if n == 1:
            raise UnavailableError(last.message) from last.__cause__
        raise UnavailableError(
            f"no router answers (tried {', '.join(tried)}): {last.message}") from last.__cause__


async def _tls_handshake(loop, sock: socket.socket, context: ssl.SSLContext, target: str,
                         server_name: Optional[str], timeout: float) -> ssl.SSLSocket:
    """moerun.client.tls_handshake on the event loop."""
    tsock = wrap_tls(sock, context, target, server_name)
    fd = tsock.fileno()

    async def run():
        while True:
            try:
                tsock.do_handshake()
                return
            except ssl.SSLWantReadError:
                await _fd_ready(loop, fd, False)
            except ssl.SSLWantWriteError:
                await _fd_ready(loop, fd, True)

    try:
        await asyncio.wait_for(run(), timeout)
        return tsock
    except asyncio.TimeoutError:
        tsock.close()
        raise UnavailableError(f"connect to {target}: TLS handshake failed: no answer within "
                               f"{timeout:g} s") from None
    except OSError as e:  # ssl.SSLError included
        tsock.close()
        raise tls_handshake_error(target, e) from e
    except BaseException:
        tsock.close()
        raise


async def _connect(loop, target: str, timeout: float, tls: Optional[ssl.SSLContext] = None,
                   tls_server_name: Optional[str] = None) -> socket.socket:
    host, port = split_host_port(target)
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout)
    except (socket.gaierror, asyncio.TimeoutError) as e:
        raise UnavailableError(f"connect to {target}: cannot resolve {host!r}: {e}") from None
    last = f"connect to {target}: no address"
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, addr), timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except asyncio.TimeoutError:
            sock.close()
            last = f"connect to {target} ({addr[0]}:{addr[1]}): no answer within {timeout:g} s"
            continue
        except OSError as e:
            sock.close()
            last = f"connect to {target} ({addr[0]}:{addr[1]}): {e.strerror or e}"
            continue
        if tls is None:
            return sock
        # The server answered: a failed handshake is its answer (no other address is tried).
        return await _tls_handshake(loop, sock, tls, target, tls_server_name, timeout)
    raise UnavailableError(last)
