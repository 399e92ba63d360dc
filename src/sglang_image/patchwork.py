"""A maintainer's patch workflow on git (after Electron's and quilt's): edit, export, rebase.

- edit FLAVOR: a git work tree of the unpacked upstream wheels (tag `upstream`) with one commit per
  patch of the series; the commit's subject is the patch file name and its body the DEP-3 header.
- export FLAVOR: writes the commits after `upstream` back as the series, headers kept.
- rebase FROM TO: carries FROM's series onto TO's upstream with a three-way merge (git cherry-pick,
  which follows renamed files; a file removed upstream is followed to where its code went when the
  hunks apply there with zero fuzz). At a conflict it stops with the markers in the work tree, like
  `git am -3`; `rebase --continue` resumes after the fix.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sglang_image.errors import PatchApplyError
from sglang_image.patch import FilePatch, apply_file_patch, apply_patch, parse_patch
from sglang_image.pins import REPO_ROOT, Flavor
from sglang_image.trees import prepare_tree

WORK_ROOT = REPO_ROOT / ".cache" / "patchwork"
_DIFF_START = re.compile(r"^(diff --git |--- (a/|/dev/null))", re.MULTILINE)
_IDENTITY = ["-c", "user.name=sglang-image", "-c", "user.email=maintainers@sglang-image.invalid",
             "-c", "commit.gpgsign=false", "-c", "core.autocrlf=false",
             # a work tree of tens of thousands of files: no packing after each commit
             "-c", "gc.auto=0"]


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


@dataclass(frozen=True)
class RebaseState:
    """A rebase in progress: what `rebase --continue` needs (kept in the work tree's .git)."""
    source: str
    target: str
    current: str | None  # the commit whose conflicts wait for the maintainer
    todo: tuple[str, ...]  # commits still to pick after it
    outcomes: tuple[RebaseOutcome, ...]

    def save(self, repo: Path) -> None:
        data = {"source": self.source, "target": self.target, "current": self.current,
                "todo": list(self.todo), "outcomes": [dataclasses.asdict(o) for o in self.outcomes]}
        _state_path(repo).write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, repo: Path) -> RebaseState:
        path = _state_path(repo)
        if not path.is_file():
            raise PatchApplyError(f"{repo}: no rebase in progress (start one with: "
                                  "nox -s patches -- rebase FROM TO)")
        data = json.loads(path.read_text())
        return cls(source=data["source"], target=data["target"], current=data["current"],
                   todo=tuple(data["todo"]),
                   outcomes=tuple(RebaseOutcome(**o) for o in data["outcomes"]))


@dataclass(frozen=True)
class RebaseResult:
    repo: Path
    outcomes: list[RebaseOutcome]
    stopped: RebaseOutcome | None  # the patch left with conflicts in the work tree, if any


def _state_path(repo: Path) -> Path:
    return repo / ".git" / "sglang-image-rebase.json"


def _unmerged(repo: Path) -> list[str]:
    return sorted(set(_git(repo, "diff", "--name-only", "--diff-filter=U").stdout.split()))


def _significant(line: str) -> str | None:
    """A line worth searching for elsewhere: code, not blank lines, brackets or imports."""
    text = line.strip()
    if len(text) < 12 or text.startswith(("#", "import ", "from ", ")", "]", "}")):
        return None
    return text


def find_by_content(repo: Path, fp: FilePatch) -> list[tuple[str, int, int]]:
    """Files of the work tree holding the most of a file patch's old lines: (path, found, of)."""
    wanted = {t for hunk in fp.hunks for ln in hunk.old_lines if (t := _significant(ln))}
    if not wanted:
        return []
    suffix = Path(fp.path).suffix
    tracked = _git(repo, "ls-files").stdout.splitlines()
    scores = []
    for rel in tracked:
        if rel == fp.path or not rel.endswith(suffix):
            continue
        try:
            lines = {ln.strip() for ln in (repo / rel).read_text(encoding="utf-8").splitlines()}
        except (UnicodeDecodeError, OSError):
            continue
        found = len(wanted & lines)
        if found:
            scores.append((rel, found, len(wanted)))
    scores.sort(key=lambda s: (-s[1], s[0]))
    return [s for s in scores[:3] if s[1] * 2 >= s[2]]  # at least half of the lines


_HUNK_SCOPE = re.compile(r"^@@ [^@]* @@ .*?\b(def|class) (\w+)")


def moved_definitions(repo: Path, fp: FilePatch) -> list[str]:
    """For the functions and classes a file patch's hunks sit in (git names them in the hunk
    header): those no longer defined in the file, with the files that define them now."""
    text = _git(repo, "show", f"HEAD:{fp.path}", check=False).stdout  # upstream's, no markers
    notes = []
    for kind, name in dict.fromkeys(m.groups() for h in fp.hunks if (m := _HUNK_SCOPE.match(h.header))):
        pattern = f"{kind} {name}"
        if re.search(rf"^\s*{pattern}\b", text, re.MULTILINE):
            continue
        grep = _git(repo, "grep", "-l", "-E", rf"^\s*(async )?{pattern}\b", "--", f"*{Path(fp.path).suffix}",
                    check=False).stdout.split()
        grep = [rel for rel in grep if rel != fp.path]  # its work-tree copy holds the patched side
        if grep:
            notes.append(f"{name} moved from {fp.path} to {', '.join(grep[:3])}")
    return notes


def _file_patch(repo: Path, sha: str, path: str) -> FilePatch:
    diff = _git(repo, "diff", "--no-color", "--no-renames", f"{sha}~1", sha, "--", path).stdout
    [fp] = parse_patch(diff, path)
    return fp


