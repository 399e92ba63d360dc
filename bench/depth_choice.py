"""The draft depth per load that a bench of fixed depths measured best, as a depth schedule.

    python -m bench schedule BENCH_JSON

BENCH_JSON is the bench.json of a call (or of `python -m bench merge`) that ran servers of one
draft depth each side by side: plain (depth 0), eagle3 (3) and eagle3_depth (`--depth 1,5,7`).
At each concurrency the servers are ranked within each block; the depth kept at a load is the one
whose tokens/s over the block's best has the highest median, under one rule: a larger load never
gets a deeper draft (the plugin's schedules and `auto` keep it). Among the depth sequences that
keep it, the one with the largest sum of log ratios wins; where the best depth at each load
already keeps it, that is the answer.

One card holds only so many servers, so the depths may come from several calls merged (`python -m
bench merge`), each beside one server they share (e.g. eagle3 in both). Where no block holds every
depth, each depth is compared with that shared server within its own blocks and the ratios are
compared through it (pairing.compare_through); the table marks such a load.

An edge between two loads measured with different depths lies at their geometric middle (loads are
swept on a log scale): the edge is a guess between two measurements, and the table says so.
Servers of another kind (threshold, schedule, auto) and fixed ones started with an environment
of their own (e.g. eagle3_upstream_combine) are not depths and are left out, named.

Prints the table (per load: each depth's tokens/s, the one kept, its ratio to the best there
and the best over the runner-up, with its 95% interval) and the flags that launch the schedule.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from bench import configs, pairing
from sglang_image_plugin.setting import DEPTH_SCHEDULE_FLAG, parse_schedule


class NoDepths(Exception):
    """A result this cannot choose from: the message names the cause and the fix."""


@dataclass(frozen=True)
class Load:
    """One concurrency: each depth's median tokens/s, the one kept, and how it compares."""
    concurrency: int
    tok_per_s: dict[int, float]
    best: int  # the depth with the highest median ratio to its block's best
    kept: int  # the depth the schedule runs here (best, unless a lighter load kept a shallower one)
    kept_over_best: float  # median over the blocks of kept / best (1.0 where they are one)
    best_over_next: pairing.Ratio | None  # the best over the runner-up depth, within blocks
    via: str | None = None  # the server the depths were compared through (no block held them all)


class Choice(NamedTuple):
    """What a bench of fixed depths says: the loads compared, in order; the servers that are no
    depth; the loads where the depths could not be compared (neither in one block nor through one
    server that ran beside each of them)."""
    loads: list[Load]
    left_out: list[str]
    not_compared: list[int]


def depth_servers(result: dict[str, Any]) -> tuple[dict[int, str], list[str]]:
    """The servers that are one draft depth each, by depth; the names left out."""
    by_depth: dict[int, str] = {}
    left_out = []
    for name, rec in configs.from_result(result).items():
        if name not in result.get("configs", []):  # configured, but it did not run (not_run)
            continue
        depth = rec.one_depth
        if depth is None:
            if not rec.twin:
                left_out.append(name)
        elif depth in by_depth:
            raise NoDepths(f"{by_depth[depth]} and {name} both run depth {depth}: keep one of them "
                           "(a merge of calls that ran the same depth twice, or a --depth list with a repeat)")
        else:
            by_depth[depth] = name
    if len(by_depth) < 2:
        raise NoDepths(f"servers of {len(by_depth)} draft depth(s) ({', '.join(by_depth.values()) or 'none'}); "
                       "run at least two side by side, e.g. --configs plain,eagle3,eagle3_depth --depth 1,5")
    return by_depth, left_out


def block_shares(blocks: Sequence[dict[str, Any]], by_depth: dict[int, str]) -> dict[int, list[float]]:
    """Per depth, its tokens/s over the block's best, in each block where every depth ran clean."""
    shares: dict[int, list[float]] = {d: [] for d in by_depth}
    for block in blocks:
        rates = {d: pairing.rate(block, name) for d, name in by_depth.items()}
        if any(r is None for r in rates.values()):
            continue
        top = max(r for r in rates.values() if r is not None)
        for d, r in rates.items():
            if r is not None:
                shares[d].append(r / top)
    return shares


