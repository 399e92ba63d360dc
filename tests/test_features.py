"""The feature matrix's own logic (smoke.features): how answers are read and compared. The matrix
itself needs a GPU and runs in `python -m bench e2e --phases ...,features` (docs/validation.md)."""
from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest

from bench.__main__ import build_parser as bench_parser
from smoke import features as F
from smoke.__main__ import build_parser
from tests.server_fakes import VariantRecorder, port_recording_server


def outcome(ids: list[int], finish: object = None, lps: list[float] | None = None,
            top: list[list[tuple[int, float]]] | None = None) -> F.Outcome:
    return F.Outcome(ids=[ids], text=[" ".join(map(str, ids))], finish=[finish],
                     logprobs=[lps or []], top=[top or []])


def test_generate_answers_are_read_for_one_and_for_n_choices():
    one = {"output_ids": [5, 6], "text": "ab", "meta_info": {
        "finish_reason": {"type": "stop", "matched": 6},
        "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]],
        "output_top_logprobs": [[[-0.1, 5, None], [-3.0, 9, None]], [[-0.2, 6, None]]]}}
    o = F.read_generate(one)
    assert o.ids == [[5, 6]] and o.finish == [["stop", 6]] and o.logprobs == [[-0.1, -0.2]]
    assert o.top == [[[(5, -0.1), (9, -3.0)], [(6, -0.2)]]]
    two = F.read_generate([one, dict(one, output_ids=[7])])
    assert two.ids == [[5, 6], [7]]
    with pytest.raises(F.CaseFailure, match="no output_ids"):
        F.read_generate({"error": "boom"})


def test_streams_are_joined_and_an_error_event_fails():
    events = [{"choices": [{"text": "he"}]}, {"choices": [{"text": "llo", "finish_reason": "length"}]}]
    assert F.read_stream(events, chat=False).text == ["hello"]
    chat = [{"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": "hi"}}]},
            {"choices": [{"delta": {}, "finish_reason": "stop"}]}]
    got = F.read_stream(chat, chat=True)
    assert got.text == ["hi"] and got.finish == ["stop"]
    with pytest.raises(F.CaseFailure, match="error event"):
        F.read_stream([{"error": {"message": "x"}}], chat=False)


def test_token_comparison_names_the_first_difference():
    ref = [outcome([1, 2, 3, 4], "length")]
    assert F.equal_tokens(ref, [outcome([1, 2, 3, 4], "length")]) == {"requests": 1}
    with pytest.raises(F.CaseFailure, match=r"first difference at token 2: got \[9, 4\] expected \[3, 4\]"):
        F.equal_tokens(ref, [outcome([1, 2, 9, 4], "length")])
    with pytest.raises(F.CaseFailure, match="finish"):
        F.equal_tokens(ref, [outcome([1, 2, 3, 4], ["stop", 4])])
    with pytest.raises(F.CaseFailure, match="1 request"):
        F.equal_tokens(ref, [F.Outcome(error="HTTP 500")])


def test_logprobs_must_agree_within_the_tolerance():
    ref = [outcome([1, 2], lps=[-0.10, -0.20], top=[[(1, -0.1), (7, -4.0)], [(2, -0.2)]])]
    near = [outcome([1, 2], lps=[-0.11, -0.19], top=[[(1, -0.11), (7, -4.02)], [(2, -0.19)]])]
    assert F.close_logprobs(ref, near)["max_logprob_diff"] == pytest.approx(0.02)
    far = [outcome([1, 2], lps=[-0.10, -0.40], top=[[(1, -0.1)], [(2, -0.4)]])]
    with pytest.raises(F.CaseFailure, match="token 1: logprob -0.4000"):
        F.close_logprobs(ref, far)
    missing = [outcome([1, 2], lps=[], top=[])]
    with pytest.raises(F.CaseFailure, match="0 output logprobs"):
        F.close_logprobs(ref, missing)
    other_top = [outcome([1, 2], lps=[-0.10, -0.20], top=[[(8, -0.1)], [(2, -0.2)]])]
    with pytest.raises(F.CaseFailure, match="top-1 token 8"):
        F.close_logprobs(ref, other_top)


