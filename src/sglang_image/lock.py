"""The hash-pinned lock of every Python package in the image (images/flavors/<flavor>.lock).

The lock is pip's requirements format with `--hash` lines, resolved by `uv pip compile
--generate-hashes` for the flavor's Python and platform, so the image build installs with
`pip install --require-hashes --no-deps` and never resolves. Entries that come from an index this
machine cannot reach are written as `# unverified:` comments (and the lock is then incomplete).
A lock already there seeds the resolution: every pin the requirements still allow is kept, so
adding a requirement changes only what it brings (uv prefers the pins of its output file).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sglang_image.errors import LockError
from sglang_image.pins import REPO_ROOT, Flavor

PYPI = "https://pypi.org/simple"
_HEADER_DIGEST = "# inputs-sha256: "
_UNVERIFIED = "# unverified: "
_ENTRY_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
_HASH_RE = re.compile(r"--hash=sha256:([0-9a-f]{64})")


@dataclass(frozen=True)
class LockEntry:
    name: str
    version: str
    hashes: tuple[str, ...]
    verified: bool
    note: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> list[LockEntry]:
    if not path.is_file():
        raise LockError(f"{path}: no lock file; generate it with: nox -s lock -- {path.stem}")
    entries: list[LockEntry] = []
    current: tuple[str, str, list[str]] | None = None
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith(_UNVERIFIED):
            body = stripped[len(_UNVERIFIED):]
            match = _ENTRY_RE.match(body)
            if match:
                entries.append(LockEntry(normalize(match.group(1)), match.group(2), (), False,
                                         body[match.end():].strip(" -")))
            continue
        if not stripped or stripped.startswith("#"):
            continue
        match = _ENTRY_RE.match(stripped)
        if match:
            if current:
                entries.append(LockEntry(current[0], current[1], tuple(current[2]), True))
            current = (normalize(match.group(1)), match.group(2), [])
        if current is not None:
            current[2].extend(_HASH_RE.findall(stripped))
    if current:
        entries.append(LockEntry(current[0], current[1], tuple(current[2]), True))
    missing = [e.requirement for e in entries if e.verified and not e.hashes]
    if missing:
        raise LockError(f"{path}: entries without --hash: {missing}; regenerate: nox -s lock")
    return entries


def read_requirements_graph(path: Path) -> dict[str, set[str]]:
    """Each locked distribution -> the locked distributions it requires, from the lock's
    `# via` lines (uv writes, under every entry, the entries that require it)."""
    graph: dict[str, set[str]] = {e.name: set() for e in read_lock(path)}
    current: str | None = None
    in_via = False
    for line in path.read_text().splitlines():
        match = _ENTRY_RE.match(line)
        if match:
            current, in_via = normalize(match.group(1)), False
            continue
        stripped = line.strip()
        if current is None or not stripped.startswith("#"):
            continue
        if stripped.startswith("# via"):
            parent = stripped[len("# via"):].strip()
            in_via = not parent
            if parent and not parent.startswith("-r"):
                graph.setdefault(normalize(parent), set()).add(current)
        elif in_via and stripped.startswith("#   "):
            parent = stripped[1:].strip()
            if not parent.startswith("-r"):
                graph.setdefault(normalize(parent), set()).add(current)
    return graph


def reachable(graph: dict[str, set[str]], roots: Iterable[str],
              stop: Iterable[str] = ()) -> set[str]:
    """The distributions the roots require, transitively, without passing through `stop`."""
    blocked = set(stop)
    seen: set[str] = set()
    todo = [normalize(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name in blocked:
            continue
        seen.add(name)
        todo.extend(graph.get(name, ()))
    return seen


def check_fresh(flavor: Flavor) -> None:
    """Fails when the flavor's pins changed after its lock was generated."""
    text = flavor.lock_path.read_text() if flavor.lock_path.is_file() else ""
    want = _HEADER_DIGEST + flavor.lock_inputs_digest()
    if want not in text.splitlines():
        raise LockError(f"{flavor.lock_path.name} is stale or missing: {flavor.toml_path.name} changed "
                        f"since it was generated. Regenerate it: nox -s lock -- {flavor.name}")


def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10):
            return True
    except (urllib.error.URLError, OSError):
        return False


def _uv() -> str:
    uv = shutil.which("uv")
    if not uv:
        raise LockError("uv is not installed: run the lock through nox (nox -s lock), which installs it")
    return uv


