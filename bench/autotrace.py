"""`auto`'s step trace (SGLANG_IMAGE_AUTO_TRACE, JSON lines), read back: per batch-size bucket and
mode, the steps its estimate was made of, how their times spread, and how many carried a prefill.

    python -m bench auto-trace FILE [FILE ...]

The estimate takes a mode's median step time in a bucket; the traffic pays the mean, prefills
included. Where the two disagree between the modes, the crossover it learns is not the one the
traffic sees: these rows show both side by side.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("speculative", "plain")


def read(path: Path) -> list[dict[str, Any]]:
    """The trace's records; a line cut short (the server stopped while writing) is skipped."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def bucket_of(batch: int) -> tuple[int, int]:
    """The power-of-two bucket (low, high) a batch size falls in: 1-1, 2-2, 3-4, 5-8, ..."""
    high = 1
    while high < batch:
        high *= 2
    return (high // 2 + 1, high)


@dataclass(frozen=True)
class Row:
    low: int
    high: int
    kind: str
    steps: int  # recorded steps (the ones the estimate saw)
    left_out: int  # steps of this kind here that it did not record
    with_prefill: float  # share of the recorded steps with a prefill in their interval
    mean_batch: float
    median_ms: float
    mean_ms: float
    tok_s_median: float  # mean tokens per step over the median step time: what the estimate uses
    tok_s_sums: float  # all tokens over all time: what the traffic got from these steps

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def summarize(records: Iterable[dict[str, Any]]) -> list[Row]:
    steps: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    skipped: dict[tuple[int, int, str], int] = {}
    for r in records:
        if r.get("kind") not in KINDS or not r.get("batch"):
            continue
        key = (*bucket_of(int(r["batch"])), str(r["kind"]))
        if r.get("recorded"):
            steps.setdefault(key, []).append(r)
        else:
            skipped[key] = skipped.get(key, 0) + 1
    rows = []
    for (low, high, kind), got in sorted(steps.items()):
        seconds = [float(r["seconds"]) for r in got]
        tokens = [int(r["tokens"]) for r in got]
        median = statistics.median(seconds)
        rows.append(Row(low, high, kind, len(got), skipped.get((low, high, kind), 0),
                        sum(1 for r in got if r.get("prefills")) / len(got),
                        statistics.fmean(int(r["batch"]) for r in got), 1e3 * median,
                        1e3 * statistics.fmean(seconds), statistics.fmean(tokens) / median,
                        sum(tokens) / sum(seconds)))
    return rows


def render(rows: list[Row] | list[dict[str, Any]]) -> list[str]:
    """A line per bucket and mode, and where both modes ran, the ratio each way of reading."""
    data = [r if isinstance(r, Row) else Row(**r) for r in rows]
    lines = []
    by_bucket: dict[tuple[int, int], dict[str, Row]] = {}
    for r in data:
        by_bucket.setdefault((r.low, r.high), {})[r.kind] = r
        lines.append(f"{r.low}-{r.high} {r.kind}: {r.steps} steps (+{r.left_out} left out), batch "
                     f"{r.mean_batch:.1f}, {100 * r.with_prefill:.0f}% with a prefill; median "
                     f"{r.median_ms:.2f} ms, mean {r.mean_ms:.2f} ms; {r.tok_s_median:.0f} tok/s by the "
                     f"median, {r.tok_s_sums:.0f} by the sums")
    for (low, high), kinds in sorted(by_bucket.items()):
        if set(kinds) == set(KINDS):
            s, p = kinds["speculative"], kinds["plain"]
            lines.append(f"{low}-{high} speculative / plain: {s.tok_s_median / p.tok_s_median:.3f}x by the "
                         f"medians, {s.tok_s_sums / p.tok_s_sums:.3f}x by the sums")
    return lines


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("traces", type=Path, nargs="+", help="step traces (JSON lines) of auto servers")


def main(a: argparse.Namespace) -> int:
    for path in a.traces:
        if not path.is_file():
            raise SystemExit(f"{path}: no such trace (a server with {THRESHOLD_TRACE_HINT} writes one)")
        print(f"{path}:")
        for line in render(summarize(read(path))):
            print(f"  {line}")
    return 0


THRESHOLD_TRACE_HINT = "--speculative-disable-batch-threshold auto and SGLANG_IMAGE_AUTO_TRACE=FILE"
