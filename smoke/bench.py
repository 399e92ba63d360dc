"""Output tokens/s at several concurrencies for plain, always-on EAGLE-3, upstream's adaptive EAGLE-3 and
EAGLE-3 with the dynamic disable threshold (CUDA graphs on), on the 1B-shaped generated models.

    python -m smoke bench --models DIR --out DIR [--threshold 16] [--concurrency 1,8,256] [--ab-rounds N]

Every configuration gets the same prompts (greedy, ignore_eos, fixed lengths), so the EAGLE-3
outputs are also compared with the plain ones (a mismatch is a failure: the plain step under CUDA
graphs must not change results). Prints a table with the ratio to plain.

--ab-rounds N (A/B mode) measures with every configuration's server up at once and the load (each
concurrency in turn) sent to one server at a time, N rounds, the order reversed every other round. On the
H200 the host's speed drifts by up to 1.6x within minutes (docs/gpu-runs/2026-11-30), and one server
measured after another turns that drift into the ratio; interleaved rounds give each ratio from
measurements seconds apart, and their spread says how far to trust it. Servers started later get smaller
KV pools (each sizes its pool from the memory free at its start); where a round overflows the smaller
one, only that server would evict radix-cache entries, so the A/B gives every server the smallest pool.
The table also gives the ratio per round order and their geometric mean; --ab-primer runs an unmeasured
window on the same server before each measured one (a measured window then never follows the other
server's load, whose effect on the next server the H200 runs 31, 34 and 35 suggest; run 36 of
2026-12-01 showed no such effect). --ab-pin-cpus gives each server's processes CPUs of their own and
the client the rest: the H200's full-load rate is bimodal per window (~100k or ~65k tok/s at 1B for
either server) with no CPU steal, which leaves the OS's thread placement as a suspect. Every window
records the host's CPU steal and load.

--device-timer turns on sglang's device timer (CUDA events around each forward pass; the series times the
draft's K/V-only writes too) and splits every A/B window's GPU time by forward category (prefill, decode,
draft writes, ...); the rest of the wall time is the GPU waiting for the host or the client. With the
prefill batches counted from the server log, it says where one server's extra time per round goes.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shlex
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from smoke import client, profile, pyspy
from smoke.client import Prompt
from smoke.runner import Deadline, SmokeFailure, check_log_clean, draft_plain_step, spec_state
from smoke.server import Server, ServerConfig, log_tail, pinned

# eagle3_adaptive: upstream's own way to stop drafting (--speculative-adaptive), the reference ours has
# to beat at high load. Its default config (sglang/srt/speculative/adaptive_spec_params.py) minus the
# 7-step tier of batch 1: that tier's draft-extend graph capture crashed the server at start on the
# H200 (illegal memory access, triton attention, graphs up to batch 256; docs/gpu-runs/2026-11-30,
# run 13). The 0-step tier from batch 64 that matters at high load is unchanged.
ADAPTIVE_CONFIG = {
    "1": {"candidate_steps": [1, 3], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0},
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
}
CONFIGS = ("plain", "eagle3", "eagle3_adaptive", "eagle3_thr")
# A/B mode: seconds to budget per server start (59-111 s seen on the H200, 1B and 8B models)
AB_START_S_PER_SERVER = 75


@dataclass
class BenchOptions:
    models: Path
    out: Path
    threshold: int = 16
    concurrency: tuple[int, ...] = (1, 8, 256)
    output_len: int = 256
    port: int = 30000
    mem_fraction: float = 0.3
    configs: tuple[str, ...] = CONFIGS
    deadline: Deadline = field(default_factory=lambda: Deadline(time.time() + 3600))
    min_server_s: float = 150
    min_measure_s: float = 75
    health_timeout: float = 420
    profile_steps: int = 0  # >0: torch-profile that many steps at full load (plain and eagle3_thr)
    pyspy_seconds: float = 0  # >0: py-spy the scheduler that long at full load (plain and eagle3_thr)
    # >0 (A/B): py-spy the scheduler that long from the moment a round's load is sent: the admission of
    # a wave of requests, where the device timer found the threshold server's extra GPU idle time
    pyspy_admission_seconds: float = 0
    pyspy_dirs: tuple[Path, ...] = ()  # where to look for the py-spy binary besides PATH
    server_args: tuple[str, ...] = ()  # appended to every bench server's flags (e.g. --gc-threshold)
    ab_rounds: int = 0  # >0: A/B mode (see the module docstring)
    ab_primer: bool = False  # A/B: an unmeasured window on the same server before each measured one
    # A/B: each server's processes on CPUs of their own, the client (this process) on the rest
    ab_pin_cpus: bool = False
    device_timer: bool = False  # GPU seconds per forward category in each A/B window (module docstring)
    # >0: --max-total-tokens of every bench server. A/B servers size their KV pools from the memory free
    # at their start, so a later one gets a smaller pool; where a round's tokens exceed it, only that
    # server evicts radix-cache entries (8B: plain 348k tokens, the threshold server 148k, a round 233k)
    max_total_tokens: int = 0


def workload(vocab: int, concurrency: int, output_len: int, seed: int) -> list[Prompt]:
    rnd = random.Random(seed * 1000 + concurrency)
    # a few seconds of traffic per cell (a cell of ~1 s was mostly ramp-up and noise), and three full
    # waves at high load so that the server log holds enough full-batch intervals
    n = 16 * concurrency if concurrency < 64 else 3 * concurrency
    return [Prompt(f"c{concurrency}-{i}", tuple(rnd.randrange(3, vocab) for _ in range(rnd.randint(32, 64))),
                   output_len) for i in range(n)]


def server_config(name: str, opts: BenchOptions) -> ServerConfig:
    max_bs = max(opts.concurrency)
    cfg = ServerConfig(name, opts.models / "target", cuda_graph=True, cuda_graph_max_bs=max_bs,
                       max_running=max_bs, mem_fraction=opts.mem_fraction, enable_metrics=True)
    if name != "plain":
        cfg.draft = opts.models / "draft"
    if name == "eagle3_thr":
        cfg.threshold = opts.threshold
    if name == "eagle3_adaptive":
        cfg.extra = (*cfg.extra, "--speculative-adaptive", "--speculative-adaptive-config",
                     str(opts.out / "adaptive_config.json"))
    cfg.extra = (*cfg.extra, *opts.server_args)
    if opts.device_timer:
        cfg.env["SGLANG_ENABLE_METRICS_DEVICE_TIMER"] = "1"
    if opts.max_total_tokens:
        cfg.extra = (*cfg.extra, "--max-total-tokens", str(opts.max_total_tokens))
    return cfg


POOL_TOLERANCE = 1.1  # KV pools within 10% of each other count as equal


def equalise_kv_pools(pools: dict[str, int], round_tokens: int, restart: Callable[[str, int], int]) -> int | None:
    """Where `pool_caveat` applies, restart each server whose pool is over 10% above the smallest with
    that smallest size as --max-total-tokens (it held more at its first start, so it gets exactly that)
    and update `pools`. Returns the size used, or None when nothing needed it."""
    if pool_caveat(pools, round_tokens) is None:
        return None
    cap = min(pools.values())
    for name, tokens in list(pools.items()):
        if tokens > POOL_TOLERANCE * cap:
            pools[name] = restart(name, cap)
    return cap


def kv_pool_tokens(base: str) -> int:
    """The server's KV pool size in tokens (0 when it does not say)."""
    try:
        return int(client.load(base).get("max_total_num_tokens") or 0)
    except (client.HTTPFailure, KeyError, IndexError, TypeError, ValueError):
        return 0


