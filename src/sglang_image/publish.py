"""`nox -s publish -- --registry HOST[:PORT]/NAMESPACE`: push a smoke-tested image and its SBOM.

1. Refuses an image without a passed smoke of exactly its digest (`nox -s smoke` records one; a
   PARTIAL one counts only with --allow-partial-smoke).
2. Pushes the image through the engine as NAMESPACE/sglang-image:VERSION-FLAVOR; its labels travel
   in its config.
3. Pushes the SBOM (the one inside the image) as an OCI artifact whose `subject` is the image:
   registries with the referrers API list it there; it is also tagged `sha256-<image hex>.sbom`
   (the tag scheme cosign and oras use), which finds it on every registry.
4. Pulls the image back by digest through a second engine (a temporary one with a fresh data root
   unless --verify-host names one) and compares image ID and layers.
5. Only then moves the FLAVOR tag: a failed publish never leaves that tag on a half-pushed image.

Credentials are those `docker login` stored (the Docker config and its credential helpers), for
the engine's push and for the SBOM alike; they are never taken from arguments nor printed. The
SBOM travels through the `oras` client (token and basic auth as the registry asks).
"""
from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker.auth
import docker.errors
import oras.container
import oras.provider
import requests
from docker import DockerClient
from rich.console import Console
from rich.markup import escape

from sglang_image import deploy, docker_engine, dockerbuild, image_smoke, imageref, plan, topology
from sglang_image.errors import PublishError, SglangImageError, UsageError
from sglang_image.imageref import Target, is_loopback
from sglang_image.labels import LABEL_PREFIX, SBOM_PATH
from sglang_image.pins import Flavor

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"
CYCLONEDX = "application/vnd.cyclonedx+json"
SBOM_TITLE = "sbom.cdx.json"
VERSION_LABEL = "org.opencontainers.image.version"
FLAVOR_LABEL = f"{LABEL_PREFIX}.flavor"
SBOM_LABEL = f"{LABEL_PREFIX}.sbom"
REQUIRED_LABELS = (VERSION_LABEL, "org.opencontainers.image.revision",
                   "org.opencontainers.image.created", FLAVOR_LABEL)
DOCKER_CERTS = Path("/etc/docker/certs.d")  # where the engine looks for a registry's CA


@dataclass(frozen=True)
class PublishResult:
    reference: str  # registry/repository@sha256:... (what users pull)
    digest: str  # the image manifest's digest in the registry
    tags: tuple[str, ...]  # registry/repository:tag, the complete ones
    sbom_reference: str  # registry/repository:sha256-<hex>.sbom
    sbom_digest: str
    referrers_api: bool  # the registry lists the SBOM as a referrer of the image
    pulled_image_id: str  # what the second engine got back (== the local image ID)


def parse_registry(text: str, image_name: str = plan.IMAGE_REPO) -> Target:
    """HOST[:PORT][/NAMESPACE] -> Target (the image goes to NAMESPACE/sglang-image)."""
    try:
        return imageref.parse_registry(text, image_name)
    except UsageError as exc:
        raise PublishError(str(exc)) from None


def release_tags(labels: dict[str, str]) -> tuple[str, str]:
    """(VERSION-FLAVOR, FLAVOR) from the image's own labels: what it was built as."""
    missing = [key for key in REQUIRED_LABELS if key not in labels]
    if missing:
        raise PublishError(f"the image lacks the labels {missing}: it was not built by "
                           "nox -s build; build it: nox -s build")
    flavor = labels[FLAVOR_LABEL]
    return f"{labels[VERSION_LABEL]}-{flavor}", flavor


def sbom_manifest(sbom: bytes, subject: dict[str, Any], created: str) -> dict[str, Any]:
    """The OCI 1.1 artifact manifest that carries the SBOM (pure: tested without a registry)."""
    return {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": CYCLONEDX,
        "config": {"mediaType": OCI_EMPTY, "digest": sha256_digest(b"{}"), "size": 2},
        "layers": [{"mediaType": CYCLONEDX, "digest": sha256_digest(sbom), "size": len(sbom),
                    "annotations": {"org.opencontainers.image.title": SBOM_TITLE}}],
        "subject": subject,
        "annotations": {"org.opencontainers.image.created": created},
    }


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def sbom_tag(image_digest: str) -> str:
    return f"{image_digest.replace(':', '-')}.sbom"


