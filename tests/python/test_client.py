"""moerun.Client against a 4-rank `moerun serve` job: answers bitwise equal to `moerun forward`,
numpy and torch, f32 and bf16, any leading dims, pipelined requests, no copies; the framing
against a scripted server (ids matched out of order, the request's bytes)."""

import threading
import time
import tracemalloc

import numpy as np
import pytest

pytest.importorskip("moerun.v1.serving_pb2", reason="the generated protobuf classes (build moerun; "
                    "PYTHONPATH=python:build/python)")

import moerun  # noqa: E402
from moerun import tensors
from moerun.v1 import serving_pb2

from jobs import FakeServer, bits, recv_frame, send_frame


def test_numpy_f32_bitwise(client, reference):
    x, want = reference
    y = client.infer(x)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == x.shape
    assert np.array_equal(bits(y), bits(want))
    t = client.last_timing
    assert t is not None and t.compute_us > 0


def test_torch_f32_bitwise(client, reference):
    torch = pytest.importorskip("torch")
    x, want = reference
    xt = torch.from_numpy(x.copy())
    y = client.infer(xt)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and tuple(y.shape) == x.shape
    assert np.array_equal(bits(y.numpy()), bits(want))


def test_leading_dims_flattened_and_restored(client, reference):
    x, want = reference
    h = x.shape[1]
    y = client.infer(x[:6].reshape(2, 3, h))
    assert y.shape == (2, 3, h)
    assert np.array_equal(bits(y.reshape(6, h)), bits(want[:6]))
    y1 = client.infer(x[7])  # [hidden]: one token
    assert y1.shape == (h,) and np.array_equal(bits(y1), bits(want[7]))


def test_non_contiguous_input(client, reference):
    x, want = reference
    xt = np.asfortranarray(x[::2])
    y = client.infer(xt)
    assert np.array_equal(bits(y), bits(want[::2]))


def test_torch_bf16_in_bf16_out(client, reference):
    torch = pytest.importorskip("torch")
    x, _ = reference
    h = x.shape[1]
    xb = torch.from_numpy(x.copy()).to(torch.bfloat16).reshape(4, 12, h)
    y = client.infer(xb)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and tuple(y.shape) == (4, 12, h)
    # The server widens BF16 exactly, computes in f32 and rounds the answer to nearest even: the
    # f32 answer to the bf16-rounded input, rounded, bit for bit. (Against the f32 answer to x
    # itself only roughly: rounding the input may change a token's experts.)
    y32 = client.infer(xb.float().reshape(-1, h).numpy())
    ybits = y.reshape(-1, h).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ybits, tensors.float32_to_bf16_bits(y32))
    assert np.abs(y.float().reshape(-1, h).numpy() - y32).max() <= 2.0 ** -7 * np.abs(y32).max()
    # The same request as numpy bf16 bits: the same answer.
    raw = xb.reshape(-1, h).view(torch.int16).numpy().view(np.uint16)
    yb = client.infer(raw, dtype="bf16")
    assert yb.dtype == np.uint16 and yb.shape == raw.shape
    assert np.array_equal(yb, ybits)


def test_f32_sent_as_bf16(client, reference):
    x, _ = reference
    y = client.infer(x, dtype="bf16")
    assert y.dtype == np.float32 and y.shape == x.shape
    # = the server's BF16 answer to the input rounded to bf16, widened back.
    raw = client.infer(tensors.float32_to_bf16_bits(x), dtype="bf16")
    assert np.array_equal(bits(y), bits(tensors.bf16_bits_to_float32(raw)))
    xr = tensors.bf16_bits_to_float32(tensors.float32_to_bf16_bits(x))
    assert np.array_equal(tensors.float32_to_bf16_bits(client.infer(xr)), raw)
    torch = pytest.importorskip("torch")
    yt = client.infer(torch.from_numpy(x.copy()), dtype="bf16")
    assert yt.dtype == torch.float32 and np.array_equal(bits(yt.numpy()), bits(y))
    yf = client.infer(torch.from_numpy(xr).to(torch.bfloat16), dtype="f32")  # and the other way
    assert yf.dtype == torch.bfloat16
    assert np.array_equal(yf.view(torch.int16).numpy().view(np.uint16), raw)


def test_infer_many_pipelined(client, reference):
    x, want = reference
    cuts = [0, 1, 5, 6, 14, 20, 21, 30, 33, 40, 47, 48]
    xs = [x[a:b] for a, b in zip(cuts, cuts[1:])]
    first = client._next_id
    ys = client.infer_many(xs)
    assert client._next_id == first + len(xs)  # one id per request, increasing
    assert len(ys) == len(xs)
    for (a, b), y in zip(zip(cuts, cuts[1:]), ys):
        assert np.array_equal(bits(y), bits(want[a:b]))
    assert client.infer_many([]) == []


