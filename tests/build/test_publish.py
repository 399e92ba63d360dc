"""nox -s publish against real registries on loopback (Debian's docker-registry, started here):
one open, one with htpasswd auth; credentials only through a Docker config (DOCKER_CONFIG)."""
from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from docker import DockerClient

from sglang_image import build, cli, image_smoke, pins, publish
from sglang_image.errors import PublishError, SmokeError
from sglang_image.labels import SBOM_PATH
from tests.build.conftest_docker import one_engine
from tests.build.registries import Registry, docker_config, start_registry

USER, PASSWORD = "alice", "correct-horse-7"
SBOM = {"bomFormat": "CycloneDX", "specVersion": "1.6", "components": [
    {"type": "library", "name": "sglang", "version": "0.5.23"}]}


# --- pure -----------------------------------------------------------------------------------------

def test_registry_argument() -> None:
    assert publish.parse_registry("127.0.0.1:5000/team") == \
        publish.Target("127.0.0.1:5000", "team/sglang-image")
    assert publish.parse_registry("registry.example.com/a/b").repository == "a/b/sglang-image"
    assert publish.parse_registry("localhost:5000").repository == "sglang-image"
    for bad in ("https://ghcr.io/x", "user:pw@ghcr.io/x", "ghcr.io/Team"):
        with pytest.raises(PublishError, match="HOST"):
            publish.parse_registry(bad)
    assert publish.is_loopback("127.0.0.1:5000") and not publish.is_loopback("ghcr.io")


def test_sbom_manifest_points_at_its_image() -> None:
    subject = {"mediaType": publish.OCI_MANIFEST, "digest": "sha256:" + "a" * 64, "size": 7}
    data = publish.sbom_manifest(b'{"bomFormat":"CycloneDX"}', subject, "2026-01-01")
    assert data["artifactType"] == publish.CYCLONEDX
    assert data["subject"] == subject
    assert data["config"]["mediaType"] == publish.OCI_EMPTY
    assert data["layers"][0]["size"] == len(b'{"bomFormat":"CycloneDX"}')
    assert publish.sbom_tag("sha256:" + "a" * 64) == "sha256-" + "a" * 64 + ".sbom"


def test_tags_come_from_the_image_labels() -> None:
    labels = {"org.opencontainers.image.version": "0.1.0", "org.opencontainers.image.revision": "x",
              "org.opencontainers.image.created": "2026", "io.sglang-image.flavor": "sglang-0.5.23"}
    assert publish.release_tags(labels) == ("0.1.0-sglang-0.5.23", "sglang-0.5.23")
    with pytest.raises(PublishError, match="not built by nox -s build"):
        publish.release_tags({"org.opencontainers.image.version": "0.1.0"})


def _record(records: Path, image_id: str, mode: str) -> None:
    res = image_smoke.SmokeResult(mode, True, 0, records, image_id=image_id)
    assert image_smoke.write_record(res, "img:tag", records) is not None


def test_smoke_gate(tmp_path: Path) -> None:
    image_id = "sha256:" + "b" * 64
    with pytest.raises(PublishError, match=r"nox -s smoke -- --image img:tag"):
        publish.require_smoke(image_id, "img:tag", allow_partial=True, records_dir=tmp_path)
    _record(tmp_path, image_id, "partial")
    with pytest.raises(PublishError, match="only the PARTIAL smoke.*--allow-partial-smoke"):
        publish.require_smoke(image_id, "img:tag", allow_partial=False, records_dir=tmp_path)
    assert publish.require_smoke(image_id, "img:tag", allow_partial=True,
                                 records_dir=tmp_path).mode == "partial"
    # Another image's record does not count, even under a copied file name.
    other = "sha256:" + "c" * 64
    image_smoke.record_path(other, tmp_path).write_text(image_smoke.record_path(image_id, tmp_path).read_text())
    with pytest.raises(PublishError, match="no passed smoke"):
        publish.require_smoke(other, "img:tag", allow_partial=True, records_dir=tmp_path)
    _record(tmp_path, image_id, "full")
    assert publish.require_smoke(image_id, "img:tag", allow_partial=False,
                                 records_dir=tmp_path).mode == "full"


