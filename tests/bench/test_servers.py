"""The bench's servers (bench.servers): started side by side, recorded to outlive a call, found
alive (or dead, or started with other options) by the next one, pinned to CPUs of their own."""
from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from bench import hostinfo, servers
from smoke import client
from smoke.checks import check_log_clean
from smoke.server import Server, ServerConfig, SmokeError, group_running
from tests.bench.conftest import free_port_base

HEALTHY_AFTER = textwrap.dedent("""
    import http.server, sys, time
    print("spawned", time.time(), flush=True)
    time.sleep(float(sys.argv[2]))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


class SleepyConfig(ServerConfig):
    """A stand-in server: answers /health `delay` s after its spawn."""
    delay: float = 0.0

    def argv(self, port: int) -> list[str]:
        return [sys.executable, "-c", HEALTHY_AFTER, str(port), str(self.delay), *self.extra]


def sleepy(name: str, tmp_path: Path, delay: float = 0.0, extra: tuple[str, ...] = ()) -> SleepyConfig:
    cfg = SleepyConfig(name, tmp_path, extra=extra)
    cfg.delay = delay
    return cfg


def test_a_server_is_judged_by_its_own_output_not_by_an_earlier_server_s(tmp_path):
    # The matrix's logs keep every start of a server (a failed one's output stays readable); a
    # later run on the same machine judged its new server by the old traceback (GPU, 2026-12-04).
    log = tmp_path / "features_plain.log"
    log.write_text("$ the earlier server\nTraceback (most recent call last):\nImportError: no torch\n")
    srv = Server(sleepy("plain", tmp_path), free_port_base(), log)
    try:
        srv.start(30)
        text = srv.log_text()
        assert text.startswith("$ ") and "spawned" in text and "Traceback" not in text
        check_log_clean(text)
        assert "ImportError: no torch" in log.read_text()  # the earlier output is kept
    finally:
        srv.stop()


@pytest.fixture
def pool_of(tmp_path):
    """ServerPools on one registry, as successive calls make them; every server stopped at the end."""
    made: list[servers.ServerPool] = []
    events: list[str] = []

    def make(cpus_per_server: int = 0) -> servers.ServerPool:
        pool = servers.ServerPool(tmp_path / "reg.json", "1b", free_port_base(), cpus_per_server, say=events.append)
        made.append(pool)
        return pool

    make.events = events  # type: ignore[attr-defined]
    yield make
    servers.stop_recorded(tmp_path / "reg.json", say=lambda _: None)


def logs(tmp_path: Path) -> Any:
    return lambda name: tmp_path / f"{name}.{time.time_ns()}.log"


def test_a_live_server_is_found_and_used_by_the_next_call(pool_of, tmp_path):
    first = pool_of().ensure({"plain": sleepy("plain", tmp_path)}, "site-1", logs(tmp_path), 30)
    pgid = first["plain"].pgid
    assert pgid and group_running(pgid)
    # the next call (a new process: a new pool on the same registry) finds it and starts nothing
    again = pool_of()
    found = again.ensure({"plain": sleepy("plain", tmp_path)}, "site-1", logs(tmp_path), 30)
    assert found["plain"].pgid == pgid and found["plain"].proc is None and found["plain"].port == first["plain"].port
    assert pool_of.events[-1].startswith("plain: the server started earlier (process group") and "reused" in pool_of.events[-1]
    assert client.healthy(found["plain"].base)
    again.stop_all()  # the bench complete: stopped, and gone from the registry
    assert not group_running(pgid) and json.loads((tmp_path / "reg.json").read_text()) == {}


def test_a_dead_server_is_said_and_started_again(pool_of, tmp_path):
    import signal

    pgid = pool_of().ensure({"eagle3": sleepy("eagle3", tmp_path)}, "", logs(tmp_path), 30)["eagle3"].pgid
    assert pgid is not None
    os.killpg(pgid, signal.SIGKILL)
    for _ in range(50):
        if not group_running(pgid):
            break
        time.sleep(0.1)
    srv = pool_of().ensure({"eagle3": sleepy("eagle3", tmp_path)}, "", logs(tmp_path), 30)["eagle3"]
    assert srv.pgid != pgid and client.healthy(srv.base)
    assert f"eagle3: the server started earlier (process group {pgid}) is dead: starting it again" in pool_of.events


def test_a_server_recorded_with_other_options_is_not_reused(pool_of, tmp_path):
    old = pool_of().ensure({"plain": sleepy("plain", tmp_path)}, "site-1", logs(tmp_path), 30)["plain"].pgid
    changed = pool_of().ensure({"plain": sleepy("plain", tmp_path, extra=("--gc-threshold", "7"))}, "site-1",
                               logs(tmp_path), 30)["plain"]
    assert changed.pgid != old and not group_running(old)
    assert any("recorded with other options: stopping it" in e for e in pool_of.events)
    # another installed site (e2e's install key) is another option too
    other_site = pool_of().ensure({"plain": sleepy("plain", tmp_path, extra=("--gc-threshold", "7"))}, "site-2",
                                  logs(tmp_path), 30)["plain"]
    assert other_site.pgid != changed.pgid
    # --stop: what the registry holds, whatever call started it
    assert servers.stop_recorded(tmp_path / "reg.json", say=lambda _: None) == 1
    assert not group_running(other_site.pgid) and not (tmp_path / "reg.json").exists()


def test_a_server_recorded_with_another_environment_is_not_reused(pool_of, tmp_path):
    # eagle3 and eagle3_extend_verify share their flags and differ in one variable: a running
    # server of the one must never stand for the other
    def cfg(env: dict[str, str]) -> SleepyConfig:
        c = sleepy("eagle3", tmp_path)
        c.env = env
        return c

    old = pool_of().ensure({"eagle3": cfg({})}, "", logs(tmp_path), 30)["eagle3"].pgid
    assert servers.options_key(cfg({})) != servers.options_key(cfg({"SGLANG_ENABLE_SPLITKV_VERIFY": "0"}))
    switched = pool_of().ensure({"eagle3": cfg({"SGLANG_ENABLE_SPLITKV_VERIFY": "0"})}, "", logs(tmp_path), 30)
    assert switched["eagle3"].pgid != old and not group_running(old)
    assert any("eagle3: recorded with other options: stopping it" in e for e in pool_of.events)


# A stand-in for the plugin's step trace: the server appends a line with its pid to the file
TRACING = "import os\nwith open(os.environ['SGLANG_IMAGE_AUTO_TRACE'], 'a') as f: f.write(f'{os.getpid()}\\n')\n"


class TracingConfig(SleepyConfig):
    def argv(self, port: int) -> list[str]:
        return [sys.executable, "-c", TRACING + HEALTHY_AFTER, str(port), "0", *self.extra]


def test_a_new_server_s_step_trace_holds_only_its_own_steps(pool_of, tmp_path):
    # The trace is named after the config: a later call's new server of the same name appended to
    # the earlier server's file, and the report read both servers' steps as its own.
    trace = tmp_path / "eagle3_auto_steps.jsonl"

    def cfg(*extra: str) -> TracingConfig:
        c = TracingConfig("eagle3_auto", tmp_path, extra=extra)
        c.env = {"SGLANG_IMAGE_AUTO_TRACE": str(trace)}
        return c

    def lines() -> list[str]:
        for _ in range(100):  # the stand-in writes once it runs, before it answers
            if trace.exists() and trace.read_text():
                break
            time.sleep(0.05)
        return trace.read_text().split()

    first = pool_of().ensure({"eagle3_auto": cfg()}, "", logs(tmp_path), 30)["eagle3_auto"]
    assert lines() == [str(first.pgid)]
    # reused by the next call: one server, its trace kept
    assert pool_of().ensure({"eagle3_auto": cfg()}, "", logs(tmp_path), 30)["eagle3_auto"].pgid == first.pgid
    assert lines() == [str(first.pgid)]
    # another concurrency set (other options): a new server, a trace of its own
    second = pool_of().ensure({"eagle3_auto": cfg("--max-running-requests", "256")}, "", logs(tmp_path),
                              30)["eagle3_auto"]
    assert second.pgid != first.pgid and lines() == [str(second.pgid)]


def test_servers_start_side_by_side_and_each_is_pinned_to_its_own_cpus(pool_of, tmp_path):
    """No start waits for another's (their pools are fixed); once healthy, every process and thread
    of a server runs on CPUs of its own, beside the client's; where none are left, it says so."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs: the client's and a server's")
    pool = pool_of(cpus_per_server=1)
    names = ["a", "b", "c"][:len(cpus)]  # one server more than there are CPUs beside the client's
    got = pool.ensure({n: sleepy(n, tmp_path, 1.0) for n in names}, "", logs(tmp_path), 30)
    spawned = [float(s.log_path.read_text().split("spawned ")[1].split()[0]) for s in got.values()]
    assert max(spawned) - min(spawned) < 0.9  # none held back until another answered (1 s after its spawn)
    assert pool.client_cpus() == (cpus[-1],)  # the last: the first ones take the interrupts
    pins = {n: os.sched_getaffinity(s.pgid) for n, s in got.items()}
    pinned = [n for n in names if len(pins[n]) == 1]
    assert pinned == names[:-1] and len({min(pins[n]) for n in pinned}) == len(pinned)
    assert all(cpus[-1] not in pins[n] for n in pinned)
    assert pool_of.events[-1] == (f"{names[-1]}: not pinned: fewer than 1 CPUs left beside the client's 1 and "
                                  "the other servers'")
    entries = json.loads((tmp_path / "reg.json").read_text())
    assert sorted(tuple(e["cpus"]) for e in entries.values() if e["cpus"]) == sorted(tuple(pins[n]) for n in pinned)


def test_a_server_that_exits_at_start_fails_with_its_log(pool_of, tmp_path):
    class Crashing(ServerConfig):
        def argv(self, port: int) -> list[str]:
            return [sys.executable, "-c", "import sys; print('CUDA out of memory'); sys.exit(3)", str(port)]

    with pytest.raises(SmokeError) as err:
        pool_of().ensure({"eagle3": Crashing("eagle3", tmp_path)}, "", logs(tmp_path), 30)
    assert "exited with code 3" in err.value.cause and "CUDA out of memory" in err.value.log.read_text()
    assert json.loads((tmp_path / "reg.json").read_text()) == {}  # nothing recorded that does not run


def test_a_server_still_starting_at_the_deadline_is_left_for_the_next_call(pool_of, tmp_path):
    with pytest.raises(servers.StillStarting, match="slow: still starting after 1s"):
        pool_of().ensure({"slow": sleepy("slow", tmp_path, 3.0)}, "", logs(tmp_path), 1)
    entry = next(iter(json.loads((tmp_path / "reg.json").read_text()).values()))
    assert group_running(entry["pgid"])  # not stopped: the next call finds it, up by then
    srv = pool_of().ensure({"slow": sleepy("slow", tmp_path, 3.0)}, "", logs(tmp_path), 30)["slow"]
    assert srv.pgid == entry["pgid"] and client.healthy(srv.base)


LAUNCH_TITLED = textwrap.dedent("""
    import subprocess, sys
    code = '''
    import setproctitle, sys, time
    setproctitle.setproctitle(sys.argv[1])
    print("titled", flush=True)
    time.sleep(60)
    '''
    procs = [subprocess.Popen([sys.executable, "-c", code, title], stdout=subprocess.PIPE, text=True)
             for title in ("sglang::scheduler_TP0", "sglang::detokenizer")]
    for p in procs:
        p.stdout.readline()
    print(" ".join(str(p.pid) for p in procs), flush=True)
    procs[0].wait()
""")


def test_a_pinned_server_s_scheduler_thread_has_a_cpu_to_itself():
    """With two CPUs or more, the scheduler's main thread gets the first alone and the server's
    other processes (its HTTP front, the detokenizer) the rest; with one, all share it."""
    import signal
    import subprocess

    cpus = tuple(sorted(os.sched_getaffinity(0))[:2])
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCH_TITLED], start_new_session=True,
                                stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    scheduler, detokenizer = (int(x) for x in launcher.stdout.readline().split())
    try:
        assert servers.pin_group(launcher.pid, cpus) == cpus[0]
        assert os.sched_getaffinity(scheduler) == {cpus[0]}
        assert os.sched_getaffinity(detokenizer) == os.sched_getaffinity(launcher.pid) == {cpus[1]}
        assert servers.pin_group(launcher.pid, cpus[:1]) is None
        assert all(os.sched_getaffinity(p) == {cpus[0]} for p in (scheduler, detokenizer, launcher.pid))
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def test_servers_get_cpus_core_by_core(monkeypatch, tmp_path):
    """Where a core has two threads (siblings 0,2 and 1,3), a server of two CPUs gets one whole
    core, not a thread of each (which it would share with the next server or the client)."""
    monkeypatch.setattr(servers.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(hostinfo, "cpu_topology", lambda cpus=None: {"cpus": [0, 1, 2, 3], "cores": [[0, 2], [1, 3]]})
    pool = servers.ServerPool(None, "1b", 30000, 2)
    assert servers.by_core({0, 1, 2, 3}) == [0, 2, 1, 3]
    assert pool.client_cpus() == (3,) and pool.free_cpus(set()) == (0, 2)
    assert pool.free_cpus({0, 2}) == ()  # one CPU left beside the client's: too few for a server
