"""`auto`'s step trace (SGLANG_IMAGE_AUTO_TRACE, JSON lines), read back: per batch-size bucket and
mode, the steps its estimate was made of, how their times spread, and how many carried a prefill.

    python -m bench auto-trace FILE [FILE ...] [--replay KEY=VALUE,... [--leave-out-prefills same|next]]

The estimate takes a mode's median step time in a bucket; the traffic pays the mean, prefills
included. Where the two disagree between the modes, the crossover it learns is not the one the
traffic sees: these rows show both side by side, and a third reading, by dwells: all tokens over
all time in runs of at least DWELL_STEPS steps of one mode in one bucket, the first DWELL_SKIP
of each run left out (the arrivals there are still the other mode's). A short burst of a mode
carries few of the prefills its own rhythm brings; a dwell carries them. Then a line per trial
the server ran (its paired blocks of both modes in a tied bucket at the crossover): what each
mode made there and where the crossover went. --replay feeds the same
steps, in the same order, to a fresh controller with other settings (AutoConfig's fields; none:
today's) and prints the crossovers it would have moved to beside the server's: an estimator change
tried on a GPU's steps (--leave-out-prefills: the estimate without the steps a prefill fell in).
"""
from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_image_plugin import auto_threshold
from sglang_image_plugin.auto_estimate import DWELL_SKIP, DWELL_STEPS  # the controller's dwells
from sglang_image_plugin.setting import AUTO, AUTO_TRACE_ENV, THRESHOLD_FLAG, Mode

KINDS = ("speculative", "plain")
THRESHOLD_TRACE_HINT = f"{THRESHOLD_FLAG} {AUTO} and {AUTO_TRACE_ENV}=FILE"


def read(path: Path) -> list[dict[str, Any]]:
    """The trace's records; a line cut short (the server stopped while writing) is skipped."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


@functools.cache
def server_edges() -> tuple[int, ...]:
    """The bucket edges an auto server uses (the plugin's quarter_octave_edges), far past any batch."""
    return tuple(auto_threshold.quarter_octave_edges(1 << 20))


def bucket_of(batch: int) -> tuple[int, int]:
    """The server's bucket (low, high) of a batch size: 1-1, 2-2, 3-4, 5-8, ..., 33-40, 41-48, ...
    (as _bucket finds it)."""
    edges = server_edges()
    i = bisect.bisect_left(edges, batch)
    return (edges[i - 1] + 1 if i else 1, edges[i])


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
    dwells: int = 0  # runs long enough to count (module docstring)
    tok_s_dwells: float | None = None  # all tokens over all time in those runs, their heads left out

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def dwells(records: Iterable[dict[str, Any]]) -> dict[tuple[int, int, str], list[list[dict[str, Any]]]]:
    """Per (bucket, kind), its runs of recorded steps long enough to count, each without its first
    DWELL_SKIP steps. Any other step (another mode or bucket, one not recorded, a catch-up) ends a
    run; the prefills between steps do not (their time is in the next step's)."""
    out: dict[tuple[int, int, str], list[list[dict[str, Any]]]] = {}
    run: list[dict[str, Any]] = []
    key: tuple[int, int, str] | None = None

    def close() -> None:
        if key is not None and len(run) >= DWELL_SKIP + DWELL_STEPS:
            out.setdefault(key, []).append(run[DWELL_SKIP:])

    for r in records:
        if r.get("kind") == "prefill":
            continue
        here = ((*bucket_of(int(r["batch"])), str(r["kind"]))
                if r.get("kind") in KINDS and r.get("batch") and r.get("recorded") else None)
        if here is None or here != key:
            close()
            run, key = [], here
        if here is not None:
            run.append(r)
    close()
    return out


def summarize(records: Iterable[dict[str, Any]]) -> list[Row]:
    records = list(records)
    runs = dwells(records)
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
        own_runs = runs.get((low, high, kind), [])
        dwelt = [r for run in own_runs for r in run]
        rows.append(Row(low, high, kind, len(got), skipped.get((low, high, kind), 0),
                        sum(1 for r in got if r.get("prefills")) / len(got),
                        statistics.fmean(int(r["batch"]) for r in got), 1e3 * median,
                        1e3 * statistics.fmean(seconds), statistics.fmean(tokens) / median,
                        sum(tokens) / sum(seconds), len(own_runs),
                        (sum(int(r["tokens"]) for r in dwelt) / sum(float(r["seconds"]) for r in dwelt))
                        if dwelt else None))
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
                     f"median, {r.tok_s_sums:.0f} by the sums"
                     + (f", {r.tok_s_dwells:.0f} by {r.dwells} dwell(s)" if r.tok_s_dwells else ""))
    for (low, high), kinds in sorted(by_bucket.items()):
        if set(kinds) == set(KINDS):
            s, p = kinds["speculative"], kinds["plain"]
            lines.append(f"{low}-{high} speculative / plain: {s.tok_s_median / p.tok_s_median:.3f}x by the "
                         f"medians, {s.tok_s_sums / p.tok_s_sums:.3f}x by the sums"
                         + (f", {s.tok_s_dwells / p.tok_s_dwells:.3f}x by the dwells"
                            if s.tok_s_dwells and p.tok_s_dwells else ", not by dwells (one mode has none)"))
    return lines


