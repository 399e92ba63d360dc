"""The smoke run (`python -m smoke run`, smoke.run_command): plain reference outputs, then each
EAGLE-3 server variant (smoke.variant_runs, smoke.schedule_run), one after the other or side by
side, each on its own port. `run_smoke` collects the failures of every variant (one GPU call should
tell as much as it can); `summarize` is the short report, `exit_code` non-zero on any failure or
skip. The deadline's margin kills the servers (smoke.server.Server): what they left undone is
skipped, not failed, and the next call with the same state runs it."""
from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sglang_image_plugin.setting import AUTO
from smoke import client, endurance
from smoke.checks import check_hf_reference, check_log_clean, check_no_errors
from smoke.client import Prompt
from smoke.deadline import DeadlineStop
from smoke.prompts import make_prompts, make_schedule_prompts, unique_prompts
from smoke.scenario import VARIANTS, SmokeOptions
from smoke.schedule_run import run_schedule_variant
from smoke.server import Server, ServerConfig, SmokeError, log_tail
from smoke.tiers import ABOVE_FACTOR
from smoke.variant_runs import log_suffix, record_error, run_auto_variant, run_variant

# The plain reference server runs eager (no CUDA graphs: nothing to capture before it serves), so
# its step is launch-bound and costs about the same at 1 or 64 requests: at 8 at a time the 1B
# models' references took over 8 minutes. The models' designed top-1 margins keep greedy outputs
# independent of the batch they run in, so the references may run many at a time.
REFERENCE_CONCURRENCY = 64


def in_flight(threshold: int, servers: int = 1) -> int:
    """The most requests the smoke has in flight at once, N being the threshold or a schedule's
    top edge: each variant's "above" load and its aborts (8N), `servers` variants side by side."""
    return ABOVE_FACTOR * threshold * servers


def record_references(opts: SmokeOptions, expected: dict[str, Any], prompts: list[Prompt],
                      state: dict[str, Any]) -> dict[str, list[int]]:
    """The plain server's outputs for every prompt; DeadlineStop where the deadline's margin killed
    it before it answered them all."""
    cfg = ServerConfig("plain", opts.models / "target", cuda_graph=False,
                       mem_fraction=opts.mem_fraction, enable_metrics=False)
    log = opts.out / "server_plain.log"
    with Server(cfg, opts.port, log, deadline=opts.deadline) as srv:
        srv.start(min(opts.health_timeout, opts.deadline.left() - 60))
        state["plain_start_s"] = round(srv.start_seconds, 1)
        opts.note("plain", f"server up in {srv.start_seconds:.0f}s, {len(prompts)} prompts to answer")
        opts.save()
        res = client.run_concurrent(srv.base, prompts, REFERENCE_CONCURRENCY, opts.request_timeout())
        try:
            check_no_errors(res, "plain reference")
        except SmokeError as exc:
            if srv.past_margin():
                raise DeadlineStop("stopped by the deadline's margin while it answered") from exc
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
        try:
            if opts.deadline.left() < opts.min_server_s:
                raise DeadlineStop("not started: too little time left")
            refs = record_references(opts, expected, unique_prompts(sets), state)
        except DeadlineStop as exc:
            report["skipped"] = ["plain (deadline)"] + [VARIANTS[v].name for v in opts.variants]
            opts.note("plain", str(exc))
            return report
        except (SmokeError, client.HTTPFailure) as exc:
            f = exc if isinstance(exc, SmokeError) else SmokeError(str(exc))
            f.log = f.log or opts.out / "server_plain.log"
            report["failures"].append({"variant": "plain", "cause": f.cause, "log_tail": log_tail(f.log)})
            opts.note("plain", f"FAIL: {first_line(f.cause)}")
            return report
        state["refs"] = refs
        opts.note("plain", f"{len(refs)} references kept")
        opts.save()
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
            opts.note(v.name, "not started: too little time left")
            continue
        rep = variant_runner(opts)(opts, v, opts.models / "draft", sets, refs)
        file_variant(opts, report, done, v.name, rep)
    return collect_failures(report)


def first_line(text: str | None) -> str:
    return (text or "").partition("\n")[0]


def file_variant(opts: SmokeOptions, report: dict[str, Any], done: dict[str, Any], name: str,
                 rep: dict[str, Any]) -> None:
    """A variant's report into the smoke's, its verdict in the progress, then the caller's
    save_state: one that passed is done (the next call reuses it), one the deadline's margin
    stopped is skipped (the next call runs it again)."""
    if rep.get("deadline"):
        report.setdefault("skipped", []).append(f"{name} ({rep['deadline']})")
        opts.note(name, rep["deadline"])
    else:
        report["variants"][name] = rep
        if rep.get("ok"):
            done[name] = rep
        opts.note(name, "PASS" if rep.get("ok") else f"FAIL: {first_line(rep.get('cause'))}")
    opts.save()


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
            opts.note(v.name, "not started: too little time left")
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
            file_variant(opts, report, done, name, reports[name])
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
