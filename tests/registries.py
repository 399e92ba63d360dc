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
from typing import Any

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
    ca: Path | None = None  # the CA of its TLS certificate; None: plain HTTP

    def url(self, path: str) -> str:
        return f"{'https' if self.ca else 'http'}://{self.address}/v2/{path}"

    def get(self, path: str, **kw: Any) -> requests.Response:
        return requests.get(self.url(path), verify=str(self.ca) if self.ca else True, timeout=10,
                            **kw)

    def tags(self, repository: str, auth: tuple[str, str] | None = None) -> list[str]:
        """The repository's tags, [] when it does not exist."""
        response = self.get(f"{repository}/tags/list", auth=auth)
        if response.status_code == 404:
            return []
        response.raise_for_status()
        return list(response.json().get("tags") or [])


def make_tls_certificate(directory: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate, server key) for 127.0.0.1, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is not installed: apt-get install -y openssl")
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.crt", directory / "ca.key"
    cert, key, csr = directory / "server.crt", directory / "server.key", directory / "server.csr"
    ext = directory / "server.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
                   "basicConstraints=CA:FALSE\n")
    for argv in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
         "-days", "2", "-subj", "/CN=sglang-image test CA"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
         "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "2", "-extfile", ext],
    ):
        subprocess.run(["openssl", *map(str, argv)], check=True, capture_output=True)
    return ca, cert, key


@contextmanager
def start_registry(tmp: Path, users: dict[str, str] | None = None,
                   tls: bool = False) -> Iterator[Registry]:
    """A registry on 127.0.0.1:<free port>; with `users`, htpasswd auth for them (bcrypt);
    with `tls`, HTTPS with a certificate of a CA made here (Registry.ca)."""
    binary = registry_binary()
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ca = None
    tls_config = ""
    if tls:
        ca, cert, key = make_tls_certificate(tmp / "tls")
        tls_config = f"  tls:\n    certificate: {cert}\n    key: {key}\n"
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
                      f"http:\n  addr: 127.0.0.1:{port}\n{tls_config}{auth}")
    log_path = tmp / "registry.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([binary, "serve", str(config)], stdout=log,
                                stderr=subprocess.STDOUT)
    registry = Registry(f"127.0.0.1:{port}", tmp / "data", log_path, ca)
    try:
        for _ in range(100):
            try:  # 200 when open, 401 with auth: either way it answers
                if registry.get("").status_code in (200, 401):
                    break
            except requests.ConnectionError:
                time.sleep(0.1)
        else:
            pytest.fail(f"registry did not start: {log_path.read_text()[-2000:]}")
        yield registry
    finally:
        proc.kill()  # a terminated registry drains its clients' idle connections for seconds
        proc.wait(timeout=30)


def docker_config(directory: Path, registry: str, user: str, password: str) -> Path:
    """A Docker config directory as `docker login REGISTRY` leaves it (inline auth)."""
    directory.mkdir(parents=True, exist_ok=True)
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    (directory / "config.json").write_text(json.dumps({"auths": {registry: {"auth": token}}}))
    return directory
