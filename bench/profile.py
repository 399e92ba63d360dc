"""Where a decode step's time goes: a torch-profiler window of N steps at full load, summarised.

Used by `bench run --diagnose` (bench.diagnose) on every server at full load, so that servers
are compared step for step: wall time per step, GPU busy time per step, and how
many kernel launches, graph launches, copies and host syncs each step issues (a CUDA-graph step
should be a handful of launches; hundreds mean eager work on the host's critical path). The top
Python functions by inclusive time show where the host spends it.

The profiler adds overhead (with_stack), so compare servers, not absolute numbers.
"""
from __future__ import annotations

import gzip
import json
import time
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

from smoke import client

LAUNCHES = {
    "kernel_launches": ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"),
    "graph_launches": ("cudaGraphLaunch", "cuGraphLaunch"),
    "memcpy": ("cudaMemcpyAsync", "cudaMemcpy"),
    "syncs": ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize"),
}


def start(base: str, out_dir: Path, steps: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    client.post(base + "/start_profile", {  # answers "Start profiling." as text
        "output_dir": str(out_dir), "num_steps": steps, "activities": ["CPU", "GPU"],
        "with_stack": True, "record_shapes": False}, timeout=60)


def wait_for_trace(out_dir: Path, timeout: float = 90) -> Path | None:
    end = time.time() + timeout
    while time.time() < end:
        found = sorted(out_dir.rglob("*.json.gz")) + sorted(out_dir.rglob("*.json"))
        if found:
            size = found[0].stat().st_size
            time.sleep(2)  # still being written?
            if found[0].stat().st_size == size:
                return found[0]
        time.sleep(1)
    return None


def _busy_intervals(gpu: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The GPU events' union as disjoint, sorted (start, end) intervals (us)."""
    merged: list[tuple[float, float]] = []
    for s, e in sorted((ev["ts"], ev["ts"] + ev["dur"]) for ev in gpu):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _host_during_gaps(events: list[dict[str, Any]], gaps: list[tuple[float, float]]) -> Counter[str]:
    """For each GPU-idle gap, the innermost Python frame of the launching thread at the gap's middle,
    weighted by the gap's length: what the host was busy with while the GPU waited."""
    launches = LAUNCHES["kernel_launches"] + LAUNCHES["graph_launches"]
    by_thread = Counter((e.get("pid"), e.get("tid")) for e in events if e.get("name") in launches)
    if not by_thread or not gaps:
        return Counter()
    thread = by_thread.most_common(1)[0][0]
    frames = [e for e in events if e.get("cat") == "python_function" and (e.get("pid"), e.get("tid")) == thread]
    out: Counter[str] = Counter()
    for s, e in gaps:
        mid = (s + e) / 2
        covering = [f for f in frames if f["ts"] <= mid <= f["ts"] + f["dur"]]
        name = min(covering, key=lambda f: f["dur"])["name"] if covering else "(no Python frame)"
        out[name] += round(e - s)  # whole microseconds
    return out


STEP_MARKER = "): run_batch"  # sglang's Scheduler.run_batch: one call per scheduled batch


def summarize(trace: Path, steps: int, top: int = 25, gap_us: float = 20.0) -> dict[str, Any]:
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "python_function")]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not host:
        return {"trace": trace.name, "error": "no host events in the trace"}
    t0 = min(e["ts"] for e in host)
    t1 = max(e["ts"] + e["dur"] for e in host)
    # sglang's own step count can differ from the window's; count the batches seen when stacks exist
    seen = sum(1 for e in events if e.get("cat") == "python_function" and e["name"].endswith(STEP_MARKER))
    per = max(seen or steps, 1)
    busy = _busy_intervals(gpu)
    # GPU idle between consecutive busy intervals (only gaps long enough to be the host's doing)
    gaps = [(e0, s1) for (_, e0), (s1, _) in pairwise(busy) if s1 - e0 >= gap_us]
    idle = _host_during_gaps(events, gaps)
    counts = Counter(e["name"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver"))
    kern: Counter[str] = Counter()
    kern_n: Counter[str] = Counter()
    for e in gpu:
        kern[e["name"][:90]] += e["dur"]
        kern_n[e["name"][:90]] += 1
    py: Counter[str] = Counter()
    for e in events:
        if e.get("cat") == "python_function":
            py[e["name"]] += e["dur"]
    return {
        "trace": trace.name, "steps": per, "steps_requested": steps, "steps_seen": seen,
        "gpu_idle_gaps_per_step": round(len(gaps) / per, 1),
        "gpu_idle_ms_per_step": round(sum(e - s for s, e in gaps) / 1000.0 / per, 3),
        "host_during_gpu_idle_ms_per_step": [(name[-110:], round(us / 1000.0 / per, 3))
                                             for name, us in idle.most_common(10)],
        "wall_ms_per_step": round((t1 - t0) / 1000.0 / per, 3),
        "gpu_busy_ms_per_step": round(sum(e - s for s, e in busy) / 1000.0 / per, 3),
        "per_step": {k: round(sum(counts[n] for n in names) / per, 1) for k, names in LAUNCHES.items()},
        "top_gpu_ms_per_step": [(name, round(us / 1000.0 / per, 3), kern_n[name]) for name, us in kern.most_common(40)],
        "top_python_ms_per_step": [(name[-110:], round(us / 1000.0 / per, 3)) for name, us in py.most_common(top)],
    }


def render(name: str, s: dict[str, Any]) -> str:
    if "error" in s:
        return f"profile {name}: {s['error']}"
    lines = [f"profile {name}: {s['steps']} steps, {s['wall_ms_per_step']} ms/step wall, "
             f"{s['gpu_busy_ms_per_step']} ms/step GPU busy, {s.get('gpu_idle_ms_per_step')} ms/step GPU idle "
             f"in gaps >= 20 us; " + ", ".join(f"{k} {v}/step" for k, v in s["per_step"].items())]
    lines += [f"  idle {ms:8.3f} ms  {fn}" for fn, ms in s.get("host_during_gpu_idle_ms_per_step", [])]
    lines += [f"  gpu {ms:8.3f} ms  x{n:<5d} {k}" for k, ms, n in s.get("top_gpu_ms_per_step", [])]
    lines += [f"    {ms:8.3f} ms  {fn}" for fn, ms in s["top_python_ms_per_step"]]
    return "\n".join(lines)
