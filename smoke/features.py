"""Feature matrix: what users send, checked across the threshold server's mode changes.

    python -m smoke features --models DIR --out DIR [--threshold N] [--variants overlap,sync]
                             [--parallel-variants]

A plain server (the reference) and an EAGLE-3 server with the threshold run side by side. Each case
sends the same requests to both; on the threshold server it runs four times, under four loads:
  below       alone: the batch stays under the threshold (speculative steps only)
  above       while a filler load of 4N long greedy requests runs (plain steps only)
  cross_up    the filler arrives while the case's requests run (speculative -> plain mid-request)
  cross_down  the filler leaves while they run (plain -> speculative mid-request)
A crossing is not assumed from timing: the runner watches the server's mode and fails the case if
the change did not happen while the case's requests were in flight. After every run of a case the
KV pool must be back to its idle size. The KV-pressure case runs once per server, with 256
concurrent requests against a pool that holds 2N whole filler requests and no more (pool_tokens),
so that the scheduler retracts requests in both modes.

The matrix keeps its deadline: each request takes its timeout from the time left as it starts, a
case starts only with time left for it, and a case the deadline cuts short is skipped, not failed.
What is finished is kept in the resume state as it ends (the references case by case, each variant's
cases one by one): the next call with the same state runs only what is missing. A line is printed as
each piece ends.

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
    round differently, and bf16 resolves an unlikely token's logprob more coarsely).
  sampling (temperature > 0): speculative sampling draws other random numbers than plain decoding,
    so outputs cannot be equal token for token (upstream guarantees that only under
    --enable-deterministic-inference, which changes the kernels under test). The check is
    statistical: the mean logprob of the sampled tokens, per request, must not differ from the plain
    server's by more than SAMPLING_Z standard errors (a biased sampler, one that accepts draft
    tokens too often, samples likelier tokens and moves the mean).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import random
import re
import statistics
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smoke import client
from smoke.checks import check_kv_back, check_log_clean, spec_state, wait_idle
from smoke.deadline import Deadline
from smoke.grammar_check import Grammar, first_break
from smoke.runner import (
    DEFAULT_THRESHOLD,
    REFERENCE_CONCURRENCY,
    comma_list,
    exit_code,
    side_by_side,
    side_port,
)
from smoke.server import Server, ServerConfig, SmokeError, log_tail

MODES = ("below", "above", "cross_up", "cross_down")
CASE_NAMES = ("greedy", "logprobs", "sampling", "penalties", "n2", "long_prompt", "json_schema", "regex",
              "completions_stream", "chat_stream", "abort_stream", "stop", "kv_pressure")
LOGPROB_TOL = 0.05       # nats; decode and verify kernels round differently in bf16 ...
LOGPROB_BF16_STEPS = 4   # ... by a few steps of bf16 (8 significant bits) at the value's magnitude:
                         # seen on a GPU, 0.5.23, in pure speculation too (below the threshold):
                         # -27.69 vs -27.38 (2.5 steps), -16.25 vs -16.50 (2 steps)
# two choices closer than this (logits) are a tie that rounding may break either way: the same
# token's logprob differed by up to 0.19 between the plain and the threshold server (GPU, the
# logprobs case), so two tokens may move 0.38 against each other
TIE_LOGITS = 0.5
TIE_TOP = 5  # top logprobs the constrained cases ask for (tie_margin)
SAMPLING_Z = 4.5         # a false alarm about once in 150,000 checks
SAMPLES = 24             # sampled requests per run of the sampling case
MIN_POOL_TOKENS = 16384  # --max-total-tokens of both servers at least (see pool_tokens)
CHUNKED_PREFILL = 512    # --chunked-prefill-size: the long-prompt case is longer
PRESSURE_REQUESTS = 256
# new tokens per pressure request: long, so that requests admitted together outgrow what admission
# reserves for them (a share of max_new_tokens) before any can finish; with 96-160 early finishes
# made room as fast as the rest grew (GPU, 0.5.23: the pool peaked at 75%, nothing retracted)
PRESSURE_NEW_TOKENS = (384, 448, 512)
PRESSURE_PROMPT_TOKENS = (24, 64)  # fewest and most prompt tokens of a pressure request
# the pressure requests admitted together must need this many times the pool before one can finish
PRESSURE_OVERFILL = 1.5
# the filler: 4N requests of FILLER_PROMPT_TOKENS, each FILLER_NEW_TOKENS long while it keeps the
# batch above N ("above", "cross_up"), CROSS_DOWN_NEW_TOKENS when it must leave mid-case
FILLER_PROMPT_TOKENS = 32
FILLER_NEW_TOKENS = 400
CROSS_DOWN_NEW_TOKENS = 64
# the pool holds this many times N whole filler requests: admission reserves up to a request's whole
# length after a retraction (GPU, 0.5.23, N=64: a pool of 16,384 tokens ran 37 filler requests, and
# the batch never passed the threshold)
FILLER_POOL_FACTOR = 2
CASE_TOKENS = 192        # new tokens per request: long enough for a mode change mid-request
# a case's requests at once, at most (below N): at 2, the sampling case's 24 requests took 33-103 s
# under the filler (GPU, N=64), each pair queued behind it
CASE_CONCURRENCY = 8
STOP_REPEATS = 5         # the stop case's requests, each sent this many times (see stop_cases)
ATTEMPTS = 3             # runs of a case under a crossing mode before "the mode did not change" fails
RETRACT_LOG = re.compile(r"Retract requests")  # the scheduler's warning (not `retraction_policy`)
SCHEDULE_CONSERVATIVENESS = 0.2  # admit against ~14% of max_new_tokens, so 256 requests overfill the pool
# The deadline: every request ends REQUEST_MARGIN_S before it, and none starts with less than
# MIN_REQUEST_S left (Deadline.request_budget).
REQUEST_CAP_S = 600.0    # a request that hangs fails after this long, deadline or not
DEADLINE = "deadline: "  # an Outcome's error that starts so: the deadline, not the server, stopped it
# A case starts only with this much left (beyond the margin): the slowest case of this call so far,
# half again (the cases differ: stop repeats its requests, a crossing may need all ATTEMPTS), and at
# least CASE_RESERVE_MIN_S (the first case has no measure yet; four modes' waits for the mode and for
# the pool alone take about a minute). A case cut short is run again whole by the next call.
CASE_RESERVE_FACTOR = 1.5
CASE_RESERVE_MIN_S = 90.0
# A run of one mode starts only with this much left (beyond the margin): before its requests go out
# it may wait 20 s for the filler to move the mode and 10 s for its first request to run.
MODE_RESERVE_S = 45.0
# The resume state is written by the variants' threads at once (each its own entries); the caller's
# save_state reads all of it.
STATE_LOCK = threading.Lock()


def pool_tokens(threshold: int) -> int:
    """--max-total-tokens of the matrix's servers: room for FILLER_POOL_FACTOR x N whole filler
    requests (else the filler cannot hold the batch above N), at least MIN_POOL_TOKENS."""
    return max(MIN_POOL_TOKENS, FILLER_POOL_FACTOR * threshold * (FILLER_PROMPT_TOKENS + FILLER_NEW_TOKENS))


def pressure_overfill(pool: int) -> float:
    """How many times the pool the pressure requests admitted together need before the first can
    finish: all of them if their reservations fit (their prompts and a share of max_new_tokens,
    sglang's initial new-token ratio 0.7 x the conservativeness), else as many as do."""
    prompt = statistics.fmean(PRESSURE_PROMPT_TOKENS)
    new = statistics.fmean(PRESSURE_NEW_TOKENS)
    reserved = prompt + 0.7 * SCHEDULE_CONSERVATIVENESS * new
    admitted = min(PRESSURE_REQUESTS, pool / reserved)
    return admitted * (prompt + min(PRESSURE_NEW_TOKENS)) / pool


def max_threshold() -> int:
    """The largest N whose pool the pressure case still overfills."""
    return max((n for n in range(2, PRESSURE_REQUESTS + 1)
                if pressure_overfill(pool_tokens(n)) >= PRESSURE_OVERFILL), default=1)


def check_threshold(threshold: int, flag: str = "--threshold") -> None:
    """SystemExit naming the cause and the fix for an N the matrix cannot run."""
    if threshold < 2:
        raise SystemExit(f"{flag} {threshold}: the feature matrix needs N >= 2 (its 'below' runs need "
                         "one request under the threshold)")
    if threshold > max_threshold():
        raise SystemExit(f"{flag} {threshold}: the feature matrix holds the batch above N with 4N requests, "
                         f"which needs a KV pool of {pool_tokens(threshold)} tokens; its KV-pressure case "
                         f"({PRESSURE_REQUESTS} requests) cannot overfill a pool that large. Run the matrix "
                         f"with N <= {max_threshold()}")


class DeadlineReached(Exception):
    """Too little time is left to start the named server, or to finish its work: the next call
    resumes there."""


class CaseInterrupted(Exception):
    """The deadline stopped a case (not the server): skipped, and run again by the next call."""


class CaseFailure(Exception):
    """One case failed under one mode: the cause, and nothing else stops."""


class NotExercised(CaseFailure):
    """The load did not move the mode as the run needed (timing): tried again, then a failure."""


# ----------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class Request:
    """One request of a case: `kind` picks the endpoint and how its answer is read."""
    kind: str                       # generate | completions_stream | chat_stream | abort_stream
    payload: dict[str, Any]


@dataclass
class Outcome:
    ids: list[list[int]] = field(default_factory=list)      # one list per choice (n > 1: several)
    text: list[str] = field(default_factory=list)
    finish: list[Any] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    top: list[list[list[tuple[int, float]]]] = field(default_factory=list)
    error: str | None = None


def _finish(meta: dict[str, Any]) -> Any:
    fr = meta.get("finish_reason")
    if isinstance(fr, dict):  # {"type": "stop", "matched": id or str} / {"type": "length", ...}
        return [fr.get("type"), fr.get("matched")]
    return fr


def read_generate(answer: Any) -> Outcome:
    out = Outcome()
    for item in answer if isinstance(answer, list) else [answer]:
        meta = item.get("meta_info") or {}
        if item.get("output_ids") is None:
            raise CaseFailure(f"no output_ids in the answer: {str(item)[:300]}")
        out.ids.append(list(item["output_ids"]))
        out.text.append(item.get("text") or "")
        out.finish.append(_finish(meta))
        out.logprobs.append([float(t[0]) for t in meta.get("output_token_logprobs") or []])
        out.top.append([[(int(t[1]), float(t[0])) for t in pos or []]
                        for pos in meta.get("output_top_logprobs") or []])
    return out


def sse_events(url: str, payload: dict[str, Any], timeout: float,
               stop_after: int | None = None) -> list[dict[str, Any]]:
    """The JSON events of a server-sent-events answer; with stop_after, the connection is closed
    after that many (the server must abort the request). `timeout` bounds the whole stream (the
    socket's own timeout bounds each read only)."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    events: list[dict[str, Any]] = []
    ends_at = time.time() + timeout
    with urllib.request.urlopen(req, timeout=timeout) as answer:
        for raw in answer:
            if time.time() > ends_at:
                raise TimeoutError(f"the stream ran past its timeout ({timeout:.0f}s)")
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            events.append(json.loads(data))
            if stop_after is not None and len(events) >= stop_after:
                break
    return events


def read_stream(events: list[dict[str, Any]], chat: bool) -> Outcome:
    text, finish = [], None
    for ev in events:
        if "error" in ev:
            raise CaseFailure(f"error event in the stream: {str(ev)[:300]}")
        for ch in ev.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
            text.append(piece or "")
            finish = ch.get("finish_reason") or finish
    return Outcome(text=["".join(text)], finish=[finish])


def cut_by_deadline(outs: Sequence[Outcome]) -> bool:
    """Whether the deadline stopped one of these requests (or kept it from starting)."""
    return any(o.error is not None and o.error.startswith(DEADLINE) for o in outs)


def send(base: str, req: Request, deadline: Deadline, cap: float = REQUEST_CAP_S) -> Outcome:
    """One request, its timeout taken from the deadline as it starts; one the deadline stopped or
    kept from starting answers an error that starts with DEADLINE."""
    timeout = deadline.request_budget(cap)
    if timeout is None:
        return Outcome(error=f"{DEADLINE}not started, {deadline.left():.0f}s left")
    try:
        return _send(base, req, timeout)
    except (client.HTTPFailure, OSError, ValueError) as exc:
        # a timeout the deadline shortened ran out with the deadline: not the server's failure
        why = DEADLINE if timeout < cap and deadline.request_budget(REQUEST_CAP_S) is None else ""
        return Outcome(error=f"{why}{type(exc).__name__}: {exc}"[:600])


def _send(base: str, req: Request, timeout: float) -> Outcome:
    try:
        if req.kind == "generate":
            return read_generate(client.post_json(base + "/generate", req.payload, timeout))
        if req.kind in ("completions_stream", "chat_stream"):
            path = "/v1/chat/completions" if req.kind == "chat_stream" else "/v1/completions"
            return read_stream(sse_events(base + path, req.payload, timeout), req.kind == "chat_stream")
        if req.kind == "abort_stream":
            events = sse_events(base + "/generate", req.payload, timeout, stop_after=4)
            return Outcome(text=[str(len(events))])
        raise ValueError(f"unknown request kind {req.kind}")
    except CaseFailure as exc:
        return Outcome(error=str(exc))


def send_all(base: str, reqs: Sequence[Request], concurrency: int, deadline: Deadline) -> list[Outcome]:
    if concurrency <= 1:
        return [send(base, r, deadline) for r in reqs]
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda r: send(base, r, deadline), reqs))


# ----------------------------------------------------------------------------- comparisons
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


def logprob_tolerance(plain: float, tol: float = LOGPROB_TOL) -> float:
    """How far a threshold server's logprob may lie from the plain server's `plain`."""
    return tol + LOGPROB_BF16_STEPS * bf16_step(plain)


def close_logprobs(ref: Sequence[Outcome], got: Sequence[Outcome], tol: float = LOGPROB_TOL) -> dict[str, Any]:
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
                    worst = max(worst, abs(lp - want[tok]))
                    if abs(lp - want[tok]) > logprob_tolerance(want[tok], tol):
                        raise CaseFailure(f"request {i} position {k}: top logprob of token {tok} "
                                          f"{lp:.4f}, plain server {want[tok]:.4f} (tolerance "
                                          f"{logprob_tolerance(want[tok], tol):.4f})")
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


# ----------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    name: str
    requests: tuple[Request, ...]
    check: Callable[[Sequence[Outcome], Sequence[Outcome]], dict[str, Any]]
    concurrency: int = 1
    note: str = ""
    modes: tuple[str, ...] = MODES


def _gen(ids: Sequence[int], *, logprobs: int | None = None, **sampling: Any) -> Request:
    """A /generate request; logprobs: return them, with that many top logprobs per position."""
    params = {"temperature": 0, "max_new_tokens": CASE_TOKENS, "ignore_eos": True, **sampling}
    payload: dict[str, Any] = {"input_ids": list(ids), "sampling_params": params}
    if logprobs is not None:
        payload.update(return_logprob=True, top_logprobs_num=logprobs)
    return Request("generate", payload)


def make_cases(expected: dict[str, Any], threshold: int, model: str, seed: int = 0) -> list[Case]:
    """The matrix's cases (references come from the plain server; no case needs a tokenizer here)."""
    rnd = random.Random(seed)
    vocab = int(expected["vocab_size"])

    def ids(n: int) -> list[int]:
        return [rnd.randrange(3, vocab) for _ in range(n)]

    # at most threshold - 1 running at once: "below" must stay below (the n=2 case runs alone); as
    # many as CASE_CONCURRENCY where N allows, as under the filler each round of a case's requests
    # waits behind its queue
    conc = max(1, min(CASE_CONCURRENCY, threshold - 1))
    prompt_text = str(expected.get("prompt") or "def fibonacci(n):")
    # a temperature at which the first and second choice of the model are about 2:1 (the models'
    # top-1/top-2 margin is many logits, so temperature 1 would sample the greedy token every time)
    temperature = max(1.0, float(expected.get("mean_top1_top2_margin", 1.0)) / math.log(2))
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                          "n": {"type": "integer"}},
                         "required": ["name", "n"]})
    regex = "(yes|no) [0-9]{2,40}[a-f]+"
    cases = [
        Case("greedy", tuple(_gen(ids(24)) for _ in range(2)), equal_tokens, conc),
        Case("logprobs", tuple(_gen(ids(24), logprobs=5) for _ in range(2)),
             close_logprobs, conc),
        Case("sampling", tuple(_gen(ids(16), logprobs=0, temperature=round(temperature, 3), top_p=1.0,
                                    max_new_tokens=48) for _ in range(SAMPLES)),
             same_distribution, conc, note=f"temperature {temperature:.2f}; statistical check"),
        Case("penalties", (_gen(ids(24), frequency_penalty=1.5), _gen(ids(24), presence_penalty=1.5),
                           _gen(ids(24), repetition_penalty=1.5)), equal_tokens, conc),
        Case("n2", (_gen(ids(24), n=2, max_new_tokens=96),), equal_tokens, 1),
        Case("long_prompt", (_gen(ids(3 * CHUNKED_PREFILL + 37), max_new_tokens=96),), equal_tokens, 1,
             note=f"{3 * CHUNKED_PREFILL + 37} prompt tokens, chunked prefill {CHUNKED_PREFILL}"),
        Case("json_schema", (_gen(ids(16), json_schema=schema, ignore_eos=False, logprobs=TIE_TOP),),
             equal_until_tie(Grammar("json_schema", schema, model, any_whitespace=False)), 1),
        Case("regex", (_gen(ids(16), regex=regex, ignore_eos=False, logprobs=TIE_TOP),),
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
    reqs = [_gen(p, stop_token_ids=[out_ids[stop_at]], ignore_eos=False),
            # the earlier stop id comes before min_new_tokens: only the later one may stop it
            _gen(p, stop_token_ids=[out_ids[early], out_ids[later]], min_new_tokens=early + 5,
                 ignore_eos=False)]
    piece = text[len(text) // 3: len(text) // 3 + 3]
    if piece.strip():
        reqs.append(_gen(p, stop=[piece], ignore_eos=False))
    # each request stops within a few dozen tokens: sent STOP_REPEATS times one after the other,
    # the case runs as long as the others, so a mode change can happen while it is in flight
    return [Case("stop", tuple(reqs) * STOP_REPEATS, equal_tokens, 1,
                 note=f"stop id at token {stop_at}; min_new_tokens past a stop id at {early}, stop at {later}; "
                      f"stop string {piece!r}; each {STOP_REPEATS} times")]


# ----------------------------------------------------------------------------- load modes
class Filler:
    """4N greedy requests that keep the threshold server's batch above the threshold. `rolling`: each
    slot sends its next request when one ends, until stop(); else each slot sends one. No request
    outlives the deadline's margin, and none starts past it."""

    def __init__(self, base: str, prompts: list[list[int]], max_new: int, tag: str, deadline: Deadline,
                 rolling: bool):
        self.base, self.max_new, self.tag, self.deadline, self.rolling = base, max_new, tag, deadline, rolling
        self.stopping = False
        self.current: dict[int, str] = {}
        self.pool = ThreadPoolExecutor(max_workers=len(prompts))
        self.futures = [self.pool.submit(self._slot, i, p) for i, p in enumerate(prompts)]

    def _slot(self, i: int, ids: list[int]) -> str | None:
        k = 0
        while not self.stopping:
            timeout = self.deadline.request_budget(REQUEST_CAP_S)
            if timeout is None:
                return None  # the case's own requests say that the deadline stopped the run
            rid = self.current[i] = f"{self.tag}-{i}-{k}"
            payload = {"input_ids": ids, "rid": rid, "sampling_params": {
                "temperature": 0, "max_new_tokens": self.max_new, "ignore_eos": True}}
            try:
                client.post_json(self.base + "/generate", payload, timeout)
            except client.HTTPFailure as exc:
                if not self.stopping and self.deadline.request_budget(REQUEST_CAP_S) is not None:
                    return f"filler request {rid}: {exc}"[:400]
            k += 1
            if not self.rolling:
                break
        return None

    def stop(self) -> None:
        self.stopping = True
        for rid in list(self.current.values()):
            try:
                client.abort(self.base, rid)
            except client.HTTPFailure:
                pass
        self.wait()

    def wait(self) -> None:
        errors = [e for e in (f.result() for f in self.futures) if e]
        self.pool.shutdown()
        if errors:
            raise CaseFailure(errors[0])


def wait_mode(base: str, mode: str, timeout: float = 20) -> bool:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if spec_state(client.server_info(base))["mode"] == mode:
            return True
        time.sleep(0.05)
    return False


def wait_running(base: str, n: int, timeout: float = 10) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout and client.load(base).get("num_running_reqs", 0) < n:
        time.sleep(0.01)


def stop_if_cut(case: Case, mode: str, outs: Sequence[Outcome]) -> None:
    """A run the deadline cut short proves nothing either way: the case is run again next call."""
    if cut_by_deadline(outs):
        raise CaseInterrupted(f"{case.name} {mode}: the deadline stopped its requests")


def run_under(mode: str, base: str, case: Case, filler_prompts: list[list[int]],
              deadline: Deadline) -> tuple[list[Outcome], dict[str, Any]]:
    """The case's requests on the threshold server under one load mode; what the mode did."""
    tag = f"filler-{case.name}-{mode}-{int(time.time() * 1000)}"

    seen: dict[str, Any] = {}
    # the cross modes: how long the case's requests ran and when the mode changed, both from their
    # start (a crossing that came too late says by how much)
    started = time.monotonic()

    def case_run() -> list[Outcome]:
        outs = send_all(base, case.requests, case.concurrency, deadline)
        seen["case_ran_s"] = round(time.monotonic() - started, 2)
        return outs

    if mode == "below":
        outs = case_run()
        stop_if_cut(case, mode, outs)
        return outs, seen
    with ThreadPoolExecutor(max_workers=1) as one:
        if mode == "above":
            filler = Filler(base, filler_prompts, FILLER_NEW_TOKENS, tag, deadline, rolling=True)
            seen["plain_before"] = wait_mode(base, "plain")
            outs = case_run()
            seen["plain_after"] = spec_state(client.server_info(base))["mode"] == "plain"
            filler.stop()
            stop_if_cut(case, mode, outs)
            if not (seen["plain_before"] and seen["plain_after"]):
                raise NotExercised(f"above: the server was not in plain mode for the whole case ({seen})")
            return outs, seen
        if mode == "cross_up":
            fut = one.submit(case_run)
            wait_running(base, 1)  # the case's first request is in the batch
            filler = Filler(base, filler_prompts, FILLER_NEW_TOKENS, tag, deadline, rolling=True)
            changed = wait_mode(base, "plain")
            seen["crossed_in_flight"] = changed and not fut.done()
        elif mode == "cross_down":
            # short: it ends while the case's requests (CASE_TOKENS new tokens) still run
            filler = Filler(base, filler_prompts, CROSS_DOWN_NEW_TOKENS, tag, deadline, rolling=False)
            plain_before = wait_mode(base, "plain")
            started = time.monotonic()
            fut = one.submit(case_run)
            changed = plain_before and wait_mode(base, "speculative")
            seen["crossed_in_flight"] = changed and not fut.done()
        else:
            raise ValueError(mode)
        seen["mode_changed_after_s"] = round(time.monotonic() - started, 2) if changed else None
        outs = fut.result()
        if mode == "cross_up":
            filler.stop()
        else:
            filler.wait()
    stop_if_cut(case, mode, outs)
    if not seen.get("crossed_in_flight"):
        raise NotExercised(f"{mode}: the mode did not change while the case's requests were in flight "
                          f"({seen}): the run proved nothing")
    return outs, seen


# ----------------------------------------------------------------------------- the matrix
def print_now(line: str) -> None:
    print(line, flush=True)


def nothing_to_save() -> None:
    pass


@dataclass
class FeatureOptions:
    models: Path
    out: Path
    threshold: int = DEFAULT_THRESHOLD
    variants: tuple[str, ...] = ("overlap", "sync")
    port: int = 30100
    mem_fraction: float = 0.12
    deadline: Deadline = field(default_factory=lambda: Deadline(time.time() + 3600))
    health_timeout: float = 480
    min_server_s: float = 150
    graph_bs: int = 64  # decode CUDA graphs captured up to this batch (at most PRESSURE_REQUESTS)
    # the variants' servers side by side, each on its own port, started at once: opt-in, as it
    # needs a GPU with memory for them all (SIDE_BY_SIDE_MEM_SHARE)
    parallel_variants: bool = False
    # the cases to run on the threshold servers (the plain server answers all of them): a subset
    # reruns what failed without the rest
    cases: tuple[str, ...] = CASE_NAMES
    # a line as each piece of work ends: a call stopped from outside still shows where it was
    progress: Callable[[str], None] = print_now
    # called (under STATE_LOCK) each time a piece of work is kept in the resume state: the caller
    # may write the state out, so that a call stopped from outside leaves it for the next
    save_state: Callable[[], None] = nothing_to_save


VARIANT_FLAGS = {"overlap": True, "sync": False}  # CUDA graphs on in both
# --mem-fraction-static of servers that start side by side: sglang keeps (1 - share) of the memory
# free before its weights load for what is not weights and KV pool, and takes the pool from what is
# free after them; a share this large leaves the pool (fixed: --max-total-tokens) whole whatever the
# other server takes meanwhile (1B models: a few GB each)
SIDE_BY_SIDE_MEM_SHARE = 0.6


def server_config(name: str, opts: FeatureOptions, *, draft: bool, overlap: bool = True) -> ServerConfig:
    # metrics on for the threshold server only; xgrammar for the constrained cases (JSON without
    # free whitespace: see the module's docstring); a pool sized for the filler and the pressure
    # case (pool_tokens), chunked prefill for the long-prompt case
    extra = ("--grammar-backend", "xgrammar", "--constrained-json-disable-any-whitespace",
             "--max-total-tokens", str(pool_tokens(opts.threshold)),
             "--chunked-prefill-size", str(CHUNKED_PREFILL),
             # at the default (1.0) 0.5.23 admitted so few requests that the pool stayed 59% full
             "--schedule-conservativeness", str(SCHEDULE_CONSERVATIVENESS))
    n = opts.threshold
    share = SIDE_BY_SIDE_MEM_SHARE if opts.parallel_variants else opts.mem_fraction
    return ServerConfig(name, opts.models / "target", draft=(opts.models / "draft") if draft else None,
                        threshold=n if draft else None, overlap=overlap, cuda_graph=True,
                        cuda_graph_max_bs=opts.graph_bs, max_running=PRESSURE_REQUESTS,
                        mem_fraction=share, enable_metrics=draft, extra=extra)


def pressure_requests(seed: int, vocab: int) -> tuple[Request, ...]:
    """Not ignore_eos: 0.5.23's admission reserves the whole max_new_tokens of such a request, so
    they never overfill the pool (GPU: nothing retracted). min_new_tokens keeps them as long."""
    rnd = random.Random(seed + 7)

    def one() -> Request:
        prompt = [rnd.randrange(3, vocab) for _ in range(rnd.randint(*PRESSURE_PROMPT_TOKENS))]
        new = rnd.choice(PRESSURE_NEW_TOKENS)
        return _gen(prompt, max_new_tokens=new, min_new_tokens=new, ignore_eos=False)

    return tuple(one() for _ in range(PRESSURE_REQUESTS))


def retractions(log: Path) -> int:
    return sum(1 for line in log.read_text(errors="replace").splitlines() if RETRACT_LOG.search(line))


def pool_back(base: str, baseline: dict[str, Any], deadline: Deadline, timeout: float = 30) -> None:
    """The KV pool back at its idle size after a run (wait_idle, ended by the deadline's margin). A
    wait the deadline cut short is no failure: the pool may still have been emptying."""
    allowed = min(timeout, deadline.left_for_requests())
    idle = wait_idle(base, baseline, timeout=max(0.0, allowed))
    try:
        check_kv_back(baseline, idle)
    except SmokeError as exc:
        if allowed < timeout:
            raise CaseInterrupted(f"the deadline came while the pool emptied: {exc.cause}") from exc
        raise CaseFailure(exc.cause) from exc


def run_case_mode(case: Case, mode: str, ref: list[Outcome], base: str, baseline: dict[str, Any],
                  filler_prompts: list[list[int]], deadline: Deadline) -> dict[str, Any]:
    before = spec_state(client.server_info(base))
    try:
        outs, seen = run_under(mode, base, case, filler_prompts, deadline)
        detail = case.check(ref, outs)
        after = spec_state(client.server_info(base))
        if mode == "below" and after["plain_steps"] - before["plain_steps"] > 1:
            raise CaseFailure(f"below: {after['plain_steps'] - before['plain_steps']} plain steps "
                              "while the batch stayed under the threshold")
        pool_back(base, baseline, deadline)
        # the steps, not only the mode: on 0.5.17 a batch holding a grammar or penalties keeps
        # speculating while the mode is plain (they are applied inside verification)
        return {"ok": True, **detail, **seen, "mode_changes": after["mode_changes"] - before["mode_changes"],
                "plain_steps": after["plain_steps"] - before["plain_steps"],
                "speculative_steps": after["speculative_steps"] - before["speculative_steps"]}
    except CaseFailure as exc:
        wait_idle(base, baseline, timeout=max(0.0, min(30, deadline.left_for_requests())))
        return {"ok": False, "cause": str(exc), "not_exercised": isinstance(exc, NotExercised)}


def run_case_modes(case: Case, ref: list[Outcome], base: str, baseline: dict[str, Any],
                   filler_prompts: list[list[int]], deadline: Deadline) -> dict[str, Any]:
    """Every mode of the case, a mode that did not move as it needed tried again; CaseInterrupted
    where the deadline leaves too little time for the next run."""
    rows: dict[str, Any] = {}
    for mode in case.modes:
        for attempt in range(1, ATTEMPTS + 1):
            if deadline.left_for_requests() < MODE_RESERVE_S:
                raise CaseInterrupted(f"{case.name} {mode}: not started, {deadline.left():.0f}s left")
            rows[mode] = run_case_mode(case, mode, ref, base, baseline, filler_prompts, deadline)
            rows[mode]["attempts"] = attempt
            if rows[mode]["ok"] or not rows[mode].get("not_exercised"):
                break
    return rows


def keep(opts: FeatureOptions, store: dict[str, Any], name: str, value: Any) -> None:
    """One finished piece of work into the resume state (`store` lies inside it)."""
    with STATE_LOCK:
        store[name] = value
        opts.save_state()


def references(opts: FeatureOptions, cases: list[Case], stop_prompt: list[int],
               state: dict[str, Any]) -> tuple[list[Case], dict[str, list[Outcome]]]:
    """Every case's answers from the plain server, kept in `state` case by case: a call the deadline
    stops keeps what it has (DeadlineReached), and the next asks the plain server only for the rest.
    The stop case is made from the plain server's greedy output for stop_prompt, so it is added here."""
    kept: dict[str, Any] = state.setdefault("refs", {})

    def all_cases() -> list[Case]:
        return cases + stop_cases(Outcome(**state["stop_base"]), stop_prompt)

    if "stop_base" not in state or any(c.name not in kept for c in all_cases()):
        answer_references(opts, cases, stop_prompt, state)
    every = all_cases()
    return every, {c.name: [Outcome(**o) for o in state["refs"][c.name]] for c in every}


def answer_references(opts: FeatureOptions, cases: list[Case], stop_prompt: list[int],
                      state: dict[str, Any]) -> None:
    """The plain server answers what `state` lacks. A failure forgets every answer kept so far (a
    failed plain server's answers are not trusted: the next call asks again); the deadline keeps
    them and raises DeadlineReached."""
    if opts.deadline.left() < opts.min_server_s:
        raise DeadlineReached("plain")
    log = opts.out / "features_plain.log"
    with Server(server_config("features_plain", opts, draft=False), opts.port, log) as srv:
        srv.start(min(opts.health_timeout, opts.deadline.left() - 60))
        opts.progress(f"features references: plain server up in {srv.start_seconds:.0f}s "
                      f"(left {opts.deadline.left():.0f}s)")
        try:
            finished = answer_missing(opts, srv.base, cases, stop_prompt, state, log)
            check_log_clean(srv.log_text())
        except (SmokeError, client.HTTPFailure):
            with STATE_LOCK:
                state.pop("refs", None)
                state.pop("stop_base", None)
                opts.save_state()
            raise
    if not finished:
        raise DeadlineReached("plain")


def answer_missing(opts: FeatureOptions, base: str, cases: list[Case], stop_prompt: list[int],
                   state: dict[str, Any], log: Path) -> bool:
    """The stop case's base request first (the stop case is made from its answer), then each case
    not in state["refs"], REFERENCE_CONCURRENCY requests at a time (as the smoke's references: the
    models' greedy outputs do not depend on the batch), each kept as it completes. False where the
    deadline stopped it."""
    if "stop_base" not in state:
        out = send(base, _gen(stop_prompt, max_new_tokens=64), opts.deadline)
        if cut_by_deadline([out]):
            opts.progress("features references: stopped by the deadline before the first case")
            return False
        if out.error:
            raise SmokeError(f"plain server: {out.error}", log=log)
        keep(opts, state, "stop_base", out.__dict__)
    kept: dict[str, Any] = state["refs"]
    todo = [c for c in cases + stop_cases(Outcome(**state["stop_base"]), stop_prompt) if c.name not in kept]
    opts.progress(f"features references: {len(todo)} case(s) to answer")
    for done, case in enumerate(todo):
        started = opts.deadline.left()
        outs = send_all(base, case.requests, REFERENCE_CONCURRENCY, opts.deadline)
        if cut_by_deadline(outs):
            opts.progress(f"features references: stopped by the deadline at {case.name}; "
                          f"{len(todo) - done} case(s) left for the next call")
            return False
        errs = [o.error for o in outs if o.error]
        if errs:
            raise SmokeError(f"plain server, case {case.name}: {errs[0]}", log=log)
        keep(opts, kept, case.name, [o.__dict__ for o in outs])
        opts.progress(f"features references: {case.name} {len(outs)} request(s) "
                      f"{started - opts.deadline.left():.1f}s (left {opts.deadline.left():.0f}s)")
    opts.progress("features references: done")
    return True


def run_features(opts: FeatureOptions, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The plain server's references, then each variant's matrix. `state` (a dict kept between
    calls) holds what is finished: the references case by case, each variant's finished cases
    (state["variant_cases"]) and its report once it ran to its end (state["variants"])."""
    state = state if state is not None else {}
    opts.out.mkdir(parents=True, exist_ok=True)
    expected = json.loads((opts.models / "expected.json").read_text())
    vocab = int(expected["vocab_size"])
    rnd = random.Random(99)
    stop_prompt = [rnd.randrange(3, vocab) for _ in range(24)]
    pressure = Case("kv_pressure", pressure_requests(0, vocab), equal_tokens, PRESSURE_REQUESTS,
                    modes=("above",),
                    note=f"{PRESSURE_REQUESTS} concurrent requests, pool of {pool_tokens(opts.threshold)} tokens")
    report: dict[str, Any] = {"threshold": opts.threshold, "variants": {}, "failures": [],
                              "pool_tokens": pool_tokens(opts.threshold)}
    if set(opts.cases) != set(CASE_NAMES):
        report["only_cases"] = [n for n in CASE_NAMES if n in opts.cases]
    early = spawn_variants_early(opts, state.setdefault("variants", {}))
    try:
        return run_matrix(opts, state, report, expected, stop_prompt, pressure, early)
    finally:
        for srv in early.values():  # those run_variant did not reach (it stops the others)
            srv.stop()


def spawn_variants_early(opts: FeatureOptions, done: dict[str, Any]) -> dict[str, Server]:
    """Side by side (opts.parallel_variants): the variants' servers spawned before the plain server
    starts for the references, so that they start while it starts and answers (their pools are
    fixed: server_config); run_variant waits for them. One that cannot be spawned is left to
    run_variant, which starts it and reports its failure."""
    early: dict[str, Server] = {}
    if not opts.parallel_variants or opts.deadline.left() < opts.min_server_s:
        return early
    for key in opts.variants:
        if key in done or key in early:
            continue
        cfg = server_config(f"features_{key}", opts, draft=True, overlap=VARIANT_FLAGS[key])
        srv = Server(cfg, side_port(opts.port, opts.variants, key), opts.out / f"features_{key}.log")
        try:
            srv.spawn()
        except SmokeError:
            continue
        early[key] = srv
    return early


def run_matrix(opts: FeatureOptions, state: dict[str, Any], report: dict[str, Any], expected: dict[str, Any],
               stop_prompt: list[int], pressure: Case, early: dict[str, Server]) -> dict[str, Any]:
    """run_features' work once its servers are spawned: the references, then the variants."""
    vocab = int(expected["vocab_size"])
    try:
        cases, refs = references(opts, make_cases(expected, opts.threshold, str(opts.models / "target"))
                                 + [pressure], stop_prompt, state)
    except DeadlineReached as exc:
        report["skipped"] = [str(exc)] + [f"{key}" for key in opts.variants]
        return report
    except (SmokeError, client.HTTPFailure) as exc:
        cause = exc.cause if isinstance(exc, SmokeError) else str(exc)
        report["failures"].append({"variant": "plain", "case": "-", "mode": "-", "cause": cause,
                                   "log_tail": log_tail(opts.out / "features_plain.log")})
        return report
    report["cases"] = {c.name: c.note for c in cases}
    done = state.setdefault("variants", {})
    cases_kept = state.setdefault("variant_cases", {})
    matrix = [c for c in cases if c is not pressure]
    if opts.parallel_variants:
        run_side_by_side(opts, matrix, refs, pressure, vocab, done, cases_kept, report, early)
    else:
        for key in opts.variants:
            if key in done:
                report["variants"][key] = done[key]
                continue
            if opts.deadline.left() < opts.min_server_s:
                report.setdefault("skipped", []).append(key)
                continue
            rep = run_variant(opts, key, matrix, refs, pressure, vocab, kept=cases_kept.setdefault(key, {}))
            report["variants"][key] = rep
            file_variant(done, cases_kept, key, rep)
    for key, rep in report["variants"].items():
        if rep.get("cause"):
            report["failures"].append({"variant": key, "case": "-", "mode": "-", "cause": rep["cause"],
                                       "log_tail": rep.get("log_tail")})
        for name in rep.get("skipped", []):
            report.setdefault("skipped", []).append(f"{key}: {name}")
        for name, rows in rep.get("cases", {}).items():
            for mode, row in rows.items():
                if isinstance(row, dict) and not row.get("ok"):
                    report["failures"].append({"variant": key, "case": name, "mode": mode,
                                               "cause": row.get("cause")})
    return report


def file_variant(done: dict[str, Any], cases_kept: dict[str, Any], key: str, rep: dict[str, Any],
                 crashed: bool = False) -> None:
    """A variant that ran to its end is done (the next call reuses its report); one the deadline
    stopped keeps its finished cases in `cases_kept` for the next call; one that crashed is run
    again whole."""
    if crashed:
        cases_kept.pop(key, None)
    elif not rep.get("skipped"):
        done[key] = rep
        cases_kept.pop(key, None)


def run_side_by_side(opts: FeatureOptions, cases: list[Case], refs: dict[str, Any], pressure: Case,
                     vocab: int, done: dict[str, Any], cases_kept: dict[str, Any],
                     report: dict[str, Any], early: dict[str, Server] | None = None) -> None:
    """run_features' variants at once, each server on its own port (side_port), those in `early`
    already spawned: the same skips, the same reports in the order of opts.variants. Each thread
    writes only its own variant's entry of `cases_kept`; `done` is written here only. A variant
    that raised is a failure of its own and is not kept (the next call reruns it)."""
    jobs: dict[str, Callable[[], dict[str, Any]]] = {}
    for key in opts.variants:
        if key in done or key in jobs:
            continue
        if opts.deadline.left() < opts.min_server_s:
            report.setdefault("skipped", []).append(key)
            continue
        jobs[key] = functools.partial(run_variant, opts, key, cases, refs, pressure, vocab,
                                      port=side_port(opts.port, opts.variants, key),
                                      kept=cases_kept.setdefault(key, {}),
                                      spawned=(early or {}).get(key))
    crashed: set[str] = set()

    def on_error(key: str, exc: Exception) -> dict[str, Any]:
        crashed.add(key)
        return {"overlap": VARIANT_FLAGS[key], "cuda_graph": True, "cases": {},
                "cause": f"runner error: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-1200:]}",
                "log_tail": log_tail(opts.out / f"features_{key}.log", 40)}

    reports = side_by_side(jobs, on_error)
    for key in opts.variants:
        if key in done:
            report["variants"][key] = done[key]
        elif key in reports:
            report["variants"][key] = reports[key]
            file_variant(done, cases_kept, key, reports[key], crashed=key in crashed)


def run_pressure(pressure: Case, ref: list[Outcome], base: str, baseline: dict[str, Any], log: Path,
                 deadline: Deadline) -> dict[str, Any]:
    """KV pressure: all requests at once into a small pool; retractions must happen and change nothing."""
    retract_before = retractions(log)
    before = spec_state(client.server_info(base))
    outs = send_all(base, pressure.requests, pressure.concurrency, deadline)
    stop_if_cut(pressure, "above", outs)
    try:
        row: dict[str, Any] = {"ok": True, **equal_tokens(ref, outs)}
        after = spec_state(client.server_info(base))
        for k in ("mode_changes", "plain_steps", "speculative_steps"):
            row[k] = after[k] - before[k]
        row["retract_log_lines"] = retractions(log) - retract_before
        if row["retract_log_lines"] == 0:
            raise CaseFailure("no request was retracted: the pool was not under pressure")
        pool_back(base, baseline, deadline, timeout=60)
    except (CaseFailure, SmokeError) as exc:
        row = {"ok": False, "cause": getattr(exc, "cause", str(exc))}
    return row


def case_verdict(rows: dict[str, Any]) -> str:
    failed = [mode for mode, row in rows.items() if isinstance(row, dict) and not row.get("ok")]
    return f"FAILED ({', '.join(failed)})" if failed else "ok"


def case_reserve(slowest: float) -> float:
    """The time a case needs left (beyond the margin) to start: see CASE_RESERVE_FACTOR."""
    return max(CASE_RESERVE_MIN_S, CASE_RESERVE_FACTOR * slowest)


def run_variant(opts: FeatureOptions, key: str, cases: list[Case], refs: dict[str, Any],
                pressure: Case, vocab: int, port: int | None = None,
                kept: dict[str, Any] | None = None, spawned: Server | None = None) -> dict[str, Any]:
    """One threshold server (on `port`, default opts.port + 1; `spawned`: already spawned there by
    spawn_variants_early, waited for here): every case under every mode, then the pressure case.
    `kept` (this variant's finished cases in the resume state) gets each case as it ends, and the
    cases already in it are not run again. The cases the deadline left or cut short
    are listed in rep["skipped"]: the next call runs them."""
    kept = kept if kept is not None else {}
    log = opts.out / f"features_{key}.log"
    cfg = server_config(f"features_{key}", opts, draft=True, overlap=VARIANT_FLAGS[key])
    rep: dict[str, Any] = {"overlap": VARIANT_FLAGS[key], "cuda_graph": True, "cases": {}}
    rnd = random.Random(5)
    filler_prompts = [[rnd.randrange(3, vocab) for _ in range(FILLER_PROMPT_TOKENS)]
                      for _ in range(4 * opts.threshold)]
    todo = [c for c in [*cases, pressure] if c.name in opts.cases and c.name not in kept]
    srv = spawned or Server(cfg, opts.port + 1 if port is None else port, log)
    try:
        timeout = min(opts.health_timeout, opts.deadline.left() - 60)
        if spawned is not None:
            srv.wait_healthy(timeout)
        else:
            srv.start(timeout)
        rep["start_s"] = round(srv.start_seconds, 1)
        early = " (spawned beside the plain server)" if spawned is not None else ""
        opts.progress(f"features {key}: server up in {srv.start_seconds:.0f}s{early}, {len(todo)} case(s) "
                      f"to run (left {opts.deadline.left():.0f}s)")
        baseline = wait_idle(srv.base, client.load(srv.base))
        skipped = run_cases(opts, key, todo, refs, pressure, srv.base, baseline, filler_prompts, log, kept)
        if skipped:
            rep["skipped"] = skipped
        if not srv.alive():
            raise SmokeError("server process died during the matrix")
        check_log_clean(srv.log_text())
    except (SmokeError, client.HTTPFailure) as exc:
        rep["cause"] = exc.cause if isinstance(exc, SmokeError) else f"HTTP failure: {exc}"
        rep["log_tail"] = log_tail(log, 40)
    finally:
        srv.stop()
    rep["cases"] = {c.name: kept[c.name] for c in [*cases, pressure] if c.name in kept}
    return rep


def run_cases(opts: FeatureOptions, key: str, todo: list[Case], refs: dict[str, Any], pressure: Case,
              base: str, baseline: dict[str, Any], filler_prompts: list[list[int]], log: Path,
              kept: dict[str, Any]) -> list[str]:
    """The cases of `todo` one after the other on variant `key`'s server, each kept as it ends; the
    names of those the deadline left to the next call."""
    skipped: list[str] = []
    slowest = 0.0
    for case in todo:
        if opts.deadline.left_for_requests() < case_reserve(slowest):
            skipped.append(case.name)
            continue
        started = opts.deadline.left()
        rows: dict[str, Any]
        try:
            if case is pressure:
                rows = {"above": run_pressure(case, refs[case.name], base, baseline, log, opts.deadline)}
            else:
                rows = run_case_modes(case, refs[case.name], base, baseline, filler_prompts, opts.deadline)
        except CaseInterrupted as exc:
            skipped.append(case.name)
            opts.progress(f"features {key}: {case.name} stopped by the deadline: {exc}")
            continue
        seconds = started - opts.deadline.left()
        slowest = max(slowest, seconds)
        rows["seconds"] = round(seconds, 1)
        keep(opts, kept, case.name, rows)
        opts.progress(f"features {key}: {case.name} {case_verdict(rows)} {seconds:.1f}s "
                      f"(left {opts.deadline.left():.0f}s)")
    if skipped:
        opts.progress(f"features {key}: left for the next call: {', '.join(skipped)}")
    return skipped


def tie_note(row: dict[str, Any]) -> str:
    """", tie at 17 (0.062)": where a constrained output parted from plain's at a tie."""
    return "".join(f", tie at {t['at']} ({t['margin']})" for t in row.get("ties") or [])


def summarize(report: dict[str, Any]) -> str:
    """A line per case: each mode's result, with (mode changes, plain/speculative steps)."""
    lines = [f"features: threshold={report['threshold']} pool={report.get('pool_tokens')} tokens"
             + (f"; only the cases {', '.join(report['only_cases'])}" if report.get("only_cases") else "")]
    for key, rep in report.get("variants", {}).items():
        lines.append(f"  {key}: overlap={rep.get('overlap')} cuda_graph={rep.get('cuda_graph')} "
                     f"start {rep.get('start_s')}s")
        for name, rows in rep.get("cases", {}).items():
            cells = [f"{mode} " + (f"PASS({row.get('mode_changes')}, {row.get('plain_steps')}p/"
                                   f"{row.get('speculative_steps')}s{tie_note(row)})" if row.get("ok") else "FAIL")
                     for mode, row in rows.items() if isinstance(row, dict)]
            lines.append(f"    {name:20s} " + "  ".join(cells) + f"  [{rows.get('seconds', '-')}s]")
    for s in report.get("skipped", []):
        lines.append(f"  SKIPPED {s}")
    for f in report.get("failures", []):
        lines.append(f"FEATURE FAILED [{f['variant']} {f['case']} {f['mode']}]: {f['cause']}")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", type=Path, required=True, help="dir from `python -m smoke models`")
    ap.add_argument("--out", type=Path, required=True, help="logs and features.json go here")
    ap.add_argument("--threshold", type=int, default=DEFAULT_THRESHOLD,
                    help=f"N, 2 to {max_threshold()} (the KV pool grows with N; see pool_tokens)")
    ap.add_argument("--variants", default="overlap,sync",
                    help="comma list of: overlap, sync (--disable-overlap-schedule); CUDA graphs on")
    ap.add_argument("--port", type=int, default=30100)
    ap.add_argument("--deadline", type=float, default=3600, help="seconds from now")
    ap.add_argument("--cases", default=",".join(CASE_NAMES),
                    help="comma list of the cases to run (default: all); a subset reruns what failed")
    ap.add_argument("--parallel-variants", action="store_true",
                    help="run the variants side by side, their servers on ports PORT+1, PORT+2, "
                         "...: they start at once (their KV pools are fixed), then their matrices overlap; for a "
                         "GPU with memory for two servers")


def options(a: argparse.Namespace) -> FeatureOptions:
    variants = comma_list(a.variants, VARIANT_FLAGS, "--variants")
    check_threshold(a.threshold)
    return FeatureOptions(models=a.models, out=a.out, threshold=a.threshold, variants=variants,
                          port=a.port, deadline=Deadline(time.time() + a.deadline),
                          parallel_variants=a.parallel_variants,
                          cases=comma_list(a.cases, CASE_NAMES, "--cases"))


def main(a: argparse.Namespace) -> int:
    opts = options(a)
    report = run_features(opts)
    (opts.out / "features.json").write_text(json.dumps(report, indent=1))
    print(summarize(report))
    return exit_code(report)
