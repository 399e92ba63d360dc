"""One window (bench.window) against a fake generate: the tokens of the counted seconds, the
abort at its end, the server's decode steps and host counters."""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import pytest

from bench import diagnose, window, workload
from smoke import client


def test_tokens_are_counted_in_the_window_only():
    # 100 tokens over 0-2 s, 50 over 1-3 s, 30 over 2.5-5 s; the window 1-3 s
    spans = [(0.0, 2.0, 100), (1.0, 3.0, 50), (2.5, 5.0, 30)]
    assert window.tokens_between(spans, 1.0, 3.0) == pytest.approx(50 + 50 + 6)
    assert window.tokens_between([(1.0, 1.0, 9)], 0.0, 2.0) == 0  # no lifetime: nothing to spread


def test_time_to_first_token_of_the_requests_started_in_the_span():
    # (start, meta_info, got a token); the span 10-20 s, the abort at 21 s
    stamp = window.FIRST_TOKEN_KEY
    requests = [(9.0, {stamp: 5.0}, True),  # started before the span: not counted
                (10.0, {stamp: 0.010}, True), (11.0, {stamp: 0.020}, True), (12.0, {stamp: 0.030}, True),
                (13.0, {}, True),  # no stamp on it: nothing to count
                (20.5, {stamp: 0.001}, True)]  # started after the span: not counted
    assert window.first_token_ms(requests, 10.0, 20.0, 21.0) == {"p50": 20.0, "p90": 28.0, "n": 3, "censored": 0}
    # cut short before a first token: its age at the abort, a lower bound; the server's stamp (the
    # abort's arrival) where it sent one, else the client's
    cut = [(19.5, {stamp: 0.4}, False), (20.0, {}, False)]
    assert window.first_token_ms(requests + cut, 10.0, 20.0, 21.0) == {
        "p50": 30.0, "p90": 760.0, "n": 5, "censored": 2}


def test_no_time_to_first_token_where_the_server_sends_none():
    # an older sglang, or one without --enable-metrics: no stamp on any request, no figure (and a
    # stamp only outside the span says nothing of the span)
    assert window.first_token_ms([(10.0, {}, True), (11.0, {}, False)], 10.0, 20.0, 21.0) is None
    assert window.first_token_ms([(9.0, {window.FIRST_TOKEN_KEY: 0.01}, True), (11.0, {}, False)],
                                 10.0, 20.0, 21.0) is None
    assert window.first_token_ms([], 10.0, 20.0, 21.0) is None


def test_percentiles_run_linearly_between_ranks():
    assert window.percentile([0.3], 0.9) == 0.3
    assert window.percentile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert window.percentile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0], 0.9) == pytest.approx(10.0)


def test_decode_steps_come_from_the_servers_own_counter():
    def scrape(graph: float, eager: float, prefill: float) -> dict[str, float]:
        return client.parse_prometheus(
            f'sglang:cuda_graph_passes_total{{model_name="t",mode="decode_cuda_graph"}} {graph}\n'
            f'sglang:cuda_graph_passes_total{{model_name="t",mode="decode_none"}} {eager}\n'
            f'sglang:cuda_graph_passes_total{{model_name="t",mode="prefill_none"}} {prefill}\n')
    assert diagnose.decode_steps(scrape(10, 2, 5), scrape(110, 3, 50)) == 101  # prefill passes are no decode step
    assert diagnose.decode_steps({}, {"sglang:num_running_reqs": 3.0}) is None  # metrics without the counter


