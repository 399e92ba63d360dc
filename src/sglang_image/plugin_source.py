"""The plugin's sources as the build system sees them: where plugin/ is, and its standard-library
-only modules (targets.py, spec_disable.py) loaded by path.

By path, not imported: the plugin package reaches into sglang, which the build system does not
install. The smoke, which runs where this package is absent, has its own loader (smoke/names.py).
"""
from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from sglang_image.pins import REPO_ROOT

PLUGIN_DIR = REPO_ROOT / "plugin"
PACKAGE_DIR = PLUGIN_DIR / "sglang_image_plugin"


def load(name: str) -> ModuleType:
    """plugin/sglang_image_plugin/<name>.py, loaded once per process."""
    key = f"_sglang_image_plugin_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, PACKAGE_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


def targets() -> ModuleType:
    """targets.py: the hooks and the upstream code relied on (pure data)."""
    return load("targets")


def spec_disable() -> ModuleType:
    """spec_disable.py: the threshold flag, `auto` and the parser, spelled there once for the
    plugin, the build system, the smoke and the benchmark (read through sglang_image.threshold)."""
    return load("spec_disable")
