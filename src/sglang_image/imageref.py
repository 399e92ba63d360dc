"""Where a published image lives: the registry argument and the digest users pull by.

One grammar for `nox -s publish -- --registry` and `nox -s deploy -- --registry --digest`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from sglang_image.errors import UsageError

_REGISTRY = re.compile(r"^(?P<host>[A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\])(?::(?P<port>\d+))?"
                       r"(?:/(?P<namespace>[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*))?$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class Target:
    registry: str  # host[:port]
    repository: str  # [namespace/]sglang-image

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"

    def by_digest(self, digest: str) -> str:
        """REGISTRY/REPOSITORY@sha256:... (what users pull and what the manifests run)."""
        return f"{self.name}@{parse_digest(digest)}"


def parse_registry(text: str, image_name: str) -> Target:
    """HOST[:PORT][/NAMESPACE] -> Target (the image goes to NAMESPACE/IMAGE_NAME)."""
    if "://" in text or "@" in text:
        raise UsageError(f"--registry {text!r}: give HOST[:PORT]/NAMESPACE, without a scheme "
                         "or credentials (they come from `docker login HOST[:PORT]`)")
    match = _REGISTRY.match(text.rstrip("/"))
    if match is None:
        raise UsageError(f"--registry {text!r} is not HOST[:PORT]/NAMESPACE (lower-case "
                         "namespace), e.g. registry.example.com/team or 127.0.0.1:5000/test")
    registry = match["host"] + (f":{match['port']}" if match["port"] else "")
    namespace = match["namespace"]
    return Target(registry, f"{namespace}/{image_name}" if namespace else image_name)


def parse_digest(text: str) -> str:
    """sha256:<64 lower-case hex digits>, the digest `nox -s publish` prints."""
    if not _DIGEST.match(text):
        raise UsageError(f"--digest {text!r} is not an image digest: give sha256: and 64 "
                         "lower-case hex digits, the last line `nox -s publish` printed "
                         "(or `docker buildx imagetools inspect IMAGE` shows)")
    return text


def is_loopback(registry: str) -> bool:
    """The engine treats 127.0.0.0/8 and localhost as insecure registries (HTTPS, else plain
    HTTP) without being told: so do we."""
    host = registry.rsplit(":", 1)[0] if not registry.startswith("[") else registry[1:].split("]")[0]
    return host in ("localhost", "::1") or host.startswith("127.")
