"""The Docker engine's side of a build: the classic builder run with networking off and its log
streamed, the runtime base built once per key and kept tagged, build-cache tags that leave no
dangling image, files copied out of an image, and its layer table."""
from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import docker.errors
from docker import DockerClient
from rich.console import Console
from rich.markup import escape

from sglang_image import normalize
from sglang_image.base import PATH_ENV
from sglang_image.context import INSTALL_VENV, context_tar
from sglang_image.errors import BuildError, PatchApplyError
from sglang_image.plan import IMAGE_REPO, BuildPlan

# The history entry of the venv's layer (images/install-venv.sh, run by install_venv).
INSTALL_STEP = ("sglang-image: python -m venv /opt/venv, pip install --no-index --require-hashes "
                "--no-deps -r deps.txt: every locked wheel but SGLang's (images/install-venv.sh)")

# Stages of the one-stage Dockerfile (before the runtime base and part 2) whose cache images an
# engine may still hold tagged: each build removes them.
LEGACY_CACHE_STAGES = ("deps", "sglang")


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
            remove_untagged(client, last_step)
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


def remove_untagged(client: DockerClient, image_id: str) -> None:
    """The image of a failed build's last good step, and its untagged parents: the classic
    builder leaves them untagged (gigabytes), and nothing reuses them. A tagged image (the base
    a build failed on at once) is kept."""
    if not image_id:
        return
    try:
        if not client.images.get(image_id).tags:
            client.images.remove(image_id, noprune=False)
    except docker.errors.APIError:  # gone, or a parent of another image: nothing to free
        pass


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


def runtime_base_key(ctx: Path, inputs: Path, buildargs: dict[str, str], python_version: str,
                     base_id: str) -> str:
    """What part 1 is made of: its Dockerfile, the install script, the locked wheels (their
    hashes are in deps.txt), its build arguments, the Python the venv is made with and the base
    image."""
    digest = hashlib.sha256(json.dumps([buildargs, python_version, base_id],
                                       sort_keys=True).encode())
    for path in (ctx / "Dockerfile", inputs / INSTALL_VENV.name, inputs / "deps.txt"):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _remove_quietly(client: DockerClient, ref: str) -> None:
    try:
        client.images.remove(ref)
    except docker.errors.APIError:
        pass  # in use (a container, a child image): the user's to remove


def runtime_base(client: DockerClient, plan: BuildPlan, ctx: Path, inputs: Path, *,
                 buildargs: dict[str, str], console: Console,
                 log: Callable[[str], None]) -> tuple[str, bytes]:
    """Part 1, built and normalised once per key and kept tagged; returns (tag, its config).

    images/Dockerfile makes the user and the container's settings (seconds); the venv is then
    installed in a container of that image with the wheelhouse `inputs` mounted (install_venv)
    and what it changed is loaded as the last layer."""
    opts, work, base = plan.options, plan.work, plan.base
    python_version = plan.flavor.python_version
    key = runtime_base_key(ctx, inputs, buildargs, python_version, base.image_id)[:16]
    tag = f"{IMAGE_REPO}-runtime-base:{work.name}-{key}"
    config_file = opts.work_dir / "runtime-base" / f"{work.name}-{key}.json"
    if not opts.no_cache and config_file.exists():
        try:
            if client.images.get(tag).id == "sha256:" + hashlib.sha256(config_file.read_bytes()).hexdigest():
                log(f"runtime base: unchanged, reusing {tag}")
                return tag, config_file.read_bytes()
        except docker.errors.ImageNotFound:
            pass
    size = sum(p.stat().st_size for p in inputs.rglob("*") if p.is_file())
    log(f"runtime base: building {tag} (a wheelhouse of {size / 1e9:.2f} GB, network off)")
    started = time.monotonic()
    raw_id, stages = run_build(client, ctx, buildargs=buildargs, no_cache=opts.no_cache,
                               console=console, target="runtime-base")
    settings_id, settings_config = normalize.normalize_image(
        client, raw_id, epoch=plan.epoch, tags=[], base_diff_ids=list(base.diff_ids),
        base_history=base.history, log=log, cache=opts.work_dir / "normalized-layers.json")
    for image_id in [*stages.values(), raw_id]:  # the builder's: nothing reuses them
        _remove_quietly(client, image_id)
    log(f"runtime base: the user and the settings took {time.monotonic() - started:.0f} s")
    layer_file = config_file.with_suffix(".venv.tar")
    layer_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        started = time.monotonic()
        diff_id, layer_size = install_venv(client, settings_id, inputs, layer_file,
                                           python_version=python_version,
                                           console=console, log=log)
        log(f"runtime base: the venv ({layer_size / 1e9:.2f} GB) took "
            f"{time.monotonic() - started:.0f} s")
        config = normalize.with_layer(settings_config, diff_id, INSTALL_STEP,
                                      epoch=plan.epoch, base_history=base.history)
        started = time.monotonic()
        normalize.load_composed(client, config, {diff_id: layer_file}, [tag], log=log)
        log(f"runtime base: loading it took {time.monotonic() - started:.0f} s")
    finally:
        layer_file.unlink(missing_ok=True)
        _remove_quietly(client, settings_id)  # untagged; the runtime base holds its layers
    config_file.write_bytes(config)
    # Earlier runtime bases of this flavor are gigabytes nothing reads again.
    for image in client.images.list(name=f"{IMAGE_REPO}-runtime-base"):
        for old in image.tags:
            if old.startswith(f"{IMAGE_REPO}-runtime-base:{work.name}-") and old != tag:
                _remove_quietly(client, old)
    return tag, config


def install_venv(client: DockerClient, image_id: str, inputs: Path, dest: Path, *,
                 python_version: str, console: Console,
                 log: Callable[[str], None]) -> tuple[str, int]:
    """Runs images/install-venv.sh as root in a container of `image_id` (network off, a clean
    environment, `inputs` mounted read-only at /tmp/build-inputs) and writes what it changed,
    the mount point left out, as a layer into `dest`; returns its diff ID and size."""
    env = [PATH_ENV, "HOME=/root", f"PYTHON_VERSION={python_version}"]
    mount = f"/{normalize.BUILD_INPUTS}"
    script = f"{mount}/{INSTALL_VENV.name}"
    # Exit 3: the mount is empty (an engine on another machine sees no such folder).
    run = f"test -f {script} || exit 3; exec /bin/sh {script}"
    container = client.containers.create(
        image_id, entrypoint=["/usr/bin/env", "-i", *env, "/bin/sh", "-c", run], command=[],
        user="0:0", working_dir="/", network_mode="none", healthcheck={"test": ["NONE"]},
        volumes={str(inputs.resolve()): {"bind": mount, "mode": "ro"}})
    try:
        container.start()
        tail: list[str] = []
        for chunk in container.logs(stream=True, follow=True):
            for line in chunk.decode(errors="replace").splitlines():
                tail = (tail + [line])[-40:]
                if line.strip():
                    console.print(f"  {line}", highlight=False, markup=False)
        status = int(container.wait()["StatusCode"])
        if status == 3:
            raise BuildError(f"the engine did not mount the wheelhouse {inputs}: the runtime base "
                             "is installed from a folder of this machine, so the engine must run "
                             "here (unset DOCKER_HOST, or let the build start its own engine)")
        if status != 0:
            raise BuildError(f"installing the venv failed (exit {status}); last lines:\n"
                             + "\n".join(tail))
        return normalize.container_layer(client, str(container.id), dest,
                                         drop=normalize.BUILD_INPUTS, log=log)
    finally:
        container.remove(force=True)
