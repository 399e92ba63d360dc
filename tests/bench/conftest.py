"""Shared by the bench's tests: the options `bench run` parses, a recorded result, a free port,
and FakeLab, the bench's servers and windows replaced by fakes that spend the deadline instead of
time.

tests/data/bench_result_format.json is a bench.json in the current format whose figures are made
up to exercise the report (a host whose speed drifts 30% between blocks); it is not a measurement."""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from bench import options, servers, throughput, workload
from smoke.deadline import Deadline
from smoke.server import ServerConfig

REPO = Path(__file__).resolve().parents[2]
RESULT = REPO / "tests" / "data" / "bench_result_format.json"


def bench_options(*flags: str) -> options.BenchOptions:
    """`bench run`'s options parsed from these flags (after --models)."""
    ap = argparse.ArgumentParser()
    options.add_arguments(ap)
    return options.options(ap.parse_args(["--models", "m", *flags]))


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def free_port_base(span: int = 8) -> int:
    """The first of `span` ports that nothing listens on or holds, below the kernel's ephemeral
    range (from 32768: a client socket of another test or the Docker engine may take one there
    at any time, and a server started on it then fails to bind)."""
    import socket

    start = 20000 + os.getpid() % 1000 * span
    for base in [*range(start, 32000 - span, span), *range(20000, start, span)]:
        try:
            for port in range(base, base + span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {span} free ports in 20000-32000")


def titled(title: str, busy_s: float) -> Any:
    """A process titled as SGLang titles its own (setproctitle), computing `busy_s` then sleeping
    0.05 s, over and over."""
    import subprocess

    code = textwrap.dedent(f"""
        import setproctitle, time
        setproctitle.setproctitle({title!r})
        print("titled", flush=True)
        while True:
            end = time.thread_time() + {busy_s}
            while time.thread_time() < end:
                pass
            time.sleep(0.05)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "titled"
    return proc


class FakeServer:
    group: int | None = None  # the process group every fake server reports (None: none known)

    def __init__(self, name: str, log: Path):
        self.base, self.start_seconds, self.log_path, self.pgid = f"http://{name}", 60.0, log, FakeServer.group


class FakeLab:
    """The bench's servers and windows replaced by fakes that spend the deadline instead of time:
    starting the servers (side by side) 60 s, a warm-up 10 s, a window --settle-s + --window-s, a
    ramp its schedule. The servers it has "running" outlive a call, as the registry's do. Records
    the calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
        self.running: set[str] = set()  # servers alive across calls
        self.warm: set[str] = set()
        self.launched: list[str] = []
        self.stopped: list[str] = []
        self.windows: list[tuple[str, int, str]] = []  # (server, concurrency, first prompt key)
        self.ramps: list[str] = []
        self.opts: options.BenchOptions | None = None
        self.deadline = Deadline(0.0)  # the one the bench's options hold
        self.pool = 0  # the KV pool each server holds: the one it was given (server_config)
        self.tmp_path = tmp_path
        (tmp_path / "expected.json").write_text(json.dumps({"vocab_size": 3072, "size": "1b"}))
        (tmp_path / "log").write_text("")
        lab = self

        class Pool:
            def __init__(self, registry: Path | None, scope: str, port_base: int, cpus: int, say: Any = print):
                self.registry, self.servers, self.say = registry, {}, say
                self.entries: dict[str, servers.Entry] = {}

            def ensure(self, configs: dict[str, ServerConfig], key_extra: str, log_for: Any, timeout: float) -> Any:
                new = [n for n in configs if n not in lab.running]
                if new:
                    lab.spend(60)
                for name in configs:
                    if name in lab.running:
                        self.say(f"{name}: the server started earlier (process group 1, port 2) is alive: reused")
                    else:
                        lab.launched.append(name)
                        lab.running.add(name)
                    self.servers[name] = FakeServer(name, log_for(name))
                    self.entries[name] = servers.Entry("k", 1, 2, "log")
                return self.servers

            def launch(self, configs: dict[str, ServerConfig], key_extra: str, log_for: Any) -> list[str]:
                new = [n for n in configs if n not in lab.running]
                lab.launched += new
                lab.running |= set(new)
                return new

            def warmed(self, name: str) -> bool:
                return name in lab.warm

            def mark_warmed(self, name: str) -> None:
                lab.warm.add(name)

            def wait_for_other_starts(self, timeout: float) -> list[str]:
                return []

            def client_cpus(self) -> tuple[int, ...]:
                return ()

            def recorded_alive(self, configs: dict[str, ServerConfig], key_extra: str) -> dict[str, bool]:
                return {n: n in lab.warm for n in configs if n in lab.running}

            def stop(self, name: str) -> None:
                self.servers.pop(name)
                lab.running.discard(name)
                lab.warm.discard(name)
                lab.stopped.append(name)

            def stop_all(self) -> None:
                for name in list(self.servers):
                    self.stop(name)

        monkeypatch.setattr(servers, "ServerPool", Pool)
        config = throughput.server_config

        def server_config(name: str, opts: options.BenchOptions) -> ServerConfig:
            self.deadline = opts.deadline  # the deadline of options the bench made itself (the command line)
            self.pool = opts.max_total_tokens or workload.pool_tokens(opts)  # what each server holds
            return config(name, opts)

        monkeypatch.setattr(throughput, "server_config", server_config)
        monkeypatch.setattr(throughput, "kv_pool", lambda srv: self.pool)
        monkeypatch.setattr(throughput, "warm_up", lambda base, opts, vocab: self.spend(10))
        monkeypatch.setattr(throughput, "flush_cache", lambda base: None)
        monkeypatch.setattr(throughput, "measure", self.measure)
        monkeypatch.setattr(throughput, "run_ramp", self.run_ramp)
        monkeypatch.setattr(throughput, "server_checks", lambda name, srv, top, switching: ({"kv_used_after_flush": 0}, []))

    def options(self, seconds: float, **kw: Any) -> options.BenchOptions:
        kw = {"configs": ("plain", "eagle3"), "concurrency": (1, 4), "pairs": 2, "ramp_cycles": 1,
              "ramp_hold_s": 5.0, "window_s": 20.0, "settle_s": 1.0, "registry": self.tmp_path / "reg.json", **kw}
        self.opts = options.BenchOptions(models=self.tmp_path, out=self.tmp_path / "out",
                                         deadline=Deadline(time.time() + seconds), **kw)
        self.deadline = self.opts.deadline
        return self.opts

    def spend(self, seconds: float) -> None:
        self.deadline.at -= seconds

    def measure(self, base: str, prompt_at: Any, c: int, settle_s: float, window_s: float, timeout: float,
                stop_at: float, scrape: Any = None, counters: Any = None) -> dict[str, Any]:
        self.spend(settle_s + window_s)
        name = base.removeprefix("http://")
        self.windows.append((name, c, prompt_at(0).key))
        speed = 100.0 * c * (1.2 if name == "eagle3" and c == 1 else 0.8 if name == "eagle3" else 1)
        keys = [prompt_at(i).key for i in range(3)]
        return {"requests": 3, "aborted": c, "errors": 0, "first_error": None, "output_tokens": int(speed * window_s),
                "seconds": window_s, "tok_per_s": speed, "accept_length": None, "steps": None, "tail_s": 0.2,
                "abort_all": True, "cut": False, "outputs": {k: [len(k)] for k in keys}, "prefixes": {},
                "abort_reasons": {}}

    def run_ramp(self, base: str, levels: list[int], hold_s: float, vocab: int, output_len: int, timeout: float,
                 poll: Any) -> dict[str, Any]:
        self.spend(hold_s * len(levels))
        self.ramps.append(base.removeprefix("http://"))
        windows = [{"t": i * hold_s, "level": lv, "tok_per_s": 100.0 * lv, "plain_share": None, "crossover": None}
                   for i, lv in enumerate(levels)]
        return {"windows": windows, "requests": 3, "errors": 0, "first_error": None, "mode_changes": None,
                "outputs": {"ramp-0-0": [1, 2], "ramp-0-1": [3]}}

    @staticmethod
    def measured(result: dict[str, Any]) -> list[tuple[str, int, int]]:
        """(server, concurrency, block) of every window kept in a result."""
        return sorted((n, int(c), b["block"]) for c, bl in result["blocks"].items() for b in bl for n in b["windows"])


@pytest.fixture
def lab(monkeypatch, tmp_path) -> FakeLab:
    return FakeLab(monkeypatch, tmp_path)