# --- smoke gate ----------------------------------------------------------------------------------

def require_smoke(image_id: str, image: str, *, allow_partial: bool,
                  records_dir: Path | None = None) -> image_smoke.SmokeRecord:
    """The passed smoke of exactly this image, or a PublishError naming the command to run."""
    record = image_smoke.passed_smoke(image_id, records_dir)
    if record is None:
        raise PublishError(
            f"no passed smoke of {image} ({image_id}): run `nox -s smoke -- --image {image}` on a "
            "GPU host first (without a GPU it runs the PARTIAL check, which publish accepts "
            "only with --allow-partial-smoke)")
    if record.mode != "full" and not allow_partial:
        raise PublishError(
            f"{image} ({image_id}) passed only the PARTIAL smoke (no GPU: servers, EAGLE-3 and "
            f"the threshold were not checked): run `nox -s smoke -- --image {image}` on a GPU "
            "host, or publish it knowingly with --allow-partial-smoke")
    return record


# --- credentials and the OCI client ----------------------------------------------------------------

def docker_credentials(registry: str) -> tuple[str, str] | None:
    """(username, secret) that `docker login REGISTRY` stored (config or credential helper)."""
    try:
        found = docker.auth.load_config().resolve_authconfig(registry)
    except docker.errors.DockerException as exc:
        raise PublishError(f"reading the Docker credentials for {registry} failed: {exc}; "
                           f"run `docker login {registry}` again") from exc
    if not found:
        return None
    if "IdentityToken" in found:
        raise PublishError(f"the Docker config holds an identity token for {registry}, which the "
                           f"SBOM client cannot use: `docker login {registry}` with a username "
                           "and password (or an access token as the password)")
    # Inline config entries come lower-case, credential helpers' capitalised.
    user = found.get("Username") or found.get("username")
    secret = found.get("Password") or found.get("password")
    return (str(user), str(secret)) if user and secret else None


class OciClient(oras.provider.Registry):  # type: ignore[misc]  # oras has no stubs
    """oras' registry client with two changes. No retry loop: oras tries 5 times over 2+
    minutes on any error, a wrong password included, which waiting does not mend. A new token
    when the registry refuses the one in hand: oras keeps its first token, whose scope (one
    repository, pull only, or none) a token registry answers 401 to elsewhere."""

    def do_request(self, url: str, method: str = "GET", data: Any = None,
                   headers: dict[str, str] | None = None, json: dict[str, Any] | None = None,
                   stream: bool = False) -> requests.Response:
        undecorated = oras.provider.Registry.do_request.__wrapped__
        try:
            response: requests.Response = undecorated(self, url, method, data, dict(headers or {}),
                                                      json, stream)
            if response.status_code == 401 and getattr(self.auth, "token", None):
                self.auth.token = None  # ask for one with the scope of this request's challenge
                response = undecorated(self, url, method, data, dict(headers or {}), json, stream)
            return response
        except requests.RequestException as exc:
            raise PublishError(f"registry {self.hostname} does not answer ({type(exc).__name__}); "
                               "start it or check the address") from exc
        except ValueError as exc:  # oras: "Cannot respond to request for authentication."
            raise PublishError(f"registry {self.hostname} refused the credentials of the Docker "
                               f"config ({exc}): run `docker login {self.hostname}`") from exc


def oci_client(registry: str) -> OciClient:
    """An oras client for `registry` with the Docker credentials, speaking the auth scheme the
    registry announces (Bearer token or Basic), trusting the CA the engine trusts for it."""
    ca = DOCKER_CERTS / registry / "ca.crt"
    verify: bool | str = str(ca) if ca.is_file() else True
    scheme, ping = _ping(registry, verify)
    challenge = ping.headers.get("Www-Authenticate", "")
    backend = "basic" if challenge.lower().startswith("basic") else "token"
    client = OciClient(hostname=registry, insecure=scheme == "http", tls_verify=verify,
                       auth_backend=backend)
    credentials = docker_credentials(registry)
    if credentials is not None:
        client.auth.set_basic_auth(*credentials)
    elif ping.status_code == 401:
        raise PublishError(f"registry {registry} asks for credentials and the Docker config has "
                           f"none for it: run `docker login {registry}`")
    return client


