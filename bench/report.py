"""The benchmark's result as files: bench.json, bench.md (tables) and two PNG plots.

Works on a saved result alone (`python -m bench run --render bench.json --out DIR`), so the
tables and plots can be drawn where matplotlib is installed, away from the GPU host.
"""
from __future__ import annotations

import json
import shlex
import statistics
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bench import autotrace, configs, diagnose, hostinfo, pairing, pyspy, report_steps
from bench.configs import LAUNCH_STEPS, TWINS, output_reference

FIXED_MODES = ("plain", "eagle3")  # the two a threshold chooses between


def label(result: dict[str, Any], name: str) -> str:
    """What a server of the result is, in words (its record's label)."""
    rec = configs.from_result(result).get(name)
    return rec.label if rec is not None else name


def plain_step_note(st: dict[str, Any] | None) -> str:
    """What the server's plain step runs (its server info), where it says."""
    step = (st or {}).get("plain_step")
    if not isinstance(step, dict):
        return ""
    return "; plain step: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in step.items())


def blocks_at(result: dict[str, Any], c: str) -> list[dict[str, Any]]:
    return list(result.get("blocks", {}).get(c, []))


def levels(result: dict[str, Any]) -> list[str]:
    return sorted(result.get("blocks", {}), key=int)


def sources_at(result: dict[str, Any], c: str, name: str | None = None) -> list[int]:
    """The calls a merged result (bench.merge: each block tagged with its `source`) has blocks
    from at concurrency c, those with a window of `name` where given; empty for one call's result."""
    return sorted({b["source"] for b in blocks_at(result, c)
                   if "source" in b and (name is None or name in b["windows"])})


def mixed_levels(result: dict[str, Any]) -> list[str]:
    """The concurrencies where a merged result's blocks come from several calls: a tokens/s median
    there pools windows of different calls (each ratio stays within its block)."""
    return [c for c in levels(result) if len(sources_at(result, c)) > 1]


def blocks_expected(result: dict[str, Any], c: str) -> int:
    """The blocks the calls meant to measure at c: --pairs, or in a merged result the sum of the
    --pairs of the calls that measured c."""
    return int((result.get("pairs_at") or {}).get(c, result.get("pairs") or 0))


def reference(result: dict[str, Any]) -> str:
    """The server the level table's ratios are taken against: plain where it ran, else the first of
    the result's configs (the one named first on --bench-configs; in a merged result, the first in
    the report's order)."""
    names = result.get("configs") or []
    return "plain" if "plain" in names or not names else str(names[0])


