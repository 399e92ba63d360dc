"""The user-facing benchmark (bench.throughput), its report (bench.report) and --diagnose
(bench.diagnose), on a CPU: what every server is started with, the load's shape, the files a result
becomes (a real matplotlib render), and the arguments refused.

tests/data/bench_result_format.json is a bench.json in the current format whose figures are made
up to exercise the report; it is not a measurement.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import diagnose, pyspy
from bench import report as bench_report
from bench import throughput as bench
from bench.__main__ import build_parser
from smoke import models
from smoke.runner import Deadline

RESULT = REPO / "tests" / "data" / "bench_result_format.json"


def bench_options(*flags: str) -> bench.BenchOptions:
    """`bench run`'s options parsed from these flags (after --models)."""
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    return bench.options(ap.parse_args(["--models", "m", *flags]))


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


# ----------------------------------------------------------------------------- report
def test_a_recorded_result_becomes_json_markdown_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    result = json.loads(RESULT.read_text())
    paths = bench_report.write(result, tmp_path)
    assert [p.name for p in paths] == ["bench.json", "bench.md", "concurrency.png", "ramp.png"]
    assert json.loads((tmp_path / "bench.json").read_text()) == result
    for png in ("concurrency.png", "ramp.png"):
        width, height = png_size(tmp_path / png)
        assert width > 500 and height > 300
    md = (tmp_path / "bench.md").read_text()
    first_table = md.split("| concurrency |", 1)[1].split("\n\n", 1)[0]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in first_table.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()}
    assert list(rows) == ["1", "4", "16", "64", "256"]
    # c=256: plain 60000.0 and 57600.0 -> 58800; EAGLE-3 33000.0 and 31996.8 -> 32498, ratios
    # 0.55 and 0.5555 -> 0.55, spread 0.55-0.56
    assert rows["256"][:2] == ["58800", "32498 (0.55x, 0.55-0.56)"]
    assert "min-max over the rounds" in md
    header = next(line for line in md.splitlines() if line.startswith("| concurrency"))
    assert "EAGLE-3 + threshold 16 | EAGLE-3 + threshold 64 | EAGLE-3 + auto" in header
    # c=64: auto 33660.0 and 32636.7, plain 34000.0 and 32640.0 (better than EAGLE-3 there), the
    # threshold-16 server (best of the sweep at 64) 33320.0 and 32307.1
    assert "| 64 | 0.995 | 16 | 1.010 |" in md
    ramp = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| EAGLE-3 + auto")}
    # auto's level windows over the better of plain and EAGLE-3 at the same level: 0.98 at 16 and 256
    assert "| 0.980 |" in ramp["EAGLE-3 + auto"] and ramp["EAGLE-3 + auto"].rstrip().endswith("| 4 |")
    assert "EAGLE-3 + auto: threshold auto, crossover 32" in md
    assert "every output equal to plain decoding's; 0 request errors" in md
    assert "![tokens/s by concurrency](concurrency.png)" in md


def test_level_table_and_ramp_summary_figures():
    result = json.loads(RESULT.read_text())
    table = bench_report.level_table(result)
    assert table["256"]["eagle3"] == {"tok_per_s": 32498.4, "vs_plain": 0.553, "vs_plain_min": 0.55,
                                      "vs_plain_max": 0.555, "accept_length": 3.1, "rounds": 2}
    assert table["1"]["plain"]["vs_plain"] == 1.0
    ramp = bench_report.ramp_summary(result)
    assert ramp["eagle3_auto"]["min_share_of_better"] == 0.98
    assert ramp["plain"]["min_share_of_better"] == pytest.approx(1 / 2.1, abs=1e-3)  # at 1 client
    assert ramp["eagle3"]["mode_changes"] is None and ramp["eagle3_thr16"]["mode_changes"] == 4
    auto = bench_report.auto_comparison(result)
    assert auto["1"] == {"vs_better_of_plain_eagle3": 0.99, "best_fixed": 64, "vs_best_fixed": 1.005}


def test_each_switching_server_is_measured_against_the_better_of_plain_and_eagle3():
    # the product's promise, round by round: c=64, threshold 16 made 33320.0 and 32307.1 where the
    # better fixed server (plain there) made 34000.0 and 32640.0
    result = json.loads(RESULT.read_text())
    better = bench_report.better_table(result)
    assert better["64"]["eagle3_thr16"] == {"vs_better": 0.985, "min": 0.98, "max": 0.99, "rounds": 2}
    assert set(better["64"]) == {"eagle3_adaptive", "eagle3_thr16", "eagle3_thr64", "eagle3_auto"}
    md = bench_report.markdown(result)
    assert "| 64 | 0.70x (0.70-0.71) | 0.98x (0.98-0.99) | 0.92x (0.91-0.92) | 0.99x (0.99-1.00) |" in md
    # without always-on EAGLE-3 there is no "better of the two" to compare with
    for level in result["levels"].values():
        level.pop("eagle3", None)
    assert bench_report.better_table(result) == {}
    assert "better of plain and always-on EAGLE-3 in each round" not in bench_report.markdown(result)


