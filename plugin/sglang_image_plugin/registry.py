"""Putting our hooks in place through SGLang's HookRegistry, and checking that each took.

Start-up hooks (targets.START) are registered when SGLang loads the plugin and applied by its
loader with every other plugin's. The per-step hooks are installed by the worker once its plain
step is resolved (plain_step.py): only those of the groups its setup runs, so a step pays for no
hook it does not need. SGLang's loader has applied every plugin's hooks by then; a target that
another plugin hooked already is wrapped once more, with ours alone.

A hook that does not take stops the process (PluginHookError): SGLang logs and skips a plugin or
a hook that fails, and a server silently without its flag or switch is worse than one that stops.
"""

from __future__ import annotations

import logging
import pkgutil
from collections.abc import Callable, Iterable
from typing import Any

from sglang_image_plugin.setting import THRESHOLD_FLAG
from sglang_image_plugin.targets import HookSpec

logger = logging.getLogger(__name__)


class PluginHookError(SystemExit):
    """A hook did not take. SystemExit, not Exception: SGLang's plugin loader catches Exception
    and carries on without the plugin."""


# Set by register(): checks once per process, from the first hook that runs, that every start-up
# hook is in place (the loader applies them only after all plugins have registered).
_check: Callable[[], None] | None = None


def set_check(check: Callable[[], None]) -> None:
    global _check
    _check = check


def check_once() -> None:
    """Called by every hook that can run first in a process (the CLI hook in the launcher, the
    worker hook in the scheduler): the set check, the first time only."""
    global _check
    check, _check = _check, None
    if check is not None:
        check()


def function(spec: HookSpec) -> Callable[..., Any]:
    """The function a spec installs (its dotted name, resolved)."""
    found: Callable[..., Any] = pkgutil.resolve_name(spec.function)
    return found


def _chain(obj: Any) -> list[Any]:
    """The function at a hook target and every function it wraps (__wrapped__)."""
    found: list[Any] = []
    fn = getattr(obj, "__func__", obj)  # classmethod / staticmethod
    while fn is not None and len(found) < 64:
        found.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return found


def wraps_hook(obj: Any, hook: Callable[..., Any]) -> bool:
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


def not_taken(specs: Iterable[HookSpec]) -> list[str]:
    """Each of these hooks that is not in place, with the reason."""
    problems = []
    for spec in specs:
        try:
            attribute = _raw_attribute(spec.target)
        except (ImportError, AttributeError, ValueError) as e:
            problems.append(f"{spec.target}: cannot be resolved ({type(e).__name__}: {e})")
            continue
        if not wraps_hook(attribute, function(spec)):
            problems.append(f"{spec.target}: the {spec.hook_type} hook is not applied")
    return problems


def ensure_applied(specs: tuple[HookSpec, ...], what: str) -> None:
    """Stop the process if one of these hooks is not in place."""
    problems = not_taken(specs)
    if problems:
        message = (
            "sglang-image-plugin: hooks did not take, so dynamic speculation disable "
            f"({THRESHOLD_FLAG}) cannot work; this sglang release "
            "needs a plugin update (run `nox -s plugin-check` on its wheel):\n  "
            + "\n  ".join(problems)
        )
        logger.critical(message)
        raise PluginHookError(message)
    logger.info("sglang-image-plugin: %d %s hooks applied", len(specs), what)


def register(specs: Iterable[HookSpec]) -> None:
    """Register hooks for SGLang's loader to apply (at plugin load)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for spec in specs:
        HookRegistry.register(spec.target, function(spec), HookType(spec.hook_type))


def install(specs: tuple[HookSpec, ...], what: str) -> None:
    """Register and apply hooks now (after SGLang's loader ran), then check them. A target that
    is in place already (ours from an earlier install, or another plugin's) is wrapped with this
    hook alone; one already wrapped by this very hook is left as it is."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for spec in specs:
        hook = function(spec)
        try:
            if wraps_hook(_raw_attribute(spec.target), hook):
                continue
        except (ImportError, AttributeError, ValueError):
            pass  # not resolvable: the check below names it
        entry = (HookType(spec.hook_type), hook, None)
        HookRegistry._hooks[spec.target].append(entry)
        try:
            HookRegistry._apply_target(spec.target, [entry])
            HookRegistry._patched.add(spec.target)
        except Exception:  # the check below names the target
            logger.exception("sglang-image-plugin: applying the hook on %s failed", spec.target)
    ensure_applied(specs, what)