def _ping(registry: str, verify: bool | str) -> tuple[str, requests.Response]:
    """(scheme, response to GET /v2/): HTTPS, and on loopback plain HTTP when HTTPS fails."""
    schemes = ("https", "http") if is_loopback(registry) else ("https",)
    failure: Exception | None = None
    for scheme in schemes:
        try:
            return scheme, requests.get(f"{scheme}://{registry}/v2/", timeout=30, verify=verify)
        except requests.RequestException as exc:
            failure = failure or exc
            if "CERTIFICATE_VERIFY_FAILED" in str(exc):
                break  # it speaks TLS with a certificate we cannot check: never fall back
    hint = (f"; a registry with its own CA: put the CA in {DOCKER_CERTS / registry / 'ca.crt'}, "
            "as for the engine") if isinstance(failure, requests.exceptions.SSLError) else ""
    raise PublishError(f"registry {registry} does not answer ({type(failure).__name__}: "
                       f"{failure}); start it or check the address{hint}")


def check_access(client: OciClient) -> None:
    """Logs in as the registry asks (token or basic) before anything is pushed: bad or missing
    credentials end the publish here, with nothing sent."""
    response = client.do_request(f"{client.prefix}://{client.hostname}/v2/", "GET")
    if response.status_code in (401, 403):
        raise PublishError(f"registry {client.hostname} refused the credentials of the Docker "
                           f"config (HTTP {response.status_code}): run `docker login "
                           f"{client.hostname}` and publish again")


def _checked(response: requests.Response, what: str) -> requests.Response:
    if response.status_code >= 400:
        if response.status_code in (401, 403):
            raise PublishError(f"the registry refused {what} (HTTP {response.status_code}): the "
                               "Docker config's credentials lack access; `docker login` again")
        raise PublishError(f"the registry refused {what}: HTTP {response.status_code} "
                           f"{response.text[:300]}")
    return response


def _container(target: Target, ref: str) -> oras.container.Container:
    """oras' parsed reference for a tag or a sha256 digest in the target repository."""
    return oras.container.Container(f"{target.name}{'@' if ref.startswith('sha256:') else ':'}{ref}")


def referrers_api(client: OciClient, target: Target, digest: str) -> bool:
    """The registry implements OCI 1.1's referrers API for this repository."""
    response = client.do_request(f"{client.prefix}://{target.registry}/v2/{target.repository}"
                                 f"/referrers/{digest}", "GET", headers={"Accept": OCI_INDEX})
    return response.status_code == 200 and \
        response.headers.get("Content-Type", "").startswith(OCI_INDEX)


def push_sbom(client: OciClient, target: Target, image_digest: str, sbom: bytes,
              created: str) -> tuple[str, str, bool]:
    """Pushes the SBOM artifact; returns (tag, its manifest digest, listed by referrers API)."""
    image = _container(target, image_digest)
    manifest = _checked(client.do_request(
        f"{client.prefix}://{image.manifest_url(image_digest)}", "GET",
        headers={"Accept": f"{OCI_MANIFEST}, application/vnd.docker.distribution.manifest.v2+json"}),
        f"reading the image manifest {image_digest}")
    subject = {"mediaType": manifest.headers.get("Content-Type", OCI_MANIFEST).split(";")[0],
               "digest": image_digest, "size": len(manifest.content)}
    tag = sbom_tag(image_digest)
    artifact = _container(target, tag)
    with tempfile.TemporaryDirectory(prefix="sgl-sbom-") as tmp:
        for name, data, media_type in (("config.json", b"{}", OCI_EMPTY),
                                       (SBOM_TITLE, sbom, CYCLONEDX)):
            path = Path(tmp) / name
            path.write_bytes(data)
            layer = {"mediaType": media_type, "digest": sha256_digest(data), "size": len(data)}
            _checked(client.upload_blob(str(path), artifact, layer), f"uploading {name}")
    response = _checked(client.upload_manifest(sbom_manifest(sbom, subject, created), artifact),
                        f"storing the SBOM manifest {tag}")
    digest = response.headers.get("Docker-Content-Digest") or sha256_digest(
        response.request.body if isinstance(response.request.body, bytes) else b"")
    return tag, digest, referrers_api(client, target, image_digest)


