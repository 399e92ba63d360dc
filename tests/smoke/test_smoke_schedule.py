"""The smoke and the feature matrix with a depth schedule: `--schedule` on both command lines and
on `bench e2e` (parsed by the setting's contract, refused beside --threshold), whole smoke runs
against server processes that walk the schedule with the plugin's own policy
(tests/smoke/fake_schedule_server.py), a plain server the deadline's margin stops, and the endurance
ramp's memory check on a real process group."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.__main__ import build_parser as bench_parser
from smoke import endurance, run_command, runner, scenario, variant_runs
from smoke import features as F
from smoke import server as server_mod
from smoke.__main__ import build_parser
from smoke.deadline import REQUEST_MARGIN_S
from smoke.server import SmokeError
from tests.ports import free_port
from tests.smoke.fake_schedule_server import output_ids

FAKE = Path(__file__).with_name("fake_schedule_server.py")
SCHEDULE = "1-8:3,9-24:2,25-64:1,65-:0"
SMALL = "1-2:3,3-4:2,5-:0"  # the fake's loads: a few dozen requests
WIDE = "1-16:3,17-64:2,65-192:1,193-:0"  # a top edge where users now set N (192-256)


# ----------------------------------------------------------------------------- arguments
def test_schedule_is_parsed_by_the_contract_and_refused_beside_a_threshold():
    ap = build_parser()
    run = ["run", "--models", "m", "--out", "o"]
    opts = run_command.options(ap.parse_args([*run, "--schedule", " 1-8:3,9-24:2,25-64:1,65-:0 "]))
    assert str(opts.schedule) == SCHEDULE and opts.threshold == 64 and not opts.auto
    assert run_command.options(ap.parse_args(run)).schedule is None  # the threshold path as before
    # a tier deeper than the launch depth: the smoke's servers launch that deep
    assert run_command.options(ap.parse_args([*run, "--schedule", "1-8:5,9-:3"])).schedule is not None
    for flags, why in ((["--schedule", "1-8:3,10-:0"], "--schedule: tier 10-:0 must start at 9"),
                       (["--schedule", "1-:3"], "--schedule: 1-:3 is one tier"),
                       (["--schedule", "fast"], "--schedule: 'fast' is not a tier"),
                       (["--threshold", "4", "--schedule", SCHEDULE], "--schedule and --threshold are both given"),
                       (["--schedule", SCHEDULE, "--threshold", "auto"], "--schedule and --threshold are both given")):
        with pytest.raises(SystemExit, match=why):
            run_command.options(ap.parse_args([*run, *flags]))
    # the feature matrix: the same flag, the pool and the filler from the top edge
    feats = ["features", "--models", "m", "--out", "o"]
    f = F.options(ap.parse_args([*feats, "--schedule", SCHEDULE]))
    assert f.schedule == SCHEDULE and f.threshold == 64
    cfg = F.server_config("x", f, draft=True)
    assert "--speculative-depth-schedule" in cfg.argv(1) and cfg.threshold is None
    assert cfg.argv(1)[cfg.argv(1).index("--speculative-depth-schedule") + 1] == SCHEDULE
    assert "--speculative-depth-schedule" not in F.server_config("x", f, draft=False).argv(1)
    with pytest.raises(SystemExit, match="--schedule and --threshold are both given"):
        F.options(ap.parse_args([*feats, "--threshold", "4", "--schedule", SCHEDULE]))
    with pytest.raises(SystemExit, match="too narrow for the feature matrix"):
        F.options(ap.parse_args([*feats, "--schedule", SMALL]))
    with pytest.raises(SystemExit, match=f"--schedule 1-16:3,17-300:1,301-:0: .*top edge up to "
                                         f"{F.MAX_THRESHOLD}.* Give a top edge <= {F.MAX_THRESHOLD}"):
        F.options(ap.parse_args([*feats, "--schedule", "1-16:3,17-300:1,301-:0"]))
    # a top edge of 192 (was: refused above 84): the pool, the pressure case and the running
    # limit from it, as for N=192
    f = F.options(ap.parse_args([*feats, "--schedule", WIDE]))
    assert f.threshold == 192 and f.schedule == WIDE
    argv = F.server_config("x", f, draft=True).argv(1)
    assert argv[argv.index("--max-total-tokens") + 1] == str(F.pool_tokens(192))
    assert int(argv[argv.index("--max-running-requests") + 1]) == F.pressure_count(192) > 192
    assert F.pressure_overfill(F.pool_tokens(192), F.pressure_count(192)) >= F.PRESSURE_OVERFILL
    # the smoke's servers get it too
    sched = run_command.options(ap.parse_args([*run, "--schedule", SCHEDULE]))
    srv, log, rep = variant_runs.variant_server(sched, scenario.VARIANTS["sync"], Path("d"), None, reach=256,
                                          port=None, schedule=sched.schedule)
    argv = srv.cfg.argv(1)
    assert argv[argv.index("--speculative-depth-schedule") + 1] == SCHEDULE
    assert "--speculative-disable-batch-threshold" not in argv and "--max-running-requests" in argv
    assert rep["schedule"] == SCHEDULE and log.name == "server_eagle_sync_schedule.log"
    with pytest.raises(SystemExit, match="--ramp-minutes: the endurance ramp runs on a fixed threshold"):
        run_command.options(ap.parse_args([*run, "--threshold", "auto", "--ramp-minutes", "1"]))


def test_e2e_passes_the_schedule_and_the_ramp_to_the_smoke_and_the_matrix(tmp_path, monkeypatch):
    from bench import e2e, run_phases

    seen: dict = {}

    def fake(phase: str):
        def run(opts, state):
            seen[phase] = opts
            return {"threshold": opts.threshold, "variants": {}, "failures": []}
        return run

    monkeypatch.setattr(run_phases.features_mod, "run_features", fake("features"))
    monkeypatch.setattr(run_phases.runner, "run_smoke", fake("smoke"))

    def driver(*flags: str) -> e2e.E2E:
        return e2e.E2E(bench_parser().parse_args(["e2e", "--state", str(tmp_path / "state"), "--out",
                                                  str(tmp_path / "out"), "--phases", "smoke,features", *flags]))

    drv = driver("--schedule", SCHEDULE, "--smoke-ramp-minutes", "10", "--smoke-ramp-max-growth-mib", "256")
    drv.runs.smoke()
    drv.runs.features()
    assert str(seen["smoke"].schedule) == SCHEDULE and seen["smoke"].threshold == 64
    assert (seen["smoke"].ramp_minutes, seen["smoke"].ramp_max_growth_mib) == (10, 256)
    assert seen["features"].schedule == SCHEDULE and seen["features"].threshold == 64
    # a schedule, or its ramp, is other options: the phases' results of a threshold are not reused
    plain = driver()
    assert plain.runs.options_digest("smoke") != drv.runs.options_digest("smoke")
    assert plain.runs.options_digest("features") != drv.runs.options_digest("features")
    assert driver("--schedule", SCHEDULE).runs.options_digest("smoke") != drv.runs.options_digest("smoke")
    plain.runs.smoke()
    assert seen["smoke"].schedule is None and seen["smoke"].ramp_minutes == 0
    for flags, why in ((["--threshold", "4", "--schedule", SCHEDULE], "--schedule and --threshold are both given"),
                       (["--schedule", "1-8:3"], "--schedule: the last tier must be open"),
                       (["--schedule", SMALL], "too narrow for the feature matrix")):
        with pytest.raises(SystemExit, match=why):
            e2e.main(bench_parser().parse_args(["e2e", "--phases", "smoke,features", "--out",
                                                str(tmp_path / "o"), *flags]))
    assert not (tmp_path / "o").exists()


def test_e2e_takes_a_schedule_topping_out_at_192_with_graphs_past_256(tmp_path, monkeypatch):
    from bench import e2e

    class StartsNothing:
        def __init__(self, a):
            self.site = None

        def run(self) -> int:
            return 0

    monkeypatch.setattr(e2e, "E2E", StartsNothing)
    monkeypatch.setattr(e2e.client, "allow_connections", lambda count: None)
    assert e2e.main(bench_parser().parse_args(["e2e", "--phases", "smoke,features", "--schedule", WIDE,
                                               "--feature-graph-bs", "512"])) == 0
    with pytest.raises(SystemExit, match=f"--feature-graph-bs 600: give 1 to {F.running_limit(192)} "):
        e2e.main(bench_parser().parse_args(["e2e", "--phases", "features", "--schedule", WIDE,
                                            "--feature-graph-bs", "600"]))


# ----------------------------------------------------------------------------- whole runs
def fake_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str,
               server_flags: tuple[str, ...] = ()) -> tuple[int, dict]:
    """`python -m smoke run` (one variant) against fake server processes: a plain one, then one
    that walks the setting with the plugin's policy (tests/smoke/fake_schedule_server.py)."""

    class FakeConfig(server_mod.ServerConfig):
        def argv(self, port: int) -> list[str]:  # sglang's flags, to the fake
            return [sys.executable, str(FAKE), *super().argv(port)[3:], *server_flags]

    monkeypatch.setattr(runner, "ServerConfig", FakeConfig)  # the plain server's
    monkeypatch.setattr(variant_runs, "ServerConfig", FakeConfig)  # the EAGLE-3 servers'
    models = tmp_path / "models"
    models.mkdir()
    prompt = [5, 6, 7, 8]
    (models / "expected.json").write_text(json.dumps({"vocab_size": 3000, "prompt_ids": prompt,
                                                      "greedy_ids": output_ids(prompt, 24)}))
    a = build_parser().parse_args(["run", "--models", str(models), "--out", str(tmp_path / "out"),
                                   "--variants", "sync", "--port", str(free_port()), *flags])
    code = run_command.main(a)
    return code, json.loads((tmp_path / "out" / "report.json").read_text())


