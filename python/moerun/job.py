"""A local `moerun serve` job, started and stopped from Python (examples, benchmarks, tests).

    with moerun.job.LocalJob("tests/data/hf-moe/qwen3_moe", ranks=4, routers=2) as job:
        with moerun.Client(job.targets) as c:
            y = c.infer(x)

LocalJob writes a config for the model folder, starts `mpirun -np RANKS moerun serve` (or with
transport="inproc" one process whose ranks are threads) on free local ports with a control token
and a ready file, waits for the ready file (and for every router's port) within `ready_timeout`,
and on exit ALWAYS stops the whole job, also when the block raised: SIGTERM to its process group
(mpirun is started in a session of its own), SIGKILL after a grace period, then SIGKILL to any
process still carrying the job's MOERUN_JOB_TAG (ranks that escaped the group). The log stays
readable (job.log()) after the stop; the work folder is removed (kept with MOERUN_KEEP_WORK=1).
Errors (no mpirun, no moerun binary, the job exiting or not getting ready in time) raise
RuntimeError with the job's log tail.
"""

import atexit
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Union

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def find_binary(name: str) -> str:
    """$MOERUN_BUILD_DIR/bin/NAME, the folder of $MOERUN_BIN, this checkout's build/bin/NAME, or
    NAME on PATH (an installed moerun)."""
    candidates = []
    if os.environ.get("MOERUN_BUILD_DIR"):
        candidates.append(os.path.join(os.environ["MOERUN_BUILD_DIR"], "bin", name))
    if os.environ.get("MOERUN_BIN"):
        candidates.append(os.path.join(os.path.dirname(os.environ["MOERUN_BIN"]), name))
    candidates.append(os.path.join(_ROOT, "build", "bin", name))
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(f"{name} not found (looked in {', '.join(candidates)} and PATH)")


def _ports_free(ports: Sequence[int]) -> bool:
    held = []
    try:
        for p in ports:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", p))
        return True
    except OSError:
        return False
    finally:
        for s in held:
            s.close()


