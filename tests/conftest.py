"""Shared fixtures: real, unpacked (and patched) SGLang wheels, and a Docker engine."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from sglang_image import patch, pins

REPO_ROOT = pins.REPO_ROOT
TREE_CACHE = REPO_ROOT / ".cache" / "trees"

pytest_plugins = ["tests.conftest_docker"]


def _series_key(flavor: pins.Flavor) -> str:
    """Changes whenever the series or any patch of it changes: the cached tree is then rebuilt."""
    import hashlib

    digest = hashlib.sha256(flavor.toml_path.read_bytes())
    for path in [flavor.patch_dir / "series", *flavor.series()]:
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def sglang_tree() -> Callable[[str, bool], Path]:
    """Factory: sglang_tree(flavor, patched) -> a dir holding the flavor's real sglang/ and
    flashinfer/ packages, unpacked from the hash-checked wheels, with the series applied if patched.
    Trees are cached under .cache/trees and rebuilt when the series changes."""
    made: dict[tuple[str, bool], Path] = {}

    def make(flavor_name: str, patched: bool = True) -> Path:
        if (flavor_name, patched) in made:
            return made[(flavor_name, patched)]
        flavor = pins.load_flavor(flavor_name)
        key = _series_key(flavor) if patched else "pristine"
        dest = TREE_CACHE / f"{flavor_name}-{key}"
        if not (dest / ".complete").exists():
            shutil.rmtree(dest, ignore_errors=True)
            patch.prepare_tree(flavor, dest, patched=patched)
            (dest / ".complete").write_text("ok\n")
        made[(flavor_name, patched)] = dest
        return dest

    return make


@pytest.fixture(scope="module")
def patched(request: pytest.FixtureRequest, sglang_tree: Callable[[str, bool], Path]) -> Path:
    """The test module's FLAVOR, unpacked with its series applied."""
    return sglang_tree(request.module.FLAVOR, True)


@pytest.fixture(scope="module")
def pristine(request: pytest.FixtureRequest, sglang_tree: Callable[[str, bool], Path]) -> Path:
    """The test module's FLAVOR, unpacked as the wheel ships it (proves a check can fail)."""
    return sglang_tree(request.module.FLAVOR, False)


@pytest.fixture(scope="session")
def run_in_tree() -> Callable[..., subprocess.CompletedProcess[str]]:
    """run_in_tree(tree, code, env=None, timeout=600): `python -c code` with the tree first on
    PYTHONPATH, in its own process (each flavor's sglang needs its own interpreter)."""

    def run(tree: Path, code: str, env: dict[str, str] | None = None,
            timeout: int = 600) -> subprocess.CompletedProcess[str]:
        full_env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
        return subprocess.run([sys.executable, "-c", code], cwd=tree, env=full_env, check=False,
                              capture_output=True, text=True, timeout=timeout)

    return run