def test_failed_smoke_leaves_no_record(tmp_path: Path) -> None:
    res = image_smoke.SmokeResult("full", False, 1, tmp_path, image_id="sha256:" + "d" * 64)
    assert image_smoke.write_record(res, "img:tag", tmp_path) is None
    assert image_smoke.passed_smoke(res.image_id, tmp_path) is None


# --- real registries and engines --------------------------------------------------------------------

@dataclass
class TinyImage:
    tag: str
    image_id: str
    sbom: bytes


@pytest.fixture(autouse=True)
def engine_under_test(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """nox -s publish finds its engine through DOCKER_HOST, as a user's shell would: point it at
    the engine the test runs on (the tests run once per engine)."""
    if "docker_client" in request.fixturenames:
        monkeypatch.setenv("DOCKER_HOST", request.getfixturevalue("docker_host"))


@pytest.fixture(scope="module")
def tiny_image(docker_client: DockerClient) -> Iterator[TinyImage]:
    """An image of two small files with the labels nox -s build sets and an SBOM where it puts
    one (docker import: seconds, where a light build takes minutes)."""
    sbom = json.dumps(SBOM, indent=1).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("opt/sglang-image/sbom.cdx.json", sbom), ("hello.txt", b"hello\n")):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 315532800
            tar.addfile(info, io.BytesIO(data))
    labels = {"org.opencontainers.image.version": "0.1.0",
              "org.opencontainers.image.revision": "0" * 40,
              "org.opencontainers.image.created": "2026-12-01T00:00:00Z",
              "io.sglang-image.flavor": "sglang-test", "io.sglang-image.sbom": SBOM_PATH}
    changes = [f'LABEL "{k}"="{v}"' for k, v in labels.items()] + ['CMD ["/hello.txt"]']
    docker_client.api.import_image_from_data(buf.getvalue(), repository="sglang-image-test",
                                             tag="tiny", changes=changes)
    image = docker_client.images.get("sglang-image-test:tiny")
    yield TinyImage("sglang-image-test:tiny", str(image.id), sbom)
    docker_client.images.remove(str(image.id), force=True)


@pytest.fixture(scope="module")
def open_registry(tmp_path_factory: pytest.TempPathFactory, engine_name: str) -> Iterator[Registry]:
    # one registry per engine: the engines push different manifests of one image
    with start_registry(tmp_path_factory.mktemp("open-registry")) as registry:
        yield registry


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory: pytest.TempPathFactory, engine_name: str) -> Iterator[Registry]:
    # one registry per engine: the engines push different manifests of one image
    with start_registry(tmp_path_factory.mktemp("auth-registry"), users={USER: PASSWORD}) as reg:
        yield reg


@pytest.fixture(scope="module")
def tls_registry(tmp_path_factory: pytest.TempPathFactory, engine_name: str) -> Iterator[Registry]:
    # one registry per engine: the engines push different manifests of one image
    with start_registry(tmp_path_factory.mktemp("tls-registry"), users={USER: PASSWORD},
                        tls=True) as registry:
        yield registry


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory: pytest.TempPathFactory, engine_name: str) -> Iterator[Registry]:
    # one registry per engine: the engines push different manifests of one image
    with start_registry(tmp_path_factory.mktemp("token-registry"), users={USER: PASSWORD},
                        token=True) as registry:
        yield registry


@pytest.fixture
def records(tmp_path: Path) -> Path:
    return tmp_path / "smoke-records"


@pytest.fixture
def no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty Docker config: nothing of the user's ~/.docker leaks into a test."""
    (tmp_path / "docker-config").mkdir()
    (tmp_path / "docker-config" / "config.json").write_text("{}")
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))


def _login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry: str, password: str) -> None:
    config = docker_config(tmp_path / "docker-config", registry, USER, password)
    monkeypatch.setenv("DOCKER_CONFIG", str(config))


def _our_local_tags(client: DockerClient, target: publish.Target) -> list[str]:
    return [t for image in client.images.list() for t in image.tags if t.startswith(target.name)]


def _clean(client: DockerClient, result: publish.PublishResult) -> None:
    for tag in result.tags:
        client.images.remove(tag)


