"""Output tokens/s of plain decoding, always-on EAGLE-3, upstream's adaptive EAGLE-3, a fixed
speculation-disable threshold and `auto`, on servers started here (a GPU host, no Docker needed),
compared in paired windows with an A/A noise floor beside every comparison.

    python -m bench run --models DIR [--out out/bench] [--configs plain,plain_twin,eagle3,...]
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
  `eagle3_twin` is the same for always-on EAGLE-3, the better mode up to the crossover.
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
import importlib.metadata
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import diagnose, hostinfo, pairing, servers
from bench import report as bench_report
from bench.checks import (
    compared_outputs,
    digest,
    learned_schedule_of,
    mismatches,
    mode_of,
    over_max,
    server_checks,
    trial_of,
)
from bench.configs import from_result, output_reference
from bench.options import (
    BenchOptions,
    config_records,
    load_state,
    options,
    registry_of,
    server_names,
)
from bench.ramp import ramp_levels, run_ramp
from bench.window import WINDOW_END_S, flush_cache, host_counters, measure
from bench.workload import output_lengths, pool_tokens, window_prompt, workload
from sglang_image_plugin.setting import AUTO_TRACE_ENV, DEPTH_SCHEDULE_FLAG, THRESHOLD_FLAG
from smoke import client
from smoke.client import Prompt
from smoke.server import Server, ServerConfig, SmokeError, log_tail

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
TRIAL_CHUNK_S = 5.0  # the learning pass looks again whether a trial still runs this often
WARM_S = 15  # one server's warm-up (they warm up one after the other), budgeted until measured


# ----------------------------------------------------------------------------- what runs
def auto_supported() -> bool:
    """Whether this Python's sglang takes the threshold `auto` (the plugin
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
    cfg.env.update(opts.server_env)  # part of the server's key, as the record's own
    cfg.env.update(rec.env)  # e.g. eagle3_extend_verify's upstream switch, over --server-env's
    if rec.kind == "threshold":
        cfg.threshold = rec.threshold
    if rec.kind == "schedule" and rec.schedule is not None:
        extra += [DEPTH_SCHEDULE_FLAG, rec.schedule]
    if rec.kind == "auto":
        extra += [THRESHOLD_FLAG, "auto"]
    if rec.learns:
        # its step trace, to read offline why it chose what it chose (in the logs it brings back)
        cfg.env[AUTO_TRACE_ENV] = str((opts.out / f"{name}_steps.jsonl").resolve())
    if rec.kind == "adaptive":
        extra += ["--speculative-adaptive", "--speculative-adaptive-config", str(opts.out / "adaptive_config.json")]
    if opts.diagnose or opts.device_timer:
        cfg.env.update(diagnose.SERVER_ENV)
    cfg.extra = (*extra, *rec.args, *opts.server_args)  # --server-args last: a caller's flag wins
    return cfg


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


