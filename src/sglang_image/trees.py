"""Unpacked upstream trees: a flavor's patch targets, fetched by hash and laid out as in
site-packages, optionally with the series applied (for `nox -s patches`, the patch workflow and
the tests). The image build does not use it: it installs the wheels with pip.
"""
from __future__ import annotations

import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from sglang_image.fetch import fetch_wheels
from sglang_image.patch import PatchResult, apply_series
from sglang_image.pins import Flavor


def unpack_wheels(wheels: Sequence[Path], dest: Path) -> None:
    """Unpacks wheels as pip would lay them out in site-packages (no scripts, no bytecode)."""
    dest.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(dest)


def prepare_tree(flavor: Flavor, dest: Path, *, patched: bool = True,
                 extra: Iterable[str] = ()) -> list[PatchResult]:
    """Fetches the flavor's patch targets (hash-checked) and the `extra` distributions of its lock,
    unpacks them into `dest` and, when `patched`, applies the series. Returns one result per patch
    (empty when not patched)."""
    with tempfile.TemporaryDirectory() as tmp:
        wheels = fetch_wheels(flavor, Path(tmp), only=dict.fromkeys([*flavor.patch_targets, *extra]))
        unpack_wheels(wheels, dest)
    if not patched:
        return []
    return apply_series(flavor.series(), dest)