def test_the_logprob_tolerance_grows_with_the_magnitude_bf16_can_resolve():
    # seen on a GPU (0.5.23, EAGLE-3 verify vs plain decode): one bf16 step apart, 18 nats down
    ref = [outcome([1], lps=[-0.5], top=[[(1, -0.5), (37, -18.625)]])]
    seen = [outcome([1], lps=[-0.5], top=[[(1, -0.5), (37, -18.5625)]])]
    assert F.close_logprobs(ref, seen)["max_logprob_diff"] == pytest.approx(0.0625)
    # seen on a GPU (0.5.23), below the threshold too: 2.5 and 2 bf16 steps apart
    for plain, got in ((-27.375, -27.6875), (-16.5, -16.25)):
        ref_far = [outcome([1], lps=[-0.5], top=[[(1, -0.5), (90, plain)]])]
        got_far = [outcome([1], lps=[-0.5], top=[[(1, -0.5), (90, got)]])]
        assert F.close_logprobs(ref_far, got_far)["max_logprob_diff"] == pytest.approx(abs(plain - got))
    # ... but a real shift there fails, and near zero the tolerance stays tight
    shifted = [outcome([1], lps=[-0.5], top=[[(1, -0.5), (37, -17.875)]])]
    with pytest.raises(F.CaseFailure, match="token 37 -17.8750, plain server -18.6250"):
        F.close_logprobs(ref, shifted)
    near_zero = [outcome([1], lps=[-0.58], top=[[(1, -0.5), (37, -18.625)]])]
    with pytest.raises(F.CaseFailure, match="token 0: logprob -0.5800"):
        F.close_logprobs(ref, near_zero)


def test_bf16_step_is_the_spacing_of_bf16_numbers():
    assert F.bf16_step(1.0) == F.bf16_step(1.99) == 2 ** -7
    assert F.bf16_step(-16.25) == F.bf16_step(31.9) == 0.125
    assert F.bf16_step(0.5) == 2 ** -8 and F.bf16_step(0.0) == 0.0


