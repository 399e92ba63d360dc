"""The user-facing benchmark (bench.throughput), its paired windows (bench.pairing), its servers
that outlive a call (bench.servers), its report (bench.report) and --diagnose (bench.diagnose), on
a CPU: what every server is started with, the load's shape, the statistics, the files a result
becomes (a real matplotlib render), and the arguments refused.

tests/data/bench_result_format.json is a bench.json in the current format whose figures are made
up to exercise the report (a host whose speed drifts 30% between blocks); it is not a measurement.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import struct
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import (
    checks,
    diagnose,
    hostinfo,
    options,
    pairing,
    pyspy,
    ramp,
    servers,
    throughput,
    window,
    workload,
)
from bench import report as bench_report
from bench.__main__ import build_parser
from smoke import client, models
from smoke.checks import check_log_clean
from smoke.deadline import Deadline
from smoke.server import Server, ServerConfig, SmokeError, group_running

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


def free_port_base() -> int:
    return 32000 + os.getpid() % 1500 * 8


# ----------------------------------------------------------------------------- paired windows
def test_blocks_alternate_the_order_so_each_server_comes_first_as_often():
    orders = [pairing.block_order(["a", "b", "c"], k) for k in range(4)]
    assert orders == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"], ["c", "b", "a"]]
    firsts = [o[0] for o in orders]
    assert firsts.count("a") == firsts.count("c") == 2


def test_a_ratio_within_each_block_does_not_see_the_host_drift():
    """The host runs 30% slower in every other block and B is 0.97x A in every block: the ratio is
    0.97 with a zero-width interval, though B's tokens/s spread from 679 to 970."""
    blocks = [{"windows": {"A": {"tok_per_s": 1000 * s}, "B": {"tok_per_s": 970 * s}}}
              for s in (1.0, 0.7, 1.0, 0.7, 1.0, 0.7)]
    ratio = pairing.compare(blocks, "B", ["A"])
    assert ratio is not None and ratio.median == pytest.approx(0.97)
    assert ratio.low == pytest.approx(0.97) and ratio.high == pytest.approx(0.97)
    assert ratio.text() == "0.97x [0.97-0.97]" and ratio.as_dict()["pairs"] == 6


def test_the_bootstrap_interval_holds_the_median_and_widens_with_the_spread():
    tight = [0.99, 1.0, 1.01, 1.0, 0.995, 1.005]
    wide = [0.85, 1.0, 1.15, 0.9, 1.1, 1.0]
    lo_t, hi_t = pairing.bootstrap_interval(tight)
    lo_w, hi_w = pairing.bootstrap_interval(wide)
    assert lo_t <= statistics.median(tight) <= hi_t and lo_w <= statistics.median(wide) <= hi_w
    assert hi_t - lo_t < hi_w - lo_w
    assert min(tight) <= lo_t and hi_t <= max(tight)  # a median resampled stays within the data
    assert pairing.bootstrap_interval(tight) == (lo_t, hi_t)  # seeded: the same windows, the same interval
    with pytest.raises(ValueError):
        pairing.bootstrap_interval([])


def test_a_block_with_a_failed_window_is_left_out_of_its_ratios():
    blocks = [{"windows": {"A": {"tok_per_s": 100.0}, "B": {"tok_per_s": 90.0}}},
              {"windows": {"A": {"tok_per_s": 100.0, "errors": 2}, "B": {"tok_per_s": 10.0}}},
              {"windows": {"A": {"tok_per_s": 100.0}}},
              {"windows": {"A": {"tok_per_s": 80.0}, "B": {"tok_per_s": 72.0}, "C": {"tok_per_s": 88.0}}}]
    assert pairing.block_ratios(blocks, "B", ["A"]) == [0.9, 0.9]
    assert pairing.block_ratios(blocks, "C", ["A", "B"]) == [1.1]  # over the better of the two
    assert pairing.compare(blocks, "D", ["A"]) is None


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
    assert list(rows) == ["1", "64", "256"]
    # c=256: plain 54000 x drift (1.0, 0.8, 1.1, 0.9) -> median 51300; EAGLE-3 30000/54000 in every block
    assert rows["256"][0] == "51300" and rows["256"][2] == "28500 (0.56x [0.56-0.56])"
    # the twin: 0.99, 1.0, 1.01, 1.0 of plain in its blocks
    assert rows["256"][1] == "51030 (1.00x [0.99-1.01])"
    header = next(line for line in md.splitlines() if line.startswith("| concurrency"))
    assert "plain | plain (A/A twin) | EAGLE-3 | EAGLE-3 + threshold 16 | EAGLE-3 + auto" in header
    # the promise table carries the A/A floor beside every comparison
    assert "| 256 | 0.98x [0.98-0.98] | 0.99x [0.98-1.00] | 1.00x [0.99-1.01] |" in md
    assert "| 64 | 0.99x [0.98-1.00] | 16 | 1.01x [1.00-1.02] |" in md  # auto against the alternatives
    # per decode step at 256: 3 s over the steps; GPU 3.8 ms (decode + extend), host the rest
    assert "| 256 | 5.00 / 3.80 / 1.20 (256) |" in md
    assert "- server: call 2: plain: the server started earlier" in md
    assert "at most EAGLE-3 0.02" in md and "CPUs: plain 1,2,3" in md
    assert "every output equal to plain decoding's" in md
    assert "![tokens/s by concurrency](concurrency.png)" in md


def test_tables_of_the_recorded_result():
    result = json.loads(RESULT.read_text())
    table = bench_report.level_table(result)
    assert table["256"]["eagle3"]["vs_plain"]["median"] == pytest.approx(0.5556, abs=1e-4)
    assert table["256"]["eagle3"]["blocks"] == 4 and table["256"]["eagle3"]["accept_length"] == 3.1
    assert table["1"]["plain"]["vs_plain"] is None
    floor = bench_report.floor_table(result)
    assert floor["256"]["ratios"] == [0.99, 1.0, 1.01, 1.0] and floor["256"]["median"] == 1.0
    better = bench_report.better_table(result)
    assert better["256"]["eagle3_thr16"]["median"] == pytest.approx(0.98)
    assert set(better["256"]) == {"eagle3_thr16", "eagle3_auto"}  # not the twin, not the fixed modes
    steps = bench_report.step_table(result)
    assert steps["256"]["plain"] == pytest.approx({"wall_ms": 5.0, "tokens_per_step": 256.0, "gpu_ms": 3.8,
                                                   "host_ms": 1.2}, abs=0.03)
    assert "gpu_ms" not in steps["64"]["plain"]  # no device timer figures there
    ramp = bench_report.ramp_summary(result)
    assert ramp["eagle3_auto"]["min_share_of_better"] == 0.98
    assert ramp["eagle3"]["mode_changes"] is None and ramp["eagle3_thr16"]["mode_changes"] == 4
    # without always-on EAGLE-3 there is no "better of the two": the A/A table stands alone
    result["configs"].remove("eagle3")
    assert bench_report.better_table(result) == {}
    md = bench_report.markdown(result)
    assert "better of plain and always-on EAGLE-3 in the same block" not in md
    assert "| 256 | 1.00x [0.99-1.01] | 0.990, 1.000, 1.010, 1.000 |" in md


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
    result["configs"].remove("plain_twin")
    assert "| not measured |" in bench_report.markdown(result)  # no twin: the floor column says so


# ----------------------------------------------------------------------------- the load
def test_window_workload_and_ramp_schedule():
    assert workload.workload(3000, 8, 256, 0, 5) == workload.workload(3000, 8, 256, 0, 5)  # the same for every server
    assert workload.workload(3000, 8, 256, 0, 5) != workload.workload(3000, 8, 256, 1, 5)  # another block, other prompts
    assert workload.workload(3000, 8, 256, 0, 9)[:5] == workload.workload(3000, 8, 256, 0, 5)  # one stream, cut anywhere
    assert all(32 <= len(p.input_ids) <= workload.MAX_PROMPT_LEN for p in workload.workload(3000, 8, 256, 0, 50))
    assert workload.ramp_prompt(3000, 64, "ramp-3-1") == workload.ramp_prompt(3000, 64, "ramp-3-1")
    assert ramp.ramp_levels((1, 4, 16), 2) == [1, 4, 16, 4, 1, 4, 16, 4, 1]
    assert ramp.ramp_levels((1, 4, 16), 0) == []


def test_tokens_are_counted_in_the_window_only():
    # 100 tokens over 0-2 s, 50 over 1-3 s, 30 over 2.5-5 s; the window 1-3 s
    spans = [(0.0, 2.0, 100), (1.0, 3.0, 50), (2.5, 5.0, 30)]
    assert window.tokens_between(spans, 1.0, 3.0) == pytest.approx(50 + 50 + 6)
    assert window.tokens_between([(1.0, 1.0, 9)], 0.0, 2.0) == 0  # no lifetime: nothing to spread


def test_decode_steps_come_from_the_servers_own_counter():
    def scrape(graph: float, eager: float, prefill: float) -> dict[str, float]:
        return client.parse_prometheus(
            f'sglang:cuda_graph_passes_total{{model_name="t",mode="decode_cuda_graph"}} {graph}\n'
            f'sglang:cuda_graph_passes_total{{model_name="t",mode="decode_none"}} {eager}\n'
            f'sglang:cuda_graph_passes_total{{model_name="t",mode="prefill_none"}} {prefill}\n')
    assert window.decode_steps(scrape(10, 2, 5), scrape(110, 3, 50)) == 101  # prefill passes are no decode step
    assert window.decode_steps({}, {"sglang:num_running_reqs": 3.0}) is None  # metrics without the counter