def pool_caveat(pools: dict[str, int], round_tokens: int) -> str | None:
    """Why an A/B ratio may not be the patch's: the servers' KV pools differ by over 10% and a round
    writes more tokens than the smaller one holds, so that server alone evicts radix-cache entries."""
    if len(pools) < 2 or min(pools.values()) <= 0:
        return None
    small = min(pools.values())
    if max(pools.values()) <= POOL_TOLERANCE * small or round_tokens <= small:
        return None
    sizes = ", ".join(f"{n} {t}" for n, t in pools.items())
    return (f"unequal KV pools ({sizes} tokens) and a round writes ~{round_tokens}: the smaller pool evicts "
            "radix-cache entries, the larger may not, and the ratio carries that; give every server the same "
            "pool with --max-total-tokens")


def measure(base: str, prompts: list[Prompt], concurrency: int, timeout: float = 240) -> dict[str, Any]:
    t0 = time.time()
    res = client.run_concurrent(base, prompts, concurrency, timeout)
    wall = time.time() - t0
    errors = [r for r in res if r.error]
    toks = sum(len(r.output_ids or []) for r in res)
    lens = [r.meta["spec_accept_length"] for r in res if "spec_accept_length" in r.meta]
    return {"requests": len(res), "errors": len(errors), "first_error": errors[0].error if errors else None,
            "output_tokens": toks, "seconds": round(wall, 3), "tok_per_s": round(toks / wall, 1),
            "accept_length": round(sum(lens) / len(lens), 3) if lens else None,
            "outputs": {r.key: r.output_ids for r in res}}


_DECODE_LINE = re.compile(r"Decode batch.*?#running-req: (\d+),.*?(\w[\w ]*): (True|False), "
                          r"gen throughput \(token/s\): ([\d.]+)")


_PREFILL_LINE = re.compile(r"Prefill batch.*?#new-seq: (\d+), #new-token: (\d+)")
FORWARD_SECONDS = "sglang:forward_execution_seconds_total"  # sglang's device timer, per category


def prefill_stats(log_text: str) -> dict[str, int]:
    """Prefill batches in a server-log window and the prompt tokens they computed."""
    rows = [(int(seqs), int(toks)) for seqs, toks in _PREFILL_LINE.findall(log_text)]
    return {"batches": len(rows), "seqs": sum(r[0] for r in rows), "tokens": sum(r[1] for r in rows)}


