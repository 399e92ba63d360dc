"""Output tokens/s of plain decoding, always-on EAGLE-3, upstream's adaptive EAGLE-3, a fixed
speculation-disable threshold and `auto`, on servers started here (a GPU host, no Docker needed),
compared in paired windows with an A/A noise floor beside every comparison.

    python -m bench run --models DIR --out docs/bench [--configs plain,plain_twin,eagle3,...]
                          [--concurrency 1,4,16,64,256] [--pairs 6] [--window-s 3 --settle-s 1]
                          [--threshold 16[,32,...]] [--ramp-cycles 3 --ramp-hold 2]
                          [--device-timer] [--diagnose] [--state FILE] [--stop] [--deadline S]

DIR holds a target and an EAGLE-3 draft (`python -m smoke models DIR --size 1b --draft chain
--device cuda`).

- Paired windows (bench.pairing): at each concurrency c, --pairs blocks back to back, each a short
  window on every server, the order reversed every other block (A B, B A, ...): a host's speed
  drifts by tens of percent within minutes, and only servers measured seconds apart can be
  compared. A window: c clients each send their next request as the last one ends; after
  --settle-s (the first prefills, a server waking up) the output tokens of --window-s seconds are
  counted (each request's tokens spread over its lifetime), then every request in flight is
  aborted. Per c and comparison, the ratio of each block, their median and a bootstrap 95%
  interval.
- A/A floor: `plain_twin` is a second plain server, identical to the first; its ratio to plain,
  measured by the same procedure, is the noise floor printed beside every comparison.
- Host time per decode step (device timer, --device-timer): per server and c, wall and GPU-busy
  time per decode step (steps counted by the server's metrics); the host's share is the rest.
- Where the host time went (bench.hostinfo), read in every window: the scheduler thread's time on
  a CPU and waiting for one, the rest of the server's CPU, and a probe of the CPUs' speed; the
  report says which of them moved with the wall time from window to window (the A/A floor's
  cause on a host-bound shape), and which CPUs share a core.
- Ramp: the number of clients steps through the concurrencies up to the top and back down, several
  times, a level every --ramp-hold seconds; tokens/s per level and, for the threshold servers, the
  mode they are in (and auto's crossover) over time.

Greedy prompts of fixed lengths; every output is compared with plain decoding's (an aborted one as
a prefix). Writes under --out: bench.json (every window), bench.md (the tables), concurrency.png
and ramp.png (matplotlib; `--render bench.json` draws them again elsewhere). `auto` runs only where
the server has it (the sglang-image-plugin with its auto threshold). --diagnose adds where each
server's time goes at full load (bench.diagnose).

The servers (bench.servers) start side by side, each with the same fixed KV pool, and with
--state FILE they outlive the call: recorded beside FILE, found alive and used by the next call
with the same options (a dead one is started again, one with other options anew), stopped when the
bench is complete or by --stop. Every finished block, ramp and diagnosis is kept in the state, so
the same command after a deadline measures only what is left; the report lists what remains.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import random
import re
import shlex
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import autotrace, diagnose, hostinfo, pairing, servers
from bench import report as bench_report
from bench.configs import CONFIGS, TWIN, BenchConfig, expand
from smoke import client, names
from smoke.checks import check_log_clean, spec_state
from smoke.client import Prompt
from smoke.deadline import Deadline
from smoke.server import Server, ServerConfig, SmokeError, log_tail

DEFAULT_CONFIGS = ("plain", "eagle3", "eagle3_thr")  # the promise: a threshold against both fixed modes
THRESHOLD_FLAG = names.THRESHOLD_FLAG
DEFAULT_CONCURRENCY = (1, 4, 16, 64, 256)
# upstream's own way to stop drafting (--speculative-adaptive): its default tiers (sglang's
# speculative/adaptive_spec_params.py) without the 7-step tier of batch 1, whose draft-extend graph
# capture crashed the server at start on an H200 (triton attention, graphs up to batch 256). The
# 0-step tier from batch 64, which decides high load, is upstream's.
ADAPTIVE_CONFIG = {
    "1": {"candidate_steps": [1, 3], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0},
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
}
START_S = 150  # the servers' start, side by side, budgeted until measured
WARM_S = 15  # one server's warm-up (they warm up one after the other), budgeted until measured
WINDOW_END_S = 1.5  # a window's end: the abort, the requests coming back, the next cache flush
MAX_PROMPT_LEN = 64  # prompts of 32-64 tokens
MODE_POLL_S = 0.5  # how often the ramp asks a threshold server for its mode
DECODE_PASSES = "sglang:cuda_graph_passes_total"  # one per decode batch (mode="decode_...")


@dataclass
class BenchOptions:
    models: Path
    out: Path
    thresholds: tuple[int, ...] = (16,)  # eagle3_thr: one server per fixed threshold (a sweep)
    depths: tuple[int, ...] = (1, 2)  # eagle3_depth: one always-on EAGLE-3 server per draft depth
    schedules: tuple[str, ...] = ("1-16:3,17-48:2,49-96:1,97-:0",)  # eagle3_sched: one server per schedule
    # the switching servers (a threshold, auto) start without --max-running-requests and a decode
    # graph size, as the README's Serve command does: the plugin keeps a plain server's limits
    switching_defaults: bool = False
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    pairs: int = 6  # blocks per concurrency, the order reversed every other one
    window_s: float = 3.0  # the counted part of a window
    settle_s: float = 1.0  # ... after this long under load
    ramp_cycles: int = 0  # 0: no ramp
    ramp_hold_s: float = 2.0
    output_len: int = 256  # the mean output length of a request
    # each request's output length is drawn uniform within output_len * (1 -+ output_spread), the
    # same on every server: with one length for all, the requests a window starts together end
    # together, and a server that keeps them in step (plain steps) prefills their successors in a
    # few large batches, one that does not (speculation accepts per request) in many small ones
    output_spread: float = 0.25
    # `auto` servers run this long under the window's load at every concurrency before the blocks:
    # it learns where speculation stops paying once per batch size, as a serving server has done
    auto_learn_s: float = 5.0
    port: int = 30000  # the first port tried; each server takes the next free one
    # each server's --mem-fraction-static: the most of the memory free at its start that it may
    # count for its weights and KV pool; the pool itself is max_total_tokens, the same for all
    mem_share: float = 0.85
    # --max-total-tokens of every server (0: room for the top concurrency's requests)
    max_total_tokens: int = 0
    server_args: tuple[str, ...] = ()  # appended to every server's flags
    cpus_per_server: int = 0  # each server pinned to this many CPUs of its own (0: no pinning)
    diagnose: bool = False
    device_timer: bool = False  # GPU seconds per window (diagnose's device timer, without its solo units)
    pyspy_dirs: tuple[Path, ...] = ()  # --diagnose: where to look for py-spy besides PATH
    registry: Path | None = None  # where the servers are recorded to outlive the call (None: they stop with it)
    key_extra: str = ""  # what else a reused server must match (e2e: the installed site)
    launch_only: bool = False  # start the servers and return (they warm up in the call that measures)
    deadline: Deadline = field(default_factory=lambda: Deadline(time.time() + 3600))
    health_timeout: float = 480


# ----------------------------------------------------------------------------- what runs
def auto_supported() -> bool:
    """Whether this Python's sglang takes `--speculative-disable-batch-threshold auto` (the plugin
    that implements it is installed); read from the package metadata, without importing sglang."""
    try:
        files = importlib.metadata.distribution("sglang-image-plugin").files or []
    except importlib.metadata.PackageNotFoundError:
        return False
    return any(f.name == "auto_threshold.py" for f in files)


def server_config(name: str, opts: BenchOptions) -> ServerConfig:
    rec = config_records(opts)[name]
    top: int | None = None if opts.switching_defaults and rec.switches else max(opts.concurrency)
    cfg = ServerConfig(name, opts.models / "target", cuda_graph=True, cuda_graph_max_bs=top,
                       max_running=top, mem_fraction=round(opts.mem_share, 3), enable_metrics=True)
    # a server waiting for its turn must not spin a core; the pool is fixed, so servers can start
    # side by side and every one holds the same
    extra: list[str] = ["--sleep-on-idle", "--max-total-tokens", str(opts.max_total_tokens or pool_tokens(opts))]
    if rec.draft:
        cfg.draft, cfg.spec_steps = opts.models / "draft", rec.steps
    if rec.kind == "threshold":
        cfg.threshold = rec.threshold
    if rec.kind == "schedule" and rec.schedule is not None:
        extra += [names.DEPTH_SCHEDULE_FLAG, rec.schedule]
    if rec.kind == "auto":
        extra += [THRESHOLD_FLAG, "auto"]
        # its step trace, to read offline why it chose what it chose (in the logs it brings back)
        cfg.env[names.AUTO_TRACE_ENV] = str((opts.out / f"{name}_steps.jsonl").resolve())
    if rec.kind == "adaptive":
        extra += ["--speculative-adaptive", "--speculative-adaptive-config", str(opts.out / "adaptive_config.json")]
    if opts.diagnose or opts.device_timer:
        cfg.env.update(diagnose.SERVER_ENV)
    cfg.extra = (*extra, *opts.server_args)
    return cfg


def config_records(opts: BenchOptions) -> dict[str, BenchConfig]:
    """Every server's record (bench.configs), by its name."""
    return {rec.name: rec for rec in expand(opts.configs, opts.thresholds, opts.depths, opts.schedules)}


