"""`nox -s publish`: push a built image to a registry, with its SBOM beside it.

The image goes through the engine (`docker push`): its labels travel in its config. The SBOM
goes as an OCI artifact (OCI 1.1 image manifest, artifactType application/vnd.cyclonedx+json,
`subject` = the image's manifest), tagged `sha256-<image digest hex>.sbom`: registries with the
referrers API index it by its subject, and the tag finds it on the others (Distribution 2.8, for
one: that is the tag scheme cosign and oras use).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker.errors
import requests
from docker import DockerClient
from rich.console import Console
from rich.markup import escape

from sglang_image import build, pins
from sglang_image.docker_engine import connect
from sglang_image.errors import PublishError, SglangImageError

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"
CYCLONEDX = "application/vnd.cyclonedx+json"
ACCEPT = (f"{OCI_MANIFEST}, application/vnd.docker.distribution.manifest.v2+json, "
          "application/vnd.oci.image.index.v1+json, "
          "application/vnd.docker.distribution.manifest.list.v2+json")
REQUIRED_LABELS = ("org.opencontainers.image.version", "org.opencontainers.image.revision",
                   "org.opencontainers.image.created", "io.sglang-image.flavor")


@dataclass(frozen=True)
class PublishResult:
    reference: str  # registry/repository:tag
    digest: str  # the image manifest's digest in the registry
    sbom_reference: str  # registry/repository:sha256-<hex>.sbom
    sbom_digest: str


def _base_url(registry: str) -> str:
    """Loopback registries speak plain HTTP (as docker allows for 127.0.0.0/8); others HTTPS."""
    host = registry.split(":")[0]
    plain = host in ("localhost", "::1") or host.startswith("127.")
    return f"{'http' if plain else 'https'}://{registry}/v2"


def sbom_manifest(sbom: bytes, subject: dict[str, Any], created: str) -> bytes:
    """The OCI artifact manifest that carries the SBOM (pure: tested without a registry)."""
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": CYCLONEDX,
        "config": {"mediaType": OCI_EMPTY, "digest": _digest(b"{}"), "size": 2},
        "layers": [{"mediaType": CYCLONEDX, "digest": _digest(sbom), "size": len(sbom),
                    "annotations": {"org.opencontainers.image.title": "sbom.cdx.json"}}],
        "subject": subject,
        "annotations": {"org.opencontainers.image.created": created},
    }
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class _Registry:
    def __init__(self, registry: str, repository: str) -> None:
        self.base = f"{_base_url(registry)}/{repository}"
        self.http = requests.Session()

    def _check(self, response: requests.Response, what: str) -> requests.Response:
        if response.status_code >= 400:
            raise PublishError(f"registry refused {what}: HTTP {response.status_code} "
                               f"{response.text[:500]}")
        return response

    def manifest(self, reference: str) -> tuple[bytes, str]:
        response = self._check(self.http.get(f"{self.base}/manifests/{reference}",
                                             headers={"Accept": ACCEPT}, timeout=60),
                               f"reading manifest {reference}")
        return response.content, response.headers.get("Content-Type", "")

    def blob(self, digest: str) -> bytes:
        return self._check(self.http.get(f"{self.base}/blobs/{digest}", timeout=300),
                           f"reading blob {digest}").content

    def put_blob(self, data: bytes) -> str:
        digest = _digest(data)
        if self.http.head(f"{self.base}/blobs/{digest}", timeout=60).status_code == 200:
            return digest
        start = self._check(self.http.post(f"{self.base}/blobs/uploads/", timeout=60),
                            "starting a blob upload")
        location = start.headers["Location"]
        if location.startswith("/"):
            location = self.base.split("/v2/")[0] + location
        sep = "&" if "?" in location else "?"
        self._check(self.http.put(f"{location}{sep}digest={digest}", data=data, timeout=300,
                                  headers={"Content-Type": "application/octet-stream"}),
                    f"uploading blob {digest}")
        return digest

    def put_manifest(self, reference: str, data: bytes, media_type: str) -> str:
        self._check(self.http.put(f"{self.base}/manifests/{reference}", data=data, timeout=60,
                                  headers={"Content-Type": media_type}),
                    f"storing manifest {reference}")
        return _digest(data)


def push_image(client: DockerClient, image: str, target: str,
               log: Callable[[str], None]) -> str:
    """Tags `image` as `target` and pushes it; returns the registry's manifest digest."""
    repository, _, tag = target.rpartition(":")
    client.images.get(image).tag(repository, tag)
    digest = None
    try:
        for line in client.api.push(repository, tag=tag, stream=True, decode=True):
            if "error" in line:
                raise PublishError(f"pushing {target} failed: {line['error']}")
            status, ident = line.get("status", ""), line.get("id", "")
            if status in ("Pushed", "Layer already exists", "Mounted from"):
                log(f"  {ident}: {status}")
            if "aux" in line and "Digest" in line["aux"]:
                digest = str(line["aux"]["Digest"])
    except docker.errors.APIError as exc:
        raise PublishError(f"pushing {target} failed: {exc.explanation or exc}") from exc
    if digest is None:
        raise PublishError(f"pushing {target}: the engine reported no digest")
    return digest


