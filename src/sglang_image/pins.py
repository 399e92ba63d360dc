"""Flavors: one TOML file of pins per SGLang release (images/flavors/<name>.toml).

A flavor is data. This module only reads and checks it; nothing here knows a version number.
Each version is written once in the file, in [lock] requirements (`Flavor.pinned`); [stack]
says only what is not a version pin (the Python, which requirement is the kernel).
"""
from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from sglang_image.errors import PinError
from sglang_image.patch import read_series

REPO_ROOT = Path(__file__).resolve().parents[2]
FLAVOR_DIR = REPO_ROOT / "images" / "flavors"
PATCH_ROOT = REPO_ROOT / "patches"
# The plugin's sources: its wheel is built from PLUGIN_DIR, its digests are recorded in the package's
# folder, and the smoke mounts that folder (its contract, setting.py, is imported by name).
PLUGIN_DIR = REPO_ROOT / "plugin"
PLUGIN_PACKAGE_DIR = PLUGIN_DIR / "sglang_image_plugin"
DEFAULT_FLAVOR = "sglang-0.5.23"
# The distributions every flavor's [lock] requirements pin (with its kernel_package): the stack
# the labels, the tests and the README name by version.
STACK = ("sglang", "torch", "flashinfer-python", "transformers")
# What [stack] holds: what is not a version pin.
STACK_KEYS = {"python", "kernel_package"}


@dataclass(frozen=True, kw_only=True)
class PinnedBase:
    """The flavor's base image as its file pins it ([base_image]): a name and a digest."""

    name: str
    digest: str
    digest_verified: bool

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.digest}"


@dataclass(frozen=True, kw_only=True)
class Flavor:
    name: str
    python_version: str
    kernel_package: str  # which requirement is SGLang's kernel (sgl-kernel, later sglang-kernel)
    base_image: PinnedBase
    cuda_arch_list: str
    platforms: tuple[str, ...]
    requirements: tuple[str, ...]
    indexes: tuple[str, ...]
    find_links: tuple[str, ...]
    patch_targets: tuple[str, ...]
    # The project's SGLang plugin package (plugin/) goes into this flavor's image.
    plugin: bool = False
    toml_path: Path
    lock_path: Path
    patch_dir: Path

    def pinned(self, distribution: str) -> str:
        """The version `requirements` pin `distribution` to: the flavor file's one record of it."""
        wanted = canonicalize_name(distribution)
        for text in self.requirements:
            requirement = Requirement(text)
            if canonicalize_name(requirement.name) == wanted:
                return requirement_pin(text)
        raise PinError(f"{self.toml_path.name} [lock]: requirements pin no {distribution}: add "
                       f"'{distribution}==VERSION' there")

    def requires(self, distribution: str) -> bool:
        """Whether `requirements` name `distribution`: the flavor's image carries it."""
        wanted = canonicalize_name(distribution)
        return any(canonicalize_name(Requirement(text).name) == wanted
                   for text in self.requirements)

    @property
    def sglang_version(self) -> str:
        return self.pinned("sglang")

    def series(self) -> list[Path]:
        """The patch files in the order of patches/<flavor>/series."""
        return read_series(self.patch_dir)

    def lock_inputs_digest(self) -> str:
        """Hash of what the lock is resolved from: a lock whose header differs is stale."""
        inputs = {"python": self.python_version, "platforms": self.platforms,
                  "requirements": self.requirements, "indexes": self.indexes,
                  "find_links": self.find_links}
        return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def requirement_pin(text: str) -> str:
    """The version of a requirement pinned with one `==` ("torch==2.9.1+cu130" -> "2.9.1+cu130")."""
    specifiers = list(Requirement(text).specifier)
    if len(specifiers) != 1 or specifiers[0].operator != "==":
        raise ValueError(f"{text!r} is not pinned with one '=='")
    return specifiers[0].version


def flavor_names() -> list[str]:
    return sorted(p.stem for p in FLAVOR_DIR.glob("*.toml"))


def _require(table: dict[str, Any], key: str, where: str) -> Any:
    if key not in table:
        raise PinError(f"{where}: missing key '{key}'")
    return table[key]


def _flag(table: dict[str, Any], key: str, where: str) -> bool:
    value = table.get(key, False)
    if not isinstance(value, bool):
        raise PinError(f"{where}: '{key}' must be true or false, got {value!r}")
    return value


def _is_pinned(text: str) -> bool:
    try:
        requirement_pin(text)
    except (InvalidRequirement, ValueError):
        return False
    return True


def load_flavor(name: str | None = None, flavor_dir: Path = FLAVOR_DIR) -> Flavor:
    name = name or DEFAULT_FLAVOR
    path = flavor_dir / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(p.stem for p in sorted(flavor_dir.glob("*.toml"))) or "none"
        raise PinError(f"unknown flavor '{name}': {path} does not exist (known flavors: {known})")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise PinError(f"{path}: not valid TOML: {exc}") from exc
    where = str(path.relative_to(flavor_dir.parent.parent)) if flavor_dir == FLAVOR_DIR else str(path)
    stack = _require(data, "stack", where)
    versions = sorted(set(stack) - STACK_KEYS)
    if versions:
        raise PinError(f"{where} [stack]: {versions} not known there: a version is written once, in "
                       f"[lock] requirements ('NAME==VERSION'); [stack] holds only "
                       f"{', '.join(sorted(STACK_KEYS))}")
    base = _require(data, "base_image", where)
    build = _require(data, "build", where)
    lock = _require(data, "lock", where)
    digest = str(_require(base, "digest", f"{where} [base_image]"))
    if not digest.startswith("sha256:") or len(digest) != 71:
        raise PinError(f"{where} [base_image]: digest must be 'sha256:' and 64 hex digits, "
                       f"got {digest!r} (a tag alone is not a pin)")
    requirements = tuple(str(r) for r in _require(lock, "requirements", f"{where} [lock]"))
    patch = data.get("patch", {})
    unpinned = [r for r in requirements if not _is_pinned(r)]
    if unpinned:
        raise PinError(f"{where} [lock]: every requirement must be pinned with '==': {unpinned}")
    flavor = Flavor(
        name=name,
        python_version=str(_require(stack, "python", where)),
        kernel_package=str(_require(stack, "kernel_package", where)),
        base_image=PinnedBase(name=str(_require(base, "name", where)), digest=digest,
                             digest_verified=bool(base.get("digest_verified", False))),
        cuda_arch_list=str(_require(build, "cuda_arch_list", where)),
        platforms=tuple(_require(build, "platforms", where)),
        requirements=requirements,
        indexes=tuple(lock.get("indexes", ())),
        find_links=tuple(lock.get("find_links", ())),
        patch_targets=tuple(patch.get("targets", ("sglang",))),
        plugin=_flag(patch, "plugin", f"{where} [patch]"),
        toml_path=path,
        lock_path=path.with_suffix(".lock"),
        patch_dir=PATCH_ROOT / name,
    )
    for distribution in (*STACK, flavor.kernel_package):
        flavor.pinned(distribution)  # the stack's versions are there, once: checked here
    return flavor
