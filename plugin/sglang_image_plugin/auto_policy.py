"""`auto` behind upstream's adaptive-speculation policy protocol: TimedPolicy times each decode
step and pairs it with its verify result; AutoPolicy hands the threshold's controller
(auto_threshold.py) its mode, seconds and output tokens (the learned depth schedule's policy,
auto_depth_policy.py, is another TimedPolicy); StepTrace writes the steps to a file for reading
offline.

Pure Python (no torch, no sglang).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sglang_image_plugin.auto_threshold import AutoController
from sglang_image_plugin.setting import AUTO_TRACE_ENV, THRESHOLD_FLAG, Mode


@dataclass
class Step:
    depth: int  # the draft steps decided (0: plain)
    batch_size: int
    start: float
    seconds: float | None = None  # 0.0: no time (the server went idle after it)
    output_tokens: int | None = None
    left_out: bool = False  # paired with its result, not recorded
    catch_up: bool = False  # the catch-up step (AutoPolicy.leave_out_last)
    prefills: int = 0  # prefill batches launched while this step was the last one decided

    @property
    def kind(self) -> str:
        return "catch-up" if self.catch_up else str(Mode.PLAIN if self.depth == 0 else Mode.SPECULATIVE)

    @property
    def key(self) -> tuple[str, int]:
        """What a step's time depends on: its kind and its draft depth."""
        return self.kind, self.depth


class TimedPolicy:
    """A policy behind upstream's adaptive-speculation policy protocol (sglang's
    AdaptiveSpecPolicy: candidate step counts, one `get_steps_for_batch` before each decode batch,
    one `on_verify_complete` per decode result) that times each decode step. A subclass decides the
    step's draft depth (`_decide`) and takes each timed step (`_record`) and each result's accepted
    drafts (`_accepted`).

    A step's time is the interval from its `get_steps_for_batch` to the next one: with overlap
    scheduling the host prepares a batch while the previous one runs, so in steady state that is
    the step time the traffic sees, prefills between decode steps included. But the host waits for
    a step's result only after it has launched the next one, so that interval ends when the step
    before it is done: it times the previous step. The first step of a kind (plain, speculative at
    a depth, the catch-up step) after another kind is therefore left out: it carries the other
    kind's time (and a change to plain waits once for the last speculative step). Verify results come in
    decode order, usually a step late; each fills the oldest step still waiting for one. A result
    whose batch size differs from that step's means the two sequences lost step: the pending steps
    are dropped. An idle call (no requests), or the scheduler going idle (note_idle), leaves the
    pending step without a time.

    `trace`, if given, gets a record per decided step once its time and tokens are in (recorded or
    left out), and one per prefill the server reports (note_prefill): the raw data the estimate
    is made of, for reading offline why `auto` chose what it chose (see StepTrace)."""

    MAX_PENDING = 8  # steps waiting for their results, at most (overlap keeps one or two)

    def __init__(self, speculative_steps: int, clock: Callable[[], float] | None = None,
                 trace: Callable[[dict[str, object]], None] | None = None) -> None:
        import time  # measurement only; the tests pass their own clock

        self.speculative_steps = speculative_steps
        self._clock = clock or time.perf_counter
        self._pending: list[Step] = []
        self._previous: Step | None = None  # the step decided last (recorded or not)
        self._cuda_graph_bs: list[int] | None = None
        self.dropped = 0  # steps not recorded: no time, or lost step with the results
        self._trace = trace

    # -- the subclass's part --------------------------------------------------------------------
    def _decide(self, batch_size: int) -> int:
        """The draft depth of the next decode step of this many requests (>= 1)."""
        raise NotImplementedError

    def _idle_steps(self) -> int:
        """The depth to keep for an idle batch (no requests, no step)."""
        raise NotImplementedError

    def _record(self, step: Step) -> None:
        """A step with its time and its output tokens."""
        raise NotImplementedError

    def _accepted(self, step: Step, num_correct_drafts_per_req: Sequence[int]) -> None:
        """A drafting step's accepted drafts per request (the catch-up step's are none), timed or
        not."""

    def _trace_fields(self, step: Step) -> dict[str, object]:
        """What the trace adds to a step's record."""
        return {}

    def _went_idle(self) -> None:
        """The scheduler found nothing to run (note_idle): what the decisions forget then."""

    # -- the protocol ---------------------------------------------------------------------------
    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        """Every captured size for every step count: what runs where is learned at run time."""
        return self._cuda_graph_bs

    def get_steps_for_batch(self, batch_size: int) -> int:
        now = self._clock()
        last = self._pending[-1] if self._pending else None
        if last is not None and last.seconds is None:
            last.seconds = now - last.start if batch_size > 0 else 0.0
        self._flush()
        if batch_size <= 0:
            self._previous = None
            return self._idle_steps()
        step = Step(self._decide(batch_size), batch_size, now)
        self._after(step)
        self._pending.append(step)
        while len(self._pending) > self.MAX_PENDING:
            self._pending.pop(0)
            self.dropped += 1
        return step.depth

    def leave_out_last(self) -> None:
        """The step just decided runs as neither mode (the catch-up step that prepares the draft
        when speculation resumes): its result is paired with it and not recorded."""
        if self._pending:
            self._pending[-1].left_out = self._pending[-1].catch_up = True

    def _after(self, step: Step) -> None:
        """Leave out a step whose interval times another kind's step, or, the first after an
        idle gap, the prefill that ended it."""
        previous, self._previous = self._previous, step
        if previous is None or previous.key != step.key:
            step.left_out = True

    def note_idle(self) -> None:
        """The scheduler found nothing to run: the step before this has no step time (the interval
        to the next decode step would be the idle gap, and a burst after a pause would charge the
        whole pause to the last step before it)."""
        self._went_idle()
        self._previous = None
        last = self._pending[-1] if self._pending else None
        if last is not None and last.seconds is None:
            last.seconds = 0.0
            self._flush()
        flush = getattr(self._trace, "flush", None)
        if flush is not None:
            flush()

    def note_prefill(self, tokens: int) -> None:
        """The scheduler launched a prefill batch of `tokens` new tokens: it falls inside the
        interval of the last step decided (for the trace; the estimate does not use it)."""
        last = self._pending[-1] if self._pending else None
        if last is not None and last.seconds is None:
            last.prefills += 1
        if self._trace is not None:
            self._trace({"t": round(self._clock(), 6), "kind": "prefill", "tokens": int(tokens)})

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> int | None:
        """The output tokens of the oldest step waiting for them: the accepted drafts plus one per
        request. Returns None: the step count is chosen per batch, in get_steps_for_batch."""
        step = next((s for s in self._pending if s.output_tokens is None), None)
        if step is None:
            return None
        if len(num_correct_drafts_per_req) != step.batch_size:
            self.dropped += len(self._pending)
            self._pending = []
            return None
        step.output_tokens = sum(num_correct_drafts_per_req) + step.batch_size
        if step.depth > 0 and not step.catch_up:
            self._accepted(step, num_correct_drafts_per_req)
        self._flush()
        return None

    def _flush(self) -> None:
        """Record the oldest steps that have both their time and their tokens."""
        while self._pending and self._pending[0].seconds is not None and self._pending[0].output_tokens is not None:
            s = self._pending.pop(0)
            recorded = not s.left_out and bool(s.seconds) and s.output_tokens is not None
            if recorded:
                self._record(s)
            elif not s.left_out:
                self.dropped += 1  # no time (idle after it)
            if self._trace is not None:
                self._trace({"t": round(s.start, 6), "kind": s.kind, "batch": s.batch_size,
                             "seconds": round(s.seconds or 0.0, 6), "tokens": s.output_tokens,
                             "recorded": recorded, "prefills": s.prefills, **self._trace_fields(s)})


