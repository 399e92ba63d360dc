"""The smoke run (smoke.runner, smoke.variant_runs, smoke.run_command): its failure reports,
prompts, variants and argument parsing; the model generator, the partial smoke and the host side
(CPU, no server; the checks themselves: tests/smoke/test_checks.py).

The failure paths run on real text and real outputs: a server log in sglang 0.5.17's format, the
greedy continuation of a model generated here. Nothing pretends to be an sglang server.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.__main__ import build_parser as bench_parser
from smoke import checks, client, models, partial, run_command, runner, scenario, variant_runs
from smoke.__main__ import build_parser
from smoke.deadline import Deadline
from tests.ports import free_port
from tests.smoke.draft_emulation import emulate_draft
from tests.smoke.server_fakes import VariantRecorder, port_recording_server
from tests.smoke.server_log import PATCH_LINE, SERVER_LOG


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
    # the logprobs check's logit scale: the largest top logit along that continuation
    with torch.no_grad():
        logits = model(torch.tensor([exp["prompt_ids"] + exp["greedy_ids"][:-1]])).logits[0]
    tops = logits[len(exp["prompt_ids"]) - 1:].max(-1).values
    assert exp["max_top_logit"] == pytest.approx(float(tops.max()), abs=1e-3)


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
    emu = emulate_draft(tiny_models[draft], rounds=5)
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


# ----------------------------------------------------------------------------- failure paths
def test_missing_log_line_fails_with_cause_and_log_tail(tmp_path):
    log = tmp_path / "server_eagle_overlap.log"
    log.write_text(SERVER_LOG)
    rep: dict = {"name": "eagle_overlap", "phases": {}}
    with pytest.raises(runner.SmokeError) as ei:
        checks.check_start_log(log.read_text(), 4)
    assert "Dynamic speculation disable enabled: threshold=4" in ei.value.cause
    variant_runs.record_failure(rep, ei.value, log)
    report = runner.collect_failures({"threshold": 4, "variants": {"eagle_overlap": rep},
                                      "failures": []})
    text = runner.summarize(report)
    assert "SMOKE FAILED [eagle_overlap]: start log line missing" in text
    assert "The server is fired up and ready to roll!" in text  # the log's tail is shown
    assert runner.exit_code(report) == 1
    assert "tail of" in ei.value.render() and "Uvicorn running" in ei.value.render()


def test_an_auto_report_is_summarized():
    # the shape an auto server's smoke reported on a GPU: its phases count no mode steps
    phase = {"requests": 4, "accept_length": 2.0, "verify_ct": 104, "completion_tokens": 208}
    rep = {"name": "eagle_overlap", "ok": True, "start_s": 101.0, "overlap": True, "cuda_graph": True,
           "threshold": "auto", "phases": {"below": phase, "above": {**phase, "requests": 32}},
           "spec_disable_final": {"threshold": "auto", "crossover": 64, "mode": "speculative"},
           "kv_baseline": {"num_used_tokens": 0}, "kv_final": {"num_used_tokens": 0}}
    text = runner.summarize({"threshold": "auto", "variants": {"eagle_overlap": rep}, "failures": []})
    assert "eagle_overlap  PASS" in text and "above  reqs  32  accept_len 2.00" in text
    assert "'crossover': 64" in text and "d_spec" not in text


def test_output_mismatch_fails_with_cause_and_log_tail(tiny_models, tmp_path):
    exp = json.loads((tiny_models["first"] / "expected.json").read_text())
    ref = {"hf": exp["greedy_ids"]}
    same = client.Result("hf", list(exp["greedy_ids"]))
    checks.check_outputs(ref, [same], "below")
    checks.check_hf_reference(exp, same.output_ids)
    wrong = list(exp["greedy_ids"])
    wrong[7] = (wrong[7] + 1) % exp["vocab_size"]
    log = tmp_path / "server_eagle_sync.log"
    log.write_text(SERVER_LOG + PATCH_LINE)
    rep: dict = {"name": "eagle_sync", "phases": {}}
    with pytest.raises(runner.SmokeError) as ei:
        checks.check_outputs(ref, [client.Result("hf", wrong)], "above")
    assert "above: output mismatch" in ei.value.cause and "first difference at token 7" in ei.value.cause
    variant_runs.record_failure(rep, ei.value, log)
    report = runner.collect_failures({"threshold": 4, "variants": {"eagle_sync": rep}, "failures": []})
    text = runner.summarize(report)
    assert "SMOKE FAILED [eagle_sync]: above: output mismatch" in text
    assert "Dynamic speculation disable enabled" in text
    assert runner.exit_code(report) == 1
    with pytest.raises(runner.SmokeError, match="HF transformers reference"):
        checks.check_hf_reference(exp, wrong)


def test_prompts_cover_below_at_above_and_ramp():
    exp = {"vocab_size": 3072, "prompt_ids": [1, 2, 3], "greedy_ids": [4] * 32}
    sets = runner.make_prompts(exp, 4)
    assert len(sets["below"]) == 4 and sets["below"][0].key == "hf"
    assert len(sets["at"]) == 4 and len(sets["above"]) == 32  # 1, 4 and 32 concurrent requests with N=4
    assert all(len(sets[f"ramp_burst{i}"]) == 16 for i in range(3))
    keys = [p.key for p in runner.unique_prompts(sets)]
    assert len(keys) == len(set(keys))
    assert runner.make_prompts(exp, 4) == sets  # deterministic
    sets = runner.make_prompts({"vocab_size": 3072, "prompt_ids": [1], "greedy_ids": [4]}, 4)
    assert len(sets["abort_plain"]) == 32 and len(sets["abort_spec"]) == 1


def test_a_smoke_at_n_256_may_hold_its_8n_requests_at_once(tmp_path, monkeypatch):
    """Where users now set N (up to 256): 8N requests at once, each a connection of this process,
    which raises its limit of open files for them (smoke.client.allow_connections) before any
    server starts; its prompts' keys stay unique past p999."""
    sets = runner.make_prompts({"vocab_size": 3072, "prompt_ids": [1], "greedy_ids": [4]}, 256)
    assert len(sets["above"]) == len(sets["abort_plain"]) == 2048
    keys = [p.key for p in runner.unique_prompts(sets)]
    assert len(keys) == len(set(keys)) > 7000
    asked: list[int] = []
    monkeypatch.setattr(run_command.client, "allow_connections", asked.append)
    monkeypatch.setattr(run_command, "run_smoke", lambda opts: {"threshold": opts.threshold, "variants": {},
                                                                "failures": []})
    for flags, want in (([], 2048), (["--parallel-variants"], 2 * 2048)):
        a = build_parser().parse_args(["run", "--models", "m", "--out", str(tmp_path), "--threshold", "256",
                                       *flags])
        assert run_command.main(a) == 0 and asked[-1] == want
    a = build_parser().parse_args(["run", "--models", "m", "--out", str(tmp_path), "--schedule",
                                   "1-16:3,17-64:2,65-192:1,193-:0"])
    assert run_command.main(a) == 0 and asked[-1] == 8 * 192  # the top edge's


