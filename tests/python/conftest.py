"""Fixtures of the Python client tests (tests/python): the `moerun serve` job they talk to.

Run: PYTHONPATH=python:build/python python3 -m pytest -q tests/python

One 4-rank job under mpirun serves the client, asyncio, error and control tests (session
scope): qwen3_moe, 2 routers (router 1 is the live target of the failover tests), 2 expert
ranks, serving.max_frame_bytes 8 MiB (so that a request over the server's limit stays cheap).
One job, not two, on purpose: idle ranks still poll, and the tests must fit on 2 cores.
"""

import importlib
import os
import shutil
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import jobs  # noqa: E402

SERVER_MAX_FRAME = 8 << 20
JOB_MODEL = "qwen3_moe"


def _missing():
    try:
        importlib.import_module("moerun.v1.serving_pb2")
        importlib.import_module("moerun.v1.control_pb2")
    except ImportError as e:
        return f"the generated protobuf classes are missing (build moerun; PYTHONPATH=python:build/python): {e}"
    if not os.access(jobs.binary("moerun"), os.X_OK):
        return f"{jobs.binary('moerun')} is not built"
    return None


@pytest.fixture(scope="session")
def needs_build():
    why = _missing()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="session")
def serve_job(needs_build):
    """A session-wide 4-rank `moerun serve` job (mpirun, 2 routers) on qwen3_moe."""
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found")
    job = jobs.ServeJob(jobs.fixture(JOB_MODEL), ranks=4, routers=2, transport="mpi",
                        serving={"max_frame_bytes": SERVER_MAX_FRAME})
    job.start()
    try:
        yield job
    finally:
        job.stop()


@pytest.fixture(scope="session")
def failover_job(serve_job):
    """The 2-router job of the failover tests (the session job: it has 2 routers)."""
    assert serve_job.routers >= 2
    return serve_job


@pytest.fixture(scope="session")
def reference(serve_job, tmp_path_factory):
    """(x, y): a random input [48, hidden] and `moerun forward`'s output for it."""
    hidden = _hidden(serve_job.model)
    x = np.random.default_rng(17).standard_normal((48, hidden)).astype(np.float32)
    y = jobs.forward(serve_job.model, x, str(tmp_path_factory.mktemp("forward")))
    return x, y


def _hidden(model: str) -> int:
    import json

    with open(os.path.join(model, "config.json")) as f:
        return int(json.load(f)["hidden_size"])


@pytest.fixture
def client(serve_job):
    """A Client of the session job's router 0."""
    import moerun

    with moerun.Client(serve_job.target, timeout=20.0) as c:
        yield c



# A run in which any test skipped ends with exit code 77, which ctest reads as "skipped"
# (SKIP_RETURN_CODE 77 in tests/CMakeLists.txt), not 0 ("passed"): a suite whose protobuf
# classes, binary, mpirun or torch are missing must not look green. Each skip is printed as one
# "SKIP: <test>: <reason>" line, which the test command's summary (scripts/test_summary.py) shows.
_skips = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skips.append((report.nodeid, reason.removeprefix("Skipped: ")))


def pytest_collectreport(report):
    if report.skipped:  # a module skipped as a whole (importorskip at its top)
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skips.append((report.nodeid, reason.removeprefix("Skipped: ")))


def pytest_sessionfinish(session, exitstatus):
    if not _skips:
        return
    for nodeid, reason in _skips:
        print(f"\nSKIP: {nodeid}: {reason}", end="")
    print()
    if exitstatus in (0, 5):  # all ran passed (or none ran): the skips decide
        session.exitstatus = 77
