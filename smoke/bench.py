"""Output tokens/s of plain decoding, always-on EAGLE-3, upstream's adaptive EAGLE-3, a fixed
speculation-disable threshold and `auto`, on servers started here (a GPU host, no Docker needed).

    python -m smoke bench --models DIR --out docs/bench [--configs plain,eagle3,...]
                          [--concurrency 1,2,4,...,256] [--rounds 2] [--threshold 16[,32,...]]
                          [--ramp-cycles 3 --ramp-hold 2] [--diagnose]

DIR holds a target and an EAGLE-3 draft (`python -m smoke models DIR --size 1b --draft chain
--device cuda`).
All servers run at once and every load goes to each of them in turn, the order reversed every other
time, so that each ratio compares measurements seconds apart: a host's speed can drift by tens of
percent within minutes, which one server measured after another would read as a difference
between them. Greedy prompts of fixed lengths; every output is compared with plain decoding's.

- Closed loop: at concurrency c, c clients each send their next request when the last one ends.
- Ramp: the number of clients steps through the concurrencies up to the top and back down, several
  times, a level every --ramp-hold seconds; tokens/s per level and, for the threshold servers, the
  mode they are in (and auto's crossover) over time.

Writes under --out: bench.json (every measurement), bench.md (the tables), concurrency.png and
ramp.png (matplotlib; `--render bench.json` draws them again elsewhere). `auto` runs only where the
server has it (the sglang-image-plugin with its auto threshold). --diagnose adds where each
server's time goes at full load (smoke.diagnose).
"""
from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import random
import shlex
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smoke import bench_report, client, diagnose
from smoke.client import Prompt
from smoke.runner import Deadline, SmokeError, check_log_clean, spec_state
from smoke.server import Server, ServerConfig, log_tail

CONFIGS = ("plain", "eagle3", "eagle3_adaptive", "eagle3_thr", "eagle3_auto")
THRESHOLD_FLAG = "--speculative-disable-batch-threshold"
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256)
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
START_S_PER_SERVER = 75  # a server's start, budgeted (59-111 s seen on an H200, 1B and 8B shapes)
MODE_POLL_S = 0.5  # how often the ramp asks a threshold server for its mode


@dataclass
class BenchOptions:
    models: Path
    out: Path
    thresholds: tuple[int, ...] = (16,)  # eagle3_thr: one server per fixed threshold (a sweep)
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    configs: tuple[str, ...] = CONFIGS
    rounds: int = 2  # closed-loop rounds; each level alternates the server order
    ramp_cycles: int = 3  # 0: no ramp
    ramp_hold_s: float = 2.0
    output_len: int = 256
    port: int = 30000
    # of the GPU memory free before the first server, shared evenly among the servers
    mem_share: float = 0.85
    # --max-total-tokens of every server (0: room for the top concurrency's requests, the same for
    # all: a server started later would otherwise get a smaller KV pool and evict where others do not)
    max_total_tokens: int = 0
    server_args: tuple[str, ...] = ()  # appended to every server's flags
    diagnose: bool = False
    pyspy_dirs: tuple[Path, ...] = ()  # --diagnose: where to look for py-spy besides PATH
    deadline: Deadline = field(default_factory=lambda: Deadline(time.time() + 3600))
    health_timeout: float = 420


# ----------------------------------------------------------------------------- what runs
def auto_supported() -> bool:
    """Whether this Python's sglang takes `--speculative-disable-batch-threshold auto` (the plugin
    that implements it is installed); read from the package metadata, without importing sglang."""
    try:
        files = importlib.metadata.distribution("sglang-image-plugin").files or []
    except importlib.metadata.PackageNotFoundError:
        return False
    return any(f.name == "auto_threshold.py" for f in files)


def server_config(name: str, opts: BenchOptions, mem_fraction: float = 0.3,
                  max_total_tokens: int = 0) -> ServerConfig:
    top = max(opts.concurrency)
    cfg = ServerConfig(name, opts.models / "target", cuda_graph=True, cuda_graph_max_bs=top,
                       max_running=top, mem_fraction=round(mem_fraction, 3), enable_metrics=True)
    extra: list[str] = ["--sleep-on-idle"]  # a server waiting for its turn must not spin a core
    if name != "plain":
        cfg.draft = opts.models / "draft"
    if name.startswith("eagle3_thr"):
        cfg.threshold = int(name.removeprefix("eagle3_thr"))
    if name == "eagle3_auto":
        extra += [THRESHOLD_FLAG, "auto"]
    if name == "eagle3_adaptive":
        extra += ["--speculative-adaptive", "--speculative-adaptive-config", str(opts.out / "adaptive_config.json")]
    if max_total_tokens:
        extra += ["--max-total-tokens", str(max_total_tokens)]
    if opts.diagnose:
        cfg.env.update(diagnose.SERVER_ENV)
    cfg.extra = (*extra, *opts.server_args)
    return cfg


