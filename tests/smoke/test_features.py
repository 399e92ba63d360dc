"""The feature matrix's run (smoke.features): its servers' pool and flags, the references, the
variants one after the other or side by side, the deadline and the resume state, the command line.
The matrix itself needs a GPU and runs in `python -m bench e2e --phases ...,features`
(docs/validation.md); its cases, loads, requests and verdicts have their own tests."""
from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import pytest

from bench.__main__ import build_parser as bench_parser
from smoke import client
from smoke import features as F
from smoke.__main__ import build_parser
from smoke.cases import Case, generate, stop_cases
from smoke.deadline import REQUEST_MARGIN_S, Deadline
from smoke.loads import FILLER_NEW_TOKENS, FILLER_PROMPT_TOKENS, CaseInterrupted
from smoke.runner import REFERENCE_CONCURRENCY
from smoke.server import SmokeError
from smoke.verdicts import Outcome, equal_tokens
from tests.smoke.matrix_fakes import EXPECTED, GREEDY_ANSWER, Clock, ClockDeadline
from tests.smoke.server_fakes import VariantRecorder, port_recording_server


def test_the_pressure_requests_outgrow_what_admission_reserves_before_any_can_finish(tmp_path):
    # GPU runs, 0.5.23: at the default conservativeness the pool stayed 59% full; at 0.2 with 96-160
    # new tokens per request early finishes made room as fast as the rest grew (peak 75%, no
    # retraction: each request held at most 2.6x its reservation when the first could finish)
    opts = F.FeatureOptions(models=tmp_path, out=tmp_path)
    reqs = F.pressure_case(opts.threshold, 3000).requests
    first_finish = min(r.payload["sampling_params"]["max_new_tokens"] for r in reqs)
    for draft in (False, True):
        argv = F.server_config("x", opts, draft=draft).extra
        i = argv.index("--schedule-conservativeness")
        ratio = 0.7 * float(argv[i + 1])  # sglang's initial new-token ratio, 0.7 by default
        reserved = [len(r.payload["input_ids"]) + ratio * r.payload["sampling_params"]["max_new_tokens"]
                    for r in reqs]
        held = [len(r.payload["input_ids"]) + first_finish for r in reqs]
        assert sum(reserved) > pool_of(opts)  # the queue fills the pool with reservations
        assert min(h / r for h, r in zip(held, reserved)) >= 3


ADMISSION_RESERVES = """
import json, sys
from types import SimpleNamespace
from sglang.srt.managers.schedule_policy import PrefillAdder
from sglang.srt.sampling.sampling_params import SamplingParams
adder = SimpleNamespace(new_token_ratio=float(sys.argv[2]))
print(json.dumps([PrefillAdder._get_running_request_total_token_offset(
    adder, SimpleNamespace(sampling_params=SamplingParams(**p), output_ids=[]))
    for p in json.loads(sys.argv[1])]))
"""


