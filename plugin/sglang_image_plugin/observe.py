"""What a threshold server shows: Prometheus metrics beside the scheduler's own, the server info,
and, at the scheduler's start, the plain layout where the worker's plain step has it. `auto`
learns that an idle gap is no step time.

sglang and prometheus_client are imported inside the functions only.
"""

from __future__ import annotations

from typing import Any

from sglang_image_plugin import layout, spec_disable
from sglang_image_plugin import state as plugin_state
from sglang_image_plugin.state import DraftState, WorkerState
from sglang_image_plugin.tp import log_on_rank0


class PrometheusMetrics(spec_disable.Metrics):
    """sglang:spec_disable_* next to the scheduler's own metrics (same labels)."""

    def __init__(self, labels: dict[str, str]) -> None:
        from prometheus_client import Counter, Gauge

        self._crossover: Any = None
        self._depth: Any = None
        self._published_depth: int | None = None

        self._plain_mode = Gauge(
            name="sglang:spec_disable_plain_mode",
            documentation="1 while speculation is disabled (plain decode), else 0.",
            labelnames=list(labels),
            multiprocess_mode="mostrecent",
        ).labels(**labels)
        self._speculative_steps = Counter(
            name="sglang:spec_disable_speculative_steps_total",
            documentation="Decode steps that ran draft + verify.",
            labelnames=list(labels),
        ).labels(**labels)
        self._plain_steps = Counter(
            name="sglang:spec_disable_plain_steps_total",
            documentation="Decode steps that ran without drafting.",
            labelnames=list(labels),
        ).labels(**labels)
        self._labels = labels
        self._published_mode: bool | None = None

    def observe_crossover(self, crossover: int) -> None:
        if self._crossover is None:  # made on first use: a fixed threshold has none
            from prometheus_client import Gauge

            self._crossover = Gauge(
                name="sglang:spec_disable_crossover",
                documentation=(
                    "Threshold auto: the batch size up to which the server speculates now "
                    "(0: never; its max running requests: always)."
                ),
                labelnames=list(self._labels),
                multiprocess_mode="mostrecent",
            ).labels(**self._labels)
        self._crossover.set(crossover)

    def observe_depth(self, depth: int) -> None:
        """A depth schedule: the draft depth of the latest step, set only when it changed."""
        if depth == self._published_depth:
            return
        if self._depth is None:  # made on first use: only a schedule has depths
            from prometheus_client import Gauge

            self._depth = Gauge(
                name="sglang:spec_disable_depth",
                documentation="Depth schedule: the draft depth of the latest decode step (0: plain).",
                labelnames=list(self._labels),
                multiprocess_mode="mostrecent",
            ).labels(**self._labels)
        self._depth.set(depth)
        self._published_depth = depth

    def observe(self, plain_mode: bool, speculative_steps: int, plain_steps: int) -> None:
        """Every decode step: the gauge only when the mode changed, the step counter."""
        if plain_mode != self._published_mode:
            self._plain_mode.set(int(plain_mode))
            self._published_mode = plain_mode
        if speculative_steps:
            self._speculative_steps.inc(speculative_steps)
        if plain_steps:
            self._plain_steps.inc(plain_steps)


def scheduler_init(result: None, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.__init__: metrics for the controller, when metrics are on; the plain
    layout where the worker's plain step has it (layout.py) and this scheduler can run it."""
    worker: Any = getattr(scheduler, "draft_worker", None)
    own = plugin_state.peek(worker, WorkerState)
    controller = own.controller if own is not None else None
    collector = getattr(scheduler, "metrics_collector", None)
    labels = getattr(collector, "labels", None)
    if controller is not None and labels is not None:
        controller.metrics = PrometheusMetrics(dict(labels))
    step = own.plain_step if own is not None else None
    if own is None or controller is None or step is None or not step.kv_only:
        return
    draft = plugin_state.of(worker._draft_worker, DraftState)
    reason = step.layout_reason
    if reason is None and scheduler.model_worker is not worker:
        reason = "the scheduler runs another worker than the EAGLE-3 one"
    if reason is None:
        reason = layout.install(scheduler, draft.catch_up, own.acceptance)
    if reason is None:
        draft.proposal_by_row = True  # the FutureMap relays the draft's proposal
        return
    # every plain step stays a speculative-layout one and writes its own K/V: a deferred step
    # already captured into the graph is switched off there and nothing is flushed
    if draft.deferred is not None:
        draft.deferred.disable()
    draft.deferred = None
    if reason != step.layout_reason:
        own.plain_step = step.in_speculative_layout(reason)
        log_on_rank0(f"Plain step: plain steps keep the speculative layout: {reason}")


def scheduler_idle(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE Scheduler.on_idle: the policy's note_idle. The first batch after it takes its side
    by the threshold, schedule or crossover alone (no running batch for the hysteresis to hold);
    `auto` also times a step until the next decode step, and an idle gap is no step time."""
    own = plugin_state.peek(getattr(scheduler, "draft_worker", None), WorkerState)
    note_idle = getattr(own.controller, "note_idle", None) if own is not None else None
    if note_idle is not None:
        note_idle()


def add_speculative_state(result: None, state_controller: Any, state: dict[str, Any]) -> None:
    """AFTER SchedulerInternalStateController._add_speculative: the server info."""
    own = plugin_state.peek(getattr(state_controller.scheduler, "draft_worker", None), WorkerState)
    if own is not None and own.controller is not None:
        state["speculative_disable"] = own.controller.snapshot()
        if own.plain_step is not None:
            state["speculative_disable"]["plain_step"] = own.plain_step.view()
        if own.acceptance is not None:
            state["speculative_disable"]["acceptance_around_plain"] = own.acceptance.view()
        if own.state_memory:
            state["speculative_disable"]["state_memory_gib"] = {
                str(depth): round(b / 2**30, 3) for depth, b in sorted(own.state_memory.items())}
