"""Real registries on loopback for the publish tests: Debian's `docker-registry` (Distribution 2.8).

`start_registry(dir, users=...)` serves one on 127.0.0.1 with filesystem storage, open, with
htpasswd (bcrypt) basic auth, or with token auth (`token=True`: a token server started here), and
over TLS if asked (`tls=True`); `docker_config(dir, registry, user, password)` writes what
`docker login` writes, for DOCKER_CONFIG. Outside CI a missing binary skips the tests that need
it; in CI (CI=true) it is a failure, so a broken install cannot pass silently.
"""
from __future__ import annotations

import base64
import http.server
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import requests

from tests.ports import free_port

REGISTRY_BIN = "docker-registry"  # Debian's package docker-registry (Distribution 2.8)


def registry_binary() -> str:
    found = shutil.which(REGISTRY_BIN) or "/usr/bin/docker-registry"
    if not Path(found).exists():
        message = "Debian's docker-registry is not installed: apt-get install -y docker-registry"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


@dataclass
class Registry:
    address: str  # host:port
    root: Path  # its filesystem storage
    log: Path
    ca: Path | None = None  # the CA of its TLS certificate; None: plain HTTP
    token_server: TokenServer | None = None  # its token service, with token auth

    def url(self, path: str) -> str:
        return f"{'https' if self.ca else 'http'}://{self.address}/v2/{path}"

    def get(self, path: str, **kw: Any) -> requests.Response:
        return requests.get(self.url(path), verify=str(self.ca) if self.ca else True, timeout=10,
                            **kw)

    def tags(self, repository: str, auth: tuple[str, str] | None = None) -> list[str]:
        """The repository's tags, [] when it does not exist."""
        headers = {}
        if auth and self.token_server:
            token = self.token_server.token(auth[0], [f"repository:{repository}:pull"])
            headers, auth = {"Authorization": f"Bearer {token}"}, None
        response = self.get(f"{repository}/tags/list", auth=auth, headers=headers)
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


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    """The token service of Docker's token auth (what Docker Hub, GHCR, Harbor speak): checks
    Basic credentials, grants the requested scopes as an RS256 JWT whose x5c names a certificate
    the registry trusts (its rootcertbundle). Signed by openssl."""

    SERVICE, ISSUER = "sglang-image-test", "sglang-image-test-issuer"

    def __init__(self, directory: Path, users: dict[str, str]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.key, self.cert = directory / "token.key", directory / "token.crt"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                        str(self.key), "-out", str(self.cert), "-days", "2", "-subj",
                        "/CN=sglang-image test token issuer"], check=True, capture_output=True)
        der = subprocess.run(["openssl", "x509", "-in", str(self.cert), "-outform", "DER"],
                             check=True, capture_output=True).stdout
        self.x5c = base64.b64encode(der).decode()
        self.users = users
        self.requests: list[dict[str, Any]] = []  # (user, scopes) asked for: what the tests read
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                user = server.check(self.headers.get("Authorization", ""))
                scopes = [s for scope in query.get("scope", []) for s in scope.split(" ")]
                server.requests.append({"user": user, "scopes": scopes})
                if user is None and self.headers.get("Authorization"):
                    self.send_response(401)
                    self.end_headers()
                    return
                body = json.dumps({"token": server.token(user, scopes), "expires_in": 300})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.realm = f"http://127.0.0.1:{self.httpd.server_address[1]}/token"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def check(self, authorization: str) -> str | None:
        if not authorization.startswith("Basic "):
            return None
        user, _, password = base64.b64decode(authorization[6:]).decode().partition(":")
        return user if self.users.get(user) == password else None

    def token(self, user: str | None, scopes: list[str]) -> str:
        access = []
        for scope in scopes:  # repository:NAME:ACTIONS; anonymous callers get nothing
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            if user is not None and kind == "repository":
                access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        claims = {"iss": self.ISSUER, "sub": user or "", "aud": self.SERVICE, "exp": now + 300,
                  "nbf": now - 10, "iat": now, "jti": os.urandom(8).hex(), "access": access}
        signing_input = f"{_b64url(json.dumps(header).encode())}." \
                        f"{_b64url(json.dumps(claims).encode())}"
        signature = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(self.key)],
                                   input=signing_input.encode(), check=True,
                                   capture_output=True).stdout
        return f"{signing_input}.{_b64url(signature)}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextmanager
def start_registry(tmp: Path, users: dict[str, str] | None = None, tls: bool = False,
                   token: bool = False) -> Iterator[Registry]:
    """A registry on 127.0.0.1:<free port>; with `users`, htpasswd auth for them (bcrypt), or
    with `token` too, token auth through a TokenServer (Registry.token_server); with `tls`,
    HTTPS with a certificate of a CA made here (Registry.ca)."""
    binary = registry_binary()
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ca = None
    tls_config = ""
    if tls:
        ca, cert, key = make_tls_certificate(tmp / "tls")
        tls_config = f"  tls:\n    certificate: {cert}\n    key: {key}\n"
    auth = ""
    token_server = None
    if token:
        token_server = TokenServer(tmp / "token", users or {})
        auth = (f"auth:\n  token:\n    realm: {token_server.realm}\n"
                f"    service: {TokenServer.SERVICE}\n    issuer: {TokenServer.ISSUER}\n"
                f"    rootcertbundle: {token_server.cert}\n")
    elif users:
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
    registry = Registry(f"127.0.0.1:{port}", tmp / "data", log_path, ca, token_server)
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
        if token_server is not None:
            token_server.stop()
        # What was pushed (an image of hundreds of MB) goes with the registry, not at the run's end.
        shutil.rmtree(tmp / "data", ignore_errors=True)


def docker_config(directory: Path, registry: str, user: str, password: str,
                  helper_bin: Path | None = None) -> Path:
    """A Docker config directory as `docker login REGISTRY` leaves it: the credentials inline,
    or with `helper_bin` in a credential helper (docker-credential-sglangtest, written into
    helper_bin, which the caller puts on PATH) that the config names for the registry."""
    directory.mkdir(parents=True, exist_ok=True)
    if helper_bin is None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        config: dict[str, Any] = {"auths": {registry: {"auth": token}}}
    else:
        helper_bin.mkdir(parents=True, exist_ok=True)
        helper = helper_bin / "docker-credential-sglangtest"
        answer = json.dumps({"Username": user, "Secret": password})
        helper.write_text(f"#!/bin/sh\n# the helper protocol: `get`, server on stdin\n"
                          f"[ \"$1\" = get ] || exit 1\nread server\n"
                          f"[ \"$server\" = {registry} ] || {{ echo 'credentials not found in "
                          f"native keychain'; exit 1; }}\necho '{answer}'\n")
        helper.chmod(0o755)
        config = {"auths": {registry: {}}, "credHelpers": {registry: "sglangtest"}}
    (directory / "config.json").write_text(json.dumps(config))
    return directory
