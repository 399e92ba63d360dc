"""`nox -s build`: a hermetic, reproducible image of one flavor through the Docker engine.

Steps: fetch the flavor's wheels by hash (fetch.fetch_wheels) -> the runtime base (images/
Dockerfile: base, the venv of every locked wheel but SGLang's, the container's settings), built and
normalised (normalize.py) only when the lock or the base changed, else reused -> part 2 (images/
assemble.Dockerfile: SGLang, the patch series, the plugin, the SBOM) built as an image of one
layer, that layer rewritten -> the image composed from the runtime base's layers and that one and
loaded, its config written here -> SBOM copied out -> digest, size, tags and time per phase.
Both builds use the classic builder with networking off and stream their log. Same commit, same
digest; a patch-only change reads and loads megabytes, not the venv.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker.errors
from docker import DockerClient
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sglang_image import lock, normalize, pins, plugin
from sglang_image.docker_engine import connect
from sglang_image.errors import BuildError, PatchApplyError, SglangImageError
from sglang_image.fetch import WHEEL_CACHE, fetch_wheels
from sglang_image.pins import REPO_ROOT, Flavor

DOCKERFILE = REPO_ROOT / "images" / "Dockerfile"                     # part 1: the runtime base
ASSEMBLE_DOCKERFILE = REPO_ROOT / "images" / "assemble.Dockerfile"   # part 2: one layer on it
# The history entry of part 2's layer in the image config.
ASSEMBLE_STEP = "sglang-image: SGLang, the patch series, the plugin and the SBOM (images/assemble.Dockerfile)"
IMAGE_TOOL_DIR = REPO_ROOT / "images" / "tool"
IMAGE_REPO = "sglang-image"
SBOM_PATH = "/opt/sglang-image/sbom.cdx.json"
MANIFEST_PATH = "/opt/sglang-image/patches.json"
LABEL_PREFIX = "io.sglang-image"
# Stages of the one-stage Dockerfile (before the runtime base and part 2) whose cache images an
# engine may still hold tagged: each build removes them.
LEGACY_CACHE_STAGES = ("deps", "sglang")
# Installed in the light build besides SGLang and the patch targets: what the SBOM step runs.
SBOM_TOOL = "cyclonedx-bom"


@dataclass(frozen=True, kw_only=True)
class BuildOptions:
    flavor: Flavor
    tag: str | None = None  # default: sglang-image:<VERSION>-<flavor>
    base: str | None = None  # an image reference that replaces the flavor's pinned base
    no_cache: bool = False
    # Light: SGLang, the patch targets and the SBOM tool only, none of their heavy dependencies.
    # Same Dockerfile, same stages; for tests (seconds, megabytes) - not a working server.
    light: bool = False
    wheel_cache: Path = WHEEL_CACHE
    work_dir: Path = REPO_ROOT / ".cache" / "build"
    output_dir: Path | None = None  # default: build/<tag with ':' as '-'>


@dataclass(frozen=True)
class BuildResult:
    image_id: str
    tags: tuple[str, ...]
    size: int
    layers: tuple[tuple[str, int], ...]  # (instruction, size) from the base up
    labels: dict[str, str]
    sbom: Path
    output_dir: Path
    seconds: float
    epoch: int = 0
    raw_image_id: str = ""  # empty when the inputs were unchanged and nothing was built
    notes: tuple[str, ...] = field(default_factory=tuple)
    phases: tuple[tuple[str, float], ...] = ()  # (phase, seconds) in order


# --- pure helpers (tested without Docker) -------------------------------------------------------

def version() -> str:
    return (REPO_ROOT / "VERSION").read_text().strip()


def default_tag(flavor: Flavor) -> str:
    return f"{IMAGE_REPO}:{version()}-{flavor.name}"


def _git(*args: str) -> str | None:
    proc = subprocess.run(["git", "-C", str(REPO_ROOT), *args], check=False,
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def source_date_epoch() -> int:
    """SOURCE_DATE_EPOCH if set, else the last commit's time, else 0 (a tree with no commit)."""
    if os.environ.get("SOURCE_DATE_EPOCH", "").isdigit():
        return int(os.environ["SOURCE_DATE_EPOCH"])
    stamp = _git("log", "-1", "--format=%ct")
    return int(stamp) if stamp and stamp.isdigit() else 0


def revision() -> str:
    return _git("rev-parse", "HEAD") or "unknown"


