"""The maintainer's workflow (edit / export / rebase) on the real wheels of both flavors."""
from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from sglang_image import patch, patchwork, pins, trees
from sglang_image.errors import PatchApplyError

HEADER = ("Description: demo change\nAuthor: t\nOrigin: vendor\nForwarded: not-needed\n"
          "Last-Update: 2026-11-30\nDrop-when: never\n---\n")


def _flavor(name: str, patch_dir: Path) -> pins.Flavor:
    """The flavor with its series in `patch_dir`, its work trees made of the real sglang wheel
    alone: every patch these tests carry changes sglang/ only, and leaving flashinfer-python's
    files out (10,000 of them in 0.5.23) spares git hashing them in each of the tests' upstream
    commits. Every file of the sglang wheel stays, so rename detection and the search for moved
    code still see all of sglang's candidates."""
    flavor = pins.load_flavor(name)
    assert "sglang" in flavor.patch_targets
    return dataclasses.replace(flavor, patch_dir=patch_dir, patch_targets=("sglang",))


def _make_patch(repo: Path, rel: str, old: str, new: str, name: str) -> None:
    path = repo / rel
    path.write_text(path.read_text().replace(old, new, 1))
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c",
                    "gc.auto=0", "commit",
                    "-qam", f"{name}\n\n{HEADER}"], check=True)


def test_edit_export_roundtrip_and_rebase(tmp_path: Path) -> None:
    old = _flavor("sglang-0.5.9", tmp_path / "p059")
    old.patch_dir.mkdir()
    (old.patch_dir / "series").write_text("# demo series\n")
    repo = patchwork.edit(old, tmp_path / "work059")
    # a maintainer adds two patches as commits: one that survives the upgrade, one that cannot
    _make_patch(repo, "sglang/version.py", 'fallback_version="0.0.0.dev0"',
                'fallback_version="0.0.0.demo"', "version.patch")
    _make_patch(repo, "sglang/srt/speculative/eagle_worker.py", "class EAGLEWorker(",
                "class EAGLEWorker(  # demo\n", "v1-worker.patch")
    exported = patchwork.export(old, repo)
    assert [e.name for e in exported] == ["version.patch", "v1-worker.patch"]
    assert (old.patch_dir / "series").read_text() == "# demo series\nversion.patch\nv1-worker.patch\n"
    text = (old.patch_dir / "version.patch").read_text()
    assert text.startswith(HEADER) and '+                root=str(project_root), fallback_version="0.0.0.demo"' in text

    # round trip: a fresh edit of the exported series exports byte-identical files
    patchwork.edit(old, tmp_path / "again")
    before = {p.name: p.read_bytes() for p in old.patch_dir.iterdir()}
    assert all(not e.changed for e in patchwork.export(old, tmp_path / "again"))
    assert {p.name: p.read_bytes() for p in old.patch_dir.iterdir()} == before

    # the exported series applies with the zero-fuzz applier to the real wheel
    tree = tmp_path / "tree"
    trees.prepare_tree(old, tree, patched=True)
    assert "0.0.0.demo" in (tree / "sglang/version.py").read_text()

    # rebase to 0.5.17: version.py merges three ways; the V1 worker was removed upstream, so the
    # rebase stops there with the patched file left in the work tree
    new = _flavor("sglang-0.5.17", tmp_path / "p0517")
    result = patchwork.rebase(old, new, tmp_path / "work0517")
    by_name = {o.name: o for o in result.outcomes}
    assert by_name["version.patch"].carried
    assert result.stopped is not None and result.stopped.name == "v1-worker.patch"
    assert "eagle_worker.py" in result.stopped.detail
    work = result.repo
    assert "0.0.0.demo" in (work / "sglang/version.py").read_text()
    assert (work / "sglang/srt/speculative/eagle_worker_v2.py").is_file()  # 0.5.17's tree


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                           "-c", "gc.auto=0", *args],
                          check=True, capture_output=True, text=True).stdout


