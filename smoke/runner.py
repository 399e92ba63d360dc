"""The smoke runner: plain reference outputs, then EAGLE-3 servers with the dynamic speculation
disable threshold, or with a draft depth per load (a depth schedule), checked from the outside (log
line, outputs, server-info counters, accept length, KV pool, errors).

    python -m smoke run --models DIR --out DIR [--threshold N | --schedule SPEC]
                        [--variants overlap,sync] [--parallel-variants] [--ramp-minutes M] ...

A threshold N: loads below, at and above N, a ramp across it, aborts in both modes. A schedule
(`--schedule 1-8:3,9-24:2,25-64:1,65-:0`, the servers' --speculative-depth-schedule; N is the
schedule 1-N:K,N+1-:0): loads below, at and above every edge, a ramp through every tier, aborts in
the last tier and the first; every depth must run, its changes stay bounded (smoke.tiers derives
the loads from the edges). `--ramp-minutes M`: then an endurance ramp through the tiers for M
minutes, the servers' memory read before and after (smoke.endurance).

Every check is a function of smoke.checks that raises SmokeError(cause); `run_smoke` collects the
failures of every server variant (one GPU call should tell as much as it can), prints a short
report, writes report.json, and exits non-zero with each cause and the tail of the server log that
goes with it.
"""
from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_image_plugin.setting import AUTO, MODE_CHANGE_LOG_PREFIX, DepthSchedule, parse_threshold
from smoke import client, endurance
from smoke.checks import (
    DEPTH_CHANGE_LOG_PREFIX,
    accept_stats,
    check_aborted,
    check_accept_recovers,
    check_delta,
    check_depth,
    check_depth_changes,
    check_depths_of_load,
    check_depths_ran,
    check_hf_reference,
    check_kv_back,
    check_log_clean,
    check_mode,
    check_no_errors,
    check_only_depth,
    check_outputs,
    check_schedule_state,
    check_start_log,
    check_switched,
    check_threshold_state,
    depth_steps,
    draft_plain_step,
    spec_deltas,
    spec_state,
    wait_idle,
)
from smoke.client import Prompt, Result
from smoke.deadline import Deadline
from smoke.prompts import make_prompts, make_schedule_prompts, unique_prompts
from smoke.server import Server, ServerConfig, SmokeError, log_tail
from smoke.tiers import SCHEDULE_FLAG, Tiers, parse_smoke_schedule

# The smoke's threshold: small, so that the tiny model's load crosses it both ways in seconds. Every
# smoke entry point (here, e2e, `nox -s smoke`) takes its default from this one name.
DEFAULT_THRESHOLD = 4
REQUEST_TIMEOUT_S = 180  # a tiny-model request takes seconds; a hang must not outlive the deadline
# The plain reference server runs eager (no CUDA graphs: nothing to capture before it serves), so
# its step is launch-bound and costs about the same at 1 or 64 requests: at 8 at a time the 1B
# models' references took over 8 minutes. The models' designed top-1 margins keep greedy outputs
# independent of the batch they run in, so the references may run many at a time.
REFERENCE_CONCURRENCY = 64


# ----------------------------------------------------------------------------- scenario
@dataclass
class Variant:
    name: str
    overlap: bool
    cuda_graph: bool


VARIANTS = {"overlap": Variant("eagle_overlap", True, True),
            "sync": Variant("eagle_sync", False, False)}


@dataclass
class SmokeOptions:
    models: Path
    out: Path
    threshold: int = DEFAULT_THRESHOLD  # shapes the loads (N, 8N); the server's too unless auto
    auto: bool = False  # the EAGLE-3 servers run the threshold `auto`
    # the EAGLE-3 servers run this depth schedule instead of a threshold; the loads come from its
    # edges (then `threshold` is its top edge)
    schedule: DepthSchedule | None = None
    ramp_minutes: float = 0.0  # the endurance ramp after the loads (0: none)
    ramp_hold_s: float = endurance.DEFAULT_HOLD_S
    ramp_max_growth_mib: float = endurance.DEFAULT_MAX_GROWTH_MIB
    variants: tuple[str, ...] = ("overlap", "sync")
    port: int = 30000
    mem_fraction: float = 0.15
    deadline: Deadline = field(default_factory=lambda: Deadline(time.time() + 3600))
    health_timeout: float = 480
    min_server_s: float = 150  # do not start a server with less time than this left
    cuda_graph: bool = True
    # the variants' servers side by side, each on its own port: opt-in, as it needs a GPU with
    # memory for two servers (mem_fraction each)
    parallel_variants: bool = False

    def request_timeout(self) -> float:
        return self.deadline.request_timeout(REQUEST_TIMEOUT_S)