class FakeGenerate:
    """client.generate replaced: `per_token` s a token; an abort_all cuts what is in flight short."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, per_token: float = 0.002, fail: str | None = None):
        self.per_token, self.fail = per_token, fail
        self.aborted_at: float | None = None
        self.rids: list[str | None] = []
        monkeypatch.setattr(client, "generate", self.generate)
        monkeypatch.setattr(client, "post", self.post)

    def post(self, url: str, payload: Any, timeout: float = 600) -> str:
        if url.endswith("/abort_request"):
            assert payload == {"abort_all": True}
            self.aborted_at = time.time()
        return "{}"

    def generate(self, base: str, p: client.Prompt, timeout: float = 600, rid: str | None = None) -> client.Result:
        self.rids.append(rid)
        t0 = time.time()
        if p.key == self.fail:
            return client.Result(p.key, error="HTTP 500")
        ids = []
        for j in range(p.max_new_tokens):
            if self.aborted_at is not None and self.aborted_at > t0:
                break
            time.sleep(self.per_token)
            ids.append(j)
        return client.Result(p.key, ids, {"spec_accept_length": 2.0})


def test_a_window_counts_its_seconds_then_aborts_what_is_in_flight(monkeypatch):
    """The real measure() against a fake generate: clients in a closed loop; the tokens of the
    counted seconds only; at the end every request in flight is aborted and kept as a prefix."""
    fake = FakeGenerate(monkeypatch, per_token=0.005)
    prompt_at = functools.partial(workload.window_prompt, 3000, 2, 40, 100)  # 40 tokens: 0.2 s a request
    t0 = time.time()
    m = window.measure("b", prompt_at, 2, 0.3, 1.0, 10, time.time() + 60)
    assert not m["cut"] and m["seconds"] == pytest.approx(1.0, abs=0.1)
    assert time.time() - t0 < 1.3 + 0.2 + 0.5  # the aborted requests did not run to their end
    assert fake.aborted_at is not None and m["abort_all"]
    assert m["aborted"] == 2 and all(len(ids) < 40 for ids in m["prefixes"].values())
    assert m["requests"] >= 8 and all(len(ids) == 40 for ids in m["outputs"].values())
    # two clients, a token each 5 ms: about 400 tokens/s (sleeps only run longer on a busy host)
    assert 150 < m["tok_per_s"] <= 410 and m["accept_length"] == 2.0 and m["errors"] == 0
    assert len({r.rsplit("-", 1)[0] for r in fake.rids}) == 1  # named, so that they could be aborted one by one
    assert window.measure("b", prompt_at, 2, 5.0, 4, 10, time.time() + 3)["cut"]  # past the deadline: not started


def test_a_failed_request_is_an_error_not_an_abort(monkeypatch):
    FakeGenerate(monkeypatch, per_token=0.001, fail="c1-2")
    m = window.measure("b", lambda i: workload.window_prompt(3000, 1, 8, 100, i), 1, 0.0, 0.5, 10, time.time() + 60)
    assert m["errors"] == 1 and m["first_error"] == "HTTP 500" and "c1-2" not in m["outputs"]


def test_outputs_and_aborted_prefixes_are_compared_with_plain_decoding():
    outs = {"plain": {"a": [1, 2], "b": [2, 3]}, "eagle3": {"a": [1, 2], "b": [9, 3]}}
    prefixes = {"plain": {"c": [5]}, "eagle3": {"c": [5], "b": [2]}, "plain_twin": {"a": [7]}}
    assert checks.compared_outputs(outs, prefixes, "block 1 c=4") == [
        "block 1 c=4 eagle3: 1 output(s) differ from plain (e.g. b)",
        "block 1 c=4 plain_twin: 1 aborted output(s) not a prefix of plain's (e.g. a)"]


# ----------------------------------------------------------------------------- servers
def test_configs_map_to_server_flags(tmp_path):
    opts = options.BenchOptions(models=tmp_path, out=tmp_path, thresholds=(16, 64), concurrency=(1, 256),
                              configs=("plain", "plain_twin", "eagle3", "eagle3_adaptive", "eagle3_thr", "eagle3_auto"),
                              server_args=("--gc-threshold", "50000"), mem_share=0.8, max_total_tokens=1000)
    names = options.server_names(opts)
    assert names == ["plain", "plain_twin", "eagle3", "eagle3_adaptive", "eagle3_thr16", "eagle3_thr64", "eagle3_auto"]
    argv = {name: throughput.server_config(name, opts).argv(30000) for name in names}
    assert "--speculative-algorithm" not in argv["plain"] and argv["plain_twin"] == argv["plain"]  # A/A: identical
    assert all("--speculative-adaptive" not in a for n, a in argv.items() if n != "eagle3_adaptive")
    ad = argv["eagle3_adaptive"]
    assert ad[ad.index("--speculative-adaptive-config") + 1] == str(tmp_path / "adaptive_config.json")
    # upstream's default tiers, without the 7-step one that crashed at start on an H200
    assert max(max(e["candidate_steps"]) for e in throughput.ADAPTIVE_CONFIG.values()) == 3
    assert throughput.ADAPTIVE_CONFIG["64"]["candidate_steps"] == [0]
    for name, a in argv.items():
        # every server the same fixed pool: they start side by side
        assert a[a.index("--mem-fraction-static") + 1] == "0.8" and a[a.index("--max-total-tokens") + 1] == "1000"
        assert a[a.index("--cuda-graph-max-bs") + 1] == "256" and "--sleep-on-idle" in a
        assert a[-2:] == ["--gc-threshold", "50000"], name  # the user's flags last
        assert (throughput.THRESHOLD_FLAG in a) == options.config_records(opts)[name].switches
    flag = {name: a[a.index(throughput.THRESHOLD_FLAG) + 1] for name, a in argv.items() if throughput.THRESHOLD_FLAG in a}
    assert flag == {"eagle3_thr16": "16", "eagle3_thr64": "64", "eagle3_auto": "auto"}
    sized = throughput.server_config("plain", options.BenchOptions(models=tmp_path, out=tmp_path, concurrency=(1, 256)))
    assert sized.argv(1)[sized.argv(1).index("--max-total-tokens") + 1] == str(int(1.1 * 256 * (64 + 320)))
    assert throughput.server_config("plain", opts).env == {}
    assert throughput.server_config("plain", options.BenchOptions(models=tmp_path, out=tmp_path, diagnose=True)).env \
        == diagnose.SERVER_ENV
    # auto traces its steps into the bench's folder (the logs a GPU run brings back)
    assert throughput.server_config("eagle3_auto", opts).env == {
        "SGLANG_IMAGE_AUTO_TRACE": str(tmp_path.resolve() / "eagle3_auto_steps.jsonl")}
    assert all(throughput.server_config(n, opts).env == {} for n in names if n != "eagle3_auto")


def test_a_depth_sweep_is_one_always_on_eagle3_server_per_draft_depth(tmp_path):
    # eagle3_depth d: drafts d steps and verifies d + 1 tokens a request (top-k 1, a chain);
    # eagle3 is the launch depth, 3. The record, not the name, says what a server is.
    opts = options.BenchOptions(models=tmp_path, out=tmp_path, concurrency=(1, 64), depths=(1, 2),
                              configs=("plain", "eagle3", "eagle3_depth"))
    assert options.server_names(opts) == ["plain", "eagle3", "eagle3_depth1", "eagle3_depth2"]

    def spec(name: str) -> tuple[str | None, ...]:
        a = throughput.server_config(name, opts).argv(30000)
        return tuple(a[a.index(f) + 1] if f in a else None for f in (
            "--speculative-num-steps", "--speculative-num-draft-tokens", "--speculative-eagle-topk",
            "--speculative-draft-model-path"))

    draft = str(tmp_path / "draft")
    assert spec("plain") == (None, None, None, None)
    assert spec("eagle3") == ("3", "4", "1", draft)
    assert spec("eagle3_depth1") == ("1", "2", "1", draft)
    assert spec("eagle3_depth2") == ("2", "3", "1", draft)
    records = options.config_records(opts)
    assert [(r.kind, r.steps, r.switches) for r in records.values()] == [
        ("plain", 0, False), ("fixed", 3, False), ("fixed", 1, False), ("fixed", 2, False)]
    assert bench_options("--configs", "plain,eagle3_depth", "--depth", "2,1").depths == (1, 2)
    for bad in ("0", "1,1", "x", ""):
        with pytest.raises(SystemExit, match="--depth .*distinct draft depths >= 1"):
            bench_options("--configs", "plain,eagle3_depth", "--depth", bad)


def test_a_schedule_sweep_is_one_server_per_draft_depth_schedule(tmp_path):
    # eagle3_sched: the plugin's --speculative-depth-schedule, one server per schedule given
    # (';' between them), each checked by the plugin's own parser before any server starts.
    opts = bench_options("--configs", "plain,eagle3_sched", "--schedule", "1-16:3,17-:0; 1-8:3,9-16:3,17-64:1,65-:0")
    assert opts.schedules == ("1-16:3,17-:0", "1-16:3,17-64:1,65-:0")  # tiers of one depth merged
    opts = options.BenchOptions(models=tmp_path, out=tmp_path, concurrency=(1, 64), schedules=opts.schedules,
                              configs=opts.configs)
    assert options.server_names(opts) == ["plain", "eagle3_sched1", "eagle3_sched2"]
    a = throughput.server_config("eagle3_sched2", opts).argv(30000)
    assert a[a.index("--speculative-depth-schedule") + 1] == "1-16:3,17-64:1,65-:0"
    assert a[a.index("--speculative-num-steps") + 1] == "3" and throughput.THRESHOLD_FLAG not in a
    assert options.config_records(opts)["eagle3_sched1"].switches
    assert options.config_records(opts)["eagle3_sched1"].label == "EAGLE-3 + schedule 1-16:3,17-:0"
    with pytest.raises(SystemExit, match="--schedule: the last tier must be open"):
        bench_options("--configs", "plain,eagle3_sched", "--schedule", "1-16:3,17-32:0")
    with pytest.raises(SystemExit, match="--schedule .*distinct schedules"):
        bench_options("--configs", "plain,eagle3_sched", "--schedule", "1-16:3,17-:0;1-16:3,17-:0")


def test_the_report_labels_and_compares_each_depth_by_its_record():
    # A fixed depth is one more server against the better of plain and EAGLE-3 in the same block,
    # labelled by its record; its accept length is in the report's own table.
    def window(tok: float, accept: float | None) -> dict[str, Any]:
        return {"tok_per_s": tok, "accept_length": accept, "errors": 0, "output_tokens": int(tok * 3),
                "seconds": 3.0, "steps": 300}
    blocks = [{"block": k + 1, "order": [], "windows": {
        "plain": window(1000 + k, None), "eagle3": window(990, 2.8), "eagle3_depth1": window(1100, 1.7)}}
        for k in range(3)]
    result: dict[str, Any] = {
        "configs": ["plain", "eagle3", "eagle3_depth1"], "blocks": {"64": blocks}, "pairs": 3,
        "config_records": {"plain": {"name": "plain", "kind": "plain"},
                           "eagle3": {"name": "eagle3", "kind": "fixed", "steps": 3},
                           "eagle3_depth1": {"name": "eagle3_depth1", "kind": "fixed", "steps": 1}}}
    better = bench_report.better_table(result)
    assert set(better["64"]) == {"eagle3_depth1"} and better["64"]["eagle3_depth1"]["median"] == pytest.approx(1100 / 1001, abs=1e-3)
    text = bench_report.markdown(result)
    assert "EAGLE-3 depth 1" in text and "| 64 | 2.80 | 1.70 |" in text
    # a result of the bench before records: the names still say what ran
    old = {"configs": ["plain", "eagle3", "eagle3_thr16"], "not_run": {"eagle3_auto": "no plugin"}}
    assert bench_report.label(old, "eagle3_thr16") == "EAGLE-3 + threshold 16"
    assert bench_report.label(old, "eagle3") == "EAGLE-3"
    assert bench_report.label(old, "eagle3_auto") == "EAGLE-3 + auto"


def test_switching_servers_can_start_with_the_servers_own_limits(tmp_path):
    # --switching-defaults: the threshold and auto servers start as the README's Serve command
    # does (no --max-running-requests, no decode graph size); the others keep the top concurrency.
    opts = options.BenchOptions(models=tmp_path, out=tmp_path, thresholds=(16,), concurrency=(1, 64),
                              configs=("plain", "eagle3", "eagle3_thr", "eagle3_auto"),
                              switching_defaults=True)
    argv = {n: throughput.server_config(n, opts).argv(30000) for n in options.server_names(opts)}
    for name, a in argv.items():
        given = not options.config_records(opts)[name].switches
        assert ("--max-running-requests" in a) == given and ("--cuda-graph-max-bs-decode" in a
                                                             or "--cuda-graph-max-bs" in a) == given
        if given:
            assert a[a.index("--max-running-requests") + 1] == "64"
    assert bench_options("--switching-defaults").switching_defaults
    assert not bench_options().switching_defaults


class ChecksServer:
    def __init__(self, log: Path, env: dict[str, str] | None = None):
        self.base, self.log_path = "http://x", log
        self.cfg = ServerConfig("x", log.parent, env=env or {})

    def log_text(self) -> str:
        return self.log_path.read_text()


def test_server_checks_keep_every_figure_whichever_check_fails(monkeypatch, tmp_path):
    # The KV pool check of every server, a threshold server's too, even where its log shows an
    # error (it used to be dropped with the log check's exception) or its limit is too low.
    log = tmp_path / "server_bench_eagle3_thr16.2.log"
    log.write_text("Traceback (most recent call last)\nRuntimeError: boom\n")
    monkeypatch.setattr(checks, "kv_used_after_flush", lambda base: 12)
    monkeypatch.setattr(checks, "running_limit", lambda base: 48)
    monkeypatch.setattr(checks, "speculation_state", lambda base: {"threshold": 16})
    info, problems = checks.server_checks("eagle3_thr16", ChecksServer(log), 256, True)
    assert info == {"kv_used_after_flush": 12, "running_limit": 48,
                    "speculative_disable": {"threshold": 16}}
    assert problems[0] == "eagle3_thr16: 12 KV tokens still in use after the load and a cache flush"
    assert problems[1] == "eagle3_thr16: runs at most 48 requests at once, below the top concurrency 256"
    assert problems[2].startswith("eagle3_thr16: server log shows an error") and log.name in problems[2]
    log.write_text("all fine\n")
    monkeypatch.setattr(checks, "kv_used_after_flush", lambda base: 0)
    monkeypatch.setattr(checks, "running_limit", lambda base: 256)
    assert checks.server_checks("eagle3_thr16", ChecksServer(log), 256, True)[1] == []
    # auto's step trace, where its server wrote one, is read back into the report
    trace = tmp_path / "eagle3_auto_steps.jsonl"
    env = {"SGLANG_IMAGE_AUTO_TRACE": str(trace)}
    assert "step_trace" not in checks.server_checks("eagle3_auto", ChecksServer(log, env), 256, True)[0]
    trace.write_text("".join(json.dumps({"t": 0.0, "kind": k, "batch": 8, "seconds": 0.01, "tokens": n,
                                         "recorded": True, "prefills": 0}) + "\n"
                             for k, n in (("plain", 8), ("speculative", 24)) for _ in range(4)))
    info, problems = checks.server_checks("eagle3_auto", ChecksServer(log, env), 256, True)
    assert problems == [] and [r["kind"] for r in info["step_trace"]] == ["plain", "speculative"]
    md = bench_report.markdown({"configs": ["eagle3_auto"], "servers": {"eagle3_auto": info}})
    assert "- EAGLE-3 + auto steps: 5-8 speculative / plain: 3.000x by the medians, 3.000x by the sums" in md


def test_auto_runs_only_where_the_plugin_is_installed(tmp_path, monkeypatch):
    """Read from real package metadata: a dist-info listing auto_threshold.py says `auto` is there."""
    assert throughput.auto_supported() is False  # the test environment has no plugin installed
    info = tmp_path / "sglang_image_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-image-plugin\nVersion: 0.1\n")
    (info / "RECORD").write_text("sglang_image_plugin/__init__.py,,\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert throughput.auto_supported() is False  # a plugin without the auto threshold
    (info / "RECORD").write_text("sglang_image_plugin/__init__.py,,\nsglang_image_plugin/auto_threshold.py,,\n")
    assert throughput.auto_supported() is True


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


# ----------------------------------------------------------------------------- resuming, deadlines
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
            return config(name, opts)

        monkeypatch.setattr(throughput, "server_config", server_config)
        monkeypatch.setattr(throughput, "kv_pool", lambda srv: 5000)
        monkeypatch.setattr(throughput, "warm_up", lambda base, opts: self.spend(10))
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
                "abort_all": True, "cut": False, "outputs": {k: [len(k)] for k in keys}, "prefixes": {}}

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


def test_a_deadline_too_short_starts_no_server_and_says_so(tmp_path):
    (tmp_path / "expected.json").write_text(json.dumps({"vocab_size": 3072, "size": "1b"}))
    opts = options.BenchOptions(models=tmp_path, out=tmp_path / "out", deadline=Deadline(0.0),
                              configs=("plain", "eagle3", "eagle3_auto"))
    result = throughput.run_bench(opts, {})
    assert result["skipped"][0] == "concurrency 1: 6 of 6 blocks"
    assert "no server started" in result["skipped"][-1]
    assert result["configs"] == ["plain", "eagle3"] and "eagle3_auto" in result["not_run"]
    assert "remaining: concurrency 256: 6 of 6 blocks" in result["table"] and not result["blocks"]


def test_servers_warm_up_one_after_the_other(lab, monkeypatch):
    """A server that learns its crossover from its own step times must not learn them while the
    others share the GPU: the warm-ups do not overlap."""
    active: list[str] = []
    seen: list[tuple[str, int]] = []

    def warm_up(base: str, opts: options.BenchOptions) -> None:
        active.append(base)
        seen.append((base.removeprefix("http://"), len(active)))
        time.sleep(0.02)  # long enough for a second thread to enter, were there one
        lab.spend(10)
        active.remove(base)

    monkeypatch.setattr(throughput, "warm_up", warm_up)
    throughput.run_bench(lab.options(400, configs=("plain", "eagle3", "plain_twin")), {})
    assert seen == [("plain", 1), ("eagle3", 1), ("plain_twin", 1)]


def test_a_resumed_run_goes_on_with_the_servers_of_the_last_call(lab):
    """Three calls with one state, as e2e makes them after each deadline: the servers start once,
    side by side, and the later calls use them; no block or ramp is measured twice; the blocks of
    one concurrency come back to back, the order reversed every other one; the bench complete, the
    servers are checked and stopped, and a call after the end measures nothing. Budgets: a start
    150 s + a warm-up 15 s per server until measured; a block (settle + window + 2 s) per server;
    20 s + 12 s per server kept to end a call."""
    state: dict[str, Any] = {}
    saved: list[list[str]] = []
    # plan: 180 s to start, 2 x 23 s a block, 44 s kept = 270 s; spent: 60 + 20 s to start, 42 s a block
    first = throughput.run_bench(lab.options(290, ramp_hold_s=10.0), state, lambda r: saved.append(list(r["skipped"])))
    assert lab.launched == ["plain", "eagle3"] and lab.warm == {"plain", "eagle3"} and not lab.stopped
    assert lab.windows == [("plain", 1, "c1-0"), ("eagle3", 1, "c1-0"), ("eagle3", 1, "c1-0"), ("plain", 1, "c1-0"),
                           ("plain", 4, "c4-0"), ("eagle3", 4, "c4-0")]
    assert first["skipped"][:2] == ["concurrency 4: 1 of 2 blocks", "ramp of plain, eagle3"]
    assert "remaining: concurrency 4: 1 of 2 blocks" in first["table"] and not first["failures"]
    assert len(saved) == 3 and "| 4 (1 of 2 blocks) |" in first["table"] and "result" not in state
    state = json.loads(json.dumps(state))  # e2e keeps it as JSON between calls

    lab.launched.clear(), lab.windows.clear()
    # plan: the start as measured (60 s), a block 46 s, a ramp 3 x 10 + 30 s, 44 s kept
    second = throughput.run_bench(lab.options(160, ramp_hold_s=10.0), state)
    assert lab.launched == [] and lab.ramps == ["plain"]  # the servers of the first call, warm: no start
    assert lab.windows == [("eagle3", 4, "c4-0"), ("plain", 4, "c4-0")]
    assert lab.measured(second) == [(n, c, k) for n in ("eagle3", "plain") for c in (1, 4) for k in (1, 2)]
    assert second["skipped"][0] == "ramp of eagle3" and not lab.stopped
    assert any("plain: the server started earlier" in e for e in second["server_events"])
    assert bench_report.level_table(second)["1"]["eagle3"]["vs_plain"]["median"] == 1.2

    third = throughput.run_bench(lab.options(600, ramp_hold_s=10.0), state)
    assert lab.launched == [] and lab.ramps == ["plain", "eagle3"]
    assert not third["skipped"] and not third["failures"] and state["result"] is third
    assert sorted(lab.stopped) == ["eagle3", "plain"] and not lab.running  # complete: checked and stopped
    assert third["calls"] == 3 and set(third["ramp"]) == {"plain", "eagle3"} and "over 3 calls" in third["table"]
    assert "every output equal to plain decoding's" in third["table"] and "remaining" not in third["table"]
    assert set(third["servers"]) == {"plain", "eagle3"}

    assert throughput.run_bench(lab.options(600), state)["blocks"] == third["blocks"] and not lab.running


@pytest.mark.parametrize("seconds", range(10, 700, 30))
def test_a_call_finishes_whole_units_within_its_deadline(lab, seconds):
    """Whatever the time a call has: it ends within it; every block it keeps was measured on every
    server and none is measured and thrown away; no server is started without a block measured on
    it; the report lists exactly what is left."""
    result = throughput.run_bench(lab.options(seconds, pairs=1, concurrency=(1, 4, 16)), {})
    assert lab.opts is not None and lab.opts.deadline.left() > 0
    kept = lab.measured(result)
    assert len(lab.windows) == len(kept) and {(n, c) for n, c, _ in kept} == {(n, c) for n, c, _ in lab.windows}
    assert all((other, c, k) in kept for _, c, k in kept for other in ("plain", "eagle3"))
    assert bool(lab.launched) == bool(kept) and lab.launched in ([], ["plain", "eagle3"])
    levels_left = [c for c in (1, 4, 16) if str(c) not in result["blocks"]]
    if levels_left:
        assert result["skipped"][0] == f"concurrency {levels_left[0]}: 1 of 1 blocks"
        assert not lab.ramps  # the ramps wait for the blocks
    assert len(lab.ramps) == len(result["ramp"])
    assert ("ramp of plain, eagle3" in result["skipped"]) == (not result["ramp"])


def test_without_a_registry_the_servers_stop_with_the_call(lab):
    result = throughput.run_bench(lab.options(300, registry=None), {})
    assert result["skipped"] and sorted(lab.stopped) == ["eagle3", "plain"] and not lab.running


def test_launch_only_starts_the_servers_and_measures_nothing(lab):
    state: dict[str, Any] = {}
    result = throughput.run_bench(lab.options(300, launch_only=True), state)
    assert lab.launched == ["plain", "eagle3"] and not lab.windows and not lab.warm and not lab.stopped
    assert "result" not in state and any("--launch-only" in s for s in result["skipped"])


def test_e2e_keeps_each_unit_and_its_next_call_goes_on(lab, tmp_path):
    """The bench phase of `bench e2e` writes its state after every unit (a call killed at its limit
    keeps them), records its servers in the state dir, and its next call measures only what is
    left, on the same servers."""
    from bench import call, e2e

    def driver(seconds: float, *extra: str) -> e2e.E2E:
        drv = e2e.E2E(build_parser().parse_args([
            "e2e", "--bundle", str(tmp_path / "bundle"), "--state", str(tmp_path / "state"), "--out",
            str(tmp_path / "out"), "--phases", "bench", "--bench-configs", "plain,eagle3", "--bench-concurrency", "1,4",
            "--bench-pairs", "2", "--bench-ramp-cycles", "1", "--bench-ramp-hold", "5", "--bench-window-s", "40",
            *extra]))
        drv.call.deadline.at = time.time() + seconds
        lab.deadline = drv.call.deadline
        return drv

    models = tmp_path / "state" / "models" / "1b"
    models.mkdir(parents=True)
    (models / "expected.json").write_text(json.dumps({"vocab_size": 3072, "size": "1b"}))
    driver(300, "--bench-launch-only").runs.bench()  # the servers start; nothing measured or reported
    assert lab.launched == ["plain", "eagle3"] and "bench_reports" not in driver(1).call.state
    with pytest.raises(call.Deadline_):
        driver(320).runs.bench()  # returns without saving: what is on disk came from the progress calls
    assert lab.launched == ["plain", "eagle3"]  # the launched servers were used
    on_disk = json.loads((tmp_path / "state" / "state.json").read_text())
    run = next(iter(on_disk["bench_runs"].values()))
    assert run["blocks_done"] == ["1:0", "1:1", "4:0"]
    assert "concurrency 4: 1 of 2 blocks" in (tmp_path / "out" / "summary.txt").read_text()
    lab.windows.clear()
    driver(600).runs.bench()
    assert sorted(lab.windows) == [("eagle3", 4, "c4-0"), ("plain", 4, "c4-0")] and lab.ramps == ["plain", "eagle3"]
    assert not lab.running


def test_an_e2e_call_that_only_launches_does_not_count_the_bench_done(lab, tmp_path, monkeypatch):
    """A GPU run of 2026-12-04: the measuring call after a --bench-launch-only one said "bench: done
    in an earlier call" and measured nothing."""
    from bench import e2e

    monkeypatch.setattr(os, "environ", dict(os.environ))  # run() exports the servers' environment
    models = tmp_path / "state" / "models" / "1b"
    models.mkdir(parents=True)
    (models / "expected.json").write_text(json.dumps({"vocab_size": 3072, "size": "1b"}))

    def driver(*extra: str) -> e2e.E2E:
        drv = e2e.E2E(build_parser().parse_args([
            "e2e", "--bundle", str(tmp_path / "bundle"), "--state", str(tmp_path / "state"), "--out",
            str(tmp_path / "out"), "--phases", "bench", "--bench-configs", "plain,eagle3", "--bench-concurrency", "1",
            "--bench-pairs", "1", "--bench-window-s", "20", *extra]))
        drv.call.deadline.at = time.time() + 600
        return drv

    assert driver("--bench-launch-only").run() == 0 and lab.launched == ["plain", "eagle3"] and not lab.windows
    assert driver().run() == 0 and len(lab.windows) == 2 and lab.launched == ["plain", "eagle3"]
    assert "done in an earlier call" not in (tmp_path / "out" / "e2e.log").read_text()


