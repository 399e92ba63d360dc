"""The report (bench.report): the files a result becomes (a real matplotlib render), its tables
and the lines it writes for what the run recorded."""
from __future__ import annotations

import json
from typing import Any

import pytest

from bench import configs, report_steps
from bench import report as bench_report
from bench.__main__ import build_parser
from tests.bench.conftest import RESULT, png_size


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
    assert "| 256 | EAGLE-3 + auto | 3.50 | 0.30 |" in md  # the same GPU time by forward kind
    assert "- server: call 2: plain: the server started earlier" in md
    assert "at most EAGLE-3 0.02" in md and "CPUs: plain 1,2,3" in md
    assert "every output equal to plain decoding's" in md
    assert "![tokens/s by concurrency](concurrency.png)" in md
    # a bench.json from before the bench recorded them: said, not guessed
    assert "Every server's --server-env and --server-args: not recorded" in md and "Sources:" not in md
    # plain ran: the ratios are to plain, and the heading says so
    assert bench_report.reference(result) == "plain"
    assert "Output tokens/s (median over the blocks) and the ratio to plain within a block:" in md


def test_tables_of_the_recorded_result():
    result = json.loads(RESULT.read_text())
    table = bench_report.level_table(result)
    assert table["256"]["eagle3"]["vs_reference"]["median"] == pytest.approx(0.5556, abs=1e-4)
    assert table["256"]["eagle3"]["blocks"] == 4 and table["256"]["eagle3"]["accept_length"] == 3.1
    assert table["1"]["plain"]["vs_reference"] is None
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


def without_plain(names: tuple[str, ...], ratios: tuple[float, ...] = (1.05, 1.1, 1.0)) -> dict[str, Any]:
    """A call of these configs and no plain server, 3 blocks at 64 requests: the first's tokens/s
    drifts with the host from block to block, the second's is `ratios` of it in each block."""
    recs = configs.expand(names)
    first, second = (r.name for r in recs)
    window = {"errors": 0, "output_tokens": 3000, "seconds": 3.0, "steps": 300, "accept_length": 2.8}
    blocks = [{"block": k + 1, "order": [], "windows": {first: {**window, "tok_per_s": 1000.0 * drift},
                                                        second: {**window, "tok_per_s": 1000.0 * drift * r}}}
              for k, (drift, r) in enumerate(zip((1.0, 0.8, 1.2), ratios, strict=True))]
    return {"configs": [first, second], "config_records": {r.name: r.as_dict() for r in recs},
            "blocks": {"64": blocks}, "pairs": 3}


def test_without_plain_the_ratios_are_to_the_first_config_named():
    # --bench-configs eagle3_thr,eagle3_thr_prefill_graphs: no plain server, so the ratios within a
    # block are taken against the first config named, which has none itself; the heading says so
    result = without_plain(("eagle3_thr", "eagle3_thr_prefill_graphs"))
    assert bench_report.reference(result) == "eagle3_thr16"
    table = bench_report.level_table(result)["64"]
    assert table["eagle3_thr16"]["vs_reference"] is None
    ratio = table["eagle3_thr16_prefill_graphs"]["vs_reference"]
    assert ratio["ratios"] == [1.05, 1.1, 1.0] and ratio["median"] == 1.05  # the host's drift drops out
    md = bench_report.markdown(result)
    assert ("Output tokens/s (median over the blocks) and the ratio to EAGLE-3 + threshold 16 within a "
            "block:") in md
    assert "ratio to plain" not in md
    assert "| concurrency | EAGLE-3 + threshold 16 | EAGLE-3 + threshold 16 (prefill K/V graphs) |" in md
    assert "| 64 | 1000 | 1050 (1.05x [1.00-1.10]) |" in md
    assert "- outputs NOT compared (no server decoding plain in this run)" in md  # still: outputs need plain
    # the first named is the reference, whichever it is (--bench-configs eagle3_auto,eagle3)
    result = without_plain(("eagle3_auto", "eagle3"), ratios=(0.9, 0.9, 0.9))
    assert bench_report.reference(result) == "eagle3_auto"
    table = bench_report.level_table(result)["64"]
    assert table["eagle3_auto"]["vs_reference"] is None and table["eagle3"]["vs_reference"]["median"] == 0.9
    md = bench_report.markdown(result)
    assert "and the ratio to EAGLE-3 + auto within a block:" in md and "| 64 | 1000 | 900 (0.90x [0.90-0.90]) |" in md
    # the tables against plain and EAGLE-3 (the promise, the A/A floor) need both: none here
    assert bench_report.better_table(result) == {} and bench_report.floor_table(result) == {}


