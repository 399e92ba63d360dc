"""Acceptance around plain phases: does drafting recover when speculation resumes?

A draft whose KV cache is not kept current while the server decodes without drafting accepts
less once speculation resumes, for the rest of every request that lived through the plain phase.
This records, for each plain phase, the accept length (output tokens per request and step) of
the last `window` speculative steps before it and of the first `window` after it. The server
info shows the latest pairs, so a benchmark can check the recovery. Pure logic: no sglang imports.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

WINDOW_STEPS = 64


class AcceptanceAroundPlain:
    """Fed by the worker: `decided` when a decode batch's step count is chosen, `verified` when
    that batch's accepted drafts reach the CPU (under the overlap scheduler one step later, so
    decisions wait in a queue; a result whose row count does not match is not guessed at)."""

    MAX_PENDING = 8
    KEEP_PHASES = 16

    def __init__(self, window: int = WINDOW_STEPS) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.unpaired_steps = 0
        self.phases_measured = 0
        self.pairs: deque[tuple[float, float]] = deque(maxlen=self.KEEP_PHASES)
        self._pending: deque[tuple[int, int]] = deque()
        # the last speculative steps, all of one draft depth (accept lengths of two depths differ)
        self._recent: deque[tuple[int, int]] = deque(maxlen=window)
        self._recent_depth = 0
        self._in_plain = False
        self._before: float | None = None
        self._before_depth = 0
        self._after: list[tuple[int, int]] | None = None  # (tokens, rows) per step after the phase
        self.last_depth: int | None = None  # the draft depth of the latest pair

    def decided(self, depth: int, batch_size: int) -> None:
        """A decode batch's draft depth (0: a plain step) is chosen."""
        if batch_size <= 0:  # an idle batch verifies nothing
            return
        self._pending.append((int(depth), batch_size))
        while len(self._pending) > self.MAX_PENDING:
            self._pending.popleft()
            self.unpaired_steps += 1

    def verified(self, num_correct_drafts_per_req: Sequence[int]) -> None:
        if not self._pending:
            return
        depth, batch_size = self._pending.popleft()
        if len(num_correct_drafts_per_req) != batch_size:
            self.unpaired_steps += 1 + len(self._pending)
            self._pending.clear()
            return
        self._record(depth, sum(num_correct_drafts_per_req) + batch_size, batch_size)

    def _record(self, depth: int, tokens: int, rows: int) -> None:
        if depth == 0:
            if not self._in_plain:
                self._in_plain = True
                self._after = None  # a window cut short by this phase is no figure
                full = len(self._recent) == self.window
                self._before = _accept_length(self._recent) if full else None
                self._before_depth = self._recent_depth
            return
        if self._in_plain:
            self._in_plain = False
            self._recent.clear()  # "before" the next phase is what runs after this one
            self._after = [] if self._before is not None else None
        if depth != self._recent_depth:  # another draft depth: its accept length is another figure
            self._recent.clear()
            self._recent_depth = depth
        if depth != self._before_depth:
            self._after = None  # the phase ended at another depth than it began: nothing to pair
        self._recent.append((tokens, rows))
        if self._after is not None and self._before is not None:
            self._after.append((tokens, rows))
            if len(self._after) == self.window:
                self.pairs.append((self._before, _accept_length(self._after)))
                self.last_depth = depth
                self.phases_measured += 1
                self._after = None

    def view(self) -> dict[str, Any]:
        """For the server info: the latest phase's pair and the worst ratio of those kept."""
        view: dict[str, Any] = {"window_steps": self.window, "phases_measured": self.phases_measured,
                                "unpaired_steps": self.unpaired_steps}
        if self.pairs:
            before, after = self.pairs[-1]
            view["last_before"] = round(before, 4)
            view["last_after"] = round(after, 4)
            view["last_depth"] = self.last_depth
            # a step emits at least one token per row: every accept length is >= 1
            view["worst_after_over_before"] = round(min(a / b for b, a in self.pairs), 4)
        return view


def _accept_length(steps: Sequence[tuple[int, int]]) -> float:
    """Output tokens per request-step over (tokens, rows) steps."""
    rows = sum(r for _, r in steps)
    return sum(t for t, _ in steps) / rows if rows else 0.0