def gpu_seconds(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """GPU seconds per forward category between two /metrics scrapes ({} with the device timer off)."""
    out: dict[str, float] = {}
    for key, value in after.items():
        if key.startswith(FORWARD_SECONDS + "{"):
            cat = re.search(r'category="([^"]*)"', key)
            name = cat.group(1) if cat else "?"
            out[name] = out.get(name, 0.0) + value - before.get(key, 0.0)
    return {k: round(v, 4) for k, v in sorted(out.items()) if v > 0}


def server_decode_stats(log_text: str, running: int) -> dict[str, Any] | None:
    """The server's own decode-log view at (nearly) full load: median gen throughput and how many
    of those intervals ran under a CUDA graph. Independent of client-side ramp up/down."""
    rows = [(float(tput), flag == "True") for run, _, flag, tput in _DECODE_LINE.findall(log_text)
            if int(run) >= 0.9 * running]
    if not rows:
        return None
    return {"lines": len(rows), "median_tok_per_s": round(statistics.median(t for t, _ in rows), 1),
            "cuda_graph_lines": sum(g for _, g in rows)}


def warm_up(base: str, opts: BenchOptions) -> None:
    """Short requests at every concurrency, outside the measurement: lazy JIT/autotune per batch shape
    and per mode (with a threshold, small batches speculate and large ones do not)."""
    for c in opts.concurrency:
        client.run_concurrent(base, [Prompt(f"w{c}-{i}", (5 + i % 50, 6, 7, 8), 32) for i in range(max(2, c))],
                              c, opts.deadline.request_timeout(240))


def run_config(name: str, opts: BenchOptions, vocab: int) -> dict[str, Any]:
    cfg = server_config(name, opts)
    log = opts.out / f"server_bench_{name}.log"
    rep: dict[str, Any] = {"name": name, "results": {}}
    srv = Server(cfg, opts.port, log)
    try:
        srv.start(min(opts.health_timeout, opts.deadline.left() - 45))
        rep["start_s"] = round(srv.start_seconds, 1)
        if opts.deadline.left() < opts.min_measure_s:
            rep["skipped"] = True
            raise SmokeFailure(f"deadline: only {opts.deadline.left():.0f}s left after the start")
        warm_up(srv.base, opts)
        for c in opts.concurrency:
            rep["results"][str(c)] = measure(srv.base, workload(vocab, c, opts.output_len, 0), c,
                                             opts.deadline.request_timeout(240))
        if opts.profile_steps > 0 and name in ("plain", "eagle3_thr"):
            rep["profile"] = profile_full_load(srv.base, opts, vocab, name)
        if opts.pyspy_seconds > 0 and name in ("plain", "eagle3_thr"):
            rep["pyspy_raw"] = pyspy_full_load(srv, opts, vocab, name)
        log_text = log.read_text(errors="replace")
        if cfg.threshold is not None:
            rep["spec_disable"] = spec_state(client.server_info(srv.base))
            rep["draft_plain_step"] = draft_plain_step(log_text)
        rep["server_decode_at_max"] = server_decode_stats(log_text, max(opts.concurrency))
        if "pyspy_raw" in rep:
            rep["pyspy"] = summarize_pyspy(rep.pop("pyspy_raw"),
                                           (rep["server_decode_at_max"] or {}).get("median_tok_per_s"),
                                           max(opts.concurrency))
        check_log_clean(log_text)
        rep["ok"] = True
    except Exception as exc:  # noqa: BLE001 - SmokeFailure, HTTPFailure or an unexpected answer
        rep["ok"] = False
        rep["cause"] = getattr(exc, "cause", f"{type(exc).__name__}: {exc}")
        rep["log_tail"] = log_tail(log, 30)
    finally:
        srv.stop()
    return rep


def during_full_load(base: str, opts: BenchOptions, vocab: int, seed: int, settle_s: float,
                     action: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run `action` `settle_s` into a full-load run (not measured; past the first prefill wave, into
    full-batch decode) and wait for the load. A diagnostic: its failure is reported, not raised."""
    c = max(opts.concurrency)
    load = client.in_background(lambda: client.run_concurrent(
        base, workload(vocab, c, opts.output_len, seed), c, opts.deadline.request_timeout(240)))
    try:
        try:
            time.sleep(settle_s)
            return action()
        finally:
            load.result()
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}


def profile_full_load(base: str, opts: BenchOptions, vocab: int, name: str) -> dict[str, Any]:
    """Profile `profile_steps` decode steps in the middle of a full-load run."""
    out_dir = opts.out / f"profile_{name}"
    started = during_full_load(base, opts, vocab, 1, 1.0,
                               lambda: profile.start(base, out_dir, opts.profile_steps) or {})
    if "error" in started:
        return started
    try:
        trace = profile.wait_for_trace(out_dir)
        if trace is None:
            return {"error": f"no trace under {out_dir}"}
        summary = profile.summarize(trace, opts.profile_steps)
        trace.unlink()  # tens of MB; the summary is what travels back
        return summary
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}


def pyspy_full_load(srv: Server, opts: BenchOptions, vocab: int, name: str,
                    settle_s: float = 1.5, seconds: float | None = None, tag: str = "") -> dict[str, Any]:
    """Sample the scheduler with py-spy for `pyspy_seconds` (or `seconds`) `settle_s` into a full-load
    run (1.5 s: the middle; 0: from the moment the load is sent). Returns the raw stacks (or why not);
    summarized once the step time is known."""
    exe = pyspy.binary(opts.pyspy_dirs)
    pid = pyspy.scheduler_pid(srv.proc.pid) if srv.proc is not None else None
    if exe is None or pid is None:
        return {"error": "no py-spy binary" if exe is None else "no scheduler process found"}
    secs = opts.pyspy_seconds if seconds is None else seconds
    return during_full_load(srv.base, opts, vocab, 2, settle_s, lambda: {"raw": pyspy.record(
        exe, pid, secs, opts.out / f"pyspy_{name}{tag}.txt").read_text()})


def summarize_pyspy(raw: dict[str, Any], tok_per_s: float | None, batch: int) -> dict[str, Any]:
    """py-spy's shares, in ms per step where the server's full-load throughput at `batch` is known."""
    if "error" in raw:
        return raw
    step_ms = 1000.0 * batch / tok_per_s if tok_per_s else None
    return pyspy.summarize(raw["raw"], step_ms)


def compare(reps: dict[str, dict[str, Any]]) -> list[str]:
    """Output mismatches of each EAGLE config against plain (same prompts, greedy)."""
    problems = []
    plain = reps.get("plain", {}).get("results", {})
    for name, rep in reps.items():
        if name == "plain":
            continue
        for c, r in rep.get("results", {}).items():
            ref = plain.get(c, {}).get("outputs", {})
            bad = [k for k, v in r.get("outputs", {}).items() if k in ref and ref[k] != v]
            if bad:
                problems.append(f"{name} c={c}: {len(bad)} output(s) differ from plain (e.g. {bad[0]})")
            if r.get("errors"):
                problems.append(f"{name} c={c}: {r['errors']} request error(s): {r['first_error']}")
    return problems


def table(reps: dict[str, dict[str, Any]], concurrency: tuple[int, ...]) -> str:
    plain = reps.get("plain", {}).get("results", {})
    head = f"{'config':12s}" + "".join(f"{'c=' + str(c):>26s}" for c in concurrency)
    lines = ["output tokens/s (ratio to plain) [accept length]", head]
    for name in CONFIGS:
        rep = reps.get(name)
        if rep is None:
            continue
        cells = []
        for c in concurrency:
            r = rep.get("results", {}).get(str(c))
            if not r:
                cells.append(f"{'-':>26s}")
                continue
            p = plain.get(str(c), {}).get("tok_per_s")
            ratio = f"{r['tok_per_s'] / p:.2f}x" if p else "  -  "
            al = f"[{r['accept_length']:.2f}]" if r.get("accept_length") else ""
            cells.append(f"{r['tok_per_s']:>10.0f} ({ratio}) {al:>7s}")
        lines.append(f"{name:12s}" + "".join(f"{x:>26s}" for x in cells))
    for name in CONFIGS:
        srv = (reps.get(name) or {}).get("server_decode_at_max")
        if srv:
            lines.append(f"server log, {name} at c={max(concurrency)}: median {srv['median_tok_per_s']:.0f} "
                         f"tok/s over {srv['lines']} decode lines ({srv['cuda_graph_lines']} under a graph)")
    for name in CONFIGS:
        prof = (reps.get(name) or {}).get("profile")
        if prof:
            lines.append(profile.render(name, prof))
    for name in CONFIGS:
        spy = (reps.get(name) or {}).get("pyspy")
        if spy:
            lines.append(pyspy.render(name, spy))
    return "\n".join(lines)


def ab_ratios(rounds: list[dict[str, dict[str, Any]]], name: str, key: str) -> list[float]:
    """Per-round ratio of `name` to plain for one measure ('tok_per_s': client, 'server_tok_per_s': the
    server log's median over that round's full-load lines); rounds missing either side are left out."""
    out = []
    for r in rounds:
        a, b = r.get(name, {}).get(key), r.get("plain", {}).get(key)
        if a and b:
            out.append(a / b)
    return out


def round_order(names: list[str], k: int) -> list[str]:
    """The order in which A/B round k loads the servers: `names`, reversed every other round."""
    return names if k % 2 == 0 else names[::-1]


def ab_ratios_by_order(rounds: list[dict[str, dict[str, Any]]], names: list[str], name: str,
                       key: str) -> tuple[list[float], list[float]]:
    """ab_ratios split by which server took the load first in the round (round_order): (rounds where
    `name` went before plain, rounds where plain went first)."""
    first: list[float] = []
    second: list[float] = []
    for k, r in enumerate(rounds):
        order = round_order(names, k)
        a, b = r.get(name, {}).get(key), r.get("plain", {}).get(key)
        if a and b:
            (first if order.index(name) < order.index("plain") else second).append(a / b)
    return first, second


def geomean_of_medians(first: list[float], second: list[float]) -> float | None:
    return (statistics.median(first) * statistics.median(second)) ** 0.5 if first and second else None


def order_balanced_ratio(rounds: list[dict[str, dict[str, Any]]], names: list[str], name: str,
                         key: str) -> float | None:
    """The geometric mean of the two orders' median ratios, None unless both orders were measured. With an
    odd number of rounds the plain median weighs one order twice, and the order can matter: in runs 31,
    34 and 35 of 2026-11-30 on the H200 the threshold server's best round was each time the one it went
    first in (0.93x-1.01x against 0.70x-0.91x; not so in runs 17 and 25). This weighs both orders alike."""
    return geomean_of_medians(*ab_ratios_by_order(rounds, names, name, key))


FAST_WINDOW = 0.9  # a window counts as fast at >= this share of the server's best full-load rate


def fast_windows(rounds: list[dict[str, dict[str, Any]]], name: str) -> list[float]:
    """The server log's full-load rates of `name`'s windows (measured and primer pooled) that reach
    FAST_WINDOW of its best one. On the H200 each window's rate is bimodal (~100k or ~65k tok/s at 1B,
    for either server, with no CPU steal: docs/gpu-runs/2026-12-01); comparing the fast windows
    compares the two servers' steps rather than which one drew more slow windows."""
    rates = [w[key] for r in rounds if name in r for key in ("server_tok_per_s", "primer_server_tok_per_s")
             if (w := r[name]).get(key)]
    best = max(rates, default=0.0)
    return [x for x in rates if x >= FAST_WINDOW * best]


def fast_window_medians(rounds: list[dict[str, dict[str, Any]]],
                        name: str) -> tuple[float, int, float, int] | None:
    """The median and count of fast windows (fast_windows) of `name`, then of plain; None unless both
    have some."""
    fast, fast_plain = fast_windows(rounds, name), fast_windows(rounds, "plain")
    if not fast or not fast_plain:
        return None
    return statistics.median(fast), len(fast), statistics.median(fast_plain), len(fast_plain)


def ab_table(ab: dict[str, Any]) -> str:
    names = ab["configs"]
    others = [n for n in names if n != "plain"]
    rounds_by_c: dict[str, list[dict[str, dict[str, Any]]]] = ab["rounds"]
    n_rounds = max((len(r) for r in rounds_by_c.values()), default=0)
    lines = [(f"A/B: {n_rounds} round(s), all servers up, the load on one at a time (order reversed every "
              "other round); output tok/s client | server log")]
    for c, rounds in rounds_by_c.items():
        lines.append(f"c={c:<4s}" + "".join(f"{n:>28s}" for n in names))
        for i, r in enumerate(rounds, 1):
            cells = [f"{r.get(n, {}).get('tok_per_s') or 0:>10.0f} | {r.get(n, {}).get('server_tok_per_s') or 0:>8.0f}"
                     for n in names]
            lines.append(f"  {i:<4d}" + "".join(f"{x:>28s}" for x in cells))
        for n in others:
            for key, label in (("tok_per_s", "client"), ("server_tok_per_s", "server log")):
                x = ab_ratios(rounds, n, key)
                if x:
                    lines.append(f"  c={c} {n} / plain ({label}): median {statistics.median(x):.3f}x, "
                                 f"min {min(x):.3f}x, max {max(x):.3f}x over {len(x)} round(s)")
                primer = ab_ratios(rounds, n, "primer_" + key)
                if primer:
                    lines.append(f"    primer windows (each right after the other server's load): median "
                                 f"{statistics.median(primer):.3f}x over {len(primer)} round(s)")
                first, second = ab_ratios_by_order(rounds, names, n, key)
                balanced = geomean_of_medians(first, second)
                if balanced is not None:
                    lines.append(f"    by order: {n} first {statistics.median(first):.3f}x ({len(first)}), plain "
                                 f"first {statistics.median(second):.3f}x ({len(second)}); order-balanced "
                                 f"{balanced:.3f}x")
            medians = fast_window_medians(rounds, n)
            if medians:
                a, na, b, nb = medians
                lines.append(f"    fast windows (server log >= {FAST_WINDOW:g}x the server's best, primers pooled): "
                             f"{n} {a:.0f} ({na}) / plain {b:.0f} ({nb}) = {a / b:.3f}x")
        lines += time_split(rounds, names)
    if ab.get("spec_disable"):
        lines.append(f"eagle3_thr: {ab['spec_disable']}; draft in plain steps: {ab.get('draft_plain_step')}")
    if ab.get("kv_pools_equalised_to"):
        lines.append(f"KV pools equalised: servers with a larger pool restarted with --max-total-tokens "
                     f"{ab['kv_pools_equalised_to']}")
    if ab.get("cpu_sets"):
        lines.append("CPU sets: " + ", ".join(f"{n} {cpu_list(c)}" for n, c in ab["cpu_sets"].items()))
    if ab.get("kv_pool_tokens"):
        lines.append("KV pool (tokens): " + ", ".join(f"{n} {t}" for n, t in ab["kv_pool_tokens"].items())
                     + f"; a round writes ~{ab.get('round_tokens')}")
    if ab.get("kv_pools_not_equalised"):
        lines.append(f"KV pools not equalised: {ab['kv_pools_not_equalised']}")
    if ab.get("pool_caveat"):
        lines.append(f"CAVEAT: {ab['pool_caveat']}")
    return "\n".join(lines)


def time_split(rounds: list[dict[str, dict[str, Any]]], names: list[str]) -> list[str]:
    """Per config, medians over rounds: wall seconds of the window, GPU seconds per forward category and
    what is left of the wall (GPU idle: host, HTTP), prefill batches. Empty without the numbers."""
    lines = []
    for n in names:
        windows = [r[n] for r in rounds if n in r]
        if not windows or not any("gpu_s" in w or "prefill" in w or w.get("host") for w in windows):
            continue
        med = statistics.median
        wall = med(w["seconds"] for w in windows)
        cells = [f"wall {wall:.3f}s"]
        if any(w.get("gpu_s") for w in windows):
            cats = sorted({k for w in windows for k in w.get("gpu_s", {})})
            cells += [f"{k} {med(w.get('gpu_s', {}).get(k, 0.0) for w in windows):.3f}s" for k in cats]
            cells.append(f"rest {med(w['seconds'] - sum(w.get('gpu_s', {}).values()) for w in windows):.3f}s")
        if any("prefill" in w for w in windows):
            cells.append(f"prefill batches {med(w.get('prefill', {}).get('batches', 0) for w in windows):g}")
        hosts = [w["host"] for w in windows if w.get("host")]
        if hosts:
            cells.append(f"host CPU steal {med(h['steal_pct'] for h in hosts):.2f}% (max "
                         f"{max(h['steal_pct'] for h in hosts):.2f}%), busy {med(h['busy_pct'] for h in hosts):.0f}%")
        lines.append(f"    {n:<12s} " + ", ".join(cells))
    return lines


def ab_mismatches(outputs: list[dict[str, dict[str, list[int] | None]]]) -> list[str]:
    """Each round's outputs of every config against plain's of the same round (same prompts, greedy)."""
    problems = []
    for k, outs in enumerate(outputs, 1):
        ref = outs.get("plain", {})
        for name, got in outs.items():
            # a failed request (None) is counted among the errors, not here
            bad = [key for key, v in got.items()
                   if name != "plain" and v is not None and ref.get(key) is not None and ref[key] != v]
            if bad:
                problems.append(f"round {k} {name}: {len(bad)} output(s) differ from plain (e.g. {bad[0]})")
    return problems


def flush_cache(base: str) -> bool:
    """Empty the radix cache before a round: without it the earlier rounds' prompts fill the KV pool
    and every step of the next round evicts (0.7 ms/step of RadixCache.evict on the H200), by how
    much depending on each server's pool size."""
    try:
        client.post(base + "/flush_cache?timeout=10", {}, 30)
        return True
    except client.HTTPFailure:
        return False


PROC_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def host_cpu_times(stat_text: str | None = None) -> dict[str, int]:
    """The host's aggregate CPU times (clock ticks) from /proc/stat's first line; {} where unreadable."""
    try:
        text = stat_text if stat_text is not None else Path("/proc/stat").read_text()
        values = [int(x) for x in text.splitlines()[0].split()[1:1 + len(PROC_STAT_FIELDS)]]
    except (OSError, IndexError, ValueError):
        return {}
    return dict(zip(PROC_STAT_FIELDS, values))


def host_cpu_share(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """Percent of all CPU time between two host_cpu_times that was stolen by the hypervisor (steal: the
    VM's vCPUs waiting for the host's cores) and that was busy (neither idle, iowait nor steal). The
    H200 machine is a KVM guest whose speed drifts (docs/gpu-runs/2026-11-30); steal is the part of that
    drift the guest can see."""
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in PROC_STAT_FIELDS}
    total = sum(delta.values())
    if not before or not after or total <= 0:
        return {}
    busy = total - delta["idle"] - delta["iowait"] - delta["steal"]
    return {"steal_pct": round(100 * delta["steal"] / total, 2), "busy_pct": round(100 * busy / total, 1)}


def measure_window(srv: Server, prompts: list[Prompt], c: int, opts: BenchOptions) -> dict[str, Any]:
    """`measure`, plus the server log's full-load decode lines written meanwhile and the host's CPU
    steal and load meanwhile; the radix cache is flushed first."""
    flushed = flush_cache(srv.base)
    start = srv.log_path.stat().st_size
    before = client.metrics(srv.base) if opts.device_timer else {}
    cpu_before = host_cpu_times()
    m = measure(srv.base, prompts, c, opts.deadline.request_timeout(240))
    host = host_cpu_share(cpu_before, host_cpu_times())
    gpu = gpu_seconds(before, client.metrics(srv.base)) if opts.device_timer else {}
    with open(srv.log_path, "rb") as fh:
        fh.seek(start)
        window = fh.read().decode(errors="replace")
    dec = server_decode_stats(window, c)
    return m | {"server_tok_per_s": dec["median_tok_per_s"] if dec else None,
                "server_lines": dec["lines"] if dec else 0, "cache_flushed": flushed,
                "prefill": prefill_stats(window), "host": host} | ({"gpu_s": gpu} if opts.device_timer else {})


def measure_round(servers: dict[str, Any], names: list[str], k: int, prompts: list[Prompt], c: int,
                  opts: BenchOptions, measure: Callable[..., dict[str, Any]] | None = None) -> dict[str, Any]:
    """Round k of the A/B at concurrency c: each server's window in turn, in `names` order (reversed when
    k is odd). With opts.ab_primer an unmeasured window of the same load on the same server comes first
    (its tok/s kept as primer_tok_per_s / primer_server_tok_per_s), so that every measured window
    follows that server's own load, not the other one's: a test of the round-order effect."""
    measure = measure or measure_window
    row: dict[str, Any] = {}
    for name in round_order(names, k):
        primer = measure(servers[name], prompts, c, opts) if opts.ab_primer else None
        row[name] = measure(servers[name], prompts, c, opts)
        if primer is not None:
            row[name]["primer_tok_per_s"] = primer.get("tok_per_s")
            row[name]["primer_server_tok_per_s"] = primer.get("server_tok_per_s")
    return row


def cpu_sets(cpus: list[int], names: list[str]) -> dict[str, list[int]]:
    """Disjoint CPU sets: one per server in `names` and one ("client") for the load generator, which
    gets what the equal server shares leave. Too few CPUs (fewer than 2 each) is an error naming the flag."""
    cpus = sorted(cpus)
    share = len(cpus) // (len(names) + 1)
    if share < 2:
        raise SmokeFailure(f"--ab-pin-cpus: {len(cpus)} CPUs cannot give {len(names)} servers and the client "
                           "2 each; run without it")
    sets = {name: cpus[i * share:(i + 1) * share] for i, name in enumerate(names)}
    sets["client"] = cpus[len(names) * share:]
    return sets


def cpu_list(cpus: list[int]) -> str:
    return f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))


