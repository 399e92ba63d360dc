"""The depth schedule's `auto`: the server learns a draft depth per load.

Pure Python (no torch, no sglang), tested alone on a CPU. Per decode step a policy
(auto_depth_policy.py) calls

    depth = controller.decide(batch_size)                               # before the step
    controller.record(depth, batch_size, step_seconds)                  # its time, if timed
    controller.record_accepted(depth, num_correct_drafts_per_req)       # a drafting step's result

What it estimates, per batch-size bucket (the threshold's `auto`'s, AutoConfig.edges: powers of
two up to 32, then four per octave up to the max running requests) and per depth d in 0..K (K:
--speculative-num-steps; 0: the plain step): the tokens per second of step time at the batch size
the bucket's traffic runs at,

    tok/s(bucket, d) = batch * tokens(d) / seconds(bucket, d)

seconds: the median of the bucket's recent steps at that depth (auto_estimate.StepTimes, at least
`min_samples` of them; interpolated across buckets to the traffic's batch size as the threshold's
`auto` does); tokens(d): 1 + E[min(A, d)] from the one set of accept histograms
(auto_accept.py: a step at depth d informs P(A >= j) for every j <= d). A depth not timed in a bucket has a
prior there: its step time linear in depth between the two nearest timed depths (beyond them, the
slope of the nearest two, never falling with depth, and never under half the nearest one's time),
taken as uncertain by PRIOR_NOISE: a prior orders exploration and fills the table; a move to a
depth on its prior alone must beat that noise.

The schedule: per bucket the depth with the most tok/s, under one constraint, a larger batch never
drafts deeper. Every `update_every` steps a dynamic programme over the buckets (monotone_best)
finds the monotone schedule that gains the most over the current one, each bucket's gain weighted
by its recent traffic (its decode steps, forgetting at TRAFFIC_MEMORY per update). Hysteresis on
the estimate, as the threshold's `auto`: a bucket's gain at another depth counts only beyond
`margin` plus twice the noise of the difference, a loss counts in full, so where the per-bucket
best depths are not monotone the programme takes the resolution that loses least, and a bucket not
yet measured, or a depth without a figure, never looks better than what is known. The running
batch walks the schedule like a fixed one (depth_schedule.DepthController: hysteresis edge // 8 at
each edge); at a new schedule it takes its side at once.

Exploration: at most one burst of `explore_steps` steps every `explore_gap` steps, at the depth the
last update chose for the bucket the batch is in: first a depth never timed there (cold start: the
plain step first, then K, then by prior tok/s), then a depth not timed for `stale_steps` whose
estimate is within CONTENTION of the learned depth's, then one whose difference to it is still
within its noise. The policy leaves out the first step after any change of depth (its interval
times the step before); cold start drafts K everywhere, as always-on EAGLE-3 does.

Step times differ between tensor-parallel ranks: a TP hook passes `agree` (a broadcast of rank
0's DepthDecision), through which alone the estimate reaches the decisions.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sglang_image_plugin.auto_accept import AcceptHistograms
from sglang_image_plugin.auto_config import AutoConfig
from sglang_image_plugin.auto_estimate import Bucket, seconds_at
from sglang_image_plugin.depth_schedule import DepthController
from sglang_image_plugin.setting import AUTO, DepthSchedule, Tier, validated_schedule

PRIOR_NOISE = 0.1  # the relative error taken for a step time interpolated in depth
CONTENTION = 0.1  # a stale depth this close (tok/s share) to the learned one is timed again
TRAFFIC_MEMORY = 0.97  # per update, the weight a bucket's traffic keeps (~1000 steps)
NONE = -1  # DepthDecision.explore: nothing to explore in that bucket
_KEEP = 1e-9  # the programme's preference for the depths nearest a bucket's current one


@dataclass(frozen=True)
class DepthDecision:
    """What the estimate decides at an update, all a rank needs to act as the others do."""

    depths: tuple[int, ...]  # per bucket: the learned depth (non-increasing)
    explore: tuple[int, ...]  # per bucket: the depth to time there next (NONE: none)


@dataclass(frozen=True)
class Cell:
    """One bucket at one depth: log tok/s, its variance, whether timed (else a prior)."""

    value: float
    variance: float
    timed: bool


@dataclass(frozen=True)
class Move:
    """One move of the learned schedule, with what it was made on (the log line, the trace)."""

    before: str
    after: str
    buckets: tuple[tuple[int, int, int, int], ...]  # (low, high, depth before, depth after)
    tok_s: tuple[dict[int, float], ...]  # per moved bucket: tok/s per depth with a figure there
    gain: float  # traffic-weighted log tok/s gained, by the estimate
    noise: float

    def text(self) -> str:
        parts = []
        for (low, high, before, after), tok_s in zip(self.buckets, self.tok_s, strict=True):
            figures = ", ".join(f"d{d} {v:.0f}" for d, v in sorted(tok_s.items(), reverse=True))
            parts.append(f"{low}-{high}: {before} -> {after} ({figures or 'no figures'} tok/s)")
        return f"{'; '.join(parts)}; gain {100 * self.gain:.1f}% +- {100 * self.noise:.1f}%"

    def record(self) -> dict[str, object]:
        return {"kind": "move", "before": self.before, "after": self.after,
                "buckets": [{"low": low, "high": high, "before": b, "after": a,
                             "tok_s": {str(d): round(v, 1) for d, v in t.items()}}
                            for (low, high, b, a), t in zip(self.buckets, self.tok_s, strict=True)],
                "gain": round(self.gain, 5), "noise": round(self.noise, 5)}


class AutoDepthController:
    """Decides the draft depth of each decode step; see the module docstring."""

    def __init__(self, config: AutoConfig, max_depth: int,
                 agree: Callable[[DepthDecision], DepthDecision] | None = None) -> None:
        if max_depth < 1:
            raise ValueError(f"the learned depth schedule needs --speculative-num-steps >= 1, got {max_depth}")
        self.config = config
        self.max_depth = max_depth
        self.depths = tuple(range(max_depth + 1))
        edges = config.edges
        self._edges = edges
        self._buckets = [Bucket(low + 1, high, config.window, config.step_noise, self.depths)
                         for low, high in zip((0, *edges[:-1]), edges, strict=True)]
        self._agree = agree
        self.accept = AcceptHistograms(max_depth, config.accept_memory)
        self._learned = [max_depth] * len(edges)  # cold start: K everywhere, as EAGLE-3 does
        self._explore = [0] * len(edges)  # and the plain step timed first in each bucket
        self._traffic = [0.0] * len(edges)
        self._since = [0] * len(edges)
        self._walk = DepthController(self._schedule_of(self._learned))
        self.schedule_text = str(self._walk.schedule)
        self._burst_left = 0
        self._burst_depth = 0
        self._last_burst: int | None = None
        self._last = max_depth
        self.steps = 0
        self.explore_steps = 0
        self.depth_changes = 0
        self.schedule_changes = 0
        self.steps_by_depth = dict.fromkeys(self.depths, 0)
        self.last_move: Move | None = None

    # ------------------------------------------------------------------ per step
    def decide(self, batch_size: int) -> int:
        """The draft depth of the next decode step of `batch_size` running requests."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"decide: batch_size must be a whole number >= 1, got {batch_size!r}")
        self.steps += 1
        index = self._bucket(batch_size)
        self._since[index] += 1
        if self.steps % self.config.update_every == 0:
            self._update()
        walked = self._walk.step(batch_size)
        explored = self._explored(index, walked)
        depth = walked if explored is None else explored
        if depth != walked:
            self.explore_steps += 1
        if depth != self._last:
            self.depth_changes += 1
        self._last = depth
        self.steps_by_depth[depth] += 1
        return depth

    def record(self, depth: int, batch_size: int, step_seconds: float) -> None:
        """One timed decode step (the policy leaves out a step whose interval timed another)."""
        if depth not in self.depths:
            raise ValueError(f"record: depth {depth!r} not in 0..{self.max_depth}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"record: batch_size must be a whole number >= 1, got {batch_size!r}")
        if not (isinstance(step_seconds, (int, float)) and math.isfinite(step_seconds) and step_seconds > 0):
            raise ValueError(f"record: step_seconds must be a finite number > 0, got {step_seconds!r}")
        cfg = self.config
        bucket = self._buckets[self._bucket(batch_size)]
        seen = bucket.last_seen[depth]
        bucket.add(depth, step_seconds, batch_size, seen is not None and self.steps - seen > cfg.stale_steps,
                   cfg.min_samples)
        bucket.batch[depth].add(batch_size, cfg.memory)
        bucket.last_seen[depth] = self.steps

    def record_accepted(self, depth: int, num_correct_drafts_per_req: Sequence[int]) -> None:
        """A drafting step's accepted drafts per request (timed or not)."""
        self.accept.add(depth, num_correct_drafts_per_req)

    def note_idle(self) -> None:
        """The server ran nothing (no request left): the next batch walks the learned schedule
        from its start, its hysteresis forgotten (DepthController.note_idle)."""
        self._walk.note_idle()

    # ------------------------------------------------------------------ reports
    @property
    def depth(self) -> int:
        """The depth the learned schedule gives the running batch (exploration aside)."""
        return self._walk.depth

    @property
    def schedule(self) -> DepthSchedule:
        return self._walk.schedule

    def estimates(self) -> list[dict[str, object]]:
        """Per bucket: its batch size, learned depth, traffic share and tok/s per depth (timed, or
        `prior_tok_s` from the prior), with the steps each timed depth's median is taken over."""
        table, weights = self._table(), self._weights()
        out = []
        for i, (b, row) in enumerate(zip(self._buckets, table, strict=True)):
            ref = b.reference_batch()
            out.append({"low": b.low, "high": b.high, "batch_size": round(ref, 1), "depth": self._learned[i],
                        "traffic": round(weights[i], 3),
                        "tok_s": {str(d): round(math.exp(c.value), 1) for d, c in row.items() if c.timed},
                        "prior_tok_s": {str(d): round(math.exp(c.value), 1) for d, c in row.items() if not c.timed},
                        "steps": {str(d): len(b.seconds[d]) for d in self.depths if len(b.seconds[d])}})
        return out

    def estimates_text(self) -> str:
        """The timed buckets, for a log line: `low-high (learned d): dK x / ... / d0 y tok/s`."""
        parts = []
        for i, (b, row) in enumerate(zip(self._buckets, self._table(), strict=True)):
            timed = {d: math.exp(c.value) for d, c in row.items() if c.timed}
            if timed:
                figures = " / ".join(f"d{d} {v:.0f}" for d, v in sorted(timed.items(), reverse=True))
                parts.append(f"{b.low}-{b.high} (d{self._learned[i]}): {figures} tok/s")
        return "; ".join(parts) if parts else "no bucket timed yet"

    def state(self) -> dict[str, object]:
        """For server info and metrics."""
        tokens = self.accept.tokens_per_request()
        return {"schedule": AUTO, "learned": self.schedule_text, "depth": self.depth,
                "accept_length_by_depth": None if tokens is None else
                {str(d): round(t, 3) for d, t in enumerate(tokens)},
                "steps_by_depth": {str(d): n for d, n in self.steps_by_depth.items()},
                "explore_steps": self.explore_steps, "depth_changes": self.depth_changes,
                "schedule_changes": self.schedule_changes}

    # ------------------------------------------------------------------ inside
    def _bucket(self, batch_size: int) -> int:
        return min(bisect.bisect_left(self._edges, batch_size), len(self._edges) - 1)

    def _schedule_of(self, depths: Sequence[int]) -> DepthSchedule:
        tiers = [Tier(b.low, None if i == len(depths) - 1 else b.high, d)
                 for i, (b, d) in enumerate(zip(self._buckets, depths, strict=True))]
        return validated_schedule(tiers)

    def _explored(self, index: int, walked: int) -> int | None:
        """The depth to explore this step, None to follow the schedule."""
        if self._burst_left > 0:
            self._burst_left -= 1
            return self._burst_depth
        target = self._explore[index]
        if target == NONE or target == walked:
            return None
        if self._last_burst is not None and self.steps - self._last_burst < self.config.explore_gap:
            return None
        self._last_burst = self.steps
        self._burst_depth = target
        self._burst_left = self.config.explore_steps - 1
        self._explore[index] = NONE  # timed now; the next update says what is next
        return target

    def _timed(self, bucket: Bucket[int], depth: int) -> bool:
        return bucket.seconds[depth].enough(self.config.min_samples)

    def _table(self) -> list[dict[int, Cell]]:
        """Per bucket, per depth with a figure there: log tok/s at the bucket's batch size."""
        tokens = self.accept.tokens_per_request()
        if tokens is None:
            return [{} for _ in self._buckets]
        curves = {d: sorted(p for b in self._buckets if self._timed(b, d) and (p := b.point(d)) is not None)
                  for d in self.depths}
        table = []
        for b in self._buckets:
            ref = b.reference_batch()
            seconds = {d: t for d in self.depths if self._timed(b, d) and (t := seconds_at(curves[d], ref))}
            row = {d: Cell(math.log(ref * tokens[d] / t), b.seconds[d].relative_variance(), True)
                   for d, t in seconds.items()}
            for d in self.depths:
                if d not in row and (t := prior_seconds(seconds, d)) is not None:
                    row[d] = Cell(math.log(ref * tokens[d] / t), PRIOR_NOISE ** 2, False)
            table.append(row)
        return table

    def _weights(self) -> list[float]:
        total = sum(self._traffic)
        return [t / total if total > 0 else 0.0 for t in self._traffic]

    def _update(self) -> None:
        for i, n in enumerate(self._since):
            self._traffic[i] = self._traffic[i] * TRAFFIC_MEMORY + n
            self._since[i] = 0
        table, weights = self._table(), self._weights()
        depths = monotone_best(table, weights, self._learned, self.max_depth, self.config.margin)
        decision = DepthDecision(tuple(depths), tuple(self._targets(table, depths)))
        if self._agree is not None:
            decision = self._agree(decision)
        if list(decision.depths) != self._learned:
            moved = list(decision.depths)
            gain, noise = _difference(table, weights, self._learned, moved)
            changed = [i for i, (a, b) in enumerate(zip(self._learned, moved, strict=True)) if a != b]
            walk = DepthController(self._schedule_of(moved))
            self.last_move = Move(
                self.schedule_text, str(walk.schedule),
                tuple((self._buckets[i].low, self._buckets[i].high, self._learned[i], moved[i]) for i in changed),
                tuple({d: math.exp(c.value) for d, c in table[i].items() if c.timed} for i in changed),
                gain, noise)
            self._learned, self._walk, self.schedule_text = moved, walk, str(walk.schedule)
            self.schedule_changes += 1
        self._explore = list(decision.explore)

    def _targets(self, table: Sequence[dict[int, Cell]], depths: Sequence[int]) -> list[int]:
        """Per bucket, the depth to time there next (module docstring), NONE for none."""
        cfg = self.config
        out = []
        for b, row, learned in zip(self._buckets, table, depths, strict=True):
            others = [d for d in self.depths if d != learned]
            untimed = [d for d in others if not self._timed(b, d)]
            if untimed:
                if sum(self._timed(b, d) for d in self.depths) < 2:  # no prior yet: the plain step, then K, ...
                    untimed.sort(key=lambda d: (d != 0, -d))
                else:
                    untimed.sort(key=lambda d: -row[d].value if d in row else math.inf)
                out.append(untimed[0])
                continue
            mine = row.get(learned)
            if mine is None:
                out.append(NONE)
                continue
            stale = [d for d in others if d in row and self.steps - (b.last_seen[d] or 0) > cfg.stale_steps
                     and row[d].value >= mine.value + math.log(1 - CONTENTION)]
            close = [d for d in others if d in row and abs(row[d].value - mine.value)
                     <= cfg.margin + 2 * math.sqrt(row[d].variance + mine.variance)]
            pick = stale or close
            out.append(min(pick, key=lambda d: b.last_seen[d] or 0) if pick else NONE)
        return out


def prior_seconds(timed: dict[int, float], depth: int) -> float | None:
    """A depth's step seconds in a bucket from the depths timed there: linear in depth between the
    nearest timed depth on either side; beyond them, along the nearest two's slope (at least flat:
    a deeper draft never costs less) and at least half the nearest one's. None with fewer than two
    timed."""
    if depth in timed:
        return timed[depth]
    if len(timed) < 2:
        return None
    known = sorted(timed)
    right = bisect.bisect_left(known, depth)
    if 0 < right < len(known):
        d0, d1 = known[right - 1], known[right]
    else:
        d0, d1 = (known[0], known[1]) if right == 0 else (known[-2], known[-1])
    t0, t1 = timed[d0], timed[d1]
    slope = max((t1 - t0) / (d1 - d0), 0.0)
    near = timed[d0] if right == 0 else timed[d1] if right == len(known) else 0.0
    return max(t0 + slope * (depth - d0), near / 2)


def monotone_best(table: Sequence[dict[int, Cell]], weights: Sequence[float], current: Sequence[int],
                  max_depth: int, margin: float) -> list[int]:
    """The depth per bucket, non-increasing, that gains the most over the current schedule, summed
    over the buckets weighted by their traffic. A bucket's gain at a depth is its log tok/s there
    over its current depth's, a gain counted only beyond `margin` plus twice the noise of the
    difference (hysteresis on the estimate: none counts within it), a loss in full (a move that
    monotonicity forces costs what it loses). A depth without a figure loses as much as the
    bucket's worst one (it is no escape from a known loss); a bucket without a figure at its
    current depth gains nothing anywhere; ties go to the depth nearest the current one (a forced
    move moves least). A dynamic programme: best[i][d],
    the best sum over buckets 0..i with bucket i at depth d, is bucket i's own at d plus the best of
    bucket i - 1 at any depth >= d."""
    depths = range(max_depth + 1)
    best: list[float] = []
    back: list[list[int]] = []  # per bucket after the first, per depth: the depth of the one before
    for i, (row, w, cur) in enumerate(zip(table, weights, current, strict=True)):
        own = [-_KEEP * abs(d - cur) for d in depths]  # ties: the depth nearest the current one
        mine = row.get(cur)
        if mine is not None:
            gains = {}
            for d, cell in row.items():
                gain = cell.value - mine.value
                bar = margin + 2 * math.sqrt(cell.variance + mine.variance)
                gains[d] = gain - bar if gain > bar else min(gain, 0.0)
            worst = min(gains.values())
            for d in depths:
                own[d] += w * gains.get(d, worst)
        if i == 0:
            best = own
            continue
        deeper, arg = -math.inf, max_depth  # the best of the bucket before at a depth >= d
        step_back = [0] * len(depths)
        total = [0.0] * len(depths)
        for d in reversed(depths):
            if best[d] > deeper:
                deeper, arg = best[d], d
            total[d], step_back[d] = own[d] + deeper, arg
        best = total
        back.append(step_back)
    out = [max(depths, key=lambda d: best[d])]
    for step_back in reversed(back):
        out.append(step_back[out[-1]])
    return out[::-1]


def _difference(table: Sequence[dict[int, Cell]], weights: Sequence[float], current: Sequence[int],
                new: Sequence[int]) -> tuple[float, float]:
    """The traffic-weighted log tok/s that `new` gains over `current`, and its noise."""
    gain = variance = 0.0
    for row, w, a, b in zip(table, weights, current, new, strict=True):
        if a == b or a not in row:
            continue
        cell_a = row[a]
        cell_b = row.get(b, Cell(cell_a.value, 0.0, False))
        gain += w * (cell_b.value - cell_a.value)
        variance += w * w * (cell_a.variance + cell_b.variance)
    return gain, math.sqrt(variance)
