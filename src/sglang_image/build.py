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

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from docker import DockerClient
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sglang_image import normalize
from sglang_image.context import prepare_context
from sglang_image.docker_engine import ensure_engine
from sglang_image.dockerbuild import (
    LEGACY_CACHE_STAGES,
    _known,
    _remember,
    _remove_quietly,
    _retag,
    build_key,
    copy_out,
    layer_table,
    run_build,
    runtime_base,
)
from sglang_image.labels import MANIFEST_PATH, SBOM_PATH, labels
from sglang_image.pins import REPO_ROOT, Flavor
from sglang_image.plan import (
    BUILD_CACHE_REPO,
    BuildOptions,
    locked_entries,
    make_plan,
    unverified_base_warning,
)

# The history entry of part 2's layer in the image config.
ASSEMBLE_STEP = "sglang-image: SGLang, the patch series, the plugin and the SBOM (images/assemble.Dockerfile)"


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


class _Phases:
    """Wall-clock seconds per phase of one build, printed at the end."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float]] = []
        self._mark = time.monotonic()

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.rows.append((name, now - self._mark))
        self._mark = now


def build(flavor: Flavor, options: BuildOptions, console: Console | None = None,
          client: DockerClient | None = None) -> BuildResult:
    """Builds the flavor's image (the steps in the module docstring) on `client`, or on the engine
    ensure_engine finds or starts."""
    console = console or Console(stderr=True)
    log: Callable[[str], None] = lambda msg: console.print(f"[bold]»[/] {msg}", highlight=False)
    started = time.monotonic()
    phases = _Phases()
    warning = unverified_base_warning(flavor, options)
    if warning:
        log(f"[yellow]warning:[/] {escape(warning)}")
    # A stale or incomplete lock stops here, before an engine is found or started.
    entries = locked_entries(flavor, light=options.light)
    if client is None:
        client = ensure_engine(log=log).client
    plan = make_plan(flavor, options, entries, client, log)
    work, epoch, base = plan.work, plan.epoch, plan.base
    tags = list(plan.tags)
    tag = tags[0]
    phases.done("lock and base")
    ctx = work / "context"
    context = prepare_context(plan, ctx, log)
    build_labels = labels(flavor, epoch=epoch, base_name=base.name, base_digest=base.digest,
                          patches=list(context.patches), light=options.light,
                          plugin_wheel=context.plugin)
    base_args = {"BASE_IMAGE": base.ref,
                 "CUDA_HOME": context.cuda_home, "TORCH_CUDA_ARCH_LIST": flavor.cuda_arch_list}
    key = build_key(ctx, {**base_args, "PYTHON_VERSION": flavor.python_version,
                          "SOURCE_DATE_EPOCH": str(epoch)}, base.image_id, build_labels)
    phases.done("fetch wheels")
    index = work / "built.json"
    raw_id = ""
    image_id = None if options.no_cache else _known(client, index, key)
    if image_id:
        log(f"build: inputs unchanged, reusing {image_id[:19]}")
    else:
        base_tag, base_config = runtime_base(client, plan, ctx / "runtime-base", ctx / "build-inputs",
                                             buildargs=base_args, console=console, log=log)
        phases.done("runtime base")
        log(f"build: part 2 of {flavor.name} on {base_tag}, network off")
        raw_id, stages = run_build(client, ctx / "assemble", no_cache=options.no_cache, console=console,
                                   target="layer",
                                   buildargs={"RUNTIME_BASE": base_tag, "PYTHON_VERSION": flavor.python_version,
                                              "SOURCE_DATE_EPOCH": str(epoch)})
        # The builder's images stay, tagged, so that the SGLang install stays cached; one a tag
        # leaves goes, with the cache only it used, so nothing is left dangling.
        for stage_name, stage_id in stages.items():
            _retag(client, str(client.images.get(stage_id).id),
                   [f"{BUILD_CACHE_REPO}:{work.name}-{stage_name}"])
        _retag(client, raw_id, [f"{BUILD_CACHE_REPO}:{work.name}"])
        for stage_name in LEGACY_CACHE_STAGES:  # gigabytes the one-stage build left behind
            _remove_quietly(client, f"{BUILD_CACHE_REPO}:{work.name}-{stage_name}")
        phases.done("part 2")
        layer_file = work / "part2-layer.tar"
        diff_id, size = normalize.export_layer(client, raw_id, layer_file)
        config = normalize.with_layer(base_config, diff_id, ASSEMBLE_STEP, epoch=epoch,
                                      base_history=base.history, labels=build_labels)
        log(f"compose: part 2 is {size / 1e6:.1f} MB ({diff_id[:19]})")
        image_id = normalize.load_composed(client, config, {diff_id: layer_file}, [])
        layer_file.unlink()
        phases.done("compose")
        _remember(index, key, image_id)
    shutil.rmtree(ctx, ignore_errors=True)
    _retag(client, image_id, tags)
    out = options.output_dir or REPO_ROOT / "build" / tag.replace("/", "_").replace(":", "-")
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


def run(flavor: Flavor, options: BuildOptions) -> int:
    """`nox -s build`: builds, prints the layer table and the summary (stderr), the image ID
    (stdout, for scripts)."""
    console = Console(stderr=True)
    result = build(flavor, options, console)
    print_result(result, console)
    print(result.image_id)
    return 0