def test_answer_is_a_view_of_the_frame(client, reference):
    x, want = reference
    y = client.infer(x)
    assert not y.flags.owndata and y.flags.writeable
    assert isinstance(y.base, np.ndarray) and y.base.dtype == np.uint8
    assert y.base.nbytes < y.nbytes + 256  # the frame's buffer: header fields + alignment
    assert y.ctypes.data % 64 == 0
    y[0, 0] = 1.0  # writable, and nothing else sees it
    torch = pytest.importorskip("torch")
    yt = client.infer(torch.from_numpy(x.copy()))
    assert yt.data_ptr() % 64 == 0
    # torch outputs are torch.from_numpy over the answer's buffer (f32 and bf16).
    for t in (torch.from_numpy(x.copy()), torch.from_numpy(x.copy()).to(torch.bfloat16)):
        prep = tensors.prepare(t)
        frame = np.zeros(prep.nbytes, np.uint8)
        out = prep.restore(frame, prep.wire_dtype, [prep.tokens, prep.hidden])
        assert out.dtype == t.dtype and out.data_ptr() == frame.ctypes.data
        assert prep.payload.ctypes.data == t.data_ptr()  # and the input is sent from its own buffer


def test_no_copy_of_a_large_input(client, serve_job):
    h = 64
    x = np.random.default_rng(5).standard_normal((16384, h)).astype(np.float32)  # 4 MiB
    client.infer(x[:4])  # connected, warm
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        y = client.infer(x)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert y.shape == x.shape
    # The answer itself is x.nbytes; a copy of the input (or of the answer) would double it.
    assert peak < 1.25 * x.nbytes, (peak, x.nbytes)


def test_connect_eagerly_and_properties(serve_job):
    c = moerun.Client(serve_job.targets)
    assert not c.connected and c.targets == serve_job.targets
    c.connect()
    assert c.connected and c.target == serve_job.targets[0]
    c.close()
    assert not c.connected
    assert moerun.Client(",".join(serve_job.targets)).targets == serve_job.targets


def test_bad_targets():
    for bad in ["", "nohost", "127.0.0.1:0", "127.0.0.1:70000", ":5700", "a:1,,b:2", []]:
        with pytest.raises(moerun.InvalidArgumentError):
            moerun.Client(bad)
    assert moerun.Client("[::1]:5700").targets == ["[::1]:5700"]


def test_one_call_at_a_time():
    def silent(conn):
        while recv_frame(conn) is not None:
            pass

    with FakeServer(silent) as srv, moerun.Client(srv.address, timeout=1.5) as c:
        errors = []

        def slow():
            try:
                c.infer(np.zeros((1, 4), np.float32))
            except moerun.DeadlineExceededError:
                pass
            except Exception as e:  # pragma: no cover
                errors.append(e)

        t = threading.Thread(target=slow)
        t.start()
        time.sleep(0.3)
        with pytest.raises(RuntimeError, match="one call at a time"):
            c.infer(np.zeros((1, 4), np.float32))
        t.join()
        assert not errors


# --- the framing, against a scripted server -------------------------------------------------

def _echo(reverse_after: int):
    """Answers each request with its own data (an identity layer), `reverse_after` at a time in
    reverse order."""

    def handler(conn):
        held = []
        while True:
            body = recv_frame(conn)
            if body is None:
                return
            req = serving_pb2.InferRequest()
            req.ParseFromString(body)
            held.append(req)
            if len(held) == reverse_after:
                for r in reversed(held):
                    resp = serving_pb2.InferResponse(id=r.id, code=0, dtype=r.dtype,
                                                     shape=r.shape, data=r.data, queue_us=7,
                                                     compute_us=9)
                    send_frame(conn, resp.SerializeToString())
                held = []

    return handler


def test_answers_matched_by_id_out_of_order():
    xs = [np.full((i + 1, 8), float(i), np.float32) for i in range(6)]
    with FakeServer(_echo(3)) as srv, moerun.Client(srv.address, timeout=5) as c:
        ys = c.infer_many(xs)
        for x, y in zip(xs, ys):
            assert np.array_equal(x, y)
        assert c.last_timing == (7, 9)


def test_request_bytes_are_a_valid_infer_request():
    seen = []

    def handler(conn):
        body = recv_frame(conn)
        req = serving_pb2.InferRequest()
        req.ParseFromString(body)
        seen.append((body, req))
        send_frame(conn, serving_pb2.InferResponse(id=req.id, dtype=req.dtype, shape=req.shape,
                                                   data=req.data).SerializeToString())
        recv_frame(conn)

    x = np.arange(3 * 70, dtype=np.float32).reshape(3, 70)  # data over 127 bytes: 2-byte length
    with FakeServer(handler) as srv, moerun.Client(srv.address, timeout=5) as c:
        y = c.infer(x, layer=3, deadline_ms=250)
    body, req = seen[0]
    assert req.layer == 3 and req.HasField("layer") and req.deadline_ms == 250
    assert req.dtype == serving_pb2.F32 and list(req.shape) == [3, 70]
    assert req.data == x.tobytes() and req.id >= 1
    # Exactly what Protobuf itself would write, but for the field order (data last).
    assert len(body) == len(req.SerializeToString())
    assert np.array_equal(x, y)


