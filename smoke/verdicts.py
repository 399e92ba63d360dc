"""The feature matrix's verdicts: when a threshold server's answers to a case equal the plain
server's (the reference, always). Each check takes both servers' Outcomes and returns what it
measured, or raises CaseFailure naming the first difference.

What "equal" means per case (the reference is always the plain server):
  greedy, stop, penalties, n>1, long prompts, KV pressure: token ids (and finish reason) equal;
    streams: the streamed text equal.
  constrained (JSON schema, regex): token ids equal up to a tie, if any: a position where the token
    the threshold server took lies within TIE_LOGITS of the plain server's choice (by the plain
    server's top logprobs where they list it, else by each server's logprob of its own token).
    Under a grammar mask the models' designed margin is gone: most allowed tokens have an lm_head
    row of zeros (logit exactly 0, a tie that argmax breaks by kernel), the others lie a few
    hundredths apart, and the verify and decode kernels round them differently. From a tie on,
    the output must still be one the grammar allows (smoke.grammar_check). The servers run
    without JSON's free whitespace: with it the model writes whitespace after "{" to the end.
  logprobs: token ids equal; each returned logprob within LOGPROB_TOL plus LOGPROB_BF16_STEPS
    steps of bf16 at its magnitude of the plain server's (upstream's verify and decode kernels
    round differently, and bf16 resolves an unlikely token's logprob more coarsely); a top
    logprob other than the top token's, where more, within LOGIT_ROUNDING_STEPS steps at the
    model's logit scale: the LM head's output is bf16 (0.5.23 keeps it so), and such a logprob is
    its logit less the log-sum-exp, which the top logit sets, so each server's rounding of both
    logits moves it by up to a step at their magnitude (the top token's own rounding cancels).
  sampling (temperature > 0): speculative sampling draws other random numbers than plain decoding,
    so outputs cannot be equal token for token (upstream guarantees that only under
    --enable-deterministic-inference, which changes the kernels under test). The check is
    statistical: the mean logprob of the sampled tokens, per request, must not differ from the plain
    server's by more than SAMPLING_Z standard errors (a biased sampler, one that accepts draft
    tokens too often, samples likelier tokens and moves the mean).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from smoke.grammar_check import Grammar, first_break

LOGPROB_TOL = 0.05       # nats; decode and verify kernels round differently in bf16 ...
LOGPROB_BF16_STEPS = 4   # ... by a few steps of bf16 (8 significant bits) at the value's magnitude:
                         # seen on a GPU, 0.5.23, in pure speculation too (below the threshold):
                         # -27.69 vs -27.38 (2.5 steps), -16.25 vs -16.50 (2 steps)
# ... or, where more, this many steps at the model's largest logit (its logit scale): one server's
# rounding of a logit and of the top logit (which sets the log-sum-exp) is at most half a step each,
# two servers' a step each. Seen on a GPU (0.5.23, a 5/4/3 schedule): -7.0037 vs -6.8168, one step
# of a logit near 13 and one of the top logit (16-32): 0.0625 + 0.125
LOGIT_ROUNDING_STEPS = 2
# two choices closer than this (logits) are a tie that rounding may break either way: the same
# token's logprob differed by up to 0.19 between the plain and the threshold server (GPU, the
# logprobs case), so two tokens may move 0.38 against each other
TIE_LOGITS = 0.5
SAMPLING_Z = 4.5         # a false alarm about once in 150,000 checks


class CaseFailure(Exception):
    """One case failed under one mode: the cause, and nothing else stops."""


@dataclass
class Outcome:
    """A request's answer as the verdicts read it, or the error that stopped it."""
    ids: list[list[int]] = field(default_factory=list)      # one list per choice (n > 1: several)
    text: list[str] = field(default_factory=list)
    finish: list[Any] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    top: list[list[list[tuple[int, float]]]] = field(default_factory=list)
    error: str | None = None


def no_errors(outs: Sequence[Outcome], who: str) -> None:
    bad = [o.error for o in outs if o.error]
    if bad:
        raise CaseFailure(f"{who}: {len(bad)} request(s) failed, first: {bad[0]}")


