"""`auto`'s statistics, which the controllers (auto_threshold.py, auto_depth.py) decide with: per
batch-size bucket and mode (or draft depth), the recent step seconds (their median and its noise)
and the batch sizes of the traffic; a mode's step seconds at any batch size from the buckets
it was measured in; and what a mode's dwells add to its median step (Overhead, Dwells).

Pure Python (no torch, no sglang).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)  # what a bucket's step times are kept by: a Mode, a depth

EXTRAPOLATION_SPAN: Final = 1.5  # see seconds_at
DWELL_SKIP: Final = 4  # steps of a run left out: the first after a change of mode or bucket
DWELL_STEPS: Final = 16  # steps of a run folded into its Overhead at a time
OVERHEAD_MEMORY: Final = 0.95  # weight a dwell's chunks keep per new chunk (~40 chunks, ~600 steps)
OVERHEAD_CHUNKS: Final = 8  # chunks (128 steps) before a mode's Overhead counts in a bucket: a load's
# first requests end together, so a dwell's first chunks may carry none of the prefills that follow


@dataclass
class Average:
    """A mean that forgets: each new sample keeps `memory` of the weight of those before."""

    total: float = 0.0
    weight: float = 0.0

    def add(self, value: float, memory: float, weight: float = 1.0) -> None:
        self.total = self.total * memory + value * weight
        self.weight = self.weight * memory + weight

    @property
    def value(self) -> float | None:
        return self.total / self.weight if self.weight > 0 else None


class StepTimes:
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

    def extend(self, other: StepTimes) -> None:
        self._samples.extend(other._samples)
        self._batches.extend(other._batches)

    @property
    def batch(self) -> float | None:
        return statistics.fmean(self._batches) if self._batches else None

    def __len__(self) -> int:
        return len(self._samples)

    def differs(self, other: StepTimes) -> bool:
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


class Overhead:
    """What a mode's steps cost beyond its median step in one bucket, prefills in, over the runs it
    dwells there (Dwells): per chunk of DWELL_STEPS steps, their mean over their median.

    A median leaves out the prefills that fall between the decode steps, and on a GPU under load
    they take a fifth to a third of the time and differ by mode: a plain step is short, so the
    arrivals reach it in more and smaller prefill batches (8B shape, one H100, docs/validation.md
    row 54: the mean step 1.16x the median at 192 requests speculating, 1.25x at 256 plain). A
    burst of a few steps of the other mode carries the arrivals of the mode before it, not its own
    rhythm; a dwell carries them. A chunk's own median (not the bucket's) keeps the ratio to the
    batch sizes it ran at, which change between chunks. One chunk is noisy (a wave of prefills
    falls in some), so this is the chunks' mean, not their median, and counts once
    OVERHEAD_CHUNKS are in. A wave also lifts its chunk's median, so the ratio errs low, toward
    the medians alone: on row 54's steps plain at 225-256 reads 1.17."""

    def __init__(self) -> None:
        self._ratio = Average()
        self._square = Average()
        self.chunks = 0

    def add(self, seconds: Sequence[float]) -> None:
        ratio = statistics.fmean(seconds) / statistics.median(seconds)
        self._ratio.add(ratio, OVERHEAD_MEMORY)
        self._square.add(ratio * ratio, OVERHEAD_MEMORY)
        self.chunks += 1

    @property
    def value(self) -> float | None:
        return self._ratio.value if self.chunks >= OVERHEAD_CHUNKS else None

    def relative_variance(self) -> float:
        """The squared standard error of the ratio over the ratio squared, the chunks counted as many
        as their forgetting mean weighs."""
        mean, square = self._ratio.value, self._square.value
        if mean is None or square is None:
            return 0.0
        count = min(self.chunks, (1 + OVERHEAD_MEMORY) / (1 - OVERHEAD_MEMORY))
        return max(square - mean * mean, 0.0) / (mean * mean) / count


class Dwells(Generic[Key]):
    """The run of steps going on: of one mode (key) in one bucket, recorded one after another. After
    its first DWELL_SKIP steps (a switch's transient: the catch-up, the other mode's arrivals) each
    DWELL_STEPS steps fold into that bucket's Overhead for the mode."""

    def __init__(self) -> None:
        self._run: tuple[int, Key] | None = None
        self._length = 0
        self._chunk: list[float] = []

    def add(self, index: int, key: Key, seconds: float, bucket: Bucket[Key]) -> bool:
        """One recorded step; whether it completed a chunk."""
        if self._run != (index, key):
            self.end()
            self._run = (index, key)
        self._length += 1
        if self._length <= DWELL_SKIP:
            return False
        self._chunk.append(seconds)
        if len(self._chunk) < DWELL_STEPS:
            return False
        bucket.overhead[key].add(self._chunk)
        self._chunk = []
        return True

    def end(self) -> None:
        """The run ends (another mode or bucket, an idle server): its unfolded steps are dropped."""
        self._run, self._length, self._chunk = None, 0, []


@dataclass
class Bucket(Generic[Key]):
    """One batch-size bucket: each mode's (or depth's: `keys`) recent step seconds, the batch sizes
    of its traffic, when each was last measured (the controller's step count)."""

    low: int
    high: int
    window: int
    step_noise: float
    keys: tuple[Key, ...]
    # per key: recent step seconds and their batch sizes; and the batch sizes of its traffic
    seconds: dict[Key, StepTimes] = field(init=False)
    batch: dict[Key, Average] = field(init=False)
    last_seen: dict[Key, int | None] = field(init=False)
    overhead: dict[Key, Overhead] = field(init=False)  # per key: what its dwells add to its median

    def __post_init__(self) -> None:
        self.seconds = {m: StepTimes(self.window, self.step_noise) for m in self.keys}
        self.overhead = {m: Overhead() for m in self.keys}
        self.batch = {m: Average() for m in self.keys}
        self.last_seen = dict.fromkeys(self.keys)
        self.fresh: dict[Key, StepTimes | None] = dict.fromkeys(self.keys)  # see add

    def add(self, mode: Key, seconds: float, batch_size: int, after_stale_gap: bool, min_samples: int) -> None:
        """One step's seconds. The steps after a stale gap gather apart until they are enough to
        decide on (the old ones count meanwhile); then they replace the old ones if the two differ
        beyond their noise (the GPU was not what it is now, e.g. shared), else they join them
        (a window of a few steps would decide on more noise)."""
        if after_stale_gap:
            self.fresh[mode] = StepTimes(self.window, self.step_noise)
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

    def point(self, mode: Key) -> tuple[float, float] | None:
        """(batch size, step seconds) of this mode's recent steps here, None before a measurement."""
        b, t = self.seconds[mode].batch, self.seconds[mode].value
        return None if b is None or t is None else (b, t)

    def reference_batch(self) -> float:
        """The batch size this bucket's traffic runs at, both modes pooled."""
        weight = sum(a.weight for a in self.batch.values())
        return sum(a.total for a in self.batch.values()) / weight if weight else float(self.high)


def seconds_at(points: list[tuple[float, float]], batch_size: float) -> float | None:
    """A mode's step seconds at `batch_size` from its curve (AutoController._curves): linear
    between the two measured buckets around it (within a bucket the two modes are seldom measured
    at the same batch sizes, and step time grows with the batch). Beyond the measured ones, a line
    from the nearest through one at least EXTRAPOLATION_SPAN times farther or nearer, its slope
    kept between flat and proportional to the batch (a step never gets faster, nor costlier per
    request, with more requests)."""
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
