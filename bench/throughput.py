"""Output tokens/s of plain decoding, always-on EAGLE-3, upstream's adaptive EAGLE-3, a fixed
speculation-disable threshold and `auto`, on servers started here (a GPU host, no Docker needed).

    python -m bench run --models DIR --out docs/bench [--configs plain,eagle3,...]
                          [--concurrency 1,2,4,...,256] [--rounds 2] [--threshold 16[,32,...]]
                          [--window-s 10 --window-waves 3] [--ramp-cycles 3 --ramp-hold 2]
                          [--diagnose] [--state FILE] [--deadline S]

DIR holds a target and an EAGLE-3 draft (`python -m smoke models DIR --size 1b --draft chain
--device cuda`).
For the closed loop all servers run at once and every load goes to each of them in turn, the order
reversed every other time, so that each ratio compares measurements seconds apart: a host's speed can drift by tens of
percent within minutes, which one server measured after another would read as a difference
between them. Greedy prompts of fixed lengths; every output is compared with plain decoding's.

- Closed loop: at concurrency c, c clients each send their next request when the last one ends,
  for at least --window-s seconds and --window-waves requests per client on each server (a short
  window at low concurrency reads a host's drift as a difference); every round at every level
  before the next round. It lasts about rounds x levels x servers x --window-s (longer where
  --window-waves requests take longer). The table shows, per level, the median and the spread
  (min-max) of the per-round ratios to plain: the noise of the figure.
- Ramp: the number of clients steps through the concurrencies up to the top and back down, several
  times, a level every --ramp-hold seconds; tokens/s per level and, for the threshold servers, the
  mode they are in (and auto's crossover) over time.

Writes under --out: bench.json (every measurement), bench.md (the tables), concurrency.png and
ramp.png (matplotlib; `--render bench.json` draws them again elsewhere). `auto` runs only where the
server has it (the sglang-image-plugin with its auto threshold). --diagnose adds where each
server's time goes at full load (bench.diagnose).

Resumable (`--state FILE`, or the state that `bench e2e` keeps): every closed-loop window (a round
at a level, on every server), every server's ramp and diagnosis is kept once done, so that the same
command after a deadline measures only what is left; the report lists what remains. The closed loop
comes first, then each server's own units, one server started at a time; no server is started
without the time to finish a unit.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import json
import random
import shlex
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import diagnose
from bench import report as bench_report
from smoke import client, names
from smoke.client import Prompt
from smoke.runner import Deadline, check_log_clean, spec_state
from smoke.server import Server, ServerConfig, SmokeError, log_tail

CONFIGS = ("plain", "eagle3", "eagle3_adaptive", "eagle3_thr", "eagle3_auto")
THRESHOLD_FLAG = names.THRESHOLD_FLAG
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256)
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
START_S_PER_SERVER = 75  # a server's start, budgeted until measured (about a minute or two)
WARM_S = 30  # its warm-up, budgeted until measured
MAX_PROMPT_LEN = 64  # prompts of 32-64 tokens
MIN_WINDOW_REQUESTS = 8
MODE_POLL_S = 0.5  # how often the ramp asks a threshold server for its mode


@dataclass
class BenchOptions:
    models: Path
    out: Path
    thresholds: tuple[int, ...] = (16,)  # eagle3_thr: one server per fixed threshold (a sweep)
    # the switching servers (a threshold, auto) start without --max-running-requests and a decode
    # graph size, as the README's Serve command does: the plugin keeps a plain server's limits
    switching_defaults: bool = False
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    configs: tuple[str, ...] = CONFIGS
    rounds: int = 2  # closed-loop rounds; each level alternates the server order
    window_s: float = 10.0  # a closed-loop window lasts at least this long on each server
    window_waves: int = 3  # ... and sends at least this many requests per client
    ramp_cycles: int = 3  # 0: no ramp
    ramp_hold_s: float = 2.0
    output_len: int = 256
    port: int = 30000
    # of the GPU memory free before the first server, shared evenly among the servers
    mem_share: float = 0.85
    # --max-total-tokens of every server (0: room for the top concurrency's requests, the same for
    # all: a server started later would otherwise get a smaller KV pool and evict where others do not)
    max_total_tokens: int = 0
    server_args: tuple[str, ...] = ()  # appended to every server's flags
    diagnose: bool = False
    device_timer: bool = False  # GPU seconds per window (diagnose's device timer, without its solo units)
    pyspy_dirs: tuple[Path, ...] = ()  # --diagnose: where to look for py-spy besides PATH
    deadline: Deadline = field(default_factory=lambda: Deadline(time.time() + 3600))
    health_timeout: float = 420


# ----------------------------------------------------------------------------- what runs
def auto_supported() -> bool:
    """Whether this Python's sglang takes `--speculative-disable-batch-threshold auto` (the plugin
    that implements it is installed); read from the package metadata, without importing sglang."""
    try:
        files = importlib.metadata.distribution("sglang-image-plugin").files or []
    except importlib.metadata.PackageNotFoundError:
        return False
    return any(f.name == "auto_threshold.py" for f in files)


def server_config(name: str, opts: BenchOptions, mem_fraction: float = 0.3,
                  max_total_tokens: int = 0) -> ServerConfig:
    top: int | None = None if opts.switching_defaults and switches(name) else max(opts.concurrency)
    cfg = ServerConfig(name, opts.models / "target", cuda_graph=True, cuda_graph_max_bs=top,
                       max_running=top, mem_fraction=round(mem_fraction, 3), enable_metrics=True)
    extra: list[str] = ["--sleep-on-idle"]  # a server waiting for its turn must not spin a core
    if name != "plain":
        cfg.draft = opts.models / "draft"
    if name.startswith("eagle3_thr"):
        cfg.threshold = int(name.removeprefix("eagle3_thr"))
    if name == "eagle3_auto":
        extra += [THRESHOLD_FLAG, "auto"]
    if name == "eagle3_adaptive":
        extra += ["--speculative-adaptive", "--speculative-adaptive-config", str(opts.out / "adaptive_config.json")]
    if max_total_tokens:
        extra += ["--max-total-tokens", str(max_total_tokens)]
    if opts.diagnose or opts.device_timer:
        cfg.env.update(diagnose.SERVER_ENV)
    cfg.extra = (*extra, *opts.server_args)
    return cfg


def server_names(opts: BenchOptions) -> list[str]:
    """The servers of the configs, in order: eagle3_thr becomes one per threshold (eagle3_thr16, ...)."""
    names: list[str] = []
    for name in opts.configs:
        names += [f"eagle3_thr{n}" for n in opts.thresholds] if name == "eagle3_thr" else [name]
    return names


def window_requests(concurrency: int, waves: int) -> int:
    """The fewest requests of a closed-loop window: `waves` per client, at least MIN_WINDOW_REQUESTS
    (a window also lasts at least --window-s; it sends more where that takes longer)."""
    return max(MIN_WINDOW_REQUESTS, waves * concurrency)


def window_prompt(vocab: int, concurrency: int, output_len: int, seed: int, i: int) -> Prompt:
    """The i-th prompt of a closed-loop window's stream: the same on every server, another per round
    (seed) and level."""
    rnd = random.Random(f"{seed}-{concurrency}-{i}")
    return Prompt(f"c{concurrency}-{i}", tuple(rnd.randrange(3, vocab) for _ in range(rnd.randint(32, MAX_PROMPT_LEN))),
                  output_len)


def workload(vocab: int, concurrency: int, output_len: int, seed: int, n: int) -> list[Prompt]:
    """The first n prompts of a window's stream."""
    return [window_prompt(vocab, concurrency, output_len, seed, i) for i in range(n)]


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
    """KV room for the top concurrency's running requests with a quarter to spare."""
    return int(1.25 * max(opts.concurrency) * (MAX_PROMPT_LEN + opts.output_len))


