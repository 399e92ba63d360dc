"""The feature matrix's verdicts (smoke.verdicts): when a threshold server's answers equal the
plain server's, case by case, down to the constrained cases' ties on the generated models."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from smoke.cases import CASE_TOKENS, SAMPLES, TIE_TOP, Case, make_cases
from smoke.features import FeatureOptions, server_config, summarize
from smoke.verdicts import (
    SAMPLING_Z,
    TIE_LOGITS,
    CaseFailure,
    Outcome,
    bf16_step,
    close_logprobs,
    equal_tokens,
    equal_until_tie,
    first_difference,
    logprob_tolerance,
    same_distribution,
)
from tests.smoke.matrix_fakes import EXPECTED


def outcome(ids: list[int], finish: object = None, lps: list[float] | None = None,
            top: list[list[tuple[int, float]]] | None = None) -> Outcome:
    return Outcome(ids=[ids], text=[" ".join(map(str, ids))], finish=[finish],
                     logprobs=[lps or []], top=[top or []])


def test_token_comparison_names_the_first_difference():
    ref = [outcome([1, 2, 3, 4], "length")]
    assert equal_tokens(ref, [outcome([1, 2, 3, 4], "length")]) == {"requests": 1}
    with pytest.raises(CaseFailure, match=r"first difference at token 2: got \[9, 4\] expected \[3, 4\]"):
        equal_tokens(ref, [outcome([1, 2, 9, 4], "length")])
    with pytest.raises(CaseFailure, match="finish"):
        equal_tokens(ref, [outcome([1, 2, 3, 4], ["stop", 4])])
    with pytest.raises(CaseFailure, match="1 request"):
        equal_tokens(ref, [Outcome(error="HTTP 500")])


def test_logprobs_must_agree_within_the_tolerance():
    ref = [outcome([1, 2], lps=[-0.10, -0.20], top=[[(1, -0.1), (7, -4.0)], [(2, -0.2)]])]
    near = [outcome([1, 2], lps=[-0.11, -0.19], top=[[(1, -0.11), (7, -4.02)], [(2, -0.19)]])]
    assert close_logprobs(ref, near)["max_logprob_diff"] == pytest.approx(0.02)
    far = [outcome([1, 2], lps=[-0.10, -0.40], top=[[(1, -0.1)], [(2, -0.4)]])]
    with pytest.raises(CaseFailure, match="token 1: logprob -0.4000"):
        close_logprobs(ref, far)
    missing = [outcome([1, 2], lps=[], top=[])]
    with pytest.raises(CaseFailure, match="0 output logprobs"):
        close_logprobs(ref, missing)
    other_top = [outcome([1, 2], lps=[-0.10, -0.20], top=[[(8, -0.1)], [(2, -0.2)]])]
    with pytest.raises(CaseFailure, match="top-1 token 8"):
        close_logprobs(ref, other_top)


def test_the_logprob_tolerance_grows_with_the_magnitude_bf16_can_resolve():
    # seen on a GPU (0.5.23, EAGLE-3 verify vs plain decode): one bf16 step apart, 18 nats down
    ref = [outcome([1], lps=[-0.5], top=[[(1, -0.5), (37, -18.625)]])]
    seen = [outcome([1], lps=[-0.5], top=[[(1, -0.5), (37, -18.5625)]])]
    assert close_logprobs(ref, seen)["max_logprob_diff"] == pytest.approx(0.0625)
    # seen on a GPU (0.5.23), below the threshold too: 2.5 and 2 bf16 steps apart
    for plain, got in ((-27.375, -27.6875), (-16.5, -16.25)):
        ref_far = [outcome([1], lps=[-0.5], top=[[(1, -0.5), (90, plain)]])]
        got_far = [outcome([1], lps=[-0.5], top=[[(1, -0.5), (90, got)]])]
        assert close_logprobs(ref_far, got_far)["max_logprob_diff"] == pytest.approx(abs(plain - got))
    # ... but a real shift there fails, and near zero the tolerance stays tight
    shifted = [outcome([1], lps=[-0.5], top=[[(1, -0.5), (37, -17.875)]])]
    with pytest.raises(CaseFailure, match="token 37 -17.8750, plain server -18.6250"):
        close_logprobs(ref, shifted)
    near_zero = [outcome([1], lps=[-0.58], top=[[(1, -0.5), (37, -18.625)]])]
    with pytest.raises(CaseFailure, match="token 0: logprob -0.5800"):
        close_logprobs(ref, near_zero)


def test_bf16_step_is_the_spacing_of_bf16_numbers():
    assert bf16_step(1.0) == bf16_step(1.99) == 2 ** -7
    assert bf16_step(-16.25) == bf16_step(31.9) == 0.125
    assert bf16_step(0.5) == 2 ** -8 and bf16_step(0.0) == 0.0


def test_sampling_check_passes_one_distribution_and_catches_a_biased_sampler():
    rnd = random.Random(1)

    def draws(bias: float) -> list[Outcome]:
        # per-token logprob of a sampled token: the greedy one (-0.7) with p, another (-1.4) else
        return [outcome([1] * 48, lps=[-0.7 if rnd.random() < 0.5 + bias else -1.4 for _ in range(48)])
                for _ in range(SAMPLES)]

    same = same_distribution(draws(0.0), draws(0.0))
    assert abs(same["z"]) < SAMPLING_Z
    with pytest.raises(CaseFailure, match="z = "):
        same_distribution(draws(0.0), draws(0.25))  # accepts the likelier token too often


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
    opts = FeatureOptions(models=grammar_model, out=grammar_model)
    assert all("--constrained-json-disable-any-whitespace" in server_config("x", opts, draft=d).extra
               for d in (False, True))
    compact = Grammar("json_schema", SCHEMA, str(grammar_model), any_whitespace=False)
    assert first_break(compact, encode(grammar_model, '{"name": "ab", "n": 15}')) is None
    assert "is not one the grammar allows" in first_break(compact, encode(grammar_model, '{\n  "name"'))


def tie_case(grammar_model: Path, kind: str, source: str, ref_text: str, got_text: str,
             margin: float) -> tuple[Outcome, Outcome, Case]:
    """A reference and an answer that part at their first differing token, the reference's top 2
    there being its own token and the answer's, `margin` apart."""
    from smoke.grammar_check import Grammar

    b, a = encode(grammar_model, ref_text), encode(grammar_model, got_text)
    at = first_difference(a, b)
    top = [[(t, -0.1)] for t in b]
    if at is not None and at < min(len(a), len(b)):
        top[at] = [(a[at], -0.7 - margin), (b[at], -0.7)]  # not in order: the check ranks them
    ref = outcome(b, ["length", None], top=top)
    got = outcome(a, ["length", None])
    return ref, got, Case(kind, (), equal_until_tie(Grammar(kind, source, str(grammar_model))))


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
    assert f"below PASS(None, Nonep/Nones, tie at {at} (0.2))" in summarize(report)
    ref, got, case = tie_case(grammar_model, "json_schema", SCHEMA, '{"name": "ab", "n": 15}',
                              '{"name": "xy", "n": 7}', 0.1)
    assert len(case.check([ref], [got])["ties"]) == 1
    # the same parting with the choices far apart is a failure, and says so
    ref, got, case = tie_case(grammar_model, "regex", REGEX, "yes 1234abc", "yes 1299abc", 2.0)
    with pytest.raises(CaseFailure, match="leads the token taken by 2.000, not a tie"):
        case.check([ref], [got])
    # a tie after which the output leaves the grammar
    ref, got, case = tie_case(grammar_model, "regex", REGEX, "yes 1234abc", "yes 12zz", 0.2)
    with pytest.raises(CaseFailure, match="a tie .* but after it token"):
        case.check([ref], [got])


