"""The smoke's endurance ramp (`python -m smoke run ... --ramp-minutes M`): for M minutes a closed
loop of clients whose number steps through every tier of the server's switching and back, a level
every few seconds (smoke.tiers.Tiers.endurance_levels), so that its depth (a schedule) or its mode
(a threshold) keeps changing; every output compared with the plain server's.

Memory is read with the server idle, before and after: the resident set (VmRSS of
/proc/PID/status) of every process of the server's group (its HTTP server, scheduler and
detokenizer), and the GPU memory nvidia-smi says each of them holds (where there is an nvidia-smi,
and it lists them). The numbers are reported either way; the ramp fails where either total grew by
more than a bound (--ramp-max-growth-mib): memory that grows with every change grows without bound
in a long enough run.
"""
from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from smoke import client
from smoke.checks import check_kv_back, spec_state, wait_idle
from smoke.client import Prompt
from smoke.deadline import Deadline
from smoke.server import SmokeError, group_pids

DEFAULT_HOLD_S = 5.0  # seconds per level
DEFAULT_MAX_GROWTH_MIB = 512.0  # per total (host, GPU) between before and after
RESERVE_S = 60.0  # the ramp starts only with this much left besides its own minutes: the checks after it


def rss_mib(pid: int) -> float | None:
    """VmRSS of /proc/PID/status in MiB; None for a process gone (or a kernel thread)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def gpu_mib_by_pid() -> tuple[dict[int, float] | None, str]:
    """GPU memory per process from nvidia-smi's compute apps; (None, why) where it cannot say."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi not found: GPU memory not read"
    try:
        p = subprocess.run([exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"nvidia-smi did not answer: {exc}"
    if p.returncode != 0:
        return None, f"nvidia-smi failed ({p.returncode}): {(p.stderr or p.stdout).strip()[:200]}"
    out: dict[int, float] = {}
    for line in p.stdout.splitlines():
        pid, _, used = line.partition(",")
        try:
            out[int(pid)] = out.get(int(pid), 0.0) + float(used)
        except ValueError:
            continue  # "[N/A]" (no permission) or a line that is not one
    return out, ""


def memory_of(pgid: int) -> dict[str, Any]:
    """The memory of the server's process group now: host (VmRSS) and GPU, in MiB per process and
    in all; gpu_mib None (and gpu_note why) where it could not be read for these processes."""
    pids = group_pids(pgid)
    rss = {pid: m for pid in pids if (m := rss_mib(pid)) is not None}
    out: dict[str, Any] = {"pids": pids, "rss_mib": round(sum(rss.values()), 1),
                           "rss_by_pid": {str(k): round(v, 1) for k, v in rss.items()}, "gpu_mib": None}
    gpu, note = gpu_mib_by_pid()
    if gpu is None:
        out["gpu_note"] = note
        return out
    mine = {pid: m for pid, m in gpu.items() if pid in pids}
    if mine:
        out["gpu_mib"] = round(sum(mine.values()), 1)
        out["gpu_by_pid"] = {str(k): v for k, v in mine.items()}
    else:
        out["gpu_note"] = (f"nvidia-smi lists none of the server's processes {pids} (another PID "
                           f"namespace?); its compute apps hold {sum(gpu.values()):.0f} MiB in all")
        out["gpu_all_mib"] = round(sum(gpu.values()), 1)
    return out


def growth(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float | None]:
    """MiB more after than before, host and GPU (None: GPU not read both times)."""
    gpu = (round(after["gpu_mib"] - before["gpu_mib"], 1)
           if before.get("gpu_mib") is not None and after.get("gpu_mib") is not None else None)
    return {"rss_mib": round(after["rss_mib"] - before["rss_mib"], 1), "gpu_mib": gpu}


def check_memory_growth(before: dict[str, Any], after: dict[str, Any], bound_mib: float) -> None:
    """SmokeError naming the total that grew by more than `bound_mib` MiB."""
    grown = growth(before, after)
    for key, what in (("rss_mib", "host memory (VmRSS)"), ("gpu_mib", "GPU memory")):
        g = grown[key]
        if g is not None and g > bound_mib:
            raise SmokeError(f"endurance: the server's {what} grew by {g:.0f} MiB over the ramp "
                             f"({before[key]:.0f} -> {after[key]:.0f} MiB), more than the bound of "
                             f"{bound_mib:.0f} MiB (--ramp-max-growth-mib)")


def run_endurance(base: str, prompts: Sequence[Prompt], refs: dict[str, list[int]], levels: list[int],
                  hold_s: float, seconds: float, timeout: float) -> dict[str, Any]:
    """A closed loop whose number of clients follows `levels` round and round, one every `hold_s`
    seconds, for `seconds`. Each client sends the prompts in turn (they have plain references);
    returns how many requests ran, failed, and came back unlike plain (the first of each)."""
    top = max(levels)
    t0 = time.time()
    end = t0 + seconds
    lock = threading.Lock()
    tally: dict[str, Any] = {"requests": 0, "errors": 0, "mismatches": 0, "first_error": None,
                             "first_mismatch": None}

    def worker(w: int) -> None:
        k = 0
        while (now := time.time()) < end:
            if w >= levels[int((now - t0) / hold_s) % len(levels)]:
                time.sleep(0.02)
                continue
            p = prompts[(w + k * top) % len(prompts)]
            k += 1
            r = client.generate(base, p, timeout)
            with lock:
                tally["requests"] += 1
                if r.error:
                    tally["errors"] += 1
                    tally["first_error"] = tally["first_error"] or f"{p.key}: {r.error[:300]}"
                elif r.output_ids != refs[p.key]:
                    tally["mismatches"] += 1
                    tally["first_mismatch"] = tally["first_mismatch"] or p.key

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(top)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, end - time.time()) + timeout)
    return {"seconds": round(time.time() - t0, 1), "levels": levels, "hold_s": hold_s, **tally}


