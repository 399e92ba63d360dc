"""Feature matrix: what users send, checked across the switching server's mode (or depth) changes.

    python -m smoke features --models DIR --out DIR [--threshold N | --schedule SPEC]
                             [--variants overlap,sync] [--parallel-variants]

A plain server (the reference) and an EAGLE-3 server with the threshold run side by side. Each case
sends the same requests to both; on the threshold server it runs four times, under four loads:
  below       alone: the batch stays under the threshold (speculative steps only)
  above       while a filler load of 4N long greedy requests runs (plain steps only)
  cross_up    the filler arrives while the case's requests run (speculative -> plain mid-request)
  cross_down  the filler leaves while they run (plain -> speculative mid-request)
A crossing is not assumed from timing: the runner watches the server's mode and fails the case if
the change did not happen while the case's requests were in flight. After every run of a case the
KV pool must be back to its idle size. The KV-pressure case runs once per server, with all its
requests at once against a pool that holds 2N whole filler requests and no more (pool_tokens): at
least 256, as many more as that pool needs to overfill (pressure_count, ~3N above N=84), so that
the scheduler retracts requests in both modes. N runs from 2 to MAX_THRESHOLD (256).

With a depth schedule (`--schedule 1-8:3,9-24:2,25-64:1,65-:0`, the server's
--speculative-depth-schedule) the loads are per tier and edge (smoke.tiers.Tiers.matrix_plan):
"below" runs in the first tier (depth3), "above" in every other one (depth2, depth1, depth0: a
filler holds the batch inside each), "cross_up" and "cross_down" across every edge both ways (up8,
down8, ...: a filler holds the lower tier, more arrive or leave mid-case); the runner watches the
depth. N is the schedule's top edge there (the pool, the 4N filler of the last tier, the pressure
case).

The matrix keeps its deadline: each request takes its timeout from the time left as it starts, a
case starts only with time left for it, and a case the deadline cuts short is skipped, not failed.
What is finished is kept in the resume state as it ends (the references case by case, each variant's
cases one by one): the next call with the same state runs only what is missing. A line is printed as
each piece ends.

The cases are smoke.cases, the loads they run under smoke.loads, their requests smoke.answers,
and what "equal" means per case smoke.verdicts.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_image_plugin.setting import DepthSchedule
from smoke import client
from smoke.answers import Request, cut_by_deadline, send, send_all
from smoke.cases import (
    CASE_CONCURRENCY,
    CHUNKED_PREFILL,
    Case,
    generate,
    make_cases,
    on_tiers,
    stop_cases,
)
from smoke.checks import check_log_clean, wait_idle
from smoke.deadline import Deadline
from smoke.loads import (
    FILLER_NEW_TOKENS,
    FILLER_PROMPT_TOKENS,
    CaseInterrupted,
    run_case_modes,
    run_pressure,
)
from smoke.run_command import Given, comma_list, schedule_option
from smoke.runner import REFERENCE_CONCURRENCY, exit_code, side_by_side, side_port
from smoke.scenario import DEFAULT_THRESHOLD
from smoke.server import Server, ServerConfig, SmokeError, log_tail
from smoke.tiers import SCHEDULE_FLAG, MatrixPlan, Tiers, parse_smoke_schedule
from smoke.verdicts import Outcome, equal_tokens

CASE_NAMES = ("greedy", "logprobs", "sampling", "penalties", "n2", "long_prompt", "json_schema", "regex",
              "completions_stream", "chat_stream", "abort_stream", "stop", "kv_pressure")
MIN_POOL_TOKENS = 16384  # --max-total-tokens of both servers at least (see pool_tokens)
# The pressure case's fewest requests (as many as ran on the GPU, 0.5.23); a larger N's pool takes
# more to overfill (pressure_count)
MIN_PRESSURE_REQUESTS = 256
# new tokens per pressure request: long, so that requests admitted together outgrow what admission
# reserves for them (a share of max_new_tokens) before any can finish; with 96-160 early finishes
# made room as fast as the rest grew (GPU, 0.5.23: the pool peaked at 75%, nothing retracted)
PRESSURE_NEW_TOKENS = (384, 448, 512)
PRESSURE_PROMPT_TOKENS = (24, 64)  # fewest and most prompt tokens of a pressure request
# the pressure requests admitted together must need this many times the pool before one can finish
PRESSURE_OVERFILL = 1.5
# the pool holds this many times N whole filler requests: admission reserves up to a request's whole
# length after a retraction (GPU, 0.5.23, N=64: a pool of 16,384 tokens ran 37 filler requests, and
# the batch never passed the threshold)
FILLER_POOL_FACTOR = 2
# admit against ~14% of max_new_tokens, so that the pressure requests admitted together overfill
# the pool
SCHEDULE_CONSERVATIVENESS = 0.2
# The largest N (or schedule top edge) the matrix runs. Users set N just below their crossover of
# plain and always-on EAGLE-3, which the split-KV verify moved to 192-256 requests on the 8B shape,
# within the servers' decode graphs (up to 256); the matrix's loads grow with N (4N filler requests
# at once, a pool of FILLER_POOL_FACTOR x N whole filler requests, ~3N pressure requests).
MAX_THRESHOLD = 256
# A case starts only with this much left (beyond the margin): the slowest case of this call so far,
# half again (the cases differ: stop repeats its requests, a crossing may need all ATTEMPTS), and at
# least CASE_RESERVE_MIN_S (the first case has no measure yet; four modes' waits for the mode and for
# the pool alone take about a minute). A case cut short is run again whole by the next call.
CASE_RESERVE_FACTOR = 1.5
CASE_RESERVE_MIN_S = 90.0
# The resume state is written by the variants' threads at once (each its own entries); the caller's
# save_state reads all of it.
STATE_LOCK = threading.Lock()


def pool_tokens(threshold: int) -> int:
    """--max-total-tokens of the matrix's servers: room for FILLER_POOL_FACTOR x N whole filler
    requests (else the filler cannot hold the batch above N), at least MIN_POOL_TOKENS."""
    return max(MIN_POOL_TOKENS, FILLER_POOL_FACTOR * threshold * (FILLER_PROMPT_TOKENS + FILLER_NEW_TOKENS))


def pool_shortfall(actual: int | None, threshold: int) -> str | None:
    """Why a server's KV pool (its max_total_num_tokens) cannot run the matrix for N, None where it
    can: --max-total-tokens only caps the pool, and a server whose memory share holds less gets
    less, so the filler no longer holds the batch above N and the pressure case's overfill is
    another than its note says."""
    planned = pool_tokens(threshold)
    if actual is None or actual >= planned:
        return None
    return (f"the server's KV pool holds {actual} tokens, fewer than the {planned} the matrix sizes "
            f"for N={threshold} (the filler above N, the pressure case's overfill): its GPU memory "
            f"share is too small; run the variants one after the other (no --parallel-variants), "
            f"on a GPU with more memory, or with a smaller N")


def pressure_overfill(pool: int, requests: int) -> float:
    """How many times the pool `requests` pressure requests admitted together need before the
    first can finish: all of them if their reservations fit (their prompts and a share of
    max_new_tokens, sglang's initial new-token ratio 0.7 x the conservativeness), else as many as
    do."""
    prompt = statistics.fmean(PRESSURE_PROMPT_TOKENS)
    new = statistics.fmean(PRESSURE_NEW_TOKENS)
    reserved = prompt + 0.7 * SCHEDULE_CONSERVATIVENESS * new
    admitted = min(requests, pool / reserved)
    return admitted * (prompt + min(PRESSURE_NEW_TOKENS)) / pool


def pressure_count(threshold: int) -> int:
    """The pressure case's requests for N: the fewest from MIN_PRESSURE_REQUESTS up that overfill
    the matrix's pool PRESSURE_OVERFILL times. There is one: as many as the pool admits together
    need ~4x it before the first can finish (a test holds the constants to that)."""
    pool = pool_tokens(threshold)
    return next(n for n in itertools.count(MIN_PRESSURE_REQUESTS)
                if pressure_overfill(pool, n) >= PRESSURE_OVERFILL)


def running_limit(threshold: int) -> int:
    """--max-running-requests of the matrix's servers: every pressure request at once (requests
    left queued would not overfill the pool); more than N, so the filler holds the batch above it."""
    return pressure_count(threshold)


def in_flight(threshold: int, servers: int = 1) -> int:
    """The most requests the matrix has in flight at once: per threshold server its filler (4N)
    beside a case's, or the pressure case; `servers` variants side by side."""
    return max(4 * threshold + CASE_CONCURRENCY, pressure_count(threshold)) * servers