def record_references(opts: SmokeOptions, expected: dict[str, Any], prompts: list[Prompt],
                      state: dict[str, Any]) -> dict[str, list[int]]:
    cfg = ServerConfig("plain", opts.models / "target", cuda_graph=False,
                       mem_fraction=opts.mem_fraction, enable_metrics=False)
    log = opts.out / "server_plain.log"
    with Server(cfg, opts.port, log) as srv:
        srv.start(min(opts.health_timeout, opts.deadline.left() - 60))
        state["plain_start_s"] = round(srv.start_seconds, 1)
        res = client.run_concurrent(srv.base, prompts, REFERENCE_CONCURRENCY, opts.request_timeout())
        try:
            check_no_errors(res, "plain reference")
        except SmokeError as exc:
            exc.log = log
            raise
        refs = {r.key: r.output_ids for r in res if r.output_ids is not None}
        try:
            check_log_clean(srv.log_text())
        except SmokeError as exc:
            exc.log = log
            raise
        try:  # a failure, but the EAGLE-3 servers are still compared with this server's outputs
            check_hf_reference(expected, refs.get("hf"))
        except SmokeError as exc:
            state["hf_mismatch"] = exc.cause
    return refs


def record_error(rep: dict[str, Any], exc: BaseException, log: Path) -> None:
    """A variant's failure in its report, with the cause and its server log: a check's own, an
    HTTP failure, or an unexpected answer (with its traceback). Interrupts propagate."""
    if isinstance(exc, SmokeError):
        record_failure(rep, exc, log)
    elif isinstance(exc, client.HTTPFailure):
        record_failure(rep, SmokeError(f"HTTP failure talking to the server: {exc}"), log)
    elif isinstance(exc, Exception):
        import traceback

        record_failure(rep, SmokeError(f"runner error: {type(exc).__name__}: {exc}\n"
                                       f"{traceback.format_exc()[-1200:]}"), log)
    else:
        raise exc


def log_suffix(threshold: int | str | None, schedule: DepthSchedule | None) -> str:
    """What a variant's server log is named after its setting: auto and a schedule get their own."""
    return "_auto" if threshold == AUTO else "_schedule" if schedule is not None else ""


def variant_server(opts: SmokeOptions, v: Variant, draft: Path, threshold: int | str | None, *,
                   reach: int, port: int | None,
                   schedule: DepthSchedule | None = None) -> tuple[Server, Path, dict[str, Any]]:
    """The EAGLE-3 server of variant `v` with `threshold` or `schedule` (on `port`, default
    opts.port), its decode graphs and running requests up to `reach` (64 at least); its log and
    its report."""
    cfg = ServerConfig(v.name, opts.models / "target", draft=draft, threshold=threshold,
                       schedule=None if schedule is None else str(schedule),
                       overlap=v.overlap, cuda_graph=v.cuda_graph and opts.cuda_graph,
                       cuda_graph_max_bs=max(64, reach), max_running=max(64, reach),
                       mem_fraction=opts.mem_fraction)
    # leaks: sglang logs "memory leak detected" at idle; check_log_clean fails on it
    log = opts.out / f"server_{v.name}{log_suffix(threshold, schedule)}.log"
    setting: dict[str, Any] = {"threshold": threshold} if schedule is None else {"schedule": str(schedule)}
    rep: dict[str, Any] = {"name": v.name, "overlap": v.overlap, "cuda_graph": cfg.cuda_graph,
                           **setting, "phases": {}}
    return Server(cfg, opts.port if port is None else port, log), log, rep


def start_variant_server(srv: Server, opts: SmokeOptions, rep: dict[str, Any]) -> str:
    """Starts it within the deadline (a minute left for the checks); its base URL."""
    srv.start(min(opts.health_timeout, opts.deadline.left() - 60))
    rep["start_s"] = round(srv.start_seconds, 1)
    return srv.base


