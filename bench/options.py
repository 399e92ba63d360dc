"""`bench run`'s options: one BenchOptions per call, built from the command line (and from e2e's
--bench-* flags), validated once; which servers the configs name; the state key that a resumed
call must match."""
from __future__ import annotations

import argparse
import json
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import depth_choice
from bench.configs import (
    CONFIGS,
    DELAYER_PASSES,
    DELAYER_RATIO,
    EXTEND_VERIFY,
    HEADWISE_VERIFY,
    LAUNCH_STEPS,
    METADATA_GLUE,
    PREFILL_DELAYER,
    PREFILL_GRAPHS,
    SPLITS_BY_LOAD,
    TWIN,
    TWINS,
    UPSTREAM_COMBINE,
    WITH_FLAGS,
    BenchConfig,
    expand,
)
from sglang_image_plugin.setting import (
    DEPTH_SCHEDULE_EXAMPLE,
    DEPTH_SCHEDULE_FLAG,
    parse_schedule_or_auto,
)
from smoke.deadline import Deadline

DEFAULT_CONFIGS = ("plain", "eagle3", "eagle3_thr")  # the promise: a threshold against both fixed modes
DEFAULT_CONCURRENCY = (1, 4, 16, 64, 256)


@dataclass
class BenchOptions:
    models: Path
    out: Path
    thresholds: tuple[int, ...] = (16,)  # eagle3_thr: one server per fixed threshold (a sweep)
    depths: tuple[int, ...] = (1, 2)  # eagle3_depth: one always-on EAGLE-3 server per draft depth
    schedules: tuple[str, ...] = (DEPTH_SCHEDULE_EXAMPLE,)  # eagle3_sched: one server per schedule
    auto_depth: int = LAUNCH_STEPS  # the draft steps eagle3_sched's `auto` launches with (the deepest it learns)
    delayer_ratio: float = DELAYER_RATIO  # the *_prefill_delayer configs' queue trigger
    delayer_passes: int = DELAYER_PASSES  # and the most scheduler passes they hold a prefill
    # the switching servers (a threshold, auto) start without --max-running-requests and a decode
    # graph size, as the README's Serve command does: the plugin keeps a plain server's limits
    switching_defaults: bool = False
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    pairs: int = 6  # blocks per concurrency, the order reversed every other one
    window_s: float = 3.0  # the counted part of a window
    settle_s: float = 1.0  # ... after this long under load
    ramp_cycles: int = 0  # 0: no ramp
    ramp_hold_s: float = 2.0
    output_len: int = 256  # the mean output length of a request
    # each request's output length is drawn uniform within output_len * (1 -+ output_spread), the
    # same on every server: with one length for all, the requests a window starts together end
    # together, and a server that keeps them in step (plain steps) prefills their successors in a
    # few large batches, one that does not (speculation accepts per request) in many small ones
    output_spread: float = 0.25
    # `auto` servers run this long under the window's load at every concurrency before the blocks:
    # it learns where speculation stops paying once per batch size, as a serving server has done
    auto_learn_s: float = 5.0
    # at most this much longer at a level while eagle3_auto runs a trial there (auto_threshold.Trial)
    auto_trial_s: float = 20.0
    port: int = 30000  # the first port tried; each server takes the next free one
    # each server's --mem-fraction-static: the most of the memory free at its start that it may
    # count for its weights and KV pool; the pool itself is max_total_tokens, the same for all
    mem_share: float = 0.85
    # --max-total-tokens of every server (0: room for the top concurrency's requests)
    max_total_tokens: int = 0
    server_args: tuple[str, ...] = ()  # appended to every server's flags
    # every server's environment besides its own record's (the record wins: eagle3_extend_verify's 0)
    server_env: tuple[tuple[str, str], ...] = ()
    cpus_per_server: int = 0  # each server pinned to this many CPUs of its own (0: no pinning)
    diagnose: bool = False
    device_timer: bool = False  # GPU seconds per window (diagnose's device timer, without its solo units)
    pyspy_dirs: tuple[Path, ...] = ()  # --diagnose: where to look for py-spy besides PATH
    registry: Path | None = None  # where the servers are recorded to outlive the call (None: they stop with it)
    key_extra: str = ""  # what else a reused server must match (e2e: the installed site)
    launch_only: bool = False  # start the servers and return (they warm up in the call that measures)
    deadline: Deadline = field(default_factory=lambda: Deadline(time.time() + 3600))
    health_timeout: float = 480


