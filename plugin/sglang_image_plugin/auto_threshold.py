"""The threshold `auto`: the server finds where speculation stops paying.

Pure Python (no torch, no sglang), so it is tested alone on a CPU. A worker hook calls, per
decode step:

    mode = controller.decide(batch_size)                                 # before the step
    controller.record(mode, batch_size, step_seconds, output_tokens)     # after it

step_seconds is the step's wall time as the scheduler sees it (with overlap scheduling, the time
between the starts of two decode steps); a catch-up step that prepares the draft when speculation
resumes is not recorded. AutoPolicy (auto_policy.py) does this behind upstream's
adaptive-speculation policy protocol (K draft steps or upstream's zero-step tier), timing the
steps itself.

What it estimates: per batch-size bucket, the output tokens/s of a speculative step (the live
accept length per request over its step time) and of a plain step (one token per request), both
at the batch size the bucket's traffic runs at (each mode's step time interpolated between the
buckets it was measured in: within a bucket the two modes are seldom measured at the same batch
sizes). A mode's step time in a bucket is the median of its recent steps there, and a bucket
counts once both modes have `min_samples` of them: a step timed by the scheduler's clock may
carry a first use's compile, a wave of prefills or an abort, and one such step in a mean of ten
outweighs the difference between the modes. But the prefills between the steps are the traffic's
cost too, and a plain step, being short, meets more of them per token: so each mode's median is
multiplied by what its dwells (runs of 16 steps and more in one bucket) pay over their median
(auto_estimate.Overhead), taken from the nearest bucket the mode dwelt in where it did not dwell
in this one, and left uncorrected while either mode dwelt nowhere. The buckets
(AutoConfig.edges): powers of two up to 32, then four per octave (40, 48, 56, 64, 80, ...) up to
max_batch_size, so that a crossover between two powers of two (speculation winning at 192
requests, losing at 256) has an edge near it. Speculation pays in a prefix of the batch sizes (its step costs a multiple of a plain one's
compute, so its advantage shrinks as the batch fills the GPU); the crossover is the split
that maximizes the summed log advantage of the speculating buckets. Every `update_every` steps it
moves there only if that beats the current split by `margin` plus twice the noise of the
difference (from the spread of the step times, taken as at least `step_noise` a step, so that a
few steps that happened to run alike do not pass for a sure figure): hysteresis on the estimate.
A move takes along only the measured buckets whose own figures favour it by the margin and one
standard deviation, so a clear win at 225-256 requests does not carry a tie at 161-192 with it.
Running batches switch like a fixed threshold N = crossover: plain above N, speculative again at
N - N//8 (hysteresis on the batch size), so one arrival does not flip the mode; when the crossover
moves, the running batch takes its side at once.

The live accept length is measured wherever the server speculates and applied to every bucket,
so a shift of acceptance moves the crossover without exploring. A bucket whose other mode has no
recent measurement (`stale_steps`) of `min_samples` steps runs that mode for `explore_steps`
steps, at most one such burst every `explore_gap` steps; so does any measured bucket, near the
crossover or far from it, whose own figures say the other side, or neither beyond their noise:
its other mode is often timed in one burst as the load arrives, among the load's prefills, and
waiting `stale_steps` for the next one left it undecided for tens of seconds. Exploration costs at
most explore_steps / explore_gap of the steps. Steps measured after a stale gap replace the old
ones where the two differ beyond their noise: a mode timed once, while something else slowed the
GPU, and never again (the other mode winning there), would otherwise hold the bucket's decision
for good.
The estimate above cannot tell the modes apart where they differ by less than its noise, and a
bucket's first figures may come from a few steps of odd traffic (a warm-up's 5 fast plain steps
set 161-192 plain on a GPU, docs/validation.md row 70, and the prefills' noise held it there at
0.89x of the better mode). So a measured bucket on either side of the crossover whose figures do
not decide gets a trial (Trial): blocks of `trial_block` steps of each mode in turn, each pair
of blocks a ratio of tokens over seconds with the prefills in, as the bench compares two
servers, until their mean clears a tie by twice its noise or `trial_max_pairs` pairs are in;
then the crossover moves past that bucket if the mean says its other side by the margin, and the
mean stands for the bucket's figure for `trial_gap` steps. One trial runs at a time, in the
bucket's own traffic only, and a bucket gets one every `trial_gap` steps at most (done or given
up when its traffic leaves for `trial_timeout` steps).
A cold start may take a prior (for example step times timed at CUDA-graph capture, per batch size):
one step of each mode in each bucket it covers, which counts there at once and which the steps
measured then outvote; without one it speculates everywhere, as EAGLE-3 does, until measurements
say otherwise.

Every decision is a function of the measurements given, without randomness. Step times differ
between tensor-parallel ranks, so a TP hook passes `agree` (a broadcast of rank 0's Decision):
the estimate reaches the decisions only through it (the crossover, and the buckets still being
explored), at the same steps on every rank; everything else follows from the batch sizes
and the order of the calls, which the ranks share.

Here the controller; its settings are auto_config.py's (AutoConfig, Prior), its statistics
auto_estimate.py's, and AutoPolicy and StepTrace auto_policy.py's. The settings and Mode are
reachable here too, for the readers of the controller (bench/autotrace.py).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sglang_image_plugin.auto_config import (
    AutoConfig,
    Prior,
    quarter_octave_edges,
    resume_batch_size,
)
from sglang_image_plugin.auto_estimate import DWELL_SKIP, Average, Bucket, Dwells, seconds_at
from sglang_image_plugin.setting import AUTO, Mode

__all__ = ["AutoConfig", "AutoController", "BucketEstimate", "Decision", "Mode", "Prior", "Trial",
           "quarter_octave_edges", "resume_batch_size"]
NO_TRIAL = -1  # Decision.trial: none runs


@dataclass(frozen=True)
class Decision:
    """What the estimate decides at an update, all a rank needs to act as the others do."""

    split: int  # buckets [0, split) speculate
    undecided: frozenset[int]  # buckets still explored: their figures contradict or do not decide
    trial: int = NO_TRIAL  # the bucket a trial runs in (Trial)


@dataclass
class Trial:
    """Both modes compared in one bucket as the bench compares two servers: blocks of
    trial_block recorded steps of one mode, in the order A B B A A B ..., each pair of blocks
    a ratio of output tokens over seconds, the prefills between the steps in (a block is long
    enough to carry its own mode's rhythm of arrivals; its first DWELL_SKIP steps, which carry
    the other mode's, are not counted). The pairs' mean is the bucket's advantage, without the
    medians, their corrections or their noise (AutoController._overheads)."""

    index: int  # the bucket
    first: Mode  # the mode of the first block
    config: AutoConfig  # trial_block, trial_pairs, trial_max_pairs, margin
    last: int  # the controller's step count at the start, then when a step last counted
    blocks: list[tuple[float, float]] = field(default_factory=list)  # per block done: tokens, seconds
    steps: int = 0  # recorded steps of the block going on
    tokens: float = 0.0
    seconds: float = 0.0

    def mode_of(self, block: int) -> Mode:
        """The mode of block number `block` (A B B A: each pair's order turns, so a drift of the
        traffic falls on both modes alike)."""
        return self.first if block % 4 in (0, 3) else self.first.other()

    @property
    def mode(self) -> Mode:
        """The mode of the block going on."""
        return self.mode_of(len(self.blocks))

    @property
    def pairs(self) -> int:
        return len(self.blocks) // 2

    @property
    def concluded(self) -> bool:
        """trial_pairs pairs and their mean clear of a tie by the margin and 2 sd, or
        trial_max_pairs pairs. (It rests on this rank's seconds: ranks agree on the end through
        Decision.trial.)"""
        cfg = self.config
        if len(self.blocks) % 2 or self.pairs < cfg.trial_pairs:
            return False
        mean, variance = self.verdict()
        return self.pairs >= cfg.trial_max_pairs or abs(mean) > cfg.margin + 2 * math.sqrt(variance)

    def add(self, mode: Mode, seconds: float, tokens: int, now: int) -> None:
        """A recorded step in the trial's bucket; one of the other mode (a step decided before the
        block changed, recorded after) is not the block's. The blocks end by the count of steps
        alone, so that every rank's end alike."""
        if mode is not self.mode or self.pairs >= self.config.trial_max_pairs:
            return
        self.steps += 1
        self.last = now
        if self.steps > DWELL_SKIP:
            self.tokens += tokens
            self.seconds += seconds
        if self.steps >= self.config.trial_block:
            self.blocks.append((self.tokens, self.seconds))
            self.steps, self.tokens, self.seconds = 0, 0.0, 0.0

    def verdict(self) -> tuple[float, float]:
        """The mean over the pairs of log(speculative tokens/s / plain tokens/s), and its
        variance (the pairs' spread over their count)."""
        ratios = []
        for k in range(0, len(self.blocks) - 1, 2):
            (t0, s0), (t1, s1) = self.blocks[k], self.blocks[k + 1]
            r = math.log(max(t0, 1.0) / s0) - math.log(max(t1, 1.0) / s1)
            ratios.append(r if self.mode_of(k) is Mode.SPECULATIVE else -r)
        mean = statistics.fmean(ratios)
        variance = statistics.variance(ratios) / len(ratios) if len(ratios) > 1 else math.inf
        return mean, variance


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
    speculative_overhead: float = 1.0  # what each mode's dwells add to its median step (_overheads)
    plain_overhead: float = 1.0


