"""Dynamic speculation disable: flags, validation and the hysteresis controller.

Pure logic (no sglang, torch or GPU imports), so it is tested on any machine and
shared by every flavor the plugin supports. Above a running-batch-size threshold N
the EAGLE worker decodes with the target alone; it speculates again once the batch
has shrunk to N - H (hysteresis H).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from sglang_image_plugin.depth_schedule import DepthSchedule

logger = logging.getLogger(__name__)

THRESHOLD_FLAG = "--speculative-disable-batch-threshold"
HYSTERESIS_FLAG = "--speculative-disable-hysteresis"
THRESHOLD_ENV = "SGLANG_SPEC_DISABLE_BATCH_THRESHOLD"
# `auto`: a file to append its step trace to (JSON lines, rank 0; auto_threshold.StepTrace)
AUTO_TRACE_ENV = "SGLANG_IMAGE_AUTO_TRACE"
# argparse destinations: not ServerArgs fields, so ServerArgs.from_cli_args skips them.
THRESHOLD_DEST = "speculative_disable_batch_threshold"
HYSTERESIS_DEST = "speculative_disable_hysteresis"

AUTO: Literal["auto"] = "auto"

# Mode-change log lines closer together than this are folded into the next one.
MODE_LOG_INTERVAL_S = 5.0
SUPPORTED_ALGORITHMS = ("EAGLE", "EAGLE3")

THRESHOLD_HELP = (
    "Dynamic speculation disable: when the running decode batch has more than N "
    "requests, decode with the target model alone (no drafting, no verification; the "
    "draft KV cache stays filled so acceptance recovers when speculation resumes). "
    "`auto`: the server measures the step times and accept length of both modes per "
    "batch-size bucket and finds N itself, following it as traffic and acceptance change. "
    f"0 disables it. Without the flag the environment variable {THRESHOLD_ENV} is read. "
    "EAGLE/EAGLE3 with topk 1 only."
)
HYSTERESIS_HELP = (
    f"Hysteresis for {THRESHOLD_FLAG} N: once plain, speculation resumes only when the "
    "batch size is <= N - H. 0 <= H < N; default N // 8 (at least 1 when N > 1), so one "
    "arrival or finish does not flip the mode back and forth."
)

Threshold = int | Literal["auto"]


class Mode(StrEnum):
    """How the worker decodes a step: drafting and verifying, or with the target alone."""

    SPECULATIVE = "speculative"
    PLAIN = "plain"

    def other(self) -> Mode:
        return Mode.PLAIN if self is Mode.SPECULATIVE else Mode.SPECULATIVE


@dataclass(frozen=True, kw_only=True)
class Setting:
    """The resolved switch: threshold 0 and no schedule means off."""

    threshold: Threshold
    hysteresis: int
    schedule: DepthSchedule | None = None  # a draft depth per load (then threshold 0)

    @property
    def enabled(self) -> bool:
        return (self.schedule is not None or self.threshold == AUTO
                or (isinstance(self.threshold, int) and self.threshold > 0))


OFF = Setting(threshold=0, hysteresis=0)


class ThresholdError(ValueError):
    """A threshold value that is neither `auto` nor a whole number in range."""


def parse_threshold(raw: str | int, *, source: str = THRESHOLD_FLAG,
                    allow_zero: bool = True) -> Threshold:
    """`auto` (any case) or a whole number of requests; 0 (off) only where `allow_zero`.

    Refuses anything else (`auto` mixed with numbers, signs, fractions, words) with a
    ThresholdError that names `source` (the flag, or the environment variable).
    """
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise ThresholdError(f"{source}: expected `auto` or a whole number, got {raw!r}")
    text = str(raw).strip()
    if text.lower() == AUTO:
        return AUTO
    lowest = 0 if allow_zero else 1
    if text.isascii() and text.isdigit() and int(text) >= lowest:
        return int(text)
    off = " (0 turns it off)" if allow_zero else ""
    raise ThresholdError(
        f"{source}: {raw!r} is not a batch-size threshold; give `auto` (the server measures "
        f"where speculation stops paying) or a whole number N >= {lowest} (speculate while at "
        f"most N requests run){off}, e.g. {THRESHOLD_FLAG} auto"
    )


def parse_hysteresis(text: str) -> int:
    try:
        number = int(text.strip())
    except ValueError:
        raise ValueError(f"{HYSTERESIS_FLAG} must be an integer >= 0, got {text!r}") from None
    if number < 0:
        raise ValueError(f"{HYSTERESIS_FLAG} must be >= 0, got {number}")
    return number


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Register both flags (argparse then names the flag in any parse error)."""
    parser.add_argument(
        THRESHOLD_FLAG,
        dest=THRESHOLD_DEST,
        type=_argparse_type(parse_threshold),
        default=None,
        metavar="N|auto",
        help=THRESHOLD_HELP,
    )
    parser.add_argument(
        HYSTERESIS_FLAG,
        dest=HYSTERESIS_DEST,
        type=_argparse_type(parse_hysteresis),
        default=None,
        metavar="H",
        help=HYSTERESIS_HELP,
    )
    # the schedule's module is imported where a server runs, not by what loads this file alone
    # (the build system and the smoke read the threshold's names here without the package)
    from sglang_image_plugin import depth_schedule as ds

    parser.add_argument(
        ds.DEPTH_SCHEDULE_FLAG,
        dest=ds.DEPTH_SCHEDULE_DEST,
        type=_argparse_type(ds.parse),
        default=None,
        metavar="LOW-HIGH:DEPTH,...",
        help=(
            "A draft depth per load: comma-separated tiers LOW-HIGH:DEPTH covering every running "
            f"batch size from 1, the last open (LOW-:DEPTH), e.g. {ds.EXAMPLE}; DEPTH 0 decodes with "
            "the target alone. A larger batch never drafts deeper; no depth beyond "
            "--speculative-num-steps. Each edge has hysteresis (edge // 8): shallower at once, "
            f"deeper once the batch is that far below the edge. Instead of {THRESHOLD_FLAG} (N is "
            f"the schedule 1-N:K,N+1-:0). Without the flag the environment variable "
            f"{ds.DEPTH_SCHEDULE_ENV} is read. EAGLE/EAGLE3 with topk 1 only."
        ),
    )