def test_a_schedule_smoke_passes_against_a_server_walking_the_schedule(tmp_path, monkeypatch, capsys):
    code, report = fake_smoke(tmp_path, monkeypatch, "--schedule", SMALL, "--ramp-minutes", "0.05",
                              "--ramp-hold", "0.4")
    out = capsys.readouterr().out
    assert code == 0, out
    rep = report["variants"]["eagle_sync"]
    assert report["schedule"] == SMALL and rep["ok"] and rep["schedule"] == SMALL
    # below, at and above each edge (2 and 4), 8x the top edge, then one at a time again
    assert list(rep["phases"])[:7] == ["below", "edge2_at", "edge2_above", "edge4_at", "edge4_above",
                                       "above", "after"]
    assert {ph["concurrency"] for ph in rep["phases"].values() if "concurrency" in ph} == {1, 2, 3, 4, 5, 32}
    final = rep["spec_disable_final"]
    assert all(n > 0 for n in final["steps_by_depth"].values())  # every depth ran
    assert 2 <= rep["depth_changes"]["count"] <= rep["depth_changes"]["bound"]
    assert rep["kv_baseline"]["num_used_tokens"] == rep["kv_final"]["num_used_tokens"] == 0
    assert rep["depth_change_log_lines"] >= 1 and rep["metrics"]["sglang:spec_disable_depth"] is not None
    # the endurance ramp: its numbers printed and reported, whatever the verdict
    e = rep["endurance"]
    assert e["requests"] > 0 and e["errors"] == e["mismatches"] == 0 and e["changes"] >= 2
    assert e["memory_before"]["rss_mib"] > 0 and e["memory_after"]["pids"]
    assert "endurance 0.1 min" in out or "endurance 0.0 min" in out
    assert "host RSS" in out and "depth changes" in out
    if e["memory_after"]["gpu_mib"] is None:  # no GPU here: it says why
        assert "GPU: " in out and e["memory_after"]["gpu_note"]


