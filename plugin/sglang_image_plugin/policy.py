"""The threshold as a policy of upstream's adaptive speculation (AdaptiveSpecPolicy).

Upstream's AdaptiveController builds one runtime state per candidate step count
(draft/verify attention backends and CUDA graphs) and switches the worker between
them per decode batch. Two candidates, the configured step count K and 0, give the
switch: 0 steps is upstream's zero-step tier (no drafting; the target samples one
token per request from a one-token verify, and the draft extend keeps the draft's
KV cache filled). Pure logic: no sglang imports. ThresholdPolicy: a fixed N;
AutoThresholdPolicy: `auto`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from sglang_image_plugin.auto_config import resume_batch_size
from sglang_image_plugin.auto_policy import AutoPolicy
from sglang_image_plugin.auto_threshold import AutoController
from sglang_image_plugin.depth_schedule import DepthController
from sglang_image_plugin.setting import MODE_CHANGE_LOG_PREFIX, Mode
from sglang_image_plugin.spec_disable import MODE_LOG_INTERVAL_S, Metrics, SpecDisableController

logger = logging.getLogger(__name__)

PLAIN_STEPS = 0


class ThresholdPolicy:
    """Steps K below the threshold, 0 above it, with the controller's hysteresis."""

    def __init__(self, controller: SpecDisableController, speculative_steps: int) -> None:
        if speculative_steps < 1:
            raise ValueError(
                f"dynamic speculation disable needs --speculative-num-steps >= 1, "
                f"got {speculative_steps}"
            )
        self.controller = controller
        self.speculative_steps = speculative_steps
        self._cuda_graph_bs: list[int] | None = None

    @property
    def candidate_steps(self) -> list[int]:
        return [PLAIN_STEPS, self.speculative_steps]

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None

    def get_steps_for_batch(self, batch_size: int) -> int:
        """Called once per decode batch before it drafts (an idle batch: 0 requests)."""
        if batch_size <= 0:
            plain = self.controller.mode is not Mode.SPECULATIVE
        else:
            plain = self.controller.step(batch_size)
        return PLAIN_STEPS if plain else self.speculative_steps

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> None:
        """The threshold does not follow acceptance."""

    def note_idle(self) -> None:
        """The scheduler found nothing to run (observe.scheduler_idle)."""
        self.controller.note_idle()

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        """The captured batch sizes a step count can run at (a batch pads up to the
        next captured size): plain from the resume size up, speculative up to the
        threshold."""
        if self._cuda_graph_bs is None:
            return None
        sizes = self._cuda_graph_bs
        if step == PLAIN_STEPS:
            return [v for v in sizes if v > self.controller.resume_batch_size]
        return [v for i, v in enumerate(sizes) if i == 0 or sizes[i - 1] < self.controller.threshold]