@pytest.mark.docker
@pytest.mark.usefixtures("no_credentials")
def test_publish_to_an_open_registry(docker_client: DockerClient, open_registry: Registry,
                                     tiny_image: TinyImage, records: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    _record(records, tiny_image.image_id, "full")
    target = publish.parse_registry(f"{open_registry.address}/team")
    lines: list[str] = []
    result = publish.publish(docker_client, tiny_image.tag, target, records_dir=records,
                             log=lines.append)
    assert result.tags == (f"{target.name}:0.1.0-sglang-test", f"{target.name}:sglang-test")
    assert sorted(open_registry.tags("team/sglang-image")) == sorted(
        ["0.1.0-sglang-test", "sglang-test", publish.sbom_tag(result.digest)])
    manifest = requests.get(open_registry.url("team/sglang-image/manifests/sglang-test"),
                            headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
                            timeout=10)
    assert manifest.headers["Docker-Content-Digest"] == result.digest
    # The registry's config is the local image's: the digest users pull is the one we built.
    assert manifest.json()["config"]["digest"] == tiny_image.image_id
    assert result.pulled_image_id == tiny_image.image_id
    assert any("same image ID and layers" in line for line in lines)
    # Distribution 2.8 has no referrers API: the SBOM is found by its tag.
    assert result.referrers_api is False
    artifact = requests.get(open_registry.url(f"team/sglang-image/manifests/"
                                              f"{publish.sbom_tag(result.digest)}"),
                            headers={"Accept": publish.OCI_MANIFEST}, timeout=10).json()
    assert artifact["subject"]["digest"] == result.digest
    assert artifact["artifactType"] == publish.CYCLONEDX
    fetched = publish.fetch_sbom(result.reference, tmp_path / "sbom.json")
    assert fetched.read_bytes() == tiny_image.sbom
    # Again, pulled back through an engine named by --verify-host: the same digest.
    with publish.fresh_engine() as second:
        assert cli.main(["publish", "--registry", f"{open_registry.address}/team", "--image",
                         tiny_image.tag, "--smoke-records", str(records),
                         "--verify-host", second.host,
                         "--deploy-out", str(tmp_path / "deploy")]) == 0
        assert second.client.images.get(result.reference).id == tiny_image.image_id
        # The deployment manifests run what was pushed, by its digest.
        compose = (tmp_path / "deploy" / "compose.yaml").read_text()
        assert f"image: {result.reference}\n" in compose
        other = {**docker_client.images.get(tiny_image.tag).attrs, "Id": "sha256:" + "0" * 64}
        with pytest.raises(PublishError, match="differs from the local image in image ID"):
            publish.verify_pull(second.client, result.reference, other)
    assert capsys.readouterr().out.strip() == result.digest
    _clean(docker_client, result)


@pytest.mark.docker
@pytest.mark.parametrize("store", ["config", "helper"])
def test_publish_with_the_credentials_of_docker_login(
        docker_client: DockerClient, auth_registry: Registry, tiny_image: TinyImage, records: Path,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        store: str) -> None:
    """Credentials as `docker login` stores them, inline or in a credential helper."""
    _record(records, tiny_image.image_id, "full")
    if store == "helper":
        helper_bin = tmp_path / "bin"
        config = docker_config(tmp_path / "docker-config", auth_registry.address, USER, PASSWORD,
                               helper_bin=helper_bin)
        monkeypatch.setenv("DOCKER_CONFIG", str(config))
        monkeypatch.setenv("PATH", f"{helper_bin}:{os.environ['PATH']}")
    else:
        _login(tmp_path, monkeypatch, auth_registry.address, PASSWORD)
    target = publish.parse_registry(f"{auth_registry.address}/private")
    code = cli.main(["publish", "--registry", f"{auth_registry.address}/private", "--image",
                     tiny_image.tag, "--smoke-records", str(records),
                     "--deploy-out", str(tmp_path / "deploy")])
    out, err = capsys.readouterr()
    assert code == 0, err
    digest = out.strip()
    assert digest.startswith("sha256:") and f"{target.name}@{digest}" in err
    assert PASSWORD not in out + err
    assert sorted(auth_registry.tags("private/sglang-image", (USER, PASSWORD))) == sorted(
        ["0.1.0-sglang-test", "sglang-test", publish.sbom_tag(digest)])
    assert requests.get(auth_registry.url("private/sglang-image/tags/list"),
                        timeout=10).status_code == 401
    # The documented fetch-back command, through the same credentials.
    sbom_out = tmp_path / "fetched.cdx.json"
    assert cli.main(["publish", "--fetch-sbom", f"{target.name}@{digest}",
                     "--out", str(sbom_out)]) == 0
    assert sbom_out.read_bytes() == tiny_image.sbom
    for tag in ("0.1.0-sglang-test", "sglang-test"):
        docker_client.images.remove(f"{target.name}:{tag}")


@pytest.mark.docker
def test_publish_over_tls_checks_the_registry_ca(
        docker_client: DockerClient, tls_registry: Registry, tiny_image: TinyImage, records: Path,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SBOM client checks the registry's certificate against the CA where the engine looks
    for it (/etc/docker/certs.d/HOST:PORT/ca.crt; a stand-in directory here). The engine itself
    does not check it on loopback, which it treats as an insecure registry."""
    _record(records, tiny_image.image_id, "full")
    _login(tmp_path, monkeypatch, tls_registry.address, PASSWORD)
    certs = tmp_path / "certs.d"
    monkeypatch.setattr(publish, "DOCKER_CERTS", certs)
    target = publish.parse_registry(f"{tls_registry.address}/tls")
    with pytest.raises(PublishError, match=f"{certs / tls_registry.address / 'ca.crt'}"):
        publish.publish(docker_client, tiny_image.tag, target, records_dir=records,
                        log=lambda _: None)
    assert tls_registry.tags("tls/sglang-image", (USER, PASSWORD)) == []
    assert tls_registry.ca is not None
    (certs / tls_registry.address).mkdir(parents=True)
    (certs / tls_registry.address / "ca.crt").write_bytes(tls_registry.ca.read_bytes())
    result = publish.publish(docker_client, tiny_image.tag, target, records_dir=records,
                             log=lambda _: None)
    assert result.pulled_image_id == tiny_image.image_id
    assert publish.fetch_sbom(result.reference, tmp_path / "sbom.json").read_bytes() == \
        tiny_image.sbom
    _clean(docker_client, result)


@pytest.mark.docker
def test_publish_to_a_token_auth_registry(
        docker_client: DockerClient, token_registry: Registry, tiny_image: TinyImage,
        records: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Token auth as Docker Hub, GHCR or Harbor do it: one token per scope, from the Docker
    config's credentials; a wrong password is refused before anything is pushed."""
    assert token_registry.token_server is not None
    _record(records, tiny_image.image_id, "full")
    target = publish.parse_registry(f"{token_registry.address}/tok")
    _login(tmp_path, monkeypatch, token_registry.address, "wrong-password")
    with pytest.raises(PublishError, match="refused the credentials") as err:
        publish.publish(docker_client, tiny_image.tag, target, records_dir=records,
                        log=lambda _: None)
    assert "wrong-password" not in str(err.value)
    assert token_registry.tags("tok/sglang-image", (USER, PASSWORD)) == []
    _login(tmp_path, monkeypatch, token_registry.address, PASSWORD)
    token_registry.token_server.requests.clear()
    result = publish.publish(docker_client, tiny_image.tag, target, records_dir=records,
                             log=lambda _: None)
    assert sorted(token_registry.tags("tok/sglang-image", (USER, PASSWORD))) == sorted(
        ["0.1.0-sglang-test", "sglang-test", publish.sbom_tag(result.digest)])
    asked = token_registry.token_server.requests
    assert all(r["user"] == USER for r in asked), asked  # never anonymous, never refused
    assert any(any(s.startswith("repository:tok/sglang-image:") and "push" in s
                   for s in r["scopes"]) for r in asked), asked
    assert publish.fetch_sbom(result.reference, tmp_path / "sbom.json").read_bytes() == \
        tiny_image.sbom
    _clean(docker_client, result)


@pytest.mark.docker
def test_wrong_credentials_are_a_clear_error_and_tag_nothing(
        docker_client: DockerClient, auth_registry: Registry, tiny_image: TinyImage, records: Path,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _record(records, tiny_image.image_id, "full")
    _login(tmp_path, monkeypatch, auth_registry.address, "wrong-password")
    target = publish.parse_registry(f"{auth_registry.address}/wrong")
    with pytest.raises(PublishError, match=r"refused the credentials.*docker login "
                                           + auth_registry.address.replace(".", r"\.")) as err:
        publish.publish(docker_client, tiny_image.tag, target, records_dir=records,
                        log=lambda _: None)
    assert "wrong-password" not in str(err.value)
    assert auth_registry.tags("wrong/sglang-image", (USER, PASSWORD)) == []
    assert _our_local_tags(docker_client, target) == []
    # No credentials at all: the same, before anything is sent.
    (tmp_path / "docker-config" / "config.json").write_text("{}")
    with pytest.raises(PublishError, match="docker login"):
        publish.publish(docker_client, tiny_image.tag, target, records_dir=records,
                        log=lambda _: None)
    assert auth_registry.tags("wrong/sglang-image", (USER, PASSWORD)) == []


@pytest.mark.docker
@pytest.mark.usefixtures("no_credentials")
def test_a_registry_that_is_down_is_a_clear_error(docker_client: DockerClient,
                                                  tiny_image: TinyImage, records: Path,
                                                  tmp_path: Path) -> None:
    _record(records, tiny_image.image_id, "full")
    with start_registry(tmp_path / "short-lived") as registry:
        address = registry.address
    target = publish.parse_registry(f"{address}/down")
    with pytest.raises(PublishError, match=f"registry {address} does not answer"):
        publish.publish(docker_client, tiny_image.tag, target, records_dir=records,
                        log=lambda _: None)
    assert _our_local_tags(docker_client, target) == []


@pytest.mark.docker
@pytest.mark.usefixtures("no_credentials")
def test_publish_refuses_an_image_without_a_passed_smoke(
        docker_client: DockerClient, open_registry: Registry, tiny_image: TinyImage,
        records: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--registry", f"{open_registry.address}/gate", "--image", tiny_image.tag,
            "--smoke-records", str(records), "--no-deploy"]
    assert cli.main(["publish", *argv]) == PublishError.exit_code
    assert f"nox -s smoke -- --image {tiny_image.tag}" in capsys.readouterr().err
    _record(records, tiny_image.image_id, "partial")
    assert cli.main(["publish", *argv]) == PublishError.exit_code
    assert "--allow-partial-smoke" in capsys.readouterr().err
    assert open_registry.tags("gate/sglang-image") == []


@pytest.mark.docker
@one_engine  # pushing and pulling back on every engine: the tiny image's tests above
@pytest.mark.usefixtures("no_credentials")
def test_light_image_partial_smoke_then_publish(docker_client: DockerClient,
                                                open_registry: Registry,
                                                light_image: build.BuildResult, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The built (light) image: its real PARTIAL smoke is no pass to a script and records a
    PARTIAL pass, which publish takes only when told; the SBOM comes back as built."""
    records, tag = tmp_path / "records", light_image.tags[0]
    argv = ["--image", tag, "--no-gpu", "--records", str(records), "--out", str(tmp_path / "o")]
    assert cli.main(["smoke", *argv]) == image_smoke.PARTIAL_EXIT_CODE
    out = capsys.readouterr().out
    assert "NOT a pass" in out and "EAGLE-3 greedy outputs equal to plain decoding" in out
    assert cli.main(["smoke", *argv, "--accept-partial"]) == 0
    record = image_smoke.passed_smoke(light_image.image_id, records)
    assert record is not None and record.mode == "partial"
    target = publish.parse_registry(f"{open_registry.address}/light")
    with pytest.raises(PublishError, match="PARTIAL"):
        publish.publish(docker_client, tag, target, records_dir=records, log=lambda _: None)
    result = publish.publish(docker_client, tag, target, records_dir=records,
                             allow_partial_smoke=True, log=lambda _: None)
    assert result.pulled_image_id == light_image.image_id
    fetched = publish.fetch_sbom(result.reference, tmp_path / "sbom.json")
    assert fetched.read_bytes() == light_image.sbom.read_bytes()
    _clean(docker_client, result)
    # A later failed smoke of the same image (here: a series the image was not built from)
    # takes its pass away.
    real = image_smoke.expected_series(pins.load_flavor())
    tampered = [dict(real[0], sha256="0" * 64), *real[1:]]
    monkeypatch.setattr(image_smoke, "expected_series", lambda flavor=None: tampered)
    assert cli.main(["smoke", *argv]) == SmokeError.exit_code
    assert image_smoke.passed_smoke(light_image.image_id, records) is None