def server_names(opts: BenchOptions) -> list[str]:
    """The servers of the configs, in order: a sweep becomes one per value (eagle3_thr16, ...)."""
    return list(config_records(opts))


def output_lengths(output_len: int, spread: float) -> tuple[int, int]:
    """The shortest and longest output length of a request (BenchOptions.output_spread)."""
    return max(1, round(output_len * (1 - spread))), max(1, round(output_len * (1 + spread)))


def window_prompt(vocab: int, concurrency: int, output_len: int, seed: int, i: int, spread: float = 0.0) -> Prompt:
    """The i-th prompt of a window's stream, with its output length: the same on every server of a
    block, another per block (seed) and level."""
    rnd = random.Random(f"{seed}-{concurrency}-{i}")
    tokens = tuple(rnd.randrange(3, vocab) for _ in range(rnd.randint(32, MAX_PROMPT_LEN)))
    return Prompt(f"c{concurrency}-{i}", tokens, rnd.randint(*output_lengths(output_len, spread)) if spread else output_len)


def workload(vocab: int, concurrency: int, output_len: int, seed: int, n: int, spread: float = 0.0) -> list[Prompt]:
    """The first n prompts of a window's stream."""
    return [window_prompt(vocab, concurrency, output_len, seed, i, spread) for i in range(n)]


def ramp_prompt(vocab: int, output_len: int, key: str) -> Prompt:
    """The ramp's prompt of one client's k-th request: the same on every server."""
    rnd = random.Random(key)
    return Prompt(key, tuple(rnd.randrange(3, vocab) for _ in range(rnd.randint(32, 64))), output_len)


def ramp_levels(concurrency: tuple[int, ...], cycles: int) -> list[int]:
    """Up through every concurrency to the top and back down, `cycles` times."""
    levels = sorted(concurrency)
    out: list[int] = []
    for _ in range(cycles):
        out += levels[:-1] + levels[::-1][:-1]
    return [*out, levels[0]] if cycles else []


def pool_tokens(opts: BenchOptions) -> int:
    """KV room for the top concurrency's running requests at their longest, a tenth to spare (the
    draft tokens of a speculative step)."""
    return int(1.1 * max(opts.concurrency) * (MAX_PROMPT_LEN + output_lengths(opts.output_len, opts.output_spread)[1]))


# ----------------------------------------------------------------------------- measuring
def flush_cache(base: str) -> None:
    """Empty the radix cache before a window: every window starts from the same empty cache."""
    try:
        client.post(base + "/flush_cache?timeout=10", {}, 30)
    except client.HTTPFailure:
        pass


def abort_all(base: str) -> bool:
    """Every request of the server aborted (sglang's /abort_request with abort_all); False where the
    server refused, and the requests in flight then finish on their own."""
    try:
        client.post(base + "/abort_request", {"abort_all": True}, 30)
        return True
    except client.HTTPFailure:
        return False


def tokens_between(requests: list[tuple[float, float, int]], lo: float, hi: float) -> float:
    """Output tokens produced in [lo, hi]: each request's (start, end, tokens) spread evenly over its
    lifetime."""
    return sum(n * max(0.0, min(end, hi) - max(start, lo)) / (end - start)
               for start, end, n in requests if end > start)


def decode_steps(before: dict[str, float], after: dict[str, float]) -> int | None:
    """Decode batches run between two /metrics scrapes (sglang counts one per decode step, graph or
    not); None where the server exports no such counter."""
    keys = [k for k in after if k.startswith(DECODE_PASSES + "{") and re.search(r'mode="decode', k)]
    if not keys:
        return None
    return round(sum(after[k] - before.get(k, 0.0) for k in keys))


