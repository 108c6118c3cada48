"""What ``moectl`` asks router 0's control endpoint, from Python.

::

    from moerun.ctl import Control, to_dict
    with Control("127.0.0.1:5800", token_file="token") as ctl:
        st = ctl.status()                     # moerun.v1.StatusResponse
        print(st.health, [r.state for r in st.ranks])
        print(to_dict(ctl.plan(redundant=1)))  # as `moectl placement plan --json` prints it

The control protocol (``runtime/proto/moerun/v1/control.proto``): the serving protocol's framing, one
``ControlRequest`` (with the token) per ``ControlResponse``. The answers are the generated
Protobuf classes (``moerun.v1.control_pb2``), with attribute access. A missing or wrong token
raises :class:`~moerun.errors.UnauthenticatedError` with the server's message; any other error
answer raises its exception (e.g. :class:`~moerun.errors.InvalidArgumentError` for a plan
whose slots do not divide over the expert ranks). A request whose connection broke is sent once
more on a fresh connection (they are all read-only).

TLS (a job with ``serving.tls``, whose control endpoint then speaks TLS): ``tls_ca_file``
(else ``$MOERUN_TLS_CA_FILE``, as moectl), ``tls=True`` (the system's CA store) or an
``ssl.SSLContext``, and ``tls_server_name``, as :class:`moerun.client.Client` takes them.

Thread-safety: one call at a time per :class:`Control` (one per thread).
"""

import os
import ssl
import stat
import threading
import time
from typing import Optional, Union

from moerun import _frame
from moerun.client import _wait, connect_socket, tls_context
from moerun.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    MoerunError,
    UnavailableError,
    error_from_code,
)
from moerun.v1 import control_pb2

__all__ = ["Control", "read_token_file", "to_dict", "CONTROL_MAX_FRAME_BYTES"]

# The largest control frame the server reads (runtime/serving/control_endpoint.h).
CONTROL_MAX_FRAME_BYTES = 1 << 20


def _kubelet_secret(st: os.stat_result) -> bool:
    """A Kubernetes Secret volume with the pod's fsGroup (runtime/serving/control_auth.cc KubeletSecret)."""
    if st.st_uid != 0 or os.geteuid() == 0 or (st.st_mode & 0o077) != 0o040:
        return False
    return st.st_gid == os.getegid() or st.st_gid in os.getgroups()


