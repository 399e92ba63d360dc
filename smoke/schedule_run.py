"""One EAGLE-3 server variant's run with a depth schedule (run_schedule_variant): the loads of
its edges (smoke.tiers), every check in order against one server."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from smoke import client
from smoke.checks import (
    DEPTH_CHANGE_LOG_PREFIX,
    accept_stats,
    check_accept_recovers,
    check_depth,
    check_depth_changes,
    check_depths_of_load,
    check_depths_ran,
    check_kv_back,
    check_no_errors,
    check_only_depth,
    check_outputs,
    check_schedule_state,
    check_start_log,
    depth_steps,
    draft_plain_step,
    spec_deltas,
    spec_state,
    wait_idle,
)
from smoke.client import Prompt, Result
from smoke.scenario import SmokeOptions, Variant
from smoke.server import SmokeError
from smoke.tiers import Tiers
from smoke.variant_runs import (
    abort_phase,
    endurance_phase,
    log_lines_with,
    phase_done,
    record_end,
    record_error,
    required_metrics,
    start_variant_server,
    variant_server,
)


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
            phase_done(opts, rep, name, {"requests": len(results), "concurrency": size,
                                         **accept_stats(results), **spec_deltas(st, st_before)})
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
        phase_done(opts, rep, "ramp", {"requests": len(ramp), "bursts": bursts, **accept_stats(ramp),
                                       **spec_deltas(st, before)})
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
        rep["metrics"] = required_metrics(
            base, ("sglang:spec_disable_depth", "sglang:spec_disable_plain_mode",
                   "sglang:spec_disable_speculative_steps_total", "sglang:spec_disable_plain_steps_total"),
            ("sglang:kv_used_tokens",))
        rep["depth_change_log_lines"] = log_lines_with(srv, DEPTH_CHANGE_LOG_PREFIX)
        if rep["depth_change_log_lines"] == 0:
            raise SmokeError(f"no {DEPTH_CHANGE_LOG_PREFIX!r} line in the server log after "
                             f"{rep['depth_changes']['count']} depth changes")
        record_end(rep, base, all_results)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported with its log
        record_error(rep, exc, log, cut=srv.past_margin())
    finally:
        srv.stop()
    return rep
