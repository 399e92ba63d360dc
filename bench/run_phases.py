"""The e2e driver's models phase and the phases that run servers (smoke, features, bench, comm,
router): each builds its options from the call's flags, resumes from its part of the state (emptied
when the options it depends on changed) and keeps its report in the state."""
from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import comm as comm_mod
from bench import router as router_mod
from bench.call import REPO, Call, Deadline_
from bench.options import BenchOptions, tuning_options
from bench.throughput import run_bench
from sglang_image_plugin.setting import AUTO, parse_threshold
from smoke import features as features_mod
from smoke import run_command, runner
from smoke.scenario import DEFAULT_THRESHOLD, SmokeOptions
from smoke.tiers import Tiers

# model dir -> (`smoke models` args, the phases that use it)
MODELS = {"tiny": (["--size", "tiny", "--draft", "first"], ("smoke", "features")),
          "1b": (["--size", "1b", "--draft", "chain"], ("bench", "router", "smoke", "features")),
          "8b": (["--size", "8b", "--draft", "chain"], ("bench",)),
          "qwen3": (["--arch", "qwen3", "--size", "tp2"], ("comm",))}


def smoke_threshold(text: str) -> tuple[bool, int]:
    """--threshold: (auto, N); with auto the loads (and the feature matrix) use the default N.
    ValueError names a bad value."""
    parsed = parse_threshold(text, source="--threshold", allow_zero=False)
    auto = parsed == AUTO
    return auto, DEFAULT_THRESHOLD if auto else int(parsed)


