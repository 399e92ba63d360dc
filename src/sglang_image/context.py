"""The build contexts of one plan: part 1 (the runtime base: its Dockerfile, and beside it the
wheelhouse its venv is installed from: deps.txt, every locked wheel but SGLang's, the install
script) and part 2 (SGLang's wheel, the series and the stdlib-only applier, the
image's tool folder, the plugin wheel), streamed to the engine as tars with fixed owners and times.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_image import lock, normalize, plugin_wheel
from sglang_image.fetch import fetch_entries
from sglang_image.pins import REPO_ROOT, Flavor
from sglang_image.plan import BuildPlan

DOCKERFILE = REPO_ROOT / "images" / "Dockerfile"                     # part 1: the runtime base
ASSEMBLE_DOCKERFILE = REPO_ROOT / "images" / "assemble.Dockerfile"   # part 2: one layer on it
INSTALL_VENV = REPO_ROOT / "images" / "install-venv.sh"              # part 1's venv, in a container
IMAGE_TOOL_DIR = REPO_ROOT / "images" / "tool"


@dataclass(frozen=True, kw_only=True)
class BuildContext:
    """What prepare_context laid out, and the facts the labels and build arguments need."""

    root: Path  # root/runtime-base and root/build-inputs (part 1), root/assemble (part 2)
    patches: tuple[tuple[str, str], ...]  # (file name, sha256) in series order
    cuda_home: str  # where nvcc lands in the image's venv
    wheels: int
    plugin: tuple[str, str] | None  # (wheel file name, sha256); None: the flavor has no plugin


def requirement_lines(entries: Iterable[lock.LockEntry]) -> str:
    return "".join(f"{e.name}=={e.version} " + " ".join(f"--hash=sha256:{h}" for h in e.hashes)
                   + "\n" for e in sorted(entries, key=lambda e: e.name))


def cuda_home(wheels: Iterable[Path], python_version: str) -> str:
    """Where nvcc lands in the venv, read from the nvcc wheel (cu12 and cu13 lay it out apart)."""
    site = f"/opt/venv/lib/python{python_version}/site-packages"
    for wheel in wheels:
        if wheel.name.startswith("nvidia_cuda_nvcc"):
            with zipfile.ZipFile(wheel) as zf:
                for name in zf.namelist():
                    if name.endswith("/bin/nvcc"):
                        return f"{site}/{name[: -len('/bin/nvcc')]}"
    return f"{site}/nvidia/cu13"  # no nvcc wheel (light build): where CUDA 13's would be


def context_tar(root: Path, dest: Any, epoch: int = normalize.LAYER_EPOCH) -> None:
    """Writes the build context as a tar stream to `dest` (a writable file), with fixed
    owners, times and order (COPY keeps those)."""
    with tarfile.open(fileobj=dest, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(root.rglob("*")):
            info = tarfile.TarInfo(path.relative_to(root).as_posix())
            info.mtime, info.uid, info.gid, info.uname, info.gname = epoch, 0, 0, "", ""
            if path.is_dir():
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size = path.stat().st_size
                info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
                with path.open("rb") as fh:
                    tar.addfile(info, fh)


def _link(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def prepare_context(plan: BuildPlan, ctx: Path, log: Callable[[str], None]) -> BuildContext:
    """Fills ctx/runtime-base and ctx/build-inputs (part 1: Dockerfile; deps.txt, the wheels and
    the install script) and
    ctx/assemble (part 2: SGLang's wheel, the series, the tool, the plugin) from the plan's
    verified lock entries."""
    flavor, entries = plan.flavor, list(plan.entries)
    by_name = {e.name: e for e in entries}
    sglang_name = lock.normalize("sglang")
    shutil.rmtree(ctx, ignore_errors=True)
    first, second = ctx / "runtime-base", ctx / "assemble"
    inputs = ctx / "build-inputs"  # mounted at /tmp/build-inputs: see images/install-venv.sh
    (inputs / "wheels").mkdir(parents=True)
    first.mkdir(parents=True)
    (second / "requirements").mkdir(parents=True)
    log(f"fetch: {len(entries)} wheels of {flavor.lock_path.name}, by hash")
    wheelhouse = ctx / "fetched"
    wheels = fetch_entries(entries, flavor, wheelhouse, plan.options.wheel_cache, flavor.lock_path.name,
                           log)
    placed = []
    for wheel in wheels:
        part = (second / "wheelhouse" / "sglang" if lock.normalize(wheel.name.split("-")[0]) == sglang_name
                else inputs / "wheels")
        placed.append(part / wheel.name)
        _link(wheel, placed[-1])
    shutil.rmtree(wheelhouse)
    deps = [e for e in entries if e.name != sglang_name]
    (inputs / "deps.txt").write_text(requirement_lines(deps))
    (second / "requirements" / "sglang.txt").write_text(requirement_lines([by_name[sglang_name]]))
    shutil.copy2(DOCKERFILE, first / "Dockerfile")
    shutil.copy2(INSTALL_VENV, inputs / INSTALL_VENV.name)
    shutil.copy2(ASSEMBLE_DOCKERFILE, second / "Dockerfile")
    # The image keeps the series and the stdlib-only applier (the same code as nox -s patches).
    image = second / "image"
    series = flavor.series()
    (image / "patches").mkdir(parents=True)
    shutil.copy2(flavor.patch_dir / "series", image / "patches" / "series")
    for patch_file in series:
        shutil.copy2(patch_file, image / "patches" / patch_file.name)
    tool = image / "tool"
    shutil.copytree(IMAGE_TOOL_DIR, tool)
    (tool / "sglang_image").mkdir()
    (tool / "sglang_image" / "__init__.py").write_text("")
    pkg = Path(__file__).parent
    for module in ("errors.py", "patch.py"):
        shutil.copy2(pkg / module, tool / "sglang_image" / module)
    patches = [(p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in series]
    return BuildContext(root=ctx, patches=tuple(patches), cuda_home=cuda_home(placed, flavor.python_version),
                        wheels=len(wheels), plugin=add_plugin(flavor, image / "plugin"))


def add_plugin(flavor: Flavor, dest: Path) -> tuple[str, str] | None:
    """For a flavor that carries the project's SGLang plugin: builds its wheel reproducibly into
    `dest` with a hash-pinned requirements file (the image installs it like a locked wheel);
    returns (wheel file name, sha256). None, and nothing written, for other flavors."""
    if not flavor.plugin:
        return None
    wheel = plugin_wheel.build_wheel(dest)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    name, version = wheel.name.split("-")[:2]
    (dest / "requirements.txt").write_text(
        f"{name.replace('_', '-')}=={version} --hash=sha256:{digest}\n")
    return wheel.name, digest
