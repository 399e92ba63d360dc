"""A maintainer's patch workflow on git (after Electron's and quilt's): edit, export, rebase.

- edit FLAVOR: a git work tree of the unpacked upstream wheels (tag `upstream`) with one commit per
  patch of the series; the commit's subject is the patch file name and its body the DEP-3 header.
- export FLAVOR: writes the commits after `upstream` back as the series, headers kept.
- rebase FROM TO: carries FROM's series onto TO's upstream with a three-way merge (git cherry-pick)
  and reports each patch that needs hand work, with the conflicting files.
"""
from __future__ import annotations

import datetime
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sglang_image.errors import PatchApplyError
from sglang_image.patch import apply_patch
from sglang_image.pins import REPO_ROOT, Flavor
from sglang_image.trees import prepare_tree

WORK_ROOT = REPO_ROOT / ".cache" / "patchwork"
_DIFF_START = re.compile(r"^(diff --git |--- (a/|/dev/null))", re.MULTILINE)
_IDENTITY = ["-c", "user.name=sglang-image", "-c", "user.email=maintainers@sglang-image.invalid",
             "-c", "commit.gpgsign=false", "-c", "core.autocrlf=false"]


def _git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["git", "-C", str(repo), *_IDENTITY, *args], check=False,
                          capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise PatchApplyError(f"git {' '.join(args)} failed in {repo}:\n{proc.stderr.strip()}")
    return proc


def split_header(text: str) -> tuple[str, str]:
    """(DEP-3 header, diff) of a patch file."""
    match = _DIFF_START.search(text)
    if not match:
        return text, ""
    return text[:match.start()], text[match.start():]


def _commit_all(repo: Path, message: str) -> None:
    _git(repo, "add", "-A", ".")
    subprocess.run(["git", "-C", str(repo), *_IDENTITY, "commit", "-q", "--allow-empty", "-F", "-"],
                   input=message, text=True, check=True, capture_output=True)


def _init_upstream(flavor: Flavor, repo: Path) -> None:
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    prepare_tree(flavor, repo, patched=False)
    _git(repo, "init", "-q", "-b", "work")
    (repo / ".git" / "info" / "exclude").write_text("__pycache__/\n*.pyc\n")
    _commit_all(repo, f"upstream {flavor.name}\n\nUnpacked, hash-checked wheels: "
                      f"{', '.join(flavor.patch_targets)}\n")
    _git(repo, "tag", "-f", "upstream")


def edit(flavor: Flavor, repo: Path | None = None) -> Path:
    """Creates the work tree; returns its path."""
    repo = repo or WORK_ROOT / flavor.name
    _init_upstream(flavor, repo)
    for patch_file in flavor.series():
        apply_patch(patch_file, repo, compile_check=False)
        header, _ = split_header(patch_file.read_text())
        _commit_all(repo, f"{patch_file.name}\n\n{header}")
    return repo


@dataclass(frozen=True)
class ExportedPatch:
    name: str
    changed: bool
    header_added: bool


def _header_for_new_commit(subject: str) -> str:
    today = datetime.date.today().isoformat()
    return (f"Description: {subject}\nAuthor: sglang-image maintainers\nOrigin: vendor\n"
            f"Forwarded: no\nLast-Update: {today}\nDrop-when: TODO say what would let us drop it\n---\n")


def _slug(subject: str) -> str:
    if subject.endswith(".patch"):
        return subject
    return re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")[:60] + ".patch"


def export(flavor: Flavor, repo: Path | None = None) -> list[ExportedPatch]:
    """Writes patches/<flavor>/ from the work tree's commits after `upstream`."""
    repo = repo or WORK_ROOT / flavor.name
    if not (repo / ".git").exists():
        raise PatchApplyError(f"{repo}: no work tree; create it with: nox -s patches -- edit {flavor.name}")
    shas = _git(repo, "rev-list", "--reverse", "upstream..HEAD").stdout.split()
    flavor.patch_dir.mkdir(parents=True, exist_ok=True)
    exported, names = [], []
    for sha in shas:
        message = _git(repo, "log", "-1", "--format=%B", sha).stdout
        subject, _, body = message.partition("\n")
        name = _slug(subject.strip())
        header = body.lstrip("\n")
        header_added = not header.strip()
        if header_added:
            header = _header_for_new_commit(subject.strip())
        diff = _git(repo, "diff", "--no-color", "--no-renames", f"{sha}~1", sha).stdout
        if not diff:
            continue
        text = header if header.endswith("\n") else header + "\n"
        text += diff
        target = flavor.patch_dir / name
        changed = not target.is_file() or target.read_text() != text
        target.write_text(text)
        names.append(name)
        exported.append(ExportedPatch(name, changed, header_added))
    series = flavor.patch_dir / "series"
    comments = [ln for ln in series.read_text().splitlines() if ln.startswith("#")] if series.is_file() else []
    series.write_text("\n".join([*comments, *names]) + "\n")
    for stale in sorted({p.name for p in flavor.patch_dir.glob("*.patch")} - set(names)):
        (flavor.patch_dir / stale).unlink()
    return exported


@dataclass(frozen=True)
class RebaseOutcome:
    name: str
    carried: bool
    detail: str


def rebase(source: Flavor, target: Flavor, repo: Path | None = None) -> tuple[Path, list[RebaseOutcome]]:
    """Carries source's series to target's upstream. The result is target's edit work tree."""
    repo = repo or WORK_ROOT / target.name
    edit(source, repo)
    patch_shas = _git(repo, "rev-list", "--reverse", "upstream..HEAD").stdout.split()
    # The new upstream as a child of the old one, so cherry-pick can merge three ways.
    _git(repo, "checkout", "-q", "-b", "rebase", "upstream")
    for child in repo.iterdir():
        if child.name != ".git":
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    prepare_tree(target, repo, patched=False)
    _commit_all(repo, f"upstream {target.name}\n\nUnpacked, hash-checked wheels: "
                      f"{', '.join(target.patch_targets)}\n")
    _git(repo, "tag", "-f", "upstream")
    outcomes = []
    for sha in patch_shas:
        name = _git(repo, "log", "-1", "--format=%s", sha).stdout.strip()
        pick = _git(repo, "cherry-pick", "--allow-empty", sha, check=False)
        if pick.returncode == 0:
            outcomes.append(RebaseOutcome(name, True, "merged"))
            continue
        conflicts = _git(repo, "diff", "--name-only", "--diff-filter=U").stdout.split()
        _git(repo, "cherry-pick", "--abort", check=False)
        outcomes.append(RebaseOutcome(name, False, "conflicts in " + ", ".join(conflicts or ["?"])))
    _git(repo, "branch", "-f", "work", "HEAD")
    _git(repo, "checkout", "-q", "work")
    _git(repo, "branch", "-D", "rebase")
    return repo, outcomes
