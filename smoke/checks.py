"""The checks of a server from the outside: its log, its outputs against the plain server's, its
speculation counters (server info), the accept length, aborted requests, the KV pool. Each raises
SmokeError(cause); all but wait_idle are pure (they read what the run collected). The smoke run
(smoke.runner), the feature matrix and bench/ call them.
"""
from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any

from sglang_image_plugin.setting import START_LOG_LINE, DepthSchedule, start_log_line
from smoke import client
from smoke.client import Result
from smoke.server import SmokeError

# the plugin's (and the 0.5.17 flavor's patch's) words for the plain step (the start and
# mode-change lines are the setting's)
KV_ONLY_LINE = "write only the draft's K/V"
FULL_DRAFT_LINE = "run the draft's full step"
# what a depth schedule server's state has instead of a threshold (plugin: DepthSchedulePolicy)
SCHEDULE_STATE = ("schedule", "depth", "steps_by_depth", "depth_changes")
# the start of the line a depth schedule server logs at a depth change (plugin: policy.py)
DEPTH_CHANGE_LOG_PREFIX = "Speculation depth ->"
# Lines that mean the server is broken even if every request came back.
BAD_LOG_PATTERNS = (
    re.compile(r"^Traceback \(most recent call last\)", re.MULTILINE),
    re.compile(r"memory leak detected", re.IGNORECASE),
    re.compile(r"KV double free|use-after-free", re.IGNORECASE),
    re.compile(r"CUDA error|illegal memory access", re.IGNORECASE),
)


def check_start_log(log_text: str, threshold: int | str, schedule: DepthSchedule | None = None) -> None:
    """The setting's start line for this threshold (or, given one, depth schedule), exactly: the
    value must not continue (threshold=4 must not match threshold=40, a schedule ending 65-:0
    not one that goes on)."""
    want = START_LOG_LINE.format(threshold=threshold) if schedule is None else start_log_line(0, schedule)
    goes_on = "0123456789" if schedule is None else "0123456789,-:"
    for line in log_text.splitlines():
        if want in line:
            rest = line.split(want, 1)[1]
            if rest[:1] == "" or rest[0] not in goes_on:
                return
    raise SmokeError(f"start log line missing: expected a line containing {want!r} "
                       "(is the dynamic-speculation-disable patch applied and the flag passed?)")


def draft_plain_step(state: dict[str, Any], log_text: str) -> str | None:
    """What the server's plain steps do with the draft: "kv_only" (the draft's K/V only,
    one-layer EAGLE-3 drafts), "full" (the draft's whole step), None (it does not say). The
    server info's `plain_step` where the server has one (the plugin), else the start log's words
    (0.5.17's series)."""
    step = state.get("plain_step")
    if isinstance(step, dict) and "draft" in step:
        return "kv_only" if step["draft"] == "kv only" else "full"
    for line in log_text.splitlines():
        if KV_ONLY_LINE in line:
            return "kv_only"
        if FULL_DRAFT_LINE in line:
            return "full"
    return None


def check_log_clean(log_text: str) -> None:
    for pat in BAD_LOG_PATTERNS:
        m = pat.search(log_text)
        if m:
            start = log_text.rfind("\n", 0, m.start()) + 1
            end = log_text.find("\n", m.end())
            line = log_text[start: end if end >= 0 else None]
            raise SmokeError(f"server log shows an error: {line.strip()[:300]!r}")


def check_no_errors(results: Iterable[Result], phase: str) -> None:
    errs = [(r.key, r.error) for r in results if r.error]
    if errs:
        key, error = errs[0]
        raise SmokeError(f"{phase}: {len(errs)} request(s) failed, first ({key}): {error[:400]}")


def check_outputs(reference: dict[str, list[int]], results: Iterable[Result], phase: str) -> None:
    """Greedy outputs must equal the plain server's token for token."""
    bad = []
    for r in results:
        if r.error:
            continue
        ref = reference.get(r.key)
        if ref is None:
            raise SmokeError(f"{phase}: no reference output for prompt {r.key}")
        if r.output_ids != ref:
            got = r.output_ids or []
            at = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            bad.append(f"{r.key}: first difference at token {at}: got {got[at:at + 5]} "
                       f"expected {ref[at:at + 5]} (lengths {len(got)}/{len(ref)})")
    if bad:
        raise SmokeError(f"{phase}: output mismatch vs the plain server in {len(bad)} request(s); "
                           + "; ".join(bad[:3]))


def check_hf_reference(expected: dict[str, Any], output_ids: list[int] | None) -> None:
    if output_ids != expected["greedy_ids"]:
        raise SmokeError("plain server output differs from the HF transformers reference in "
                           f"expected.json: got {output_ids} expected {expected['greedy_ids']}")


