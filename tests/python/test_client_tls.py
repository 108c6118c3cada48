"""The Python clients over TLS (``tls``, ``tls_ca_file``, ``tls_server_name``).

Certificates are made here with the openssl command (a CA, a server certificate with
subjectAltName IP:127.0.0.1 and DNS:localhost, and an unrelated CA), never checked in.

Part 1, against a TLS server in this file (jobs.FakeServer wrapped in the ssl module, answering
each InferRequest with its own data, each ControlRequest with a status): the blocking client,
the asyncio client and moerun.ctl.Control round trip small and large requests by address and
by name; a wrong CA and a wrong name fail the handshake with UnavailableError whose cause is the
ssl error; a plain client of the TLS server and a TLS client of a plain server fail in time;
the options are checked.

Part 2, against a real ``moerun serve`` with ``serving: {tls: ...}`` and a serving key (one
process, inproc, qwen3_moe): a keyed request over TLS is answered bitwise as ``moerun forward``
computes it (blocking and asyncio); one without the key is refused (UNAUTHENTICATED); a plain
client fails cleanly; a wrong CA fails with an ssl error; ``moectl --tls-ca-file ... status``
and ``moerun.ctl.Control`` work over TLS on the control endpoint, and a plain moectl fails;
``moebench serve --verify --tls-ca-file`` passes (and fails with a wrong --tls-server-name).
Skipped (saying so) when the moerun binary has no TLS support.

Run: PYTHONPATH=python:build/python python3 -m pytest -q tests/python/test_client_tls.py
"""

import asyncio
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import time

import numpy as np
import pytest

import jobs

MODEL = "qwen3_moe"


# --- certificates ----------------------------------------------------------------------------

def _openssl(*args, cwd):
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)}: {r.stderr[-1000:]}")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """Paths: ca.crt, other.crt (an unrelated CA), server.crt, server.key (chmod 600)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    d = tmp_path_factory.mktemp("tls")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca_ext = ["-addext", "basicConstraints=critical,CA:TRUE",
              "-addext", "keyUsage=critical,keyCertSign,cRLSign"]
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=moerun-test-ca", *ca_ext, cwd=d)
    _openssl("req", "-x509", *ec, "-keyout", "other.key", "-out", "other.crt", "-days", "2",
             "-subj", "/CN=moerun-other-ca", *ca_ext, cwd=d)
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost",
             cwd=d)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "server.ext",
             cwd=d)
    for name in os.listdir(d):
        os.chmod(d / name, 0o600)
    return {n: str(d / n) for n in ("ca.crt", "other.crt", "server.crt", "server.key")}


# --- part 1: a TLS server of this file ------------------------------------------------------

def _server_context(certs) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs["server.crt"], certs["server.key"])
    return ctx


def _tls_echo(certs, handshakes):
    """A FakeServer handler: TLS, then each InferRequest answered with its own data (the
    answer is the input), each ControlRequest with a StatusResponse naming its token."""
    from moerun.v1 import control_pb2, serving_pb2

    ctx = _server_context(certs)

    def handler(conn: socket.socket) -> None:
        try:
            t = ctx.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError) as e:
            handshakes.append(e)
            return
        handshakes.append(None)
        try:
            while True:
                body = jobs.recv_frame(t)
                if body is None:
                    return
                req = serving_pb2.InferRequest.FromString(body)
                if req.id:
                    resp = serving_pb2.InferResponse(id=req.id, dtype=req.dtype, shape=req.shape,
                                                     data=req.data)
                    jobs.send_frame(t, resp.SerializeToString())
                else:  # a ControlRequest (its field 1 is not an id): answer a status
                    creq = control_pb2.ControlRequest.FromString(body)
                    status = control_pb2.StatusResponse(model="tls:" + creq.token, num_ranks=3)
                    jobs.send_frame(t, control_pb2.ControlResponse(
                        status=status).SerializeToString())
        finally:
            t.close()

    return handler


