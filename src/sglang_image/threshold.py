"""The threshold of the EAGLE-3 servers the project starts (`nox -s smoke`) and deploys (`nox -s
deploy`, `nox -s publish`), on the build side: its one parser, `auto`, and the flavor check.

The values are the plugin's (spec_disable.py parses them once for the server, the smoke, the
benchmark and this module): a whole number N >= 1 of running requests, or `auto`. A bad value is
a UsageError naming it and the fix, raised here and nowhere else. The smoke's default N is the
smoke's own (smoke/runner.py's DEFAULT_THRESHOLD: the build passes a threshold only when given),
the deployments' is deploy/serve.toml's.
"""
from __future__ import annotations

from typing import Literal

from sglang_image.errors import UsageError
from sglang_image.pins import Flavor, flavor_names, load_flavor
from sglang_image.plugin_source import spec_disable

Threshold = int | Literal["auto"]  # the one shape of a parsed threshold

FLAG: str = spec_disable().THRESHOLD_FLAG  # the server's flag
AUTO: Literal["auto"] = spec_disable().AUTO  # the server finds the crossover: plugin flavors only


def parse(raw: object, source: str = "--threshold") -> Threshold:
    """`auto` or a whole number >= 1 from a command line or a settings file (TOML gives an int),
    else a UsageError naming `source`, the value and the fix."""
    text = str(raw).strip() if isinstance(raw, (int, str)) and not isinstance(raw, bool) else repr(raw)
    try:
        value: Threshold = spec_disable().parse_threshold(text, source=source, allow_zero=False)
    except ValueError as exc:  # the plugin's ThresholdError
        raise UsageError(str(exc)) from None
    return value


def check_flavor(threshold: Threshold, flavor: Flavor) -> None:
    """`auto` only where the flavor's image carries the plugin that implements it."""
    if threshold == AUTO and not flavor.plugin:
        having = ", ".join(n for n in flavor_names() if load_flavor(n).plugin) or "none"
        raise UsageError(f"--threshold auto: the {flavor.name} image has no automatic threshold "
                         f"(flavors that have it: {having}); give a number of requests instead")
