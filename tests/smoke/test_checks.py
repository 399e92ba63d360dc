"""The checks of a server from the outside (smoke.checks), on real text: a server log in sglang
0.5.17's format, server-info states and answers as the server gives them."""
from __future__ import annotations

import pytest

from smoke import checks
from smoke.client import Result
from smoke.server import SmokeError
from tests.smoke.server_log import PATCH_LINE, SERVER_LOG


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


# ----------------------------------------------------------------------------- a depth schedule
def schedule_server(text: str, batch_sizes: list[int]):
    """The server-info state and log lines of a server whose policy (the plugin's own) decoded
    these batch sizes, with a fresh copy of the state after each step."""
    from sglang_image_plugin.depth_schedule import DepthController
    from sglang_image_plugin.policy import DepthSchedulePolicy
    from sglang_image_plugin.setting import parse_schedule

    lines: list[str] = []
    policy = DepthSchedulePolicy(DepthController(parse_schedule(text)), log_fn=lines.append)
    states = [policy.snapshot()]
    for b in batch_sizes:
        policy.get_steps_for_batch(b)
        states.append(policy.snapshot())
    return [{"internal_states": [{"speculative_disable": st}]} for st in states], lines


SCHEDULE = "1-8:3,9-24:2,25-64:1,65-:0"


def test_a_schedule_server_s_state_is_read_and_judged():
    from sglang_image_plugin.setting import parse_schedule

    infos, lines = schedule_server(SCHEDULE, [1, 1, 20, 20, 1])
    st0, st = checks.spec_state(infos[0]), checks.spec_state(infos[-1])
    schedule = parse_schedule(SCHEDULE)
    checks.check_schedule_state(st0, schedule)
    checks.check_depth(st0, 3, "after start")
    with pytest.raises(SmokeError, match="server-info schedule is '1-8:3,9-24:2,25-64:1,65-:0', expected '1-8:3,9-:0'"):
        checks.check_schedule_state(st0, parse_schedule("1-8:3,9-:0"))
    # the plugin's depth-change line is the one the smoke counts
    assert lines and all(line.startswith(checks.DEPTH_CHANGE_LOG_PREFIX) for line in lines)
    # a depth never run fails, naming it; once every depth ran, it passes
    with pytest.raises(SmokeError, match=r"end of load: no step at depth\(s\) \[1, 0\]"):
        checks.check_depths_ran(st, schedule.depths, "end of load")
    infos, _ = schedule_server(SCHEDULE, [1, 20, 40, 100, 1])
    checks.check_depths_ran(checks.spec_state(infos[-1]), schedule.depths, "end of load")
    with pytest.raises(SmokeError, match=r"ramp: no step at depth\(s\) \[2\]"):  # since `before`
        checks.check_depths_ran(checks.spec_state(infos[-1]), [3, 2], "ramp", checks.spec_state(infos[-2]))
    missing = dict(infos[0]["internal_states"][0]["speculative_disable"])
    del missing["steps_by_depth"]
    with pytest.raises(SmokeError, match=r"lacks \['steps_by_depth'\]"):
        checks.spec_state({"internal_states": [{"speculative_disable": missing}]})
    deltas = checks.spec_deltas(checks.spec_state(infos[-1]), st0)
    assert deltas["d_steps_by_depth"] == {"0": 1, "1": 1, "2": 1, "3": 2} and deltas["d_depth_changes"] == 4


def test_a_load_runs_the_depth_of_its_size_and_none_of_a_larger_batch():
    infos, _ = schedule_server(SCHEDULE, [9, 20, 24, 12, 1])  # a load of 24 at once, draining
    st = [checks.spec_state(i) for i in infos]
    # 12 is above the edge at 8 less its hysteresis: still depth 2
    assert checks.check_depths_of_load(st[0], st[-1], 2, "edge24_at") == {0: 0, 1: 0, 2: 4, 3: 1}
    with pytest.raises(SmokeError, match="edge24_above: no step at depth 1"):
        checks.check_depths_of_load(st[0], st[-1], 1, "edge24_above")
    infos, _ = schedule_server(SCHEDULE, [20, 30, 20, 1])  # one step above the load's size
    with pytest.raises(SmokeError, match=r"edge24_at: steps at depths \[1\] of larger batches"):
        checks.check_depths_of_load(checks.spec_state(infos[0]), checks.spec_state(infos[-1]), 2, "edge24_at")
    infos, _ = schedule_server(SCHEDULE, [1, 1, 1])
    checks.check_only_depth(checks.spec_state(infos[0]), checks.spec_state(infos[-1]), 3, "below")
    infos, _ = schedule_server(SCHEDULE, [1, 9, 1])
    with pytest.raises(SmokeError, match="below: 1 step.* at other depths than 3"):
        checks.check_only_depth(checks.spec_state(infos[0]), checks.spec_state(infos[-1]), 3, "below")
    checks.check_only_depth(checks.spec_state(infos[0]), checks.spec_state(infos[-1]), 3, "after", at_most=1)


def test_depth_changes_are_counted_and_bounded():
    infos, _ = schedule_server(SCHEDULE, [1, 30, 1])
    a, b = checks.spec_state(infos[0]), checks.spec_state(infos[-1])
    assert checks.check_depth_changes(a, b, "ramp", at_least=2, at_most=4) == 2
    with pytest.raises(SmokeError, match="ramp: 2 depth change"):
        checks.check_depth_changes(a, b, "ramp", at_least=3, at_most=10)
    infos, _ = schedule_server(SCHEDULE, [9, 7] * 20)  # across the edge at 8 every step
    with pytest.raises(SmokeError, match="40 depth changes, more than the 12 .* flips back and forth"):
        checks.check_depth_changes(checks.spec_state(infos[0]), checks.spec_state(infos[-1]), "load",
                                   at_least=2, at_most=12)


def test_the_start_line_of_a_schedule_is_found_exactly():
    from sglang_image_plugin.setting import parse_schedule, start_log_line

    schedule = parse_schedule("1-8:3,9-:1")
    line = f"[2026-12-06 08:40:10] {start_log_line(0, schedule)}\n"
    checks.check_start_log(SERVER_LOG + line, 0, schedule)
    with pytest.raises(SmokeError, match="depth schedule=1-8:3,9-:1"):
        checks.check_start_log(SERVER_LOG + PATCH_LINE, 0, schedule)  # a threshold server's
    with pytest.raises(SmokeError):  # a schedule that goes on is another one
        checks.check_start_log(SERVER_LOG + line.replace("9-:1", "9-:12"), 0, schedule)
    with pytest.raises(SmokeError):
        checks.check_start_log(SERVER_LOG + line, 4)  # the threshold's line is not there
