"""The bench phase of `bench e2e` (bench.run_phases, bench.e2e) on FakeLab: each unit kept as it
is done, the next call going on; a launch-only call; a failed bench run again; the model shapes.
The smoke phase against stand-in server processes: stopped at the deadline's margin, its progress
and logs kept."""
from __future__ import annotations

import functools
import json
import os
import sys
import tarfile
import time
from pathlib import Path

import pytest

from bench import throughput
from bench.__main__ import build_parser
from smoke import models


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



def test_a_failed_bench_of_an_earlier_call_is_named_as_such_in_the_result(lab, tmp_path, monkeypatch):
    """A GPU run of 2026-12-07: a bench failed (its servers' KV pools did not fit at 128 requests), the
    next call, with the lower top concurrency the message asked for, passed, and its RESULT repeated
    the first bench's failure as "bench 8b-<key>: ...", as if the second had failed too."""
    from bench import e2e

    monkeypatch.setattr(os, "environ", dict(os.environ))  # run() exports the servers' environment
    models = tmp_path / "state" / "models" / "1b"
    models.mkdir(parents=True)
    (models / "expected.json").write_text(json.dumps({"vocab_size": 3072, "size": "1b"}))

    def driver(loads: str) -> e2e.E2E:
        drv = e2e.E2E(build_parser().parse_args([
            "e2e", "--bundle", str(tmp_path / "bundle"), "--state", str(tmp_path / "state"), "--out",
            str(tmp_path / "out"), "--phases", "bench", "--bench-configs", "plain,eagle3", "--bench-concurrency", loads,
            "--bench-pairs", "1", "--bench-window-s", "20"]))
        drv.call.deadline.at = time.time() + 600
        return drv

    monkeypatch.setattr(throughput, "server_checks",
                        lambda name, srv, top, switching: ({"kv_used_after_flush": 7}, [f"{name}: 7 KV tokens in use"]))
    first = driver("1,4")
    assert first.run() == 1
    assert any(f.startswith(f"bench {first.runs.bench_key} (plain,eagle3 at 1,4 requests): plain: 7 KV")
               for f in first.all_failures())
    monkeypatch.setattr(throughput, "server_checks", lambda name, srv, top, switching: ({"kv_used_after_flush": 0}, []))
    second = driver("1")
    assert second.run() == 1  # the state keeps every bench's failures: the first one's still counts
    failures = second.all_failures()
    assert failures and all(f.startswith(f"bench {first.runs.bench_key} (plain,eagle3 at 1,4 requests, "
                                         "an earlier call's options): ") for f in failures)
    assert "an earlier call's options" in (tmp_path / "out" / "summary.txt").read_text()

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