def run_variant(opts: SmokeOptions, v: Variant, draft: Path, sets: dict[str, list[Prompt]],
                refs: dict[str, list[int]], port: int | None = None) -> dict[str, Any]:
    """One EAGLE-3 server with the threshold (on `port`, default opts.port): every check, in order.
    Returns the variant's report."""
    n = opts.threshold
    srv, log, rep = variant_server(opts, v, draft, n, reach=4 * n, port=port)
    try:
        base = start_variant_server(srv, opts, rep)
        start_log = srv.log_text()
        check_start_log(start_log, n)
        st0 = spec_state(client.server_info(base))
        rep["draft_plain_step"] = draft_plain_step(st0, start_log)
        check_threshold_state(st0, n)
        check_mode(st0, "speculative", "after start")
        baseline = wait_idle(base, client.load(base))
        rep["kv_baseline"] = {k: baseline.get(k) for k in ("num_used_tokens", "max_total_num_tokens")}
        m0 = client.metrics(base)
        rep["kv_available_tokens_start"] = client.metric(m0, "sglang:kv_available_tokens")
        all_results: list[Result] = []

        def phase(name: str, results: list[Result], st_before: dict[str, Any]) -> dict[str, Any]:
            all_results.extend(results)
            check_no_errors(results, name)
            check_outputs(refs, results, name)
            st = spec_state(client.server_info(base))
            rep["phases"][name] = {"requests": len(results), **accept_stats(results),
                                   **spec_deltas(st, st_before)}
            return st

        # 1) below the threshold, one at a time: speculative only
        st1 = phase("below", client.run_concurrent(base, sets["below"], 1, opts.request_timeout()), st0)
        check_delta(st0, st1, "speculative_steps", "below", positive=True)
        check_delta(st0, st1, "plain_steps", "below", positive=False)
        # 2) exactly N at once (the boundary; outputs only)
        st2 = phase("at", client.run_concurrent(base, sets["at"], n, opts.request_timeout()), st1)
        # 3) 8N at once (32 with N=4): speculation must turn off
        st3 = phase("above", client.run_concurrent(base, sets["above"], 8 * n, opts.request_timeout()), st2)
        check_delta(st2, st3, "plain_steps", "above", positive=True)
        wait_idle(base, baseline)
        # 4) below again: speculation back on, accept length as before
        st4 = phase("after", client.run_concurrent(base, sets["after"], 1, opts.request_timeout()), st3)
        check_delta(st3, st4, "speculative_steps", "after", positive=True)
        # the first step below the threshold after a plain phase may be one catch-up plain step
        # (the plain steps wrote only the draft's K/V; that step computes its next proposal)
        check_delta(st3, st4, "plain_steps", "after", positive=False, at_most=1)
        check_mode(st4, "speculative", "after")
        check_accept_recovers(rep["phases"]["below"], rep["phases"]["after"])
        # 5) ramp: long requests keep running while bursts of 4N come and go (switches mid-request)
        longs = client.in_background(lambda: client.run_concurrent(base, sets["ramp_long"], 2, opts.request_timeout()))
        ramp: list[Result] = []
        for i in range(3):
            time.sleep(0.3)
            ramp += client.run_concurrent(base, sets[f"ramp_burst{i}"], 4 * n, opts.request_timeout())
        ramp += longs.result()
        st5 = phase("ramp", ramp, st4)
        if st5["mode_changes"] - st4["mode_changes"] < 2:
            raise SmokeError(f"ramp: only {st5['mode_changes'] - st4['mode_changes']} mode change(s) "
                               f"while the load crossed the threshold 6 times ({st5})")
        check_switched(st5, "end of load")
        # 6) aborts mid-generation, in plain mode and in speculative mode; the pool must still empty
        st6 = abort_phase(base, sets, refs, rep, opts, st5, baseline)
        check_delta(st5, st6, "plain_steps", "abort", positive=True)
        # the endurance ramp across the threshold, where asked (--ramp-minutes)
        endurance_phase(opts, srv, base, baseline, Tiers.of_threshold(n), sets, refs, rep)
        # 7) the load is over: pool back to its initial state, no error in the log, metrics exported
        final = wait_idle(base, baseline)
        rep["kv_final"] = {k: final.get(k) for k in ("num_used_tokens", "max_total_num_tokens")}
        check_kv_back(baseline, final)
        client.get_text(base + "/flush_cache")
        after_flush = wait_idle(base, baseline)
        check_kv_back(baseline, after_flush)
        m1 = client.metrics(base)
        rep["metrics"] = {k: client.metric(m1, k) for k in (
            "sglang:spec_disable_plain_mode", "sglang:spec_disable_speculative_steps_total",
            "sglang:spec_disable_plain_steps_total", "sglang:kv_available_tokens",
            "sglang:kv_used_tokens")}
        for k in ("sglang:spec_disable_plain_mode", "sglang:spec_disable_speculative_steps_total",
                  "sglang:spec_disable_plain_steps_total"):
            if rep["metrics"][k] is None:
                raise SmokeError(f"Prometheus metric {k} missing from /metrics (--enable-metrics is on)")
        if not srv.alive():
            raise SmokeError("server process died during the test")
        text = srv.log_text()
        check_log_clean(text)
        rep["mode_change_log_lines"] = sum(1 for line in text.splitlines() if MODE_CHANGE_LOG_PREFIX in line)
        info = client.server_info(base)
        rep["avg_spec_accept_length"] = (info.get("internal_states") or [{}])[0].get("avg_spec_accept_length")
        rep["spec_disable_final"] = spec_state(info)
        rep["errors"] = sum(1 for r in all_results if r.error)
        rep["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - every failure is reported with its log
        record_error(rep, exc, log)
    finally:
        srv.stop()
    return rep


def run_schedule_variant(opts: SmokeOptions, v: Variant, draft: Path, sets: dict[str, list[Prompt]],
                         refs: dict[str, list[int]], port: int | None = None) -> dict[str, Any]:
    """One EAGLE-3 server with the depth schedule (on `port`, default opts.port): its start line and
    server-info state; one request at a time; loads below, at and above every edge, each from the
    first tier, each running at the depth of its size and at none of a larger batch; 8x the top
    edge at once; one at a time again (the accept length back); a ramp through every tier beside
    long requests; aborts in the last tier and alone in the first; the endurance ramp where asked.
    Every output equal to plain, every depth run, the depth changes bounded, the KV pool back at
    its start, the metrics and the log lines there. Returns the variant's report."""
    schedule = opts.schedule
    assert schedule is not None
    tiers = Tiers(schedule)
    first, last = tiers.depths[0], tiers.depths[-1]
    bursts = tiers.ramp_bursts()
    srv, log, rep = variant_server(opts, v, draft, None, schedule=schedule, port=port,
                                   reach=max(bursts))
    try:
        base = start_variant_server(srv, opts, rep)
        start_log = srv.log_text()
        check_start_log(start_log, 0, schedule)
        st0 = spec_state(client.server_info(base))
        rep["draft_plain_step"] = draft_plain_step(st0, start_log)
        check_schedule_state(st0, schedule)
        check_depth(st0, first, "after start")
        baseline = wait_idle(base, client.load(base))
        rep["kv_baseline"] = {k: baseline.get(k) for k in ("num_used_tokens", "max_total_num_tokens")}
        all_results: list[Result] = []
        timeout = opts.request_timeout

        def phase(name: str, size: int, st_before: dict[str, Any]) -> dict[str, Any]:
            """The prompts of set `name`, `size` at a time; checked against plain and recorded."""
            results = client.run_concurrent(base, sets[name], size, timeout())
            all_results.extend(results)
            check_no_errors(results, name)
            check_outputs(refs, results, name)
            st = spec_state(client.server_info(base))
            rep["phases"][name] = {"requests": len(results), "concurrency": size,
                                   **accept_stats(results), **spec_deltas(st, st_before)}
            return st

        # 1) one at a time: the first tier only
        st = phase("below", 1, st0)
        check_only_depth(st0, st, first, "below")
        # 2) below, at and above every edge, each load at once; its last request alone brings the
        # server back to the first tier; then 8x the top edge
        waves = 0
        for name, size in [*tiers.edge_loads(), ("above", tiers.above)]:
            wait_idle(base, baseline)
            before, st = st, phase(name, size, st)
            check_depths_of_load(before, st, tiers.depth_at(size), name)
            waves += 1
        wait_idle(base, baseline)
        # 3) one at a time again: the first tier, its accept length as before the loads
        before, st = st, phase("after", 1, st)
        # the first step after plain steps may be a catch-up step, counted where its batch is
        check_only_depth(before, st, first, "after", at_most=1)
        check_depth(st, first, "after")
        check_accept_recovers(rep["phases"]["below"], rep["phases"]["after"])
        # 4) ramp: long requests run while bursts take the batch through every tier and back
        before = st
        longs = client.in_background(lambda: client.run_concurrent(base, sets["ramp_long"], 2, timeout()))
        ramp: list[Result] = []
        for i, size in enumerate(bursts):
            time.sleep(0.3)
            ramp += client.run_concurrent(base, sets[f"ramp_burst{i}"], size, timeout())
        ramp += longs.result()
        all_results.extend(ramp)
        check_no_errors(ramp, "ramp")
        check_outputs(refs, ramp, "ramp")
        st = spec_state(client.server_info(base))
        rep["phases"]["ramp"] = {"requests": len(ramp), "bursts": bursts, **accept_stats(ramp),
                                 **spec_deltas(st, before)}
        check_depths_ran(st, sorted({tiers.depth_at(b) for b in bursts}), "ramp", before)
        waves += len(bursts) + 1
        check_depth_changes(before, st, "ramp", at_least=2, at_most=tiers.changes_bound(len(bursts) + 1))
        # 5) aborts mid-generation, in the last tier and alone in the first; the pool must empty
        before = st
        st = abort_phase(base, sets, refs, rep, opts, before, baseline,
                         where=(f"depth {last}", f"depth {first}"))
        if depth_steps(st)[last] <= depth_steps(before)[last]:
            raise SmokeError(f"abort: no step at depth {last} while {tiers.above} requests ran ({st})")
        waves += 3
        # every depth of the schedule ran; the depth changed, and not more often than the loads
        # can make it
        check_depths_ran(st, schedule.depths, "end of load", st0)
        rep["depth_changes"] = {"count": check_depth_changes(st0, st, "end of load", at_least=2,
                                                             at_most=tiers.changes_bound(waves)),
                                "bound": tiers.changes_bound(waves)}
        # the endurance ramp through the tiers, where asked (--ramp-minutes)
        endurance_phase(opts, srv, base, baseline, tiers, sets, refs, rep)
        # 6) the load is over: pool back to its initial state, no error in the log, metrics there
        final = wait_idle(base, baseline)
        rep["kv_final"] = {k: final.get(k) for k in ("num_used_tokens", "max_total_num_tokens")}
        check_kv_back(baseline, final)
        client.get_text(base + "/flush_cache")
        check_kv_back(baseline, wait_idle(base, baseline))
        m1 = client.metrics(base)
        names = ("sglang:spec_disable_depth", "sglang:spec_disable_plain_mode",
                 "sglang:spec_disable_speculative_steps_total", "sglang:spec_disable_plain_steps_total")
        rep["metrics"] = {k: client.metric(m1, k) for k in (*names, "sglang:kv_used_tokens")}
        for k in names:
            if rep["metrics"][k] is None:
                raise SmokeError(f"Prometheus metric {k} missing from /metrics (--enable-metrics is on)")
        if not srv.alive():
            raise SmokeError("server process died during the test")
        text = srv.log_text()
        check_log_clean(text)
        rep["depth_change_log_lines"] = sum(1 for line in text.splitlines()
                                            if DEPTH_CHANGE_LOG_PREFIX in line)
        if rep["depth_change_log_lines"] == 0:
            raise SmokeError(f"no {DEPTH_CHANGE_LOG_PREFIX!r} line in the server log after "
                             f"{rep['depth_changes']['count']} depth changes")
        info = client.server_info(base)
        rep["avg_spec_accept_length"] = (info.get("internal_states") or [{}])[0].get("avg_spec_accept_length")
        rep["spec_disable_final"] = spec_state(info)
        rep["errors"] = sum(1 for r in all_results if r.error)
        rep["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - every failure is reported with its log
        record_error(rep, exc, log)
    finally:
        srv.stop()
    return rep


def endurance_phase(opts: SmokeOptions, srv: Server, base: str, baseline: dict[str, Any], tiers: Tiers,
                    sets: dict[str, list[Prompt]], refs: dict[str, list[int]], rep: dict[str, Any]) -> None:
    """--ramp-minutes M (nothing at 0): the endurance ramp (smoke.endurance.phase) through every
    tier and back, on the prompts of the short sets (they have plain references)."""
    if opts.ramp_minutes <= 0:
        return
    assert srv.pgid is not None
    prompts = [p for p in unique_prompts(sets) if p.max_new_tokens <= 64 and p.key in refs]
    endurance.phase(base, baseline, srv.pgid, tiers.endurance_levels(), prompts, refs, rep,
                    minutes=opts.ramp_minutes, hold_s=opts.ramp_hold_s,
                    max_growth_mib=opts.ramp_max_growth_mib, deadline=opts.deadline,
                    timeout=opts.request_timeout(), counter="depth_changes" if opts.schedule is not None else "mode_changes")


def run_auto_variant(opts: SmokeOptions, v: Variant, draft: Path, sets: dict[str, list[Prompt]],
                     refs: dict[str, list[int]], port: int | None = None) -> dict[str, Any]:
    """One EAGLE-3 server with `auto`: what holds whatever crossover it learns. The start line,
    the crossover in the server info and in /metrics, outputs equal to plain decoding below, far
    above and across any crossover (1, 8N at once, bursts of 4N beside long requests), no errors,
    the KV pool back to its idle size, a clean log."""
    n = opts.threshold
    srv, log, rep = variant_server(opts, v, draft, AUTO, reach=8 * n, port=port)
    try:
        base = start_variant_server(srv, opts, rep)
        check_start_log(srv.log_text(), AUTO)
        st0 = spec_state(client.server_info(base))
        if "crossover" not in st0:
            raise SmokeError(f"server info of an auto server has no crossover: {st0}")
        baseline = wait_idle(base, client.load(base))
        rep["kv_baseline"] = {k: baseline.get(k) for k in ("num_used_tokens", "max_total_num_tokens")}
        results: list[Result] = []
        for name, conc in (("below", 1), ("above", 8 * n), ("after", 1)):
            got = client.run_concurrent(base, sets[name], conc, opts.request_timeout())
            check_no_errors(got, name)
            check_outputs(refs, got, name)
            results += got
            rep["phases"][name] = {"requests": len(got), **accept_stats(got)}
        longs = client.in_background(
            lambda: client.run_concurrent(base, sets["ramp_long"], 2, opts.request_timeout()))
        ramp: list[Result] = []
        for i in range(3):
            time.sleep(0.3)
            ramp += client.run_concurrent(base, sets[f"ramp_burst{i}"], 4 * n, opts.request_timeout())
        ramp += longs.result()
        check_no_errors(ramp, "ramp")
        check_outputs(refs, ramp, "ramp")
        results += ramp
        final = wait_idle(base, baseline)
        rep["kv_final"] = {k: final.get(k) for k in ("num_used_tokens", "max_total_num_tokens")}
        check_kv_back(baseline, final)
        metrics = client.metrics(base)
        rep["metrics"] = {k: client.metric(metrics, k) for k in (
            "sglang:spec_disable_crossover", "sglang:spec_disable_speculative_steps_total",
            "sglang:spec_disable_plain_steps_total")}
        if rep["metrics"]["sglang:spec_disable_crossover"] is None:
            raise SmokeError("Prometheus metric sglang:spec_disable_crossover missing (auto)")
        if not srv.alive():
            raise SmokeError("server process died during the test")
        text = srv.log_text()
        check_log_clean(text)
        rep["mode_change_log_lines"] = sum(1 for line in text.splitlines() if MODE_CHANGE_LOG_PREFIX in line)
        rep["spec_disable_final"] = spec_state(client.server_info(base))
        rep["errors"] = sum(1 for r in results if r.error)
        rep["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - every failure is reported with its log
        record_error(rep, exc, log)
    finally:
        srv.stop()
    return rep


def abort_phase(base: str, sets: dict[str, list[Prompt]], refs: dict[str, list[int]], rep: dict[str, Any],
                opts: SmokeOptions, st_before: dict[str, Any], baseline: dict[str, Any],
                where: tuple[str, str] = ("plain mode", "speculative mode")) -> dict[str, Any]:
    """Many long requests (the last tier, `where[0]`), every other one aborted mid-generation;
    then one alone (the first tier, `where[1]`) aborted, and short ones after it."""
    tag = f"{int(time.time() * 1000)}"  # rids unique across calls on the same server

    def start(ps: list[Prompt]) -> list[Any]:
        return [client.in_background(functools.partial(client.generate, base, p, opts.request_timeout(),
                                                       rid=f"smoke-{tag}-{p.key}")) for p in ps]

    plain_set, spec_set = sets["abort_plain"], sets["abort_spec"]
    futs = start(plain_set)
    time.sleep(0.5)  # the batch is above the threshold by now: plain steps
    aborted = {p.key for p in plain_set[::2]}
    for key in sorted(aborted):
        client.abort(base, f"smoke-{tag}-{key}")
    results = [f.result() for f in futs]
    counts = check_aborted(refs, results, aborted, f"abort ({where[0]})")
    wait_idle(base, baseline)  # aborted requests leave the batch before the next load starts
    spec_fut = start(spec_set)
    time.sleep(0.5)  # alone: speculative steps
    client.abort(base, f"smoke-{tag}-{spec_set[0].key}")
    spec_res = [f.result() for f in spec_fut]
    spec_counts = check_aborted(refs, spec_res, {spec_set[0].key}, f"abort ({where[1]})")
    after = client.run_concurrent(base, sets["abort_after"], 1, opts.request_timeout())
    check_no_errors(after, "after the aborts")
    check_outputs(refs, after, "after the aborts")
    st = spec_state(client.server_info(base))
    rep["phases"]["abort"] = {"requests": len(results) + len(spec_res) + len(after),
                              "plain_mode": counts, "speculative_mode": spec_counts,
                              **accept_stats(after), **spec_deltas(st, st_before)}
    if counts["aborted_cut_short"] == 0:
        raise SmokeError(f"abort: none of the {len(aborted)} aborted requests was cut short (aborts "
                           "arrived after they finished: the phase proved nothing)")
    return st


def record_failure(rep: dict[str, Any], exc: SmokeError, log: Path) -> dict[str, Any]:
    """A variant's report after a failed check: the cause and the tail of its server log."""
    exc.log = exc.log or log
    rep["ok"] = False
    rep["cause"] = exc.cause
    rep["log_tail"] = log_tail(exc.log, 40)
    return rep


def collect_failures(report: dict[str, Any]) -> dict[str, Any]:
    for name, rep in report["variants"].items():
        if not rep.get("ok"):
            report["failures"].append({"variant": name, "cause": rep.get("cause"),
                                       "log_tail": rep.get("log_tail")})
    return report


def exit_code(report: dict[str, Any]) -> int:
    return 1 if report.get("failures") or report.get("skipped") else 0


def side_port(base: int, variants: Sequence[str], key: str) -> int:
    """The port of variant `key`'s server when the variants run side by side: base + 1 + its place
    in `variants`, so no two of them and not the plain server (base) share one."""
    return base + 1 + list(variants).index(key)


def side_by_side(jobs: dict[str, Callable[[], dict[str, Any]]],
                 on_error: Callable[[str, Exception], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Runs every job in a thread of its own and returns each one's report once all have ended; a
    job that raised gets on_error's report (called in this thread, in its except block), so one
    variant's crash neither loses the others' results nor passes silently."""
    if not jobs:
        return {}
    with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="variant") as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
    reports: dict[str, dict[str, Any]] = {}
    for key, fut in futures.items():
        try:
            reports[key] = fut.result()
        except Exception as exc:  # noqa: BLE001 - a failure row for this variant, not a crash
            reports[key] = on_error(key, exc)
    return reports


def run_smoke(opts: SmokeOptions, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """refs (plain server) -> each EAGLE-3 variant. `state` (a dict kept between device calls) lets a
    later call skip what an earlier one finished."""
    state = state if state is not None else {}
    opts.out.mkdir(parents=True, exist_ok=True)
    expected = json.loads((opts.models / "expected.json").read_text())
    if opts.schedule is not None:
        sets = make_schedule_prompts(expected, opts.schedule)
        setting: dict[str, Any] = {"schedule": str(opts.schedule)}
    else:
        sets = make_prompts(expected, opts.threshold)
        setting = {"threshold": AUTO if opts.auto else opts.threshold}
    report: dict[str, Any] = {**setting,
                              "models": str(opts.models),
                              "designed_accept_length": expected.get("designed_accept_length"),
                              "variants": {}, "failures": []}
    refs = state.get("refs")
    if refs is None:
        if opts.deadline.left() < opts.min_server_s:
            report["skipped"] = ["plain (deadline)"] + [VARIANTS[v].name for v in opts.variants]
            return report
        try:
            refs = record_references(opts, expected, unique_prompts(sets), state)
        except (SmokeError, client.HTTPFailure) as exc:
            f = exc if isinstance(exc, SmokeError) else SmokeError(str(exc))
            f.log = f.log or opts.out / "server_plain.log"
            report["failures"].append({"variant": "plain", "cause": f.cause, "log_tail": log_tail(f.log)})
            return report
        state["refs"] = refs
    if state.get("hf_mismatch"):
        report["failures"].append({"variant": "plain", "cause": state["hf_mismatch"],
                                   "log_tail": "(plain server: see server_plain.log)"})
    done = state.setdefault("variants", {})
    if opts.parallel_variants:
        return collect_failures(run_side_by_side(opts, sets, refs, done, report))
    for key in opts.variants:
        v = VARIANTS[key]
        if v.name in done:
            report["variants"][v.name] = done[v.name]
            continue
        if opts.deadline.left() < opts.min_server_s:
            report.setdefault("skipped", []).append(f"{v.name} (deadline)")
            continue
        rep = variant_runner(opts)(opts, v, opts.models / "draft", sets, refs)
        report["variants"][v.name] = rep
        if rep.get("ok"):
            done[v.name] = rep
    return collect_failures(report)


VariantRun = Callable[..., dict[str, Any]]


def variant_runner(opts: SmokeOptions) -> VariantRun:
    """What checks one variant's server: a schedule's, auto's or a fixed threshold's checks."""
    if opts.schedule is not None:
        return run_schedule_variant
    return run_auto_variant if opts.auto else run_variant


def run_side_by_side(opts: SmokeOptions, sets: dict[str, list[Prompt]], refs: dict[str, list[int]],
                     done: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """run_smoke's variants at once, each server on its own port (side_port): the same skips, the
    same reports in the order of opts.variants, `done` (the resume state) written here only."""
    run = variant_runner(opts)
    jobs: dict[str, Callable[[], dict[str, Any]]] = {}
    for key in opts.variants:
        v = VARIANTS[key]
        if v.name in done or v.name in jobs:
            continue
        if opts.deadline.left() < opts.min_server_s:
            report.setdefault("skipped", []).append(f"{v.name} (deadline)")
            continue
        jobs[v.name] = functools.partial(run, opts, v, opts.models / "draft", sets, refs,
                                         port=side_port(opts.port, opts.variants, key))

    def crashed(name: str, exc: Exception) -> dict[str, Any]:
        v = next(v for v in VARIANTS.values() if v.name == name)
        threshold = AUTO if opts.auto else opts.threshold
        setting = {"threshold": threshold} if opts.schedule is None else {"schedule": str(opts.schedule)}
        rep: dict[str, Any] = {"name": name, "overlap": v.overlap,
                               "cuda_graph": v.cuda_graph and opts.cuda_graph, **setting, "phases": {}}
        record_error(rep, exc, opts.out / f"server_{name}{log_suffix(threshold, opts.schedule)}.log")
        return rep

    reports = side_by_side(jobs, crashed)
    for key in opts.variants:
        name = VARIANTS[key].name
        if name in done:
            report["variants"][name] = done[name]
        elif name in reports:
            report["variants"][name] = reports[name]
            if reports[name].get("ok"):
                done[name] = reports[name]
    return report


def summarize(report: dict[str, Any]) -> str:
    setting = (f"schedule={report['schedule']}" if report.get("schedule")
               else f"threshold={report.get('threshold')}")
    lines = [f"smoke: {setting} designed accept length {report.get('designed_accept_length')}"]
    for name, rep in report.get("variants", {}).items():
        status = "PASS" if rep.get("ok") else "FAIL"
        lines.append(f"  {name:14s} {status}  start {rep.get('start_s')}s  overlap={rep.get('overlap')} "
                     f"cuda_graph={rep.get('cuda_graph')}  draft in plain steps: {rep.get('draft_plain_step')}")
        for ph, d in rep.get("phases", {}).items():
            al = d.get("accept_length")
            line = (f"    {ph:6s} reqs {d['requests']:3d}  accept_len "
                    f"{'-' if al is None else f'{al:.2f}'}")
            if "d_speculative_steps" in d:  # a fixed N; an auto server's phases count no steps
                line += (f"  d_spec {d['d_speculative_steps']:5d}  d_plain {d['d_plain_steps']:5d}  "
                         f"d_changes {d['d_mode_changes']}")
            if "d_steps_by_depth" in d:  # a depth schedule's: the steps per depth, the changes
                line += f"  d_steps_by_depth {d['d_steps_by_depth']}  d_depth_changes {d['d_depth_changes']}"
            if "plain_mode" in d:
                line += (f"  cut short {d['plain_mode']['aborted_cut_short']}/"
                         f"{d['plain_mode']['aborted_sent']} (plain) "
                         f"{d['speculative_mode']['aborted_cut_short']}/1 (spec)")
            lines.append(line)
        if rep.get("depth_changes"):
            lines.append(f"    depth changes {rep['depth_changes']['count']} (at most "
                         f"{rep['depth_changes']['bound']} for its loads)")
        if rep.get("endurance"):
            lines.append(f"    {endurance.summary_line(rep['endurance'])}")
        if rep.get("spec_disable_final"):
            lines.append(f"    final {rep['spec_disable_final']}  kv {rep.get('kv_baseline')} -> "
                         f"{rep.get('kv_final')}")
    for s in report.get("skipped", []):
        lines.append(f"  SKIPPED {s}")
    for f in report.get("failures", []):
        lines.append(f"SMOKE FAILED [{f['variant']}]: {f['cause']}\n--- server log tail ---\n"
                     f"{f.get('log_tail')}")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", type=Path, required=True, help="dir from `python -m smoke models`")
    ap.add_argument("--out", type=Path, required=True, help="logs and report.json go here")
    ap.add_argument("--threshold", default=str(DEFAULT_THRESHOLD), action=Given,
                    help=f"the servers' threshold N >= 1 (default {DEFAULT_THRESHOLD}), or `auto`: "
                         "the server finds its crossover; the loads are then shaped for "
                         f"N={DEFAULT_THRESHOLD} and the checks are those that hold for any crossover")
    ap.add_argument(SCHEDULE_FLAG, metavar="LOW-HIGH:DEPTH,...",
                    help="instead of --threshold: the servers' draft depth per load "
                         "(--speculative-depth-schedule), e.g. 1-8:3,9-24:2,25-64:1,65-:0; the loads "
                         "visit every tier and cross every edge both ways")
    add_endurance_arguments(ap)
    ap.add_argument("--variants", default="overlap,sync",
                    help="comma list of: overlap (CUDA graphs on), sync (--disable-overlap-schedule)")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--mem-fraction", type=float, default=0.15)
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--deadline", type=float, default=3600, help="seconds from now")
    ap.add_argument("--parallel-variants", action="store_true",
                    help="run the variants side by side, their servers on ports PORT+1, PORT+2, "
                         "...: they start one after the other, then their checks overlap; for a "
                         "GPU with memory for two servers")


def add_endurance_arguments(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """The endurance ramp's flags (`bench e2e` gives them as --smoke-ramp-*)."""
    p = "--" + prefix
    ap.add_argument(p + "ramp-minutes", type=float, default=0.0,
                    help="after the loads, a closed loop through every tier and back for this many "
                         "minutes, the servers' memory read before and after (0: none)")
    if not prefix:
        ap.add_argument("--ramp-hold", type=float, default=endurance.DEFAULT_HOLD_S,
                        help="the endurance ramp's seconds per level")
    ap.add_argument(p + "ramp-max-growth-mib", type=float, default=endurance.DEFAULT_MAX_GROWTH_MIB,
                    help="the endurance ramp fails where a server's host (VmRSS) or GPU memory grew "
                         "by more than this many MiB")


class Given(argparse.Action):
    """Stores the value and notes that the flag was given (`{dest}_given`): a flag whose default
    may not be combined with another one's value, where given (--threshold with --schedule)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def schedule_option(a: argparse.Namespace, flag: str = SCHEDULE_FLAG) -> DepthSchedule | None:
    """--schedule parsed (None where not given); SystemExit naming the flag for a bad one, or for
    one given with --threshold."""
    if a.schedule is None:
        return None
    if getattr(a, "threshold_given", False):
        raise SystemExit(f"{flag} and --threshold are both given: give one (a threshold N is the "
                         "schedule 1-N:K,N+1-:0)")
    try:
        return parse_smoke_schedule(a.schedule, flag)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def comma_list(text: str, known: Iterable[str], flag: str) -> tuple[str, ...]:
    """The names of a comma list option, each one of `known`; else exits naming the option."""
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    choices = list(known)
    unknown = [v for v in names if v not in choices]
    if unknown:
        raise SystemExit(f"{flag}: unknown {unknown}; choose from {','.join(choices)}")
    return names


def options(a: argparse.Namespace) -> SmokeOptions:
    variants = comma_list(a.variants, VARIANTS, "--variants")
    schedule = schedule_option(a)
    try:
        parsed = parse_threshold(a.threshold, source="--threshold", allow_zero=False)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    auto = parsed == AUTO and schedule is None
    threshold = Tiers(schedule).top if schedule else DEFAULT_THRESHOLD if auto else int(parsed)
    if a.ramp_minutes < 0 or a.ramp_hold <= 0 or a.ramp_max_growth_mib < 0:
        raise SystemExit(f"--ramp-minutes {a.ramp_minutes:g} --ramp-hold {a.ramp_hold:g} "
                         f"--ramp-max-growth-mib {a.ramp_max_growth_mib:g}: give minutes >= 0, a hold "
                         "> 0 and a bound >= 0")
    if a.ramp_minutes and auto:
        raise SystemExit("--ramp-minutes: the endurance ramp runs on a fixed threshold or a schedule, "
                         "not auto (its tiers move)")
    return SmokeOptions(models=a.models, out=a.out, threshold=threshold, auto=auto, schedule=schedule,
                        variants=variants, port=a.port, mem_fraction=a.mem_fraction,
                        cuda_graph=not a.no_cuda_graph, deadline=Deadline(time.time() + a.deadline),
                        parallel_variants=a.parallel_variants, ramp_minutes=a.ramp_minutes,
                        ramp_hold_s=a.ramp_hold, ramp_max_growth_mib=a.ramp_max_growth_mib)


def main(a: argparse.Namespace) -> int:
    opts = options(a)
    report = run_smoke(opts)
    (opts.out / "report.json").write_text(json.dumps(report, indent=1))
    print(summarize(report))
    return exit_code(report)
