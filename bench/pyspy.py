"""Where the scheduler's host time goes, without the profiler's overhead: py-spy samples.

The torch profiler (bench.profile) records every Python call when `with_stack` is on, which slows
the host several times over; a step that is GPU-bound unprofiled becomes host-bound under it. py-spy
reads the scheduler's stacks from outside at a fixed rate (`--nonblocking`: the process is never
paused), so the shares it reports are those of the unprofiled server. `--idle` keeps samples where
the thread waits (a CUDA sync, a lock): a blocked host is exactly what we look for.

Used by `bench run --diagnose` (bench.diagnose) on every server at full load: the share of the
scheduler thread's samples in each function (inclusive and self), and ms per step when the step
time is known (the load's wall time over the decode steps the server counted).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

from bench import hostinfo

MAIN_LOOP = "event_loop"        # event_loop_normal / event_loop_overlap: the scheduler thread
IDLE = "Scheduler.on_idle"      # no batch to run: before or after the load, never part of a step
_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
_FRAME_LINE_NO = re.compile(r":\d+\)$")


def binary(extra_dirs: tuple[Path, ...] = ()) -> str | None:
    for d in extra_dirs:
        p = d / "py-spy"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return shutil.which("py-spy")


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc/*/stat parent links)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses
        parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        frontier += kids
    return found


def scheduler_pid(server_pid: int) -> int | None:
    """The scheduler process among the server's descendants (hostinfo.scheduler_pid)."""
    return hostinfo.scheduler_pid(descendants(server_pid))


def record(exe: str, pid: int, seconds: float, out: Path, rate: int = 1000) -> Path:
    cmd = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--duration", str(int(seconds)),
           "--format", "raw", "--output", str(out), "--nonblocking", "--idle", "--threads"]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=seconds + 60)
    if p.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy failed ({p.returncode}): {(p.stderr or p.stdout)[-400:]}")
    return out


def parse(raw: str) -> list[tuple[list[str], int]]:
    stacks = []
    for line in raw.splitlines():
        m = _LINE.match(line.strip())
        if m:
            stacks.append((m["stack"].split(";"), int(m["count"])))
    return stacks


def _func(frame: str) -> str:
    """'name (path/to/file.py:123)' -> 'name (path/to/file.py)': one entry per function."""
    frame = _FRAME_LINE_NO.sub(")", frame)
    return re.sub(r"\(.*?(sglang/|torch/|site-packages/)", r"(\1", frame)


# `inclusive_all` and `self_all` keep every function with at least this share of the busy samples
# (%), so that two servers' summaries can be set against each other (difference) beyond their top rows.
KEPT_PCT = 0.05
# Left out of a difference: the frames of the plugin framework's hook wrappers (each mirrors the
# function it wraps, which is shown) and the loop's own frames (all of a step on both sides).
WRAPPER = "_wrap_fn.<locals>.wrapper (plugins/hook_registry.py)"
WHOLE_STEP_PCT = 99.0


def summarize(raw: str, step_ms: float | None = None, top: int = 30) -> dict[str, Any]:
    """Shares of the scheduler thread's busy samples by function, inclusive and self. Idle samples
    (no batch: the window ran past the load) are counted apart and left out, so that ms per step is
    the host time of a step under load, not diluted by time with nothing to do."""
    stacks = parse(raw)
    by_thread: Counter[str] = Counter()
    for frames, n in stacks:
        if any(MAIN_LOOP in f for f in frames[1:]):
            by_thread[frames[0]] += n
    if not by_thread:
        return {"error": "no sample of the scheduler loop"}
    thread = by_thread.most_common(1)[0][0]
    idle = 0
    inclusive: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    for frames, n in stacks:
        if frames[0] != thread:
            continue
        funcs = [_func(f) for f in frames[1:]]
        if any(f.startswith(IDLE + " ") for f in funcs):
            idle += n
            continue
        for f in set(funcs):
            inclusive[f] += n
        if funcs:
            leaf[funcs[-1]] += n

    total = by_thread[thread] - idle
    if total <= 0:
        return {"error": f"all {idle} samples of the scheduler loop are idle (no batch): the load missed the window"}

    def rows(c: Counter[str]) -> list[list[Any]]:
        return [[f, round(100.0 * n / total, 2)] + ([round(step_ms * n / total, 3)] if step_ms else [])
                for f, n in c.most_common(top)]
    return {"samples": total, "idle_samples": idle, "step_ms": step_ms, "inclusive_pct": rows(inclusive),
            "self_pct": rows(leaf),
            **{f"{kind}_all": {f: round(100.0 * n / total, 3) for f, n in c.most_common()
                               if 100.0 * n / total >= KEPT_PCT}
               for kind, c in (("inclusive", inclusive), ("self", leaf))}}