def fetch_sbom(reference: str, out: Path) -> Path:
    """Fetches the SBOM of REGISTRY/REPOSITORY@sha256:... into `out` and checks its digest.

    Through the referrers API where the registry has it, else the sha256-<hex>.sbom tag."""
    name, _, digest = reference.partition("@")
    if not digest.startswith("sha256:") or "/" not in name:
        raise PublishError(f"{reference!r} is not REGISTRY/REPOSITORY@sha256:<digest> (the "
                           "digest nox -s publish printed)")
    registry, repository = name.split("/", 1)
    target = Target(registry, repository)
    client = oci_client(registry)
    artifact_ref = sbom_tag(digest)
    response = client.do_request(f"{client.prefix}://{registry}/v2/{repository}/referrers/"
                                 f"{digest}?artifactType={CYCLONEDX}", "GET",
                                 headers={"Accept": OCI_INDEX})
    if response.status_code == 200 and response.headers.get("Content-Type", "").startswith(OCI_INDEX):
        listed = [m for m in response.json().get("manifests", [])
                  if m.get("artifactType") == CYCLONEDX]
        if listed:
            artifact_ref = listed[-1]["digest"]
    container = _container(target, artifact_ref)
    manifest = _checked(client.do_request(
        f"{client.prefix}://{container.manifest_url(artifact_ref)}", "GET",
        headers={"Accept": OCI_MANIFEST}), f"reading the SBOM of {reference} ({artifact_ref})"
    ).json()
    if manifest.get("subject", {}).get("digest") != digest:
        raise PublishError(f"{artifact_ref} in {name} is not the SBOM of {digest}")
    layer = next(m for m in manifest["layers"] if m["mediaType"] == CYCLONEDX)
    data = _checked(client.get_blob(container, layer["digest"]), "reading the SBOM blob").content
    if sha256_digest(data) != layer["digest"]:
        raise PublishError(f"the SBOM blob of {reference} does not match its digest")
    out.write_bytes(data)
    return out


# --- the image: push through the engine, pull back through another --------------------------------

def push_image(client: DockerClient, image_id: str, target: Target, tag: str,
               log: Callable[[str], None]) -> str:
    """Tags the image as TARGET:TAG and pushes it; returns the registry's manifest digest."""
    reference = f"{target.name}:{tag}"
    client.images.get(image_id).tag(target.name, tag)
    client.api.reload_config()  # credentials stored by a `docker login` since the client started
    digest = None
    try:
        for line in client.api.push(target.name, tag=tag, stream=True, decode=True):
            if "error" in line:
                raise PublishError(_push_error(target.registry, reference, str(line["error"])))
            status, ident = line.get("status", ""), line.get("id", "")
            if status in ("Pushed", "Layer already exists") or status.startswith("Mounted from"):
                log(f"  {ident}: {status}")
            if "aux" in line and "Digest" in line["aux"]:
                digest = str(line["aux"]["Digest"])
    except docker.errors.APIError as exc:
        raise PublishError(_push_error(target.registry, reference,
                                       str(exc.explanation or exc))) from exc
    if digest is None:
        raise PublishError(f"pushing {reference}: the engine reported no digest")
    return digest


def _push_error(registry: str, reference: str, error: str) -> str:
    lowered = error.lower()
    if any(word in lowered for word in ("unauthorized", "authentication required", "denied",
                                        "no basic auth credentials")):
        return (f"pushing {reference} failed: the registry refused the credentials of the Docker "
                f"config ({error}); run `docker login {registry}` and publish again")
    if "connection refused" in lowered or "no such host" in lowered or "timeout" in lowered:
        return (f"pushing {reference} failed: registry {registry} does not answer ({error}); "
                "start it or check the address")
    return f"pushing {reference} failed: {error}"


