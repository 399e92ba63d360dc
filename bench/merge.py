"""Several calls' results as one report: the concurrencies a single card could not hold side by
side, measured by separate calls, in one table and one plot.

    python -m bench merge --out DIR BENCH_JSON [BENCH_JSON ...]

Each BENCH_JSON is the bench.json of a `python -m bench run` or `e2e` call (or of an earlier
merge, whose calls are taken apart again). Writes bench.json, bench.md and, where matplotlib is
installed, concurrency.png under DIR, as `bench run` does.

- The blocks at a concurrency are the union of the calls' blocks there, each tagged with its
  `source` (the call it came from, numbered as the merged result's `sources`). A ratio is still
  taken within a block, so ratios from different calls may stand side by side; a tokens/s median
  at a concurrency that several calls measured pools windows of different calls, and the table
  and the plot mark it.
- The configs are the union, plain first; `sources` keeps each call's path, date, concurrencies,
  configs and its whole result but the blocks (its servers, checks, ramps, diagnoses), so nothing
  of an input is lost, and its failures and notes are carried over tagged with the source.
- Refused, naming the cause: a file that is not a bench result; calls of another model, other
  output lengths, window or settle seconds or device timer; a config name that means another
  server in another call (its record); other --server-env or --server-args (a call that did not
  record them is unknown there, said in the report, not refused); the same call twice; an output
  folder where the merge would overwrite an input.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import configs, report
from bench.configs import BenchConfig

# configs.CONFIGS' order, by kind: plain first, then always-on EAGLE-3, then the switching ones
KIND_ORDER = ("plain", "fixed", "adaptive", "threshold", "schedule", "auto")
# what one call's failures and notes are kept in: carried over, each tagged with its source
TAGGED = ("checks", "start_failures", "window_mismatches", "prefix_mismatches", "mismatches", "failures",
          "server_events", "skipped", "not_measured")
WRITTEN = ("bench.json", "bench.md", "concurrency.png", "ramp.png")  # what report.write may write


class Refused(Exception):
    """Inputs that cannot be merged: the message names the cause and the fix."""


@dataclass(frozen=True)
class Source:
    """One call's result (blocks included) and the file it came from."""
    path: str
    result: dict[str, Any]


def lengths_of(result: dict[str, Any]) -> list[Any]:
    """The range of the requests' output lengths (a result from before the spread: one length)."""
    return list(result.get("output_lengths") or [result.get("output_len")] * 2)


def device_timer(result: dict[str, Any]) -> bool:
    """Whether every server ran the device timer (--device-timer, or --diagnose: its environment)."""
    return bool(result.get("device_timer") or result.get("diagnose_wanted"))


# What a window's tokens/s depends on besides its own server: calls that differ in one measured
# something else. (what, how a result says it, the fix)
MUST_MATCH: tuple[tuple[str, Callable[[dict[str, Any]], Any], str], ...] = (
    ("models", lambda r: r.get("model"), "merge each model's calls on their own"),
    ("output lengths", lengths_of, "merge only calls run with the same --output-len and --output-spread"),
    ("window seconds", lambda r: r.get("window_s"), "merge only calls run with the same --window-s"),
    ("settle seconds", lambda r: r.get("settle_s"), "merge only calls run with the same --settle-s"),
    ("device timer settings", device_timer,
     "merge only calls run alike with or without --device-timer (it is in every server's environment)"),
    # a result that did not record them (an older bench) is unknown, not different: None is skipped
    ("--server-env settings", lambda r: r.get("server_env"), "merge only calls run with the same --server-env"),
    ("--server-args settings", lambda r: r.get("server_args"), "merge only calls run with the same --server-args"),
)
MAY_BE_UNKNOWN = ("--server-env settings", "--server-args settings")