def config_records(opts: BenchOptions) -> dict[str, BenchConfig]:
    """Every server's record (bench.configs), by its name."""
    return {rec.name: rec for rec in expand(opts.configs, opts.thresholds, opts.depths, opts.schedules,
                                         opts.auto_depth, opts.delayer_ratio, opts.delayer_passes)}


def server_names(opts: BenchOptions) -> list[str]:
    """The servers of the configs, in order: a sweep becomes one per value (eagle3_thr16, ...)."""
    return list(config_records(opts))


FROM_BENCH = "from:"  # --schedule from:BENCH_JSON: the schedule `bench schedule BENCH_JSON` prints


def resolved_schedule(text: str, source: str) -> str:
    """A --schedule value as the server takes it: `auto`, a schedule, or the one a bench of fixed
    depths measured (from:BENCH_JSON, read when the options are, so the record holds the tiers)."""
    if text.startswith(FROM_BENCH):
        return depth_choice.schedule_of(Path(text.removeprefix(FROM_BENCH)))
    return str(parse_schedule_or_auto(text, source=source))


def add_tuning_arguments(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """What to measure and how: shared by `bench run` and `bench e2e` (there as --bench-*)."""
    p = "--" + prefix
    ap.add_argument(p + "configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma list of {','.join(CONFIGS)} ({TWIN}: a second plain server, the A/A "
                         "noise floor; eagle3_twin: a second always-on EAGLE-3 server, the floor where EAGLE-3 "
                         "is the better mode; eagle3_extend_verify: eagle3 with upstream's split-KV verify kernel "
                         f"off, {'='.join(EXTEND_VERIFY)}; eagle3_headwise_verify: eagle3 with the split-KV "
                         f"verify's prefix stage upstream's, one program a query head, {'='.join(HEADWISE_VERIFY)}; "
                         f"eagle3_upstream_combine: eagle3 with upstream's split combine, not the plugin's "
                         f"looped one, {'='.join(UPSTREAM_COMBINE)} (eagle3_sched_upstream_combine: eagle3_sched "
                         "with it); eagle3_splits_by_load: eagle3 with the verify's prefix cut by the batch's "
                         f"size, {'='.join(SPLITS_BY_LOAD)}; "
                         f"eagle3_metadata_glue: eagle3 with upstream's metadata glue "
                         f"graph, {'='.join(METADATA_GLUE)}; eagle3_thr_prefill_graphs: eagle3_thr writing a "
                         f"prefill's draft K/V in plain mode from CUDA graphs, {'='.join(PREFILL_GRAPHS)}; "
                         f"plain_prefill_delayer, eagle3_prefill_delayer, eagle3_sched_prefill_delayer: the "
                         f"config started with upstream's prefill delayer, {' '.join(PREFILL_DELAYER)} (overlap "
                         "scheduler only); eagle3_auto runs only where the server has it)")
    ap.add_argument(p + "delayer-ratio", type=float, default=DELAYER_RATIO,
                    help="the *_prefill_delayer configs' queue trigger: a prefill waits until the running "
                         "requests times RATIO wait (upstream's --prefill-delayer-queue-min-ratio; "
                         f"default {DELAYER_RATIO:g}: from 16 running requests up, 0.0625: from 32)")
    ap.add_argument(p + "delayer-passes", type=int, default=DELAYER_PASSES,
                    help="the *_prefill_delayer configs hold a prefill for at most N scheduler passes "
                         "(decode steps), which bounds what the delayer adds to the time to first token "
                         f"(upstream's --prefill-delayer-max-delay-passes; default {DELAYER_PASSES})")
    ap.add_argument(p + "concurrency", default=",".join(map(str, DEFAULT_CONCURRENCY)),
                    help="comma list of closed-loop loads, measured in the order given (a switching "
                         "server carries what one load taught it into the next: 256,192 shows a "
                         "learned crossover after a higher load); the report sorts them")
    ap.add_argument(p + "threshold", default="16",
                    help="eagle3_thr's fixed threshold N; a comma list runs one server per N (a sweep)")
    ap.add_argument(p + "depth", default="1,2",
                    help="eagle3_depth's draft depths d, a comma list: one always-on EAGLE-3 server per d, "
                         "drafting d steps and verifying d + 1 tokens a request (eagle3 itself drafts 3)")
    ap.add_argument(p + "schedule", default=DEPTH_SCHEDULE_EXAMPLE,
                    help=f"eagle3_sched's draft depth per load (the server's {DEPTH_SCHEDULE_FLAG}); "
                         "several separated by ';' run one server each; `auto`: the server learns it; "
                         f"{FROM_BENCH}BENCH_JSON: the one `bench schedule BENCH_JSON` reads off a bench of "
                         "fixed depths (a call before this one)")
    ap.add_argument(p + "auto-depth", type=int, default=LAUNCH_STEPS,
                    help="the draft steps a --schedule auto server launches with: it learns a depth "
                         f"of 0 to this per load (default {LAUNCH_STEPS}, as eagle3)")
    ap.add_argument(p + "switching-defaults", action="store_true",
                    help="start the threshold and auto servers without --max-running-requests and a "
                         "decode graph size, as the README's Serve command does (the others get the "
                         "top concurrency); each server's limit is checked against the top concurrency")
    ap.add_argument(p + "pairs", type=int, default=6,
                    help="blocks per concurrency, each a window on every server, the order reversed "
                         "every other block (0: the ramp alone)")
    ap.add_argument(p + "window-s", type=float, default=3.0,
                    help="seconds of a window whose output tokens are counted")
    ap.add_argument(p + "settle-s", type=float, default=1.0,
                    help="seconds under load before a window starts counting")
    ap.add_argument(p + "output-spread", type=float, default=0.25,
                    help="each request's output length uniform within the mean (--output-len) times "
                         "1 -+ this, the same on every server (0: all alike; then the requests a window "
                         "starts together end together, which rewards a server that keeps them in step)")
    ap.add_argument(p + "auto-learn-s", type=float, default=5.0,
                    help="seconds eagle3_auto runs each level's load before the blocks (0: it learns in "
                         "the first block, as a newly started server does)")
    ap.add_argument(p + "auto-trial-s", type=float, default=20.0,
                    help="at most this many seconds more at a level of the learning pass while eagle3_auto "
                         "runs a trial (both modes in turn on a tied bucket): a trial the pass began ends "
                         "in it, not in the blocks (0: the pass never runs longer)")
    ap.add_argument(p + "ramp-cycles", type=int, default=0, help="ramp up and down this many times (0: none)")
    ap.add_argument(p + "ramp-hold", type=float, default=2.0, help="seconds per ramp level")
    ap.add_argument(p + "mem-share", type=float, default=0.85,
                    help="each server's --mem-fraction-static (the pool itself is --max-total-tokens)")
    ap.add_argument(p + "max-total-tokens", type=int, default=0,
                    help="KV pool of every server (0: room for the top concurrency's requests)")
    ap.add_argument(p + "cpus-per-server", type=int, default=0,
                    help="pin each server to this many CPUs of its own, the client to one more; with 2 or "
                         "more the server's scheduler thread has the first to itself (0, the default: no "
                         "pinning; 3 CPUs each did not narrow the A/A floor on an H200 host)")
    ap.add_argument(p + "server-args", default="",
                    help="extra flags for every server, one shell-quoted string (e.g. '--gc-threshold 50000')")
    ap.add_argument(p + "server-env", default="",
                    help="environment variables for every server, NAME=VALUE separated by spaces (e.g. "
                         "'SGLANG_ENABLE_SPLITKV_VERIFY=1'); a config's own value of one wins "
                         "(eagle3_extend_verify keeps its 0)")
    ap.add_argument(p + "diagnose", action="store_true",
                    help="also where each server's time goes at full load (py-spy, torch profiler, device timer)")
    ap.add_argument(p + "device-timer", action="store_true",
                    help="GPU seconds per window from each server's device timer (the host's share of a "
                         "decode step is the rest), without --diagnose's full-load units")
    ap.add_argument(p + "launch-only", action="store_true",
                    help="start the servers (recorded: they outlive this call) and return; the next call "
                         "with the same options warms them up and measures")


def tuning_options(a: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """BenchOptions fields from add_tuning_arguments' flags; a bad value exits naming the flag."""
    def get(name: str) -> Any:
        return getattr(a, (prefix + name).replace("-", "_"))

    def refuse(flag: str, why: str) -> SystemExit:
        return SystemExit(f"--{prefix}{flag} {get(flag)!r}: {why}")

    configs = tuple(x.strip() for x in get("configs").split(",") if x.strip())
    if not configs or any(c not in CONFIGS for c in configs) or len(set(configs)) < len(configs):
        raise refuse("configs", f"give distinct names among {','.join(CONFIGS)}")
    for twin, base in TWINS.items():
        if twin in configs and base not in configs:
            raise refuse("configs", f"{twin} is measured against {base}: add {base}")
    conc = [x.strip() for x in get("concurrency").split(",") if x.strip()]
    if not conc or not all(x.isdigit() and int(x) >= 1 for x in conc) or len(set(conc)) < len(conc):
        raise refuse("concurrency", "give distinct whole numbers >= 1, e.g. 1,2,4,8")
    thresholds = [x.strip() for x in str(get("threshold")).split(",") if x.strip()]
    if not thresholds or not all(x.isdigit() and int(x) >= 1 for x in thresholds) or len(set(thresholds)) < len(thresholds):
        raise refuse("threshold", "give distinct whole numbers >= 1, e.g. 16 or 8,16,32")
    depths = [x.strip() for x in str(get("depth")).split(",") if x.strip()]
    if not depths or not all(x.isdigit() and int(x) >= 1 for x in depths) or len(set(depths)) < len(depths):
        raise refuse("depth", "give distinct draft depths >= 1, e.g. 1,2")
    schedules = [x.strip() for x in str(get("schedule")).split(";") if x.strip()]
    try:
        schedules = [resolved_schedule(x, f"--{prefix}schedule") for x in schedules]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    except depth_choice.NoDepths as exc:
        raise refuse("schedule", str(exc)) from None
    if not schedules or len(set(schedules)) < len(schedules):
        raise refuse("schedule", "give one or more distinct schedules separated by ';', e.g. 1-16:3,17-:0")
    if get("auto-depth") < 1:
        raise refuse("auto-depth", f"must be >= 1 draft steps (default {LAUNCH_STEPS})")
    if not 0 < get("delayer-ratio") <= 1:
        raise refuse("delayer-ratio", "must be in (0, 1]: the share of the running requests that must wait "
                                      f"before a prefill runs (default {DELAYER_RATIO:g})")
    if get("delayer-passes") < 1:
        raise refuse("delayer-passes", "must be >= 1 scheduler passes (1: a prefill is never held; "
                                       f"default {DELAYER_PASSES})")
    if get("pairs") < 0:
        raise refuse("pairs", "must be >= 0 (0: the ramp alone)")
    if not get("window-s") > 0:
        raise refuse("window-s", "must be > 0 seconds (longer windows: less noise, a longer run)")
    if get("settle-s") < 0:
        raise refuse("settle-s", "must be >= 0 seconds")
    if not 0 <= get("output-spread") < 1:
        raise refuse("output-spread", "must be in [0, 1): lengths within the mean times 1 -+ it")
    if get("auto-learn-s") < 0:
        raise refuse("auto-learn-s", "must be >= 0 seconds (0: no learning before the blocks)")
    if get("auto-trial-s") < 0:
        raise refuse("auto-trial-s", "must be >= 0 seconds (0: the learning pass never runs longer)")
    if get("ramp-cycles") < 0 or get("ramp-hold") <= 0 or get("pairs") + get("ramp-cycles") == 0:
        raise SystemExit(f"--{prefix}ramp-cycles {get('ramp-cycles')} / --{prefix}ramp-hold {get('ramp-hold')}: "
                         f"need cycles >= 0 (> 0 with --{prefix}pairs 0) and a hold > 0 seconds")
    if not 0 < get("mem-share") < 1:
        raise refuse("mem-share", "must be between 0 and 1")
    if get("max-total-tokens") < 0:
        raise refuse("max-total-tokens", "must be >= 0 (0: sized for the top concurrency)")
    if get("cpus-per-server") < 0:
        raise refuse("cpus-per-server", "must be >= 0 (0: no pinning)")
    server_args = tuple(shlex.split(get("server-args")))
    delayed = [c for c in configs if c in WITH_FLAGS and "--enable-prefill-delayer" in WITH_FLAGS[c][1]]
    if delayed and "--disable-overlap-schedule" in server_args:
        raise refuse("server-args", f"{', '.join(delayed)} start upstream's prefill delayer, which runs only "
                                    f"on the overlap scheduler: drop them from --{prefix}configs, or drop "
                                    "--disable-overlap-schedule")
    server_env = []
    for item in shlex.split(get("server-env")):
        name, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise refuse("server-env", f"{item!r} is not NAME=VALUE (e.g. SGLANG_ENABLE_SPLITKV_VERIFY=1)")
        server_env.append((name, value))
    return {"configs": configs, "concurrency": tuple(int(x) for x in conc),
            "thresholds": tuple(sorted(int(x) for x in thresholds)),
            "depths": tuple(sorted(int(x) for x in depths)), "schedules": tuple(schedules),
            "auto_depth": get("auto-depth"), "delayer_ratio": get("delayer-ratio"),
            "delayer_passes": get("delayer-passes"),
            "switching_defaults": get("switching-defaults"), "pairs": get("pairs"),
            "window_s": get("window-s"), "settle_s": get("settle-s"),
            "output_spread": get("output-spread"), "auto_learn_s": get("auto-learn-s"),
            "auto_trial_s": get("auto-trial-s"),
            "ramp_cycles": get("ramp-cycles"), "ramp_hold_s": get("ramp-hold"),
            "mem_share": get("mem-share"), "max_total_tokens": get("max-total-tokens"),
            "cpus_per_server": get("cpus-per-server"),
            "server_args": server_args, "server_env": tuple(server_env),
            "diagnose": get("diagnose"),
            "device_timer": get("device-timer"), "launch_only": get("launch-only")}


# options that change neither what a window measures nor which windows exist: a state measured
# without them goes on with them
NOT_IN_STATE_KEY = ("deadline", "out", "port", "health_timeout", "registry", "key_extra", "launch_only",
                    "pyspy_dirs")


def state_key(opts: BenchOptions) -> str:
    return json.dumps({k: v for k, v in vars(opts).items() if k not in NOT_IN_STATE_KEY},
                      default=str, sort_keys=True)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", type=Path, help="a target and draft (python -m smoke models)")
    # a run's raw report stays out of the tree; docs/validation.md keeps one row of its figures
    ap.add_argument("--out", type=Path, default=Path("out/bench"))
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--port", type=int, default=30000, help="the first port tried for a server")
    ap.add_argument("--deadline", type=float, default=7200, help="seconds from now")
    ap.add_argument("--state", type=Path, metavar="FILE",
                    help="keep what is measured here, and the servers running (recorded beside it, "
                         "FILE.servers.json); the same command again goes on where a deadline stopped it")
    ap.add_argument("--stop", action="store_true",
                    help="stop the servers that --state FILE's calls left running, and exit")
    ap.add_argument("--render", type=Path, metavar="BENCH_JSON",
                    help="only write the tables and plots of a saved result into --out")
    add_tuning_arguments(ap)


def registry_of(state: Path) -> Path:
    return state.with_name(state.name + ".servers.json")


def options(a: argparse.Namespace) -> BenchOptions:
    if a.models is None:
        raise SystemExit("--models DIR is needed (a target and draft: python -m smoke models DIR --size 1b)")
    if a.output_len < 1:
        raise SystemExit(f"--output-len {a.output_len}: must be >= 1")
    registry = registry_of(a.state) if a.state is not None else None
    if a.launch_only and registry is None:
        raise SystemExit("--launch-only needs --state FILE: the servers it starts are recorded beside it")
    return BenchOptions(models=a.models, out=a.out, output_len=a.output_len, port=a.port, registry=registry,
                        deadline=Deadline(time.time() + a.deadline), **tuning_options(a))


def load_state(path: Path | None, opts: BenchOptions) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    """`--state FILE`'s state, and the function that writes it after every unit. A state measured
    with other options is refused: its windows would be mixed with these."""
    key = state_key(opts)
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