def source_url(pyproject: Path = REPO_ROOT / "pyproject.toml") -> str | None:
    """[project.urls] Source of pyproject.toml, or None: the project's address, never the clone's
    remote (clones of one commit with different remotes must give one digest)."""
    source = tomllib.loads(pyproject.read_text()).get("project", {}).get("urls", {}).get("Source")
    return str(source) if source else None


def dependency_closure(lock_text: str, roots: Iterable[str]) -> set[str]:
    """Names reachable from `roots` through the lock's `# via` comments (uv pip compile)."""
    parents: dict[str, set[str]] = {}
    current = None
    for line in lock_text.splitlines():
        head = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", line)
        if head:
            current = lock.normalize(head.group(1))
            parents[current] = set()
            continue
        by = re.match(r"^\s+#\s+(?:via\s+)?([A-Za-z0-9][A-Za-z0-9._-]*)\s*$", line)
        if current and by and by.group(1) != "via":
            parents[current].add(lock.normalize(by.group(1)))
    wanted = {lock.normalize(r) for r in roots}
    changed = True
    while changed:
        changed = False
        for name, via in parents.items():
            if name not in wanted and via & wanted:
                wanted.add(name)
                changed = True
    return wanted


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


def labels(flavor: Flavor, *, epoch: int, base_name: str, base_digest: str,
           patches: list[tuple[str, str]], light: bool,
           plugin_wheel: tuple[str, str] | None = None) -> dict[str, str]:
    oci = "org.opencontainers.image"
    out = {
        f"{oci}.title": "sglang-image",
        f"{oci}.version": version(),
        f"{oci}.revision": revision(),
        f"{oci}.created": normalize.iso_time(epoch),
        f"{oci}.base.name": base_name,
        f"{oci}.base.digest": base_digest,
        # SGLang and our patches; each installed package's own license is in the SBOM.
        f"{oci}.licenses": "Apache-2.0",
        f"{LABEL_PREFIX}.flavor": flavor.name,
        f"{LABEL_PREFIX}.sglang.version": flavor.sglang_version,
        f"{LABEL_PREFIX}.patches": ",".join(name for name, _ in patches),
        f"{LABEL_PREFIX}.sbom": SBOM_PATH,
    }
    source = source_url()
    if source:  # set once the project declares where it is published
        out[f"{oci}.source"] = source
    for name, digest in patches:
        out[f"{LABEL_PREFIX}.patch.{name}"] = f"sha256:{digest}"
    if plugin_wheel is not None:
        out[f"{LABEL_PREFIX}.plugin"] = plugin_wheel[0]
        out[f"{LABEL_PREFIX}.plugin.sha256"] = f"sha256:{plugin_wheel[1]}"
    if light:
        out[f"{LABEL_PREFIX}.light"] = "true"
    return out


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


def unverified_base_warning(opts: BuildOptions) -> str | None:
    """What to say when the build uses a pinned base whose digest nobody checked."""
    base = opts.flavor.base_image
    if opts.base is not None or base.digest_verified:
        return None
    return (f"the base digest in {opts.flavor.toml_path.name} is unverified (digest_verified = "
            f"false): {base.ref} was pinned without checking it against its registry. Check it "
            f"where the hub is reachable (docker pull {base.name}; compare RepoDigests), then set "
            f"digest_verified = true")


# --- the build --------------------------------------------------------------------------------