def measure(base: str, prompt_at: Callable[[int], Prompt], concurrency: int, settle_s: float, window_s: float,
            timeout: float, stop_at: float, scrape: Callable[[str], dict[str, float]] | None = None,
            counters: Callable[[], dict[str, float]] | None = None) -> dict[str, Any]:
    """One window: `concurrency` clients each send the stream's next prompt when their last request
    ends; the tokens of [settle_s, settle_s + window_s] are counted; then sending stops and every
    request in flight is aborted (kept as a prefix). A window that would end past `stop_at` (the
    call's deadline) is not started ("cut"). `counters` (the server's host counters) are read at
    the counted span's ends, as `scrape` is; `span` is that span (time.time())."""
    t0 = time.time()
    lo_at, hi_at = t0 + settle_s, t0 + settle_s + window_s
    if hi_at + WINDOW_END_S > stop_at:
        return {"cut": True}
    lock = threading.Lock()
    nxt, stop = [0], [False]
    tag = f"bench-{int(t0 * 1000)}"
    done: list[tuple[float, float, client.Result, Prompt]] = []

    def worker() -> None:
        while True:
            with lock:
                if stop[0] or time.time() >= hi_at:
                    return
                i = nxt[0]
                nxt[0] += 1
            p = prompt_at(i)
            start = time.time()
            r = client.generate(base, p, timeout, rid=f"{tag}-{i}")
            with lock:
                done.append((start, time.time(), r, p))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, lo_at - time.time()))
    lo, before = time.time(), scrape(base) if scrape else {}
    host_before = counters() if counters else {}
    time.sleep(max(0.0, hi_at - time.time()))
    hi, after = time.time(), scrape(base) if scrape else {}
    host_after = counters() if counters else {}
    with lock:
        stop[0] = True
    aborted_at = time.time()
    aborted = abort_all(base)
    for t in threads:
        t.join(timeout)
    tail = time.time() - aborted_at
    complete, cut_short, errors = [], [], []
    for start, end, r, p in done:
        if r.error is None and len(r.output_ids or []) == p.max_new_tokens:
            complete.append((start, end, r))
        elif end >= aborted_at:  # in flight at the end: aborted, what it returned must be a prefix
            cut_short.append((start, min(end, aborted_at), r))
        else:
            errors.append(r)
    spans = [(s, e, len(r.output_ids or [])) for s, e, r in complete + cut_short]
    toks = tokens_between(spans, lo, hi)
    lens = [r.meta["spec_accept_length"] for _, _, r in complete if "spec_accept_length" in r.meta]
    steps = decode_steps(before, after)
    m: dict[str, Any] = {
        "requests": len(complete), "aborted": len(cut_short), "errors": len(errors),
        "first_error": errors[0].error if errors else None, "output_tokens": round(toks),
        "seconds": round(hi - lo, 3), "tok_per_s": round(toks / (hi - lo), 1) if hi > lo else 0.0,
        "accept_length": round(statistics.mean(lens), 3) if lens else None, "steps": steps,
        "tail_s": round(tail, 2), "abort_all": aborted, "cut": False,
        "outputs": {r.key: r.output_ids for _, _, r in complete},
        "prefixes": {r.key: r.output_ids for _, _, r in cut_short if r.output_ids}}
    gpu = diagnose.gpu_seconds(before, after) if scrape else {}
    if gpu:
        m["gpu_s"] = gpu
    if counters:
        m["span"] = [lo, hi]
        m["counters"] = hostinfo.counters_delta(host_before, host_after)
    return m


def host_counters(pgid: int | None) -> Callable[[], dict[str, float]] | None:
    """What a window reads of a server's host time at its counted span's ends: the CPU seconds of
    all its processes and its scheduler thread's counters (hostinfo.thread_counters, `scheduler_`
    first); None for a server of no known process group."""
    if pgid is None:
        return None
    pids = servers.group_pids(pgid)
    scheduler = hostinfo.scheduler_pid(pids)

    def read() -> dict[str, float]:
        out = {"server_cpu_s": hostinfo.process_cpu_seconds(pids)}
        if scheduler is not None:
            out |= {f"scheduler_{k}": v for k, v in hostinfo.thread_counters(scheduler).items()}
        return out

    return read


def speculation_state(base: str) -> dict[str, Any]:
    """The server's dynamic speculation disable state, from /server_info (sglang >= 0.5.23 logs a
    deprecation warning for each /get_server_info, which older ones alone serve)."""
    try:
        info = client.get_json(base + "/server_info")
    except client.HTTPFailure:
        info = client.server_info(base)
    return spec_state(info)


def mode_of(base: str) -> tuple[str | None, int | None, int | None]:
    """A threshold server's mode, crossover (auto) and mode-change count; Nones where it says nothing."""
    try:
        st = speculation_state(base)
    except (SmokeError, client.HTTPFailure, ValueError):
        return None, None, None
    crossover = st.get("crossover")
    return st.get("mode"), crossover if isinstance(crossover, int) else None, st.get("mode_changes")


def run_ramp(base: str, levels: list[int], hold_s: float, vocab: int, output_len: int, timeout: float,
             poll: Callable[[], tuple[str | None, int | None, int | None]] | None) -> dict[str, Any]:
    """Closed loop whose number of clients follows `levels`, one every `hold_s` seconds. Returns per
    level its tokens/s (each request's tokens spread over its lifetime) and the modes polled."""
    top = max(levels)
    t0 = time.time()
    end = t0 + hold_s * len(levels)
    done: list[tuple[float, float, int, str, list[int] | None, str | None]] = []
    lock = threading.Lock()
    samples: list[tuple[float, str | None, int | None]] = []
    first_changes: list[int | None] = []

    def level_at(t: float) -> int:
        return levels[min(int((t - t0) / hold_s), len(levels) - 1)]

    def worker(w: int) -> None:
        k = 0
        while (now := time.time()) < end:
            if w >= level_at(now):
                time.sleep(0.02)
                continue
            key = f"ramp-{w}-{k}"
            k += 1
            r = client.generate(base, ramp_prompt(vocab, output_len, key), timeout)
            with lock:
                done.append((now - t0, time.time() - t0, len(r.output_ids or []), key, r.output_ids, r.error))

    def poller() -> None:
        while time.time() < end:
            mode, crossover, changes = poll() if poll else (None, None, None)
            if not first_changes:
                first_changes.append(changes)
            samples.append((time.time() - t0, mode, crossover))
            time.sleep(MODE_POLL_S)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(top)]
    threads.append(threading.Thread(target=poller, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, end - time.time()) + timeout)
    last_changes = poll()[2] if poll else None
    windows = ramp_windows(levels, hold_s, [(start, stop, n) for start, stop, n, *_ in done], samples)
    errors = [e for *_, e in done if e]
    mode_changes = (last_changes - first_changes[0] if isinstance(last_changes, int) and first_changes
                    and isinstance(first_changes[0], int) else None)
    return {"windows": windows, "requests": len(done), "errors": len(errors),
            "first_error": errors[0] if errors else None, "mode_changes": mode_changes,
            "outputs": {key: ids for *_, key, ids, err in done if not err}}


def ramp_windows(levels: list[int], hold_s: float, requests: list[tuple[float, float, int]],
                 samples: list[tuple[float, str | None, int | None]]) -> list[dict[str, Any]]:
    """One window per level: tokens/s, each request's (start s, end s, tokens) spread evenly over its
    lifetime; the share of the mode samples (s, mode, crossover) that said plain, the last crossover."""
    windows = []
    for i, level in enumerate(levels):
        lo, hi = i * hold_s, (i + 1) * hold_s
        tokens = sum(n * max(0.0, min(stop, hi) - max(start, lo)) / (stop - start)
                     for start, stop, n in requests if stop > start)
        modes = [m for t, m, _ in samples if lo <= t < hi and m]
        crossovers = [c for t, _, c in samples if lo <= t < hi and c is not None]
        windows.append({"t": lo, "level": level, "tok_per_s": round(tokens / hold_s, 1),
                        "plain_share": round(modes.count("plain") / len(modes), 2) if modes else None,
                        "crossover": crossovers[-1] if crossovers else None})
    return windows