def test_a_tie_outside_plains_top_list_is_told_by_each_servers_logprob_of_its_own_token(grammar_model):
    # CPU, the 1B models: 2048 of 3072 lm_head rows are zeros, so under a grammar many allowed
    # tokens tie at an exact 0 logit, more than a top list holds; argmax breaks the tie by kernel
    ref, got, case = tie_case(grammar_model, "regex", REGEX, "yes 1234abc", "yes 1299abc", 0.2)
    at = first_difference(got.ids[0], ref.ids[0])
    ref.top[0][at] = [(ref.ids[0][at], -2.0), (7, -2.0)]
    ref.logprobs[0] = [-0.1] * len(ref.ids[0])
    got.logprobs[0] = [-0.1] * len(got.ids[0])
    ref.logprobs[0][at], got.logprobs[0][at] = -2.0, -2.0
    assert [t["margin"] for t in case.check([ref], [got])["ties"]] == [0.0]
    got.logprobs[0][at] = -4.5  # the token taken is far less likely than plain's: a wrong choice
    with pytest.raises(CaseFailure, match="leads the token taken by 2.500, not a tie"):
        case.check([ref], [got])
    ref.logprobs[0], got.logprobs[0] = [], []
    with pytest.raises(CaseFailure, match="no logprobs to tell a tie by"):
        case.check([ref], [got])
    # one output the start of the other: no tie to speak of
    ref, got, case = tie_case(grammar_model, "regex", REGEX, "yes 1234abc", "yes 1234", 0.0)
    with pytest.raises(CaseFailure, match="first difference"):
        case.check([ref], [got])


