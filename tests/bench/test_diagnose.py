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
    s: dict[str, Any] = diagnose.summarize_pyspy({"raw": raw}, 256_000 / 4.0, 256)
    assert s["step_ms"] == pytest.approx(4.0)
    incl = {f: pct for f, pct, _ in s["inclusive_pct"]}
    assert incl["Scheduler.event_loop_overlap (scheduler.py)"] == 100.0
    assert 10 < incl["EAGLEWorkerV2._forward_plain_decode (eagle_worker_v2.py)"] < 100
    assert not any("watchdog" in f or "Timer.check" in f for f in incl)  # other threads left out
    assert all(row[2] == pytest.approx(row[1] * 4.0 / 100, abs=1e-3) for row in s["inclusive_pct"])
    assert sum(pct for _, pct, _ in s["self_pct"]) <= 100.0
    text = pyspy.render("eagle3_thr", s)
    assert text.startswith("py-spy eagle3_thr:")
    assert diagnose.summarize_pyspy({"error": "no py-spy binary"}, None, 256) == {"error": "no py-spy binary"}
    assert pyspy.summarize("thread (1): MainThread;other (x.py:1) 5\n")["error"].startswith("no sample")
    # the sample's three idle stacks (Scheduler.on_idle: no batch) are counted apart, not in the shares
    assert s["idle_samples"] == 28 + 7 + 6 and not any("on_idle" in f or "Poller.poll" in f for f in incl)
    assert "41 idle ones, with no batch, left out" in text
    assert "pyspy eagle3_thr: no py-spy binary" in diagnose.render("eagle3_thr", {"pyspy": {"error": "no py-spy binary"},
                                                                                   "profile": {"error": "x"}})
