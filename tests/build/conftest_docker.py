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
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Rebuilt:
    """The light image built once more without any cache, and the untagged images of its engine
    before and after that build."""
    result: build.BuildResult
    dangling_before: set[str]
    dangling_after: set[str]


class _Engines:
    """Engines started on first use and stopped at the end of the session, and the builds the
    tests read, each made once a session by one worker thread, in the order asked for (see
    builds_ahead)."""

    def __init__(self) -> None:
        self.started: dict[str, docker_engine.Engine] = {}
        self.jobs: dict[tuple[str, str], Future[Any]] = {}  # (engine, what) -> its build
        self._lock = threading.RLock()  # the test thread and the builder start engines alike
        self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-builds")

    def client(self, name: str) -> DockerClient:
        with self._lock:
            return self._client(name)

    def _client(self, name: str) -> DockerClient:
        if name not in self.started:
            dockerd, state = ENGINES[name]
            running = docker_engine.connect_state(state)  # one a killed session left: stopped too
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

    def base(self, name: str, rootfs: Path) -> str:
        """The test base's tag in engine `name`, loaded there once."""
        with self._lock:
            return load_base(self.client(name), rootfs)

    def _job(self, name: str, what: str, make: Callable[[], Any]) -> Future[Any]:
        with self._lock:
            if (name, what) not in self.jobs:
                self.jobs[(name, what)] = self._builder.submit(make)
            return self.jobs[(name, what)]

    def light_future(self, name: str, rootfs: Callable[[], Path],
                     tmp_path_factory: pytest.TempPathFactory) -> Future[build.BuildResult]:
        """The light image of engine `name`, tagged sglang-image-test:light-a."""
        tmp = tmp_path_factory.mktemp(f"light-{name}") if (name, "light") not in self.jobs else None

        def make() -> build.BuildResult:
            assert tmp is not None
            base_ref = self.base(name, rootfs())
            result = light_build(self.client(name), base_ref, tmp, tag="sglang-image-test:light-a")
            if name not in _wanted_engines()[:1]:
                # The build scenarios that reuse the build cache run on the first engine only
                # (one_engine): on any other, nothing reads its cache again this run.
                drop_build_cache(self.client(name))
            return result

        return self._job(name, "light", make)

    def rebuilt_future(self, name: str, rootfs: Callable[[], Path],
                       tmp_path_factory: pytest.TempPathFactory) -> Future[Rebuilt]:
        """The light image of engine `name` built once more, without cache, a second after the
        first (wall-clock times would differ if any leaked), tagged sglang-image-test:light-b."""
        first = self.light_future(name, rootfs, tmp_path_factory)
        tmp = tmp_path_factory.mktemp(f"rebuilt-{name}") if (name, "rebuilt") not in self.jobs else None

        def make() -> Rebuilt:
            assert tmp is not None
            first.result()
            client = self.client(name)
            time.sleep(1.1)
            before = {i.id for i in client.images.list(filters={"dangling": True})}
            again = light_build(client, self.base(name, rootfs()), tmp,
                                tag="sglang-image-test:light-b", no_cache=True)
            after = {i.id for i in client.images.list(filters={"dangling": True})}
            return Rebuilt(again, before, after)

        return self._job(name, "rebuilt", make)

    def settle(self, name: str) -> None:
        """Waits for the builds queued on engine `name`: a test that reads the engine's images
        runs alone on it."""
        wait([job for (engine, _), job in list(self.jobs.items()) if engine == name])

    def stop(self) -> None:
        self._builder.shutdown(wait=True, cancel_futures=True)
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
    """A docker SDK client of the engine under test (started here, its own data root), once the
    builds queued on it are done."""
    client = engines.client(engine_name)
    engines.settle(engine_name)
    return client


@pytest.fixture(scope="session")
def docker_host(engines: _Engines, engine_name: str, docker_client: DockerClient) -> str:
    """DOCKER_HOST of the engine under test (for code that finds its engine itself)."""
    return engines.started[engine_name].host


_rootfs_lock = threading.Lock()


def make_base_rootfs() -> Path:
    """The test base's root file system (`nox -s base`'s code), made once and cached."""
    rootfs = REPO_ROOT / ".cache" / "base" / f"{BASE_TAG.rsplit(':', 1)[1]}.tar"
    with _rootfs_lock:
        if not rootfs.exists():
            if base.find_python(BASE_PYTHON) is None and not os.environ.get("CI"):
                pytest.skip(f"no CPython {BASE_PYTHON} on this host to put in the base")
            rootfs.parent.mkdir(parents=True, exist_ok=True)
            base.make_rootfs(rootfs, python_version=BASE_PYTHON, log=lambda _: None)
    return rootfs