def switches(name: str) -> bool:
    """Whether the server switches between speculative and plain steps itself (a threshold, auto)."""
    return name.startswith("eagle3_thr") or name == "eagle3_auto"


def round_order(names: list[str], k: int) -> list[str]:
    return names if k % 2 == 0 else names[::-1]


# ----------------------------------------------------------------------------- measuring
def flush_cache(base: str) -> None:
    """Empty the radix cache before a window: every window starts from the same empty cache."""
    try:
        client.post(base + "/flush_cache?timeout=10", {}, 30)
    except client.HTTPFailure:
        pass


def measure(base: str, prompt_at: Callable[[int], Prompt], concurrency: int, min_s: float,
            min_requests: int, timeout: float, stop_at: float) -> dict[str, Any]:
    """One closed-loop window: `concurrency` clients each send the stream's next prompt when their
    last request ends, until the window has lasted `min_s` and sent `min_requests`; the requests in
    flight then finish. Sending stops early at the first error or at `stop_at` (the call's deadline:
    the window is then "cut" and not a measurement)."""
    t0 = time.time()
    lock = threading.Lock()
    sent = [0]
    cut, failed = [False], [False]
    results: list[client.Result] = []

    def worker() -> None:
        while True:
            with lock:
                now = time.time()
                if now >= stop_at:
                    cut[0] = True
                if cut[0] or failed[0] or (sent[0] >= min_requests and now - t0 >= min_s):
                    return
                i = sent[0]
                sent[0] += 1
            r = client.generate(base, prompt_at(i), timeout)
            with lock:
                results.append(r)
                failed[0] = failed[0] or r.error is not None

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - t0
    errors = [r for r in results if r.error]
    toks = sum(len(r.output_ids or []) for r in results)
    lens = [r.meta["spec_accept_length"] for r in results if "spec_accept_length" in r.meta]
    return {"requests": len(results), "errors": len(errors), "first_error": errors[0].error if errors else None,
            "output_tokens": toks, "seconds": round(wall, 3), "tok_per_s": round(toks / wall, 1) if wall else 0.0,
            "accept_length": round(statistics.mean(lens), 3) if lens else None, "cut": cut[0],
            "outputs": {r.key: r.output_ids for r in results}}


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
# state (e2e's next call after a deadline) goes on where the last one stopped: the closed-loop
# windows, one per (round, concurrency), measured on every server at once; then per server its
# ramp and (--diagnose) its full-load diagnosis, for which it is started alone when the closed loop
# is done. No unit is started without the time to finish it, and no server without the time to use it.
def launch(opts: BenchOptions, name: str, mem_fraction: float, tokens: int, log_path: Path) -> Server:
    """Start one bench server (its port from its place among the configs) and wait until healthy."""
    k = server_names(opts).index(name)
    srv = Server(server_config(name, opts, mem_fraction, tokens), opts.port + k, log_path)
    try:
        srv.start(min(opts.health_timeout, opts.deadline.left() - 45))
    except BaseException:
        srv.stop()  # a server that never became healthy must not hold the GPU or the port
        raise
    return srv


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


