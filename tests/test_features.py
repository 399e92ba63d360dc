"""The feature matrix's own logic (smoke.features): how answers are read and compared. The matrix
itself needs a GPU and runs in `python -m bench e2e --phases ...,features` (docs/validation.md)."""
from __future__ import annotations

import ast
import json
import math
import random
import re
import threading
import time
from pathlib import Path

import pytest

from bench.__main__ import build_parser as bench_parser
from smoke import features as F
from smoke.__main__ import build_parser
from smoke.deadline import REQUEST_MARGIN_S
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
    params = [r.payload["sampling_params"] for r in F.pressure_requests(0, 3000)]
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
    for threshold in (2, 4, 16, 64):
        for case in F.make_cases(expected, threshold, "m"):
            n = max(int(r.payload.get("sampling_params", {}).get("n", 1)) for r in case.requests)
            assert case.concurrency * n < threshold or case.concurrency * n == 2, case.name
            if threshold == 64 and len(case.requests) > 1:  # as many at once as N allows, up to 8
                assert case.concurrency == F.CASE_CONCURRENCY, case.name
            json.dumps([r.payload for r in case.requests])
            assert set(case.modes) <= set(F.MODES)


def test_e2e_and_cli_take_the_features_phase():
    a = bench_parser().parse_args(["e2e", "--phases", "models,features", "--feature-variants", "sync"])
    assert a.phases == "models,features" and a.feature_variants == "sync"
    a = build_parser().parse_args(["features", "--models", "m", "--out", "o", "--threshold", "1"])
    with pytest.raises(SystemExit, match="needs N >= 2"):
        F.options(a)


def pool_of(opts: F.FeatureOptions) -> int:
    argv = F.server_config("x", opts, draft=True).extra
    return int(argv[argv.index("--max-total-tokens") + 1])


@pytest.mark.parametrize("threshold", [2, 4, 16, 64, F.max_threshold()])
def test_the_pool_holds_the_filler_above_the_threshold_and_the_pressure_still_overfills_it(threshold, tmp_path):
    # GPU, 0.5.23, N=64: in a pool of 16,384 tokens the filler's 256 requests ran 37 at a time (the
    # pool full of their whole lengths after a retraction), so "above" and "cross_up" never left
    # speculation
    pool = pool_of(F.FeatureOptions(models=tmp_path, out=tmp_path, threshold=threshold))
    whole_filler_request = F.FILLER_PROMPT_TOKENS + F.FILLER_NEW_TOKENS
    assert pool // whole_filler_request >= 2 * threshold
    assert pool >= F.MIN_POOL_TOKENS
    # the pressure case, against the same pool: its requests admitted together need well over the
    # pool before the first can finish (the same model of admission as the test above)
    reqs = F.pressure_requests(0, 3000)
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


def test_a_threshold_the_matrix_cannot_run_is_refused_before_any_work(tmp_path):
    too_high = F.max_threshold() + 1
    a = build_parser().parse_args(["features", "--models", "m", "--out", "o", "--threshold", str(too_high)])
    with pytest.raises(SystemExit, match=f"--threshold {too_high}: .* N <= {F.max_threshold()}"):
        F.options(a)
    from bench import e2e
    for phases in ("models,features", "all"):
        with pytest.raises(SystemExit, match=f"--threshold {too_high}: .*KV pool"):
            e2e.main(bench_parser().parse_args(["e2e", "--phases", phases, "--out", str(tmp_path / "o"),
                                                "--threshold", str(too_high)]))
    with pytest.raises(SystemExit, match="--threshold"):
        e2e.main(bench_parser().parse_args(["e2e", "--phases", "smoke", "--out", str(tmp_path / "o"),
                                            "--threshold", "lots"]))
    assert not (tmp_path / "o").exists()


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
        # the matrix's progress reaches e2e.log, and its state the disk as each case is done
        seen["features"].progress("features overlap: greedy ok")
        assert "features overlap: greedy ok" in (tmp_path / "out" / "e2e.log").read_text()
        drv.state["features"]["marker"] = 1
        seen["features"].save_state()
        assert json.loads(drv.state_file.read_text())["features"]["marker"] == 1


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
    assert driver("--feature-cases", "regex,kv_pressure").feature_cases() == ("regex", "kv_pressure")
    with pytest.raises(SystemExit, match=r"--feature-cases: unknown \['regexp'\]"):
        e2e.main(bench_parser().parse_args(["e2e", "--feature-cases", "regex,regexp"]))


