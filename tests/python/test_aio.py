"""moerun.AsyncClient: many concurrent calls on one connection, answers matched by id, close with
calls pending, timeouts, failover."""

import asyncio
import time

import numpy as np
import pytest

pytest.importorskip("moerun.v1.serving_pb2", reason="the generated protobuf classes (build moerun; "
                    "PYTHONPATH=python:build/python)")

import moerun  # noqa: E402
from moerun.v1 import serving_pb2

from jobs import FakeServer, bits, free_port, recv_frame, send_frame


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_32_concurrent_calls_on_one_connection(serve_job, reference):
    x, want = reference

    async def main():
        async with moerun.AsyncClient(serve_job.target, timeout=20) as c:
            conn = c._conn
            cuts = [(i % 40, i % 40 + 1 + i % 8) for i in range(32)]
            ys = await asyncio.gather(*(c.infer(x[a:b]) for a, b in cuts))
            assert c._conn is conn and c.failovers == 0  # all on the one connection
            for (a, b), y in zip(cuts, ys):
                assert np.array_equal(bits(y), bits(want[a:b]))
            assert c.last_timing is not None
            ys = await c.infer_many([x[:10], x[10:]])
            assert np.array_equal(bits(np.concatenate(ys)), bits(want))

    run(main())


def test_torch_and_bf16(serve_job, reference):
    torch = pytest.importorskip("torch")
    x, want = reference

    async def main():
        c = await moerun.AsyncClient.connect(serve_job.target)
        try:
            y = await c.infer(torch.from_numpy(x.copy()).reshape(2, 24, -1))
            assert y.dtype == torch.float32 and tuple(y.shape) == (2, 24, x.shape[1])
            assert np.array_equal(bits(y.reshape(48, -1).numpy()), bits(want))
            yb = await c.infer(torch.from_numpy(x.copy()).to(torch.bfloat16))
            assert yb.dtype == torch.bfloat16 and tuple(yb.shape) == x.shape
        finally:
            await c.close()

    run(main())


def test_server_errors_raised(serve_job, reference):
    x, _ = reference

    async def main():
        async with moerun.AsyncClient(serve_job.target) as c:
            with pytest.raises(moerun.InvalidArgumentError, match="hidden size 32"):
                await c.infer(x[:, :32].copy())
            xn = x.copy()
            xn[1, 2] = np.nan
            bad, good = await asyncio.gather(c.infer(xn), c.infer(x), return_exceptions=True)
            assert isinstance(bad, moerun.InvalidArgumentError) and bad.from_server
            assert isinstance(good, np.ndarray)

    run(main())


def _silent(conn):
    while recv_frame(conn) is not None:
        pass


def test_close_with_calls_pending():
    async def main():
        with FakeServer(_silent) as srv:
            c = await moerun.AsyncClient.connect(srv.address, timeout=30)
            tasks = [asyncio.ensure_future(c.infer(np.zeros((2, 8), np.float32)))
                     for _ in range(5)]
            await asyncio.sleep(0.2)
            assert not any(t.done() for t in tasks)
            t0 = time.monotonic()
            await c.close()
            res = await asyncio.gather(*tasks, return_exceptions=True)
            assert time.monotonic() - t0 < 1
            assert all(isinstance(r, moerun.UnavailableError) for r in res), res
            with pytest.raises(moerun.UnavailableError):
                await c.infer(np.zeros((2, 8), np.float32))

    run(main())


def test_timeout_and_dead_server():
    async def main():
        with FakeServer(_silent) as srv:
            async with moerun.AsyncClient(srv.address, timeout=0.5) as c:
                t0 = time.monotonic()
                res = await asyncio.gather(*(c.infer(np.zeros((1, 4), np.float32))
                                             for _ in range(4)), return_exceptions=True)
                assert 0.45 < time.monotonic() - t0 < 1.5
                assert all(isinstance(r, moerun.DeadlineExceededError) for r in res), res
        port = free_port()
        t0 = time.monotonic()
        with pytest.raises(moerun.UnavailableError, match=str(port)):
            await moerun.AsyncClient.connect(f"127.0.0.1:{port}")
        assert time.monotonic() - t0 < 2

    run(main())


def test_answers_out_of_order():
    def reverse(conn):  # holds 8 requests, answers them last first (identity layer)
        held = []
        while True:
            body = recv_frame(conn)
            if body is None:
                return
            held.append(serving_pb2.InferRequest.FromString(body))
            if len(held) == 8:
                for r in reversed(held):
                    send_frame(conn, serving_pb2.InferResponse(
                        id=r.id, dtype=r.dtype, shape=r.shape, data=r.data).SerializeToString())
                held = []

    async def main():
        with FakeServer(reverse) as srv:
            async with moerun.AsyncClient(srv.address, timeout=10) as c:
                xs = [np.full((i + 1, 16), i, np.float32) for i in range(16)]
                ys = await asyncio.gather(*(c.infer(x) for x in xs))
                assert all(np.array_equal(a, b) for a, b in zip(xs, ys))

    run(main())


def test_failover(failover_job, reference):
    x, want = reference

    def drop(conn):
        recv_frame(conn)
        conn.close()

    async def main():
        dead = f"127.0.0.1:{free_port()}"
        async with moerun.AsyncClient([dead, failover_job.targets[1]], timeout=10) as c:
            assert c.target == failover_job.targets[1]
            assert np.array_equal(bits(await c.infer(x)), bits(want))
        with FakeServer(drop) as srv:
            c = moerun.AsyncClient([srv.address, failover_job.targets[1]], timeout=10)
            ys = await asyncio.gather(*(c.infer(x[i:i + 6]) for i in range(0, 48, 6)))
            assert np.array_equal(bits(np.concatenate(ys)), bits(want))
            assert c.retried >= 1 and c.target == failover_job.targets[1]
            await c.close()

    run(main())