def test_failures_and_configs_not_run_are_in_the_table(tmp_path):
    result = json.loads(RESULT.read_text())
    result["configs"].remove("eagle3_auto")
    result["not_run"] = {"eagle3_auto": "this sglang has no `auto` threshold"}
    result["failures"] = ["ramp eagle3_thr16: 1 output(s) differ from plain (e.g. ramp-3-1)"]
    md = bench_report.markdown(result)
    assert "- EAGLE-3 + auto not run: this sglang has no `auto` threshold" in md
    assert "- FAILED: ramp eagle3_thr16: 1 output(s) differ from plain" in md
    assert "every output equal" not in md and "EAGLE-3 + auto |" not in md
    assert "auto / best fixed" not in md


def test_render_flag_draws_a_saved_result_without_servers(tmp_path):
    pytest.importorskip("matplotlib")
    a = build_parser().parse_args(["run", "--render", str(RESULT), "--out", str(tmp_path / "docs")])
    assert a.main(a) == 0
    assert {p.name for p in (tmp_path / "docs").iterdir()} == {"bench.json", "bench.md", "concurrency.png", "ramp.png"}


# ----------------------------------------------------------------------------- the load
def test_closed_loop_workload_and_ramp_schedule():
    assert bench.workload(3000, 8, 256, 0, 5) == bench.workload(3000, 8, 256, 0, 5)  # the same for every server
    assert bench.workload(3000, 8, 256, 0, 5) != bench.workload(3000, 8, 256, 1, 5)  # another round, other prompts
    assert bench.workload(3000, 8, 256, 0, 9)[:5] == bench.workload(3000, 8, 256, 0, 5)  # one stream, cut anywhere
    assert all(32 <= len(p.input_ids) <= bench.MAX_PROMPT_LEN for p in bench.workload(3000, 8, 256, 0, 50))
    assert bench.ramp_prompt(3000, 64, "ramp-3-1") == bench.ramp_prompt(3000, 64, "ramp-3-1")
    assert bench.ramp_levels((1, 4, 16), 2) == [1, 4, 16, 4, 1, 4, 16, 4, 1]
    assert bench.ramp_levels((1, 4, 16), 0) == []
    assert [bench.round_order(["a", "b", "c"], k) for k in (0, 1)] == [["a", "b", "c"], ["c", "b", "a"]]


def test_ramp_windows_spread_each_request_over_its_lifetime():
    # request 1: 100 tokens over 1-3 s; request 2: 50 tokens over 2.5-3.5 s; 2 s windows
    windows = bench.ramp_windows([1, 2], 2.0, [(1.0, 3.0, 100), (2.5, 3.5, 50)],
                                 [(0.5, "speculative", None), (1.0, "plain", 32), (2.5, "plain", 16)])
    assert [w["tok_per_s"] for w in windows] == [25.0, 50.0]  # 50 / 2 s; (50 + 50) / 2 s
    assert [w["plain_share"] for w in windows] == [0.5, 1.0] and [w["crossover"] for w in windows] == [32, 16]


def test_outputs_are_compared_with_plain_decoding():
    outs = {"plain": {"a": [1], "b": [2], "c": [3]}, "eagle3": {"a": [1], "b": [9], "c": None},
            "eagle3_auto": {"a": [1], "d": [4]}}
    assert bench.mismatches(outs, "round 1") == ["round 1 eagle3: 1 output(s) differ from plain (e.g. b)"]


# ----------------------------------------------------------------------------- servers
def test_configs_map_to_server_flags(tmp_path):
    opts = bench.BenchOptions(models=tmp_path, out=tmp_path, thresholds=(16, 64), concurrency=(1, 256),
                              server_args=("--gc-threshold", "50000"))
    names = bench.server_names(opts)
    assert names == ["plain", "eagle3", "eagle3_adaptive", "eagle3_thr16", "eagle3_thr64", "eagle3_auto"]
    argv = {name: bench.server_config(name, opts, 0.2, 1000).argv(30000) for name in names}
    assert "--speculative-algorithm" not in argv["plain"]
    assert all("--speculative-adaptive" not in a for n, a in argv.items() if n != "eagle3_adaptive")
    ad = argv["eagle3_adaptive"]
    assert ad[ad.index("--speculative-adaptive-config") + 1] == str(tmp_path / "adaptive_config.json")
    # upstream's default tiers, without the 7-step one that crashed at start on an H200
    assert max(max(e["candidate_steps"]) for e in bench.ADAPTIVE_CONFIG.values()) == 3
    assert bench.ADAPTIVE_CONFIG["64"]["candidate_steps"] == [0]
    for name, a in argv.items():
        assert a[a.index("--mem-fraction-static") + 1] == "0.2" and a[a.index("--max-total-tokens") + 1] == "1000"
        assert a[a.index("--cuda-graph-max-bs") + 1] == "256" and "--sleep-on-idle" in a
        assert a[-2:] == ["--gc-threshold", "50000"], name  # the user's flags last
        assert (bench.THRESHOLD_FLAG in a) == bench.switches(name)
    flag = {name: a[a.index(bench.THRESHOLD_FLAG) + 1] for name, a in argv.items() if bench.switches(name)}
    assert flag == {"eagle3_thr16": "16", "eagle3_thr64": "64", "eagle3_auto": "auto"}
    assert bench.server_config("plain", opts).env == {}
    assert bench.server_config("plain", bench.BenchOptions(models=tmp_path, out=tmp_path, diagnose=True)).env \
        == diagnose.SERVER_ENV