class FakeGenerate:
    """client.generate replaced: `per_token` s a token; an abort_all cuts what is in flight short."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, per_token: float = 0.002, fail: str | None = None,
                 cut: Callable[[client.Prompt, list[int]], list[int]] | None = None,
                 first_token_s: float | None = None):
        self.per_token, self.fail = per_token, fail
        self.cut = cut  # what an aborted request returns, from its prompt and its tokens (None: them)
        # the server's time-to-first-token stamp of every request that got a token (None: as an
        # older sglang, or one without metrics, it sends none)
        self.first_token_s = first_token_s
        self.aborted_at: float | None = None
        self.rids: list[str | None] = []
        monkeypatch.setattr(client, "generate", self.generate)
        monkeypatch.setattr(client, "post", self.post)

    def post(self, url: str, payload: Any, timeout: float = 600) -> str:
        if url.endswith("/abort_request"):
            assert payload == {"abort_all": True}
            self.aborted_at = time.time()
        return "{}"

    def generate(self, base: str, p: client.Prompt, timeout: float = 600, rid: str | None = None) -> client.Result:
        self.rids.append(rid)
        t0 = time.time()
        if p.key == self.fail:
            return client.Result(p.key, error="HTTP 500")
        ids = []
        for j in range(p.max_new_tokens):
            if self.aborted_at is not None and self.aborted_at > t0:
                break
            time.sleep(self.per_token)
            ids.append(j)
        stamp = {window.FIRST_TOKEN_KEY: self.first_token_s} if self.first_token_s is not None and ids else {}
        if len(ids) < p.max_new_tokens:  # aborted: as sglang answers an abort_all
            return client.Result(p.key, self.cut(p, ids) if self.cut else ids,
                                 {"finish_reason": {"type": "abort", "message": "Abort all requests"}, **stamp})
        return client.Result(p.key, ids, {"spec_accept_length": 2.0, **stamp})


def test_a_window_counts_its_seconds_then_aborts_what_is_in_flight(monkeypatch):
    """The real measure() against a fake generate: clients in a closed loop; the tokens of the
    counted seconds only; at the end every request in flight is aborted and kept as a prefix."""
    fake = FakeGenerate(monkeypatch, per_token=0.005)
    prompt_at = functools.partial(workload.window_prompt, 3000, 2, 40, 100)  # 40 tokens: 0.2 s a request
    t0 = time.time()
    m = window.measure("b", prompt_at, 2, 0.3, 1.0, 10, time.time() + 60)
    assert not m["cut"] and m["seconds"] == pytest.approx(1.0, abs=0.1)
    assert time.time() - t0 < 1.3 + 0.2 + 0.5  # the aborted requests did not run to their end
    assert fake.aborted_at is not None and m["abort_all"]
    assert m["aborted"] == 2 and all(len(ids) < 40 for ids in m["prefixes"].values())
    assert m["aborted_over_max"] == m["aborted_empty"] == 0
    assert m["requests"] >= 8 and all(len(ids) == 40 for ids in m["outputs"].values())
    # two clients, a token each 5 ms: about 400 tokens/s (sleeps only run longer on a busy host)
    assert 150 < m["tok_per_s"] <= 410 and m["accept_length"] == 2.0 and m["errors"] == 0
    assert len({r.rsplit("-", 1)[0] for r in fake.rids}) == 1  # named, so that they could be aborted one by one
    assert "ttft_ms" not in m  # a server that sends no time to first token: none recorded
    assert window.measure("b", prompt_at, 2, 5.0, 4, 10, time.time() + 3)["cut"]  # past the deadline: not started


def test_a_window_says_which_aborted_outputs_are_too_long_or_empty_and_keeps_why_they_ended(monkeypatch):
    # an aborted request holds no more tokens than it asked for, and an empty one is not compared
    # (it is no prefix): the window counts both; the server's finish_reason of each aborted output
    # is kept for the comparison with plain's (bench.checks)
    def cut(p: client.Prompt, ids: list[int]) -> list[int]:
        return [*range(p.max_new_tokens + 3)] if p.key.endswith("-0") else [] if p.key.endswith("-1") else ids

    FakeGenerate(monkeypatch, per_token=0.01, cut=cut)
    prompt_at = functools.partial(workload.window_prompt, 3000, 3, 400, 100)  # no request ends in the window
    m = window.measure("b", prompt_at, 3, 0.0, 0.3, 10, time.time() + 60)
    assert m["aborted"] == 3 and m["aborted_over_max"] == 1 and m["aborted_empty"] == 1
    assert sorted(m["prefixes"]) == sorted(m["abort_reasons"]) == ["c3-0", "c3-2"]
    assert m["abort_reasons"]["c3-0"] == {"type": "abort", "message": "Abort all requests"}


def test_a_window_keeps_the_server_s_time_to_first_token(monkeypatch):
    # the server stamps 25 ms on every request that got a token; a window of 20-token requests
    # (0.2 s each) on 2 clients starts about 10 of them in its counted second
    FakeGenerate(monkeypatch, per_token=0.01, first_token_s=0.025)
    prompt_at = functools.partial(workload.window_prompt, 3000, 2, 20, 100)
    m = window.measure("b", prompt_at, 2, 0.3, 1.0, 10, time.time() + 60)
    ttft = m["ttft_ms"]
    assert ttft["p50"] == 25.0 and 4 <= ttft["n"] <= 12 and ttft["censored"] <= 2
    assert set(ttft) == {"p50", "p90", "n", "censored"}


def test_a_failed_request_is_an_error_not_an_abort(monkeypatch):
    FakeGenerate(monkeypatch, per_token=0.001, fail="c1-2")
    m = window.measure("b", lambda i: workload.window_prompt(3000, 1, 8, 100, i), 1, 0.0, 0.5, 10, time.time() + 60)
    assert m["errors"] == 1 and m["first_error"] == "HTTP 500" and "c1-2" not in m["outputs"]


def test_a_window_reads_the_server_s_counters_at_its_counted_span(monkeypatch):
    FakeGenerate(monkeypatch, per_token=0.002)
    reads: list[float] = []

    def counters() -> dict[str, float]:
        reads.append(time.time())
        return {"scheduler_cpu_s": 2.0 * len(reads), "server_cpu_s": 5.0}

    m = window.measure("b", lambda i: workload.window_prompt(3000, 1, 8, 100, i), 1, 0.2, 0.5, 10, time.time() + 60,
                       counters=counters)
    assert m["counters"] == {"scheduler_cpu_s": 2.0, "server_cpu_s": 0.0}
    lo, hi = m["span"]
    assert [round(t, 1) for t in reads] == [round(lo, 1), round(hi, 1)] and hi - lo == pytest.approx(0.5, abs=0.1)
