"""--diagnose (bench.diagnose, bench.pyspy): GPU seconds by category, a real py-spy sample."""
from __future__ import annotations

from typing import Any

import pytest

from bench import diagnose, pyspy
from smoke import client
from tests.bench.conftest import REPO


def test_diagnose_counts_gpu_seconds_by_category():
    def scrape(decode: float, extend: float) -> dict[str, float]:
        return client.parse_prometheus(
            "# TYPE sglang:forward_execution_seconds_total counter\n"
            f'sglang:forward_execution_seconds_total{{model_name="t",category="decode"}} {decode}\n'
            f'sglang:forward_execution_seconds_total{{model_name="t",category="extend"}} {extend}\n'
            'sglang:num_running_reqs{model_name="t"} 3.0\n')
    assert diagnose.gpu_seconds(scrape(1.0, 2.0), scrape(8.5, 2.25)) == {"decode": 7.5, "extend": 0.25}
    assert diagnose.gpu_seconds({}, {}) == {}  # timer off: no such counter


def test_pyspy_summary_of_a_real_scheduler_sample():
    """py-spy's raw output from an H200 run (threshold server in plain mode at 256 requests, the 80
    heaviest stacks): only the scheduler thread counts, shares are of its samples, ms from step time."""
    raw = (REPO / "tests/data/pyspy_scheduler_plain_mode.txt").read_text()
    s: dict[str, Any] = diagnose.summarize_pyspy({"raw": raw}, diagnose.load_step_ms(10.0, None, 256_000 / 4.0, 256))
    assert s["step_ms"] == pytest.approx(4.0)
    incl = {f: pct for f, pct, _ in s["inclusive_pct"]}
    assert incl["Scheduler.event_loop_overlap (scheduler.py)"] == 100.0
    assert 10 < incl["EAGLEWorkerV2._forward_plain_decode (eagle_worker_v2.py)"] < 100
    assert not any("watchdog" in f or "Timer.check" in f for f in incl)  # other threads left out
    assert all(row[2] == pytest.approx(row[1] * 4.0 / 100, abs=1e-3) for row in s["inclusive_pct"])
    assert sum(pct for _, pct, _ in s["self_pct"]) <= 100.0
    text = pyspy.render("eagle3_thr", s)
    assert text.startswith("py-spy eagle3_thr:")
    assert diagnose.summarize_pyspy({"error": "no py-spy binary"}, None) == {"error": "no py-spy binary"}
    assert pyspy.summarize("thread (1): MainThread;other (x.py:1) 5\n")["error"].startswith("no sample")
    # the sample's three idle stacks (Scheduler.on_idle: no batch) are counted apart, not in the shares
    assert s["idle_samples"] == 28 + 7 + 6 and not any("on_idle" in f or "Poller.poll" in f for f in incl)
    assert "41 idle ones, with no batch, left out" in text
    assert "pyspy eagle3_thr: no py-spy binary" in diagnose.render("eagle3_thr", {"pyspy": {"error": "no py-spy binary"},
                                                                                   "profile": {"error": "x"}})


def test_two_servers_samples_set_against_each_other(tmp_path, capsys):
    """pyspy.difference: where one server spends more host time a step than another, self and
    inclusive, in ms per step; the hook wrappers and the loop's own frames left out. Here the real
    sample, and the same with one leaf stack twice as often (+1 ms a step at a 10 ms step)."""
    raw = (REPO / "tests/data/pyspy_scheduler_plain_mode.txt").read_text()
    lines = raw.splitlines()
    i, (stack, n) = next((i, line.rsplit(" ", 1)) for i, line in enumerate(lines)
                         if "MainThread" in line and line.rsplit(" ", 1)[0].endswith("(eagle_utils.py:933)"))
    base = pyspy.summarize(raw, 10.0)
    busy = base["samples"]
    extra = round(busy / 10)  # 1 ms of a 10 ms step
    more = "\n".join(lines[:i] + [f"{stack} {int(n) + extra}"] + lines[i + 1:]) + "\n"
    other = pyspy.summarize(more, 10.0 * (busy + extra) / busy)  # the same ms per sample
    d = pyspy.difference(base, other, top=12)
    assert d is not None and d["unit"] == "ms/step"
    leaf = "eagle_prepare_for_decode (eagle_utils.py)"
    assert d["self"][0][0] == leaf and d["self"][0][3] == pytest.approx(1.0, abs=0.02)
    assert all(abs(row[3]) < 0.02 for row in d["self"][1:])
    incl = {row[0]: row[3] for row in d["inclusive"]}
    assert incl["spec_prepare_for_decode (spec_utils.py)"] == pytest.approx(1.0, abs=0.02)
    assert not any("event_loop_overlap" in f or "hook_registry" in f for f in incl)
    text = pyspy.render_difference("plain", "eagle3_thr", d)
    assert text.splitlines()[0].startswith("py-spy eagle3_thr against plain: the functions whose ms/step")
    assert text.splitlines()[1].startswith("  self ") and text.splitlines()[1].endswith(f"  {leaf}")
    # a summary without the kept shares (an older bench.json, or an error): no difference
    assert pyspy.difference({"error": "no py-spy binary"}, other) is None
    # the command line, on the raw files
    (tmp_path / "a.txt").write_text(raw)
    (tmp_path / "b.txt").write_text(more)
    from bench.__main__ import main
    assert main(["pyspy-diff", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "% of samples" in out and leaf in out.splitlines()[1]


def test_a_speculative_server_s_py_spy_ms_are_per_its_own_steps():
    """EAGLE-3 at 64 requests gains ~3 tokens a request a step: its load's step time is its wall time
    over the decode steps it counted (a first GPU run, taken from tokens/s at one token a request a
    step, printed 8.42 ms where the device timer measured 16.44), and tokens/s only where the server
    counts no steps."""
    # 10 s of load, 608 steps counted, 11,978 tok/s at 64 requests
    assert diagnose.load_step_ms(10.0, 608, 11_978.0, 64) == pytest.approx(16.45, abs=0.01)
    assert diagnose.load_step_ms(10.0, None, 11_978.0, 64) == pytest.approx(5.34, abs=0.01)
    assert diagnose.load_step_ms(10.0, 0, None, 64) is None
    raw = (REPO / "tests/data/pyspy_scheduler_plain_mode.txt").read_text()
    s = diagnose.summarize_pyspy({"raw": raw}, diagnose.load_step_ms(10.0, 608, 11_978.0, 64))
    assert s["step_ms"] == pytest.approx(16.45, abs=0.01)


def test_a_full_load_outlasts_its_py_spy_sample_at_the_server_s_own_speed():
    """The sample starts SETTLE_S into the load and lasts PYSPY_SECONDS: the prompts cover both and
    LOAD_SPARE_S at the server's measured tokens/s, so a faster server gets more of them."""
    busy = diagnose.SETTLE_S + diagnose.PYSPY_SECONDS + diagnose.LOAD_SPARE_S
    eagle3 = diagnose.full_load_prompts(64, 11_978.0, 256)
    plain = diagnose.full_load_prompts(64, 7_912.0, 256)
    assert (eagle3 - 64) * 256 / 11_978.0 >= busy and (plain - 64) * 256 / 7_912.0 >= busy
    assert eagle3 > plain > 3 * 64  # 3 a client ran out 4 s in on EAGLE-3 at 64
    assert diagnose.full_load_prompts(64, None, 256) == 192  # no measured rate: 3 a client
    assert diagnose.full_load_prompts(256, 100.0, 256) == 256 * 3  # a slow server: still 3 a client
