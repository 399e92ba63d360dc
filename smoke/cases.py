"""The feature matrix's cases: what users send (greedy, logprobs, sampling, penalties, n > 1, a
long prompt, a JSON schema, a regex, streams, a stream closed early, stops), each with the
verdict that judges it and the load modes it runs under. No case needs a tokenizer: the prompts
are token ids, the stops are taken from the plain server's own output."""
from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from smoke.answers import Request
from smoke.grammar_check import Grammar
from smoke.tiers import LoadMode, MatrixPlan
from smoke.verdicts import (
    Outcome,
    close_logprobs,
    equal_text,
    equal_tokens,
    equal_until_tie,
    same_distribution,
    streams_closed,
)

# the loads a case runs under (smoke.loads), a threshold server's; on a schedule server each is one
# per tier or edge (on_tiers)
MODES = ("below", "above", "cross_up", "cross_down")
TIE_TOP = 5  # top logprobs the constrained cases ask for (tie_margin)
SAMPLES = 24             # sampled requests per run of the sampling case
CHUNKED_PREFILL = 512    # --chunked-prefill-size: the long-prompt case is longer
CASE_TOKENS = 192        # new tokens per request: long enough for a mode change mid-request
# a case's requests at once, at most (below N): at 2, the sampling case's 24 requests took 33-103 s
# under the filler (GPU, N=64), each pair queued behind it
CASE_CONCURRENCY = 8
STOP_REPEATS = 5         # the stop case's requests, each sent this many times (see stop_cases)


@dataclass(frozen=True)
class Case:
    """A case: its requests, the verdict on (the plain server's answers, the threshold server's),
    how many of its requests run at once, and the load modes it runs under."""
    name: str
    requests: tuple[Request, ...]
    check: Callable[[Sequence[Outcome], Sequence[Outcome]], dict[str, Any]]
    concurrency: int = 1
    note: str = ""
    modes: tuple[str | LoadMode, ...] = MODES


def generate(ids: Sequence[int], *, logprobs: int | None = None, **sampling: Any) -> Request:
    """A /generate request; logprobs: return them, with that many top logprobs per position."""
    params = {"temperature": 0, "max_new_tokens": CASE_TOKENS, "ignore_eos": True, **sampling}
    payload: dict[str, Any] = {"input_ids": list(ids), "sampling_params": params}
    if logprobs is not None:
        payload.update(return_logprob=True, top_logprobs_num=logprobs)
    return Request("generate", payload)