def test_only_the_schedulers_retraction_warning_counts(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("server_args={'retraction_policy': 'length', 'disaggregation_decode_retraction_backup'"
                   ": None}\n[x] Decode batch, #running-req: 87, token usage: 0.59\n")
    assert F.retractions(log) == 0
    with open(log, "a") as fh:  # the warning as 0.5.17 and 0.5.23 word it
        fh.write("[x] KV cache pool is full. Retract requests. #retracted_reqs: 3, "
                 "#new_tokens_gained: 420, #new_token_ratio: 0.1400 -> 0.5000\n")
    assert F.retractions(log) == 1


@pytest.mark.parametrize("flavor", ["sglang-0.5.17", "sglang-0.5.23"])
def test_the_retraction_warning_is_the_one_the_flavors_scheduler_writes(flavor, sglang_tree):
    scheduler = (sglang_tree(flavor, False) / "sglang/srt/managers/scheduler.py").read_text()
    assert F.RETRACT_LOG.search(scheduler), f"{flavor}: the scheduler no longer says 'Retract requests'"


def test_the_pressure_requests_outgrow_what_admission_reserves_before_any_can_finish(tmp_path):
    # GPU runs, 0.5.23: at the default conservativeness the pool stayed 59% full; at 0.2 with 96-160
    # new tokens per request early finishes made room as fast as the rest grew (peak 75%, no
    # retraction: each request held at most 2.6x its reservation when the first could finish)
    opts = F.FeatureOptions(models=tmp_path, out=tmp_path)
    reqs = F.pressure_requests(0, 3000)
    first_finish = min(r.payload["sampling_params"]["max_new_tokens"] for r in reqs)
    for draft in (False, True):
        argv = F.server_config("x", opts, draft=draft).extra
        i = argv.index("--schedule-conservativeness")
        ratio = 0.7 * float(argv[i + 1])  # sglang's initial new-token ratio, 0.7 by default
        reserved = [len(r.payload["input_ids"]) + ratio * r.payload["sampling_params"]["max_new_tokens"]
                    for r in reqs]
        held = [len(r.payload["input_ids"]) + first_finish for r in reqs]
        assert sum(reserved) > F.POOL_TOKENS  # the queue fills the pool with reservations
        assert min(h / r for h, r in zip(held, reserved)) >= 3


def test_a_late_call_skips_the_matrix_instead_of_starting_a_server(tmp_path, monkeypatch):
    (tmp_path / "expected.json").write_text('{"vocab_size": 100}')
    monkeypatch.setattr(F, "Server", lambda *a, **k: pytest.fail("a server was started"))
    opts = F.FeatureOptions(models=tmp_path, out=tmp_path / "out", deadline=F.Deadline(0.0))
    report = F.run_features(opts, {})
    assert report["skipped"] == ["plain", "overlap", "sync"] and not report["failures"]


def test_sampling_check_passes_one_distribution_and_catches_a_biased_sampler():
    rnd = random.Random(1)

    def draws(bias: float) -> list[F.Outcome]:
        # per-token logprob of a sampled token: the greedy one (-0.7) with p, another (-1.4) else
        return [outcome([1] * 48, lps=[-0.7 if rnd.random() < 0.5 + bias else -1.4 for _ in range(48)])
                for _ in range(F.SAMPLES)]

    same = F.same_distribution(draws(0.0), draws(0.0))
    assert abs(same["z"]) < F.SAMPLING_Z
    with pytest.raises(F.CaseFailure, match="z = "):
        F.same_distribution(draws(0.0), draws(0.25))  # accepts the likelier token too often


def test_stop_cases_are_chosen_to_stop_early_from_the_plain_output():
    out_ids = [10, 11, 12, 10, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    base = F.Outcome(ids=[out_ids], text=["abcdefghijklmnopqrstuvwxyz"], finish=["length"])
    (case,) = F.stop_cases(base, [3, 4, 5])
    first, second, by_string = (r.payload["sampling_params"] for r in case.requests[:3])
    assert case.requests == case.requests[:3] * F.STOP_REPEATS
    assert first["stop_token_ids"] == [out_ids[12]] and first["ignore_eos"] is False
    early_id, later_id = second["stop_token_ids"]
    early, later = out_ids.index(early_id), out_ids.index(later_id)
    assert early < second["min_new_tokens"] <= later  # only the later stop id may end it
    assert by_string["stop"] == ["ijk"]


def test_the_stop_case_runs_as_long_as_a_case_a_mode_change_can_cross():
    # GPU, 0.5.23, sync scheduler: three requests stopping within ~30 tokens ended before the mode
    # changed in all three attempts of cross_up and cross_down ("the run proved nothing")
    out_ids = list(range(100, 164))  # every token new: stops at the earliest positions allowed
    base = F.Outcome(ids=[out_ids], text=["".join(chr(97 + i % 26) for i in range(64))], finish=["length"])
    (case,) = F.stop_cases(base, [3, 4])
    stops = [out_ids.index(r.payload["sampling_params"]["stop_token_ids"][-1])
             if "stop_token_ids" in r.payload["sampling_params"] else len(out_ids) // 3
             for r in case.requests]
    assert case.concurrency == 1 and sum(stops) >= F.CASE_TOKENS


def test_cases_keep_below_under_the_threshold_and_are_plain_json():
    expected = {"vocab_size": 3000, "mean_top1_top2_margin": 20.0, "prompt": "def f"}
    for threshold in (2, 4, 16):
        for case in F.make_cases(expected, threshold, "m"):
            n = max(int(r.payload.get("sampling_params", {}).get("n", 1)) for r in case.requests)
            assert case.concurrency * n < threshold or case.concurrency * n == 2, case.name
            json.dumps([r.payload for r in case.requests])
            assert set(case.modes) <= set(F.MODES)


def test_e2e_and_cli_take_the_features_phase():
    a = bench_parser().parse_args(["e2e", "--phases", "models,features", "--feature-variants", "sync"])
    assert a.phases == "models,features" and a.feature_variants == "sync"
    a = build_parser().parse_args(["features", "--models", "m", "--out", "o", "--threshold", "1"])
    with pytest.raises(SystemExit, match="threshold must be >= 2"):
        F.options(a)


def test_parallel_variants_flag_reaches_the_matrix_from_both_clis(tmp_path, monkeypatch):
    from bench import e2e
    from smoke import runner

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

    monkeypatch.setattr(e2e.features_mod, "run_features", fake_features)
    monkeypatch.setattr(e2e.runner, "run_smoke", fake_smoke)
    for flag, want in (([], False), (["--parallel-variants"], True)):
        drv = e2e.E2E(bench_parser().parse_args(["e2e", "--state", str(tmp_path / "state"), "--out",
                                                 str(tmp_path / "out"), "--phases", "smoke,features",
                                                 *flag]))
        drv.phase_smoke()
        drv.phase_features()
        assert seen["smoke"].parallel_variants is want and seen["features"].parallel_variants is want
        assert isinstance(seen["smoke"], runner.SmokeOptions)


def test_smoke_and_matrix_run_on_the_1b_models_with_graphs_to_256_when_asked(tmp_path, monkeypatch):
    """--smoke-size 1b and --feature-graph-bs 256: the smoke and the matrix on the bench's 1B
    models, the matrix's servers capturing decode graphs up to 256; the models phase builds the
    1B models for them (and the tiny ones only where a phase runs on them)."""
    from bench import e2e

    seen: dict = {}

    def fake(phase: str):
        def run(opts, state):
            seen[phase] = opts
            return {"threshold": opts.threshold, "variants": {}, "failures": []}
        return run

    monkeypatch.setattr(e2e.features_mod, "run_features", fake("features"))
    monkeypatch.setattr(e2e.runner, "run_smoke", fake("smoke"))
    built: list[str] = []

    class Done:
        returncode, stdout, stderr = 0, "built", ""

    def sh(self, cmd, log, **kw):
        built.append(cmd[cmd.index("models") + 1].rsplit("/", 1)[-1])
        Path(cmd[cmd.index("models") + 1]).mkdir(parents=True, exist_ok=True)
        (Path(cmd[cmd.index("models") + 1]) / "expected.json").write_text("{}")
        return Done()

    monkeypatch.setattr(e2e.E2E, "sh", sh)

    def driver(*flags: str) -> e2e.E2E:
        return e2e.E2E(bench_parser().parse_args(["e2e", "--state", str(tmp_path / "state"), "--out",
                                                  str(tmp_path / "out"), *flags]))

    drv = driver("--phases", "models,smoke,features", "--smoke-size", "1b", "--feature-graph-bs", "256")
    drv.phase_models()
    drv.phase_smoke()
    drv.phase_features()
    assert built == ["1b"]
    assert seen["smoke"].models.name == "1b" and seen["features"].models.name == "1b"
    assert F.server_config("x", seen["features"], draft=True).cuda_graph_max_bs == 256
    assert F.server_config("x", F.FeatureOptions(models=tmp_path, out=tmp_path), draft=True).cuda_graph_max_bs == 64
    driver("--phases", "models,smoke,bench", "--bench-size", "8b").phase_models()
    assert built == ["1b", "tiny", "8b"]
    with pytest.raises(SystemExit, match="--feature-graph-bs 512"):
        e2e.main(bench_parser().parse_args(["e2e", "--feature-graph-bs", "512"]))


# ----------------------------------------------------------------------------- variants side by side
class MatrixVariantRecorder(VariantRecorder):
    """Stands in for the feature matrix's run_variant (tests/server_fakes.py)."""

    def __call__(self, opts, key, cases, refs, pressure, vocab, port=None):
        return self.record(key, port, lambda: RuntimeError(f"{key} blew up"),
                           {"overlap": F.VARIANT_FLAGS[key], "cuda_graph": True, "cases": {}, "ran": key})


def matrix_options(tmp_path, monkeypatch, recorder, **kw) -> F.FeatureOptions:
    """FeatureOptions over a models dir with only expected.json; the plain server's references
    (F.references) and each variant (F.run_variant) replaced: no server starts."""
    (tmp_path / "expected.json").write_text(json.dumps(
        {"vocab_size": 3000, "mean_top1_top2_margin": 20.0, "prompt": "def f"}))
    monkeypatch.setattr(F, "references", lambda opts, cases, stop_prompt, state: (cases, {}))
    monkeypatch.setattr(F, "run_variant", recorder)
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
    opts = matrix_options(tmp_path, monkeypatch, rec, parallel_variants=True, deadline=F.Deadline(0.0))
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
    pressure = F.Case("kv_pressure", (), F.equal_tokens)
    monkeypatch.setattr(F, "Server", NoServer)
    assert F.run_variant(opts, "sync", [], {}, pressure, 100)["cause"] == "no GPU here"
    F.run_variant(opts, "sync", [], {}, pressure, 100, port=30107)
    assert ports == [opts.port + 1, 30107]


ACCEPTS = """
import dataclasses, json, sys
sys.path.insert(0, {repo!r})
from smoke import features as F
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams

expected = {{"vocab_size": 3000, "mean_top1_top2_margin": 20.0, "prompt": "def f"}}
base = F.Outcome(ids=[list(range(10, 60))], text=["abcdefghijklmnopqrstuvwxyz"], finish=["length"])
cases = F.make_cases(expected, 4, "m") + F.stop_cases(base, [3, 4]) + [
    F.Case("kv_pressure", F.pressure_requests(0, 3000), F.equal_tokens)]
fields = {{f.name for f in dataclasses.fields(GenerateReqInput)}}
checked = 0
for case in cases:
    for r in case.requests:
        if r.kind in ("generate", "abort_stream"):
            unknown = set(r.payload) - fields
            assert not unknown, (case.name, unknown)
            req = GenerateReqInput(**r.payload)
            req.normalize_batch_and_arguments()
            SamplingParams(**r.payload["sampling_params"]).verify(3000)
        elif r.kind == "chat_stream":
            ChatCompletionRequest(**r.payload)
        else:
            CompletionRequest(**r.payload)
        checked += 1
print("checked", checked)
"""


@pytest.mark.parametrize("flavor", ["sglang-0.5.17", "sglang-0.5.23"])
def test_every_request_of_the_matrix_is_one_the_real_server_accepts(flavor, sglang_tree, forked_in_tree):
    """Each case's payload goes through the flavor's own request classes (GenerateReqInput with its
    normalisation, SamplingParams.verify, the OpenAI protocol models): a misplaced field (say,
    return_logprob inside sampling_params) fails here, not after a GPU server started."""
    from pathlib import Path

    tree = sglang_tree(flavor, False)
    p = forked_in_tree(tree, ACCEPTS.format(repo=str(Path(__file__).resolve().parents[1])))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "checked" in p.stdout


def test_the_partial_smoke_names_every_case_it_could_not_run():
    from sglang_image.image_smoke import NOT_CHECKED_WITHOUT_GPU, full_command

    expected = {"vocab_size": 3000, "mean_top1_top2_margin": 20.0, "prompt": "def f"}
    base = F.Outcome(ids=[list(range(10, 60))], text=["abcdefghijklmnopqrstuvwxyz"], finish=["length"])
    names = [c.name for c in F.make_cases(expected, 4, "m") + F.stop_cases(base, [3])] + ["kv_pressure"]
    assert tuple(names) == F.CASE_NAMES
    said = " ".join(NOT_CHECKED_WITHOUT_GPU)
    assert [n for n in F.CASE_NAMES if n not in said] == []
    assert "python3 -m smoke features" in full_command(4)[-1]  # the full smoke runs the matrix too


def test_the_smoke_checks_an_image_against_the_series_of_its_own_flavor():
    from sglang_image.errors import SmokeError
    from sglang_image.image_smoke import image_flavor

    labels = {"io.sglang-image.flavor": "sglang-0.5.17"}
    assert image_flavor("img", labels, None) == "sglang-0.5.17"
    assert image_flavor("img", {}, None) is None  # the default flavor
    with pytest.raises(SmokeError, match="built for flavor sglang-0.5.17, not sglang-0.5.23"):
        image_flavor("img", labels, "sglang-0.5.23")
