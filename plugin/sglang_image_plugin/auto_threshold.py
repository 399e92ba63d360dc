"""The threshold `auto`: the server finds where speculation stops paying.

Pure Python (no torch, no sglang), so it is tested alone on a CPU. A worker hook calls, per
decode step:

    mode = controller.decide(batch_size)                                 # before the step
    controller.record(mode, batch_size, step_seconds, output_tokens)     # after it

step_seconds is the step's wall time as the scheduler sees it (with overlap scheduling, the time
between the starts of two decode steps); a catch-up step that prepares the draft when speculation
resumes is not recorded. AutoPolicy does this behind upstream's adaptive-speculation policy
protocol (K draft steps or upstream's zero-step tier), timing the steps itself.

What it estimates: per batch-size bucket, the output tokens/s of a speculative step (the live
accept length per request over its step time) and of a plain step (one token per request), both
at the batch size the bucket's traffic runs at (each mode's step time interpolated between the
buckets it was measured in: within a bucket the two modes are seldom measured at the same batch
sizes). A mode's step time in a bucket is the median of its recent steps there, and a bucket
counts once both modes have `min_samples` of them: a step timed by the scheduler's clock may
carry a first use's compile, a wave of prefills or an abort, and one such step in a mean of ten
outweighs the difference between the modes. Speculation pays in a prefix of the batch sizes
(its step costs a multiple of a plain one's compute, so its advantage shrinks as the batch fills
the GPU); the crossover is the split
that maximizes the summed log advantage of the speculating buckets. Every `update_every` steps it
moves there only if that beats the current split by `margin` plus twice the noise of the
difference (from the spread of the step times, taken as at least `step_noise` a step, so that a
few steps that happened to run alike do not pass for a sure figure): hysteresis on the estimate.
Running batches switch like a fixed threshold N = crossover: plain above N, speculative again at
N - N//8 (hysteresis on the batch size), so one arrival does not flip the mode; when the crossover
moves, the running batch takes its side at once.

The live accept length is measured wherever the server speculates and applied to every bucket,
so a shift of acceptance moves the crossover without exploring. A bucket whose other mode has no
recent measurement (`stale_steps`) of `min_samples` steps runs that mode for `explore_steps`
steps, at most one such burst every `explore_gap` steps; so does a bucket next to the crossover
whose advantage is still within its noise. Exploration costs at most explore_steps / explore_gap
of the steps. Steps measured after a stale gap replace the old ones where the two differ beyond
their noise: a mode timed once, while something else slowed the GPU, and never again (the other
mode winning there), would otherwise hold the bucket's decision for good.
A cold start may take a prior (for example step times timed at CUDA-graph capture, per batch size):
one step of each mode in each bucket it covers, which counts there at once and which the steps
measured then outvote; without one it speculates everywhere, as EAGLE-3 does, until measurements
say otherwise.

Every decision is a function of the measurements given, without randomness. Step times differ
between tensor-parallel ranks, so a TP hook passes `agree` (a broadcast of rank 0's Decision):
the estimate reaches the decisions only through it (the crossover, and the buckets near it still
being explored), at the same steps on every rank; everything else follows from the batch sizes
and the order of the calls, which the ranks share.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

# The flag, its parser and the fixed threshold's hysteresis are the setting's.
from sglang_image_plugin.setting import (
    AUTO,
    AUTO_TRACE_ENV,
    THRESHOLD_FLAG,
    Mode,
    default_hysteresis,
)

EXTRAPOLATION_SPAN: Final = 1.5  # see AutoController._seconds_at


def resume_batch_size(threshold: int) -> int:
    """Below a threshold N, the batch size at which a plain server speculates again: N - N//8 (at
    least one below N where N > 1), so that one request arriving or finishing near N does not flip
    the mode on every step."""
    return threshold - default_hysteresis(threshold)


def power_of_two_edges(max_batch_size: int) -> tuple[int, ...]:
    """Bucket upper edges 1, 2, 4, ... and max_batch_size last."""
    edges = []
    edge = 1
    while edge < max_batch_size:
        edges.append(edge)
        edge *= 2
    return (*edges, max_batch_size)


@dataclass(frozen=True, kw_only=True)
class AutoConfig:
    """How the controller measures and how cautiously it moves; the defaults suit a server that
    runs hundreds of steps a second."""

    max_batch_size: int  # the largest decode batch the server runs (its max running requests)
    # upper edges of the batch-size buckets, increasing, the last = max_batch_size (default: powers
    # of two; a server may pass its CUDA-graph batch sizes: step time is flat between two of them)
    bucket_edges: tuple[int, ...] = ()
    # a new crossover must beat the current one by this much summed log advantage (0.02: 2% in
    # one bucket), besides the noise: a switch costs a catch-up step, and so close a choice matters little
    margin: float = 0.02
    update_every: int = 32  # steps between two re-estimates of the crossover
    # how fast a bucket forgets: the weight each sample of its batch sizes keeps per new one; its
    # median step time is taken over as many steps as make it as precise as that mean would be
    # (`window`: 30 at 0.9)
    memory: float = 0.9
    accept_memory: float = 0.98  # per-step weight kept by the live accept length (~50 steps)
    # a measurement older than this many steps is not recent: the bucket explores that mode again
    # (at most ~0.6% of the steps, in bursts of explore_steps), and where the new steps differ
    # from the old beyond their noise they replace them (see _Bucket.add)
    stale_steps: int = 1024
    # steps of one exploration burst; the first one or two time the step before (see AutoPolicy)
    explore_steps: int = 6
    explore_gap: int = 256  # steps between the starts of two bursts, at least
    min_samples: int = 4  # steps of each mode a bucket needs before it counts
    # the least spread of one step's time the estimate assumes: a few steps can look as alike as
    # a few microseconds by chance, and a burst of them would then outvote a window (GPU, 8B
    # shape, 64 requests: 4 speculative steps replaced 30 and moved the crossover the wrong way)
    step_noise: float = 0.05

    def __post_init__(self) -> None:
        problems = []
        if self.max_batch_size < 1:
            problems.append(f"max_batch_size {self.max_batch_size} < 1")
        edges = self.bucket_edges
        if edges and (list(edges) != sorted(set(edges)) or edges[0] < 1 or edges[-1] != self.max_batch_size):
            problems.append(f"bucket_edges {edges}: must increase from >= 1 to max_batch_size")
        if not 0 <= self.margin < 1:
            problems.append(f"margin {self.margin} not in [0, 1)")
        if not 0 <= self.step_noise < 1:
            problems.append(f"step_noise {self.step_noise} not in [0, 1)")
        for name in ("memory", "accept_memory"):
            if not 0 < getattr(self, name) < 1:
                problems.append(f"{name} {getattr(self, name)} not in (0, 1)")
        for name in ("update_every", "stale_steps", "explore_steps", "explore_gap", "min_samples"):
            if getattr(self, name) < 1:
                problems.append(f"{name} {getattr(self, name)} < 1")
        if self.explore_steps > self.explore_gap:
            problems.append(f"explore_steps {self.explore_steps} > explore_gap {self.explore_gap}")
        if problems:
            raise ValueError(f"{THRESHOLD_FLAG} auto: bad controller config: " + "; ".join(problems))

    @property
    def edges(self) -> tuple[int, ...]:
        return self.bucket_edges or power_of_two_edges(self.max_batch_size)

    @property
    def window(self) -> int:
        """The steps a bucket's median step time is taken over: a mean forgetting at `memory`
        weighs (1 + memory) / (1 - memory) samples' worth, and a median needs pi / 2 times the
        samples of a mean for its precision."""
        return max(1, round(math.pi / 2 * (1 + self.memory) / (1 - self.memory)))

    @property
    def explore_share(self) -> float:
        """The largest share of steps that exploration may take."""
        return self.explore_steps / self.explore_gap


@dataclass(frozen=True)
class Prior:
    """What the server expects before it has measured: step seconds of each mode by batch size (for
    example timed while capturing its CUDA graphs) and an accept length (tokens per request per
    speculative step)."""

    accept_length: float
    speculative_seconds: Mapping[int, float]
    plain_seconds: Mapping[int, float]

    def __post_init__(self) -> None:
        bad = [f"{k}: {v}" for m in (self.speculative_seconds, self.plain_seconds) for k, v in m.items()
               if k < 1 or not v > 0 or not math.isfinite(v)]
        if not self.accept_length >= 1 or not math.isfinite(self.accept_length) or bad:
            raise ValueError(f"{THRESHOLD_FLAG} auto: bad prior (accept length {self.accept_length}, "
                             f"must be >= 1; step seconds must be > 0 at batch sizes >= 1: {bad})")


@dataclass
class _Average:
    """A mean that forgets: each new sample keeps `memory` of the weight of those before."""

    total: float = 0.0
    weight: float = 0.0

    def add(self, value: float, memory: float, weight: float = 1.0) -> None:
        self.total = self.total * memory + value * weight
        self.weight = self.weight * memory + weight

    @property
    def value(self) -> float | None:
        return self.total / self.weight if self.weight > 0 else None


class _Times:
    """One mode's recent step seconds in one bucket: their median, which a few steps that carried
    something else do not move far, its noise, and the mean batch size of those steps."""

    def __init__(self, window: int, step_noise: float = 0.0) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self._batches: deque[float] = deque(maxlen=window)
        self.step_noise = step_noise  # AutoConfig.step_noise
        self.seeded = False  # holds a prior's step (AutoController._seed)

    def add(self, value: float, batch_size: float) -> None:
        self._samples.append(value)
        self._batches.append(batch_size)

    def extend(self, other: _Times) -> None:
        self._samples.extend(other._samples)
        self._batches.extend(other._batches)

    @property
    def batch(self) -> float | None:
        return statistics.fmean(self._batches) if self._batches else None

    def __len__(self) -> int:
        return len(self._samples)

    def differs(self, other: _Times) -> bool:
        """Whether the two medians are apart by more than three times the noise of their ratio
        (a few steps' spread is itself uncertain)."""
        a, b = self.value, other.value
        if a is None or b is None:
            return True
        return abs(math.log(a / b)) > 3 * math.sqrt(self.relative_variance() + other.relative_variance())

    def enough(self, min_samples: int) -> bool:
        """Whether to decide on it: min_samples steps (or all the window holds), or a prior."""
        return self.seeded or len(self._samples) >= min(min_samples, self._samples.maxlen or min_samples)

    @property
    def value(self) -> float | None:
        return statistics.median(self._samples) if self._samples else None

    def relative_variance(self) -> float:
        """The squared standard error of the median over the median squared (0 with one step: a
        prior's). The spread is the median absolute deviation's (an outlier would make it a
        standard deviation's for as long as the step stays in the window), with its small-sample
        factor, and at least step_noise of the median."""
        n = len(self._samples)
        if n < 2:
            return 0.0
        median = statistics.median(self._samples)
        sigma = 1.4826 * statistics.median(abs(x - median) for x in self._samples) * n / (n - 0.8)
        relative = max(sigma / median, self.step_noise)
        return math.pi / 2 * relative * relative / n


@dataclass
class _Bucket:
    low: int
    high: int
    window: int
    step_noise: float = 0.0
    # per mode: recent step seconds and their batch sizes; and the batch sizes of its traffic
    seconds: dict[Mode, _Times] = field(init=False)
    batch: dict[Mode, _Average] = field(default_factory=lambda: {m: _Average() for m in Mode})
    last_seen: dict[Mode, int | None] = field(default_factory=lambda: {m: None for m in Mode})

    def __post_init__(self) -> None:
        self.seconds = {m: _Times(self.window, self.step_noise) for m in Mode}
        self.fresh: dict[Mode, _Times | None] = dict.fromkeys(Mode)  # see add

    def add(self, mode: Mode, seconds: float, batch_size: int, after_stale_gap: bool, min_samples: int) -> None:
        """One step's seconds. The steps after a stale gap gather apart until they are enough to
        decide on (the old ones count meanwhile); then they replace the old ones if the two differ
        beyond their noise (the GPU was not what it is now, e.g. shared), else they join them
        (a window of a few steps would decide on more noise)."""
        if after_stale_gap:
            self.fresh[mode] = _Times(self.window, self.step_noise)
        fresh = self.fresh[mode]
        if fresh is None:
            self.seconds[mode].add(seconds, batch_size)
            return
        fresh.add(seconds, batch_size)
        if fresh.enough(min_samples):
            old, self.fresh[mode] = self.seconds[mode], None
            if old.differs(fresh):
                self.seconds[mode] = fresh
            else:
                old.extend(fresh)

    def point(self, mode: Mode) -> tuple[float, float] | None:
        """(batch size, step seconds) of this mode's recent steps here, None before a measurement."""
        b, t = self.seconds[mode].batch, self.seconds[mode].value
        return None if b is None or t is None else (b, t)

    def reference_batch(self) -> float:
        """The batch size this bucket's traffic runs at, both modes pooled."""
        weight = sum(a.weight for a in self.batch.values())
        return sum(a.total for a in self.batch.values()) / weight if weight else float(self.high)


@dataclass(frozen=True)
class Decision:
    """What the estimate decides at an update, all a rank needs to act as the others do."""

    split: int  # buckets [0, split) speculate
    undecided: frozenset[int]  # buckets next to the split still explored: within the noise


@dataclass(frozen=True)
class BucketEstimate:
    """One bucket's view, for reports: output tokens/s of each mode at the batch size the bucket's
    traffic runs at (None: not measured in both modes yet)."""

    low: int
    high: int
    batch_size: float
    speculative_tok_s: float | None
    plain_tok_s: float | None
    speculate: bool
    speculative_steps: int = 0  # the steps each mode's median is taken over
    plain_steps: int = 0


class AutoController:
    """Decides per decode step whether to speculate; see the module docstring."""

    def __init__(self, config: AutoConfig, prior: Prior | None = None,
                 agree: Callable[[Decision], Decision] | None = None) -> None:
        self.config = config
        edges = config.edges
        self._buckets = [_Bucket(low + 1, high, config.window, config.step_noise)
                         for low, high in zip((0, *edges[:-1]), edges, strict=True)]
        self._edges = edges
        self._agree = agree
        self._accept = _Average()
        self._split = len(self._buckets)  # buckets [0, split) speculate: all, as EAGLE-3 does
        self._mode = Mode.SPECULATIVE
        self._last = Mode.SPECULATIVE
        self._burst_left = 0
        self._burst_mode = Mode.PLAIN
        self._last_burst: int | None = None
        # the buckets on either side of the crossover whose advantage is within its noise: more
        # measurements there decide where the crossover goes
        self._undecided: set[int] = set()
        self.steps = 0
        self.explore_steps = 0
        self.mode_changes = 0
        self.crossover_changes = 0
        self.steps_by_mode = dict.fromkeys(Mode, 0)
        if prior is not None:
            self._seed(prior)
            if agree is not None:
                self._split = agree(Decision(self._split, frozenset())).split
        self._mode_for = self.crossover()  # the crossover self._mode was last set against

    # ------------------------------------------------------------------ per step
    def decide(self, batch_size: int) -> Mode:
        """The mode of the next decode step of a batch of `batch_size` running requests."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"decide: batch_size must be a whole number >= 1, got {batch_size!r}")
        self.steps += 1
        if self.steps % self.config.update_every == 0:
            self._update()
        n = self.crossover()
        if n != self._mode_for:
            # the estimate moved the crossover: the batch takes its side now (hysteresis holds a
            # mode against the batch size's wobble, not against a new estimate; a closed loop of
            # exactly N requests would otherwise stay plain under a crossover that rose to N)
            self._mode_for = n
            self._mode = Mode.SPECULATIVE if batch_size <= n else Mode.PLAIN
        elif self._mode is Mode.SPECULATIVE and batch_size > n:
            self._mode = Mode.PLAIN
        elif self._mode is Mode.PLAIN and batch_size <= resume_batch_size(n):
            self._mode = Mode.SPECULATIVE
        mode = self._explore(self._bucket(batch_size)) or self._mode
        if mode is not self._mode:
            self.explore_steps += 1
        if mode is not self._last:
            self.mode_changes += 1
        self._last = mode
        self.steps_by_mode[mode] += 1
        return mode

    def record(self, mode: Mode, batch_size: int, step_seconds: float, output_tokens: int) -> None:
        """One measured decode step: its wall time and the output tokens it produced (a plain step:
        one per request; a speculative one: the accepted tokens plus one per request). A step that
        is neither (the catch-up step that prepares the draft when speculation resumes) is left out."""
        if not isinstance(mode, Mode):
            raise TypeError(f"record: mode must be a Mode, got {mode!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"record: batch_size must be a whole number >= 1, got {batch_size!r}")
        if not (isinstance(step_seconds, (int, float)) and math.isfinite(step_seconds) and step_seconds > 0):
            raise ValueError(f"record: step_seconds must be a finite number > 0, got {step_seconds!r}")
        if isinstance(output_tokens, bool) or not isinstance(output_tokens, int) or output_tokens < 0:
            raise ValueError(f"record: output_tokens must be a whole number >= 0, got {output_tokens!r}")
        bucket = self._buckets[self._bucket(batch_size)]
        seen = bucket.last_seen[mode]
        bucket.add(mode, step_seconds, batch_size, seen is not None and self.steps - seen > self.config.stale_steps,
                   self.config.min_samples)
        bucket.batch[mode].add(batch_size, self.config.memory)
        bucket.last_seen[mode] = self.steps
        if mode is Mode.SPECULATIVE:
            self._accept.add(output_tokens / batch_size, self.config.accept_memory, batch_size)

    # ------------------------------------------------------------------ reports
    def crossover(self) -> int:
        """The batch size up to which the server speculates now (0: never; max_batch_size: always)."""
        return self._edges[self._split - 1] if self._split else 0

    @property
    def mode(self) -> Mode:
        """The mode the crossover gives the running batch (exploration steps aside)."""
        return self._mode

    def accept_length(self) -> float | None:
        """The live accept length: tokens per request per speculative step, recent steps weighing most."""
        return self._accept.value

    def estimates(self) -> list[BucketEstimate]:
        accept = self._accept.value
        curves = self._curves()
        out = []
        for i, b in enumerate(self._buckets):
            ref = b.reference_batch()
            spec = self._seconds_at(curves[Mode.SPECULATIVE], ref)
            plain = self._seconds_at(curves[Mode.PLAIN], ref)
            measured = self._counts(b)
            out.append(BucketEstimate(b.low, b.high, round(ref, 1),
                                      ref * accept / spec if measured and spec and accept else None,
                                      ref / plain if measured and plain else None, i < self._split,
                                      len(b.seconds[Mode.SPECULATIVE]), len(b.seconds[Mode.PLAIN])))
        return out

    def estimates_text(self) -> str:
        """The buckets measured in both modes, for a log line: `low-high: speculative / plain
        tokens/s (steps of each in the median)`."""
        parts = [f"{e.low}-{e.high}: {e.speculative_tok_s:.0f} / {e.plain_tok_s:.0f} tok/s "
                 f"({e.speculative_steps}/{e.plain_steps} steps)"
                 for e in self.estimates() if e.speculative_tok_s is not None and e.plain_tok_s is not None]
        return "; ".join(parts) if parts else "no bucket measured in both modes yet"

    def state(self) -> dict[str, object]:
        """For server info and metrics."""
        accept = self._accept.value
        return {"threshold": AUTO, "crossover": self.crossover(), "mode": str(self._mode),
                "accept_length": round(accept, 3) if accept is not None else None,
                "speculative_steps": self.steps_by_mode[Mode.SPECULATIVE],
                "plain_steps": self.steps_by_mode[Mode.PLAIN], "explore_steps": self.explore_steps,
                "mode_changes": self.mode_changes, "crossover_changes": self.crossover_changes}

    # ------------------------------------------------------------------ inside
    def _bucket(self, batch_size: int) -> int:
        return min(bisect.bisect_left(self._edges, batch_size), len(self._edges) - 1)

    def _recent(self, bucket: _Bucket, mode: Mode) -> bool:
        """Whether this mode was measured here lately, in enough steps to decide on."""
        seen = bucket.last_seen[mode]
        return (seen is not None and self.steps - seen <= self.config.stale_steps
                and bucket.seconds[mode].enough(self.config.min_samples))

    def _explore(self, index: int) -> Mode | None:
        """The mode to explore this step, None to follow the crossover."""
        if self._burst_left > 0:
            self._burst_left -= 1
            return self._burst_mode
        other = self._mode.other()
        cfg = self.config
        if self._recent(self._buckets[index], other) and index not in self._undecided:
            return None
        if self._last_burst is not None and self.steps - self._last_burst < cfg.explore_gap:
            return None
        self._last_burst = self.steps
        self._burst_mode = other
        self._burst_left = cfg.explore_steps - 1
        return other

    def _advantages(self) -> list[tuple[float, float]] | None:
        """Per bucket, log(speculative tok/s / plain tok/s) and its variance from the step times'
        noise; a bucket not measured in both modes takes its neighbours' values (linear between two).
        Beyond the measured ones only what the nearest bounds is taken (speculation's advantage
        shrinks as the batch grows): below a bucket where plain wins, and above one where
        speculation wins, an unmeasured bucket counts as neutral (0), so it keeps its current
        mode until measured. None: no bucket is."""
        accept = self._accept.value
        curves = self._curves()
        known: dict[int, tuple[float, float]] = {}
        for i, b in enumerate(self._buckets):
            if accept is None or not self._counts(b):
                continue
            ref = b.reference_batch()
            spec = self._seconds_at(curves[Mode.SPECULATIVE], ref)
            plain = self._seconds_at(curves[Mode.PLAIN], ref)
            if spec is not None and plain is not None:
                variance = sum(b.seconds[m].relative_variance() for m in Mode)
                known[i] = (math.log(accept * plain / spec), variance)
        if not known:
            return None
        points = sorted(known)
        out = []
        for i in range(len(self._buckets)):
            right = bisect.bisect_left(points, i)
            if i in known:
                out.append(known[i])
            elif right == 0:  # speculation pays at least as much below: a lower bound
                d, variance = known[points[0]]
                out.append((max(d, 0.0), variance))
            elif right == len(points):  # and at most as much above: an upper bound
                d, variance = known[points[-1]]
                out.append((min(d, 0.0), variance))
            else:
                lo, hi = points[right - 1], points[right]
                w = (i - lo) / (hi - lo)
                (d0, v0), (d1, v1) = known[lo], known[hi]
                out.append((d0 + (d1 - d0) * w, v0 + (v1 - v0) * w))
        return out

    def _counts(self, bucket: _Bucket) -> bool:
        """Whether both modes' step times in this bucket have enough steps to decide on."""
        return all(bucket.seconds[m].enough(self.config.min_samples) for m in Mode)

    def _curves(self) -> dict[Mode, list[tuple[float, float]]]:
        """Per mode, the (batch size, step seconds) of the buckets it counts in, by batch size."""
        return {m: sorted(p for b in self._buckets
                          if b.seconds[m].enough(self.config.min_samples) and (p := b.point(m)) is not None)
                for m in Mode}

    @staticmethod
    def _seconds_at(points: list[tuple[float, float]], batch_size: float) -> float | None:
        """A mode's step seconds at `batch_size` from its curve (_curves): linear between the two
        measured buckets around it (within a bucket the two modes are seldom measured at the same
        batch sizes, and step time grows with the batch). Beyond the measured ones, a line from the nearest through one at
        least EXTRAPOLATION_SPAN times farther or nearer, its slope kept between flat and
        proportional to the batch (a step never gets faster, nor costlier per request, with more
        requests)."""
        if not points:
            return None
        if len(points) == 1:
            return points[0][1]
        right = bisect.bisect_left(points, (batch_size, -math.inf))
        if 0 < right < len(points):
            (b0, t0), (b1, t1) = points[right - 1], points[right]
            return t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0) if b1 > b0 else (t0 + t1) / 2
        near_b, near_t = points[-1] if right else points[0]
        others = points[-2::-1] if right else points[1:]
        far_b, far_t = next((p for p in others if max(p[0], near_b) >= EXTRAPOLATION_SPAN * min(p[0], near_b)),
                            others[-1])
        slope = (near_t - far_t) / (near_b - far_b) if near_b != far_b else 0.0
        slope = min(max(slope, 0.0), near_t / near_b)
        return max(near_t + slope * (batch_size - near_b), near_t * batch_size / near_b if right == 0 else 0.0)

    def _best_split(self, advantages: Sequence[tuple[float, float]], margin: float) -> int:
        """The split whose speculating prefix sums the most advantage, if it beats the current one by
        more than `margin` plus twice the noise of that difference; else the current one."""
        sums, variances = [0.0], [0.0]
        for d, variance in advantages:
            sums.append(sums[-1] + d)
            variances.append(variances[-1] + variance)
        current = self._split
        best = max(range(len(sums)), key=lambda k: (sums[k], -abs(k - current)))
        noise = math.sqrt(abs(variances[best] - variances[current]))
        return best if sums[best] - sums[current] > margin + 2 * noise else current

    def _update(self) -> None:
        advantages = self._advantages()
        split = self._split if advantages is None else self._best_split(advantages, self.config.margin)
        undecided = set()
        if advantages is not None:
            for i in (split - 1, split):
                if 0 <= i < len(advantages) and self._counts(self._buckets[i]):
                    d, variance = advantages[i]
                    if abs(d) <= self.config.margin + 2 * math.sqrt(variance):
                        undecided.add(i)
        decision = Decision(split, frozenset(undecided))
        if self._agree is not None:
            decision = self._agree(decision)
        if decision.split != self._split:
            self._split = decision.split
            self.crossover_changes += 1
        self._undecided = set(decision.undecided)

    def _seed(self, prior: Prior) -> None:
        """The prior as one step per bucket and mode (the means of the batch sizes it gives there,
        and of their times: their spread is the batch sizes', not noise), then a crossover from it
        alone."""
        for mode, seconds in ((Mode.SPECULATIVE, prior.speculative_seconds), (Mode.PLAIN, prior.plain_seconds)):
            by_bucket: dict[int, list[tuple[int, float]]] = {}
            for batch_size, t in seconds.items():
                by_bucket.setdefault(self._bucket(batch_size), []).append((batch_size, t))
            for index, points in by_bucket.items():
                bucket = self._buckets[index]
                bucket.seconds[mode].add(statistics.fmean(t for _, t in points), statistics.fmean(b for b, _ in points))
                bucket.seconds[mode].seeded = True
                bucket.batch[mode].add(statistics.fmean(b for b, _ in points), self.config.memory)
        self._accept.add(prior.accept_length, self.config.accept_memory)
        advantages = self._advantages()
        if advantages is not None:
            self._split = self._best_split(advantages, 0.0)


