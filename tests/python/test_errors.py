"""The client's errors: each server error code as its exception with the server's message, a dead
server, a silent one, failover between targets, frames over the limit. Nothing may hang: every
case is bounded by the client's timeout."""

import pickle
import socket
import time

import numpy as np
import pytest

pytest.importorskip("moerun.v1.serving_pb2", reason="the generated protobuf classes (build moerun; "
                    "PYTHONPATH=python:build/python)")

import moerun  # noqa: E402
from moerun import errors
from moerun.v1 import serving_pb2

from conftest import SERVER_MAX_FRAME
from jobs import FakeServer, answer_every_request, bits, free_port, recv_frame, send_frame


# --- the error classes --------------------------------------------------------------------------

def test_error_from_code_and_builtins():
    cases = {
        1: (moerun.InvalidArgumentError, ValueError),
        2: (moerun.DeadlineExceededError, TimeoutError),
        3: (moerun.OverloadedError, moerun.MoerunError),
        4: (moerun.UnavailableError, ConnectionError),
        5: (moerun.FrameTooLargeError, moerun.MoerunError),
        6: (moerun.MalformedFrameError, moerun.MoerunError),
        7: (moerun.FrameTimeoutError, TimeoutError),
        8: (moerun.UnauthenticatedError, PermissionError),
        9: (moerun.InternalError, moerun.MoerunError),
    }
    for code, (cls, builtin) in cases.items():
        e = errors.error_from_code(code, "why")
        assert type(e) is cls and isinstance(e, builtin) and isinstance(e, moerun.MoerunError)
        assert e.code == serving_pb2.ErrorCode.Name(code) and e.message == "why" and e.from_server
        assert str(e) == f"server: {e.code.lower()}: why"
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is cls and back.message == "why" and str(back) == str(e)
    odd = errors.error_from_code(42, "new")
    assert type(odd) is moerun.MoerunError and odd.code == "CODE_42"
    assert str(errors.error_from_code(3, "")) == "server: overloaded"
    with pytest.raises(ValueError):
        errors.error_from_code(0, "")
    local = moerun.UnavailableError("connect to x:1: refused")
    assert str(local) == "connect to x:1: refused" and not local.from_server


# --- no server, a silent server, a broken one -----------------------------------------------------

def test_dead_server_is_unavailable_at_once():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(moerun.UnavailableError) as ei:
        moerun.Client(f"127.0.0.1:{port}", timeout=20).infer(np.zeros((1, 4), np.float32))
    assert time.monotonic() - t0 < 2
    assert f"127.0.0.1:{port}" in str(ei.value) and not ei.value.from_server
    a, b = free_port(), free_port()
    with pytest.raises(moerun.UnavailableError, match=f"tried 127.0.0.1:{a}, 127.0.0.1:{b}"):
        moerun.Client([f"127.0.0.1:{a}", f"127.0.0.1:{b}"]).infer(np.zeros((1, 4), np.float32))


def _silent(conn):
    while recv_frame(conn) is not None:
        pass


def test_silent_server_times_out():
    x = np.zeros((2, 8), np.float32)
    with FakeServer(_silent) as srv:
        c = moerun.Client(srv.address, timeout=0.8)
        t0 = time.monotonic()
        with pytest.raises(moerun.DeadlineExceededError) as ei:
            c.infer(x)
        took = time.monotonic() - t0
        assert 0.75 <= took < 2.0, took
        assert not ei.value.from_server and srv.address in str(ei.value)
        assert not c.connected  # dropped: a late answer cannot be taken for another's
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):  # per-call timeout, pipelined calls too
            c.infer_many([x, x, x], timeout=0.3)
        assert time.monotonic() - t0 < 1.5


def test_garbage_from_the_server_is_malformed():
    def garbage(conn):
        recv_frame(conn)
        send_frame(conn, b"\xff\xff\xff")
        recv_frame(conn)

    with FakeServer(garbage) as srv, moerun.Client(srv.address, timeout=5) as c:
        with pytest.raises(moerun.MalformedFrameError):
            c.infer(np.zeros((1, 4), np.float32))


