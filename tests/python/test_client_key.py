"""The serving key against a real keyed `moerun serve` job (--serving-key-file; one process,
inproc transport, qwen3_moe): a request from the Python client (blocking and asyncio) with the
key is answered bitwise as `moerun forward` computes it; one without it, or with a wrong one, is
refused with UnauthenticatedError carrying its request id; `moebench serve --verify --key-file`
passes and fails without the key; a key file others may read is refused by the client, by
`moerun serve` (exit 2) and by moebench.

Run: PYTHONPATH=python:build/python python3 -m pytest -q tests/python/test_client_key.py
"""

import asyncio
import os
import secrets
import subprocess
import time

import numpy as np
import pytest

import jobs

MODEL = "qwen3_moe"


def _write_key(path, key: str, mode: int = 0o600) -> str:
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.chmod(str(path), mode)
    return str(path)


@pytest.fixture(scope="module")
def keyed(needs_build, tmp_path_factory):
    """(job, key, key_file): a 2-rank inproc job that requires the key."""
    work = tmp_path_factory.mktemp("serving-key")
    key = "key-" + secrets.token_hex(16)
    key_file = _write_key(work / "serving.key", key)
    job = jobs.ServeJob(jobs.fixture(MODEL), ranks=2, routers=1, transport="inproc",
                        serving_key_file=key_file)
    job.start()
    try:
        yield job, key, key_file
    finally:
        job.stop()


@pytest.fixture(scope="module")
def reference(keyed, tmp_path_factory):
    import json

    job = keyed[0]
    with open(os.path.join(job.model, "config.json")) as f:
        hidden = int(json.load(f)["hidden_size"])
    x = np.random.default_rng(23).standard_normal((12, hidden)).astype(np.float32)
    y = jobs.forward(job.model, x, str(tmp_path_factory.mktemp("forward")))
    return x, y


def test_keyed_request_answered_bitwise(keyed, reference):
    import moerun

    job, key, key_file = keyed
    x, y = reference
    with moerun.Client(job.target, key=key, timeout=20.0) as c:
        np.testing.assert_array_equal(jobs.bits(c.infer(x)), jobs.bits(y))
        outs = c.infer_many([x[:5], x[5:]])
        np.testing.assert_array_equal(jobs.bits(np.concatenate(outs)), jobs.bits(y))
    with moerun.Client(job.target, key_file=key_file, timeout=20.0) as c:
        np.testing.assert_array_equal(jobs.bits(c.infer(x)), jobs.bits(y))


def test_request_without_the_key_refused(keyed, reference):
    import moerun

    job, key, _ = keyed
    x, _ = reference
    with moerun.Client(job.target, timeout=20.0) as c:
        with pytest.raises(moerun.UnauthenticatedError, match="requires a key") as e:
            c.infer(x)
        assert e.value.from_server and e.value.request_id == 1
        # The connection stays: the next request is refused the same way, with its own id.
        with pytest.raises(moerun.UnauthenticatedError) as e:
            c.infer(x)
        assert e.value.request_id == 2
    with moerun.Client(job.target, key=key[:-1] + ("0" if key[-1] != "0" else "1"),
                       timeout=20.0) as c:
        with pytest.raises(moerun.UnauthenticatedError, match="wrong key"):
            c.infer(x)
    # The refusals are logged as a summary, not one line per request.
    end = time.monotonic() + 5
    while "serving: refused a request" not in job.log() and time.monotonic() < end:
        time.sleep(0.1)
    log = job.log()
    assert "serving: refused a request with no key from 127.0.0.1" in log
    assert log.count("serving: refused a request") == 1, log[-2000:]


def test_async_client_sends_the_key(keyed, reference):
    import moerun.aio

    job, key, _ = keyed
    x, y = reference

    async def run():
        async with moerun.aio.AsyncClient(job.target, key=key, timeout=20.0) as c:
            outs = await asyncio.gather(c.infer(x), c.infer(x[:3]))
        async with moerun.aio.AsyncClient(job.target, timeout=20.0) as c:
            with pytest.raises(moerun.UnauthenticatedError):
                await c.infer(x)
        return outs

    outs = asyncio.run(run())
    np.testing.assert_array_equal(jobs.bits(outs[0]), jobs.bits(y))
    np.testing.assert_array_equal(jobs.bits(outs[1]), jobs.bits(y[:3]))


def test_client_key_options_checked(tmp_path):
    import moerun

    loose = _write_key(tmp_path / "loose.key", "k", 0o644)
    with pytest.raises(moerun.InvalidArgumentError, match="key_file: .*mode 0644"):
        moerun.Client("127.0.0.1:1", key_file=loose)
    with pytest.raises(moerun.InvalidArgumentError, match="not both"):
        moerun.Client("127.0.0.1:1", key="a", key_file=loose)
    with pytest.raises(moerun.InvalidArgumentError, match="non-empty"):
        moerun.Client("127.0.0.1:1", key="")


def test_serve_refuses_a_key_file_others_may_read(keyed, tmp_path):
    job = keyed[0]
    loose = _write_key(tmp_path / "loose.key", "k", 0o640)
    r = subprocess.run([jobs.binary("moerun"), "serve", "--config", job.config_path, "--transport",
                        "inproc", "--serving-key-file", loose, "--listen", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "serving key file" in r.stderr and "mode 0640" in r.stderr, r.stderr[-2000:]


def _moebench(job, *extra):
    return subprocess.run([jobs.binary("moebench"), "serve", "--target", job.target,
                           "--concurrency", "2", "--duration", "1", "--warmup", "0.2",
                           "--tokens-per-request", "4", "--verify", "--model", job.model,
                           "--threads", "1", *extra],
                          capture_output=True, text=True, timeout=120)


def test_moebench_verify_with_the_key(keyed, tmp_path):
    job, _, key_file = keyed
    ok = _moebench(job, "--key-file", key_file)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "verified" in ok.stderr + ok.stdout
    refused = _moebench(job)
    assert refused.returncode != 0
    assert "unauthenticated" in refused.stderr, refused.stderr[-2000:]
    loose = _write_key(tmp_path / "loose.key", "k", 0o644)
    bad = _moebench(job, "--key-file", loose)
    assert bad.returncode == 2 and "mode 0644" in bad.stderr, bad.stderr[-2000:]
