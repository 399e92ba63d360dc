"""The switching of a smoke's EAGLE-3 server as tiers of running batch sizes, and the loads that
the smoke run and the feature matrix derive from the tiers' edges.

A depth schedule (`--schedule 1-8:3,9-24:2,25-64:1,65-:0`, the servers'
--speculative-depth-schedule) drafts one depth per tier; a fixed threshold N is the two-tier
schedule 1-N:K,N+1-:0. Every edge has hysteresis (edge // 8): the server leaves a tier as soon as
the batch passes its top, and comes back only once the batch is that far below it. What a load
must make the server do is computed with that walk: Tiers.walk runs the plugin's own
depth_schedule.DepthController (standard library only, like the contract), so the smoke predicts
exactly what the server decides.

Pure: no server, no GPU; the standard library, the plugin's contract and its schedule walk only.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sglang_image_plugin.depth_schedule import DepthController
from sglang_image_plugin.setting import (
    DEPTH_SCHEDULE_EXAMPLE,
    DepthSchedule,
    Mode,
    ScheduleError,
    default_hysteresis,
    parse_schedule,
    schedule_from_threshold,
)
from smoke.server import EAGLE_STEPS

SCHEDULE_FLAG = "--schedule"
# Beyond the top edge E: the smoke sends 8E requests at once ("above", as 8N for a threshold) and
# bursts of 4E in its ramp; the feature matrix's filler holds the last tier with 4E requests.
ABOVE_FACTOR = 8
BURST_FACTOR = 4


def parse_smoke_schedule(text: str, flag: str = SCHEDULE_FLAG) -> DepthSchedule:
    """The contract's parser (setting.parse_schedule), then what the smoke's servers can run: a
    tier that drafts, at least one edge (they launch at the deepest tier, smoke.server.launch_steps).
    A ScheduleError names `flag`."""
    schedule = parse_schedule(text, source=flag)
    if schedule.deepest < 1:
        raise ScheduleError(f"{flag}: {schedule} never drafts; its first tier must draft")
    if len(schedule.tiers) < 2:
        raise ScheduleError(f"{flag}: {schedule} is one tier, so nothing switches; give two or "
                            f"more, e.g. {DEPTH_SCHEDULE_EXAMPLE}")
    return schedule


@dataclass(frozen=True)
class LoadMode:
    """A load that a feature-matrix case runs under (smoke.loads): the batch held in one tier
    ("in"), or moved across an edge while the case's requests run ("up", "down"). `start` and
    `end`: where the server is as the case starts and where the crossing takes it, a threshold
    server's mode ("speculative", "plain") or a schedule server's depth. The filler: `base`
    requests hold the batch where the case starts (0: the case alone), `extra` more arrive (up)
    or leave (down) mid-case. None: every filler prompt (a threshold's 4N), for `extra` all of
    them after `base`."""
    name: str
    kind: str
    start: str | int
    end: str | int | None = None
    base: int | None = 0
    extra: int | None = None


SPECULATIVE, PLAIN = str(Mode.SPECULATIVE), str(Mode.PLAIN)
# the threshold server's modes, by the names the cases give them (smoke.cases.MODES)
THRESHOLD_MODES = {m.name: m for m in (
    LoadMode("below", "in", SPECULATIVE),
    LoadMode("above", "in", PLAIN, base=None),
    LoadMode("cross_up", "up", SPECULATIVE, PLAIN),
    LoadMode("cross_down", "down", PLAIN, SPECULATIVE),
)}


@dataclass(frozen=True)
class MatrixPlan:
    """The feature matrix's loads on a schedule server: each mode a case names ("below", "above",
    "cross_up", "cross_down", a threshold server's) becomes one per tier or edge: below in the
    first tier, above in every other one, and across every edge, up and down."""
    concurrency: int  # a case's requests at once, at most: each tier holds them beside its filler
    modes: dict[str, tuple[LoadMode, ...]]

    def expand(self, names: Sequence[str | LoadMode]) -> tuple[LoadMode, ...]:
        return tuple(m for name in names
                     for m in ((name,) if isinstance(name, LoadMode) else self.modes[name]))


@dataclass(frozen=True)
class Tiers:
    schedule: DepthSchedule

    @classmethod
    def of_threshold(cls, threshold: int, steps: int = EAGLE_STEPS) -> Tiers:
        """A fixed threshold N: the schedule 1-N:K,N+1-:0."""
        return cls(schedule_from_threshold(threshold, steps))

    @property
    def count(self) -> int:
        return len(self.schedule.tiers)

    @property
    def depths(self) -> list[int]:
        """Each tier's depth, in tier order (the deepest first)."""
        return [t.depth for t in self.schedule.tiers]

    @property
    def edges(self) -> list[int]:
        """The top of every tier but the last."""
        return [t.high for t in self.schedule.tiers if t.high is not None]

    @property
    def top(self) -> int:
        return self.edges[-1]

    def hysteresis(self, edge: int) -> int:
        """Of the edge-th edge (0: the first tier's top): the setting's default, edge // 8."""
        return default_hysteresis(self.edges[edge])

    def resume(self, tier: int) -> int:
        """The batch size at or under which tier `tier - 1` takes over again from `tier`."""
        return DepthController(self.schedule).resume_below(tier)

    def depth_at(self, batch_size: int) -> int:
        """The depth a load of this many requests runs at, coming from a deeper tier."""
        return self.schedule.depth_at(batch_size)

    def walk(self, batch_sizes: Iterable[int], tier: int = 0) -> list[int]:
        """The depth of each decode step of these batch sizes, the server starting in `tier` (the
        first at its start): shallower at once where the batch passes the tier's top, deeper only
        once it is at or under where the tier below takes over again."""
        walker = DepthController(self.schedule)  # the plugin's own walk, without its counters' use
        walker.tier = tier
        depths = []
        for b in batch_sizes:
            walker.tier = walker.next_tier(b)
            depths.append(walker.depth)
        return depths

    def arrival(self, tier: int) -> tuple[int, int | None]:
        """The batch sizes that bring the server into `tier` from whichever tier it is in: above
        the edge below (it goes shallower at once), at most where the tier above hands back to
        it (it goes deeper only that far below the edge); None: no top."""
        low = self.schedule.tiers[tier].low
        return low, None if tier == self.count - 1 else self.resume(tier + 1)

    def probe(self, tier: int) -> int:
        """A batch size that holds `tier` whichever tier the server was in: the middle of its
        arrival window (a tier narrower than its edge's hysteresis: its lowest size, reached from
        below only); the last tier's: twice the top edge."""
        low, high = self.arrival(tier)
        if high is None:
            return 2 * self.top
        return low if high < low else (low + high) // 2

    # -- the smoke run's loads --------------------------------------------------------------------
    def edge_loads(self) -> list[tuple[str, int]]:
        """(name, requests sent at once) at every edge e with hysteresis h: e - h (where a server
        above the edge comes back), e (the tier's top) and e + 1 (the next tier's lowest); a
        size sent before (1: the smoke's "below") is not sent again."""
        loads: list[tuple[str, int]] = []
        seen = {1}
        for i, edge in enumerate(self.edges):
            for where, size in (("below", edge - self.hysteresis(i)), ("at", edge), ("above", edge + 1)):
                if size not in seen:
                    loads.append((f"edge{edge}_{where}", size))
                    seen.add(size)
        return loads

    @property
    def above(self) -> int:
        return ABOVE_FACTOR * self.top

    def ramp_bursts(self) -> list[int]:
        """The ramp's bursts, beside long requests: every tier above the first in turn, up to
        BURST_FACTOR x the top edge and back down, each held whatever the one before left."""
        middle = [self.probe(i) for i in range(1, self.count - 1)]
        return [*middle, BURST_FACTOR * self.top, *middle[::-1]]

    def endurance_levels(self) -> list[int]:
        """One cycle of the endurance ramp's levels (clients at once): every tier's probe, up and
        back down."""
        probes = [self.probe(i) for i in range(self.count)]
        return probes + probes[-2:0:-1]

    def changes_bound(self, waves: int) -> int:
        """The most depth changes `waves` loads may cause, each rising once and draining once: a
        batch that only grows, then only shrinks, crosses each edge at most once each way;
        doubled for a batch that steps back on its way (a retraction)."""
        return 2 * 2 * len(self.edges) * waves

    # -- the feature matrix's loads ----------------------------------------------------------------
    def matrix_plan(self, most: int) -> MatrixPlan:
        """The matrix's load modes, its cases sending at most `most` requests at once. Each tier
        between the first and the last holds a filler and a case's requests beside it within its
        arrival window, so it is entered from either side; ScheduleError where one is too
        narrow for that."""
        windows: list[tuple[int, int]] = []
        for i in range(1, self.count - 1):
            low, high = self.arrival(i)
            assert high is not None
            if high - low < 1:
                raise ScheduleError(
                    f"{SCHEDULE_FLAG}: tier {self.schedule.tiers[i]} is too narrow for the feature "
                    f"matrix: a filler and a case's request must hold the batch between {low} and "
                    f"{high} (the hysteresis of its top edge is {self.hysteresis(i)}); widen it")
            windows.append((low, high))
        concurrency = min([most, self.resume(1), *(high - low for low, high in windows)])
        fill = [0, *(low + (high - concurrency - low) // 2 for low, high in windows),
                BURST_FACTOR * self.top]
        d = self.depths
        ins = [LoadMode(f"depth{d[i]}", "in", d[i], base=fill[i]) for i in range(self.count)]
        ups = [LoadMode(f"up{e}", "up", d[i], d[i + 1], base=fill[i], extra=fill[i + 1] - fill[i])
               for i, e in enumerate(self.edges)]
        downs = [LoadMode(f"down{e}", "down", d[i + 1], d[i], base=fill[i],
                          extra=fill[i + 1] - fill[i]) for i, e in enumerate(self.edges)]
        return MatrixPlan(concurrency, {"below": (ins[0],), "above": tuple(ins[1:]),
                                        "cross_up": tuple(ups), "cross_down": tuple(downs)})
