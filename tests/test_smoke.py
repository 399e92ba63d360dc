"""The smoke runner's checks, the model generator and the argument parsing (CPU, no server).

The checks run on real text and real outputs: a server log in sglang 0.5.17's format, the greedy
continuation of a model generated here. Nothing pretends to be an sglang server.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from smoke import client, models, partial, runner
from smoke.__main__ import build_parser

# A server log as sglang 0.5.17 writes it (launch of an EAGLE-3 server), without the patch's line.
SERVER_LOG = """\
$ python3 -m sglang.launch_server --model-path /tmp/smoke-state/models/tiny/target --host 127.0.0.1 --port 30000 --speculative-algorithm EAGLE3 --speculative-disable-batch-threshold 4
[2026-11-30 08:40:02] server_args=ServerArgs(model_path='/tmp/smoke-state/models/tiny/target', tokenizer_path='/tmp/smoke-state/models/tiny/target', attention_backend='triton', sampling_backend='pytorch', grammar_backend='none', speculative_algorithm='EAGLE3', speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4, ...)
[2026-11-30 08:40:09] Load weight begin. avail mem=138.72 GB
[2026-11-30 08:40:09] Load weight end. elapsed=0.05 s, type=LlamaForCausalLM, dtype=torch.bfloat16, avail mem=138.70 GB, mem usage=0.02 GB.
[2026-11-30 08:40:10] KV Cache is allocated. #tokens: 1966080, K size: 3.75 GB, V size: 3.75 GB
[2026-11-30 08:40:10] Memory pool end. avail mem=130.96 GB
[2026-11-30 08:40:14] Capture cuda graph begin. This can take up to several minutes. avail mem=130.90 GB
[2026-11-30 08:40:31] Capture cuda graph end. Time elapsed: 17.02 s. mem usage=0.11 GB. avail mem=130.79 GB.
[2026-11-30 08:40:33] max_total_num_tokens=1966080, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=64, context_len=4096, available_gpu_mem=130.79 GB
[2026-11-30 08:40:34] INFO:     Started server process [41233]
[2026-11-30 08:40:34] INFO:     Waiting for application startup.
[2026-11-30 08:40:34] INFO:     Application startup complete.
[2026-11-30 08:40:34] INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)
[2026-11-30 08:40:35] INFO:     127.0.0.1:51220 - "GET /health HTTP/1.1" 200 OK
[2026-11-30 08:40:36] Prefill batch, #new-seq: 1, #new-token: 9, #cached-token: 0, token usage: 0.00, #running-req: 0, #queue-req: 0,
[2026-11-30 08:40:36] The server is fired up and ready to roll!
"""
PATCH_LINE = "[2026-11-30 08:40:10] Dynamic speculation disable enabled: threshold=4 (hysteresis=1)\n"


def bench_options(*flags: str) -> Any:
    """`smoke bench`'s options parsed from these flags (after the required --models and --out)."""
    from smoke import bench

    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    return bench.options(ap.parse_args(["--models", "m", "--out", "o", *flags]))


# ----------------------------------------------------------------------------- models (real, CPU)
@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for draft in ("first", "chain"):
        d = tmp_path_factory.mktemp(f"models-{draft}")
        models.build(d, size="tiny", draft=draft, accept=1.0, corpus_bytes=200_000, gen_len=24)
        out[draft] = d
    return out


