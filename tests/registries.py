"""Real registries on loopback for the publish tests: Debian's `docker-registry` (Distribution 2.8).

`start_registry(dir, users=...)` serves one on 127.0.0.1 with filesystem storage, open or with
htpasswd (bcrypt) basic auth; `docker_config(dir, registry, user, password)` writes what
`docker login` writes, for DOCKER_CONFIG. Outside CI a missing binary skips the tests that need
it; in CI (CI=true) it is a failure, so a broken install cannot pass silently.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest
import requests

REGISTRY_BIN = "docker-registry"  # Debian's package docker-registry (Distribution 2.8)


def registry_binary() -> str:
    found = shutil.which(REGISTRY_BIN) or "/usr/bin/docker-registry"
    if not Path(found).exists():
        message = "Debian's docker-registry is not installed: apt-get install -y docker-registry"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Registry:
    address: str  # host:port
    root: Path  # its filesystem storage
    log: Path

    def url(self, path: str) -> str:
        return f"http://{self.address}/v2/{path}"

    def tags(self, repository: str, auth: tuple[str, str] | None = None) -> list[str]:
        """The repository's tags, [] when it does not exist."""
        response = requests.get(self.url(f"{repository}/tags/list"), auth=auth, timeout=10)
        if response.status_code == 404:
            return []
        response.raise_for_status()
        return list(response.json().get("tags") or [])


@contextmanager
def start_registry(tmp: Path, users: dict[str, str] | None = None) -> Iterator[Registry]:
    """A registry on 127.0.0.1:<free port>; with `users`, htpasswd auth for them (bcrypt)."""
    binary = registry_binary()
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    auth = ""
    if users:
        htpasswd = tmp / "htpasswd"
        htpasswd.write_text("".join(
            f"{user}:{bcrypt.hashpw(pw.encode(), bcrypt.gensalt(rounds=5)).decode()}\n"
            for user, pw in users.items()))
        auth = f"auth:\n  htpasswd:\n    realm: sglang-image-test\n    path: {htpasswd}\n"
    config = tmp / "config.yml"
    config.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
                      f"    rootdirectory: {tmp / 'data'}\n  delete:\n    enabled: true\n"
                      f"http:\n  addr: 127.0.0.1:{port}\n{auth}")
    log_path = tmp / "registry.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([binary, "serve", str(config)], stdout=log,
                                stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:  # 200 when open, 401 with auth: either way it answers
                if requests.get(f"http://{address}/v2/", timeout=1).status_code in (200, 401):
                    break
            except requests.ConnectionError:
                time.sleep(0.1)
        else:
            pytest.fail(f"registry did not start: {log_path.read_text()[-2000:]}")
        yield Registry(address, tmp / "data", log_path)
    finally:
        proc.kill()  # a terminated registry drains its clients' idle connections for seconds
        proc.wait(timeout=30)


def docker_config(directory: Path, registry: str, user: str, password: str) -> Path:
    """A Docker config directory as `docker login REGISTRY` leaves it (inline auth)."""
    directory.mkdir(parents=True, exist_ok=True)
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    (directory / "config.json").write_text(json.dumps({"auths": {registry: {"auth": token}}}))
    return directory