def spec_state(info: dict[str, Any]) -> dict[str, Any]:
    """internal_states[0]["speculative_disable"] of /get_server_info (the patch's contract): a
    threshold server's, or a depth schedule server's (its schedule, depth and steps per depth)."""
    states = info.get("internal_states") or []
    if not states or not isinstance(states[0], dict) or "speculative_disable" not in states[0]:
        raise SmokeError("/get_server_info has no internal_states[0]['speculative_disable'] "
                           "(is the dynamic-speculation-disable patch applied?)")
    st = states[0]["speculative_disable"]
    own = SCHEDULE_STATE if isinstance(st, dict) and "schedule" in st else ("threshold",)
    missing = [k for k in (*own, "mode", "speculative_steps", "plain_steps", "mode_changes")
               if k not in st]
    if missing:
        raise SmokeError(f"speculative_disable state lacks {missing}: {st}")
    state: dict[str, Any] = st
    return state


def check_threshold_state(st: dict[str, Any], threshold: int) -> None:
    if st["threshold"] != threshold:
        raise SmokeError(f"server-info threshold is {st['threshold']}, expected {threshold}")


def check_mode(st: dict[str, Any], mode: str, phase: str) -> None:
    if st["mode"] != mode:
        raise SmokeError(f"{phase}: mode is {st['mode']!r}, expected {mode!r} ({st})")


def check_switched(st: dict[str, Any], phase: str, *, min_changes: int = 2) -> None:
    problems = []
    if st["plain_steps"] <= 0:
        problems.append("plain_steps == 0 (speculation never turned off above the threshold)")
    if st["speculative_steps"] <= 0:
        problems.append("speculative_steps == 0")
    if st["mode_changes"] < min_changes:
        problems.append(f"mode_changes {st['mode_changes']} < {min_changes}")
    if problems:
        raise SmokeError(f"{phase}: the mode did not switch as expected: " + "; ".join(problems)
                           + f" ({st})")


def depth_steps(st: dict[str, Any]) -> dict[int, int]:
    """A schedule server's decode steps so far, by depth."""
    return {int(d): int(n) for d, n in st["steps_by_depth"].items()}


def check_schedule_state(st: dict[str, Any], schedule: DepthSchedule) -> None:
    """The server runs this schedule (its normal form) and counts the steps of each of its depths."""
    if st["schedule"] != str(schedule):
        raise SmokeError(f"server-info schedule is {st['schedule']!r}, expected {str(schedule)!r}")
    if sorted(depth_steps(st)) != sorted(schedule.depths):
        raise SmokeError(f"server-info steps_by_depth counts depths {sorted(depth_steps(st))}, "
                         f"expected the schedule's {sorted(schedule.depths)} ({st})")


def check_depth(st: dict[str, Any], depth: int, phase: str) -> None:
    if st["depth"] != depth:
        raise SmokeError(f"{phase}: depth is {st['depth']}, expected {depth} ({st})")


def check_depths_of_load(before: dict[str, Any], after: dict[str, Any], depth: int,
                         phase: str) -> dict[int, int]:
    """A load that took the batch up to a size of the tier of `depth`, from a deeper tier: steps
    at that depth, none at a shallower one (a tier of larger batches). Returns the steps it ran
    at each depth."""
    d = {k: n - depth_steps(before)[k] for k, n in depth_steps(after).items()}
    if d.get(depth, 0) <= 0:
        raise SmokeError(f"{phase}: no step at depth {depth}, the depth of its batch size "
                         f"(steps by depth during the load: {d})")
    beyond = {k: n for k, n in d.items() if k < depth and n > 0}
    if beyond:
        raise SmokeError(f"{phase}: steps at depths {sorted(beyond)} of larger batches than the "
                         f"load's, whose depth is {depth} (steps by depth during the load: {d})")
    return d


def check_only_depth(before: dict[str, Any], after: dict[str, Any], depth: int, phase: str,
                     *, at_most: int = 0) -> None:
    """Requests one at a time: steps at `depth` (the first tier's), at most `at_most` at others."""
    d = {k: n - depth_steps(before)[k] for k, n in depth_steps(after).items()}
    if d.get(depth, 0) <= 0:
        raise SmokeError(f"{phase}: no step at depth {depth} (steps by depth: {d})")
    other = sum(n for k, n in d.items() if k != depth)
    if other > at_most:
        raise SmokeError(f"{phase}: {other} step(s) at other depths than {depth} while one request "
                         f"ran at a time (steps by depth: {d})")


def check_depths_ran(st: dict[str, Any], depths: list[int], phase: str,
                     before: dict[str, Any] | None = None) -> None:
    """Every one of `depths` ran steps (since `before`, where given): a schedule's every depth
    after the loads."""
    now = depth_steps(st)
    then = depth_steps(before) if before is not None else {}
    idle = [d for d in depths if now.get(d, 0) - then.get(d, 0) <= 0]
    if idle:
        raise SmokeError(f"{phase}: no step at depth(s) {idle} of {sorted(depths, reverse=True)} "
                         f"(steps by depth: {now}{'' if before is None else f', before: {then}'})")


def check_depth_changes(before: dict[str, Any], after: dict[str, Any], phase: str, *,
                        at_least: int, at_most: int) -> int:
    """The depth changed at least `at_least` times (the load crossed edges) and at most `at_most`
    (it did not flip back and forth)."""
    n = int(after["depth_changes"]) - int(before["depth_changes"])
    if n < at_least:
        raise SmokeError(f"{phase}: {n} depth change(s), expected at least {at_least} ({after})")
    if n > at_most:
        raise SmokeError(f"{phase}: {n} depth changes, more than the {at_most} its loads can "
                         f"cause: the depth flips back and forth ({after})")
    return n


