"""Paired windows: the order of the servers in each block, the ratio of two servers within a block,
and the median of those ratios with a bootstrap 95% interval.

A host's speed drifts by tens of percent between minutes, so two servers are only compared within
a block: one short window on each, back to back, the order reversed every other block (A B, B A,
A B, ...), so that a steady drift and the cost of coming first cancel over the blocks. A ratio is
taken within each block; across blocks only ratios are pooled, never tokens/s.

Standard library only: this runs on a bare GPU host.
"""
from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

BOOTSTRAP_RESAMPLES = 4000
BOOTSTRAP_SEED = 20261203  # fixed: the same windows always print the same interval
LEVEL = 0.95


def block_order(names: Sequence[str], block: int) -> list[str]:
    """The servers of block `block` in the order they are measured: as given, reversed every other
    block (A B, B A, ...: each server comes first as often as it comes last)."""
    return list(names) if block % 2 == 0 else list(reversed(names))


def bootstrap_interval(values: Sequence[float], stat: Callable[[Sequence[float]], float] = statistics.median,
                       level: float = LEVEL, resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """The percentile bootstrap interval of `stat` over `values`: `stat` of `resamples` samples
    drawn with replacement, their (1 - level) / 2 and (1 + level) / 2 quantiles."""
    if not values:
        raise ValueError("no values to bootstrap")
    rnd = random.Random(seed)
    n = len(values)
    return percentiles([stat([values[rnd.randrange(n)] for _ in range(n)]) for _ in range(resamples)], level)


def percentiles(stats: Sequence[float], level: float = LEVEL) -> tuple[float, float]:
    """The (1 - level) / 2 and (1 + level) / 2 quantiles of a bootstrap's statistics."""
    ordered = sorted(stats)
    k = len(ordered) - 1
    return ordered[int((1 - level) / 2 * k)], ordered[round((1 + level) / 2 * k)]


@dataclass(frozen=True)
class Ratio:
    """One comparison at one concurrency: the per-block ratios, their median and interval."""
    ratios: tuple[float, ...]
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, ratios: Sequence[float]) -> Ratio | None:
        if not ratios:
            return None
        lo, hi = bootstrap_interval(ratios)
        return cls(tuple(ratios), statistics.median(ratios), lo, hi)

    def as_dict(self) -> dict[str, Any]:
        return {"median": round(self.median, 4), "low": round(self.low, 4), "high": round(self.high, 4),
                "pairs": len(self.ratios), "ratios": [round(r, 4) for r in self.ratios]}

    def text(self) -> str:
        """"0.98x [0.95-1.01]": the median and its 95% interval."""
        return f"{self.median:.2f}x [{self.low:.2f}-{self.high:.2f}]"


def rate(block: dict[str, Any], name: str) -> float | None:
    """A server's tokens/s in a block, None where it has no clean window there."""
    window = block.get("windows", {}).get(name)
    if not window or window.get("errors") or not window.get("tok_per_s"):
        return None
    return float(window["tok_per_s"])


def block_ratios(blocks: Sequence[dict[str, Any]], name: str, against: Sequence[str]) -> list[float]:
    """Per block: `name`'s tokens/s over the best of `against` in the same block (blocks where one of
    them has no clean window are left out)."""
    out = []
    for block in blocks:
        got = rate(block, name)
        others = [rate(block, other) for other in against]
        if got is not None and others and all(o is not None for o in others):
            out.append(got / max(o for o in others if o is not None))
    return out


def compare(blocks: Sequence[dict[str, Any]], name: str, against: Sequence[str]) -> Ratio | None:
    return Ratio.of(block_ratios(blocks, name, against))


def compare_through(blocks: Sequence[dict[str, Any]], name: str, other: str, reference: str,
                    floor: float = 0.0) -> Ratio | None:
    """`name` over `other` where no block holds both (two calls, each beside `reference`):
    `name` / `reference` and `other` / `reference`, each taken within its own blocks, and the
    quotient of their medians, median(name / ref) / max(floor, median(other / ref)). The interval
    resamples both sets of ratios independently; the per-block ratios kept are name / ref over
    that same divisor. None without both sets."""
    mine = block_ratios(blocks, name, [reference])
    theirs = block_ratios(blocks, other, [reference])
    if not mine or not theirs:
        return None

    def stat(a: Sequence[float], b: Sequence[float]) -> float:
        return statistics.median(a) / max(floor, statistics.median(b))

    rnd = random.Random(BOOTSTRAP_SEED)
    low, high = percentiles([stat([mine[rnd.randrange(len(mine))] for _ in mine],
                                  [theirs[rnd.randrange(len(theirs))] for _ in theirs])
                             for _ in range(BOOTSTRAP_RESAMPLES)])
    divisor = max(floor, statistics.median(theirs))
    return Ratio(tuple(r / divisor for r in mine), stat(mine, theirs), low, high)


def compare_to_better_through(blocks: Sequence[dict[str, Any]], name: str, other: str,
                              reference: str) -> Ratio | None:
    """`name` over the better of `reference` and `other` where no block holds both `name` and
    `other`: compare_through with `other` / `reference` floored at 1 (`reference` itself is the
    better where `other` is slower)."""
    return compare_through(blocks, name, other, reference, floor=1.0)