def test_switching_servers_can_start_with_the_servers_own_limits(tmp_path):
    # --switching-defaults: the threshold and auto servers start as the README's Serve command
    # does (no --max-running-requests, no decode graph size); the others keep the top concurrency.
    opts = bench.BenchOptions(models=tmp_path, out=tmp_path, thresholds=(16,), concurrency=(1, 64),
                              configs=("plain", "eagle3", "eagle3_thr", "eagle3_auto"),
                              switching_defaults=True)
    argv = {n: bench.server_config(n, opts).argv(30000) for n in bench.server_names(opts)}
    for name, a in argv.items():
        given = not bench.switches(name)
        assert ("--max-running-requests" in a) == given and ("--cuda-graph-max-bs-decode" in a
                                                             or "--cuda-graph-max-bs" in a) == given
        if given:
            assert a[a.index("--max-running-requests") + 1] == "64"
    assert bench_options("--switching-defaults").switching_defaults
    assert not bench_options().switching_defaults


class ChecksServer:
    def __init__(self, log: Path):
        self.base, self.log_path = "http://x", log


def test_server_checks_keep_every_figure_whichever_check_fails(monkeypatch, tmp_path):
    # The KV pool check of every server, a threshold server's too, even where its log shows an
    # error (it used to be dropped with the log check's exception) or its limit is too low.
    log = tmp_path / "server_bench_eagle3_thr16.2.log"
    log.write_text("Traceback (most recent call last)\nRuntimeError: boom\n")
    monkeypatch.setattr(bench, "kv_used_after_flush", lambda base: 12)
    monkeypatch.setattr(bench, "running_limit", lambda base: 48)
    monkeypatch.setattr(bench, "speculation_state", lambda base: {"threshold": 16})
    info, problems = bench.server_checks("eagle3_thr16", ChecksServer(log), 256)
    assert info == {"kv_used_after_flush": 12, "running_limit": 48,
                    "speculative_disable": {"threshold": 16}}
    assert problems[0] == "eagle3_thr16: 12 KV tokens still in use after the load and a cache flush"
    assert problems[1] == "eagle3_thr16: runs at most 48 requests at once, below the top concurrency 256"
    assert problems[2].startswith("eagle3_thr16: server log shows an error") and log.name in problems[2]
    log.write_text("all fine\n")
    monkeypatch.setattr(bench, "kv_used_after_flush", lambda base: 0)
    monkeypatch.setattr(bench, "running_limit", lambda base: 256)
    assert bench.server_checks("eagle3_thr16", ChecksServer(log), 256)[1] == []


