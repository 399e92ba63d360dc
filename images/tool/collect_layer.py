"""Copies what part 2 of the image added to the runtime base into one folder: its top layer.

Usage: collect_layer.py --dest DIR --manifest PATCHES_JSON --tree DIR [DIST ...]
(stdlib only; runs inside the assemble stage of images/assemble.Dockerfile)

Collected: every file a DIST's RECORD lists (sources, bytecode, entry-point scripts; a DIST that is
not installed is skipped), every file the patch manifest names with its bytecode (patches may
change files of the runtime base, such as FlashInfer's), and the --tree folder. Modes and
owners are kept; times do not matter (the build sets every time in the layer to one constant).
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path


def copy_with_parents(src: Path, dest_root: Path) -> None:
    dest = dest_root / src.relative_to("/")
    missing = []
    parent = dest.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for folder in reversed(missing):  # made top-down, each with its source folder's mode and owner
        folder.mkdir()
        origin = Path("/") / folder.relative_to(dest_root)
        shutil.copystat(origin, folder)
        st = origin.stat()
        os.chown(folder, st.st_uid, st.st_gid)
    if src.is_symlink():
        os.symlink(os.readlink(src), dest)
    else:
        shutil.copy2(src, dest)
        st = src.stat()
        os.chown(dest, st.st_uid, st.st_gid)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, required=True)
    ap.add_argument("--manifest", type=Path, required=True)
    ap.add_argument("--tree", type=Path, required=True)
    ap.add_argument("dists", nargs="*")
    a = ap.parse_args(argv)
    site = Path(sysconfig.get_paths()["purelib"])
    files: set[Path] = set()
    for name in a.dists:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        for rel in dist.files or []:
            path = Path(os.path.normpath(dist.locate_file(rel)))
            if path.is_file() or path.is_symlink():
                files.add(path)
    for entry in json.loads(a.manifest.read_text()):
        for rel in entry["files"]:
            path = site / rel
            files.add(path)
            if path.suffix == ".py":
                cached = Path(importlib.util.cache_from_source(str(path)))
                if cached.exists():
                    files.add(cached)
    files |= {p for p in a.tree.rglob("*") if p.is_file() or p.is_symlink()}
    for path in sorted(files):
        copy_with_parents(path, a.dest)
    print(f"collect_layer: {len(files)} files into {a.dest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