@dataclass
class _Step:
    mode: Mode
    batch_size: int
    start: float
    seconds: float | None = None  # 0.0: no time (the server went idle after it)
    output_tokens: int | None = None
    left_out: bool = False  # paired with its result, not recorded
    catch_up: bool = False  # the catch-up step (AutoPolicy.leave_out_last)
    prefills: int = 0  # prefill batches launched while this step was the last one decided

    @property
    def kind(self) -> str:
        return "catch-up" if self.catch_up else str(self.mode)


class AutoPolicy:
    """AutoController behind upstream's adaptive-speculation policy protocol (sglang's
    AdaptiveSpecPolicy: candidate step counts, one `get_steps_for_batch` before each decode batch,
    one `on_verify_complete` per decode result): K draft steps or 0 (upstream's zero-step tier,
    a plain step).

    A step's time is the interval from its `get_steps_for_batch` to the next one: with overlap
    scheduling the host prepares a batch while the previous one runs, so in steady state that is
    the step time the traffic sees, prefills between decode steps included. But the host waits for
    a step's result only after it has launched the next one, so that interval ends when the step
    before it is done: it times the previous step. The first step of a kind (plain, speculative,
    the catch-up step) after another kind is therefore left out: it carries the other kind's time
    (and a change to plain waits once for the last speculative step). Verify results come in
    decode order, usually a step late; each fills the oldest step still waiting for one. A result
    whose batch size differs from that step's means the two sequences lost step: the pending steps
    are dropped. An idle call (no requests), or the scheduler going idle (note_idle), leaves the
    pending step without a time.

    `trace`, if given, gets a record per decided step once its time and tokens are in (recorded or
    left out), and one per prefill the server reports (note_prefill): the raw data the estimate
    is made of, for reading offline why `auto` chose what it chose (see StepTrace)."""

    MAX_PENDING = 8  # steps waiting for their results, at most (overlap keeps one or two)

    def __init__(self, controller: AutoController, speculative_steps: int,
                 clock: Callable[[], float] | None = None,
                 trace: Callable[[dict[str, object]], None] | None = None) -> None:
        if speculative_steps < 1:
            raise ValueError(f"{THRESHOLD_FLAG} auto needs --speculative-num-steps >= 1, got {speculative_steps}")
        import time  # measurement only; the tests pass their own clock

        self.controller = controller
        self.speculative_steps = speculative_steps
        self._clock = clock or time.perf_counter
        self._pending: list[_Step] = []
        self._previous: _Step | None = None  # the step decided last (recorded or not)
        self._cuda_graph_bs: list[int] | None = None
        self.dropped = 0  # steps not recorded: no time, or lost step with the results
        self._trace = trace

    @property
    def candidate_steps(self) -> list[int]:
        return [0, self.speculative_steps]

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        """Every captured size for both step counts: the crossover moves at run time."""
        return self._cuda_graph_bs

    def get_steps_for_batch(self, batch_size: int) -> int:
        now = self._clock()
        last = self._pending[-1] if self._pending else None
        if last is not None and last.seconds is None:
            last.seconds = now - last.start if batch_size > 0 else 0.0
        self._flush()
        if batch_size <= 0:
            self._previous = None
            return 0 if self.controller.mode is Mode.PLAIN else self.speculative_steps
        mode = self.controller.decide(batch_size)
        step = _Step(mode, batch_size, now)
        self._after(step)
        self._pending.append(step)
        while len(self._pending) > self.MAX_PENDING:
            self._pending.pop(0)
            self.dropped += 1
        return 0 if mode is Mode.PLAIN else self.speculative_steps

    def leave_out_last(self) -> None:
        """The step just decided runs as neither mode (the catch-up step that prepares the draft
        when speculation resumes): its result is paired with it and not recorded."""
        if self._pending:
            self._pending[-1].left_out = self._pending[-1].catch_up = True

    def _after(self, step: _Step) -> None:
        """Leave out a step whose interval times another kind's step, or, the first after an
        idle gap, the prefill that ended it."""
        previous, self._previous = self._previous, step
        if previous is None or previous.kind != step.kind:
            step.left_out = True

    def note_idle(self) -> None:
        """The scheduler found nothing to run: the step before this has no step time (the interval
        to the next decode step would be the idle gap, and a burst after a pause would charge the
        whole pause to the last step before it)."""
        self._previous = None
        last = self._pending[-1] if self._pending else None
        if last is not None and last.seconds is None:
            last.seconds = 0.0
            self._flush()
        flush = getattr(self._trace, "flush", None)
        if flush is not None:
            flush()

    def note_prefill(self, tokens: int) -> None:
        """The scheduler launched a prefill batch of `tokens` new tokens: it falls inside the
        interval of the last step decided (for the trace; the estimate does not use it)."""
        last = self._pending[-1] if self._pending else None
        if last is not None and last.seconds is None:
            last.prefills += 1
        if self._trace is not None:
            self._trace({"t": round(self._clock(), 6), "kind": "prefill", "tokens": int(tokens)})

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> int | None:
        """The output tokens of the oldest step waiting for them: the accepted drafts plus one per
        request. Returns None: the step count is chosen per batch, in get_steps_for_batch."""
        step = next((s for s in self._pending if s.output_tokens is None), None)
        if step is None:
            return None
        if len(num_correct_drafts_per_req) != step.batch_size:
            self.dropped += len(self._pending)
            self._pending = []
            return None
        step.output_tokens = sum(num_correct_drafts_per_req) + step.batch_size
        self._flush()
        return None

    def _flush(self) -> None:
        """Record the oldest steps that have both their time and their tokens."""
        while self._pending and self._pending[0].seconds is not None and self._pending[0].output_tokens is not None:
            s = self._pending.pop(0)
            recorded = not s.left_out and bool(s.seconds) and s.output_tokens is not None
            if recorded:
                self.controller.record(s.mode, s.batch_size, s.seconds or 0.0, s.output_tokens or 0)
            elif not s.left_out:
                self.dropped += 1  # no time (idle after it)
            if self._trace is not None:
                self._trace({"t": round(s.start, 6), "kind": s.kind, "batch": s.batch_size,
                             "seconds": round(s.seconds or 0.0, 6), "tokens": s.output_tokens,
                             "recorded": recorded, "prefills": s.prefills,
                             "crossover": self.controller.crossover()})


class StepTrace:
    """AutoPolicy's trace as JSON lines in a file (AUTO_TRACE_ENV): buffered, written out
    whenever the server goes idle (flush) and when the process exits."""

    def __init__(self, path: str) -> None:
        import atexit
        import json

        self._dumps = json.dumps
        try:
            self._file = open(path, "a", buffering=1 << 16, encoding="utf-8")  # noqa: SIM115 (kept open)
        except OSError as exc:
            raise ValueError(f"{AUTO_TRACE_ENV}={path}: cannot append `auto`'s step trace there "
                             f"({exc.strerror}); give a writable file path, or unset it") from exc
        atexit.register(self._file.close)

    def __call__(self, record: dict[str, object]) -> None:
        self._file.write(self._dumps(record, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        self._file.flush()