# ----------------------------------------------------------------------------- arguments
def test_argument_parsing(tmp_path):
    ap = build_parser()
    a = ap.parse_args(["run", "--models", "m", "--out", "o", "--threshold", "8", "--variants", "sync"])
    opts = run_command.options(a)
    assert opts.threshold == 8 and opts.variants == ("sync",) and opts.cuda_graph
    with pytest.raises(SystemExit):
        run_command.options(ap.parse_args(["run", "--models", "m", "--out", "o", "--variants", "bogus"]))
    with pytest.raises(SystemExit):
        run_command.options(ap.parse_args(["run", "--models", "m", "--out", "o", "--threshold", "0"]))
    auto = run_command.options(ap.parse_args(["run", "--models", "m", "--out", "o", "--threshold", "AUTO"]))
    assert auto.auto and auto.threshold == scenario.DEFAULT_THRESHOLD  # loads shaped for N=4
    for bad in ("auto8", "-1", "lots"):
        with pytest.raises(SystemExit, match=r"give `auto` .* or a whole number N >= 1"):
            run_command.options(ap.parse_args(["run", "--models", "m", "--out", "o", "--threshold", bad]))
    from sglang_image import image_smoke

    script = image_smoke.full_command("auto")[-1]
    assert "smoke run --models /tmp/models --out /out --threshold auto" in script.replace(
        image_smoke.OUT_MOUNT, "/out")
    # with auto the feature matrix runs at its own default N, the runner's DEFAULT_THRESHOLD
    assert script.replace(image_smoke.OUT_MOUNT, "/out").endswith(
        "features --models /tmp/models --out /out/features")
    assert ap.parse_args(["features", "--models", "m", "--out", "o"]).threshold == scenario.DEFAULT_THRESHOLD
    a = ap.parse_args(["models", str(tmp_path), "--size", "1b", "--draft", "chain",
                       "--draft-accept", "0.7", "--device", "cuda"])
    assert (a.size, a.draft, a.draft_accept, a.device) == ("1b", "chain", 0.7, "cuda")
    with pytest.raises(SystemExit):
        ap.parse_args(["models", str(tmp_path), "--size", "70b"])
    from bench import options as bench_options

    with pytest.raises(SystemExit):
        ap.parse_args(["bench", "--models", "m", "--out", "o"])  # the benchmark is not in the image's package
    ap = bench_parser()
    b = bench_options.options(ap.parse_args(["run", "--models", "m", "--out", "o", "--concurrency", "1,8,256"]))
    assert b.concurrency == (1, 8, 256) and b.configs == bench_options.DEFAULT_CONFIGS
    with pytest.raises(SystemExit):
        bench_options.options(ap.parse_args(["run", "--models", "m", "--out", "o", "--configs", "x"]))
    e = ap.parse_args(["e2e", "--bundle", ".gpu", "--phases", "smoke,bench", "--out", "o"])
    assert e.deadline == 560 and e.phases == "smoke,bench"
    from bench import e2e

    with pytest.raises(SystemExit):
        e2e.main(ap.parse_args(["e2e", "--phases", "smoke,nope", "--out", str(tmp_path)]))


