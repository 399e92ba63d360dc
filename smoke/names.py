"""The names the smoke and the benchmark share with the plugin, spelled once, in the plugin's
spec_disable.py and depth_schedule.py (standard library only): the threshold flag, its environment
variable, `auto` and the threshold parser; the depth schedule's flag and parser.

Loaded by path, not imported as the plugin package: the smoke runs where the plugin is absent
(an image of a flavor without it, this repository's tests), and a copy of the package on the
path would shadow an installed plugin in the servers it starts. Looked for beside this package
(the repository; the image's smoke mount carries plugin/ there too), then in an installed plugin.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

MODULE_FILE = "spec_disable.py"
MODULE_NAME = "_sglang_image_plugin_names"
SCHEDULE_FILE = "depth_schedule.py"
SCHEDULE_MODULE_NAME = "_sglang_image_plugin_schedule"


def candidates(module_file: str = MODULE_FILE) -> list[Path]:
    found = [Path(__file__).resolve().parents[1] / "plugin" / "sglang_image_plugin" / module_file]
    spec = importlib.util.find_spec("sglang_image_plugin")  # a top-level name: nothing is imported
    if spec is not None and spec.submodule_search_locations:
        found += [Path(p) / module_file for p in spec.submodule_search_locations]
    return found


def load(module_file: str = MODULE_FILE, module_name: str = MODULE_NAME) -> ModuleType:
    if module_name in sys.modules:
        return sys.modules[module_name]
    for path in candidates(module_file):
        if path.is_file():
            spec = importlib.util.spec_from_file_location(module_name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module  # dataclasses look their module up while defining
            spec.loader.exec_module(module)
            return module
    raise ImportError(f"the plugin's {module_file} is in none of "
                      f"{', '.join(map(str, candidates(module_file)))}: run from the repository, or mount "
                      "its plugin/ folder beside smoke/")


_names = load()
THRESHOLD_FLAG: str = _names.THRESHOLD_FLAG
THRESHOLD_ENV: str = _names.THRESHOLD_ENV
AUTO_TRACE_ENV: str = _names.AUTO_TRACE_ENV
AUTO: str = _names.AUTO
# a draft depth per load (depth_schedule.py, standard library only too)
_schedule = load(SCHEDULE_FILE, SCHEDULE_MODULE_NAME)
DEPTH_SCHEDULE_FLAG: str = _schedule.DEPTH_SCHEDULE_FLAG
DEPTH_SCHEDULE_EXAMPLE: str = _schedule.EXAMPLE  # the schedule the docs and the bench start from


def parse_schedule(raw: str, source: str = "--schedule") -> str:
    """A depth schedule in its normal form (tiers merged); ValueError naming `source` otherwise
    (the plugin's own parser)."""
    return str(_schedule.parse(raw, source=source))


def parse_threshold(raw: str | int, source: str = "--threshold") -> int | str:
    """`auto` or a whole number >= 1 of running requests; ValueError naming `source` otherwise
    (the plugin's own parser, so the smoke, the bench and the server accept the same values)."""
    value: int | str = _names.parse_threshold(raw, source=source, allow_zero=False)
    return value
