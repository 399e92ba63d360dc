"""The zero-fuzz applier, on the real pinned sglang wheel."""
from __future__ import annotations

import marshal
import py_compile
import shutil
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from sglang_image import patch, pins, trees
from sglang_image.errors import PatchApplyError

TARGET = "sglang/srt/server_args.py"


def _git_diff(tree: Path, edit: Callable[[Path], None], tmp_path: Path) -> str:
    """A real patch: copy one file of the real wheel into a git repo, edit it, git diff."""
    repo = tmp_path / "repo"
    (repo / TARGET).parent.mkdir(parents=True)
    shutil.copy(tree / TARGET, repo / TARGET)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    edit(repo / TARGET)
    diff = subprocess.run([*git, "diff", "--no-color"], check=True, capture_output=True, text=True)
    return diff.stdout


def _replace(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, count))


@pytest.fixture
def pristine(sglang_tree: Callable[[str, bool], Path], tmp_path: Path) -> Path:
    """A private copy of the real sglang 0.5.17 server_args.py (the test edits it)."""
    src = sglang_tree("sglang-0.5.17", False)
    tree = tmp_path / "tree"
    (tree / TARGET).parent.mkdir(parents=True)
    shutil.copy(src / TARGET, tree / TARGET)
    return tree


def _write_patch(tmp_path: Path, body: str, name: str = "demo.patch") -> Path:
    path = tmp_path / name
    path.write_text("Description: demo\nOrigin: vendor\nForwarded: not-needed\n"
                    "Last-Update: 2026-11-30\n---\n" + body)
    return path


def _code_names(code: types.CodeType) -> set[str]:
    """Every name a code object and the code objects nested in it refer to."""
    names = set(code.co_names) | set(code.co_varnames)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def test_applies_and_byte_compiles(pristine: Path, tmp_path: Path) -> None:
    marker = "PATCHED_BY_TEST = True"
    diff = _git_diff(pristine, lambda p: _replace(p, "class ServerArgs:", f"class ServerArgs:\n    {marker}"),
                     tmp_path)
    result = patch.apply_patch(_write_patch(tmp_path, diff), pristine)
    assert result.ok and result.files == (TARGET,)
    # the patched file byte-compiles, and its bytecode carries the patch's statement
    pyc = tmp_path / "server_args.pyc"
    py_compile.compile(str(pristine / TARGET), cfile=str(pyc), doraise=True)
    code = marshal.loads(pyc.read_bytes()[16:])  # after the 16-byte pyc header (PEP 552)
    assert "PATCHED_BY_TEST" in _code_names(code)


def test_offset_is_allowed(pristine: Path, tmp_path: Path) -> None:
    diff = _git_diff(pristine, lambda p: _replace(p, "class ServerArgs:", "class ServerArgs:\n    # x"),
                     tmp_path)
    # upstream moved the code down by three lines: same context, other line numbers
    target = pristine / TARGET
    target.write_text("# a\n# b\n# c\n" + target.read_text())
    patch.apply_patch(_write_patch(tmp_path, diff), pristine)
    assert "class ServerArgs:\n    # x" in target.read_text()


def test_changed_context_is_refused_with_file_and_hunk(pristine: Path, tmp_path: Path) -> None:
    def two_hunks(p: Path) -> None:
        _replace(p, "import argparse", "import argparse  # first hunk")
        _replace(p, "class ServerArgs:", "class ServerArgs:\n    # second hunk")

    diff = _git_diff(pristine, two_hunks, tmp_path)
    target = pristine / TARGET
    before_edit = target.read_text()
    # one context line of hunk #2 changes upstream (3 lines above "class ServerArgs:")
    lines = before_edit.splitlines(keepends=True)
    idx = next(i for i, ln in enumerate(lines) if ln.startswith("class ServerArgs:"))
    lines[idx - 2] = lines[idx - 2].rstrip("\n") + "  # upstream changed this\n"
    target.write_text("".join(lines))
    changed = target.read_text()
    patch_file = _write_patch(tmp_path, diff)
    with pytest.raises(PatchApplyError) as err:
        patch.apply_patch(patch_file, pristine)
    message = str(err.value)
    assert "demo.patch" in message and TARGET in message and "hunk #2" in message
    assert "upstream changed this" in message  # names the line that differs
    assert target.read_text() == changed  # a failing patch writes nothing (hunk #1 included)
    # GNU patch would have applied this "almost" (fuzz 1): that is what we refuse.
    if shutil.which("patch"):
        gnu = subprocess.run(["patch", "-p1", "--dry-run", "-d", str(pristine), "-i", str(patch_file)],
                             check=False, capture_output=True, text=True)
        assert gnu.returncode == 0 and "fuzz" in gnu.stdout


def test_already_applied_is_named(pristine: Path, tmp_path: Path) -> None:
    diff = _git_diff(pristine, lambda p: _replace(p, "class ServerArgs:", "class ServerArgs:\n    # x"),
                     tmp_path)
    patch_file = _write_patch(tmp_path, diff)
    patch.apply_patch(patch_file, pristine)
    with pytest.raises(PatchApplyError, match="already applied"):
        patch.apply_patch(patch_file, pristine)


def test_new_file_and_syntax_check(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    new_file = _write_patch(tmp_path, "--- /dev/null\n+++ b/pkg/new.py\n@@ -0,0 +1,2 @@\n+x = 1\n+y = 2\n")
    patch.apply_patch(new_file, tree)
    assert (tree / "pkg/new.py").read_text() == "x = 1\ny = 2\n"
    broken = _write_patch(tmp_path, "--- a/pkg/new.py\n+++ b/pkg/new.py\n@@ -1,2 +1,2 @@\n x = 1\n"
                          "-y = 2\n+y = (\n", "broken.patch")
    with pytest.raises(PatchApplyError, match="does not compile"):
        patch.apply_patch(broken, tree)
    assert (tree / "pkg/new.py").read_text() == "x = 1\ny = 2\n"


def test_series_lists_missing_patch(tmp_path: Path) -> None:
    (tmp_path / "series").write_text("# comment\nthere.patch\nmissing.patch -p1\n")
    (tmp_path / "there.patch").write_text("")
    with pytest.raises(PatchApplyError, match="missing.patch"):
        patch.read_series(tmp_path)


@pytest.mark.parametrize("flavor", pins.flavor_names())
def test_every_series_applies_to_the_real_wheels(flavor: str, tmp_path: Path) -> None:
    """What `nox -s patches` does, through the CLI the image uses."""
    f = pins.load_flavor(flavor)
    trees.prepare_tree(f, tmp_path, patched=False)
    proc = subprocess.run([sys.executable, "-m", "sglang_image.patch", "apply", "--series-dir",
                           str(f.patch_dir), "--site-packages", str(tmp_path), "--manifest",
                           str(tmp_path / "manifest.json")], check=False, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    names = [p.name for p in f.series()]
    assert proc.stdout.count("applied ") == len(names)
    import json

    assert [row["name"] for row in json.loads((tmp_path / "manifest.json").read_text())] == names
