"""What the host was doing during a window, read without changing anything: the CPU time the
hypervisor took from this machine (steal, /proc/stat), the CPUs' clock (/proc/cpuinfo) and the
GPU's SM clock and power (nvidia-smi's query, where there is one). A window that ran slow for no
reason of its server's shows here: the A/A floor's cause, named.

Where a host-bound server's time goes from one window to the next:
- its scheduler thread (the process SGLang titles `sglang::scheduler`, its main thread): seconds on
  a CPU and seconds runnable but waiting for one (/proc/PID/schedstat), and how often it gave the
  CPU up (waiting for the GPU, a socket) or was preempted (/proc/PID/status);
- the speed of this machine's CPUs: SpeedProbe times a fixed piece of work in a process of its own
  (its CPU time, so a wait for a CPU does not count); a VM shows one nominal clock whatever its
  cores run at.
- the CPU topology (which CPUs share a core): pinned servers should not share one.

Standard library only: this runs on a bare GPU host.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

SCHEDULER_TITLE = "sglang::scheduler"  # SGLang's scheduler process sets this title (setproctitle)

GPU_QUERY = "clocks.sm,power.draw"


def cpu_times() -> dict[str, float]:
    """System-wide CPU seconds so far: busy, steal (the first line of /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return {}
    ticks = [int(x) for x in fields]
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (ticks + [0] * 8)[:8]
    return {"busy": (user + nice + system + irq + softirq) / hz, "steal": steal / hz,
            "all": sum(ticks[:8]) / hz}


def cpu_mhz() -> float | None:
    """The mean clock of this machine's CPUs now."""
    try:
        mhz = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("cpu MHz")]
    except (OSError, ValueError, IndexError):
        return None
    return round(sum(mhz) / len(mhz)) if mhz else None


def gpu_clocks() -> dict[str, float]:
    """GPU 0's SM clock (MHz) and power draw (W) now; {} without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe, f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=5, check=False).stdout
        sm, power = (float(x) for x in out.strip().split(",")[:2])
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}
    return {"gpu_sm_mhz": sm, "gpu_power_w": power}


def sample() -> dict[str, Any]:
    return {"cpu": cpu_times()}


def during(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """A window's host figures: the share of all CPU time stolen, the CPUs' mean clock and the
    GPU's clocks at its end."""
    out: dict[str, Any] = {}
    b, a = before.get("cpu") or {}, after.get("cpu") or {}
    if b and a and a["all"] > b["all"]:
        out["steal_share"] = round((a["steal"] - b["steal"]) / (a["all"] - b["all"]), 4)
        out["busy_share"] = round((a["busy"] - b["busy"]) / (a["all"] - b["all"]), 4)
    mhz = cpu_mhz()
    if mhz:
        out["cpu_mhz"] = mhz
    return {**out, **gpu_clocks()}


# ----------------------------------------------------------------------------- the scheduler thread
def cmdline(pid: int) -> str:
    """A process's command line, arguments joined by spaces (a title set by setproctitle as it
    reads); "" where the process is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def scheduler_pid(pids: Iterable[int]) -> int | None:
    """The scheduler process among a server's `pids` (with tensor parallelism, the lowest pid: rank
    0 is started first; the other ranks' are not watched); None where none has its title yet."""
    return min((pid for pid in pids if cmdline(pid).startswith(SCHEDULER_TITLE)), default=None)


def thread_counters(pid: int) -> dict[str, float]:
    """The main thread of process `pid` so far: seconds on a CPU (`cpu_s`) and runnable but waiting
    for a CPU (`wait_s`), the times it gave the CPU up (`yields`: waiting for the GPU, a socket,
    a lock) and was preempted (`preempted`); {} where the process is gone."""
    try:
        run_ns, wait_ns, _slices = Path(f"/proc/{pid}/schedstat").read_text().split()[:3]
        status = Path(f"/proc/{pid}/status").read_text()
    except (OSError, ValueError):
        return {}
    counts = dict(line.split(":", 1) for line in status.splitlines() if "ctxt_switches" in line)
    return {"cpu_s": int(run_ns) / 1e9, "wait_s": int(wait_ns) / 1e9,
            "yields": float(counts.get("voluntary_ctxt_switches", "0").strip() or 0),
            "preempted": float(counts.get("nonvoluntary_ctxt_switches", "0").strip() or 0)}