def not_a_result(result: Any) -> str | None:
    """Why a file's JSON is not a bench result with blocks to merge; None where it is one."""
    if not isinstance(result, dict):
        return "not a JSON object"
    for key, kind in (("model", dict), ("configs", list), ("blocks", dict)):
        if not isinstance(result.get(key), kind):
            return f"no {key!r}"
    if not result["blocks"]:
        return "no blocks: a ramp alone, or a call that measured nothing"
    for c, blocks in result["blocks"].items():
        if not c.isdigit() or not isinstance(blocks, list) or \
                not all(isinstance(b, dict) and isinstance(b.get("windows"), dict) for b in blocks):
            return f"the blocks at {c!r} are not a list of blocks with windows"
    return None


def load(path: Path) -> list[Source]:
    """The calls of one file: its own, or an earlier merge's, taken apart again."""
    try:
        result = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Refused(f"{path}: not a bench result ({exc}); give the bench.json a `python -m bench run` "
                      "or `e2e` call wrote") from None
    why = not_a_result(result)
    if why:
        raise Refused(f"{path}: not a bench result ({why}); give the bench.json a `python -m bench run` "
                      "or `e2e` call wrote")
    if result.get("sources"):
        return unmerged(result)
    return [Source(str(path.resolve()), result)]


def unmerged(result: dict[str, Any]) -> list[Source]:
    """A merged result's calls as they were: each source's result with its own blocks back."""
    out = []
    for i, src in enumerate(result["sources"], 1):
        blocks = {c: [{k: v for k, v in b.items() if k != "source"} for b in bl if b.get("source") == i]
                  for c, bl in result["blocks"].items()}
        out.append(Source(src["path"], {**src["result"], "blocks": {c: bl for c, bl in blocks.items() if bl}}))
    return out


def check(sources: list[Source]) -> None:
    """Refuse what cannot share a table (Refused names the cause and the fix)."""
    if len(sources) < 2:
        raise Refused("one call alone: give two or more bench.json files (`python -m bench run --render "
                      "BENCH_JSON --out DIR` draws one call's report)")
    seen: dict[str, str] = {}
    for s in sources:
        key = json.dumps(s.result["blocks"], sort_keys=True)
        if key in seen:
            raise Refused(f"{seen[key]} and {s.path} hold the same blocks (one call given twice): give each call once")
        seen[key] = s.path
    for what, value, fix in MUST_MATCH:
        known = [(s, v) for s in sources if (v := value(s.result)) is not None or what not in MAY_BE_UNKNOWN]
        for s, v in known[1:]:
            if v != known[0][1]:
                raise Refused(f"the {what} differ: {known[0][0].path} has {known[0][1]!r}, {s.path} has {v!r}; "
                              f"their windows measured different things: {fix}")
    check_records(sources)


def check_records(sources: list[Source]) -> None:
    """A config name must mean one server in every call: its record (kind, depth, threshold,
    schedule, environment) the same wherever it ran."""
    first: dict[str, tuple[Source, BenchConfig | None]] = {}
    for s in sources:
        records = configs.from_result(s.result)
        for name in s.result["configs"]:
            rec = records.get(name)
            other, was = first.setdefault(name, (s, rec))
            if rec != was:
                raise Refused(f"{name!r} is another server in {other.path} ({record_text(was)}) than in {s.path} "
                              f"({record_text(rec)}): merge only calls whose configs of one name are the same "
                              "server (the same --depth, --threshold, --schedule and bench version)")


def record_text(rec: BenchConfig | None) -> str:
    return "no record: an older bench" if rec is None else json.dumps(rec.as_dict())


def config_order(names: list[str], records: dict[str, BenchConfig]) -> list[str]:
    """The configs as the report shows them: plain first (then its A/A twin), always-on EAGLE-3
    from the deepest down (at the launch depth its A/A twin, then its variants), upstream's
    adaptive, the thresholds from the lowest, the schedules, auto; a name without a record last;
    else in the order met."""
    def key(item: tuple[int, str]) -> tuple[int, int, int, bool, int, int]:
        met, name = item
        rec = records.get(name)
        if rec is None or rec.kind not in KIND_ORDER:
            return len(KIND_ORDER), 0, 0, False, 0, met
        return KIND_ORDER.index(rec.kind), -rec.steps, len(rec.env) + len(rec.args), rec.twin, rec.threshold or 0, met

    return [name for _, name in sorted(enumerate(names), key=key)]


