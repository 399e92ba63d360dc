"""Find a Docker engine, or start one (Debian's docker.io) for tests and for machines without one.

One rule for every command that needs an engine (build, base, smoke, publish, and `nox -s engine`
itself): `ensure_engine()` finds one, or starts the project's own where none answers and says so
in one line, with how to stop it (`nox -s engine -- stop`). `connect()` only finds.
The flags are those seen working on a container-less, systemd-less Debian 12 host (no bridge, no
iptables, cgroupfs): builds and runs then have `network_mode="none"` or `"host"` only.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors
from docker import DockerClient

from sglang_image.errors import DockerUnavailableError, UsageError
from sglang_image.pins import REPO_ROOT, Flavor

# Short paths: dockerd's unix sockets (containerd, netns) break beyond ~100 characters.
DEFAULT_STATE = Path(os.environ.get("SGLANG_IMAGE_DOCKER_STATE", REPO_ROOT / ".cache" / "docker"))


def exec_root(state: Path) -> Path:
    """dockerd's exec root: short (unix socket paths) and one per state dir (two daemons
    cannot share one)."""
    return Path("/tmp") / f"sgl-dockerd-{hashlib.sha256(str(state.resolve()).encode()).hexdigest()[:8]}"

START_HINT = ("start one: `nox -s engine` (Debian: apt-get install -y docker.io first) and export "
              "the DOCKER_HOST it prints, or point DOCKER_HOST at a running engine")


def alive(pid: int) -> bool:
    """Whether process `pid` runs: a zombie (ended, not yet reaped by its parent) does not."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@dataclass
class Engine:
    client: DockerClient
    host: str
    pid: int | None = None  # set when we started dockerd: stop() ends only that process
    state: Path | None = None
    process: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        if self.pid is None:
            return
        self.client.close()
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        if self.process is not None:  # our child: wait reaps it (no zombie left behind)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        else:
            for _ in range(300):
                if not alive(self.pid):
                    break
                time.sleep(0.1)
        assert self.state is not None
        remove_exec_root(self.state, self.pid)
        self.pid = None


def remove_exec_root(state: Path, pid: int | None) -> None:
    """What an ended dockerd of `state` leaves in /tmp: its default network namespace, still
    mounted, and its exec root (kept while process `pid` still runs)."""
    runtime = exec_root(state)
    if not runtime.exists():
        return
    subprocess.run(["umount", str(runtime / "netns" / "default")], check=False,
                   capture_output=True)
    if pid is None or not alive(pid):
        shutil.rmtree(runtime, ignore_errors=True)


def _try(host: str | None, timeout: int = 10) -> DockerClient | None:
    try:
        client = docker.DockerClient(base_url=host, timeout=timeout) if host else \
            docker.from_env(timeout=timeout)
        client.ping()
        return client
    except (docker.errors.DockerException, OSError):
        return None


def _candidates(state: Path) -> list[str | None]:
    hosts: list[str | None] = [None]  # None: DOCKER_HOST or the default socket
    hosts.append(f"unix://{state / 'docker.sock'}")
    return hosts