def test_auto_runs_only_where_the_plugin_is_installed(tmp_path, monkeypatch):
    """Read from real package metadata: a dist-info listing auto_threshold.py says `auto` is there."""
    assert bench.auto_supported() is False  # the test environment has no plugin installed
    info = tmp_path / "sglang_image_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-image-plugin\nVersion: 0.1\n")
    (info / "RECORD").write_text("sglang_image_plugin/__init__.py,,\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert bench.auto_supported() is False  # a plugin without the auto threshold
    (info / "RECORD").write_text("sglang_image_plugin/__init__.py,,\nsglang_image_plugin/auto_threshold.py,,\n")
    assert bench.auto_supported() is True


def test_a_deadline_too_short_starts_no_server_and_says_so(tmp_path):
    (tmp_path / "expected.json").write_text(json.dumps({"vocab_size": 3072, "size": "1b"}))
    opts = bench.BenchOptions(models=tmp_path, out=tmp_path / "out", deadline=Deadline(0.0),
                              configs=("plain", "eagle3", "eagle3_auto"))
    result = bench.run_bench(opts, {})
    assert result["skipped"][0] == "closed loop round 1 at concurrency " + ", ".join(map(str, bench.DEFAULT_CONCURRENCY))
    assert "no server started" in result["skipped"][-1]
    assert result["configs"] == ["plain", "eagle3"] and "eagle3_auto" in result["not_run"]
    assert "remaining: closed loop round 2" in result["table"] and not result["levels"]


# ----------------------------------------------------------------------------- resuming, deadlines
class FakeServer:
    def __init__(self, name: str, log: Path):
        self.base, self.start_seconds, self.log_path, self.stopped = f"http://{name}", 60.0, log, False

    def stop(self) -> None:
        self.stopped = True


class FakeLab:
    """The bench's contact with servers replaced by fakes that spend the deadline instead of time:
    a server start 60 s, a warm-up 10 s, a window --window-s, a ramp its schedule. Records the calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
        self.launched: list[str] = []
        self.logs: list[str] = []
        self.windows: list[tuple[str, int, str]] = []  # (server, concurrency, first prompt key)
        self.ramps: list[str] = []
        self.opts: bench.BenchOptions | None = None
        self.deadline = Deadline(0.0)  # the one the bench's options hold
        self.tmp_path = tmp_path
        (tmp_path / "expected.json").write_text(json.dumps({"vocab_size": 3072, "size": "1b"}))
        (tmp_path / "log").write_text("")
        monkeypatch.setattr(bench, "launch", self.launch)
        monkeypatch.setattr(bench, "kv_pool", lambda srv: 5000)
        monkeypatch.setattr(bench, "warm_up", lambda base, opts: self.spend(10))
        monkeypatch.setattr(bench, "flush_cache", lambda base: None)
        monkeypatch.setattr(bench, "measure", self.measure)
        monkeypatch.setattr(bench, "run_ramp", self.run_ramp)
        monkeypatch.setattr(bench, "server_checks", lambda name, srv, top: ({"kv_used_after_flush": 0}, []))

    def options(self, seconds: float, **kw: Any) -> bench.BenchOptions:
        kw = {"configs": ("plain", "eagle3"), "concurrency": (1, 4), "rounds": 2, "ramp_cycles": 1,
              "ramp_hold_s": 5.0, "window_s": 20.0, **kw}
        self.opts = bench.BenchOptions(models=self.tmp_path, out=self.tmp_path / "out",
                                       deadline=Deadline(__import__("time").time() + seconds), **kw)
        self.deadline = self.opts.deadline
        return self.opts

    def spend(self, seconds: float) -> None:
        self.deadline.at -= seconds

    def launch(self, opts: bench.BenchOptions, name: str, mem_fraction: float, tokens: int,
               log_path: Path) -> FakeServer:
        self.deadline = opts.deadline
        self.logs.append(log_path.name)
        assert log_path.exists()  # taken before the start: the next start takes the next number
        self.spend(60)
        self.launched.append(name)
        return FakeServer(name, self.tmp_path / "log")

    def measure(self, base: str, prompt_at: Any, c: int, min_s: float, min_requests: int, timeout: float,
                stop_at: float) -> dict[str, Any]:
        self.spend(min_s)
        name = base.removeprefix("http://")
        self.windows.append((name, c, prompt_at(0).key))
        speed = 100.0 * c * (1.2 if name == "eagle3" and c == 1 else 0.8 if name == "eagle3" else 1)
        keys = [prompt_at(i).key for i in range(min_requests)]
        return {"requests": min_requests, "errors": 0, "first_error": None, "output_tokens": int(speed * min_s),
                "seconds": min_s, "tok_per_s": speed, "accept_length": None, "cut": False,
                "outputs": {k: [len(k)] for k in keys}}

    def run_ramp(self, base: str, levels: list[int], hold_s: float, vocab: int, output_len: int, timeout: float,
                 poll: Any) -> dict[str, Any]:
        self.spend(hold_s * len(levels))
        self.ramps.append(base.removeprefix("http://"))
        windows = [{"t": i * hold_s, "level": lv, "tok_per_s": 100.0 * lv, "plain_share": None, "crossover": None}
                   for i, lv in enumerate(levels)]
        return {"windows": windows, "requests": 3, "errors": 0, "first_error": None, "mode_changes": None,
                "outputs": {"ramp-0-0": [1, 2], "ramp-0-1": [3]}}

    def measured(self, result: dict[str, Any]) -> list[tuple[str, int, int]]:
        """(server, concurrency, round) of every window kept in a result."""
        return sorted((n, int(c), m["round"]) for c, by in result["levels"].items() for n, ms in by.items() for m in ms)


@pytest.fixture
def lab(monkeypatch, tmp_path) -> FakeLab:
    return FakeLab(monkeypatch, tmp_path)


def test_a_resumed_run_measures_only_what_is_left(lab):
    """Three calls with one state, as e2e makes them after each deadline: no window or ramp is
    measured twice, the first call's windows stay in the report, the last call starts only the
    server whose ramp is left, and a call after the end measures nothing. Budgets: the bench plans
    a start as 75 s + a 30 s warm-up per server until measured, a window it has not seen as
    1.5 x --window-s + 12 s per server, and keeps 20 s + 12 s per server to stop."""
    state: dict[str, Any] = {}
    saved: list[list[str]] = []
    # plan: 2 x 105 s starts, 2 x 42 s window, 44 s to stop = 338 s; spent: 140 s to start, 40 s a window
    first = bench.run_bench(lab.options(340), state, lambda r: saved.append(list(r["skipped"])))
    assert lab.launched == ["plain", "eagle3"]
    assert lab.measured(first) == sorted([(n, c, 1) for n in ("eagle3", "plain") for c in (1, 4)]
                                         + [("eagle3", 1, 2), ("plain", 1, 2)])
    assert first["skipped"][:2] == ["closed loop round 2 at concurrency 4", "ramp of plain, eagle3"]
    assert "remaining: closed loop round 2 at concurrency 4" in first["table"] and not first["failures"]
    assert len(saved) == 3 and saved[0][0] == "closed loop round 1 at concurrency 4"  # kept after each window
    assert "| 4 (1 of 2 rounds) |" in first["table"] and "result" not in state
    state = json.loads(json.dumps(state))  # e2e keeps it as JSON between calls

    lab.launched.clear(), lab.windows.clear()
    # plan: starts as measured (60 s), round 2 at 4 (2 x 22 s), a ramp 3 x 5 s + 30 s, each with 44 s to stop
    second = bench.run_bench(lab.options(275), state)
    assert lab.launched == ["plain", "eagle3"] and lab.ramps == ["plain"]
    assert sorted(lab.windows) == [("eagle3", 4, "c4-0"), ("plain", 4, "c4-0")]
    assert lab.measured(second) == [(n, c, k) for n in ("eagle3", "plain") for c in (1, 4) for k in (1, 2)]
    assert second["skipped"][0] == "ramp of eagle3"
    table = bench_report.level_table(second)
    assert table["1"]["eagle3"]["vs_plain"] == 1.2 and table["1"]["eagle3"]["rounds"] == 2
    assert "| 1 | 100 | 120 (1.20x, 1.20-1.20) |" in second["table"]

    lab.launched.clear()
    third = bench.run_bench(lab.options(600), state)
    assert lab.launched == ["eagle3"] and lab.ramps == ["plain", "eagle3"]  # eagle3 alone, for its ramp
    assert not third["skipped"] and not third["failures"] and state["result"] is third
    assert third["calls"] == 3 and set(third["ramp"]) == {"plain", "eagle3"} and "over 3 calls" in third["table"]
    assert "every output equal to plain decoding's" in third["table"] and "remaining" not in third["table"]
    # each start of a server writes a log of its own: one run's failure never reads as another's
    assert lab.logs == ["server_bench_plain.1.log", "server_bench_eagle3.1.log", "server_bench_plain.2.log",
                        "server_bench_eagle3.2.log", "server_bench_eagle3.3.log"]

    lab.launched.clear()
    assert bench.run_bench(lab.options(600), state)["levels"] == third["levels"] and not lab.launched


@pytest.mark.parametrize("seconds", range(10, 700, 30))
def test_a_call_finishes_whole_units_within_its_deadline(lab, seconds):
    """Whatever the time a call has: it ends within it; every window it keeps was measured on every
    server and none is measured and thrown away; no server is started without a unit measured on
    it; the report lists exactly what is left."""
    result = bench.run_bench(lab.options(seconds, rounds=1, concurrency=(1, 4, 16)), {})
    assert lab.opts is not None and lab.opts.deadline.left() > 0
    kept = lab.measured(result)
    assert len(lab.windows) == len(kept) and {(n, c) for n, c, _ in kept} == {(n, c) for n, c, _ in lab.windows}
    assert all((other, c, k) in kept for _, c, k in kept for other in ("plain", "eagle3"))
    assert bool(lab.launched) == bool(kept) and lab.launched in ([], ["plain", "eagle3"])
    levels_left = [c for c in (1, 4, 16) if str(c) not in result["levels"]]
    if levels_left:
        assert result["skipped"][0] == "closed loop round 1 at concurrency " + ", ".join(map(str, levels_left))
        assert not lab.ramps  # the ramps wait for the closed loop
    assert len(lab.ramps) == len(result["ramp"])
    assert ("ramp of plain, eagle3" in result["skipped"]) == (not result["ramp"])


def test_a_call_with_only_ramps_left_starts_one_server_at_a_time(lab):
    state: dict[str, Any] = {"windows_done": [f"{k}:{c}" for k in (0, 1) for c in (1, 4)]}
    # plan: 105 s start + a ramp 45 s + 32 s to stop = 182 s; spent 70 + 15 s: not enough for eagle3's
    result = bench.run_bench(lab.options(200), state)
    assert lab.launched == ["plain"] and lab.ramps == ["plain"] and not lab.windows
    assert result["skipped"][0] == "ramp of eagle3" and "not started" in result["skipped"][-1]
    lab.launched.clear()
    assert not bench.run_bench(lab.options(600, ramp_cycles=0), {})["skipped"]
    assert lab.launched == ["plain", "eagle3"]  # without ramps the run ends with the closed loop


def test_e2e_keeps_each_unit_and_its_next_call_goes_on(lab, tmp_path):
    """The bench phase of `bench e2e` writes its state after every unit (a call killed at its limit
    keeps them) and its next call on the same state dir measures only what is left."""
    from bench import e2e

    def driver(seconds: float) -> e2e.E2E:
        drv = e2e.E2E(build_parser().parse_args([
            "e2e", "--bundle", str(tmp_path / "bundle"), "--state", str(tmp_path / "state"), "--out",
            str(tmp_path / "out"), "--phases", "bench", "--bench-configs", "plain,eagle3", "--bench-concurrency", "1,4",
            "--bench-ramp-cycles", "1", "--bench-ramp-hold", "5", "--bench-window-s", "20"]))
        drv.deadline.at = __import__("time").time() + seconds
        lab.deadline = drv.deadline
        return drv

    models = tmp_path / "state" / "models" / "1b"
    models.mkdir(parents=True)
    (models / "expected.json").write_text(json.dumps({"vocab_size": 3072, "size": "1b"}))
    with pytest.raises(e2e.Deadline_):
        driver(340).phase_bench()  # returns without saving: what is on disk came from the progress calls
    on_disk = json.loads((tmp_path / "state" / "state.json").read_text())
    run = next(iter(on_disk["bench_runs"].values()))
    assert run["windows_done"] == ["0:1", "0:4", "1:1"]
    assert "closed loop round 2 at concurrency 4" in (tmp_path / "out" / "summary.txt").read_text()
    lab.windows.clear()
    driver(600).phase_bench()
    assert sorted(lab.windows) == [("eagle3", 4, "c4-0"), ("plain", 4, "c4-0")] and lab.ramps == ["plain", "eagle3"]


FAKE_SGLANG = """
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NAME = sys.argv[2]


class H(BaseHTTPRequestHandler):
    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.startswith("/v1/loads"):
            return self.answer({"loads": [{"num_used_tokens": 0, "max_total_num_tokens": 5000}]})
        if self.path == "/server_info":
            return self.answer({"internal_states": [{"speculative_disable": {
                "threshold": 16, "mode": "speculative", "speculative_steps": 9, "plain_steps": 0, "mode_changes": 0,
                "acceptance_around_plain": {"window_steps": 64, "phases_measured": 2, "unpaired_steps": 0,
                                            "last_before": 3.2, "last_after": 3.15,
                                            "worst_after_over_before": 0.97}}}]})
        return self.answer({})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path != "/generate":
            return self.answer({})
        n = req["sampling_params"]["max_new_tokens"]
        time.sleep(0.002 * n / (2 if NAME == "eagle3" else 1))
        meta = {"spec_accept_length": 2.5} if NAME != "plain" else {}
        return self.answer({"output_ids": [(sum(req["input_ids"]) + j) % 97 for j in range(n)], "meta_info": meta})

    def log_message(self, *a):
        pass


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_whole_run_on_real_processes(tmp_path, monkeypatch):
    """run_bench end to end with server processes that answer as sglang does (no GPU): windows of
    their minimum length on every server, ramps, outputs compared, KV pool checked, the files."""
    import os
    import sys

    from smoke.server import ServerConfig

    class FakeSglang(ServerConfig):
        def argv(self, port: int) -> list[str]:
            return [sys.executable, "-c", FAKE_SGLANG, str(port), self.name]

    monkeypatch.setattr(bench, "server_config", lambda name, opts, mem, tokens: FakeSglang(name, tmp_path))
    (tmp_path / "expected.json").write_text(json.dumps({"vocab_size": 3072, "size": "1b"}))
    opts = bench.BenchOptions(models=tmp_path, out=tmp_path / "out", configs=("plain", "eagle3", "eagle3_thr"),
                              concurrency=(1, 4), rounds=2, window_s=0.4, ramp_cycles=1, ramp_hold_s=0.3,
                              output_len=8, port=31000 + os.getpid() % 1000 * 4, deadline=Deadline(__import__("time").time() + 900))
    state: dict[str, Any] = {}
    result = bench.run_bench(opts, state)
    assert not result["failures"] and not result["skipped"] and state["result"] is result
    for c in ("1", "4"):
        for name in ("plain", "eagle3", "eagle3_thr16"):
            ms = result["levels"][c][name]
            assert [m["round"] for m in ms] == [1, 2]
            assert all(m["seconds"] >= 0.4 and m["requests"] >= bench.window_requests(int(c), 3) for m in ms)
    # the ratio is taken within each round, then the median (the fake's speeds are not asserted:
    # on a busy machine its sleeps drown in HTTP time)
    plain, eagle = (bench_report.per_round(result["levels"]["1"][n]) for n in ("plain", "eagle3"))
    expected = statistics.median(eagle[r] / plain[r] for r in plain)
    assert bench_report.level_table(result)["1"]["eagle3"]["vs_plain"] == pytest.approx(expected, abs=1e-3)
    assert set(result["ramp"]) == {"plain", "eagle3", "eagle3_thr16"} and result["calls"] == 1
    assert result["servers"]["eagle3_thr16"]["speculative_disable"]["threshold"] == 16
    assert all(info["kv_used_after_flush"] == 0 for info in result["servers"].values())
    assert "every output equal to plain decoding's" in result["table"]
    assert ("accept length 3.20 in the last 64 speculative steps before a plain phase, 3.15 in the "
            "first 64 after it (worst of 2 phases: 0.97x)") in result["table"]
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"bench.json", "bench.md"}