def test_a_smoke_fails_where_one_depth_s_outputs_differ_from_plain(tmp_path, monkeypatch, capsys):
    code, report = fake_smoke(tmp_path, monkeypatch, "--schedule", SMALL, server_flags=("--wrong-at-depth", "2"))
    assert code == 1
    cause = report["variants"]["eagle_sync"]["cause"]
    assert cause.startswith("edge2_above: output mismatch vs the plain server"), cause
    assert "depth schedule=1-2:3,3-4:2,5-:0" in report["failures"][0]["log_tail"]


def test_a_threshold_smoke_with_its_endurance_ramp_passes_as_before(tmp_path, monkeypatch, capsys):
    """The threshold path against the same fake, running SpecDisableController: its phases and
    report keys unchanged, the endurance ramp across N (the two-tier schedule's levels)."""
    code, report = fake_smoke(tmp_path, monkeypatch, "--threshold", "4", "--ramp-minutes", "0.04",
                              "--ramp-hold", "0.4")
    assert code == 0, capsys.readouterr().out
    rep = report["variants"]["eagle_sync"]
    assert report["threshold"] == 4 and rep["threshold"] == 4 and "schedule" not in rep
    assert list(rep["phases"]) == ["below", "at", "above", "after", "ramp", "abort"]
    assert rep["endurance"]["changes_of"] == "mode changes" and rep["endurance"]["changes"] >= 2
    assert rep["endurance"]["levels"] == [2, 8]


