"""Compiled kernels carried from one GPU machine to the next.

A GPU run may land on a fresh host, and there the first server spends about a minute compiling
Triton and FlashInfer kernels while it captures its CUDA graphs (a warm cache skips nearly all of
it; figures in docs/validation.md). The e2e driver packs its JIT
directory into OUT/jit-cache.tar.xz at the end of a call; copied into the bundle folder (.gpu/), it
travels with the next call, and the patch phase unpacks it before any server starts.

The archive names the kernel key it was built for (`kernel_key`: the bundle's wheels and the
patches to anything but sglang's Python files): a cache for another key is not unpacked, and files
already present are never overwritten. Patches to sglang's Python files keep the key: the kernels
they hold are Triton's, and Triton keys its own cache by each kernel's source.

FlashInfer's kernels are ninja builds, and ninja judges them by file times: an output older than an
input, or than the time its build log or deps log recorded for it, is built again. A fresh install
writes every source now, after the outputs were built, so the unpacked cache would be rebuilt in
full (86 s for the sampling module alone on an H200 host). So the install dates the site's files
to SITE_MTIME (age_site, before any patch: a patched file is new, and what it feeds is rebuilt),
and seed() gives each unpacked file its time in the archive, to the whole second below (never
later than the logs' record of it).
"""
from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import tarfile
from pathlib import Path
from typing import Any

ARCHIVE = "jit-cache.tar.xz"
MANIFEST = "jit-cache.json"            # first member: {"key": kernel_key, "files": n}
MAX_BYTES = 14 * 2**20                 # a file coming back from OUT may hold 16 MiB; the bundle travels too
MAX_RAW_BYTES = 256 * 2**20            # more would not compress under MAX_BYTES, and takes long to try
SITE_MTIME = 946684800                 # 2000-01-01: the installed sources' time, older than any build


def kernel_key(wheels_sha256: str, manifest: list[dict[str, Any]]) -> str:
    """What compiled kernels depend on: the bundle's wheels, and each applied patch (the manifest that
    `sglang_image.patch apply --manifest` writes: name, sha256, files) that changes a file outside
    sglang/ (FlashInfer's JIT builds from its patched sources)."""
    h = hashlib.sha256(wheels_sha256.encode())
    for entry in manifest:
        if any(not f.startswith("sglang/") for f in entry["files"]):
            h.update(f"\0{entry['name']}:{entry['sha256']}".encode())
    return h.hexdigest()


def fingerprint(jit_dir: Path) -> str:
    """Names and sizes of the files under jit_dir: what a new archive would hold."""
    h = hashlib.sha256()
    for p in sorted(jit_dir.rglob("*")) if jit_dir.is_dir() else []:
        if p.is_file() and not p.is_symlink():
            h.update(f"{p.relative_to(jit_dir)}\0{p.stat().st_size}\n".encode())
    return h.hexdigest()


def pack(jit_dir: Path, out: Path, key: str, max_bytes: int = MAX_BYTES) -> tuple[int, str]:
    """Write jit_dir's files to `out` (xz). Returns (bytes written, "") or (0, why not)."""
    files = [p for p in sorted(jit_dir.rglob("*")) if p.is_file() and not p.is_symlink()] if jit_dir.is_dir() else []
    if not files:
        return 0, f"nothing under {jit_dir}"
    raw = sum(p.stat().st_size for p in files)
    if raw > MAX_RAW_BYTES:
        return 0, f"{raw / 2**20:.0f} MiB of files, over the {MAX_RAW_BYTES / 2**20:.0f} MiB worth compressing"
    tmp = out.with_name(out.name + ".tmp")
    manifest = json.dumps({"key": key, "files": len(files)}).encode()
    with lzma.open(tmp, "wb", preset=3) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        info = tarfile.TarInfo(MANIFEST)
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
        for p in files:
            tar.add(p, arcname=str(p.relative_to(jit_dir)), recursive=False)
    size = tmp.stat().st_size
    if size > max_bytes:
        tmp.unlink()
        return 0, f"{size / 2**20:.1f} MiB compressed, over the {max_bytes / 2**20:.0f} MiB that may come back"
    tmp.replace(out)
    return size, ""


def extract_file(tar: tarfile.TarFile, member: tarfile.TarInfo, dest: Path) -> Path:
    """Write one regular file of `tar` under dest, refusing absolute paths and '..'.

    tarfile's own "data" filter would do this, but only from Python 3.11.4; Debian 12 has 3.11.2."""
    rel = Path(member.name)
    if rel.is_absolute() or ".." in rel.parts or not member.isfile():
        raise ValueError(f"refusing {member.name!r}: not a plain file under the archive root")
    src = tar.extractfile(member)
    if src is None:
        raise ValueError(f"refusing {member.name!r}: no file data")
    out = dest / rel
    out.parent.mkdir(parents=True, exist_ok=True)
    with src, open(out, "wb") as fh:
        while chunk := src.read(1 << 20):
            fh.write(chunk)
    return out


def age_site(site: Path, mtime: int = SITE_MTIME) -> int:
    """Date every file under a freshly installed site to `mtime` (see the module's docstring).
    Returns the files dated."""
    dated = 0
    for root, _dirs, names in os.walk(site):
        for name in names:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.utime(path, (mtime, mtime))
                dated += 1
    return dated


def seed(archive: Path, jit_dir: Path, key: str) -> tuple[int, str]:
    """Unpack `archive` into jit_dir where it was built for `key`, leaving existing files alone.
    Returns (files added, "") or (0, why not)."""
    if not archive.is_file():
        return 0, f"no {archive}"
    try:
        with tarfile.open(archive, "r:xz") as tar:
            first = tar.next()
            if first is None or first.name != MANIFEST:
                return 0, f"{archive} has no {MANIFEST}: not made by this tool"
            fh = tar.extractfile(first)
            built_for = json.loads(fh.read()).get("key") if fh else None
            if built_for != key:
                return 0, f"{archive} was built for other wheels or kernel patches"
            added = 0
            for member in tar:
                if member.name == MANIFEST or not member.isfile() or (jit_dir / member.name).exists():
                    continue
                out = extract_file(tar, member, jit_dir)
                whole = int(member.mtime) * 10**9  # the archive's time may carry a float's rounding
                os.utime(out, ns=(whole, whole))
                added += 1
    except (tarfile.TarError, lzma.LZMAError, OSError, ValueError) as exc:
        return 0, f"{archive} unreadable ({type(exc).__name__}: {exc}): delete it"
    return added, ""
