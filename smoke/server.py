"""Start and stop `python -m sglang.launch_server` in its own process group."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from sglang_image_plugin.setting import AUTO, DEPTH_SCHEDULE_FLAG, THRESHOLD_FLAG, parse_schedule
from smoke import client
from smoke.deadline import Deadline

# Flags every smoke/bench server gets: seen working on the H200 with the slimmed bundle
# (no FA3 kernels -> triton attention; pytorch sampling and no grammar avoid more JIT compilation).
BASE_FLAGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch",
              "--grammar-backend", "none", "--random-seed", "0", "--log-level", "info")
EAGLE_STEPS = 3  # draft steps of a speculative step; top-k 1 verifies one token more
# The plugin's sources beside smoke/ (the repository's plugin/, the image smoke's mount of it): on
# this process's PYTHONPATH for the setting's contract (sglang_image_plugin.setting), never on a
# server's. Ahead of site-packages, that copy would shadow the plugin installed with the server's
# sglang (the image's, the GPU host's site), whose hooks and digests are the ones to test.
SOURCE_PLUGIN_DIR = Path(__file__).resolve().parents[1] / "plugin"
MARGIN_POLL_S = 0.2  # how often a server with a deadline looks whether its margin has come


def sglang_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of an sglang process started from here: this one's and `extra`, without the
    plugin's sources on PYTHONPATH (SOURCE_PLUGIN_DIR)."""
    env = dict(os.environ, **(extra or {}))
    entries = env.get("PYTHONPATH", "").split(os.pathsep)
    kept = [p for p in entries if Path(p or ".").resolve() != SOURCE_PLUGIN_DIR]
    if kept != entries:
        if any(kept):
            env["PYTHONPATH"] = os.pathsep.join(kept)
        else:
            env.pop("PYTHONPATH")
    return env


def launch_steps(schedule: str | None, steps: int = EAGLE_STEPS) -> int:
    """The draft steps an EAGLE-3 server launches with: `steps`, or a fixed depth schedule's deepest
    tier where that is deeper (the plugin refuses a tier deeper than the launch; `auto` learns
    among the launch's depths). A bad schedule raises the contract's ScheduleError."""
    if schedule is None or schedule.strip().lower() == AUTO:
        return steps
    return max(steps, parse_schedule(schedule).deepest)


def eagle_flags(steps: int = EAGLE_STEPS) -> tuple[str, ...]:
    """EAGLE-3 drafting `steps` tokens a request (top-k 1: a chain) and verifying steps + 1."""
    return ("--speculative-algorithm", "EAGLE3", "--speculative-num-steps", str(steps),
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(steps + 1))

# One server of this host starts at a time (Server.start holds both locks until healthy): sglang
# sizes a server's KV pool from the GPU memory free while it starts, so what a second server takes
# meanwhile comes out of that pool, down to none (the start fails). The file lock covers servers of
# other processes (two smoke runs side by side). Uncontended where servers run one by one.
STARTING = threading.Lock()
# The file the host-wide lock is taken on: this module, which every run of this installation
# shares and which always exists (a lock file of its own would be left behind in /tmp).
START_LOCK_FILE = Path(__file__)