# ----------------------------------------------------------------------------- variants side by side
class MatrixVariantRecorder(VariantRecorder):
    """Stands in for the feature matrix's run_variant (tests/server_fakes.py)."""

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


# ----------------------------------------------------------------------------- the deadline
class Clock:
    """Fake time for a Deadline: it moves only when a fake request or case says it took time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.lock = threading.Lock()

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds


class ClockDeadline(F.Deadline):
    def __init__(self, clock: Clock, at: float) -> None:
        super().__init__(at)
        self.clock = clock

    def left(self) -> float:
        return self.at - self.clock.now


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


GREEDY_ANSWER = {"output_ids": list(range(100, 164)), "text": "abcdefghijklmnopqrstuvwxyz" * 2,
                 "meta_info": {"finish_reason": {"type": "length"}}}
EXPECTED = {"vocab_size": 3000, "mean_top1_top2_margin": 20.0, "prompt": "def f"}


def test_no_request_is_given_a_timeout_beyond_the_deadline(monkeypatch):
    clock = Clock()
    deadline = ClockDeadline(clock, 700.0)
    given: list[tuple[float, float]] = []  # (timeout, time left as the request started)

    def takes_100s(timeout: float) -> None:
        with clock.lock:
            given.append((timeout, deadline.left()))
            clock.now += 100

    def post_json(url, payload, timeout):
        takes_100s(timeout)
        return GREEDY_ANSWER

    def sse_events(url, payload, timeout, stop_after=None):
        takes_100s(timeout)
        return [{"choices": [{"text": "x", "delta": {"content": "x"}, "finish_reason": "length"}]}]

    monkeypatch.setattr(F.client, "post_json", post_json)
    monkeypatch.setattr(F, "sse_events", sse_events)
    case = next(c for c in F.make_cases(EXPECTED, 4, "m") if c.name == "completions_stream")
    kinds = [F._gen([5, 6]), case.requests[0], F.Request("chat_stream", {}),
             F.Request("abort_stream", {})] * 3
    outs = F.send_all("http://x", kinds, 1, deadline)
    # 700 s left: seven requests of 100 s start, each ending before the margin; the rest do not start
    assert len(given) == 7 and [o.error for o in outs[:7]] == [None] * 7
    assert all(timeout <= left - REQUEST_MARGIN_S for timeout, left in given)
    assert given[0][0] == F.REQUEST_CAP_S and given[-1][0] == 100 - REQUEST_MARGIN_S
    assert all(o.error.startswith(F.DEADLINE) for o in outs[7:]) and F.cut_by_deadline(outs)
    # the filler's requests too: it sends until the deadline leaves no time, then stops quietly
    given.clear()
    clock.now = 0.0
    F.Filler("http://x", [[1, 2]], 8, "t", deadline, rolling=True).wait()  # one slot: one order
    assert len(given) == 7 and all(timeout <= left - REQUEST_MARGIN_S for timeout, left in given)
    # a run of a case that the deadline stopped is an interruption, not a failure
    with pytest.raises(F.CaseInterrupted, match="deadline"):
        F.run_under("below", "http://x", case, [], deadline)


def test_a_timeout_at_the_deadline_is_the_deadline_s_and_an_early_failure_the_server_s(monkeypatch):
    clock = Clock()
    deadline = ClockDeadline(clock, 100.0)

    def times_out(url, payload, timeout):
        clock.now += timeout  # the deadline shortened the timeout, and it ran out
        raise F.client.HTTPFailure("timed out")

    monkeypatch.setattr(F.client, "post_json", times_out)
    assert F.send("http://x", F._gen([5]), deadline).error.startswith(F.DEADLINE)

    def refused(url, payload, timeout):
        raise F.client.HTTPFailure("connection refused")

    clock.now = 0.0
    monkeypatch.setattr(F.client, "post_json", refused)
    out = F.send("http://x", F._gen([5]), deadline)
    assert "connection refused" in out.error and not F.cut_by_deadline([out])


def test_references_the_deadline_stops_are_kept_and_the_next_call_asks_only_for_the_rest(
        tmp_path, monkeypatch):
    (tmp_path / "expected.json").write_text(json.dumps(EXPECTED))
    singles = [c for c in F.make_cases(EXPECTED, 4, "m")
               if c.name in ("n2", "long_prompt", "json_schema", "regex")]  # one request each
    monkeypatch.setattr(F, "make_cases", lambda *a, **k: list(singles))
    monkeypatch.setattr(F, "pressure_requests", lambda seed, vocab: tuple(
        F._gen([7, 8, i], max_new_tokens=384) for i in range(8)))
    started: list[str] = []
    monkeypatch.setattr(F, "Server", fake_server(started))
    monkeypatch.setattr(F, "run_variant", MatrixVariantRecorder())
    clock = Clock()
    sent: list[dict] = []
    given: list[tuple[float, float]] = []
    deadline: list[F.Deadline] = [ClockDeadline(clock, 80.0)]

    def post_json(url, payload, timeout):
        with clock.lock:  # each request takes 10 s
            sent.append(payload)
            given.append((timeout, deadline[0].left()))
            clock.now += 10
        return GREEDY_ANSWER

    monkeypatch.setattr(F.client, "post_json", post_json)
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
    assert concurrency and set(concurrency) == {F.REFERENCE_CONCURRENCY}

    state = json.loads(json.dumps(state))  # as the caller keeps it between calls
    sent.clear()
    deadline[0] = ClockDeadline(clock, clock.now + 10_000)
    report = F.run_features(options(), state)
    assert started == ["features_plain", "features_plain"]
    # only the rest: the pressure case's 8 and the stop case's requests, not the base request again
    asked = {json.dumps(p, sort_keys=True) for p in sent}
    assert not asked & {json.dumps(r.payload, sort_keys=True) for c in singles for r in c.requests}
    (stop,) = F.stop_cases(F.Outcome(**state["stop_base"]), [0])
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
    monkeypatch.setattr(F.client, "post_json", lambda url, payload, timeout: (
        {"error": "boom"} if payload["input_ids"] == [9] else GREEDY_ANSWER))
    cases = [F.Case("a", (F._gen([5]),), F.equal_tokens), F.Case("b", (F._gen([9]),), F.equal_tokens)]
    state: dict = {"refs": {"earlier": []}}
    opts = F.FeatureOptions(models=tmp_path, out=tmp_path / "out", min_server_s=0)
    opts.out.mkdir()
    with pytest.raises(F.SmokeError, match="case b: no output_ids"):
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
    monkeypatch.setattr(F.client, "load", lambda base: {"num_used_tokens": 0})
    monkeypatch.setattr(F, "wait_idle", lambda base, baseline, timeout=30: baseline)
    ran: list[tuple[str, str]] = []

    def run_case(case, base):
        ran.append((names_by_base[base], case.name))
        clock.advance(40)
        if case.name in interrupt:
            interrupt.discard(case.name)
            raise F.CaseInterrupted(f"{case.name} below: the deadline stopped its requests")

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


def test_a_case_stops_between_attempts_when_the_deadline_is_near(monkeypatch):
    clock = Clock()
    calls: list[str] = []

    def not_exercised(case, mode, ref, base, baseline, filler_prompts, deadline):
        calls.append(mode)
        clock.advance(30)
        return {"ok": False, "cause": "the mode did not change", "not_exercised": True}

    monkeypatch.setattr(F, "run_case_mode", not_exercised)
    case = F.Case("greedy", (), F.equal_tokens)
    # 100 s: two attempts of 30 s start; the third would start with less than a mode's reserve
    with pytest.raises(F.CaseInterrupted, match="greedy below: not started"):
        F.run_case_modes(case, [], "http://x", {}, [], ClockDeadline(clock, 100))
    assert calls == ["below", "below"]


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


@pytest.mark.parametrize("mode", ["cross_up", "cross_down"])
def test_a_crossing_that_came_too_late_says_by_how_much(mode, monkeypatch):
    # GPU, 0.5.23, threshold 64: two requests of a case can end in a quarter of a second, which is
    # about what 4N filler requests take to lift a batch past N. The run that proved nothing now
    # says when the mode changed and when the case's requests ended, both from their start.
    deadline = F.Deadline(time.time() + 600)
    timing = {"case": 0.05, "mode": 0.2}

    class FakeFiller:
        def __init__(self, *args, **kwargs):
            pass

        def stop(self):
            pass

        def wait(self):
            pass

    def send_all(base, requests, concurrency, deadline):
        time.sleep(timing["case"])
        return [F.Outcome(ids=[[1]]) for _ in requests]

    def wait_mode(base, want, timeout=20):
        if want == "plain" and mode == "cross_down":
            return True  # the filler's load is up before the case starts
        time.sleep(timing["mode"])
        return True

    monkeypatch.setattr(F, "Filler", FakeFiller)
    monkeypatch.setattr(F, "send_all", send_all)
    monkeypatch.setattr(F, "wait_mode", wait_mode)
    monkeypatch.setattr(F, "wait_running", lambda base, n, timeout=10: None)
    case = next(c for c in F.make_cases(EXPECTED, 4, "m") if c.name == "greedy")
    with pytest.raises(F.NotExercised, match="did not change while") as exc:
        F.run_under(mode, "http://x", case, [], deadline)
    seen = ast.literal_eval(re.search(r"(\{.*\})", str(exc.value)).group(1))
    assert seen["crossed_in_flight"] is False
    assert 0.04 <= seen["case_ran_s"] < 0.15 and 0.19 <= seen["mode_changed_after_s"] < 0.35
    timing.update(case=0.3, mode=0.05)
    outs, seen = F.run_under(mode, "http://x", case, [], deadline)
    assert seen["crossed_in_flight"] and seen["mode_changed_after_s"] < seen["case_ran_s"]
    assert len(outs) == len(case.requests)


# ----------------------------------------------------------------------------- constrained cases
@pytest.fixture(scope="module")
def grammar_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What smoke.grammar_check reads of a checkpoint: the tokenizer smoke.models makes, and its
    config's vocab size and EOS id."""
    from smoke import models

    d = tmp_path_factory.mktemp("grammar-model")
    tok = models.make_tokenizer(models.SIZES["tiny"].vocab, 200_000)
    tok.save_pretrained(d)
    (d / "config.json").write_text(json.dumps({"vocab_size": len(tok), "eos_token_id": tok.eos_token_id}))
    return d