def test_sglangs_admission_reserves_a_share_of_each_pressure_requests_new_tokens(sglang_tree, run_in_tree):
    # GPU, 0.5.23, N=64: the pressure requests were ignore_eos, which 0.5.23's admission reserves
    # whole (ratio 1.0): about 110 ran at once, the pool peaked at 70% and nothing was retracted
    params = [r.payload["sampling_params"] for r in F.pressure_requests(0, 3000, F.MIN_PRESSURE_REQUESTS)]
    ratio = 0.7 * F.SCHEDULE_CONSERVATIVENESS  # sglang's initial new-token ratio, 0.7 by default
    code = (ADMISSION_RESERVES.replace("sys.argv[1]", repr(json.dumps(params)))
            .replace("sys.argv[2]", repr(str(ratio))))
    res = run_in_tree(sglang_tree("sglang-0.5.23", True), code, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    reserved = json.loads(res.stdout.strip().splitlines()[-1])
    assert reserved == pytest.approx([ratio * p["max_new_tokens"] for p in params])
    # each still runs its whole length: no EOS before max_new_tokens
    assert all(p["min_new_tokens"] == p["max_new_tokens"] for p in params)


def test_a_late_call_skips_the_matrix_instead_of_starting_a_server(tmp_path, monkeypatch):
    (tmp_path / "expected.json").write_text('{"vocab_size": 100}')
    monkeypatch.setattr(F, "Server", lambda *a, **k: pytest.fail("a server was started"))
    opts = F.FeatureOptions(models=tmp_path, out=tmp_path / "out", deadline=Deadline(0.0))
    report = F.run_features(opts, {})
    assert report["skipped"] == ["plain", "overlap", "sync"] and not report["failures"]


def test_e2e_and_cli_take_the_features_phase():
    a = bench_parser().parse_args(["e2e", "--phases", "models,features", "--feature-variants", "sync"])
    assert a.phases == "models,features" and a.feature_variants == "sync"
    a = build_parser().parse_args(["features", "--models", "m", "--out", "o", "--threshold", "1"])
    with pytest.raises(SystemExit, match="needs N >= 2"):
        F.options(a)


def pool_of(opts: F.FeatureOptions) -> int:
    argv = F.server_config("x", opts, draft=True).extra
    return int(argv[argv.index("--max-total-tokens") + 1])


def running_limit_of(opts: F.FeatureOptions, draft: bool) -> int:
    argv = F.server_config("x", opts, draft=draft).argv(1)
    return int(argv[argv.index("--max-running-requests") + 1])


# 128-256: where users now set N (the split-KV verify moved the 8B shape's crossover to 192-256)
@pytest.mark.parametrize("threshold", [2, 4, 16, 64, 84, 85, 128, 192, F.MAX_THRESHOLD])
def test_the_pool_holds_the_filler_above_the_threshold_and_the_pressure_still_overfills_it(threshold, tmp_path):
    # GPU, 0.5.23, N=64: in a pool of 16,384 tokens the filler's 256 requests ran 37 at a time (the
    # pool full of their whole lengths after a retraction), so "above" and "cross_up" never left
    # speculation
    F.check_threshold(threshold)
    opts = F.FeatureOptions(models=tmp_path, out=tmp_path, threshold=threshold)
    pool = pool_of(opts)
    whole_filler_request = FILLER_PROMPT_TOKENS + FILLER_NEW_TOKENS
    assert pool // whole_filler_request >= 2 * threshold
    assert pool >= F.MIN_POOL_TOKENS
    # the pressure case, against the same pool: its requests admitted together need well over the
    # pool before the first can finish (the same model of admission as the test above)
    case = F.pressure_case(threshold, 3000)
    reqs = case.requests
    assert len(reqs) >= F.MIN_PRESSURE_REQUESTS and case.concurrency == len(reqs)
    assert F.pressure_overfill(pool, len(reqs)) >= F.PRESSURE_OVERFILL
    prompts = [len(r.payload["input_ids"]) for r in reqs]
    news = [r.payload["sampling_params"]["max_new_tokens"] for r in reqs]
    assert min(prompts) >= F.PRESSURE_PROMPT_TOKENS[0] and max(prompts) <= F.PRESSURE_PROMPT_TOKENS[1]
    reserved = [p + 0.7 * F.SCHEDULE_CONSERVATIVENESS * n for p, n in zip(prompts, news)]
    admitted, room = 0, pool
    for r in sorted(reserved):
        if r > room:
            break
        admitted, room = admitted + 1, room - r
    held = sorted(p + min(news) for p in prompts)[:admitted]
    assert sum(held) >= 1.4 * pool, (threshold, pool, admitted)
    # both servers run every pressure request at once (a queue would not overfill the pool), and
    # more than N (the filler holds the batch above it)
    for draft in (False, True):
        assert running_limit_of(opts, draft) == F.running_limit(threshold) >= len(reqs)
    assert F.running_limit(threshold) > threshold
    assert f"{len(reqs)} concurrent requests, pool of {pool} tokens" in case.note


def test_the_pressure_case_overfills_its_pool_at_every_n_the_matrix_takes():
    # the constants admit a count that overfills: as many requests as the pool admits together
    # need more than PRESSURE_OVERFILL x it before the first can finish
    assert F.pressure_overfill(10**6, 10**6) > F.PRESSURE_OVERFILL
    counts = [F.pressure_count(n) for n in range(2, F.MAX_THRESHOLD + 1)]
    for n, count in zip(range(2, F.MAX_THRESHOLD + 1), counts):
        assert F.pressure_overfill(F.pool_tokens(n), count) >= F.PRESSURE_OVERFILL, n
        # the fewest that do: one less would not (256 at least)
        assert count == F.MIN_PRESSURE_REQUESTS or \
            F.pressure_overfill(F.pool_tokens(n), count - 1) < F.PRESSURE_OVERFILL, n
    assert counts == sorted(counts)  # a larger N never sends fewer
    # the numbers the docs give
    assert [(F.pool_tokens(n), F.pressure_count(n)) for n in (64, 128, 192, 256)] == \
        [(55296, 256), (110592, 388), (165888, 582), (221184, 776)]


def test_a_threshold_the_matrix_cannot_run_is_refused_before_any_work(tmp_path):
    too_high = F.MAX_THRESHOLD + 1
    a = build_parser().parse_args(["features", "--models", "m", "--out", "o", "--threshold", str(too_high)])
    with pytest.raises(SystemExit, match=f"--threshold {too_high}: .* Run the matrix with N <= {F.MAX_THRESHOLD}"):
        F.options(a)
    from bench import e2e
    for phases in ("models,features", "all"):
        with pytest.raises(SystemExit, match=f"--threshold {too_high}: .*KV pool.* N <= {F.MAX_THRESHOLD}"):
            e2e.main(bench_parser().parse_args(["e2e", "--phases", phases, "--out", str(tmp_path / "o"),
                                                "--threshold", str(too_high)]))
    with pytest.raises(SystemExit, match="--threshold"):
        e2e.main(bench_parser().parse_args(["e2e", "--phases", "smoke", "--out", str(tmp_path / "o"),
                                            "--threshold", "lots"]))
    assert not (tmp_path / "o").exists()


class StartsNothing:
    """Stands in for bench.e2e.E2E once the driver is past its checks: no phase runs."""

    def __init__(self, a: argparse.Namespace):
        self.site = None

    def run(self) -> int:
        return 0


@pytest.mark.parametrize("threshold", [128, 192, F.MAX_THRESHOLD])
def test_a_large_threshold_passes_every_check_of_the_matrix_and_of_e2e(threshold, tmp_path, monkeypatch):
    """N of 128-256 (was: refused above 84): the matrix's options, its --check, and e2e's checks
    with decode graphs up to the matrix's running-request limit, not past it."""
    from bench import e2e

    feats = ["features", "--models", "m", "--out", str(tmp_path / "o"), "--threshold", str(threshold)]
    assert F.options(build_parser().parse_args(feats)).threshold == threshold
    asked: list[int] = []
    monkeypatch.setattr(F.client, "allow_connections", asked.append)
    assert F.main(build_parser().parse_args([*feats, "--check", "--parallel-variants"])) == 0
    assert asked == [2 * F.in_flight(threshold)]  # two variants side by side
    monkeypatch.setattr(e2e, "E2E", StartsNothing)
    monkeypatch.setattr(e2e.client, "allow_connections", asked.append)
    limit = F.running_limit(threshold)
    for graph_bs in (256, limit):
        assert e2e.main(bench_parser().parse_args(
            ["e2e", "--phases", "models,smoke,features", "--threshold", str(threshold),
             "--feature-graph-bs", str(graph_bs)])) == 0
    assert asked[-1] == max(8 * threshold, F.in_flight(threshold))  # the smoke's 8N, the matrix's
    with pytest.raises(SystemExit, match=f"--feature-graph-bs {limit + 1}: give 1 to {limit} "
                                         rf"\(the feature servers' running-request limit at N={threshold}"):
        e2e.main(bench_parser().parse_args(["e2e", "--phases", "features", "--threshold", str(threshold),
                                            "--feature-graph-bs", str(limit + 1)]))


def test_parallel_variants_flag_reaches_the_matrix_from_both_clis(tmp_path, monkeypatch):
    from bench import e2e, run_phases
    from smoke import scenario

    features = ["features", "--models", "m", "--out", "o"]
    assert F.options(build_parser().parse_args(features)).parallel_variants is False
    assert F.options(build_parser().parse_args(features + ["--parallel-variants"])).parallel_variants
    seen: dict = {}

    def fake_features(opts, state):
        seen["features"] = opts
        return {"threshold": opts.threshold, "variants": {}, "failures": []}

    def fake_smoke(opts, state):
        seen["smoke"] = opts
        return {"threshold": opts.threshold, "variants": {}, "failures": []}

    monkeypatch.setattr(run_phases.features_mod, "run_features", fake_features)
    monkeypatch.setattr(run_phases.runner, "run_smoke", fake_smoke)
    for flag, want in (([], False), (["--parallel-variants"], True)):
        drv = e2e.E2E(bench_parser().parse_args(["e2e", "--state", str(tmp_path / "state"), "--out",
                                                 str(tmp_path / "out"), "--phases", "smoke,features",
                                                 *flag]))
        drv.runs.smoke()
        drv.runs.features()
        assert seen["smoke"].parallel_variants is want and seen["features"].parallel_variants is want
        assert isinstance(seen["smoke"], scenario.SmokeOptions)
        # the matrix's progress reaches e2e.log, and its state the disk as each case is done
        seen["features"].progress("features overlap: greedy ok")
        assert "features overlap: greedy ok" in (tmp_path / "out" / "e2e.log").read_text()
        drv.call.state["features"]["marker"] = 1
        seen["features"].save_state()
        assert json.loads(drv.call.state_file.read_text())["features"]["marker"] == 1


def test_smoke_and_matrix_run_on_the_1b_models_with_graphs_to_256_when_asked(tmp_path, monkeypatch):
    """--smoke-size 1b and --feature-graph-bs 256: the smoke and the matrix on the bench's 1B
    models, the matrix's servers capturing decode graphs up to 256; the models phase builds the
    1B models for them (and the tiny ones only where a phase runs on them)."""
    from bench import call, e2e, run_phases

    seen: dict = {}

    def fake(phase: str):
        def run(opts, state):
            seen[phase] = opts
            return {"threshold": opts.threshold, "variants": {}, "failures": []}
        return run

    monkeypatch.setattr(run_phases.features_mod, "run_features", fake("features"))
    monkeypatch.setattr(run_phases.runner, "run_smoke", fake("smoke"))
    built: list[str] = []

    class Done:
        returncode, stdout, stderr = 0, "built", ""

    def sh(self, cmd, log, **kw):
        built.append(cmd[cmd.index("models") + 1].rsplit("/", 1)[-1])
        Path(cmd[cmd.index("models") + 1]).mkdir(parents=True, exist_ok=True)
        (Path(cmd[cmd.index("models") + 1]) / "expected.json").write_text("{}")
        return Done()

    monkeypatch.setattr(call.Call, "sh", sh)

    def driver(*flags: str) -> e2e.E2E:
        return e2e.E2E(bench_parser().parse_args(["e2e", "--state", str(tmp_path / "state"), "--out",
                                                  str(tmp_path / "out"), *flags]))

    drv = driver("--phases", "models,smoke,features", "--smoke-size", "1b", "--feature-graph-bs", "256")
    drv.runs.models()
    drv.runs.smoke()
    drv.runs.features()
    assert built == ["1b"]
    assert seen["smoke"].models.name == "1b" and seen["features"].models.name == "1b"
    assert F.server_config("x", seen["features"], draft=True).cuda_graph_max_bs == 256
    assert F.server_config("x", F.FeatureOptions(models=tmp_path, out=tmp_path), draft=True).cuda_graph_max_bs == 64
    driver("--phases", "models,smoke,bench", "--bench-size", "8b").runs.models()
    assert built == ["1b", "tiny", "8b"]
    with pytest.raises(SystemExit, match="--feature-graph-bs 512"):
        e2e.main(bench_parser().parse_args(["e2e", "--feature-graph-bs", "512"]))
    assert driver("--feature-cases", "regex,kv_pressure").runs.feature_cases() == ("regex", "kv_pressure")
    with pytest.raises(SystemExit, match=r"--feature-cases: unknown \['regexp'\]"):
        e2e.main(bench_parser().parse_args(["e2e", "--feature-cases", "regex,regexp"]))


# ----------------------------------------------------------------------------- variants side by side
class MatrixVariantRecorder(VariantRecorder):
    """Stands in for the feature matrix's run_variant (tests/smoke/server_fakes.py)."""

    def __call__(self, opts, key, cases, refs, pressure, vocab, port=None, kept=None, spawned=None):
        return self.record(key, port, lambda: RuntimeError(f"{key} blew up"),
                           {"overlap": F.VARIANT_FLAGS[key], "cuda_graph": True, "cases": {}, "ran": key})


def matrix_options(tmp_path, monkeypatch, recorder, **kw) -> F.FeatureOptions:
    """FeatureOptions over a models dir with only expected.json; the plain server's references
    (F.references), each variant (F.run_variant) and the servers spawned early replaced: no
    server starts."""
    (tmp_path / "expected.json").write_text(json.dumps(
        {"vocab_size": 3000, "mean_top1_top2_margin": 20.0, "prompt": "def f"}))
    monkeypatch.setattr(F, "references", lambda opts, cases, stop_prompt, state: (cases, {}))
    monkeypatch.setattr(F, "run_variant", recorder)
    monkeypatch.setattr(F, "Server", fake_server([]))
    return F.FeatureOptions(models=tmp_path, out=tmp_path / "out", port=30100, **kw)


def test_parallel_variants_run_at_once_each_on_its_own_port(tmp_path, monkeypatch):
    rec = MatrixVariantRecorder(threading.Barrier(2, timeout=5), slow=("overlap",))
    opts = matrix_options(tmp_path, monkeypatch, rec, parallel_variants=True)
    state: dict = {}
    report = F.run_features(opts, state)
    assert rec.most_in_flight == 2  # both past the barrier: in flight together
    ports = {key: port for key, port, _ in rec.calls}
    assert ports == {"overlap": 30101, "sync": 30102}  # base + 1 + place; the plain server has 30100
    assert all(thread != threading.main_thread().name for _, _, thread in rec.calls)
    assert list(report["variants"]) == ["overlap", "sync"]  # the order asked, not the finishing one
    assert [rep["ran"] for rep in report["variants"].values()] == ["overlap", "sync"]
    assert set(state["variants"]) == {"overlap", "sync"} and not report["failures"]
    # the order asked decides the places: sync first takes base + 1
    rec = MatrixVariantRecorder(threading.Barrier(2, timeout=5))
    opts = matrix_options(tmp_path, monkeypatch, rec, parallel_variants=True, variants=("sync", "overlap"))
    assert list(F.run_features(opts, {})["variants"]) == ["sync", "overlap"]
    assert {key: port for key, port, _ in rec.calls} == {"sync": 30101, "overlap": 30102}


def test_parallel_variants_keep_the_other_s_result_when_one_crashes(tmp_path, monkeypatch):
    rec = MatrixVariantRecorder(threading.Barrier(2, timeout=5), crash=("overlap",))
    opts = matrix_options(tmp_path, monkeypatch, rec, parallel_variants=True)
    state: dict = {}
    report = F.run_features(opts, state)
    assert report["variants"]["sync"]["ran"] == "sync"
    crash = report["variants"]["overlap"]
    assert crash["cause"].startswith("runner error: RuntimeError: overlap blew up")
    assert "Traceback" in crash["cause"]
    assert [(f["variant"], f["cause"].splitlines()[0]) for f in report["failures"]] == [
        ("overlap", "runner error: RuntimeError: overlap blew up")]
    assert list(state["variants"]) == ["sync"]  # the crashed one runs again in the next call


def test_parallel_variants_rerun_only_what_is_not_done(tmp_path, monkeypatch):
    rec = MatrixVariantRecorder()
    opts = matrix_options(tmp_path, monkeypatch, rec, parallel_variants=True)
    earlier = {"overlap": True, "cuda_graph": True, "cases": {}, "ran": "an earlier call"}
    state: dict = {"variants": {"overlap": earlier}}
    report = F.run_features(opts, state)
    assert [(key, port) for key, port, _ in rec.calls] == [("sync", 30102)]  # its place, not base + 1
    assert list(report["variants"]) == ["overlap", "sync"]
    assert report["variants"]["overlap"] is earlier
    # too little time left: nothing starts, both skipped as the serial run skips them
    rec = MatrixVariantRecorder()
    opts = matrix_options(tmp_path, monkeypatch, rec, parallel_variants=True, deadline=Deadline(0.0))
    report = F.run_features(opts, {"variants": {}})
    assert rec.calls == [] and report["skipped"] == ["overlap", "sync"] and report["variants"] == {}


def test_without_the_flag_variants_run_one_after_the_other_on_today_s_port(tmp_path, monkeypatch):
    rec = MatrixVariantRecorder(slow=("overlap",))
    opts = matrix_options(tmp_path, monkeypatch, rec)
    assert opts.parallel_variants is False
    report = F.run_features(opts, {})
    assert rec.most_in_flight == 1
    assert [(key, port, thread) for key, port, thread in rec.calls] == [
        ("overlap", None, threading.main_thread().name), ("sync", None, threading.main_thread().name)]
    assert list(report["variants"]) == ["overlap", "sync"]


def test_a_variant_s_server_listens_on_the_port_it_is_given(tmp_path, monkeypatch):
    """run_variant's own server: opts.port + 1 by default (today's), else the port passed."""
    ports: list[int] = []
    NoServer = port_recording_server(ports)

    opts = F.FeatureOptions(models=tmp_path, out=tmp_path)
    pressure = Case("kv_pressure", (), equal_tokens)
    monkeypatch.setattr(F, "Server", NoServer)
    assert F.run_variant(opts, "sync", [], {}, pressure, 100)["cause"] == "no GPU here"
    F.run_variant(opts, "sync", [], {}, pressure, 100, port=30107)
    assert ports == [opts.port + 1, 30107]


def fake_server(started: list[str], names_by_base: dict[str, str] | None = None) -> type:
    """A Server that starts at once (its log empty) and records its name as it starts."""

    class FakeServer:
        def __init__(self, cfg, port, log):
            self.cfg, self.log_path = cfg, log
            self.base = f"http://fake:{port}"
            self.start_seconds = 1.0
            if names_by_base is not None:
                names_by_base[self.base] = cfg.name

        def start(self, timeout):
            started.append(self.cfg.name)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.touch()

        def spawn(self):
            started.append(f"{self.cfg.name} (spawned)")
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.touch()

        def wait_healthy(self, timeout):
            started.append(f"{self.cfg.name} (waited for)")

        def alive(self):
            return True

        def log_text(self):
            return self.log_path.read_text()

        def stop(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.stop()

    return FakeServer


def test_references_the_deadline_stops_are_kept_and_the_next_call_asks_only_for_the_rest(
        tmp_path, monkeypatch):
    (tmp_path / "expected.json").write_text(json.dumps(EXPECTED))
    singles = [c for c in F.make_cases(EXPECTED, 4, "m")
               if c.name in ("n2", "long_prompt", "json_schema", "regex")]  # one request each
    monkeypatch.setattr(F, "make_cases", lambda *a, **k: list(singles))
    monkeypatch.setattr(F, "pressure_requests", lambda seed, vocab, count: tuple(
        generate([7, 8, i], max_new_tokens=384) for i in range(8)))
    started: list[str] = []
    monkeypatch.setattr(F, "Server", fake_server(started))
    monkeypatch.setattr(F, "run_variant", MatrixVariantRecorder())
    clock = Clock()
    sent: list[dict] = []
    given: list[tuple[float, float]] = []
    deadline: list[Deadline] = [ClockDeadline(clock, 80.0)]

    def post_json(url, payload, timeout):
        with clock.lock:  # each request takes 10 s
            sent.append(payload)
            given.append((timeout, deadline[0].left()))
            clock.now += 10
        return GREEDY_ANSWER

    monkeypatch.setattr(client, "post_json", post_json)
    concurrency: list[int] = []
    real_send_all = F.send_all

    def send_all(base, reqs, conc, dl):
        concurrency.append(conc)
        return real_send_all(base, reqs, conc, dl)

    monkeypatch.setattr(F, "send_all", send_all)
    lines: list[str] = []
    saved: list[int] = []

    def options() -> F.FeatureOptions:
        return F.FeatureOptions(models=tmp_path, out=tmp_path / "out", deadline=deadline[0],
                                min_server_s=0, progress=lines.append,
                                save_state=lambda: saved.append(len(state.get("refs", {}))))

    state: dict = {}
    report = F.run_features(options(), state)
    # 80 s: the stop case's base request and the four single cases (10 s each) fit; the pressure
    # case's requests would end past the margin: none starts, and the call ends resumable
    assert report["skipped"] == ["plain", "overlap", "sync"] and not report["failures"]
    assert sorted(state["refs"]) == ["json_schema", "long_prompt", "n2", "regex"]
    assert len(sent) == 5 and saved == [0, 1, 2, 3, 4]  # the state is handed out as each case ends
    assert all(timeout <= left - REQUEST_MARGIN_S for timeout, left in given)
    assert any("stopped by the deadline at kv_pressure" in line for line in lines)
    assert concurrency and set(concurrency) == {REFERENCE_CONCURRENCY}

    state = json.loads(json.dumps(state))  # as the caller keeps it between calls
    sent.clear()
    deadline[0] = ClockDeadline(clock, clock.now + 10_000)
    report = F.run_features(options(), state)
    assert started == ["features_plain", "features_plain"]
    # only the rest: the pressure case's 8 and the stop case's requests, not the base request again
    asked = {json.dumps(p, sort_keys=True) for p in sent}
    assert not asked & {json.dumps(r.payload, sort_keys=True) for c in singles for r in c.requests}
    (stop,) = stop_cases(Outcome(**state["stop_base"]), [0])
    assert len(sent) == 8 + len(stop.requests)
    assert all(p["sampling_params"]["max_new_tokens"] != 64 for p in sent)
    assert "skipped" not in report and not report["failures"]
    assert set(state["refs"]) == {"n2", "long_prompt", "json_schema", "regex", "kv_pressure", "stop"}
    # a third call finds every reference kept: no plain server
    monkeypatch.setattr(F, "Server", lambda *a, **k: pytest.fail("a server was started"))
    cases, refs = F.references(options(), singles, [1, 2, 3], state)
    assert [c.name for c in cases] == [*(c.name for c in singles), "stop"] and set(refs) == {
        c.name for c in cases}


def test_a_failed_plain_server_s_answers_are_not_kept(tmp_path, monkeypatch):
    started: list[str] = []
    monkeypatch.setattr(F, "Server", fake_server(started))
    monkeypatch.setattr(client, "post_json", lambda url, payload, timeout: (
        {"error": "boom"} if payload["input_ids"] == [9] else GREEDY_ANSWER))
    cases = [Case("a", (generate([5]),), equal_tokens), Case("b", (generate([9]),), equal_tokens)]
    state: dict = {"refs": {"earlier": []}}
    opts = F.FeatureOptions(models=tmp_path, out=tmp_path / "out", min_server_s=0)
    opts.out.mkdir()
    with pytest.raises(SmokeError, match="case b: no output_ids"):
        F.references(opts, cases, [1, 2, 3], state)
    assert "refs" not in state and "stop_base" not in state


def case_rows(case_name: str) -> dict:
    return {"below": {"ok": True, "requests": 1, "attempts": 1, "case": case_name}}


def fake_matrix(tmp_path, monkeypatch, clock: Clock, interrupt: set[str]) -> tuple[list, list]:
    """run_features over fake servers whose cases each take 40 s of `clock`; the cases named in
    `interrupt` are stopped by the deadline once. Returns (servers started, cases run)."""
    (tmp_path / "expected.json").write_text(json.dumps(EXPECTED))
    monkeypatch.setattr(F, "references", lambda opts, cases, stop_prompt, state: (
        cases, {c.name: [] for c in cases}))
    started: list[str] = []
    names_by_base: dict[str, str] = {}
    monkeypatch.setattr(F, "Server", fake_server(started, names_by_base))
    monkeypatch.setattr(client, "load", lambda base: {"num_used_tokens": 0})
    monkeypatch.setattr(F, "wait_idle", lambda base, baseline, timeout=30: baseline)
    ran: list[tuple[str, str]] = []

    def run_case(case, base):
        ran.append((names_by_base[base], case.name))
        clock.advance(40)
        if case.name in interrupt:
            interrupt.discard(case.name)
            raise CaseInterrupted(f"{case.name} below: the deadline stopped its requests")

    def run_case_modes(case, ref, base, baseline, filler_prompts, deadline):
        run_case(case, base)
        return case_rows(case.name)

    def run_pressure(pressure, ref, base, baseline, log, deadline):
        run_case(pressure, base)
        return {"ok": True, "retract_log_lines": 3}

    monkeypatch.setattr(F, "run_case_modes", run_case_modes)
    monkeypatch.setattr(F, "run_pressure", run_pressure)
    return started, ran


def test_the_matrix_the_deadline_stops_resumes_with_the_missing_cases_only(tmp_path, monkeypatch):
    clock = Clock()
    started, ran = fake_matrix(tmp_path, monkeypatch, clock, interrupt=set())
    whole = F.run_features(F.FeatureOptions(models=tmp_path, out=tmp_path / "one",
                                            deadline=ClockDeadline(clock, 10_000), progress=lambda _: None),
                           {})
    every = [name for _, name in ran if _ == "features_overlap"]
    assert len(every) == 12 and "skipped" not in whole and not whole["failures"]

    clock = Clock()
    started, ran = fake_matrix(tmp_path, monkeypatch, clock, interrupt={"sampling"})
    lines: list[str] = []
    state: dict = {}
    # 400 s: a case starts with 90 s + the margin left, each takes 40 s: eight start (sampling is
    # cut short by the deadline), four are left; no time to start the sync server
    opts = F.FeatureOptions(models=tmp_path, out=tmp_path / "two", deadline=ClockDeadline(clock, 400),
                            progress=lines.append)
    report = F.run_features(opts, state)
    assert started == ["features_overlap"]
    assert [name for _, name in ran] == every[:8]
    left = ["sampling", *every[8:]]
    assert report["skipped"] == ["sync", *(f"overlap: {name}" for name in left)]
    assert not report["failures"]  # an interrupted case is skipped, not failed
    assert list(state["variant_cases"]["overlap"]) == [n for n in every[:8] if n != "sampling"]
    assert "overlap" not in state["variants"]
    assert "features overlap: greedy ok 40.0s (left 360s)" in lines
    assert any("sampling stopped by the deadline" in line for line in lines)

    state = json.loads(json.dumps(state))  # as the caller keeps it between calls
    ran.clear()
    opts.deadline = ClockDeadline(clock, clock.now + 10_000)
    again = F.run_features(opts, state)
    assert started == ["features_overlap", "features_overlap", "features_sync"]
    assert [name for key, name in ran if key == "features_overlap"] == left
    assert [name for key, name in ran if key == "features_sync"] == every
    assert "skipped" not in again and not again["failures"]
    for key in ("overlap", "sync"):
        assert again["variants"][key]["cases"] == whole["variants"][key]["cases"]
    assert set(state["variants"]) == {"overlap", "sync"} and state["variant_cases"] == {}


def without_seconds(cases: dict) -> dict:
    return {name: {k: v for k, v in rows.items() if k != "seconds"} for name, rows in cases.items()}


def test_parallel_variants_resume_each_its_own_missing_cases(tmp_path, monkeypatch):
    clock = Clock()
    started, ran = fake_matrix(tmp_path, monkeypatch, clock, interrupt=set())
    whole = F.run_features(F.FeatureOptions(models=tmp_path, out=tmp_path / "one", parallel_variants=True,
                                            deadline=ClockDeadline(clock, 10_000), progress=lambda _: None),
                           {})
    clock = Clock()
    started, ran = fake_matrix(tmp_path, monkeypatch, clock, interrupt=set())
    state: dict = {}
    opts = F.FeatureOptions(models=tmp_path, out=tmp_path / "two", parallel_variants=True,
                            deadline=ClockDeadline(clock, 400), progress=lambda _: None)
    report = F.run_features(opts, state)
    first = list(ran)
    assert sorted(started) == ["features_overlap (spawned)", "features_overlap (waited for)",
                               "features_sync (spawned)", "features_sync (waited for)"] and report["skipped"]
    for key in ("overlap", "sync"):  # each thread kept its own cases, and only those
        assert list(state["variant_cases"][key]) == [n for k, n in first if k == f"features_{key}"]
    state = json.loads(json.dumps(state))
    ran.clear()
    opts.deadline = ClockDeadline(clock, clock.now + 10_000)
    again = F.run_features(opts, state)
    assert "skipped" not in again and not again["failures"]
    for key in ("overlap", "sync"):
        mine = f"features_{key}"
        assert not {n for k, n in ran if k == mine} & {n for k, n in first if k == mine}
        assert without_seconds(again["variants"][key]["cases"]) == without_seconds(
            whole["variants"][key]["cases"])


def test_the_smoke_checks_an_image_against_the_series_of_its_own_flavor():
    from sglang_image.errors import SmokeError
    from sglang_image.image_smoke import image_flavor

    labels = {"io.sglang-image.flavor": "sglang-0.5.17"}
    assert image_flavor("img", labels, None) == "sglang-0.5.17"
    assert image_flavor("img", {}, None) is None  # the default flavor
    with pytest.raises(SmokeError, match="built for flavor sglang-0.5.17, not sglang-0.5.23"):
        image_flavor("img", labels, "sglang-0.5.23")


def test_a_subset_of_the_cases_runs_only_those_and_says_so(tmp_path, monkeypatch):
    clock = Clock()
    _, ran = fake_matrix(tmp_path, monkeypatch, clock, interrupt=set())
    only = ("regex", "kv_pressure")
    report = F.run_features(F.FeatureOptions(models=tmp_path, out=tmp_path / "one", cases=only,
                                             deadline=ClockDeadline(clock, 10_000), progress=lambda _: None), {})
    assert sorted(ran) == sorted((f"features_{v}", n) for v in ("overlap", "sync") for n in only)
    assert set(report["variants"]["overlap"]["cases"]) == set(only) and "skipped" not in report
    assert "; only the cases regex, kv_pressure" in F.summarize(report).splitlines()[0]
    a = build_parser().parse_args(["features", "--models", "m", "--out", "o", "--cases", "regex,kv_pressure"])
    assert F.options(a).cases == only
    with pytest.raises(SystemExit, match=r"--cases: unknown \['json'\]"):
        F.options(build_parser().parse_args(["features", "--models", "m", "--out", "o", "--cases", "json"]))


def test_parallel_variants_start_beside_each_other_with_a_share_that_holds_their_pools(tmp_path, monkeypatch):
    # GPU, 0.5.23: the plain server started (87-155 s), answered, stopped, then each variant's
    # server started (75-87 s), one after the other, in every call
    clock = Clock()
    started, _ = fake_matrix(tmp_path, monkeypatch, clock, interrupt=set())
    refs = F.references

    def references(opts, cases, stop_prompt, state):
        started.append("references")
        return refs(opts, cases, stop_prompt, state)

    monkeypatch.setattr(F, "references", references)
    opts = F.FeatureOptions(models=tmp_path, out=tmp_path / "one", parallel_variants=True,
                            deadline=ClockDeadline(clock, 10_000), progress=lambda _: None)
    F.run_features(opts, {})
    # both spawned before the plain server's references, and waited for after them
    assert started[:3] == ["features_overlap (spawned)", "features_sync (spawned)", "references"]
    assert sorted(started[3:]) == ["features_overlap (waited for)", "features_sync (waited for)"]
    # a later call whose variants are done spawns none; one that runs them one by one, none early
    started.clear()
    state = {"variants": {"overlap": {"cases": {}}, "sync": {"cases": {}}}}
    F.run_features(opts, state)
    assert started == ["references"]
    started.clear()
    F.run_features(F.FeatureOptions(models=tmp_path, out=tmp_path / "two", deadline=ClockDeadline(clock, 10_000),
                                    progress=lambda _: None), {})
    assert started == ["references", "features_overlap", "features_sync"]
    # references that fail: the servers spawned early are stopped, not left running
    stopped: list[str] = []

    class Recording(fake_server([])):
        def stop(self):
            stopped.append(self.cfg.name)

    def failing(opts, cases, stop_prompt, state):
        raise SmokeError("plain: server exited with code 1 before it became healthy")

    monkeypatch.setattr(F, "Server", Recording)
    monkeypatch.setattr(F, "references", failing)
    report = F.run_features(opts, {})
    assert sorted(stopped) == ["features_overlap", "features_sync"]
    assert [f["variant"] for f in report["failures"]] == ["plain"]
    assert F.server_config("x", opts, draft=True).mem_fraction == F.SIDE_BY_SIDE_MEM_SHARE
    alone = F.FeatureOptions(models=tmp_path, out=tmp_path / "two")
    assert F.server_config("x", alone, draft=True).mem_fraction == alone.mem_fraction < F.SIDE_BY_SIDE_MEM_SHARE
    # the pool is fixed in both: what a server beside takes cannot shrink it
    assert "--max-total-tokens" in F.server_config("x", opts, draft=True).extra


def test_on_a_schedule_server_each_case_runs_in_every_tier_and_across_every_edge(tmp_path, monkeypatch):
    """--schedule: the cases' modes become the schedule's (smoke.tiers.Tiers.matrix_plan), their
    requests at most as many at once as its first tier holds, the filler 4x its top edge."""
    clock = Clock()
    fake_matrix(tmp_path, monkeypatch, clock, interrupt=set())
    seen: dict = {}

    def run_case_modes(case, ref, base, baseline, filler_prompts, deadline):
        names = [getattr(m, "name", m) for m in case.modes]
        seen[case.name] = (names, case.concurrency, len(filler_prompts))
        return {name: {"ok": True, "depth_changes": 2, "mode_changes": 0, "plain_steps": 1,
                       "speculative_steps": 5} for name in names}

    monkeypatch.setattr(F, "run_case_modes", run_case_modes)
    schedule = "1-8:3,9-24:2,25-64:1,65-:0"
    opts = F.options(build_parser().parse_args(["features", "--models", str(tmp_path), "--out",
                                                str(tmp_path / "one"), "--schedule", schedule,
                                                "--variants", "sync"]))
    opts.deadline, opts.progress = ClockDeadline(clock, 10_000), lambda _: None
    report = F.run_features(opts, {})
    tiers = ["depth3", "depth2", "depth1", "depth0"]
    assert seen["greedy"] == (tiers + ["up8", "up24", "up64", "down8", "down24", "down64"], 7, 256)
    assert seen["abort_stream"][0] == tiers  # in each tier, as it runs below and above a threshold
    assert seen["n2"][1] == 1 and "kv_pressure" not in seen  # the pressure case runs once, as before
    assert report["schedule"] == schedule and report["pool_tokens"] == F.pool_tokens(64)
    text = F.summarize(report)
    assert f"features: schedule={schedule} pool=" in text and "depth2 PASS(2d, 1p/5s)" in text


def test_a_variant_server_with_a_smaller_kv_pool_than_planned_is_refused_naming_the_fix(tmp_path, monkeypatch):
    """--max-total-tokens only caps the pool: a server whose memory share holds less gets less, and
    the matrix's filler and pressure case would then test another load than they say."""
    planned = F.pool_tokens(192)
    pools: list[int] = []
    monkeypatch.setattr(F, "Server", fake_server([]))
    monkeypatch.setattr(F.client, "load", lambda base: {"num_running_reqs": 0, "num_waiting_reqs": 0,
                                                        "num_used_tokens": 0, "max_total_num_tokens": pools[-1]})
    opts = F.FeatureOptions(models=tmp_path, out=tmp_path, threshold=192, cases=())
    pressure = Case("kv_pressure", (), equal_tokens)
    pools.append(planned - 1)
    rep = F.run_variant(opts, "overlap", [], {}, pressure, 100)
    assert rep["kv_pool_tokens"] == planned - 1
    assert f"holds {planned - 1} tokens, fewer than the {planned}" in rep["cause"]
    assert "no --parallel-variants" in rep["cause"] and "smaller N" in rep["cause"]
    pools.append(planned)
    rep = F.run_variant(opts, "overlap", [], {}, pressure, 100)
    assert "cause" not in rep and rep["kv_pool_tokens"] == planned
    assert F.pool_shortfall(None, 192) is None  # a server that does not say: not judged
