"""A case on the threshold server under one load mode (see smoke.features): the filler that moves
the batch across the threshold, the waits for the mode, a run that must see the mode change while
the case's requests are in flight, the KV pool back at its idle size after each run, and the
KV-pressure case, whose requests the scheduler must retract."""
from __future__ import annotations

import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from smoke import client
from smoke.answers import REQUEST_CAP_S, cut_by_deadline, send_all
from smoke.cases import Case
from smoke.checks import check_kv_back, spec_state, wait_idle
from smoke.deadline import Deadline
from smoke.server import SmokeError
from smoke.verdicts import CaseFailure, Outcome, equal_tokens

# the filler: 4N requests of FILLER_PROMPT_TOKENS, each FILLER_NEW_TOKENS long while it keeps the
# batch above N ("above", "cross_up"), CROSS_DOWN_NEW_TOKENS when it must leave mid-case
FILLER_PROMPT_TOKENS = 32
FILLER_NEW_TOKENS = 400
CROSS_DOWN_NEW_TOKENS = 64
ATTEMPTS = 3             # runs of a case under a crossing mode before "the mode did not change" fails
RETRACT_LOG = re.compile(r"Retract requests")  # the scheduler's warning (not `retraction_policy`)
# A run of one mode starts only with this much left (beyond the margin): before its requests go out
# it may wait 20 s for the filler to move the mode and 10 s for its first request to run.
MODE_RESERVE_S = 45.0


class CaseInterrupted(Exception):
    """The deadline stopped a case (not the server): skipped, and run again by the next call."""


class NotExercised(CaseFailure):
    """The load did not move the mode as the run needed (timing): tried again, then a failure."""


class Filler:
    """4N greedy requests that keep the threshold server's batch above the threshold. `rolling`: each
    slot sends its next request when one ends, until stop(); else each slot sends one. No request
    outlives the deadline's margin, and none starts past it."""

    def __init__(self, base: str, prompts: list[list[int]], max_new: int, tag: str, deadline: Deadline,
                 rolling: bool):
        self.base, self.max_new, self.tag, self.deadline, self.rolling = base, max_new, tag, deadline, rolling
        self.stopping = False
        self.current: dict[int, str] = {}
        self.pool = ThreadPoolExecutor(max_workers=len(prompts))
        self.futures = [self.pool.submit(self._slot, i, p) for i, p in enumerate(prompts)]

    def _slot(self, i: int, ids: list[int]) -> str | None:
        k = 0
        while not self.stopping:
            timeout = self.deadline.request_budget(REQUEST_CAP_S)
            if timeout is None:
                return None  # the case's own requests say that the deadline stopped the run
            rid = self.current[i] = f"{self.tag}-{i}-{k}"
            payload = {"input_ids": ids, "rid": rid, "sampling_params": {
                "temperature": 0, "max_new_tokens": self.max_new, "ignore_eos": True}}
            try:
                client.post_json(self.base + "/generate", payload, timeout)
            except client.HTTPFailure as exc:
                if not self.stopping and self.deadline.request_budget(REQUEST_CAP_S) is not None:
                    return f"filler request {rid}: {exc}"[:400]
            k += 1
            if not self.rolling:
                break
        return None

    def stop(self) -> None:
        self.stopping = True
        for rid in list(self.current.values()):
            try:
                client.abort(self.base, rid)
            except client.HTTPFailure:
                pass
        self.wait()

    def wait(self) -> None:
        errors = [e for e in (f.result() for f in self.futures) if e]
        self.pool.shutdown()
        if errors:
            raise CaseFailure(errors[0])


def wait_mode(base: str, mode: str, timeout: float = 20) -> bool:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if spec_state(client.server_info(base))["mode"] == mode:
            return True
        time.sleep(0.05)
    return False


def wait_running(base: str, n: int, timeout: float = 10) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout and client.load(base).get("num_running_reqs", 0) < n:
        time.sleep(0.01)


def stop_if_cut(case: Case, mode: str, outs: Sequence[Outcome]) -> None:
    """A run the deadline cut short proves nothing either way: the case is run again next call."""
    if cut_by_deadline(outs):
        raise CaseInterrupted(f"{case.name} {mode}: the deadline stopped its requests")


