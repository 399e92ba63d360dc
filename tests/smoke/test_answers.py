"""The feature matrix's requests (smoke.answers): how answers are read, and that no request
outlives the call's deadline (a request it stopped is the deadline's, not the server's failure)."""
from __future__ import annotations

import pytest

from smoke import client
from smoke.answers import (
    DEADLINE,
    REQUEST_CAP_S,
    Request,
    cut_by_deadline,
    read_generate,
    read_stream,
    send,
    send_all,
)
from smoke.cases import generate, make_cases
from smoke.deadline import REQUEST_MARGIN_S
from smoke.loads import CaseInterrupted, Filler, run_under
from smoke.verdicts import CaseFailure
from tests.smoke.matrix_fakes import EXPECTED, GREEDY_ANSWER, Clock, ClockDeadline


def test_generate_answers_are_read_for_one_and_for_n_choices():
    one = {"output_ids": [5, 6], "text": "ab", "meta_info": {
        "finish_reason": {"type": "stop", "matched": 6},
        "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]],
        "output_top_logprobs": [[[-0.1, 5, None], [-3.0, 9, None]], [[-0.2, 6, None]]]}}
    o = read_generate(one)
    assert o.ids == [[5, 6]] and o.finish == [["stop", 6]] and o.logprobs == [[-0.1, -0.2]]
    assert o.top == [[[(5, -0.1), (9, -3.0)], [(6, -0.2)]]]
    two = read_generate([one, dict(one, output_ids=[7])])
    assert two.ids == [[5, 6], [7]]
    with pytest.raises(CaseFailure, match="no output_ids"):
        read_generate({"error": "boom"})


def test_streams_are_joined_and_an_error_event_fails():
    events = [{"choices": [{"text": "he"}]}, {"choices": [{"text": "llo", "finish_reason": "length"}]}]
    assert read_stream(events, chat=False).text == ["hello"]
    chat = [{"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": "hi"}}]},
            {"choices": [{"delta": {}, "finish_reason": "stop"}]}]
    got = read_stream(chat, chat=True)
    assert got.text == ["hi"] and got.finish == ["stop"]
    with pytest.raises(CaseFailure, match="error event"):
        read_stream([{"error": {"message": "x"}}], chat=False)


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

    monkeypatch.setattr(client, "post_json", post_json)
    monkeypatch.setattr(client, "sse_events", sse_events)
    case = next(c for c in make_cases(EXPECTED, 4, "m") if c.name == "completions_stream")
    kinds = [generate([5, 6]), case.requests[0], Request("chat_stream", {}),
             Request("abort_stream", {})] * 3
    outs = send_all("http://x", kinds, 1, deadline)
    # 700 s left: seven requests of 100 s start, each ending before the margin; the rest do not start
    assert len(given) == 7 and [o.error for o in outs[:7]] == [None] * 7
    assert all(timeout <= left - REQUEST_MARGIN_S for timeout, left in given)
    assert given[0][0] == REQUEST_CAP_S and given[-1][0] == 100 - REQUEST_MARGIN_S
    assert all(o.error.startswith(DEADLINE) for o in outs[7:]) and cut_by_deadline(outs)
    # the filler's requests too: it sends until the deadline leaves no time, then stops quietly
    given.clear()
    clock.now = 0.0
    Filler("http://x", [[1, 2]], 8, "t", deadline, rolling=True).wait()  # one slot: one order
    assert len(given) == 7 and all(timeout <= left - REQUEST_MARGIN_S for timeout, left in given)
    # a run of a case that the deadline stopped is an interruption, not a failure
    with pytest.raises(CaseInterrupted, match="deadline"):
        run_under("below", "http://x", case, [], deadline)


def test_a_timeout_at_the_deadline_is_the_deadline_s_and_an_early_failure_the_server_s(monkeypatch):
    clock = Clock()
    deadline = ClockDeadline(clock, 100.0)

    def times_out(url, payload, timeout):
        clock.now += timeout  # the deadline shortened the timeout, and it ran out
        raise client.HTTPFailure("timed out")

    monkeypatch.setattr(client, "post_json", times_out)
    assert send("http://x", generate([5]), deadline).error.startswith(DEADLINE)

    def refused(url, payload, timeout):
        raise client.HTTPFailure("connection refused")

    clock.now = 0.0
    monkeypatch.setattr(client, "post_json", refused)
    out = send("http://x", generate([5]), deadline)
    assert "connection refused" in out.error and not cut_by_deadline([out])
