"""A draft depth per load: the schedule's grammar, its validation and the controller that walks it.

`--speculative-depth-schedule 1-16:3,17-48:2,49-96:1,97-:0` drafts 3 steps while at most 16
requests run, 2 up to 48, 1 up to 96 and none above (a plain step). Tiers cover every batch size
from 1 up, in order, without gaps; the last is open (`N-`); a larger batch never gets a deeper
draft (a draft step costs more, and pays less, the larger the batch). A fixed threshold N is
the same as `1-N:K,N+1-:0` (K: --speculative-num-steps).

Every edge has hysteresis H (default edge // 8, as the threshold's): the draft gets shallower as
soon as the batch passes an edge, and deeper again only once it is H below it, so one arrival or
finish does not flip the depth. Pure logic (standard library only): tested on any machine.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEPTH_SCHEDULE_FLAG = "--speculative-depth-schedule"
DEPTH_SCHEDULE_ENV = "SGLANG_SPEC_DEPTH_SCHEDULE"
DEPTH_SCHEDULE_DEST = "speculative_depth_schedule"
EXAMPLE = "1-16:3,17-48:2,49-96:1,97-:0"

_TIER = re.compile(r"(\d+)-(\d*):(\d+)")


class ScheduleError(ValueError):
    """A schedule that does not parse, leaves a gap, or drafts deeper at a larger batch."""


def edge_hysteresis(edge: int) -> int:
    """The default hysteresis at an edge N (the last batch size of a deeper tier): N // 8, at least
    1 when N > 1, always < N (as spec_disable.default_hysteresis)."""
    if edge <= 1:
        return 0
    return min(max(1, edge // 8), edge - 1)


@dataclass(frozen=True)
class Tier:
    """Batch sizes low..high (None: no upper end) draft `depth` steps."""

    low: int
    high: int | None
    depth: int

    def __str__(self) -> str:
        return f"{self.low}-{'' if self.high is None else self.high}:{self.depth}"


@dataclass(frozen=True)
class DepthSchedule:
    """Tiers in batch-size order; adjacent tiers of one depth are one tier."""

    tiers: tuple[Tier, ...]

    def __str__(self) -> str:
        return ",".join(map(str, self.tiers))

    @property
    def depths(self) -> list[int]:
        """Every depth the schedule runs, deepest first."""
        return sorted({t.depth for t in self.tiers}, reverse=True)

    @property
    def deepest(self) -> int:
        return self.tiers[0].depth

    def depth_at(self, batch_size: int) -> int:
        """The depth of the tier holding this batch size (no hysteresis)."""
        return self.tiers[self.tier_of(batch_size)].depth

    def tier_of(self, batch_size: int) -> int:
        for i, tier in enumerate(self.tiers):
            if tier.high is None or batch_size <= tier.high:
                return i
        raise AssertionError("the last tier is open")  # parse() guarantees it


def parse(text: str, *, source: str = DEPTH_SCHEDULE_FLAG) -> DepthSchedule:
    """`LOW-HIGH:DEPTH,...,LOW-:DEPTH` into a schedule; a ScheduleError names `source` and the fix."""
    raw = text.strip()
    if not raw:
        raise ScheduleError(f"{source}: empty; give tiers like {EXAMPLE}")
    tiers: list[Tier] = []
    for part in raw.split(","):
        m = _TIER.fullmatch(part.strip())
        if m is None:
            raise ScheduleError(
                f"{source}: {part.strip()!r} is not a tier; write LOW-HIGH:DEPTH (the last one "
                f"LOW-:DEPTH, open), e.g. {EXAMPLE}")
        low, high, depth = int(m[1]), int(m[2]) if m[2] else None, int(m[3])
        tiers.append(Tier(low, high, depth))
    return validated(tiers, source=source)


def validated(tiers: Sequence[Tier], *, source: str = DEPTH_SCHEDULE_FLAG) -> DepthSchedule:
    """The tiers as a schedule, refused where they leave a gap, overlap, do not start at 1, do not
    end open, or draft deeper at a larger batch; adjacent tiers of one depth merged."""
    expected = 1
    for i, tier in enumerate(tiers):
        last = i == len(tiers) - 1
        if tier.low != expected:
            where = "the first tier must start at 1" if i == 0 else f"tier {tier} must start at {expected}"
            raise ScheduleError(f"{source}: {where} (tiers cover every batch size, in order), e.g. {EXAMPLE}")
        if tier.high is None and not last:
            raise ScheduleError(f"{source}: only the last tier may be open ({tier}), e.g. {EXAMPLE}")
        if tier.high is not None and last:
            raise ScheduleError(
                f"{source}: the last tier must be open, {tier.low}-:{tier.depth} (every larger batch "
                f"gets a depth), e.g. {EXAMPLE}")
        if tier.high is not None and tier.high < tier.low:
            raise ScheduleError(f"{source}: tier {tier} ends before it starts")
        if i and tier.depth > tiers[i - 1].depth:
            raise ScheduleError(
                f"{source}: tier {tier} drafts deeper than tier {tiers[i - 1]} below it; a larger batch "
                "never gets a deeper draft (it costs more and pays less there)")
        expected = (tier.high or 0) + 1
    merged: list[Tier] = []
    for tier in tiers:
        if merged and merged[-1].depth == tier.depth:
            merged[-1] = Tier(merged[-1].low, tier.high, tier.depth)
        else:
            merged.append(tier)
    return DepthSchedule(tuple(merged))


def from_threshold(threshold: int, steps: int) -> DepthSchedule:
    """A fixed threshold N as a schedule: K steps up to N, none above."""
    return validated([Tier(1, threshold, steps), Tier(threshold + 1, None, 0)])


def check_against_steps(schedule: DepthSchedule, steps: int, *, source: str = DEPTH_SCHEDULE_FLAG) -> None:
    """Refuse a depth the server was not launched for: the KV reserve and the graphs' widths are
    sized once, for --speculative-num-steps K."""
    if schedule.deepest > steps:
        raise ScheduleError(
            f"{source}: depth {schedule.deepest} is deeper than --speculative-num-steps {steps}; "
            f"launch with --speculative-num-steps {schedule.deepest} "
            f"--speculative-num-draft-tokens {schedule.deepest + 1}, or draft at most {steps}")
    if schedule.deepest < 1:
        raise ScheduleError(f"{source}: no tier drafts; drop the schedule to serve without speculation")


class DepthController:
    """Walks the schedule one decode batch at a time: shallower at once when the batch passes the
    current tier's top, deeper only once it is the edge's hysteresis below the tier above's top.
    Counts the steps of each depth and the changes; `on_change(old, new, batch_size)` per change."""

    def __init__(self, schedule: DepthSchedule, hysteresis: Sequence[int] | None = None,
                 on_change: Callable[[int, int, int], None] | None = None) -> None:
        edges = [t.high for t in schedule.tiers[:-1]]
        self.schedule = schedule
        # per edge below each tier but the last: how far under it the batch must fall to go deeper
        self.hysteresis = [edge_hysteresis(e) for e in edges if e is not None] if hysteresis is None \
            else list(hysteresis)
        if len(self.hysteresis) != len(edges):
            raise ValueError(f"{len(edges)} edge(s) need as many hysteresis values, got {self.hysteresis}")
        for edge, h in zip(edges, self.hysteresis, strict=True):
            assert edge is not None
            if not 0 <= h < edge:
                raise ValueError(f"hysteresis {h} at edge {edge}: need 0 <= H < {edge}")
        self.tier = 0
        self.steps = {d: 0 for d in schedule.depths}
        self.changes = 0
        self._on_change = on_change

    @property
    def depth(self) -> int:
        return self.schedule.tiers[self.tier].depth

    def resume_below(self, tier: int) -> int:
        """The batch size at or under which tier `tier - 1` (deeper) takes over from `tier`."""
        edge = self.schedule.tiers[tier - 1].high
        assert edge is not None
        return edge - self.hysteresis[tier - 1]

    def next_tier(self, batch_size: int) -> int:
        """The transition alone (no side effects)."""
        tiers, i = self.schedule.tiers, self.tier
        while (high := tiers[i].high) is not None and batch_size > high:
            i += 1
        while i > 0 and batch_size <= self.resume_below(i):
            i -= 1
        return i

    def step(self, batch_size: int) -> int:
        """Account one decode step of this many requests; its depth."""
        new = self.next_tier(batch_size)
        if new != self.tier:
            old_depth = self.depth
            self.tier = new
            self.changes += 1
            if self._on_change is not None:
                self._on_change(old_depth, self.depth, batch_size)
        self.steps[self.depth] += 1
        return self.depth

    def run_range(self, depth: int) -> tuple[int, int | None]:
        """The batch sizes at which `depth` can run, hysteresis included: from just above where the
        tier above takes over to the top of its own tier (None: no top)."""
        tiers = self.schedule.tiers
        i = next(k for k, t in enumerate(tiers) if t.depth == depth)
        return (1 if i == 0 else self.resume_below(i) + 1), tiers[i].high

    def graph_sizes(self, depth: int, captured: Sequence[int]) -> list[int]:
        """The captured batch sizes a depth can run at (a batch pads up to the next captured size):
        the first one at or above its lowest batch up to the first at or above its top."""
        low, high = self.run_range(depth)
        sizes = sorted(captured)
        return [v for i, v in enumerate(sizes)
                if v >= low and (high is None or i == 0 or sizes[i - 1] < high)]