def trials(records: Iterable[dict[str, Any]]) -> list[str]:
    """A line per trial the server ran (its steps carry the trial's bucket, `trial`): where and
    when, the steps of each mode it recorded in that bucket meanwhile, their tokens over their
    seconds, and the crossover before and after it."""
    lines: list[str] = []
    current: dict[str, Any] | None = None

    def close() -> None:
        if current is None:
            return
        made = current["made"]  # per mode: tokens, seconds, steps
        tok_s = {k: made[k][0] / made[k][1] for k in KINDS if made[k][1] > 0}
        ratio = (f"; speculative / plain {tok_s['speculative'] / tok_s['plain']:.3f}x by the sums"
                 if len(tok_s) == len(KINDS) else "")
        lines.append(f"trial at {current['bucket']} from {current['t']:.1f}s: "
                     + " / ".join(f"{made[k][2]} {k}" for k in KINDS) + f" steps recorded there{ratio}; "
                     f"crossover {current['before']} -> {current['after']}")

    t0 = None
    for r in records:
        if r.get("kind") not in KINDS or not r.get("batch"):
            continue
        t0 = float(r["t"]) if t0 is None else t0
        bucket = r.get("trial")
        if bucket != (current["bucket"] if current else None):
            if current is not None:
                current["after"] = r.get("crossover")  # the first step after it: the move it made
            close()
            current = None if bucket is None else {"bucket": bucket, "t": float(r["t"]) - t0,
                                                    "before": r.get("crossover"),
                                                    "made": {k: [0, 0.0, 0] for k in KINDS}}
        if current is None:
            continue
        current["after"] = r.get("crossover")
        low, high = bucket_of(int(r["batch"]))
        if f"{low}-{high}" == bucket and r.get("recorded"):
            made = current["made"][str(r["kind"])]
            made[0] += int(r["tokens"])
            made[1] += float(r["seconds"])
            made[2] += 1
    close()
    return lines


def parse_settings(raw: str) -> dict[str, Any]:
    """`step_noise=0.05,stale_steps=2048` into AutoConfig's fields, typed as they are there; a
    SystemExit naming the key and the fields for a wrong one."""
    fields = {f.name: f for f in dataclasses.fields(auto_threshold.AutoConfig)}
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in raw.split(","))):
        key, _, value = item.partition("=")
        kind = {"int": int, "float": float}.get(str(fields[key].type)) if key in fields else None
        if kind is None or not value:
            raise SystemExit(f"--replay {item!r}: give KEY=VALUE with KEY one of "
                             f"{', '.join(k for k, f in fields.items() if str(f.type) in ('int', 'float'))}")
        try:
            out[key] = kind(value)
        except ValueError:
            raise SystemExit(f"--replay {item!r}: {value!r} is not a {kind.__name__}") from None
    return out


LEAVE_OUT = ("none", "same", "next")  # --leave-out-prefills: which steps a prefill marks