def test_the_report_gives_each_server_s_time_to_first_token():
    """Each window's p50 / p90 (bench.window.first_token_ms): the table gives their medians over the
    blocks per concurrency and server, and how many requests were cut short before a first token
    (lower bounds); windows that recorded none (an older sglang, an older bench.json) give none."""
    result = without_plain(("eagle3", "eagle3_prefill_delayer"))
    p50s = {"eagle3": (20.0, 30.0, 22.0), "eagle3_prefill_delayer": (60.0, 55.0, 90.0)}
    for k, b in enumerate(result["blocks"]["64"]):
        for name, p50 in p50s.items():
            b["windows"][name]["ttft_ms"] = {"p50": p50[k], "p90": 2 * p50[k], "n": 40,
                                             "censored": int(name == "eagle3_prefill_delayer" and k < 2)}
    assert bench_report.first_token_table(result) == {"64": {
        "eagle3": {"p50": 22.0, "p90": 44.0, "requests": 120, "censored": 0},
        "eagle3_prefill_delayer": {"p50": 60.0, "p90": 120.0, "requests": 120, "censored": 2}}}
    md = bench_report.markdown(result)
    table = md.split("Time to first token, ms", 1)[1].split("\n\n", 2)[1]
    assert table.splitlines() == ["| concurrency | EAGLE-3 | EAGLE-3 (prefill delayer) |", "|---:|---:|---:|",
                                  "| 64 | 22.0 / 44.0 | 60.0 / 120.0 (2 of 120 censored) |"]
    # a server whose windows recorded none: "-"; none at all: no table
    for b in result["blocks"]["64"]:
        del b["windows"]["eagle3"]["ttft_ms"]
    assert "| 64 | - | 60.0 / 120.0 (2 of 120 censored) |" in bench_report.markdown(result)
    for b in result["blocks"]["64"]:
        del b["windows"]["eagle3_prefill_delayer"]["ttft_ms"]
    assert bench_report.first_token_table(result) == {}
    assert "Time to first token" not in bench_report.markdown(result)
    assert "Time to first token" not in bench_report.markdown(json.loads(RESULT.read_text()))


def test_a_merged_result_says_which_window_its_ratios_are_against():
    result = without_plain(("eagle3_thr", "eagle3_thr_prefill_graphs"))
    result["sources"] = [{"configs": result["configs"], "pairs": 2}, {"configs": result["configs"], "pairs": 1}]
    for b, source in zip(result["blocks"]["64"], (1, 1, 2), strict=True):
        b["source"] = source
    assert "against that block's EAGLE-3 + threshold 16 window" in bench_report.mixed_calls_note(result)
    result = json.loads(RESULT.read_text())
    result["sources"] = [{}, {}]
    for k, b in enumerate(result["blocks"]["64"]):
        b["source"] = 1 + k % 2
    assert "against that block's plain window" in bench_report.mixed_calls_note(result)