def tagged(value: Any, source: int) -> Any:
    """One call's note or failure, marked with the source it came from."""
    return {**value, "source": source} if isinstance(value, dict) else f"source {source}: {value}"


def concurrency_of(result: dict[str, Any]) -> set[int]:
    """The concurrencies a call was asked for and those it measured."""
    return {int(c) for c in result.get("concurrency") or []} | {int(c) for c in result["blocks"]}


def merge(sources: list[Source]) -> dict[str, Any]:
    """One result of several calls' (report.write's input): the union of their blocks, each
    tagged with its `source`, and of their configs; `sources` keeps each call."""
    check(sources)
    results = [s.result for s in sources]
    first = results[0]
    met: list[str] = []
    records: dict[str, BenchConfig] = {}
    for r in results:
        own = configs.from_result(r)
        for name in r["configs"]:
            if name not in met:
                met.append(name)
            if name in own:
                records.setdefault(name, own[name])
    names = config_order(met, records)
    levels = sorted(set().union(*map(concurrency_of, results)))
    dates = sorted({str(r.get("date") or "") for r in results})
    merged: dict[str, Any] = {
        "date": dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}",
        "concurrency": levels,
        "pairs": max(r.get("pairs") or 0 for r in results),
        "pairs_at": {str(c): sum(r.get("pairs") or 0 for r in results if c in concurrency_of(r)) for c in levels},
        "calls": sum(r.get("calls") or 1 for r in results),
        **{key: first.get(key) for key in ("window_s", "settle_s", "output_len", "output_lengths", "device_timer",
                                           "model")},
        "thresholds": sorted({t for r in results for t in r.get("thresholds") or []}),
        "configs": names,
        "config_records": {n: records[n].as_dict() for n in names if n in records},
        "not_run": {n: f"source {i}: {why}" for i, r in enumerate(results, 1)
                    for n, why in (r.get("not_run") or {}).items() if n not in names},
        "blocks": {str(c): [{**b, "source": i} for i, r in enumerate(results, 1) for b in r["blocks"].get(str(c), [])]
                   for c in levels if any(str(c) in r["blocks"] for r in results)},
    }
    for key in TAGGED:
        merged[key] = [tagged(x, i) for i, r in enumerate(results, 1) for x in r.get(key) or []]
    for key in ("server_env", "server_args"):  # where any call recorded them (check: all that did agree)
        known = [r[key] for r in results if r.get(key) is not None]
        if known:
            merged[key] = known[0]
    merged["sources"] = [{"path": s.path, "date": s.result.get("date"),
                          "concurrency": sorted(concurrency_of(s.result)), "configs": s.result["configs"],
                          "pairs": s.result.get("pairs"), "calls": s.result.get("calls"),
                          "server_env": s.result.get("server_env"), "server_args": s.result.get("server_args"),
                          "result": {k: v for k, v in s.result.items() if k != "blocks"}}
                         for s in sources]
    merged["table"] = report.markdown(merged)
    return merged


def refuse_overwrite(inputs: list[Path], out: Path) -> None:
    """The merge writes report.write's files under `out`: none of them may be an input."""
    written = {(out / name).resolve() for name in WRITTEN}
    for path in inputs:
        if path.resolve() in written:
            raise Refused(f"{path} is an input and --out {out} would overwrite it: give another --out folder")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, required=True,
                    help="the folder for the merged bench.json, bench.md and concurrency.png (not an input's)")
    ap.add_argument("inputs", nargs="+", type=Path, metavar="BENCH_JSON",
                    help="the bench.json of each call (or of an earlier merge)")


def main(a: argparse.Namespace) -> int:
    try:
        refuse_overwrite(a.inputs, a.out)
        result = merge([s for path in a.inputs for s in load(path)])
    except Refused as exc:
        raise SystemExit(f"bench merge: cannot merge: {exc}") from None
    for path in report.write(result, a.out):
        print(path)
    return 0
