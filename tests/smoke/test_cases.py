"""The feature matrix's cases (smoke.cases): what they send, that the real server accepts every
request of them, and that the partial smoke names each one it could not run."""
from __future__ import annotations

import json

import pytest

from smoke.cases import CASE_CONCURRENCY, CASE_TOKENS, MODES, STOP_REPEATS, make_cases, stop_cases
from smoke.features import CASE_NAMES
from smoke.verdicts import Outcome


def test_stop_cases_are_chosen_to_stop_early_from_the_plain_output():
    out_ids = [10, 11, 12, 10, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    base = Outcome(ids=[out_ids], text=["abcdefghijklmnopqrstuvwxyz"], finish=["length"])
    (case,) = stop_cases(base, [3, 4, 5])
    first, second, by_string = (r.payload["sampling_params"] for r in case.requests[:3])
    assert case.requests == case.requests[:3] * STOP_REPEATS
    assert first["stop_token_ids"] == [out_ids[12]] and first["ignore_eos"] is False
    early_id, later_id = second["stop_token_ids"]
    early, later = out_ids.index(early_id), out_ids.index(later_id)
    assert early < second["min_new_tokens"] <= later  # only the later stop id may end it
    assert by_string["stop"] == ["ijk"]


def test_the_stop_case_runs_as_long_as_a_case_a_mode_change_can_cross():
    # GPU, 0.5.23, sync scheduler: three requests stopping within ~30 tokens ended before the mode
    # changed in all three attempts of cross_up and cross_down ("the run proved nothing")
    out_ids = list(range(100, 164))  # every token new: stops at the earliest positions allowed
    base = Outcome(ids=[out_ids], text=["".join(chr(97 + i % 26) for i in range(64))], finish=["length"])
    (case,) = stop_cases(base, [3, 4])
    stops = [out_ids.index(r.payload["sampling_params"]["stop_token_ids"][-1])
             if "stop_token_ids" in r.payload["sampling_params"] else len(out_ids) // 3
             for r in case.requests]
    assert case.concurrency == 1 and sum(stops) >= CASE_TOKENS


def test_cases_keep_below_under_the_threshold_and_are_plain_json():
    expected = {"vocab_size": 3000, "mean_top1_top2_margin": 20.0, "prompt": "def f"}
    for threshold in (2, 4, 16, 64):
        for case in make_cases(expected, threshold, "m"):
            n = max(int(r.payload.get("sampling_params", {}).get("n", 1)) for r in case.requests)
            assert case.concurrency * n < threshold or case.concurrency * n == 2, case.name
            if threshold == 64 and len(case.requests) > 1:  # as many at once as N allows, up to 8
                assert case.concurrency == CASE_CONCURRENCY, case.name
            json.dumps([r.payload for r in case.requests])
            assert set(case.modes) <= set(MODES)


ACCEPTS = """
import dataclasses, json, sys
sys.path.insert(0, {repo!r})
sys.path.append({repo!r} + "/plugin")  # the setting's contract, where the tree has no plugin of its own
from smoke.cases import Case, make_cases, stop_cases
from smoke.features import pressure_requests
from smoke.verdicts import Outcome, equal_tokens
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams

expected = {{"vocab_size": 3000, "mean_top1_top2_margin": 20.0, "prompt": "def f"}}
base = Outcome(ids=[list(range(10, 60))], text=["abcdefghijklmnopqrstuvwxyz"], finish=["length"])
cases = make_cases(expected, 4, "m") + stop_cases(base, [3, 4]) + [
    Case("kv_pressure", pressure_requests(0, 3000, 256), equal_tokens)]
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
    p = forked_in_tree(tree, ACCEPTS.format(repo=str(Path(__file__).resolve().parents[2])))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "checked" in p.stdout


def test_the_partial_smoke_names_every_case_it_could_not_run():
    from sglang_image.image_smoke import NOT_CHECKED_WITHOUT_GPU, full_command

    expected = {"vocab_size": 3000, "mean_top1_top2_margin": 20.0, "prompt": "def f"}
    base = Outcome(ids=[list(range(10, 60))], text=["abcdefghijklmnopqrstuvwxyz"], finish=["length"])
    names = [c.name for c in make_cases(expected, 4, "m") + stop_cases(base, [3])] + ["kv_pressure"]
    assert tuple(names) == CASE_NAMES
    said = " ".join(NOT_CHECKED_WITHOUT_GPU)
    assert [n for n in CASE_NAMES if n not in said] == []
    assert "python3 -m smoke features" in full_command(4)[-1]  # the full smoke runs the matrix too
