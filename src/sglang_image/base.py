"""`nox -s base`: a base image made from Debian packages, for machines that reach no image hub.

The flavor's pinned base is an official python image from a hub. Without a hub, this makes a
stand-in: `debootstrap --variant=minbase` of Debian 12 with the compilers nvcc calls at run time
(g++ for FlashInfer's and SGLang's kernel compilation) and the flavor's Python, loaded into the
engine as one layer with a fixed config, so the same root file system gives the same image ID on
every engine. Then: `nox -s build -- --base TAG`.

The flavor's Python: Debian 12 ships 3.11, the flavors need 3.12. When the suite's own python3 is
the flavor's version, Debian's packages are used; otherwise a CPython X.Y already on this host
(installed by `uv python install X.Y` or pyenv, or named with --python-prefix) is copied to
/usr/local, the layout of the official python images, with the Debian libraries it links to.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from docker import DockerClient

from sglang_image import normalize
from sglang_image.docker_engine import ensure_engine
from sglang_image.errors import BuildError
from sglang_image.pins import REPO_ROOT, Flavor
from sglang_image.plan import check_reference

DEFAULT_SUITE = "bookworm"
SUITE_PYTHON = {"bookworm": "3.11", "trixie": "3.13"}
# nvcc runs the host C++ compiler for every kernel compiled at run time (FlashInfer's JIT).
COMPILER_DEBS = ("g++", "make")
DEBIAN_PYTHON_DEBS = ("python3", "python3-venv", "python3-dev")
# Run-time libraries of a CPython built on Debian 12, so that a copied one runs in a minbase root.
PYTHON_RUNTIME_DEBS = ("ca-certificates", "libssl3", "libffi8", "libsqlite3-0", "libbz2-1.0",
                       "liblzma5", "libreadline8", "zlib1g", "libncursesw6", "libuuid1",
                       "libexpat1", "libgdbm6", "libtirpc3", "libnsl2", "libcrypt1")
ROOTFS_CACHE = REPO_ROOT / ".cache" / "base"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def default_tag(python_version: str, suite: str = DEFAULT_SUITE) -> str:
    return f"localhost/sglang-image-base:{suite}-py{python_version}"


def _prefix_of(python: str) -> Path | None:
    proc = subprocess.run([python, "-c", "import sys; print(sys.base_prefix)"], check=False,
                          capture_output=True, text=True)
    return Path(proc.stdout.strip()) if proc.returncode == 0 and proc.stdout.strip() else None


def find_python(version: str) -> Path | None:
    """The installation prefix of a CPython `version` on this host that can be copied: uv's
    managed ones, pyenv's, then one on PATH; never the system's /usr (Debian's packages)."""
    candidates: list[str] = []
    if shutil.which("uv"):
        proc = subprocess.run(["uv", "python", "find", "--managed-python", version],
                              check=False, capture_output=True, text=True)
        candidates += proc.stdout.split()[:1] if proc.returncode == 0 else []
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += [str(p / "bin" / f"python{version}") for p in
                   sorted(pyenv_root.glob(f"versions/{version}.*"),
                          key=lambda p: [int(x) for x in p.name.split(".") if x.isdigit()],
                          reverse=True)]
    candidates += [found for found in [shutil.which(f"python{version}")] if found]
    for python in candidates:
        if not Path(python).exists():
            continue
        prefix = _prefix_of(python)
        if prefix is not None and prefix.resolve() != Path("/usr") and \
                (prefix / "bin" / f"python{version}").exists():
            return prefix
    return None


def _copy_python(prefix: Path, root: Path, version: str) -> None:
    """Copies a CPython prefix to root/usr/local without its third-party packages (pip comes
    from ensurepip when the build makes its venv)."""
    dest = root / "usr" / "local"

    def ignore(directory: str, names: list[str]) -> set[str]:
        skip = {"__pycache__", "test", "idlelib", "tkinter", "turtledemo"}
        if directory.endswith("site-packages"):
            return set(names) - {"README.txt"}
        return {n for n in names if n in skip}

    for sub in ("bin", "lib", "include"):
        shutil.copytree(prefix / sub, dest / sub, symlinks=True, ignore=ignore, dirs_exist_ok=True)
    bindir = dest / "bin"
    for script in list(bindir.iterdir()):  # pip/idle scripts point at the old prefix
        if not script.name.startswith("python") or script.name.endswith("-config"):
            script.unlink()
    for link in ("python", "python3"):
        (bindir / link).unlink(missing_ok=True)
        (bindir / link).symlink_to(f"python{version}")
    # ld.so finds libpython in /usr/local/lib once the cache knows it.
    subprocess.run(["ldconfig", "-r", str(root)], check=False, capture_output=True)


def debs_for(copied_python: bool) -> list[str]:
    """Debian packages of the base: the compilers, and Python's or a copied Python's libraries."""
    return [*COMPILER_DEBS, *(PYTHON_RUNTIME_DEBS if copied_python
                              else ("ca-certificates", *DEBIAN_PYTHON_DEBS))]


def make_rootfs(dest: Path, *, python_version: str, suite: str = DEFAULT_SUITE,
                python_prefix: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """Writes the base's root file system as a tar to `dest` (sorted entries)."""
    if shutil.which("debootstrap") is None:
        raise BuildError("debootstrap is not installed: apt-get install -y debootstrap")
    debian_python = SUITE_PYTHON.get(suite) == python_version and python_prefix is None
    prefix = None
    if not debian_python:
        prefix = python_prefix or find_python(python_version)
        if prefix is None:
            raise BuildError(
                f"Debian {suite} ships Python {SUITE_PYTHON.get(suite, '?')}, the flavor needs "
                f"{python_version}, and no CPython {python_version} was found on this host to copy "
                f"into the base: install one (uv python install {python_version}, or pyenv install "
                f"{python_version}) or name it: --python-prefix DIR")
    debs = debs_for(copied_python=prefix is not None)
    with tempfile.TemporaryDirectory(prefix="sgl-base-", dir=dest.parent) as tmp:
        root = Path(tmp) / "root"
        log(f"base: debootstrap --variant=minbase {suite} with {', '.join(debs)}")
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(debs)}", suite, str(root),
               os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"debootstrap failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                             f"{proc.stderr[-2000:]}")
        if prefix is not None:
            log(f"base: CPython {python_version} from {prefix} to /usr/local")
            _copy_python(prefix, root, python_version)
        # Apt's lists and caches are host state, not part of a base image.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(root / junk, ignore_errors=True)
        partial = dest.with_suffix(".partial")
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
            tar.add(root, arcname=".")
        partial.replace(dest)
    return dest


def _image_archive(rootfs: Path, config: bytes, tag: str) -> Iterator[bytes]:
    """A `docker save` archive (legacy layout, loaded by every engine) of one layer."""
    def produce(put: Callable[[bytes], None]) -> None:
        sink: Any = normalize.Writer(put)  # a write-only stream; tarfile's stubs want more
        with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            config_id = hashlib.sha256(config).hexdigest()
            manifest = json.dumps([{"Config": f"{config_id}.json", "RepoTags": [tag],
                                    "Layers": ["rootfs/layer.tar"]}]).encode()
            for name, path, data in (("rootfs/layer.tar", rootfs, None),
                                     (f"{config_id}.json", None, config),
                                     ("manifest.json", None, manifest)):
                info = tarfile.TarInfo(name)
                info.mode = 0o644
                if path is not None:
                    info.size = path.stat().st_size
                    with path.open("rb") as fh:
                        tar.addfile(info, fh)
                else:
                    assert data is not None
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return normalize.pipe(produce)


def load_rootfs(client: DockerClient, rootfs: Path, tag: str, *, description: str) -> str:
    """Loads `rootfs` as image `tag` with a fixed config; returns the image ID."""
    sha = hashlib.sha256()
    with rootfs.open("rb") as fh:
        while block := fh.read(normalize.CHUNK):
            sha.update(block)
    stamp = normalize.iso_time(normalize.LAYER_EPOCH)
    config = json.dumps({
        "architecture": "amd64", "os": "linux", "created": stamp,
        "config": {"Env": [PATH_ENV, "LANG=C.UTF-8"], "Cmd": ["/bin/bash"]},
        "history": [{"created": stamp, "created_by": description}],
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{sha.hexdigest()}"]},
    }, sort_keys=True, separators=(",", ":")).encode()
    for line in client.api.load_image(_image_archive(rootfs, config, tag)):  # type: ignore[no-untyped-call]
        if "error" in line:
            raise BuildError(f"loading the base image failed: {line['error']}")
    image_id = str(client.images.get(tag).id)
    expected = "sha256:" + hashlib.sha256(config).hexdigest()
    if image_id != expected:
        raise BuildError(f"the engine loaded the base as {image_id}, expected {expected}")
    return image_id


def make_base(client: DockerClient, tag: str, *, python_version: str,
              suite: str = DEFAULT_SUITE, python_prefix: Path | None = None,
              rootfs_cache: Path = ROOTFS_CACHE, fresh: bool = False,
              log: Callable[[str], None] = print) -> str:
    """Makes (or reuses from `rootfs_cache`) the root file system and loads it as `tag`."""
    rootfs_cache.mkdir(parents=True, exist_ok=True)
    rootfs = rootfs_cache / f"{suite}-py{python_version}.tar"
    if fresh or not rootfs.exists():
        make_rootfs(rootfs, python_version=python_version, suite=suite,
                    python_prefix=python_prefix, log=log)
    else:
        log(f"base: reusing {rootfs} (--fresh makes it again)")
    return load_rootfs(client, rootfs, tag, description=(
        f"debootstrap --variant=minbase {suite} + {' '.join(COMPILER_DEBS)} + "
        f"Python {python_version} (nox -s base)"))


@dataclass(frozen=True, kw_only=True)
class BaseOptions:
    """What `nox -s base` was asked for, besides the flavor (whose Python goes in); checked when
    made."""

    tag: str | None = None  # default: default_tag(the flavor's Python, suite)
    suite: str = DEFAULT_SUITE
    python_prefix: Path | None = None  # a CPython installation to copy (default: found here)
    fresh: bool = False  # debootstrap again instead of reusing ROOTFS_CACHE

    def __post_init__(self) -> None:
        if self.tag is not None:
            check_reference(self.tag, "--tag")


def run(flavor: Flavor, options: BaseOptions) -> int:
    """`nox -s base`: makes the base for the flavor's Python, prints its tag and image ID and the
    build command that uses it."""
    tag = options.tag or default_tag(flavor.python_version, options.suite)
    log: Callable[[str], None] = lambda msg: print(f"» {msg}", file=sys.stderr)
    image_id = make_base(ensure_engine(log=log).client, tag, python_version=flavor.python_version,
                         suite=options.suite, python_prefix=options.python_prefix,
                         fresh=options.fresh, log=log)
    print(f"{tag} {image_id}\nbuild on it: nox -s build -- --flavor {flavor.name} --base {tag}")
    return 0