@pytest.fixture(scope="session")
def base_rootfs() -> Path:
    """The test base's root file system (`nox -s base`'s code), made once and cached."""
    return make_base_rootfs()


def load_base(client: DockerClient, rootfs: Path) -> str:
    if not client.images.list(name=BASE_TAG):
        base.load_rootfs(client, rootfs, BASE_TAG, description="test base (nox -s base)")
    return BASE_TAG


@pytest.fixture(scope="session")
def debootstrap_base(engines: _Engines, engine_name: str, docker_client: DockerClient,
                     base_rootfs: Path) -> str:
    """Tag of the hub-less base in the engine under test."""
    return engines.base(engine_name, base_rootfs)


def light_build(client: DockerClient, base_ref: str, tmp: Path, **kw: Any) -> build.BuildResult:
    """A light build (SGLang + patch targets + SBOM tool, no heavy dependencies) of the default
    flavor, its output under `tmp` (output_dir=, work_dir= to put them elsewhere)."""
    flavor = kw.pop("flavor", None) or pins.load_flavor(pins.DEFAULT_FLAVOR)
    options = plan.BuildOptions(base=base_ref, light=True,
                                **{"output_dir": tmp / "out", "work_dir": tmp / "work", **kw})
    return build.build(flavor, options, Console(file=io.StringIO()), client)


def drop_build_cache(client: DockerClient) -> None:
    """Removes the build-cache images a build leaves tagged (the builder's SGLang install and part
    2's layer, hundreds of MB): once the tests that reuse them are done, the rest of the run (a
    second engine pulling the image back, the other engine's build) does without them."""
    for image in client.images.list(name=plan.BUILD_CACHE_REPO):
        for tag in image.tags:
            if tag.startswith(f"{plan.BUILD_CACHE_REPO}:"):
                client.images.remove(tag)  # the last tag: the image goes, with untagged parents


def light_image_on(engines: _Engines, name: str, rootfs: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> build.BuildResult:
    """The light image on engine `name`, built once a session, tagged sglang-image-test:light-a."""
    return engines.light_future(name, lambda: rootfs, tmp_path_factory).result()


@pytest.fixture(scope="session")
def light_image(engines: _Engines, engine_name: str, base_rootfs: Path,
                tmp_path_factory: pytest.TempPathFactory) -> build.BuildResult:
    """The light image on the engine under test."""
    return light_image_on(engines, engine_name, base_rootfs, tmp_path_factory)


@pytest.fixture(scope="session")
def light_image_rebuilt(engines: _Engines, engine_name: str, light_image: build.BuildResult,
                        base_rootfs: Path, tmp_path_factory: pytest.TempPathFactory) -> Rebuilt:
    """The light image built once more without cache on the engine under test (Rebuilt)."""
    return engines.rebuilt_future(engine_name, lambda: base_rootfs, tmp_path_factory).result()


def _builds_read(item: pytest.Item) -> list[tuple[str, str]]:
    """The builds a test reads, as (engine, what): its engine's light image (and its rebuild
    without cache), or every engine's light image (the digest comparison asks each for it)."""
    callspec = getattr(item, "callspec", None)
    name = callspec.params.get("engine_name") if callspec else None
    if name in ENGINES:
        return [(str(name), what) for what, fixture in (("light", "light_image"),
                                                        ("rebuilt", "light_image_rebuilt"))
                if fixture in item.fixturenames]
    if {"engines", "base_rootfs"} <= set(item.fixturenames):
        return [(engine, "light") for engine in ENGINES]
    return []


def _uses_an_engine(item: pytest.Item) -> bool:
    return bool({"engines", "docker_client", "light_image"} & set(item.fixturenames))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that need an engine run last, in their order (pytest's grouping by engine kept):
    the builds they read are made meanwhile, beside the other tests (builds_ahead)."""
    items[:] = ([i for i in items if not _uses_an_engine(i)]
                + [i for i in items if _uses_an_engine(i)])


@pytest.fixture(scope="session", autouse=True)
def builds_ahead(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Queues, at the beginning of a run, the builds its tests will read (one worker, one build at
    a time, in the order the tests come): a build waits on the engine and on the network
    (debootstrap, wheels) much of the time, and the tests that need no engine run meanwhile."""
    wanted = list(dict.fromkeys(job for i in request.session.items for job in _builds_read(i)))
    if not wanted:
        return
    engines: _Engines = request.getfixturevalue("engines")
    for name, what in wanted:
        if what == "light":
            engines.light_future(name, make_base_rootfs, tmp_path_factory)
        else:
            engines.rebuilt_future(name, make_base_rootfs, tmp_path_factory)
