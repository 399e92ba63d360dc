"""A call's deadline: the time left, and the timeout a request started now may take so that the
call still ends in time (its servers stopped, its report written). The smoke run, the feature
matrix and bench/ each hand one down to every request they send; the smoke's servers are killed at
its margin (smoke.server.Server), and what they left undone is skipped for the next call."""
from __future__ import annotations

import time
from dataclasses import dataclass

# A request ends REQUEST_MARGIN_S before the call's deadline (the servers stop and the report is
# written in time); with less than MIN_REQUEST_S left before that, it is not worth starting.
REQUEST_MARGIN_S = 25.0
MIN_REQUEST_S = 10.0


class DeadlineStop(Exception):
    """The deadline's margin stopped a smoke server's work before its end: left to the next call,
    not a failure."""


@dataclass
class Deadline:
    at: float

    def left(self) -> float:
        return self.at - time.time()

    def left_for_requests(self) -> float:
        """The time left before the margin the end of a call keeps."""
        return self.left() - REQUEST_MARGIN_S

    def request_budget(self, cap: float) -> float | None:
        """The timeout of a request started now: at most `cap`, ending REQUEST_MARGIN_S before the
        deadline; None when less than MIN_REQUEST_S is left for it."""
        left = self.left_for_requests()
        return min(cap, left) if left >= MIN_REQUEST_S else None

    def request_timeout(self, cap: float) -> float:
        """A hung request must not outlive the deadline (the call's logs would be lost); one
        started past the margin still gets MIN_REQUEST_S."""
        return self.request_budget(cap) or MIN_REQUEST_S