def check_delta(before: dict[str, Any], after: dict[str, Any], key: str, phase: str,
                *, positive: bool, at_most: int = 0) -> int:
    """positive: the counter must grow; else it may grow by `at_most` at most."""
    d = int(after[key]) - int(before[key])
    if positive and d <= 0:
        raise SmokeError(f"{phase}: {key} did not grow ({before[key]} -> {after[key]})")
    if not positive and d > at_most:
        raise SmokeError(f"{phase}: {key} grew by {d} but should not have"
                           + (f" grown by more than {at_most}" if at_most else ""))
    return d


def spec_deltas(st: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """A phase's record of the server's speculation state: the state after it and what changed."""
    out: dict[str, Any] = {
        "spec_disable": st,
        "d_plain_steps": st["plain_steps"] - before["plain_steps"],
        "d_speculative_steps": st["speculative_steps"] - before["speculative_steps"],
        "d_mode_changes": st["mode_changes"] - before["mode_changes"]}
    if "steps_by_depth" in st:  # a depth schedule's
        was = depth_steps(before)
        out["d_depth_changes"] = st["depth_changes"] - before["depth_changes"]
        out["d_steps_by_depth"] = {str(d): n - was.get(d, 0) for d, n in depth_steps(st).items()}
    return out


def accept_stats(results: Iterable[Result]) -> dict[str, Any]:
    """Mean of the per-request meta_info spec_* fields (requests without them: no speculative step)."""
    lens = [r.meta["spec_accept_length"] for r in results if "spec_accept_length" in r.meta]
    rates = [r.meta["spec_accept_rate"] for r in results if "spec_accept_rate" in r.meta]
    verify = [r.meta.get("spec_verify_ct", 0) for r in results]
    toks = [r.meta.get("completion_tokens", len(r.output_ids or [])) for r in results]
    return {"accept_length": sum(lens) / len(lens) if lens else None,
            "accept_rate": sum(rates) / len(rates) if rates else None,
            "requests_with_spec": len(lens), "requests": len(verify),
            "verify_ct": sum(verify), "completion_tokens": sum(toks)}


def check_accept_recovers(before: dict[str, Any], after: dict[str, Any], *,
                          min_before: float = 1.2, ratio: float = 0.9) -> None:
    b, a = before.get("accept_length"), after.get("accept_length")
    if b is None or b < min_before:
        raise SmokeError(f"accept length below the threshold is {b} (< {min_before}): the draft "
                           "is not accepted at low load, so the test says nothing")
    if a is None or a < ratio * b:
        raise SmokeError(f"accept length after the disabled phase is {a}, below {ratio} x {b:.2f} "
                           "measured before it (draft state not restored after re-enabling?)")


def check_aborted(reference: dict[str, list[int]], results: Iterable[Result], aborted: set[str],
                  phase: str) -> dict[str, int]:
    """Requests not aborted must equal the plain server's output; aborted ones may end early or
    fail, but what they returned must be a prefix of it. Returns how many were cut short."""
    cut = 0
    for r in results:
        ref = reference.get(r.key)
        if ref is None:
            raise SmokeError(f"{phase}: no reference output for prompt {r.key}")
        if r.key not in aborted:
            if r.error:
                raise SmokeError(f"{phase}: request {r.key} (not aborted) failed: {r.error[:300]}")
            if r.output_ids != ref:
                check_outputs(reference, [r], phase)
            continue
        got = r.output_ids or []
        if got != ref[:len(got)]:
            raise SmokeError(f"{phase}: aborted request {r.key} returned tokens that are not a prefix "
                               f"of the plain output (lengths {len(got)}/{len(ref)})")
        cut += int(r.error is not None or len(got) < len(ref))
    return {"aborted_cut_short": cut, "aborted_sent": len(aborted)}


def check_kv_back(baseline: dict[str, Any], final: dict[str, Any]) -> None:
    if final.get("num_running_reqs", 0) != 0:
        raise SmokeError(f"requests still running after the load ended: {final}")
    if final["num_used_tokens"] != baseline["num_used_tokens"]:
        raise SmokeError(f"KV pool not back to its initial size: {final['num_used_tokens']} tokens "
                           f"in use after the load vs {baseline['num_used_tokens']} before "
                           f"(of {final.get('max_total_num_tokens')})")


def wait_idle(base: str, baseline: dict[str, Any], timeout: float = 30) -> dict[str, Any]:
    """The server's load once nothing runs or waits and the pool is back at the baseline's size;
    after `timeout`, the last load as it is (check_kv_back says what is wrong with it)."""
    t0, last = time.time(), client.load(base)
    while time.time() - t0 < timeout:
        last = client.load(base)
        if last.get("num_running_reqs", 0) == 0 and last.get("num_waiting_reqs", 0) == 0 \
                and last["num_used_tokens"] == baseline["num_used_tokens"]:
            return last
        time.sleep(0.5)
    return last