def check_threshold(threshold: int, flag: str = "--threshold") -> None:
    """SystemExit naming the cause and the fix for an N the matrix cannot run."""
    if threshold < 2:
        raise SystemExit(f"{flag} {threshold}: the feature matrix needs N >= 2 (its 'below' runs need "
                         "one request under the threshold)")
    if threshold > MAX_THRESHOLD:
        raise SystemExit(f"{flag} {threshold}: the feature matrix runs N up to {MAX_THRESHOLD}, as far "
                         f"as the servers' decode graphs go (its loads grow with N: {4 * threshold} "
                         f"filler requests at once into a KV pool of {pool_tokens(threshold)} tokens). "
                         f"Run the matrix with N <= {MAX_THRESHOLD}: its cases cross a smaller N alike")


def check_schedule(schedule: DepthSchedule, flag: str = SCHEDULE_FLAG) -> None:
    """SystemExit naming the cause and the fix for a schedule the matrix cannot run: a tier between
    others too narrow to hold a filler and a case in, or a top edge above MAX_THRESHOLD."""
    try:
        Tiers(schedule).matrix_plan(CASE_CONCURRENCY)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    top = Tiers(schedule).top
    if top > MAX_THRESHOLD:
        raise SystemExit(f"{flag} {schedule}: the feature matrix runs a top edge up to {MAX_THRESHOLD}, "
                         f"as far as the servers' decode graphs go (its loads grow with it: {4 * top} "
                         f"filler requests at once into a KV pool of {pool_tokens(top)} tokens). Give "
                         f"a top edge <= {MAX_THRESHOLD}")