def process_cpu_seconds(pids: Iterable[int]) -> float:
    """CPU seconds (user + system) used so far by these processes, all their threads."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


def counters_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the counters of thread_counters (and any other) did between two samples."""
    return {k: round(after[k] - before[k], 6) for k in after if k in before}


# ----------------------------------------------------------------------------- topology
def cpu_topology(cpus: Iterable[int] | None = None) -> dict[str, Any]:
    """This process's CPUs and which of them share a core (sysfs thread_siblings_list): `cpus`,
    `cores` (groups of siblings, those of `cpus` only)."""
    mine = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    cores: list[tuple[int, ...]] = []
    for cpu in mine:
        try:
            text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            text = str(cpu)
        siblings = tuple(c for c in _cpu_list(text) if c in mine) or (cpu,)
        if siblings not in cores:
            cores.append(siblings)
    return {"cpus": mine, "cores": [list(c) for c in cores]}


def _cpu_list(text: str) -> list[int]:
    """A sysfs CPU list ("0-3,8,10-11") as numbers."""
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            out += range(int(lo), int(hi) + 1)
        elif part.strip():
            out.append(int(part))
    return out


def shared_cores(topology: dict[str, Any], owners: Mapping[str, Iterable[int]]) -> list[str]:
    """Each core whose CPUs are given to more than one owner (a server, the client): two busy
    threads on one core run slower than on two."""
    out = []
    for core in topology.get("cores", []):
        on = sorted({name for name, cpus in owners.items() if set(core) & set(cpus)})
        if len(on) > 1:
            out.append(f"CPUs {','.join(map(str, core))}: {' and '.join(on)}")
    return out


# ----------------------------------------------------------------------------- the CPUs' speed
# The probe's work: pure Python, a fixed number of steps, timed by its own CPU time.
_PROBE = """
import sys, time
n, period = int(sys.argv[1]), float(sys.argv[2])
while True:
    t0 = time.thread_time()
    x = 0
    for i in range(n):
        x += i * i
    work = time.thread_time() - t0
    try:
        print(f"{time.time():.6f} {work:.9f}", flush=True)
    except (BrokenPipeError, OSError):
        break
    time.sleep(period)
"""


class SpeedProbe:
    """A process that times PROBE_STEPS of pure-Python work every `period_s` (about 1% of one CPU):
    the work's CPU seconds grow when this machine's cores run slower (a VM's clock, another
    tenant, a busy sibling thread), not when it waits for a CPU. `work(lo, hi)`: the median CPU
    seconds of the work between two times; the report sets each window's against their median
    over the windows."""

    STEPS = 20_000

    def __init__(self, cpus: tuple[int, ...] = (), period_s: float = 0.05) -> None:
        self.cpus, self.period_s = cpus, period_s
        self.samples: list[tuple[float, float]] = []  # (time the work ended, its CPU seconds)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> SpeedProbe:
        self._proc = subprocess.Popen([sys.executable, "-c", _PROBE, str(self.STEPS), str(self.period_s)],
                                      stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        if self.cpus:
            try:
                os.sched_setaffinity(self._proc.pid, self.cpus)
            except OSError:
                pass
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                at, work = (float(x) for x in line.split())
            except ValueError:
                continue
            with self._lock:
                self.samples.append((at, work))

    def work(self, lo: float, hi: float) -> float | None:
        """The median CPU seconds of the work that ended between `lo` and `hi` (time.time());
        None with fewer than 3 samples there."""
        with self._lock:
            inside = [w for t, w in self.samples if lo <= t <= hi]
        return round(statistics.median(inside), 9) if len(inside) >= 3 else None

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