class AutoController:
    """Decides per decode step whether to speculate; see the module docstring."""

    def __init__(self, config: AutoConfig, prior: Prior | None = None,
                 agree: Callable[[Decision], Decision] | None = None) -> None:
        self.config = config
        edges = config.edges
        self._buckets = [Bucket(low + 1, high, config.window, config.step_noise, tuple(Mode))
                         for low, high in zip((0, *edges[:-1]), edges, strict=True)]
        self._edges = edges
        self._agree = agree
        self._accept = Average()
        self._split = len(self._buckets)  # buckets [0, split) speculate: all, as EAGLE-3 does
        self._mode = Mode.SPECULATIVE
        self._last = Mode.SPECULATIVE
        self._burst_left = 0
        self._burst_mode = Mode.PLAIN
        self._last_burst: int | None = None
        # the measured buckets whose figures contradict their side or are within their noise: more
        # measurements there decide where the crossover goes
        self._undecided: set[int] = set()
        self._trial: Trial | None = None
        # per bucket, the last trial's mean, its variance, the step count when it ended and the
        # live accept length then
        self._verdicts: dict[int, tuple[float, float, int, float | None]] = {}
        self._tried: dict[int, int] = {}  # per bucket, the step count its last trial started at
        self._dwells: Dwells[Mode] = Dwells()
        # per mode, (bucket index, overhead ratio, its relative variance) where it dwelt: _overheads
        self._dwelt: dict[Mode, list[tuple[int, float, float]]] | None = None
        self.steps = 0
        self.explore_steps = 0
        self.trial_steps = 0  # steps a trial ran in the mode the crossover did not give
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
        index = self._bucket(batch_size)
        if self._trial is not None and self._trial.index == index:
            mode = self._trial.mode
            self.trial_steps += mode is not self._mode
        else:
            mode = self._explore(index) or self._mode
            self.explore_steps += mode is not self._mode
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
        index = self._bucket(batch_size)
        bucket = self._buckets[index]
        seen = bucket.last_seen[mode]
        stale = seen is not None and self.steps - seen > self.config.stale_steps
        bucket.add(mode, step_seconds, batch_size, stale, self.config.min_samples)
        if stale:
            self._dwells.end()
        if self._dwells.add(index, mode, step_seconds, bucket):
            self._dwelt = None
        bucket.batch[mode].add(batch_size, self.config.memory)
        bucket.last_seen[mode] = self.steps
        if mode is Mode.SPECULATIVE:
            self._accept.add(output_tokens / batch_size, self.config.accept_memory, batch_size)
        if self._trial is not None and self._trial.index == index:
            self._trial.add(mode, step_seconds, output_tokens, self.steps)

    def note_idle(self) -> None:
        """The server ran nothing (no request left): the next batch takes its side by the
        crossover alone (the hysteresis holds a mode against a running batch's wobble, and an
        idle server has none). A dwell ends there."""
        self._mode_for = -1
        self._dwells.end()

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
            seconds = self._seconds(i, curves)
            spec, plain = (None, None) if seconds is None else seconds[:2]
            overhead, _ = self._overheads(i)  # for the report; _seconds has applied it
            measured = self._counts(b)
            out.append(BucketEstimate(b.low, b.high, round(ref, 1),
                                      ref * accept / spec if measured and spec and accept else None,
                                      ref / plain if measured and plain else None, i < self._split,
                                      len(b.seconds[Mode.SPECULATIVE]), len(b.seconds[Mode.PLAIN]),
                                      overhead[Mode.SPECULATIVE], overhead[Mode.PLAIN]))
        return out

    def estimates_text(self) -> str:
        """The buckets measured in both modes, for a log line: `low-high: speculative / plain
        tokens/s (steps of each in the median, what each mode's dwells add to it)`; then the
        buckets a trial decides: `low-high: trial speculative / plain N.NNNx [low-high, 2 sd]`."""
        parts = [f"{e.low}-{e.high}: {e.speculative_tok_s:.0f} / {e.plain_tok_s:.0f} tok/s "
                 f"({e.speculative_steps}/{e.plain_steps} steps"
                 + (f", x{e.speculative_overhead:.2f}/x{e.plain_overhead:.2f} by dwells)"
                    if (e.speculative_overhead, e.plain_overhead) != (1.0, 1.0) else ")")
                 for e in self.estimates() if e.speculative_tok_s is not None and e.plain_tok_s is not None]
        for i, (mean, variance) in sorted(self._fresh_verdicts().items()):
            sd = math.sqrt(variance)
            parts.append(f"{self._bucket_range(i)}: trial speculative / plain {math.exp(mean):.3f}x "
                         f"[{math.exp(mean - 2 * sd):.3f}-{math.exp(mean + 2 * sd):.3f}]")
        return "; ".join(parts) if parts else "no bucket measured in both modes yet"

    def state(self) -> dict[str, object]:
        """For server info and metrics."""
        accept = self._accept.value
        return {"threshold": AUTO, "crossover": self.crossover(), "mode": str(self._mode),
                "accept_length": round(accept, 3) if accept is not None else None,
                "speculative_steps": self.steps_by_mode[Mode.SPECULATIVE],
                "plain_steps": self.steps_by_mode[Mode.PLAIN], "explore_steps": self.explore_steps,
                "mode_changes": self.mode_changes, "crossover_changes": self.crossover_changes,
                "trial": self.trial, "trial_steps": self.trial_steps}

    @property
    def trial(self) -> str | None:
        """The bucket a trial runs in now (low-high), None where none does."""
        return self._bucket_range(self._trial.index) if self._trial is not None else None

    def _bucket_range(self, index: int) -> str:
        b = self._buckets[index]
        return f"{b.low}-{b.high}"

    # ------------------------------------------------------------------ inside
    def _bucket(self, batch_size: int) -> int:
        return min(bisect.bisect_left(self._edges, batch_size), len(self._edges) - 1)

    def _recent(self, bucket: Bucket[Mode], mode: Mode) -> bool:
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
            seconds = self._seconds(i, curves)
            if seconds is not None:
                spec, plain, overhead_variance = seconds
                variance = sum(b.seconds[m].relative_variance() for m in Mode) + overhead_variance
                known[i] = (math.log(accept * plain / spec), variance)
        for i, (mean, variance) in self._fresh_verdicts().items():
            known[i] = (mean, variance)  # a trial's figure stands for the bucket's
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

    def _seconds(self, index: int,
                 curves: dict[Mode, list[tuple[float, float]]]) -> tuple[float, float, float] | None:
        """Each mode's seconds a step at the batch size bucket `index`'s traffic runs at, its
        prefills included (median step times Overhead), and the relative variance the overheads add
        to their ratio; None where a mode has no curve."""
        ref = self._buckets[index].reference_batch()
        spec = seconds_at(curves[Mode.SPECULATIVE], ref)
        plain = seconds_at(curves[Mode.PLAIN], ref)
        if spec is None or plain is None:
            return None
        overhead, variance = self._overheads(index)
        return spec * overhead[Mode.SPECULATIVE], plain * overhead[Mode.PLAIN], variance

    def _overheads(self, index: int) -> tuple[dict[Mode, float], float]:
        """Per mode, its mean step over its median step in bucket `index`, prefills in
        (auto_estimate.Overhead), and the relative variance the two add to the modes' ratio. A mode
        without dwells there takes the ratio of the nearest bucket it dwelt in (a mode runs for
        long only on its own side of the crossover, and its prefill rhythm changes slowly with the
        batch). If a mode dwelt nowhere, neither is corrected (no evidence, no correction): the
        medians decide as they are."""
        if self._dwelt is None:  # recomputed only when a dwell adds a chunk
            self._dwelt = {m: [(j, o.value, o.relative_variance()) for j, b in enumerate(self._buckets)
                               if (o := b.overhead[m]).value is not None] for m in Mode}
        if not all(self._dwelt.values()):
            return dict.fromkeys(Mode, 1.0), 0.0
        nearest = {m: min(self._dwelt[m], key=lambda d: (abs(d[0] - index), d[0])) for m in Mode}
        return {m: n[1] for m, n in nearest.items()}, sum(n[2] for n in nearest.values())

    def _counts(self, bucket: Bucket[Mode]) -> bool:
        """Whether both modes' step times in this bucket have enough steps to decide on."""
        return all(bucket.seconds[m].enough(self.config.min_samples) for m in Mode)

    def _curves(self) -> dict[Mode, list[tuple[float, float]]]:
        """Per mode, the (batch size, step seconds) of the buckets it counts in, by batch size."""
        return {m: sorted(p for b in self._buckets
                          if b.seconds[m].enough(self.config.min_samples) and (p := b.point(m)) is not None)
                for m in Mode}

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
        if not sums[best] - sums[current] > margin + 2 * noise:
            return current
        # a measured bucket the move passes over goes along only if its own figures favour the
        # move by the margin and one standard deviation of their noise: a clear win above 224
        # requests does not carry 161-192, whose figures tie, to plain with it (where the
        # hysteresis would then hold it)
        step = 1 if best > current else -1
        for k in range(current, best, step):
            i = k if step > 0 else k - 1
            d, variance = advantages[i]
            if self._counts(self._buckets[i]) and d * step <= margin + math.sqrt(variance):
                return k
        return best

    def _fresh_verdicts(self) -> dict[int, tuple[float, float]]:
        """The trials' figures not older than trial_gap steps, by bucket: the mean and its
        variance, the mean moved by the live accept length's change since (a speculative step's
        tokens scale with it, as the estimate applies it to every bucket)."""
        accept = self._accept.value
        return {i: (mean + (math.log(accept / then) if accept and then else 0.0), variance)
                for i, (mean, variance, at, then) in self._verdicts.items()
                if self.steps - at <= self.config.trial_gap}

    def _after_trial(self, index: int, mean: float) -> int:
        """The split after a trial in bucket `index` ended with `mean`: one bucket further where it
        says the other side of the split beyond the margin (the pairs' own noise aside: at a tie
        either side costs as little, and the next trial there may move it back)."""
        bar = self.config.margin
        if index == self._split and mean > bar:
            return index + 1
        if index == self._split - 1 and mean < -bar:
            return index
        return self._split

    def _trial_at(self, split: int, undecided: set[int]) -> int:
        """The bucket a trial should run in now, else NO_TRIAL: on either side of the split, its
        traffic there lately, its figures not deciding, no trial started there (done or given up)
        within trial_gap steps."""
        for i in (split, split - 1):
            if (0 <= i < len(self._buckets) and i in undecided
                    and self.steps - self._tried.get(i, -self.config.trial_gap - 1) > self.config.trial_gap):
                seen = [s for s in self._buckets[i].last_seen.values() if s is not None]
                if seen and self.steps - max(seen) <= self.config.update_every:
                    return i
        return NO_TRIAL

    def _update(self) -> None:
        cfg = self.config
        advantages = self._advantages()
        split = self._split if advantages is None else self._best_split(advantages, cfg.margin)
        trial, next_trial = self._trial, NO_TRIAL
        if trial is not None and trial.concluded:
            split = self._after_trial(trial.index, trial.verdict()[0])
        elif trial is not None and self.steps - trial.last <= cfg.trial_timeout:
            next_trial = trial.index  # going on (given up where its traffic left the bucket)
        undecided = set()
        if advantages is not None:
            bar, fresh = cfg.margin, self._fresh_verdicts()
            for i, (d, variance) in enumerate(advantages):
                # measured, and its figures say the other side, or neither beyond their noise: a
                # bucket holds the split there only as long as that noise does, wherever it lies
                against = d < 0 if i < split else d > 0
                if (i not in fresh and self._counts(self._buckets[i])
                        and (against or abs(d) <= bar + 2 * math.sqrt(variance))):
                    undecided.add(i)
        if trial is None:
            next_trial = self._trial_at(split, undecided)
        decision = Decision(split, frozenset(undecided), next_trial)
        if self._agree is not None:
            decision = self._agree(decision)
        if decision.split != self._split:
            self._split = decision.split
            self.crossover_changes += 1
        self._undecided = set(decision.undecided)
        if trial is not None and decision.trial != trial.index:  # it ended (rank 0's word)
            if trial.pairs >= cfg.trial_pairs:
                self._verdicts[trial.index] = (*trial.verdict(), self.steps, self._accept.value)
            self._trial = None
        if decision.trial != NO_TRIAL and self._trial is None:
            first = Mode.PLAIN if decision.trial < self._split else Mode.SPECULATIVE  # the other side first
            self._trial = Trial(decision.trial, first, cfg, self.steps)
            self._tried[decision.trial] = self.steps

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