def run_ab(opts: BenchOptions, vocab: int) -> dict[str, Any]:
    """A/B mode: see the module docstring. Returns {"ok", "rounds", "configs", ...}."""
    names = list(opts.configs)
    top = max(opts.concurrency)
    ab: dict[str, Any] = {"concurrency": list(opts.concurrency), "configs": names, "rounds": {}, "start_s": {},
                          "pyspy": {}}
    servers: dict[str, Server] = {}
    outputs: list[dict[str, dict[str, list[int] | None]]] = []
    need = AB_START_S_PER_SERVER * len(names) + 120
    if opts.deadline.left() < need:  # do not start servers that would leave no time to measure
        return ab | {"ok": False, "skipped": True, "mismatches": [], "errors": [],
                     "cause": f"deadline: {opts.deadline.left():.0f}s left, ~{need}s needed"}
    ab["kv_pool_tokens"] = {}
    sets: dict[str, list[int]] = {}
    client_pin = contextlib.ExitStack()  # --ab-pin-cpus: this process's CPUs until the servers stop

    def start(name: str, o: BenchOptions) -> None:
        cfg = server_config(name, o)
        cfg.extra = (*cfg.extra, "--sleep-on-idle")  # an idle server must not spin a core meanwhile
        cfg.cpus = tuple(sets.get(name, ()))
        srv = servers[name] = Server(cfg, opts.port + names.index(name), opts.out / f"server_ab_{name}.log")
        srv.start(min(opts.health_timeout, opts.deadline.left() - 45))
        ab["start_s"][name] = round(srv.start_seconds, 1)
        ab["kv_pool_tokens"][name] = kv_pool_tokens(srv.base)

    def restart(name: str, cap: int) -> int:
        servers[name].stop()
        start(name, replace(opts, max_total_tokens=cap))
        return int(ab["kv_pool_tokens"][name])

    try:
        if opts.ab_pin_cpus:
            sets.update(cpu_sets(sorted(os.sched_getaffinity(0)), names))
            ab["cpu_sets"] = sets
            client_pin.enter_context(pinned(tuple(sets["client"])))  # the load generator's threads, py-spy
        # one after another: each server sizes its KV pool from the memory left free at its start
        for name in names:
            start(name, opts)
        demand = max(sum(len(p.input_ids) + p.max_new_tokens for p in workload(vocab, c, opts.output_len, 100))
                     for c in opts.concurrency)
        ab["round_tokens"] = demand
        # unequal pools that a round overflows: the later servers alone would evict (pool_caveat); give
        # every server the smallest pool unless the user chose one or the deadline has no room for it
        if not opts.max_total_tokens and pool_caveat(ab["kv_pool_tokens"], demand):
            if opts.deadline.left() >= need:
                ab["kv_pools_equalised_to"] = equalise_kv_pools(ab["kv_pool_tokens"], demand, restart)
            else:  # say so: a silent skip reads as if the pools had been equalised
                ab["kv_pools_not_equalised"] = (f"deadline: {opts.deadline.left():.0f}s left, ~{need}s needed "
                                                "to restart the larger-pool servers")
        ab["pool_caveat"] = pool_caveat(ab["kv_pool_tokens"], demand)
        for srv in servers.values():
            warm_up(srv.base, opts)
        round_s = 0.0
        for k in range(opts.ab_rounds):
            # a round must end with time left for py-spy and the servers' stop
            spy_s = (20 if opts.pyspy_seconds else 0) + (20 if opts.pyspy_admission_seconds else 0)
            if opts.deadline.left() < 2 * round_s + 90 + spy_s:
                ab["stopped_early"] = f"deadline: {k} of {opts.ab_rounds} rounds"
                break
            t0 = time.time()
            outs: dict[str, dict[str, list[int] | None]] = {name: {} for name in names}
            for conc in opts.concurrency:
                prompts = workload(vocab, conc, opts.output_len, 100 + k)
                row = measure_round(servers, names, k, prompts, conc, opts)
                for name in names:
                    outs[name].update(row[name].pop("outputs"))
                ab["rounds"].setdefault(str(conc), []).append(row)
            outputs.append(outs)
            round_s = time.time() - t0
        if opts.pyspy_seconds > 0:
            for name in ("plain", "eagle3_thr"):
                if name in servers:
                    raw = pyspy_full_load(servers[name], opts, vocab, name)
                    srv_tps = [r[name]["server_tok_per_s"] for r in ab["rounds"].get(str(top), [])
                               if r[name].get("server_tok_per_s")]
                    ab["pyspy"][name] = summarize_pyspy(raw, statistics.median(srv_tps) if srv_tps else None, top)
        if opts.pyspy_admission_seconds > 0:
            ab["pyspy_admission"] = {}
            for name in ("plain", "eagle3_thr"):
                if name in servers:
                    flush_cache(servers[name].base)  # as before a measured round
                    raw = pyspy_full_load(servers[name], opts, vocab, name, settle_s=0.0,
                                          seconds=opts.pyspy_admission_seconds, tag="_admission")
                    ab["pyspy_admission"][name] = summarize_pyspy(raw, None, top)  # shares only: no step
        logs = {name: srv.log_path.read_text(errors="replace") for name, srv in servers.items()}
        if "eagle3_thr" in servers:
            ab["spec_disable"] = spec_state(client.server_info(servers["eagle3_thr"].base))
            ab["draft_plain_step"] = draft_plain_step(logs["eagle3_thr"])
        for log_text in logs.values():
            check_log_clean(log_text)
        ab["ok"] = bool(outputs)
        if not outputs:
            ab["skipped"] = True
            ab["cause"] = "deadline: no round measured (the servers' start took the time)"
    except Exception as exc:  # noqa: BLE001 - SmokeFailure, HTTPFailure or an unexpected answer
        ab["ok"] = False
        ab["cause"] = getattr(exc, "cause", f"{type(exc).__name__}: {exc}")
        ab["log_tail"] = "\n".join(f"-- {n}\n{log_tail(s.log_path, 20)}" for n, s in servers.items())
    finally:
        for srv in servers.values():
            srv.stop()
        client_pin.close()
    ab["mismatches"] = ab_mismatches(outputs)
    ab["errors"] = [f"c={c} round {k + 1} {n}: {m['errors']} request error(s): {m['first_error']}"
                    for c, rounds in ab["rounds"].items() for k, r in enumerate(rounds)
                    for n, m in r.items() if m.get("errors")]
    return ab