def server_names(opts: BenchOptions) -> list[str]:
    """The servers of the configs, in order: eagle3_thr becomes one per threshold (eagle3_thr16, ...)."""
    names: list[str] = []
    for name in opts.configs:
        names += [f"eagle3_thr{n}" for n in opts.thresholds] if name == "eagle3_thr" else [name]
    return names


def workload(vocab: int, concurrency: int, output_len: int, seed: int) -> list[Prompt]:
    """Prompts for one closed-loop window: a few seconds of traffic per level (8 per client below 64
    clients, 3 waves above), the same for every server."""
    rnd = random.Random(seed * 1000 + concurrency)
    n = 8 * concurrency if concurrency < 64 else 3 * concurrency
    return [Prompt(f"c{concurrency}-{i}", tuple(rnd.randrange(3, vocab) for _ in range(rnd.randint(32, 64))),
                   output_len) for i in range(n)]


def ramp_prompt(vocab: int, output_len: int, key: str) -> Prompt:
    """The ramp's prompt of one client's k-th request: the same on every server."""
    rnd = random.Random(key)
    return Prompt(key, tuple(rnd.randrange(3, vocab) for _ in range(rnd.randint(32, 64))), output_len)


def ramp_levels(concurrency: tuple[int, ...], cycles: int) -> list[int]:
    """Up through every concurrency to the top and back down, `cycles` times."""
    levels = sorted(concurrency)
    out: list[int] = []
    for _ in range(cycles):
        out += levels[:-1] + levels[::-1][:-1]
    return [*out, levels[0]] if cycles else []


def pool_tokens(opts: BenchOptions, vocab: int) -> int:
    """KV room for the top concurrency's running requests with a quarter to spare."""
    longest = max(len(p.input_ids) for p in workload(vocab, max(opts.concurrency), opts.output_len, 0))
    return int(1.25 * max(opts.concurrency) * (longest + opts.output_len))


def switches(name: str) -> bool:
    """Whether the server switches between speculative and plain steps itself (a threshold, auto)."""
    return name.startswith("eagle3_thr") or name == "eagle3_auto"


def round_order(names: list[str], k: int) -> list[str]:
    return names if k % 2 == 0 else names[::-1]


# ----------------------------------------------------------------------------- measuring
def flush_cache(base: str) -> None:
    """Empty the radix cache before a window: every window starts from the same empty cache."""
    try:
        client.post(base + "/flush_cache?timeout=10", {}, 30)
    except client.HTTPFailure:
        pass


def measure(base: str, prompts: list[Prompt], concurrency: int, timeout: float) -> dict[str, Any]:
    t0 = time.time()
    res = client.run_concurrent(base, prompts, concurrency, timeout)
    wall = time.time() - t0
    errors = [r for r in res if r.error]
    toks = sum(len(r.output_ids or []) for r in res)
    lens = [r.meta["spec_accept_length"] for r in res if "spec_accept_length" in r.meta]
    return {"requests": len(res), "errors": len(errors), "first_error": errors[0].error if errors else None,
            "output_tokens": toks, "seconds": round(wall, 3), "tok_per_s": round(toks / wall, 1),
            "accept_length": round(statistics.mean(lens), 3) if lens else None,
            "outputs": {r.key: r.output_ids for r in res}}


def speculation_state(base: str) -> dict[str, Any]:
    """The server's dynamic speculation disable state, from /server_info (sglang >= 0.5.23 logs a
    deprecation warning for each /get_server_info, which older ones alone serve)."""
    try:
        info = client.get_json(base + "/server_info")
    except client.HTTPFailure:
        info = client.server_info(base)
    return spec_state(info)


