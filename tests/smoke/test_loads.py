"""A case under the load modes (smoke.loads): the retraction warning the pressure case counts,
the retries of a run whose mode did not move, and a crossing that came too late."""
from __future__ import annotations

import ast
import re
import time

import pytest

from smoke import loads
from smoke.cases import Case, make_cases
from smoke.deadline import Deadline
from smoke.loads import (
    CROSS_DOWN_NEW_TOKENS,
    FILLER_NEW_TOKENS,
    RETRACT_LOG,
    CaseInterrupted,
    NotExercised,
    retractions,
    run_case_modes,
    run_under,
)
from smoke.verdicts import Outcome, equal_tokens
from tests.smoke.matrix_fakes import EXPECTED, Clock, ClockDeadline


def test_only_the_schedulers_retraction_warning_counts(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("server_args={'retraction_policy': 'length', 'disaggregation_decode_retraction_backup'"
                   ": None}\n[x] Decode batch, #running-req: 87, token usage: 0.59\n")
    assert retractions(log) == 0
    with open(log, "a") as fh:  # the warning as 0.5.17 and 0.5.23 word it
        fh.write("[x] KV cache pool is full. Retract requests. #retracted_reqs: 3, "
                 "#new_tokens_gained: 420, #new_token_ratio: 0.1400 -> 0.5000\n")
    assert retractions(log) == 1


@pytest.mark.parametrize("flavor", ["sglang-0.5.17", "sglang-0.5.23"])
def test_the_retraction_warning_is_the_one_the_flavors_scheduler_writes(flavor, sglang_tree):
    scheduler = (sglang_tree(flavor, False) / "sglang/srt/managers/scheduler.py").read_text()
    assert RETRACT_LOG.search(scheduler), f"{flavor}: the scheduler no longer says 'Retract requests'"


def test_a_case_stops_between_attempts_when_the_deadline_is_near(monkeypatch):
    clock = Clock()
    calls: list[str] = []

    def not_exercised(case, mode, ref, base, baseline, filler_prompts, deadline):
        calls.append(mode)
        clock.advance(30)
        return {"ok": False, "cause": "the mode did not change", "not_exercised": True}

    monkeypatch.setattr(loads, "run_case_mode", not_exercised)
    case = Case("greedy", (), equal_tokens)
    # 100 s: two attempts of 30 s start; the third would start with less than a mode's reserve
    with pytest.raises(CaseInterrupted, match="greedy below: not started"):
        run_case_modes(case, [], "http://x", {}, [], ClockDeadline(clock, 100))
    assert calls == ["below", "below"]


@pytest.mark.parametrize("mode", ["cross_up", "cross_down"])
def test_a_crossing_that_came_too_late_says_by_how_much(mode, monkeypatch):
    # GPU, 0.5.23, threshold 64: two requests of a case can end in a quarter of a second, which is
    # about what 4N filler requests take to lift a batch past N. The run that proved nothing now
    # says when the mode changed and when the case's requests ended, both from their start.
    deadline = Deadline(time.time() + 600)
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
        return [Outcome(ids=[[1]]) for _ in requests]

    def wait_mode(base, want, timeout=20):
        if want == "plain" and mode == "cross_down":
            return True  # the filler's load is up before the case starts
        time.sleep(timing["mode"])
        return True

    monkeypatch.setattr(loads, "Filler", FakeFiller)
    monkeypatch.setattr(loads, "send_all", send_all)
    monkeypatch.setattr(loads, "wait_mode", wait_mode)
    monkeypatch.setattr(loads, "wait_running", lambda base, n, timeout=10: None)
    case = next(c for c in make_cases(EXPECTED, 4, "m") if c.name == "greedy")
    with pytest.raises(NotExercised, match="did not change while") as exc:
        run_under(mode, "http://x", case, [], deadline)
    seen = ast.literal_eval(re.search(r"(\{.*\})", str(exc.value)).group(1))
    assert seen["crossed_in_flight"] is False
    assert 0.04 <= seen["case_ran_s"] < 0.15 and 0.19 <= seen["mode_changed_after_s"] < 0.35
    timing.update(case=0.3, mode=0.05)
    outs, seen = run_under(mode, "http://x", case, [], deadline)
    assert seen["crossed_in_flight"] and seen["mode_changed_after_s"] < seen["case_ran_s"]
    assert len(outs) == len(case.requests)


def test_a_schedule_server_s_modes_hold_a_tier_and_cross_an_edge_with_their_fillers(monkeypatch):
    """On a schedule server (smoke.tiers.Tiers.matrix_plan) a mode's filler holds the batch in a
    tier between others while the case runs, more arrive (up) or short ones leave (down) mid-case,
    and the runner waits for the depth, not the mode."""
    from smoke.cases import CASE_CONCURRENCY
    from smoke.tiers import Tiers, parse_smoke_schedule

    plan = Tiers(parse_smoke_schedule("1-8:3,9-24:2,25-64:1,65-:0")).matrix_plan(CASE_CONCURRENCY)
    events: list = []

    class FakeFiller:
        def __init__(self, base, prompts, max_new, tag, deadline, rolling):
            events.append(("filler", len(prompts), max_new, rolling))

        def stop(self):
            events.append("stop")

        def wait(self):
            events.append("wait")

    def wait_mode(base, want, timeout=20):
        events.append(("wait for", want))
        return True

    def send_all(base, requests, concurrency, deadline):
        time.sleep(0.2)  # in flight while the depth changes
        return [Outcome(ids=[[1]]) for _ in requests]

    depth = {"now": 2}
    monkeypatch.setattr(loads, "Filler", FakeFiller)
    monkeypatch.setattr(loads, "send_all", send_all)
    monkeypatch.setattr(loads, "wait_mode", wait_mode)
    monkeypatch.setattr(loads, "wait_running", lambda base, n, timeout=10: events.append(("running", n)))
    monkeypatch.setattr(loads.client, "server_info", lambda base: {})
    monkeypatch.setattr(loads, "spec_state", lambda info: {"mode": "speculative", "depth": depth["now"]})
    case = next(c for c in make_cases(EXPECTED, 64, "m", concurrency=plan.concurrency) if c.name == "greedy")
    deadline = Deadline(time.time() + 600)
    filler = [[1]] * 256
    in_depth2, up24, down24 = plan.modes["above"][0], plan.modes["cross_up"][1], plan.modes["cross_down"][1]
    assert (in_depth2.name, up24.name, down24.name) == ("depth2", "up24", "down24")
    outs, seen = run_under(in_depth2, "http://x", case, filler, deadline)
    assert events == [("filler", 11, FILLER_NEW_TOKENS, True), ("wait for", 2), "stop"]
    assert seen["depth2_before"] and seen["depth2_after"] and len(outs) == len(case.requests)
    depth["now"] = 1
    with pytest.raises(NotExercised, match="depth2: the server was not in depth 2 for the whole case"):
        run_under(in_depth2, "http://x", case, filler, deadline)
    events.clear()
    outs, seen = run_under(up24, "http://x", case, filler, deadline)
    assert events == [("filler", 11, FILLER_NEW_TOKENS, True), ("wait for", 2), ("running", 12),
                      ("filler", 26, FILLER_NEW_TOKENS, True), ("wait for", 1), "stop", "stop"]
    assert seen["crossed_in_flight"]
    events.clear()
    outs, seen = run_under(down24, "http://x", case, filler, deadline)
    assert events == [("filler", 11, FILLER_NEW_TOKENS, True), ("filler", 26, CROSS_DOWN_NEW_TOKENS, False),
                      ("wait for", 1), ("wait for", 2), "wait", "stop"]
    assert seen["crossed_in_flight"]
    # the first tier: the case alone, and only its depth may run (one step elsewhere allowed)
    before = {"plain_steps": 0, "speculative_steps": 10, "steps_by_depth": {"0": 0, "1": 0, "2": 0, "3": 10}}
    after = {"plain_steps": 1, "speculative_steps": 30, "steps_by_depth": {"0": 1, "1": 0, "2": 2, "3": 27}}
    assert loads.steps_elsewhere(before, after, 3) == 3 and loads.steps_elsewhere(before, after, "speculative") == 1
    assert loads.step_deltas(dict(before, mode_changes=0, depth_changes=0), dict(after, mode_changes=2, depth_changes=4)) == {
        "mode_changes": 2, "plain_steps": 1, "speculative_steps": 20, "depth_changes": 4,
        "steps_by_depth": {"0": 1, "1": 0, "2": 2, "3": 17}}


def test_a_rolling_filler_s_requests_do_not_all_end_in_the_same_step(monkeypatch):
    """Sent together with one length, a tier's filler ends all at once and the batch leaves the tier
    for as long as its requests take to come back (GPU: a grammar case saw depth 5 in depth 4)."""
    sent: dict[str, int] = {}

    def post_json(url, payload, timeout):
        sent[payload["rid"]] = payload["sampling_params"]["max_new_tokens"]
        time.sleep(0.01)
        return {}

    monkeypatch.setattr(loads.client, "post_json", post_json)
    monkeypatch.setattr(loads.client, "abort", lambda base, rid: None)
    deadline = Deadline(time.time() + 600)
    rolling = loads.Filler("http://x", [[1]] * 54, FILLER_NEW_TOKENS, "hold", deadline, rolling=True)
    time.sleep(0.2)
    rolling.stop()
    first = [n for rid, n in sent.items() if rid.endswith("-0")]  # each slot's first request
    assert len(first) == 54 and max(first) == FILLER_NEW_TOKENS and min(first) == FILLER_NEW_TOKENS // 2
    # no more than two slots end together: the batch dips by at most two while they come back
    assert max(first.count(n) for n in set(first)) <= 2
    # a slot keeps its length from request to request, so the ends stay apart
    assert all(n == sent[rid.rsplit("-", 1)[0] + "-0"] for rid, n in sent.items())
    sent.clear()
    leaving = loads.Filler("http://x", [[1]] * 8, CROSS_DOWN_NEW_TOKENS, "down", deadline, rolling=False)
    leaving.wait()
    assert sorted(sent.values()) == [CROSS_DOWN_NEW_TOKENS] * 8  # these must leave together
