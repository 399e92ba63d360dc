"""The plugin's wheel (plugin/, the `sglang-image-plugin` package), built reproducibly: the image
and the GPU host's bundle install the same bytes."""
from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from sglang_image.errors import PluginError
from sglang_image.pins import PLUGIN_DIR

# Wheel timestamps: zip's earliest date (the build must not depend on when it ran).
WHEEL_EPOCH = 315532800


def _pinned_backend() -> str:
    """The one build requirement of the plugin's pyproject.toml (`setuptools==X`)."""
    requires = tomllib.loads((PLUGIN_DIR / "pyproject.toml").read_text())["build-system"]["requires"]
    if len(requires) != 1 or not re.fullmatch(r"setuptools==[\w.]+", requires[0]):
        raise PluginError(f"{PLUGIN_DIR / 'pyproject.toml'}: build-system.requires must be one "
                          f"exact setuptools pin, got {requires}")
    return str(requires[0]).split("==")[1]


def build_wheel(out_dir: Path) -> Path:
    """Build the plugin's wheel into out_dir; the same sources give the same bytes
    (fixed timestamps and file modes, the pinned setuptools, no build isolation)."""
    pinned = _pinned_backend()
    installed = importlib.metadata.version("setuptools")
    if installed != pinned:
        raise PluginError(f"the plugin builds with setuptools=={pinned} (plugin/"
                          f"pyproject.toml), this environment has {installed}: "
                          f"install setuptools=={pinned}, or update the pin and the lock")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sglang-image-plugin-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(PLUGIN_DIR, src, ignore=shutil.ignore_patterns(
            "__pycache__", "*.pyc", "build", "dist", "*.egg-info"))
        for path in sorted(src.rglob("*")):
            mode = 0o755 if path.is_dir() else 0o644
            path.chmod(mode)
            os.utime(path, (WHEEL_EPOCH, WHEEL_EPOCH))
        dist = Path(tmp) / "dist"
        env = {**os.environ, "SOURCE_DATE_EPOCH": str(WHEEL_EPOCH), "PYTHONHASHSEED": "0"}
        proc = subprocess.run(
            [sys.executable, "-c",
         "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))",
         str(dist)],
            cwd=src, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise PluginError(f"building the plugin wheel failed:\n{proc.stderr[-3000:]}")
        wheel = dist / proc.stdout.strip().splitlines()[-1]
        target = out_dir / wheel.name
        shutil.copyfile(wheel, target)
        target.chmod(stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
    return target