def mode_of(base: str) -> tuple[str | None, int | None, int | None]:
    """A threshold server's mode, crossover (auto) and mode-change count; Nones where it says nothing."""
    try:
        st = speculation_state(base)
    except (SmokeError, client.HTTPFailure, ValueError):
        return None, None, None
    crossover = st.get("crossover")
    return st.get("mode"), crossover if isinstance(crossover, int) else None, st.get("mode_changes")


def run_ramp(base: str, levels: list[int], hold_s: float, vocab: int, output_len: int, timeout: float,
             poll: Callable[[], tuple[str | None, int | None, int | None]] | None) -> dict[str, Any]:
    """Closed loop whose number of clients follows `levels`, one every `hold_s` seconds. Returns per
    level its tokens/s (each request's tokens spread over its lifetime) and the modes polled."""
    top = max(levels)
    t0 = time.time()
    end = t0 + hold_s * len(levels)
    done: list[tuple[float, float, int, str, list[int] | None, str | None]] = []
    lock = threading.Lock()
    samples: list[tuple[float, str | None, int | None]] = []
    first_changes: list[int | None] = []

    def level_at(t: float) -> int:
        return levels[min(int((t - t0) / hold_s), len(levels) - 1)]

    def worker(w: int) -> None:
        k = 0
        while (now := time.time()) < end:
            if w >= level_at(now):
                time.sleep(0.02)
                continue
            key = f"ramp-{w}-{k}"
            k += 1
            r = client.generate(base, ramp_prompt(vocab, output_len, key), timeout)
            with lock:
                done.append((now - t0, time.time() - t0, len(r.output_ids or []), key, r.output_ids, r.error))

    def poller() -> None:
        while time.time() < end:
            mode, crossover, changes = poll() if poll else (None, None, None)
            if not first_changes:
                first_changes.append(changes)
            samples.append((time.time() - t0, mode, crossover))
            time.sleep(MODE_POLL_S)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(top)]
    threads.append(threading.Thread(target=poller, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, end - time.time()) + timeout)
    last_changes = poll()[2] if poll else None
    windows = ramp_windows(levels, hold_s, [(start, stop, n) for start, stop, n, *_ in done], samples)
    errors = [e for *_, e in done if e]
    mode_changes = (last_changes - first_changes[0] if isinstance(last_changes, int) and first_changes
                    and isinstance(first_changes[0], int) else None)
    return {"windows": windows, "requests": len(done), "errors": len(errors),
            "first_error": errors[0] if errors else None, "mode_changes": mode_changes,
            "outputs": {key: ids for *_, key, ids, err in done if not err}}


def ramp_windows(levels: list[int], hold_s: float, requests: list[tuple[float, float, int]],
                 samples: list[tuple[float, str | None, int | None]]) -> list[dict[str, Any]]:
    """One window per level: tokens/s, each request's (start s, end s, tokens) spread evenly over its
    lifetime; the share of the mode samples (s, mode, crossover) that said plain, the last crossover."""
    windows = []
    for i, level in enumerate(levels):
        lo, hi = i * hold_s, (i + 1) * hold_s
        tokens = sum(n * max(0.0, min(stop, hi) - max(start, lo)) / (stop - start)
                     for start, stop, n in requests if stop > start)
        modes = [m for t, m, _ in samples if lo <= t < hi and m]
        crossovers = [c for t, _, c in samples if lo <= t < hi and c is not None]
        windows.append({"t": lo, "level": level, "tok_per_s": round(tokens / hold_s, 1),
                        "plain_share": round(modes.count("plain") / len(modes), 2) if modes else None,
                        "crossover": crossovers[-1] if crossovers else None})
    return windows


def warm_up(base: str, opts: BenchOptions) -> None:
    """Short requests at every concurrency outside the measurement: lazy JIT and autotuning per
    batch shape and per mode."""
    for c in opts.concurrency:
        client.run_concurrent(base, [Prompt(f"w{c}-{i}", (5 + i % 50, 6, 7, 8), 32) for i in range(max(2, c))],
                              c, opts.deadline.request_timeout(240))


def kv_used_after_flush(base: str) -> int | None:
    """Tokens still held in the KV pool once the load is over and the radix cache flushed (0 when
    every request gave back what it took)."""
    for _ in range(10):
        flush_cache(base)
        try:
            used = int(client.load(base).get("num_used_tokens") or 0)
        except (client.HTTPFailure, KeyError, IndexError, TypeError, ValueError):
            return None
        if used == 0:
            return 0
        time.sleep(1)
    return used


