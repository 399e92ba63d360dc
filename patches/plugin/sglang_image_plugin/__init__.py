"""sglang-image's changes to SGLang as a plugin (entry point group `sglang.srt.plugins`).

SGLang calls `register` in every process it starts (launcher, scheduler,
detokenizer, DP controller). It registers the hooks of targets.HOOKS, applies them
and checks that each one took: SGLang logs and skips a plugin or hook that fails,
and a server silently without its flag or switch is worse than one that stops.
"""

from __future__ import annotations

import logging
import pkgutil
from collections.abc import Callable
from typing import Any

from sglang_image_plugin.hooks import FUNCTIONS
from sglang_image_plugin.targets import HOOKS

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


def register() -> None:
    """Entry point: register, apply and check every hook; stop the process if one
    did not take."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for spec in HOOKS:
        HookRegistry.register(spec.target, FUNCTIONS[spec.target], HookType(spec.hook_type))
    # Applied now (the loader applies again after every plugin ran, skipping targets
    # already patched), so that they can be checked here.
    HookRegistry.apply_hooks()
    problems = hooks_not_taken()
    if problems:
        message = (
            "sglang-image-plugin: hooks did not take, so dynamic speculation disable "
            "(--speculative-disable-batch-threshold) cannot work; this sglang release "
            "needs a plugin update (run `python -m sglang_image plugin-check` on its "
            "wheel):\n  " + "\n  ".join(problems)
        )
        logger.critical(message)
        raise PluginHookError(message)
    logger.info("sglang-image-plugin: %d hooks applied", len(HOOKS))