class DepthSchedulePolicy:
    """A draft depth per load (depth_schedule.py): every depth of the schedule is a candidate step
    count with its own runtime state; each decode batch runs the depth its controller walks to.
    Depth 0, where the schedule has it, is the plain step. Reports like the threshold: a line per
    depth change (at most one per log interval, the others counted into the next), the metrics,
    the server-info view."""

    def __init__(self, controller: DepthController, *, log_fn: Callable[[str], None] | None = None,
                 clock: Callable[[], float] | None = None,
                 log_interval_s: float = MODE_LOG_INTERVAL_S) -> None:
        self.controller = controller
        self.metrics = Metrics()
        self._cuda_graph_bs: list[int] | None = None
        self._log_fn = log_fn if log_fn is not None else logger.info
        self._clock = clock if clock is not None else time.monotonic
        self._log_interval_s = log_interval_s
        self._last_log_time: float | None = None
        self._folded = 0
        self.mode_changes = 0  # plain <-> speculative, as the threshold counts them

    @property
    def candidate_steps(self) -> list[int]:
        return sorted(self.controller.schedule.depths)

    @property
    def drafting_steps(self) -> int:
        """Decode steps that drafted, at any depth."""
        return sum(n for d, n in self.controller.steps.items() if d > PLAIN_STEPS)

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        """The captured sizes where a depth can run, its hysteresis included."""
        if self._cuda_graph_bs is None:
            return None
        return self.controller.graph_sizes(step, self._cuda_graph_bs)

    def get_steps_for_batch(self, batch_size: int) -> int:
        """Called once per decode batch before it drafts (an idle batch: 0 requests, no step)."""
        if batch_size <= 0:
            return self.controller.depth
        before = self.controller.depth
        depth = self.controller.step(batch_size)
        if depth != before:
            if (before == PLAIN_STEPS) != (depth == PLAIN_STEPS):
                self.mode_changes += 1
            self._report(before, depth, batch_size)
        plain = depth == PLAIN_STEPS
        self.metrics.observe(plain, int(not plain), int(plain))
        self.metrics.observe_depth(depth)
        return depth

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> None:
        """The schedule does not follow acceptance."""

    def note_idle(self) -> None:
        """The scheduler found nothing to run (observe.scheduler_idle)."""
        self.controller.note_idle()

    def _report(self, before: int, depth: int, batch_size: int) -> None:
        now = self._clock()
        if self._last_log_time is not None and now - self._last_log_time < self._log_interval_s:
            self._folded += 1
            return
        extra = f"; {self._folded} earlier change(s) not logged" if self._folded else ""
        self._log_fn(f"Speculation depth -> {depth} (was {before}; batch size {batch_size}; schedule "
                     f"{self.controller.schedule}); depth_changes={self.controller.changes}{extra}")
        self._folded = 0
        self._last_log_time = now

    def snapshot(self) -> dict[str, Any]:
        """The server-info view: internal_states[i]["speculative_disable"]."""
        depth = self.controller.depth
        steps = self.controller.steps
        return {"schedule": str(self.controller.schedule), "depth": depth,
                "mode": str(Mode.PLAIN if depth == PLAIN_STEPS else Mode.SPECULATIVE),
                "steps_by_depth": {str(d): n for d, n in sorted(steps.items())},
                "speculative_steps": self.drafting_steps, "plain_steps": steps.get(PLAIN_STEPS, 0),
                "depth_changes": self.controller.changes, "mode_changes": self.mode_changes}


