"""The run (bench.throughput): what every server is started with, and the loop over whole
units within each call's deadline, resumed by the next call on the same servers (FakeLab), once
on real processes that answer as sglang does."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench import configs, diagnose, hostinfo, options, servers, throughput, workload
from bench import report as bench_report
from bench.__main__ import build_parser
from smoke.client import Prompt
from smoke.deadline import Deadline
from smoke.server import ServerConfig, SmokeError, group_running
from tests.bench.conftest import FakeServer, bench_options, free_port_base, titled


def test_configs_map_to_server_flags(tmp_path):
    opts = options.BenchOptions(models=tmp_path, out=tmp_path, thresholds=(16, 64), concurrency=(1, 256),
                                configs=("plain", "plain_twin", "eagle3", "eagle3_twin", "eagle3_adaptive", "eagle3_thr",
                                         "eagle3_auto"),
                                server_args=("--gc-threshold", "50000"), mem_share=0.8, max_total_tokens=1000)
    names = options.server_names(opts)
    assert names == ["plain", "plain_twin", "eagle3", "eagle3_twin", "eagle3_adaptive", "eagle3_thr16", "eagle3_thr64",
                     "eagle3_auto"]
    argv = {name: throughput.server_config(name, opts).argv(30000) for name in names}
    assert "--speculative-algorithm" not in argv["plain"] and argv["plain_twin"] == argv["plain"]  # A/A: identical
    assert "--speculative-algorithm" in argv["eagle3"] and argv["eagle3_twin"] == argv["eagle3"]
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


def test_prefill_graphs_is_the_threshold_server_with_the_plugin_s_prefill_graphs_on(tmp_path):
    # eagle3_thr_prefill_graphs: one server per threshold, eagle3_thr's flags, started with
    # SGLANG_IMAGE_PREFILL_KV_GRAPHS=1 (a prefill's draft K/V in plain mode from CUDA graphs), so
    # the graphs and the eager write stand side by side in the same blocks
    opts = bench_options("--configs", "plain,eagle3_thr,eagle3_thr_prefill_graphs", "--threshold", "64,192")
    assert options.server_names(opts) == ["plain", "eagle3_thr64", "eagle3_thr192",
                                          "eagle3_thr64_prefill_graphs", "eagle3_thr192_prefill_graphs"]
    eager, graphs = (throughput.server_config(n, opts) for n in ("eagle3_thr192", "eagle3_thr192_prefill_graphs"))
    assert graphs.argv(30000) == eager.argv(30000)
    assert graphs.env == {"SGLANG_IMAGE_PREFILL_KV_GRAPHS": "1"} and eager.env == {}
    assert servers.options_key(eager, "site") != servers.options_key(graphs, "site")
    rec = options.config_records(opts)["eagle3_thr192_prefill_graphs"]
    assert (rec.kind, rec.threshold, rec.switches) == ("threshold", 192, True)
    assert rec.label == "EAGLE-3 + threshold 192 (prefill K/V graphs)"
    assert configs.BenchConfig.from_dict(json.loads(json.dumps(rec.as_dict()))) == rec


def test_extend_verify_is_eagle3_with_upstream_s_split_kv_verify_off(tmp_path):
    # eagle3_extend_verify: the same flags as eagle3, started with SGLANG_ENABLE_SPLITKV_VERIFY=0
    # (the verify attention on the extend kernel); its environment is in its key, so a running
    # eagle3 is never reused for it, nor it for eagle3.
    opts = options.BenchOptions(models=tmp_path, out=tmp_path, concurrency=(1, 64),
                                configs=("plain", "eagle3", "eagle3_extend_verify"))
    assert options.server_names(opts) == ["plain", "eagle3", "eagle3_extend_verify"]
    eagle3, extend = (throughput.server_config(n, opts) for n in ("eagle3", "eagle3_extend_verify"))
    assert extend.argv(30000) == eagle3.argv(30000)
    assert extend.env == {"SGLANG_ENABLE_SPLITKV_VERIFY": "0"} and eagle3.env == {}
    assert servers.options_key(extend, "site") != servers.options_key(eagle3, "site")
    # with the device timer both get its variables, and the switch stays
    timed = options.BenchOptions(models=tmp_path, out=tmp_path, configs=opts.configs, device_timer=True)
    assert throughput.server_config("eagle3_extend_verify", timed).env == {
        **diagnose.SERVER_ENV, "SGLANG_ENABLE_SPLITKV_VERIFY": "0"}
    rec = options.config_records(opts)["eagle3_extend_verify"]
    assert (rec.kind, rec.steps, rec.switches, rec.learns) == ("fixed", 3, False, False)
    assert rec.label == "EAGLE-3 (extend-kernel verify)" and options.config_records(opts)["eagle3"].label == "EAGLE-3"
    assert bench_options("--configs", "plain,eagle3,eagle3_extend_verify").configs[-1] == "eagle3_extend_verify"
    ap = argparse.ArgumentParser()
    options.add_tuning_arguments(ap)
    configs_help = next(a.help for a in ap._actions if a.dest == "configs")
    assert "eagle3_extend_verify: eagle3 with upstream's split-KV verify kernel off, " \
           "SGLANG_ENABLE_SPLITKV_VERIFY=0" in str(configs_help)


def test_headwise_verify_is_eagle3_with_upstream_s_own_prefix_stage(tmp_path):
    # eagle3_headwise_verify: eagle3's flags, started with SGLANG_IMAGE_GROUPED_VERIFY=0, so that the
    # plugin's grouped prefix stage and upstream's compare in the same blocks
    opts = options.BenchOptions(models=tmp_path, out=tmp_path, configs=("eagle3", "eagle3_headwise_verify"))
    eagle3, headwise = (throughput.server_config(n, opts) for n in ("eagle3", "eagle3_headwise_verify"))
    assert headwise.argv(30000) == eagle3.argv(30000)
    assert headwise.env == {"SGLANG_IMAGE_GROUPED_VERIFY": "0"} and eagle3.env == {}
    assert servers.options_key(headwise, "site") != servers.options_key(eagle3, "site")
    rec = options.config_records(opts)["eagle3_headwise_verify"]
    assert (rec.kind, rec.steps, rec.label) == ("fixed", 3, "EAGLE-3 (per-head verify prefix)")
    # eagle3_upstream_combine: eagle3 with upstream's combine stage, the plugin's looped one off
    opts = options.BenchOptions(models=tmp_path, out=tmp_path, configs=("eagle3", "eagle3_upstream_combine"))
    upstream = throughput.server_config("eagle3_upstream_combine", opts)
    assert upstream.argv(30000) == eagle3.argv(30000) and upstream.env == {"SGLANG_IMAGE_LOOPED_COMBINE": "0"}
    assert options.config_records(opts)["eagle3_upstream_combine"].label == "EAGLE-3 (upstream combine)"
    # eagle3_splits_by_load: eagle3 with the verify's prefix cut by the batch's size (opt-in)
    opts = options.BenchOptions(models=tmp_path, out=tmp_path, configs=("eagle3", "eagle3_splits_by_load"))
    by_load = throughput.server_config("eagle3_splits_by_load", opts)
    assert by_load.argv(30000) == eagle3.argv(30000)
    assert by_load.env == {"SGLANG_IMAGE_VERIFY_SPLITS_BY_LOAD": "1"}
    assert options.config_records(opts)["eagle3_splits_by_load"].label == "EAGLE-3 (splits by load)"


def test_server_env_reaches_every_server_but_a_config_s_own_value_wins(tmp_path):
    # --server-env SGLANG_ENABLE_SPLITKV_VERIFY=1: every server's verify on the split-KV kernel,
    # except eagle3_extend_verify, whose own 0 is the paired baseline; a bad item names the flag
    opts = bench_options("--configs", "plain,eagle3,eagle3_extend_verify,eagle3_depth", "--depth", "1",
                         "--server-env", "SGLANG_ENABLE_SPLITKV_VERIFY=1 X_Y='a b'")
    opts = dataclasses.replace(opts, models=tmp_path, out=tmp_path)
    assert opts.server_env == (("SGLANG_ENABLE_SPLITKV_VERIFY", "1"), ("X_Y", "a b"))
    env = {n: throughput.server_config(n, opts).env for n in options.server_names(opts)}
    assert env["eagle3"] == env["eagle3_depth1"] == env["plain"] == {"SGLANG_ENABLE_SPLITKV_VERIFY": "1", "X_Y": "a b"}
    assert env["eagle3_extend_verify"] == {"SGLANG_ENABLE_SPLITKV_VERIFY": "0", "X_Y": "a b"}
    plain_opts = dataclasses.replace(opts, server_env=())
    assert servers.options_key(throughput.server_config("eagle3", opts), "s") != \
        servers.options_key(throughput.server_config("eagle3", plain_opts), "s")
    for bad in ("NOEQUALS", "1X=2", "=3"):
        with pytest.raises(SystemExit, match=f"--server-env .*{bad!r} is not NAME=VALUE"):
            bench_options("--server-env", bad)


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
    # a tier deeper than the launch depth: that server launches at its deepest tier, the others
    # keep the launch depth (a shallower schedule still runs the launch depth's KV reserve)
    deep = bench_options("--configs", "eagle3_sched", "--schedule", "1-64:5,65-:3;1-16:1,17-:0")
    deep = options.BenchOptions(models=tmp_path, out=tmp_path, concurrency=(1, 64), schedules=deep.schedules,
                                configs=deep.configs)
    a = throughput.server_config("eagle3_sched1", deep).argv(30000)
    assert a[a.index("--speculative-num-steps") + 1] == "5"
    assert a[a.index("--speculative-num-draft-tokens") + 1] == "6"
    a = throughput.server_config("eagle3_sched2", deep).argv(30000)
    assert a[a.index("--speculative-num-steps") + 1] == "3"
    with pytest.raises(SystemExit, match="--schedule: the last tier must be open"):
        bench_options("--configs", "plain,eagle3_sched", "--schedule", "1-16:3,17-32:0")
    with pytest.raises(SystemExit, match="--schedule .*distinct schedules"):
        bench_options("--configs", "plain,eagle3_sched", "--schedule", "1-16:3,17-:0;1-16:3,17-:0")


def test_a_learned_schedule_is_a_schedule_server_with_a_learning_pass_and_a_trace(tmp_path):
    # `auto` among the schedules: the server learns its depth per load (the plugin's
    # --speculative-depth-schedule auto); like the threshold's `auto` it gets a learning pass at
    # every level before the blocks and writes its step trace; a fixed schedule gets neither.
    opts = bench_options("--configs", "plain,eagle3_sched", "--schedule", "AUTO;1-16:3,17-:0")
    assert opts.schedules == ("auto", "1-16:3,17-:0")
    opts = options.BenchOptions(models=tmp_path, out=tmp_path, concurrency=(1, 64), schedules=opts.schedules,
                                configs=opts.configs, auto_learn_s=4.0)
    records = options.config_records(opts)
    assert records["eagle3_sched1"].learns and not records["eagle3_sched2"].learns
    assert records["eagle3_sched1"].label == "EAGLE-3 + schedule auto"
    learner, fixed = (throughput.server_config(n, opts) for n in ("eagle3_sched1", "eagle3_sched2"))
    a = learner.argv(30000)
    assert a[a.index("--speculative-depth-schedule") + 1] == "auto" and throughput.THRESHOLD_FLAG not in a
    assert throughput.AUTO_TRACE_ENV in learner.env and throughput.AUTO_TRACE_ENV not in fixed.env
    with pytest.raises(SystemExit, match="--schedule: .*or `auto`"):
        bench_options("--configs", "plain,eagle3_sched", "--schedule", "1-16:3,17-16:0")
    # --auto-depth K: the learner launches K deep, so it can learn a deeper draft than eagle3's
    deep = bench_options("--configs", "eagle3,eagle3_sched", "--schedule", "auto;1-16:3,17-:0", "--auto-depth", "5")
    deep = options.BenchOptions(models=tmp_path, out=tmp_path, concurrency=(1, 64), schedules=deep.schedules,
                                configs=deep.configs, auto_depth=deep.auto_depth)
    a = throughput.server_config("eagle3_sched1", deep).argv(30000)
    assert a[a.index("--speculative-num-steps") + 1] == "5" and a[a.index("--speculative-num-draft-tokens") + 1] == "6"
    for name in ("eagle3", "eagle3_sched2"):
        a = throughput.server_config(name, deep).argv(30000)
        assert a[a.index("--speculative-num-steps") + 1] == "3"
    assert options.config_records(deep)["eagle3_sched1"].label == "EAGLE-3 + schedule auto (depths 0-5)"
    with pytest.raises(SystemExit, match="--auto-depth 0: must be >= 1 draft steps"):
        bench_options("--auto-depth", "0")


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

    def warm_up(base: str, opts: options.BenchOptions, vocab: int) -> None:
        active.append(base)
        seen.append((base.removeprefix("http://"), len(active)))
        time.sleep(0.02)  # long enough for a second thread to enter, were there one
        lab.spend(10)
        active.remove(base)

    monkeypatch.setattr(throughput, "warm_up", warm_up)
    throughput.run_bench(lab.options(400, configs=("plain", "eagle3", "plain_twin")), {})
    assert seen == [("plain", 1), ("eagle3", 1), ("plain_twin", 1)]


def test_the_warm_up_sends_prompts_shaped_like_the_windows_in_two_waves(monkeypatch):
    """A kernel first met in a counted window compiles there (1.38 s in one block of a GPU run):
    the warm-up's prompts have the windows' lengths and output spread, and each load sends two
    waves of them (its prefills together, then one by one beside running decodes), at every
    concurrency, in a stream no window sends."""
    sent: list[tuple[int, list[Prompt]]] = []
    monkeypatch.setattr(throughput.client, "run_concurrent",
                        lambda base, prompts, c, timeout: sent.append((c, list(prompts))) or [])
    opts = options.BenchOptions(models=Path("m"), out=Path("o"), concurrency=(1, 16, 64))
    throughput.warm_up("http://x", opts, 1000)
    assert [c for c, _ in sent] == [1, 16, 64]
    window = {len(workload.window_prompt(1000, 64, opts.output_len, 50, i, opts.output_spread).input_ids)
              for i in range(200)}
    for c, prompts in sent:
        assert len(prompts) == 2 * c
        lengths = {len(p.input_ids) for p in prompts}
        assert lengths <= window and (c == 1 or max(lengths) - min(lengths) >= 16)
        assert len({p.max_new_tokens for p in prompts}) > (c > 1)
        assert all(p.key.startswith("w") for p in prompts)
    first = {p.input_ids for p in sent[-1][1]}
    assert not first & {workload.window_prompt(1000, 64, opts.output_len, 50, i, opts.output_spread).input_ids
                        for i in range(128)}


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
    assert bench_report.level_table(second)["1"]["eagle3"]["vs_reference"]["median"] == 1.2

    third = throughput.run_bench(lab.options(600, ramp_hold_s=10.0), state)
    assert lab.launched == [] and lab.ramps == ["plain", "eagle3"]
    assert not third["skipped"] and not third["failures"] and state["result"] is third
    assert sorted(lab.stopped) == ["eagle3", "plain"] and not lab.running  # complete: checked and stopped
    assert third["calls"] == 3 and set(third["ramp"]) == {"plain", "eagle3"} and "over 3 calls" in third["table"]
    assert "every output equal to plain decoding's" in third["table"] and "remaining" not in third["table"]
    assert set(third["servers"]) == {"plain", "eagle3"}

    assert throughput.run_bench(lab.options(600), state)["blocks"] == third["blocks"] and not lab.running


def test_an_aborted_output_not_a_prefix_of_plain_s_is_described_in_bench_json(lab, monkeypatch):
    """The failure says where the aborted output leaves plain's; bench.json keeps the examples of
    each block and server with the finish_reason the server gave, and the window's counts of
    aborted outputs longer than asked for or empty; the finish reasons themselves stay out of it."""
    fake = lab.measure

    def measure(base: str, prompt_at: Any, c: int, *a: Any, **kw: Any) -> dict[str, Any]:
        m = fake(base, prompt_at, c, *a, **kw)
        key = prompt_at(0).key  # plain's complete output of it: [len(key)]
        if base.endswith("eagle3"):
            m["prefixes"] = {key: [9, len(key)]}
            m["abort_reasons"] = {key: {"type": "abort"}}
            m["aborted_over_max"] = 1
        return m

    monkeypatch.setattr(throughput, "measure", measure)
    result = throughput.run_bench(lab.options(400, concurrency=(4,), pairs=1, ramp_cycles=0), {})
    assert result["failures"] == [("block 1 c=4 eagle3: 1 aborted output(s) not a prefix of plain's (e.g. "
                                   "c4-0: differs at token 0 of 2, plain's 1 (longer than plain's), finish abort: "
                                   "got [9, 4] want [4])"),
                                  "block 1 c=4 eagle3: 1 aborted output(s) longer than their max_new_tokens"]
    assert result["prefix_mismatches"] == [{"where": "block 1 c=4", "server": "eagle3", "bad": 1, "examples": [
        {"key": "c4-0", "aborted_len": 2, "plain_len": 1, "differs_at": 0, "longer": True, "from": 0,
         "got": [9, 4], "want": [4], "finish_reason": {"type": "abort"}}]}]
    eagle3 = result["blocks"]["4"][0]["windows"]["eagle3"]
    assert eagle3["aborted_over_max"] == 1 and "abort_reasons" not in eagle3 and "prefixes" not in eagle3
    saved = json.loads((lab.tmp_path / "out" / "bench.json").read_text())
    assert saved["prefix_mismatches"] == result["prefix_mismatches"]


def test_without_plain_the_outputs_are_held_to_plain_started_with_flags(lab, monkeypatch):
    """Row 94 ran plain, EAGLE-3 and the schedule all with the prefill delayer: no server named
    plain, and no output was compared. Plain with the delayer decodes plain: the others' outputs,
    complete and aborted, and the ramp's are held to its."""
    fake = lab.measure

    def measure(base: str, prompt_at: Any, c: int, *a: Any, **kw: Any) -> dict[str, Any]:
        m = fake(base, prompt_at, c, *a, **kw)
        if base.endswith("eagle3_prefill_delayer"):
            m["outputs"][prompt_at(1).key] = [9]
        return m

    monkeypatch.setattr(throughput, "measure", measure)
    opts = lab.options(400, configs=("plain_prefill_delayer", "eagle3_prefill_delayer"), concurrency=(4,),
                       pairs=1, ramp_cycles=0)
    result = throughput.run_bench(opts, {})
    assert result["failures"] == [("block 1 c=4 eagle3_prefill_delayer: 1 output(s) differ from "
                                   "plain_prefill_delayer (e.g. c4-1)")]


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
    blocks, the ramps and the checks and then stops them; outputs compared, KV pool checked; what
    --server-env and --server-args gave every server recorded in bench.json and its header."""
    monkeypatch.setattr(throughput, "server_config", lambda name, opts: FakeSglang(name, tmp_path))
    (tmp_path / "expected.json").write_text(json.dumps({"vocab_size": 3072, "size": "1b"}))

    def opts(seconds: float) -> options.BenchOptions:
        return options.BenchOptions(models=tmp_path, out=tmp_path / "out", configs=("plain", "plain_twin", "eagle3_thr"),
                                    concurrency=(1, 4), pairs=2, window_s=0.4, settle_s=0.1, ramp_cycles=1,
                                    ramp_hold_s=0.3, output_len=32, port=free_port_base(), cpus_per_server=0,
                                    registry=tmp_path / "reg.json", deadline=Deadline(time.time() + seconds),
                                    server_env=(("SGLANG_X", "1"), ("Y", "a b")), server_args=("--gc-threshold", "50000"))

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
                # at least the window asked for; a busy host's metrics scrape (inside it) may lengthen it
                assert 0.35 <= w["seconds"] < 0.8 and w["tok_per_s"] > 0 and w["steps"] and w["abort_all"]
    assert result["calls"] == 2 and set(result["ramp"]) == {"plain", "plain_twin", "eagle3_thr16"}
    assert bench_report.floor_table(result)["4"]["pairs"] == 2
    assert result["servers"]["eagle3_thr16"]["speculative_disable"]["threshold"] == 16
    assert all(info["kv_used_after_flush"] == 0 for info in result["servers"].values())
    assert "every output equal to plain decoding's" in result["table"]
    assert ("accept length 3.20 in the last 64 speculative steps before a plain phase, 3.15 in the "
            "first 64 after it (worst of 2 phases: 0.97x)") in result["table"]
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"bench.json", "bench.md"}
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert saved["server_env"] == {"SGLANG_X": "1", "Y": "a b"} and saved["server_args"] == ["--gc-threshold", "50000"]
    assert "Every server: --server-env `SGLANG_X=1 Y='a b'`, --server-args `--gc-threshold 50000`." in result["table"]


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
    assert result["learned"]["eagle3_auto"] == {"seconds_per_level": 3.0, "crossover_after": {"1": 32, "4": 32},
                                                "trial_s": {}}
    assert set(result["learned"]) == {"eagle3_auto"}  # the fixed modes have nothing to learn
    md = bench_report.markdown(result)
    assert "3.00 s under each level's load before the blocks" in md and "crossover after each level: 1: 32, 4: 32" in md
    # 0: no learning (the first block learns, as a new server does)
    windows.clear()
    throughput.run_bench(lab.options(900, configs=("plain", "eagle3_auto"), ramp_cycles=0, auto_learn_s=0.0,
                                     registry=lab.tmp_path / "other.json"), {})
    assert all(w[2] == 20.0 for w in windows)


def test_a_trial_the_learning_pass_began_runs_on_in_it_not_in_the_blocks(lab, monkeypatch):
    """A GPU run of 2026-12-07: `auto` began a trial on a tied bucket and ran it in the blocks,
    whose traffic paid for its blocks in the worse mode. The learning pass holds a level's load
    while the server reports a trial, in 5 s pieces, up to --auto-trial-s more."""
    monkeypatch.setattr(throughput, "auto_supported", lambda: True)
    monkeypatch.setattr(throughput, "mode_of", lambda base: ("plain", 32, 3))
    windows: list[tuple[str, int, float]] = []
    measure = lab.measure

    def recording(base, prompt_at, c, settle_s, window_s, *args, **kw):
        windows.append((base.removeprefix("http://"), c, window_s))
        return measure(base, prompt_at, c, settle_s, window_s, *args, **kw)

    monkeypatch.setattr(throughput, "measure", recording)
    # a trial at level 1 that ends after the second look; none at level 4
    answers = iter(["1-1", "1-1", None, None])
    monkeypatch.setattr(throughput, "trial_of", lambda base: next(answers))
    result = throughput.run_bench(lab.options(900, configs=("plain", "eagle3_auto"), ramp_cycles=0,
                                              auto_learn_s=3.0, auto_trial_s=12.0), {})
    assert windows[:4] == [("eagle3_auto", 1, 3.0), ("eagle3_auto", 1, 5.0), ("eagle3_auto", 1, 5.0),
                           ("eagle3_auto", 4, 3.0)]
    assert all(w[2] == 20.0 for w in windows[4:])  # the blocks as before
    assert result["learned"]["eagle3_auto"]["trial_s"] == {"1": 10.0}
    assert "3.00 s under each level's load before the blocks (prompts no window sends), longer where a " \
           "trial ran on (1: 10.00 s)" in bench_report.markdown(result)
    # a trial that never ends: the level runs auto_trial_s more and no longer (5 + 5 + 2)
    windows.clear()
    monkeypatch.setattr(throughput, "trial_of", lambda base: "1-1")
    result = throughput.run_bench(lab.options(900, configs=("plain", "eagle3_auto"), ramp_cycles=0, auto_learn_s=3.0,
                                              auto_trial_s=12.0, registry=lab.tmp_path / "other.json"), {})
    assert [w[2] for w in windows[:8]] == [3.0, 5.0, 5.0, 2.0, 3.0, 5.0, 5.0, 2.0]
    assert result["learned"]["eagle3_auto"]["trial_s"] == {"1": 12.0, "4": 12.0}
    # 0: the pass never runs longer, whatever the server says
    windows.clear()
    throughput.run_bench(lab.options(900, configs=("plain", "eagle3_auto"), ramp_cycles=0, auto_learn_s=3.0,
                                     auto_trial_s=0.0, registry=lab.tmp_path / "third.json"), {})
    assert [w[2] for w in windows[:2]] == [3.0, 3.0]
    with pytest.raises(SystemExit, match="--auto-trial-s -1.0: must be >= 0"):
        bench_options("--auto-trial-s", "-1")


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


def test_the_diagnosed_load_is_sized_by_the_server_s_own_blocks(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """--diagnose's full load at the top concurrency sends as many prompts as the server's median
    tokens/s in its blocks there needs to stay full through the py-spy sample."""
    sent: dict[str, int] = {}
    monkeypatch.setattr(diagnose, "full_load", lambda srv, prompts, c, *a: sent.update({srv: len(prompts)}) or {})
    bench = object.__new__(throughput.Bench)
    bench.opts = options.BenchOptions(models=tmp_path, out=tmp_path, concurrency=(16, 64), output_len=256)
    bench.vocab, bench.pool = 1000, argparse.Namespace(servers={"plain": "plain", "eagle3": "eagle3"})
    bench.result = {"diagnose": {}, "blocks": {"64": [
        {"windows": {"plain": {"tok_per_s": tok, "errors": 0}, "eagle3": {"tok_per_s": 1.5 * tok, "errors": 0}}}
        for tok in (7_800.0, 7_900.0, 8_000.0)]}}
    for name in ("plain", "eagle3"):
        bench.diagnose(name)
    assert sent == {"plain": diagnose.full_load_prompts(64, 7_900.0, 256),
                    "eagle3": diagnose.full_load_prompts(64, 11_850.0, 256)}
    assert sent["eagle3"] > sent["plain"] > 3 * 64


def test_metadata_glue_is_eagle3_with_upstream_s_glue_graph_on():
    # eagle3_metadata_glue: always-on EAGLE-3, eagle3's flags, started with
    # SGLANG_ENABLE_METADATA_GLUE_GRAPH=1, so the host's share of a speculative step with and
    # without the glue graph compare in the same blocks
    opts = bench_options("--configs", "eagle3,eagle3_metadata_glue")
    base, glue = (throughput.server_config(n, opts) for n in ("eagle3", "eagle3_metadata_glue"))
    assert glue.argv(30000) == base.argv(30000)
    assert glue.env == {"SGLANG_ENABLE_METADATA_GLUE_GRAPH": "1"} and base.env == {}
    assert servers.options_key(base, "site") != servers.options_key(glue, "site")
    rec = options.config_records(opts)["eagle3_metadata_glue"]
    assert (rec.kind, rec.steps, rec.switches) == ("fixed", 3, False)
    assert rec.label == "EAGLE-3 (metadata glue graph)"


def test_a_server_short_of_its_kv_pool_ends_the_run_before_any_block(lab, monkeypatch):
    """A GPU run of 2026-12-07: the third of three servers side by side held 2,107 of the 81,100
    KV tokens each was given (SGLang sizes a pool from the memory the others left), and the run
    measured every block before saying so. Now it stops before the first, naming the cause and
    the fixes, and stops the servers (the same options would meet the same shortage)."""
    opts = lab.options(600, configs=("plain", "eagle3", "eagle3_depth"), depths=(1,), max_total_tokens=81100)
    monkeypatch.setattr(throughput, "kv_pool",
                        lambda srv: 2107 if srv.base.endswith("plain") else 0 if "depth" in srv.base else 81100)
    result = throughput.run_bench(opts, {})
    assert lab.windows == []
    failure = result["failures"][0]
    assert failure.startswith("KV pool short of the 81,100 tokens every server was given")
    assert "plain 2,107" in failure and "eagle3 " not in failure.split(";")[0]  # 0: not read, not judged
    assert "fewer servers in one call" in failure and "--max-total-tokens" in failure
    assert sorted(lab.stopped) == ["eagle3", "eagle3_depth1", "plain"]
    assert result["not_measured"][0] == "concurrency 1: 2 of 2 blocks"
    # without --max-total-tokens every server is given room for the top concurrency's requests
    asked = int(1.1 * 4 * (64 + 320))
    monkeypatch.setattr(throughput, "kv_pool", lambda srv: asked - 1)
    assert throughput.run_bench(lab.options(600, registry=lab.tmp_path / "b.json"), {})["failures"][0].startswith(
        f"KV pool short of the {asked:,} tokens")
    monkeypatch.setattr(throughput, "kv_pool", lambda srv: asked)  # every pool as given: the run goes on
    assert not throughput.run_bench(lab.options(600, registry=lab.tmp_path / "c.json"), {})["failures"]


def test_a_schedule_with_upstream_s_combine_is_the_schedule_server_with_the_switch_off(tmp_path):
    # eagle3_sched_upstream_combine: one server per schedule, eagle3_sched's flags (launched at its
    # deepest tier), started with SGLANG_IMAGE_LOOPED_COMBINE=0, so that a wider verify is measured
    # with either combine in the same blocks
    parsed = bench_options("--configs", "eagle3,eagle3_sched,eagle3_sched_upstream_combine", "--schedule", "1-96:5,97-:3")
    opts = options.BenchOptions(models=tmp_path, out=tmp_path, concurrency=(1, 64), schedules=parsed.schedules,
                                configs=parsed.configs)
    assert options.server_names(opts) == ["eagle3", "eagle3_sched1", "eagle3_sched1_upstream_combine"]
    looped, upstream = (throughput.server_config(n, opts) for n in ("eagle3_sched1", "eagle3_sched1_upstream_combine"))
    assert looped.argv(30000) == upstream.argv(30000)
    a = upstream.argv(30000)
    assert a[a.index("--speculative-num-steps") + 1] == "5"
    assert upstream.env == {"SGLANG_IMAGE_LOOPED_COMBINE": "0"} and looped.env == {}
    assert servers.options_key(upstream, "site") != servers.options_key(looped, "site")
    rec = options.config_records(opts)["eagle3_sched1_upstream_combine"]
    assert (rec.kind, rec.steps, rec.schedule, rec.switches) == ("schedule", 5, "1-96:5,97-:3", True)
    assert rec.label == "EAGLE-3 + schedule 1-96:5,97-:3 (upstream combine)"
    assert configs.BenchConfig.from_dict(json.loads(json.dumps(rec.as_dict()))) == rec


def test_the_delayer_s_queue_ratio_is_one_option_for_every_delayer_config_of_a_call(tmp_path):
    # Row 93: the delayer at 1/8 cost EAGLE-3 15% at 16 requests (a refill waits for a second one)
    # and row 94 doubled the time to first token at 64. --delayer-ratio 0.0625 waits only from 32
    # running requests up, on every *_prefill_delayer server of the call, named in its label.
    parsed = bench_options("--configs", "eagle3,eagle3_prefill_delayer,plain_prefill_delayer",
                           "--delayer-ratio", "0.0625")
    opts = dataclasses.replace(parsed, models=tmp_path, out=tmp_path)
    late = ("--enable-prefill-delayer", "--prefill-delayer-queue-min-ratio", "0.0625")
    records = options.config_records(opts)
    assert {n: r.args for n, r in records.items()} == {"eagle3": (), "eagle3_prefill_delayer": late,
                                                       "plain_prefill_delayer": late}
    assert throughput.server_config("eagle3_prefill_delayer", opts).argv(30000)[-3:] == list(late)
    assert records["eagle3_prefill_delayer"].label == "EAGLE-3 (prefill delayer, queue ratio 0.0625)"
    default = dataclasses.replace(bench_options("--configs", "eagle3_prefill_delayer"), models=tmp_path, out=tmp_path)
    assert options.config_records(default)["eagle3_prefill_delayer"].args == configs.PREFILL_DELAYER
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(SystemExit, match=r"--delayer-ratio .*must be in \(0, 1\]"):
            bench_options("--configs", "eagle3_prefill_delayer", "--delayer-ratio", bad)


def test_the_delayer_s_hold_is_capped_in_passes_for_every_delayer_config_of_a_call(tmp_path):
    # Row 94: with upstream's cap of 30 passes the delayer took EAGLE-3's time to first token at 64
    # requests from 35.6 / 54.8 ms (p50 / p90) to 66.2 / 138.6. --delayer-passes N bounds a held
    # prefill to N scheduler passes (decode steps), on every *_prefill_delayer server of the call.
    parsed = bench_options("--configs", "eagle3,eagle3_prefill_delayer,eagle3_sched_prefill_delayer",
                           "--schedule", "1-40:5,41-:3", "--delayer-passes", "4")
    opts = dataclasses.replace(parsed, models=tmp_path, out=tmp_path)
    capped = (*configs.PREFILL_DELAYER, "--prefill-delayer-max-delay-passes", "4")
    records = options.config_records(opts)
    assert {n: r.args for n, r in records.items()} == {"eagle3": (), "eagle3_prefill_delayer": capped,
                                                       "eagle3_sched1_prefill_delayer": capped}
    assert throughput.server_config("eagle3_prefill_delayer", opts).argv(30000)[-5:] == list(capped)
    assert records["eagle3_prefill_delayer"].label == "EAGLE-3 (prefill delayer, at most 4 passes)"
    both = dataclasses.replace(bench_options("--configs", "eagle3_prefill_delayer", "--delayer-ratio", "0.0625",
                                             "--delayer-passes", "3"), models=tmp_path, out=tmp_path)
    assert options.config_records(both)["eagle3_prefill_delayer"].label == (
        "EAGLE-3 (prefill delayer, queue ratio 0.0625, at most 3 passes)")
    # upstream's own cap names no flag: the servers of earlier calls keep their options key
    default = dataclasses.replace(bench_options("--configs", "eagle3_prefill_delayer", "--delayer-passes", "30"),
                                  models=tmp_path, out=tmp_path)
    assert options.config_records(default)["eagle3_prefill_delayer"].args == configs.PREFILL_DELAYER
    for bad in ("0", "-2"):
        with pytest.raises(SystemExit, match=r"--delayer-passes .*must be >= 1"):
            bench_options("--configs", "eagle3_prefill_delayer", "--delayer-passes", bad)


def test_a_prefill_delayer_config_is_its_base_with_upstream_s_delayer_flags(tmp_path):
    # plain_prefill_delayer, eagle3_prefill_delayer, eagle3_sched_prefill_delayer: the base's flags,
    # then upstream's prefill delayer on its queue trigger, then --server-args (a caller's flag
    # last); each is a variant, not a depth, and no fixed schedule for `auto` to be set against
    parsed = bench_options("--configs", "plain,plain_prefill_delayer,eagle3,eagle3_prefill_delayer,eagle3_sched,"
                           "eagle3_sched_prefill_delayer", "--schedule", "1-40:5,41-:3", "--server-args", "--x 1")
    opts = dataclasses.replace(parsed, models=tmp_path, out=tmp_path)
    assert options.server_names(opts) == ["plain", "plain_prefill_delayer", "eagle3", "eagle3_prefill_delayer",
                                          "eagle3_sched1", "eagle3_sched1_prefill_delayer"]
    for base in ("plain", "eagle3", "eagle3_sched1"):
        cfg, delayed = (throughput.server_config(n, opts) for n in (base, f"{base}_prefill_delayer"))
        plain_argv, argv = cfg.argv(30000), delayed.argv(30000)
        assert argv == plain_argv[:-2] + list(configs.PREFILL_DELAYER) + ["--x", "1"]
        assert delayed.env == cfg.env
        assert servers.options_key(delayed, "site") != servers.options_key(cfg, "site")
    records = options.config_records(opts)
    rec = records["eagle3_sched1_prefill_delayer"]
    assert (rec.kind, rec.steps, rec.schedule, rec.args) == ("schedule", 5, "1-40:5,41-:3", configs.PREFILL_DELAYER)
    assert rec.label == "EAGLE-3 + schedule 1-40:5,41-:3 (prefill delayer)"
    assert records["plain_prefill_delayer"].label == "plain (prefill delayer)"
    assert configs.BenchConfig.from_dict(json.loads(json.dumps(rec.as_dict()))) == rec
    assert [n for n, r in records.items() if r.one_depth is not None] == ["plain", "eagle3"]
    result = {"configs": list(records), "config_records": {n: r.as_dict() for n, r in records.items()}}
    assert bench_report.fixed_servers(result) == ["plain", "eagle3", "eagle3_sched1"]
    # upstream asserts the overlap scheduler under the delayer: refused before any server starts
    with pytest.raises(SystemExit, match=r"eagle3_prefill_delayer start upstream's prefill delayer, which runs "
                                         r"only on the overlap scheduler: drop them from --configs"):
        bench_options("--configs", "eagle3,eagle3_prefill_delayer", "--server-args=--disable-overlap-schedule")