def encode(model: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)(text, add_special_tokens=False)["input_ids"]


REGEX = "(yes|no) [0-9]{2,40}[a-f]+"
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                      "n": {"type": "integer"}}, "required": ["name", "n"]})


def test_the_grammar_check_tells_an_allowed_output_from_a_refused_one(grammar_model):
    from smoke.grammar_check import Grammar, first_break

    regex, schema = Grammar("regex", REGEX, str(grammar_model)), Grammar("json_schema", SCHEMA, str(grammar_model))
    assert first_break(regex, encode(grammar_model, "yes 1234abc")) is None
    assert first_break(regex, encode(grammar_model, "no 12")) is None  # the start of an allowed output
    assert "is not one the grammar allows" in first_break(regex, encode(grammar_model, "maybe 12"))
    assert first_break(schema, encode(grammar_model, '{"name": "ab", "n": 15}')) is None
    assert "is not one the grammar allows" in first_break(schema, encode(grammar_model, '{"n": "x"}'))
    # as the matrix's servers run it (CPU, the 1B models: with free whitespace the JSON output was
    # whitespace after "{" to its 192nd token)
    opts = F.FeatureOptions(models=grammar_model, out=grammar_model)
    assert all("--constrained-json-disable-any-whitespace" in F.server_config("x", opts, draft=d).extra
               for d in (False, True))
    compact = Grammar("json_schema", SCHEMA, str(grammar_model), any_whitespace=False)
    assert first_break(compact, encode(grammar_model, '{"name": "ab", "n": 15}')) is None
    assert "is not one the grammar allows" in first_break(compact, encode(grammar_model, '{\n  "name"'))