def pick_port_block(n: int, rng=None) -> int:
    """The first of n consecutive ports free now, below the ephemeral range (so that no
    outgoing connection takes one meanwhile)."""
    import random

    rng = rng or random.SystemRandom()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - n)
        if _ports_free(range(base, base + n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports found")


def free_port() -> int:
    """A port nothing listens on now (bound to port 0 and released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _yaml(value, indent: int = 0) -> str:
    """A tiny YAML writer for config dicts (scalars, lists of scalars, nested dicts)."""
    lines = []
    pad = "  " * indent
    for k, v in value.items():
        if isinstance(v, dict):
            lines.append(f"{pad}{k}:")
            lines.append(_yaml(v, indent + 1))
        elif isinstance(v, (list, tuple)):
            lines.append(f"{pad}{k}: [{', '.join(_scalar(x) for x in v)}]")
        else:
            lines.append(f"{pad}{k}: {_scalar(v)}")
    return "\n".join(lines)


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v)
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _die_with_parent() -> None:  # in the child, before exec
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


_LIVE: "set[LocalJob]" = set()


@atexit.register
def _stop_all():  # a test run interrupted hard still leaves no job behind
    for job in list(_LIVE):
        job.stop()


class LocalJob:
    """A `moerun serve` job on this machine.

    Parameters: ``model`` (a model folder), ``ranks``, ``routers`` (router i serves on
    serving port + i), ``transport`` ("mpi" under mpirun, "ucx", or "inproc": one process),
    ``layers`` (model layer indices, or "all": every MoE layer of the model), ``placement``,
    ``microbatch_tokens``, ``deadline_ms``, ``batching`` and ``serving`` (dicts of those config
    sections' keys, e.g. ``serving={"max_frame_bytes": 1 << 20}``), ``config`` (more top-level
    keys), ``ready_timeout`` (s), ``mpirun_args``, ``env`` (more environment),
    ``kill_with_parent`` (Linux: mpirun gets SIGTERM when the thread that started it dies, so
    that even a SIGKILLed test run leaves no job behind; start jobs from a thread that lives as
    long as they do, e.g. the main thread), ``serving_key_file``
    (``moerun serve --serving-key-file``: every request must carry that file's key).

    Attributes once started: ``target`` (router 0's serving address), ``targets`` (every
    router's), ``control`` (router 0's control endpoint), ``token_file``, ``token``,
    ``metrics`` (every rank's HTTP address), ``config_path``, ``work``, ``proc`` (the mpirun or
    moerun process); ``log()`` the job's output; ``rank_pids(r)`` the pids of rank r's process.
    """

    def __init__(self, model: str, *, ranks: int = 4, routers: int = 1, transport: str = "mpi",
                 layers: Union[str, Sequence[int]] = (0,), placement: str = "round_robin",
                 microbatch_tokens: int = 32, deadline_ms: int = 10000,
                 batching: Optional[Dict] = None, serving: Optional[Dict] = None,
                 config: Optional[Dict] = None, ready_timeout: float = 60.0,
                 mpirun_args: Sequence[str] = (), env: Optional[Dict[str, str]] = None,
                 kill_with_parent: bool = True, serving_key_file: Optional[str] = None):
        self.model = os.path.abspath(model)
        self.ranks = int(ranks)
        self.routers = int(routers)
        self.transport = transport
        if isinstance(layers, str):
            if layers != "all":
                raise ValueError(f"layers: a list of layer indices or \"all\", not {layers!r}")
            self.layers: Union[str, List[int]] = "all"
        else:
            self.layers = [int(n) for n in layers]
        self.placement = placement
        self.microbatch_tokens = microbatch_tokens
        self.deadline_ms = deadline_ms
        self.batching = {"max_batch_tokens": 256, "max_wait_us": 500, **(batching or {})}
        self.serving = dict(serving or {})
        self.config = dict(config or {})
        self.ready_timeout = float(ready_timeout)
        self.mpirun_args = list(mpirun_args)
        self.env = dict(env or {})
        self.kill_with_parent = kill_with_parent
        self.serving_key_file = serving_key_file
        self.proc: Optional[subprocess.Popen] = None
        self.work: Optional[str] = None
        self.tag = f"moerun-job-{os.getpid()}-{secrets.token_hex(6)}"
        self.target = ""
        self.targets: List[str] = []
        self.control = ""
        self.metrics: List[str] = []
        self.token = ""
        self.token_file = ""
        self.config_path = ""
        self._log_text: Optional[str] = None
        self._log_path = ""

    # --- life cycle -------------------------------------------------------------------------

    def __enter__(self) -> "LocalJob":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "LocalJob":
        """Starts the job and waits until it is ready; RuntimeError with the log's tail if it
        exits or is not ready within ready_timeout (it is stopped then)."""
        try:
            moerun = find_binary("moerun")
        except FileNotFoundError as e:
            raise RuntimeError(str(e)) from e
        self.work = tempfile.mkdtemp(prefix="moerun-job.")
        self.token = "tok-" + secrets.token_hex(16)
        self.token_file = os.path.join(self.work, "token")
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token + "\n")
        self._log_path = os.path.join(self.work, "serve.log")
        self._log_text = None
        _LIVE.add(self)
        last = ""
        try:
            for _attempt in range(3):  # a port taken between the check and the bind: again
                last = self._start_once(moerun)
                if not last:
                    return self
                if "in use" not in last.lower():
                    break
            raise RuntimeError(last)
        except BaseException:
            self.stop()
            raise

    def _start_once(self, moerun: str) -> str:
        n = self.routers + self.ranks + 1
        base = pick_port_block(n)
        serve, metrics, control = base, base + self.routers, base + self.routers + self.ranks
        cfg = {
            "model": self.model,
            "layers": self.layers,
            "routers": self.routers,
            "placement": self.placement,
            "microbatch_tokens": self.microbatch_tokens,
            "deadline_ms": self.deadline_ms,
        }
        if self.transport == "inproc":
            cfg["ranks"] = self.ranks
        cfg.update(self.config)
        cfg["batching"] = dict(self.batching)
        if self.serving:
            cfg["serving"] = dict(self.serving)
        self.config_path = os.path.join(self.work, "config.yaml")
        with open(self.config_path, "w") as f:
            f.write(_yaml(cfg) + "\n")
        ready = os.path.join(self.work, "ready")
        if os.path.exists(ready):
            os.unlink(ready)
        cmd = [moerun, "serve", "--config", self.config_path, "--transport", self.transport,
               "--listen", f"127.0.0.1:{serve}", "--control-listen", f"127.0.0.1:{control}",
               "--metrics-listen", f"127.0.0.1:{metrics}", "--token-file", self.token_file,
               "--ready-file", ready]
        if self.serving_key_file:
            cmd += ["--serving-key-file", self.serving_key_file]
        env = dict(os.environ)
        env.update(self.env)
        env["MOERUN_JOB_TAG"] = self.tag
        if self.transport != "inproc":
            mpirun = shutil.which("mpirun")
            if not mpirun:
                raise RuntimeError("mpirun not found (install openmpi-bin)")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "--mca",
                   "mpi_yield_when_idle", "1", "-np", str(self.ranks), "-x", "MOERUN_JOB_TAG",
                   *self.mpirun_args] + cmd
        self.target = f"127.0.0.1:{serve}"
        self.targets = [f"127.0.0.1:{serve + i}" for i in range(self.routers)]
        self.control = f"127.0.0.1:{control}"
        self.metrics = [f"127.0.0.1:{metrics + r}" for r in range(self.ranks)]
        with open(self._log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_die_with_parent if self.kill_with_parent
                                         else None)
        end = time.monotonic() + self.ready_timeout
        while not os.path.exists(ready):
            if self.proc.poll() is not None:
                tail = self.log()[-4000:]
                self._kill()
                return f"moerun serve exited ({self.proc.returncode}) before it was ready:\n{tail}"
            if time.monotonic() > end:
                tail = self.log()[-4000:]
                self._kill()
                return f"moerun serve was not ready within {self.ready_timeout:g} s:\n{tail}"
            time.sleep(0.05)
        for t in self.targets:  # every router listening (router 0 writes the ready file)
            host, port = t.rsplit(":", 1)
            while True:
                try:
                    socket.create_connection((host, int(port)), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > end or self.proc.poll() is not None:
                        tail = self.log()[-4000:]
                        self._kill()
                        return f"router at {t} does not listen:\n{tail}"
                    time.sleep(0.05)
        return ""

    def tagged_pids(self) -> List[int]:
        """Every process carrying this job's MOERUN_JOB_TAG (mpirun, orted, ranks)."""
        want = f"MOERUN_JOB_TAG={self.tag}".encode()
        out = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if want in f.read().split(b"\0"):
                        out.append(int(name))
            except OSError:
                continue
        return out

    def rank_pids(self, rank: int) -> List[int]:
        """The pid(s) of rank ``rank``'s moerun process (mpi/ucx transports)."""
        want = f"OMPI_COMM_WORLD_RANK={rank}".encode()
        out = []
        for pid in self.tagged_pids():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv0 = f.read().split(b"\0")[0]
            except OSError:
                continue
            if want in env and os.path.basename(argv0) == b"moerun":
                out.append(pid)
        return out

    def _kill(self, grace: float = 5.0) -> None:
        proc = self.proc
        if proc is not None:
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            try:  # the group's other members (ranks whose launcher is gone)
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in self.tagged_pids():
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass

    def stop(self) -> Optional[int]:
        """Stops everything the job started (idempotent); mpirun's exit code."""
        self._kill()
        if self._log_text is None and self._log_path:
            self._log_text = self._read_log()
        if self.work and not os.environ.get("MOERUN_KEEP_WORK"):
            shutil.rmtree(self.work, ignore_errors=True)
            self.work = None
        _LIVE.discard(self)
        return None if self.proc is None else self.proc.returncode

    def _read_log(self) -> str:
        try:
            with open(self._log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def log(self) -> str:
        """The job's output (stdout and stderr of every rank) so far, also after stop()."""
        if self._log_text is not None:
            return self._log_text
        return self._read_log() if self._log_path else ""

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __repr__(self) -> str:
        return (f"LocalJob({os.path.basename(self.model)}, ranks={self.ranks}, "
                f"routers={self.routers}, target={self.target})")


# The name the tests use.
ServeJob = LocalJob