def replay(records: Iterable[dict[str, Any]], settings: dict[str, Any],
           leave_out_prefills: str = "none") -> tuple[list[tuple[float, int]], str]:
    """The trace's decode steps, in order, through a fresh controller: each step is decided (the
    controller's clock and its updates) and a step the server recorded is recorded with the mode it
    ran in, except, with `leave_out_prefills`, a step whose interval a prefill fell in ("same": the
    step it was noted with; "next": the one after it, where the prefill's GPU time may land).
    Returns its crossover changes (time, crossover) and its estimates at the end."""
    if leave_out_prefills not in LEAVE_OUT:
        raise ValueError(f"leave_out_prefills {leave_out_prefills!r}: one of {', '.join(LEAVE_OUT)}")
    steps = [r for r in records if r.get("kind") in (*KINDS, "catch-up") and r.get("batch")]
    marked = [bool(r.get("prefills")) for r in steps]
    if leave_out_prefills == "next":
        marked = [False, *marked[:-1]]
    elif leave_out_prefills == "none":
        marked = [False] * len(steps)
    top = max((int(r["batch"]) for r in steps), default=1)
    # the server's running-request limit where the trace shows it (a server without a prior starts
    # with its crossover there), else the power of two at or above the largest batch: the buckets
    # above the traffic's take part in where the split goes
    first = next((int(r["crossover"]) for r in steps if r.get("crossover")), 0)
    size = max(1 << (top - 1).bit_length(), first)
    ctl = auto_threshold.AutoController(auto_threshold.AutoConfig(**{"max_batch_size": size, **settings}))
    changes, last = [], ctl.crossover()
    for r, skip in zip(steps, marked, strict=True):
        ctl.decide(int(r["batch"]))
        if r.get("recorded") and r.get("tokens") is not None and not skip:
            ctl.record(Mode(r["kind"]), int(r["batch"]), float(r["seconds"]), int(r["tokens"]))
        if ctl.crossover() != last:
            last = ctl.crossover()
            changes.append((float(r["t"]), last))
    return changes, ctl.estimates_text()


def server_changes(records: Iterable[dict[str, Any]]) -> list[tuple[float, int]]:
    """The crossover the server had as each step settled, where it changed."""
    out: list[tuple[float, int]] = []
    for r in records:
        if r.get("kind") in (*KINDS, "catch-up") and "crossover" in r and (not out or out[-1][1] != r["crossover"]):
            out.append((float(r["t"]), int(r["crossover"])))
    return out


def timeline(changes: list[tuple[float, int]], t0: float) -> str:
    return ", ".join(f"{c} at {t - t0:.1f}s" for t, c in changes) or "none"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("traces", type=Path, nargs="+", help="step traces (JSON lines) of auto servers")
    ap.add_argument("--replay", metavar="KEY=VALUE,...", default=None,
                    help="replay the steps through a controller with these AutoConfig settings "
                         "('' for today's defaults)")
    ap.add_argument("--leave-out-prefills", choices=LEAVE_OUT, default="none",
                    help="--replay: leave out the steps a prefill fell in (same: the step it was "
                         "noted with; next: the one after it)")


def main(a: argparse.Namespace) -> int:
    settings = parse_settings(a.replay) if a.replay is not None else None
    for path in a.traces:
        if not path.is_file():
            raise SystemExit(f"{path}: no such trace (a server with {THRESHOLD_TRACE_HINT} writes one)")
        records = read(path)
        print(f"{path}:")
        for line in [*render(summarize(records)), *trials(records)]:
            print(f"  {line}")
        if settings is not None:
            t0 = min((float(r["t"]) for r in records if "t" in r), default=0.0)
            changes, estimates = replay(records, settings, a.leave_out_prefills)
            print(f"  the server's crossover: {timeline(server_changes(records), t0)}")
            left_out = f"; steps with a prefill left out: {a.leave_out_prefills}" if a.leave_out_prefills != "none" else ""
            print(f"  replayed ({a.replay or 'defaults'}{left_out}): {timeline(changes, t0)}")
            print(f"  replayed estimates at the end: {estimates}")
    return 0