def test_answer_of_the_wrong_shape_is_malformed():
    def wrong(conn):
        while True:
            body = recv_frame(conn)
            if body is None:
                return
            req = serving_pb2.InferRequest.FromString(body)
            send_frame(conn, serving_pb2.InferResponse(id=req.id, dtype=req.dtype, shape=[1, 2],
                                                       data=b"\0" * 8).SerializeToString())

    with FakeServer(wrong) as srv, moerun.Client(srv.address, timeout=5) as c:
        with pytest.raises(moerun.MalformedFrameError, match="shape"):
            c.infer(np.zeros((3, 4), np.float32))


def test_frame_over_the_limit_is_refused_before_its_body():
    def huge(conn):
        recv_frame(conn)
        conn.sendall((100 << 20).to_bytes(4, "big") + b"\0" * 1000)  # 100 MiB announced
        time.sleep(5)

    with FakeServer(huge) as srv, moerun.Client(srv.address, timeout=10) as c:
        t0 = time.monotonic()
        with pytest.raises(moerun.FrameTooLargeError, match="104857600 bytes is over the limit"):
            c.infer(np.zeros((1, 4), np.float32))
        assert time.monotonic() - t0 < 2
        assert not c.connected


def test_request_over_the_clients_limit_is_not_sent():
    port = free_port()
    c = moerun.Client(f"127.0.0.1:{port}", max_frame_bytes=1 << 16)
    with pytest.raises(moerun.FrameTooLargeError, match="max_frame_bytes 65536"):
        c.infer(np.zeros((300, 64), np.float32))  # 76800 bytes


# --- the server's own errors --------------------------------------------------------------------

def test_wrong_hidden_size(client, reference):
    x, want = reference
    with pytest.raises(moerun.InvalidArgumentError) as ei:
        client.infer(x[:, :32].copy())
    e = ei.value
    assert e.from_server and e.code == "INVALID_ARGUMENT"
    assert "hidden size 32 does not match the model's 64" in e.message
    assert str(e) == "server: invalid_argument: " + e.message
    assert np.array_equal(bits(client.infer(x)), bits(want))  # the connection is kept


def test_error_among_pipelined_requests(client, reference):
    x, want = reference
    with pytest.raises(moerun.InvalidArgumentError) as ei:
        client.infer_many([x[:10], x[:3, :16].copy(), x[10:]])
    assert ei.value.request_id is not None
    # The other answers still due on the connection are dropped when they come.
    assert client.connected
    ys = client.infer_many([x[:24], x[24:]])
    assert np.array_equal(bits(np.concatenate(ys)), bits(want))


def test_nan_input(client, reference):
    x, _ = reference
    xn = x.copy()
    xn[3, 7] = np.nan
    with pytest.raises(moerun.InvalidArgumentError, match="token 3, column 7"):
        client.infer(xn)
    xn[3, 7] = np.inf
    with pytest.raises(ValueError, match="not finite"):
        client.infer(xn)


def test_unknown_layer(client, reference):
    x, _ = reference
    with pytest.raises(moerun.InvalidArgumentError) as ei:
        client.infer(x, layer=5)
    assert ei.value.from_server and ei.value.message


def test_short_deadline_fails_cleanly_or_answers(client, serve_job):
    x = np.random.default_rng(9).standard_normal((16384, 64)).astype(np.float32)
    t0 = time.monotonic()
    try:
        y = client.infer(x, deadline_ms=1)
    except moerun.DeadlineExceededError as e:
        assert e.from_server and e.message  # the server's DEADLINE_EXCEEDED, its message
    else:
        assert y.shape == x.shape
    assert time.monotonic() - t0 < 10
    assert client.infer(x[:2]).shape == (2, 64)