# ----------------------------------------------------------------------------- partial + nox side
def test_partial_manifest_comparison():
    want = [{"name": "a.patch", "sha256": "1" * 64}, {"name": "b.patch", "sha256": "2" * 64}]
    assert partial.compare_manifest([dict(w, files=["x"]) for w in want], want) is None
    assert "!=" in partial.compare_manifest(want[::-1], want)
    assert "sha256 differs for ['b.patch']" in partial.compare_manifest(
        [want[0], dict(want[1], sha256="3" * 64)], want)
    assert partial.help_shows_flag("  --speculative-disable-batch-threshold SPECULATIVE_DISABLE_...")


def test_the_partial_check_wants_the_schedule_flag_only_when_asked(tmp_path, monkeypatch, capsys):
    """--expect-schedule (nox -s smoke -- --schedule S): the server's --help must show the depth
    schedule's flag too; without it the checks are the threshold's alone, as before."""
    from types import SimpleNamespace

    from sglang_image_plugin.setting import DEPTH_SCHEDULE_FLAG, THRESHOLD_FLAG

    manifest = tmp_path / "patches.json"
    manifest.write_text("[]")
    shown = [f"  {THRESHOLD_FLAG} N|auto"]  # a server without the schedule, then with it
    monkeypatch.setattr(partial, "IMPORTS", ())
    monkeypatch.setattr(partial, "subprocess", SimpleNamespace(
        run=lambda cmd, **_: subprocess.CompletedProcess(cmd, 0, "\n".join(shown), "")))
    wanted = f"launch_server --help shows {DEPTH_SCHEDULE_FLAG}"

    def checks(**kw):
        rep = partial.run_checks([], manifest, **kw)
        return rep["ok"], {c["name"]: c for c in rep["checks"]}

    ok, found = checks()
    assert ok and wanted not in found and found[f"launch_server --help shows {THRESHOLD_FLAG}"]["ok"]
    ok, found = checks(expect_schedule=True)
    assert not ok and not found[wanted]["ok"] and THRESHOLD_FLAG in found[wanted]["detail"]
    shown.append(f"  {DEPTH_SCHEDULE_FLAG} LOW-HIGH:DEPTH,...|auto")
    assert checks(expect_schedule=True)[0]
    # a light image cannot run --help: said as skipped, for the schedule's flag too
    assert wanted not in checks(light=True)[1]
    ok, found = checks(light=True, expect_schedule=True)
    assert ok and found[wanted]["skipped"]
    # from the command line the image smoke runs (image_smoke.partial_command)
    series = tmp_path / "series.json"
    series.write_text("[]")
    argv = ["partial", "--expect-series", str(series), "--manifest", str(manifest), "--light"]
    assert partial.main(build_parser().parse_args([*argv, "--expect-schedule"])) == 0
    assert wanted in {c["name"] for c in json.loads(capsys.readouterr().out)["checks"]}


def test_nox_side_container_and_device_command(tmp_path):
    pytest.importorskip("docker")
    from sglang_image import gpu, image_smoke, pins

    kw = image_smoke.container_kwargs(gpu=True, out_dir=tmp_path)
    req = kw["device_requests"][0]
    assert req["Count"] == -1 and req["Capabilities"] == [["gpu"]]
    assert kw["network_mode"] == "none"
    assert "device_requests" not in image_smoke.container_kwargs(gpu=False, out_dir=tmp_path)
    # the plugin's package is mounted beside the smoke, as in the repository (a flavor's image
    # without the plugin has none of its own), and its parent is on the smoke's PYTHONPATH; the
    # smoke's servers leave it off theirs (test_the_servers_never_get_the_plugin_s_sources)
    from smoke import server as smoke_server
    binds = {v["bind"]: Path(k) for k, v in kw["volumes"].items()}
    assert binds[f"{image_smoke.PLUGIN_MOUNT}/sglang_image_plugin"] == REPO / "plugin" / "sglang_image_plugin"
    assert binds[f"{image_smoke.MOUNT}/smoke"] == REPO / "smoke"
    assert kw["environment"]["PYTHONPATH"].split(":") == [image_smoke.MOUNT, image_smoke.PLUGIN_MOUNT]
    # in the container, the smoke's own folder is MOUNT/smoke: the plugin's sources it leaves off
    # its servers' path are the mount
    assert smoke_server.SOURCE_PLUGIN_DIR.relative_to(REPO) == Path(image_smoke.PLUGIN_MOUNT).relative_to(image_smoke.MOUNT)
    series = image_smoke.expected_series(pins.load_flavor("sglang-0.5.17"))
    names = [line.split("#")[0].strip() for line in
             (REPO / "patches" / "sglang-0.5.17" / "series").read_text().splitlines()]
    assert [s["name"] for s in series] == [n for n in names if n]
    assert "PYTHONPATH=plugin${PYTHONPATH:+:$PYTHONPATH} python3 -m bench e2e --bundle .gpu" in gpu.host_command()
    default = pins.load_flavor(pins.DEFAULT_FLAVOR)
    lines, _ = gpu.bundle_requirements(default)
    assert any(line.startswith(f"sglang=={default.sglang_version}") for line in lines)
    assert any(line.startswith("sgl-deep-gemm==") for line in lines)


