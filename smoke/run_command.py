"""`python -m smoke run`, the smoke's command line. The run: plain reference outputs, then EAGLE-3
servers with the dynamic speculation disable threshold, or with a draft depth per load (a depth
schedule), checked from the outside (log line, outputs, server-info counters, accept length, KV
pool, errors).

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

This module is the command line (add_arguments, options, main); smoke.runner runs the variants. Its
option helpers serve the feature matrix's command line and `bench e2e` too (Given, schedule_option,
comma_list, add_endurance_arguments).
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sglang_image_plugin.setting import AUTO, DepthSchedule, parse_threshold
from smoke import client, endurance
from smoke.deadline import Deadline
from smoke.runner import exit_code, in_flight, run_smoke, summarize
from smoke.scenario import DEFAULT_THRESHOLD, VARIANTS, SmokeOptions
from smoke.tiers import SCHEDULE_FLAG, Tiers, parse_smoke_schedule


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
    client.allow_connections(in_flight(opts.threshold, len(opts.variants) if opts.parallel_variants else 1))
    report = run_smoke(opts)
    (opts.out / "report.json").write_text(json.dumps(report, indent=1))
    print(summarize(report))
    return exit_code(report)