def read_token_file(path: str) -> str:
    """The token in ``path`` (its first line, blanks stripped), as moectl and the server read
    it (runtime/serving/control_auth.cc). InvalidArgumentError if its group or others may read or write
    it (as moectl refuses it; the one exception is a Kubernetes Secret: owned by root, readable
    by its group only, read by a non-root process in that group), empty or unreadable."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise InvalidArgumentError(f"token file {path}: {e.strerror}") from None
    if st.st_mode & 0o077 and not _kubelet_secret(st):
        raise InvalidArgumentError(
            f"token file {path} has mode {stat.S_IMODE(st.st_mode):04o}: its group or others "
            "may read or write it; chmod 600 it")
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            line = f.readline()
    except OSError as e:
        raise InvalidArgumentError(f"token file {path}: {e.strerror}") from None
    token = line.strip(" \t\r\n")
    if not token:
        raise InvalidArgumentError(f"token file {path} is empty")
    return token


def to_dict(message) -> dict:
    """A Protobuf message as a dict, as ``moectl ... --json`` prints it (field names as in
    the .proto, fields at their default value included, 64-bit integers as strings)."""
    from google.protobuf import json_format

    try:
        return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                         including_default_value_fields=True)
    except TypeError:  # protobuf >= 26 renamed the option
        return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)


class Control:
    """A client of router 0's control endpoint (``serving.control_listen``).

    ``target``: ``"HOST:PORT"``. The token: ``token``, else the first line of ``token_file``,
    else of the file named by ``$MOERUN_TOKEN_FILE`` (as moectl); none: requests are sent
    without one (and refused). ``timeout``: seconds per request (connecting included).
    ``tls``, ``tls_ca_file`` (default ``$MOERUN_TLS_CA_FILE``), ``tls_server_name``: TLS, as
    :class:`moerun.client.Client`.
    """

    def __init__(self, target: str, *, token: Optional[str] = None,
                 token_file: Optional[str] = None, timeout: float = 10.0,
                 max_frame_bytes: int = _frame.DEFAULT_MAX_FRAME_BYTES,
                 tls: Union[None, bool, ssl.SSLContext] = None,
                 tls_ca_file: Optional[str] = None, tls_server_name: Optional[str] = None):
        from moerun.client import split_host_port

        split_host_port(target)
        if tls_ca_file is None and tls is None:
            tls_ca_file = os.environ.get("MOERUN_TLS_CA_FILE") or None
        self._tls = tls_context(tls, tls_ca_file)
        if tls_server_name is not None and self._tls is None:
            raise InvalidArgumentError("tls_server_name needs tls (or tls_ca_file)")
        self._tls_server_name = tls_server_name
        self.target = target
        if token is None:
            path = token_file or os.environ.get("MOERUN_TOKEN_FILE")
            token = read_token_file(path) if path else None
        self._token = token
        self.timeout = float(timeout)
        self.max_frame_bytes = int(max_frame_bytes)
        self._sock = None
        self._reader = None
        self._busy = threading.Lock()

    # --- the commands ------------------------------------------------------------------------

    def status(self) -> "control_pb2.StatusResponse":
        """Ranks, roles, hosts, experts, load and balancedness (``moectl status``)."""
        return self._result(control_pb2.ControlRequest(status=control_pb2.StatusRequest()),
                            "status")

    def stats(self) -> "control_pb2.StatsResponse":
        """Assignments per (layer, expert), since the start and in the window
        (``moectl stats``)."""
        return self._result(control_pb2.ControlRequest(stats=control_pb2.StatsRequest()),
                            "stats")

    def placement(self) -> "control_pb2.PlacementResponse":
        """The placement: ``version`` and ``json`` (the moerun-placement-v1 document;
        ``moectl placement show``)."""
        return self._result(
            control_pb2.ControlRequest(placement=control_pb2.PlacementRequest()), "placement")

    def plan(self, redundant: int = 0, policy: str = "", groups: int = 0,
             nodes: int = 0) -> "control_pb2.PlanResponse":
        """A dry run of the planner on the window's loads (``moectl placement plan``):
        ``redundant`` slots per layer (any count: where they do not divide over the expert
        ranks, the first ranks hold one more; default and eplb-global only), ``policy``
        ("default", "eplb-hierarchical", "eplb-global", "node-aware", "node-local"; "" =
        default), expert ``groups`` (0: the model's), ``nodes`` (0: the job's nodes).
        Nothing changes."""
        req = control_pb2.ControlRequest(plan=control_pb2.PlanRequest(
            redundant=int(redundant), policy=policy, groups=int(groups), nodes=int(nodes)))
        return self._result(req, "plan")

    def progress(self) -> "control_pb2.MigrationStatus":
        """The running or last migration (``moectl placement progress``; id 0: none yet)."""
        return self._result(
            control_pb2.ControlRequest(progress=control_pb2.ProgressRequest()), "migration")

    def call(self, request: "control_pb2.ControlRequest",
             retry: bool = False) -> "control_pb2.ControlResponse":
        """Sends any ControlRequest (its token is set here) and returns the ControlResponse
        as it is, errors included (``code``, ``message``). ``retry``: send it once more on a
        fresh connection if the connection broke (only for read-only requests)."""
        with self._guard():
            if self._token is not None:
                request.token = self._token
            try:
                return self._call_once(request)
            except (UnavailableError, OSError):
                self._close()
                if not retry:
                    raise
            return self._call_once(request)

    def close(self) -> None:
        """Closes the connection (a later call reconnects)."""
        self._close()

    def __enter__(self) -> "Control":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover
        try:
            self._close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"Control({self.target!r})"

    # --- internals ---------------------------------------------------------------------------

    def _guard(self):
        lock = self._busy

        class G:
            def __enter__(self_):
                if not lock.acquire(blocking=False):
                    raise RuntimeError("moerun.ctl.Control is used by one call at a time")

            def __exit__(self_, *exc):
                lock.release()

        return G()

    def _result(self, request, field: str):
        resp = self.call(request, retry=True)
        if resp.code != 0:
            raise error_from_code(resp.code, resp.message)
        if resp.WhichOneof("result") != field:
            raise InvalidArgumentError(
                f"{self.target}: the answer holds {resp.WhichOneof('result')!r}, not {field!r}")
        return getattr(resp, field)

    def _close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _call_once(self, request) -> "control_pb2.ControlResponse":
        deadline = time.monotonic() + self.timeout
        if self._sock is None:
            self._sock = connect_socket(self.target, self.timeout, self._tls,
                                        self._tls_server_name)
            self._reader = _frame.FrameReader(self.max_frame_bytes, False, self.target)
        sock = self._sock
        frame = _frame.encode_frame(request)
        if len(frame) - 4 > CONTROL_MAX_FRAME_BYTES:
            raise InvalidArgumentError(
                f"{self.target}: the request is {len(frame) - 4} bytes, over the control "
                f"endpoint's limit of {CONTROL_MAX_FRAME_BYTES} bytes (1 MiB) a frame: the server "
                "would refuse it (FRAME_TOO_LARGE)")
        parts = [frame]
        try:
            while parts:
                try:
                    parts = _frame.send_some(sock, parts)
                    continue
                except BlockingIOError as e:  # TLS: a write may have to read first
                    wants_read = getattr(e, "want_read", False)
                r, w = _wait(sock, wants_read, not wants_read, deadline - time.monotonic())
                if not (r or w):
                    raise DeadlineExceededError(f"{self.target}: request not sent within "
                                                f"{self.timeout:g} s")
            while True:
                r, _ = _wait(sock, True, False, deadline - time.monotonic())
                if not r:
                    raise DeadlineExceededError(f"{self.target}: no answer within "
                                                f"{self.timeout:g} s")
                try:
                    n = _frame.recv_some(sock, self._reader.get_buffer())
                except BlockingIOError:
                    continue
                if n == 0:
                    raise UnavailableError(f"{self.target}: connection closed by the server")
                frames = self._reader.update(n)
                if frames:
                    resp = control_pb2.ControlResponse()
                    _frame.parse_message(frames[0], resp)
                    return resp
        except MoerunError:
            self._close()  # out of step: a fresh connection for the next call
            raise
        except OSError as e:  # reset, broken pipe
            self._close()
            raise UnavailableError(f"{self.target}: connection closed by the server "
                                   f"({e.strerror or e})") from None
        except BaseException:
            self._close()
            raise