@contextlib.contextmanager
def host_start_lock(timeout: float) -> Iterator[bool]:
    """Holds the host-wide start lock; yields False when it could not be had within `timeout` s."""
    with open(START_LOCK_FILE, "rb") as fh:
        end = time.time() + timeout
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.time() >= end:
                    yield False
                    return
                time.sleep(0.5)
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@functools.cache
def installed_sglang() -> tuple[int, ...]:
    """The release of the sglang this process would start (its distribution's version); () where
    none is installed (the flags are then 0.5.17's)."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


def cuda_graph_max_bs_flag(release: tuple[int, ...]) -> str:
    """The largest captured decode batch: `--cuda-graph-max-bs` until 0.5.17; later releases split
    it per phase, and the old spelling is an ambiguous prefix there."""
    return "--cuda-graph-max-bs" if release <= (0, 5, 17) else "--cuda-graph-max-bs-decode"


@dataclass
class ServerConfig:
    name: str
    model: Path
    draft: Path | None = None          # EAGLE-3 when set
    spec_steps: int = EAGLE_STEPS      # its draft steps (a chain: steps + 1 tokens verified); a
    # schedule's deeper tier raises them to its depth (launch_steps)
    threshold: int | str | None = None  # the threshold flag (N or auto)
    schedule: str | None = None        # the depth schedule flag (LOW-HIGH:DEPTH,...), instead of it
    overlap: bool = True               # False -> --disable-overlap-schedule
    cuda_graph: bool = True
    cuda_graph_max_bs: int | None = 64  # None: the server's own default
    max_running: int | None = 64       # None: the server's own default
    mem_fraction: float = 0.15
    enable_metrics: bool = True
    extra: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()         # CPU affinity of the server's processes (none: the OS's choice)
    release: tuple[int, ...] | None = None  # the sglang release's flags (None: the installed one)

    def __post_init__(self) -> None:
        if self.draft is not None:
            self.spec_steps = launch_steps(self.schedule, self.spec_steps)

    def argv(self, port: int) -> list[str]:
        a = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model),
             "--host", "127.0.0.1", "--port", str(port), "--mem-fraction-static", str(self.mem_fraction),
             *BASE_FLAGS]
        if self.max_running is not None:
            a += ["--max-running-requests", str(self.max_running)]
        if self.cuda_graph and self.cuda_graph_max_bs is not None:
            release = self.release if self.release is not None else installed_sglang()
            a += [cuda_graph_max_bs_flag(release), str(self.cuda_graph_max_bs)]
        elif not self.cuda_graph:
            a += ["--disable-cuda-graph"]
        if self.draft is not None:
            a += [*eagle_flags(self.spec_steps), "--speculative-draft-model-path", str(self.draft)]
        if self.threshold is not None:
            a += [THRESHOLD_FLAG, str(self.threshold)]
        if self.schedule is not None:
            a += [DEPTH_SCHEDULE_FLAG, self.schedule]
        if not self.overlap:
            a += ["--disable-overlap-schedule"]
        if self.enable_metrics:
            a += ["--enable-metrics"]
        return a + list(self.extra)


@contextlib.contextmanager
def pinned(cpus: tuple[int, ...]) -> Iterator[None]:
    """The calling thread confined to these CPUs meanwhile (nothing where empty): a process it starts
    inherits them, and so does every process that one starts (Linux affinity is per thread)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def group_pids(pgid: int) -> list[int]:
    """The running processes of group `pgid` (Linux /proc); zombies (no memory left, reaped by
    whoever adopted them) do not count."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if int(pgrp) == pgid and state != "Z":
            pids.append(int(stat.parent.name))
    return sorted(pids)


def group_running(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (group_pids)."""
    return bool(group_pids(pgid))


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


