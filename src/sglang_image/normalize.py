"""Make a classic-builder image reproducible: same inputs, same image digest.

Why after the build: the Engine API's classic builder (the one the docker SDK drives) stamps the
build time into the config (`created`, every history entry), records the build container
(`container`, `container_config`) and keeps the wall-clock mtime of every file a RUN step writes;
none of this can be set through the API (BuildKit's SOURCE_DATE_EPOCH rewrite is not reachable
from the SDK, and Docker 20.10's embedded BuildKit predates it).

So the built image is exported (`GET /images/{id}/get`), each of its own layers rewritten with
every mtime set to LAYER_EPOCH (entry order, content, owners, modes, xattrs kept; atime and
ctime dropped), the config's times of this build set to SOURCE_DATE_EPOCH, the config cut down to
the OCI image spec's fields (no engine version, build container or intermediate image: one commit,
one digest on every engine), the labels added, and the result loaded back (`POST /images/load`).
The base image's layers pass through byte for byte. Both layouts of `docker save` are read.

Two streaming passes, no copy on disk: pass 1 computes each rewritten layer's sha256 and size
(the tar header must carry the size before the data), pass 2 streams the archive into the
engine. Layers whose rewritten chain is already in the engine are left out of the archive: the
engine's loader skips a layer whose chain it has, so a patch-only rebuild loads one small layer.
Both passes of a cold build read gigabytes for minutes: each says how far it got (progress.py).

The runtime base's venv (gigabytes) goes through neither pass: container_layer cuts it from the
export of the container that installed it, into a file, and load_composed loads it on top.
"""
from __future__ import annotations

import hashlib
import io
import json
import queue
import re
import tarfile
import threading
import time
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from docker import DockerClient

from sglang_image.errors import BuildError
from sglang_image.progress import Progress

CHUNK = 1 << 20
# File times inside our layers: a constant, not the commit's time, so that a layer whose content
# did not change keeps its digest from one commit to the next (the heavy layer is not pushed
# again). 1980-01-01: the earliest time a zip file can hold (tools zip files from images).
LAYER_EPOCH = 315532800
BLOCK = tarfile.BLOCKSIZE


def _counted(chunks: Iterator[bytes], progress: Progress) -> Iterator[bytes]:
    for chunk in chunks:
        progress.add(len(chunk))
        yield chunk