def test_the_gpu_host_command_starts_again_once_with_the_site_on_its_path(tmp_path):
    """`PYTHONPATH=plugin python3 -m bench e2e ...` from the repository's root: the setting's
    contract comes from plugin/ (no site-packages here: -S), and the driver starts again, once,
    with its site on PYTHONPATH before any phase (it imports from the site as its servers do),
    plugin/ still ahead of it (the contract stays this tree's where the site has a plugin too)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    shadow = tmp_path / "state" / "site" / "sglang_image_plugin"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the site is ahead of plugin/')\n")
    proc = subprocess.run(
        [sys.executable, "-S", "-m", "bench", "e2e", "--bundle", str(tmp_path / "bundle"), "--state",
         str(tmp_path / "state"), "--out", str(tmp_path / "out"), "--phases", "install"],
        cwd=repo, env={"PATH": os.environ["PATH"], "PYTHONPATH": "plugin"}, capture_output=True,
        text=True, timeout=120, check=False)
    log = (tmp_path / "out" / "e2e.log").read_text()
    assert log.count("starting again with") == 1 and "is not on this process's path" not in log, log
    assert "== install" in log and "wheels.tar.xz is missing" in proc.stderr, (log, proc.stderr)


def test_an_e2e_smoke_ends_at_its_deadline_s_margin_keeping_what_it_did(tmp_path, monkeypatch):
    """A GPU call of `bench e2e --phases models,smoke --deadline 380` ran 40 s past its deadline and
    was killed from outside with nothing of the smoke in OUT: past the deadline's margin each of its
    requests still got MIN_REQUEST_S, one after the other, and the smoke logged and packed nothing
    until its end. Here the margin comes while the variant's server (a slow stand-in: its requests
    take longer than that) answers its first load: the server is killed there, the call ends before
    the deadline, the variant is skipped (not failed), and e2e.log, the state and logs.tar.gz hold
    what was done; the next call runs only the variant."""
    from bench import e2e, run_phases
    from smoke import runner, scenario, server, variant_runs
    from smoke.deadline import REQUEST_MARGIN_S
    from tests.ports import free_port
    from tests.smoke.fake_schedule_server import output_ids

    fake = Path(__file__).resolve().parents[1] / "smoke" / "fake_schedule_server.py"
    slow = ["--step-s", "1"]  # a 48-token request: 12 s at depth 3

    class FakeConfig(server.ServerConfig):
        def argv(self, port: int) -> list[str]:  # sglang's flags, to the fake; the EAGLE-3 one slow
            return [sys.executable, str(fake), *super().argv(port)[3:], *(slow if self.draft else [])]

    monkeypatch.setattr(os, "environ", dict(os.environ))  # run() exports the servers' environment
    monkeypatch.setattr(runner, "ServerConfig", FakeConfig)
    monkeypatch.setattr(variant_runs, "ServerConfig", FakeConfig)
    monkeypatch.setattr(run_phases, "SmokeOptions", functools.partial(scenario.SmokeOptions, port=free_port()))
    started = variant_runs.start_variant_server
    cut: list[float] = []

    def start_then_near_deadline(srv, opts, rep):  # the margin in 1 s, the deadline 25 s after it
        base = started(srv, opts, rep)
        if not cut:
            opts.deadline.at = time.time() + REQUEST_MARGIN_S + 1
            cut.append(opts.deadline.at)
        return base

    monkeypatch.setattr(variant_runs, "start_variant_server", start_then_near_deadline)
    tiny = tmp_path / "state" / "models" / "tiny"
    tiny.mkdir(parents=True)
    prompt = [5, 6, 7, 8]
    (tiny / "expected.json").write_text(json.dumps({"vocab_size": 3000, "prompt_ids": prompt,
                                                    "greedy_ids": output_ids(prompt, 24)}))

    def driver() -> e2e.E2E:
        drv = e2e.E2E(build_parser().parse_args([
            "e2e", "--bundle", str(tmp_path / "bundle"), "--state", str(tmp_path / "state"), "--out",
            str(tmp_path / "out"), "--phases", "smoke", "--smoke-variants", "overlap", "--threshold", "4"]))
        drv.call.deadline.at = time.time() + 600
        return drv

    assert driver().run() == 3  # INCOMPLETE: run it again
    assert cut and time.time() < cut[0], f"ended {time.time() - cut[0]:.0f}s past the deadline"
    log = (tmp_path / "out" / "e2e.log").read_text()
    for line in ("smoke plain: server up", "references kept", "smoke eagle_overlap: server up",
                 "smoke eagle_overlap: stopped by the deadline's margin; loads done: none",
                 "smoke: stopped by the deadline", "INCOMPLETE"):
        assert line in log, log
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["failures"] == [] and report["incomplete"], report
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        assert {"server_plain.log", "server_eagle_overlap.log"} <= set(tar.getnames())
    pgids = [int(p) for p in (tmp_path / "state" / "servers.pid").read_text().split()]
    assert len(pgids) == 2 and not any(server.group_running(g) for g in pgids)  # both servers gone
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert state["smoke"]["refs"] and state["smoke"]["variants"] == {}
    assert not any(k.startswith("smoke_done_") for k in state)

    slow.clear()  # the next call: time enough; the plain server's references are reused
    assert driver().run() == 0
    again = (tmp_path / "out" / "e2e.log").read_text()[len(log):]
    assert "smoke eagle_overlap: PASS" in again and "smoke plain" not in again, again