@contextmanager
def fresh_engine() -> Iterator[docker_engine.Engine]:
    """A temporary dockerd with an empty data root (root and Debian's docker.io needed), beside
    the build's engine state: the image lands there once more (/tmp may be memory)."""
    parent = docker_engine.DEFAULT_STATE.parent
    parent.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="verify-", dir=parent))
    try:
        engine = docker_engine.start_dockerd(state)
    except SglangImageError as exc:
        shutil.rmtree(state, ignore_errors=True)
        raise PublishError(f"could not start a second engine to pull the image back ({exc}); "
                           "name a running one: --verify-host unix:///PATH/docker.sock") from exc
    try:
        yield engine
    finally:
        engine.stop()
        shutil.rmtree(state, ignore_errors=True)


def verify_pull(client: DockerClient, reference: str, local: dict[str, Any]) -> str:
    """Pulls REFERENCE (by digest) through `client` and compares it with the local image's
    attributes: same image ID (config digest) and the same layers; returns the pulled ID."""
    name, _, digest = reference.partition("@")
    client.api.reload_config()
    try:
        for line in client.api.pull(name, tag=digest, stream=True, decode=True):
            if "error" in line:
                raise PublishError(f"pulling {reference} back failed: {line['error']}")
        pulled = client.images.get(reference).attrs
    except docker.errors.APIError as exc:
        raise PublishError(f"pulling {reference} back failed: {exc.explanation or exc}") from exc
    differences = [what for what, a, b in (
        ("image ID", pulled["Id"], local["Id"]),
        ("layers", pulled["RootFS"].get("Layers"), local["RootFS"].get("Layers")),
        ("labels", pulled["Config"].get("Labels"), local["Config"].get("Labels")))
        if a != b]
    if differences:
        raise PublishError(f"{reference} pulled back differs from the local image in "
                           f"{', '.join(differences)} ({pulled['Id']} != {local['Id']}); its "
                           "FLAVOR tag was not moved")
    return str(pulled["Id"])


def publish(client: DockerClient, image: str, target: Target, *, allow_partial_smoke: bool = False,
            records_dir: Path | None = None, verify_client: DockerClient | None = None,
            log: Callable[[str], None] = print) -> PublishResult:
    """Everything `nox -s publish` does, in that order (see the module docstring)."""
    try:
        local = client.images.get(image)
    except docker.errors.ImageNotFound:
        raise image_smoke.image_missing(image) from None
    labels = local.labels or {}
    version_tag, flavor_tag = release_tags(labels)
    record = require_smoke(str(local.id), image, allow_partial=allow_partial_smoke,
                           records_dir=records_dir)
    log(f"smoke: {record.mode} pass of {local.id} on {record.finished}")
    sbom = _image_sbom(client, str(local.id), labels)
    log(f"push {image} -> {target.name}:{version_tag}")
    made = [f"{target.name}:{version_tag}"]
    try:
        oras_client = oci_client(target.registry)
        check_access(oras_client)
        digest = push_image(client, str(local.id), target, version_tag, log)
        tag, sbom_digest, listed = push_sbom(oras_client, target, digest, sbom,
                                             labels["org.opencontainers.image.created"])
        log(f"SBOM -> {target.name}:{tag} ({sbom_digest})"
            + (", listed by the referrers API" if listed else ""))
        reference = f"{target.name}@{digest}"
        log(f"pull back {reference} through a second engine")
        if verify_client is not None:
            pulled = verify_pull(verify_client, reference, local.attrs)
        else:
            with fresh_engine() as fresh:
                pulled = verify_pull(fresh.client, reference, local.attrs)
        log(f"  same image ID and layers: {pulled}")
        made.append(f"{target.name}:{flavor_tag}")
        if push_image(client, str(local.id), target, flavor_tag, log) != digest:
            raise PublishError(f"{made[-1]} got another digest than {reference}")
    except SglangImageError:
        for ref in made:  # leave no local tag of a publish that did not complete
            try:
                client.images.remove(ref)
            except docker.errors.APIError:
                pass
        raise
    return PublishResult(reference, digest, tuple(made), f"{target.name}:{tag}", sbom_digest,
                         listed, pulled)


def _image_sbom(client: DockerClient, image_id: str, labels: dict[str, str]) -> bytes:
    """The SBOM inside the image (the label says where): the one built with exactly it."""
    path = labels.get(SBOM_LABEL, SBOM_PATH)
    with tempfile.TemporaryDirectory(prefix="sgl-sbom-") as tmp:
        dest = Path(tmp) / SBOM_TITLE
        try:
            dockerbuild.copy_out(client, image_id, path, dest)
        except (SglangImageError, docker.errors.APIError) as exc:
            raise PublishError(f"the image has no SBOM at {path} ({exc}); rebuild it: "
                               "nox -s build") from exc
        return dest.read_bytes()