def iso_time(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _ChunkReader(io.RawIOBase):
    """A readable file over an iterator of byte chunks (the engine's export stream)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            try:
                self._buf = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


class _HashingReader:
    """Reads through `raw`, hashing every byte (the original layer's diff ID)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.sha.update(data)
        return data

    def drain(self) -> str:
        while self.read(CHUNK):
            pass
        return "sha256:" + self.sha.hexdigest()


class _Sink:
    """Write end: counts and hashes, and hands the bytes on (or drops them in pass 1)."""

    def __init__(self, emit: Callable[[bytes], object] | None = None) -> None:
        self.sha = hashlib.sha256()
        self.size = 0
        self.emit = emit

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        if self.emit is not None and data:
            self.emit(bytes(data))
        return len(data)

    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


# Where the build mounts what only its build needs (the wheelhouse of the runtime base's venv):
# the mount point, and anything under it, is left out of the layer (container_layer).
BUILD_INPUTS = "tmp/build-inputs"


def is_build_input(name: str, drop: str = BUILD_INPUTS) -> bool:
    """`drop` itself or an entry under it."""
    name = _path(name)
    return name == drop or name.startswith(drop + "/")


def rewrite_layer(src: IO[bytes], dst: Any, epoch: int = LAYER_EPOCH,
                  drop: str | None = None, only: Container[str] | None = None) -> None:
    """Copies a layer tar entry by entry, every mtime set to `epoch`, atime/ctime and owner
    names dropped; with `drop`, the build inputs under it left out (is_build_input); with
    `only`, every entry whose path (no leading ./ or trailing /) is not in it left out.

    Set, not clamped: a layer reused from the build cache must not depend on when the cache
    was filled."""
    with tarfile.open(fileobj=src, mode="r|") as tin, \
            tarfile.open(fileobj=dst, mode="w|", format=tarfile.PAX_FORMAT) as tout:
        for info in tin:
            if drop and is_build_input(info.name, drop):
                continue
            if only is not None:
                if _path(info.name) not in only:
                    continue
                if info.islnk() and _path(info.linkname) not in only:
                    raise BuildError(f"{info.name} is a hard link to {info.linkname}, which the "
                                     "layer does not hold: the step changed one name of a linked file")
            info.mtime = epoch
            # Owner names: Engine 20.10 writes them, Engine 25+ leaves them empty; the numeric
            # IDs are what a container sees.
            info.uname = info.gname = ""
            info.pax_headers = {k: v for k, v in info.pax_headers.items()
                                if k not in ("mtime", "atime", "ctime", "uname", "gname")}
            tout.addfile(info, tin.extractfile(info) if info.isreg() else None)


def _path(name: str) -> str:
    return name.removeprefix("./").strip("/")


@dataclass
class _Layer:
    raw: str  # diff ID as built
    new: str  # diff ID after the rewrite
    size: int  # size of the rewritten tar
    passthrough: bool


def _export(client: DockerClient, image_id: str,
            progress: Progress | None = None) -> tarfile.TarFile:
    chunks: Iterator[bytes] = iter(client.api.get_image(image_id, chunk_size=CHUNK))
    if progress is not None:
        chunks = _counted(chunks, progress)
    return tarfile.open(fileobj=io.BufferedReader(_ChunkReader(chunks), CHUNK), mode="r|")


def _scan(client: DockerClient, image_id: str, keep: set[str], epoch: int,
          known: dict[str, list[Any]] | None = None,
          log: Callable[[str], None] | None = None
          ) -> tuple[dict[str, _Layer], dict[str, Any], list[dict[str, Any]]]:
    """Pass 1: every layer's rewritten diff ID and size, keyed by its member in the export.

    Reads both layouts of `docker save`: the legacy one (`<id>/layer.tar`, config `<id>.json`)
    of Engine 20.10-24, and the OCI one of Engine 25 and later (`blobs/sha256/<hex>` for layers
    and config, `manifest.json` pointing into `blobs/`). In the OCI layout a layer blob is the
    uncompressed tar, so its name is its diff ID; the config blob is named by the image ID."""
    layers: dict[str, _Layer] = {}
    config: dict[str, Any] = {}
    manifest: list[dict[str, Any]] = []
    inspect = client.api.inspect_image(image_id)  # type: ignore[no-untyped-call]
    raw_diff_ids = set(inspect["RootFS"].get("Layers") or [])
    config_hex = str(inspect["Id"]).removeprefix("sha256:")
    progress = None if log is None else Progress(  # the export is about the image's size
        log, "normalise: pass 1/2, read", int(inspect.get("Size") or 0))
    with _export(client, image_id, progress) as tar:
        for member in tar:
            fh = tar.extractfile(member) if member.isreg() else None
            if fh is None:
                continue
            blob = member.name.removeprefix("blobs/sha256/") \
                if member.name.startswith("blobs/sha256/") else None
            is_layer = member.name.endswith("/layer.tar") or \
                bool(blob and f"sha256:{blob}" in raw_diff_ids)
            if blob and is_layer and known and f"sha256:{blob}" in known:
                # rewritten before (the cache is keyed by the layer's own digest): no rewrite
                new, size, *_ = known[f"sha256:{blob}"]  # [new, size]
                raw = f"sha256:{blob}"
                layers[member.name] = _Layer(raw, new, int(size), raw == new)
            elif is_layer:
                reader = _HashingReader(fh)
                sink = _Sink()
                rewrite_layer(reader, sink)  # type: ignore[arg-type]
                raw = reader.drain()
                if raw in keep:
                    layers[member.name] = _Layer(raw, raw, member.size, True)
                else:
                    layers[member.name] = _Layer(raw, sink.digest(), sink.size, False)
            elif member.name == "manifest.json":
                manifest = json.loads(fh.read())
            elif member.name in (f"{config_hex}.json", f"blobs/sha256/{config_hex}"):
                config = json.loads(fh.read())
    if not manifest or not config:
        raise BuildError(f"the export of {image_id} has no manifest or config")
    return layers, config, manifest


# What an image config keeps (the OCI image spec's fields, and Docker's Healthcheck): everything
# else records how and where it was built (docker_version, container, container_config, the
# builder's intermediate image, empty defaults such as Hostname or AttachStdin), differs between
# engines, and would give one commit two digests.
CONFIG_KEYS = ("architecture", "os", "variant", "os.version", "config", "created", "history",
               "rootfs", "author")
RUN_CONFIG_KEYS = ("User", "ExposedPorts", "Env", "Entrypoint", "Cmd", "Volumes", "WorkingDir",
                   "Labels", "StopSignal", "Healthcheck", "Shell", "OnBuild", "ArgsEscaped")
HISTORY_KEYS = ("created", "created_by", "author", "comment", "empty_layer")


def engine_neutral_step(created_by: str, healthcheck: str) -> str:
    """A history entry's command without what each engine writes its own way: the builder's
    hash of a COPY source (the layer's diff ID already pins the content) and the Go print of a
    HEALTHCHECK (the config holds the health check itself)."""
    step = re.sub(r"\b((?:COPY|ADD) (?:dir|file|multi)):[0-9a-f]{64}\b", r"\1", created_by)
    return re.sub(r"HEALTHCHECK &\{.*\}$", f"HEALTHCHECK {healthcheck}", step)


def normalized_config(config: dict[str, Any], diff_ids: list[str], epoch: int,
                      labels: dict[str, str] | None = None, base_history: int = 0) -> bytes:
    """The config with this build's times set to `epoch` (the base's first `base_history`
    entries keep theirs), cut down to CONFIG_KEYS and `labels` added (here rather than through
    the builder, which spends a step on each label)."""
    out = {k: config[k] for k in CONFIG_KEYS if config.get(k) not in (None, "", [], {})}
    inner = {k: v for k, v in (config.get("config") or {}).items()
             if k in RUN_CONFIG_KEYS and v not in (None, "", [], {}, False)}
    if labels:
        inner["Labels"] = {**(inner.get("Labels") or {}), **labels}
    out["config"] = inner
    stamp = iso_time(epoch)
    out["created"] = stamp
    history = [{k: v for k, v in h.items() if k in HISTORY_KEYS and v not in (None, "", False)}
               for h in out.get("history", [])]
    healthcheck = json.dumps(inner.get("Healthcheck"), sort_keys=True)
    for i, entry in enumerate(history):
        if i >= base_history and "created_by" in entry:
            entry["created_by"] = engine_neutral_step(entry["created_by"], healthcheck)
    out["history"] = [h if i < base_history else {**h, "created": stamp}
                      for i, h in enumerate(history)]
    out["rootfs"] = {"type": "layers", "diff_ids": diff_ids}
    return json.dumps(out, sort_keys=True, separators=(",", ":")).encode()


def pipe(produce: Callable[[Callable[[bytes], None]], None]) -> Iterator[bytes]:
    """Runs `produce(write)` in a thread and yields what it writes (bounded memory): lets a
    tar writer feed an HTTP upload without a copy on disk."""
    q: queue.Queue[bytes | Exception | None] = queue.Queue(maxsize=16)

    def run() -> None:
        try:
            produce(q.put)
            q.put(None)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            q.put(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while True:
        item = q.get()
        if item is None:
            break
        if isinstance(item, Exception):
            raise item
        yield item
    thread.join()


class Writer:
    """A minimal write-only file over a `write` callback (for tarfile's stream mode)."""

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self._write = write

    def write(self, data: bytes) -> int:
        if data:
            self._write(bytes(data))
        return len(data)


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    return info.tobuf(format=tarfile.PAX_FORMAT)  # PAX: layers over 8 GB need a size record


def _present_chains(client: DockerClient) -> set[tuple[str, ...]]:
    """Every layer-chain prefix of the images in the engine (the loader reuses those)."""
    chains: set[tuple[str, ...]] = set()
    for image in client.images.list():
        ids = image.attrs.get("RootFS", {}).get("Layers") or []
        for i in range(1, len(ids) + 1):
            chains.add(tuple(ids[:i]))
    return chains


def normalize_image(client: DockerClient, image_id: str, *, epoch: int, tags: list[str],
                    base_diff_ids: list[str], labels: dict[str, str] | None = None,
                    base_history: int = 0, log: Callable[[str], None] = print,
                    cache: Path | None = None) -> tuple[str, bytes]:
    """Rewrites `image_id` as described above, loads it tagged `tags`; returns the new image ID
    and its config (for a layer composed on top without exporting the image again).

    `cache`: a JSON file of {raw diff ID: [rewritten diff ID, size]}; a layer found there is not
    rewritten in pass 1 (OCI layout only: there a layer's name is its raw diff ID before it is
    read; in the legacy layout its digest is known only after reading it)."""
    keep = set(base_diff_ids)
    known = json.loads(cache.read_text()) if cache and cache.exists() else {}
    log("normalise: pass 1/2, hashing rewritten layers")
    started = time.monotonic()
    layers, config, manifest = _scan(client, image_id, keep, epoch, known, log)
    log(f"normalise: pass 1/2 took {time.monotonic() - started:.0f} s")
    if cache is not None:
        known.update({layer.raw: [layer.new, layer.size] for layer in layers.values()
                      if not layer.passthrough})
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known, indent=0, sort_keys=True) + "\n")
    folder_of = {layers[m].raw: m for m in manifest[0]["Layers"]}
    raw_ids: list[str] = config["rootfs"]["diff_ids"]
    new_ids = [layers[folder_of[raw]].new for raw in raw_ids]
    config_bytes = normalized_config(config, new_ids, epoch, labels, base_history)
    present = _present_chains(client)
    needed = {folder_of[raw] for i, raw in enumerate(raw_ids)
              if tuple(new_ids[: i + 1]) not in present}
    log(f"normalise: pass 2/2, loading {len(needed)} of {len(raw_ids)} layers")
    progress = Progress(log, "normalise: pass 2/2, loaded",
                        sum(layers[member].size for member in needed))

    def put_layers(put: Callable[[bytes], None]) -> None:
        def put_counted(data: bytes) -> None:
            put(data)
            progress.add(len(data))

        with _export(client, image_id) as tar:
            for member in tar:
                if member.name not in needed:
                    continue
                layer = layers[member.name]
                fh = tar.extractfile(member)
                assert fh is not None
                put(_header(f"{layer.new[7:]}/layer.tar", layer.size))
                sink = _Sink(put_counted)
                if layer.passthrough:
                    while block := fh.read(CHUNK):
                        sink.write(block)
                else:
                    rewrite_layer(fh, sink)
                if sink.digest() != layer.new or sink.size != layer.size:
                    raise BuildError(f"layer {member.name} rewrote differently twice "
                                     "(non-deterministic export?)")
                put(b"\0" * (-sink.size % BLOCK))

    started = time.monotonic()
    new_id = _load(client, config_bytes, put_layers, tags)
    log(f"normalise: pass 2/2 took {time.monotonic() - started:.0f} s")
    return new_id, config_bytes


def _load(client: DockerClient, config_bytes: bytes,
          put_layers: Callable[[Callable[[bytes], None]], None], tags: list[str]) -> str:
    """Streams an archive into the engine (`POST /images/load`): the layers put_layers writes
    (those whose chain the engine lacks), the config and a manifest naming every layer of the
    config; checks that the engine loaded the config's image ID and returns it."""
    new_id = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
    diff_ids: list[str] = json.loads(config_bytes)["rootfs"]["diff_ids"]
    manifest = [{"Config": new_id[7:] + ".json", "RepoTags": tags,
                 "Layers": [f"{d[7:]}/layer.tar" for d in diff_ids]}]

    def produce(put: Callable[[bytes], None]) -> None:
        put_layers(put)
        for name, data in ((new_id[7:] + ".json", config_bytes),
                           ("manifest.json", json.dumps(manifest).encode())):
            put(_header(name, len(data)) + data + b"\0" * (-len(data) % BLOCK))
        put(b"\0" * (2 * BLOCK))

    for line in client.api.load_image(pipe(produce)):  # type: ignore[no-untyped-call]
        if "error" in line:
            raise BuildError(f"loading the image failed: {str(line.get('error')).strip()}")
    got = client.images.get(tags[0]).id if tags else client.images.get(new_id).id
    if got != new_id:
        raise BuildError(f"the engine loaded {got}, expected {new_id}")
    return new_id


def export_layer(client: DockerClient, image_id: str, dest: Path) -> tuple[str, int]:
    """The one layer of `image_id` (an image built FROM scratch with one COPY), rewritten like
    every layer of ours, into the file `dest`; returns its diff ID and size."""
    raw_ids = list(client.api.inspect_image(image_id)["RootFS"].get("Layers") or [])  # type: ignore[no-untyped-call]
    if len(raw_ids) != 1:
        raise BuildError(f"{image_id} has {len(raw_ids)} layers, expected the one of part 2")
    with _export(client, image_id) as tar:
        for member in tar:
            fh = tar.extractfile(member) if member.isreg() else None
            if fh is None:
                continue
            if member.name.endswith("/layer.tar") or member.name == "blobs/sha256/" + raw_ids[0][7:]:
                with dest.open("wb") as out:
                    sink = _Sink(out.write)
                    rewrite_layer(fh, sink)
                return sink.digest(), sink.size
    raise BuildError(f"the export of {image_id} holds no layer")


def container_layer(client: DockerClient, container_id: str, dest: Path,
                    drop: str | None = None, log: Callable[[str], None] | None = None
                    ) -> tuple[str, int]:
    """What a stopped container changed in its image's file system, as a layer rewritten like
    every layer of ours, into the file `dest`; returns its diff ID and size.

    The engine's own diff names the changed paths and its export streams the container's file
    system, which is read once and cut down to them. No commit (the engine would copy the layer)
    and no save (Engine 20.10 writes a whole image to a temp folder before it streams a byte)."""
    changes = client.api.diff(container_id) or []
    removed = sorted(str(c["Path"]) for c in changes if c["Kind"] == 2)
    if removed:
        raise BuildError(f"the step removed {len(removed)} path(s) of its image "
                         f"({', '.join(removed[:3])}): a layer cut from an export cannot hold a "
                         "removal; leave the image's files in place")
    changed = {_path(str(c["Path"])) for c in changes}
    chunks: Iterator[bytes] = iter(client.api.export(container_id, chunk_size=CHUNK))
    if log is not None:
        listed = client.api.containers(all=True, size=True, filters={"id": container_id})
        total = int(listed[0].get("SizeRootFs") or 0) if listed else 0
        chunks = _counted(chunks, Progress(log, "layer: read the container's file system", total))
    with dest.open("wb") as out:
        sink = _Sink(out.write)
        rewrite_layer(io.BufferedReader(_ChunkReader(chunks), CHUNK), sink, drop=drop, only=changed)
    return sink.digest(), sink.size


def with_layer(config_bytes: bytes, diff_id: str, step: str, *, epoch: int, base_history: int,
               labels: dict[str, str] | None = None) -> bytes:
    """An image config with one layer more on top (its history entry `step`), normalised like
    every config of ours, `labels` added."""
    config = json.loads(config_bytes)
    config["history"] = [*config.get("history", []), {"created_by": step}]
    diff_ids = [*config["rootfs"]["diff_ids"], diff_id]
    return normalized_config(config, diff_ids, epoch, labels, base_history)


def load_composed(client: DockerClient, config_bytes: bytes, new_layers: dict[str, Path],
                  tags: list[str], log: Callable[[str], None] | None = None) -> str:
    """Loads the image of `config_bytes` whose layers are in the engine already, except those in
    `new_layers` (diff ID -> layer tar); returns its ID. With `log`, says how far it got."""
    diff_ids: list[str] = json.loads(config_bytes)["rootfs"]["diff_ids"]
    present = _present_chains(client)
    missing = [d for i, d in enumerate(diff_ids) if tuple(diff_ids[: i + 1]) not in present
               and d not in new_layers]
    if missing:
        raise BuildError(f"cannot load the image: layers {missing} are neither in the engine "
                         "nor given")

    progress = None if log is None else Progress(
        log, "load", sum(path.stat().st_size for path in new_layers.values()))

    def put_layers(put: Callable[[bytes], None]) -> None:
        for diff_id, path in new_layers.items():
            size = path.stat().st_size
            put(_header(f"{diff_id[7:]}/layer.tar", size))
            with path.open("rb") as fh:
                while block := fh.read(CHUNK):
                    put(block)
                    if progress is not None:
                        progress.add(len(block))
            put(b"\0" * (-size % BLOCK))

    return _load(client, config_bytes, put_layers, tags)