def test_a_plain_server_the_deadline_s_margin_stops_leaves_the_smoke_skipped_not_failed(tmp_path, monkeypatch):
    """The margin comes while the plain server answers (a slow one: its references take minutes,
    and past the margin each request got 10 s more, one after the other): the server is killed
    there, and run_smoke returns before the deadline, the plain server and the variant skipped,
    nothing failed, no references kept; its progress says so, its server's group is gone."""

    class SlowConfig(server_mod.ServerConfig):
        def argv(self, port: int) -> list[str]:
            return [sys.executable, str(FAKE), *super().argv(port)[3:], "--step-s", "1"]

    monkeypatch.setattr(runner, "ServerConfig", SlowConfig)
    monkeypatch.setenv("SMOKE_SERVER_PIDFILE", str(tmp_path / "servers.pid"))
    prompt = [5, 6, 7, 8]
    (tmp_path / "expected.json").write_text(json.dumps({"vocab_size": 3000, "prompt_ids": prompt,
                                                        "greedy_ids": output_ids(prompt, 24)}))
    lines: list[str] = []
    saves: list[int] = []

    def progress(line: str) -> None:
        lines.append(line)
        if "plain: server up" in line:  # the margin in 1 s, the deadline 25 s after it
            opts.deadline.at = time.time() + REQUEST_MARGIN_S + 1

    opts = scenario.SmokeOptions(models=tmp_path, out=tmp_path / "out", variants=("sync",), port=free_port(),
                                 progress=progress, save_state=lambda: saves.append(len(lines)))
    state: dict = {}
    report = runner.run_smoke(opts, state)
    assert time.time() < opts.deadline.at - REQUEST_MARGIN_S / 2, "it ran on past the margin"
    assert report["skipped"] == ["plain (deadline)", "eagle_sync"] and report["failures"] == []
    assert "refs" not in state and runner.exit_code(report) == 1
    assert lines[-1].startswith("smoke plain: stopped by the deadline's margin while it answered"), lines
    assert saves == [1]  # once the server was up: a call killed later keeps its start log
    assert not server_mod.group_running(int((tmp_path / "servers.pid").read_text()))


# ----------------------------------------------------------------------------- memory
GROWS = textwrap.dedent("""
    import signal, sys, time
    held = []
    signal.signal(signal.SIGUSR1, lambda *a: held.append(b"x" * (int(sys.argv[1]) << 20)))
    print("ready", flush=True)
    while True:
        time.sleep(0.1)
""")


def test_memory_grown_beyond_the_bound_fails_and_is_reported_either_way(tmp_path):
    """A real process group standing in for a server's: its VmRSS read before and after it took
    64 MiB more; a bound of 32 MiB fails naming both numbers, 128 MiB passes."""
    proc = subprocess.Popen([sys.executable, "-c", GROWS, "64"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        before = endurance.memory_of(proc.pid)
        assert before["pids"] == [proc.pid] and before["rss_mib"] > 1
        os.kill(proc.pid, signal.SIGUSR1)
        for _ in range(100):
            after = endurance.memory_of(proc.pid)
            if after["rss_mib"] - before["rss_mib"] >= 60:
                break
            time.sleep(0.05)
        grown = endurance.growth(before, after)
        assert 60 <= grown["rss_mib"] < 100
        with pytest.raises(SmokeError, match=r"host memory \(VmRSS\) grew by \d+ MiB .* bound of 32 MiB "
                                             r"\(--ramp-max-growth-mib\)"):
            endurance.check_memory_growth(before, after, 32)
        endurance.check_memory_growth(before, after, 128)
        e = {"seconds": 600, "requests": 10, "errors": 0, "mismatches": 0, "changes": 7,
             "changes_of": "depth changes", "memory_before": before, "memory_after": after,
             "max_growth_mib": 32.0}
        line = endurance.summary_line(e)
        assert f"host RSS {before['rss_mib']:.0f} -> {after['rss_mib']:.0f} MiB (+{grown['rss_mib']:.0f})" in line
        assert "10.0 min" in line and "7 depth changes" in line
    finally:
        proc.kill()
        proc.wait()


def test_gpu_memory_is_read_per_server_process_from_nvidia_smi(tmp_path, monkeypatch):
    """nvidia-smi's compute apps, as it lists them (csv, no header, no units): the server's own
    processes counted; absent, or listing none of them, the reason is kept."""
    monkeypatch.setattr(endurance.shutil, "which", lambda name: None)
    assert endurance.gpu_mib_by_pid() == (None, "nvidia-smi not found: GPU memory not read")
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '{os.getpid()}, 14200\\n99999999, 300\\n12, [N/A]\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setattr(endurance.shutil, "which", lambda name: str(smi))
    assert endurance.gpu_mib_by_pid() == ({os.getpid(): 14200.0, 99999999: 300.0}, "")
    mine = endurance.memory_of(os.getpgid(0))  # this process's group: it holds 14200 MiB
    assert mine["gpu_mib"] == 14200.0 and mine["gpu_by_pid"] == {str(os.getpid()): 14200.0}
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        got = endurance.memory_of(other.pid)
        assert got["gpu_mib"] is None and "lists none of the server's processes" in got["gpu_note"]
    finally:
        other.kill()
        other.wait()