def run_bench(opts: BenchOptions, state: dict[str, Any] | None = None) -> dict[str, Any]:
    state = state if state is not None else {}
    opts.out.mkdir(parents=True, exist_ok=True)
    expected = json.loads((opts.models / "expected.json").read_text())
    vocab = int(expected["vocab_size"])
    if "eagle3_adaptive" in opts.configs:  # server_config points the server at it
        (opts.out / "adaptive_config.json").write_text(json.dumps(ADAPTIVE_CONFIG, indent=1))
    if opts.ab_rounds > 0:
        return run_bench_ab(opts, state, expected, vocab)
    done = state.setdefault("configs", {})
    reps: dict[str, dict[str, Any]] = {}
    skipped = []
    for name in opts.configs:
        if name in done:
            reps[name] = done[name]
            continue
        if opts.deadline.left() < opts.min_server_s:
            skipped.append(f"{name} (deadline)")
            continue
        rep = run_config(name, opts, vocab)
        if rep.get("skipped"):
            skipped.append(f"{name} (deadline after its start)")
            continue
        reps[name] = rep
        if rep.get("ok"):
            done[name] = rep
    failures = [f"{n}: {r.get('cause')}\n{r.get('log_tail')}" for n, r in reps.items() if not r.get("ok")]
    failures += compare(reps)
    out = {"threshold": opts.threshold, "concurrency": list(opts.concurrency),
           "designed_accept_length": expected.get("designed_accept_length"),
           "model": {k: expected.get(k) for k in ("size", "hidden", "layers", "draft", "draft_accept")},
           "table": table(reps, opts.concurrency), "skipped": skipped, "failures": failures,
           "configs": {n: {k: v for k, v in r.items() if k != "results"} | {
               "results": {c: {k: v for k, v in x.items() if k != "outputs"}
                           for c, x in r.get("results", {}).items()}} for n, r in reps.items()}}
    big = str(max(opts.concurrency))
    try:
        thr = reps["eagle3_thr"]["results"][big]["tok_per_s"]
        pl = reps["plain"]["results"][big]["tok_per_s"]
        out["thr_vs_plain_at_max"] = round(thr / pl, 3)
        out["goal_0.97_met"] = thr / pl >= 0.97
    except KeyError:
        pass
    return out