def check_graph_bs(graph_bs: int, threshold: int, flag: str = "--feature-graph-bs") -> None:
    """SystemExit naming the fix for decode graphs beyond the matrix's running-request limit at N
    (sglang would capture none of the sizes past it)."""
    if not 1 <= graph_bs <= running_limit(threshold):
        raise SystemExit(f"{flag} {graph_bs}: give 1 to {running_limit(threshold)} (the feature servers' "
                         f"running-request limit at N={threshold}: its KV-pressure case's requests, "
                         "all at once)")


class DeadlineReached(Exception):
    """Too little time is left to start the named server, or to finish its work: the next call
    resumes there."""


# ----------------------------------------------------------------------------- the matrix
def print_now(line: str) -> None:
    print(line, flush=True)


def nothing_to_save() -> None:
    pass


@dataclass
class FeatureOptions:
    models: Path
    out: Path
    threshold: int = DEFAULT_THRESHOLD  # a schedule's top edge where it runs one (the pool, the filler)
    # the switching servers' depth schedule (its normal form) instead of the threshold
    schedule: str | None = None
    variants: tuple[str, ...] = ("overlap", "sync")
    port: int = 30100
    mem_fraction: float = 0.12
    deadline: Deadline = field(default_factory=lambda: Deadline(time.time() + 3600))
    health_timeout: float = 480
    min_server_s: float = 150
    graph_bs: int = 64  # decode CUDA graphs captured up to this batch (at most running_limit(threshold))
    # the variants' servers side by side, each on its own port, started at once: opt-in, as it
    # needs a GPU with memory for them all (SIDE_BY_SIDE_MEM_SHARE)
    parallel_variants: bool = False
    # the cases to run on the threshold servers (the plain server answers all of them): a subset
    # reruns what failed without the rest
    cases: tuple[str, ...] = CASE_NAMES
    # a line as each piece of work ends: a call stopped from outside still shows where it was
    progress: Callable[[str], None] = print_now
    # called (under STATE_LOCK) each time a piece of work is kept in the resume state: the caller
    # may write the state out, so that a call stopped from outside leaves it for the next
    save_state: Callable[[], None] = nothing_to_save


def matrix_plan(opts: FeatureOptions) -> MatrixPlan | None:
    """A schedule server's load modes (Tiers.matrix_plan); None for a threshold server."""
    if opts.schedule is None:
        return None
    return Tiers(parse_smoke_schedule(opts.schedule)).matrix_plan(CASE_CONCURRENCY)


VARIANT_FLAGS = {"overlap": True, "sync": False}  # CUDA graphs on in both
# --mem-fraction-static of servers that start side by side: sglang keeps (1 - share) of the memory
# free before its weights load for what is not weights and KV pool, and takes the pool from what is
# free after them; a share this large leaves the pool (fixed: --max-total-tokens) whole whatever the
# other server takes meanwhile (1B models: a few GB each)
SIDE_BY_SIDE_MEM_SHARE = 0.6


