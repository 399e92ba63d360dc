"""The build plan: what `nox -s build` was asked for, resolved once into one typed value.

`BuildOptions` checks every option when it is made (a bad --tag or --base stops before any work);
`locked_entries` checks the flavor's lock once (a stale or incomplete lock stops before an engine
is found) and keeps its verified entries (those of a light build only, for tests); `make_plan`
finds the base image in the engine (pulling a pinned one it lacks) and fixes the tags and the
commit's time. Every later step (context, labels, the builds) reads the plan - `plan.flavor`,
`plan.options` - never the lock or the command line again.
"""
from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import docker.errors
from docker import DockerClient

from sglang_image import lock
from sglang_image.errors import BuildError, UsageError
from sglang_image.fetch import WHEEL_CACHE
from sglang_image.lock import LockEntry
from sglang_image.pins import REPO_ROOT, Flavor

IMAGE_REPO = "sglang-image"
# The builder's images a build keeps tagged so that the SGLang install stays cached.
BUILD_CACHE_REPO = f"{IMAGE_REPO}-build-cache"
# Installed in the light build besides SGLang and the patch targets: what the SBOM step runs.
SBOM_TOOL = "cyclonedx-bom"


# An image reference as the engine parses it (distribution's reference grammar): an optional
# registry host[:port]/, lower-case path components, an optional :tag and, for --base, @digest.
_HOST_PART = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_DOMAIN = rf"(?:{_HOST_PART}(?:\.{_HOST_PART})*(?::[0-9]+)?/)?"
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
_TAG = r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
_DIGEST = r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?"
_REFERENCE = re.compile(_DOMAIN + _PATH + _TAG)
_REFERENCE_WITH_DIGEST = re.compile(_DOMAIN + _PATH + _TAG + _DIGEST)


def check_reference(text: str, option: str, *, digest: bool = False) -> None:
    """Refuses what the engine would refuse as an image reference, naming the option."""
    pattern = _REFERENCE_WITH_DIGEST if digest else _REFERENCE
    if not pattern.fullmatch(text):
        example = "NAME[:TAG][@sha256:DIGEST]" if digest else "NAME[:TAG]"
        raise UsageError(f"{option} {text!r} is not an image reference: give {example}, the name "
                         f"in lower case without spaces (e.g. registry.example.com/team/sglang:1)")


def with_tag(reference: str) -> str:
    """`reference` with its tag, `:latest` where it names none (a registry port is no tag)."""
    return reference if ":" in reference.rsplit("/", 1)[-1] else f"{reference}:latest"


@dataclass(frozen=True, kw_only=True)
class BuildOptions:
    """What `nox -s build` was asked for, besides the flavor; checked when made."""

    tag: str | None = None  # default: sglang-image:<VERSION>-<flavor>
    base: str | None = None  # an image reference that replaces the flavor's pinned base
    no_cache: bool = False
    # Light: SGLang, the patch targets and the SBOM tool only, none of their heavy dependencies.
    # Same Dockerfile, same stages; for tests (seconds, megabytes) - not a working server.
    light: bool = False
    wheel_cache: Path = WHEEL_CACHE
    work_dir: Path = REPO_ROOT / ".cache" / "build"
    output_dir: Path | None = None  # default: build/<tag with ':' as '-'>

    def __post_init__(self) -> None:
        if self.tag is not None:
            check_reference(self.tag, "--tag")
        if self.base is not None:
            check_reference(self.base, "--base", digest=True)


@dataclass(frozen=True, kw_only=True)
class ResolvedBase:
    """The image part 1 is built FROM, as found in the engine (the flavor's pins.PinnedBase, or
    --base)."""

    ref: str  # the reference for FROM (the pinned name@digest, or --base)
    name: str  # without the digest: the base.name label
    digest: str  # the base.digest label
    image_id: str  # sha256:<hex> of its config: part of the build keys
    diff_ids: tuple[str, ...]  # its layers, from the bottom up
    history: int  # its number of history entries


@dataclass(frozen=True, kw_only=True)
class BuildPlan:
    """One build, resolved: the flavor, the options, the flavor's verified lock entries, the base,
    the tags."""

    flavor: Flavor
    options: BuildOptions
    entries: tuple[LockEntry, ...]  # verified, all hash-pinned; a light build's subset
    base: ResolvedBase
    tags: tuple[str, ...]
    epoch: int  # SOURCE_DATE_EPOCH: the time every layer, the config and the labels carry

    @property
    def work(self) -> Path:
        """This flavor's build folder (a light build has its own)."""
        return self.options.work_dir / (self.flavor.name + ("-light" if self.options.light else ""))


def version() -> str:
    return (REPO_ROOT / "VERSION").read_text().strip()


def default_tag(flavor: Flavor) -> str:
    return f"{IMAGE_REPO}:{version()}-{flavor.name}"


