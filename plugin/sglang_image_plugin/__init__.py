"""sglang-image's changes to SGLang as a plugin (entry point group `sglang.srt.plugins`).

SGLang calls `register` in every process it starts (launcher, scheduler,
detokenizer, DP controller). It refuses an sglang release the plugin was not checked
against and registers the start-up hooks of targets.HOOKS; SGLang's loader applies them
once every plugin has registered (another plugin's hooks on the same targets are applied
with ours). The first hook that runs in a process (the CLI hook in the launcher, the
worker hook in the scheduler) checks that every one took: SGLang logs and skips a
plugin or hook that fails, and a server silently without its flag or switch is worse
than one that stops. A threshold server's worker installs the per-step hooks its plain
step needs (plain_step.py, registry.install) and checks those the same way.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from importlib import resources

from sglang_image_plugin import registry
from sglang_image_plugin.registry import PluginHookError
from sglang_image_plugin.targets import DIGESTS_FILE, START, hooks_of

logger = logging.getLogger(__name__)
__all__ = ["PluginHookError", "check_sglang_version", "checked_sglang_versions",
           "ensure_hooks_applied", "hooks_not_taken", "register"]


def hooks_not_taken() -> list[str]:
    """Each of our start-up hooks that is not in place, with the reason."""
    return registry.not_taken(hooks_of(START))


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
    """Stop the process if a start-up hook is not in place (called by the first hook that runs)."""
    registry.ensure_applied(hooks_of(START), "start-up")


def register() -> None:
    """Entry point: check the sglang release and register the start-up hooks (SGLang's loader
    applies them after all plugins ran; the worker installs the rest for its plain step)."""
    check_sglang_version()
    registry.register(hooks_of(START))
    registry.set_check(ensure_hooks_applied)