def _follow_moved(repo: Path, sha: str, path: str) -> str:
    """A file the patch changes was removed upstream: applies its hunks, with zero fuzz, to the one
    file that now holds that code, or says where the code went. Returns a line for the report."""
    fp = _file_patch(repo, sha, path)
    candidates = find_by_content(repo, fp)
    if not candidates:
        return f"{path} was removed upstream and its code was not found elsewhere"
    best = candidates[0][0]
    try:
        moved = FilePatch(best, best, fp.hunks)
        new = apply_file_patch(moved, (repo / best).read_text(encoding="utf-8"), path)
    except PatchApplyError:
        where = ", ".join(f"{rel} ({found} of {of} lines)" for rel, found, of in candidates)
        return f"{path} was removed upstream; its code is now in {where}: port the change there"
    assert new is not None
    (repo / best).write_text(new, encoding="utf-8")
    _git(repo, "rm", "-q", "--", path)
    _git(repo, "add", "--", best)
    return f"followed {path} -> {best} (found by content)"


def _pick(repo: Path, sha: str) -> tuple[RebaseOutcome, bool]:
    """Cherry-picks one patch commit. Returns its outcome and whether it is committed."""
    name = _git(repo, "log", "-1", "--format=%s", sha).stdout.strip()
    before = set(_git(repo, "diff", "--name-only", "-M", f"{sha}~1", sha).stdout.split())
    pick = _git(repo, "-c", "merge.renameLimit=100000", "cherry-pick", "--allow-empty",
                "--keep-redundant-commits", sha, check=False)
    if pick.returncode == 0:
        after = set(_git(repo, "diff", "--name-only", "HEAD~1", "HEAD").stdout.split())
        moved = sorted(after - before)
        return RebaseOutcome(name, True, "merged" + (f" (followed to {', '.join(moved)})"
                                                     if moved else "")), True
    notes = []
    status = _git(repo, "status", "--porcelain").stdout.splitlines()
    deleted_upstream = [ln[3:] for ln in status if ln.startswith("DU ")]  # removed by upstream
    for path in deleted_upstream:
        try:
            notes.append(_follow_moved(repo, sha, path))
        except (PatchApplyError, ValueError) as exc:  # a diff our parser cannot follow
            notes.append(f"{path} was removed upstream ({exc})")
    conflicts = _unmerged(repo)
    if not conflicts and not deleted_upstream:  # failed for another reason than a conflict
        raise PatchApplyError(f"git cherry-pick of {name} failed in {repo}:\n"
                              f"{(pick.stdout + pick.stderr).strip()}")
    if not conflicts:
        _git(repo, "commit", "-q", "--allow-empty", "--no-verify", "-C", sha)
        return RebaseOutcome(name, True, "merged; " + "; ".join(notes)), True
    for path in conflicts:
        if path not in deleted_upstream:
            with contextlib.suppress(PatchApplyError, ValueError):
                notes.extend(moved_definitions(repo, _file_patch(repo, sha, path)))
    detail = "conflicts in " + ", ".join(conflicts)
    return RebaseOutcome(name, False, detail + ("; " + "; ".join(notes) if notes else "")), False


def _run_picks(repo: Path, state: RebaseState) -> RebaseResult:
    outcomes = list(state.outcomes)
    todo = list(state.todo)
    while todo:
        sha = todo.pop(0)
        outcome, committed = _pick(repo, sha)
        outcomes.append(outcome)
        if not committed:
            RebaseState(state.source, state.target, sha, tuple(todo), tuple(outcomes)).save(repo)
            return RebaseResult(repo, outcomes, outcome)
    _state_path(repo).unlink(missing_ok=True)
    _git(repo, "branch", "-f", "work", "HEAD")
    _git(repo, "checkout", "-q", "work")
    _git(repo, "branch", "-D", "rebase")
    return RebaseResult(repo, outcomes, None)


def rebase(source: Flavor, target: Flavor, repo: Path | None = None) -> RebaseResult:
    """Carries source's series to target's upstream (git cherry-pick: a three-way merge that
    follows renames). A patch whose file upstream removed is applied to the file now holding its
    code when that works with zero fuzz. At the first conflict the patch is left in the work tree
    with conflict markers and the rebase stops, like `git am -3`: fix, `git add`, then
    rebase_continue. The result is target's edit work tree."""
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
    return _run_picks(repo, RebaseState(source.name, target.name, None, tuple(patch_shas), ()))


def rebase_continue(repo: Path) -> RebaseResult:
    """Commits the maintainer's fix of the stopped patch (its name and header kept) and carries on."""
    state = RebaseState.load(repo)
    unmerged = _unmerged(repo)
    if unmerged:
        raise PatchApplyError(f"still unmerged in {repo}: {', '.join(unmerged)}. Fix the conflicts, "
                              "`git add` (or `git rm`) each file, then continue.")
    markers = _git(repo, "diff", "--cached", "--check", check=False).stdout
    if "conflict marker" in markers:
        raise PatchApplyError(f"conflict markers are still staged in {repo}:\n{markers.strip()}")
    assert state.current is not None
    _git(repo, "commit", "-q", "--allow-empty", "--no-verify", "-C", state.current)
    outcomes = list(state.outcomes)
    last = outcomes.pop()
    outcomes.append(RebaseOutcome(last.name, True, "fixed by hand (" + last.detail + ")"))
    return _run_picks(repo, RebaseState(state.source, state.target, None, state.todo,
                                        tuple(outcomes)))
