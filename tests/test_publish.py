"""nox -s publish: push the light image and its SBOM to Debian's docker-registry on loopback."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from docker import DockerClient

from sglang_image import build, publish
from sglang_image.errors import PublishError

REGISTRY_BIN = "docker-registry"  # Debian's package docker-registry (Distribution 2.8)


def test_sbom_manifest_points_at_its_image() -> None:
    subject = {"mediaType": publish.OCI_MANIFEST, "digest": "sha256:" + "a" * 64, "size": 7}
    data = json.loads(publish.sbom_manifest(b'{"bomFormat":"CycloneDX"}', subject, "2026-01-01"))
    assert data["artifactType"] == publish.CYCLONEDX
    assert data["subject"] == subject
    assert data["layers"][0]["size"] == len(b'{"bomFormat":"CycloneDX"}')


def test_loopback_registries_speak_http() -> None:
    assert publish._base_url("127.0.0.1:5000") == "http://127.0.0.1:5000/v2"
    assert publish._base_url("ghcr.io") == "https://ghcr.io/v2"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """host:port of a registry on 127.0.0.1 with filesystem storage, stopped afterwards."""
    binary = shutil.which(REGISTRY_BIN) or "/usr/bin/docker-registry"
    if not Path(binary).exists():
        pytest.skip("Debian's docker-registry is not installed: apt-get install -y docker-registry")
    tmp = tmp_path_factory.mktemp("registry")
    port = _free_port()
    config = tmp / "config.yml"
    config.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
                      f"    rootdirectory: {tmp / 'data'}\n  delete:\n    enabled: true\n"
                      f"http:\n  addr: 127.0.0.1:{port}\n")
    log = (tmp / "registry.log").open("wb")
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                if requests.get(f"http://{address}/v2/", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.1)
        else:
            pytest.fail(f"registry did not start: {(tmp / 'registry.log').read_text()[-2000:]}")
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.docker
def test_publish_pushes_image_labels_and_sbom(docker_client: DockerClient, registry: str,
                                              light_image: build.BuildResult) -> None:
    result = publish.publish(docker_client, light_image.image_id, registry=registry,
                             repository="sglang-image", tag="test-light", sbom=light_image.sbom,
                             log=lambda _: None)
    base = f"http://{registry}/v2/sglang-image"
    accept = {"Accept": publish.ACCEPT}
    manifest = requests.get(f"{base}/manifests/test-light", headers=accept, timeout=10)
    assert manifest.headers["Docker-Content-Digest"] == result.digest
    config = requests.get(f"{base}/blobs/{manifest.json()['config']['digest']}", timeout=10).json()
    labels = config["config"]["Labels"]
    assert labels == {**labels, **light_image.labels}
    # The registry's config is the local image's: the digest users pull is the one we built.
    assert manifest.json()["config"]["digest"] == light_image.image_id
    sbom_tag = result.digest.replace(":", "-") + ".sbom"
    artifact = requests.get(f"{base}/manifests/{sbom_tag}", headers=accept, timeout=10).json()
    assert artifact["subject"]["digest"] == result.digest
    layer = artifact["layers"][0]
    assert layer["mediaType"] == "application/vnd.cyclonedx+json"
    blob = requests.get(f"{base}/blobs/{layer['digest']}", timeout=10).content
    assert blob == light_image.sbom.read_bytes()
    # Pushing the same image again sends no layer and gives the same digest.
    again = publish.publish(docker_client, light_image.image_id, registry=registry,
                            repository="sglang-image", tag="test-light-2",
                            sbom=light_image.sbom, log=lambda _: None)
    assert again.digest == result.digest
    for ref in (result.reference, again.reference):  # leave no registry tags in the engine
        docker_client.images.remove(ref)


@pytest.mark.docker
def test_publish_refuses_an_image_without_our_labels(docker_client: DockerClient,
                                                     debootstrap_base: str, tmp_path: Path) -> None:
    sbom = tmp_path / "sbom.json"
    sbom.write_text("{}")
    with pytest.raises(PublishError, match="not built by nox -s build"):
        publish.publish(docker_client, debootstrap_base, registry="127.0.0.1:1",
                        repository="x", tag="y", sbom=sbom, log=lambda _: None)


@pytest.mark.docker
def test_publish_to_a_dead_registry_is_a_clear_error(docker_client: DockerClient,
                                                     light_image: build.BuildResult) -> None:
    with pytest.raises(PublishError, match="pushing 127.0.0.1:1/sglang-image:dead failed"):
        publish.publish(docker_client, light_image.image_id, registry="127.0.0.1:1",
                        repository="sglang-image", tag="dead", sbom=light_image.sbom,
                        log=lambda _: None)
    docker_client.images.remove("127.0.0.1:1/sglang-image:dead")