def level_table(result: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per concurrency and config: median tokens/s over the blocks, the ratio to the reference
    (reference(): plain where it ran) within each block (`vs_reference`: median and bootstrap 95%
    interval; None for the reference itself), the median accept length, the blocks measured."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    ref = reference(result)
    for c in levels(result):
        blocks = blocks_at(result, c)
        row: dict[str, dict[str, Any]] = {}
        for name in result.get("configs", []):
            rates = [r for b in blocks if (r := pairing.rate(b, name)) is not None]
            if not rates:
                continue
            accepts = [w["accept_length"] for b in blocks if (w := b["windows"].get(name)) and w.get("accept_length")]
            vs = pairing.compare(blocks, name, [ref]) if name != ref else None
            row[name] = {"tok_per_s": round(statistics.median(rates), 1),
                         "vs_reference": vs.as_dict() if vs else None,
                         "accept_length": round(statistics.median(accepts), 2) if accepts else None,
                         "blocks": len(rates)}
        out[c] = row
    return out


def twin_floors(result: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per server with its A/A twin in the result (configs.TWINS: plain, EAGLE-3), per concurrency:
    the twin over it within each block (median and interval), the noise of the procedure at that
    server's load; empty without a twin."""
    names = result.get("configs", [])
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for twin, base in TWINS.items():
        if twin in names and base in names:
            per_c = {c: ratio.as_dict() for c in levels(result)
                     if (ratio := pairing.compare(blocks_at(result, c), twin, [base]))}
            if per_c:
                out[base] = per_c
    return out


def floor_table(result: dict[str, Any], base: str = "plain") -> dict[str, dict[str, Any]]:
    """Per concurrency: the A/A floor at `base` (its twin over it within each block: median and
    interval); empty without that twin."""
    return twin_floors(result).get(base, {})


def floors_text(result: dict[str, Any], bases: Iterable[str]) -> str:
    """The twins behind the floors, in words."""
    return " and ".join(f"{label(result, b)}'s twin over {label(result, b)}" for b in bases)


def versus_better(blocks: list[dict[str, Any]], name: str,
                   modes: tuple[str, str] = FIXED_MODES) -> dict[str, Any] | None:
    """`name`'s tokens/s over the better of plain and always-on EAGLE-3 (`modes`: their servers):
    within each block that holds all three; where none does (a merge of calls, each beside plain:
    three 8B-shaped servers may not fit one GPU), through plain (pairing.compare_to_better_through),
    marked `via`."""
    plain, eagle3 = modes
    direct = pairing.compare(blocks, name, [plain, eagle3])
    if direct:
        return direct.as_dict()
    through = pairing.compare_to_better_through(blocks, name, eagle3, plain)
    return {**through.as_dict(), "via": plain} if through else None


def modes_of(result: dict[str, Any], name: str) -> tuple[str, str]:
    """The plain and always-on EAGLE-3 servers `name` is held against: those started with the same
    flags and environment as `name` where both ran (a schedule with the prefill delayer against
    plain and EAGLE-3 with it: what a flag gives every mode is not the schedule's gain), else the
    stock two. A server that is itself one of its flags' two modes is held against the stock two."""
    records = configs.from_result(result)
    rec = records.get(name)
    if rec is None or not rec.variant or rec.kind == "plain" or (rec.kind == "fixed" and rec.steps == LAUNCH_STEPS):
        return FIXED_MODES

    def alike(n: str, kind: str) -> bool:
        r = records.get(n)
        return (r is not None and r.kind == kind and not r.twin and r.args == rec.args and r.env == rec.env
                and (kind == "plain" or r.steps == LAUNCH_STEPS))

    ran = result.get("configs", [])
    plain = next((n for n in ran if alike(n, "plain")), None)
    eagle3 = next((n for n in ran if alike(n, "fixed")), None)
    return (plain, eagle3) if plain and eagle3 else FIXED_MODES


def through_plain_note(cells: Iterable[dict[str, Any] | None]) -> list[str]:
    """The line under a table with ratios taken through plain (versus_better), and its blank line."""
    if not any(cell and cell.get("via") for cell in cells):
        return []
    return [("+: no block held this server, plain and EAGLE-3 together (merged calls): its ratio to plain "
             "over EAGLE-3's (at least 1.00), each taken within its own blocks; the interval resamples both."), ""]


def better_table(result: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per concurrency and switching config (a threshold, auto, adaptive): its tokens/s over the
    better of plain and always-on EAGLE-3 (the product's promise; versus_better), those started
    with its own flags where they ran (modes_of), median and interval; a config is left out where
    its two did not both run."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    names = result.get("configs", [])
    records = configs.from_result(result)
    held = {name: modes_of(result, name) for name in names}
    for c in levels(result):
        row = {name: ratio for name in names
               if name not in FIXED_MODES and not (name in records and records[name].twin)
               and all(m in names for m in held[name])
               if (ratio := versus_better(blocks_at(result, c), name, held[name]))}
        if row:
            out[c] = row
    return out


def step_table(result: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per concurrency and config, medians over the blocks of each window's decode step: wall ms,
    GPU-busy ms (device timer, every forward category), host ms (the rest: the GPU waiting for the
    host), tokens per step; GPU and host only with the device timer."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for c in levels(result):
        row: dict[str, dict[str, float]] = {}
        for name in result.get("configs", []):
            ws = [w for b in blocks_at(result, c) if (w := b["windows"].get(name)) and w.get("steps")]
            if not ws:
                continue
            cell = {"wall_ms": statistics.median(1000 * w["seconds"] / w["steps"] for w in ws),
                    "tokens_per_step": statistics.median(w["output_tokens"] / w["steps"] for w in ws)}
            timed = [w for w in ws if w.get("gpu_s")]
            if timed:
                cell["gpu_ms"] = statistics.median(1000 * sum(w["gpu_s"].values()) / w["steps"] for w in timed)
                cell["host_ms"] = statistics.median(1000 * (w["seconds"] - sum(w["gpu_s"].values())) / w["steps"]
                                                    for w in timed)
            row[name] = {k: round(v, 3) for k, v in cell.items()}
        if row:
            out[c] = row
    return out


def first_token_table(result: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per concurrency and config, over the blocks' windows that recorded a time to first token
    (bench.window.first_token_ms): the median of their p50 and of their p90 (ms), and the requests
    counted (`requests`) and those of them cut short before a first token (`censored`, a lower
    bound), summed."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for c in levels(result):
        row: dict[str, dict[str, float]] = {}
        for name in result.get("configs", []):
            ttfts = [t for b in blocks_at(result, c) if (w := b["windows"].get(name)) and (t := w.get("ttft_ms"))]
            if not ttfts:
                continue
            row[name] = {"p50": round(statistics.median(t["p50"] for t in ttfts), 1),
                         "p90": round(statistics.median(t["p90"] for t in ttfts), 1),
                         "requests": sum(t["n"] for t in ttfts), "censored": sum(t["censored"] for t in ttfts)}
        if row:
            out[c] = row
    return out


def server_columns(result: dict[str, Any], names: list[str], table: dict[str, dict[str, dict[str, Any]]],
                   cell_text: Callable[[dict[str, Any]], str]) -> list[str]:
    """A markdown table of one row per concurrency and one column per server ("-": none there)."""
    lines = ["| concurrency | " + " | ".join(label(result, n) for n in names) + " |", "|---:|" + "---:|" * len(names)]
    for c in sorted(table, key=int):
        cells = [cell_text(cell) if (cell := table[c].get(n)) is not None else "-" for n in names]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def step_cell(cell: dict[str, Any]) -> str:
    """A step_table cell: wall / GPU / host ms where the device timer ran, and tokens per step."""
    if "gpu_ms" in cell:
        return f"{cell['wall_ms']:.2f} / {cell['gpu_ms']:.2f} / {cell['host_ms']:.2f} ({cell['tokens_per_step']:.0f})"
    return f"{cell['wall_ms']:.2f} ({cell['tokens_per_step']:.0f})"


def first_token_cell(cell: dict[str, Any]) -> str:
    """A first_token_table cell: p50 / p90 ms, and the censored requests where there were any."""
    censored = f" ({cell['censored']:.0f} of {cell['requests']:.0f} censored)" if cell["censored"] else ""
    return f"{cell['p50']:.1f} / {cell['p90']:.1f}{censored}"


def window_host(w: dict[str, Any]) -> dict[str, float]:
    """A window's host figures where the server's counters were read (bench.hostinfo): per decode
    step, its wall ms and its scheduler thread's ms on a CPU and waiting for one; the rest of the
    server's processes in CPU cores; the probe's work seconds (the CPUs' speed)."""
    sched, steps, secs = w.get("scheduler") or {}, w.get("steps"), w.get("seconds")
    out: dict[str, float] = {}
    if steps and secs:
        out["wall"] = 1000 * secs / steps
        if "scheduler_cpu_s" in sched:
            out["on_cpu"] = 1000 * sched["scheduler_cpu_s"] / steps
            out["waiting"] = 1000 * sched.get("scheduler_wait_s", 0.0) / steps
    if secs and "server_cpu_s" in sched:
        out["rest_cores"] = (sched["server_cpu_s"] - sched.get("scheduler_cpu_s", 0.0)) / secs
    work = (w.get("host") or {}).get("probe_work_s")
    if work:
        out["probe_work"] = float(work)
    return out


def host_attribution(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per concurrency, where the windows' host time went: per config the median and range over the
    blocks of window_host's figures (`servers`), and, pooled over the configs (each window against
    its own server's median at that level, so that the configs' own speeds drop out), the spread
    of the wall time per step and of what may explain it, with each one's correlation to it
    (`spread`: figure -> (lowest, highest relative deviation, r with the wall or None))."""
    out: dict[str, dict[str, Any]] = {}
    for c in levels(result):
        per: dict[str, list[dict[str, float]]] = {}
        for b in blocks_at(result, c):
            for name, w in b["windows"].items():
                figures = window_host(w)
                if "on_cpu" in figures or "probe_work" in figures:
                    per.setdefault(name, []).append(figures)
        if not per:
            continue
        servers = {name: {k: (min(v), statistics.median(v), max(v))
                          for k in ws[0] if len(v := [f[k] for f in ws if k in f]) == len(ws)}
                   for name, ws in per.items()}
        deviations: dict[str, list[float]] = {}
        walls: dict[str, list[float]] = {}
        for name, ws in per.items():
            for key in ("wall", "on_cpu", "probe_work"):
                if not all(key in f and "wall" in f for f in ws):
                    continue
                mid = statistics.median(f[key] for f in ws)
                wall_mid = statistics.median(f["wall"] for f in ws)
                if mid > 0 and wall_mid > 0:
                    deviations.setdefault(key, []).extend(f[key] / mid - 1 for f in ws)
                    walls.setdefault(key, []).extend(f["wall"] / wall_mid - 1 for f in ws)
        spread: dict[str, tuple[float, float, float | None]] = {}
        for key, devs in deviations.items():
            r = None
            if key != "wall" and len(devs) >= 3:
                try:
                    r = round(statistics.correlation(devs, walls[key]), 2)
                except statistics.StatisticsError:  # one of them constant
                    r = None
            spread[key] = (round(min(devs), 3), round(max(devs), 3), r)
        out[c] = {"servers": servers, "spread": spread}
    return out


def attribution_lines(result: dict[str, Any]) -> list[str]:
    """The host attribution as the report's lines (empty where no counters were read)."""
    table = host_attribution(result)
    if not table:
        return []
    names = [n for n in result.get("configs", []) if any(n in row["servers"] for row in table.values())]
    lines = [("Where the host time went, per decode step (median [least-most] over the blocks): wall ms / the "
              "scheduler thread's ms on a CPU / its ms runnable but waiting for a CPU; the rest of the server "
              "in CPU cores:"), "",
             "| concurrency | " + " | ".join(label(result, n) for n in names) + " |", "|---:|" + "---:|" * len(names)]

    def span(t: tuple[float, float, float] | None, digits: int = 2) -> str:
        return "-" if t is None else f"{t[1]:.{digits}f} [{t[0]:.{digits}f}-{t[2]:.{digits}f}]"

    for c in sorted(table, key=int):
        cells = []
        for n in names:
            f = table[c]["servers"].get(n)
            if not f or "wall" not in f:
                cells.append("-")
                continue
            cells.append(f"{span(f['wall'])} / {span(f.get('on_cpu'))} / {span(f.get('waiting'))}"
                         + (f"; {f['rest_cores'][1]:.2f} cores" if "rest_cores" in f else ""))
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append("")
    words = {"wall": "wall time per step", "on_cpu": "the scheduler's time on a CPU per step",
             "probe_work": "a fixed piece of work's CPU time (the CPUs' speed, inverted)"}
    for c in sorted(table, key=int):
        spread = table[c]["spread"]
        parts = []
        for key in ("wall", "on_cpu", "probe_work"):
            if key in spread:
                lo, hi, r = spread[key]
                parts.append(f"{words[key]} {100 * lo:+.0f}% to {100 * hi:+.0f}%"
                             + (f" (r = {r:.2f} with the wall time)" if r is not None else ""))
        if parts:
            lines.append(f"- {c} requests, window to window (each against its server's median): " + "; ".join(parts))
    return lines + [""]


def topology_lines(topology: dict[str, Any] | None, owners: dict[str, list[int]]) -> list[str]:
    """The machine's CPUs and cores (bench.hostinfo.cpu_topology), and each core that two of the
    pinned (`owners`: the servers, the client) share."""
    if not topology or not topology.get("cpus"):
        return []
    n, cores = len(topology["cpus"]), topology.get("cores") or []
    shared = [group for group in cores if len(group) > 1]
    line = (f"- this process's CPUs: {n} on {len(cores)} cores"
            + (" (" + "; ".join(",".join(map(str, g)) for g in shared) + " share a core)" if shared else ""))
    clash = hostinfo.shared_cores(topology, owners)
    return [line] + [f"- one core shared: {c}" for c in clash]


def idle_cpu(result: dict[str, Any]) -> dict[str, float]:
    """Per server: the most CPU (in cores) it used during another server's window."""
    out: dict[str, float] = {}
    for blocks in result.get("blocks", {}).values():
        for b in blocks:
            for w in b["windows"].values():
                for name, share in (w.get("idle_cpu") or {}).items():
                    out[name] = max(out.get(name, 0.0), share)
    return out


def host_ranges(result: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Per host figure (steal share, CPU MHz, GPU SM MHz, GPU power): its least and most over the
    windows (bench.hostinfo)."""
    seen: dict[str, list[float]] = {}
    for blocks in result.get("blocks", {}).values():
        for b in blocks:
            for w in b["windows"].values():
                for k, v in (w.get("host") or {}).items():
                    seen.setdefault(k, []).append(float(v))
    return {k: (min(v), max(v)) for k, v in seen.items()}


PLAIN_ACCEPT = 1.1  # a median accept length under this: the server decoded plain (1.0: no drafts)


def ran_plain(row: dict[str, Any]) -> bool | None:
    """Whether a server decoded plain at a concurrency, by its median accept length there; None
    where none was measured. Measured, not inferred from N: at C = N the mode a threshold server
    holds depends on where the load came from (hysteresis; rows 38 and 40 at 16 requests)."""
    accept = row.get("accept_length")
    return None if accept is None else accept < PLAIN_ACCEPT


def fixed_servers(result: dict[str, Any]) -> list[str]:
    """The servers whose depth at a load is fixed before it comes: plain, always-on EAGLE-3 of any
    depth (without an environment of its own) and the written schedules (not `auto`, nor one
    started with flags of its own: those schedule the server's prefills otherwise)."""
    out = []
    for name, rec in configs.from_result(result).items():
        if name in result.get("configs", []) and (
                rec.one_depth is not None
                or (rec.kind == "schedule" and rec.schedule not in (None, "auto") and not rec.args)):
            out.append(name)
    return out


def learned_schedule_comparison(result: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per concurrency and `--speculative-depth-schedule auto` server: its tokens/s over the fixed
    server (fixed_servers) with the highest median there, within each block (the issue of a learned
    schedule: within a few percent of the best fixed one at every load); which one that was."""
    records = configs.from_result(result)
    learners = [n for n in result.get("configs", []) if (rec := records.get(n))
                and rec.kind == "schedule" and rec.schedule == "auto"]
    fixed = fixed_servers(result)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    if not learners or not fixed:
        return out
    table = level_table(result)
    for c in levels(result):
        ran = [n for n in fixed if n in table.get(c, {})]
        if not ran:
            continue
        best = max(ran, key=lambda n: table[c][n]["tok_per_s"])
        row = {n: {"best_fixed": best, **vs.as_dict()} for n in learners
               if (vs := pairing.compare(blocks_at(result, c), n, [best])) is not None}
        if row:
            out[c] = row
    return out


def auto_comparison(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per concurrency, auto against the alternatives a user has, each ratio taken within a block:
    the better of plain and always-on EAGLE-3, and the fixed threshold with the highest median
    tokens/s at that concurrency. Beside it, the floor of that comparison: the other fixed
    thresholds that ran the same mode as the best there (ran_plain), against it; servers that do
    the same work differ by that much, and the best of several is picked after the fact."""
    out: dict[str, dict[str, Any]] = {}
    names = result.get("configs", [])
    if "eagle3_auto" not in names:
        return out
    records = configs.from_result(result)
    table = level_table(result)
    for c in levels(result):
        blocks = blocks_at(result, c)
        row: dict[str, Any] = {}
        if all(n in names for n in FIXED_MODES):
            row["vs_better_of_plain_eagle3"] = versus_better(blocks, "eagle3_auto")
        fixed = [n for n in names if (rec := records.get(n)) and rec.kind == "threshold" and n in table.get(c, {})]
        if fixed:
            best = max(fixed, key=lambda n: table[c][n]["tok_per_s"])
            vs = pairing.compare(blocks, "eagle3_auto", [best])
            row["best_fixed"] = records[best].threshold
            row["vs_best_fixed"] = vs.as_dict() if vs else None
            mode = ran_plain(table[c][best])
            same = [n for n in fixed if n != best and mode is not None and ran_plain(table[c][n]) == mode]
            floors = {n: r for n in same if (r := pairing.compare(blocks, n, [best])) is not None}
            if floors:
                low = min(floors, key=lambda n: floors[n].median)
                row["same_mode_floor"] = {"threshold": records[low].threshold, **floors[low].as_dict()}
        out[c] = row
    return out


def ramp_summary(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per config on the ramp: mean tokens/s, and per level window its share of the better of plain
    and always-on EAGLE-3 in the same window of the schedule (min and median), mode changes."""
    ramp = result.get("ramp", {})
    fixed = [ramp[n]["windows"] for n in FIXED_MODES if n in ramp]
    best = [max(ws[i]["tok_per_s"] for ws in fixed) for i in range(min(map(len, fixed)))] if fixed else []
    out = {}
    for name, r in ramp.items():
        windows = r["windows"]
        shares = [w["tok_per_s"] / b for w, b in zip(windows, best, strict=False) if b > 0]
        out[name] = {"mean_tok_per_s": round(statistics.mean(w["tok_per_s"] for w in windows), 1) if windows else None,
                     "min_share_of_better": round(min(shares), 3) if shares else None,
                     "median_share_of_better": round(statistics.median(shares), 3) if shares else None,
                     "mode_changes": r.get("mode_changes")}
    return out


def switching_note(state: dict[str, Any]) -> str:
    """What a switching server did (its server info): a schedule's steps per depth and its changes,
    a threshold's modes; the GPU memory of each depth state beside the launch depth's; the accept
    length around plain phases."""
    if "schedule" in state:
        learned = f" (learned {state['learned']})" if state.get("learned") else ""
        steps = ", ".join(f"{n} at depth {d}" for d, n in (state.get("steps_by_depth") or {}).items())
        text = (f"schedule {state['schedule']}{learned}, steps {steps or 'none'}, "
                f"{state.get('depth_changes')} depth changes")
    else:
        crossover = f", crossover {state['crossover']}" if "crossover" in state else ""
        text = (f"threshold {state.get('threshold')}{crossover}, {state.get('speculative_steps')} speculative / "
                f"{state.get('plain_steps')} plain steps, {state.get('mode_changes')} mode changes")
    memory = state.get("state_memory_gib") or {}
    if memory:
        text += ("; GPU memory of the depth states beside the launch depth's: "
                 + ", ".join(f"depth {d} {float(g):.2f} GiB" for d, g in memory.items()))
    return text + acceptance_note(state)


def acceptance_note(state: dict[str, Any]) -> str:
    """The plugin's accept length before and after plain phases (server info), where measured."""
    acc = state.get("acceptance_around_plain") or {}
    if not acc.get("phases_measured"):
        return ""
    return (f"; accept length {acc['last_before']:.2f} in the last {acc['window_steps']} "
            f"speculative steps before a plain phase, {acc['last_after']:.2f} in the first "
            f"{acc['window_steps']} after it (worst of {acc['phases_measured']} phases: "
            f"{fmt2(acc.get('worst_after_over_before'))}x)")


def interval(d: dict[str, Any] | None) -> str:
    """"0.98x [0.95-1.01]": a ratio's median and bootstrap 95% interval ("-" where none); "+" after
    one taken through plain across calls (versus_better)."""
    if not d:
        return "-"
    return f"{d['median']:.2f}x [{d['low']:.2f}-{d['high']:.2f}]" + ("+" if d.get("via") else "")


def output_tokens_text(result: dict[str, Any]) -> str:
    """`256 output tokens`, or the range where the lengths were drawn (results before the spread
    have output_len alone)."""
    lengths = result.get("output_lengths")
    if lengths and lengths[0] != lengths[1]:
        return f"{lengths[0]}-{lengths[1]} output tokens (uniform, the same on every server)"
    return f"{result.get('output_len')} output tokens"


def learned_notes(result: dict[str, Any]) -> list[str]:
    """What `auto` learned before the blocks (BenchOptions.auto_learn_s)."""
    out = []
    for name, got in (result.get("learned") or {}).items():
        after = ", ".join(f"{c}: {x}" for c, x in (got.get("crossover_after") or {}).items())
        longer = ", ".join(f"{c}: {fmt2(x)} s" for c, x in (got.get("trial_s") or {}).items())
        out.append(f"- {label(result, name)}: {fmt2(got.get('seconds_per_level'))} s under each level's load before the "
                   f"blocks (prompts no window sends)"
                   + (f", longer where a trial ran on ({longer})" if longer else "")
                   + f"; crossover after each level: {after or 'not read'}")
    return out


def markdown(result: dict[str, Any]) -> str:
    names: list[str] = result.get("configs", [])
    model = result.get("model", {})
    sources = result.get("sources") or []
    lines = [f"# Decode throughput, {result.get('date', '')}", "",
             (f"Model: {model.get('size')}-shaped target ({model.get('layers')} layers, hidden {model.get('hidden')}), "
              f"{model.get('draft')} EAGLE-3 draft (designed accept length {fmt2(model.get('designed_accept_length'))}); "
              f"greedy, {output_tokens_text(result)} per request. Paired windows: at each "
              f"concurrency {blocks_text(result)}, each a window on every server back to back, the order "
              f"reversed every other block; a window counts {fmt2(result.get('window_s'))} s of output after "
              f"{fmt2(result.get('settle_s'))} s under load. A ratio is taken within a block; shown: the median "
              "over the blocks and its bootstrap 95% interval [low-high]"
              + (f"; merged from {len(sources)} calls (listed at the end)." if sources
                 else f"; measured over {result['calls']} calls." if (result.get("calls") or 0) > 1 else ".")), "",
             server_setting_text(result), ""]
    table = level_table(result)
    floors = twin_floors(result)
    if table:
        lines += [(f"Output tokens/s (median over the blocks) and the ratio to {label(result, reference(result))} "
                   "within a block:"), "",
                  "| concurrency | " + " | ".join(label(result, n) for n in names) + " |",
                  "|---:|" + "---:|" * len(names)]
        for c in sorted(table, key=int):
            blocks = max((cell["blocks"] for cell in table[c].values()), default=0)
            expected = blocks_expected(result, c)
            partial = f" ({blocks} of {expected} blocks)" if blocks < expected else ""
            calls = len(sources_at(result, c))
            mixed = f" ({calls} calls)" if calls > 1 else ""
            cells = []
            for n in names:
                cell = table[c].get(n)
                pooled = "*" if len(sources_at(result, c, n)) > 1 else ""
                cells.append("-" if cell is None else
                             f"{cell['tok_per_s']:.0f}{pooled}"
                             + (f" ({interval(cell['vs_reference'])})" if cell["vs_reference"] else ""))
            lines.append(f"| {c}{mixed}{partial} | " + " | ".join(cells) + " |")
        lines.append("")
        if sources:
            lines += [mixed_calls_note(result), ""]
    accepts = {c: {n: cell["accept_length"] for n, cell in row.items() if cell.get("accept_length")}
               for c, row in table.items()}
    drafting = [n for n in names if any(n in row for row in accepts.values())]
    if drafting:
        lines += [("Accept length (tokens a request gains per speculative step, median over the blocks; "
                   "1.00: the server decoded plain):"), "",
                  "| concurrency | " + " | ".join(label(result, n) for n in drafting) + " |",
                  "|---:|" + "---:|" * len(drafting)]
        for c in sorted(accepts, key=int):
            lines.append(f"| {c} | " + " | ".join(fmt2(accepts[c].get(n)) if n in accepts[c] else "-"
                                                   for n in drafting) + " |")
        lines.append("")
    better = better_table(result)
    if better:
        switching = [n for n in names if any(n in row for row in better.values())]
        floor_heads = [f"A/A floor, {label(result, b)}" for b in floors] or ["A/A floor"]
        lines += [("Each other server over the better of plain and always-on EAGLE-3 in the same block (those "
                   "started with the server's own flags where both ran), with the A/A floor ("
                   + (floors_text(result, floors) if floors else "a twin over its server, not measured here")
                   + ": the noise of the procedure itself):"), "",
                  "| concurrency | " + " | ".join([*(label(result, n) for n in switching), *floor_heads]) + " |",
                  "|---:|" + "---:|" * (len(switching) + len(floor_heads))]
        for c in sorted(better, key=int):
            cells = [interval(better[c].get(n)) for n in switching]
            cells += [interval(floors[b].get(c)) for b in floors] or ["not measured"]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines += ["", *through_plain_note(cell for row in better.values() for cell in row.values())]
    elif floors:
        for server, floor in floors.items():
            lines += [(f"A/A floor: {floors_text(result, [server])} within a block, the same procedure as every "
                       "comparison (a perfect bench: 1.00x with a narrow interval):"), "",
                      f"| concurrency | twin / {label(result, server)} | per-block ratios |", "|---:|---:|---|"]
            for c in sorted(floor, key=int):
                lines.append(f"| {c} | {interval(floor[c])} | {', '.join(f'{r:.3f}' for r in floor[c]['ratios'])} |")
            lines.append("")
    auto = auto_comparison(result)
    if auto:
        lines += ["`auto` against the alternatives (ratios within a block, median [95% interval]):", "",
                  ("| concurrency | auto / better of plain and EAGLE-3 | best fixed threshold | auto / best fixed "
                   "| another fixed threshold in the same mode / best fixed |"),
                  "|---:|---:|---:|---:|---:|"]
        for c in sorted(auto, key=int):
            a = auto[c]
            floor_ = a.get("same_mode_floor")
            same = f"{interval(floor_)} ({floor_['threshold']})" if floor_ else "-"
            lines.append(f"| {c} | {interval(a.get('vs_better_of_plain_eagle3'))} | {a.get('best_fixed', '-')} | "
                         f"{interval(a.get('vs_best_fixed'))} | {same} |")
        lines += ["", *through_plain_note(a.get("vs_better_of_plain_eagle3") for a in auto.values())]
    learned = learned_schedule_comparison(result)
    if learned:
        lines += [("A learned depth schedule (`auto`) over the fixed server with the highest median tokens/s at "
                   "each load (plain, EAGLE-3 of any depth, a written schedule), within each block:"), "",
                  "| concurrency | server | over the best fixed | the best fixed |", "|---:|---|---:|---|"]
        for c in sorted(learned, key=int):
            for n, cell in learned[c].items():
                lines.append(f"| {c} | {label(result, n)} | {interval(cell)} | {label(result, cell['best_fixed'])} |")
        lines.append("")
    steps = step_table(result)
    if steps:
        timed = any("gpu_ms" in cell for row in steps.values() for cell in row.values())
        lines += [("Per decode step (steps counted by each server; medians over the blocks): "
                   + ("wall / GPU busy / host ms (host: the GPU waiting for the host), tokens per step:" if timed
                      else "wall ms, tokens per step (GPU and host time need --device-timer):")), "",
                  *server_columns(result, names, steps, step_cell)]
    first = first_token_table(result)
    if first:
        lines += [("Time to first token, ms (the server's own stamps on the requests started in the counted span; "
                   "median over the blocks of each window's p50 / p90; censored: cut short by the window's end "
                   "before a first token and counted at their age then, a lower bound):"), "",
                  *server_columns(result, names, first, first_token_cell)]
    lines += report_steps.lines(result, lambda n: label(result, n))
    lines += attribution_lines(result)
    ramp = ramp_summary(result)
    if ramp:
        lines += [(f"Ramp: clients step through {', '.join(map(str, result.get('concurrency', [])))} and back, "
                  f"{result.get('ramp_hold_s')} s a level; share = a level's tokens/s over the better of plain "
                  "and EAGLE-3 at the same level:"), "",
                  "| config | mean tok/s | min share | median share | mode changes |", "|---|---:|---:|---:|---:|"]
        for n in names:
            r = ramp.get(n)
            if r:
                lines.append(f"| {label(result, n)} | {r['mean_tok_per_s']:.0f} | {fmt(r['min_share_of_better'])} | "
                             f"{fmt(r['median_share_of_better'])} | {fmt(r['mode_changes'])} |")
        lines.append("")
    lines += learned_notes(result)
    idle = idle_cpu(result)
    if idle:
        lines.append("- servers not under load: at most " + ", ".join(
            f"{label(result, n)} {v:.2f}" for n, v in sorted(idle.items())) + " CPU cores during another server's window")
    host = host_ranges(result)
    if host:
        parts = []
        if "steal_share" in host:
            parts.append(f"CPU time stolen by the hypervisor {100 * host['steal_share'][0]:.1f}-"
                         f"{100 * host['steal_share'][1]:.1f}%")
        for key, what in (("cpu_mhz", "CPU clock"), ("gpu_sm_mhz", "GPU SM clock"), ("gpu_power_w", "GPU power")):
            if key in host:
                unit = "W" if key == "gpu_power_w" else "MHz"
                parts.append(f"{what} {host[key][0]:.0f}-{host[key][1]:.0f} {unit}")
        lines.append("- the host over the windows: " + "; ".join(parts))
    cpus = {n: c for n, c in (result.get("cpus") or {}).items() if c}
    if cpus:
        alone = result.get("scheduler_cpus") or {}
        lines.append("- CPUs: " + "; ".join(
            f"{label(result, n)} {','.join(map(str, c))}"
            + (f" (its scheduler thread alone on {alone[n]})" if alone.get(n) is not None else "")
            for n, c in cpus.items()) + " (the client on others)")
    lines += topology_lines(result.get("cpu_topology"),
                            {**{label(result, n): c for n, c in cpus.items()}, "the client": result.get("client_cpus") or []})
    for name, info in result.get("servers", {}).items():
        lines.append(f"- {label(result, name)}: KV tokens in use after the load and a flush: "
                     f"{info.get('kv_used_after_flush')}; running-request limit "
                     f"{info.get('running_limit')}" + plain_step_note(info.get("speculative_disable")))
        st = info.get("speculative_disable")
        if st:
            lines.append(f"- {label(result, name)}: {switching_note(st)}")
            if st.get("estimates"):  # auto: what it measured, per batch-size bucket
                lines.append(f"- {label(result, name)}: per bucket, speculative / plain: {st['estimates']}")
        if info.get("serving_compiles"):  # a stall in whichever window held it: read that block with care
            lines.append(f"- {label(result, name)}: Triton kernels compiled while serving (the warm-up did not "
                         "meet their shapes; a window that held one counts the stall): " + "; ".join(
                             f"{c['kernel']} {c['seconds']:.2f} s at {c['at']}" for c in info["serving_compiles"]))
        if info.get("step_trace"):  # auto: its steps' times, as its estimate and the traffic read them
            lines += [f"- {label(result, name)} steps: {line}" for line in autotrace.render(info["step_trace"])]
    lines += [f"- server: {e}" for e in result.get("server_events", [])]
    lines += [f"- {label(result, n)} not run: {why}" for n, why in result.get("not_run", {}).items()]
    lines += [f"- remaining: {s}" for s in result.get("skipped", [])]
    lines += [f"- not measured: {s}" for s in result.get("not_measured", [])]
    lines += [f"- FAILED: {f.splitlines()[0]}" for f in result.get("failures", [])]
    if not result.get("failures") and (result.get("blocks") or result.get("ramp")):
        # a merged result: every call must have had a server decoding plain to compare with
        held_to = [output_reference(configs.from_result(s)) for s in sources] if sources else \
            [output_reference(configs.from_result(result))]
        if all(held_to):
            to = "" if set(held_to) == {"plain"} else \
                f" ({', '.join(sorted({label(result, str(n)) for n in held_to}))})"
            lines.append(f"- every output equal to plain decoding's{to} (aborted ones a prefix of it); "
                         "0 request errors")
        else:
            lines.append("- outputs NOT compared (no server decoding plain in this run); 0 request errors")
    diagnosed = result.get("diagnose", {})
    for name, diag in diagnosed.items():
        lines += ["", *diagnose.render(name, diag)]
    ref = reference(result)  # plain where it ran, as in the level table
    base = (diagnosed.get(ref) or {}).get("pyspy") or {}
    for name, diag in diagnosed.items():  # where each server's host time a step differs from the reference's
        d = pyspy.difference(base, diag.get("pyspy") or {}) if name != ref else None
        if d is not None:
            lines += ["", pyspy.render_difference(ref, name, d)]
    lines += source_lines(result)
    return "\n".join(lines).rstrip() + "\n"


def blocks_text(result: dict[str, Any]) -> str:
    """`6 blocks`; in a merged result, the blocks of every call there and how many a call took."""
    sources = result.get("sources") or []
    if not sources:
        return f"{result.get('pairs')} blocks"
    pairs = sorted({s.get("pairs") or 0 for s in sources})
    each = f"{pairs[0]}" if len(pairs) == 1 else f"{pairs[0]}-{pairs[-1]}"
    return f"the blocks of every call that measured it ({each} a call)"


def server_setting_text(result: dict[str, Any]) -> str:
    """What --server-env and --server-args gave every server; said where not recorded (a bench.json
    from before the bench kept them; in a merged result, the calls that did not)."""
    if "server_env" not in result and "server_args" not in result:
        return ("Every server's --server-env and --server-args: not recorded (a bench.json from before "
                "the bench kept them).")
    env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in (result.get("server_env") or {}).items())
    args = shlex.join(result.get("server_args") or [])
    text = ("Every server: " + (f"--server-env `{env}`" if env else "no --server-env") + ", "
            + (f"--server-args `{args}`" if args else "no --server-args"))
    unknown = [str(i) for i, s in enumerate(result.get("sources") or [], 1)
               if s.get("server_env") is None or s.get("server_args") is None]
    if unknown:
        text += (f"; not recorded by source{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} (a bench "
                 "from before it kept them): unknown there, not checked against the others")
    return text + "."


def mixed_calls_note(result: dict[str, Any]) -> str:
    """A merged result's table says what its figures mix: tokens/s medians pool calls, ratios do not."""
    n = len(result.get("sources") or [])
    mixed = mixed_levels(result)
    ref = label(result, reference(result))
    if not mixed:
        return (f"Merged from {n} calls, each concurrency measured by one of them; each ratio is taken "
                "within its own block.")
    return (f"Merged from {n} calls. At {', '.join(mixed)} requests several calls measured the level (marked): "
            "a tokens/s median marked * pools the windows of several calls, minutes or days apart, each with "
            "its own servers, and so do the accept-length, per-step and first-token medians below; each ratio "
            f"is still taken within its own block (windows seconds apart), against that block's {ref} window, "
            "and only those per-block ratios are pooled.")


def source_lines(result: dict[str, Any]) -> list[str]:
    """A merged result's calls, numbered as its blocks' `source` and the lines above say."""
    sources = result.get("sources") or []
    if not sources:
        return []
    lines = ["", (f"Sources: the {len(sources)} calls merged (`python -m bench merge`); bench.json keeps each "
                  "one's whole result under `sources` (its servers, checks, ramps, diagnoses) and tags each "
                  "block with its source:"), ""]
    for i, s in enumerate(sources, 1):
        names = ", ".join(label(result, n) for n in s.get("configs", []))
        conc = ", ".join(map(str, s.get("concurrency") or []))
        lines.append(f"- source {i}: `{s.get('path')}`, {s.get('date')}; concurrency {conc}; {names}; "
                     f"{s.get('pairs')} blocks a concurrency")
    return lines


def fmt2(x: Any) -> str:
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def fmt(x: float | None) -> str:
    return "-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))


def plot_concurrency(result: dict[str, Any], path: Path) -> None:
    """Tokens/s against concurrency, one line per config; below, each config's ratio to the reference
    (reference(): plain where it ran) within a block (median, bars: the 95% interval), with the A/A
    floor's interval (the reference's twin over it) as a grey band; a twin has no line there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = level_table(result)
    ref = reference(result)
    floor = floor_table(result, ref)  # the noise of a ratio to the reference: its twin's band
    records = configs.from_result(result)
    xs_all = sorted((int(c) for c in table), key=int)
    fig, (ax, ratio) = plt.subplots(2, 1, sharex=True, figsize=(7, 6.5), gridspec_kw={"height_ratios": [3, 2]})
    if floor:
        fx = [int(c) for c in sorted(floor, key=int)]
        ratio.fill_between(fx, [floor[str(c)]["low"] for c in fx], [floor[str(c)]["high"] for c in fx],
                           color="0.6", alpha=0.35, linewidth=0, label="A/A floor (95% interval)")
    for name in result.get("configs", []):
        xs = [c for c in xs_all if name in table[str(c)]]
        line = ax.plot(xs, [table[str(c)][name]["tok_per_s"] for c in xs], marker="o", label=label(result, name))[0]
        pooled = [c for c in xs if len(sources_at(result, str(c), name)) > 1]
        if pooled:  # a merged result: a median over several calls' windows, drawn hollow
            ax.plot(pooled, [table[str(c)][name]["tok_per_s"] for c in pooled], marker="o", linestyle="none",
                    color=line.get_color(), markerfacecolor="white", zorder=3)
        if name == ref or (name in records and records[name].twin):  # a twin's ratio: a floor, not a server
            continue
        rs = [(c, table[str(c)][name]["vs_reference"]) for c in xs if table[str(c)][name]["vs_reference"]]
        if rs:
            med = [r["median"] for _, r in rs]
            ratio.errorbar([c for c, _ in rs], med, yerr=[[m - r["low"] for m, (_, r) in zip(med, rs, strict=True)],
                                                          [r["high"] - m for m, (_, r) in zip(med, rs, strict=True)]],
                           marker="o", capsize=3, color=line.get_color())
    ratio.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ratio.set_xticks(xs_all, labels=[str(c) for c in xs_all], fontsize=8)  # 192 beside 256 on a log axis
    ratio.set_xlabel("concurrent requests (closed loop)")
    ax.set_ylabel("output tokens/s")
    ratio.set_ylabel(textwrap.fill(f"x {label(result, ref)}, within a block", 30) + "\n(bars: 95% interval)",
                     fontsize=8)
    sources = result.get("sources") or []
    ax.set_title(f"{result.get('model', {}).get('size')}-shaped model, {result.get('date', '')}"
                 + (f", merged from {len(sources)} calls" if sources else ""))
    for a in (ax, ratio):
        a.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if floor:
        ratio.legend(fontsize=7, loc="lower left")
    if sources:  # what the points mix, under the axes
        fig.text(0.01, 0.01, ("hollow: a tokens/s median over the windows of several calls; " if mixed_levels(result)
                              else "") + "each ratio: within its own block (windows seconds apart)", fontsize=7)
        fig.tight_layout(rect=(0, 0.03, 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ramp(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ramp = result.get("ramp", {})
    names = [n for n in result.get("configs", []) if n in ramp]
    switching = [n for n in names if any(w.get("plain_share") is not None for w in ramp[n]["windows"])]
    fig, axes = plt.subplots(2 + len(switching), 1, sharex=True, figsize=(9, 5 + 0.8 * len(switching)),
                             gridspec_kw={"height_ratios": [4, 1.2] + [0.8] * len(switching)})
    hold = float(result.get("ramp_hold_s") or 1)
    for name in names:
        ws = ramp[name]["windows"]
        axes[0].step([w["t"] for w in ws] + [ws[-1]["t"] + hold], [w["tok_per_s"] for w in ws] + [ws[-1]["tok_per_s"]],
                     where="post", label=label(result, name))
    axes[0].set_ylabel("output tokens/s")
    axes[0].legend(fontsize=8)
    axes[0].grid(alpha=0.3)
    first = ramp[names[0]]["windows"] if names else []
    axes[1].step([w["t"] for w in first] + [first[-1]["t"] + hold] if first else [],
                 [w["level"] for w in first] + [first[-1]["level"]] if first else [], where="post", color="black")
    axes[1].set_yscale("log", base=2)
    axes[1].set_ylabel("clients")
    for ax, name in zip(axes[2:], switching, strict=True):
        ws = ramp[name]["windows"]
        ax.bar([w["t"] for w in ws], [w.get("plain_share") or 0 for w in ws], width=hold, align="edge", color="tab:gray")
        for w in ws:
            if w.get("crossover") is not None:
                ax.text(w["t"] + hold / 2, 0.5, str(w["crossover"]), ha="center", va="center", fontsize=6)
        ax.set_ylim(0, 1)
        ax.set_ylabel(label(result, name).replace("EAGLE-3 + ", "") + "\nplain share", fontsize=7)
    axes[-1].set_xlabel("seconds into the ramp")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(result: dict[str, Any], out: Path) -> list[Path]:
    """bench.json, bench.md and, where matplotlib is installed, concurrency.png and ramp.png."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json", out / "bench.md"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        text += "\n(no plots: matplotlib is not installed here; `python -m bench run --render bench.json` draws them)\n"
    else:
        for key, name, plot, caption in (("blocks", "concurrency.png", plot_concurrency, "tokens/s by concurrency"),
                                         ("ramp", "ramp.png", plot_ramp, "tokens/s on the ramp, with the mode")):
            if result.get(key):
                plot(result, out / name)
                paths.append(out / name)
                text += f"\n![{caption}]({name})\n"
    paths[1].write_text(text)
    return paths