def run_under(mode: str, base: str, case: Case, filler_prompts: list[list[int]],
              deadline: Deadline) -> tuple[list[Outcome], dict[str, Any]]:
    """The case's requests on the threshold server under one load mode; what the mode did."""
    tag = f"filler-{case.name}-{mode}-{int(time.time() * 1000)}"

    seen: dict[str, Any] = {}
    # the cross modes: how long the case's requests ran and when the mode changed, both from their
    # start (a crossing that came too late says by how much)
    started = time.monotonic()

    def case_run() -> list[Outcome]:
        outs = send_all(base, case.requests, case.concurrency, deadline)
        seen["case_ran_s"] = round(time.monotonic() - started, 2)
        return outs

    if mode == "below":
        outs = case_run()
        stop_if_cut(case, mode, outs)
        return outs, seen
    with ThreadPoolExecutor(max_workers=1) as one:
        if mode == "above":
            filler = Filler(base, filler_prompts, FILLER_NEW_TOKENS, tag, deadline, rolling=True)
            seen["plain_before"] = wait_mode(base, "plain")
            outs = case_run()
            seen["plain_after"] = spec_state(client.server_info(base))["mode"] == "plain"
            filler.stop()
            stop_if_cut(case, mode, outs)
            if not (seen["plain_before"] and seen["plain_after"]):
                raise NotExercised(f"above: the server was not in plain mode for the whole case ({seen})")
            return outs, seen
        if mode == "cross_up":
            fut = one.submit(case_run)
            wait_running(base, 1)  # the case's first request is in the batch
            filler = Filler(base, filler_prompts, FILLER_NEW_TOKENS, tag, deadline, rolling=True)
            changed = wait_mode(base, "plain")
            seen["crossed_in_flight"] = changed and not fut.done()
        elif mode == "cross_down":
            # short: it ends while the case's requests (CASE_TOKENS new tokens) still run
            filler = Filler(base, filler_prompts, CROSS_DOWN_NEW_TOKENS, tag, deadline, rolling=False)
            plain_before = wait_mode(base, "plain")
            started = time.monotonic()
            fut = one.submit(case_run)
            changed = plain_before and wait_mode(base, "speculative")
            seen["crossed_in_flight"] = changed and not fut.done()
        else:
            raise ValueError(mode)
        seen["mode_changed_after_s"] = round(time.monotonic() - started, 2) if changed else None
        outs = fut.result()
        if mode == "cross_up":
            filler.stop()
        else:
            filler.wait()
    stop_if_cut(case, mode, outs)
    if not seen.get("crossed_in_flight"):
        raise NotExercised(f"{mode}: the mode did not change while the case's requests were in flight "
                          f"({seen}): the run proved nothing")
    return outs, seen


def retractions(log: Path) -> int:
    return sum(1 for line in log.read_text(errors="replace").splitlines() if RETRACT_LOG.search(line))


def pool_back(base: str, baseline: dict[str, Any], deadline: Deadline, timeout: float = 30) -> None:
    """The KV pool back at its idle size after a run (wait_idle, ended by the deadline's margin). A
    wait the deadline cut short is no failure: the pool may still have been emptying."""
    allowed = min(timeout, deadline.left_for_requests())
    idle = wait_idle(base, baseline, timeout=max(0.0, allowed))
    try:
        check_kv_back(baseline, idle)
    except SmokeError as exc:
        if allowed < timeout:
            raise CaseInterrupted(f"the deadline came while the pool emptied: {exc.cause}") from exc
        raise CaseFailure(exc.cause) from exc


def run_case_mode(case: Case, mode: str, ref: list[Outcome], base: str, baseline: dict[str, Any],
                  filler_prompts: list[list[int]], deadline: Deadline) -> dict[str, Any]:
    before = spec_state(client.server_info(base))
    try:
        outs, seen = run_under(mode, base, case, filler_prompts, deadline)
        detail = case.check(ref, outs)
        after = spec_state(client.server_info(base))
        if mode == "below" and after["plain_steps"] - before["plain_steps"] > 1:
            raise CaseFailure(f"below: {after['plain_steps'] - before['plain_steps']} plain steps "
                              "while the batch stayed under the threshold")
        pool_back(base, baseline, deadline)
        # the steps, not only the mode: on 0.5.17 a batch holding a grammar or penalties keeps
        # speculating while the mode is plain (they are applied inside verification)
        return {"ok": True, **detail, **seen, "mode_changes": after["mode_changes"] - before["mode_changes"],
                "plain_steps": after["plain_steps"] - before["plain_steps"],
                "speculative_steps": after["speculative_steps"] - before["speculative_steps"]}
    except CaseFailure as exc:
        wait_idle(base, baseline, timeout=max(0.0, min(30, deadline.left_for_requests())))
        return {"ok": False, "cause": str(exc), "not_exercised": isinstance(exc, NotExercised)}


def run_case_modes(case: Case, ref: list[Outcome], base: str, baseline: dict[str, Any],
                   filler_prompts: list[list[int]], deadline: Deadline) -> dict[str, Any]:
    """Every mode of the case, a mode that did not move as it needed tried again; CaseInterrupted
    where the deadline leaves too little time for the next run."""
    rows: dict[str, Any] = {}
    for mode in case.modes:
        for attempt in range(1, ATTEMPTS + 1):
            if deadline.left_for_requests() < MODE_RESERVE_S:
                raise CaseInterrupted(f"{case.name} {mode}: not started, {deadline.left():.0f}s left")
            rows[mode] = run_case_mode(case, mode, ref, base, baseline, filler_prompts, deadline)
            rows[mode]["attempts"] = attempt
            if rows[mode]["ok"] or not rows[mode].get("not_exercised"):
                break
    return rows


def run_pressure(pressure: Case, ref: list[Outcome], base: str, baseline: dict[str, Any], log: Path,
                 deadline: Deadline) -> dict[str, Any]:
    """KV pressure: all requests at once into a small pool; retractions must happen and change nothing."""
    retract_before = retractions(log)
    before = spec_state(client.server_info(base))
    outs = send_all(base, pressure.requests, pressure.concurrency, deadline)
    stop_if_cut(pressure, "above", outs)
    try:
        row: dict[str, Any] = {"ok": True, **equal_tokens(ref, outs)}
        after = spec_state(client.server_info(base))
        for k in ("mode_changes", "plain_steps", "speculative_steps"):
            row[k] = after[k] - before[k]
        row["retract_log_lines"] = retractions(log) - retract_before
        if row["retract_log_lines"] == 0:
            raise CaseFailure("no request was retracted: the pool was not under pressure")
        pool_back(base, baseline, deadline, timeout=60)
    except (CaseFailure, SmokeError) as exc:
        row = {"ok": False, "cause": getattr(exc, "cause", str(exc))}
    return row