def test_command_line_state_file_resumes(lab, tmp_path, capsys):
    """`bench run --state FILE`: a run stopped by --deadline says what is left and how to go on;
    the same command measures the rest."""
    argv = ["run", "--models", str(tmp_path), "--out", str(tmp_path / "out"), "--configs", "plain,eagle3",
            "--concurrency", "1,4", "--ramp-cycles", "0", "--window-s", "20", "--state", str(tmp_path / "st.json")]
    a = build_parser().parse_args([*argv, "--deadline", "340"])
    assert a.main(a) == 1
    out = capsys.readouterr().out
    assert "BENCH INCOMPLETE: closed loop round 2 at concurrency 4" in out and "Run the same command to" in out
    lab.windows.clear()
    a = build_parser().parse_args([*argv, "--deadline", "600"])
    assert a.main(a) == 0 and sorted(lab.windows) == [("eagle3", 4, "c4-0"), ("plain", 4, "c4-0")]
    assert "BENCH INCOMPLETE" not in capsys.readouterr().out
    a = build_parser().parse_args([*argv, "--deadline", "340", "--rounds", "3"])
    with pytest.raises(SystemExit, match="other options"):
        a.main(a)


def test_a_server_that_fails_to_start_ends_the_run_with_its_log(lab, monkeypatch, tmp_path):
    from smoke.server import SmokeError

    started: list[FakeServer] = []
    (tmp_path / "eagle3.log").write_text("Traceback ...\nRuntimeError: CUDA out of memory\n")

    def launch(opts: bench.BenchOptions, name: str, mem_fraction: float, tokens: int,
               log_path: Path) -> FakeServer:
        if name == "eagle3":
            raise SmokeError("eagle3: server exited with code 1 before it became healthy", log=tmp_path / "eagle3.log")
        started.append(FakeServer(name, tmp_path / "log"))
        return started[-1]

    monkeypatch.setattr(bench, "launch", launch)
    state: dict[str, Any] = {}
    result = bench.run_bench(lab.options(600), state)
    assert result["failures"][0].startswith("eagle3: server exited with code 1")
    assert "CUDA out of memory" in result["failures"][0] and all(s.stopped for s in started)
    assert not result["skipped"] and result["not_measured"][0] == "closed loop round 1 at concurrency 1, 4"
    assert state["result"] is result and "- not measured: closed loop round 1" in result["table"]