@dataclass(frozen=True, kw_only=True)
class PublishOptions:
    """What `nox -s publish` was asked for, besides the flavor (whose image is the default);
    checked when made."""

    target: Target | None = None  # parse_registry(--registry); None only with fetch_sbom
    image: str | None = None  # default: the tag nox -s build gives the flavor
    allow_partial_smoke: bool = False
    verify_host: str | None = None  # default: a temporary engine with a fresh data root
    smoke_records: Path | None = None  # default: image_smoke.RECORDS_DIR
    # where the deployment manifests of the pushed digest go (None: --no-deploy, none written)
    deploy_out: Path | None = deploy.DEFAULT_OUT
    # --fetch-sbom REFERENCE: fetch that image's published SBOM into sbom_out instead
    fetch_sbom: str | None = None
    sbom_out: Path = Path(SBOM_TITLE)

    def __post_init__(self) -> None:
        if self.target is None and self.fetch_sbom is None:
            raise UsageError("nox -s publish needs --registry HOST[:PORT]/NAMESPACE (or "
                             "--fetch-sbom REFERENCE)")


def _deploy_settings(flavor: Flavor | None) -> topology.Settings:
    """The settings of the manifests publish writes (deploy/serve.toml), checked."""
    try:
        return deploy.settings(deploy.SETTINGS, {}, flavor)
    except UsageError as exc:
        raise UsageError(f"{deploy.SETTINGS}: {exc} (nothing was pushed; fix the file, or "
                         "publish with --no-deploy)") from None


def run(flavor: Flavor, options: PublishOptions) -> int:
    """`nox -s publish`: publishes (see the module docstring), writes the deployment manifests of
    the pushed digest, prints the references (stderr) and the digest alone (stdout, for scripts).
    With fetch_sbom: only that image's published SBOM, into sbom_out."""
    if options.fetch_sbom is not None:
        return run_fetch_sbom(options.fetch_sbom, options.sbom_out)
    assert options.target is not None  # checked when made
    console = Console(stderr=True, soft_wrap=True)  # references stay whole, to copy
    log: Callable[[str], None] = lambda m: console.print(escape(m), highlight=False)
    image = options.image or plan.default_tag(flavor)
    # The manifests' settings and folder, checked before anything is pushed.
    serve, deploy_out = None, None
    if options.deploy_out is not None:
        serve = _deploy_settings(flavor)
        deploy_out = deploy.check_out(options.deploy_out)
    try:
        verify = DockerClient(base_url=options.verify_host) if options.verify_host else None
        result = publish(docker_engine.ensure_engine(log=log).client, image, options.target,
                         allow_partial_smoke=options.allow_partial_smoke,
                         records_dir=options.smoke_records, verify_client=verify, log=log)
    except docker.errors.DockerException as exc:
        raise PublishError(f"the Docker engine failed: {exc}") from exc
    written = None if serve is None or deploy_out is None else deploy.deploy(
        serve, result.reference, deploy_out)
    console.print(f"[bold green]pushed[/] {result.reference}\n"
                  + "".join(f"[bold green]tag[/]    {t}\n" for t in result.tags)
                  + f"[bold green]SBOM[/]   {result.sbom_reference} ({result.sbom_digest})",
                  highlight=False)
    if serve is not None and written is not None:
        console.print(f"[bold green]deploy[/] {escape(str(written))}\n"
                      + "".join(f"  {escape(line)}\n" for line in deploy.apply_hint(written, serve)),
                      highlight=False, end="")
    print(result.digest)  # stdout: the digest alone, for scripts
    return 0


def run_fetch_sbom(reference: str, out: Path) -> int:
    """`nox -s publish -- --fetch-sbom REFERENCE`: the published SBOM of an image into `out`."""
    path = fetch_sbom(reference, out)
    Console(stderr=True, soft_wrap=True).print(f"SBOM of {escape(reference)} -> {escape(str(path))}",
                                               highlight=False)
    return 0