def constrained_greedy(model: object, compiler: object, payload: dict, eos: int, vocab: int,
                       cached: bool) -> Outcome:
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
            top = torch.topk(lp, TIE_TOP)
            out.append(token)
            lps.append(float(lp[token]))
            tops.append([(int(i), float(v)) for v, i in zip(top.values, top.indices)])
            assert matcher.accept_token(token)
            ids.append(token)
            step = torch.tensor([[token]])
            if token == eos:
                break
    finish = ["stop", eos] if out and out[-1] == eos else ["length", None]
    return Outcome(ids=[out], text=[""], finish=[finish], logprobs=[lps], top=[tops])


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
    cases = {c.name: c for c in make_cases(expected, 64, str(target))}
    for name in ("json_schema", "regex"):
        case = cases[name]
        plain, other = (constrained_greedy(model, compiler, case.requests[0].payload, eos, vocab, cached)
                        for cached in (True, False))
        detail = case.check([plain], [other])  # equal, or parted at a tie and still allowed
        assert all(t["margin"] <= TIE_LOGITS for t in detail["ties"]), detail
        if name == "json_schema":  # without free whitespace, where it ends it ends with EOS (on an
            # AVX2-only CPU the tiny model's bf16 greedy answer runs to the cap inside a string)
            assert (plain.finish[0] == ["stop", eos]) == (len(plain.ids[0]) < CASE_TOKENS), plain.finish
        # the same answer with a token the grammar allows but the model ranks far below: no tie
        at, far = next((k, t) for k, pos in enumerate(plain.top[0]) for t, lp in pos[1:]
                       if math.isfinite(lp) and pos[0][1] - lp > 2 * TIE_LOGITS)
        wrong = Outcome(ids=[plain.ids[0][:at] + [far]], text=[""], finish=[["length", None]],
                          logprobs=[plain.logprobs[0][:at] + [dict(plain.top[0][at])[far]]], top=[[]])
        with pytest.raises(CaseFailure, match="not a tie"):
            case.check([plain], [wrong])


def test_a_top_logprob_may_move_by_the_rounding_of_its_logit_and_of_the_top_logit():
    # seen on a GPU (0.5.23, a 5/4/3 schedule): one step of a logit near 13 (0.0625) and one of
    # the top logit (16-32: 0.125) apart; the value's own magnitude (4-8) allows 0.175
    ref = [outcome([1], lps=[-0.01], top=[[(1, -0.01), (1179, -6.8168)]])]
    seen = [outcome([1], lps=[-0.01], top=[[(1, -0.01), (1179, -7.0037)]])]
    with pytest.raises(CaseFailure, match="tolerance 0.1750"):
        close_logprobs(ref, seen)  # a model of unknown logit scale: the value's magnitude alone
    assert close_logprobs(ref, seen, logit_scale=20.0)["max_logprob_diff"] == pytest.approx(0.1869)
    assert logprob_tolerance(-6.8168, logit_scale=20.0) == pytest.approx(0.05 + 2 * 0.125)
    # more than both roundings fails, at that scale too
    shifted = [outcome([1], lps=[-0.01], top=[[(1, -0.01), (1179, -7.2)]])]
    with pytest.raises(CaseFailure, match="token 1179 -7.2000"):
        close_logprobs(ref, shifted, logit_scale=20.0)
    # the top token's own logit and the log-sum-exp round together: no allowance for it
    top_moved = [outcome([1], lps=[-0.01], top=[[(1, -0.2), (1179, -6.8168)]])]
    with pytest.raises(CaseFailure, match="token 1 -0.2000"):
        close_logprobs(ref, top_moved, logit_scale=20.0)


def test_the_logprobs_case_checks_at_the_models_logit_scale():
    case = next(c for c in make_cases({**EXPECTED, "max_top_logit": 20.0}, 16, "m") if c.name == "logprobs")
    ref = [outcome([1], lps=[-0.01], top=[[(1, -0.01), (1179, -6.8168)]])] * 2
    seen = [outcome([1], lps=[-0.01], top=[[(1, -0.01), (1179, -7.0037)]])] * 2
    assert case.check(ref, seen)["max_logprob_diff"] == pytest.approx(0.1869)
    assert case.note == "logit scale 20"
    old_model = next(c for c in make_cases(EXPECTED, 16, "m") if c.name == "logprobs")
    with pytest.raises(CaseFailure, match="tolerance 0.1750"):
        old_model.check(ref, seen)
