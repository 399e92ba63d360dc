"""One EAGLE-3 server variant's run with a threshold: a fixed N (run_variant) or `auto`
(run_auto_variant), every check in order against one server; and what every variant's run shares
(smoke.schedule_run's too): its server and report (variant_server), each load's row in the report
and the progress (phase_done), the abort and endurance phases, a failure recorded in its report
with the cause and its server log, or the deadline's stop (record_error)."""
from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sglang_image_plugin.setting import AUTO, MODE_CHANGE_LOG_PREFIX, DepthSchedule
from smoke import client, endurance
from smoke.checks import (
    accept_stats,
    check_aborted,
    check_accept_recovers,
    check_delta,
    check_kv_back,
    check_log_clean,
    check_mode,
    check_no_errors,
    check_outputs,
    check_start_log,
    check_switched,
    check_threshold_state,
    draft_plain_step,
    spec_deltas,
    spec_state,
    wait_idle,
)
from smoke.client import Prompt, Result
from smoke.prompts import unique_prompts
from smoke.scenario import SmokeOptions, Variant
from smoke.server import Server, ServerConfig, SmokeError, log_tail
from smoke.tiers import Tiers


def required_metrics(base: str, required: Sequence[str], also: Sequence[str] = ()) -> dict[str, Any]:
    """The server's /metrics values of `required` and `also`; a required one missing fails."""
    page = client.metrics(base)
    values = {k: client.metric(page, k) for k in (*required, *also)}
    for k in required:
        if values[k] is None:
            raise SmokeError(f"Prometheus metric {k} missing from /metrics (--enable-metrics is on)")
    return values


def log_lines_with(srv: Server, prefix: str) -> int:
    """After the loads: the server still runs and its log is clean; how many of its lines say `prefix`."""
    if not srv.alive():
        raise SmokeError("server process died during the test")
    text = srv.log_text()
    check_log_clean(text)
    return sum(1 for line in text.splitlines() if prefix in line)


def record_end(rep: dict[str, Any], base: str, results: Sequence[Any], *, accept_length: bool = True) -> None:
    """What a variant run records once every check passed: the server's final speculation state
    (and accept length), the requests that failed, ok."""
    info = client.server_info(base)
    if accept_length:
        rep["avg_spec_accept_length"] = (info.get("internal_states") or [{}])[0].get("avg_spec_accept_length")
    rep["spec_disable_final"] = spec_state(info)
    rep["errors"] = sum(1 for r in results if r.error)
    rep["ok"] = True


def record_error(rep: dict[str, Any], exc: BaseException, log: Path, *, cut: bool = False) -> None:
    """A variant's failure in its report, with the cause and its server log: a check's own, an
    HTTP failure, or an unexpected answer (with its traceback). Where the deadline's margin has
    come (`cut`: the server is killed there), whatever failed failed of that: rep["deadline"] says
    where the run stopped, and the next call runs the variant again. Interrupts propagate."""
    if cut and isinstance(exc, Exception):
        done = ", ".join(rep["phases"]) or "none"
        rep["ok"] = False
        rep["deadline"] = f"stopped by the deadline's margin; loads done: {done}"
    elif isinstance(exc, SmokeError):
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
    return Server(cfg, opts.port if port is None else port, log, deadline=opts.deadline), log, rep


def start_variant_server(srv: Server, opts: SmokeOptions, rep: dict[str, Any]) -> str:
    """Starts it within the deadline (a minute left for the checks); its base URL. Its start in
    the progress, and the caller's save_state (a call killed later keeps its start log)."""
    srv.start(min(opts.health_timeout, opts.deadline.left() - 60))
    rep["start_s"] = round(srv.start_seconds, 1)
    opts.note(rep["name"], f"server up in {srv.start_seconds:.0f}s")
    opts.save()
    return srv.base


def phase_done(opts: SmokeOptions, rep: dict[str, Any], name: str, row: dict[str, Any]) -> None:
    """A load's row in the variant's report, and a line in the progress."""
    rep["phases"][name] = row
    opts.note(rep["name"], f"{name}: {row['requests']} requests")


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
            phase_done(opts, rep, name, {"requests": len(results), **accept_stats(results),
                                         **spec_deltas(st, st_before)})
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
        rep["metrics"] = required_metrics(
            base, ("sglang:spec_disable_plain_mode", "sglang:spec_disable_speculative_steps_total",
                   "sglang:spec_disable_plain_steps_total"), ("sglang:kv_available_tokens", "sglang:kv_used_tokens"))
        rep["mode_change_log_lines"] = log_lines_with(srv, MODE_CHANGE_LOG_PREFIX)
        record_end(rep, base, all_results)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported with its log
        record_error(rep, exc, log, cut=srv.past_margin())
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
                    timeout=opts.request_timeout(), counter="depth_changes" if opts.schedule is not None else "mode_changes",
                    say=lambda line: opts.progress(f"smoke {line}"))


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
            phase_done(opts, rep, name, {"requests": len(got), **accept_stats(got)})
        longs = client.in_background(
            lambda: client.run_concurrent(base, sets["ramp_long"], 2, opts.request_timeout()))
        ramp: list[Result] = []
        for i in range(3):
            time.sleep(0.3)
            ramp += client.run_concurrent(base, sets[f"ramp_burst{i}"], 4 * n, opts.request_timeout())
        ramp += longs.result()
        check_no_errors(ramp, "ramp")
        check_outputs(refs, ramp, "ramp")
        opts.note(rep["name"], f"ramp: {len(ramp)} requests")
        results += ramp
        final = wait_idle(base, baseline)
        rep["kv_final"] = {k: final.get(k) for k in ("num_used_tokens", "max_total_num_tokens")}
        check_kv_back(baseline, final)
        rep["metrics"] = required_metrics(base, ("sglang:spec_disable_crossover",), (
            "sglang:spec_disable_speculative_steps_total", "sglang:spec_disable_plain_steps_total"))
        rep["mode_change_log_lines"] = log_lines_with(srv, MODE_CHANGE_LOG_PREFIX)
        record_end(rep, base, results, accept_length=False)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported with its log
        record_error(rep, exc, log, cut=srv.past_margin())
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
    phase_done(opts, rep, "abort", {"requests": len(results) + len(spec_res) + len(after),
                                    "plain_mode": counts, "speculative_mode": spec_counts,
                                    **accept_stats(after), **spec_deltas(st, st_before)})
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