def test_partial_checks_on_the_real_patched_tree(sglang_tree, forked_in_tree, tmp_path):
    """The no-GPU image check, run on the real sglang 0.5.17 wheel with the series applied."""
    from sglang_image import image_smoke, pins

    tree = sglang_tree("sglang-0.5.17", True)
    expected = image_smoke.expected_series(pins.load_flavor("sglang-0.5.17"))
    manifest = tmp_path / "patches.json"
    manifest.write_text(json.dumps([dict(e, files=[]) for e in expected]))
    repo, series, man = str(REPO), json.dumps(expected), str(manifest)
    # the smoke with the plugin's package beside it, as the image smoke mounts them
    code = (f"import json, sys; from pathlib import Path; sys.path += [{repo!r}, {repo + '/plugin'!r}]\n"
            "from smoke import partial\n"
            f"print(json.dumps(partial.run_checks(json.loads({series!r}), Path({man!r}))))")
    p = forked_in_tree(tree, code, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    checks = {c["name"]: c for c in rep["checks"]}
    assert rep["partial"] is True and "needs one" in rep["note"]
    assert checks["import sglang.srt.server_args"]["ok"], checks["import sglang.srt.server_args"]
    assert checks["launch_server --help shows --speculative-disable-batch-threshold"]["ok"]
    assert checks[f"patch manifest {manifest} matches the series"]["ok"]
    # (a manifest from other patch files: test_partial_manifest_comparison)


def test_profile_summary_of_a_real_torch_trace(tmp_path):
    """A real torch-profiler chrome trace (CPU, with Python stacks), summarised per step."""
    torch = pytest.importorskip("torch")
    from bench import profile

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


def test_profile_counts_steps_and_names_the_host_work_during_gpu_idle(tmp_path):
    """A synthetic trace: two batches, each a kernel launch then host work with the GPU idle."""
    from bench import profile

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


def test_pyspy_finds_the_scheduler_process_and_samples_it(tmp_path):
    """A real process titled like sglang's scheduler, below a parent, sampled by the real py-spy."""
    import subprocess
    import textwrap
    import time

    from bench import pyspy

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


def test_the_servers_never_get_the_plugin_s_sources(tmp_path, monkeypatch):
    """The smoke imports the setting's contract from the plugin's sources (plugin/ beside smoke/:
    `PYTHONPATH=plugin` on a GPU host, the image smoke's mount): a server started from here gets
    the rest of PYTHONPATH without them, so the plugin installed with its sglang is the one it
    loads (a copy ahead of site-packages would shadow the image's)."""
    import os

    from smoke import server as server_mod

    plugin = REPO / "plugin"
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["plugin", str(tmp_path), str(plugin) + "/", "src"]))
    assert server_mod.sglang_env()["PYTHONPATH"] == os.pathsep.join([str(tmp_path), "src"])
    assert server_mod.sglang_env({"PYTHONPATH": str(plugin)}).get("PYTHONPATH") is None
    assert server_mod.sglang_env({"X": "1"})["X"] == "1"
    monkeypatch.delenv("PYTHONPATH")
    assert "PYTHONPATH" not in server_mod.sglang_env()

    # a server process's own environment
    seen = tmp_path / "seen.txt"

    class EnvConfig(server_mod.ServerConfig):
        def argv(self, port: int) -> list[str]:
            code = (f"import os; open({str(seen)!r}, 'w').write(os.environ.get('PYTHONPATH', '-') + "
                    "'|' + os.environ.get('SEEN_EXTRA', '-'))")
            return [sys.executable, "-c", code]

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(plugin), str(tmp_path)]))
    srv = server_mod.Server(EnvConfig("env", tmp_path, env={"SEEN_EXTRA": "yes"}), 1, tmp_path / "env.log")
    srv.launch()
    assert srv.proc is not None and srv.proc.wait(30) == 0
    assert seen.read_text() == f"{tmp_path}|yes"


def test_servers_of_one_process_start_one_after_the_other(tmp_path):
    """Variants side by side: sglang sizes a server's KV pool from the GPU memory free while it
    starts, so a second server is spawned only once the first answers; the wait counts against the
    second one's start timeout."""
    import textwrap

    from smoke import server as server_mod

    leader = textwrap.dedent("""
        import http.server, sys, time
        print("spawned", time.time(), flush=True)
        time.sleep(float(sys.argv[2]))
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers()
            def log_message(self, *a):
                pass
        srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
        print("listening", time.time(), flush=True)
        srv.serve_forever()
    """)

    class FakeConfig(server_mod.ServerConfig):
        def argv(self, port: int) -> list[str]:  # the first one is slow to listen
            return [sys.executable, "-c", leader, str(port), "3" if self.name == "first" else "0.5"]

    def stamp(log: Path, what: str) -> float:
        return next(float(line.split()[1]) for line in log.read_text().splitlines() if line.startswith(what))

    first, late, second, beside = (server_mod.Server(FakeConfig(name, tmp_path), free_port(), tmp_path / f"{name}.log")
                                   for name in ("first", "late", "second", "beside"))
    try:
        starting = threading.Thread(target=first.start, args=(30,))
        starting.start()
        for _ in range(100):  # the first one has been spawned (holds the start)
            if "spawned" in (first.log_path.read_text() if first.log_path.exists() else ""):
                break
            time.sleep(0.05)
        # a server whose pool is fixed up front starts at once, beside the one starting
        beside.spawn()
        beside.wait_healthy(30)
        with pytest.raises(runner.SmokeError, match="no time left to start after waiting"):
            late.start(0.3)
        assert late.proc is None  # never spawned
        second.start(30)
        starting.join(30)
        assert first.alive() and second.alive() and beside.alive()
        assert stamp(second.log_path, "spawned") >= stamp(first.log_path, "listening")
        assert stamp(beside.log_path, "spawned") < stamp(first.log_path, "listening")
    finally:
        for srv in (first, late, second, beside):
            srv.stop()