def test_models_load_with_transformers_and_give_the_recorded_continuation(tiny_models):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    d = tiny_models["first"]
    exp = json.loads((d / "expected.json").read_text())
    tok = AutoTokenizer.from_pretrained(d / "target")
    assert tok(exp["prompt"], add_special_tokens=False)["input_ids"] == exp["prompt_ids"]
    model = LlamaForCausalLM.from_pretrained(d / "target", dtype=torch.float32).eval()
    out = model.generate(torch.tensor([exp["prompt_ids"]]), max_new_tokens=len(exp["greedy_ids"]),
                         do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
    assert out[0, len(exp["prompt_ids"]):].tolist() == exp["greedy_ids"]
    # the greedy choice does not depend on kernel rounding: a wide top-1/top-2 gap everywhere
    assert exp["min_top1_top2_margin"] > 3.0
    assert exp["steps_following_designed_chain"] == len(exp["greedy_ids"])


def test_draft_files_are_in_the_eagle3_format_sglang_loads(tiny_models):
    from safetensors.torch import load_file

    for d in tiny_models.values():
        cfg = json.loads((d / "draft" / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 1024
        assert cfg["target_hidden_size"] == cfg["hidden_size"]
        assert len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == 3
        w = load_file(d / "draft" / "model.safetensors")
        exp = json.loads((d / "expected.json").read_text())
        assert (w["d2t"] + __import__("torch").arange(1024)).tolist() == exp["hot_ids"]
        assert int(w["t2d"].sum()) == 1024
        assert w["fc.weight"].shape == (cfg["hidden_size"], 3 * cfg["hidden_size"])
        assert w["lm_head.weight"].shape == (1024, cfg["hidden_size"])
        assert {k for k in w if k.startswith("midlayer.")} >= {
            "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight",
            "midlayer.mlp.down_proj.weight"}


@pytest.mark.parametrize("draft,want", [("first", 2.0), ("chain", 4.0)])
def test_draft_acceptance_is_the_designed_one(tiny_models, draft, want):
    exp = json.loads((tiny_models[draft] / "expected.json").read_text())
    assert exp["designed_accept_length"] == pytest.approx(want)
    emu = models.emulate_draft(tiny_models[draft], rounds=5)
    assert emu["accept_length"] == pytest.approx(want)
    # speculative decoding reproduces the target's greedy output
    n = len(exp["prompt_ids"])
    got = emu["tokens"][n:]
    k = min(len(got), len(exp["greedy_ids"]))
    assert got[:k] == exp["greedy_ids"][:k]


def test_designed_accept_length_counts_consecutive_good_tokens():
    chain = list(range(100))
    assert models.designed_accept_length(chain, set(chain), 3) == 4.0
    assert models.designed_accept_length(chain, set(), 3) == 1.0
    assert models.designed_accept_length(chain, None, 3) == 2.0
    # good on even tokens: every round starts on an even token, accepts it, stops at the odd one
    assert models.designed_accept_length(chain, {x for x in chain if x % 2 == 0}, 3) == 2.0
    # good on all but every 4th: runs of 3 then a miss
    assert models.designed_accept_length(chain, {x for x in chain if x % 4 != 3}, 3) == 4.0


def test_bench_model_shapes():
    """1b: ~1.0e9 target parameters (host-bound on an H200 at 256 requests); 8b: Llama-3-8B's layer
    shapes (~7e9 with the small vocab). The chain draft needs heads x head_dim == hidden."""
    def params(sz):
        head_dim = sz.hidden // sz.heads
        attn = sz.hidden * head_dim * (2 * sz.heads + 2 * sz.kv_heads)
        return sz.layers * (attn + 3 * sz.hidden * sz.intermediate) + 2 * sz.vocab * sz.hidden
    assert 0.95e9 < params(models.SIZES["1b"]) < 1.05e9
    assert 6.9e9 < params(models.SIZES["8b"]) < 7.1e9
    for name in ("1b", "8b"):
        sz = models.SIZES[name]
        assert sz.hidden % sz.heads == 0 and sz.layers - 2 > sz.layers // 2 - 1 > 0  # three aux layers
    ap = build_parser()
    assert ap.parse_args(["e2e", "--bench-size", "8b"]).bench_size == "8b"
    assert ap.parse_args(["e2e"]).bench_size == "1b"
    with pytest.raises(SystemExit):
        ap.parse_args(["e2e", "--bench-size", "tiny"])


# ----------------------------------------------------------------------------- failure paths
def test_missing_log_line_fails_with_cause_and_log_tail(tmp_path):
    log = tmp_path / "server_eagle_overlap.log"
    log.write_text(SERVER_LOG)
    rep: dict = {"name": "eagle_overlap", "phases": {}}
    with pytest.raises(runner.SmokeFailure) as ei:
        runner.check_start_log(log.read_text(), 4)
    assert "Dynamic speculation disable enabled: threshold=4" in ei.value.cause
    runner.record_failure(rep, ei.value, log)
    report = runner.collect_failures({"threshold": 4, "variants": {"eagle_overlap": rep},
                                      "failures": []})
    text = runner.summarize(report)
    assert "SMOKE FAILED [eagle_overlap]: start log line missing" in text
    assert "The server is fired up and ready to roll!" in text  # the log's tail is shown
    assert runner.exit_code(report) == 1
    assert "tail of" in ei.value.render() and "Uvicorn running" in ei.value.render()


def test_start_log_line_found_and_exact():
    runner.check_start_log(SERVER_LOG + PATCH_LINE, 4)
    with pytest.raises(runner.SmokeFailure):
        runner.check_start_log(SERVER_LOG + PATCH_LINE.replace("threshold=4", "threshold=40"), 4)
    with pytest.raises(runner.SmokeFailure):
        runner.check_start_log(SERVER_LOG + PATCH_LINE, 8)


def test_output_mismatch_fails_with_cause_and_log_tail(tiny_models, tmp_path):
    exp = json.loads((tiny_models["first"] / "expected.json").read_text())
    ref = {"hf": exp["greedy_ids"]}
    same = client.Result("hf", list(exp["greedy_ids"]))
    runner.check_outputs(ref, [same], "below")
    runner.check_hf_reference(exp, same.output_ids)
    wrong = list(exp["greedy_ids"])
    wrong[7] = (wrong[7] + 1) % exp["vocab_size"]
    log = tmp_path / "server_eagle_sync.log"
    log.write_text(SERVER_LOG + PATCH_LINE)
    rep: dict = {"name": "eagle_sync", "phases": {}}
    with pytest.raises(runner.SmokeFailure) as ei:
        runner.check_outputs(ref, [client.Result("hf", wrong)], "above")
    assert "above: output mismatch" in ei.value.cause and "first difference at token 7" in ei.value.cause
    runner.record_failure(rep, ei.value, log)
    report = runner.collect_failures({"threshold": 4, "variants": {"eagle_sync": rep}, "failures": []})
    text = runner.summarize(report)
    assert "SMOKE FAILED [eagle_sync]: above: output mismatch" in text
    assert "Dynamic speculation disable enabled" in text
    assert runner.exit_code(report) == 1
    with pytest.raises(runner.SmokeFailure, match="HF transformers reference"):
        runner.check_hf_reference(exp, wrong)


def test_request_errors_and_bad_log_lines_fail():
    with pytest.raises(runner.SmokeFailure, match="1 request"):
        runner.check_no_errors([client.Result("p1", error="HTTP 500 from /generate: boom")], "ramp")
    bad = SERVER_LOG + ("[2026-11-30 08:41:00] Scheduler hit an exception: Traceback (most recent call last):\n"
                        "Traceback (most recent call last):\n  File \"scheduler.py\", line 1\n")
    with pytest.raises(runner.SmokeFailure, match="Traceback"):
        runner.check_log_clean(bad)
    with pytest.raises(runner.SmokeFailure, match="memory leak"):
        runner.check_log_clean(SERVER_LOG + "[2026-11-30 08:41:00] pool memory leak detected! full: 12\n")
    runner.check_log_clean(SERVER_LOG + PATCH_LINE)


def test_server_info_counters():
    st = {"threshold": 4, "hysteresis": 1, "mode": "speculative", "speculative_steps": 120,
          "plain_steps": 40, "mode_changes": 4}
    info = {"internal_states": [{"speculative_disable": st, "avg_spec_accept_length": 2.0}]}
    assert runner.spec_state(info) == st
    runner.check_threshold_state(st, 4)
    runner.check_switched(st, "end")
    with pytest.raises(runner.SmokeFailure, match="patch applied"):
        runner.spec_state({"internal_states": [{"avg_spec_accept_length": 2.0}]})
    with pytest.raises(runner.SmokeFailure, match="plain_steps == 0"):
        runner.check_switched(dict(st, plain_steps=0, mode_changes=0), "end")
    with pytest.raises(runner.SmokeFailure, match="did not grow"):
        runner.check_delta(st, st, "plain_steps", "above", positive=True)
    with pytest.raises(runner.SmokeFailure, match="should not"):
        runner.check_delta(st, dict(st, plain_steps=41), "plain_steps", "below", positive=False)
    # the catch-up step after a plain phase: one plain step allowed, two are not
    assert runner.check_delta(st, dict(st, plain_steps=41), "plain_steps", "after", positive=False, at_most=1) == 1
    with pytest.raises(runner.SmokeFailure, match="more than 1"):
        runner.check_delta(st, dict(st, plain_steps=42), "plain_steps", "after", positive=False, at_most=1)


def test_accept_length_and_kv_checks():
    before = runner.accept_stats([client.Result("a", [1] * 48, {"spec_accept_length": 2.0,
                                                                  "spec_accept_rate": 0.33,
                                                                  "spec_verify_ct": 24})])
    assert before["accept_length"] == 2.0
    runner.check_accept_recovers(before, {"accept_length": 1.95})
    with pytest.raises(runner.SmokeFailure, match="after the disabled phase"):
        runner.check_accept_recovers(before, {"accept_length": 1.2})
    with pytest.raises(runner.SmokeFailure, match="not accepted at low load"):
        runner.check_accept_recovers({"accept_length": 1.0}, {"accept_length": 1.0})
    base = {"num_used_tokens": 0, "max_total_num_tokens": 100000, "num_running_reqs": 0}
    runner.check_kv_back(base, dict(base))
    with pytest.raises(runner.SmokeFailure, match="KV pool not back"):
        runner.check_kv_back(base, dict(base, num_used_tokens=37))


def test_prometheus_parsing():
    text = ("# HELP sglang:spec_disable_plain_mode 1 while speculation is off\n"
            "# TYPE sglang:spec_disable_plain_mode gauge\n"
            'sglang:spec_disable_plain_mode{model_name="target",engine_type="unified",tp_rank="0"} 0.0\n'
            'sglang:spec_disable_plain_steps_total{model_name="target",tp_rank="0"} 57.0\n'
            'sglang:kv_available_tokens{model_name="target"} 1966080.0\n')
    m = client.parse_prometheus(text)
    assert client.metric(m, "sglang:spec_disable_plain_steps_total") == 57.0
    assert client.metric(m, "sglang:spec_disable_plain_mode") == 0.0
    assert client.metric(m, "sglang:spec_disable_speculative_steps_total") is None


def test_prompts_cover_below_at_above_and_ramp():
    exp = {"vocab_size": 3072, "prompt_ids": [1, 2, 3], "greedy_ids": [4] * 32}
    sets = runner.make_prompts(exp, 4)
    assert len(sets["below"]) == 4 and sets["below"][0].key == "hf"
    assert len(sets["at"]) == 4 and len(sets["above"]) == 32  # 1, 4 and 32 concurrent requests with N=4
    assert all(len(sets[f"ramp_burst{i}"]) == 16 for i in range(3))
    keys = [p.key for p in runner.unique_prompts(sets)]
    assert len(keys) == len(set(keys))
    assert runner.make_prompts(exp, 4) == sets  # deterministic


# ----------------------------------------------------------------------------- arguments
def test_argument_parsing(tmp_path):
    ap = build_parser()
    a = ap.parse_args(["run", "--models", "m", "--out", "o", "--threshold", "8", "--variants", "sync"])
    opts = runner.options(a)
    assert opts.threshold == 8 and opts.variants == ("sync",) and opts.cuda_graph
    with pytest.raises(SystemExit):
        runner.options(ap.parse_args(["run", "--models", "m", "--out", "o", "--variants", "bogus"]))
    with pytest.raises(SystemExit):
        runner.options(ap.parse_args(["run", "--models", "m", "--out", "o", "--threshold", "0"]))
    a = ap.parse_args(["models", str(tmp_path), "--size", "1b", "--draft", "chain",
                       "--draft-accept", "0.7", "--device", "cuda"])
    assert (a.size, a.draft, a.draft_accept, a.device) == ("1b", "chain", 0.7, "cuda")
    with pytest.raises(SystemExit):
        ap.parse_args(["models", str(tmp_path), "--size", "70b"])
    from smoke import bench

    b = bench.options(ap.parse_args(["bench", "--models", "m", "--out", "o", "--concurrency", "1,8,256"]))
    assert b.concurrency == (1, 8, 256) and b.configs == bench.CONFIGS
    with pytest.raises(SystemExit):
        bench.options(ap.parse_args(["bench", "--models", "m", "--out", "o", "--configs", "x"]))
    e = ap.parse_args(["e2e", "--bundle", ".gpu", "--phases", "smoke,bench", "--out", "o"])
    assert e.deadline == 560 and e.phases == "smoke,bench"
    from smoke import e2e

    with pytest.raises(SystemExit):
        e2e.main(ap.parse_args(["e2e", "--phases", "smoke,nope", "--out", str(tmp_path)]))


def test_bench_table_and_comparison():
    from smoke import bench

    def res(tps, outs, al=None):
        return {"tok_per_s": tps, "accept_length": al, "errors": 0, "first_error": None, "outputs": outs}

    reps = {"plain": {"results": {"256": res(20000.0, {"a": [1, 2]})}},
            "eagle3": {"results": {"256": res(10400.0, {"a": [1, 2]}, 2.9)}},
            "eagle3_thr": {"results": {"256": res(19600.0, {"a": [1, 3]})}}}
    t = bench.table(reps, (256,))
    assert "0.52x" in t and "0.98x" in t
    problems = bench.compare(reps)
    assert problems == ["eagle3_thr c=256: 1 output(s) differ from plain (e.g. a)"]


# ----------------------------------------------------------------------------- partial + nox side
def test_partial_manifest_comparison():
    want = [{"name": "a.patch", "sha256": "1" * 64}, {"name": "b.patch", "sha256": "2" * 64}]
    assert partial.compare_manifest([dict(w, files=["x"]) for w in want], want) is None
    assert "!=" in partial.compare_manifest(want[::-1], want)
    assert "sha256 differs for ['b.patch']" in partial.compare_manifest(
        [want[0], dict(want[1], sha256="3" * 64)], want)
    assert partial.help_shows_flag("  --speculative-disable-batch-threshold SPECULATIVE_DISABLE_...")


def test_nox_side_container_and_device_command(tmp_path):
    pytest.importorskip("docker")
    from sglang_image import gpu, smoke

    kw = smoke.container_kwargs(gpu=True, out_dir=tmp_path)
    req = kw["device_requests"][0]
    assert req["Count"] == -1 and req["Capabilities"] == [["gpu"]]
    assert kw["network_mode"] == "none"
    assert "device_requests" not in smoke.container_kwargs(gpu=False, out_dir=tmp_path)
    series = smoke.expected_series("sglang-0.5.17")
    names = [line.split("#")[0].strip() for line in
             (REPO / "patches" / "sglang-0.5.17" / "series").read_text().splitlines()]
    assert [s["name"] for s in series] == [n for n in names if n]
    assert "python3 -m smoke e2e --bundle .gpu" in gpu.host_command()
    lines, _ = gpu.bundle_requirements()
    assert any(line.startswith("sglang==0.5.17") for line in lines)
    assert any(line.startswith("sgl-deep-gemm==") for line in lines)


def test_partial_checks_on_the_real_patched_tree(sglang_tree, run_in_tree, tmp_path):
    """The no-GPU image check, run on the real sglang 0.5.17 wheel with the series applied."""
    from sglang_image import smoke

    tree = sglang_tree("sglang-0.5.17", True)
    expected = smoke.expected_series("sglang-0.5.17")
    manifest = tmp_path / "patches.json"
    manifest.write_text(json.dumps([dict(e, files=[]) for e in expected]))
    repo, series, man = str(REPO), json.dumps(expected), str(manifest)
    code = (f"import json, sys; from pathlib import Path; sys.path.append({repo!r})\n"
            "from smoke import partial\n"
            f"print(json.dumps(partial.run_checks(json.loads({series!r}), Path({man!r}))))")
    p = run_in_tree(tree, code, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    checks = {c["name"]: c for c in rep["checks"]}
    assert rep["partial"] is True and "needs one" in rep["note"]
    assert checks["import sglang.srt.server_args"]["ok"], checks["import sglang.srt.server_args"]
    assert checks["launch_server --help shows --speculative-disable-batch-threshold"]["ok"]
    assert checks[f"patch manifest {manifest} matches the series"]["ok"]
    # (a manifest from other patch files: test_partial_manifest_comparison)


def test_bench_reads_the_servers_full_load_decode_lines():
    from smoke import bench

    lines = [
        ("[2026-11-30 10:54:32] Decode batch, #running-req: 256, #token: 30353, token usage: 0.02, accept len: 0.00, "
         "accept rate: 0.00, cuda graph: True, gen throughput (token/s): 50479.88, #queue-req: 0"),
        ("[2026-11-30 10:54:33] Decode batch, #running-req: 240, #token: 40593, token usage: 0.03, "
         "cuda graph: False, gen throughput (token/s): 40000.00, #queue-req: 0"),
        ("[2026-11-30 10:54:33] Decode batch, #running-req: 98, #token: 28058, token usage: 0.02, "
         "cuda graph: True, gen throughput (token/s): 18156.17, #queue-req: 0"),
    ]
    log = "\n".join(lines)
    assert bench.server_decode_stats(log, 256) == {"lines": 2, "median_tok_per_s": 45239.9, "cuda_graph_lines": 1}
    assert bench.server_decode_stats(log, 512) is None


def test_profile_summary_of_a_real_torch_trace(tmp_path):
    """A real torch-profiler chrome trace (CPU, with Python stacks), summarised per step."""
    torch = pytest.importorskip("torch")
    from smoke import profile

    def step(x):
        return (x @ x).relu().sum()

    x = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(4):
            step(x)
    trace = tmp_path / "t.trace.json"
    prof.export_chrome_trace(str(trace))
    s = profile.summarize(trace, steps=4, top=500)  # pytest frames sit above step() in the stack
    assert s["steps"] == 4 and s["wall_ms_per_step"] > 0 and s["gpu_busy_ms_per_step"] == 0
    assert set(s["per_step"]) == {"kernel_launches", "graph_launches", "memcpy", "syncs"}
    assert any("step" in name for name, _ in s["top_python_ms_per_step"]), s["top_python_ms_per_step"]
    assert "ms/step wall" in profile.render("plain", s)


def test_abort_check_wants_exact_survivors_and_prefix_aborted():
    from smoke.client import Result

    refs = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [9, 9, 9, 9]}
    ok = [Result("a", [1, 2]), Result("b", [5, 6, 7, 8]), Result("c", None, error="HTTP 400 aborted")]
    assert runner.check_aborted(refs, ok, {"a", "c"}, "abort") == {"aborted_cut_short": 2, "aborted_sent": 2}
    with pytest.raises(runner.SmokeFailure, match="not a prefix"):
        runner.check_aborted(refs, [Result("a", [1, 3])], {"a"}, "abort")
    with pytest.raises(runner.SmokeFailure, match="output mismatch"):
        runner.check_aborted(refs, [Result("b", [5, 6])], {"a"}, "abort")  # b was not aborted
    with pytest.raises(runner.SmokeFailure, match="not aborted"):
        runner.check_aborted(refs, [Result("b", None, error="boom")], set(), "abort")
    sets = runner.make_prompts({"vocab_size": 3072, "prompt_ids": [1], "greedy_ids": [4]}, 4)
    assert len(sets["abort_plain"]) == 32 and len(sets["abort_spec"]) == 1


def test_profile_counts_steps_and_names_the_host_work_during_gpu_idle(tmp_path):
    """A synthetic trace: two batches, each a kernel launch then host work with the GPU idle."""
    from smoke import profile

    def x(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    events = []
    for k, t in enumerate((0, 1000)):
        events += [x("python_function", "sglang/srt/managers/scheduler.py(3527): run_batch", t, 900),
                   x("cuda_runtime", "cudaGraphLaunch", t + 10, 5),
                   x("kernel", "decode", t + 20, 300, tid=7),
                   x("python_function", "scheduler.py(3813): process_batch_result", t + 400, 500),
                   x("python_function", "eagle_utils.py(879): eagle_prepare_for_decode", t + 400, 450),
                   x("python_function", "threading.py(359): wait", t, 1000, tid=2)]  # another thread
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    s = profile.summarize(trace, steps=30)
    assert s["steps"] == 2 and s["steps_seen"] == 2 and s["steps_requested"] == 30
    assert s["gpu_busy_ms_per_step"] == 0.3 and s["gpu_idle_gaps_per_step"] == 0.5
    assert s["host_during_gpu_idle_ms_per_step"][0][0].endswith("eagle_prepare_for_decode")


def test_bench_workload_sizes_are_deterministic_and_seconds_long():
    from smoke import bench

    assert [len(bench.workload(3000, c, 256, 0)) for c in (1, 8, 256)] == [16, 128, 768]
    assert bench.workload(3000, 8, 256, 0) == bench.workload(3000, 8, 256, 0)  # same prompts for every config
    assert bench.workload(3000, 8, 256, 0) != bench.workload(3000, 8, 256, 1)  # the profile load differs


def test_bench_configs_map_to_server_flags(tmp_path):
    from smoke import bench

    opts = bench.BenchOptions(models=tmp_path, out=tmp_path, threshold=16, concurrency=(1, 256))
    argv = {name: bench.server_config(name, opts).argv(30000) for name in bench.CONFIGS}
    assert "--speculative-algorithm" not in argv["plain"]
    assert "--speculative-adaptive" in argv["eagle3_adaptive"] and "--speculative-adaptive" not in argv["eagle3"]
    ad = argv["eagle3_adaptive"]
    assert ad[ad.index("--speculative-adaptive-config") + 1] == str(tmp_path / "adaptive_config.json")
    # upstream's default tiers, without the 7-step one that crashed at start on the H200
    assert max(max(e["candidate_steps"]) for e in bench.ADAPTIVE_CONFIG.values()) == 3
    assert bench.ADAPTIVE_CONFIG["64"]["candidate_steps"] == [0]
    extra = bench.BenchOptions(models=tmp_path, out=tmp_path, server_args=("--gc-threshold", "50000"))
    for name in bench.CONFIGS:  # the same extra flags on every server, last
        assert bench.server_config(name, extra).argv(30000)[-2:] == ["--gc-threshold", "50000"]
    a = build_parser().parse_args(["bench", "--models", "m", "--out", "o", "--server-args", "--gc-threshold 7 8"])
    assert bench.options(a).server_args == ("--gc-threshold", "7", "8")
    thr = argv["eagle3_thr"]
    assert thr[thr.index("--speculative-disable-batch-threshold") + 1] == "16"
    assert "--speculative-adaptive" not in thr  # the patch refuses the two together


def test_pyspy_summary_of_a_real_scheduler_sample():
    """py-spy's raw output from the H200 run (threshold server in plain mode at 256 requests, the 80
    heaviest stacks): only the scheduler thread counts, shares are of its samples, ms from step time."""
    from smoke import bench, pyspy

    raw = (REPO / "tests/data/pyspy_scheduler_plain_mode.txt").read_text()
    s = bench.summarize_pyspy({"raw": raw}, 256_000 / 4.0, 256)
    assert s["step_ms"] == pytest.approx(4.0)
    incl = {f: pct for f, pct, _ in s["inclusive_pct"]}
    assert incl["Scheduler.event_loop_overlap (scheduler.py)"] == 100.0
    assert 10 < incl["EAGLEWorkerV2._forward_plain_decode (eagle_worker_v2.py)"] < 100
    assert not any("watchdog" in f or "Timer.check" in f for f in incl)  # other threads left out
    assert all(row[2] == pytest.approx(row[1] * 4.0 / 100, abs=1e-3) for row in s["inclusive_pct"])
    assert sum(pct for _, pct, _ in s["self_pct"]) <= 100.0
    text = pyspy.render("eagle3_thr", s)
    assert text.startswith("py-spy eagle3_thr:") and "ms/step (server log)" in text
    assert bench.summarize_pyspy({"error": "no py-spy binary"}, None, 256) == {"error": "no py-spy binary"}
    assert pyspy.summarize("thread (1): MainThread;other (x.py:1) 5\n")["error"].startswith("no sample")
    # the sample's three idle stacks (Scheduler.on_idle: no batch) are counted apart, not in the shares
    assert s["idle_samples"] == 28 + 7 + 6 and not any("on_idle" in f or "Poller.poll" in f for f in incl)
    assert "41 idle ones, with no batch, left out" in text
    idle_only = "thread (1): MainThread;Scheduler.event_loop_overlap (a/scheduler.py:1);Scheduler.on_idle (a/scheduler.py:2) 9\n"
    assert "all 9 samples of the scheduler loop are idle" in pyspy.summarize(idle_only)["error"]


def test_pyspy_finds_the_scheduler_process_and_samples_it(tmp_path):
    """A real process titled like sglang's scheduler, below a parent, sampled by the real py-spy."""
    import subprocess
    import textwrap
    import time

    from smoke import pyspy

    exe = pyspy.binary((Path(sys.executable).parent,))
    assert exe is not None, "py-spy is a test dependency (pyproject: test)"
    loop = textwrap.dedent("""
        import time
        def busy():
            s = 0
            for i in range(200000):   # ~10 ms: most of each iteration, even on a loaded machine
                s += i
        def event_loop_overlap():
            end = time.time() + 20
            while time.time() < end:
                busy()
                time.sleep(0.001)
        event_loop_overlap()
    """)
    # like a server: a parent whose child renamed itself (sglang uses setproctitle)
    parent = subprocess.Popen(["bash", "-c", f"exec -a sglang::scheduler_TP0 {sys.executable} -c '{loop}' & wait"])
    try:
        pid = None
        for _ in range(50):
            pid = pyspy.scheduler_pid(parent.pid)
            if pid:
                break
            time.sleep(0.1)
        assert pid is not None and pid != parent.pid
        raw = pyspy.record(exe, pid, 1, tmp_path / "raw.txt", rate=200).read_text()
        s = pyspy.summarize(raw, step_ms=2.0)
        incl = {f: pct for f, pct, _ in s["inclusive_pct"]}
        assert incl["event_loop_overlap (<string>)"] == 100.0
        assert incl["busy (<string>)"] > 20   # the busy loop, not only the sleep (--idle keeps both)
    finally:
        for p in pyspy.descendants(parent.pid):
            subprocess.run(["kill", "-9", str(p)], check=False)
        parent.kill()
        parent.wait()


def test_bench_ab_ratios_table_and_mismatches():
    from smoke import bench

    rounds = [{"plain": {"tok_per_s": 100.0, "server_tok_per_s": 200.0},
               "eagle3_thr": {"tok_per_s": 90.0, "server_tok_per_s": 150.0}},
              {"plain": {"tok_per_s": 50.0, "server_tok_per_s": None},
               "eagle3_thr": {"tok_per_s": 49.0, "server_tok_per_s": 120.0}}]
    assert bench.ab_ratios(rounds, "eagle3_thr", "tok_per_s") == [0.9, 0.98]
    assert bench.ab_ratios(rounds, "eagle3_thr", "server_tok_per_s") == [0.75]  # round 2: no plain line
    t = bench.ab_table({"concurrency": [8, 256], "configs": ["plain", "eagle3_thr"],
                        "rounds": {"8": rounds[:1], "256": rounds}})
    assert "c=256 eagle3_thr / plain (client): median 0.940x, min 0.900x, max 0.980x over 2 round(s)" in t
    assert "c=256 eagle3_thr / plain (server log): median 0.750x" in t
    assert "c=8 eagle3_thr / plain (client): median 0.900x" in t
    outs = [{"plain": {"a": [1], "b": [2]}, "eagle3_thr": {"a": [1], "b": [3]}},
            {"plain": {"a": [1]}, "eagle3_thr": {"a": [1]}}]
    assert bench.ab_mismatches(outs) == ["round 1 eagle3_thr: 1 output(s) differ from plain (e.g. b)"]


def test_bench_ab_ratio_by_order_and_order_balanced_goal():
    """Run 35's client numbers (plain, eagle3_thr first in rounds 1 and 3, eagle3_thr first in round 2):
    the ratio per order, their geometric mean, and the goal read from it (an odd number of rounds weighs
    one order twice in the plain median); one order alone falls back to the median."""
    from smoke import bench

    names = ["plain", "eagle3_thr"]
    rounds = [{"plain": {"tok_per_s": 57213.0}, "eagle3_thr": {"tok_per_s": 39936.0}},
              {"eagle3_thr": {"tok_per_s": 52694.0}, "plain": {"tok_per_s": 56840.0}},
              {"plain": {"tok_per_s": 50128.0}, "eagle3_thr": {"tok_per_s": 39070.0}}]
    first, second = bench.ab_ratios_by_order(rounds, names, "eagle3_thr", "tok_per_s")
    assert [round(x, 3) for x in first] == [0.927] and [round(x, 3) for x in second] == [0.698, 0.779]
    balanced = bench.order_balanced_ratio(rounds, names, "eagle3_thr", "tok_per_s")
    assert round(balanced, 3) == round((0.9270583 * (0.6980232 + 0.7794047) / 2) ** 0.5, 3) == 0.828
    assert bench.order_balanced_ratio(rounds[:1], names, "eagle3_thr", "tok_per_s") is None
    t = bench.ab_table({"concurrency": [256], "configs": names, "rounds": {"256": rounds}})
    assert "c=256 eagle3_thr / plain (client): median 0.779x" in t
    assert "by order: eagle3_thr first 0.927x (1), plain first 0.739x (2); order-balanced 0.828x" in t


def test_bench_ab_round_order_and_primer_windows(tmp_path):
    """A round measures each server in turn, the order reversed every other round; with --ab-primer an
    unmeasured window of the same load on the same server comes right before each measured one, its
    numbers kept apart and shown as their own ratio."""
    from smoke import bench

    calls = []
    def fake_measure(srv, prompts, c, opts):
        calls.append(srv)
        return {"tok_per_s": 100.0 * len(calls), "server_tok_per_s": 10.0 * len(calls), "outputs": {}}

    servers = {"plain": "P", "eagle3_thr": "T"}
    names = ["plain", "eagle3_thr"]
    opts = bench.BenchOptions(models=tmp_path, out=tmp_path, ab_rounds=2)
    row = bench.measure_round(servers, names, 1, [], 256, opts, measure=fake_measure)
    assert calls == ["T", "P"] and row["eagle3_thr"]["tok_per_s"] == 100.0 and "primer_tok_per_s" not in row["plain"]
    calls.clear()
    opts = bench.BenchOptions(models=tmp_path, out=tmp_path, ab_rounds=2, ab_primer=True)
    rounds = [bench.measure_round(servers, names, k, [], 256, opts, measure=fake_measure) for k in (0, 1)]
    assert calls == ["P", "P", "T", "T", "T", "T", "P", "P"]   # primer, then measured, per server
    assert rounds[0]["plain"]["primer_tok_per_s"] == 100.0 and rounds[0]["plain"]["tok_per_s"] == 200.0
    assert rounds[1]["eagle3_thr"]["primer_server_tok_per_s"] == 50.0
    for r in rounds:
        for v in r.values():
            v.pop("outputs")
    t = bench.ab_table({"concurrency": [256], "configs": names, "rounds": {"256": rounds}})
    # primers: round 0 300/100, round 1 500/700
    assert "primer windows (each right after the other server's load): median 1.857x over 2 round(s)" in t
    assert bench_options("--ab-rounds", "2", "--ab-primer").ab_primer is True
    with pytest.raises(SystemExit, match="ab-primer"):
        bench_options("--ab-primer")


def test_bench_splits_each_window_by_gpu_category_and_counts_prefills(tmp_path):
    """The device timer's counters (Prometheus text as sglang exports it) become GPU seconds per
    category per window; the server log's prefill lines are counted; the A/B table shows both."""
    from smoke import bench, client

    opts = bench.BenchOptions(models=tmp_path, out=tmp_path, device_timer=True)
    assert all(bench.server_config(n, opts).env == {"SGLANG_ENABLE_METRICS_DEVICE_TIMER": "1"} for n in bench.CONFIGS)
    assert bench.server_config("plain", bench.BenchOptions(models=tmp_path, out=tmp_path)).env == {}

    def scrape(decode: float, extend: float) -> dict[str, float]:
        return client.parse_prometheus(
            "# TYPE sglang:forward_execution_seconds_total counter\n"
            f'sglang:forward_execution_seconds_total{{model_name="t",category="decode"}} {decode}\n'
            f'sglang:forward_execution_seconds_total{{model_name="t",category="extend"}} {extend}\n'
            'sglang:num_running_reqs{model_name="t"} 3.0\n')
    assert bench.gpu_seconds(scrape(1.0, 2.0), scrape(8.5, 2.25)) == {"decode": 7.5, "extend": 0.25}
    assert bench.gpu_seconds({}, {}) == {}  # timer off: no such counter
    lines = [
        ("[2026-11-30 10:54:31] Prefill batch, #new-seq: 40, #new-token: 1920, #cached-token: 0, token usage: 0.00, "
         "#running-req: 0, #queue-req: 216, #pending-token: 0, cuda graph: False, input throughput (token/s): 0.00"),
        ("[2026-11-30 10:54:31] Prefill batch, #new-seq: 216, #new-token: 10368, #cached-token: 0, token usage: 0.01, "
         "#running-req: 40, #queue-req: 0, #pending-token: 0, cuda graph: False, input throughput (token/s): 9.00"),
        ("[2026-11-30 10:54:32] Decode batch, #running-req: 256, #token: 30353, cuda graph: True, "
         "gen throughput (token/s): 50479.88, #queue-req: 0"),
    ]
    log = "\n".join(lines)
    assert bench.prefill_stats(log) == {"batches": 2, "seqs": 256, "tokens": 12288}
    rounds = [{"plain": {"tok_per_s": 100.0, "seconds": 10.0, "gpu_s": {"decode": 8.0, "extend": 1.0},
                         "prefill": {"batches": 6}},
               "eagle3_thr": {"tok_per_s": 90.0, "seconds": 11.0, "prefill": {"batches": 7},
                              "gpu_s": {"decode": 8.2, "extend": 1.2, "draft_kv_only": 0.1}}}]
    t = bench.ab_table({"concurrency": [256], "configs": ["plain", "eagle3_thr"], "rounds": {"256": rounds}})
    assert "plain        wall 10.000s, decode 8.000s, extend 1.000s, rest 1.000s, prefill batches 6" in t
    assert ("eagle3_thr   wall 11.000s, decode 8.200s, draft_kv_only 0.100s, extend 1.200s, rest 1.500s, "
            "prefill batches 7") in t
    a = build_parser().parse_args(["bench", "--models", "m", "--out", "o", "--device-timer"])
    assert bench.options(a).device_timer and not bench.options(build_parser().parse_args(
        ["bench", "--models", "m", "--out", "o"])).device_timer


def test_bench_windows_record_the_hosts_cpu_steal(tmp_path):
    """Each A/B window records the host's CPU steal and load from /proc/stat (the H200 machine is a
    KVM guest); the table shows their medians per server. Unreadable input gives no numbers."""
    from smoke import bench

    before = bench.host_cpu_times("cpu  1000 0 200 5000 10 0 0 40 0 0\ncpu0 1 2 3\n")
    after = bench.host_cpu_times("cpu  1600 0 300 5200 10 0 0 140 0 0\n")
    assert before["steal"] == 40 and after["user"] == 1600
    assert bench.host_cpu_share(before, after) == {"steal_pct": 10.0, "busy_pct": 70.0}
    assert bench.host_cpu_share({}, after) == {} and bench.host_cpu_times("garbage") == {}
    assert set(bench.host_cpu_times()) == set(bench.PROC_STAT_FIELDS)   # this machine's /proc/stat
    rounds = [{"plain": {"tok_per_s": 100.0, "seconds": 10.0, "host": {"steal_pct": 0.5, "busy_pct": 40.0}},
               "eagle3_thr": {"tok_per_s": 90.0, "seconds": 11.0, "host": {"steal_pct": 3.0, "busy_pct": 45.0}}},
              {"plain": {"tok_per_s": 100.0, "seconds": 10.0, "host": {"steal_pct": 1.5, "busy_pct": 42.0}},
               "eagle3_thr": {"tok_per_s": 90.0, "seconds": 11.0, "host": {}}}]
    t = bench.ab_table({"concurrency": [256], "configs": ["plain", "eagle3_thr"], "rounds": {"256": rounds}})
    assert "plain        wall 10.000s, host CPU steal 1.00% (max 1.50%), busy 41%" in t
    assert "eagle3_thr   wall 11.000s, host CPU steal 3.00% (max 3.00%), busy 45%" in t


def test_bench_ab_fast_windows_compare_like_with_like():
    """Run 38's server-log rates (measured and primer windows): plain ran slow in 5 of its 8 windows,
    the threshold server in 2; the windows at >= 0.9x each server's best give 0.971x."""
    from smoke import bench

    names = ["plain", "eagle3_thr"]
    def w(rate, primer):
        return {"tok_per_s": 1.0, "server_tok_per_s": rate, "primer_server_tok_per_s": primer}
    rounds = [{"plain": w(63197.2, 70065.6), "eagle3_thr": w(101730.6, 98606.9)},
              {"eagle3_thr": w(98038.3, 96803.3), "plain": w(104916.3, 74513.7)},
              {"plain": w(101219.4, 97180.9), "eagle3_thr": w(76370.4, 98669.9)},
              {"eagle3_thr": w(93449.5, 61079.7), "plain": w(68388.1, 70478.4)}]
    assert sorted(bench.fast_windows(rounds, "plain")) == [97180.9, 101219.4, 104916.3]
    assert len(bench.fast_windows(rounds, "eagle3_thr")) == 6
    t = bench.ab_table({"concurrency": [256], "configs": names, "rounds": {"256": rounds}})
    assert ("fast windows (server log >= 0.9x the server's best, primers pooled): eagle3_thr 98323 (6) / "
            "plain 101219 (3) = 0.971x") in t
    assert bench.fast_windows([{"plain": {"server_tok_per_s": None}}], "plain") == []
    for r in rounds:  # the client rates of run 38
        r["plain"]["tok_per_s"], r["eagle3_thr"]["tok_per_s"] = {
            63197.2: (48290.0, 59586.4), 104916.3: (63487.7, 59870.2), 101219.4: (56495.0, 54252.6),
            68388.1: (48450.2, 54260.3)}[r["plain"]["server_tok_per_s"]]
    assert bench.goal_figures(rounds, names) == {
        "thr_vs_plain_at_max_median": 1.04, "thr_vs_plain_at_max": 1.064,
        "thr_vs_plain_at_max_basis": "order-balanced", "goal_0.97_met": True, "thr_vs_plain_fast_windows": 0.971}
    assert bench.goal_figures([], names) == {}


def test_bench_ab_cpu_sets_split_the_cpus_between_servers_and_client(tmp_path):
    """--ab-pin-cpus: disjoint CPU sets, equal for the servers, the rest for the load generator; too few
    CPUs fail naming the flag; the table says which; the flag needs A/B mode."""
    from smoke import bench
    from smoke.runner import SmokeFailure

    sets = bench.cpu_sets(list(range(16)), ["plain", "eagle3_thr"])
    assert sets == {"plain": [0, 1, 2, 3, 4], "eagle3_thr": [5, 6, 7, 8, 9], "client": list(range(10, 16))}
    assert bench.cpu_sets([8, 2, 4, 6, 0, 10], ["plain"]) == {"plain": [0, 2, 4], "client": [6, 8, 10]}
    with pytest.raises(SmokeFailure, match="ab-pin-cpus"):
        bench.cpu_sets([0, 1, 2, 3, 4], ["plain", "eagle3_thr"])
    assert bench.cpu_list([5, 6, 7]) == "5-7" and bench.cpu_list([0, 2, 4]) == "0,2,4"
    t = bench.ab_table({"concurrency": [256], "configs": ["plain", "eagle3_thr"], "rounds": {"256": []},
                        "cpu_sets": sets})
    assert "CPU sets: plain 0-4, eagle3_thr 5-9, client 10-15" in t
    assert bench_options("--ab-rounds", "2", "--ab-pin-cpus").ab_pin_cpus is True
    with pytest.raises(SystemExit, match="ab-pin-cpus"):
        bench_options("--ab-pin-cpus")


def test_bench_ab_flags_unequal_kv_pools_and_can_equalise_them(tmp_path):
    """A/B servers size their pools from the memory free at their start: run 23's 8B pools (plain
    348253, threshold 147880 tokens) against a round of ~233k tokens is flagged; equal pools, or a
    round that fits the smaller one, are not. --max-total-tokens reaches every server, and the A/B
    restarts the servers with larger pools at the smallest size."""
    from smoke import bench

    caveat = bench.pool_caveat({"plain": 348253, "eagle3_thr": 147880}, 233000)
    assert caveat is not None and "eagle3_thr 147880" in caveat and "--max-total-tokens" in caveat
    assert bench.pool_caveat({"plain": 348253, "eagle3_thr": 147880}, 120000) is None  # fits both
    assert bench.pool_caveat({"plain": 150000, "eagle3_thr": 147880}, 233000) is None  # equal: both evict
    assert bench.pool_caveat({"plain": 348253, "eagle3_thr": 0}, 233000) is None       # size unknown
    assert bench.pool_caveat({"plain": 348253}, 233000) is None
    opts = bench.BenchOptions(models=tmp_path, out=tmp_path, max_total_tokens=140000)
    for name in bench.CONFIGS:
        argv = bench.server_config(name, opts).argv(30000)
        assert argv[argv.index("--max-total-tokens") + 1] == "140000"
    assert "--max-total-tokens" not in bench.server_config("plain", bench.BenchOptions(tmp_path, tmp_path)).argv(1)
    t = bench.ab_table({"concurrency": [256], "configs": ["plain", "eagle3_thr"], "rounds": {},
                        "kv_pool_tokens": {"plain": 348253, "eagle3_thr": 147880}, "round_tokens": 233000,
                        "pool_caveat": caveat})
    assert "KV pool (tokens): plain 348253, eagle3_thr 147880; a round writes ~233000" in t
    assert "CAVEAT: unequal KV pools" in t
    # the A/B restarts the servers with the larger pools at the smallest size (each held more before)
    restarted = []
    def restart(name, cap):
        restarted.append((name, cap))
        return cap
    pools = {"plain": 348253, "eagle3": 150000, "eagle3_thr": 147880}
    assert bench.equalise_kv_pools(pools, 233000, restart) == 147880
    assert restarted == [("plain", 147880)] and pools["plain"] == 147880  # 150000 is within 10%
    assert bench.pool_caveat(pools, 233000) is None
    restarted.clear()
    assert bench.equalise_kv_pools({"plain": 348253, "eagle3_thr": 147880}, 120000, restart) is None
    assert restarted == []  # a round fits both: nothing to equalise
    t = bench.ab_table({"concurrency": [256], "configs": ["plain", "eagle3_thr"], "rounds": {},
                        "kv_pools_equalised_to": 147880})
    assert "KV pools equalised: servers with a larger pool restarted with --max-total-tokens 147880" in t
    t = bench.ab_table({"concurrency": [256], "configs": ["plain", "eagle3_thr"], "rounds": {},
                        "kv_pools_not_equalised": "deadline: 259s left, ~270s needed to restart the larger-pool servers"})
    assert "KV pools not equalised: deadline: 259s left" in t
    assert bench_options("--max-total-tokens", "9").max_total_tokens == 9
    with pytest.raises(SystemExit, match="max-total-tokens"):
        bench_options("--max-total-tokens", "-1")


def test_bench_ab_options_need_plain_and_another_config():
    o = bench_options("--ab-rounds", "3", "--configs", "plain,eagle3_thr")
    assert o.ab_rounds == 3 and o.mem_fraction == 0.3
    for bad in (["--ab-rounds", "3", "--configs", "eagle3,eagle3_thr"], ["--ab-rounds", "3", "--configs", "plain"],
                ["--ab-rounds", "-1"], ["--mem-fraction", "1.5"], ["--pyspy-admission-seconds", "2"],
                ["--ab-rounds", "3", "--pyspy-admission-seconds", "-1"]):
        with pytest.raises(SystemExit, match="ab-rounds|mem-fraction|pyspy-admission-seconds"):
            bench_options(*bad)
    o = bench_options("--ab-rounds", "2", "--pyspy-admission-seconds", "1.5")
    assert o.pyspy_admission_seconds == 1.5 and o.pyspy_seconds == 0


def test_bench_ab_does_not_start_servers_it_has_no_time_to_measure(tmp_path):
    from smoke import bench
    from smoke.runner import Deadline

    (tmp_path / "expected.json").write_text(json.dumps({"vocab_size": 3000}))
    opts = bench.BenchOptions(models=tmp_path, out=tmp_path, configs=("plain", "eagle3_thr"), concurrency=(256,),
                              ab_rounds=3, deadline=Deadline(time.time() + 200))
    out = bench.run_bench(opts, {})
    assert out["failures"] == [] and len(out["skipped"]) == 1
    assert out["skipped"][0].startswith("A/B (deadline: ") and "s left, ~270s needed" in out["skipped"][0]
    assert not list(tmp_path.glob("server_ab_*.log"))  # no server was started


def test_server_stop_leaves_no_running_member_of_its_group(tmp_path):
    """A real process group like a server's: an HTTP leader and a child in the scheduler's place.
    group_running sees the group while the child runs and not once only a zombie is left (this
    container's init does not reap at once); stop() returns with no running member left, since a
    server started next sizes its KV pool from the GPU memory the old children still hold."""
    import os
    import subprocess
    import textwrap

    from smoke import server as server_mod

    group = subprocess.Popen(["bash", "-c", "sleep 1 & wait"], start_new_session=True)
    time.sleep(0.3)
    assert server_mod.group_running(group.pid)
    group.wait()
    time.sleep(0.2)
    assert not server_mod.group_running(group.pid)
    assert server_mod.group_running(os.getpgid(0))  # this test's own group runs

    child_pid_file = tmp_path / "child.pid"
    leader = textwrap.dedent(f"""
        import http.server, subprocess, sys
        child = subprocess.Popen(["bash", "-c", "trap '' TERM; while :; do sleep 0.1; done"])
        open({str(child_pid_file)!r}, "w").write(str(child.pid))
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers()
            def log_message(self, *a):
                pass
        http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """)

    class FakeConfig(server_mod.ServerConfig):
        def argv(self, port: int) -> list[str]:
            return [sys.executable, "-c", leader, str(port)]

    port = 30000 + os.getpid() % 2000
    ours = os.sched_getaffinity(0)
    cpu = min(ours)
    srv = server_mod.Server(FakeConfig("fake", tmp_path, cpus=(cpu,)), port, tmp_path / "server.log")
    srv.start(30)
    assert srv.proc is not None
    pgid = srv.proc.pid
    child = int(child_pid_file.read_text())
    assert os.getpgid(child) == pgid  # the child ignores SIGTERM: only the group's SIGKILL ends it
    # cpus: the server and what it starts run on those CPUs; the caller keeps its own
    assert os.sched_getaffinity(pgid) == os.sched_getaffinity(child) == {cpu}
    assert os.sched_getaffinity(0) == ours
    srv.stop()
    assert not server_mod.group_running(pgid)
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    assert server_mod.port_free(port)


def test_e2e_reruns_a_phase_whose_options_or_site_changed(tmp_path, monkeypatch):
    """A later call on a warm machine must not report an earlier call's result as its own: a run
    phase's done flag and resume state are keyed by its options, and a site installed from another
    bundle or series is refused unless the call installs again (a GPU run of 2026-11-30 got "bench:
    done in an earlier call" for a bench with another --max-total-tokens)."""
    from smoke import e2e

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "wheels.tar.xz").write_bytes(b"wheels")
    ap = build_parser()

    def driver(*extra: str) -> e2e.E2E:
        return e2e.E2E(ap.parse_args(["e2e", "--bundle", str(bundle), "--state", str(tmp_path / "state"),
                                      "--out", str(tmp_path / "out"), *extra]))

    first = driver("--phases", "bench,smoke", "--bench-size", "8b", "--bench-ab-rounds", "3")
    assert first.bench_key.startswith("8b-ab-")
    again = driver("--phases", "bench", "--bench-size", "8b", "--bench-ab-rounds", "3")
    other = driver("--phases", "bench", "--bench-size", "8b", "--bench-ab-rounds", "3",
                   "--bench-max-total-tokens", "147000")
    assert again.bench_key == first.bench_key and other.bench_key != first.bench_key
    first.state["install"] = first.install_key()
    first.resumable("smoke")["eagle_overlap"] = {"done": True}
    assert first.resumable("smoke") == {"eagle_overlap": {"done": True}}
    first.save()
    assert driver("--phases", "smoke").resumable("smoke") == {"eagle_overlap": {"done": True}}
    assert driver("--phases", "smoke", "--smoke-variants", "sync").resumable("smoke") == {}
    # the site: this tree's bundle and series pass; another series (flavor) needs install again
    assert driver("--phases", "bench").stale_site() is None
    stale = driver("--phases", "bench", "--flavor", "sglang-0.5.9").stale_site()
    assert stale is not None and "add install,patch,check to --phases" in stale
    assert driver("--phases", "install,bench", "--flavor", "sglang-0.5.9").stale_site() is None
    assert driver("--phases", "models", "--flavor", "sglang-0.5.9").stale_site() is None  # no run phase

    # the whole driver on a bench already done: skipped as done; a broken bundle fails at install by
    # name (before, any non-run phase crashed the driver with KeyError while it computed its done key)
    import os
    monkeypatch.setattr(os, "environ", dict(os.environ))  # run() exports the servers' environment
    done = driver("--phases", "bench", "--bench-size", "8b", "--bench-ab-rounds", "3")
    done.state.pop("install")
    done.state[f"bench_done_{done.bench_key}"] = True
    done.save()
    assert driver("--phases", "bench", "--bench-size", "8b", "--bench-ab-rounds", "3").run() == 0
    assert "bench: done in an earlier call" in (tmp_path / "out" / "e2e.log").read_text()
    broken = driver("--phases", "install,bench", "--bench-size", "8b", "--bench-ab-rounds", "3")
    assert broken.run() == 1 and broken.failures[0].startswith("install: ")


def test_jit_cache_travels_between_fresh_gpu_machines(tmp_path, monkeypatch):
    """The kernels a call compiled come back as OUT/jit-cache.tar.xz and, put into the bundle folder,
    are unpacked by the next call's install: only for the same wheels and kernel patches, never over
    files already there, and not at all when over the size that may come back."""
    from smoke import e2e, jitcache

    jit = tmp_path / "jit"
    (jit / "triton" / "ab12").mkdir(parents=True)
    (jit / "triton" / "ab12" / "kernel.cubin").write_bytes(b"\x7fELF" + bytes(range(256)) * 64)
    (jit / "flashinfer" / "comm.so").parent.mkdir(parents=True)
    (jit / "flashinfer" / "comm.so").write_bytes(b"so" * 1000)
    archive = tmp_path / "bundle" / jitcache.ARCHIVE
    archive.parent.mkdir()
    size, why = jitcache.pack(jit, archive, "key-1")
    assert size > 0 and why == "" and archive.stat().st_size == size
    fresh = tmp_path / "fresh-jit"
    assert jitcache.seed(archive, fresh, "key-1") == (2, "")
    assert (fresh / "triton" / "ab12" / "kernel.cubin").read_bytes() == (jit / "triton" / "ab12" / "kernel.cubin").read_bytes()
    assert jitcache.fingerprint(fresh) == jitcache.fingerprint(jit)
    (fresh / "flashinfer" / "comm.so").write_bytes(b"rebuilt here")
    assert jitcache.seed(archive, fresh, "key-1") == (0, "")  # nothing overwritten
    assert (fresh / "flashinfer" / "comm.so").read_bytes() == b"rebuilt here"
    added, why = jitcache.seed(archive, tmp_path / "other", "key-2")
    assert added == 0 and "other wheels or kernel patches" in why and not (tmp_path / "other").exists()
    assert jitcache.pack(jit, tmp_path / "big.tar.xz", "key-1", max_bytes=10)[1].startswith("0.0 MiB compressed, over")
    assert not (tmp_path / "big.tar.xz").exists()
    assert "nothing under" in jitcache.pack(tmp_path / "none", tmp_path / "x.tar.xz", "k")[1]
    (tmp_path / "bad.tar.xz").write_bytes(b"not xz")
    assert "unreadable" in jitcache.seed(tmp_path / "bad.tar.xz", fresh, "key-1")[1]
    # the key follows the wheels and the patches outside sglang/ (FlashInfer's), not sglang's Python
    # (the manifest `sglang_image.patch apply` writes: name, sha256, files, here of the real series)
    from sglang_image.patch import parse_patch

    def applied(name: str, text: str) -> dict:
        return {"name": name, "sha256": hashlib.sha256(text.encode()).hexdigest(),
                "files": [fp.path for fp in parse_patch(text, name)]}
    series = REPO / "patches" / "sglang-0.5.17"
    manifest = [applied(n, (series / n).read_text())
                for n in ("sm120-flashinfer-trtllm-comm.patch", "dynamic-speculation-disable.patch")]
    wheels = hashlib.sha256(b"wheels").hexdigest()
    key = jitcache.kernel_key(wheels, manifest)
    manifest[1] = applied("dynamic-speculation-disable.patch", "--- a/sglang/srt/x.py\n+++ b/sglang/srt/x.py\n@@ -1 +1 @@\n-a\n+changed\n")
    assert jitcache.kernel_key(wheels, manifest) == key
    manifest[0] = applied("sm120-flashinfer-trtllm-comm.patch", "--- a/flashinfer/jit/comm.py\n+++ b/flashinfer/jit/comm.py\n@@ -1 +1 @@\n-a\n+changed\n")
    assert jitcache.kernel_key(wheels, manifest) != key
    # the driver packs what a call compiled, once, into OUT
    monkeypatch.setattr(e2e.E2E, "kernel_key", lambda self: "key-1")
    drv = e2e.E2E(build_parser().parse_args(["e2e", "--bundle", str(tmp_path / "bundle"), "--state",
                                             str(tmp_path / "state"), "--out", str(tmp_path / "out")]))
    drv.state["install"] = "site"
    drv.state["jit_fingerprint"] = jitcache.fingerprint(drv.state_dir / "jit")  # what install unpacked
    shutil.copytree(jit, drv.state_dir / "jit")                                 # compiled in this call
    drv.bring_back_jit_cache()
    brought = tmp_path / "out" / jitcache.ARCHIVE
    assert jitcache.seed(brought, tmp_path / "next-machine", "key-1") == (2, "")
    brought.unlink()
    drv.bring_back_jit_cache()
    assert not brought.exists()  # nothing new compiled since