def monotone_depths(scores: list[dict[int, float]]) -> list[int]:
    """One depth per load, in load order, never deeper than the one before, with the largest sum of
    scores (log ratios); ties go to the deeper depth at the lighter load."""
    depths = sorted({d for s in scores for d in s}, reverse=True)
    # best[d]: the best total of the loads so far with the last one at depth d, and its path
    best: dict[int, tuple[float, list[int]]] = {d: (scores[0].get(d, -math.inf), [d]) for d in depths}
    for s in scores[1:]:
        nxt: dict[int, tuple[float, list[int]]] = {}
        for d in depths:
            prev = max((best[p] for p in depths if p >= d), key=lambda t: t[0])
            nxt[d] = (prev[0] + s.get(d, -math.inf), [*prev[1], d])
        best = nxt
    return max(best.values(), key=lambda t: t[0])[1]


def load_scores(blocks: Sequence[dict[str, Any]], by_depth: dict[int, str]) -> tuple[dict[int, float], str | None] | None:
    """Per depth at one load, the log of its median tokens/s over a common yardstick, and the server
    compared through (None: within whole blocks); None where the depths cannot be compared. Where
    blocks hold every depth, the yardstick is the block's best; else one server that ran beside each
    other depth in some block (the one in most blocks), each ratio taken within its own blocks."""
    shares = block_shares(blocks, by_depth)
    if all(shares[d] for d in by_depth):
        return {d: math.log(statistics.median(s)) for d, s in shares.items()}, None
    ratios = {(d, p): pairing.block_ratios(blocks, by_depth[d], [by_depth[p]]) for d in by_depth for p in by_depth}
    pivots = [p for p in by_depth if all(ratios[(d, p)] for d in by_depth if d != p)]
    if not pivots:
        return None
    pivot = max(pivots, key=lambda p: (sum(pairing.rate(b, by_depth[p]) is not None for b in blocks), p))
    return ({d: 0.0 if d == pivot else math.log(statistics.median(ratios[(d, pivot)])) for d in by_depth},
            by_depth[pivot])


def versus(blocks: Sequence[dict[str, Any]], name: str, other: str, via: str | None) -> pairing.Ratio | None:
    """`name` over `other` within the blocks that hold both, else through `via`."""
    direct = pairing.compare(blocks, name, [other])
    if direct is not None or via is None:
        return direct
    return pairing.compare_through(blocks, name, other, via)


def choose(result: dict[str, Any]) -> Choice:
    """Per measured concurrency, the depths' figures and the one kept; the servers left out; the
    loads whose depths could not be compared."""
    by_depth, left_out = depth_servers(result)
    measured: list[tuple[int, dict[int, float], str | None, list[dict[str, Any]]]] = []
    not_compared = []
    for key in sorted(result.get("blocks", {}), key=int):
        blocks = result["blocks"][key]
        scored = load_scores(blocks, by_depth)
        if scored is None:
            not_compared.append(int(key))
        else:
            measured.append((int(key), scored[0], scored[1], blocks))
    if not measured:
        raise NoDepths("no concurrency where every depth ran a clean window beside the others (in one block, "
                       "or each beside one server they share): run the bench again (its report lists the errors)")
    kept = monotone_depths([score for _, score, _, _ in measured])
    loads = []
    for (c, score, via, blocks), k in zip(measured, kept, strict=True):
        best = max(score, key=lambda d: (score[d], d))
        runner_up = max((d for d in score if d != best), key=lambda d: (score[d], d))
        rates = {d: statistics.median(r for b in blocks if (r := pairing.rate(b, n)) is not None)
                 for d, n in by_depth.items()}
        kept_over_best = versus(blocks, by_depth[k], by_depth[best], via) if k != best else None
        loads.append(Load(c, rates, best, k, kept_over_best.median if kept_over_best else 1.0,
                          versus(blocks, by_depth[best], by_depth[runner_up], via), via))
    return Choice(loads, left_out, not_compared)


