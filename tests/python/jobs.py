"""Test helpers: a `moerun serve` job started for a test (ServeJob: the package's
moerun.job.LocalJob), a scripted TCP server (FakeServer) for the client's error paths, and
`moerun forward` as the reference.

    with ServeJob("tests/data/hf-moe/qwen3_moe", ranks=4, routers=2) as job:
        with moerun.Client(job.targets) as c:
            y = c.infer(x)
"""

import os
import socket
import subprocess
import sys
import threading
from typing import Callable, List, Optional

import numpy as np

from moerun.job import LocalJob as ServeJob  # noqa: F401  (re-exported for the tests)
from moerun.job import find_binary, free_port, pick_port_block  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "data", "hf-moe")
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def binary(name: str) -> str:
    """The moerun binary NAME the tests run (moerun.job.find_binary)."""
    return find_binary(name)


def fixture(name: str) -> str:
    """The folder of a shipped fixture, tests/data/hf-moe/NAME."""
    return os.path.join(FIXTURES, name)


def bits(a) -> np.ndarray:
    """The raw bits of a float32 array (bitwise comparisons, NaN included)."""
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


# --- the reference ----------------------------------------------------------------------------

def forward(model: str, x: np.ndarray, work: str) -> np.ndarray:
    """`moerun forward --model MODEL` of x [T, H] float32 (bitwise what every rank layout and
    batching gives)."""
    import safetensors_io

    inp, out = os.path.join(work, "forward-in.safetensors"), os.path.join(work, "forward-out.safetensors")
    safetensors_io.write_tensors(inp, {"input": np.ascontiguousarray(x, np.float32)})
    r = subprocess.run([binary("moerun"), "forward", "--model", model, "--input", inp,
                        "--output", out, "--threads", "1"], capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"moerun forward failed ({r.returncode}): {r.stderr[-2000:]}")
    return safetensors_io.read_tensors(out)["output"]


# --- a scripted server -----------------------------------------------------------------------

def recv_frame(conn: socket.socket) -> Optional[bytes]:
    """One frame's body from a blocking socket (None at the end of the stream)."""
    head = _recv_exact(conn, 4)
    if head is None:
        return None
    n = int.from_bytes(head, "big")
    return _recv_exact(conn, n)


def _recv_exact(conn: socket.socket, n: int) -> Optional[bytes]:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = conn.recv(min(n - len(buf), 1 << 20))
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def send_frame(conn: socket.socket, body: bytes) -> None:
    conn.sendall(len(body).to_bytes(4, "big") + body)


def answer_every_request(code: int, message: str) -> Callable[[socket.socket], None]:
    """A FakeServer handler that answers each request on its connection with the error
    `code` (a moerun.v1 ErrorCode) and `message`, until the client closes."""
    from moerun.v1 import serving_pb2

    def handler(conn: socket.socket) -> None:
        while True:
            body = recv_frame(conn)
            if body is None:
                return
            req = serving_pb2.InferRequest.FromString(body)
            send_frame(conn, serving_pb2.InferResponse(id=req.id, code=code,
                                                       message=message).SerializeToString())

    return handler


class FakeServer:
    """A TCP server on 127.0.0.1 whose connections are each handled by ``handler(conn)`` in a
    thread of their own (blocking socket). ``address``: "127.0.0.1:PORT"; ``connections``:
    how many were accepted. Closes everything on exit."""

    def __init__(self, handler: Callable[[socket.socket], None]):
        self.handler = handler
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._conns: List[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self.connections += 1
            self._conns.append(conn)
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self.handler(conn)
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self._thread.join(2)

    def __enter__(self) -> "FakeServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
