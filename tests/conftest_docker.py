"""Docker fixtures: each engine the tests need, started here, and a hub-less base image.

Imported by tests/conftest.py (pytest_plugins). Two engines: Debian 12's docker.io (20.10) and a
current one (Debian 13's docker.io, 26.x: `tools/fetch-docker-engine` unpacks it under
.cache/engines/trixie). Each is started by the tests with its own data root, so the image tests
run on both and one test compares their digests. SGLANG_IMAGE_ENGINES=20.10 (or =current) picks
one. Outside CI a missing engine skips its tests; in CI (CI=true) that is a failure, so a broken
install cannot pass silently.
"""
from __future__ import annotations

import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from docker import DockerClient
from rich.console import Console

from sglang_image import base, build, docker_engine, pins, plan
from sglang_image.errors import SglangImageError

REPO_ROOT = pins.REPO_ROOT
CURRENT_DOCKERD = Path(os.environ.get("SGLANG_IMAGE_DOCKERD_CURRENT",
                                      REPO_ROOT / ".cache" / "engines" / "trixie" / "usr" / "sbin"
                                      / "dockerd"))
# name -> (dockerd to start, state dir): separate data roots, separate sockets.
ENGINES = {
    "20.10": ("dockerd", REPO_ROOT / ".cache" / "docker"),
    "current": (str(CURRENT_DOCKERD), REPO_ROOT / ".cache" / "docker-current"),
}
# The user-facing base (`nox -s base`): Debian 12 minbase, g++, and a CPython 3.12 copied from
# this host (Debian 12's own is 3.11). One root file system, loaded into every engine, so both
# start from one base image ID. Bump the suffix to make it again.
BASE_TAG = "localhost/sglang-image-test-base:bookworm-py3.12-2"
BASE_PYTHON = "3.12"


def _wanted_engines() -> list[str]:
    names = [n.strip() for n in os.environ.get("SGLANG_IMAGE_ENGINES", ",".join(ENGINES)).split(",")]
    return [n for n in names if n in ENGINES]


class _Engines:
    """Engines started on first use and stopped at the end of the session."""

    def __init__(self) -> None:
        self.started: dict[str, docker_engine.Engine] = {}
        self.light: dict[str, build.BuildResult] = {}

    def client(self, name: str) -> DockerClient:
        if name not in self.started:
            dockerd, state = ENGINES[name]
            running = docker_engine.connect_state(state)  # one a killed session left running
            if running is not None:
                self.started[name] = running
                return running.client
            if shutil.which(dockerd) is None:
                hint = ("apt-get install -y docker.io" if name == "20.10"
                        else "tools/fetch-docker-engine")
                if os.environ.get("CI"):
                    raise RuntimeError(f"engine {name}: {dockerd} is missing ({hint})")
                pytest.skip(f"engine {name}: {dockerd} is missing ({hint})")
            try:
                self.started[name] = docker_engine.start_dockerd(state, dockerd=dockerd)
            except SglangImageError as exc:
                if os.environ.get("CI"):
                    raise
                pytest.skip(f"engine {name}: {exc}")
        return self.started[name].client

    def stop(self) -> None:
        for engine in self.started.values():
            engine.stop()


@pytest.fixture(scope="session")
def engines() -> Iterator[_Engines]:
    registry = _Engines()
    try:
        yield registry
    finally:
        registry.stop()


@pytest.fixture(scope="session", params=_wanted_engines())
def engine_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# A build scenario whose outcome is the build's own logic (a rebuild without cache, a patch-only
# change, a patch that does not apply) runs once, on the first engine under test: each extra engine
# would cost a whole build. What depends on the engine (the light image each one builds, its
# digest, its layers, pushing it) runs on every engine, and test_one_commit_one_digest_on_every_engine
# compares the images the engines build.
one_engine = pytest.mark.parametrize("engine_name", _wanted_engines()[:1], indirect=True)


@pytest.fixture(scope="session")
def docker_client(engines: _Engines, engine_name: str) -> DockerClient:
    """A docker SDK client of the engine under test (started here, its own data root)."""
    return engines.client(engine_name)


@pytest.fixture(scope="session")
def docker_host(engines: _Engines, engine_name: str, docker_client: DockerClient) -> str:
    """DOCKER_HOST of the engine under test (for code that finds its engine itself)."""
    return engines.started[engine_name].host


@pytest.fixture(scope="session")
def base_rootfs() -> Path:
    """The test base's root file system (`nox -s base`'s code), made once and cached."""
    rootfs = REPO_ROOT / ".cache" / "base" / f"{BASE_TAG.rsplit(':', 1)[1]}.tar"
    if not rootfs.exists():
        if base.find_python(BASE_PYTHON) is None and not os.environ.get("CI"):
            pytest.skip(f"no CPython {BASE_PYTHON} on this host to put in the base")
        rootfs.parent.mkdir(parents=True, exist_ok=True)
        base.make_rootfs(rootfs, python_version=BASE_PYTHON, log=lambda _: None)
    return rootfs


def load_base(client: DockerClient, rootfs: Path) -> str:
    if not client.images.list(name=BASE_TAG):
        base.load_rootfs(client, rootfs, BASE_TAG, description="test base (nox -s base)")
    return BASE_TAG


@pytest.fixture(scope="session")
def debootstrap_base(docker_client: DockerClient, base_rootfs: Path) -> str:
    """Tag of the hub-less base in the engine under test."""
    return load_base(docker_client, base_rootfs)


def light_build(client: DockerClient, base_ref: str, tmp: Path, **kw: Any) -> build.BuildResult:
    """A light build (SGLang + patch targets + SBOM tool, no heavy dependencies) of the default
    flavor, its output under `tmp` (output_dir=, work_dir= to put them elsewhere)."""
    flavor = kw.pop("flavor", None) or pins.load_flavor(pins.DEFAULT_FLAVOR)
    opts = plan.BuildOptions(flavor=flavor, base=base_ref, light=True,
                              **{"output_dir": tmp / "out", "work_dir": tmp / "work", **kw})
    return build.build(opts, Console(file=io.StringIO()), client)


def light_image_on(engines: _Engines, name: str, rootfs: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> build.BuildResult:
    """The light image on engine `name`, built once a session, tagged sglang-image-test:light-a."""
    if name not in engines.light:
        client = engines.client(name)
        engines.light[name] = light_build(client, load_base(client, rootfs),
                                          tmp_path_factory.mktemp(f"light-{name}"),
                                          tag="sglang-image-test:light-a")
    return engines.light[name]


@pytest.fixture(scope="session")
def light_image(engines: _Engines, engine_name: str, base_rootfs: Path,
                tmp_path_factory: pytest.TempPathFactory) -> build.BuildResult:
    """The light image on the engine under test."""
    return light_image_on(engines, engine_name, base_rootfs, tmp_path_factory)
