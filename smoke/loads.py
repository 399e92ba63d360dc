"""A case on the switching server under one load mode (see smoke.features): the filler that moves
the batch across an edge (a threshold's, or each of a depth schedule's), the waits for the mode or
the depth, a run that must see the change while the case's requests are in flight, the KV pool back
at its idle size after each run, and the KV-pressure case, whose requests the scheduler must
retract. A mode is a threshold server's by its name ("below", "above", "cross_up", "cross_down")
or a smoke.tiers.LoadMode (a schedule server's per tier and edge; Tiers.matrix_plan)."""
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
from smoke.tiers import PLAIN, THRESHOLD_MODES, LoadMode
from smoke.verdicts import CaseFailure, Outcome, equal_tokens

# the filler: 4N requests of FILLER_PROMPT_TOKENS, each FILLER_NEW_TOKENS long while it keeps the
# batch above N ("above", "cross_up"), CROSS_DOWN_NEW_TOKENS when it must leave mid-case; for a
# schedule, 4x its top edge, of which the LoadMode's base and extra are taken
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


def slot_tokens(slot: int, slots: int, longest: int) -> int:
    """The length of a rolling filler slot's requests: spread evenly from half `longest` to
    `longest`. Sent together with one length, they would all end in the same step, and the batch
    would fall out of the tier it holds while they come back (GPU, a 5/4/3 schedule: a grammar
    case that ran as long as they did saw depth 5 in its tier of depth 4)."""
    if slots <= 1:
        return longest
    return longest - (longest // 2) * slot // (slots - 1)


class Filler:
    """4N greedy requests that keep the threshold server's batch above the threshold. `rolling`: each
    slot sends its next request when one ends, until stop(), its requests of its own length
    (slot_tokens, at most `max_new`); else each slot sends one of `max_new` tokens, all ending
    together. No request outlives the deadline's margin, and none starts past it."""

    def __init__(self, base: str, prompts: list[list[int]], max_new: int, tag: str, deadline: Deadline,
                 rolling: bool):
        self.base, self.max_new, self.tag, self.deadline, self.rolling = base, max_new, tag, deadline, rolling
        self.stopping = False
        self.current: dict[int, str] = {}
        self.slots = len(prompts)
        self.pool = ThreadPoolExecutor(max_workers=len(prompts))
        self.futures = [self.pool.submit(self._slot, i, p) for i, p in enumerate(prompts)]

    def _slot(self, i: int, ids: list[int]) -> str | None:
        k = 0
        new_tokens = slot_tokens(i, self.slots, self.max_new) if self.rolling else self.max_new
        while not self.stopping:
            timeout = self.deadline.request_budget(REQUEST_CAP_S)
            if timeout is None:
                return None  # the case's own requests say that the deadline stopped the run
            rid = self.current[i] = f"{self.tag}-{i}-{k}"
            payload = {"input_ids": ids, "rid": rid, "sampling_params": {
                "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
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


def mode_of(mode: str | LoadMode) -> LoadMode:
    """A threshold mode's name as its LoadMode; a LoadMode as it is."""
    return mode if isinstance(mode, LoadMode) else THRESHOLD_MODES[mode]


def at(st: dict[str, Any], where: str | int) -> bool:
    """Whether the server is there: a mode ("plain", "speculative") or a schedule's depth."""
    return bool(st.get("depth") == where) if isinstance(where, int) else bool(st["mode"] == where)


def where_name(where: str | int) -> str:
    return f"depth {where}" if isinstance(where, int) else f"{where} mode"


def wait_mode(base: str, mode: str | int, timeout: float = 20) -> bool:
    """Until the server is in `mode` (or at that depth: at()); False after `timeout`."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if at(spec_state(client.server_info(base)), mode):
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


def run_under(mode: str | LoadMode, base: str, case: Case, filler_prompts: list[list[int]],
              deadline: Deadline) -> tuple[list[Outcome], dict[str, Any]]:
    """The case's requests on the switching server under one load mode; what the load did. The
    filler: `base` of its prompts hold the batch where the case starts (none: the case alone),
    the next `extra` arrive (up) or leave (down) while the case's requests run."""
    load = mode_of(mode)
    tag = f"filler-{case.name}-{load.name}-{int(time.time() * 1000)}"

    seen: dict[str, Any] = {}
    # the cross modes: how long the case's requests ran and when the mode changed, both from their
    # start (a crossing that came too late says by how much)
    started = time.monotonic()

    def case_run() -> list[Outcome]:
        outs = send_all(base, case.requests, case.concurrency, deadline)
        seen["case_ran_s"] = round(time.monotonic() - started, 2)
        return outs

    if load.kind == "in" and load.base == 0:
        outs = case_run()
        stop_if_cut(case, load.name, outs)
        return outs, seen
    holding = filler_prompts if load.base is None else filler_prompts[:load.base]
    moving = filler_prompts[len(holding):] if load.extra is None else \
        filler_prompts[len(holding):len(holding) + load.extra]
    with ThreadPoolExecutor(max_workers=1) as one:
        if load.kind == "in":
            label = load.start if isinstance(load.start, str) else f"depth{load.start}"
            filler = Filler(base, holding, FILLER_NEW_TOKENS, tag, deadline, rolling=True)
            seen[f"{label}_before"] = wait_mode(base, load.start)
            outs = case_run()
            seen[f"{label}_after"] = at(spec_state(client.server_info(base)), load.start)
            filler.stop()
            stop_if_cut(case, load.name, outs)
            if not (seen[f"{label}_before"] and seen[f"{label}_after"]):
                raise NotExercised(f"{load.name}: the server was not in {where_name(load.start)} for "
                                   f"the whole case ({seen})")
            return outs, seen
        assert load.end is not None
        # a schedule's tier between others: a filler holds the batch there while the case runs
        hold = (Filler(base, holding, FILLER_NEW_TOKENS, tag + "-hold", deadline, rolling=True)
                if holding else None)
        try:
            if load.kind == "up":
                start_ok = hold is None or wait_mode(base, load.start)
                started = time.monotonic()
                fut = one.submit(case_run)
                wait_running(base, len(holding) + 1)  # the case's first request is in the batch
                filler = Filler(base, moving, FILLER_NEW_TOKENS, tag, deadline, rolling=True)
                changed = start_ok and wait_mode(base, load.end)
            elif load.kind == "down":
                # short: it ends while the case's requests (CASE_TOKENS new tokens) still run
                filler = Filler(base, moving, CROSS_DOWN_NEW_TOKENS, tag, deadline, rolling=False)
                start_ok = wait_mode(base, load.start)
                started = time.monotonic()
                fut = one.submit(case_run)
                changed = start_ok and wait_mode(base, load.end)
            else:
                raise ValueError(load.kind)
            seen["crossed_in_flight"] = changed and not fut.done()
            seen["mode_changed_after_s"] = round(time.monotonic() - started, 2) if changed else None
            outs = fut.result()
            if load.kind == "up":
                filler.stop()
            else:
                filler.wait()
        finally:
            if hold is not None:
                hold.stop()
    stop_if_cut(case, load.name, outs)
    if not seen.get("crossed_in_flight"):
        raise NotExercised(f"{load.name}: the {'mode' if isinstance(load.end, str) else 'depth'} did "
                           f"not change while the case's requests were in flight ({seen}): the run "
                           "proved nothing")
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


def steps_elsewhere(before: dict[str, Any], after: dict[str, Any], where: str | int) -> int:
    """Decode steps since `before` that did not run there: a threshold server's plain steps (where
    it should speculate), a schedule server's steps at other depths than `where`."""
    if isinstance(where, str):
        other = "speculative_steps" if where == PLAIN else "plain_steps"
        return int(after[other]) - int(before[other])
    return sum(int(n) - int(before["steps_by_depth"].get(d, 0))
               for d, n in after["steps_by_depth"].items() if int(d) != where)


def step_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """A run's mode changes and steps; a schedule server's depth changes and steps per depth too.
    The steps, not only the mode: on 0.5.17 a batch holding a grammar or penalties keeps
    speculating while the mode is plain (they are applied inside verification)."""
    out: dict[str, Any] = {k: after[k] - before[k] for k in ("mode_changes", "plain_steps", "speculative_steps")}
    if "steps_by_depth" in after:
        out["depth_changes"] = after["depth_changes"] - before["depth_changes"]
        out["steps_by_depth"] = {d: n - before["steps_by_depth"].get(d, 0)
                                 for d, n in after["steps_by_depth"].items()}
    return out


def run_case_mode(case: Case, mode: str | LoadMode, ref: list[Outcome], base: str,
                  baseline: dict[str, Any], filler_prompts: list[list[int]],
                  deadline: Deadline) -> dict[str, Any]:
    load = mode_of(mode)
    before = spec_state(client.server_info(base))
    try:
        outs, seen = run_under(load, base, case, filler_prompts, deadline)
        detail = case.check(ref, outs)
        after = spec_state(client.server_info(base))
        if load.kind == "in" and load.base == 0:  # the case alone: the first tier only
            n = steps_elsewhere(before, after, load.start)
            if n > 1 and isinstance(load.start, str):
                raise CaseFailure(f"below: {n} plain steps while the batch stayed under the threshold")
            if n > 1:
                raise CaseFailure(f"{load.name}: {n} steps at other depths than {load.start} while "
                                  "the batch stayed in its tier")
        pool_back(base, baseline, deadline)
        return {"ok": True, **detail, **seen, **step_deltas(before, after)}
    except CaseFailure as exc:
        wait_idle(base, baseline, timeout=max(0.0, min(30, deadline.left_for_requests())))
        return {"ok": False, "cause": str(exc), "not_exercised": isinstance(exc, NotExercised)}


def run_case_modes(case: Case, ref: list[Outcome], base: str, baseline: dict[str, Any],
                   filler_prompts: list[list[int]], deadline: Deadline) -> dict[str, Any]:
    """Every mode of the case (its LoadModes, on a schedule server: Tiers.matrix_plan), a mode that
    did not move as it needed tried again; CaseInterrupted where the deadline leaves too little
    time for the next run."""
    rows: dict[str, Any] = {}
    for mode in case.modes:
        name = mode_of(mode).name
        for attempt in range(1, ATTEMPTS + 1):
            if deadline.left_for_requests() < MODE_RESERVE_S:
                raise CaseInterrupted(f"{case.name} {name}: not started, {deadline.left():.0f}s left")
            rows[name] = run_case_mode(case, mode, ref, base, baseline, filler_prompts, deadline)
            rows[name]["attempts"] = attempt
            if rows[name]["ok"] or not rows[name].get("not_exercised"):
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
        row.update(step_deltas(before, spec_state(client.server_info(base))))
        row["retract_log_lines"] = retractions(log) - retract_before
        if row["retract_log_lines"] == 0:
            raise CaseFailure("no request was retracted: the pool was not under pressure")
        pool_back(base, baseline, deadline, timeout=60)
    except (CaseFailure, SmokeError) as exc:
        row = {"ok": False, "cause": getattr(exc, "cause", str(exc))}
    return row