class CatchUpPolicy:
    """A policy whose plain steps write only the draft's K/V (draft_kv.py). The step that
    the wrapped policy would run speculatively right after plain steps runs once more as a
    plain step with the full draft extend (`full_draft_extend`, the catch-up step), so the
    speculative step after it drafts from a current proposal. Plain steps then run at every
    captured batch size (a catch-up step runs at or below the resume size). Everything else
    is the wrapped policy's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.full_draft_extend = True
        self.catch_up_steps = 0
        self._draft_stale = False
        self._cuda_graph_bs: list[int] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def draft_stale(self) -> bool:
        """The mode is plain: a plain step ran since the last full draft step, so the next step
        that would speculate runs the catch-up step first (a prefill now may write only the
        draft's K/V: draft_extend.draft_extend_for_prefill)."""
        return self._draft_stale

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None
        self.inner.set_cuda_graph_bs(cuda_graph_bs)

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        if step == PLAIN_STEPS:
            return self._cuda_graph_bs
        sizes: list[int] | None = self.inner.cuda_graph_bs_for_step(step)
        return sizes

    def get_steps_for_batch(self, batch_size: int) -> int:
        steps: int = self.inner.get_steps_for_batch(batch_size)
        if batch_size <= 0:  # an idle batch drafts nothing
            return steps
        if steps == PLAIN_STEPS:
            self.full_draft_extend = False
            self._draft_stale = True
        elif self._draft_stale:
            steps = PLAIN_STEPS
            self.full_draft_extend = True
            self._draft_stale = False
            self.catch_up_steps += 1
            leave_out = getattr(self.inner, "leave_out_last", None)
            if leave_out is not None:  # `auto`: neither a plain nor a speculative step's figures
                leave_out()
        return steps


    def defer(self) -> None:
        """The catch-up step chosen for this batch cannot run now: plain once more, and the
        catch-up step again at the next step that would speculate."""
        if self.full_draft_extend and not self._draft_stale:
            self.catch_up_steps -= 1
        self.full_draft_extend = False
        self._draft_stale = True


class AutoThresholdPolicy(AutoPolicy):
    """`auto`: AutoPolicy (the self-tuning crossover) as the worker's policy, reporting
    like the fixed threshold does: the mode line whenever the crossover's mode or the
    crossover itself moves (at most one line per log interval; a change folded into
    the interval is logged once it has passed), the metrics, the server-info view."""

    def __init__(
        self,
        controller: AutoController,
        speculative_steps: int,
        *,
        log_fn: Callable[[str], None] | None = None,
        clock: Callable[[], float] | None = None,
        log_interval_s: float = MODE_LOG_INTERVAL_S,
        step_clock: Callable[[], float] | None = None,
        trace: Callable[[dict[str, object]], None] | None = None,
    ) -> None:
        super().__init__(controller, speculative_steps, step_clock, trace)
        self._metrics = Metrics()
        self._published_crossover = controller.crossover()
        self._log_fn = log_fn if log_fn is not None else logger.info
        # (AutoPolicy._clock times the steps)
        self._log_clock = clock if clock is not None else time.monotonic
        self._log_interval_s = log_interval_s
        self._last_log_time: float | None = None
        self._logged = (controller.crossover(), controller.mode)
        self._seen = self._logged
        self._folded = 0  # state changes since the last line (it reports the last one)
        self._changed_at = 0  # the batch size of the step that made the last change

    @property
    def metrics(self) -> Metrics:
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: Metrics) -> None:
        """Where to report (the scheduler attaches Prometheus); the crossover at once."""
        self._metrics = metrics
        self._published_crossover = self.controller.crossover()
        metrics.observe_crossover(self._published_crossover)

    def get_steps_for_batch(self, batch_size: int) -> int:
        steps = super().get_steps_for_batch(batch_size)
        if batch_size > 0:
            plain = steps == PLAIN_STEPS
            self.metrics.observe(plain, int(not plain), int(plain))
        crossover = self.controller.crossover()
        if crossover != self._published_crossover:
            self._published_crossover = crossover
            self.metrics.observe_crossover(crossover)
        if batch_size > 0:
            self._report(batch_size)
        return steps

    def _report(self, batch_size: int) -> None:
        now_state = (self.controller.crossover(), self.controller.mode)
        if now_state != self._seen:
            self._seen = now_state
            self._folded += 1
            self._changed_at = batch_size
        if now_state == self._logged:
            return
        now = self._log_clock()
        if self._last_log_time is not None and now - self._last_log_time < self._log_interval_s:
            return
        crossover, mode = now_state
        batch_size = self._changed_at  # a folded change is logged after it happened
        if crossover != self._logged[0]:
            accept = self.controller.accept_length()
            shown = "unknown" if accept is None else f"{accept:.2f}"
            line = (f"Speculation crossover -> {crossover} (auto, was {self._logged[0]}; "
                    f"accept length {shown}); mode={mode}; per bucket, speculative / plain: "
                    f"{self.controller.estimates_text()}")
        elif mode is Mode.PLAIN:
            line = f"{MODE_CHANGE_LOG_PREFIX} plain (batch size {batch_size} > crossover {crossover}, auto)"
        else:
            line = (f"{MODE_CHANGE_LOG_PREFIX} speculative (batch size {batch_size} <= "
                    f"{resume_batch_size(crossover)}, crossover {crossover}, auto)")
        state = self.controller.state()
        line += (f"; mode_changes={state['mode_changes']}, "
                 f"crossover_changes={state['crossover_changes']}")
        if self._folded > 1:
            line += f"; {self._folded - 1} earlier change(s) not logged"
        self._log_fn(line)
        self._logged = now_state
        self._folded = 0
        self._last_log_time = now

    def snapshot(self) -> dict[str, Any]:
        """The server-info view: internal_states[i]["speculative_disable"]."""
        return {**self.controller.state(), "max_batch_size": self.controller.config.max_batch_size,
                "unrecorded_steps": self.dropped, "estimates": self.controller.estimates_text()}
