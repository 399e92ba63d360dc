"""The checks of a server from the outside (smoke.checks), on real text: a server log in sglang
0.5.17's format, server-info states and answers as the server gives them."""
from __future__ import annotations

import pytest

from smoke import checks
from smoke.client import Result
from smoke.server import SmokeError
from tests.server_log import PATCH_LINE, SERVER_LOG


def test_start_log_line_found_and_exact():
    checks.check_start_log(SERVER_LOG + PATCH_LINE, 4)
    with pytest.raises(SmokeError):
        checks.check_start_log(SERVER_LOG + PATCH_LINE.replace("threshold=4", "threshold=40"), 4)
    with pytest.raises(SmokeError):
        checks.check_start_log(SERVER_LOG + PATCH_LINE, 8)


def test_request_errors_and_bad_log_lines_fail():
    with pytest.raises(SmokeError, match="1 request"):
        checks.check_no_errors([Result("p1", error="HTTP 500 from /generate: boom")], "ramp")
    bad = SERVER_LOG + ("[2026-11-30 08:41:00] Scheduler hit an exception: Traceback (most recent call last):\n"
                        "Traceback (most recent call last):\n  File \"scheduler.py\", line 1\n")
    with pytest.raises(SmokeError, match="Traceback"):
        checks.check_log_clean(bad)
    with pytest.raises(SmokeError, match="memory leak"):
        checks.check_log_clean(SERVER_LOG + "[2026-11-30 08:41:00] pool memory leak detected! full: 12\n")
    checks.check_log_clean(SERVER_LOG + PATCH_LINE)


def test_server_info_counters():
    st = {"threshold": 4, "hysteresis": 1, "mode": "speculative", "speculative_steps": 120,
          "plain_steps": 40, "mode_changes": 4}
    info = {"internal_states": [{"speculative_disable": st, "avg_spec_accept_length": 2.0}]}
    assert checks.spec_state(info) == st
    checks.check_threshold_state(st, 4)
    checks.check_switched(st, "end")
    with pytest.raises(SmokeError, match="patch applied"):
        checks.spec_state({"internal_states": [{"avg_spec_accept_length": 2.0}]})
    with pytest.raises(SmokeError, match="plain_steps == 0"):
        checks.check_switched(dict(st, plain_steps=0, mode_changes=0), "end")
    with pytest.raises(SmokeError, match="did not grow"):
        checks.check_delta(st, st, "plain_steps", "above", positive=True)
    with pytest.raises(SmokeError, match="should not"):
        checks.check_delta(st, dict(st, plain_steps=41), "plain_steps", "below", positive=False)
    # the catch-up step after a plain phase: one plain step allowed, two are not
    assert checks.check_delta(st, dict(st, plain_steps=41), "plain_steps", "after", positive=False, at_most=1) == 1
    with pytest.raises(SmokeError, match="more than 1"):
        checks.check_delta(st, dict(st, plain_steps=42), "plain_steps", "after", positive=False, at_most=1)


def test_accept_length_and_kv_checks():
    before = checks.accept_stats([Result("a", [1] * 48, {"spec_accept_length": 2.0,
                                                                  "spec_accept_rate": 0.33,
                                                                  "spec_verify_ct": 24})])
    assert before["accept_length"] == 2.0
    checks.check_accept_recovers(before, {"accept_length": 1.95})
    with pytest.raises(SmokeError, match="after the disabled phase"):
        checks.check_accept_recovers(before, {"accept_length": 1.2})
    with pytest.raises(SmokeError, match="not accepted at low load"):
        checks.check_accept_recovers({"accept_length": 1.0}, {"accept_length": 1.0})
    base = {"num_used_tokens": 0, "max_total_num_tokens": 100000, "num_running_reqs": 0}
    checks.check_kv_back(base, dict(base))
    with pytest.raises(SmokeError, match="KV pool not back"):
        checks.check_kv_back(base, dict(base, num_used_tokens=37))


def test_abort_check_wants_exact_survivors_and_prefix_aborted():
    refs = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [9, 9, 9, 9]}
    ok = [Result("a", [1, 2]), Result("b", [5, 6, 7, 8]), Result("c", None, error="HTTP 400 aborted")]
    assert checks.check_aborted(refs, ok, {"a", "c"}, "abort") == {"aborted_cut_short": 2, "aborted_sent": 2}
    with pytest.raises(SmokeError, match="not a prefix"):
        checks.check_aborted(refs, [Result("a", [1, 3])], {"a"}, "abort")
    with pytest.raises(SmokeError, match="output mismatch"):
        checks.check_aborted(refs, [Result("b", [5, 6])], {"a"}, "abort")  # b was not aborted
    with pytest.raises(SmokeError, match="not aborted"):
        checks.check_aborted(refs, [Result("b", None, error="boom")], set(), "abort")
