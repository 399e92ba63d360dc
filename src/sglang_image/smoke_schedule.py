"""The depth schedule of `nox -s smoke -- --schedule S`, on the build side: the image's EAGLE-3
servers draft a depth per load (the plugin's --speculative-depth-schedule) instead of switching at
a threshold, and the smoke and the feature matrix inside the image run with `--schedule S`.

Checked before any container starts, with the rules of the smoke inside the image: the grammar is
the plugin's contract (sglang_image_plugin.setting.parse_schedule); then what the smoke's servers
can run (smoke/tiers.py parse_smoke_schedule): a tier that drafts, at least one edge. A tier deeper
than the smoke's launch depth launches its servers that deep (smoke/server.py launch_steps).
`auto` is refused, as the smoke refuses it: the smoke derives its loads from the edges of a fixed
schedule. Only a flavor with the plugin has the schedule.
"""
from __future__ import annotations

from sglang_image.errors import UsageError
from sglang_image.pins import Flavor
from sglang_image.threshold import plugin_flavors
from sglang_image_plugin.setting import (
    AUTO,
    DEPTH_SCHEDULE_FLAG,
    DepthSchedule,
    ScheduleError,
    parse_schedule,
)

OPTION = "--schedule"
# The draft steps the smoke's servers launch with (smoke/server.py EAGLE_STEPS), unless a schedule's
# tier drafts deeper. The build may not import the smoke (tests/test_layout.py); a test holds the
# two equal, and these rules to parse_smoke_schedule's.
SMOKE_STEPS = 3
# A schedule that the smoke and its feature matrix both run (the matrix takes a top edge up to 256):
# small, so that the smoke's loads (8x the top edge at once) stay short on its tiny models.
EXAMPLE = "1-8:3,9-24:2,25-64:1,65-:0"


def parse(raw: str) -> DepthSchedule:
    """A schedule the smoke can run, from the command line; else a UsageError naming --schedule,
    the value and the fix."""
    text = str(raw).strip()
    if text.lower() == AUTO:
        raise UsageError(f"{OPTION} auto: the smoke runs a fixed schedule (its loads come from the "
                         f"schedule's edges); give tiers, e.g. {OPTION} {EXAMPLE}, or --threshold "
                         "auto for a server that finds its own threshold")
    try:
        schedule = parse_schedule(text, source=OPTION)
    except ScheduleError as exc:
        raise UsageError(str(exc)) from None
    check(schedule)
    return schedule


def check(schedule: DepthSchedule) -> None:
    """What the smoke's servers can run of a parsed schedule (smoke/tiers.py parse_smoke_schedule
    refuses the same inside the image)."""
    if schedule.deepest < 1:
        raise UsageError(f"{OPTION} {schedule}: never drafts; its first tier must draft, e.g. "
                         f"{OPTION} {EXAMPLE}")
    if len(schedule.tiers) < 2:
        raise UsageError(f"{OPTION} {schedule}: one tier, so nothing switches; give two or more, "
                         f"e.g. {OPTION} {EXAMPLE}")


def check_flavor(schedule: DepthSchedule, flavor: Flavor) -> None:
    """Only an image with the plugin has the depth schedule (the other flavors' patch series carry
    the threshold alone)."""
    if not flavor.plugin:
        raise UsageError(f"{OPTION} {schedule}: the {flavor.name} image has no depth schedule "
                         f"({DEPTH_SCHEDULE_FLAG} comes with the plugin; flavors that have it: "
                         f"{plugin_flavors()}); smoke this image with --threshold N instead, or an "
                         "image of a flavor with the plugin with --schedule")