def hold_lock(lock: Path, seconds: float) -> subprocess.Popen[str]:
    """Another process that holds the host-wide start lock for `seconds` (returns once it does)."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, time
        fh = open({str(lock)!r}, "a")
        fcntl.flock(fh, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep({seconds})
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_server_of_another_process_starting_holds_this_start(tmp_path, monkeypatch):
    """Two smoke runs side by side on one host: the start lock is a file lock too, so a server does
    not start while another process's server starts."""

    from smoke import server as server_mod

    lock = tmp_path / "start.lock"
    monkeypatch.setattr(server_mod, "START_LOCK_FILE", lock)
    holder = hold_lock(lock, seconds=60)
    try:
        srv = server_mod.Server(server_mod.ServerConfig("blocked", tmp_path), 1, tmp_path / "b.log")
        with pytest.raises(runner.SmokeError, match="no time left to start after waiting"):
            srv.start(1.0)
        assert srv.proc is None  # never spawned
    finally:
        holder.kill()
        holder.wait()
    with server_mod.host_start_lock(1.0) as locked:  # free again once the holder is gone
        assert locked


def test_a_start_timeout_spent_waiting_for_another_server_says_so(tmp_path, monkeypatch):
    """Seen on a GPU host: a benchmark server waited ~9 minutes for a feature-matrix run's starts
    and then failed as "not healthy after 11s", which read as a server that would not come up."""

    from smoke import server as server_mod

    class SilentConfig(server_mod.ServerConfig):
        def argv(self, port: int) -> list[str]:  # alive, never healthy
            return [sys.executable, "-c", "import time; time.sleep(30)"]

    lock = tmp_path / "start.lock"
    monkeypatch.setattr(server_mod, "START_LOCK_FILE", lock)
    holder = hold_lock(lock, seconds=2)
    srv = server_mod.Server(SilentConfig("late", tmp_path), 1, tmp_path / "late.log")
    try:
        with pytest.raises(runner.SmokeError,
                           match=r"late: not healthy after \d+s \(after \d+s waiting for another server's start\)"):
            srv.start(4.0)
    finally:
        srv.stop()
        holder.kill()
        holder.wait()


def test_the_host_start_lock_leaves_nothing_in_the_temporary_directory():
    """CI fails a run that leaves a file in /tmp; a user's smoke should not either."""
    import tempfile

    from smoke import server as server_mod

    temp = Path(tempfile.gettempdir())
    before = set(temp.iterdir())
    with server_mod.host_start_lock(1.0) as locked:
        assert locked
    assert set(temp.iterdir()) - before == set()


# ----------------------------------------------------------------------------- variants side by side
class SmokeVariantRecorder(VariantRecorder):
    """Stands in for run_variant / run_auto_variant (tests/smoke/server_fakes.py)."""

    def __call__(self, opts, v, draft, sets, refs, port=None):
        return self.record(v.name, port, lambda: KeyError("missing field"),
                           {"name": v.name, "ok": True, "phases": {}, "port": port})


def smoke_options(tmp_path, monkeypatch, recorder, *, auto: bool = False, **kw) -> scenario.SmokeOptions:
    """SmokeOptions over a models dir with only expected.json; the variant function replaced (the
    other one fails if called): no server starts. Pass state with "refs" to skip the plain server."""
    (tmp_path / "expected.json").write_text(json.dumps({"vocab_size": 1000, "prompt_ids": [5, 6, 7],
                                                        "greedy_ids": [8, 9]}))
    used, unused = ("run_auto_variant", "run_variant") if auto else ("run_variant", "run_auto_variant")
    monkeypatch.setattr(runner, used, recorder)
    monkeypatch.setattr(runner, unused, lambda *a, **k: pytest.fail(f"{unused} called"))
    return scenario.SmokeOptions(models=tmp_path, out=tmp_path / "out", port=30000, auto=auto, **kw)


@pytest.mark.parametrize("auto", [False, True])
def test_parallel_smoke_variants_run_at_once_each_on_its_own_port(tmp_path, monkeypatch, auto):
    rec = SmokeVariantRecorder(threading.Barrier(2, timeout=5), slow=("eagle_overlap",))
    opts = smoke_options(tmp_path, monkeypatch, rec, auto=auto, parallel_variants=True)
    state: dict = {"refs": {}}
    report = runner.run_smoke(opts, state)
    assert rec.most_in_flight == 2  # both past the barrier: in flight together
    # base + 1 + place: the plain server's port (30000) is not reused while both run
    assert {name: port for name, port, _ in rec.calls} == {"eagle_overlap": 30001, "eagle_sync": 30002}
    assert all(thread != threading.main_thread().name for _, _, thread in rec.calls)
    assert list(report["variants"]) == ["eagle_overlap", "eagle_sync"]  # asked order, not finishing
    assert list(state["variants"]) == ["eagle_overlap", "eagle_sync"] and not report["failures"]