def test_a_window_lasts_its_minimum_time_and_requests(monkeypatch):
    """The real measure() against a fake generate: a window sends until it has lasted --window-s
    and sent --window-waves requests per client, then lets the requests in flight finish."""
    import time

    from smoke import client

    def generate(base: str, p: client.Prompt, timeout: float = 600, rid: str | None = None) -> client.Result:
        time.sleep(0.01)
        return client.Result(p.key, [7] * p.max_new_tokens, {"spec_accept_length": 2.0})

    monkeypatch.setattr(client, "generate", generate)
    prompt_at = functools.partial(bench.window_prompt, 3000, 2, 4, 100)
    far = time.time() + 60
    by_time = bench.measure("b", prompt_at, 2, 0.3, 4, 10, far)
    assert by_time["seconds"] >= 0.3 and by_time["requests"] > 4 and not by_time["cut"]
    assert by_time["output_tokens"] == 4 * by_time["requests"] and by_time["accept_length"] == 2.0
    assert set(by_time["outputs"]) == {f"c2-{i}" for i in range(by_time["requests"])}  # the stream's first ones
    by_count = bench.measure("b", prompt_at, 2, 0.0, 12, 10, far)
    assert by_count["requests"] == 12
    assert bench.measure("b", prompt_at, 2, 5.0, 4, 10, time.time())["cut"]  # past the deadline: not kept
    assert [bench.window_requests(c, 3) for c in (1, 2, 4, 256)] == [8, 8, 12, 768]
    assert bench_options("--window-s", "30", "--window-waves", "5").window_s == 30.0
    assert bench_options().window_s == 10.0 and bench_options().window_waves == 3


