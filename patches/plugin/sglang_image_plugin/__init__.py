"""sglang-image's changes to SGLang as a plugin (entry point group `sglang.srt.plugins`).

SGLang calls `register` in every process it starts (launcher, scheduler,
detokenizer, DP controller). It refuses an sglang release the plugin was not checked
against and registers the hooks of targets.HOOKS; SGLang's loader applies them once
every plugin has registered (another plugin's hooks on the same targets are applied
with ours). The first hook that runs in a process (the CLI hook in the launcher, the
worker hook in the scheduler) checks that every hook took: SGLang logs and skips a
plugin or hook that fails, and a server silently without its flag or switch is worse
than one that stops.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import pkgutil
from collections.abc import Callable
from importlib import resources
from typing import Any

from sglang_image_plugin.hooks import FUNCTIONS, set_hook_check
from sglang_image_plugin.targets import DIGESTS_FILE, HOOKS

logger = logging.getLogger(__name__)


class PluginHookError(SystemExit):
    """A hook did not take. SystemExit, not Exception: SGLang's plugin loader
    catches Exception and carries on without the plugin."""


def _chain(obj: Any) -> list[Any]:
    """The function at a hook target and every function it wraps (__wrapped__)."""
    found: list[Any] = []
    fn = getattr(obj, "__func__", obj)  # classmethod / staticmethod
    while fn is not None and len(found) < 64:
        found.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return found


def _wraps_hook(obj: Any, hook: Callable[..., Any]) -> bool:
    """Whether one of the wrappers at a target closes over this hook."""
    for fn in _chain(obj):
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # an empty cell
                continue
    return False


def _raw_attribute(target: str) -> Any:
    """The attribute at a dotted path as stored (a classmethod object, not bound)."""
    owner_path, name = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in klass.__dict__:
                return klass.__dict__[name]
    return getattr(owner, name)


def hooks_not_taken() -> list[str]:
    """Each of our hooks that is not in place, with the reason."""
    problems = []
    for spec in HOOKS:
        hook = FUNCTIONS[spec.target]
        try:
            attribute = _raw_attribute(spec.target)
        except (ImportError, AttributeError, ValueError) as e:
            problems.append(f"{spec.target}: cannot be resolved ({type(e).__name__}: {e})")
            continue
        if not _wraps_hook(attribute, hook):
            problems.append(f"{spec.target}: the {spec.hook_type} hook is not applied")
    return problems


def checked_sglang_versions() -> list[str]:
    """The sglang releases the plugin was reviewed against: those with recorded digests
    of the upstream code it relies on (upstream_digests.json)."""
    text = resources.files(__package__).joinpath(DIGESTS_FILE).read_text()
    return sorted(json.loads(text))


def check_sglang_version(installed: str | None = None) -> None:
    """Stop the process when this sglang release is not one the plugin was checked on."""
    if installed is None:
        installed = importlib.metadata.version("sglang")
    checked = checked_sglang_versions()
    if installed not in checked:
        message = (
            f"sglang-image-plugin was checked against sglang {', '.join(checked)}, and this "
            f"is sglang {installed}: its hooks reach into upstream code that may have changed. "
            "Install the plugin built for this release (the image of its flavor), or check it: "
            "`nox -s plugin-check -- --site-packages DIR` on this release's unpacked wheel"
        )
        logger.critical(message)
        raise PluginHookError(message)


def ensure_hooks_applied() -> None:
    """Stop the process if a hook is not in place (called by the first hook that runs)."""
    problems = hooks_not_taken()
    if problems:
        message = (
            "sglang-image-plugin: hooks did not take, so dynamic speculation disable "
            "(--speculative-disable-batch-threshold) cannot work; this sglang release "
            "needs a plugin update (run `nox -s plugin-check` on its wheel):\n  "
            + "\n  ".join(problems)
        )
        logger.critical(message)
        raise PluginHookError(message)
    logger.info("sglang-image-plugin: %d hooks applied", len(HOOKS))


def register() -> None:
    """Entry point: check the sglang release and register every hook (SGLang's
    loader applies them after all plugins ran)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_sglang_version()
    for spec in HOOKS:
        HookRegistry.register(spec.target, FUNCTIONS[spec.target], HookType(spec.hook_type))
    set_hook_check(ensure_hooks_applied)