@pytest.fixture
def tls_server(needs_build, certs):
    handshakes = []
    with jobs.FakeServer(_tls_echo(certs, handshakes)) as srv:
        srv.handshakes = handshakes
        yield srv


def _port(address: str) -> str:
    return address.rsplit(":", 1)[1]


def test_round_trip_by_address_and_by_name(tls_server, certs):
    import moerun

    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    big = rng.standard_normal((4096, 512)).astype(np.float32)  # 8 MiB: many TLS records
    for target in (tls_server.address, "localhost:" + _port(tls_server.address)):
        with moerun.Client(target, tls_ca_file=certs["ca.crt"], timeout=20.0) as c:
            np.testing.assert_array_equal(c.infer(x), x)
            np.testing.assert_array_equal(c.infer(big), big)
            outs = c.infer_many([x, big, x[:1], big[:7]])  # pipelined on one connection
            for got, want in zip(outs, [x, big, x[:1], big[:7]]):
                np.testing.assert_array_equal(got, want)
    # An SSLContext of one's own, and the name given for an address target.
    ctx = ssl.create_default_context(cafile=certs["ca.crt"])
    with moerun.Client(tls_server.address, tls=ctx, tls_server_name="localhost") as c:
        np.testing.assert_array_equal(c.infer(x), x)
    assert tls_server.handshakes and all(h is None for h in tls_server.handshakes)


def test_asyncio_client_over_tls(tls_server, certs):
    import moerun

    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((int(n), 256)).astype(np.float32) for n in rng.integers(1, 900, 40)]

    async def main():
        async with moerun.AsyncClient(tls_server.address, tls_ca_file=certs["ca.crt"],
                                      timeout=30.0) as c:
            return await asyncio.gather(*(c.infer(x) for x in xs))  # concurrent, one connection

    outs = asyncio.run(main())
    for got, want in zip(outs, xs):
        np.testing.assert_array_equal(got, want)


def test_control_over_tls(tls_server, certs):
    from moerun.ctl import Control

    with Control(tls_server.address, token="t0k", tls_ca_file=certs["ca.crt"]) as ctl:
        st = ctl.status()
        assert st.model == "tls:t0k" and st.num_ranks == 3
        assert ctl.status().num_ranks == 3  # the same connection again


def test_wrong_ca_fails_with_an_ssl_error(tls_server, certs):
    import moerun
    from moerun.ctl import Control

    x = np.zeros((1, 8), np.float32)
    with moerun.Client(tls_server.address, tls_ca_file=certs["other.crt"], timeout=5.0) as c:
        with pytest.raises(moerun.UnavailableError,
                           match="TLS handshake failed: certificate verify failed") as e:
            c.infer(x)
    assert isinstance(e.value.__cause__, ssl.SSLCertVerificationError)
    assert tls_server.address in str(e.value)

    async def main():
        async with moerun.AsyncClient(tls_server.address, tls_ca_file=certs["other.crt"],
                                      timeout=5.0) as c:
            await c.infer(x)

    with pytest.raises(moerun.UnavailableError, match="certificate verify failed") as e:
        asyncio.run(main())
    assert isinstance(e.value.__cause__, ssl.SSLCertVerificationError)
    with pytest.raises(moerun.UnavailableError, match="certificate verify failed"):
        Control(tls_server.address, tls_ca_file=certs["other.crt"], timeout=5.0).status()


def test_wrong_name_fails_the_handshake(tls_server, certs):
    import moerun

    x = np.zeros((1, 8), np.float32)
    for name, why in (("wrong.example", "Hostname mismatch"), ("10.1.2.3", "IP address mismatch")):
        with moerun.Client(tls_server.address, tls_ca_file=certs["ca.crt"],
                           tls_server_name=name, timeout=5.0) as c:
            with pytest.raises(moerun.UnavailableError, match="certificate verify failed") as e:
                c.infer(x)
        assert why.lower() in str(e.value).lower()
        assert isinstance(e.value.__cause__, ssl.SSLCertVerificationError)