def default_hysteresis(threshold: int) -> int:
    """N // 8, at least 1 when N > 1, always < N: a schedule's at each edge."""
    from sglang_image_plugin.depth_schedule import edge_hysteresis

    return edge_hysteresis(threshold)


def resolve_threshold(flag: str | int | None, environ: Mapping[str, str] | None = None) -> Threshold:
    """The flag wins; else the environment variable; else 0 (off)."""
    if flag is not None:
        return parse_threshold(flag)
    raw = (os.environ if environ is None else environ).get(THRESHOLD_ENV)
    if raw is None or raw.strip() == "":
        return 0
    return parse_threshold(raw, source=f"{THRESHOLD_ENV} (the fallback for {THRESHOLD_FLAG})")


def resolve_schedule(flag: DepthSchedule | str | None,
                     environ: Mapping[str, str] | None = None) -> DepthSchedule | None:
    """The flag wins; else the environment variable; else none."""
    from sglang_image_plugin import depth_schedule as ds

    if isinstance(flag, ds.DepthSchedule):
        return flag
    if flag is not None:
        return ds.parse(flag)
    raw = (os.environ if environ is None else environ).get(ds.DEPTH_SCHEDULE_ENV)
    if raw is None or raw.strip() == "":
        return None
    return ds.parse(raw, source=f"{ds.DEPTH_SCHEDULE_ENV} (the fallback for {ds.DEPTH_SCHEDULE_FLAG})")


@dataclass(frozen=True, kw_only=True)
class ServerView:
    """What validation reads from the resolved server arguments."""

    speculative_algorithm: str | None
    speculative_eagle_topk: int | None
    speculative_adaptive: bool
    speculative_num_steps: int | None = None  # the launch depth K (None: not known here)
    # Why upstream's adaptive state switch cannot run here (None: it can). The
    # plain tier is built and switched by that machinery.
    adaptive_unsupported_reason: str | None = None