FAKE_SGLANG = """
import json, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NAME = sys.argv[2]
LOCK = threading.Lock()
STATE = {"aborted_at": 0.0, "steps": 0}


class H(BaseHTTPRequestHandler):
    def answer(self, body, text=False):
        data = body.encode() if text else json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.startswith("/v1/loads"):
            return self.answer({"loads": [{"num_used_tokens": 0, "max_total_num_tokens": 5000}]})
        if self.path == "/metrics":
            return self.answer('sglang:cuda_graph_passes_total{mode="decode_cuda_graph"} %d\\n' % STATE["steps"], True)
        if self.path == "/server_info":
            return self.answer({"internal_states": [{"speculative_disable": {
                "threshold": 16, "mode": "speculative", "speculative_steps": 9, "plain_steps": 0, "mode_changes": 0,
                "acceptance_around_plain": {"window_steps": 64, "phases_measured": 2, "unpaired_steps": 0,
                                            "last_before": 3.2, "last_after": 3.15,
                                            "worst_after_over_before": 0.97}}}]})
        return self.answer({})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path == "/abort_request":
            STATE["aborted_at"] = time.time()
            return self.answer({})
        if self.path != "/generate":
            return self.answer({})
        t0, n = time.time(), req["sampling_params"]["max_new_tokens"]
        out = []
        for j in range(n):
            if STATE["aborted_at"] > t0:
                break
            time.sleep(0.002 / (2 if NAME == "eagle3" else 1))
            out.append((sum(req["input_ids"]) + j) % 97)
            with LOCK:
                STATE["steps"] += 1
        meta = {"spec_accept_length": 2.5} if NAME != "plain" else {}
        return self.answer({"output_ids": out, "meta_info": meta})

    def log_message(self, *a):
        pass


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class FakeSglang(ServerConfig):
    def argv(self, port: int) -> list[str]:
        return [sys.executable, "-c", FAKE_SGLANG, str(port), self.name]


def test_a_whole_run_on_real_processes_over_two_calls(tmp_path, monkeypatch):
    """run_bench end to end with server processes that answer as sglang does (no GPU), in two calls
    as e2e makes them: the first call's servers are found alive by the second, which finishes the
    blocks, the ramps and the checks and then stops them; outputs compared, KV pool checked."""
    monkeypatch.setattr(throughput, "server_config", lambda name, opts: FakeSglang(name, tmp_path))
    (tmp_path / "expected.json").write_text(json.dumps({"vocab_size": 3072, "size": "1b"}))

    def opts(seconds: float) -> options.BenchOptions:
        return options.BenchOptions(models=tmp_path, out=tmp_path / "out", configs=("plain", "plain_twin", "eagle3_thr"),
                                  concurrency=(1, 4), pairs=2, window_s=0.4, settle_s=0.1, ramp_cycles=1,
                                  ramp_hold_s=0.3, output_len=32, port=free_port_base(), cpus_per_server=0,
                                  registry=tmp_path / "reg.json", deadline=Deadline(time.time() + seconds))

    state: dict[str, Any] = {}
    first_opts = opts(900)

    def deadline_comes(_: dict[str, Any]) -> None:  # after the first block: only the time to end the call
        first_opts.deadline.at = time.time() + 60

    first = throughput.run_bench(first_opts, state, deadline_comes)
    assert state["blocks_done"] == ["1:0"] and first["skipped"][0] == "concurrency 1: 1 of 2 blocks"
    recorded = json.loads((tmp_path / "reg.json").read_text())
    assert set(recorded) == {f"{tmp_path.name}/{n}" for n in ("plain", "plain_twin", "eagle3_thr16")}
    pgids = {e["pgid"] for e in recorded.values()}
    assert all(group_running(p) for p in pgids)  # they outlive the call
    result = throughput.run_bench(opts(900), json.loads(json.dumps(state)))
    assert not result["failures"] and not result["skipped"]
    assert sum("is alive: reused" in e for e in result["server_events"]) == 3
    assert not any(group_running(p) for p in pgids) and json.loads((tmp_path / "reg.json").read_text()) == {}
    for c in ("1", "4"):
        blocks = result["blocks"][c]
        assert [b["block"] for b in blocks] == [1, 2] and blocks[1]["order"] == blocks[0]["order"][::-1]
        for b in blocks:
            for name in ("plain", "plain_twin", "eagle3_thr16"):
                w = b["windows"][name]
                assert w["seconds"] == pytest.approx(0.4, abs=0.05) and w["tok_per_s"] > 0 and w["steps"] and w["abort_all"]
    assert result["calls"] == 2 and set(result["ramp"]) == {"plain", "plain_twin", "eagle3_thr16"}
    assert bench_report.floor_table(result)["4"]["pairs"] == 2
    assert result["servers"]["eagle3_thr16"]["speculative_disable"]["threshold"] == 16
    assert all(info["kv_used_after_flush"] == 0 for info in result["servers"].values())
    assert "every output equal to plain decoding's" in result["table"]
    assert ("accept length 3.20 in the last 64 speculative steps before a plain phase, 3.15 in the "
            "first 64 after it (worst of 2 phases: 0.97x)") in result["table"]
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"bench.json", "bench.md"}


def test_command_line_state_file_resumes_and_stop_ends_its_servers(lab, tmp_path, capsys):
    """`bench run --state FILE`: a run stopped by --deadline says what is left and how to go on;
    the same command measures the rest; other options are refused; --stop ends what runs."""
    argv = ["run", "--models", str(tmp_path), "--out", str(tmp_path / "out"), "--configs", "plain,eagle3",
            "--concurrency", "1,4", "--pairs", "2", "--window-s", "20", "--state", str(tmp_path / "st.json")]
    a = build_parser().parse_args([*argv, "--deadline", "290"])
    assert a.main(a) == 1
    out = capsys.readouterr().out
    assert "BENCH INCOMPLETE: concurrency 4: 1 of 2 blocks" in out and "Run the same command to" in out
    assert lab.running == {"plain", "eagle3"}  # kept for the next call (recorded beside the state)
    lab.windows.clear()
    a = build_parser().parse_args([*argv, "--deadline", "600"])
    assert a.main(a) == 0 and sorted(lab.windows) == [("eagle3", 4, "c4-0"), ("plain", 4, "c4-0")]
    assert "BENCH INCOMPLETE" not in capsys.readouterr().out and not lab.running
    a = build_parser().parse_args([*argv, "--deadline", "340", "--pairs", "3"])
    with pytest.raises(SystemExit, match="other options"):
        a.main(a)
    a = build_parser().parse_args([*argv, "--stop"])
    assert a.main(a) == 0 and "stopped 0 server(s)" in capsys.readouterr().out


def test_a_server_that_fails_to_start_ends_the_run_with_its_log(lab, monkeypatch, tmp_path):
    """Without a registry nothing outlives the call: the failed start ends the run."""
    (tmp_path / "eagle3.log").write_text("Traceback ...\nRuntimeError: CUDA out of memory\n")

    def ensure(self: Any, configs: dict[str, ServerConfig], key_extra: str, log_for: Any, timeout: float) -> Any:
        raise SmokeError("eagle3: server exited with code 1 before it became healthy", log=tmp_path / "eagle3.log")

    monkeypatch.setattr(servers.ServerPool, "ensure", ensure)
    state: dict[str, Any] = {}
    result = throughput.run_bench(lab.options(600, registry=None), state)
    assert result["failures"][0].startswith("eagle3: server exited with code 1")
    assert "CUDA out of memory" in result["failures"][0]
    assert not result["skipped"] and result["not_measured"][0] == "concurrency 1: 2 of 2 blocks"
    assert state["result"] is result and "- not measured: concurrency 1: 2 of 2 blocks" in result["table"]


def test_a_failed_start_fails_its_call_and_the_next_call_starts_the_server_again(lab, monkeypatch, tmp_path):
    """A GPU run of 2026-12-04: the servers died at start (the host's torch was not in place yet);
    the run kept that as its final failure, so every call after the host was fixed replayed it
    and measured nothing. With the servers recorded, a failed start fails its own call only."""
    (tmp_path / "eagle3.log").write_text("Traceback ...\nImportError: undefined symbol\n")
    ensure = servers.ServerPool.ensure

    def failing(self: Any, configs: dict[str, ServerConfig], key_extra: str, log_for: Any, timeout: float) -> Any:
        raise SmokeError("eagle3: server exited with code 1 before it became healthy", log=tmp_path / "eagle3.log")

    monkeypatch.setattr(servers.ServerPool, "ensure", failing)
    state: dict[str, Any] = {}
    first = throughput.run_bench(lab.options(600), state)
    assert first["failures"][0].startswith("eagle3: server exited") and "undefined symbol" in first["failures"][0]
    assert "result" not in state and first["skipped"][0] == "concurrency 1: 2 of 2 blocks"
    monkeypatch.setattr(servers.ServerPool, "ensure", ensure)
    second = throughput.run_bench(lab.options(600), state)
    assert not second["failures"] and not second["skipped"] and state["result"] is second
    assert len(lab.measured(second)) == 8  # 2 servers, 2 concurrencies, 2 blocks
    assert "eagle3: server exited" not in second["table"]


def test_an_e2e_bench_that_failed_runs_again_on_the_next_call(lab, tmp_path, monkeypatch):
    """A failed phase runs again on the next call, the bench too: not its earlier failure replayed."""
    from bench import e2e

    monkeypatch.setattr(os, "environ", dict(os.environ))  # run() exports the servers' environment
    models = tmp_path / "state" / "models" / "1b"
    models.mkdir(parents=True)
    (models / "expected.json").write_text(json.dumps({"vocab_size": 3072, "size": "1b"}))

    def driver() -> e2e.E2E:
        drv = e2e.E2E(build_parser().parse_args([
            "e2e", "--bundle", str(tmp_path / "bundle"), "--state", str(tmp_path / "state"), "--out",
            str(tmp_path / "out"), "--phases", "bench", "--bench-configs", "plain,eagle3", "--bench-concurrency", "1",
            "--bench-pairs", "1", "--bench-window-s", "20"]))
        drv.call.deadline.at = time.time() + 600
        return drv

    monkeypatch.setattr(throughput, "server_checks",
                        lambda name, srv, top, switching: ({"kv_used_after_flush": 7}, [f"{name}: 7 KV tokens in use"]))
    assert driver().run() == 1 and len(lab.windows) == 2
    monkeypatch.setattr(throughput, "server_checks", lambda name, srv, top, switching: ({"kv_used_after_flush": 0}, []))
    assert driver().run() == 0 and len(lab.windows) == 4
    assert "measured anew" in (tmp_path / "out" / "e2e.log").read_text()


def test_state_file_of_other_options_is_refused(tmp_path):
    opts = bench_options("--pairs", "2")
    state, save = options.load_state(tmp_path / "s.json", opts)
    state["blocks_done"] = ["1:0"]
    save({})
    assert options.load_state(tmp_path / "s.json", bench_options("--pairs", "2"))[0]["blocks_done"] == ["1:0"]
    # where the servers run and whether this call only launches them: the same measurement
    assert options.load_state(tmp_path / "s.json", bench_options("--pairs", "2", "--port", "31000"))[0]
    with pytest.raises(SystemExit, match="--state .*other options"):
        options.load_state(tmp_path / "s.json", bench_options("--pairs", "3"))


# ----------------------------------------------------------------------------- arguments
def test_options_and_refused_values():
    o = bench_options()
    assert o.concurrency == (1, 4, 16, 64, 256) and o.configs == options.DEFAULT_CONFIGS == ("plain", "eagle3", "eagle3_thr")
    assert o.pairs == 6 and o.window_s == 3.0 and o.settle_s == 1.0 and o.out == Path("docs/bench")
    assert o.registry is None and o.cpus_per_server == 0  # pinning is asked for, not the default
    o = bench_options("--concurrency", "256,1,8", "--configs", "plain,plain_twin,eagle3_auto",
                      "--server-args", "--gc-threshold 7 8", "--threshold", "32,8", "--state", "st.json")
    assert o.concurrency == (1, 8, 256) and o.configs == ("plain", "plain_twin", "eagle3_auto")
    assert o.thresholds == (8, 32) and o.server_args == ("--gc-threshold", "7", "8")
    assert o.registry == Path("st.json.servers.json")
    for flags, word in ((("--configs", "plain,nope"), "--configs"), (("--configs", "plain,plain"), "--configs"),
                        (("--configs", "plain_twin,eagle3"), "add plain"),
                        (("--concurrency", "1,0"), "--concurrency"), (("--concurrency", "1,x"), "--concurrency"),
                        (("--threshold", "0"), "--threshold"), (("--threshold", "8,8"), "--threshold"),
                        (("--threshold", "auto"), "--threshold"), (("--pairs", "-1"), "--pairs"),
                        (("--pairs", "0", "--ramp-cycles", "0"), "--ramp-cycles"),
                        (("--ramp-hold", "0"), "--ramp-hold"), (("--mem-share", "1.5"), "--mem-share"),
                        (("--max-total-tokens", "-1"), "--max-total-tokens"), (("--output-len", "0"), "--output-len"),
                        (("--window-s", "0"), "--window-s"), (("--settle-s", "-1"), "--settle-s"),
                        (("--cpus-per-server", "-1"), "--cpus-per-server"),
                        (("--output-spread", "1"), "--output-spread"), (("--output-spread", "-0.1"), "--output-spread"),
                        (("--auto-learn-s", "-1"), "--auto-learn-s"),
                        (("--launch-only",), "--launch-only needs --state")):
        with pytest.raises(SystemExit, match=word):
            bench_options(*flags)
    ap = argparse.ArgumentParser()
    options.add_arguments(ap)
    with pytest.raises(SystemExit, match="--models"):
        options.options(ap.parse_args([]))
    e2e = build_parser().parse_args(["e2e", "--bench-pairs", "5", "--bench-configs", "plain,eagle3_thr"])
    assert options.tuning_options(e2e, "bench-")["pairs"] == 5
    with pytest.raises(SystemExit, match="--bench-pairs"):
        options.tuning_options(build_parser().parse_args(["e2e", "--bench-pairs", "-2"]), "bench-")
    assert bench_options("--pairs", "0", "--ramp-cycles", "1").pairs == 0  # the ramp alone


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
def test_diagnose_counts_gpu_seconds_by_category():
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


def test_render_flag_draws_a_saved_result_without_servers(tmp_path):
    pytest.importorskip("matplotlib")
    a = build_parser().parse_args(["run", "--render", str(RESULT), "--out", str(tmp_path / "docs")])
    assert a.main(a) == 0
    assert {p.name for p in (tmp_path / "docs").iterdir()} == {"bench.json", "bench.md", "concurrency.png", "ramp.png"}


def test_ramp_windows_spread_each_request_over_its_lifetime():
    # request 1: 100 tokens over 1-3 s; request 2: 50 tokens over 2.5-3.5 s; 2 s windows
    windows = ramp.ramp_windows([1, 2], 2.0, [(1.0, 3.0, 100), (2.5, 3.5, 50)],
                                 [(0.5, "speculative", None), (1.0, "plain", 32), (2.5, "plain", 16)])
    assert [w["tok_per_s"] for w in windows] == [25.0, 50.0]  # 50 / 2 s; (50 + 50) / 2 s
    assert [w["plain_share"] for w in windows] == [0.5, 1.0] and [w["crossover"] for w in windows] == [32, 16]


def test_a_server_still_starting_at_the_deadline_is_left_for_the_next_call(pool_of, tmp_path):
    with pytest.raises(servers.StillStarting, match="slow: still starting after 1s"):
        pool_of().ensure({"slow": sleepy("slow", tmp_path, 3.0)}, "", logs(tmp_path), 1)
    entry = next(iter(json.loads((tmp_path / "reg.json").read_text()).values()))
    assert group_running(entry["pgid"])  # not stopped: the next call finds it, up by then
    srv = pool_of().ensure({"slow": sleepy("slow", tmp_path, 3.0)}, "", logs(tmp_path), 30)["slow"]
    assert srv.pgid == entry["pgid"] and client.healthy(srv.base)


def test_what_the_host_did_during_a_window_is_kept(monkeypatch):
    before = hostinfo.sample()
    end = time.time() + 0.3
    while time.time() < end:  # some CPU time to account
        pass
    monkeypatch.setattr(hostinfo.shutil, "which", lambda exe: None)  # no GPU here
    got = hostinfo.during(before, hostinfo.sample())
    assert 0 <= got["steal_share"] <= 1 and 0 < got["busy_share"] <= 1 and "gpu_sm_mhz" not in got
    result = json.loads(RESULT.read_text())
    result["blocks"]["1"][0]["windows"]["plain"]["host"] = {"steal_share": 0.02, "gpu_sm_mhz": 1980.0}
    result["blocks"]["1"][1]["windows"]["plain"]["host"] = {"steal_share": 0.10, "gpu_sm_mhz": 1755.0}
    assert ("- the host over the windows: CPU time stolen by the hypervisor 2.0-10.0%; GPU SM clock "
            "1755-1980 MHz") in bench_report.markdown(result)


def test_the_report_shows_what_auto_measured_per_bucket():
    # Row 35: auto ran plain at 1 and 16 requests and the report gave only its crossover; the
    # server's per-bucket estimates say why it moved there.
    result = json.loads(RESULT.read_text())
    estimates = "1-1: 494 / 251 tok/s (30/5 steps); 9-16: 5188 / 2973 tok/s (30/5 steps)"
    result["servers"]["eagle3_auto"] = {"kv_used_after_flush": 0, "running_limit": 4096, "speculative_disable": {
        "threshold": "auto", "crossover": 16, "speculative_steps": 10, "plain_steps": 5, "mode_changes": 2,
        "estimates": estimates}}
    md = bench_report.markdown(result)
    assert f"EAGLE-3 + auto: per bucket, speculative / plain: {estimates}" in md
    assert "threshold 16: per bucket" not in md  # a fixed threshold measures nothing


def test_auto_s_step_trace_is_read_back_per_bucket_and_mode(tmp_path, capsys):
    from bench import autotrace
    from bench.__main__ import main as bench_main

    def step(kind, batch, seconds, tokens, prefills=0, recorded=True):
        return {"t": 0.0, "kind": kind, "batch": batch, "seconds": seconds, "tokens": tokens,
                "recorded": recorded, "prefills": prefills, "crossover": 64}

    # at 64 requests: plain steps of 5 ms, a quarter of them 9 ms with a prefill; speculative steps
    # of 15 ms, three quarters of them 19 ms with one (requests end three times as often)
    records = ([step("plain", 64, 0.005, 64)] * 30 + [step("plain", 64, 0.009, 64, 1)] * 10
               + [step("speculative", 63, 0.015, 189)] * 10 + [step("speculative", 64, 0.019, 192, 1)] * 30
               + [step("plain", 64, 0.1, 64, recorded=False), step("catch-up", 64, 0.007, 64, recorded=False),
                  {"t": 1.0, "kind": "prefill", "tokens": 48}, step("speculative", 1, 0.006, 3)])
    path = tmp_path / "eagle3_auto_steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"t": 2.0, "kind": "spe')  # cut short
    rows = {(r.low, r.high, r.kind): r for r in autotrace.summarize(autotrace.read(path))}
    assert set(rows) == {(33, 64, "plain"), (33, 64, "speculative"), (1, 1, "speculative")}
    plain, spec = rows[(33, 64, "plain")], rows[(33, 64, "speculative")]
    assert (plain.steps, plain.left_out, plain.with_prefill) == (40, 1, 0.25)
    assert plain.median_ms == pytest.approx(5.0) and plain.mean_ms == pytest.approx(6.0)
    assert plain.tok_s_median == pytest.approx(64 / 0.005) and plain.tok_s_sums == pytest.approx(64 / 0.006)
    assert spec.median_ms == pytest.approx(19.0) and spec.mean_batch == pytest.approx(63.75)
    assert spec.tok_s_sums == pytest.approx((10 * 189 + 30 * 192) / (10 * 0.015 + 30 * 0.019))
    lines = autotrace.render(list(rows.values()))
    by_medians = (spec.tok_s_median / plain.tok_s_median)
    by_sums = (spec.tok_s_sums / plain.tok_s_sums)
    assert f"33-64 speculative / plain: {by_medians:.3f}x by the medians, {by_sums:.3f}x by the sums" in lines
    assert any(line.startswith("33-64 plain: 40 steps (+1 left out), batch 64.0, 25% with a prefill") for line in lines)
    # the same lines from the report's dicts, and from the command line
    assert autotrace.render([r.as_dict() for r in rows.values()]) == lines
    assert bench_main(["auto-trace", str(path)]) == 0
    assert lines[0] in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no such trace"):
        bench_main(["auto-trace", str(tmp_path / "none.jsonl")])


def test_a_trace_replayed_with_its_own_settings_moves_as_the_server_did_and_with_others_shows_theirs(tmp_path, capsys):
    """--replay: the steps of a trace through a fresh controller. With the settings that made the
    trace it must move its crossover exactly as the server did (else it would not show what another
    setting changes); with today's step_noise, the lucky burst of the auto test moves nothing."""
    import math
    import random

    from bench import autotrace
    from bench.__main__ import main as bench_main

    auto = autotrace.controller_module()
    rng = random.Random(0)
    ctl = auto.AutoController(auto.AutoConfig(max_batch_size=64, step_noise=0.0))
    plain = {16: 4.82e-3, 64: 6.1e-3}
    spec = {16: 9.3e-3, 64: 19.7e-3}  # 1.55x plain's tokens/s at 16, 0.93x at 64
    records, clock, bursts, last = [], 0.0, 0, None
    for phase, (batch, steps) in enumerate([(16, 3000), (64, 8000)]):
        for _ in range(steps):
            mode = ctl.decide(batch)
            is_spec = mode is auto.Mode.SPECULATIVE
            seconds = (spec if is_spec else plain)[batch] * math.exp(rng.gauss(0, 0.03))
            if phase == 1 and is_spec and ctl.crossover() == 32:
                bursts += last is not auto.Mode.SPECULATIVE
                seconds *= 0.88 if bursts == 2 else 1.0
            last = mode
            ctl.record(mode, batch, seconds, batch * (3 if is_spec else 1))
            records.append({"t": clock, "kind": str(mode), "batch": batch, "seconds": seconds,
                            "tokens": batch * (3 if is_spec else 1), "recorded": True, "prefills": 0,
                            "crossover": ctl.crossover()})
            clock += seconds
    served = autotrace.server_changes(records)
    assert [c for _, c in served] == [64, 32, 64, 32]  # the burst moved it (and back)
    same, _ = autotrace.replay(records, {"step_noise": 0.0})
    assert same == served[1:]  # (the server started at its max batch: no change to replay there)
    today, estimates = autotrace.replay(records, {})
    assert [c for _, c in today] == [32] and "33-64" in estimates
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert bench_main(["auto-trace", str(path), "--replay", "step_noise=0"]) == 0
    out = capsys.readouterr().out
    assert "the server's crossover: 64 at 0.0s, 32 at " in out and "replayed (step_noise=0): 32 at " in out
    assert bench_main(["auto-trace", str(path), "--replay", "", "--leave-out-prefills", "next"]) == 0
    assert "replayed (defaults; steps with a prefill left out: next): 32 at " in capsys.readouterr().out
    for bad in ("noise=1", "step_noise=", "step_noise=much", "bucket_edges=1"):
        with pytest.raises(SystemExit, match="--replay"):
            bench_main(["auto-trace", str(path), "--replay", bad])


def test_auto_s_comparison_carries_the_spread_of_fixed_thresholds_that_do_the_same_work():
    # row 38 (8B shape): at 4 requests thresholds 8, 16 and 32 all speculate, yet threshold 8 ran
    # at 0.97x of 16; auto's "0.97x of the best" there is that spread, not a wrong mode
    # row 40: at 16 requests threshold 16 decoded plain (accept length 1.00) and 32 speculated: not
    # the same mode, though 16 <= 16 (where the load came from decides at C = N)
    tok = {"4": {"eagle3_auto": 1710, "eagle3_thr8": 1722, "eagle3_thr16": 1784, "eagle3_thr32": 1779},
           "16": {"eagle3_auto": 5112, "eagle3_thr8": 3151, "eagle3_thr16": 3143, "eagle3_thr32": 5076},
           "64": {"eagle3_auto": 9554, "eagle3_thr8": 10293, "eagle3_thr16": 10127, "eagle3_thr32": 10368},
           "1": {"eagle3_auto": 475, "eagle3_thr8": 469}}
    accept = {"4": 3.1, "64": 1.0, "1": 3.1}
    accept_16 = {"eagle3_auto": 3.0, "eagle3_thr8": 1.0, "eagle3_thr16": 1.004, "eagle3_thr32": 3.1}
    names = ["eagle3_auto", "eagle3_thr8", "eagle3_thr16", "eagle3_thr32"]
    result = {"configs": names, "thresholds": [8, 16, 32], "blocks": {
        c: [{"block": b, "order": list(row), "windows": {n: {"tok_per_s": v * (1 + 0.001 * b), "output_tokens": v,
                                                            "seconds": 1.0, "requests": 4, "errors": 0,
                                                            "accept_length": accept.get(c) or accept_16[n]}
                                                        for n, v in row.items()}}
            for b in range(4)] for c, row in tok.items()}}
    auto = bench_report.auto_comparison(result)
    assert auto["4"]["best_fixed"] == 16 and auto["4"]["same_mode_floor"]["threshold"] == 8
    assert auto["4"]["same_mode_floor"]["median"] == pytest.approx(1722 / 1784, abs=1e-3)
    # at 64 all three decode plain: the lowest of the other two against the best (32)
    assert auto["64"]["best_fixed"] == 32 and auto["64"]["same_mode_floor"]["threshold"] == 16
    assert "same_mode_floor" not in auto["1"]  # threshold 8 alone there
    assert auto["16"]["best_fixed"] == 32 and "same_mode_floor" not in auto["16"]
    md = bench_report.markdown(result)
    assert "| 4 | - | 16 | 0.96x [0.96-0.96] | 0.97x [0.97-0.97] (8) |" in md


@pytest.mark.parametrize("leave_out,steps", [("none", "(10/10 steps)"), ("same", "(9/6 steps)"),
                                             ("next", "(10/5 steps)")])
def test_a_replay_can_leave_out_the_steps_a_prefill_fell_in(leave_out, steps):
    # where a prefill's GPU time lands (the step it was noted with, or the one after it under the
    # overlap scheduler) is for a GPU trace to show; the replay tries both
    from bench import autotrace

    def step(kind, prefills):
        return {"t": 0.0, "kind": kind, "batch": 64, "seconds": 0.02 if kind == "speculative" else 0.006,
                "tokens": 192 if kind == "speculative" else 64, "recorded": True, "prefills": prefills}

    records = ([step("speculative", 0)] * 9 + [step("speculative", 1)]
               + [step("plain", i in (1, 3, 5, 7)) for i in range(10)])
    _, estimates = autotrace.replay(records, {}, leave_out)
    assert estimates.startswith("33-64: ") and estimates.endswith(steps)
    with pytest.raises(ValueError, match="leave_out_prefills 'all'"):
        autotrace.replay(records, {}, "all")


def test_output_lengths_vary_alike_on_every_server_around_the_mean():
    # One length for all made a window's requests end in step on a server that keeps them in step
    # (plain steps) and apart on one that does not (speculation): the second then prefilled their
    # successors in 39 small batches a window against 10 (GPU, 8B shape, 64 requests, 2026-12-04).
    prompts = workload.workload(3072, 64, 256, 101, 400, spread=0.25)
    lengths = [p.max_new_tokens for p in prompts]
    assert min(lengths) >= 192 and max(lengths) <= 320 and len(set(lengths)) > 50
    assert abs(statistics.fmean(lengths) - 256) < 8
    assert prompts == workload.workload(3072, 64, 256, 101, 400, spread=0.25)  # every server gets the same
    alike = workload.workload(3072, 64, 256, 101, 400)
    assert all(p.max_new_tokens == 256 for p in alike)
    assert [p.input_ids for p in alike] == [p.input_ids for p in prompts]  # the spread changes the lengths alone
    opts = options.BenchOptions(models=Path("m"), out=Path("o"), concurrency=(1, 256))
    assert workload.pool_tokens(opts) == int(1.1 * 256 * (64 + 320))  # room for every request at its longest


def test_auto_learns_each_level_before_the_blocks(lab, monkeypatch):
    """What `auto` learns at a batch size it meets for the first time must not land in the first
    block: it runs every level's load once, with prompts no window sends, before any block."""
    monkeypatch.setattr(throughput, "auto_supported", lambda: True)
    monkeypatch.setattr(throughput, "mode_of", lambda base: ("plain", 32, 3))
    windows: list[tuple[str, int, float, tuple[int, ...]]] = []
    measure = lab.measure

    def recording(base, prompt_at, c, settle_s, window_s, *args, **kw):
        windows.append((base.removeprefix("http://"), c, window_s, prompt_at(0).input_ids))
        return measure(base, prompt_at, c, settle_s, window_s, *args, **kw)

    monkeypatch.setattr(throughput, "measure", recording)
    result = throughput.run_bench(lab.options(900, configs=("plain", "eagle3_auto"), ramp_cycles=0,
                                         auto_learn_s=3.0), {})
    assert [w[:3] for w in windows[:2]] == [("eagle3_auto", 1, 3.0), ("eagle3_auto", 4, 3.0)]
    assert all(w[2] == 20.0 for w in windows[2:]) and len(windows) == 2 + 2 * 2 * 2
    learned_prompts = {w[3] for w in windows[:2]}
    assert not learned_prompts & {w[3] for w in windows[2:]}
    assert result["learned"]["eagle3_auto"] == {"seconds_per_level": 3.0, "crossover_after": {"1": 32, "4": 32}}
    assert set(result["learned"]) == {"eagle3_auto"}  # the fixed modes have nothing to learn
    md = bench_report.markdown(result)
    assert "3.00 s under each level's load before the blocks" in md and "crossover after each level: 1: 32, 4: 32" in md
    # 0: no learning (the first block learns, as a new server does)
    windows.clear()
    throughput.run_bench(lab.options(900, configs=("plain", "eagle3_auto"), ramp_cycles=0, auto_learn_s=0.0,
                                registry=lab.tmp_path / "other.json"), {})
    assert all(w[2] == 20.0 for w in windows)


# ----------------------------------------------------------------------------- where the host time went
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


def test_the_scheduler_thread_is_found_by_its_title_and_its_time_read():
    """Of a server's processes, the one SGLang titles sglang::scheduler; its main thread's seconds
    on a CPU grow while it computes, and it gives the CPU up each time it sleeps."""
    from bench import hostinfo

    scheduler, detokenizer = titled("sglang::scheduler_TP0", 0.05), titled("sglang::detokenizer", 0.0)
    try:
        pids = [detokenizer.pid, scheduler.pid]
        assert hostinfo.scheduler_pid(pids) == scheduler.pid
        assert hostinfo.scheduler_pid([detokenizer.pid]) is None
        before, quiet = hostinfo.thread_counters(scheduler.pid), hostinfo.thread_counters(detokenizer.pid)
        time.sleep(1.0)
        delta = hostinfo.counters_delta(before, hostinfo.thread_counters(scheduler.pid))
        assert 0.25 < delta["cpu_s"] <= 1.05 and delta["wait_s"] >= 0 and delta["yields"] >= 5
        idle = hostinfo.counters_delta(quiet, hostinfo.thread_counters(detokenizer.pid))
        assert idle["cpu_s"] < 0.1 and idle["yields"] >= 5  # it sleeps, waking 20 times a second
        read = window.host_counters(os.getpgid(scheduler.pid))  # the test's own group: it holds both
        assert read is not None and {"server_cpu_s", "scheduler_cpu_s", "scheduler_wait_s"} <= set(read())
    finally:
        for proc in (scheduler, detokenizer):
            proc.kill()
            proc.wait()
    assert hostinfo.thread_counters(scheduler.pid) == {}  # gone: nothing, no error
    assert window.host_counters(None) is None


def test_a_window_reads_the_server_s_counters_at_its_counted_span(monkeypatch):
    FakeGenerate(monkeypatch, per_token=0.002)
    reads: list[float] = []

    def counters() -> dict[str, float]:
        reads.append(time.time())
        return {"scheduler_cpu_s": 2.0 * len(reads), "server_cpu_s": 5.0}

    m = window.measure("b", lambda i: workload.window_prompt(3000, 1, 8, 100, i), 1, 0.2, 0.5, 10, time.time() + 60,
                      counters=counters)
    assert m["counters"] == {"scheduler_cpu_s": 2.0, "server_cpu_s": 0.0}
    lo, hi = m["span"]
    assert [round(t, 1) for t in reads] == [round(lo, 1), round(hi, 1)] and hi - lo == pytest.approx(0.5, abs=0.1)


def test_the_speed_probe_reports_its_work_time_per_window():
    from bench import hostinfo

    probe = hostinfo.SpeedProbe(period_s=0.01).start()
    try:
        t0 = time.time()
        time.sleep(0.8)
        t1 = time.time()
        work = probe.work(t0, t1)
        assert work is not None and 0 < work < 0.5
        inside = sorted(w for t, w in probe.samples if t0 <= t <= t1)
        assert work == pytest.approx(statistics.median(inside))
        assert probe.work(t1 + 100, t1 + 200) is None  # no sample there
    finally:
        probe.stop()
    assert probe._proc is not None and probe._proc.poll() is not None


def test_cpu_topology_and_the_cores_two_owners_share():
    from bench import hostinfo

    assert hostinfo._cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    mine = hostinfo.cpu_topology()
    assert mine["cpus"] == sorted(os.sched_getaffinity(0)) and sorted(c for core in mine["cores"] for c in core) == mine["cpus"]
    topology = {"cpus": [0, 1, 2, 3], "cores": [[0, 2], [1, 3]]}
    assert hostinfo.shared_cores(topology, {"plain": [0], "plain (A/A twin)": [2], "the client": [1]}) == [
        "CPUs 0,2: plain and plain (A/A twin)"]
    lines = bench_report.topology_lines(topology, {"plain": [0], "the client": [2]})
    assert lines == ["- this process's CPUs: 4 on 2 cores (0,2; 1,3 share a core)",
                     "- one core shared: CPUs 0,2: plain and the client"]


def test_the_report_says_where_the_host_time_went():
    """Each window of plain and its twin at 256 requests with its scheduler's counters and the
    probe's work: the report gives, per server, the wall, on-CPU and waiting ms per step, and
    which of them moved with the wall time from window to window."""
    result = json.loads(RESULT.read_text())
    on_cpu = {"plain": [4.0, 6.0, 5.0, 5.0], "plain_twin": [4.5, 5.5, 5.0, 6.5]}
    for k, b in enumerate(result["blocks"]["256"]):
        for name in ("plain", "plain_twin"):
            w = b["windows"][name]
            w["steps"], w["seconds"] = 500, 3.0
            cpu = on_cpu[name][k]  # ms per step; the wall follows it, 1 ms above
            w["seconds"] = 500 * (cpu + 1.0) / 1000
            w["scheduler"] = {"scheduler_cpu_s": 500 * cpu / 1000, "scheduler_wait_s": 0.005,
                              "scheduler_preempted": 10.0, "server_cpu_s": 500 * cpu / 1000 + 1.2 * w["seconds"]}
            w.setdefault("host", {})["probe_work_s"] = 0.001  # the CPUs' speed: no change
    md = bench_report.markdown(result)
    assert "Where the host time went, per decode step" in md
    row = next(line for line in md.splitlines() if line.startswith("| 256 |") and "cores" in line)
    assert "6.00 [5.00-7.00] / 5.00 [4.00-6.00] / 0.01 [0.01-0.01]; 1.20 cores" in row
    spread = next(line for line in md.splitlines() if line.startswith("- 256 requests, window to window"))
    assert "the scheduler's time on a CPU per step -20% to +24% (r = 1.00 with the wall time)" in spread
    assert "wall time per step -17% to +20%" in spread
    assert spread.endswith("(the CPUs' speed, inverted) +0% to +0%")  # constant: no correlation to give
    # no counters read (an older result): no such section
    assert "Where the host time went" not in bench_report.markdown(json.loads(RESULT.read_text()))
    result["cpus"], result["scheduler_cpus"] = {"plain": [0, 1, 2], "plain_twin": [3]}, {"plain": 0, "plain_twin": None}
    assert ("- CPUs: plain 0,1,2 (its scheduler thread alone on 0); plain (A/A twin) 3 (the client on others)"
            in bench_report.markdown(result))


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


def test_each_window_keeps_its_server_s_host_counters_and_the_cpus_speed(lab, monkeypatch):
    """The block's glue: a server of a known process group gets its counters read at its window's
    counted span, kept as the window's `scheduler` figures, and the probe's work there as the
    host's; the run records the CPU topology, and the report draws the section from them."""
    scheduler = titled("sglang::scheduler_TP0", 0.02)  # in this test's process group
    measure = lab.measure

    def with_counters(base, prompt_at, c, settle_s, window_s, timeout, stop_at, scrape=None, counters=None):
        assert counters is not None  # a server of a known group
        before, lo = counters(), time.time()
        time.sleep(0.5)
        after, hi = counters(), time.time()
        m = measure(base, prompt_at, c, settle_s, window_s, timeout, stop_at)
        return {**m, "steps": 100, "seconds": hi - lo, "span": [lo, hi],
                "counters": hostinfo.counters_delta(before, after)}

    monkeypatch.setattr(throughput, "measure", with_counters)
    monkeypatch.setattr(FakeServer, "group", os.getpgid(0))
    try:
        result = throughput.run_bench(lab.options(600, concurrency=(4,), pairs=1, ramp_cycles=0), {})
    finally:
        scheduler.kill()
        scheduler.wait()
    windows = result["blocks"]["4"][0]["windows"]
    assert all(w["scheduler"]["scheduler_cpu_s"] > 0 and w["scheduler"]["server_cpu_s"] >= 0 for w in windows.values())
    # the probe's first samples come once its interpreter is up: the second window has them at least
    assert windows[result["blocks"]["4"][0]["order"][-1]]["host"]["probe_work_s"] > 0
    assert result["cpu_topology"]["cpus"] == sorted(os.sched_getaffinity(0)) and result["client_cpus"] == []
    assert "Where the host time went, per decode step" in bench_report.markdown(result)


def test_servers_get_cpus_core_by_core(monkeypatch, tmp_path):
    """Where a core has two threads (siblings 0,2 and 1,3), a server of two CPUs gets one whole
    core, not a thread of each (which it would share with the next server or the client)."""
    from bench import hostinfo

    monkeypatch.setattr(servers.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(hostinfo, "cpu_topology", lambda cpus=None: {"cpus": [0, 1, 2, 3], "cores": [[0, 2], [1, 3]]})
    pool = servers.ServerPool(None, "1b", 30000, 2)
    assert servers.by_core({0, 1, 2, 3}) == [0, 2, 1, 3]
    assert pool.client_cpus() == (3,) and pool.free_cpus(set()) == (0, 2)
    assert pool.free_cpus({0, 2}) == ()  # one CPU left beside the client's: too few for a server