def test_rebase_0517_to_0523_stops_at_conflicts_follows_moves_and_continues(tmp_path: Path) -> None:
    """The real series moving from 0.5.17's wheels to 0.5.23's, as a maintainer meets it."""
    real = pins.load_flavor("sglang-0.5.17").patch_dir
    old = _flavor("sglang-0.5.17", tmp_path / "p0517")
    old.patch_dir.mkdir()
    picked = ["sm120-torch-symm-mem.patch", "sm120-support.patch", "sm120-flashinfer-allreduce-fusion.patch"]
    for name in picked:
        (old.patch_dir / name).write_bytes((real / name).read_bytes())
    (old.patch_dir / "series").write_text("\n".join(picked) + "\n")
    repo = patchwork.edit(old, tmp_path / "work0517")
    # a patch on a file that 0.5.23 moved (sglang/kernels/kernel_api_logging.py, same content)
    _make_patch(repo, "sglang/kernel_api_logging.py", "import fnmatch\n", "import fnmatch  # demo\n",
                "logging.patch")
    # a patch on a file 0.5.23 removed, whose code (and the hunk's context) now lives elsewhere
    _make_patch(repo, "sglang/srt/layers/communicator.py", "        # before reaching them.\n",
                "        # before reaching them (demo).\n", "gate-comment.patch")
    patchwork.export(old, repo)

    new = _flavor("sglang-0.5.23", tmp_path / "p0523")
    work = tmp_path / "work0523"
    result = patchwork.rebase(old, new, work)
    carried = {o.name: o for o in result.outcomes if o.carried}
    assert carried["sm120-torch-symm-mem.patch"].detail == "merged"
    # stopped at the first conflict, like git am -3: markers in the work tree, nothing after it picked
    assert result.stopped is not None and result.stopped.name == "sm120-support.patch"
    assert "sglang/srt/arg_groups/overrides.py" in result.stopped.detail
    assert ("_olmo2_overrides moved from sglang/srt/arg_groups/overrides.py to "
            "sglang/srt/arg_groups/model_overrides/olmo2.py") in result.stopped.detail
    assert "<<<<<<<" in (work / "sglang/srt/arg_groups/overrides.py").read_text()
    assert [o.name for o in result.outcomes][-1] == "sm120-support.patch"
    with pytest.raises(PatchApplyError, match="still unmerged.*overrides.py"):
        patchwork.rebase_continue(work)
    _git(work, "add", "-A")  # staged with the markers in: refused too
    with pytest.raises(PatchApplyError, match="conflict markers"):
        patchwork.rebase_continue(work)
    # the fix: upstream's file back, the change where 0.5.23 keeps the Olmo2 choice now
    _git(work, "checkout", "HEAD", "--", "sglang/srt/arg_groups/overrides.py")
    ported = pins.load_flavor("sglang-0.5.23").patch_dir
    patch.apply_patch(ported / "sm120-support.patch", work)
    _git(work, "add", "-A")

    result = patchwork.rebase_continue(work)
    by_name = {o.name: o for o in result.outcomes}
    assert by_name["sm120-support.patch"].carried
    # the allreduce-fusion patch: communicator.py is gone; the message names where its code went
    assert result.stopped is not None and result.stopped.name == "sm120-flashinfer-allreduce-fusion.patch"
    assert ("sglang/srt/layers/communicator.py was removed upstream; its code is now in "
            "sglang/srt/layers/layer_boundary/residual/add_norm.py") in result.stopped.detail
    _git(work, "reset", "-q", "--hard", "HEAD")
    patch.apply_patch(ported / "sm120-flashinfer-allreduce-fusion.patch", work)
    _git(work, "add", "-A")
    result = patchwork.rebase_continue(work)
    assert result.stopped is None and all(o.carried for o in result.outcomes)
    logging_patch = next(o for o in result.outcomes if o.name == "logging.patch")
    assert "followed to sglang/kernels/kernel_api_logging.py" in logging_patch.detail  # git's rename
    assert "import fnmatch  # demo" in (work / "sglang/kernels/kernel_api_logging.py").read_text()
    moved = next(o for o in result.outcomes if o.name == "gate-comment.patch")
    assert ("followed sglang/srt/layers/communicator.py -> "
            "sglang/srt/layers/layer_boundary/residual/add_norm.py (found by content)") in moved.detail
    assert "(demo)" in (work / "sglang/srt/layers/layer_boundary/residual/add_norm.py").read_text()
    assert not (work / "sglang/srt/layers/communicator.py").exists()
    assert _git(work, "rev-parse", "--abbrev-ref", "HEAD").strip() == "work"

    # export writes 0.5.23's series; it applies to the pristine wheels with zero fuzz
    patchwork.export(new, work)
    names = (new.patch_dir / "series").read_text().split()
    assert names == ["sm120-torch-symm-mem.patch", "sm120-support.patch",
                     "sm120-flashinfer-allreduce-fusion.patch", "logging.patch", "gate-comment.patch"]
    tree = tmp_path / "tree"
    trees.prepare_tree(new, tree, patched=True)
    assert "import fnmatch  # demo" in (tree / "sglang/kernels/kernel_api_logging.py").read_text()


def test_continue_without_a_rebase_says_how_to_start_one(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    with pytest.raises(PatchApplyError, match=r"no rebase in progress.*nox -s patches -- rebase FROM TO"):
        patchwork.rebase_continue(tmp_path)