def test_traceparent_sent_as_given():
    seen = []

    def handler(conn):
        req = serving_pb2.InferRequest()
        req.ParseFromString(recv_frame(conn))
        seen.append(req)
        send_frame(conn, serving_pb2.InferResponse(id=req.id, dtype=req.dtype, shape=req.shape,
                                                   data=req.data).SerializeToString())
        recv_frame(conn)

    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    x = np.ones((2, 8), np.float32)
    with FakeServer(handler) as srv, moerun.Client(srv.address, timeout=5) as c:
        c.infer(x, traceparent=tp)
    assert seen[0].traceparent == tp.encode()


def test_large_answers_received_in_place():
    x = np.random.default_rng(1).standard_normal((20000, 32)).astype(np.float32)  # 2.4 MiB
    with FakeServer(_echo(1)) as srv, moerun.Client(srv.address, timeout=10) as c:
        ys = c.infer_many([x, x[:3], x])
    assert all(np.array_equal(a, b) for a, b in zip([x, x[:3], x], ys))
    assert all(y.ctypes.data % 64 == 0 for y in ys)


def test_bf16_conversion_matches_the_cpp_rounding():
    u = np.random.default_rng(3).integers(0, 1 << 32, 50000, dtype=np.uint64).astype(np.uint32)
    u[:8] = [0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x3F808000,
             0x3F818000, 0x00000000]
    f = u.view(np.float32)
    got = tensors.float32_to_bf16_bits(f).astype(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    want = np.where(nan, (u >> 16) | 0x40, ((u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16)
                    & 0xFFFF).astype(np.uint32)
    assert np.array_equal(got, want)
    assert list(got[:8]) == [0x7F80, 0xFF80, 0x7FC0, 0x7FC0, 0xFFFF, 0x3F80, 0x3F82, 0]
    back = tensors.bf16_bits_to_float32(got.astype(np.uint16))
    assert np.array_equal(back.view(np.uint32)[~nan], (got[~nan] << 16))
    torch = pytest.importorskip("torch")
    finite = f[np.isfinite(f)]
    tb = torch.from_numpy(finite.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(tb, tensors.float32_to_bf16_bits(finite))  # = torch's rounding


def test_inputs_refused_before_sending():
    c = moerun.Client("127.0.0.1:9")  # never connected: these fail first
    with pytest.raises(moerun.InvalidArgumentError, match="float32"):
        c.infer(np.zeros((2, 4)))  # float64
    with pytest.raises(moerun.InvalidArgumentError, match="dtype='bf16'"):
        c.infer(np.zeros((2, 4), np.uint16))
    with pytest.raises(moerun.InvalidArgumentError, match="dtype"):
        c.infer(np.zeros((2, 4), np.float32), dtype="f16")
    with pytest.raises(TypeError):
        c.infer([[1.0, 2.0]])
    with pytest.raises(moerun.InvalidArgumentError, match="scalar"):
        c.infer(np.array(1.0, np.float32))
    assert not c.connected


def test_frame_reader_on_any_cut_of_the_stream():
    from moerun import _frame

    rng = np.random.default_rng(11)
    sizes = [0, 1, 3, 17, 1000, 16384, 70000, 5, 300000, 2, 65530, 65536]
    msgs, stream = [], bytearray()
    for i, n in enumerate(sizes):
        data = rng.integers(0, 256, n * 4, dtype=np.uint8).tobytes()
        m = serving_pb2.InferResponse(id=i + 1, code=0, dtype=1, shape=[n, 1], data=data,
                                      queue_us=i, compute_us=2 * i, message="x" * (i % 3))
        msgs.append(m)
        stream += len(m.SerializeToString()).to_bytes(4, "big") + m.SerializeToString()
    for chunking in ("bytes", "random", "whole"):
        reader = _frame.FrameReader(4 << 20, True)
        pos, got = 0, []
        while pos < len(stream):
            buf = reader.get_buffer()
            assert len(buf) > 0
            if chunking == "bytes" and pos < 200:
                want = 1
            elif chunking == "random":
                want = int(rng.integers(1, 100000))
            else:
                want = len(stream)
            n = min(len(buf), want, len(stream) - pos)
            buf[:n] = stream[pos:pos + n]
            pos += n
            got += reader.update(n)
        assert len(got) == len(msgs)
        for f, m in zip(got, msgs):
            resp = serving_pb2.InferResponse()
            data = _frame.parse_infer_response(f, resp)
            assert resp.id == m.id and resp.queue_us == m.queue_us and resp.message == m.message
            assert resp.data == b""  # left out of the parse: returned as a view instead
            assert (data is None and not m.data) or data.tobytes() == m.data
            if data is not None and len(data):
                assert data.ctypes.data % 64 == 0
    reader = _frame.FrameReader(1000, True)
    buf = reader.get_buffer()
    buf[:4] = (1001).to_bytes(4, "big")
    with pytest.raises(moerun.FrameTooLargeError, match="1001 bytes is over the limit of 1000"):
        reader.update(4)
    with pytest.raises(moerun.FrameTooLargeError):  # and it stays failed
        reader.get_buffer()
