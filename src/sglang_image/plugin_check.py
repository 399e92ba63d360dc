"""`nox -s plugin-check`: the plugin's hook targets still exist in an unpacked sglang wheel and
the upstream code it relies on is unchanged since its digests were recorded.

The check reads the wheel's sources (ast, no import, no GPU), so it runs on a new release before
anything is built; `nox -s patches` runs it on every flavor with the plugin.
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from sglang_image.errors import PluginError, UsageError
from sglang_image.pins import PLUGIN_PACKAGE_DIR, Flavor
from sglang_image_plugin import targets as plugin_targets


def digests_path() -> Path:
    """The digests in the plugin's sources (where `--record` writes them, whatever imported the
    targets)."""
    return PLUGIN_PACKAGE_DIR / plugin_targets.DIGESTS_FILE


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
    recorded = (load_digests() if digests is None else digests).get(sglang_version)
    problems = []
    found_version = wheel_version(site_packages)
    if found_version is not None and found_version != sglang_version:
        problems.append(f"{site_packages} holds sglang {found_version}, not {sglang_version}")
    for spec in plugin_targets.HOOKS:
        if definition_source(site_packages, spec.target) is None:
            problems.append(f"hook target {spec.target} ({spec.hook_type}: {spec.why}) does "
                            f"not exist in sglang {sglang_version}: move the hook")
    if recorded is None:
        problems.append(f"no digests recorded for sglang {sglang_version}: review "
                        f"{', '.join(plugin_targets.RELIED)} against the plugin, then record them "
                        f"(nox -s plugin-check -- --site-packages DIR --record)")
    for dotted in plugin_targets.RELIED:
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
    for dotted in plugin_targets.RELIED:
        source = definition_source(site_packages, dotted)
        if source is None:
            raise PluginError(f"{dotted} does not exist under {site_packages}: fix the plugin "
                              "before recording digests")
        entry[dotted] = source_digest(source)
    digests = load_digests()
    digests[sglang_version] = entry
    digests_path().write_text(json.dumps(digests, indent=2, sort_keys=True) + "\n")
    return entry


def check_flavor(flavor: Flavor, tree: Path) -> list[str]:
    """Problems of the plugin against the flavor's unpacked upstream `tree` (empty: none; a flavor
    without the plugin has none)."""
    return check_hook_targets(tree, flavor.sglang_version) if flavor.plugin else []


@dataclass(frozen=True, kw_only=True)
class PluginCheckOptions:
    """What `nox -s plugin-check` was asked for; checked when made."""

    site_packages: Path  # an unpacked sglang wheel (the directory holding sglang/)
    sglang_version: str | None = None  # default: the flavor's, else the wheel's dist-info
    record: bool = False  # after review: record this release's digests of the relied-on code

    def __post_init__(self) -> None:
        if not (self.site_packages / "sglang").is_dir():
            raise PluginError(f"{self.site_packages} has no sglang/ directory: unpack the wheel "
                              "there (python -m zipfile -e sglang-X.whl DIR)")


def run(flavor: Flavor | None, options: PluginCheckOptions) -> int:
    """`nox -s plugin-check -- --site-packages DIR`: the hook targets and relied-on code in an
    unpacked sglang wheel of `flavor`'s release (None: the release the wheel names), or, with
    `record`, their digests recorded after review; 1 when a check fails."""
    site = options.site_packages
    if flavor is not None and options.sglang_version not in (None, flavor.sglang_version):
        raise UsageError(f"--sglang-version {options.sglang_version} and --flavor {flavor.name} "
                         f"(sglang {flavor.sglang_version}) disagree: give one of them")
    version = (options.sglang_version or (flavor.sglang_version if flavor else None)
               or wheel_version(site))
    if version is None:
        raise PluginError(f"{site} has no sglang-*.dist-info: pass --sglang-version")
    if options.record:
        entry = record_digests(site, version)
        print(f"recorded {len(entry)} digests for sglang {version} in {digests_path()}")
        return 0
    problems = check_hook_targets(site, version)
    for line in problems:
        print(f"FAIL {line}")
    if not problems:
        print(f"ok: sglang {version}: {len(plugin_targets.HOOKS)} hook targets exist, "
              f"{len(plugin_targets.RELIED)} relied-on definitions unchanged")
    return 1 if problems else 0