def summary_line(e: dict[str, Any]) -> str:
    """The endurance ramp's numbers on one line: requests, changes, memory before and after."""
    b, a = e["memory_before"], e["memory_after"]
    g = growth(b, a)
    gpu = (f"GPU {b['gpu_mib']:.0f} -> {a['gpu_mib']:.0f} MiB ({g['gpu_mib']:+.0f})"
           if g["gpu_mib"] is not None else f"GPU: {a.get('gpu_note') or b.get('gpu_note')}")
    return (f"endurance {e['seconds'] / 60:.1f} min: {e['requests']} requests ({e['errors']} errors, "
            f"{e['mismatches']} unlike plain), {e['changes']} {e['changes_of']}; host RSS "
            f"{b['rss_mib']:.0f} -> {a['rss_mib']:.0f} MiB ({g['rss_mib']:+.0f}); {gpu}; "
            f"bound +{e['max_growth_mib']:.0f} MiB")


def phase(base: str, baseline: dict[str, Any], pgid: int, levels: list[int], prompts: Sequence[Prompt],
          refs: dict[str, list[int]], rep: dict[str, Any], *, minutes: float, hold_s: float,
          max_growth_mib: float, deadline: Deadline, timeout: float, counter: str,
          say: Callable[[str], None] = print) -> None:
    """The endurance ramp of a smoke server (its process group `pgid`): memory read idle, the
    closed loop through `levels` for `minutes`, memory read idle again; the numbers in
    rep["endurance"] and said (`say`: the smoke's progress), then checked: no error, every output
    equal to plain, the state's `counter` (depth_changes, mode_changes) moved, the KV pool back,
    neither memory total grown by more than `max_growth_mib`."""
    seconds = 60 * minutes
    left = deadline.left_for_requests()
    if left < seconds + RESERVE_S:
        raise SmokeError(f"endurance: --ramp-minutes {minutes:g} needs {seconds:.0f} s and "
                         f"{RESERVE_S:.0f} s for the checks after it, {left:.0f} s are left: "
                         "give a longer --deadline")
    wait_idle(base, baseline)
    st0, before = spec_state(client.server_info(base)), memory_of(pgid)
    res = run_endurance(base, prompts, refs, levels, hold_s, seconds, timeout)
    idle = wait_idle(base, baseline)
    st1, after = spec_state(client.server_info(base)), memory_of(pgid)
    rep["endurance"] = e = {**res, "changes": st1[counter] - st0[counter],
                            "changes_of": counter.replace("_", " "), "memory_before": before,
                            "memory_after": after, "growth": growth(before, after),
                            "max_growth_mib": max_growth_mib}
    say(f"{rep.get('name')}: {summary_line(e)}")
    if e["errors"]:
        raise SmokeError(f"endurance: {e['errors']} of {e['requests']} requests failed, first {e['first_error']}")
    if e["mismatches"]:
        raise SmokeError(f"endurance: {e['mismatches']} of {e['requests']} outputs unlike the plain "
                         f"server's, first {e['first_mismatch']}")
    if e["changes"] < 2:
        raise SmokeError(f"endurance: {e['changes']} {e['changes_of']} over levels {e['levels']}: "
                         "the load did not cross an edge, so the ramp proved nothing")
    check_kv_back(baseline, idle)
    check_memory_growth(before, after, max_growth_mib)
