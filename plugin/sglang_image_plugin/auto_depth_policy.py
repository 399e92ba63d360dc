"""The learned depth schedule (`--speculative-depth-schedule auto`) as the worker's policy:
AutoDepthController (auto_depth.py) behind upstream's adaptive-speculation policy protocol, timing
each step (auto_policy.TimedPolicy: the first step after a change of depth or kind left out) and
reporting like the fixed schedule: the metrics, a log line per move of the learned schedule with
what it was made on, the server-info view, and the step trace (each move too).

Pure Python (no torch, no sglang).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from sglang_image_plugin.auto_depth import AutoDepthController
from sglang_image_plugin.auto_policy import Step, TimedPolicy
from sglang_image_plugin.setting import Mode
from sglang_image_plugin.spec_disable import MODE_LOG_INTERVAL_S, Metrics

logger = logging.getLogger(__name__)

MOVE_LOG_PREFIX = "Speculation depth schedule ->"


class AutoDepthPolicy(TimedPolicy):
    """Every depth 0..K is a candidate step count with its own runtime state, its graphs at every
    captured batch size (the schedule is learned at run time); each decode batch runs the depth the
    controller decides. A move of the learned schedule is logged (at most one line per log
    interval; a move within it is counted into the next line, which reports the latest)."""

    def __init__(self, controller: AutoDepthController, *,
                 log_fn: Callable[[str], None] | None = None,
                 clock: Callable[[], float] | None = None,
                 log_interval_s: float = MODE_LOG_INTERVAL_S,
                 step_clock: Callable[[], float] | None = None,
                 trace: Callable[[dict[str, object]], None] | None = None) -> None:
        super().__init__(controller.max_depth, step_clock, trace)
        self.controller = controller
        self.metrics = Metrics()
        self._log_fn = log_fn if log_fn is not None else logger.info
        self._log_clock = clock if clock is not None else time.monotonic
        self._log_interval_s = log_interval_s
        self._last_log_time: float | None = None
        self._moves_seen = 0  # controller.schedule_changes when last looked at
        self._folded = 0  # moves since the last line
        self.mode_changes = 0  # plain <-> drafting, as the other policies count them
        self._last_depth = controller.max_depth

    @property
    def candidate_steps(self) -> list[int]:
        return list(self.controller.depths)

    # -- TimedPolicy's part ---------------------------------------------------------------------
    def _decide(self, batch_size: int) -> int:
        return self.controller.decide(batch_size)

    def _idle_steps(self) -> int:
        return self._last_depth

    def _record(self, step: Step) -> None:
        self.controller.record(step.depth, step.batch_size, step.seconds or 0.0)

    def _accepted(self, step: Step, num_correct_drafts_per_req: Sequence[int]) -> None:
        self.controller.record_accepted(step.depth, num_correct_drafts_per_req)

    def _trace_fields(self, step: Step) -> dict[str, object]:
        return {"depth": step.depth, "schedule": self.controller.schedule_text}

    def _went_idle(self) -> None:
        self.controller.note_idle()

    # -- the protocol, with the reports ---------------------------------------------------------
    def get_steps_for_batch(self, batch_size: int) -> int:
        depth = super().get_steps_for_batch(batch_size)
        if batch_size <= 0:
            return depth
        if (depth == 0) != (self._last_depth == 0):
            self.mode_changes += 1
        self._last_depth = depth
        plain = depth == 0
        self.metrics.observe(plain, int(not plain), int(plain))
        self.metrics.observe_depth(depth)
        if self.controller.schedule_changes != self._moves_seen:
            self._folded += self.controller.schedule_changes - self._moves_seen
            self._moves_seen = self.controller.schedule_changes
            move = self.controller.last_move
            if move is not None and self._trace is not None:
                self._trace({"t": round(self._clock(), 6), **move.record()})
        if self._folded:
            self._report()
        return depth

    def _report(self) -> None:
        move = self.controller.last_move
        now = self._log_clock()
        if move is None or (self._last_log_time is not None
                            and now - self._last_log_time < self._log_interval_s):
            return
        folded = f"; {self._folded - 1} earlier move(s) not logged" if self._folded > 1 else ""
        self._log_fn(f"{MOVE_LOG_PREFIX} {move.after} (auto, was {move.before}; {move.text()}); "
                     f"schedule_changes={self.controller.schedule_changes}{folded}")
        self._folded = 0
        self._last_log_time = now

    def snapshot(self) -> dict[str, Any]:
        """The server-info view: internal_states[i]["speculative_disable"]."""
        state = self.controller.state()
        steps = self.controller.steps_by_depth
        return {**state, "mode": str(Mode.PLAIN if state["depth"] == 0 else Mode.SPECULATIVE),
                "speculative_steps": sum(n for d, n in steps.items() if d > 0), "plain_steps": steps[0],
                "mode_changes": self.mode_changes, "max_batch_size": self.controller.config.max_batch_size,
                "unrecorded_steps": self.dropped, "estimates": self.controller.estimates(),
                "estimates_text": self.controller.estimates_text()}
