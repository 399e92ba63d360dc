"""Find a Docker engine, or start one (Debian's docker.io) for tests and for machines without one.

`connect()` only finds: the build never starts daemons behind a user's back, it says how.
`ensure_engine()` finds or starts: tests, CI and `python -m sglang_image.docker_engine start` use it.
The flags are those seen working on a container-less, systemd-less Debian 12 host (no bridge, no
iptables, cgroupfs): builds and runs then have `network_mode="none"` or `"host"` only.
`import_debootstrap_base()` makes a base image without any image hub (tests, local full builds).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors
from docker import DockerClient

from sglang_image.errors import BuildError, DockerUnavailableError, SglangImageError
from sglang_image.pins import REPO_ROOT

# Short paths: dockerd's unix sockets (containerd, netns) break beyond ~100 characters.
DEFAULT_STATE = Path(os.environ.get("SGLANG_IMAGE_DOCKER_STATE", REPO_ROOT / ".cache" / "docker"))


def exec_root(state: Path) -> Path:
    """dockerd's exec root: short (unix socket paths) and one per state dir (two daemons
    cannot share one)."""
    return Path("/tmp") / f"sgl-dockerd-{hashlib.sha256(str(state.resolve()).encode()).hexdigest()[:8]}"

START_HINT = ("start one: `python -m sglang_image.docker_engine start` (Debian: apt-get install -y "
              "docker.io first) and export the DOCKER_HOST it prints, or point DOCKER_HOST at a "
              "running engine")


@dataclass
class Engine:
    client: DockerClient
    host: str
    pid: int | None = None  # set when we started dockerd: stop() ends only that process
    state: Path | None = None

    def stop(self) -> None:
        if self.pid is None:
            return
        self.client.close()
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        for _ in range(100):
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        # dockerd leaves its default network namespace mounted.
        assert self.state is not None
        subprocess.run(["umount", str(exec_root(self.state) / "netns" / "default")], check=False,
                       capture_output=True)
        self.pid = None


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


def dockerd_argv(state: Path) -> list[str]:
    """The daemon command line (pure: tested without Docker)."""
    return ["dockerd", "--data-root", str(state / "data"), "--exec-root", str(exec_root(state)),
            "--pidfile", str(state / "dockerd.pid"), "-H", f"unix://{state / 'docker.sock'}",
            "--storage-driver=overlay2", "--iptables=false", "--ip6tables=false",
            "--bridge=none", "--exec-opt", "native.cgroupdriver=cgroupfs"]


def start_dockerd(state: Path = DEFAULT_STATE, timeout: float = 60) -> Engine:
    """Starts dockerd in the background with its state under `state`; returns when it answers."""
    if shutil.which("dockerd") is None:
        raise DockerUnavailableError("no Docker engine answers and dockerd is not installed; "
                                     "install it: apt-get install -y docker.io")
    state.mkdir(parents=True, exist_ok=True)
    pidfile = state / "dockerd.pid"
    if pidfile.exists():  # a daemon of a killed session: its pidfile would stop a new one
        try:
            os.kill(int(pidfile.read_text().strip()), 0)
        except (ProcessLookupError, ValueError):
            pidfile.unlink()
    log = (state / "dockerd.log").open("ab")
    proc = subprocess.Popen(dockerd_argv(state), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    host = f"unix://{state / 'docker.sock'}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DockerUnavailableError(f"dockerd exited with {proc.returncode}; see "
                                         f"{state / 'dockerd.log'}")
        client = _try(host, timeout=600)
        if client is not None:
            return Engine(client, host, proc.pid, state)
        time.sleep(0.3)
    proc.terminate()
    raise DockerUnavailableError(f"dockerd did not answer within {timeout:.0f}s; see "
                                 f"{state / 'dockerd.log'}")


def ensure_engine(state: Path = DEFAULT_STATE) -> Engine:
    """An engine that answers, started under `state` when none does (Engine.pid says so)."""
    try:
        return connect(state)
    except DockerUnavailableError:
        return start_dockerd(state)


# --- a base image without an image hub ---------------------------------------------------------

# Runtime libraries of a CPython built on Debian 12 (pyenv), so it runs in a minbase root.
PYTHON_RUNTIME_DEBS = ("ca-certificates", "libssl3", "libffi8", "libsqlite3-0", "libbz2-1.0",
                       "liblzma5", "libreadline8", "zlib1g", "libncursesw6", "libuuid1",
                       "libexpat1", "libgdbm6", "libtirpc3", "libnsl2", "libcrypt1")


def find_local_python(version: str) -> Path | None:
    """A CPython `version` installation prefix on this host (pyenv's), or None."""
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found = sorted(pyenv_root.glob(f"versions/{version}.*"),
                   key=lambda p: [int(x) for x in p.name.split(".") if x.isdigit()])
    found = [p for p in found if (p / "bin" / f"python{version}").exists()]
    return found[-1] if found else None


def import_debootstrap_base(client: DockerClient, tag: str, *, python_version: str | None = None,
                            extra_debs: tuple[str, ...] = (), suite: str = "bookworm") -> str:
    """Imports `debootstrap --variant=minbase <suite>` plus a Python as image `tag`; returns its id.

    python_version None: Debian's python3. "3.12": the host's pyenv CPython copied to /usr/local,
    the layout of the official python images (which this stands in for, as no hub is reachable).
    """
    if shutil.which("debootstrap") is None:
        raise BuildError("debootstrap is not installed: apt-get install -y debootstrap")
    debs = list(extra_debs)
    prefix = None
    if python_version is None:
        debs += ["python3", "python3-venv"]
    else:
        prefix = find_local_python(python_version)
        if prefix is None:
            raise BuildError(f"no CPython {python_version} on this host to copy into the base "
                             f"(looked in pyenv); install one: pyenv install {python_version}")
        debs += PYTHON_RUNTIME_DEBS
    with tempfile.TemporaryDirectory(prefix="sgl-base-") as tmp:
        root = Path(tmp) / "root"
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(debs)}", suite, str(root),
               os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"debootstrap failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                             f"{proc.stderr[-2000:]}")
        if prefix is not None:
            _copy_python(prefix, root / "usr" / "local", python_version or "")
        # Apt's lists and caches are host state, not part of a base image.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(root / junk, ignore_errors=True)
        tar_path = Path(tmp) / "root.tar"
        with tarfile.open(tar_path, "w") as tar:
            tar.add(root, arcname=".")
        repo, _, version = tag.rpartition(":")
        client.api.import_image(src=str(tar_path), repository=repo or version,
                                tag=version if repo else "latest", changes=['CMD ["/bin/bash"]'])
    return str(client.images.get(tag).id)


