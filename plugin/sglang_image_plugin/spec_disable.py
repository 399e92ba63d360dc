"""Dynamic speculation disable at a fixed threshold: the hysteresis controller.

Pure logic (no sglang, torch or GPU imports), so it is tested on any machine and shared by every
flavor the plugin supports. Above a running-batch-size threshold N the EAGLE worker decodes with
the target alone; it speculates again once the batch has shrunk to N - H (hysteresis H). The
setting's names, parsers, defaults and validation are setting.py's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from sglang_image_plugin.setting import (
    HYSTERESIS_FLAG,
    MODE_CHANGE_LOG_PREFIX,
    THRESHOLD_FLAG,
    Mode,
)

logger = logging.getLogger(__name__)

# Mode-change log lines closer together than this are folded into the next one.
MODE_LOG_INTERVAL_S = 5.0


class Metrics:
    """Where the controller reports: Prometheus in a server, nothing in tests."""

    def observe(self, plain_mode: bool, speculative_steps: int, plain_steps: int) -> None:
        """The mode now and the steps taken since the last call."""

    def observe_crossover(self, crossover: int) -> None:
        """`auto`: the batch size up to which the server speculates now."""

    def observe_depth(self, depth: int) -> None:
        """A depth schedule: the draft depth of the step just decided (0: plain)."""


class SpecDisableController:
    """Speculative -> plain when batch_size > N; plain -> speculative when <= N - H.

    The decision depends only on the running batch size, which every TP rank sees
    identically, so all ranks choose the same mode without communication. An idle
    server (note_idle) holds no batch for the hysteresis to protect: the first batch
    after it takes its side by N alone, as at start.
    """

    def __init__(
        self,
        threshold: int,
        hysteresis: int,
        *,
        log_fn: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        log_interval_s: float = MODE_LOG_INTERVAL_S,
    ) -> None:
        if threshold <= 0:
            raise ValueError(f"{THRESHOLD_FLAG} must be > 0 here, got {threshold}")
        if not 0 <= hysteresis < threshold:
            raise ValueError(
                f"{HYSTERESIS_FLAG} must satisfy 0 <= H < N, got H={hysteresis}, N={threshold}"
            )
        self.threshold = threshold
        self.hysteresis = hysteresis
        self.mode = Mode.SPECULATIVE
        self.speculative_steps = 0
        self.plain_steps = 0
        self.mode_changes = 0
        self.metrics = Metrics()
        self._log_fn = log_fn if log_fn is not None else logger.info
        self._clock = clock
        self._log_interval_s = log_interval_s
        self._last_log_time: float | None = None
        self._suppressed = 0
        self._after_idle = False  # the next batch is the first since the server went idle

    @property
    def resume_batch_size(self) -> int:
        return self.threshold - self.hysteresis

    def note_idle(self) -> None:
        """The server ran nothing (no request left): the next batch is decided by N alone.
        Otherwise a server that went plain under a burst above N stays plain through every later
        burst that starts between N - H and N, for as long as each lasts."""
        self._after_idle = True

    def next_mode(self, batch_size: int) -> Mode:
        """The transition function alone (no side effects)."""
        if self.mode is Mode.SPECULATIVE or self._after_idle:
            return Mode.PLAIN if batch_size > self.threshold else Mode.SPECULATIVE
        return Mode.SPECULATIVE if batch_size <= self.resume_batch_size else Mode.PLAIN

    def step(self, batch_size: int) -> bool:
        """Account one decode step of this many requests; True: it runs plain."""
        new_mode = self.next_mode(batch_size)
        after_idle, self._after_idle = self._after_idle, False
        if new_mode != self.mode:
            self.mode = new_mode
            self.mode_changes += 1
            self._log_mode_change(batch_size, after_idle)
        plain = self.mode is Mode.PLAIN
        if plain:
            self.plain_steps += 1
        else:
            self.speculative_steps += 1
        self.metrics.observe(plain, int(not plain), int(plain))
        return plain

    def _log_mode_change(self, batch_size: int, after_idle: bool) -> None:
        now = self._clock()
        if self._last_log_time is not None and now - self._last_log_time < self._log_interval_s:
            self._suppressed += 1
            return
        if self.mode is Mode.PLAIN:
            why = f"batch size {batch_size} > threshold {self.threshold}"
        elif after_idle:
            why = f"batch size {batch_size} <= threshold {self.threshold}, the first batch since the server went idle"
        else:
            why = (
                f"batch size {batch_size} <= {self.resume_batch_size} (threshold "
                f"{self.threshold} - hysteresis {self.hysteresis})"
            )
        extra = f"; {self._suppressed} earlier change(s) not logged" if self._suppressed else ""
        self._log_fn(
            f"{MODE_CHANGE_LOG_PREFIX} {self.mode} ({why}); mode_changes={self.mode_changes}{extra}"
        )
        self._suppressed = 0
        self._last_log_time = now

    def snapshot(self) -> dict[str, Any]:
        """The server-info view: internal_states[i]["speculative_disable"]."""
        return {
            "threshold": self.threshold,
            "hysteresis": self.hysteresis,
            "mode": self.mode,
            "speculative_steps": self.speculative_steps,
            "plain_steps": self.plain_steps,
            "mode_changes": self.mode_changes,
        }