def test_a_window_stops_sending_at_the_first_error(monkeypatch):
    from smoke import client

    def generate(base: str, p: client.Prompt, timeout: float = 600, rid: str | None = None) -> client.Result:
        return client.Result(p.key, error="HTTP 500") if p.key == "c1-2" else client.Result(p.key, [1])

    monkeypatch.setattr(client, "generate", generate)
    m = bench.measure("b", lambda i: bench.window_prompt(3000, 1, 4, 100, i), 1, 30.0, 8, 10,
                      __import__("time").time() + 60)
    assert m["requests"] == 3 and m["errors"] == 1 and m["first_error"] == "HTTP 500"


def test_state_file_of_other_options_is_refused(tmp_path):
    opts = bench_options("--rounds", "2")
    state, save = bench.load_state(tmp_path / "s.json", opts)
    state["windows_done"] = ["0:1"]
    save({})
    assert bench.load_state(tmp_path / "s.json", bench_options("--rounds", "2"))[0]["windows_done"] == ["0:1"]
    with pytest.raises(SystemExit, match="--state .*other options"):
        bench.load_state(tmp_path / "s.json", bench_options("--rounds", "3"))


# ----------------------------------------------------------------------------- arguments
def test_options_and_refused_values():
    o = bench_options()
    assert o.concurrency == bench.DEFAULT_CONCURRENCY and o.configs == bench.CONFIGS and o.out == Path("docs/bench")
    o = bench_options("--concurrency", "256,1,8", "--configs", "plain,eagle3_auto", "--server-args", "--gc-threshold 7 8",
                      "--threshold", "32,8")
    assert o.concurrency == (1, 8, 256) and o.configs == ("plain", "eagle3_auto") and o.thresholds == (8, 32)
    assert o.server_args == ("--gc-threshold", "7", "8")
    for flags, word in ((("--configs", "plain,nope"), "--configs"), (("--configs", "plain,plain"), "--configs"),
                        (("--concurrency", "1,0"), "--concurrency"), (("--concurrency", "1,x"), "--concurrency"),
                        (("--threshold", "0"), "--threshold"), (("--threshold", "8,8"), "--threshold"),
                        (("--threshold", "auto"), "--threshold"), (("--rounds", "-1"), "--rounds"),
                        (("--rounds", "0", "--ramp-cycles", "0"), "--ramp-cycles"),
                        (("--ramp-hold", "0"), "--ramp-hold"), (("--mem-share", "1.5"), "--mem-share"),
                        (("--max-total-tokens", "-1"), "--max-total-tokens"), (("--output-len", "0"), "--output-len"),
                        (("--window-s", "0"), "--window-s"), (("--window-waves", "0"), "--window-waves")):
        with pytest.raises(SystemExit, match=word):
            bench_options(*flags)
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    with pytest.raises(SystemExit, match="--models"):
        bench.options(ap.parse_args([]))
    e2e = build_parser().parse_args(["e2e", "--bench-rounds", "3", "--bench-configs", "plain,eagle3_thr"])
    assert bench.tuning_options(e2e, "bench-")["rounds"] == 3
    with pytest.raises(SystemExit, match="--bench-rounds"):
        bench.tuning_options(build_parser().parse_args(["e2e", "--bench-rounds", "-2"]), "bench-")
    assert bench_options("--rounds", "0").rounds == 0  # the ramp alone