def test_parallel_smoke_variants_keep_the_other_s_result_when_one_crashes(tmp_path, monkeypatch):
    rec = SmokeVariantRecorder(threading.Barrier(2, timeout=5), crash=("eagle_sync",))
    opts = smoke_options(tmp_path, monkeypatch, rec, parallel_variants=True)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "server_eagle_sync.log").write_text("the sync server's last words\n")
    state: dict = {"refs": {}}
    report = runner.run_smoke(opts, state)
    assert report["variants"]["eagle_overlap"]["ok"] is True
    crash = report["variants"]["eagle_sync"]
    assert crash["ok"] is False and crash["cause"].startswith("runner error: KeyError: 'missing field'")
    assert "the sync server's last words" in crash["log_tail"]
    assert [f["variant"] for f in report["failures"]] == ["eagle_sync"]
    assert list(state["variants"]) == ["eagle_overlap"]  # the crashed one runs again next call
    assert runner.exit_code(report) == 1


def test_parallel_smoke_variants_rerun_only_what_is_not_done(tmp_path, monkeypatch):
    rec = SmokeVariantRecorder()
    opts = smoke_options(tmp_path, monkeypatch, rec, parallel_variants=True)
    earlier = {"name": "eagle_overlap", "ok": True, "phases": {}, "from": "an earlier call"}
    report = runner.run_smoke(opts, {"refs": {}, "variants": {"eagle_overlap": earlier}})
    assert [(name, port) for name, port, _ in rec.calls] == [("eagle_sync", 30002)]
    assert list(report["variants"]) == ["eagle_overlap", "eagle_sync"]
    assert report["variants"]["eagle_overlap"] is earlier
    rec = SmokeVariantRecorder()  # too little time left: nothing starts, both skipped by name
    opts = smoke_options(tmp_path, monkeypatch, rec, parallel_variants=True, deadline=Deadline(0.0))
    report = runner.run_smoke(opts, {"refs": {}})
    assert rec.calls == [] and report["variants"] == {}
    assert report["skipped"] == ["eagle_overlap (deadline)", "eagle_sync (deadline)"]


@pytest.mark.parametrize("parallel", [False, True])
def test_a_variant_the_deadline_s_margin_stopped_is_skipped_not_failed(tmp_path, monkeypatch, parallel):
    """A variant whose server the deadline's margin killed (what failed after it failed of that) is
    skipped, neither failed nor done: the next call runs it again. Each variant's verdict is a
    progress line, and the caller saves after each."""
    def run(opts, v, draft, sets, refs, port=None):
        if v.name == "eagle_overlap":
            return {"name": v.name, "ok": True, "phases": {}}
        rep: dict = {"name": v.name, "phases": {"below": {"requests": 4}}}
        variant_runs.record_error(rep, client.HTTPFailure("Connection refused"), tmp_path / "log", cut=True)
        return rep

    lines: list[str] = []
    saves: list[int] = []
    opts = smoke_options(tmp_path, monkeypatch, run, parallel_variants=parallel, progress=lines.append,
                         save_state=lambda: saves.append(len(lines)))
    state: dict = {"refs": {}}
    report = runner.run_smoke(opts, state)
    stopped = "stopped by the deadline's margin; loads done: below"
    assert list(report["variants"]) == ["eagle_overlap"] and report["failures"] == []
    assert report["skipped"] == [f"eagle_sync ({stopped})"] and runner.exit_code(report) == 1
    assert list(state["variants"]) == ["eagle_overlap"]  # the stopped one runs again next call
    assert [line.rsplit(" (left", 1)[0] for line in lines] == ["smoke eagle_overlap: PASS",
                                                              f"smoke eagle_sync: {stopped}"]
    assert saves == [1, 2]
    summary = runner.summarize(report)
    assert f"SKIPPED eagle_sync ({stopped})" in summary and "FAIL" not in summary


def test_without_the_flag_smoke_variants_run_one_after_the_other_on_today_s_port(tmp_path, monkeypatch):
    rec = SmokeVariantRecorder(slow=("eagle_overlap",))
    opts = smoke_options(tmp_path, monkeypatch, rec)
    assert opts.parallel_variants is False
    report = runner.run_smoke(opts, {"refs": {}})
    assert rec.most_in_flight == 1
    main = threading.main_thread().name
    assert rec.calls == [("eagle_overlap", None, main), ("eagle_sync", None, main)]
    assert list(report["variants"]) == ["eagle_overlap", "eagle_sync"]


