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
    RETRACT_LOG,
    CaseInterrupted,
    NotExercised,
    retractions,
    run_case_modes,
    run_under,
)
from smoke.verdicts import Outcome, equal_tokens
from tests.matrix_fakes import EXPECTED, Clock, ClockDeadline


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