def test_bench_model_shapes():
    """The parameter counts of the real transformers models the bench shapes build (on the meta
    device: no memory): 1b ~1.0e9, 8b ~7e9 (Llama-3-8B's layers, small vocab)."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    def params(name: str) -> int:
        sz = models.SIZES[name]
        cfg = LlamaConfig(vocab_size=sz.vocab, hidden_size=sz.hidden, intermediate_size=sz.intermediate,
                          num_hidden_layers=sz.layers, num_attention_heads=sz.heads,
                          num_key_value_heads=sz.kv_heads, head_dim=sz.hidden // sz.heads,
                          tie_word_embeddings=False)
        with torch.device("meta"):
            return sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())

    assert 0.95e9 < params("1b") < 1.05e9
    assert 6.9e9 < params("8b") < 7.1e9
    ap = build_parser()
    assert ap.parse_args(["e2e", "--bench-size", "8b"]).bench_size == "8b"
    with pytest.raises(SystemExit):
        ap.parse_args(["e2e", "--bench-size", "tiny"])


# ----------------------------------------------------------------------------- --diagnose
def test_diagnose_splits_gpu_seconds_by_category():
    levels = {"256": {"plain": [{"seconds": 10.0, "gpu_s": {"decode": 8.0, "extend": 1.0}},
                                {"seconds": 12.0, "gpu_s": {"decode": 9.0, "extend": 1.0}}],
                      "eagle3_thr": [{"seconds": 11.0, "gpu_s": {"decode": 8.2, "draft_kv_only": 0.1}}],
                      "eagle3": [{"seconds": 9.0}]}}
    assert diagnose.gpu_split(levels) == [
        "c=256 plain: wall 11.000s, decode 8.500s, extend 1.000s, rest 1.500s",
        "c=256 eagle3_thr: wall 11.000s, decode 8.200s, draft_kv_only 0.100s, rest 2.700s"]
    from smoke import client

    def scrape(decode: float, extend: float) -> dict[str, float]:
        return client.parse_prometheus(
            "# TYPE sglang:forward_execution_seconds_total counter\n"
            f'sglang:forward_execution_seconds_total{{model_name="t",category="decode"}} {decode}\n'
            f'sglang:forward_execution_seconds_total{{model_name="t",category="extend"}} {extend}\n'
            'sglang:num_running_reqs{model_name="t"} 3.0\n')
    assert diagnose.gpu_seconds(scrape(1.0, 2.0), scrape(8.5, 2.25)) == {"decode": 7.5, "extend": 0.25}
    assert diagnose.gpu_seconds({}, {}) == {}  # timer off: no such counter


def test_pyspy_summary_of_a_real_scheduler_sample():
    """py-spy's raw output from an H200 run (threshold server in plain mode at 256 requests, the 80
    heaviest stacks): only the scheduler thread counts, shares are of its samples, ms from step time."""
    raw = (REPO / "tests/data/pyspy_scheduler_plain_mode.txt").read_text()
    s: dict[str, Any] = diagnose.summarize_pyspy({"raw": raw}, 256_000 / 4.0, 256)
    assert s["step_ms"] == pytest.approx(4.0)
    incl = {f: pct for f, pct, _ in s["inclusive_pct"]}
    assert incl["Scheduler.event_loop_overlap (scheduler.py)"] == 100.0
    assert 10 < incl["EAGLEWorkerV2._forward_plain_decode (eagle_worker_v2.py)"] < 100
    assert not any("watchdog" in f or "Timer.check" in f for f in incl)  # other threads left out
    assert all(row[2] == pytest.approx(row[1] * 4.0 / 100, abs=1e-3) for row in s["inclusive_pct"])
    assert sum(pct for _, pct, _ in s["self_pct"]) <= 100.0
    text = pyspy.render("eagle3_thr", s)
    assert text.startswith("py-spy eagle3_thr:")
    assert diagnose.summarize_pyspy({"error": "no py-spy binary"}, None, 256) == {"error": "no py-spy binary"}
    assert pyspy.summarize("thread (1): MainThread;other (x.py:1) 5\n")["error"].startswith("no sample")
    # the sample's three idle stacks (Scheduler.on_idle: no batch) are counted apart, not in the shares
    assert s["idle_samples"] == 28 + 7 + 6 and not any("on_idle" in f or "Poller.poll" in f for f in incl)
    assert "41 idle ones, with no batch, left out" in text
    assert "pyspy eagle3_thr: no py-spy binary" in diagnose.render("eagle3_thr", {"pyspy": {"error": "no py-spy binary"},
                                                                                   "profile": {"error": "x"}})


def test_a_run_without_plain_does_not_claim_equal_outputs():
    # the outputs are compared with the plain server's of the same run: without one, nothing is
    result = json.loads(RESULT.read_text())
    assert "every output equal to plain decoding's" in bench_report.markdown(result)
    result["configs"] = [c for c in result["configs"] if c != "plain"]
    result["servers"].pop("plain", None)
    md = bench_report.markdown(result)
    assert "every output equal" not in md
    assert "- outputs NOT compared (no plain server in this run); 0 request errors" in md