def tie_case(grammar_model: Path, kind: str, source: str, ref_text: str, got_text: str,
             margin: float) -> tuple[F.Outcome, F.Outcome, F.Case]:
    """A reference and an answer that part at their first differing token, the reference's top 2
    there being its own token and the answer's, `margin` apart."""
    from smoke.grammar_check import Grammar

    b, a = encode(grammar_model, ref_text), encode(grammar_model, got_text)
    at = F.first_difference(a, b)
    top = [[(t, -0.1)] for t in b]
    if at is not None and at < min(len(a), len(b)):
        top[at] = [(a[at], -0.7 - margin), (b[at], -0.7)]  # not in order: the check ranks them
    ref = outcome(b, ["length", None], top=top)
    got = outcome(a, ["length", None])
    return ref, got, F.Case(kind, (), F.equal_until_tie(Grammar(kind, source, str(grammar_model))))


def test_a_constrained_output_equal_to_plains_passes_with_no_tie(grammar_model):
    ref, got, case = tie_case(grammar_model, "regex", REGEX, "yes 1234abc", "yes 1234abc", 0.0)
    assert case.check([ref], [got]) == {"requests": 1, "ties": []}


def test_a_constrained_output_may_part_from_plains_only_at_a_tie_and_must_keep_the_grammar(grammar_model):
    # GPU, 0.5.23, the 1B models at threshold 64: the JSON output parted from plain's at token 17
    # or 42, the regex output at token 4 or 74, in every mode, pure speculation too
    ref, got, case = tie_case(grammar_model, "regex", REGEX, "yes 1234abc", "yes 1299abc", 0.2)
    detail = case.check([ref], [got])
    assert [t["margin"] for t in detail["ties"]] == [0.2]
    at = detail["ties"][0]["at"]
    report = {"threshold": 64, "variants": {"overlap": {"cases": {"regex": {"below": {"ok": True, **detail}}}}}}
    assert f"below PASS(None, Nonep/Nones, tie at {at} (0.2))" in F.summarize(report)
    ref, got, case = tie_case(grammar_model, "json_schema", SCHEMA, '{"name": "ab", "n": 15}',
                              '{"name": "xy", "n": 7}', 0.1)
    assert len(case.check([ref], [got])["ties"]) == 1
    # the same parting with the choices far apart is a failure, and says so
    ref, got, case = tie_case(grammar_model, "regex", REGEX, "yes 1234abc", "yes 1299abc", 2.0)
    with pytest.raises(F.CaseFailure, match="leads the token taken by 2.000, not a tie"):
        case.check([ref], [got])
    # a tie after which the output leaves the grammar
    ref, got, case = tie_case(grammar_model, "regex", REGEX, "yes 1234abc", "yes 12zz", 0.2)
    with pytest.raises(F.CaseFailure, match="a tie .* but after it token"):
        case.check([ref], [got])