def resolve_and_validate(
    *,
    threshold_flag: Threshold | None,
    hysteresis_flag: int | None,
    server: ServerView,
    environ: Mapping[str, str] | None = None,
    schedule_flag: DepthSchedule | str | None = None,
) -> Setting:
    """Resolve the setting and refuse unsupported combinations.

    Raises ValueError whose message names the flag and says what to change.
    """
    environ = os.environ if environ is None else environ
    schedule = resolve_schedule(schedule_flag, environ)
    threshold = resolve_threshold(threshold_flag, environ)
    if schedule is not None:
        from sglang_image_plugin import depth_schedule as ds

        if threshold != 0:
            raise ValueError(
                f"{ds.DEPTH_SCHEDULE_FLAG}={schedule} and {THRESHOLD_FLAG}={threshold} are both set "
                f"(flag or environment): give one; a threshold N is the schedule 1-N:K,N+1-:0"
            )
        if hysteresis_flag is not None:
            raise ValueError(
                f"{HYSTERESIS_FLAG} applies to {THRESHOLD_FLAG}; each edge of "
                f"{ds.DEPTH_SCHEDULE_FLAG} keeps its own (edge // 8): drop the hysteresis flag"
            )
        _check_server(f"{ds.DEPTH_SCHEDULE_FLAG}={schedule}", server)
        if server.speculative_num_steps is not None:
            ds.check_against_steps(schedule, server.speculative_num_steps)
        return Setting(threshold=0, hysteresis=0, schedule=schedule)
    if threshold == 0:
        return OFF
    _check_server(f"{THRESHOLD_FLAG}={threshold}", server)
    if threshold == AUTO:
        if hysteresis_flag is not None:
            raise ValueError(
                f"{HYSTERESIS_FLAG} applies to a fixed {THRESHOLD_FLAG} N; with `auto` the "
                "controller keeps its own hysteresis (on the estimate and on the batch size): "
                "drop the hysteresis flag or give a number"
            )
        return Setting(threshold=AUTO, hysteresis=0)
    assert isinstance(threshold, int)
    hysteresis = default_hysteresis(threshold) if hysteresis_flag is None else hysteresis_flag
    if hysteresis >= threshold:
        raise ValueError(
            f"{HYSTERESIS_FLAG} must be smaller than {THRESHOLD_FLAG} (got H={hysteresis}, "
            f"N={threshold}); speculation would never resume"
        )
    return Setting(threshold=threshold, hysteresis=hysteresis)


def _check_server(shown: str, server: ServerView) -> None:
    """What a switching server needs of the speculation it switches (ValueError names `shown`)."""
    if server.speculative_algorithm not in SUPPORTED_ALGORITHMS:
        raise ValueError(
            f"{shown} needs --speculative-algorithm EAGLE or EAGLE3 "
            f"(got {server.speculative_algorithm!r}); drop the threshold or pick EAGLE3"
        )
    if server.speculative_eagle_topk not in (None, 1):
        raise ValueError(
            f"{shown} needs --speculative-eagle-topk 1 (got {server.speculative_eagle_topk})"
        )
    if server.speculative_adaptive:
        raise ValueError(
            f"{shown} cannot be combined with --speculative-adaptive (both switch the "
            "speculation state); use one of them"
        )
    if server.adaptive_unsupported_reason is not None:
        raise ValueError(f"{shown} is not supported here: {server.adaptive_unsupported_reason}")


def start_log_line(threshold: Threshold, schedule: DepthSchedule | None = None) -> str:
    if schedule is not None:
        return f"Dynamic speculation disable enabled: depth schedule={schedule}"
    return f"Dynamic speculation disable enabled: threshold={threshold}"


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
    identically, so all ranks choose the same mode without communication.
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

    @property
    def resume_batch_size(self) -> int:
        return self.threshold - self.hysteresis

    def next_mode(self, batch_size: int) -> Mode:
        """The transition function alone (no side effects)."""
        if self.mode is Mode.SPECULATIVE:
            return Mode.PLAIN if batch_size > self.threshold else Mode.SPECULATIVE
        return Mode.SPECULATIVE if batch_size <= self.resume_batch_size else Mode.PLAIN

    def step(self, batch_size: int) -> bool:
        """Account one decode step of this many requests; True: it runs plain."""
        new_mode = self.next_mode(batch_size)
        if new_mode != self.mode:
            self.mode = new_mode
            self.mode_changes += 1
            self._log_mode_change(batch_size)
        plain = self.mode is Mode.PLAIN
        if plain:
            self.plain_steps += 1
        else:
            self.speculative_steps += 1
        self.metrics.observe(plain, int(not plain), int(plain))
        return plain

    def _log_mode_change(self, batch_size: int) -> None:
        now = self._clock()
        if self._last_log_time is not None and now - self._last_log_time < self._log_interval_s:
            self._suppressed += 1
            return
        if self.mode is Mode.PLAIN:
            why = f"batch size {batch_size} > threshold {self.threshold}"
        else:
            why = (
                f"batch size {batch_size} <= {self.resume_batch_size} (threshold "
                f"{self.threshold} - hysteresis {self.hysteresis})"
            )
        extra = f"; {self._suppressed} earlier change(s) not logged" if self._suppressed else ""
        self._log_fn(
            f"Speculation mode -> {self.mode} ({why}); mode_changes={self.mode_changes}{extra}"
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