def server_config(name: str, opts: FeatureOptions, *, draft: bool, overlap: bool = True) -> ServerConfig:
    # metrics on for the threshold server only; xgrammar for the constrained cases (JSON without
    # free whitespace: see smoke.verdicts); a pool sized for the filler and the pressure
    # case (pool_tokens), chunked prefill for the long-prompt case
    extra = ("--grammar-backend", "xgrammar", "--constrained-json-disable-any-whitespace",
             "--max-total-tokens", str(pool_tokens(opts.threshold)),
             "--chunked-prefill-size", str(CHUNKED_PREFILL),
             # at the default (1.0) 0.5.23 admitted so few requests that the pool stayed 59% full
             "--schedule-conservativeness", str(SCHEDULE_CONSERVATIVENESS))
    n = opts.threshold
    share = SIDE_BY_SIDE_MEM_SHARE if opts.parallel_variants else opts.mem_fraction
    return ServerConfig(name, opts.models / "target", draft=(opts.models / "draft") if draft else None,
                        threshold=n if draft and opts.schedule is None else None,
                        schedule=opts.schedule if draft else None, overlap=overlap, cuda_graph=True,
                        cuda_graph_max_bs=opts.graph_bs, max_running=running_limit(n),
                        mem_fraction=share, enable_metrics=draft, extra=extra)


def pressure_requests(seed: int, vocab: int, count: int) -> tuple[Request, ...]:
    """`count` pressure requests (pressure_count). Not ignore_eos: 0.5.23's admission reserves the
    whole max_new_tokens of such a request, so they never overfill the pool (GPU: nothing
    retracted). min_new_tokens keeps them as long."""
    rnd = random.Random(seed + 7)

    def one() -> Request:
        prompt = [rnd.randrange(3, vocab) for _ in range(rnd.randint(*PRESSURE_PROMPT_TOKENS))]
        new = rnd.choice(PRESSURE_NEW_TOKENS)
        return generate(prompt, max_new_tokens=new, min_new_tokens=new, ignore_eos=False)

    return tuple(one() for _ in range(count))


def pressure_case(threshold: int, vocab: int) -> Case:
    """The KV-pressure case for N: its requests all at once (pressure_count), on the threshold
    server above N only (it runs once per server)."""
    count, pool = pressure_count(threshold), pool_tokens(threshold)
    return Case("kv_pressure", pressure_requests(0, vocab, count), equal_tokens, count, modes=("above",),
                note=f"{count} concurrent requests, pool of {pool} tokens "
                     f"({pressure_overfill(pool, count):.2f}x needed before the first can finish)")


def keep(opts: FeatureOptions, store: dict[str, Any], name: str, value: Any) -> None:
    """One finished piece of work into the resume state (`store` lies inside it)."""
    with STATE_LOCK:
        store[name] = value
        opts.save_state()


def references(opts: FeatureOptions, cases: list[Case], stop_prompt: list[int],
               state: dict[str, Any]) -> tuple[list[Case], dict[str, list[Outcome]]]:
    """Every case's answers from the plain server, kept in `state` case by case: a call the deadline
    stops keeps what it has (DeadlineReached), and the next asks the plain server only for the rest.
    The stop case is made from the plain server's greedy output for stop_prompt, so it is added here."""
    kept: dict[str, Any] = state.setdefault("refs", {})

    def all_cases() -> list[Case]:
        return cases + stop_cases(Outcome(**state["stop_base"]), stop_prompt)

    if "stop_base" not in state or any(c.name not in kept for c in all_cases()):
        answer_references(opts, cases, stop_prompt, state)
    every = all_cases()
    return every, {c.name: [Outcome(**o) for o in state["refs"][c.name]] for c in every}


def answer_references(opts: FeatureOptions, cases: list[Case], stop_prompt: list[int],
                      state: dict[str, Any]) -> None:
    """The plain server answers what `state` lacks. A failure forgets every answer kept so far (a
    failed plain server's answers are not trusted: the next call asks again); the deadline keeps
    them and raises DeadlineReached."""
    if opts.deadline.left() < opts.min_server_s:
        raise DeadlineReached("plain")
    log = opts.out / "features_plain.log"
    with Server(server_config("features_plain", opts, draft=False), opts.port, log) as srv:
        srv.start(min(opts.health_timeout, opts.deadline.left() - 60))
        opts.progress(f"features references: plain server up in {srv.start_seconds:.0f}s "
                      f"(left {opts.deadline.left():.0f}s)")
        try:
            finished = answer_missing(opts, srv.base, cases, stop_prompt, state, log)
            check_log_clean(srv.log_text())
        except (SmokeError, client.HTTPFailure):
            with STATE_LOCK:
                state.pop("refs", None)
                state.pop("stop_base", None)
                opts.save_state()
            raise
    if not finished:
        raise DeadlineReached("plain")