def test_a_tie_outside_plains_top_list_is_told_by_each_servers_logprob_of_its_own_token(grammar_model):
    # CPU, the 1B models: 2048 of 3072 lm_head rows are zeros, so under a grammar many allowed
    # tokens tie at an exact 0 logit, more than a top list holds; argmax breaks the tie by kernel
    ref, got, case = tie_case(grammar_model, "regex", REGEX, "yes 1234abc", "yes 1299abc", 0.2)
    at = F.first_difference(got.ids[0], ref.ids[0])
    ref.top[0][at] = [(ref.ids[0][at], -2.0), (7, -2.0)]
    ref.logprobs[0] = [-0.1] * len(ref.ids[0])
    got.logprobs[0] = [-0.1] * len(got.ids[0])
    ref.logprobs[0][at], got.logprobs[0][at] = -2.0, -2.0
    assert [t["margin"] for t in case.check([ref], [got])["ties"]] == [0.0]
    got.logprobs[0][at] = -4.5  # the token taken is far less likely than plain's: a wrong choice
    with pytest.raises(F.CaseFailure, match="leads the token taken by 2.500, not a tie"):
        case.check([ref], [got])
    ref.logprobs[0], got.logprobs[0] = [], []
    with pytest.raises(F.CaseFailure, match="no logprobs to tell a tie by"):
        case.check([ref], [got])
    # one output the start of the other: no tie to speak of
    ref, got, case = tie_case(grammar_model, "regex", REGEX, "yes 1234abc", "yes 1234", 0.0)
    with pytest.raises(F.CaseFailure, match="first difference"):
        case.check([ref], [got])


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
        raise F.SmokeError("plain: server exited with code 1 before it became healthy")

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