# ----------------------------------------------------------------------------- the run
def start_servers(opts: BenchOptions, names: list[str], tokens: int, result: dict[str, Any]) -> dict[str, Server]:
    """One after another, each taking an even share of the memory still free."""
    servers: dict[str, Server] = {}
    for k, name in enumerate(names):
        cfg = server_config(name, opts, opts.mem_share / (len(names) - k), tokens)
        srv = servers[name] = Server(cfg, opts.port + k, opts.out / f"server_bench_{name}.log")
        srv.start(min(opts.health_timeout, opts.deadline.left() - 45))
        result["start_s"][name] = round(srv.start_seconds, 1)
        try:
            result["kv_pool_tokens"][name] = int(client.load(srv.base).get("max_total_num_tokens") or 0)
        except (client.HTTPFailure, KeyError, IndexError, TypeError, ValueError):
            result["kv_pool_tokens"][name] = 0
    return servers


def closed_loop(servers: dict[str, Server], names: list[str], opts: BenchOptions, vocab: int,
                result: dict[str, Any]) -> None:
    """`opts.rounds` rounds over the concurrencies; each level's windows in alternating order."""
    round_s = 0.0
    for k in range(opts.rounds):
        if opts.deadline.left() < round_s + 60:
            result["skipped"].append(f"closed loop: {k} of {opts.rounds} rounds (deadline)")
            return
        t0 = time.time()
        outputs: dict[str, dict[str, list[int] | None]] = {n: {} for n in names}
        for i, c in enumerate(opts.concurrency):
            prompts = workload(vocab, c, opts.output_len, 100 + k)
            for name in round_order(names, k + i):
                srv = servers[name]
                flush_cache(srv.base)
                before = diagnose.scrape(srv.base) if opts.diagnose else {}
                m = measure(srv.base, prompts, c, opts.deadline.request_timeout(240))
                if opts.diagnose:
                    m["gpu_s"] = diagnose.gpu_seconds(before, diagnose.scrape(srv.base))
                outputs[name].update(m.pop("outputs"))
                m["round"] = k + 1
                result["levels"].setdefault(str(c), {}).setdefault(name, []).append(m)
        result["mismatches"] += mismatches(outputs, f"round {k + 1}")
        round_s = time.time() - t0


def ramp_all(servers: dict[str, Server], names: list[str], opts: BenchOptions, vocab: int,
             result: dict[str, Any]) -> None:
    levels = ramp_levels(opts.concurrency, opts.ramp_cycles)
    need = opts.ramp_hold_s * len(levels) + 60
    outputs: dict[str, dict[str, list[int] | None]] = {}
    for name in names:
        if opts.deadline.left() < need:
            result["skipped"].append(f"ramp of {name} (deadline)")
            continue
        srv = servers[name]
        flush_cache(srv.base)
        poll = functools.partial(mode_of, srv.base) if switches(name) else None
        r = run_ramp(srv.base, levels, opts.ramp_hold_s, vocab, opts.output_len,
                     opts.deadline.request_timeout(240), poll)
        outputs[name] = r.pop("outputs")
        result["ramp"][name] = r
    result["mismatches"] += mismatches(outputs, "ramp")


def mismatches(outputs: dict[str, dict[str, list[int] | None]], where: str) -> list[str]:
    """Every config's outputs against plain's for the same prompts (greedy: they must be equal)."""
    ref = outputs.get("plain", {})
    problems = []
    for name, got in outputs.items():
        bad = [k for k, v in got.items() if name != "plain" and v is not None and ref.get(k) not in (None, v)]
        if bad:
            problems.append(f"{where} {name}: {len(bad)} output(s) differ from plain (e.g. {bad[0]})")
    return problems