class RunPhases:
    """Each phase a method, run by the driver (bench.e2e) in the order of --phases."""

    def __init__(self, call: Call, report: Callable[[], None]):
        self.call, self.a = call, call.a
        self.report = report  # OUT written anew: the bench and comm phases call it after each unit

    def models(self) -> None:
        # in a subprocess: the driver must not keep GPU memory while the servers run
        # the smoke and the feature matrix run on --smoke-size, the bench on --bench-size, the
        # router run on the 1B shape; all of them when no phase that runs servers is selected
        by_phase = {"smoke": self.a.smoke_size, "features": self.a.smoke_size,
                    "bench": self.a.bench_size, "router": "1b", "comm": "qwen3"}
        wanted = list(dict.fromkeys(by_phase[ph] for ph in self.call.phases if ph in by_phase)
                      or dict.fromkeys(["tiny", self.a.bench_size, "qwen3"]))
        for name in wanted:
            args = list(MODELS[name][0])
            if "bench" in MODELS[name][1]:  # one 1B folder for the bench, the smoke and the router
                args += ["--draft-accept", str(self.a.bench_draft_accept)]
            d = self.call.models_dir / name
            if (d / "expected.json").exists() and self.call.state.get(f"models_{name}") == args:
                continue
            shutil.rmtree(d, ignore_errors=True)
            p = self.call.sh([sys.executable, "-m", "smoke", "models", str(d), "--device", "cuda", *args],
                             "setup.log", cwd=str(REPO))
            if p.returncode != 0:
                raise RuntimeError(f"models {name}: {p.stderr.strip()[-1500:]}")
            self.call.state[f"models_{name}"] = args
            self.call.save()
            self.call.log(f"models {name}: {p.stdout.strip().splitlines()[-1]}")

    def kernels(self) -> None:
        """`python -m bench verify-kernel` in a subprocess (its GPU memory freed with it), with the
        site on its path as the servers have it; its table in e2e.log, its files with the logs."""
        cmd = [sys.executable, "-m", "bench", "verify-kernel", "--out", str(self.call.logs),
               *shlex.split(self.a.kernel_args)]
        p = self.call.sh(cmd, "kernels.log", cwd=str(REPO))
        self.call.log(p.stdout.strip())
        if p.returncode != 0:
            raise RuntimeError(f"verify-kernel: {(p.stdout + p.stderr).strip()[-1500:]}")

    def smoke(self) -> None:
        st = self.resumable("smoke")
        auto, threshold = smoke_threshold(self.a.threshold)
        schedule = run_command.schedule_option(self.a)
        if schedule is not None:  # the loads come from its edges
            auto, threshold = False, Tiers(schedule).top

        def save() -> None:  # the state, and OUT with the servers' logs so far (logs.tar.gz)
            self.call.save()
            self.report()

        opts = SmokeOptions(models=self.call.models_dir / self.a.smoke_size, out=self.call.logs,
                            auto=auto, threshold=threshold, schedule=schedule,
                            deadline=self.call.deadline, mem_fraction=0.15,
                            variants=tuple(self.a.smoke_variants.split(",")),
                            parallel_variants=self.a.parallel_variants,
                            ramp_minutes=self.a.smoke_ramp_minutes,
                            ramp_max_growth_mib=self.a.smoke_ramp_max_growth_mib,
                            # progress in e2e.log, the state and OUT on disk as each step is
                            # done: a call killed from outside keeps them
                            progress=self.call.log, save_state=save)
        rep = runner.run_smoke(opts, st)
        self.call.state["smoke_report"] = rep
        self.call.log("\n" + runner.summarize(rep))
        if rep.get("skipped"):
            raise Deadline_(f"smoke: skipped {rep['skipped']}")

    def features(self) -> None:
        st = self.resumable("features")
        schedule = run_command.schedule_option(self.a)
        threshold = smoke_threshold(self.a.threshold)[1] if schedule is None else Tiers(schedule).top
        opts = features_mod.FeatureOptions(models=self.call.models_dir / self.a.smoke_size, out=self.call.logs,
                                           graph_bs=self.a.feature_graph_bs, threshold=threshold,
                                           schedule=None if schedule is None else str(schedule),
                                           deadline=self.call.deadline,
                                           variants=tuple(self.a.feature_variants.split(",")),
                                           parallel_variants=self.a.parallel_variants,
                                           cases=self.feature_cases(),
                                           # progress in e2e.log, and the state on disk as each
                                           # case is done: a call killed from outside keeps them
                                           progress=self.call.log, save_state=self.call.save)
        rep = features_mod.run_features(opts, st)
        self.call.state["features_report"] = rep
        self.call.log("\n" + features_mod.summarize(rep))
        if rep.get("skipped"):
            raise Deadline_(f"features: skipped {rep['skipped']}")

    def feature_cases(self) -> tuple[str, ...]:
        return run_command.comma_list(self.a.feature_cases, features_mod.CASE_NAMES, "--feature-cases")

    def options_digest(self, ph: str) -> str:
        """The options a run phase's result depends on: a later call that changes any of them runs the
        phase again instead of reporting the earlier result as its own."""
        setting = self.a.threshold if self.a.schedule is None else f"schedule {self.a.schedule}"
        opts: Any = {"smoke": [setting, self.a.smoke_variants, self.a.smoke_size,
                               *([self.a.smoke_ramp_minutes, self.a.smoke_ramp_max_growth_mib]
                                 if self.a.smoke_ramp_minutes else [])],
                     "features": [setting, self.a.feature_variants, self.a.smoke_size,
                                  self.a.feature_graph_bs, sorted(self.feature_cases())],
                     "bench": [self.a.bench_size, self.a.bench_draft_accept,
                               {k: v for k, v in tuning_options(self.a, "bench-").items()
                                if k != "launch_only"}],
                     "comm": [self.a.comm_runs],
                     "router": [self.a.router_threshold, self.a.router_levels, self.a.router_kill,
                                self.a.bench_draft_accept]}[ph]
        return hashlib.sha256(json.dumps(opts, default=str).encode()).hexdigest()[:10]

    @property
    def bench_key(self) -> str:
        """One bench per model size, mode and options: a later call with other ones runs its own, and
        the report keeps both."""
        return str(self.a.bench_size) + "-" + self.options_digest("bench")

    def resumable(self, ph: str) -> dict[str, Any]:
        """The resume state of the smoke or comm phase, emptied when its options changed."""
        if self.call.state.get(f"{ph}_options") != self.options_digest(ph):
            self.call.state[ph] = {}
            self.call.state[f"{ph}_options"] = self.options_digest(ph)
        phase: dict[str, Any] = self.call.state.setdefault(ph, {})
        return phase

    @property
    def bench_registry(self) -> Path:
        """Where the bench's servers are recorded: they outlive a call on a warm machine."""
        return self.call.state_dir / "bench-servers.json"

    def bench(self) -> None:
        opts = BenchOptions(
            models=self.call.models_dir / self.a.bench_size, out=self.call.logs / f"bench_{self.a.bench_size}",
            deadline=self.call.deadline, pyspy_dirs=(self.call.site_dir / "bin",), registry=self.bench_registry,
            key_extra=str(self.call.state.get("install", "")), **tuning_options(self.a, "bench-"))
        if opts.launch_only:  # the servers start meanwhile; the call that measures keeps the report
            rep = run_bench(opts, {})
            self.call.log(f"bench: servers of {self.a.bench_size} launched: {', '.join(rep['configs'])}")
            return
        runs = self.call.state.setdefault("bench_runs", {})
        if (runs.get(self.bench_key) or {}).get("result", {}).get("failures"):
            # a failed phase runs again (as the others do), not its earlier failure replayed
            self.call.log("bench: the run of an earlier call with these options failed: measured anew")
            runs[self.bench_key] = {}
        st = runs.setdefault(self.bench_key, {})

        def progress(rep: dict[str, Any]) -> None:  # every finished unit is kept, even if this call is killed
            self.call.state.setdefault("bench_reports", {})[self.bench_key] = rep
            self.call.save()
            self.report()

        rep = run_bench(opts, st, progress)
        self.call.state.setdefault("bench_reports", {})[self.bench_key] = rep
        self.call.log("\n" + rep["table"])
        if rep.get("start_failures"):
            raise RuntimeError("a server did not start (the next call starts it again): "
                               + "; ".join(f.splitlines()[0] for f in rep["start_failures"]))
        if rep.get("skipped"):
            raise Deadline_(f"bench: skipped {rep['skipped']}")

    def comm(self) -> None:
        st = self.resumable("comm")
        opts = comm_mod.CommOptions(model=self.call.models_dir / "qwen3", out=self.call.logs,
                                    deadline=self.call.deadline, runs=tuple(self.a.comm_runs.split(",")))

        def progress(rep: dict[str, Any]) -> None:  # OUT is current after every server
            self.call.state["comm_report"] = rep
            self.call.save()
            self.report()

        rep = comm_mod.run_comm(opts, st, progress)
        self.call.state["comm_report"] = rep
        self.call.log("\n" + comm_mod.summarize(rep))
        if rep.get("skipped"):
            raise Deadline_(f"comm: skipped {rep['skipped']}")

    def router(self) -> None:
        opts = router_mod.RouterOptions(
            models=self.call.models_dir / "1b", out=self.call.logs / "router", deadline=self.call.deadline,
            threshold=self.a.router_threshold,
            levels=tuple(int(c) for c in self.a.router_levels.split(",")),
            kill_level=self.a.router_levels.count(",") if self.a.router_kill else -1)
        if self.call.deadline.left() < 420:  # three starts side by side, the router, the levels
            raise Deadline_(f"router: not started with {self.call.deadline.left():.0f}s left (~420 s needed)")
        rep = router_mod.run_router(opts)
        self.call.state["router_report"] = rep
        self.call.log("\n" + rep["summary"])