def answer_missing(opts: FeatureOptions, base: str, cases: list[Case], stop_prompt: list[int],
                   state: dict[str, Any], log: Path) -> bool:
    """The stop case's base request first (the stop case is made from its answer), then each case
    not in state["refs"], REFERENCE_CONCURRENCY requests at a time (as the smoke's references: the
    models' greedy outputs do not depend on the batch), each kept as it completes. False where the
    deadline stopped it."""
    if "stop_base" not in state:
        out = send(base, generate(stop_prompt, max_new_tokens=64), opts.deadline)
        if cut_by_deadline([out]):
            opts.progress("features references: stopped by the deadline before the first case")
            return False
        if out.error:
            raise SmokeError(f"plain server: {out.error}", log=log)
        keep(opts, state, "stop_base", out.__dict__)
    kept: dict[str, Any] = state["refs"]
    todo = [c for c in cases + stop_cases(Outcome(**state["stop_base"]), stop_prompt) if c.name not in kept]
    opts.progress(f"features references: {len(todo)} case(s) to answer")
    for done, case in enumerate(todo):
        started = opts.deadline.left()
        outs = send_all(base, case.requests, REFERENCE_CONCURRENCY, opts.deadline)
        if cut_by_deadline(outs):
            opts.progress(f"features references: stopped by the deadline at {case.name}; "
                          f"{len(todo) - done} case(s) left for the next call")
            return False
        errs = [o.error for o in outs if o.error]
        if errs:
            raise SmokeError(f"plain server, case {case.name}: {errs[0]}", log=log)
        keep(opts, kept, case.name, [o.__dict__ for o in outs])
        opts.progress(f"features references: {case.name} {len(outs)} request(s) "
                      f"{started - opts.deadline.left():.1f}s (left {opts.deadline.left():.0f}s)")
    opts.progress("features references: done")
    return True


