"""Table of contents of the project: each session is one command of the sglang_image package.

    nox -s build                 build the default flavor's image (nox -s build -- --help)
    nox -s tests                 run the test suite (starts its own Docker engine if needed)
    nox -s tests -- -m "not docker"   the quick subset: no engine, no image build
    nox -l                       list everything
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import nox

nox.needs_version = ">=2025.2.9"
nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"
# A session's venv is made once and kept (`nox --reuse-venv=no` makes it anew): a
# second command starts in about a second instead of reinstalling.
nox.options.reuse_venv = "yes"

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")


def _install(session: nox.Session, *groups: str, extra: tuple[str, ...] = ()) -> None:
    """Installs the project (editable) and the groups' requirements, unless the kept venv already
    holds exactly these: a stamp in the venv records what was installed last. With --no-venv
    (this Python as it is, as the tests run a session) nothing is installed."""
    if session.venv_backend == "none":
        return
    requirements = ["-e", ".", *(r for g in groups for r in nox.project.dependency_groups(PYPROJECT, g)),
                    *extra]
    stamp = Path(str(session.virtualenv.location)) / ".sglang-image-installed"
    key = hashlib.sha256(json.dumps([requirements, PYPROJECT["project"], PYPROJECT["build-system"],
                                     PYPROJECT["tool"]["setuptools"],  # the packages installed
                                     (ROOT / "VERSION").read_text()]).encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == key:
        session.log("requirements unchanged since the last install: nothing to install")
        return
    stamp.unlink(missing_ok=True)
    session.install(*requirements)
    stamp.write_text(key)


def _run(session: nox.Session, *command: str) -> None:
    """`python -m sglang_image COMMAND`; nox exits with the command's own code (the README's
    table), not nox's 1 for every failed session."""
    try:
        session.run("python", "-m", "sglang_image", *command, *session.posargs)
    except nox.command.CommandFailed as exc:
        raise SystemExit(exc.return_code or 1) from None


@nox.session(default=False)
def build(session: nox.Session) -> None:
    """Build the image of a flavor from pinned, hash-checked wheels (-- --flavor F --tag T --no-cache)."""
    _install(session)
    _run(session, "build")


@nox.session(default=False)
def engine(session: nox.Session) -> None:
    """Start the project's own Docker engine where none answers (prints its DOCKER_HOST), or stop it (-- stop)."""
    _install(session)
    _run(session, "engine")


@nox.session(default=False)
def base(session: nox.Session) -> None:
    """Make a base image from Debian packages (debootstrap, g++, the flavor's Python) where no image hub is reachable (-- --flavor F)."""
    _install(session)
    _run(session, "base")


@nox.session(default=False)
def smoke(session: nox.Session) -> None:
    """Start the server in the built image with a threshold and prove the output (-- --image T --threshold N|--schedule S)."""
    _install(session)
    _run(session, "smoke")


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite: real wheels, a real Docker engine (started when none answers), no GPU."""
    _install(session, "test")
    session.run("pytest", *session.posargs)


@nox.session(default=False)
def patches(session: nox.Session) -> None:
    """Apply every flavor's patch series to its real wheels with zero fuzz (-- edit|export F, rebase FROM TO [--continue])."""
    _install(session)
    _run(session, "patches")


@nox.session(name="plugin-check", default=False)
def plugin_check(session: nox.Session) -> None:
    """Check the plugin's hook targets and relied-on upstream code in an unpacked sglang wheel (-- --site-packages DIR)."""
    _install(session)
    _run(session, "plugin-check")


@nox.session(default=False)
def lock(session: nox.Session) -> None:
    """Regenerate the hash-pinned lock of a flavor (-- FLAVOR) with uv pip compile --generate-hashes."""
    _install(session, extra=("uv",))
    _run(session, "lock")


@nox.session(default=False)
def publish(session: nox.Session) -> None:
    """Push the smoke-tested image and its SBOM to a registry (-- --registry HOST[:PORT]/NAMESPACE)."""
    _install(session)
    _run(session, "publish")


@nox.session(default=False)
def deploy(session: nox.Session) -> None:
    """Write the Compose file and Kubernetes manifests of a published image (-- --digest sha256:... --registry HOST/NAMESPACE)."""
    _install(session)
    _run(session, "deploy")


@nox.session(name="gpu-e2e", default=False)
def gpu_e2e(session: nox.Session) -> None:
    """Prepare the wheel bundle for a GPU host without Docker and print the command to run there."""
    _install(session)
    _run(session, "gpu-e2e")


@nox.session(venv_backend="none", default=False)
def bench(session: nox.Session) -> None:
    """Tokens/s of plain, EAGLE-3, adaptive, threshold and auto servers of this Python's sglang on a GPU host (-- --models DIR [--out out/bench])."""
    # plugin/ on the path: the benchmark imports the speculation setting's contract from it (its
    # servers get this Python's own sglang and plugin: smoke.server.sglang_env)
    path = os.pathsep.join(p for p in (str(ROOT / "plugin"), os.environ.get("PYTHONPATH")) if p)
    session.run("python", "-m", "bench", "run", *session.posargs, env={"PYTHONPATH": path})


@nox.session(default=False)
def lint(session: nox.Session) -> None:
    """ruff over the code and tests, mypy --strict over src/, smoke/, bench/, the plugin and this file (light: no torch, no sglang)."""
    _install(session, "lint")
    session.run("ruff", "check", "src", "tests", "noxfile.py", "smoke", "bench", "plugin")
    session.run("mypy")
