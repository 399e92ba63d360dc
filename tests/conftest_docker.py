"""Docker fixtures: an engine (started here when none answers) and a hub-less base image.

Imported by tests/conftest.py (pytest_plugins). Outside CI, a machine without Docker skips the
`docker` tests; in CI (CI=true) that is a failure, so a broken install cannot pass silently.
"""
from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from docker import DockerClient
from rich.console import Console

from sglang_image import build, docker_engine, pins
from sglang_image.errors import SglangImageError

# Debian 12 minbase + the host's CPython 3.12 in /usr/local: a stand-in for the official
# python:3.12-slim-bookworm (no image hub is reachable from CI). Bump the suffix to rebuild it.
BASE_TAG = "localhost/sglang-image-test-base:bookworm-py3.12-1"
BASE_PYTHON = "3.12"


@pytest.fixture(scope="session")
def docker_client() -> Iterator[DockerClient]:
    """A docker SDK client; dockerd (Debian's docker.io) is started under .cache/docker when no
    engine answers, and stopped at the end of the session."""
    try:
        engine = docker_engine.ensure_engine()
    except SglangImageError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no Docker engine: {exc}")
    try:
        yield engine.client
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def debootstrap_base(docker_client: DockerClient) -> str:
    """Tag of a base image made with debootstrap --variant=minbase bookworm plus Python 3.12
    (imported with docker import; kept in the engine, so made once per engine state)."""
    if docker_client.images.list(name=BASE_TAG):
        return BASE_TAG
    if docker_engine.find_local_python(BASE_PYTHON) is None and not os.environ.get("CI"):
        pytest.skip(f"no CPython {BASE_PYTHON} on this host to put in the base (pyenv install)")
    docker_engine.import_debootstrap_base(docker_client, BASE_TAG, python_version=BASE_PYTHON)
    return BASE_TAG


def light_build(client: DockerClient, base: str, tmp: Path, **kw: Any) -> build.BuildResult:
    """A light build (SGLang + patch targets + SBOM tool, no heavy dependencies) of the default
    flavor from images/Dockerfile, its output under `tmp`."""
    flavor = kw.pop("flavor", None) or pins.load_flavor(pins.DEFAULT_FLAVOR)
    opts = build.BuildOptions(flavor=flavor, base=base, light=True, output_dir=tmp / "out",
                              work_dir=tmp / "work", **kw)
    return build.build(opts, Console(file=io.StringIO()), client)


@pytest.fixture(scope="session")
def light_image(docker_client: DockerClient, debootstrap_base: str,
                tmp_path_factory: pytest.TempPathFactory) -> build.BuildResult:
    """The light image, built once a session and tagged sglang-image-test:light-a."""
    return light_build(docker_client, debootstrap_base, tmp_path_factory.mktemp("light"),
                       tag="sglang-image-test:light-a")