def _compile(flavor: Flavor, requirements: list[str], extra_indexes: list[str],
             find_links: list[str]) -> str:
    platform = next(p for p in flavor.platforms if p.startswith("manylinux"))
    tag = "x86_64-" + platform.replace("_x86_64", "")
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "flavor-requirements.in"
        req.write_text("\n".join(requirements) + "\n")
        out = Path(tmp) / "lock.txt"
        if flavor.lock_path.is_file():  # uv keeps the pins of an existing output file
            shutil.copyfile(flavor.lock_path, out)
        # Relative paths, run from the temp dir: the lock's "# via -r ..." lines stay stable.
        cmd = [_uv(), "pip", "compile", req.name, "--python-version", flavor.python_version,
               "--python-platform", tag, "--generate-hashes", "--no-header",
               "--index-url", PYPI, "--index-strategy", "unsafe-best-match", "-o", out.name]
        for index in extra_indexes:
            cmd += ["--extra-index-url", index]
        for link in find_links:
            cmd += ["--find-links", link]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=tmp)
        if proc.returncode != 0:
            raise LockError(f"uv pip compile failed for {flavor.name}:\n{proc.stderr.strip()[-3000:]}")
        return out.read_text()


def regenerate(flavor: Flavor) -> Path:
    """Resolves the flavor's requirements and writes the lock; returns its path."""
    unreachable = [u for u in (*flavor.indexes, *flavor.find_links) if not _reachable(u)]
    header = [f"# Lock of every Python package in the {flavor.name} image. Generated; do not edit.",
              f"# Regenerate: nox -s lock -- {flavor.name}",
              _HEADER_DIGEST + flavor.lock_inputs_digest()]
    if not unreachable:
        body = _compile(flavor, list(flavor.requirements), list(flavor.indexes),
                        list(flavor.find_links))
        flavor.lock_path.write_text("\n".join(header) + "\n" + body)
        return flavor.lock_path
    # Partial lock: resolve the rest against PyPI with the local-version pins relaxed to their
    # public release, then list the off-PyPI wheels as unverified.
    local = [r for r in flavor.requirements if "+" in r]
    relaxed = [r.split("+", 1)[0] for r in local]
    public = [r for r in flavor.requirements if "+" not in r] + relaxed
    body = _compile(flavor, public, [], [])
    kept, skip = [], False
    relaxed_names = {normalize(r.split("==")[0]) for r in relaxed}
    for line in body.splitlines():
        match = _ENTRY_RE.match(line)
        if match:
            skip = normalize(match.group(1)) in relaxed_names
        if not skip:
            kept.append(line)
    header += [f"# INCOMPLETE: {', '.join(unreachable)} not reachable from this machine.",
               "# The entries below marked 'unverified' have no hash yet; the CUDA runtime wheels were",
               "# resolved for PyPI's build of the same torch release. Run the lock again where those",
               "# indexes are reachable to complete it. The image build refuses an incomplete lock."]
    sources = ", ".join(unreachable)
    header += [f"{_UNVERIFIED}{r} - from {sources}; hash not checked" for r in local]
    flavor.lock_path.write_text("\n".join(header) + "\n" + "\n".join(kept) + "\n")
    return flavor.lock_path


def require_complete(flavor: Flavor) -> list[LockEntry]:
    """The lock's entries, or an error when any of them is unverified (what a build needs)."""
    check_fresh(flavor)
    entries = read_lock(flavor.lock_path)
    unverified = [e.requirement for e in entries if not e.verified]
    if unverified:
        raise LockError(f"{flavor.lock_path.name} is incomplete: {unverified} could not be hash-checked "
                        f"here. On a machine that reaches {', '.join(flavor.indexes + flavor.find_links)}"
                        f" run: nox -s lock -- {flavor.name}")
    return entries


@dataclass(frozen=True, kw_only=True)
class LockOptions:
    """What `nox -s lock` was asked for besides the flavor: nothing yet (a lock already there
    seeds the resolution; delete it to resolve afresh)."""


def run(flavor: Flavor, options: LockOptions) -> int:
    """`nox -s lock -- FLAVOR`: regenerates the flavor's lock and says what it holds (and which
    entries are unverified, for an incomplete one)."""
    path = regenerate(flavor)
    entries = read_lock(path)
    unverified = [e.requirement for e in entries if not e.verified]
    print(f"{flavor.name}: {len(entries)} packages -> {path.relative_to(REPO_ROOT)}"
          + (f" (incomplete: {', '.join(unverified)})" if unverified else ""))
    return 0
