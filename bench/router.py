"""The router topology on one GPU host: sglang-router, started with the flags deploy/ renders for
it, in front of two threshold servers; a load that crosses each server's threshold both ways;
every output equal to a plain server's; one server killed mid-load, and no request lost.

    PYTHONPATH=plugin python3 -m bench e2e --bundle .gpu --state STATE --out OUT --phases install,patch,check,models,router

What a deployment adds (Services, probes, discovery by label) is checked by the CPU tests of
deploy/; this run checks what only real servers show: the router's retries across a server's
death with requests in flight, and the threshold switching per server behind it.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.workload import ramp_prompt
from smoke import client
from smoke.checks import spec_state
from smoke.client import Prompt
from smoke.deadline import Deadline
from smoke.server import Server, ServerConfig, SmokeError, log_tail

REPO = Path(__file__).resolve().parents[1]
ROUTER_MODULE = "sglang_router.launch_router"
WORKERS = ("worker-0", "worker-1")
MAX_PROMPT_LEN = 64  # ramp_prompt: 32-64 tokens


@dataclass
class RouterOptions:
    models: Path  # the 1B-shaped models (target/, draft/, expected.json)
    out: Path
    deadline: Deadline = field(default_factory=lambda: Deadline(time.time() + 3600))
    threshold: int = 16
    # clients through the router, one level after another: below, above and across each server's
    # threshold (the router spreads them over the two servers)
    levels: tuple[int, ...] = (2, 8, 96, 8, 96)
    requests_per_client: int = 3
    output_len: int = 128
    kill_level: int = 4  # the level (index) during which a server is killed; -1: none
    # ... once this many requests run on it (a fixed delay met a drained server on a fast GPU),
    # waiting at most kill_wait_s for them
    kill_when_running: int = 4
    kill_wait_s: float = 30.0
    port: int = 31000
    mem_share: float = 0.85
    health_timeout: float = 480


# ----------------------------------------------------------------------------- the processes
def server_configs(opts: RouterOptions) -> dict[str, ServerConfig]:
    """A plain server (the reference outputs) and the two threshold servers the router fronts,
    started as the README's Serve command starts one (the server's own limits and graph sizes);
    every KV pool fixed up front, so the three start side by side."""
    top = max(opts.levels)
    pool = ("--max-total-tokens", str(int(1.25 * top * (MAX_PROMPT_LEN + opts.output_len))),
            "--sleep-on-idle")
    plain = ServerConfig("plain", opts.models / "target", cuda_graph_max_bs=top, max_running=top,
                         mem_fraction=opts.mem_share, extra=pool)
    out = {"plain": plain}
    for name in WORKERS:
        out[name] = ServerConfig(name, opts.models / "target", draft=opts.models / "draft",
                                 threshold=opts.threshold, cuda_graph_max_bs=None, max_running=None,
                                 mem_fraction=opts.mem_share, extra=pool)
    return out


def rendered_router_flags(replicas: int, threshold: int) -> list[str]:
    """The router's flags as deploy/ renders them for one box (`topology.router_args`, compose):
    read from the build side's code in a subprocess, so that this package stays free of it."""
    code = ("import json, sys; from sglang_image import topology as t\n"
            "s = t.check(t.Settings(model_path='m', draft_model_path='d', replicas=int(sys.argv[1]),"
            " threshold=int(sys.argv[2])))\n"
            "print(json.dumps(list(t.router_args(s, 'compose'))))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p))
    p = subprocess.run([sys.executable, "-c", code, str(replicas), str(threshold)], env=env,
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise SmokeError(f"the router's rendered flags: {p.stderr.strip()[-800:]}")
    flags: list[str] = json.loads(p.stdout)
    return flags


def on_loopback(rendered: list[str], urls: list[str], port: int, metrics_port: int) -> list[str]:
    """The rendered flags with the router's and the servers' addresses on loopback: the worker
    list in rendered order mapped to `urls`, every other value as rendered."""
    values = {"--host": "127.0.0.1", "--port": str(port), "--prometheus-host": "127.0.0.1",
              "--prometheus-port": str(metrics_port)}
    argv, flag, workers = [], "", iter(urls)
    for arg in rendered:
        if arg.startswith("--"):
            flag = arg
            argv.append(arg)
        elif flag == "--worker-urls":
            argv.append(next(workers))
        else:
            argv.append(values.get(flag, arg))
    return argv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RouterProcess:
    """sglang-router in a process session of its own; its log in OUT."""

    def __init__(self, argv: list[str], log: Path):
        self.log = log
        self.base = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
        self.metrics_base = f"http://127.0.0.1:{argv[argv.index('--prometheus-port') + 1]}"
        # nothing leaves the host: a tokenizer looked for on a hub would meet a closed port
        env = dict(os.environ, HF_ENDPOINT=f"http://127.0.0.1:{free_port()}", HF_HUB_OFFLINE="1")
        with log.open("ab") as fh:
            fh.write(("$ " + " ".join([sys.executable, "-m", ROUTER_MODULE, *argv]) + "\n").encode())
            fh.flush()
            self.proc = subprocess.Popen([sys.executable, "-m", ROUTER_MODULE, *argv], stdout=fh,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, workers: int, timeout: float) -> None:
        """Until the router answers with every server healthy behind it."""
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                raise SmokeError(f"router: exited with code {self.proc.returncode} at start", log=self.log)
            try:
                if client.get_json_object(self.base + "/readiness", 5).get("healthy_workers") == workers:
                    return
            except client.HTTPFailure:
                pass
            time.sleep(1)
        raise SmokeError(f"router: not ready with {workers} healthy servers after {timeout:.0f}s",
                         log=self.log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# ----------------------------------------------------------------------------- the load
def speculation(base: str) -> dict[str, Any] | None:
    """A threshold server's speculative_disable state (None once it is gone)."""
    try:
        return spec_state(client.server_info(base))
    except client.HTTPFailure:
        return None


def run_level(base: str, prompts: list[list[Prompt]], timeout: float,
              during: Callable[[], None] | None = None) -> tuple[list[client.Result], float]:
    """Each client sends its prompts one after another (a closed loop); `during` runs meanwhile
    (in this thread). The results and the seconds the level took."""
    results: list[list[client.Result]] = [[] for _ in prompts]

    def one(i: int) -> None:
        for p in prompts[i]:
            results[i].append(client.generate(base, p, timeout))

    t0 = time.time()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join()
    return [r for rs in results for r in rs], time.time() - t0


def running_on(srv: Server) -> int | None:
    """The requests running on a server now (None: it does not answer)."""
    try:
        return int(client.load(srv.base).get("num_running_reqs") or 0)
    except client.HTTPFailure:
        return None


def wait_for_running(srv: Server, count: int, timeout: float) -> int | None:
    """Polls the server until `count` requests run on it or `timeout` passes; the last count."""
    end = time.time() + timeout
    while True:
        running = running_on(srv)
        if (running or 0) >= count or time.time() >= end:
            return running
        time.sleep(0.02)


def kill_group(srv: Server) -> None:
    """The server's whole process group at once (SIGKILL): a crash, not a shutdown."""
    if srv.pgid is not None:
        try:
            os.killpg(srv.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ----------------------------------------------------------------------------- the run
def run_router(opts: RouterOptions) -> dict[str, Any]:
    """Start the servers and the router, run the levels, compare every output with the plain
    server's; the report (its `failures` empty when every check held)."""
    opts.out.mkdir(parents=True, exist_ok=True)
    vocab = int(json.loads((opts.models / "expected.json").read_text())["vocab_size"])
    rep: dict[str, Any] = {"threshold": opts.threshold, "levels": [], "killed": None, "failures": [],
                           "requests": 0, "errors": 0, "mismatches": 0, "start_s": {},
                           "router_flags": [], "speculation": {}}
    servers: dict[str, Server] = {}
    router: RouterProcess | None = None
    try:
        for i, (name, cfg) in enumerate(server_configs(opts).items()):
            servers[name] = Server(cfg, opts.port + i, opts.out / f"server_router_{name}.log")
            servers[name].launch()
        for name, srv in servers.items():
            srv.wait_healthy(min(opts.health_timeout, opts.deadline.left() - 60))
            rep["start_s"][name] = round(srv.start_seconds, 1)
        rendered = rendered_router_flags(len(WORKERS), opts.threshold)
        argv = on_loopback(rendered, [servers[w].base for w in WORKERS], free_port(), free_port())
        rep["router_flags"] = argv
        router = RouterProcess(argv, opts.out / "router.log")
        router.wait_ready(len(WORKERS), min(120, opts.deadline.left() - 60))
        outputs = load_through(router, servers, opts, vocab, rep)
        compare_with_plain(servers["plain"], outputs, opts, rep)
        rep["router_metrics"] = {k: v for k, v in client.metrics(router.metrics_base).items()
                                 if "retr" in k or "circuit" in k or "request_errors" in k}
        for name in WORKERS:
            state = speculation(servers[name].base)
            if state is not None:
                rep["speculation"][name] = state
        check_switching(rep, opts)
    except SmokeError as exc:
        tail = log_tail(exc.log, 30) if exc.log is not None else ""
        rep["failures"].append(f"{exc.cause}\n{tail}".strip())
    finally:
        if router is not None:
            router.stop()
        for srv in servers.values():
            srv.stop()
    if rep["errors"]:
        rep["failures"].append(f"{rep['errors']} of {rep['requests']} requests through the router "
                               f"failed: {rep['first_error']}")
    if rep["mismatches"]:
        rep["failures"].append(f"{rep['mismatches']} outputs differ from the plain server's")
    rep["summary"] = summarize(rep)
    (opts.out / "router.json").write_text(json.dumps(rep, indent=1))
    return rep


def load_through(router: RouterProcess, servers: dict[str, Server], opts: RouterOptions, vocab: int,
                 rep: dict[str, Any]) -> dict[str, tuple[Prompt, list[int] | None]]:
    """The levels through the router: per level its throughput and what each server's mode did;
    during the kill level the second server dies with requests in flight."""
    outputs: dict[str, tuple[Prompt, list[int] | None]] = {}
    victim = servers[WORKERS[1]]
    for k, c in enumerate(opts.levels):
        if opts.deadline.left() < 90:
            rep["failures"].append(f"the deadline: levels {list(opts.levels[k:])} not run")
            break
        prompts = [[ramp_prompt(vocab, opts.output_len, f"L{k}-c{i}-r{j}")
                    for j in range(opts.requests_per_client)] for i in range(c)]
        before = {w: speculation(servers[w].base) for w in WORKERS}
        def kill(level: int = k, clients: int = c) -> None:
            t0 = time.time()
            in_flight = wait_for_running(victim, opts.kill_when_running, opts.kill_wait_s)
            kill_group(victim)
            rep["killed"] = {"server": victim.cfg.name, "level": level, "clients": clients,
                             "after_s": round(time.time() - t0, 2), "running_on_it": in_flight}
            if (in_flight or 0) < opts.kill_when_running:
                rep["failures"].append(
                    f"the kill of {victim.cfg.name} met {in_flight} requests in flight on it (wanted "
                    f">= {opts.kill_when_running} within {opts.kill_wait_s:.0f} s): no request could "
                    "be lost, so the run proves nothing about it; give the kill level more clients")

        results, seconds = run_level(router.base, prompts, opts.deadline.request_timeout(300),
                                     kill if k == opts.kill_level else None)
        after = {w: speculation(servers[w].base) for w in WORKERS}
        tokens = sum(len(r.output_ids or []) for r in results)
        errors = [r for r in results if r.error]
        rep["requests"] += len(results)
        rep["errors"] += len(errors)
        if errors and "first_error" not in rep:
            rep["first_error"] = errors[0].error
        rep["levels"].append({"clients": c, "requests": len(results), "errors": len(errors),
                              "seconds": round(seconds, 1), "tok_per_s": round(tokens / max(seconds, 1e-6)),
                              "steps": {w: steps_between(before[w], after[w]) for w in WORKERS}})
        for p, r in zip((p for ps in prompts for p in ps), results_in_prompt_order(prompts, results)):
            outputs[p.key] = (p, r.output_ids)
    return outputs


def results_in_prompt_order(prompts: list[list[Prompt]], results: list[client.Result]) -> list[client.Result]:
    by_key = {r.key: r for r in results}
    return [by_key[p.key] for ps in prompts for p in ps]


def steps_between(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, int] | None:
    """The speculative and plain steps a server ran during a level (None: it was gone)."""
    if before is None or after is None:
        return None
    return {kind: int(after.get(f"{kind}_steps", 0)) - int(before.get(f"{kind}_steps", 0))
            for kind in ("speculative", "plain")}


def compare_with_plain(plain: Server, outputs: dict[str, tuple[Prompt, list[int] | None]],
                       opts: RouterOptions, rep: dict[str, Any]) -> None:
    """Every prompt again on the plain server: the outputs through the router must equal its."""
    answered = [(p, ids) for p, ids in outputs.values() if ids is not None]
    timeout = opts.deadline.request_timeout(300)
    reference = client.run_concurrent(plain.base, [p for p, _ in answered], max(opts.levels), timeout)
    # a reference request that failed is asked again, alone: the plain server's error is not a
    # difference of the router's servers
    reference = [ref if ref.error is None else client.generate(plain.base, p, timeout)
                 for (p, _), ref in zip(answered, reference)]
    failed = [ref for ref in reference if ref.error]
    if failed:
        rep["failures"].append(f"plain server: {len(failed)} reference requests failed: {failed[0].error}")
    differ = [p.key for (p, ids), ref in zip(answered, reference) if ref.error is None and ref.output_ids != ids]
    rep["compared"] = len(answered) - len(failed)
    rep["mismatches"] = len(differ)
    rep["first_mismatches"] = differ[:5]


def check_switching(rep: dict[str, Any], opts: RouterOptions) -> None:
    """Each threshold server behind the router decoded both ways: speculative steps at a level
    below its threshold and plain steps at one above."""
    for w in WORKERS:
        ran = [lv["steps"][w] for lv in rep["levels"] if lv["steps"].get(w)]
        spec = sum(s["speculative"] for s in ran)
        plain = sum(s["plain"] for s in ran)
        if not (spec and plain):
            rep["failures"].append(f"{w}: the load did not cross its threshold {opts.threshold} both ways "
                                   f"({spec} speculative, {plain} plain steps)")


def summarize(rep: dict[str, Any]) -> str:
    head = (f"router in front of {', '.join(WORKERS)} (threshold {rep['threshold']}); "
            f"{rep['requests']} requests, {rep['errors']} failed; {rep.get('compared', 0)} outputs "
            f"compared with plain, {rep['mismatches']} differ")
    lines = [head]
    for lv in rep["levels"]:
        steps = "; ".join(f"{w}: " + (f"{s['speculative']} speculative / {s['plain']} plain steps" if s else "gone")
                          for w, s in lv["steps"].items())
        lines.append(f"  {lv['clients']:>4} clients: {lv['requests']} requests, {lv['errors']} failed, "
                     f"{lv['tok_per_s']} tok/s; {steps}")
    if rep["killed"]:
        k = rep["killed"]
        lines.append(f"  killed {k['server']} {k['after_s']} s into the level of {k['clients']} clients "
                     f"({k['running_on_it']} requests running on it)")
    lines += [f"  FAILED: {f.splitlines()[0]}" for f in rep["failures"]]
    return "\n".join(lines)