def run_bench_ab(opts: BenchOptions, state: dict[str, Any], expected: dict[str, Any], vocab: int) -> dict[str, Any]:
    ab = state.get("ab") or run_ab(opts, vocab)
    if ab.get("ok"):
        state["ab"] = ab  # a resumed call reuses it
    skipped = [f"A/B ({ab['cause']})"] if ab.get("skipped") else []
    failures = ([] if ab.get("ok") or skipped else [f"A/B: {ab.get('cause')}\n{ab.get('log_tail', '')}"])
    failures += ab["mismatches"] + ab["errors"]
    parts = [ab_table(ab)] if ab["rounds"] else []
    parts += [pyspy.render(n, spy) for n, spy in ab.get("pyspy", {}).items() if spy]
    parts += [pyspy.render(f"{n} (the first {opts.pyspy_admission_seconds:g} s of a round: admission; "
                           "idle samples counted apart)", spy)
              for n, spy in ab.get("pyspy_admission", {}).items() if spy]
    out = {"mode": "ab", "threshold": opts.threshold, "concurrency": ab["concurrency"],
           "designed_accept_length": expected.get("designed_accept_length"),
           "model": {k: expected.get(k) for k in ("size", "hidden", "layers", "draft", "draft_accept")},
           "table": "\n".join(parts) or "A/B: no round measured", "skipped": skipped, "failures": failures,
           "ab": ab}
    top_rounds = ab["rounds"].get(str(max(opts.concurrency)), [])
    return out | goal_figures(top_rounds, list(ab["configs"]))


