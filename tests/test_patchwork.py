"""The maintainer's workflow (edit / export / rebase) on the real wheels of both flavors."""
from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

from sglang_image import patch, patchwork, pins

HEADER = ("Description: demo change\nAuthor: t\nOrigin: vendor\nForwarded: not-needed\n"
          "Last-Update: 2026-11-30\nDrop-when: never\n---\n")


def _flavor(name: str, patch_dir: Path) -> pins.Flavor:
    return dataclasses.replace(pins.load_flavor(name), patch_dir=patch_dir)


def _make_patch(repo: Path, rel: str, old: str, new: str, name: str) -> None:
    path = repo / rel
    path.write_text(path.read_text().replace(old, new, 1))
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit",
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
    patch.prepare_tree(old, tree, patched=True)
    assert "0.0.0.demo" in (tree / "sglang/version.py").read_text()

    # rebase to 0.5.17: version.py merges three ways; the V1 worker was removed upstream
    new = _flavor("sglang-0.5.17", tmp_path / "p0517")
    work, outcomes = patchwork.rebase(old, new, tmp_path / "work0517")
    by_name = {o.name: o for o in outcomes}
    assert not by_name["v1-worker.patch"].carried
    assert "eagle_worker.py" in by_name["v1-worker.patch"].detail
    assert by_name["version.patch"].carried
    assert "0.0.0.demo" in (work / "sglang/version.py").read_text()
    assert (work / "sglang/srt/speculative/eagle_worker_v2.py").is_file()  # 0.5.17's tree
