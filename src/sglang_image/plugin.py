"""The SGLang plugin package (plugin/): its reproducible wheel, and the check
that its hook targets still exist and the upstream code it relies on is unchanged.

The check reads an unpacked sglang wheel's sources (ast, no import, no GPU), so it runs
on a new release before anything is built: `python -m sglang_image plugin-check
--site-packages DIR`.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from pathlib import Path
from types import ModuleType

from sglang_image.errors import SglangImageError
from sglang_image.pins import REPO_ROOT

PLUGIN_DIR = REPO_ROOT / "plugin"
PACKAGE_DIR = PLUGIN_DIR / "sglang_image_plugin"
# Wheel timestamps: zip's earliest date (the build must not depend on when it ran).
WHEEL_EPOCH = 315532800


class PluginError(SglangImageError):
    """The plugin cannot be built, or does not fit a sglang release."""

    exit_code = 14


def _load(name: str) -> ModuleType:
    """A standard-library-only module of plugin/sglang_image_plugin/, loaded by path (the build
    system does not import the plugin package, which reaches into sglang)."""
    key = f"_sglang_image_plugin_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, PACKAGE_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


def _targets() -> ModuleType:
    """targets.py: the hooks and the upstream code relied on (pure data)."""
    return _load("targets")


def names() -> ModuleType:
    """spec_disable.py: the threshold flag, its environment variable, `auto` and the parser,
    spelled there once for the plugin, the build system, the smoke and the benchmark."""
    return _load("spec_disable")


def digests_path() -> Path:
    return PACKAGE_DIR / str(_targets().DIGESTS_FILE)


def load_digests() -> dict[str, dict[str, str]]:
    """sglang version -> dotted path -> sha256 of that definition's source."""
    path = digests_path()
    return json.loads(path.read_text()) if path.exists() else {}


def _locate(site_packages: Path, dotted: str) -> tuple[Path, list[str]] | None:
    """The module file of a dotted path and the names inside it (longest module match)."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        base = site_packages.joinpath(*parts[:split])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate, parts[split:]
    return None


Definition = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def _find(tree: ast.Module, names: list[str]) -> Definition | None:
    """The class or function definition at names[0].names[1]... in a module."""
    body: list[ast.stmt] = tree.body
    node: Definition | None = None
    for name in names:
        node = next((n for n in body if isinstance(n, Definition) and n.name == name), None)
        if node is None:
            return None
        body = node.body
    return node


def definition_source(site_packages: Path, dotted: str) -> str | None:
    """A definition's source text (decorators included, dedented); None if absent."""
    located = _locate(site_packages, dotted)
    if located is None:
        return None
    path, names = located
    text = path.read_text()
    node = _find(ast.parse(text), names)
    if node is None:
        return None
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    lines = text.splitlines()[first - 1: node.end_lineno]
    return textwrap.dedent("\n".join(lines)) + "\n"


def source_digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def wheel_version(site_packages: Path) -> str | None:
    """The sglang version of an unpacked wheel (its dist-info)."""
    for meta in sorted(site_packages.glob("sglang-*.dist-info/METADATA")):
        match = re.search(r"^Version: (\S+)$", meta.read_text(errors="replace"), re.MULTILINE)
        if match:
            return match.group(1)
    return None


def check_hook_targets(site_packages: Path, sglang_version: str,
                       digests: dict[str, dict[str, str]] | None = None) -> list[str]:
    """Problems, one line each naming what to review: a hook target that does not
    exist in this tree, an upstream definition the plugin relies on that is missing,
    has no recorded digest for this version, or changed since it was recorded."""
    targets = _targets()
    recorded = (load_digests() if digests is None else digests).get(sglang_version)
    problems = []
    found_version = wheel_version(site_packages)
    if found_version is not None and found_version != sglang_version:
        problems.append(f"{site_packages} holds sglang {found_version}, not {sglang_version}")
    for spec in targets.HOOKS:
        if definition_source(site_packages, spec.target) is None:
            problems.append(f"hook target {spec.target} ({spec.hook_type}: {spec.why}) does "
                            f"not exist in sglang {sglang_version}: move the hook")
    if recorded is None:
        problems.append(f"no digests recorded for sglang {sglang_version}: review "
                        f"{', '.join(targets.RELIED)} against the plugin, then record them "
                        f"(nox -s plugin-check -- --site-packages DIR --record)")
    for dotted in targets.RELIED:
        source = definition_source(site_packages, dotted)
        if source is None:
            problems.append(f"{dotted} does not exist in sglang {sglang_version}: the plugin "
                            "relies on it; review the plugin")
        elif recorded is not None and dotted not in recorded:
            problems.append(f"{dotted}: no digest recorded for sglang {sglang_version}")
        elif recorded is not None and recorded[dotted] != source_digest(source):
            problems.append(f"{dotted} changed in sglang {sglang_version} since the plugin "
                            "was checked against it: review it, then record the digests again")
    return problems


def record_digests(site_packages: Path, sglang_version: str) -> dict[str, str]:
    """Write this release's digests of every relied-on definition (after review)."""
    entry = {}
    for dotted in _targets().RELIED:
        source = definition_source(site_packages, dotted)
        if source is None:
            raise PluginError(f"{dotted} does not exist under {site_packages}: fix the plugin "
                              "before recording digests")
        entry[dotted] = source_digest(source)
    digests = load_digests()
    digests[sglang_version] = entry
    digests_path().write_text(json.dumps(digests, indent=2, sort_keys=True) + "\n")
    return entry


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


def run(site: Path, sglang_version: str | None = None, record: bool = False) -> int:
    """`nox -s plugin-check -- --site-packages DIR [--sglang-version V] [--record]`: the hook
    targets and relied-on code in an unpacked sglang wheel (or, with `record`, their digests
    recorded after review); 1 when a check fails."""
    if not (site / "sglang").is_dir():
        raise PluginError(f"{site} has no sglang/ directory: unpack the wheel there "
                          "(python -m zipfile -e sglang-X.whl DIR)")
    version = sglang_version or wheel_version(site)
    if version is None:
        raise PluginError(f"{site} has no sglang-*.dist-info: pass --sglang-version")
    if record:
        entry = record_digests(site, version)
        print(f"recorded {len(entry)} digests for sglang {version} in {digests_path()}")
        return 0
    problems = check_hook_targets(site, version)
    for line in problems:
        print(f"FAIL {line}")
    if not problems:
        targets = _targets()
        print(f"ok: sglang {version}: {len(targets.HOOKS)} hook targets exist, "
              f"{len(targets.RELIED)} relied-on definitions unchanged")
    return 1 if problems else 0