def difference(base: dict[str, Any], other: dict[str, Any], top: int = 15) -> dict[str, Any] | None:
    """The functions whose share differs most between two servers' summaries, self (where the
    time itself goes; the differences add up to the step's) and inclusive (which caller spends
    it), in ms per step where both know their step time, else in % of samples: rows of [function,
    base, other, other - base], the largest differences first. None where either summary lacks
    them (an error, or a bench.json from before they were kept)."""
    if any(s.get(f"{kind}_all") is None for s in (base, other) for kind in ("inclusive", "self")):
        return None
    ms = bool(base.get("step_ms")) and bool(other.get("step_ms"))
    scale = [s["step_ms"] / 100.0 if ms else 1.0 for s in (base, other)]
    out: dict[str, Any] = {"unit": "ms/step" if ms else "% of samples"}
    for kind in ("self", "inclusive"):
        a, b = base[f"{kind}_all"], other[f"{kind}_all"]
        funcs = {f for f in set(a) | set(b) if f != WRAPPER
                 and not (a.get(f, 0.0) >= WHOLE_STEP_PCT and b.get(f, 0.0) >= WHOLE_STEP_PCT)}
        rows = [[f, round(a.get(f, 0.0) * scale[0], 3), round(b.get(f, 0.0) * scale[1], 3)] for f in funcs]
        rows = [[f, x, y, round(y - x, 3)] for f, x, y in rows]
        rows.sort(key=lambda r: (-abs(r[3]), r[0]))
        out[kind] = rows[:top]
    return out


def render_difference(base_name: str, name: str, d: dict[str, Any]) -> str:
    lines = [(f"py-spy {name} against {base_name}: the functions whose {d['unit']} differ most "
              f"({base_name}, {name}, difference), self then inclusive")]
    lines += [f"  {kind[:4]} {x:8.3f} {y:8.3f} {diff:+8.3f}  {f}"
              for kind in ("self", "inclusive") for f, x, y, diff in d[kind]]
    return "\n".join(lines)


def add_arguments(ap: Any) -> None:
    ap.add_argument("base", help="py-spy's raw samples of the server to compare against (pyspy_NAME.txt)")
    ap.add_argument("other", help="py-spy's raw samples of the other server")
    ap.add_argument("--step-ms", nargs=2, type=float, metavar=("BASE", "OTHER"),
                    help="each server's ms per step under that load (else shares in %%)")
    ap.add_argument("--top", type=int, default=25, help="how many functions to show")


def main(args: Any) -> int:
    """Two servers' scheduler samples from `bench run --diagnose` (pyspy_NAME.txt), function by
    function: where one spends more host time a step than the other."""
    steps = args.step_ms or (None, None)
    base, other = (summarize(Path(p).read_text(), ms) for p, ms in zip((args.base, args.other), steps, strict=True))
    for name, s in ((args.base, base), (args.other, other)):
        if "error" in s:
            print(f"{name}: {s['error']}")
            return 1
    d = difference(base, other, args.top)
    assert d is not None  # both summaries were just made
    print(render_difference(Path(args.base).name, Path(args.other).name, d))
    return 0


def render(name: str, s: dict[str, Any]) -> str:
    if "error" in s:
        return f"py-spy {name}: {s['error']}"
    unit = f", ~{s['step_ms']:.2f} ms/step (the load's)" if s.get("step_ms") else ""
    idle = f" ({s['idle_samples']} idle ones, with no batch, left out)" if s.get("idle_samples") else ""
    lines = [(f"py-spy {name}: {s['samples']} busy samples of the scheduler thread{idle}{unit}; % of "
              f"samples (ms/step) inclusive, then self")]
    for kind in ("inclusive_pct", "self_pct"):
        for row in s[kind]:
            ms = f" {row[2]:7.3f} ms" if len(row) > 2 else ""
            lines.append(f"  {kind[:4]} {row[1]:6.2f}%{ms}  {row[0]}")
    return "\n".join(lines)
