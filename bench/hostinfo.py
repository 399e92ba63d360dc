"""What the host was doing during a window, read without changing anything: the CPU time the
hypervisor took from this machine (steal, /proc/stat), the CPUs' clock (/proc/cpuinfo) and the
GPU's SM clock and power (nvidia-smi's query, where there is one). A window that ran slow for no
reason of its server's shows here: the A/A floor's cause, named.

Standard library only: this runs on a bare GPU host.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

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