# ----------------------------------------------------------------------------- the run
# The work comes in whole units, each kept in the state once done so that a call with the same
# state (e2e's next call after a deadline) goes on where the last one stopped: the blocks, one per
# (concurrency, block), a window on every server; then per server its ramp and (--diagnose) its
# full-load diagnosis. No unit is started without the time to finish it.
def kv_pool(srv: Server) -> int:
    try:
        return int(client.load(srv.base).get("max_total_num_tokens") or 0)
    except (client.HTTPFailure, KeyError, IndexError, TypeError, ValueError):
        return 0


def warm_up(base: str, opts: BenchOptions) -> None:
    """Short requests at every concurrency outside the measurement: lazy JIT and autotuning per
    batch shape and per mode."""
    for c in opts.concurrency:
        client.run_concurrent(base, [Prompt(f"w{c}-{i}", (5 + i % 50, 6, 7, 8), 32) for i in range(max(2, c))],
                              c, opts.deadline.request_timeout(240))


def kv_used_after_flush(base: str) -> int | None:
    """Tokens still held in the KV pool once the load is over and the radix cache flushed (0 when
    every request gave back what it took)."""
    for _ in range(10):
        flush_cache(base)
        try:
            used = int(client.load(base).get("num_used_tokens") or 0)
        except (client.HTTPFailure, KeyError, IndexError, TypeError, ValueError):
            return None
        if used == 0:
            return 0
        time.sleep(1)
    return used


def running_limit(base: str) -> int | None:
    """The server's running-request limit (/server_info), None where it says none."""
    try:
        states = client.get_json(base + "/server_info").get("internal_states") or [{}]
        return int(states[0]["effective_max_running_requests_per_dp"])
    except (client.HTTPFailure, KeyError, IndexError, TypeError, ValueError):
        return None


def server_checks(name: str, srv: Server, top: int, switching: bool) -> tuple[dict[str, Any], list[str]]:
    """After a server's load: its KV pool back to empty, its running-request limit, its mode
    counters (a server `switching` between modes itself), its log clean. Every figure is kept, whichever check fails (the failures listed)."""
    info: dict[str, Any] = {"kv_used_after_flush": kv_used_after_flush(srv.base),
                            "running_limit": running_limit(srv.base)}
    problems = []
    if info["kv_used_after_flush"]:
        problems.append(f"{name}: {info['kv_used_after_flush']} KV tokens still in use after the "
                        "load and a cache flush")
    if info["running_limit"] is not None and info["running_limit"] < top:
        problems.append(f"{name}: runs at most {info['running_limit']} requests at once, below the "
                        f"top concurrency {top}")
    if switching:
        try:
            info["speculative_disable"] = speculation_state(srv.base)
        except (SmokeError, client.HTTPFailure, ValueError) as exc:
            problems.append(f"{name}: no speculation state: {getattr(exc, 'cause', exc)}")
    trace = srv.cfg.env.get(names.AUTO_TRACE_ENV)
    if trace and Path(trace).is_file():  # auto's steps, written out as the server went idle after the load
        info["step_trace"] = [r.as_dict() for r in autotrace.summarize(autotrace.read(Path(trace)))]
    try:
        check_log_clean(srv.log_text())
    except SmokeError as exc:
        problems.append(f"{name}: {exc.cause} ({srv.log_path.name})")
    return info, problems


def mismatches(outputs: dict[str, dict[str, Any]], where: str) -> list[str]:
    """Every config's outputs against plain's for the same prompts (greedy: they must be equal)."""
    ref = outputs.get("plain", {})
    problems = []
    for name, got in outputs.items():
        bad = [k for k, v in got.items() if name != "plain" and v is not None and ref.get(k) not in (None, v)]
        if bad:
            problems.append(f"{where} {name}: {len(bad)} output(s) differ from plain (e.g. {bad[0]})")
    return problems


def digest(ids: list[int] | None) -> str | None:
    """A ramp output as kept in the state until every config's ramp is done (compared with plain's)."""
    return None if ids is None else hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def compared_outputs(outputs: dict[str, dict[str, Any]], prefixes: dict[str, dict[str, Any]],
                     where: str) -> list[str]:
    """mismatches() of the complete outputs, and every aborted output a prefix of plain's."""
    problems = mismatches(outputs, where)
    ref = outputs.get("plain", {})
    for name, got in prefixes.items():
        if name == "plain":
            continue
        bad = [k for k, v in got.items() if k in ref and ref[k] is not None and v != ref[k][:len(v)]]
        if bad:
            problems.append(f"{where} {name}: {len(bad)} aborted output(s) not a prefix of plain's (e.g. {bad[0]})")
    return problems