def constrained_greedy(model: object, compiler: object, payload: dict, eos: int, vocab: int,
                       cached: bool) -> F.Outcome:
    """A server's answer to a constrained case's request, on the CPU: greedy under xgrammar's
    mask in bf16, step by step with a KV cache (cached) or a full forward at each step (the other
    order of sums a verify pass has), with its logprobs and top 5 as the matrix asks for them."""
    import torch
    import xgrammar as xgr

    sp = payload["sampling_params"]
    grammar = (compiler.compile_json_schema(sp["json_schema"], any_whitespace=False) if "json_schema" in sp
               else compiler.compile_regex(sp["regex"]))
    matcher, mask = xgr.GrammarMatcher(grammar), xgr.allocate_token_bitmask(1, vocab)
    ids, out, lps, tops, past = list(payload["input_ids"]), [], [], [], None
    step = torch.tensor([ids])
    with torch.no_grad():
        while len(out) < sp["max_new_tokens"] and not matcher.is_terminated():
            o = model(input_ids=step, past_key_values=past, use_cache=True) if cached else \
                model(input_ids=torch.tensor([ids]))
            past = o.past_key_values if cached else None
            logits = o.logits[0, -1, :vocab].float()
            matcher.fill_next_token_bitmask(mask)
            allowed = torch.zeros(1, vocab)
            xgr.apply_token_bitmask_inplace(allowed, mask)
            logits[~torch.isfinite(allowed[0])] = float("-inf")
            lp = torch.log_softmax(logits, -1)
            token = int(torch.argmax(logits))
            top = torch.topk(lp, F.TIE_TOP)
            out.append(token)
            lps.append(float(lp[token]))
            tops.append([(int(i), float(v)) for v, i in zip(top.values, top.indices)])
            assert matcher.accept_token(token)
            ids.append(token)
            step = torch.tensor([[token]])
            if token == eos:
                break
    finish = ["stop", eos] if out and out[-1] == eos else ["length", None]
    return F.Outcome(ids=[out], text=[""], finish=[finish], logprobs=[lps], top=[tops])


def test_the_constrained_cases_check_real_outputs_of_the_generated_models(tmp_path):
    # the check as it meets a GPU: the generated models' own tokenizer and EOS, xgrammar's mask,
    # bf16, and two orders of summation (CPU, the 1B models: they parted at an exact tie at token 8
    # of the JSON output and at 0.008 apart at token 33 of the regex one)
    import torch
    import transformers
    import xgrammar as xgr

    from smoke import models

    models.build(tmp_path, size="tiny", draft="chain", accept=1.0, corpus_bytes=200_000, gen_len=24)
    target = tmp_path / "target"
    expected = json.loads((tmp_path / "expected.json").read_text())
    vocab, eos = int(expected["vocab_size"]), json.loads((target / "config.json").read_text())["eos_token_id"]
    tok = transformers.AutoTokenizer.from_pretrained(target)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos]))
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
    cases = {c.name: c for c in F.make_cases(expected, 64, str(target))}
    for name in ("json_schema", "regex"):
        case = cases[name]
        plain, other = (constrained_greedy(model, compiler, case.requests[0].payload, eos, vocab, cached)
                        for cached in (True, False))
        detail = case.check([plain], [other])  # equal, or parted at a tie and still allowed
        assert all(t["margin"] <= F.TIE_LOGITS for t in detail["ties"]), detail
        if name == "json_schema":  # without free whitespace it ends, EOS and all
            assert plain.finish[0] == ["stop", eos] and len(plain.ids[0]) < F.CASE_TOKENS
        # the same answer with a token the grammar allows but the model ranks far below: no tie
        at, far = next((k, t) for k, pos in enumerate(plain.top[0]) for t, lp in pos[1:]
                       if math.isfinite(lp) and pos[0][1] - lp > 2 * F.TIE_LOGITS)
        wrong = F.Outcome(ids=[plain.ids[0][:at] + [far]], text=[""], finish=[["length", None]],
                          logprobs=[plain.logprobs[0][:at] + [dict(plain.top[0][at])[far]]], top=[[]])
        with pytest.raises(F.CaseFailure, match="not a tie"):
            case.check([plain], [wrong])
