"""`bench run --diagnose`: where each server's time goes, for a benchmark figure that needs
explaining.

- GPU seconds per forward category (decode, extend, the draft's K/V-only writes, ...) in every
  closed-loop window, from sglang's device timer (SGLANG_ENABLE_METRICS_DEVICE_TIMER: CUDA events
  around each forward); the rest of a window's wall time is the GPU waiting for the host.
- At full load: the scheduler's stacks sampled by py-spy (the host's share per function, in ms
  per step) and a torch-profiler window of a few steps (launches, syncs, GPU busy time per step:
  bench.profile).

The device timer and the profiler cost time themselves: compare servers with each other under
--diagnose, not with a run without it.
"""
from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import profile, pyspy
from smoke import client
from smoke.client import Prompt
from smoke.deadline import Deadline
from smoke.server import Server

SERVER_ENV = {"SGLANG_ENABLE_METRICS_DEVICE_TIMER": "1"}
FORWARD_SECONDS = "sglang:forward_execution_seconds_total"  # the device timer's counter, per category
DECODE_PASSES = "sglang:cuda_graph_passes_total"  # one per decode batch (mode="decode_...")
PROFILE_STEPS = 20
PYSPY_SECONDS = 5.0
SETTLE_S = 1.5  # into a full-load run: past the first prefill wave, into full-batch decode
# the batch stays full this long past the py-spy sample (the load's tail, its batch shrinking to 0,
# brings batch sizes the windows never ran, and their kernels' first launches, into no sample)
LOAD_SPARE_S = 1.5


def scrape(base: str) -> dict[str, float]:
    return client.metrics(base)


def gpu_seconds(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """GPU seconds per forward category between two /metrics scrapes ({} with the device timer off)."""
    out: dict[str, float] = {}
    for key, value in after.items():
        if key.startswith(FORWARD_SECONDS + "{"):
            cat = re.search(r'category="([^"]*)"', key)
            name = cat.group(1) if cat else "?"
            out[name] = out.get(name, 0.0) + value - before.get(key, 0.0)
    return {k: round(v, 4) for k, v in sorted(out.items()) if v > 0}


def during_load(base: str, prompts: list[Prompt], concurrency: int, timeout: float,
                action: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run `action` SETTLE_S into a load and wait for the load; a failure is reported, not raised."""
    load = client.in_background(lambda: client.run_concurrent(base, prompts, concurrency, timeout))
    try:
        try:
            time.sleep(SETTLE_S)
            return action()
        finally:
            load.result()
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not fail the benchmark
        return {"error": f"{type(exc).__name__}: {exc}"}


def decode_steps(before: dict[str, float], after: dict[str, float]) -> int | None:
    """Decode batches run between two /metrics scrapes (sglang counts one per decode step, graph or
    not); None where the server exports no such counter."""
    keys = [k for k in after if k.startswith(DECODE_PASSES + "{") and re.search(r'mode="decode', k)]
    if not keys:
        return None
    return round(sum(after[k] - before.get(k, 0.0) for k in keys))


def full_load_prompts(concurrency: int, tok_per_s: float | None, mean_output: int) -> int:
    """How many prompts a full-load run sends, so that its batch is still full when the py-spy
    sample ends: enough for the server's measured tokens/s at this concurrency over the settle,
    the sample and LOAD_SPARE_S, past the first `concurrency` (at least 3 a client). A fixed 3 a
    client ran out after 4 s on EAGLE-3 at 64 requests: half its sample was the tail and idle."""
    if not tok_per_s or mean_output <= 0:
        return 3 * concurrency
    busy_s = SETTLE_S + PYSPY_SECONDS + LOAD_SPARE_S
    return concurrency + max(2 * concurrency, math.ceil(tok_per_s * busy_s / mean_output))


def load_step_ms(elapsed_s: float, steps: int | None, tok_per_s: float | None, batch: int) -> float | None:
    """A full-load run's ms per decode step: its wall time over the decode steps the server counted
    (a speculative step gains several tokens a request, so tokens/s alone would make its steps look
    3x shorter); where the server counts none, from tokens/s at one token a request a step."""
    if steps:
        return 1000.0 * elapsed_s / steps
    return 1000.0 * batch / tok_per_s if tok_per_s else None


def summarize_pyspy(raw: dict[str, Any], step_ms: float | None) -> dict[str, Any]:
    """py-spy's shares, in ms per step where the full load's step time is known (load_step_ms)."""
    if "error" in raw:
        return raw
    return pyspy.summarize(raw["raw"], step_ms)


def full_load(srv: Server, prompts: list[Prompt], concurrency: int, out: Path,
              pyspy_dirs: tuple[Path, ...], deadline: Deadline) -> dict[str, Any]:
    """py-spy and torch-profiler summaries of `srv` at full load (two runs of `prompts`)."""
    timeout = deadline.request_timeout(240)
    result: dict[str, Any] = {}
    exe = pyspy.binary(pyspy_dirs)
    pid = pyspy.scheduler_pid(srv.pgid) if srv.pgid is not None else None
    if exe is None or pid is None:
        result["pyspy"] = {"error": "no py-spy binary" if exe is None else "no scheduler process found"}
    else:
        before = scrape(srv.base)
        t0 = time.time()
        raw = during_load(srv.base, prompts, concurrency, timeout, lambda: {"raw": pyspy.record(
            exe, pid, PYSPY_SECONDS, out / f"pyspy_{srv.cfg.name}.txt").read_text()})
        elapsed = time.time() - t0
        steps = decode_steps(before, scrape(srv.base))
        tok_s = sum(p.max_new_tokens for p in prompts) / elapsed
        result["pyspy"] = summarize_pyspy(raw, load_step_ms(elapsed, steps, tok_s, concurrency))
    trace_dir = out / f"profile_{srv.cfg.name}"
    def start_profile() -> dict[str, Any]:
        profile.start(srv.base, trace_dir, PROFILE_STEPS)
        return {}

    started = during_load(srv.base, prompts, concurrency, timeout, start_profile)
    if "error" in started:
        result["profile"] = started
        return result
    trace = profile.wait_for_trace(trace_dir)
    if trace is None:
        result["profile"] = {"error": f"no trace under {trace_dir}"}
    else:
        result["profile"] = profile.summarize(trace, PROFILE_STEPS)
        trace.unlink()  # tens of MB; the summary is what is kept
    return result


def render(name: str, diag: dict[str, Any]) -> list[str]:
    lines = []
    for key, show in (("pyspy", pyspy.render), ("profile", profile.render)):
        part = diag.get(key) or {}
        lines.append(f"{key} {name}: {part['error']}" if "error" in part else show(name, part))
    return lines