def _link(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def prepare_context(opts: BuildOptions, ctx: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Fills ctx/runtime-base (part 1: Dockerfile, build-inputs/ with deps.txt and the wheels) and
    ctx/assemble (part 2: SGLang's wheel, the series, the tool, the plugin); returns build facts."""
    flavor = opts.flavor
    entries = lock.require_complete(flavor)
    by_name = {e.name: e for e in entries}
    sglang_name = lock.normalize("sglang")
    if opts.light:
        wanted = dependency_closure(flavor.lock_path.read_text(), [SBOM_TOOL])
        wanted |= {lock.normalize(t) for t in flavor.patch_targets} | {sglang_name}
        entries = [e for e in entries if e.name in wanted]
    shutil.rmtree(ctx, ignore_errors=True)
    first, second = ctx / "runtime-base", ctx / "assemble"
    inputs = first / "build-inputs"  # lands in /tmp/build-inputs: see images/Dockerfile
    (inputs / "wheels").mkdir(parents=True)
    (second / "requirements").mkdir(parents=True)
    log(f"fetch: {len(entries)} wheels of {flavor.lock_path.name}, by hash")
    wheelhouse = ctx / "fetched"
    wheels = fetch_wheels(flavor, wheelhouse, only=[e.name for e in entries], cache=opts.wheel_cache)
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
    return {"patches": patches, "cuda_home": cuda_home(placed, flavor.python_version),
            "wheels": len(wheels), "plugin": add_plugin(flavor, image / "plugin")}


def add_plugin(flavor: Flavor, dest: Path) -> tuple[str, str] | None:
    """For a flavor that carries the project's SGLang plugin: builds its wheel reproducibly into
    `dest` with a hash-pinned requirements file (the image installs it like a locked wheel);
    returns (wheel file name, sha256). None, and nothing written, for other flavors."""
    if not flavor.plugin:
        return None
    wheel = plugin.build_wheel(dest)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    name, version = wheel.name.split("-")[:2]
    (dest / "requirements.txt").write_text(
        f"{name.replace('_', '-')}=={version} --hash=sha256:{digest}\n")
    return wheel.name, digest


def resolve_base(client: DockerClient, opts: BuildOptions, log: Callable[[str], None]
                 ) -> tuple[str, str, str, list[str], int]:
    """(reference for FROM, base.name, base.digest, base layer diff IDs, base history length);
    pulls a pinned base that is not in the engine."""
    if opts.base:
        ref, name = opts.base, opts.base.split("@")[0]
    else:
        ref, name = opts.flavor.base_image.ref, opts.flavor.base_image.name
    try:
        image = client.images.get(ref)
    except docker.errors.ImageNotFound:
        log(f"base: {ref} is not in the engine, pulling it")
        try:
            repo, _, digest = ref.partition("@")
            image = client.images.pull(repo, tag=digest or None)
        except docker.errors.APIError as exc:
            raise BuildError(
                f"base image {ref} is missing: not in the engine and the pull failed "
                f"({exc.explanation or exc}). Without an image hub, make a base from Debian "
                f"packages and build on it: nox -s base -- --flavor {opts.flavor.name}, then "
                f"nox -s build -- --flavor {opts.flavor.name} --base TAG (the tag it prints). "
                f"Or load the pinned one (docker load -i FILE / docker pull {ref} where a "
                f"registry is reachable)") from exc
    if "@" in ref:
        digest = ref.split("@", 1)[1]
    else:
        repo_digests = image.attrs.get("RepoDigests") or []
        digest = repo_digests[0].split("@", 1)[1] if repo_digests else str(image.id)
    return (ref, name, digest, list(image.attrs["RootFS"].get("Layers") or []),
            len(client.api.history(image.id)))  # type: ignore[no-untyped-call]


_PATCH_ERROR = re.compile(r"^error: (.+\.patch: .+)$", re.MULTILINE)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the builder colours a step's stderr


_STAGE = re.compile(r"^Step \d+/\d+ : FROM \S+ AS (\S+)", re.IGNORECASE)
_STEP_IMAGE = re.compile(r"^ ---> ([0-9a-f]{12})$")


def run_build(client: DockerClient, ctx: Path, *, buildargs: dict[str, str],
              no_cache: bool, console: Console, target: str) -> tuple[str, dict[str, str]]:
    """Streams the context up (no tar on disk) and the classic builder's log back; returns the
    built image ID and the last image of each earlier stage (read from the log), or raises with
    the log's tail."""
    tail: list[str] = []
    image_id = None
    stages: dict[str, str] = {}
    stage, last_step = "", ""
    upload = normalize.pipe(lambda put: context_tar(ctx, normalize.Writer(put)))
    stream = client.api.build(fileobj=upload, custom_context=True,  # type: ignore[arg-type]
                              buildargs=buildargs, nocache=no_cache, rm=True, forcerm=True,
                              pull=False, network_mode="none", target=target, decode=True)
    for chunk in stream:
        if "stream" in chunk:
            text = _ANSI.sub("", str(chunk["stream"]))
            for line in text.splitlines():
                tail = (tail + [line])[-60:]
                if (new_stage := _STAGE.match(line)) is not None:
                    if stage and last_step:
                        stages[stage] = last_step
                    stage = new_stage.group(1)
                elif (step := _STEP_IMAGE.match(line)) is not None:
                    last_step = step.group(1)
                if line.startswith("Step "):
                    console.print(f"[bold cyan]{escape(line)}[/]", highlight=False)
                elif line.strip():
                    console.print(f"  {line}", highlight=False, markup=False)
        if "aux" in chunk and "ID" in chunk["aux"]:
            image_id = str(chunk["aux"]["ID"])
        if "error" in chunk:
            log = "\n".join(tail)
            patch_error = _PATCH_ERROR.search(log)
            if patch_error:
                raise PatchApplyError(f"the patch series does not apply inside the image: "
                                      f"{patch_error.group(1)}\nRebase it: nox -s patches")
            raise BuildError(f"the image build failed: {chunk['error'].strip()}\n"
                             f"last lines of the log:\n{log}")
    if image_id is None:
        raise BuildError("the engine finished the build without an image ID")
    return image_id, stages


def copy_out(client: DockerClient, image_id: str, path: str, dest: Path) -> None:
    """Copies one file out of an image (a created, never started, container)."""
    container = client.containers.create(image_id, network_mode="none")
    try:
        bits, _ = container.get_archive(path)
        with tarfile.open(fileobj=io.BytesIO(b"".join(bits))) as tar:
            member = tar.next()
            fh = tar.extractfile(member) if member else None
            if fh is None:
                raise BuildError(f"{path} is not a file in {image_id}")
            dest.write_bytes(fh.read())
    finally:
        container.remove(force=True)


def layer_table(client: DockerClient, image_id: str) -> tuple[tuple[str, int], ...]:
    rows = []
    for entry in reversed(client.api.history(image_id)):  # type: ignore[no-untyped-call]
        if entry.get("Size", 0) or "#(nop)" not in entry.get("CreatedBy", ""):
            created_by = re.sub(r"\s+", " ", entry.get("CreatedBy", "")).strip()
            rows.append((created_by, int(entry.get("Size", 0))))
    return tuple(rows)


class _Phases:
    """Wall-clock seconds per phase of one build, printed at the end."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float]] = []
        self._mark = time.monotonic()

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.rows.append((name, now - self._mark))
        self._mark = now


def build_key(ctx: Path, buildargs: dict[str, str], base_id: str,
              build_labels: dict[str, str]) -> str:
    """What the image is made of: the context (wheels by name; their hashes are in the
    requirements files), the build arguments, the base image ID and the labels. The same key
    gives the same image, so an unchanged tree reuses it instead of building."""
    digest = hashlib.sha256(json.dumps([buildargs, base_id, build_labels],
                                       sort_keys=True).encode())
    for path in sorted(ctx.rglob("*")):
        rel = path.relative_to(ctx).as_posix()
        digest.update(rel.encode() + b"\0")
        if path.is_file() and not {"wheelhouse", "wheels"} & set(path.relative_to(ctx).parts):
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _remember(index: Path, key: str, image_id: str) -> None:
    known = json.loads(index.read_text()) if index.exists() else {}
    known[key] = image_id
    index.write_text(json.dumps(known, indent=1) + "\n")


def _known(client: DockerClient, index: Path, key: str) -> str | None:
    image_id = (json.loads(index.read_text()) if index.exists() else {}).get(key)
    if not image_id:
        return None
    try:
        return str(client.images.get(image_id).id)
    except docker.errors.ImageNotFound:
        return None


def _retag(client: DockerClient, image_id: str, tags: list[str]) -> None:
    """Points `tags` at `image_id`; an image a tag leaves without any tag is removed (a build
    leaves no dangling image behind)."""
    for tag in tags:
        try:
            previous = client.images.get(tag).id
        except docker.errors.ImageNotFound:
            previous = None
        repo, _, name = tag.rpartition(":")
        client.api.tag(image_id, repo, name)
        if previous and previous != image_id and not client.images.get(previous).tags:
            _remove_quietly(client, previous)


def runtime_base_key(ctx: Path, buildargs: dict[str, str], base_id: str) -> str:
    """What part 1 is made of: its Dockerfile, the locked wheels (their hashes are in deps.txt),
    its build arguments and the base image."""
    digest = hashlib.sha256(json.dumps([buildargs, base_id], sort_keys=True).encode())
    for name in ("Dockerfile", "build-inputs/deps.txt"):
        digest.update((ctx / name).read_bytes())
    return digest.hexdigest()


def _remove_quietly(client: DockerClient, ref: str) -> None:
    try:
        client.images.remove(ref)
    except docker.errors.APIError:
        pass  # in use (a container, a child image): the user's to remove


def runtime_base(client: DockerClient, opts: BuildOptions, ctx: Path, work: Path, *,
                 buildargs: dict[str, str], base_id: str, base_layers: list[str],
                 base_history: int, epoch: int, console: Console,
                 log: Callable[[str], None]) -> tuple[str, bytes]:
    """Part 1, built and normalised once per key and kept tagged; returns (tag, its config)."""
    key = runtime_base_key(ctx, buildargs, base_id)[:16]
    tag = f"{IMAGE_REPO}-runtime-base:{work.name}-{key}"
    config_file = opts.work_dir / "runtime-base" / f"{work.name}-{key}.json"
    if not opts.no_cache and config_file.exists():
        try:
            if client.images.get(tag).id == "sha256:" + hashlib.sha256(config_file.read_bytes()).hexdigest():
                log(f"runtime base: unchanged, reusing {tag}")
                return tag, config_file.read_bytes()
        except docker.errors.ImageNotFound:
            pass
    size = sum(p.stat().st_size for p in ctx.rglob("*") if p.is_file())
    log(f"runtime base: building {tag} ({size / 1e9:.2f} GB of context, network off)")
    raw_id, stages = run_build(client, ctx, buildargs=buildargs, no_cache=opts.no_cache,
                               console=console, target="runtime-base")
    normalize.normalize_image(client, raw_id, epoch=epoch, tags=[tag], base_diff_ids=base_layers,
                              base_history=base_history, log=log,
                              cache=opts.work_dir / "normalized-layers.json", config_out=config_file,
                              drop=normalize.BUILD_INPUTS)
    # The builder's images (with the wheelhouse and the venv) are gigabytes that only a rebuild of
    # this very key would reuse: they go. So do earlier runtime bases of this flavor.
    for image_id in [*stages.values(), raw_id]:
        _remove_quietly(client, image_id)
    for image in client.images.list(name=f"{IMAGE_REPO}-runtime-base"):
        for old in image.tags:
            if old.startswith(f"{IMAGE_REPO}-runtime-base:{work.name}-") and old != tag:
                _remove_quietly(client, old)
    return tag, config_file.read_bytes()


def compose_config(base_config: bytes, layer_diff_id: str, *, epoch: int, labels: dict[str, str],
                   base_history: int) -> bytes:
    """The image's config: the runtime base's, with part 2's layer, its history entry, the labels
    and this commit's time."""
    config = json.loads(base_config)
    config["history"] = [*config.get("history", []), {"created_by": ASSEMBLE_STEP}]
    diff_ids = [*config["rootfs"]["diff_ids"], layer_diff_id]
    return normalize.normalized_config(config, diff_ids, epoch, labels, base_history)


def build(opts: BuildOptions, console: Console | None = None,
          client: DockerClient | None = None) -> BuildResult:
    console = console or Console(stderr=True)
    log: Callable[[str], None] = lambda msg: console.print(f"[bold]»[/] {msg}", highlight=False)
    started = time.monotonic()
    phases = _Phases()
    flavor = opts.flavor
    tag = opts.tag or default_tag(flavor)
    tags = [tag] if ":" in tag else [f"{tag}:latest"]
    lock.require_complete(flavor)  # a stale or incomplete lock stops here, before any work
    warning = unverified_base_warning(opts)
    if warning:
        log(f"[yellow]warning:[/] {escape(warning)}")
    client = client or connect().client
    epoch = source_date_epoch()
    base_ref, base_name, base_digest, base_layers, base_history = resolve_base(client, opts, log)
    base_id = str(client.images.get(base_ref).id)
    phases.done("lock and base")
    work = opts.work_dir / (flavor.name + ("-light" if opts.light else ""))
    ctx = work / "context"
    facts = prepare_context(opts, ctx, log)
    build_labels = labels(flavor, epoch=epoch, base_name=base_name, base_digest=base_digest,
                          patches=facts["patches"], light=opts.light, plugin_wheel=facts["plugin"])
    base_args = {"BASE_IMAGE": base_ref, "PYTHON_VERSION": flavor.python_version,
                 "CUDA_HOME": facts["cuda_home"], "TORCH_CUDA_ARCH_LIST": flavor.cuda_arch_list}
    key = build_key(ctx, {**base_args, "SOURCE_DATE_EPOCH": str(epoch)}, base_id, build_labels)
    phases.done("fetch wheels")
    index = work / "built.json"
    raw_id = ""
    image_id = None if opts.no_cache else _known(client, index, key)
    if image_id:
        log(f"build: inputs unchanged, reusing {image_id[:19]}")
    else:
        base_tag, base_config = runtime_base(
            client, opts, ctx / "runtime-base", work, buildargs=base_args, base_id=base_id,
            base_layers=base_layers, base_history=base_history, epoch=epoch, console=console, log=log)
        phases.done("runtime base")
        log(f"build: part 2 of {flavor.name} on {base_tag}, network off")
        raw_id, stages = run_build(client, ctx / "assemble", no_cache=opts.no_cache, console=console,
                                   target="layer",
                                   buildargs={"RUNTIME_BASE": base_tag, "PYTHON_VERSION": flavor.python_version,
                                              "SOURCE_DATE_EPOCH": str(epoch)})
        # The builder's images stay, tagged, so that the SGLang install stays cached; one a tag
        # leaves goes, with the cache only it used, so nothing is left dangling.
        for stage_name, stage_id in stages.items():
            _retag(client, str(client.images.get(stage_id).id),
                   [f"{IMAGE_REPO}-build-cache:{work.name}-{stage_name}"])
        _retag(client, raw_id, [f"{IMAGE_REPO}-build-cache:{work.name}"])
        for stage_name in LEGACY_CACHE_STAGES:  # gigabytes the one-stage build left behind
            _remove_quietly(client, f"{IMAGE_REPO}-build-cache:{work.name}-{stage_name}")
        phases.done("part 2")
        layer_file = work / "part2-layer.tar"
        diff_id, size = normalize.export_layer(client, raw_id, layer_file)
        config = compose_config(base_config, diff_id, epoch=epoch, labels=build_labels,
                                base_history=base_history)
        log(f"compose: part 2 is {size / 1e6:.1f} MB ({diff_id[:19]})")
        image_id = normalize.load_composed(client, config, {diff_id: layer_file}, [])
        layer_file.unlink()
        phases.done("compose")
        _remember(index, key, image_id)
    shutil.rmtree(ctx, ignore_errors=True)
    _retag(client, image_id, tags)
    out = opts.output_dir or REPO_ROOT / "build" / tag.replace("/", "_").replace(":", "-")
    out.mkdir(parents=True, exist_ok=True)
    copy_out(client, image_id, SBOM_PATH, out / "sbom.cdx.json")
    copy_out(client, image_id, MANIFEST_PATH, out / "patches.json")
    image = client.images.get(image_id)
    phases.done("tag and copy out")
    result = BuildResult(image_id=image_id, tags=tuple(tags), size=int(image.attrs["Size"]),
                         layers=layer_table(client, image_id), labels=build_labels,
                         sbom=out / "sbom.cdx.json", output_dir=out,
                         seconds=time.monotonic() - started, epoch=epoch, raw_image_id=raw_id,
                         phases=tuple(phases.rows))
    (out / "build.json").write_text(json.dumps(
        {"image_id": image_id, "tags": tags, "size": result.size, "epoch": epoch,
         "layers": [{"created_by": c, "size": s} for c, s in result.layers],
         "labels": build_labels, "seconds": round(result.seconds, 1),
         "phases": {n: round(t, 1) for n, t in result.phases}}, indent=1) + "\n")
    return result


def print_result(result: BuildResult, console: Console) -> None:
    table = Table(title="layers (base first)", show_lines=False)
    table.add_column("size", justify="right")
    table.add_column("instruction")
    for created_by, size in result.layers:
        table.add_row(f"{size / 1e6:,.1f} MB", created_by.replace("/bin/sh -c ", "")[:100])
    console.print(table)
    console.print(f"[bold green]digest[/] {result.image_id}\n[bold green]size[/]   "
                  f"{result.size / 1e9:.2f} GB\n[bold green]tags[/]   {', '.join(result.tags)}\n"
                  f"[bold green]SBOM[/]   {result.sbom}\n[bold green]time[/]   "
                  f"{result.seconds:.0f} s ("
                  + ", ".join(f"{name} {sec:.0f} s" for name, sec in result.phases) + ")",
                  highlight=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nox -s build --", description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default=None, help=f"default: {pins.DEFAULT_FLAVOR}")
    parser.add_argument("--tag", help="default: sglang-image:<VERSION>-<flavor>")
    parser.add_argument("--base", help="base image reference instead of the flavor's pinned one")
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--light", action="store_true",
                        help="SGLang and the patches without the heavy dependencies (tests)")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    try:
        flavor = pins.load_flavor(args.flavor)
        result = build(BuildOptions(flavor=flavor, tag=args.tag, base=args.base,
                                    no_cache=args.no_cache, light=args.light), console)
    except SglangImageError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return exc.exit_code
    print_result(result, console)
    print(result.image_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