def schedule_text(loads: Sequence[Load]) -> str:
    """The kept depths as tiers: an edge at the geometric middle of two loads that differ."""
    tiers: list[tuple[int, int]] = []  # (tier's last batch size, depth); the last tier is open
    for here, there in itertools.pairwise(loads):
        if there.kept != here.kept:
            edge = max(here.concurrency, min(there.concurrency - 1,
                                             math.isqrt(here.concurrency * there.concurrency)))
            tiers.append((edge, here.kept))
    parts, low = [], 1
    for high, depth in tiers:
        parts.append(f"{low}-{high}:{depth}")
        low = high + 1
    parts.append(f"{low}-:{loads[-1].kept}")
    text = ",".join(parts)
    parse_schedule(text, source="bench schedule")  # the plugin's own parser: a bug here, not the user's
    return text


def render(loads: Sequence[Load], left_out: Sequence[str], not_compared: Sequence[int] = ()) -> list[str]:
    depths = sorted(loads[0].tok_per_s, reverse=True)
    lines = ["| concurrency | " + " | ".join(f"depth {d} tok/s" for d in depths)
             + " | best | kept | kept / best | best / runner-up |",
             "|---:|" + "---:|" * len(depths) + "---:|---:|---:|---|"]
    for ld in loads:
        cells = [f"{ld.tok_per_s[d]:,.0f}" for d in depths]
        mark = "+" if ld.via else ""
        vs_next = ld.best_over_next.text() + mark if ld.best_over_next else "-"
        lines.append(f"| {ld.concurrency} | " + " | ".join(cells)
                     + f" | {ld.best} | {ld.kept} | {ld.kept_over_best:.2f}x{mark if ld.kept != ld.best else ''} "
                     f"| {vs_next} |")
    through = sorted({ld.via for ld in loads if ld.via})
    if through:
        lines.append(f"\n+: no block held every depth (merged calls): each depth over {' and '.join(through)} "
                     "within its own blocks, compared through it; the interval resamples both sides.")
    undecided = [ld.concurrency for ld in loads if ld.best_over_next and ld.best_over_next.low <= 1.0]
    if undecided:
        lines.append(f"\nUndecided (the best's interval over the runner-up holds 1.00): at "
                     f"{', '.join(map(str, undecided))} requests; more blocks there (--pairs) decide it.")
    if left_out:
        lines.append(f"Left out (not one depth each): {', '.join(left_out)}.")
    if not_compared:
        lines.append(f"Not compared (a depth that ran neither beside the others nor beside one server they "
                     f"share): at {', '.join(map(str, not_compared))} requests.")
    return lines


def launch_flags(loads: Sequence[Load]) -> str:
    """What starts a server with the kept schedule (launched at its deepest tier)."""
    deepest = max(ld.kept for ld in loads)
    if len({ld.kept for ld in loads}) == 1:
        return (f"one depth at every load measured ({deepest}): no schedule"
                + ("; plain decoding" if deepest == 0 else f"; --speculative-num-steps {deepest}"))
    return (f"--speculative-num-steps {deepest} --speculative-num-draft-tokens {deepest + 1} "
            f"{DEPTH_SCHEDULE_FLAG} {schedule_text(loads)}  (edges: the geometric middle of the loads "
            "measured on either side)")


def read_result(path: Path) -> dict[str, Any]:
    try:
        result: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise NoDepths(f"not a bench result ({exc}); give a bench.json of `python -m bench run`, `e2e` or "
                       "`merge` that ran servers of one depth each") from exc
    return result


def schedule_of(path: Path) -> str:
    """The schedule that `bench schedule PATH` prints, for a bench to run (`--schedule from:PATH`):
    NoDepths names the file and what is missing."""
    try:
        loads = choose(read_result(path)).loads
    except NoDepths as exc:
        raise NoDepths(f"{path}: {exc}") from None
    if all(ld.kept == 0 for ld in loads):
        raise NoDepths(f"{path}: plain decoding made the most at every load measured: no schedule drafts")
    return schedule_text(loads)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("result", type=Path, help="bench.json of servers of one draft depth each")


def main(a: argparse.Namespace) -> int:
    try:
        choice = choose(read_result(a.result))
    except NoDepths as exc:
        raise SystemExit(f"{a.result}: {exc}") from exc
    print("\n".join(render(*choice)))
    print(f"\n{launch_flags(choice.loads)}")
    return 0