def server_checks(name: str, srv: Server, top: int) -> tuple[dict[str, Any], list[str]]:
    """After a server's load: its KV pool back to empty, its running-request limit, its mode
    counters, its log clean. Every figure is kept, whichever check fails (the failures listed)."""
    info: dict[str, Any] = {"kv_used_after_flush": kv_used_after_flush(srv.base),
                            "running_limit": running_limit(srv.base)}
    problems = []
    if info["kv_used_after_flush"]:
        problems.append(f"{name}: {info['kv_used_after_flush']} KV tokens still in use after the "
                        "load and a cache flush")
    if info["running_limit"] is not None and info["running_limit"] < top:
        problems.append(f"{name}: runs at most {info['running_limit']} requests at once, below the "
                        f"top concurrency {top}")
    if switches(name):
        try:
            info["speculative_disable"] = speculation_state(srv.base)
        except (SmokeError, client.HTTPFailure, ValueError) as exc:
            problems.append(f"{name}: no speculation state: {getattr(exc, 'cause', exc)}")
    try:
        check_log_clean(srv.log_path.read_text(errors="replace"))
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


class Bench:
    """One call's work on the state `st` (JSON: e2e keeps it between calls)."""

    def __init__(self, opts: BenchOptions, st: dict[str, Any], vocab: int, names: list[str],
                 progress: Callable[[dict[str, Any]], None] | None):
        self.opts, self.st, self.vocab, self.names, self.progress = opts, st, vocab, names, progress
        self.result: dict[str, Any] = st["partial"]
        self.tokens = opts.max_total_tokens or pool_tokens(opts)
        self.servers: dict[str, Server] = {}
        self.notes: list[str] = []  # why this call left work undone

    # -------------------------------------------------------- what is left, and what it costs
    def windows_left(self) -> list[tuple[int, int]]:
        done = set(self.st.setdefault("windows_done", []))
        return [(k, c) for k in range(self.opts.rounds) for c in self.opts.concurrency if f"{k}:{c}" not in done]

    def solo_left(self, name: str) -> list[str]:
        """A server's own units still to do: "ramp", "diagnose"."""
        units = ["ramp"] if self.opts.ramp_cycles and name not in self.result["ramp"] else []
        return units + (["diagnose"] if self.opts.diagnose and name not in self.result["diagnose"] else [])

    def window_cost(self, c: int) -> float:
        """A window on every server: the longest seen at this level, else --window-s with room for
        the requests in flight at its end."""
        seen = [m["seconds"] for ms in self.result["levels"].get(str(c), {}).values() for m in ms]
        longest = max((m["seconds"] for by in self.result["levels"].values() for ms in by.values() for m in ms),
                      default=0.0)
        return len(self.names) * ((max(seen) if seen else max(self.opts.window_s * 1.5 + 10, 1.5 * longest)) + 2)

    def unit_cost(self, unit: str) -> float:
        if unit == "ramp":
            return self.opts.ramp_hold_s * len(ramp_levels(self.opts.concurrency, self.opts.ramp_cycles)) + 30
        return 60.0  # diagnose: a full-load window with py-spy and the profiler

    def start_cost(self, names: list[str]) -> float:
        return float(sum(self.result["start_s"].get(n, START_S_PER_SERVER) + self.result["warm_s"].get(n, WARM_S)
                         for n in names))

    def reserve(self, servers: int) -> float:
        """The end of a call: the KV and log checks and the stop of each server, the report."""
        return 20.0 + 12.0 * servers

    def fits(self, cost: float, servers: int) -> bool:
        return self.opts.deadline.left() >= cost + self.reserve(servers)

    # -------------------------------------------------------- servers
    def start(self, names: list[str]) -> None:
        """One after another, each taking an even share of the memory still free (a server started
        alone takes the share it would have among all: the same start whether alone or not)."""
        for k, name in enumerate(names):
            share = self.opts.mem_share / (len(names) - k if len(names) > 1 else len(self.names))
            t0 = time.time()
            srv = self.servers[name] = launch(self.opts, name, share, self.tokens, self.log_path(name))
            self.result["start_s"][name] = round(srv.start_seconds or time.time() - t0, 1)
            self.result["kv_pool_tokens"][name] = kv_pool(srv)
        pools = self.result["kv_pool_tokens"]
        if len(set(pools.values())) > 1 and not any(f.startswith("unequal KV pools") for f in self.result["checks"]):
            self.result["checks"].append(f"unequal KV pools {pools}: lower --mem-share or set --max-total-tokens "
                                         "so that every server holds the same")
        for name in names:
            t0 = time.time()
            warm_up(self.servers[name].base, self.opts)
            self.result["warm_s"][name] = round(time.time() - t0, 1)

    def log_path(self, name: str) -> Path:
        """A log of its own for each start of a server: the first number not taken in the output
        folder (a failure of another run, of another bench in the same folder, or of an earlier
        start never reads as this one's)."""
        n = 1
        while (path := self.opts.out / f"server_bench_{name}.{n}.log").exists():
            n += 1
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        return path

    def stop(self, name: str) -> None:
        srv = self.servers.pop(name)
        try:
            if self.fits(0, 0):
                info, problems = server_checks(name, srv, max(self.opts.concurrency))
                self.result["servers"][name] = info
                self.result["checks"] += problems
        finally:
            srv.stop()

    def stop_all(self) -> None:
        errors = []
        for name in list(self.servers):
            try:
                self.stop(name)
            except Exception as exc:  # noqa: BLE001 - stop every server, report each failure
                errors.append(f"{name}: {getattr(exc, 'cause', f'{type(exc).__name__}: {exc}')}")
        self.result["checks"] += errors

    def saved(self) -> None:
        """A unit is done: the caller keeps the state (e2e writes it out, so a killed call loses nothing)."""
        if self.progress:
            self.progress(finish(self.result, self.st, self.notes, self.names))

    # -------------------------------------------------------- units
    def closed_loop(self) -> None:
        """The windows left, round by round (every level of a round before the next round), each on
        every server in turn, the order alternating."""
        todo = self.windows_left()
        if not todo:
            return
        if not self.fits(self.start_cost(self.names) + self.window_cost(todo[0][1]), len(self.names)):
            self.notes.append(f"no server started: {self.opts.deadline.left():.0f}s left, ~"
                              f"{self.start_cost(self.names) + self.window_cost(todo[0][1]) + self.reserve(len(self.names)):.0f}s "
                              "needed to start them all and measure one closed-loop window")
            return
        self.start(self.names)
        for k, c in todo:
            if not self.fits(self.window_cost(c), len(self.servers)):
                self.notes.append(f"closed loop stopped before round {k + 1} at {c} (the deadline)")
                return
            if not self.window(k, c):
                self.notes.append(f"closed loop: round {k + 1} at {c} cut by the deadline (not kept)")
                return
            self.saved()

    def window(self, k: int, c: int) -> bool:
        """Round k's window at concurrency c on every server; kept only when every server finished it."""
        opts, i = self.opts, self.opts.concurrency.index(c)
        prompt_at = functools.partial(window_prompt, self.vocab, c, opts.output_len, 100 + k)
        got: dict[str, dict[str, Any]] = {}
        outputs: dict[str, dict[str, Any]] = {}
        for name in round_order(self.names, k + i):
            srv = self.servers[name]
            flush_cache(srv.base)
            timed = opts.diagnose or opts.device_timer
            before = diagnose.scrape(srv.base) if timed else {}
            m = measure(srv.base, prompt_at, c, opts.window_s, window_requests(c, opts.window_waves),
                        opts.deadline.request_timeout(240), opts.deadline.at - self.reserve(len(self.servers)))
            if m.pop("cut"):
                return False
            if timed:
                m["gpu_s"] = diagnose.gpu_seconds(before, diagnose.scrape(srv.base))
            outputs[name] = m.pop("outputs")
            got[name] = {**m, "round": k + 1}
        for name in self.names:
            self.result["levels"].setdefault(str(c), {}).setdefault(name, []).append(got[name])
        self.result["window_mismatches"] += mismatches(outputs, f"round {k + 1} c={c}")
        self.st["windows_done"].append(f"{k}:{c}")
        return True

    def solo(self) -> None:
        """Per server its ramp, then its diagnosis: on the servers already up, then each server left
        started alone, when there is the time to start it and finish its first unit."""
        for name in self.names:
            units = self.solo_left(name)
            if not units:
                continue
            if name not in self.servers:
                need = self.start_cost([name]) + self.unit_cost(units[0])
                if not self.fits(need, 1):
                    self.notes.append(f"{', '.join(units)} of {name} and after: not started "
                                      f"({self.opts.deadline.left():.0f}s left, ~{need + self.reserve(1):.0f}s needed)")
                    return
                self.start([name])
            for unit in units:
                if not self.fits(self.unit_cost(unit), len(self.servers)):
                    self.notes.append(f"{unit} of {name} and after: not started (the deadline)")
                    return
                (self.ramp if unit == "ramp" else self.diagnose)(name)
                self.saved()
            if len(self.servers) == 1:  # started alone: make room for the next one
                self.stop(name)

    def ramp(self, name: str) -> None:
        srv, opts = self.servers[name], self.opts
        flush_cache(srv.base)
        poll = functools.partial(mode_of, srv.base) if switches(name) else None
        r = run_ramp(srv.base, ramp_levels(opts.concurrency, opts.ramp_cycles), opts.ramp_hold_s, self.vocab,
                     opts.output_len, opts.deadline.request_timeout(240), poll)
        self.st.setdefault("ramp_digests", {})[name] = {key: digest(ids) for key, ids in r.pop("outputs").items()}
        self.result["ramp"][name] = r

    def diagnose(self, name: str) -> None:
        c = max(self.opts.concurrency)
        prompts = workload(self.vocab, c, self.opts.output_len, 7, window_requests(c, self.opts.window_waves))
        self.result["diagnose"][name] = diagnose.full_load(self.servers[name], prompts, c, self.opts.out,
                                                           self.opts.pyspy_dirs, self.opts.deadline)


