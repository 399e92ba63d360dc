"""`auto`'s settings: how the controller (auto_threshold.py) measures and how cautiously it moves
(AutoConfig), what it may start from (Prior), the bucket edges and the batch size at which a plain
batch speculates again.

Pure Python (no torch, no sglang).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from sglang_image_plugin.auto_estimate import DWELL_SKIP

# The flag, its parser and the fixed threshold's hysteresis live with the other flags.
from sglang_image_plugin.setting import THRESHOLD_FLAG, default_hysteresis


def resume_batch_size(threshold: int) -> int:
    """Below a threshold N, the batch size at which a plain server speculates again: N - N//8 (at
    least one below N where N > 1), so that one request arriving or finishing near N does not flip
    the mode on every step."""
    return threshold - default_hysteresis(threshold)


FINE_FROM = 32  # the default bucket edges: powers of two up to here, then four per octave


def quarter_octave_edges(max_batch_size: int) -> tuple[int, ...]:
    """Bucket upper edges 1, 2, 4, ..., FINE_FROM, then four per octave, the octave's start times
    1.25, 1.5, 1.75 and 2 (40, 48, 56, 64, 80, 96, 112, 128, 160, ...), and max_batch_size last.
    Where the batch fills the GPU, speculation's advantage falls by several percent a quarter
    octave: a crossover between two powers of two (speculation winning at 192 requests, losing at
    256) would otherwise be rounded to one of them. Below FINE_FROM a quarter octave is a request
    or two."""
    edges = []
    edge = 1
    while edge < max_batch_size:
        edges.append(edge)
        edge += edge if edge < FINE_FROM else (1 << (edge.bit_length() - 1)) // 4
    return (*edges, max_batch_size)


@dataclass(frozen=True, kw_only=True)
class AutoConfig:
    """How the controller measures and how cautiously it moves; the defaults suit a server that
    runs hundreds of steps a second."""

    max_batch_size: int  # the largest decode batch the server runs (its max running requests)
    # upper edges of the batch-size buckets, increasing, the last = max_batch_size (default:
    # quarter_octave_edges; a server may pass its CUDA-graph batch sizes: step time is flat between
    # two of them)
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
    # from the old beyond their noise they replace them (see auto_estimate.Bucket.add)
    stale_steps: int = 1024
    # steps of one exploration burst; the first one or two time the step before (see AutoPolicy)
    explore_steps: int = 6
    explore_gap: int = 256  # steps between the starts of two bursts, at least
    min_samples: int = 4  # steps of each mode a bucket needs before it counts
    # the least spread of one step's time the estimate assumes: a few steps can look as alike as
    # a few microseconds by chance, and a burst of them would then outvote a window (GPU, 8B
    # shape, 64 requests: 4 speculative steps replaced 30 and moved the crossover the wrong way)
    step_noise: float = 0.05
    # a trial (auto_threshold.Trial) at the bucket on either side of the crossover, where its
    # figures do not decide: pairs of blocks, each trial_block steps of one mode in that bucket
    # (the first few of a block not counted); at most one a bucket every trial_gap steps, given up
    # when the traffic leaves that bucket for trial_timeout steps
    trial_block: int = 64
    trial_pairs: int = 3  # at least; it goes on until the pairs decide beyond their noise
    trial_max_pairs: int = 12  # or up to this many, where they tie
    trial_gap: int = 8192
    trial_timeout: int = 2048

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
        for name in ("update_every", "stale_steps", "explore_steps", "explore_gap", "min_samples",
                     "trial_gap", "trial_timeout"):
            if getattr(self, name) < 1:
                problems.append(f"{name} {getattr(self, name)} < 1")
        if not 2 <= self.trial_pairs <= self.trial_max_pairs:
            problems.append(f"trial_pairs {self.trial_pairs}, trial_max_pairs {self.trial_max_pairs}: "
                            "need 2 <= trial_pairs <= trial_max_pairs (a mean needs its spread)")
        if self.trial_block <= DWELL_SKIP:
            problems.append(f"trial_block {self.trial_block} <= {DWELL_SKIP} (the steps of a block not counted)")
        if self.explore_steps > self.explore_gap:
            problems.append(f"explore_steps {self.explore_steps} > explore_gap {self.explore_gap}")
        if problems:
            raise ValueError(f"{THRESHOLD_FLAG} auto: bad controller config: " + "; ".join(problems))

    @property
    def edges(self) -> tuple[int, ...]:
        return self.bucket_edges or quarter_octave_edges(self.max_batch_size)

    @property
    def window(self) -> int:
        """The steps a bucket's median step time is taken over: a mean forgetting at `memory`
        weighs (1 + memory) / (1 - memory) samples' worth, and a median needs pi / 2 times the
        samples of a mean for its precision."""
        return max(1, round(math.pi / 2 * (1 + self.memory) / (1 - self.memory)))

    @property
    def most_trial_steps(self) -> int:
        """The most steps one trial runs in the mode the crossover does not give its bucket."""
        return self.trial_max_pairs * self.trial_block

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