def _copy_python(prefix: Path, dest: Path, version: str) -> None:
    """Copies a CPython prefix without its third-party packages (pip comes from ensurepip)."""
    def ignore(directory: str, names: list[str]) -> set[str]:
        skip = {"__pycache__", "test", "idlelib", "tkinter", "turtledemo"}
        if directory.endswith("site-packages"):
            return set(names) - {"README.txt"}
        return {n for n in names if n in skip}

    for sub in ("bin", "lib", "include"):
        shutil.copytree(prefix / sub, dest / sub, symlinks=True, ignore=ignore, dirs_exist_ok=True)
    bindir = dest / "bin"
    for script in list(bindir.iterdir()):  # pyenv's pip/idle scripts point at the old prefix
        if not script.name.startswith("python") or script.name.endswith("-config"):
            script.unlink()
    for link in ("python", "python3"):
        (bindir / link).unlink(missing_ok=True)
        (bindir / link).symlink_to(f"python{version}")
    # ld.so finds libpython in /usr/local/lib once the cache knows it.
    (dest.parent.parent / "etc" / "ld.so.conf.d").mkdir(parents=True, exist_ok=True)
    subprocess.run(["ldconfig", "-r", str(dest.parent.parent)], check=False, capture_output=True)


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_image.docker_engine",
                                     description="Find or start a Docker engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start dockerd in the background unless one answers")
    start.add_argument("--state", type=Path, default=DEFAULT_STATE)
    base = sub.add_parser("base", help="import a debootstrap base image (no image hub needed)")
    base.add_argument("--tag", required=True)
    base.add_argument("--python", dest="python_version", help="copy the host's CPython X.Y")
    base.add_argument("--deb", action="append", default=[], help="extra Debian package")
    args = parser.parse_args(argv)
    try:
        if args.command == "start":
            engine = ensure_engine(args.state)
            how = f"started, pid {engine.pid}" if engine.pid else "already running"
            print(f"# Docker engine {how}\nexport DOCKER_HOST={engine.host}")
        else:
            engine = connect()
            image_id = import_debootstrap_base(engine.client, args.tag, python_version=
                                               args.python_version, extra_debs=tuple(args.deb))
            print(f"{args.tag} {image_id}")
    except SglangImageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