def test_a_smoke_variant_s_server_listens_on_the_port_it_is_given(tmp_path, monkeypatch):
    """run_variant's and run_auto_variant's server: opts.port by default (today's, the plain
    server's, stopped by then), else the port passed."""
    ports: list[int] = []
    NoServer = port_recording_server(ports)

    monkeypatch.setattr(variant_runs, "Server", NoServer)
    opts = scenario.SmokeOptions(models=tmp_path, out=tmp_path, port=30000)
    for run in (variant_runs.run_variant, variant_runs.run_auto_variant):
        assert run(opts, scenario.VARIANTS["sync"], tmp_path, {}, {})["cause"] == "no GPU here"
        run(opts, scenario.VARIANTS["sync"], tmp_path, {}, {}, port=30005)
    assert ports == [30000, 30005, 30000, 30005]


def test_parallel_variants_flag_reaches_the_smoke(tmp_path):
    ap = build_parser()
    base = ["run", "--models", "m", "--out", "o"]
    assert run_command.options(ap.parse_args(base)).parallel_variants is False
    assert run_command.options(ap.parse_args(base + ["--parallel-variants"])).parallel_variants is True
    assert bench_parser().parse_args(["e2e", "--parallel-variants"]).parallel_variants is True
    assert bench_parser().parse_args(["e2e"]).parallel_variants is False


def test_e2e_reruns_a_phase_whose_options_or_site_changed(tmp_path, monkeypatch):
    """A later call on a warm machine must not report an earlier call's result as its own: a run
    phase's done flag and resume state are keyed by its options, and a site installed from another
    bundle or series is refused unless the call installs again (a GPU run of 2026-11-30 got "bench:
    done in an earlier call" for a bench with another --max-total-tokens)."""
    from bench import e2e

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "wheels.tar.xz").write_bytes(b"wheels")
    (bundle / "bundle.json").write_text('{"flavor": "sglang-0.5.17"}')  # as nox -s gpu-e2e writes it
    ap = bench_parser()

    def driver(*extra: str) -> e2e.E2E:
        return e2e.E2E(ap.parse_args(["e2e", "--bundle", str(bundle), "--state", str(tmp_path / "state"),
                                      "--out", str(tmp_path / "out"), *extra]))

    first = driver("--phases", "bench,smoke", "--bench-size", "8b", "--bench-pairs", "3")
    assert first.runs.bench_key.startswith("8b-")
    again = driver("--phases", "bench", "--bench-size", "8b", "--bench-pairs", "3")
    other = driver("--phases", "bench", "--bench-size", "8b", "--bench-pairs", "3",
                   "--bench-max-total-tokens", "147000")
    assert again.runs.bench_key == first.runs.bench_key and other.runs.bench_key != first.runs.bench_key
    first.call.state["install"] = first.site.install_key()
    first.runs.resumable("smoke")["eagle_overlap"] = {"done": True}
    assert first.runs.resumable("smoke") == {"eagle_overlap": {"done": True}}
    first.call.save()
    assert driver("--phases", "smoke").runs.resumable("smoke") == {"eagle_overlap": {"done": True}}
    assert driver("--phases", "smoke", "--smoke-variants", "sync").runs.resumable("smoke") == {}
    # the site: this tree's bundle and series pass; another series (flavor) needs install again
    assert driver("--phases", "bench").stale_site() is None
    meta = bundle / "bundle.json"
    meta.write_text('{"flavor": "sglang-0.5.9"}')  # the bundle nox -s gpu-e2e made of another flavor
    stale = driver("--phases", "bench").stale_site()
    assert stale is not None and "add install,patch,check to --phases" in stale
    assert driver("--phases", "install,bench").stale_site() is None
    assert driver("--phases", "models").stale_site() is None  # no run phase
    meta.write_text('{"flavor": "sglang-0.5.17"}')

    # the whole driver on a bench already done: skipped as done; a broken bundle fails at install by
    # name (before, any non-run phase crashed the driver with KeyError while it computed its done key)
    import os
    monkeypatch.setattr(os, "environ", dict(os.environ))  # run() exports the servers' environment
    done = driver("--phases", "bench", "--bench-size", "8b", "--bench-pairs", "3")
    done.call.state.pop("install")
    done.call.state[f"bench_done_{done.runs.bench_key}"] = True
    done.call.save()
    assert driver("--phases", "bench", "--bench-size", "8b", "--bench-pairs", "3").run() == 0
    assert "bench: done in an earlier call" in (tmp_path / "out" / "e2e.log").read_text()
    broken = driver("--phases", "install,bench", "--bench-size", "8b", "--bench-pairs", "3")
    assert broken.run() == 1 and broken.failures[0].startswith("install: ")

    # a phase whose checks failed is not done: the next call runs it again (a GPU run of
    # 2026-12-02 had to clear the state by hand to rerun a smoke whose plain server failed)
    failed = driver("--phases", "smoke")
    failed.call.state["smoke_report"] = {"failures": [{"variant": "plain", "cause": "exited"}]}
    assert failed.phase_failures("smoke") == [{"variant": "plain", "cause": "exited"}]
    failed.call.state["smoke_report"] = {"failures": []}
    assert failed.phase_failures("smoke") == [] and failed.phase_failures("comm") == []


NINJA_BUILD = """\
rule cc
  command = cat $in > $out && printf '%s: %s %s\\n' $out $in {hdr} > $out.d
  depfile = $out.d
  deps = gcc
rule link
  command = cat $in > $out
build {jit}/ops/kernel.o: cc {site}/flashinfer/csrc/kernel.cu
build {jit}/ops/kernel.so: link {jit}/ops/kernel.o
"""