def connect(state: Path = DEFAULT_STATE) -> Engine:
    """The first engine that answers: DOCKER_HOST, /var/run/docker.sock, then one we started."""
    for host in _candidates(state):
        client = _try(host, timeout=600)
        if client is not None:
            return Engine(client, host or os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock"))
    raise DockerUnavailableError(f"no Docker engine answers (DOCKER_HOST="
                                 f"{os.environ.get('DOCKER_HOST', 'unset')}); {START_HINT}")


def connect_state(state: Path) -> Engine | None:
    """The engine whose state is under `state` (started earlier by start_dockerd), if it answers.
    Its pid comes from the state's pidfile, so stop() ends it and removes its exec root as it
    does for an engine start_dockerd returned."""
    state = state.resolve()
    host = f"unix://{state / 'docker.sock'}"
    client = _try(host, timeout=600)
    if client is None:
        return None
    pidfile = state / "dockerd.pid"
    pid_text = pidfile.read_text().strip() if pidfile.is_file() else ""
    pid = int(pid_text) if pid_text.isdigit() and alive(int(pid_text)) else None
    return Engine(client, host, pid, state)


def dockerd_argv(state: Path, dockerd: str = "dockerd") -> list[str]:
    """The daemon command line: state under `state`, no bridge, no iptables (none needed: builds
    and runs use network_mode none or host)."""
    return [dockerd, "--data-root", str(state / "data"), "--exec-root", str(exec_root(state)),
            "--pidfile", str(state / "dockerd.pid"), "-H", f"unix://{state / 'docker.sock'}",
            "--storage-driver=overlay2", "--iptables=false", "--ip6tables=false",
            "--bridge=none", "--exec-opt", "native.cgroupdriver=cgroupfs"]


def start_dockerd(state: Path = DEFAULT_STATE, timeout: float = 60,
                  dockerd: str = "dockerd") -> Engine:
    """Starts `dockerd` (a name on PATH or a path) in the background with its state under
    `state`; returns when it answers."""
    state = state.resolve()  # the daemon's paths and socket must not depend on the cwd
    if shutil.which(dockerd) is None:
        raise DockerUnavailableError("no Docker engine answers and dockerd is not installed; "
                                     "install it: apt-get install -y docker.io")
    state.mkdir(parents=True, exist_ok=True)
    pidfile = state / "dockerd.pid"
    if pidfile.exists():  # a daemon of a killed session: its pidfile would stop a new one
        pid = pidfile.read_text().strip()
        if not (pid.isdigit() and alive(int(pid))):
            pidfile.unlink()
    log = (state / "dockerd.log").open("ab")
    # containerd, which dockerd starts, writes its goroutine dump to $TMPDIR when dockerd finds it
    # unhealthy (seen on a busy 2-core machine): under the state dir, not left in /tmp
    tmp = state / "tmp"
    tmp.mkdir(exist_ok=True)
    proc = subprocess.Popen(dockerd_argv(state, dockerd), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    host = f"unix://{state / 'docker.sock'}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DockerUnavailableError(f"dockerd exited with {proc.returncode}; see "
                                         f"{state / 'dockerd.log'}")
        client = _try(host, timeout=600)
        if client is not None:
            return Engine(client, host, proc.pid, state, proc)
        time.sleep(0.3)
    proc.terminate()
    raise DockerUnavailableError(f"dockerd did not answer within {timeout:.0f}s; see "
                                 f"{state / 'dockerd.log'}")


def ensure_engine(state: Path = DEFAULT_STATE,
                  log: Callable[[str], None] | None = None) -> Engine:
    """An engine that answers, started under `state` when none does (Engine.pid says so, and
    `log` gets started_note's line)."""
    try:
        return connect(state)
    except DockerUnavailableError:
        engine = start_dockerd(state)
    if log is not None:
        log(started_note(engine))
    return engine


STOP_HINT = "nox -s engine -- stop"


def started_note(engine: Engine) -> str:
    """The one line a command prints when it started the project's own engine."""
    return (f"no Docker engine answered: started the project's own (dockerd, pid {engine.pid}, "
            f"state in {engine.state}); it keeps running, stop it with: {STOP_HINT}")


def stop_dockerd(state: Path = DEFAULT_STATE, timeout: float = 30) -> int | None:
    """Stops the engine started under `state` (its pidfile) and removes what it left in /tmp;
    returns its pid, None if none runs."""
    pidfile = state.resolve() / "dockerd.pid"
    pid_text = pidfile.read_text().strip() if pidfile.is_file() else ""
    if not pid_text.isdigit() or not alive(int(pid_text)):
        remove_exec_root(state, None)  # of an engine that ended without being stopped
        return None
    pid = int(pid_text)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive(pid):
        raise DockerUnavailableError(f"dockerd (pid {pid}) did not stop within {timeout:.0f}s; "
                                     f"see {state / 'dockerd.log'}")
    remove_exec_root(state, pid)
    return pid


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """What `nox -s engine` was asked for; checked when made."""

    action: str = "start"  # start: unless one answers; stop: the one started under `state`
    state: Path = DEFAULT_STATE  # the engine's data, socket and log

    def __post_init__(self) -> None:
        if self.action not in ("start", "stop"):
            raise UsageError(f"engine action {self.action!r}: give start or stop")


def run(flavor: Flavor | None, options: EngineOptions) -> int:
    """`nox -s engine [start|stop]`: start the project's own engine unless one answers, and print
    the DOCKER_HOST to export; or stop the one started under `options.state`. One engine serves
    every flavor: `flavor` is None."""
    state = options.state
    if options.action == "stop":
        pid = stop_dockerd(state)
        print(f"stopped dockerd (pid {pid})" if pid else f"no engine runs under {state}")
        return 0
    engine = ensure_engine(state)
    how = f"started, pid {engine.pid}" if engine.pid else "already running"
    print(f"# Docker engine {how}\nexport DOCKER_HOST={engine.host}")
    return 0