class PoolTooSmall(RuntimeError):
    """A server came up with less KV room than every server was given: its blocks would measure
    requests waiting for room, not decoding."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause  # the run's failure says it as it is (run_bench)


def short_pool_check(pools: dict[str, int], opts: BenchOptions) -> None:
    """Before any block: each server holds the pool it was given (0: not read, not judged).
    SGLang sizes a pool from the memory free when that server loads, so the last of several
    servers side by side gets what the others left, silently (a GPU run of 2026-12-07: three
    8B-shaped servers sized for 192 requests on 78 GiB, the third held 2,107 of 81,100 tokens,
    found only after its blocks)."""
    asked = opts.max_total_tokens or pool_tokens(opts)
    short = {name: tokens for name, tokens in pools.items() if 0 < tokens < asked}
    if short:
        held = ", ".join(f"{name} {tokens:,}" for name, tokens in short.items())
        raise PoolTooSmall(
            f"KV pool short of the {asked:,} tokens every server was given (--max-total-tokens): {held}; "
            f"the GPU's memory does not hold these {len(pools)} servers' weights and pools side by side: "
            "run fewer servers in one call (--configs), or a lower top --concurrency, or give every "
            "server a smaller pool (--max-total-tokens)")


WARM_OUTPUT_LEN = 32  # a warm-up request's mean output length (spread as the windows' are)
WARM_SEED = 1  # the warm-up's prompt stream: no window's (50, 100 + block, 7)


def warm_up(base: str, opts: BenchOptions, vocab: int) -> None:
    """Requests at every concurrency outside the measurement: lazy JIT and autotuning per batch
    shape, per mode and per draft depth. Two waves of prompts shaped like the windows' (their
    lengths, their output spread): the first wave's prefills run together, the second's one by one
    beside running decodes, as a window's refills do; a kernel first met there would otherwise
    compile inside a counted window (a GPU run of 2026-12-08: 1.38 s in one block)."""
    for c in opts.concurrency:
        prompts = workload(vocab, c, WARM_OUTPUT_LEN, WARM_SEED, 2 * c, opts.output_spread)
        client.run_concurrent(base, [replace(p, key=f"w{p.key}") for p in prompts], c,
                              opts.deadline.request_timeout(240))


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


def window_on(srv: Server, others: dict[str, Server], prompt_at: Callable[[int], Prompt], c: int,
              opts: BenchOptions, stop_at: float, probe: hostinfo.SpeedProbe | None) -> dict[str, Any] | None:
    """One server's window of a block (measure), with what the host did meanwhile: the host's
    figures, the server's scheduler counters and the CPUs' speed (the probe's work) over the counted
    span, and the CPU the other servers used while idle. None where the deadline cut it."""
    flush_cache(srv.base)
    idle = {n: s for n, s in others.items() if s.pgid is not None}
    cpu0 = {n: servers.group_cpu_seconds(s.pgid) for n, s in idle.items() if s.pgid is not None}
    t0, host0 = time.time(), hostinfo.sample()
    m = measure(srv.base, prompt_at, c, opts.settle_s, opts.window_s, opts.deadline.request_timeout(240),
                stop_at, diagnose.scrape, host_counters(srv.pgid))
    if m.pop("cut"):
        return None
    wall = max(time.time() - t0, 1e-6)
    m["host"] = hostinfo.during(host0, hostinfo.sample())
    span, counted = m.pop("span", None), m.pop("counters", None)
    if counted:
        m["scheduler"] = counted
    work = probe.work(*span) if probe is not None and span else None
    if work is not None:
        m["host"]["probe_work_s"] = work
    m["idle_cpu"] = {n: round((servers.group_cpu_seconds(s.pgid) - cpu0[n]) / wall, 3)
                     for n, s in idle.items() if s.pgid is not None and n in cpu0}
    return m


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
        if not config_records(self.opts)[name].learns or self.opts.auto_learn_s <= 0:
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
        short_pool_check(pools, self.opts)
        if len(set(pools.values())) > 1 and not any(f.startswith("unequal KV pools") for f in self.result["checks"]):
            self.result["checks"].append(f"unequal KV pools {pools}: lower --mem-share or set --max-total-tokens "
                                         "so that every server holds the same")
        # One at a time: a server that learns from its own step times (`auto`) would otherwise learn
        # them while the others share the GPU (four warming up side by side made its steps 4x slower).
        for name in [n for n in self.names if not self.pool.warmed(n)]:
            t0 = time.time()
            warm_up(self.servers[name].base, self.opts, self.vocab)
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
        # what it learned by each level: the threshold's `auto` a crossover, the schedule's a schedule
        learned_at = learned_schedule_of if config_records(opts)[name].kind == "schedule" else (
            lambda base: mode_of(base)[1])
        crossovers, trial_s = {}, {}
        for c in opts.concurrency:
            prompt_at = functools.partial(window_prompt, self.vocab, c, opts.output_len, 50, spread=opts.output_spread)

            def load(seconds: float, c: int = c, prompt_at: Any = prompt_at) -> dict[str, Any]:
                return measure(srv.base, prompt_at, c, 0.0, seconds, opts.deadline.request_timeout(240),
                               opts.deadline.at - self.reserve())

            m = load(opts.auto_learn_s)
            # a trial this level began runs on here, not in the blocks (whose traffic would pay for
            # its blocks in the worse mode: a GPU run of 2026-12-07), up to auto_trial_s more
            more = 0.0
            while not m.get("cut") and more < opts.auto_trial_s and trial_of(srv.base) is not None:
                chunk = min(TRIAL_CHUNK_S, opts.auto_trial_s - more)
                m = load(chunk)
                more += chunk
            if more:
                trial_s[str(c)] = more
            if m.get("cut"):
                break
            crossovers[str(c)] = learned_at(srv.base)
        self.result.setdefault("learned", {})[name] = {"seconds_per_level": opts.auto_learn_s,
                                                       "crossover_after": crossovers, "trial_s": trial_s}
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
        reasons: dict[str, dict[str, Any]] = {}
        order = pairing.block_order(self.names, k)
        for name in order:
            others = {n: s for n, s in self.servers.items() if n != name}
            m = window_on(self.servers[name], others, prompt_at, c, opts, opts.deadline.at - self.reserve(), self.probe)
            if m is None:
                return False
            outputs[name] = m.pop("outputs")
            prefixes[name] = m.pop("prefixes")
            reasons[name] = m.pop("abort_reasons")
            got[name] = m
        self.result["blocks"].setdefault(str(c), []).append({"block": k + 1, "order": order, "windows": got})
        reference = output_reference(config_records(opts)) or "plain"
        problems, details = compared_outputs(outputs, prefixes, f"block {k + 1} c={c}", reasons, reference)
        self.result["window_mismatches"] += problems + over_max(got, f"block {k + 1} c={c}")
        # what the aborted outputs that are not a prefix of plain's hold (a state of an older bench has none)
        self.result.setdefault("prefix_mismatches", []).extend(details)
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
        rates = [r for b in self.result["blocks"].get(str(c), []) if (r := pairing.rate(b, name)) is not None]
        n = diagnose.full_load_prompts(c, statistics.median(rates) if rates else None, self.opts.output_len)
        prompts = workload(self.vocab, c, self.opts.output_len, 7, n, self.opts.output_spread)
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
            "ramp": {}, "servers": {}, "diagnose": {}, "window_mismatches": [], "prefix_mismatches": [],
            "checks": [], "calls": 0,
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
        {n: digests[n] for n in names if n in digests}, "ramp", output_reference(from_result(result)) or "plain")
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
    # what every server got besides its record: set by every call, so that a state an older bench
    # began records them too (the state's key holds them, so they never change within a state)
    result["server_env"] = dict(opts.server_env)
    result["server_args"] = list(opts.server_args)
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