def new_result(opts: BenchOptions, expected: dict[str, Any]) -> dict[str, Any]:
    return {"date": time.strftime("%Y-%m-%d"), "thresholds": list(opts.thresholds),
            "concurrency": list(opts.concurrency), "rounds": opts.rounds, "window_s": opts.window_s,
            "window_waves": opts.window_waves, "ramp_hold_s": opts.ramp_hold_s, "output_len": opts.output_len,
            "model": {k: expected.get(k) for k in ("size", "hidden", "layers", "draft", "draft_accept",
                                                    "designed_accept_length")},
            "configs": [], "not_run": {}, "start_s": {}, "warm_s": {}, "kv_pool_tokens": {}, "levels": {},
            "ramp": {}, "servers": {}, "diagnose": {}, "window_mismatches": [], "checks": [], "calls": 0,
            "mismatches": [], "failures": [], "skipped": []}


def remaining(result: dict[str, Any], st: dict[str, Any], names: list[str]) -> list[str]:
    """What is still to measure, in words (empty when the run is complete)."""
    done = set(st.get("windows_done", []))
    left: dict[int, list[int]] = {}
    for k in range(result["rounds"]):
        for c in result["concurrency"]:
            if f"{k}:{c}" not in done:
                left.setdefault(k + 1, []).append(c)
    out = [f"closed loop round {k} at concurrency {', '.join(map(str, cs))}" for k, cs in left.items()]
    ramps = [n for n in names if result.get("ramp_cycles") and n not in result["ramp"]]
    out += [f"ramp of {', '.join(ramps)}"] if ramps else []
    diag = [n for n in names if result.get("diagnose_wanted") and n not in result["diagnose"]]
    return out + ([f"diagnosis of {', '.join(diag)}"] if diag else [])


