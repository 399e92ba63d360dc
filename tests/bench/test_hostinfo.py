"""Where the host time went (bench.hostinfo): what the host did during a window, the scheduler
thread's counters, the CPUs' speed probe, the CPU topology."""
from __future__ import annotations

import json
import os
import statistics
import time

import pytest

from bench import hostinfo, window
from bench import report as bench_report
from tests.bench.conftest import RESULT, titled


def test_what_the_host_did_during_a_window_is_kept(monkeypatch):
    before = hostinfo.sample()
    end = time.time() + 0.3
    while time.time() < end:  # some CPU time to account
        pass
    monkeypatch.setattr(hostinfo.shutil, "which", lambda exe: None)  # no GPU here
    got = hostinfo.during(before, hostinfo.sample())
    assert 0 <= got["steal_share"] <= 1 and 0 < got["busy_share"] <= 1 and "gpu_sm_mhz" not in got
    result = json.loads(RESULT.read_text())
    result["blocks"]["1"][0]["windows"]["plain"]["host"] = {"steal_share": 0.02, "gpu_sm_mhz": 1980.0}
    result["blocks"]["1"][1]["windows"]["plain"]["host"] = {"steal_share": 0.10, "gpu_sm_mhz": 1755.0}
    assert ("- the host over the windows: CPU time stolen by the hypervisor 2.0-10.0%; GPU SM clock "
            "1755-1980 MHz") in bench_report.markdown(result)


def test_the_scheduler_thread_is_found_by_its_title_and_its_time_read():
    """Of a server's processes, the one SGLang titles sglang::scheduler; its main thread's seconds
    on a CPU grow while it computes, and it gives the CPU up each time it sleeps."""
    scheduler, detokenizer = titled("sglang::scheduler_TP0", 0.05), titled("sglang::detokenizer", 0.0)
    try:
        pids = [detokenizer.pid, scheduler.pid]
        assert hostinfo.scheduler_pid(pids) == scheduler.pid
        assert hostinfo.scheduler_pid([detokenizer.pid]) is None
        before, quiet = hostinfo.thread_counters(scheduler.pid), hostinfo.thread_counters(detokenizer.pid)
        time.sleep(1.0)
        delta = hostinfo.counters_delta(before, hostinfo.thread_counters(scheduler.pid))
        assert 0.25 < delta["cpu_s"] <= 1.05 and delta["wait_s"] >= 0 and delta["yields"] >= 5
        idle = hostinfo.counters_delta(quiet, hostinfo.thread_counters(detokenizer.pid))
        assert idle["cpu_s"] < 0.1 and idle["yields"] >= 5  # it sleeps, waking 20 times a second
        read = window.host_counters(os.getpgid(scheduler.pid))  # the test's own group: it holds both
        assert read is not None and {"server_cpu_s", "scheduler_cpu_s", "scheduler_wait_s"} <= set(read())
    finally:
        for proc in (scheduler, detokenizer):
            proc.kill()
            proc.wait()
    assert hostinfo.thread_counters(scheduler.pid) == {}  # gone: nothing, no error
    assert window.host_counters(None) is None


def test_the_speed_probe_reports_its_work_time_per_window():
    probe = hostinfo.SpeedProbe(period_s=0.01).start()
    try:
        t0 = time.time()
        time.sleep(0.8)
        t1 = time.time()
        work = probe.work(t0, t1)
        assert work is not None and 0 < work < 0.5
        inside = sorted(w for t, w in probe.samples if t0 <= t <= t1)
        assert work == pytest.approx(statistics.median(inside))
        assert probe.work(t1 + 100, t1 + 200) is None  # no sample there
    finally:
        probe.stop()
    assert probe._proc is not None and probe._proc.poll() is not None


def test_cpu_topology_and_the_cores_two_owners_share():
    assert hostinfo._cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    mine = hostinfo.cpu_topology()
    assert mine["cpus"] == sorted(os.sched_getaffinity(0)) and sorted(c for core in mine["cores"] for c in core) == mine["cpus"]
    topology = {"cpus": [0, 1, 2, 3], "cores": [[0, 2], [1, 3]]}
    assert hostinfo.shared_cores(topology, {"plain": [0], "plain (A/A twin)": [2], "the client": [1]}) == [
        "CPUs 0,2: plain and plain (A/A twin)"]
    lines = bench_report.topology_lines(topology, {"plain": [0], "the client": [2]})
    assert lines == ["- this process's CPUs: 4 on 2 cores (0,2; 1,3 share a core)",
                     "- one core shared: CPUs 0,2: plain and the client"]
