"""How far a long step got, said in one line at most every few seconds: a pass over gigabytes of
layers, or a download of hundreds of wheels, is not minutes of silence."""
from __future__ import annotations

import time
from collections.abc import Callable


class Progress:
    """Counts what a step did of `total` and logs "WHAT: DONE of TOTAL UNIT (N%)" at most every
    `every` seconds; `scale` divides the counts for the line (1e9 with "GB": bytes as GB)."""

    def __init__(self, log: Callable[[str], None], what: str, total: int, *, unit: str = "GB",
                 scale: float = 1e9, every: float = 15.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.what, self.total, self.unit, self.scale = log, what, total, unit, scale
        self.every, self.clock = every, clock
        self.done = 0
        self._next = clock() + every

    def add(self, count: int) -> None:
        self.done += count
        now = self.clock()
        if now >= self._next:
            self._next = now + self.every
            self.log(self.line())

    def line(self) -> str:
        share = min(100, 100 * self.done // self.total) if self.total else 100
        done, total = ((f"{n / self.scale:.1f}" if self.scale != 1 else str(n))
                       for n in (self.done, self.total))
        return f"{self.what}: {done} of {total} {self.unit} ({share}%)"