def _git(*args: str) -> str | None:
    proc = subprocess.run(["git", "-C", str(REPO_ROOT), *args], check=False,
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def source_date_epoch() -> int:
    """SOURCE_DATE_EPOCH if set, else the last commit's time, else 0 (a tree with no commit)."""
    if os.environ.get("SOURCE_DATE_EPOCH", "").isdigit():
        return int(os.environ["SOURCE_DATE_EPOCH"])
    stamp = _git("log", "-1", "--format=%ct")
    return int(stamp) if stamp and stamp.isdigit() else 0


def revision() -> str:
    return _git("rev-parse", "HEAD") or "unknown"


def dependency_closure(lock_text: str, roots: Iterable[str]) -> set[str]:
    """Names reachable from `roots` through the lock's `# via` comments (uv pip compile)."""
    parents: dict[str, set[str]] = {}
    current = None
    for line in lock_text.splitlines():
        head = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", line)
        if head:
            current = lock.normalize(head.group(1))
            parents[current] = set()
            continue
        by = re.match(r"^\s+#\s+(?:via\s+)?([A-Za-z0-9][A-Za-z0-9._-]*)\s*$", line)
        if current and by and by.group(1) != "via":
            parents[current].add(lock.normalize(by.group(1)))
    wanted = {lock.normalize(r) for r in roots}
    changed = True
    while changed:
        changed = False
        for name, via in parents.items():
            if name not in wanted and via & wanted:
                wanted.add(name)
                changed = True
    return wanted


def unverified_base_warning(flavor: Flavor, options: BuildOptions) -> str | None:
    """What to say when the build uses a pinned base whose digest nobody checked."""
    base = flavor.base_image
    if options.base is not None or base.digest_verified:
        return None
    return (f"the base digest in {flavor.toml_path.name} is unverified (digest_verified = "
            f"false): {base.ref} was pinned without checking it against its registry. Check it "
            f"where the hub is reachable (docker pull {base.name}; compare RepoDigests), then set "
            f"digest_verified = true")


def locked_entries(flavor: Flavor, *, light: bool = False) -> tuple[LockEntry, ...]:
    """The flavor's lock, checked once: fresh, complete, every entry verified; for a light build
    only SGLang, the patch targets and the SBOM tool with their dependencies."""
    entries = lock.require_complete(flavor)
    if light:
        wanted = dependency_closure(flavor.lock_path.read_text(), [SBOM_TOOL])
        wanted |= {lock.normalize(t) for t in flavor.patch_targets} | {lock.normalize("sglang")}
        entries = [e for e in entries if e.name in wanted]
    return tuple(entries)


def resolve_base(client: DockerClient, flavor: Flavor, options: BuildOptions,
                 log: Callable[[str], None]) -> ResolvedBase:
    """The base image in the engine; pulls a pinned base that is not there."""
    if options.base:
        ref, name = options.base, options.base.split("@")[0]
    else:
        ref, name = flavor.base_image.ref, flavor.base_image.name
    try:
        image = client.images.get(ref)
    except docker.errors.ImageNotFound:
        log(f"base: {ref} is not in the engine, pulling it")
        try:
            repo, _, digest = ref.partition("@")
            image = client.images.pull(repo, tag=digest or None)
        except docker.errors.APIError as exc:
            raise BuildError(
                f"base image {ref} is missing: not in the engine and the pull failed "
                f"({exc.explanation or exc}). Without an image hub, make a base from Debian "
                f"packages and build on it: nox -s base -- --flavor {flavor.name}, then "
                f"nox -s build -- --flavor {flavor.name} --base TAG (the tag it prints). "
                f"Or load the pinned one (docker load -i FILE / docker pull {ref} where a "
                f"registry is reachable)") from exc
    if "@" in ref:
        digest = ref.split("@", 1)[1]
    else:
        repo_digests = image.attrs.get("RepoDigests") or []
        digest = repo_digests[0].split("@", 1)[1] if repo_digests else str(image.id)
    return ResolvedBase(ref=ref, name=name, digest=digest, image_id=str(image.id),
                     diff_ids=tuple(image.attrs["RootFS"].get("Layers") or ()),
                     history=len(client.api.history(image.id)))  # type: ignore[no-untyped-call]


def make_plan(flavor: Flavor, options: BuildOptions, entries: tuple[LockEntry, ...],
              client: DockerClient, log: Callable[[str], None]) -> BuildPlan:
    """The plan of one build from the flavor's `locked_entries`: the base found in the engine."""
    return BuildPlan(flavor=flavor, options=options, entries=entries,
                     base=resolve_base(client, flavor, options, log),
                     tags=(with_tag(options.tag or default_tag(flavor)),), epoch=source_date_epoch())