def finish(result: dict[str, Any], st: dict[str, Any], notes: list[str], names: list[str]) -> dict[str, Any]:
    """The result as the report shows it: outputs compared, failures gathered, what remains."""
    digests = st.get("ramp_digests", {})
    result["mismatches"] = result["window_mismatches"] + mismatches(
        {n: digests[n] for n in names if n in digests}, "ramp")
    result["failures"] = result["checks"] + result["mismatches"] + errors(result)
    left = remaining(result, st, names)
    result["skipped"] = left + ([f"(this call: {'; '.join(notes)})"] if left and notes else [])
    result["table"] = bench_report.markdown(result)
    return result


def run_bench(opts: BenchOptions, state: dict[str, Any] | None = None,
              progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Start the servers, measure, stop them; the result (bench_report's input). Resumable: `state`
    (JSON) keeps every finished unit, so a call with the state of one that the deadline stopped
    measures only what is left (and a call after the last one returns the finished result).
    `progress(result)` after every unit, for the caller to keep the state."""
    state = state if state is not None else {}
    if state.get("result"):
        return dict(state["result"])
    opts.out.mkdir(parents=True, exist_ok=True)
    expected = json.loads((opts.models / "expected.json").read_text())
    names = server_names(opts)
    result: dict[str, Any] = state.setdefault("partial", new_result(opts, expected))
    result["calls"] += 1
    result["ramp_cycles"], result["diagnose_wanted"] = opts.ramp_cycles, opts.diagnose
    if "eagle3_auto" in names and not auto_supported():
        names.remove("eagle3_auto")
        result["not_run"]["eagle3_auto"] = "this sglang has no `auto` threshold (the sglang-image-plugin is not installed)"
    if "eagle3_adaptive" in names:
        (opts.out / "adaptive_config.json").write_text(json.dumps(ADAPTIVE_CONFIG, indent=1))
    result["configs"] = names
    run = Bench(opts, state, int(expected["vocab_size"]), names, progress)
    failed = False
    try:
        run.closed_loop()
        if not run.windows_left():
            run.solo()
        elif run.servers:  # the closed loop is unfinished: the servers' own units wait for the next call
            run.notes.append("ramps wait until the closed loop is done")
    except Exception as exc:  # noqa: BLE001 - SmokeError, HTTPFailure or an unexpected answer
        failed = True
        logs = {n: s.log_path for n, s in run.servers.items()}
        if isinstance(exc, SmokeError) and exc.log is not None and exc.log not in logs.values():
            logs["the server that failed"] = exc.log  # a start that failed: no longer among the servers
        result["checks"].append(f"{getattr(exc, 'cause', f'{type(exc).__name__}: {exc}')}\n"
                                + "\n".join(f"-- {n}\n{log_tail(path, 20)}" for n, path in logs.items()))
    finally:
        run.stop_all()
    finish(result, state, run.notes, names)
    if failed:  # the run ends here: a resumed call would meet the same failure
        result["not_measured"] = remaining(result, state, names)
        result["skipped"] = []
        result["table"] = bench_report.markdown(result)
    result["files"] = [str(p) for p in bench_report.write(result, opts.out)]
    if not result["skipped"]:
        state["result"] = result
        state.pop("ramp_digests", None)
    return result


def errors(result: dict[str, Any]) -> list[str]:
    out = [f"c={c} round {m['round']} {name}: {m['errors']} request error(s): {m['first_error']}"
           for c, by_name in result["levels"].items() for name, ms in by_name.items() for m in ms if m["errors"]]
    out += [f"ramp {name}: {r['errors']} request error(s): {r['first_error']}"
            for name, r in result["ramp"].items() if r["errors"]]
    return out


# ----------------------------------------------------------------------------- command line
def add_tuning_arguments(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """What to measure and how: shared by `smoke bench` and `smoke e2e` (there as --bench-*)."""
    p = "--" + prefix
    ap.add_argument(p + "configs", default=",".join(CONFIGS),
                    help=f"comma list of {','.join(CONFIGS)} (eagle3_auto runs only where the server has it)")
    ap.add_argument(p + "concurrency", default=",".join(map(str, DEFAULT_CONCURRENCY)))
    ap.add_argument(p + "threshold", default="16",
                    help="eagle3_thr's fixed threshold N; a comma list runs one server per N (a sweep)")
    ap.add_argument(p + "switching-defaults", action="store_true",
                    help="start the threshold and auto servers without --max-running-requests and a "
                         "decode graph size, as the README's Serve command does (the others get the "
                         "top concurrency); each server's limit is checked against the top concurrency")
    ap.add_argument(p + "rounds", type=int, default=2,
                    help="closed-loop rounds (the server order alternates; 0: the ramp alone)")
    ap.add_argument(p + "window-s", type=float, default=10.0,
                    help="a closed-loop window lasts at least this many seconds on each server")
    ap.add_argument(p + "window-waves", type=int, default=3,
                    help=f"... and sends at least this many requests per client (and {MIN_WINDOW_REQUESTS} in all)")
    ap.add_argument(p + "ramp-cycles", type=int, default=3, help="ramp up and down this many times (0: none)")
    ap.add_argument(p + "ramp-hold", type=float, default=2.0, help="seconds per ramp level")
    ap.add_argument(p + "mem-share", type=float, default=0.85,
                    help="share of the free GPU memory that the servers divide evenly")
    ap.add_argument(p + "max-total-tokens", type=int, default=0,
                    help="KV pool of every server (0: room for the top concurrency's requests)")
    ap.add_argument(p + "server-args", default="",
                    help="extra flags for every server, one shell-quoted string (e.g. '--gc-threshold 50000')")
    ap.add_argument(p + "diagnose", action="store_true",
                    help="also where each server's time goes at full load (py-spy, torch profiler, device timer)")
    ap.add_argument(p + "device-timer", action="store_true",
                    help="GPU seconds per closed-loop window from each server's device timer (the host's "
                         "share of a step is the rest), without --diagnose's full-load units")


def tuning_options(a: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """BenchOptions fields from add_tuning_arguments' flags; a bad value exits naming the flag."""
    def get(name: str) -> Any:
        return getattr(a, (prefix + name).replace("-", "_"))

    def refuse(flag: str, why: str) -> SystemExit:
        return SystemExit(f"--{prefix}{flag} {get(flag)!r}: {why}")

    configs = tuple(x.strip() for x in get("configs").split(",") if x.strip())
    if not configs or any(c not in CONFIGS for c in configs) or len(set(configs)) < len(configs):
        raise refuse("configs", f"give distinct names among {','.join(CONFIGS)}")
    conc = [x.strip() for x in get("concurrency").split(",") if x.strip()]
    if not conc or not all(x.isdigit() and int(x) >= 1 for x in conc) or len(set(conc)) < len(conc):
        raise refuse("concurrency", "give distinct whole numbers >= 1, e.g. 1,2,4,8")
    thresholds = [x.strip() for x in str(get("threshold")).split(",") if x.strip()]
    if not thresholds or not all(x.isdigit() and int(x) >= 1 for x in thresholds) or len(set(thresholds)) < len(thresholds):
        raise refuse("threshold", "give distinct whole numbers >= 1, e.g. 16 or 8,16,32")
    if get("rounds") < 0:
        raise refuse("rounds", "must be >= 0 (0: the ramp alone)")
    if not get("window-s") > 0:
        raise refuse("window-s", "must be > 0 seconds (longer windows: less noise, a longer run)")
    if get("window-waves") < 1:
        raise refuse("window-waves", "must be >= 1 request per client")
    if get("ramp-cycles") < 0 or get("ramp-hold") <= 0 or get("rounds") + get("ramp-cycles") == 0:
        raise SystemExit(f"--{prefix}ramp-cycles {get('ramp-cycles')} / --{prefix}ramp-hold {get('ramp-hold')}: "
                         f"need cycles >= 0 (> 0 with --{prefix}rounds 0) and a hold > 0 seconds")
    if not 0 < get("mem-share") < 1:
        raise refuse("mem-share", "must be between 0 and 1")
    if get("max-total-tokens") < 0:
        raise refuse("max-total-tokens", "must be >= 0 (0: sized for the top concurrency)")
    return {"configs": configs, "concurrency": tuple(sorted(int(x) for x in conc)),
            "thresholds": tuple(sorted(int(x) for x in thresholds)),
            "switching_defaults": get("switching-defaults"),
            "rounds": get("rounds"), "window_s": get("window-s"), "window_waves": get("window-waves"),
            "ramp_cycles": get("ramp-cycles"), "ramp_hold_s": get("ramp-hold"),
            "mem_share": get("mem-share"), "max_total_tokens": get("max-total-tokens"),
            "server_args": tuple(shlex.split(get("server-args"))), "diagnose": get("diagnose"),
            "device_timer": get("device-timer")}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", type=Path, help="a target and draft (python -m smoke models)")
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--deadline", type=float, default=7200, help="seconds from now")
    ap.add_argument("--state", type=Path, metavar="FILE",
                    help="keep what is measured here; the same command again goes on where a deadline stopped it")
    ap.add_argument("--render", type=Path, metavar="BENCH_JSON",
                    help="only write the tables and plots of a saved result into --out")
    add_tuning_arguments(ap)


def options(a: argparse.Namespace) -> BenchOptions:
    if a.models is None:
        raise SystemExit("--models DIR is needed (a target and draft: python -m smoke models DIR --size 1b)")
    if a.output_len < 1:
        raise SystemExit(f"--output-len {a.output_len}: must be >= 1")
    return BenchOptions(models=a.models, out=a.out, output_len=a.output_len, port=a.port,
                        deadline=Deadline(time.time() + a.deadline), **tuning_options(a))


def load_state(path: Path | None, opts: BenchOptions) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    """`--state FILE`'s state, and the function that writes it after every unit. A state measured
    with other options is refused: its windows would be mixed with these."""
    key = json.dumps({k: v for k, v in vars(opts).items() if k not in ("deadline", "out", "port", "health_timeout")},
                     default=str, sort_keys=True)
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