def test_plain_client_of_tls_server_fails_in_time(tls_server, certs):
    import moerun

    x = np.zeros((1, 8), np.float32)
    t0 = time.monotonic()
    with moerun.Client(tls_server.address, timeout=5.0, retries=0) as c:
        with pytest.raises(moerun.MoerunError):
            c.infer(x)
    assert time.monotonic() - t0 < 5.5
    end = time.monotonic() + 5  # the server's thread notes it after closing
    while not tls_server.handshakes and time.monotonic() < end:
        time.sleep(0.01)
    assert isinstance(tls_server.handshakes[-1], (ssl.SSLError, OSError))


def test_tls_client_of_plain_server_fails_in_time(needs_build, certs):
    import moerun

    def silent(conn):  # reads the ClientHello, answers nothing
        while conn.recv(4096):
            pass

    with jobs.FakeServer(silent) as srv:
        t0 = time.monotonic()
        with moerun.Client(srv.address, tls_ca_file=certs["ca.crt"], connect_timeout=1.0,
                           timeout=3.0) as c:
            with pytest.raises(moerun.UnavailableError, match="TLS handshake failed: no answer"):
                c.infer(np.zeros((1, 8), np.float32))
        assert time.monotonic() - t0 < 3.0


def test_tls_options_are_checked(needs_build, certs, tmp_path):
    import moerun

    with pytest.raises(moerun.InvalidArgumentError, match="tls_ca_file .*missing.crt"):
        moerun.Client("127.0.0.1:1", tls_ca_file=str(tmp_path / "missing.crt"))
    with pytest.raises(moerun.InvalidArgumentError, match="tls_server_name needs tls"):
        moerun.Client("127.0.0.1:1", tls_server_name="localhost")
    with pytest.raises(moerun.InvalidArgumentError, match="not both"):
        moerun.Client("127.0.0.1:1", tls=ssl.create_default_context(),
                      tls_ca_file=certs["ca.crt"])
    with pytest.raises(moerun.InvalidArgumentError, match="tls must be"):
        moerun.Client("127.0.0.1:1", tls="yes")


# --- part 2: a real `moerun serve` with serving.tls ------------------------------------------