def goal_figures(rounds: list[dict[str, dict[str, Any]]], names: list[str]) -> dict[str, Any]:
    """The threshold server's ratio to plain at the top concurrency, as the 0.97 goal reads it: the
    order-balanced client ratio where both orders were measured (ab_table says why), else the median;
    the fast windows' full-load ratio beside it, a diagnostic, not the goal's basis. {} without rounds."""
    thr = ab_ratios(rounds, "eagle3_thr", "tok_per_s")
    if not thr:
        return {}
    balanced = order_balanced_ratio(rounds, names, "eagle3_thr", "tok_per_s")
    figure = round(balanced if balanced is not None else statistics.median(thr), 3)
    out: dict[str, Any] = {"thr_vs_plain_at_max_median": round(statistics.median(thr), 3),
                           "thr_vs_plain_at_max": figure,
                           "thr_vs_plain_at_max_basis": "order-balanced" if balanced is not None else "median",
                           "goal_0.97_met": figure >= 0.97}
    medians = fast_window_medians(rounds, "eagle3_thr")
    if medians:
        out["thr_vs_plain_fast_windows"] = round(medians[0] / medians[2], 3)
    return out


def add_tuning_arguments(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """What to measure and how: shared by `smoke bench` and `smoke e2e` (there as --bench-*)."""
    p = "--" + prefix
    ap.add_argument(p + "threshold", type=int, default=16)
    ap.add_argument(p + "concurrency", default="1,8,256")
    ap.add_argument(p + "configs", default=",".join(CONFIGS))
    ap.add_argument(p + "profile-steps", type=int, default=0,
                    help="torch-profile this many full-load decode steps (plain and eagle3_thr; 0 = off)")
    ap.add_argument(p + "pyspy-seconds", type=float, default=0,
                    help="py-spy the scheduler this long at full load (plain and eagle3_thr)")
    ap.add_argument(p + "pyspy-admission-seconds", type=float, default=0,
                    help="A/B: py-spy the scheduler this long from the moment a round's load is sent "
                         "(a wave of requests being admitted; plain and eagle3_thr)")
    ap.add_argument(p + "server-args", default="",
                    help="extra flags for every bench server, one shell-quoted string (e.g. '--gc-threshold 50000')")
    ap.add_argument(p + "ab-rounds", type=int, default=0,
                    help="A/B mode: all configs' servers up at once, each concurrency's load on each in turn, "
                         "this many rounds (0 = off: one server after another)")
    ap.add_argument(p + "ab-primer", action="store_true",
                    help="A/B: before each measured window, one unmeasured window of the same load on the same "
                         "server, so that no measured window follows the other server's load (the threshold "
                         "server's rounds after plain's measured 0.70x-0.91x, its first ones 0.93x-1.01x)")
    ap.add_argument(p + "ab-pin-cpus", action="store_true",
                    help="A/B: each server's processes on CPUs of their own and the client on the rest (the "
                         "H200 machine's 1B windows are bimodal, ~65k or ~100k tok/s in the server log, for "
                         "either server: a test of CPU placement)")
    ap.add_argument(p + "mem-fraction", type=float, default=0.3,
                    help="--mem-fraction-static of each bench server (A/B: of the memory free at its start)")
    ap.add_argument(p + "max-total-tokens", type=int, default=0,
                    help="--max-total-tokens of every bench server (A/B: the same KV pool for all; 0 = sglang's "
                         "own sizing, which gives a server started later a smaller pool)")
    ap.add_argument(p + "device-timer", action="store_true",
                    help="A/B: GPU seconds per forward category in every window (sglang's device timer)")


def tuning_options(a: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """BenchOptions fields from add_tuning_arguments' flags; a bad value exits naming the flag."""
    def get(name: str) -> Any:
        return getattr(a, (prefix + name).replace("-", "_"))
    conc = [x.strip() for x in get("concurrency").split(",") if x.strip()]
    configs = tuple(x.strip() for x in get("configs").split(",") if x.strip())
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not conc or not all(x.isdigit() and int(x) >= 1 for x in conc):
        raise SystemExit(f"--{prefix}configs {bad} / --{prefix}concurrency {get('concurrency')}: invalid")
    if get("ab-rounds") < 0 or (get("ab-rounds") and ("plain" not in configs or len(configs) < 2)):
        raise SystemExit(f"--{prefix}ab-rounds {get('ab-rounds')}: needs >= 0 and, when on, 'plain' and at "
                         f"least one other config in --{prefix}configs (got {','.join(configs)})")
    if not 0 < get("mem-fraction") < 1:
        raise SystemExit(f"--{prefix}mem-fraction {get('mem-fraction')}: must be between 0 and 1")
    if get("max-total-tokens") < 0:
        raise SystemExit(f"--{prefix}max-total-tokens {get('max-total-tokens')}: must be >= 0 (0 = sglang's sizing)")
    if get("ab-pin-cpus") and not get("ab-rounds"):
        raise SystemExit(f"--{prefix}ab-pin-cpus: needs A/B mode (--{prefix}ab-rounds N)")
    if get("ab-primer") and not get("ab-rounds"):
        raise SystemExit(f"--{prefix}ab-primer: needs A/B mode (--{prefix}ab-rounds N)")
    if get("pyspy-admission-seconds") < 0 or (get("pyspy-admission-seconds") and not get("ab-rounds")):
        raise SystemExit(f"--{prefix}pyspy-admission-seconds {get('pyspy-admission-seconds')}: needs >= 0 and, "
                         f"when on, A/B mode (--{prefix}ab-rounds N)")
    return {"threshold": get("threshold"), "concurrency": tuple(int(x) for x in conc), "configs": configs,
            "profile_steps": get("profile-steps"), "pyspy_seconds": get("pyspy-seconds"),
            "pyspy_admission_seconds": get("pyspy-admission-seconds"),
            "server_args": tuple(shlex.split(get("server-args"))), "ab_rounds": get("ab-rounds"),
            "ab_primer": get("ab-primer"), "ab_pin_cpus": get("ab-pin-cpus"),
            "mem_fraction": get("mem-fraction"), "device_timer": get("device-timer"),
            "max_total_tokens": get("max-total-tokens")}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--deadline", type=float, default=3600, help="seconds from now")
    add_tuning_arguments(ap)


def options(a: argparse.Namespace) -> BenchOptions:
    return BenchOptions(models=a.models, out=a.out, output_len=a.output_len, port=a.port,
                        deadline=Deadline(time.time() + a.deadline),
                        **tuning_options(a))


def main(a: argparse.Namespace) -> int:
    opts = options(a)
    out = run_bench(opts)
    (opts.out / "bench.json").write_text(json.dumps(out, indent=1))
    print(out["table"])
    for f in out["failures"]:
        print("BENCH FAILED:", f)
    return 1 if out["failures"] or out["skipped"] else 0
