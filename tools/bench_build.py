"""Build timings: the time per phase of a cold, an unchanged and a patch-only build.

    PYTHONPATH=src:plugin python tools/bench_build.py [--flavor F] [--base TAG] [--light] [--skip-cold]

Scenarios, in this order, on the engine DOCKER_HOST names (or the one `ensure_engine()` finds
or starts, as every command does):
  cold        --no-cache: the runtime base and part 2 built again (the wheels already fetched)
  unchanged   the same inputs again: what a rebuild of an unchanged tree costs
  patch-only  one patch's header changed: the runtime base reused, part 2 rebuilt from its cached
              SGLang install, its one layer composed onto the base
Prints one row per scenario with the seconds of each phase, the total, the engine's disk use
and the dangling images left behind. Numbers only: it asserts nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sglang_image import build, pins, plan
from sglang_image.cli import add_flavor
from sglang_image.docker_engine import ensure_engine


def _patch_only(flavor: pins.Flavor, where: Path) -> pins.Flavor:
    """The flavor with a copy of its series whose first patch has one more header line."""
    series_dir = where / "patches"
    shutil.copytree(flavor.patch_dir, series_dir)
    first = series_dir / flavor.series()[0].name
    first.write_text(f"X-Bench: {time.time_ns()}\n" + first.read_text())
    return dataclasses.replace(flavor, patch_dir=series_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flavor(ap, "the flavor to build")
    ap.add_argument("--base", default=None, help="base image (default: the flavor's)")
    ap.add_argument("--light", action="store_true", help="the light target (seconds, not minutes)")
    ap.add_argument("--skip-cold", action="store_true", help="start from the engine's cache")
    ap.add_argument("--tag", default="sglang-image-bench:latest")
    args = ap.parse_args(argv)
    flavor: pins.Flavor = args.flavor
    client = ensure_engine(log=lambda m: print(f"» {m}", file=sys.stderr)).client
    quiet = Console(file=io.StringIO())
    table = Table(title=f"build timings: {flavor.name}{' (light)' if args.light else ''}")
    phase_names: list[str] = []
    rows: list[tuple[str, build.BuildResult, float, int]] = []
    with tempfile.TemporaryDirectory(prefix="bench-build-") as tmp:
        scenarios = [("cold", flavor, True), ("unchanged", flavor, False),
                     ("patch-only", _patch_only(flavor, Path(tmp)), False)]
        for name, fl, no_cache in scenarios:
            if name == "cold" and args.skip_cold:
                continue
            print(f"» {name} ...", file=sys.stderr, flush=True)
            options = plan.BuildOptions(base=args.base, light=args.light, no_cache=no_cache,
                                        tag=args.tag, output_dir=Path(tmp) / "out" / name)
            result = build.build(fl, options, quiet, client)
            df = client.df()
            disk = sum(int(i.get("Size", 0)) for i in df.get("Images") or []) / 1e9
            dangling = len(client.images.list(filters={"dangling": True}))
            rows.append((name, result, disk, dangling))
            phase_names += [p for p, _ in result.phases if p not in phase_names]
    table.add_column("scenario")
    for p in phase_names:
        table.add_column(p, justify="right")
    for col in ("total", "image GB", "engine images GB", "dangling"):
        table.add_column(col, justify="right")
    for name, result, disk, dangling in rows:
        by_phase = dict(result.phases)
        table.add_row(name, *(f"{by_phase[p]:.1f} s" if p in by_phase else "-" for p in phase_names),
                      f"{result.seconds:.1f} s", f"{result.size / 1e9:.2f}", f"{disk:.1f}",
                      str(dangling))
    Console(width=200).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