class AutoPolicy(TimedPolicy):
    """The threshold's `auto` (AutoController) as a TimedPolicy: K draft steps or 0 (upstream's
    zero-step tier, a plain step)."""

    def __init__(self, controller: AutoController, speculative_steps: int,
                 clock: Callable[[], float] | None = None,
                 trace: Callable[[dict[str, object]], None] | None = None) -> None:
        if speculative_steps < 1:
            raise ValueError(f"{THRESHOLD_FLAG} auto needs --speculative-num-steps >= 1, got {speculative_steps}")
        super().__init__(speculative_steps, clock, trace)
        self.controller = controller

    @property
    def candidate_steps(self) -> list[int]:
        return [0, self.speculative_steps]

    def _decide(self, batch_size: int) -> int:
        return 0 if self.controller.decide(batch_size) is Mode.PLAIN else self.speculative_steps

    def _idle_steps(self) -> int:
        return 0 if self.controller.mode is Mode.PLAIN else self.speculative_steps

    def _record(self, step: Step) -> None:
        mode = Mode.PLAIN if step.depth == 0 else Mode.SPECULATIVE
        self.controller.record(mode, step.batch_size, step.seconds or 0.0, step.output_tokens or 0)

    def _trace_fields(self, step: Step) -> dict[str, object]:
        trial = self.controller.trial  # a trial's steps run its block's mode, not the crossover's
        return {"crossover": self.controller.crossover(), **({"trial": trial} if trial else {})}

    def _went_idle(self) -> None:
        self.controller.note_idle()


class StepTrace:
    """AutoPolicy's trace as JSON lines in a file (AUTO_TRACE_ENV): buffered, written out
    whenever the server goes idle (flush) and when the process exits."""

    def __init__(self, path: str) -> None:
        import atexit
        import json

        self._dumps = json.dumps
        try:
            self._file = open(path, "a", buffering=1 << 16, encoding="utf-8")  # noqa: SIM115 (kept open)
        except OSError as exc:
            raise ValueError(f"{AUTO_TRACE_ENV}={path}: cannot append `auto`'s step trace there "
                             f"({exc.strerror}); give a writable file path, or unset it") from exc
        atexit.register(self._file.close)

    def __call__(self, record: dict[str, object]) -> None:
        self._file.write(self._dumps(record, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        self._file.flush()
