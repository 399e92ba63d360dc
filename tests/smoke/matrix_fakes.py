"""Stand-ins for the feature matrix's tests: a clock that moves only when a fake request or case
says so and the Deadline it drives, a greedy answer as a server gives it, a models dir's
expected.json."""
from __future__ import annotations

import threading

from smoke.deadline import Deadline


class Clock:
    """Fake time for a Deadline: it moves only when a fake request or case says it took time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.lock = threading.Lock()

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds


class ClockDeadline(Deadline):
    def __init__(self, clock: Clock, at: float) -> None:
        super().__init__(at)
        self.clock = clock

    def left(self) -> float:
        return self.at - self.clock.now


GREEDY_ANSWER = {"output_ids": list(range(100, 164)), "text": "abcdefghijklmnopqrstuvwxyz" * 2,
                 "meta_info": {"finish_reason": {"type": "length"}}}


EXPECTED = {"vocab_size": 3000, "mean_top1_top2_margin": 20.0, "prompt": "def f"}
