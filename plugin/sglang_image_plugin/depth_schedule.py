"""A draft depth per load: the controller that walks a depth schedule one decode batch at a time.

The schedule's flag, grammar, parser and validation are setting.py's (`1-16:3,17-48:2,49-96:1,97-:0`
drafts 3 steps while at most 16 requests run, 2 up to 48, 1 up to 96 and none above). Every edge
has hysteresis H (default edge // 8, as the threshold's): the draft gets shallower as soon as the
batch passes an edge, and deeper again only once it is H below it, so one arrival or finish does
not flip the depth. A server gone idle (note_idle) has no batch for the hysteresis to protect: the
first batch after it walks from the deepest tier, as at start. Pure logic (standard library only):
tested on any machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sglang_image_plugin.setting import DepthSchedule, default_hysteresis


class DepthController:
    """Walks the schedule one decode batch at a time: shallower at once when the batch passes the
    current tier's top, deeper only once it is the edge's hysteresis below the tier above's top.
    Counts the steps of each depth and the changes; `on_change(old, new, batch_size)` per change."""

    def __init__(self, schedule: DepthSchedule, hysteresis: Sequence[int] | None = None,
                 on_change: Callable[[int, int, int], None] | None = None) -> None:
        edges = [t.high for t in schedule.tiers[:-1]]
        self.schedule = schedule
        # per edge below each tier but the last: how far under it the batch must fall to go deeper
        self.hysteresis = [default_hysteresis(e) for e in edges if e is not None] if hysteresis is None \
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
        self._after_idle = False  # the next batch is the first since the server went idle

    @property
    def depth(self) -> int:
        return self.schedule.tiers[self.tier].depth

    def resume_below(self, tier: int) -> int:
        """The batch size at or under which tier `tier - 1` (deeper) takes over from `tier`."""
        edge = self.schedule.tiers[tier - 1].high
        assert edge is not None
        return edge - self.hysteresis[tier - 1]

    def note_idle(self) -> None:
        """The server ran nothing (no request left): the next batch walks from the start."""
        self._after_idle = True

    def next_tier(self, batch_size: int) -> int:
        """The transition alone (no side effects)."""
        tiers, i = self.schedule.tiers, 0 if self._after_idle else self.tier
        while (high := tiers[i].high) is not None and batch_size > high:
            i += 1
        while i > 0 and batch_size <= self.resume_below(i):
            i -= 1
        return i

    def step(self, batch_size: int) -> int:
        """Account one decode step of this many requests; its depth."""
        new = self.next_tier(batch_size)
        self._after_idle = False
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