def make_cases(expected: dict[str, Any], threshold: int, model: str, seed: int = 0, *,
               concurrency: int | None = None) -> list[Case]:
    """The matrix's cases (references come from the plain server; no case needs a tokenizer here).
    `concurrency`: a case's requests at once at most, where not the threshold's (a schedule's:
    MatrixPlan.concurrency)."""
    rnd = random.Random(seed)
    vocab = int(expected["vocab_size"])

    def ids(n: int) -> list[int]:
        return [rnd.randrange(3, vocab) for _ in range(n)]

    # at most threshold - 1 running at once: "below" must stay below (the n=2 case runs alone); as
    # many as CASE_CONCURRENCY where N allows, as under the filler each round of a case's requests
    # waits behind its queue
    conc = max(1, min(CASE_CONCURRENCY, threshold - 1)) if concurrency is None else concurrency
    prompt_text = str(expected.get("prompt") or "def fibonacci(n):")
    # a temperature at which the first and second choice of the model are about 2:1 (the models'
    # top-1/top-2 margin is many logits, so temperature 1 would sample the greedy token every time)
    temperature = max(1.0, float(expected.get("mean_top1_top2_margin", 1.0)) / math.log(2))
    # the model's largest logit sets how coarsely bf16 rounds a logprob (smoke.verdicts); 0 for
    # models built before it was recorded
    logit_scale = float(expected.get("max_top_logit", 0.0))
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                          "n": {"type": "integer"}},
                         "required": ["name", "n"]})
    regex = "(yes|no) [0-9]{2,40}[a-f]+"
    cases = [
        Case("greedy", tuple(generate(ids(24)) for _ in range(2)), equal_tokens, conc),
        Case("logprobs", tuple(generate(ids(24), logprobs=5) for _ in range(2)),
             functools.partial(close_logprobs, logit_scale=logit_scale), conc,
             note=f"logit scale {logit_scale:g}" if logit_scale else ""),
        Case("sampling", tuple(generate(ids(16), logprobs=0, temperature=round(temperature, 3), top_p=1.0,
                                       max_new_tokens=48) for _ in range(SAMPLES)),
             same_distribution, conc, note=f"temperature {temperature:.2f}; statistical check"),
        Case("penalties", (generate(ids(24), frequency_penalty=1.5), generate(ids(24), presence_penalty=1.5),
                           generate(ids(24), repetition_penalty=1.5)), equal_tokens, conc),
        Case("n2", (generate(ids(24), n=2, max_new_tokens=96),), equal_tokens, 1),
        Case("long_prompt", (generate(ids(3 * CHUNKED_PREFILL + 37), max_new_tokens=96),), equal_tokens, 1,
             note=f"{3 * CHUNKED_PREFILL + 37} prompt tokens, chunked prefill {CHUNKED_PREFILL}"),
        Case("json_schema", (generate(ids(16), json_schema=schema, ignore_eos=False, logprobs=TIE_TOP),),
             equal_until_tie(Grammar("json_schema", schema, model, any_whitespace=False)), 1),
        Case("regex", (generate(ids(16), regex=regex, ignore_eos=False, logprobs=TIE_TOP),),
             equal_until_tie(Grammar("regex", regex, model)), 1),
        Case("completions_stream", (Request("completions_stream", {
            "model": model, "prompt": ids(24), "max_tokens": CASE_TOKENS, "temperature": 0,
            "stream": True}),), equal_text, 1),
        Case("chat_stream", (Request("chat_stream", {
            "model": model, "messages": [{"role": "user", "content": prompt_text}],
            "max_tokens": CASE_TOKENS, "temperature": 0, "stream": True}),), equal_text, 1),
        Case("abort_stream", tuple(Request("abort_stream", {
            "input_ids": ids(24), "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 2048, "ignore_eos": True}})
            for _ in range(2)), streams_closed, conc, modes=("below", "above"),
            note="the client closes the stream after 4 events, in each mode"),
    ]
    return cases


def on_tiers(case: Case, plan: MatrixPlan | None) -> Case:
    """The case with its modes a schedule server's (one per tier or edge: plan.expand); as it is
    on a threshold server (no plan)."""
    return case if plan is None else replace(case, modes=plan.expand(case.modes))


def stop_cases(base: Outcome, p: list[int]) -> list[Case]:
    """Stop token ids, stop strings and min_new_tokens, chosen from the plain server's own greedy
    output so that each stops early (a stop that never triggers would prove nothing)."""
    out_ids, text = base.ids[0], base.text[0]
    first: dict[int, int] = {}
    for i, t in enumerate(out_ids):
        first.setdefault(t, i)
    stop_at = next(i for i, t in enumerate(out_ids) if i >= 12 and first[t] == i)
    early = next(i for i, t in enumerate(out_ids) if i >= 2 and first[t] == i)
    later = next(i for i, t in enumerate(out_ids) if i >= early + 10 and first[t] == i)
    reqs = [generate(p, stop_token_ids=[out_ids[stop_at]], ignore_eos=False),
            # the earlier stop id comes before min_new_tokens: only the later one may stop it
            generate(p, stop_token_ids=[out_ids[early], out_ids[later]], min_new_tokens=early + 5,
                     ignore_eos=False)]
    piece = text[len(text) // 3: len(text) // 3 + 3]
    if piece.strip():
        reqs.append(generate(p, stop=[piece], ignore_eos=False))
    # each request stops within a few dozen tokens: sent STOP_REPEATS times one after the other,
    # the case runs as long as the others, so a mode change can happen while it is in flight
    return [Case("stop", tuple(reqs) * STOP_REPEATS, equal_tokens, 1,
                 note=f"stop id at token {stop_at}; min_new_tokens past a stop id at {early}, stop at {later}; "
                      f"stop string {piece!r}; each {STOP_REPEATS} times")]