def run_features(opts: FeatureOptions, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The plain server's references, then each variant's matrix. `state` (a dict kept between
    calls) holds what is finished: the references case by case, each variant's finished cases
    (state["variant_cases"]) and its report once it ran to its end (state["variants"])."""
    state = state if state is not None else {}
    opts.out.mkdir(parents=True, exist_ok=True)
    expected = json.loads((opts.models / "expected.json").read_text())
    vocab = int(expected["vocab_size"])
    rnd = random.Random(99)
    stop_prompt = [rnd.randrange(3, vocab) for _ in range(24)]
    pressure = pressure_case(opts.threshold, vocab)
    report: dict[str, Any] = {"threshold": opts.threshold, "variants": {}, "failures": [],
                              "pool_tokens": pool_tokens(opts.threshold)}
    if opts.schedule is not None:
        report["schedule"] = opts.schedule
    if set(opts.cases) != set(CASE_NAMES):
        report["only_cases"] = [n for n in CASE_NAMES if n in opts.cases]
    early = spawn_variants_early(opts, state.setdefault("variants", {}))
    try:
        return run_matrix(opts, state, report, expected, stop_prompt, pressure, early)
    finally:
        for srv in early.values():  # those run_variant did not reach (it stops the others)
            srv.stop()


def spawn_variants_early(opts: FeatureOptions, done: dict[str, Any]) -> dict[str, Server]:
    """Side by side (opts.parallel_variants): the variants' servers spawned before the plain server
    starts for the references, so that they start while it starts and answers (their pools are
    fixed: server_config); run_variant waits for them. One that cannot be spawned is left to
    run_variant, which starts it and reports its failure."""
    early: dict[str, Server] = {}
    if not opts.parallel_variants or opts.deadline.left() < opts.min_server_s:
        return early
    for key in opts.variants:
        if key in done or key in early:
            continue
        cfg = server_config(f"features_{key}", opts, draft=True, overlap=VARIANT_FLAGS[key])
        srv = Server(cfg, side_port(opts.port, opts.variants, key), opts.out / f"features_{key}.log")
        try:
            srv.spawn()
        except SmokeError:
            continue
        early[key] = srv
    return early


def run_matrix(opts: FeatureOptions, state: dict[str, Any], report: dict[str, Any], expected: dict[str, Any],
               stop_prompt: list[int], pressure: Case, early: dict[str, Server]) -> dict[str, Any]:
    """run_features' work once its servers are spawned: the references, then the variants."""
    vocab = int(expected["vocab_size"])
    try:
        plan = matrix_plan(opts)
        made = make_cases(expected, opts.threshold, str(opts.models / "target"),
                          concurrency=None if plan is None else plan.concurrency)
        cases, refs = references(opts, made + [pressure], stop_prompt, state)
    except DeadlineReached as exc:
        report["skipped"] = [str(exc)] + [f"{key}" for key in opts.variants]
        return report
    except (SmokeError, client.HTTPFailure) as exc:
        cause = exc.cause if isinstance(exc, SmokeError) else str(exc)
        report["failures"].append({"variant": "plain", "case": "-", "mode": "-", "cause": cause,
                                   "log_tail": log_tail(opts.out / "features_plain.log")})
        return report
    report["cases"] = {c.name: c.note for c in cases}
    done = state.setdefault("variants", {})
    cases_kept = state.setdefault("variant_cases", {})
    matrix = [c for c in cases if c is not pressure]
    if opts.parallel_variants:
        run_side_by_side(opts, matrix, refs, pressure, vocab, done, cases_kept, report, early)
    else:
        for key in opts.variants:
            if key in done:
                report["variants"][key] = done[key]
                continue
            if opts.deadline.left() < opts.min_server_s:
                report.setdefault("skipped", []).append(key)
                continue
            rep = run_variant(opts, key, matrix, refs, pressure, vocab, kept=cases_kept.setdefault(key, {}))
            report["variants"][key] = rep
            file_variant(done, cases_kept, key, rep)
    for key, rep in report["variants"].items():
        if rep.get("cause"):
            report["failures"].append({"variant": key, "case": "-", "mode": "-", "cause": rep["cause"],
                                       "log_tail": rep.get("log_tail")})
        for name in rep.get("skipped", []):
            report.setdefault("skipped", []).append(f"{key}: {name}")
        for name, rows in rep.get("cases", {}).items():
            for mode, row in rows.items():
                if isinstance(row, dict) and not row.get("ok"):
                    report["failures"].append({"variant": key, "case": name, "mode": mode,
                                               "cause": row.get("cause")})
    return report


def file_variant(done: dict[str, Any], cases_kept: dict[str, Any], key: str, rep: dict[str, Any],
                 crashed: bool = False) -> None:
    """A variant that ran to its end is done (the next call reuses its report); one the deadline
    stopped keeps its finished cases in `cases_kept` for the next call; one that crashed is run
    again whole."""
    if crashed:
        cases_kept.pop(key, None)
    elif not rep.get("skipped"):
        done[key] = rep
        cases_kept.pop(key, None)


def run_side_by_side(opts: FeatureOptions, cases: list[Case], refs: dict[str, Any], pressure: Case,
                     vocab: int, done: dict[str, Any], cases_kept: dict[str, Any],
                     report: dict[str, Any], early: dict[str, Server] | None = None) -> None:
    """run_features' variants at once, each server on its own port (side_port), those in `early`
    already spawned: the same skips, the same reports in the order of opts.variants. Each thread
    writes only its own variant's entry of `cases_kept`; `done` is written here only. A variant
    that raised is a failure of its own and is not kept (the next call reruns it)."""
    jobs: dict[str, Callable[[], dict[str, Any]]] = {}
    for key in opts.variants:
        if key in done or key in jobs:
            continue
        if opts.deadline.left() < opts.min_server_s:
            report.setdefault("skipped", []).append(key)
            continue
        jobs[key] = functools.partial(run_variant, opts, key, cases, refs, pressure, vocab,
                                      port=side_port(opts.port, opts.variants, key),
                                      kept=cases_kept.setdefault(key, {}),
                                      spawned=(early or {}).get(key))
    crashed: set[str] = set()

    def on_error(key: str, exc: Exception) -> dict[str, Any]:
        crashed.add(key)
        return {"overlap": VARIANT_FLAGS[key], "cuda_graph": True, "cases": {},
                "cause": f"runner error: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-1200:]}",
                "log_tail": log_tail(opts.out / f"features_{key}.log", 40)}

    reports = side_by_side(jobs, on_error)
    for key in opts.variants:
        if key in done:
            report["variants"][key] = done[key]
        elif key in reports:
            report["variants"][key] = reports[key]
            file_variant(done, cases_kept, key, reports[key], crashed=key in crashed)


def case_verdict(rows: dict[str, Any]) -> str:
    failed = [mode for mode, row in rows.items() if isinstance(row, dict) and not row.get("ok")]
    return f"FAILED ({', '.join(failed)})" if failed else "ok"


def case_reserve(slowest: float) -> float:
    """The time a case needs left (beyond the margin) to start: see CASE_RESERVE_FACTOR."""
    return max(CASE_RESERVE_MIN_S, CASE_RESERVE_FACTOR * slowest)


def run_variant(opts: FeatureOptions, key: str, cases: list[Case], refs: dict[str, Any],
                pressure: Case, vocab: int, port: int | None = None,
                kept: dict[str, Any] | None = None, spawned: Server | None = None) -> dict[str, Any]:
    """One threshold server (on `port`, default opts.port + 1; `spawned`: already spawned there by
    spawn_variants_early, waited for here): every case under every mode, then the pressure case.
    `kept` (this variant's finished cases in the resume state) gets each case as it ends, and the
    cases already in it are not run again. The cases the deadline left or cut short
    are listed in rep["skipped"]: the next call runs them."""
    kept = kept if kept is not None else {}
    log = opts.out / f"features_{key}.log"
    cfg = server_config(f"features_{key}", opts, draft=True, overlap=VARIANT_FLAGS[key])
    rep: dict[str, Any] = {"overlap": VARIANT_FLAGS[key], "cuda_graph": True, "cases": {}}
    rnd = random.Random(5)
    filler_prompts = [[rnd.randrange(3, vocab) for _ in range(FILLER_PROMPT_TOKENS)]
                      for _ in range(4 * opts.threshold)]
    plan = matrix_plan(opts)  # a schedule server: each case's modes per tier and edge
    todo = [c if c is pressure else on_tiers(c, plan)
            for c in [*cases, pressure] if c.name in opts.cases and c.name not in kept]
    srv = spawned or Server(cfg, opts.port + 1 if port is None else port, log)
    try:
        timeout = min(opts.health_timeout, opts.deadline.left() - 60)
        if spawned is not None:
            srv.wait_healthy(timeout)
        else:
            srv.start(timeout)
        rep["start_s"] = round(srv.start_seconds, 1)
        early = " (spawned beside the plain server)" if spawned is not None else ""
        opts.progress(f"features {key}: server up in {srv.start_seconds:.0f}s{early}, {len(todo)} case(s) "
                      f"to run (left {opts.deadline.left():.0f}s)")
        baseline = wait_idle(srv.base, client.load(srv.base))
        rep["kv_pool_tokens"] = baseline.get("max_total_num_tokens")
        short = pool_shortfall(rep["kv_pool_tokens"], opts.threshold)
        if short is not None:
            raise SmokeError(short)
        skipped = run_cases(opts, key, todo, refs, pressure, srv.base, baseline, filler_prompts, log, kept)
        if skipped:
            rep["skipped"] = skipped
        if not srv.alive():
            raise SmokeError("server process died during the matrix")
        check_log_clean(srv.log_text())
    except (SmokeError, client.HTTPFailure) as exc:
        rep["cause"] = exc.cause if isinstance(exc, SmokeError) else f"HTTP failure: {exc}"
        rep["log_tail"] = log_tail(log, 40)
    finally:
        srv.stop()
    rep["cases"] = {c.name: kept[c.name] for c in [*cases, pressure] if c.name in kept}
    return rep


def run_cases(opts: FeatureOptions, key: str, todo: list[Case], refs: dict[str, Any], pressure: Case,
              base: str, baseline: dict[str, Any], filler_prompts: list[list[int]], log: Path,
              kept: dict[str, Any]) -> list[str]:
    """The cases of `todo` one after the other on variant `key`'s server, each kept as it ends; the
    names of those the deadline left to the next call."""
    skipped: list[str] = []
    slowest = 0.0
    for case in todo:
        if opts.deadline.left_for_requests() < case_reserve(slowest):
            skipped.append(case.name)
            continue
        started = opts.deadline.left()
        rows: dict[str, Any]
        try:
            if case is pressure:
                rows = {"above": run_pressure(case, refs[case.name], base, baseline, log, opts.deadline)}
            else:
                rows = run_case_modes(case, refs[case.name], base, baseline, filler_prompts, opts.deadline)
        except CaseInterrupted as exc:
            skipped.append(case.name)
            opts.progress(f"features {key}: {case.name} stopped by the deadline: {exc}")
            continue
        seconds = started - opts.deadline.left()
        slowest = max(slowest, seconds)
        rows["seconds"] = round(seconds, 1)
        keep(opts, kept, case.name, rows)
        opts.progress(f"features {key}: {case.name} {case_verdict(rows)} {seconds:.1f}s "
                      f"(left {opts.deadline.left():.0f}s)")
    if skipped:
        opts.progress(f"features {key}: left for the next call: {', '.join(skipped)}")
    return skipped


def tie_note(row: dict[str, Any]) -> str:
    """", tie at 17 (0.062)": where a constrained output parted from plain's at a tie."""
    return "".join(f", tie at {t['at']} ({t['margin']})" for t in row.get("ties") or [])


def changes(row: dict[str, Any]) -> str:
    """A run's changes: the mode's, a schedule server's depth's (`3d`)."""
    return f"{row['depth_changes']}d" if "depth_changes" in row else str(row.get("mode_changes"))


def summarize(report: dict[str, Any]) -> str:
    """A line per case: each mode's result, with (mode changes, plain/speculative steps)."""
    setting = (f"schedule={report['schedule']}" if report.get("schedule")
               else f"threshold={report['threshold']}")
    lines = [f"features: {setting} pool={report.get('pool_tokens')} tokens"
             + (f"; only the cases {', '.join(report['only_cases'])}" if report.get("only_cases") else "")]
    for key, rep in report.get("variants", {}).items():
        lines.append(f"  {key}: overlap={rep.get('overlap')} cuda_graph={rep.get('cuda_graph')} "
                     f"start {rep.get('start_s')}s")
        for name, rows in rep.get("cases", {}).items():
            cells = [f"{mode} " + (f"PASS({changes(row)}, {row.get('plain_steps')}p/"
                                   f"{row.get('speculative_steps')}s{tie_note(row)})" if row.get("ok") else "FAIL")
                     for mode, row in rows.items() if isinstance(row, dict)]
            lines.append(f"    {name:20s} " + "  ".join(cells) + f"  [{rows.get('seconds', '-')}s]")
    for s in report.get("skipped", []):
        lines.append(f"  SKIPPED {s}")
    for f in report.get("failures", []):
        lines.append(f"FEATURE FAILED [{f['variant']} {f['case']} {f['mode']}]: {f['cause']}")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", type=Path, required=True, help="dir from `python -m smoke models`")
    ap.add_argument("--out", type=Path, required=True, help="logs and features.json go here")
    ap.add_argument("--threshold", type=int, default=DEFAULT_THRESHOLD, action=Given,
                    help=f"N, 2 to {MAX_THRESHOLD} (the KV pool and the pressure case grow with N; "
                         "see pool_tokens, pressure_count)")
    ap.add_argument(SCHEDULE_FLAG, metavar="LOW-HIGH:DEPTH,...",
                    help="instead of --threshold: the servers' draft depth per load, e.g. "
                         "1-8:3,9-24:2,25-64:1,65-:0; each case runs in every tier and across every "
                         f"edge both ways (the top edge at most {MAX_THRESHOLD})")
    ap.add_argument("--variants", default="overlap,sync",
                    help="comma list of: overlap, sync (--disable-overlap-schedule); CUDA graphs on")
    ap.add_argument("--port", type=int, default=30100)
    ap.add_argument("--deadline", type=float, default=3600, help="seconds from now")
    ap.add_argument("--cases", default=",".join(CASE_NAMES),
                    help="comma list of the cases to run (default: all); a subset reruns what failed")
    ap.add_argument("--check", action="store_true",
                    help="check the options (the threshold or the schedule against the matrix's limits, "
                         "the open files its requests need) and exit, starting nothing: the image smoke "
                         "does so before its first server")
    ap.add_argument("--parallel-variants", action="store_true",
                    help="run the variants side by side, their servers on ports PORT+1, PORT+2, "
                         "...: they start at once (their KV pools are fixed), then their matrices overlap; for a "
                         "GPU with memory for two servers")


def options(a: argparse.Namespace) -> FeatureOptions:
    variants = comma_list(a.variants, VARIANT_FLAGS, "--variants")
    schedule = schedule_option(a)
    if schedule is not None:
        check_schedule(schedule)
    else:
        check_threshold(a.threshold)
    threshold = a.threshold if schedule is None else Tiers(schedule).top
    return FeatureOptions(models=a.models, out=a.out, threshold=threshold,
                          schedule=None if schedule is None else str(schedule), variants=variants,
                          port=a.port, deadline=Deadline(time.time() + a.deadline),
                          parallel_variants=a.parallel_variants,
                          cases=comma_list(a.cases, CASE_NAMES, "--cases"))


def main(a: argparse.Namespace) -> int:
    opts = options(a)
    client.allow_connections(in_flight(opts.threshold, len(opts.variants) if opts.parallel_variants else 1))
    if a.check:
        print(f"features: the options hold (threshold {opts.threshold}, schedule {opts.schedule})", flush=True)
        return 0
    report = run_features(opts)
    (opts.out / "features.json").write_text(json.dumps(report, indent=1))
    print(summarize(report))
    return exit_code(report)
