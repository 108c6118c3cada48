"""moerun.ctl.Control against router 0's control endpoint: the same answers as moectl's JSON;
a missing or wrong token refused."""

import json
import os
import subprocess
import time

import pytest

pytest.importorskip("moerun.v1.serving_pb2", reason="the generated protobuf classes (build moerun; "
                    "PYTHONPATH=python:build/python)")

import moerun  # noqa: E402
from moerun.ctl import Control, read_token_file, to_dict

from jobs import binary


def moectl(job, *args):
    r = subprocess.run([binary("moectl"), "--target", job.control, "--token-file", job.token_file,
                        *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture
def ctl(serve_job):
    with Control(serve_job.control, token_file=serve_job.token_file) as c:
        yield c


# Fields that move on their own between two requests.
_VOLATILE = {"uptime_s", "last_seen_s", "resident_bytes", "window_s", "window_assignments",
             "window_balancedness"}


def _strip(d):
    if isinstance(d, dict):
        return {k: _strip(v) for k, v in d.items() if k not in _VOLATILE}
    if isinstance(d, list):
        return [_strip(v) for v in d]
    return d


def _same_as_moectl(ask, *moectl_args):
    """(mine, theirs) from the Python client and from moectl, once two such answers agree. The
    expert ranks' counters reach router 0 with their heartbeats, a moment after the batch that moved
    them, so the answers right after a batch may still differ; they settle within a few beats."""
    deadline = time.monotonic() + 15
    while True:
        mine = to_dict(ask())
        theirs = json.loads(moectl(*moectl_args))
        if _strip(mine) == _strip(theirs) or time.monotonic() > deadline:
            return mine, theirs
        time.sleep(0.3)


def test_status_as_moectl(ctl, serve_job, client, reference):
    client.infer(reference[0])  # some load
    st = ctl.status()
    assert st.model == "qwen3_moe" and st.num_ranks == 4 and st.num_routers == 2 and st.ready
    assert [r.role for r in st.ranks] == ["router", "router", "expert", "expert"]
    assert st.health == "ok" and st.batches >= 1
    mine, theirs = _same_as_moectl(ctl.status, serve_job, "status", "--json")
    assert _strip(mine) == _strip(theirs)
    assert mine["placement_version"] == theirs["placement_version"]  # uint64 as a string, both


def test_stats_as_moectl(ctl, serve_job):
    mine, theirs = _same_as_moectl(ctl.stats, serve_job, "stats", "--json")
    assert _strip(mine) == _strip(theirs)
    assert len(mine["experts"]) == 16 and sum(int(e["assignments"]) for e in mine["experts"]) > 0


def test_plan_as_moectl(ctl, serve_job):
    p = ctl.plan(redundant=2, policy="eplb-global")
    assert p.policy == "eplb-global" and p.slots_per_rank == 9 and len(p.layers) == 1
    mine = to_dict(p)
    theirs = json.loads(moectl(serve_job, "placement", "plan", "--redundant", "2", "--policy",
                               "eplb-global", "--json"))
    assert set(mine) == set(theirs)
    assert (mine["policy"], mine["slots_per_rank"]) == (theirs["policy"], theirs["slots_per_rank"])
    assert [lp["layer"] for lp in mine["layers"]] == [lp["layer"] for lp in theirs["layers"]]
    assert ctl.plan().slots_per_rank == 8  # 16 experts over 2 expert ranks
    odd = ctl.plan(redundant=1)  # 17 slots: 9 and 8
    assert (odd.slots_per_rank, odd.min_slots_per_rank) == (9, 8)
    with pytest.raises(moerun.InvalidArgumentError, match="do not divide evenly") as ei:
        ctl.plan(redundant=1, policy="eplb-hierarchical")
    assert ei.value.from_server


def test_placement_and_progress(ctl, serve_job):
    pl = ctl.placement()
    assert json.loads(pl.json) == json.loads(moectl(serve_job, "placement", "show"))
    assert pl.version == ctl.status().placement_version
    m = ctl.progress()
    assert m.id == 0 and m.state == "none"


def test_a_request_over_the_frame_limit_is_refused_before_sending(ctl):
    from moerun.ctl import CONTROL_MAX_FRAME_BYTES
    from moerun.v1 import control_pb2
    big = control_pb2.ControlRequest(
        apply=control_pb2.ApplyRequest(placement_json="{" + " " * CONTROL_MAX_FRAME_BYTES + "}"))
    with pytest.raises(moerun.InvalidArgumentError, match="over the control endpoint's limit of "
                       "1048576 bytes"):
        ctl.call(big)
    assert ctl.status().ready  # nothing was sent: the connection still serves


def test_token_refused(serve_job):
    with pytest.raises(moerun.UnauthenticatedError, match="wrong token") as ei:
        Control(serve_job.control, token="not-the-token").status()
    assert ei.value.from_server and isinstance(ei.value, PermissionError)
    env = os.environ.pop("MOERUN_TOKEN_FILE", None)
    try:
        with pytest.raises(moerun.UnauthenticatedError, match="a token is required"):
            Control(serve_job.control).stats()
    finally:
        if env is not None:
            os.environ["MOERUN_TOKEN_FILE"] = env


def test_token_from_the_environment(serve_job, monkeypatch):
    monkeypatch.setenv("MOERUN_TOKEN_FILE", serve_job.token_file)
    assert Control(serve_job.control).status().ready


def test_token_file_checks(tmp_path):
    f = tmp_path / "tok"
    f.write_text("  secret \n")
    os.chmod(f, 0o600)
    assert read_token_file(str(f)) == "secret"
    os.chmod(f, 0o644)
    with pytest.raises(moerun.InvalidArgumentError, match="mode 0644.*chmod 600"):
        read_token_file(str(f))
    os.chmod(f, 0o640)  # group-readable: refused too, as moectl and the server refuse it
    with pytest.raises(moerun.InvalidArgumentError, match="mode 0640"):
        read_token_file(str(f))
    with pytest.raises(moerun.InvalidArgumentError):
        read_token_file(str(tmp_path / "missing"))


def test_no_control_endpoint():
    from jobs import free_port

    with pytest.raises(moerun.UnavailableError):
        Control(f"127.0.0.1:{free_port()}", token="x", timeout=2).status()