def test_request_over_the_servers_limit(serve_job, reference):
    # 10 MiB against the job's serving.max_frame_bytes of 8 MiB: FRAME_TOO_LARGE, answered
    # before the body is read, then the server closes. Not retried elsewhere.
    x = np.zeros((40000, 64), np.float32)
    c = moerun.Client(serve_job.targets, timeout=10)
    with pytest.raises(moerun.FrameTooLargeError) as ei:
        c.infer(x)
    assert ei.value.from_server and str(SERVER_MAX_FRAME) in ei.value.message
    assert c.retried == 0
    xs, want = reference
    assert np.array_equal(bits(c.infer(xs)), bits(want))  # a new connection serves again


# --- failover -------------------------------------------------------------------------------------

def test_failover_past_a_closed_port(failover_job, reference):
    x, want = reference
    dead = f"127.0.0.1:{free_port()}"
    with moerun.Client([dead, failover_job.targets[1]], timeout=10) as c:
        assert np.array_equal(bits(c.infer(x)), bits(want))
        assert c.target == failover_job.targets[1] and c.failovers == 1
        ys = c.infer_many([x[:8], x[8:]])
        assert np.array_equal(bits(np.concatenate(ys)), bits(want))


def test_request_sent_again_when_its_connection_breaks(failover_job, reference):
    x, want = reference

    def drop(conn):  # reads the request, then closes without an answer (a router dying)
        recv_frame(conn)
        conn.close()

    with FakeServer(drop) as srv, moerun.Client([srv.address, failover_job.targets[1]],
                                                timeout=10) as c:
        ys = c.infer_many([x[:20], x[20:]])
        assert np.array_equal(bits(np.concatenate(ys)), bits(want))
        assert c.retried >= 1 and c.target == failover_job.targets[1]
        assert srv.connections == 1


def test_unavailable_answer_moves_to_the_next_router(failover_job, reference):
    x, want = reference

    draining = answer_every_request(serving_pb2.UNAVAILABLE, "the server is draining")
    with FakeServer(draining) as srv:
        with moerun.Client([srv.address, failover_job.targets[1]], timeout=10) as c:
            assert np.array_equal(bits(c.infer(x)), bits(want))
            assert c.retried == 1 and c.target == failover_job.targets[1]
        with moerun.Client(srv.address, timeout=10) as c:  # one target: the answer raised
            with pytest.raises(moerun.UnavailableError, match="draining") as ei:
                c.infer(x)
            assert ei.value.from_server


def test_retries_run_out():
    def drop(conn):
        recv_frame(conn)
        conn.close()

    with FakeServer(drop) as a, FakeServer(drop) as b:
        c = moerun.Client([a.address, b.address], timeout=10)
        t0 = time.monotonic()
        with pytest.raises(moerun.UnavailableError, match="sent 2 time"):
            c.infer(np.zeros((1, 4), np.float32))
        assert time.monotonic() - t0 < 3
        assert a.connections + b.connections == 2


def test_overloaded_is_not_retried():
    full = answer_every_request(serving_pb2.OVERLOADED, "queue full; retry later")
    with FakeServer(full) as a, FakeServer(full) as b:
        c = moerun.Client([a.address, b.address], timeout=10)
        with pytest.raises(moerun.OverloadedError, match="retry later") as ei:
            c.infer(np.zeros((1, 4), np.float32))
        assert ei.value.from_server and c.retried == 0 and b.connections == 0
        assert c.connected  # an answer, not a broken connection


def test_connect_timeout_bounded():
    # A listening socket with a full backlog and no accept: connects may hang; the timeout holds.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(0)
    try:
        addr = f"127.0.0.1:{s.getsockname()[1]}"
        t0 = time.monotonic()
        try:
            moerun.Client(addr, timeout=1.0, connect_timeout=0.5).infer(np.zeros((1, 4), np.float32))
        except (moerun.UnavailableError, moerun.DeadlineExceededError):
            pass
        assert time.monotonic() - t0 < 2.5
    finally:
        s.close()