class Server:
    """A server process in its own session (setsid): stopping kills the whole group. With a
    deadline, the group is killed at its margin (kill_at_margin)."""

    def __init__(self, cfg: ServerConfig, port: int, log_path: Path, deadline: Deadline | None = None):
        self.cfg, self.port, self.log_path, self.deadline = cfg, port, log_path, deadline
        self.base = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None  # None when attached (another process started it)
        self.pgid: int | None = None
        self.t_launch = 0.0
        self.start_seconds = 0.0
        # where this process's output begins in log_path: the file keeps earlier servers' output
        # (a failed start's stays readable), and their errors are not this one's
        self.log_offset = 0

    def start(self, timeout: float) -> None:
        """Starts the server and waits until it is healthy: `timeout` s in all, the wait for another
        server's start (STARTING) included. For servers whose KV pool is not fixed up front: one
        at a time, see STARTING (one whose pool is fixed, with a memory share that holds it
        whatever the others take meanwhile, may spawn() at once and wait_healthy())."""
        t_call = time.time()
        with STARTING, host_start_lock(timeout) as locked:
            left = timeout - (time.time() - t_call)
            if not locked or left <= 0:
                raise SmokeError(f"{self.cfg.name}: no time left to start after waiting "
                                 f"{time.time() - t_call:.0f}s for another server's start")
            self._start(left, waited=time.time() - t_call)

    def _start(self, timeout: float, waited: float = 0.0) -> None:
        self.spawn()
        self.wait_healthy(timeout, waited)

    def spawn(self) -> None:
        """launch(), its process group recorded in SMOKE_SERVER_PIDFILE (where set): a later run
        kills the group if this one is killed before stop(). wait_healthy() waits for it."""
        self.launch()
        pidfile = os.environ.get("SMOKE_SERVER_PIDFILE")
        if pidfile:
            with open(pidfile, "a") as fh:
                fh.write(f"{self.pgid}\n")

    def launch(self) -> None:
        """Spawns the server in a process session of its own (it outlives this process unless
        stopped) and returns at once; wait_healthy() waits for it."""
        for _ in range(30):
            if port_free(self.port):
                break
            time.sleep(1)
        else:
            raise SmokeError(f"{self.cfg.name}: port {self.port} is still in use before the start")
        env = sglang_env(self.cfg.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.log_offset = log.tell()
            log.write(("$ " + " ".join(self.cfg.argv(self.port)) + "\n").encode())
            log.flush()
            self.t_launch = time.time()
            with pinned(self.cfg.cpus):
                self.proc = subprocess.Popen(self.cfg.argv(self.port), stdout=log,
                                             stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        if self.deadline is not None:
            threading.Thread(target=self.kill_at_margin, args=(self.pgid,), daemon=True,
                             name=f"margin-{self.cfg.name}").start()

    def kill_at_margin(self, pgid: int) -> None:
        """Until this server stops: at the deadline's margin its group is killed, so that whatever a
        run on it waits for (a request, a wait for the pool, a stop's grace) fails at once and the
        run ends, its server stopped and its report written, before the deadline. Bounding each
        step by the deadline was not enough: past the margin each request still got MIN_REQUEST_S,
        one after the other, and each wait its 30 s (a GPU run went 40 s past its deadline)."""
        while self.pgid == pgid:
            if self.past_margin():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                return
            time.sleep(MARGIN_POLL_S)

    def past_margin(self) -> bool:
        """Whether its deadline's margin has come: the server is killed there, and a request whose
        timeout the deadline set ends then too, so that what failed since failed of that."""
        return self.deadline is not None and self.deadline.left_for_requests() <= 0

    def wait_healthy(self, timeout: float, waited: float = 0.0) -> None:
        """Until /health answers; a server that exits or stays unhealthy raises with its log."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if not self.alive():
                code = f" with code {self.proc.returncode}" if self.proc is not None else ""
                raise SmokeError(f"{self.cfg.name}: server exited{code} before it became healthy",
                                 log=self.log_path)
            if client.healthy(self.base):
                self.start_seconds = time.time() - (self.t_launch or t0)
                return
            time.sleep(2)
        # a timeout mostly spent waiting for another run's server reads otherwise as a slow start
        after_wait = f" (after {waited:.0f}s waiting for another server's start)" if waited >= 1 else ""
        raise SmokeError(f"{self.cfg.name}: not healthy after {timeout:.0f}s{after_wait}", log=self.log_path)

    def log_text(self) -> str:
        """This server's output so far: its log from its own launch on (see log_offset)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_offset)
                return log.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    @classmethod
    def attach(cls, cfg: ServerConfig, port: int, log_path: Path, pgid: int) -> Server:
        """A server that an earlier process started (launch()) and left running: stop() ends it."""
        srv = cls(cfg, port, log_path)
        srv.pgid = pgid
        return srv

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self.pgid is not None and group_running(self.pgid)

    def stop(self) -> None:
        if self.pgid is None:
            return
        pgid = self.pgid
        # TERM gives the server time to shut down; KILL then takes what is left of the group
        # (scheduler and detokenizer children).
        for sig, grace_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
            if self.proc is not None:
                try:
                    self.proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    pass
            else:  # attached: not our child, nothing to reap; wait for the group to go
                end = time.time() + grace_s
                while time.time() < end and group_running(pgid):
                    time.sleep(0.2)
        # the scheduler children hold the GPU memory: a server started next (an A/B restart) sizes
        # its KV pool from what is free, so wait until the whole group is gone
        for _ in range(60):
            if not group_running(pgid):
                break
            time.sleep(0.5)
        for _ in range(30):
            if port_free(self.port):
                break
            time.sleep(1)
        self.proc = None
        self.pgid = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SmokeError(Exception):
    """A smoke check failed: `cause` says which and why; `log` is the server log to show the tail of.

    Defined here, beside the server whose log it shows; the smoke's runs (smoke.runner, smoke.variant_runs) raise it too. The host's `nox -s smoke` reports the same failure as `sglang_image.errors.SmokeError` (exit code
    9): this package runs inside the image and on a bare GPU host, where that package is absent.
    """

    def __init__(self, cause: str, *, log: Path | None = None):
        super().__init__(cause)
        self.cause = cause
        self.log = log

    def render(self, lines: int = 40) -> str:
        out = f"SMOKE FAILED: {self.cause}"
        if self.log is not None:
            out += f"\n--- tail of {self.log} ---\n{log_tail(self.log, lines)}"
        return out


def log_tail(path: Path | None, lines: int = 40, width: int = 400) -> str:
    if path is None or not Path(path).is_file():
        return "(no server log)"
    text = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(line[:width] for line in text[-lines:])