def equal_tokens(ref: Sequence[Outcome], got: Sequence[Outcome]) -> dict[str, Any]:
    no_errors(got, "threshold server")
    for i, (r, g) in enumerate(zip(ref, got)):
        if (g.ids, g.finish) != (r.ids, r.finish):
            for c, (a, b) in enumerate(zip(g.ids, r.ids)):
                at = first_difference(a, b)
                if at is not None:
                    raise CaseFailure(f"request {i} choice {c}: first difference at token {at}: got "
                                      f"{a[at:at + 5]} expected {b[at:at + 5]} (lengths {len(a)}/{len(b)})")
            raise CaseFailure(f"request {i}: finish {g.finish} / {len(g.ids)} choice(s), plain server "
                              f"{r.finish} / {len(r.ids)}")
    return {"requests": len(got)}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where a and b differ (the shorter one's length if one begins the other),
    None if they are equal."""
    if list(a) == list(b):
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tie_margin(ref: Outcome, got: Outcome, choice: int, at: int) -> float | None:
    """By how much (nats, as logits) the plain server's token at `at` leads the one the threshold
    server took there: from the plain server's top logprobs where they list the latter, else from
    each server's logprob of its own token (ties among many tokens at an exact 0 logit outnumber
    any top list); None without logprobs."""
    top = dict(ref.top[choice][at]) if at < len(ref.top[choice]) else {}
    chosen, taken = ref.ids[choice][at], got.ids[choice][at]
    if chosen in top and taken in top:
        return top[chosen] - top[taken]
    mine, theirs = ref.logprobs[choice], got.logprobs[choice]
    if at < len(mine) and at < len(theirs):
        return mine[at] - theirs[at]
    return None


def equal_until_tie(grammar: Grammar) -> Callable[[Sequence[Outcome], Sequence[Outcome]], dict[str, Any]]:
    """The constrained cases' check (see the module's docstring): the requests ask for logprobs,
    so that the answers say where a choice was a tie."""

    def check(ref: Sequence[Outcome], got: Sequence[Outcome]) -> dict[str, Any]:
        no_errors(got, "threshold server")
        ties: list[dict[str, Any]] = []
        for i, (r, g) in enumerate(zip(ref, got)):
            if len(g.ids) != len(r.ids):
                raise CaseFailure(f"request {i}: {len(g.ids)} choice(s), plain server {len(r.ids)}")
            for c, (a, b) in enumerate(zip(g.ids, r.ids)):
                at = first_difference(a, b)
                if at is None:
                    if g.finish[c] != r.finish[c]:
                        raise CaseFailure(f"request {i} choice {c}: finish {g.finish[c]}, plain server "
                                          f"{r.finish[c]}")
                    continue
                head = (f"request {i} choice {c}: first difference at token {at}: got {a[at:at + 5]} "
                        f"expected {b[at:at + 5]} (lengths {len(a)}/{len(b)})")
                if at >= min(len(a), len(b)):
                    raise CaseFailure(head)
                margin = tie_margin(r, g, c, at)
                if margin is None:
                    raise CaseFailure(f"{head}; no logprobs to tell a tie by")
                if margin > TIE_LOGITS:
                    raise CaseFailure(f"{head}; the plain server's choice there leads the token taken by "
                                      f"{margin:.3f}, not a tie (at most {TIE_LOGITS})")
                broken = first_break(grammar, a)
                if broken:
                    raise CaseFailure(f"{head}; a tie ({margin:.3f} apart), but after it {broken}")
                ties.append({"request": i, "at": at, "margin": round(margin, 4)})
        return {"requests": len(got), "ties": ties}

    return check


def equal_text(ref: Sequence[Outcome], got: Sequence[Outcome]) -> dict[str, Any]:
    no_errors(got, "threshold server")
    for i, (r, g) in enumerate(zip(ref, got)):
        if g.text != r.text or g.finish != r.finish:
            a, b = g.text[0], r.text[0]
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise CaseFailure(f"stream {i}: text differs at character {at}: got {a[at:at + 20]!r} "
                              f"expected {b[at:at + 20]!r}; finish {g.finish} vs {r.finish}")
    return {"requests": len(got), "chars": sum(len(o.text[0]) for o in got)}


def bf16_step(x: float) -> float:
    """The spacing of bf16 numbers at |x| (8 significant bits): 0.125 between 16 and 32."""
    return math.ldexp(1.0, math.frexp(abs(x))[1] - 8) if x else 0.0


def logprob_tolerance(plain: float, tol: float = LOGPROB_TOL, logit_scale: float = 0.0) -> float:
    """How far a threshold server's logprob may lie from the plain server's `plain`; `logit_scale`:
    the model's largest logit (0: unknown, the value's own magnitude alone)."""
    return tol + max(LOGPROB_BF16_STEPS * bf16_step(plain),
                     LOGIT_ROUNDING_STEPS * bf16_step(max(abs(plain), logit_scale)))


def close_logprobs(ref: Sequence[Outcome], got: Sequence[Outcome], tol: float = LOGPROB_TOL,
                   logit_scale: float = 0.0) -> dict[str, Any]:
    equal_tokens(ref, got)
    worst = 0.0
    for i, (r, g) in enumerate(zip(ref, got)):
        if len(g.logprobs[0]) != len(r.logprobs[0]) or not r.logprobs[0]:
            raise CaseFailure(f"request {i}: {len(g.logprobs[0])} output logprobs, plain server "
                              f"{len(r.logprobs[0])}")
        for k, (a, b) in enumerate(zip(g.logprobs[0], r.logprobs[0])):
            worst = max(worst, abs(a - b))
            if abs(a - b) > logprob_tolerance(b, tol):
                raise CaseFailure(f"request {i} token {k}: logprob {a:.4f}, plain server {b:.4f} "
                                  f"(tolerance {logprob_tolerance(b, tol):.4f})")
        if len(g.top[0]) != len(r.top[0]):
            raise CaseFailure(f"request {i}: top logprobs at {len(g.top[0])} positions, plain "
                              f"server {len(r.top[0])}")
        for k, (gt, rt) in enumerate(zip(g.top[0], r.top[0])):
            want = dict(rt)
            for tok, lp in gt:
                if tok in want:
                    # the top token's own logit and the log-sum-exp move together: its rounding cancels
                    bound = logprob_tolerance(want[tok], tol, 0.0 if tok == rt[0][0] else logit_scale)
                    worst = max(worst, abs(lp - want[tok]))
                    if abs(lp - want[tok]) > bound:
                        raise CaseFailure(f"request {i} position {k}: top logprob of token {tok} "
                                          f"{lp:.4f}, plain server {want[tok]:.4f} (tolerance "
                                          f"{bound:.4f})")
            if gt[:1] and rt[:1] and gt[0][0] != rt[0][0]:
                raise CaseFailure(f"request {i} position {k}: top-1 token {gt[0][0]}, plain server "
                                  f"{rt[0][0]}")
    return {"requests": len(got), "max_logprob_diff": round(worst, 5)}


def mean_logprob(outs: Sequence[Outcome]) -> list[float]:
    return [statistics.fmean(o.logprobs[0]) for o in outs if o.logprobs and o.logprobs[0]]


def same_distribution(ref: Sequence[Outcome], got: Sequence[Outcome], z_max: float = SAMPLING_Z) -> dict[str, Any]:
    """Welch's z of the per-request mean logprob of the sampled tokens, threshold vs plain server."""
    no_errors(got, "threshold server")
    a, b = mean_logprob(got), mean_logprob(ref)
    if len(a) < 2 or len(b) < 2:
        raise CaseFailure(f"sampling: too few requests with logprobs ({len(a)}, plain {len(b)})")
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    diff = statistics.fmean(a) - statistics.fmean(b)
    z = diff / se if se > 0 else (0.0 if diff == 0 else math.inf)
    distinct = len({tuple(o.ids[0]) for o in got})
    if abs(z) > z_max:
        raise CaseFailure(f"sampling: mean logprob of sampled tokens {statistics.fmean(a):.4f} vs "
                          f"plain {statistics.fmean(b):.4f}: z = {z:.2f} (limit {z_max})")
    return {"requests": len(got), "mean_logprob": round(statistics.fmean(a), 4),
            "plain_mean_logprob": round(statistics.fmean(b), 4), "z": round(z, 2),
            "distinct_outputs": distinct}


def streams_closed(ref: Sequence[Outcome], got: Sequence[Outcome]) -> dict[str, Any]:
    """Streams closed by the client after a few events: each must have started (the KV pool check
    after the run shows that the server let go of them)."""
    no_errors(got, "threshold server")
    events = [int(o.text[0]) for o in got]
    if min(events) < 1:
        raise CaseFailure(f"a stream closed early sent no event before the close ({events})")
    return {"requests": len(got), "events_before_close": events}