def run_bench(opts: BenchOptions, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Start the servers, measure, stop them; the result (bench_report's input). A resumed call
    (the same `state`) returns the finished result."""
    state = state if state is not None else {}
    if state.get("result"):
        return dict(state["result"])
    opts.out.mkdir(parents=True, exist_ok=True)
    expected = json.loads((opts.models / "expected.json").read_text())
    vocab = int(expected["vocab_size"])
    names = server_names(opts)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "thresholds": list(opts.thresholds), "concurrency": list(opts.concurrency),
        "rounds": opts.rounds, "ramp_hold_s": opts.ramp_hold_s, "output_len": opts.output_len,
        "model": {k: expected.get(k) for k in ("size", "hidden", "layers", "draft", "draft_accept",
                                                "designed_accept_length")},
        "configs": [], "not_run": {}, "start_s": {}, "kv_pool_tokens": {}, "levels": {}, "ramp": {},
        "servers": {}, "diagnose": {}, "mismatches": [], "failures": [], "skipped": []}
    if "eagle3_auto" in names and not auto_supported():
        names.remove("eagle3_auto")
        result["not_run"]["eagle3_auto"] = "this sglang has no `auto` threshold (the sglang-image-plugin is not installed)"
    if "eagle3_adaptive" in names:
        (opts.out / "adaptive_config.json").write_text(json.dumps(ADAPTIVE_CONFIG, indent=1))
    result["configs"] = names
    need = START_S_PER_SERVER * len(names) + 120
    if opts.deadline.left() < need:
        result["skipped"].append(f"everything: {opts.deadline.left():.0f}s left, ~{need}s needed")
        result["table"] = bench_report.markdown(result)
        result["files"] = []
        return result
    servers: dict[str, Server] = {}
    try:
        servers = start_servers(opts, names, opts.max_total_tokens or pool_tokens(opts, vocab), result)
        if len(set(result["kv_pool_tokens"].values())) > 1:
            result["failures"].append(f"unequal KV pools {result['kv_pool_tokens']}: lower --mem-share's "
                                      "servers or --max-total-tokens so that every server holds the same")
        for srv in servers.values():
            warm_up(srv.base, opts)
        closed_loop(servers, names, opts, vocab, result)
        if opts.ramp_cycles:
            ramp_all(servers, names, opts, vocab, result)
        if opts.diagnose:
            for name, srv in servers.items():
                prompts = workload(vocab, max(opts.concurrency), opts.output_len, 7)
                result["diagnose"][name] = diagnose.full_load(srv, prompts, max(opts.concurrency), opts.out,
                                                              opts.pyspy_dirs, opts.deadline)
        for name, srv in servers.items():
            info: dict[str, Any] = {"kv_used_after_flush": kv_used_after_flush(srv.base)}
            if switches(name):
                info["speculative_disable"] = speculation_state(srv.base)
            result["servers"][name] = info
            if info["kv_used_after_flush"]:
                result["failures"].append(f"{name}: {info['kv_used_after_flush']} KV tokens still in use "
                                          "after the load and a cache flush")
            check_log_clean(srv.log_path.read_text(errors="replace"))
    except Exception as exc:  # noqa: BLE001 - SmokeError, HTTPFailure or an unexpected answer
        result["failures"].append(f"{getattr(exc, 'cause', f'{type(exc).__name__}: {exc}')}\n"
                                  + "\n".join(f"-- {n}\n{log_tail(s.log_path, 20)}" for n, s in servers.items()))
    finally:
        for srv in servers.values():
            srv.stop()
    result["failures"] += result["mismatches"] + errors(result)
    result["table"] = bench_report.markdown(result)
    result["files"] = [str(p) for p in bench_report.write(result, opts.out)]
    if not result["failures"] and not result["skipped"]:
        state["result"] = result
    return result


def errors(result: dict[str, Any]) -> list[str]:
    out = [f"c={c} round {m['round']} {name}: {m['errors']} request error(s): {m['first_error']}"
           for c, by_name in result["levels"].items() for name, ms in by_name.items() for m in ms if m["errors"]]
    out += [f"ramp {name}: {r['errors']} request error(s): {r['first_error']}"
            for name, r in result["ramp"].items() if r["errors"]]
    return out


# ----------------------------------------------------------------------------- command line
def add_tuning_arguments(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """What to measure and how: shared by `smoke bench` and `smoke e2e` (there as --bench-*)."""
    p = "--" + prefix
    ap.add_argument(p + "configs", default=",".join(CONFIGS),
                    help=f"comma list of {','.join(CONFIGS)} (eagle3_auto runs only where the server has it)")
    ap.add_argument(p + "concurrency", default=",".join(map(str, DEFAULT_CONCURRENCY)))
    ap.add_argument(p + "threshold", default="16",
                    help="eagle3_thr's fixed threshold N; a comma list runs one server per N (a sweep)")
    ap.add_argument(p + "rounds", type=int, default=2,
                    help="closed-loop rounds (the server order alternates; 0: the ramp alone)")
    ap.add_argument(p + "ramp-cycles", type=int, default=3, help="ramp up and down this many times (0: none)")
    ap.add_argument(p + "ramp-hold", type=float, default=2.0, help="seconds per ramp level")
    ap.add_argument(p + "mem-share", type=float, default=0.85,
                    help="share of the free GPU memory that the servers divide evenly")
    ap.add_argument(p + "max-total-tokens", type=int, default=0,
                    help="KV pool of every server (0: room for the top concurrency's requests)")
    ap.add_argument(p + "server-args", default="",
                    help="extra flags for every server, one shell-quoted string (e.g. '--gc-threshold 50000')")
    ap.add_argument(p + "diagnose", action="store_true",
                    help="also where each server's time goes at full load (py-spy, torch profiler, device timer)")


def tuning_options(a: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """BenchOptions fields from add_tuning_arguments' flags; a bad value exits naming the flag."""
    def get(name: str) -> Any:
        return getattr(a, (prefix + name).replace("-", "_"))

    def refuse(flag: str, why: str) -> SystemExit:
        return SystemExit(f"--{prefix}{flag} {get(flag)!r}: {why}")

    configs = tuple(x.strip() for x in get("configs").split(",") if x.strip())
    if not configs or any(c not in CONFIGS for c in configs) or len(set(configs)) < len(configs):
        raise refuse("configs", f"give distinct names among {','.join(CONFIGS)}")
    conc = [x.strip() for x in get("concurrency").split(",") if x.strip()]
    if not conc or not all(x.isdigit() and int(x) >= 1 for x in conc) or len(set(conc)) < len(conc):
        raise refuse("concurrency", "give distinct whole numbers >= 1, e.g. 1,2,4,8")
    thresholds = [x.strip() for x in str(get("threshold")).split(",") if x.strip()]
    if not thresholds or not all(x.isdigit() and int(x) >= 1 for x in thresholds) or len(set(thresholds)) < len(thresholds):
        raise refuse("threshold", "give distinct whole numbers >= 1, e.g. 16 or 8,16,32")
    if get("rounds") < 0:
        raise refuse("rounds", "must be >= 0 (0: the ramp alone)")
    if get("ramp-cycles") < 0 or get("ramp-hold") <= 0 or get("rounds") + get("ramp-cycles") == 0:
        raise SystemExit(f"--{prefix}ramp-cycles {get('ramp-cycles')} / --{prefix}ramp-hold {get('ramp-hold')}: "
                         f"need cycles >= 0 (> 0 with --{prefix}rounds 0) and a hold > 0 seconds")
    if not 0 < get("mem-share") < 1:
        raise refuse("mem-share", "must be between 0 and 1")
    if get("max-total-tokens") < 0:
        raise refuse("max-total-tokens", "must be >= 0 (0: sized for the top concurrency)")
    return {"configs": configs, "concurrency": tuple(sorted(int(x) for x in conc)),
            "thresholds": tuple(sorted(int(x) for x in thresholds)),
            "rounds": get("rounds"), "ramp_cycles": get("ramp-cycles"), "ramp_hold_s": get("ramp-hold"),
            "mem_share": get("mem-share"), "max_total_tokens": get("max-total-tokens"),
            "server_args": tuple(shlex.split(get("server-args"))), "diagnose": get("diagnose")}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", type=Path, help="a target and draft (python -m smoke models)")
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--deadline", type=float, default=7200, help="seconds from now")
    ap.add_argument("--render", type=Path, metavar="BENCH_JSON",
                    help="only write the tables and plots of a saved result into --out")
    add_tuning_arguments(ap)


def options(a: argparse.Namespace) -> BenchOptions:
    if a.models is None:
        raise SystemExit("--models DIR is needed (a target and draft: python -m smoke models DIR --size 1b)")
    if a.output_len < 1:
        raise SystemExit(f"--output-len {a.output_len}: must be >= 1")
    return BenchOptions(models=a.models, out=a.out, output_len=a.output_len, port=a.port,
                        deadline=Deadline(time.time() + a.deadline), **tuning_options(a))


def main(a: argparse.Namespace) -> int:
    if a.render is not None:
        result = json.loads(a.render.read_text())
        for path in bench_report.write(result, a.out):
            print(path)
        return 0
    result = run_bench(options(a))
    print(result["table"])
    print("\n".join(result["files"]))
    for f in result["failures"]:
        print("BENCH FAILED:", f)
    return 1 if result["failures"] or result["skipped"] else 0