def _serve_has_tls() -> bool:
    try:
        r = subprocess.run([jobs.binary("moerun"), "serve", "--help"], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return "--tls-cert-file" in r.stdout + r.stderr


@pytest.fixture(scope="module")
def tls_job(needs_build, certs, tmp_path_factory):
    """(job, key): a 2-rank inproc job with serving.tls and a serving key."""
    if not _serve_has_tls():
        pytest.skip("this moerun has no TLS on its endpoints (serving.tls, issue 41)")
    work = tmp_path_factory.mktemp("tls-job")
    key = "key-" + secrets.token_hex(16)
    key_file = str(work / "serving.key")
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    job = jobs.ServeJob(jobs.fixture(MODEL), ranks=2, routers=1, transport="inproc",
                        serving_key_file=key_file,
                        serving={"tls": {"cert_file": certs["server.crt"],
                                         "key_file": certs["server.key"]}})
    job.start()
    try:
        yield job, key
    finally:
        job.stop()


@pytest.fixture(scope="module")
def tls_reference(tls_job, tmp_path_factory):
    import json

    job = tls_job[0]
    with open(os.path.join(job.model, "config.json")) as f:
        hidden = int(json.load(f)["hidden_size"])
    x = np.random.default_rng(41).standard_normal((9, hidden)).astype(np.float32)
    return x, jobs.forward(job.model, x, str(tmp_path_factory.mktemp("forward")))


def test_serve_keyed_request_over_tls_answered_bitwise(tls_job, tls_reference, certs):
    import moerun

    job, key = tls_job
    x, y = tls_reference
    with moerun.Client(job.target, key=key, tls_ca_file=certs["ca.crt"], timeout=20.0) as c:
        np.testing.assert_array_equal(jobs.bits(c.infer(x)), jobs.bits(y))
        outs = c.infer_many([x[:4], x[4:]])
        np.testing.assert_array_equal(jobs.bits(np.concatenate(outs)), jobs.bits(y))

    async def main():
        async with moerun.AsyncClient(job.target, key=key, tls_ca_file=certs["ca.crt"],
                                      timeout=20.0) as c:
            return await asyncio.gather(c.infer(x[:2]), c.infer(x[2:]))

    outs = asyncio.run(main())
    np.testing.assert_array_equal(jobs.bits(np.concatenate(outs)), jobs.bits(y))


def test_serve_request_without_the_key_refused_over_tls(tls_job, tls_reference, certs):
    import moerun

    job, _ = tls_job
    x, _ = tls_reference
    with moerun.Client(job.target, tls_ca_file=certs["ca.crt"], timeout=20.0) as c:
        with pytest.raises(moerun.UnauthenticatedError):
            c.infer(x)


def test_serve_plain_client_fails_cleanly(tls_job, tls_reference):
    import moerun

    job, key = tls_job
    x, _ = tls_reference
    t0 = time.monotonic()
    with moerun.Client(job.target, key=key, timeout=15.0, retries=0) as c:
        with pytest.raises(moerun.MoerunError):
            c.infer(x)
    assert time.monotonic() - t0 < 15.5


def test_serve_wrong_ca_fails_with_an_ssl_error(tls_job, tls_reference, certs):
    import moerun

    job, key = tls_job
    x, _ = tls_reference
    with moerun.Client(job.target, key=key, tls_ca_file=certs["other.crt"], timeout=10.0) as c:
        with pytest.raises(moerun.UnavailableError, match="certificate verify failed") as e:
            c.infer(x)
    assert isinstance(e.value.__cause__, ssl.SSLCertVerificationError)


def test_serve_control_over_tls(tls_job, certs):
    from moerun.ctl import Control

    job, _ = tls_job
    moectl = jobs.binary("moectl")
    base = [moectl, "--target", job.control, "--token-file", job.token_file, "--timeout-ms",
            "10000"]
    r = subprocess.run(base + ["--tls-ca-file", certs["ca.crt"], "status", "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert '"num_ranks": 2' in r.stdout
    # By name, the CA from the environment.
    env = dict(os.environ, MOERUN_TLS_CA_FILE=certs["ca.crt"])
    r = subprocess.run([moectl, "--target", "localhost:" + _port(job.control), "--token-file",
                        job.token_file, "status"], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(base + ["--tls-ca-file", certs["other.crt"], "status"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "TLS handshake failed: certificate verify failed" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = subprocess.run(base + ["status"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout

    with Control(job.control, token_file=job.token_file, tls_ca_file=certs["ca.crt"]) as ctl:
        assert ctl.status().num_ranks == 2


def test_serve_moebench_verify_over_tls(tls_job, certs, tmp_path):
    job, key = tls_job
    key_file = str(tmp_path / "serving.key")
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    base = [jobs.binary("moebench"), "serve", "--target", job.target, "--concurrency", "2",
            "--duration", "1", "--warmup", "0.2", "--tokens-per-request", "4", "--verify",
            "--model", job.model, "--threads", "1", "--key-file", key_file]
    ok = subprocess.run(base + ["--tls-ca-file", certs["ca.crt"]], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "verified" in ok.stderr + ok.stdout
    named = subprocess.run(base + ["--tls-ca-file", certs["ca.crt"], "--tls-server-name",
                                   "wrong.example"], capture_output=True, text=True, timeout=120)
    assert named.returncode == 1
    assert "hostname mismatch" in named.stderr, named.stderr[-2000:]
