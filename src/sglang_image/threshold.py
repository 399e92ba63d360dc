"""The threshold of the EAGLE-3 servers the project starts (`nox -s smoke`) and deploys (`nox -s
deploy`, `nox -s publish`), on the build side: a bad value as a UsageError, and the flavor check.

The values, `auto` and their parser are the plugin's contract for the speculation setting
(sglang_image_plugin.setting, imported by name): a whole number N >= 1 of running requests, or
`auto`, accepted alike by the server, the smoke, the benchmark and the build. The smoke's default N
is the smoke's own (smoke/scenario.py's DEFAULT_THRESHOLD: the build passes a threshold only when
given), the deployments' is deploy/serve.toml's.
"""
from __future__ import annotations

from sglang_image.errors import UsageError
from sglang_image.pins import Flavor, flavor_names, load_flavor
from sglang_image_plugin.setting import AUTO, Threshold, ThresholdError, parse_threshold


def parse(raw: object, source: str = "--threshold") -> Threshold:
    """`auto` or a whole number >= 1 from a command line or a settings file (TOML gives an int),
    else a UsageError naming `source`, the value and the fix."""
    text = str(raw).strip() if isinstance(raw, (int, str)) and not isinstance(raw, bool) else repr(raw)
    try:
        return parse_threshold(text, source=source, allow_zero=False)
    except ThresholdError as exc:
        raise UsageError(str(exc)) from None


def plugin_flavors() -> str:
    """The flavors whose image carries the plugin, for an error that names them ("none" if none)."""
    return ", ".join(n for n in flavor_names() if load_flavor(n).plugin) or "none"


def check_flavor(threshold: Threshold, flavor: Flavor) -> None:
    """`auto` only where the flavor's image carries the plugin that implements it."""
    if threshold == AUTO and not flavor.plugin:
        having = plugin_flavors()
        raise UsageError(f"--threshold auto: the {flavor.name} image has no automatic threshold "
                         f"(flavors that have it: {having}); give a number of requests instead")
