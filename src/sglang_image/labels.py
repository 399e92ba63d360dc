"""The image's labels: OCI annotations, the flavor, every applied patch and the plugin wheel with
their sha256 (what `docker inspect` and the registry show)."""
from __future__ import annotations

import tomllib
from pathlib import Path

from sglang_image import normalize
from sglang_image.pins import REPO_ROOT, Flavor
from sglang_image.plan import revision, version

LABEL_PREFIX = "io.sglang-image"
SBOM_PATH = "/opt/sglang-image/sbom.cdx.json"
MANIFEST_PATH = "/opt/sglang-image/patches.json"


def source_url(pyproject: Path = REPO_ROOT / "pyproject.toml") -> str | None:
    """[project.urls] Source of pyproject.toml, or None: the project's address, never the clone's
    remote (clones of one commit with different remotes must give one digest)."""
    source = tomllib.loads(pyproject.read_text()).get("project", {}).get("urls", {}).get("Source")
    return str(source) if source else None


def labels(flavor: Flavor, *, epoch: int, base_name: str, base_digest: str,
           patches: list[tuple[str, str]], light: bool,
           plugin_wheel: tuple[str, str] | None = None) -> dict[str, str]:
    oci = "org.opencontainers.image"
    out = {
        f"{oci}.title": "sglang-image",
        f"{oci}.version": version(),
        f"{oci}.revision": revision(),
        f"{oci}.created": normalize.iso_time(epoch),
        f"{oci}.base.name": base_name,
        f"{oci}.base.digest": base_digest,
        # SGLang and our patches; each installed package's own license is in the SBOM.
        f"{oci}.licenses": "Apache-2.0",
        f"{LABEL_PREFIX}.flavor": flavor.name,
        f"{LABEL_PREFIX}.sglang.version": flavor.sglang_version,
        f"{LABEL_PREFIX}.patches": ",".join(name for name, _ in patches),
        f"{LABEL_PREFIX}.sbom": SBOM_PATH,
    }
    source = source_url()
    if source:  # set once the project declares where it is published
        out[f"{oci}.source"] = source
    for name, digest in patches:
        out[f"{LABEL_PREFIX}.patch.{name}"] = f"sha256:{digest}"
    if plugin_wheel is not None:
        out[f"{LABEL_PREFIX}.plugin"] = plugin_wheel[0]
        out[f"{LABEL_PREFIX}.plugin.sha256"] = f"sha256:{plugin_wheel[1]}"
    if light:
        out[f"{LABEL_PREFIX}.light"] = "true"
    return out