def test_the_plot_s_ratio_panel_is_against_the_reference(tmp_path, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    close, figures = plt.close, []
    monkeypatch.setattr(plt, "close", figures.append)  # keep each figure to read its axes
    try:
        bench_report.plot_concurrency(json.loads(RESULT.read_text()), tmp_path / "with.png")
        bench_report.plot_concurrency(without_plain(("eagle3_thr", "eagle3_thr_prefill_graphs")),
                                      tmp_path / "without.png")
        (_, with_plain), (_, without) = (fig.axes for fig in figures)
        assert with_plain.get_ylabel() == "x plain, within a block\n(bars: 95% interval)"
        assert without.get_ylabel() == "x EAGLE-3 + threshold 16,\nwithin a block\n(bars: 95% interval)"
        # one ratio drawn: the prefill-graphs server's at 64, none for the reference itself
        assert len(without.containers) == 1
        assert list(without.containers[0].lines[0].get_ydata()) == [1.05]
    finally:
        for fig in figures:
            close(fig)


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


def test_a_server_s_environment_comes_back_from_bench_json_and_is_in_its_label():
    # bench.json keeps the records as JSON (env's pairs become lists): read back they are the same
    # records, and the extend-verify server is one more always-on EAGLE-3 against the better of
    # plain and EAGLE-3 in the same block, labelled by its environment.
    recs = configs.expand(("plain", "eagle3", "eagle3_extend_verify"))
    result: dict[str, Any] = json.loads(json.dumps({
        "configs": [r.name for r in recs], "config_records": {r.name: r.as_dict() for r in recs}}))
    assert result["config_records"]["eagle3_extend_verify"]["env"] == [["SGLANG_ENABLE_SPLITKV_VERIFY", "0"]]
    back = configs.from_result(result)
    assert back == {r.name: r for r in recs}
    assert back["eagle3_extend_verify"].env == (("SGLANG_ENABLE_SPLITKV_VERIFY", "0"),)
    # a record of a bench before env, and a result that kept names only
    assert configs.from_result({"config_records": {"eagle3": {"name": "eagle3", "kind": "fixed", "steps": 3}}}
                               )["eagle3"].env == ()
    assert configs.from_result({"configs": ["eagle3_extend_verify"]})["eagle3_extend_verify"] == recs[2]
    assert configs.BenchConfig("x", "fixed", 3, env=(("A", "1"),)).label == "EAGLE-3 (A=1)"
    window = {"errors": 0, "output_tokens": 3000, "seconds": 3.0, "steps": 300, "accept_length": 2.8}
    result["blocks"] = {"1": [{"block": k + 1, "order": [], "windows": {
        "plain": {**window, "tok_per_s": 500.0, "accept_length": None}, "eagle3": {**window, "tok_per_s": 1000.0},
        "eagle3_extend_verify": {**window, "tok_per_s": 900.0 + k}}} for k in range(3)]}
    result["pairs"] = 3
    assert set(bench_report.better_table(result)["1"]) == {"eagle3_extend_verify"}
    assert bench_report.better_table(result)["1"]["eagle3_extend_verify"]["median"] == pytest.approx(0.901)
    assert "| concurrency | plain | EAGLE-3 | EAGLE-3 (extend-kernel verify) |" in bench_report.markdown(result)


def test_a_run_without_plain_does_not_claim_equal_outputs():
    # the outputs are compared with those of a server of the same run that decodes plain: without
    # one, nothing is; with plain started with flags of its own (row 94: the prefill delayer on
    # every server), with that one's, and the report names it
    result = json.loads(RESULT.read_text())
    assert "- every output equal to plain decoding's (aborted ones a prefix of it)" in bench_report.markdown(result)
    records = configs.from_result(result)
    for name in ("plain", "plain_twin"):
        result["configs"] = [c for c in result["configs"] if c != name]
        result["servers"].pop(name, None)
        records.pop(name, None)
    result["config_records"] = {n: r.as_dict() for n, r in records.items()}
    md = bench_report.markdown(result)
    assert "every output equal" not in md
    assert "- outputs NOT compared (no server decoding plain in this run); 0 request errors" in md
    delayed = configs.expand(("plain_prefill_delayer",))[0]
    result["config_records"]["plain_prefill_delayer"] = delayed.as_dict()
    result["configs"].append("plain_prefill_delayer")
    assert ("- every output equal to plain decoding's (plain (prefill delayer)) (aborted ones a prefix of it)"
            in bench_report.markdown(result))


def test_render_flag_draws_a_saved_result_without_servers(tmp_path):
    pytest.importorskip("matplotlib")
    a = build_parser().parse_args(["run", "--render", str(RESULT), "--out", str(tmp_path / "docs")])
    assert a.main(a) == 0
    assert {p.name for p in (tmp_path / "docs").iterdir()} == {"bench.json", "bench.md", "concurrency.png", "ramp.png"}


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


def test_the_report_says_what_a_schedule_server_ran_at_each_depth_and_what_its_states_cost():
    # Row 92's report called a schedule server "threshold None, 3290 speculative / 0 plain steps,
    # 0 mode changes": not the depths it ran, nor what each extra depth state took of the GPU.
    result = json.loads(RESULT.read_text())
    result["servers"]["eagle3_auto"] = {"kv_used_after_flush": 0, "running_limit": 128, "speculative_disable": {
        "schedule": "1-22:7,23-90:5,91-:3", "depth": 3, "mode": "speculative",
        "steps_by_depth": {"3": 600, "5": 1900, "7": 790}, "speculative_steps": 3290, "plain_steps": 0,
        "depth_changes": 5, "mode_changes": 0, "state_memory_gib": {"3": 0.37, "5": 0.625}}}
    md = bench_report.markdown(result)
    assert ("EAGLE-3 + auto: schedule 1-22:7,23-90:5,91-:3, steps 600 at depth 3, 1900 at depth 5, "
            "790 at depth 7, 5 depth changes; GPU memory of the depth states beside the launch depth's: "
            "depth 3 0.37 GiB, depth 5 0.62 GiB") in md
    assert "threshold None" not in md
    result["servers"]["eagle3_auto"]["speculative_disable"] = {
        "threshold": 16, "speculative_steps": 10, "plain_steps": 5, "mode_changes": 2}
    assert "EAGLE-3 + auto: threshold 16, 10 speculative / 5 plain steps, 2 mode changes" in \
        bench_report.markdown(result)


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


def test_gpu_time_per_step_by_forward_kind() -> None:
    # the device timer's categories per decode step, medians over the blocks; an unknown category
    # goes to "other"; no table without the timer
    def window(steps: int, **gpu_s: float) -> dict[str, Any]:
        return {"steps": steps, "seconds": 3.0, "output_tokens": 10 * steps, "gpu_s": gpu_s}

    result: dict[str, Any] = {"configs": ["plain", "eagle3_depth1"], "blocks": {"64": [
        {"windows": {"plain": window(100, decode=0.6, extend=0.2),
                     "eagle3_depth1": window(50, target_verify=0.8, eagle_draft_extend=0.03, split_prefill=0.01)}},
        {"windows": {"plain": window(100, decode=0.8, extend=0.1),
                     "eagle3_depth1": window(50, target_verify=0.6, eagle_draft_extend=0.03)}},
    ]}}
    table = report_steps.gpu_ms_by_kind(result)
    assert table == {"64": {"plain": {"decode": 7.0, "prefill": 1.5},
                            "eagle3_depth1": {"verify": 14.0, "draft extend": 0.6, "other": 0.2}}}
    text = "\n".join(report_steps.lines(result, lambda n: n.upper()))
    assert "| concurrency | server | decode | verify | draft extend | prefill | other |" in text
    assert "| 64 | EAGLE3_DEPTH1 | - | 14.00 | 0.60 | - | 0.20 |" in text
    for b in result["blocks"]["64"]:
        for w in b["windows"].values():
            del w["gpu_s"]
    assert report_steps.lines(result, str) == []


def test_the_report_sets_each_diagnosed_server_against_plain() -> None:
    """With --diagnose, each server's py-spy summary after plain's gets the functions whose host
    time a step differs most from plain's; without plain's (or from an older bench.json without the
    kept shares) none."""
    from bench import pyspy

    result = json.loads(RESULT.read_text())
    plain = "thread (1): MainThread;Scheduler.event_loop_overlap (scheduler.py:1);run_batch (s.py:2) 80\n"
    more = plain + "thread (1): MainThread;Scheduler.event_loop_overlap (scheduler.py:1);hook (p.py:3) 20\n"
    no_trace = {"error": "no trace"}
    result["diagnose"] = {"plain": {"pyspy": pyspy.summarize(plain, 8.0), "profile": no_trace},
                          "eagle3_thr16": {"pyspy": pyspy.summarize(more, 10.0), "profile": no_trace}}
    md = bench_report.markdown(result)
    section = md.split("py-spy eagle3_thr16 against plain: the functions whose ms/step differ most", 1)[1]
    assert "  self    0.000    2.000   +2.000  hook (p.py)" in section
    assert "  incl    8.000    8.000   +0.000  run_batch (s.py)" in section
    del result["diagnose"]["plain"]
    assert "against plain" not in bench_report.markdown(result)
    # a run without plain: each against the reference of the level table, the first config named
    result["configs"] = ["eagle3_thr16", "eagle3"]
    result["diagnose"]["eagle3"] = {"pyspy": pyspy.summarize(plain, 8.0), "profile": no_trace}
    md = bench_report.markdown(result)
    assert "py-spy eagle3 against eagle3_thr16: the functions whose ms/step differ most" in md
    assert "py-spy eagle3_thr16 against" not in md


def two_calls_beside_plain(auto_over_plain: tuple[float, ...], eagle3_over_plain: tuple[float, ...],
                           both: bool = False) -> dict[str, Any]:
    """A merge of two calls at 64 requests, each beside plain: plain with auto (3 blocks) and plain
    with EAGLE-3 (3 blocks), the host drifting; `both`: one more block that holds all three."""
    recs = configs.expand(("plain", "eagle3", "eagle3_auto"))
    window = {"errors": 0, "output_tokens": 3000, "seconds": 3.0, "steps": 300, "accept_length": 2.8}

    def block(k: int, drift: float, **ratios: float) -> dict[str, Any]:
        return {"block": k, "order": [], "windows": {"plain": {**window, "tok_per_s": 1000.0 * drift},
                                                     **{n: {**window, "tok_per_s": 1000.0 * drift * r}
                                                        for n, r in ratios.items()}}}
    drifts = (1.0, 0.8, 1.2)
    blocks = ([block(k, d, eagle3_auto=r) for k, (d, r) in enumerate(zip(drifts, auto_over_plain, strict=True))]
              + [block(k, d, eagle3=r) for k, (d, r) in enumerate(zip(drifts, eagle3_over_plain, strict=True))]
              + ([block(7, 1.0, eagle3=1.5, eagle3_auto=1.5)] if both else []))
    return {"configs": ["plain", "eagle3", "eagle3_auto"], "config_records": {r.name: r.as_dict() for r in recs},
            "blocks": {"64": blocks}, "pairs": 3}


def test_the_better_mode_is_compared_through_plain_where_no_block_holds_all_three():
    # three 8B-shaped servers may not fit one GPU: auto beside plain in one call, EAGLE-3 beside plain
    # in another, merged; auto over the better mode is its ratio to plain over EAGLE-3's (>= 1)
    result = two_calls_beside_plain((1.50, 1.56, 1.53), (1.50, 1.51, 1.49))
    cell = bench_report.better_table(result)["64"]["eagle3_auto"]
    assert cell["via"] == "plain" and cell["median"] == pytest.approx(1.53 / 1.50, abs=1e-4)
    assert cell["low"] <= cell["median"] <= cell["high"]
    auto = bench_report.auto_comparison(result)["64"]["vs_better_of_plain_eagle3"]
    assert auto["median"] == cell["median"] and auto["via"] == "plain"
    md = bench_report.markdown(result)
    assert f"{bench_report.interval(cell)}" in md and cell and bench_report.interval(cell).endswith("+")
    assert "+: no block held this server, plain and EAGLE-3 together" in md
    # EAGLE-3 below plain: the better mode is plain itself, so the divisor is 1
    slow = two_calls_beside_plain((0.97, 0.98, 0.99), (0.95, 0.94, 0.96))
    assert bench_report.better_table(slow)["64"]["eagle3_auto"]["median"] == pytest.approx(0.98)
    # one block with all three: the comparison within that block, not through plain
    direct = bench_report.better_table(two_calls_beside_plain((1.5,) * 3, (1.5,) * 3, both=True))["64"]["eagle3_auto"]
    assert "via" not in direct and direct["ratios"] == [1.0]
    # without EAGLE-3 beside plain anywhere there is nothing to compare through
    assert bench_report.better_table(without_plain(("eagle3", "eagle3_auto"))) == {}


def test_a_learned_schedule_is_set_against_the_best_fixed_server_at_each_load():
    recs = configs.expand(("plain", "plain_twin", "eagle3", "eagle3_sched", "eagle3_upstream_combine"),
                          schedules=("1-40:5,41-96:4,97-:3", "auto"), auto_depth=5)
    assert [r.name for r in recs][3:5] == ["eagle3_sched1", "eagle3_sched2"]
    # over plain per load: the written schedule leads at 32, EAGLE-3 at 128; auto 0.97x and 0.99x of
    # the leader; the twin and the server with an environment of its own are no fixed alternative
    over_plain = {"32": {"eagle3": 1.9, "eagle3_sched1": 2.0, "eagle3_sched2": 1.94, "plain_twin": 2.5,
                         "eagle3_upstream_combine": 2.5},
                  "128": {"eagle3": 1.35, "eagle3_sched1": 1.33, "eagle3_sched2": 1.3365, "plain_twin": 1.0,
                          "eagle3_upstream_combine": 1.4}}
    window = {"errors": 0, "output_tokens": 3000, "seconds": 3.0, "steps": 300, "accept_length": 3.0}
    result = {"configs": [r.name for r in recs], "config_records": {r.name: r.as_dict() for r in recs}, "pairs": 3,
              "blocks": {c: [{"block": k + 1, "order": [], "windows": {
                  "plain": {**window, "tok_per_s": 1000.0 * drift},
                  **{n: {**window, "tok_per_s": 1000.0 * drift * r} for n, r in ratios.items()}}}
                  for k, drift in enumerate((1.0, 0.8, 1.2))] for c, ratios in over_plain.items()}}
    assert bench_report.fixed_servers(result) == ["plain", "eagle3", "eagle3_sched1"]
    learned = bench_report.learned_schedule_comparison(result)
    assert learned["32"]["eagle3_sched2"]["best_fixed"] == "eagle3_sched1"
    assert learned["32"]["eagle3_sched2"]["median"] == pytest.approx(0.97)
    assert learned["128"]["eagle3_sched2"]["best_fixed"] == "eagle3"
    assert learned["128"]["eagle3_sched2"]["median"] == pytest.approx(0.99)
    md = bench_report.markdown(result)
    assert "A learned depth schedule (`auto`) over the fixed server with the highest median" in md
    assert f"| 128 | {bench_report.label(result, 'eagle3_sched2')} | 0.99x [0.99-0.99] | EAGLE-3 |" in md
    # without a learning server there is nothing to set against
    del result["config_records"]["eagle3_sched2"]
    result["configs"].remove("eagle3_sched2")
    assert bench_report.learned_schedule_comparison(result) == {}


def test_a_server_with_flags_is_held_against_plain_and_eagle3_with_the_same_flags():
    """A schedule started with the prefill delayer is held against plain and EAGLE-3 with the
    delayer where both ran, not against the stock two: what the flag gives every mode is not the
    schedule's (row 93: the delayer alone made EAGLE-3 1.27x at 64 requests). Before, the table
    needed servers named plain and eagle3 and, with them, credited the flag's gain to the schedule;
    without them it was not drawn at all."""
    recs = configs.expand(("plain", "eagle3", "plain_prefill_delayer", "eagle3_prefill_delayer",
                           "eagle3_sched_prefill_delayer"), schedules=("1-40:5,41-:3",))
    tok = {"plain": 500.0, "eagle3": 1000.0, "plain_prefill_delayer": 600.0, "eagle3_prefill_delayer": 1300.0,
           "eagle3_sched1_prefill_delayer": 1365.0}
    window = {"errors": 0, "output_tokens": 3000, "seconds": 3.0, "steps": 300, "accept_length": 3.0}

    def result_of(names: tuple[str, ...]) -> dict[str, Any]:
        return json.loads(json.dumps({
            "configs": list(names), "config_records": {r.name: r.as_dict() for r in recs if r.name in names},
            "pairs": 2, "blocks": {"64": [{"block": k + 1, "order": [], "windows": {
                n: {**window, "tok_per_s": tok[n] * (1 + k / 100)} for n in names}} for k in range(2)]}}))

    every = bench_report.better_table(result_of(tuple(tok)))["64"]
    assert every["eagle3_sched1_prefill_delayer"]["median"] == pytest.approx(1.05)  # over EAGLE-3 with the delayer
    assert every["eagle3_prefill_delayer"]["median"] == pytest.approx(1.3)  # a mode of its flags: over the stock two
    assert every["plain_prefill_delayer"]["median"] == pytest.approx(0.6)
    only_delayer = ("plain_prefill_delayer", "eagle3_prefill_delayer", "eagle3_sched1_prefill_delayer")
    row = bench_report.better_table(result_of(only_delayer))["64"]
    assert set(row) == {"eagle3_sched1_prefill_delayer"} and row["eagle3_sched1_prefill_delayer"]["median"] == pytest.approx(1.05)
    assert "those started with the server's own flags" in bench_report.markdown(result_of(only_delayer))
    # without plain with the delayer, the stock two are the reference (as before)
    stock = bench_report.better_table(result_of(("plain", "eagle3", "eagle3_sched1_prefill_delayer")))["64"]
    assert stock["eagle3_sched1_prefill_delayer"]["median"] == pytest.approx(1.365)


def blocks_of(names: tuple[str, ...], shares: dict[str, tuple[float, ...]], c: str = "64") -> dict[str, Any]:
    """A call of these configs, one block per share: the first config's tokens/s drifts with the host
    (1.0, 0.8, 1.2, ...), each other's is its share of the first's in that block."""
    recs = configs.expand(names, schedules=("1-40:5,41-:3",))
    first = recs[0].name
    window = {"errors": 0, "output_tokens": 3000, "seconds": 3.0, "steps": 300, "accept_length": 2.8}
    drifts = (1.0, 0.8, 1.2, 0.9, 1.1)
    blocks = [{"block": k + 1, "order": [], "windows": {
        r.name: {**window, "tok_per_s": 1000.0 * drift * (1.0 if r.name == first else shares[r.name][k])}
        for r in recs}} for k, drift in enumerate(drifts[:len(next(iter(shares.values())))])]
    return {"configs": [r.name for r in recs], "config_records": {r.name: r.as_dict() for r in recs},
            "blocks": {c: blocks}, "pairs": len(blocks)}


def test_eagle3_s_twin_gives_the_floor_where_eagle3_is_the_better_mode(tmp_path, monkeypatch):
    # --bench-configs eagle3,eagle3_twin,eagle3_sched: three servers on one card, no plain. The floor
    # is EAGLE-3's twin over EAGLE-3 in each block, the ratio the schedule's is read against.
    result = blocks_of(("eagle3", "eagle3_twin", "eagle3_sched"),
                       {"eagle3_twin": (0.97, 1.02, 1.0), "eagle3_sched1": (1.06, 1.04, 1.08)})
    twin = configs.expand(("eagle3_twin",))[0]
    assert twin.twin and twin.kind == "fixed" and twin.steps == configs.LAUNCH_STEPS and twin.one_depth is None
    assert twin.label == "EAGLE-3 (A/A twin)"
    floors = bench_report.twin_floors(result)
    assert list(floors) == ["eagle3"] and floors["eagle3"]["64"]["ratios"] == [0.97, 1.02, 1.0]
    assert bench_report.floor_table(result) == {}  # no plain twin here
    md = bench_report.markdown(result)
    assert "A/A floor: EAGLE-3's twin over EAGLE-3 within a block" in md
    assert "| concurrency | twin / EAGLE-3 | per-block ratios |" in md
    assert "| 64 | 1.00x [0.97-1.02] | 0.970, 1.020, 1.000 |" in md
    # a twin is no depth of its own: `bench schedule` does not see two servers at depth 3
    assert bench_report.fixed_servers(result) == ["eagle3", "eagle3_sched1"]
    # with plain and both twins, the promise's table carries both floors
    result = blocks_of(("plain", "plain_twin", "eagle3", "eagle3_twin", "eagle3_thr"),
                       {"plain_twin": (1.0, 0.99, 1.01), "eagle3": (1.6, 1.6, 1.6),
                        "eagle3_twin": (1.6 * 0.95, 1.6 * 1.05, 1.6), "eagle3_thr16": (1.6, 1.6, 1.6)})
    assert set(bench_report.better_table(result)["64"]) == {"eagle3_thr16"}  # no twin in it
    md = bench_report.markdown(result)
    assert ("with the A/A floor (plain's twin over plain and EAGLE-3's twin over EAGLE-3: the noise of the "
            "procedure itself)") in md
    assert "| concurrency | EAGLE-3 + threshold 16 | A/A floor, plain | A/A floor, EAGLE-3 |" in md
    assert "| 64 | 1.00x [1.00-1.00] | 1.00x [0.99-1.01] | 1.00x [0.95-1.05] |" in md
    # the plot: the band is the reference's own floor, and no twin draws a ratio of its own
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    close, figures = plt.close, []
    monkeypatch.setattr(plt, "close", figures.append)
    try:
        bench_report.plot_concurrency(blocks_of(("eagle3", "eagle3_twin", "eagle3_sched"),
                                                {"eagle3_twin": (0.97, 1.02, 1.0),
                                                 "eagle3_sched1": (1.06, 1.04, 1.08)}), tmp_path / "c.png")
        (_, ratio), = (fig.axes for fig in figures)
        assert [list(bar.lines[0].get_ydata()) for bar in ratio.containers] == [[1.06]]  # the schedule's only
        band = ratio.collections[0].get_paths()[0].vertices[:, 1]
        assert min(band) == pytest.approx(0.97) and max(band) == pytest.approx(1.02)
    finally:
        for fig in figures:
            close(fig)