@contextlib.contextmanager
def on_cpus(cpus: tuple[int, ...]) -> Iterator[None]:
    """This thread (and the client threads it starts) on `cpus` meanwhile; nothing where empty."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class Bench:
    """One call's work on the state `st` (JSON: e2e keeps it between calls)."""

    def __init__(self, opts: BenchOptions, st: dict[str, Any], vocab: int, names: list[str],
                 progress: Callable[[dict[str, Any]], None] | None):
        self.opts, self.st, self.vocab, self.names, self.progress = opts, st, vocab, names, progress
        self.result: dict[str, Any] = st["partial"]
        self.pool = servers.ServerPool(opts.registry, opts.models.name, opts.port, opts.cpus_per_server,
                                       say=self.event)
        self.notes: list[str] = []  # why this call left work undone
        self.starting = False  # the servers are being started (a failure then is a start's)
        self.probe: hostinfo.SpeedProbe | None = None  # the CPUs' speed, during the blocks

    def event(self, line: str) -> None:
        """A server found, lost or started again: kept in the report and printed."""
        self.result.setdefault("server_events", []).append(f"call {self.result['calls']}: {line}")
        print(f"bench: {line}", flush=True)

    @property
    def servers(self) -> dict[str, Server]:
        return self.pool.servers

    # -------------------------------------------------------- what is left, and what it costs
    def blocks_left(self) -> list[tuple[int, int]]:
        done = set(self.st.setdefault("blocks_done", []))
        return [(c, k) for c in self.opts.concurrency for k in range(self.opts.pairs) if f"{c}:{k}" not in done]

    def solo_left(self, name: str) -> list[str]:
        """A server's own units still to do: "ramp", "diagnose"."""
        units = ["ramp"] if self.opts.ramp_cycles and name not in self.result["ramp"] else []
        return units + (["diagnose"] if self.opts.diagnose and name not in self.result["diagnose"] else [])

    def block_cost(self, c: int) -> float:
        """A window on every server: settle, count, the end (the longest end seen at this level)."""
        tails = [float(w.get("tail_s", 0.0)) for b in self.result["blocks"].get(str(c), []) for w in b["windows"].values()]
        end = max([WINDOW_END_S, *tails]) + 0.5
        return len(self.names) * (self.opts.settle_s + self.opts.window_s + end)

    def unit_cost(self, unit: str) -> float:
        if unit == "ramp":
            return self.opts.ramp_hold_s * len(ramp_levels(self.opts.concurrency, self.opts.ramp_cycles)) + 30
        return 60.0  # diagnose: a full-load window with py-spy and the profiler

    def start_cost(self) -> float:
        """Starting whatever is not up yet, side by side (the slowest start), then warming up what
        is not warm yet, one after the other (a server an earlier call left running costs nothing)."""
        configs = {name: server_config(name, self.opts) for name in self.names}
        alive = self.pool.recorded_alive(configs, self.opts.key_extra)
        starts = [self.result["start_s"].get(n, START_S) for n in self.names if n not in alive]
        warms = [float(self.result["warm_s"].get(n, WARM_S + self.learn_cost(n))) for n in self.names if not alive.get(n)]
        return max(starts, default=0.0) + sum(warms)

    def learn_cost(self, name: str) -> float:
        """learn()'s seconds: a window of auto_learn_s at every level, and its end."""
        if config_records(self.opts)[name].kind != "auto" or self.opts.auto_learn_s <= 0:
            return 0.0
        return len(self.opts.concurrency) * (self.opts.auto_learn_s + WINDOW_END_S + 0.5)

    def reserve(self) -> float:
        """The end of a call: the report, and where the bench is complete, each server's checks and stop."""
        return 20.0 + 12.0 * len(self.names)

    def fits(self, cost: float) -> bool:
        return self.opts.deadline.left() >= cost + self.reserve()

    # -------------------------------------------------------- servers
    def up(self) -> None:
        """Every server healthy (the recorded ones reused, the rest started side by side), pinned to
        its CPUs and warmed up once, one after the other; then no recorded server of this host
        still starting."""
        configs = {name: server_config(name, self.opts) for name in self.names}
        timeout = min(self.opts.health_timeout, self.opts.deadline.left() - self.reserve())
        self.pool.ensure(configs, self.opts.key_extra, self.log_path, timeout)
        for name, srv in self.servers.items():
            if name not in self.result["start_s"] and srv.start_seconds:
                self.result["start_s"][name] = round(srv.start_seconds, 1)
            self.result["kv_pool_tokens"][name] = kv_pool(srv)
            self.result.setdefault("cpus", {})[name] = list(self.pool.entries[name].cpus)
            self.result.setdefault("scheduler_cpus", {})[name] = self.pool.entries[name].scheduler_cpu
        pools = self.result["kv_pool_tokens"]
        if len(set(pools.values())) > 1 and not any(f.startswith("unequal KV pools") for f in self.result["checks"]):
            self.result["checks"].append(f"unequal KV pools {pools}: lower --mem-share or set --max-total-tokens "
                                         "so that every server holds the same")
        # One at a time: a server that learns from its own step times (`auto`) would otherwise learn
        # them while the others share the GPU (four warming up side by side made its steps 4x slower).
        for name in [n for n in self.names if not self.pool.warmed(n)]:
            t0 = time.time()
            warm_up(self.servers[name].base, self.opts)
            self.learn(name)
            self.pool.mark_warmed(name)
            self.result["warm_s"][name] = round(time.time() - t0, 1)
        self.pool.wait_for_other_starts(min(self.opts.health_timeout, self.opts.deadline.left() - self.reserve()))

    def learn(self, name: str) -> None:
        """`auto` under each level's load for opts.auto_learn_s (prompts no window sends): what it
        learns at a batch size it has not met would otherwise be learned in the first block. The
        other servers have nothing to learn (learn_cost 0)."""
        if not self.learn_cost(name):
            return
        opts, srv = self.opts, self.servers[name]
        crossovers = {}
        for c in opts.concurrency:
            prompt_at = functools.partial(window_prompt, self.vocab, c, opts.output_len, 50, spread=opts.output_spread)
            m = measure(srv.base, prompt_at, c, 0.0, opts.auto_learn_s, opts.deadline.request_timeout(240),
                        opts.deadline.at - self.reserve())
            if m.get("cut"):
                break
            crossovers[str(c)] = mode_of(srv.base)[1]
        self.result.setdefault("learned", {})[name] = {"seconds_per_level": opts.auto_learn_s,
                                                       "crossover_after": crossovers}
        flush_cache(srv.base)

    def log_path(self, name: str) -> Path:
        """A log of its own for each start of a server: the first number not taken in the output
        folder (a failure of another run, of another bench in the same folder, or of an earlier
        start never reads as this one's)."""
        n = 1
        while (path := self.opts.out / f"server_bench_{self.opts.models.name}_{name}.{n}.log").exists():
            n += 1
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        return path

    def check_and_stop_all(self) -> None:
        """The bench is complete: each server's checks (KV back to empty, limits, log), then its stop."""
        problems = []
        for name in list(self.servers):
            try:
                info, found = server_checks(name, self.servers[name], max(self.opts.concurrency),
                                            config_records(self.opts)[name].switches)
                self.result["servers"][name] = info
                problems += found
            except Exception as exc:  # noqa: BLE001 - check and stop every server, report each failure
                problems.append(f"{name}: {getattr(exc, 'cause', f'{type(exc).__name__}: {exc}')}")
            finally:
                self.pool.stop(name)
        self.result["checks"] += problems

    def saved(self) -> None:
        """A unit is done: the caller keeps the state (e2e writes it out, so a killed call loses nothing)."""
        if self.progress:
            self.progress(finish(self.result, self.st, self.notes, self.names))

    # -------------------------------------------------------- units
    def run(self) -> None:
        todo, solo = self.blocks_left(), [n for n in self.names if self.solo_left(n)]
        if not todo and not solo:
            return
        if not all(n in self.servers for n in self.names):
            first = self.block_cost(todo[0][0]) if todo else self.unit_cost(self.solo_left(solo[0])[0])
            need = 0.0 if self.opts.launch_only else first
            if not self.fits(self.start_cost() + need):
                self.notes.append(f"no server started: {self.opts.deadline.left():.0f}s left, "
                                  f"~{self.start_cost() + need + self.reserve():.0f}s needed to start the "
                                  "servers and measure one block")
                return
            if self.opts.launch_only:
                self.launch_only()
                return
            self.starting = True
            try:
                self.up()
            except servers.StillStarting as exc:
                self.notes.append(f"{exc.cause} (the deadline): the next call goes on with them"
                                  if self.opts.registry else exc.cause)
                if self.opts.registry is None:
                    raise
                return
            self.starting = False
        client_cpus = self.pool.client_cpus() if self.opts.cpus_per_server > 0 else ()
        self.result["cpu_topology"] = hostinfo.cpu_topology()
        self.result["client_cpus"] = list(client_cpus)
        with on_cpus(client_cpus):
            self.probe = hostinfo.SpeedProbe(client_cpus).start() if self.blocks_left() else None
            try:
                self.blocks()
            finally:
                if self.probe is not None:
                    self.probe.stop()
            if not self.blocks_left():
                self.solo()

    def launch_only(self) -> None:
        configs = {name: server_config(name, self.opts) for name in self.names}
        self.pool.launch(configs, self.opts.key_extra, self.log_path)
        self.notes.append("servers launched (--launch-only): the next call with these options measures")

    def blocks(self) -> None:
        for c, k in self.blocks_left():
            if not self.fits(self.block_cost(c)):
                self.notes.append(f"stopped before block {k + 1} at concurrency {c} (the deadline)")
                return
            if not self.block(c, k):
                self.notes.append(f"block {k + 1} at concurrency {c} cut by the deadline (not kept)")
                return
            self.saved()

    def block(self, c: int, k: int) -> bool:
        """Block k at concurrency c: a window on every server, back to back; kept only when every
        server finished its window."""
        opts = self.opts
        prompt_at = functools.partial(window_prompt, self.vocab, c, opts.output_len, 100 + k, spread=opts.output_spread)
        got: dict[str, dict[str, Any]] = {}
        outputs: dict[str, dict[str, Any]] = {}
        prefixes: dict[str, dict[str, Any]] = {}
        order = pairing.block_order(self.names, k)
        for name in order:
            srv = self.servers[name]
            flush_cache(srv.base)
            idle = {n: s for n, s in self.servers.items() if n != name and s.pgid is not None}
            cpu0 = {n: servers.group_cpu_seconds(s.pgid) for n, s in idle.items() if s.pgid is not None}
            t0, host0 = time.time(), hostinfo.sample()
            m = measure(srv.base, prompt_at, c, opts.settle_s, opts.window_s, opts.deadline.request_timeout(240),
                        opts.deadline.at - self.reserve(), diagnose.scrape, host_counters(srv.pgid))
            if m.pop("cut"):
                return False
            wall = max(time.time() - t0, 1e-6)
            m["host"] = hostinfo.during(host0, hostinfo.sample())
            span, counted = m.pop("span", None), m.pop("counters", None)
            if counted:
                m["scheduler"] = counted
            work = self.probe.work(*span) if self.probe is not None and span else None
            if work is not None:
                m["host"]["probe_work_s"] = work
            m["idle_cpu"] = {n: round((servers.group_cpu_seconds(s.pgid) - cpu0[n]) / wall, 3)
                             for n, s in idle.items() if s.pgid is not None and n in cpu0}
            outputs[name] = m.pop("outputs")
            prefixes[name] = m.pop("prefixes")
            got[name] = m
        self.result["blocks"].setdefault(str(c), []).append({"block": k + 1, "order": order, "windows": got})
        self.result["window_mismatches"] += compared_outputs(outputs, prefixes, f"block {k + 1} c={c}")
        self.st["blocks_done"].append(f"{c}:{k}")
        return True

    def solo(self) -> None:
        """Per server its ramp, then its diagnosis, one server at a time (the others idle)."""
        for name in self.names:
            for unit in self.solo_left(name):
                if not self.fits(self.unit_cost(unit)):
                    self.notes.append(f"{unit} of {name} and after: not started (the deadline)")
                    return
                (self.ramp if unit == "ramp" else self.diagnose)(name)
                self.saved()

    def ramp(self, name: str) -> None:
        srv, opts = self.servers[name], self.opts
        flush_cache(srv.base)
        poll = functools.partial(mode_of, srv.base) if config_records(opts)[name].switches else None
        r = run_ramp(srv.base, ramp_levels(opts.concurrency, opts.ramp_cycles), opts.ramp_hold_s, self.vocab,
                     opts.output_len, opts.deadline.request_timeout(240), poll)
        self.st.setdefault("ramp_digests", {})[name] = {key: digest(ids) for key, ids in r.pop("outputs").items()}
        self.result["ramp"][name] = r

    def diagnose(self, name: str) -> None:
        c = max(self.opts.concurrency)
        prompts = workload(self.vocab, c, self.opts.output_len, 7, 3 * c, self.opts.output_spread)
        self.result["diagnose"][name] = diagnose.full_load(self.servers[name], prompts, c, self.opts.out,
                                                           self.opts.pyspy_dirs, self.opts.deadline)