def test_unpacked_ninja_builds_are_not_built_again_on_a_fresh_install(tmp_path):
    """FlashInfer's JIT kernels are ninja builds, judged by file times. On a fresh machine the site
    is installed after the cached kernels were built: without dating the site's files back, ninja
    built the whole cache again (the sampling module: 86 s, GPU host, 2026-12-04)."""
    from bench import jitcache

    site, jit = tmp_path / "site", tmp_path / "jit"

    def install() -> None:  # the wheels' files, written now (later than any build before)
        shutil.rmtree(site, ignore_errors=True)
        (site / "flashinfer" / "csrc").mkdir(parents=True)
        (site / "flashinfer" / "csrc" / "kernel.cu").write_text("__global__ void k() {}\n")
        (site / "flashinfer" / "include.cuh").write_text("#pragma once\n")
        later = time.time() + 100
        for f in (site / "flashinfer" / "csrc" / "kernel.cu", site / "flashinfer" / "include.cuh"):
            os.utime(f, (later, later))

    def ninja(*args: str) -> str:
        p = subprocess.run([sys.executable, "-m", "ninja", "-C", str(jit), *args], check=False,
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout

    def fresh_machine(age: bool) -> None:
        shutil.rmtree(jit)
        install()
        if age:
            jitcache.age_site(site)
        assert jitcache.seed(archive, jit, "k")[0] == 5  # build.ninja, both logs, both outputs
        (jit / "build.ninja").touch()  # FlashInfer writes it again on every build

    install()
    jitcache.age_site(site)
    (jit / "ops").mkdir(parents=True)
    (jit / "build.ninja").write_text(NINJA_BUILD.format(jit=jit, site=site, hdr=site / "flashinfer" / "include.cuh"))
    time.sleep(1.1)  # the outputs' whole second is after the sources'
    ninja()
    assert "no work to do" in ninja()
    archive = tmp_path / jitcache.ARCHIVE
    assert jitcache.pack(jit, archive, "k")[1] == ""
    fresh_machine(age=False)
    assert "no work to do" not in ninja("-n")  # the old way: everything built again
    fresh_machine(age=True)
    assert "no work to do" in ninja("-n", "-d", "explain")
    # a patched source (or header) is new, and what it feeds is built again
    os.utime(site / "flashinfer" / "include.cuh")
    assert "kernel.o" in ninja("-n")


def test_jit_cache_travels_between_fresh_gpu_machines(tmp_path, monkeypatch):
    """The kernels a call compiled come back as OUT/jit-cache.tar.xz and, put into the bundle folder,
    are unpacked by the next call's install: only for the same wheels and kernel patches, never over
    files already there, and not at all when over the size that may come back."""
    from bench import e2e, jitcache, site

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
    # a member that would land outside the JIT folder is refused, on every Python the tool runs on
    evil = tmp_path / "evil.tar.xz"
    with tarfile.open(evil, "w:xz") as tar:
        for name, data in ((jitcache.MANIFEST, json.dumps({"key": "key-1"}).encode()), ("../escaped", b"x")):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    added, why = jitcache.seed(evil, tmp_path / "evil-jit", "key-1")
    assert added == 0 and "refusing '../escaped'" in why and not (tmp_path / "escaped").exists()
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
    monkeypatch.setattr(site.Site, "kernel_key", lambda self: "key-1")
    drv = e2e.E2E(bench_parser().parse_args(["e2e", "--bundle", str(tmp_path / "bundle"), "--state",
                                             str(tmp_path / "state"), "--out", str(tmp_path / "out")]))
    drv.call.state["install"] = "site"
    drv.call.state["jit_fingerprint"] = jitcache.fingerprint(drv.call.state_dir / "jit")  # what install unpacked
    shutil.copytree(jit, drv.call.state_dir / "jit")                                      # compiled in this call
    drv.site.bring_back_jit_cache()
    brought = tmp_path / "out" / jitcache.ARCHIVE
    assert jitcache.seed(brought, tmp_path / "next-machine", "key-1") == (2, "")
    brought.unlink()
    drv.site.bring_back_jit_cache()
    assert not brought.exists()  # nothing new compiled since


def test_a_variant_s_failure_is_reported_with_its_cause_and_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("line 1\nthe server's last words\n")
    for exc, cause in ((runner.SmokeError("a check failed"), "a check failed"),
                       (client.HTTPFailure("503 from /generate"),
                        "HTTP failure talking to the server: 503 from /generate")):
        rep: dict = {}
        variant_runs.record_error(rep, exc, log)
        assert rep["ok"] is False and rep["cause"] == cause
        assert "the server's last words" in rep["log_tail"]
    rep = {}
    try:
        raise KeyError("missing field")
    except KeyError as exc:
        variant_runs.record_error(rep, exc, log)
    assert rep["cause"].startswith("runner error: KeyError: 'missing field'")
    assert "Traceback" in rep["cause"]
    with pytest.raises(KeyboardInterrupt):  # an interrupt is not a smoke failure
        variant_runs.record_error({}, KeyboardInterrupt(), log)