def publish(client: DockerClient, image: str, *, registry: str, repository: str, tag: str,
            sbom: Path, log: Callable[[str], None] = print) -> PublishResult:
    try:
        local = client.images.get(image)
    except docker.errors.ImageNotFound as exc:
        raise PublishError(f"image {image} is not in the engine; build it: nox -s build") from exc
    labels = local.labels or {}
    missing = [key for key in REQUIRED_LABELS if key not in labels]
    if missing:
        raise PublishError(f"{image} lacks the labels {missing}: it was not built by nox -s build")
    if not sbom.is_file():
        raise PublishError(f"no SBOM at {sbom}; nox -s build writes it beside the build output")
    target = f"{registry}/{repository}:{tag}"
    log(f"push {image} -> {target}")
    try:
        digest = push_image(client, image, target, log)
        reg = _Registry(registry, repository)
        manifest, media_type = reg.manifest(digest)
        subject = {"mediaType": media_type.split(";")[0], "digest": digest, "size": len(manifest)}
        sbom_bytes = sbom.read_bytes()
        reg.put_blob(b"{}")
        reg.put_blob(sbom_bytes)
        sbom_tag = f"{digest.replace(':', '-')}.sbom"
        sbom_digest = reg.put_manifest(sbom_tag, sbom_manifest(
            sbom_bytes, subject, labels["org.opencontainers.image.created"]), OCI_MANIFEST)
    except requests.RequestException as exc:
        raise PublishError(f"registry {registry} does not answer ({exc}); start it or check "
                           "the address") from exc
    log(f"SBOM -> {registry}/{repository}:{sbom_tag}")
    return PublishResult(target, digest, f"{registry}/{repository}:{sbom_tag}", sbom_digest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nox -s publish --", description=__doc__.splitlines()[0])
    parser.add_argument("--registry", required=True, help="host[:port], e.g. 127.0.0.1:5000")
    parser.add_argument("--flavor", default=None, help=f"default: {pins.DEFAULT_FLAVOR}")
    parser.add_argument("--image", help="local image; default: sglang-image:<VERSION>-<flavor>")
    parser.add_argument("--repository", default=build.IMAGE_REPO)
    parser.add_argument("--sbom", type=Path, help="default: build/<image>/sbom.cdx.json")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    try:
        image = args.image or build.default_tag(pins.load_flavor(args.flavor))
        tag = image.rpartition(":")[2] if ":" in image.split("/")[-1] else "latest"
        sbom = args.sbom or pins.REPO_ROOT / "build" / image.replace("/", "_").replace(":", "-") \
            / "sbom.cdx.json"
        result = publish(connect().client, image, registry=args.registry,
                         repository=args.repository, tag=tag, sbom=sbom,
                         log=lambda m: console.print(escape(m), highlight=False))
    except SglangImageError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return exc.exit_code
    console.print(f"[bold green]pushed[/] {result.reference}@{result.digest}\n"
                  f"[bold green]SBOM[/]   {result.sbom_reference} ({result.sbom_digest})",
                  highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