def new_result(opts: BenchOptions, expected: dict[str, Any]) -> dict[str, Any]:
    return {"date": time.strftime("%Y-%m-%d"), "thresholds": list(opts.thresholds),
            "concurrency": list(opts.concurrency), "pairs": opts.pairs, "window_s": opts.window_s,
            "settle_s": opts.settle_s, "ramp_hold_s": opts.ramp_hold_s, "output_len": opts.output_len,
            "output_lengths": list(output_lengths(opts.output_len, opts.output_spread)),
            "auto_learn_s": opts.auto_learn_s, "device_timer": opts.device_timer,
            "model": {k: expected.get(k) for k in ("size", "hidden", "layers", "draft", "draft_accept",
                                                    "designed_accept_length")},
            "configs": [], "not_run": {}, "start_s": {}, "warm_s": {}, "kv_pool_tokens": {}, "blocks": {},
            "ramp": {}, "servers": {}, "diagnose": {}, "window_mismatches": [], "checks": [], "calls": 0,
            "server_events": [], "cpus": {}, "mismatches": [], "failures": [], "skipped": []}


def remaining(result: dict[str, Any], st: dict[str, Any], names: list[str]) -> list[str]:
    """What is still to measure, in words (empty when the run is complete)."""
    done = set(st.get("blocks_done", []))
    out = []
    for c in result["concurrency"]:
        left = [k + 1 for k in range(result["pairs"]) if f"{c}:{k}" not in done]
        if left:
            out.append(f"concurrency {c}: {len(left)} of {result['pairs']} blocks")
    ramps = [n for n in names if result.get("ramp_cycles") and n not in result["ramp"]]
    out += [f"ramp of {', '.join(ramps)}"] if ramps else []
    diag = [n for n in names if result.get("diagnose_wanted") and n not in result["diagnose"]]
    return out + ([f"diagnosis of {', '.join(diag)}"] if diag else [])


def finish(result: dict[str, Any], st: dict[str, Any], notes: list[str], names: list[str]) -> dict[str, Any]:
    """The result as the report shows it: outputs compared, failures gathered, what remains."""
    digests = st.get("ramp_digests", {})
    result["mismatches"] = result["window_mismatches"] + mismatches(
        {n: digests[n] for n in names if n in digests}, "ramp")
    result["failures"] = (result["checks"] + result.get("start_failures", []) + result["mismatches"]
                          + errors(result))
    left = remaining(result, st, names)
    result["skipped"] = left + ([f"(this call: {'; '.join(notes)})"] if left and notes else [])
    result["table"] = bench_report.markdown(result)
    return result


