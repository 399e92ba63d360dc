"""The whole GPU run as one resumable driver (for the device machine: no Docker, no internet).

    PYTHONPATH=plugin python3 -m bench e2e --bundle .gpu --state /tmp/smoke-state --out "$OUT" [--deadline 560]
                         [--phases all|install,patch,models,smoke,bench,comm] [--fresh]
                         [--parallel-variants]

In the repository's root: plugin/ holds the speculation setting's contract, which the smoke and
the bench import by name (their servers load the plugin installed in the site instead). Before
any phase the driver starts itself again, once, with the site on its PYTHONPATH (it imports from
the site as its servers do: restart_with_site).

Phases, each skipped when the state dir says it is done (a warm machine keeps /tmp between calls,
so the same command a second time resumes where the deadline stopped the first; a smoke, bench or
comm result counts as done only for the same options, and a site installed from another bundle or
patch series is refused unless this call installs again):
  install  unpack .gpu/wheels.tar.xz, pip install --no-index --no-deps --target SITE, IPython stub
  patch    PYTHONPATH=src python -m sglang_image.patch apply --series-dir patches/<flavor>
           --site-packages SITE --manifest STATE/patches.json (on a fresh SITE only: never twice)
           then unpacks the bundle's jit-cache.tar.xz for these wheels and patches (bench.jitcache)
  check    imports the server chain; `launch_server --help` must show the threshold flag
  models   the models of the selected phases: --smoke-size, --bench-size (--device cuda: seconds)
  smoke    plain reference server, EAGLE-3 + threshold (overlap on, CUDA graphs) and
           (--disable-overlap-schedule, no CUDA graphs) with every check of smoke.runner;
           --schedule SPEC: a depth schedule instead, its every tier and edge; --smoke-ramp-minutes
           M: then an endurance ramp through the tiers, the servers' memory before and after
  features the feature matrix of smoke.features (sampling, logprobs, stops, streams, grammars,
           penalties, n > 1, chunked prefill, KV pressure, aborts) across the mode changes (with
           --schedule: in every tier and across every edge both ways)
  bench    the paired benchmark of bench.throughput (--bench-*: configs, concurrency, pairs, the
           A/A twin); its servers outlive the call (recorded in STATE/bench-servers.json), so the
           next call goes on with them; they stop when the bench is complete or with --stop
  comm     TP=2/TP=1 runs of a tiny Qwen3 with torch symm mem / FlashInfer allreduce fusion (bench.comm;
           needs 2 GPUs; `python3 -m bench comm` = this driver with install,patch,models,comm)
  kernels  `python -m bench verify-kernel` with --kernel-args: the EAGLE verify's attention alone,
           upstream's prefill kernel against its split-KV one (seconds, no server; run every call)
  router   sglang-router with deploy/'s rendered flags in front of two threshold servers (1B-shaped
           models): load across each threshold, outputs equal to plain, a server killed mid-load
           with no request lost (bench.router; --router-*)
The models phase builds only the models of the selected phases (all when none of
smoke/bench/comm/router is).
No server is started with less than ~150 s left before the deadline, and the smoke's are killed at
its margin (25 s before it: what they left undone is skipped, for the next call). What is done is
written to OUT (report.json, summary.txt, e2e.log, logs.tar.gz: at most 8 files come back), and the
kernels compiled in this call as jit-cache.tar.xz, for the bundle folder (bench.jitcache); the smoke
logs each step it ends in e2e.log and writes OUT anew as each of its servers is up and each variant
ends, so that a call killed from outside keeps them.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys
import tarfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import comm as comm_mod
from bench import router as router_mod
from bench import servers as bench_servers
from bench.call import Call, Deadline_
from bench.options import add_tuning_arguments, tuning_options
from bench.run_phases import MODELS, RunPhases, smoke_threshold
from bench.site import Site
from smoke import client, run_command, runner
from smoke import features as features_mod
from smoke.scenario import DEFAULT_THRESHOLD, VARIANTS
from smoke.tiers import Tiers

PHASES = ("install", "patch", "check", "models", "kernels", "smoke", "features", "bench", "comm", "router")
RUN_PHASES = ("smoke", "features", "bench", "comm", "router")  # marked done in the state once complete


def bench_label(key: str, bench: dict[str, Any], this_call: str | None) -> str:
    """A bench of the state as its reader knows it: its servers and loads, and whether an earlier
    call ran it (the state keeps every bench's failures, so a failed bench stays in RESULT after a
    call with other options ran and passed: the line must say which one failed)."""
    what = ",".join(bench.get("configs", []))
    if bench.get("concurrency"):
        what += f" at {','.join(str(c) for c in bench['concurrency'])} requests"
    if key != this_call:
        what += ", an earlier call's options"
    what = what.strip(", ")
    return f"bench {key} ({what})" if what else f"bench {key}"


class E2E:
    """The selected phases in order, each skipped where the state says it is done, and OUT written
    after each: the site's (bench.site), the models and the phases that run servers
    (bench.run_phases)."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.phases = PHASES if a.phases == "all" else tuple(a.phases.split(","))
        self.call = Call(a, self.phases)
        self.site = Site(self.call)
        self.runs = RunPhases(self.call, report=lambda: self.finish([]))
        self.failures: list[str] = []  # this call's failed phases

    def stale_site(self) -> str | None:
        """Why the selected phases would run on a site that no longer matches this tree (its bundle or
        series changed since the install, and this call does not install again), else None."""
        installed = self.call.state.get("install")
        if "install" in self.phases or not installed or not any(p in self.phases for p in RUN_PHASES):
            return None
        if not (self.a.bundle / "wheels.tar.xz").exists() or self.site.install_key() == installed:
            return None
        return (f"the site in {self.site.path} holds another bundle or patch series than this tree's "
                f"({self.a.bundle}, patches/{self.site.flavor}): add install,patch,check to --phases (or use --fresh)")

    def kill_leftover_servers(self) -> None:
        """Servers of an earlier call killed mid-run (setsid: they outlive it) still hold the port."""
        pidfile = self.call.state_dir / "servers.pid"
        if not pidfile.exists():
            return
        for line in pidfile.read_text().split():
            pgid = int(line)
            try:
                cmd = Path(f"/proc/{pgid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"sglang.launch_server" in cmd:
                self.call.log(f"killing the leftover server process group {pgid}")
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        pidfile.unlink()
        time.sleep(2)

    def stop_servers(self) -> int:
        """--stop: every server earlier calls left running (the bench's, and any smoke leftover)."""
        self.kill_leftover_servers()
        n = bench_servers.stop_recorded(self.runs.bench_registry, say=self.call.log)
        self.call.log(f"stopped {n} bench server(s)")
        return 0

    def run(self) -> int:
        phases = self.phases
        self.site.env()
        if self.a.stop:
            return self.stop_servers()
        self.kill_leftover_servers()
        steps: dict[str, Callable[[], None]] = {
            "install": self.site.install, "patch": self.site.patch, "check": self.site.check,
            "models": self.runs.models, "kernels": self.runs.kernels, "smoke": self.runs.smoke, "features": self.runs.features,
            "bench": self.runs.bench, "comm": self.runs.comm, "router": self.runs.router}
        stale = self.stale_site()
        if stale:
            self.call.log(f"FAILED: {stale}")
            return 1
        if any(ph in phases for ph in ("check", "models", *RUN_PHASES)):
            # before the install too: a call on the wrong torch otherwise installs, builds models
            # and fails in its first server's imports, minutes later
            try:
                self.site.check_host_stack()
            except RuntimeError as exc:
                self.call.log(f"FAILED: {exc}")
                return 1
        incomplete = []
        for ph in phases:
            done_key = (f"{ph}_done_" + (self.runs.bench_key if ph == "bench" else self.runs.options_digest(ph))
                        if ph in RUN_PHASES else "")
            if done_key and self.call.state.get(done_key):
                self.call.log(f"{ph}: done in an earlier call")
                continue
            self.call.log(f"== {ph} ({self.call.deadline.left():.0f}s left)")
            try:
                steps[ph]()
                launch_only = ph == "bench" and self.a.bench_launch_only  # nothing measured yet
                if done_key and not self.phase_failures(ph) and not launch_only:
                    self.call.state[done_key] = True  # a failed phase runs again on the next call
            except Deadline_ as exc:
                incomplete.append(str(exc))
                self.call.log(f"{ph}: stopped by the deadline: {exc}")
            except Exception as exc:  # noqa: BLE001 - one failing phase must not lose the others
                self.failures.append(f"{ph}: {exc}")
                self.call.log(f"{ph}: FAILED: {exc}\n{traceback.format_exc()[-1500:]}")
                if ph == "install":
                    break
            finally:
                self.call.save()
                self.finish(incomplete)  # OUT always holds the latest state, even if killed later
        self.finish(incomplete)
        self.site.bring_back_jit_cache()
        if incomplete:
            self.call.log("INCOMPLETE: run the same command again on the warm machine to resume: "
                          + "; ".join(incomplete))
            return 3
        failures = self.all_failures()
        self.call.log("RESULT: " + ("PASS" if not failures else "FAIL"))
        for f in failures:
            self.call.log("  FAILED " + f[:2000])
        return 1 if failures else 0

    def phase_failures(self, ph: str) -> list[Any]:
        """The failed checks a run phase's report holds (its report from this call)."""
        report = (self.call.state.get("bench_reports", {}).get(self.runs.bench_key) if ph == "bench"
                  else self.call.state.get(f"{ph}_report"))
        return list((report or {}).get("failures", []))

    def all_failures(self) -> list[str]:
        """This call's phase failures + the checks' failures of every call (kept in the state)."""
        out = list(self.failures)
        smoke = self.call.state.get("smoke_report") or {}
        out += [f"smoke {f['variant']}: {f['cause']}" for f in smoke.get("failures", [])]
        feats = self.call.state.get("features_report") or {}
        out += [f"features {f['variant']} {f['case']} {f['mode']}: {f['cause']}"
                for f in feats.get("failures", [])]
        this_call = self.runs.bench_key if "bench" in self.phases else None
        for key, bench in self.call.state.get("bench_reports", {}).items():
            out += [f"{bench_label(key, bench, this_call)}: {f.splitlines()[0]}" for f in bench.get("failures", [])]
        out += [f"router: {f.splitlines()[0]}" for f in (self.call.state.get("router_report") or {}).get("failures", [])]
        comm = self.call.state.get("comm_report") or {}
        out += [f"{f['variant']}: {f['cause']}" for f in comm.get("failures", [])]
        return out

    def finish(self, incomplete: list[str]) -> None:
        state = self.call.state
        report: dict[str, Any] = {"elapsed_s": round(time.time() - self.call.t0, 1), "failures": self.all_failures(),
                                  "incomplete": incomplete, "patches": state.get("patch"),
                                  "smoke": state.get("smoke_report"), "features": state.get("features_report"),
                                  "bench": state.get("bench_reports") or None, "comm": state.get("comm_report"),
                                  "router": state.get("router_report")}
        (self.call.out / "report.json").write_text(json.dumps(report, indent=1))
        parts = []
        if report["smoke"]:
            parts.append(runner.summarize(report["smoke"]))
        if report["features"]:
            parts.append(features_mod.summarize(report["features"]))
        for key, bench in (report["bench"] or {}).items():
            parts.append(f"bench {key}:\n{bench['table']}")
        if report["comm"]:
            parts.append(comm_mod.summarize(report["comm"]))
        if report["router"]:
            parts.append(report["router"]["summary"])
        if report["failures"] or incomplete:
            parts.append("\n".join([f"FAILED {f[:300]}" for f in report["failures"]]
                                   + [f"INCOMPLETE {i}" for i in incomplete]))
        (self.call.out / "summary.txt").write_text("\n\n".join(parts) + "\n")
        buf = self.call.out / "logs.tar.gz"
        with tarfile.open(buf, "w:gz") as tar:
            for p in sorted(self.call.logs.rglob("*")):  # the benches' files in a folder per model size
                if p.is_file():
                    # keep each log's last 4 MiB: the whole bundle must stay under 16 MiB
                    data = p.read_bytes()[-4 * 2**20:]
                    ti = tarfile.TarInfo(str(p.relative_to(self.call.logs)))
                    ti.size = len(data)
                    tar.addfile(ti, io.BytesIO(data))
            for name in MODELS:
                e = self.call.models_dir / name / "expected.json"
                if e.exists():
                    tar.add(e, arcname=f"expected_{name}.json")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--bundle", type=Path, default=Path(".gpu"))
    ap.add_argument("--state", type=Path, default=Path("/tmp/smoke-state"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--deadline", type=float, default=560, help="seconds from the start")
    ap.add_argument("--phases", default="all", help=f"'all' or a comma list of {','.join(PHASES)}")
    ap.add_argument("--threshold", default=str(DEFAULT_THRESHOLD), action=run_command.Given,
                    help=f"smoke threshold N (default {DEFAULT_THRESHOLD}), or auto (the smoke "
                         f"phase's servers run auto; the feature matrix keeps N={DEFAULT_THRESHOLD}); "
                         f"the features phase takes N of 2 to {features_mod.MAX_THRESHOLD}")
    ap.add_argument("--schedule", metavar="LOW-HIGH:DEPTH,...",
                    help="smoke and features phases: instead of --threshold, the servers' draft depth "
                         "per load (e.g. 1-8:3,9-24:2,25-64:1,65-:0); the loads visit every tier and "
                         f"cross every edge both ways (the features phase: the top edge at most "
                         f"{features_mod.MAX_THRESHOLD})")
    run_command.add_endurance_arguments(ap, "smoke-")
    ap.add_argument("--kernel-args", default="",
                    help="kernels phase: flags for python -m bench verify-kernel, one shell-quoted string "
                         "(default: its own: the 8B shape at 16-256 requests, contexts 256 and 2048)")
    ap.add_argument("--smoke-variants", default="overlap,sync", help="smoke phase: comma list of overlap,sync")
    ap.add_argument("--feature-variants", default="overlap,sync",
                    help="features phase: comma list of overlap,sync (CUDA graphs on in both)")
    ap.add_argument("--smoke-size", default="tiny", choices=[n for n, (_, used_by) in MODELS.items() if "smoke" in used_by],
                    help="smoke and features phases: the models (tiny, or the bench's 1B shape)")
    ap.add_argument("--feature-graph-bs", type=int, default=64,
                    help="features phase: decode CUDA graphs captured up to this batch, at most the "
                         "feature servers' running-request limit (its KV-pressure case's requests: "
                         f"{features_mod.running_limit(DEFAULT_THRESHOLD)} at N={DEFAULT_THRESHOLD}, "
                         f"{features_mod.running_limit(features_mod.MAX_THRESHOLD)} at "
                         f"N={features_mod.MAX_THRESHOLD})")
    ap.add_argument("--feature-cases", default=",".join(features_mod.CASE_NAMES),
                    help="features phase: comma list of the cases to run (default: all)")
    ap.add_argument("--parallel-variants", action="store_true",
                    help="smoke and features phases: the variants side by side, each server on a "
                         "port of its own (for a GPU with memory for two servers)")
    ap.add_argument("--bench-draft-accept", type=float, default=0.85,
                    help="chain draft of the 1B-shaped models: designed accept length ~3.2 (3 steps)")
    ap.add_argument("--bench-size", default="1b", choices=[n for n, (_, used_by) in MODELS.items() if "bench" in used_by],
                    help="bench model shape: 1b (host-bound at high load on a fast GPU) or 8b (GPU-bound)")
    add_tuning_arguments(ap, "bench-")
    ap.add_argument("--comm-runs", default=",".join(comm_mod.RUN_NAMES),
                    help="comm phase: comma list of runs, in this order")
    ap.add_argument("--router-threshold", type=int, default=16,
                    help="router phase: each server's threshold N (an integer)")
    ap.add_argument("--router-levels", default=",".join(map(str, router_mod.RouterOptions.levels)),
                    help="router phase: clients through the router, level after level (comma list)")
    ap.add_argument("--router-kill", action=argparse.BooleanOptionalAction, default=True,
                    help="router phase: kill the second server during the last level")
    ap.add_argument("--fresh", action="store_true", help="forget the state of earlier calls")
    ap.add_argument("--stop", action="store_true",
                    help="stop the servers earlier calls left running (the bench's outlive a call), and exit")


def main(a: argparse.Namespace) -> int:
    if a.phases != "all":
        run_command.comma_list(a.phases, PHASES, "--phases")
    run_command.comma_list(a.smoke_variants, VARIANTS, "--smoke-variants")
    run_command.comma_list(a.feature_variants, features_mod.VARIANT_FLAGS, "--feature-variants")
    run_command.comma_list(a.feature_cases, features_mod.CASE_NAMES, "--feature-cases")
    run_command.comma_list(a.comm_runs, comm_mod.RUN_NAMES, "--comm-runs")
    try:
        _, threshold = smoke_threshold(a.threshold)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    schedule = run_command.schedule_option(a)  # exits naming --schedule (or it beside --threshold)
    phases = PHASES if a.phases == "all" else a.phases.split(",")
    matrix_n = threshold if schedule is None else Tiers(schedule).top  # auto: the default N
    if "features" in phases and not a.stop:
        if schedule is not None:
            features_mod.check_schedule(schedule)
        else:
            features_mod.check_threshold(threshold)
    if a.smoke_ramp_minutes < 0 or a.smoke_ramp_max_growth_mib < 0:
        raise SystemExit(f"--smoke-ramp-minutes {a.smoke_ramp_minutes:g} --smoke-ramp-max-growth-mib "
                         f"{a.smoke_ramp_max_growth_mib:g}: give numbers >= 0")
    features_mod.check_graph_bs(a.feature_graph_bs, matrix_n)
    tuning_options(a, "bench-")  # exits naming a bad --bench-* value before any work
    try:
        levels = [int(c) for c in a.router_levels.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1 or a.router_threshold < 1:
        raise SystemExit(f"--router-levels {a.router_levels} --router-threshold {a.router_threshold}: "
                         "give client counts >= 1 as a comma list (e.g. 2,8,96) and a threshold >= 1")
    if not a.stop:  # kept by the restart below (execv)
        client.allow_connections(in_flight(a, phases, matrix_n))
    driver = E2E(a)
    if not a.stop:
        restart_with_site(driver.site)
    return driver.run()


def in_flight(a: argparse.Namespace, phases: Sequence[str], n: int) -> int:
    """The most requests the smoke and features phases have in flight at once (N: the threshold,
    a schedule's top edge, the default N for auto), their variants side by side where asked."""
    def servers(variants: str) -> int:
        return len(variants.split(",")) if a.parallel_variants else 1

    counts = [0]
    if "smoke" in phases:
        counts.append(runner.in_flight(n, servers(a.smoke_variants)))
    if "features" in phases:
        counts.append(features_mod.in_flight(n, servers(a.feature_variants)))
    return max(counts)


RESTARTED_ENV = "SGLANG_IMAGE_E2E_RESTARTED"


def restart_with_site(site: Site) -> None:
    """Run this command again, once, in a process that starts with the site on its PYTHONPATH
    (Site.env), where this one did not: the driver imports from the site too, as its servers do.
    Only the command line `python -m bench` starts again, before any phase; a call from Python
    (the tests) goes on as it is."""
    restarted = os.environ.pop(RESTARTED_ENV, None) is not None  # kept out of the servers' env
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main_spec is None or main_spec.name != "bench.__main__":
        return
    site.env()
    if site.on_path():
        return
    if restarted:  # python -E or -I: once only
        site.call.log(f"{site.path} is not on this process's path although PYTHONPATH has it "
                      "(python -E or -I?): the checks that import from the site will fail")
        return
    os.environ[RESTARTED_ENV] = "1"
    site.call.log(f"starting again with {site.path} on PYTHONPATH")
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
