"""Apply a patch series to a site-packages tree with zero fuzz.

Why our own applier: the same code must run on the host (`nox -s patches`) and inside the image,
whose base has neither GNU patch nor git. Rules (those of Debian quilt): every hunk's context must
match exactly; a hunk may move (offset) but never match "almost" (no fuzz). A failing patch names
the file, the hunk and the first line that differs, and writes nothing for that patch.

Stdlib only: imported inside the image before any third-party package is trusted. It reads
patch files and a series and fetches nothing (the trees module unpacks wheels for it).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sglang_image.errors import PatchApplyError, SglangImageError

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_NO_NEWLINE = "\\ No newline at end of file"


@dataclass
class Hunk:
    old_start: int  # 1-based line number in the old file
    old_lines: list[str] = field(default_factory=list)  # context and removed lines, with line ends
    new_lines: list[str] = field(default_factory=list)  # context and added lines, with line ends
    header: str = ""


@dataclass
class FilePatch:
    old_path: str | None  # None: the patch creates the file
    new_path: str | None  # None: the patch deletes the file
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def path(self) -> str:
        path = self.new_path or self.old_path
        assert path is not None
        return path


@dataclass(frozen=True)
class PatchResult:
    name: str
    sha256: str
    files: tuple[str, ...]
    ok: bool
    message: str = ""


def _strip_prefix(raw: str) -> str | None:
    path = raw.split("\t", 1)[0].strip()
    if path == "/dev/null":
        return None
    if path.startswith(("a/", "b/")):
        path = path[2:]
    return path


def parse_patch(text: str, name: str = "<patch>") -> list[FilePatch]:
    """Parses a unified diff (git style, a/ b/ prefixes); the DEP-3 header above it is skipped."""
    lines = text.splitlines(keepends=True)
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(("GIT binary patch", "Binary files ")):
            raise PatchApplyError(f"{name}: binary patches are not supported ({line.strip()})")
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            current = FilePatch(_strip_prefix(line[4:]), _strip_prefix(lines[i + 1][4:]))
            files.append(current)
            i += 2
            while i < len(lines):
                match = _HUNK_RE.match(lines[i])
                if not match:
                    break
                i = _parse_hunk(lines, i, match, current, name)
            continue
        i += 1
    if not files:
        raise PatchApplyError(f"{name}: no unified diff found (expected '--- a/...' / '+++ b/...')")
    return files


def _parse_hunk(lines: list[str], i: int, match: re.Match[str], fp: FilePatch, name: str) -> int:
    old_count = int(match.group(2) or "1")
    new_count = int(match.group(4) or "1")
    hunk = Hunk(old_start=int(match.group(1)), header=lines[i].rstrip("\n"))
    # A zero-length old side names the line *after which* to insert.
    if old_count == 0:
        hunk.old_start += 1
    i += 1
    seen_old = seen_new = 0
    last: str | None = None
    while i < len(lines) and (seen_old < old_count or seen_new < new_count or
                              lines[i].startswith(_NO_NEWLINE)):
        line = lines[i]
        if line.startswith(_NO_NEWLINE):
            # The previous line has no newline in the file it belongs to.
            if last in (" ", "-"):
                hunk.old_lines[-1] = hunk.old_lines[-1].rstrip("\n")
            if last in (" ", "+"):
                hunk.new_lines[-1] = hunk.new_lines[-1].rstrip("\n")
            i += 1
            continue
        tag, body = line[:1], line[1:]
        if line in ("\n", ""):  # some editors strip the single space of an empty context line
            tag, body = " ", "\n"
        if tag == " ":
            hunk.old_lines.append(body)
            hunk.new_lines.append(body)
            seen_old += 1
            seen_new += 1
        elif tag == "-":
            hunk.old_lines.append(body)
            seen_old += 1
        elif tag == "+":
            hunk.new_lines.append(body)
            seen_new += 1
        else:
            raise PatchApplyError(f"{name}: {fp.path}: malformed hunk {hunk.header!r}: {line!r}")
        last = tag
        i += 1
    if seen_old != old_count or seen_new != new_count:
        raise PatchApplyError(f"{name}: {fp.path}: truncated hunk {hunk.header!r}")
    fp.hunks.append(hunk)
    return i


def _find(haystack: list[str], needle: list[str], expected: int, start: int) -> int | None:
    """Exact match of `needle` nearest to `expected`, not before `start` (offsets, no fuzz)."""
    if not needle:
        return min(max(expected, start), len(haystack))
    limit = len(haystack) - len(needle)
    for distance in range(len(haystack) + 1):
        for pos in (expected - distance, expected + distance) if distance else (expected,):
            if start <= pos <= limit and haystack[pos:pos + len(needle)] == needle:
                return pos
        if expected - distance < start and expected + distance > limit:
            return None
    return None


def _first_difference(actual: list[str], wanted: list[str], at: int) -> str:
    for k, want in enumerate(wanted):
        have = actual[at + k] if at + k < len(actual) else "<end of file>"
        if have != want:
            return (f"line {at + k + 1}: expected {want.rstrip(chr(10))!r}, "
                    f"found {have.rstrip(chr(10)) if isinstance(have, str) else have!r}")
    return "context matches only partly"


def apply_file_patch(fp: FilePatch, original: str | None, name: str) -> str | None:
    """Returns the new content (None: file deleted). Raises PatchApplyError at the failing hunk."""
    if fp.old_path is None:
        if original is not None:
            raise PatchApplyError(
                f"{name}: {fp.path}: the patch creates this file but it already exists "
                "(is the series applied twice, or did upstream add the file?)")
        return "".join(line for hunk in fp.hunks for line in hunk.new_lines)
    if original is None:
        raise PatchApplyError(f"{name}: {fp.path}: file not found in the tree "
                              "(moved or removed upstream? rebase the series: nox -s patches -- rebase)")
    lines = original.splitlines(keepends=True)
    out: list[str] = []
    cursor = 0  # first line of `lines` not yet copied to `out`
    offset = 0
    for number, hunk in enumerate(fp.hunks, start=1):
        expected = hunk.old_start - 1 + offset
        pos = _find(lines, hunk.old_lines, expected, cursor)
        if pos is None:
            reapplied = _find(lines, hunk.new_lines, expected, cursor) if hunk.new_lines else None
            hint = (" It looks already applied." if reapplied is not None and hunk.old_lines
                    != hunk.new_lines else f" First difference at the expected place: "
                    f"{_first_difference(lines, hunk.old_lines, max(0, min(expected, len(lines))))}.")
            raise PatchApplyError(
                f"{name}: {fp.path}: hunk #{number} ({hunk.header}) does not apply with zero fuzz "
                f"at line {hunk.old_start}.{hint} Refresh the patch against this upstream: "
                "nox -s patches -- edit FLAVOR, then export.")
        out.extend(lines[cursor:pos])
        out.extend(hunk.new_lines)
        cursor = pos + len(hunk.old_lines)
        offset = pos - (hunk.old_start - 1)
    out.extend(lines[cursor:])
    if fp.new_path is None:
        if out:
            raise PatchApplyError(f"{name}: {fp.path}: deletion patch does not cover the whole file")
        return None
    return "".join(out)


def read_series(patch_dir: Path) -> list[Path]:
    """Patch files in the order of `patch_dir/series` (quilt format: one name a line, # comments)."""
    series = patch_dir / "series"
    if not series.is_file():
        raise PatchApplyError(f"{series}: no series file (list the patches, one per line, in order)")
    names = []
    for raw in series.read_text().splitlines():
        entry = raw.split("#", 1)[0].strip()
        if entry:
            names.append(entry.split()[0])  # quilt allows options such as -p1 after the name
    paths = [patch_dir / n for n in names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise PatchApplyError(f"{series}: lists patches that do not exist: {', '.join(missing)}")
    return paths


def apply_patch(patch_file: Path, site_packages: Path, *, compile_check: bool = True) -> PatchResult:
    data = patch_file.read_bytes()
    name = patch_file.name
    file_patches = parse_patch(data.decode("utf-8"), name)
    new_contents: dict[Path, str | None] = {}
    for fp in file_patches:
        target = site_packages / fp.path
        if target in new_contents:  # several sections for one file: chain them
            original = new_contents[target]
        else:
            original = target.read_text(encoding="utf-8") if target.is_file() else None
        new_contents[target] = apply_file_patch(fp, original, name)
    if compile_check:
        for target, content in new_contents.items():
            if content is not None and target.suffix == ".py":
                try:
                    compile(content, str(target), "exec", dont_inherit=True)
                except SyntaxError as exc:
                    raise PatchApplyError(f"{name}: {target.relative_to(site_packages)} applies but "
                                          f"does not compile: {exc}") from exc
    # Only now touch the tree: a failing patch writes nothing.
    for target, content in new_contents.items():
        if content is None:
            target.unlink()
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content, encoding="utf-8")
    files = tuple(dict.fromkeys(fp.path for fp in file_patches))
    return PatchResult(name, hashlib.sha256(data).hexdigest(), files, True)


def apply_series(patch_files: Sequence[Path], site_packages: Path, *,
                 compile_check: bool = True, keep_going: bool = False) -> list[PatchResult]:
    """Applies patches in order. Raises at the first failure unless keep_going (then reports all)."""
    results = []
    for patch_file in patch_files:
        try:
            results.append(apply_patch(patch_file, site_packages, compile_check=compile_check))
        except PatchApplyError as exc:
            if not keep_going:
                raise
            digest = hashlib.sha256(patch_file.read_bytes()).hexdigest()
            results.append(PatchResult(patch_file.name, digest, (), False, str(exc)))
    return results


def write_manifest(results: Sequence[PatchResult], path: Path) -> None:
    rows = [{"name": r.name, "sha256": r.sha256, "files": list(r.files)} for r in results if r.ok]
    path.write_text(json.dumps(rows, indent=1) + "\n")


def _cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_image.patch",
                                     description="Apply a patch series with zero fuzz.")
    sub = parser.add_subparsers(dest="command", required=True)
    apply = sub.add_parser("apply", help="apply patches/<flavor>/series to a site-packages dir")
    apply.add_argument("--series-dir", type=Path, required=True)
    apply.add_argument("--site-packages", type=Path, required=True)
    apply.add_argument("--manifest", type=Path, help="write the applied patches (name, sha256, files)")
    args = parser.parse_args(argv)
    try:
        results = apply_series(read_series(args.series_dir), args.site_packages)
    except SglangImageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    for r in results:
        print(f"applied  {r.name}  sha256:{r.sha256[:12]}  {', '.join(r.files)}")
    if args.manifest:
        write_manifest(results, args.manifest)
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