def run_bench(opts: BenchOptions, state: dict[str, Any] | None = None,
              progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Start (or find) the servers, measure, and once the bench is complete check and stop them;
    the result (bench_report's input). Resumable: `state` (JSON) keeps every finished unit, so a
    call with the state of one that the deadline stopped measures only what is left (and a call
    after the last one returns the finished result). `progress(result)` after every unit, for the
    caller to keep the state. A failure ends the run, except a server's failed start where the
    servers are recorded: that call fails, and the next one starts the server again."""
    state = state if state is not None else {}
    if state.get("result"):
        return dict(state["result"])
    opts.out.mkdir(parents=True, exist_ok=True)
    expected = json.loads((opts.models / "expected.json").read_text())
    names = server_names(opts)
    result: dict[str, Any] = state.setdefault("partial", new_result(opts, expected))
    result["calls"] += 1
    result["start_failures"] = []  # this call's: the next call starts the server again
    result["ramp_cycles"], result["diagnose_wanted"] = opts.ramp_cycles, opts.diagnose
    if "eagle3_auto" in names and not auto_supported():
        names.remove("eagle3_auto")
        result["not_run"]["eagle3_auto"] = "this sglang has no `auto` threshold (the sglang-image-plugin is not installed)"
    if "eagle3_adaptive" in names:
        (opts.out / "adaptive_config.json").write_text(json.dumps(ADAPTIVE_CONFIG, indent=1))
    result["configs"] = names
    result["config_records"] = {n: rec.as_dict() for n, rec in config_records(opts).items()}
    run = Bench(opts, state, int(expected["vocab_size"]), names, progress)
    failed = False
    try:
        run.run()
    except Exception as exc:  # noqa: BLE001 - SmokeError, HTTPFailure or an unexpected answer
        logs = {n: s.log_path for n, s in run.servers.items()}
        if isinstance(exc, SmokeError) and exc.log is not None and exc.log not in logs.values():
            logs["the server that failed"] = exc.log  # a start that failed: no longer among the servers
        text = (f"{getattr(exc, 'cause', f'{type(exc).__name__}: {exc}')}\n"
                + "\n".join(f"-- {n}\n{log_tail(path, 20)}" for n, path in logs.items()))
        if run.starting and isinstance(exc, SmokeError) and opts.registry is not None:
            # a server that did not start (a host not ready, memory still held): this call fails,
            # the blocks measured and the servers up stay, and the next call starts it again
            result["start_failures"].append(text)
        else:
            failed = True
            result["checks"].append(text)
    finish(result, state, run.notes, names)
    complete = not result["skipped"] and not opts.launch_only
    if failed or complete or opts.registry is None:
        if run.servers and opts.deadline.left() >= run.reserve() - 20:
            run.check_and_stop_all()  # checks after a failure too: every figure is kept
        else:
            run.pool.stop_all()
    finish(result, state, run.notes, names)
    if failed:  # the run ends here: a resumed call would meet the same failure
        result["not_measured"] = remaining(result, state, names)
        result["skipped"] = []
        result["table"] = bench_report.markdown(result)
    result["files"] = [str(p) for p in bench_report.write(result, opts.out)]
    if not result["skipped"] and not opts.launch_only:
        state["result"] = result
        state.pop("ramp_digests", None)
    return result


def errors(result: dict[str, Any]) -> list[str]:
    out = [f"c={c} block {b['block']} {name}: {m['errors']} request error(s): {m['first_error']}"
           for c, blocks in result["blocks"].items() for b in blocks for name, m in b["windows"].items() if m["errors"]]
    out += [f"ramp {name}: {r['errors']} request error(s): {r['first_error']}"
            for name, r in result["ramp"].items() if r["errors"]]
    return out


# ----------------------------------------------------------------------------- command line
def add_tuning_arguments(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """What to measure and how: shared by `bench run` and `bench e2e` (there as --bench-*)."""
    p = "--" + prefix
    ap.add_argument(p + "configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma list of {','.join(CONFIGS)} ({TWIN}: a second plain server, the A/A "
                         "noise floor; eagle3_auto runs only where the server has it)")
    ap.add_argument(p + "concurrency", default=",".join(map(str, DEFAULT_CONCURRENCY)))
    ap.add_argument(p + "threshold", default="16",
                    help="eagle3_thr's fixed threshold N; a comma list runs one server per N (a sweep)")
    ap.add_argument(p + "depth", default="1,2",
                    help="eagle3_depth's draft depths d, a comma list: one always-on EAGLE-3 server per d, "
                         "drafting d steps and verifying d + 1 tokens a request (eagle3 itself drafts 3)")
    ap.add_argument(p + "schedule", default="1-16:3,17-48:2,49-96:1,97-:0",
                    help="eagle3_sched's draft depth per load (the server's --speculative-depth-schedule); "
                         "several separated by ';' run one server each")
    ap.add_argument(p + "switching-defaults", action="store_true",
                    help="start the threshold and auto servers without --max-running-requests and a "
                         "decode graph size, as the README's Serve command does (the others get the "
                         "top concurrency); each server's limit is checked against the top concurrency")
    ap.add_argument(p + "pairs", type=int, default=6,
                    help="blocks per concurrency, each a window on every server, the order reversed "
                         "every other block (0: the ramp alone)")
    ap.add_argument(p + "window-s", type=float, default=3.0,
                    help="seconds of a window whose output tokens are counted")
    ap.add_argument(p + "settle-s", type=float, default=1.0,
                    help="seconds under load before a window starts counting")
    ap.add_argument(p + "output-spread", type=float, default=0.25,
                    help="each request's output length uniform within the mean (--output-len) times "
                         "1 -+ this, the same on every server (0: all alike; then the requests a window "
                         "starts together end together, which rewards a server that keeps them in step)")
    ap.add_argument(p + "auto-learn-s", type=float, default=5.0,
                    help="seconds eagle3_auto runs each level's load before the blocks (0: it learns in "
                         "the first block, as a newly started server does)")
    ap.add_argument(p + "ramp-cycles", type=int, default=0, help="ramp up and down this many times (0: none)")
    ap.add_argument(p + "ramp-hold", type=float, default=2.0, help="seconds per ramp level")
    ap.add_argument(p + "mem-share", type=float, default=0.85,
                    help="each server's --mem-fraction-static (the pool itself is --max-total-tokens)")
    ap.add_argument(p + "max-total-tokens", type=int, default=0,
                    help="KV pool of every server (0: room for the top concurrency's requests)")
    ap.add_argument(p + "cpus-per-server", type=int, default=0,
                    help="pin each server to this many CPUs of its own, the client to one more; with 2 or "
                         "more the server's scheduler thread has the first to itself (0, the default: no "
                         "pinning; 3 CPUs each did not narrow the A/A floor on an H200 host)")
    ap.add_argument(p + "server-args", default="",
                    help="extra flags for every server, one shell-quoted string (e.g. '--gc-threshold 50000')")
    ap.add_argument(p + "diagnose", action="store_true",
                    help="also where each server's time goes at full load (py-spy, torch profiler, device timer)")
    ap.add_argument(p + "device-timer", action="store_true",
                    help="GPU seconds per window from each server's device timer (the host's share of a "
                         "decode step is the rest), without --diagnose's full-load units")
    ap.add_argument(p + "launch-only", action="store_true",
                    help="start the servers (recorded: they outlive this call) and return; the next call "
                         "with the same options warms them up and measures")


def tuning_options(a: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """BenchOptions fields from add_tuning_arguments' flags; a bad value exits naming the flag."""
    def get(name: str) -> Any:
        return getattr(a, (prefix + name).replace("-", "_"))

    def refuse(flag: str, why: str) -> SystemExit:
        return SystemExit(f"--{prefix}{flag} {get(flag)!r}: {why}")

    configs = tuple(x.strip() for x in get("configs").split(",") if x.strip())
    if not configs or any(c not in CONFIGS for c in configs) or len(set(configs)) < len(configs):
        raise refuse("configs", f"give distinct names among {','.join(CONFIGS)}")
    if TWIN in configs and "plain" not in configs:
        raise refuse("configs", f"{TWIN} is measured against plain: add plain")
    conc = [x.strip() for x in get("concurrency").split(",") if x.strip()]
    if not conc or not all(x.isdigit() and int(x) >= 1 for x in conc) or len(set(conc)) < len(conc):
        raise refuse("concurrency", "give distinct whole numbers >= 1, e.g. 1,2,4,8")
    thresholds = [x.strip() for x in str(get("threshold")).split(",") if x.strip()]
    if not thresholds or not all(x.isdigit() and int(x) >= 1 for x in thresholds) or len(set(thresholds)) < len(thresholds):
        raise refuse("threshold", "give distinct whole numbers >= 1, e.g. 16 or 8,16,32")
    depths = [x.strip() for x in str(get("depth")).split(",") if x.strip()]
    if not depths or not all(x.isdigit() and int(x) >= 1 for x in depths) or len(set(depths)) < len(depths):
        raise refuse("depth", "give distinct draft depths >= 1, e.g. 1,2")
    schedules = [x.strip() for x in str(get("schedule")).split(";") if x.strip()]
    try:
        schedules = [names.parse_schedule(x, source=f"--{prefix}schedule") for x in schedules]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if not schedules or len(set(schedules)) < len(schedules):
        raise refuse("schedule", "give one or more distinct schedules separated by ';', e.g. 1-16:3,17-:0")
    if get("pairs") < 0:
        raise refuse("pairs", "must be >= 0 (0: the ramp alone)")
    if not get("window-s") > 0:
        raise refuse("window-s", "must be > 0 seconds (longer windows: less noise, a longer run)")
    if get("settle-s") < 0:
        raise refuse("settle-s", "must be >= 0 seconds")
    if not 0 <= get("output-spread") < 1:
        raise refuse("output-spread", "must be in [0, 1): lengths within the mean times 1 -+ it")
    if get("auto-learn-s") < 0:
        raise refuse("auto-learn-s", "must be >= 0 seconds (0: no learning before the blocks)")
    if get("ramp-cycles") < 0 or get("ramp-hold") <= 0 or get("pairs") + get("ramp-cycles") == 0:
        raise SystemExit(f"--{prefix}ramp-cycles {get('ramp-cycles')} / --{prefix}ramp-hold {get('ramp-hold')}: "
                         f"need cycles >= 0 (> 0 with --{prefix}pairs 0) and a hold > 0 seconds")
    if not 0 < get("mem-share") < 1:
        raise refuse("mem-share", "must be between 0 and 1")
    if get("max-total-tokens") < 0:
        raise refuse("max-total-tokens", "must be >= 0 (0: sized for the top concurrency)")
    if get("cpus-per-server") < 0:
        raise refuse("cpus-per-server", "must be >= 0 (0: no pinning)")
    return {"configs": configs, "concurrency": tuple(sorted(int(x) for x in conc)),
            "thresholds": tuple(sorted(int(x) for x in thresholds)),
            "depths": tuple(sorted(int(x) for x in depths)), "schedules": tuple(schedules),
            "switching_defaults": get("switching-defaults"), "pairs": get("pairs"),
            "window_s": get("window-s"), "settle_s": get("settle-s"),
            "output_spread": get("output-spread"), "auto_learn_s": get("auto-learn-s"),
            "ramp_cycles": get("ramp-cycles"), "ramp_hold_s": get("ramp-hold"),
            "mem_share": get("mem-share"), "max_total_tokens": get("max-total-tokens"),
            "cpus_per_server": get("cpus-per-server"),
            "server_args": tuple(shlex.split(get("server-args"))), "diagnose": get("diagnose"),
            "device_timer": get("device-timer"), "launch_only": get("launch-only")}


# options that change neither what a window measures nor which windows exist: a state measured
# without them goes on with them
NOT_IN_STATE_KEY = ("deadline", "out", "port", "health_timeout", "registry", "key_extra", "launch_only",
                    "pyspy_dirs")


def state_key(opts: BenchOptions) -> str:
    return json.dumps({k: v for k, v in vars(opts).items() if k not in NOT_IN_STATE_KEY},
                      default=str, sort_keys=True)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", type=Path, help="a target and draft (python -m smoke models)")
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--port", type=int, default=30000, help="the first port tried for a server")
    ap.add_argument("--deadline", type=float, default=7200, help="seconds from now")
    ap.add_argument("--state", type=Path, metavar="FILE",
                    help="keep what is measured here, and the servers running (recorded beside it, "
                         "FILE.servers.json); the same command again goes on where a deadline stopped it")
    ap.add_argument("--stop", action="store_true",
                    help="stop the servers that --state FILE's calls left running, and exit")
    ap.add_argument("--render", type=Path, metavar="BENCH_JSON",
                    help="only write the tables and plots of a saved result into --out")
    add_tuning_arguments(ap)


def registry_of(state: Path) -> Path:
    return state.with_name(state.name + ".servers.json")


def options(a: argparse.Namespace) -> BenchOptions:
    if a.models is None:
        raise SystemExit("--models DIR is needed (a target and draft: python -m smoke models DIR --size 1b)")
    if a.output_len < 1:
        raise SystemExit(f"--output-len {a.output_len}: must be >= 1")
    registry = registry_of(a.state) if a.state is not None else None
    if a.launch_only and registry is None:
        raise SystemExit("--launch-only needs --state FILE: the servers it starts are recorded beside it")
    return BenchOptions(models=a.models, out=a.out, output_len=a.output_len, port=a.port, registry=registry,
                        deadline=Deadline(time.time() + a.deadline), **tuning_options(a))


def load_state(path: Path | None, opts: BenchOptions) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    """`--state FILE`'s state, and the function that writes it after every unit. A state measured
    with other options is refused: its windows would be mixed with these."""
    key = state_key(opts)
    state: dict[str, Any] = {"options": key}
    if path is not None and path.exists():
        state = json.loads(path.read_text())
        if state.get("options") != key:
            raise SystemExit(f"--state {path}: measured with other options; give the same options, or another "
                             "file (or delete it) to start afresh")

    def save(_: dict[str, Any]) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(state))

    return state, save


def main(a: argparse.Namespace) -> int:
    if a.render is not None:
        result = json.loads(a.render.read_text())
        for path in bench_report.write(result, a.out):
            print(path)
        return 0
    if a.stop:
        if a.state is None:
            raise SystemExit("--stop needs --state FILE: the servers are recorded beside it")
        n = servers.stop_recorded(registry_of(a.state))
        print(f"stopped {n} server(s) recorded beside {a.state}")
        return 0
    opts = options(a)
    state, save = load_state(a.state, opts)
    result = run_bench(opts, state, save)
    save(result)
    print(result["table"])
    print("\n".join(result["files"]))
    for f in result["failures"]:
        print("BENCH FAILED:", f)
    if result["skipped"]:
        again = "the same command" if a.state else "the same command with --state FILE (this run kept nothing)"
        print(f"BENCH INCOMPLETE: {'; '.join(result['skipped'])}\nRun {again} to measure what is left.")
    return 1 if result["failures"] or result["skipped"] else 0
