"""The speculation setting, as one contract: a batch-size threshold N or `auto`, its hysteresis, or
a draft depth per load (a depth schedule). Its names (flags, environment variables, log lines), its
parsers, its defaults and its validation are spelled here once, for the plugin that implements it
and for everything that starts or checks such a server: the build system (`--threshold`, the
deployments), the smoke and the benchmark import this module by name.

Standard library only, and so is what importing it runs (the package's __init__, registry.py and
targets.py import no sglang at module level): it imports where sglang, torch and a GPU are absent
(the build system, an image of a flavor without the plugin, a bare GPU host before its install).

Threshold N: above N running requests the EAGLE worker decodes with the target alone; it
speculates again once the batch has shrunk to N - H (hysteresis H, default N // 8). `auto`: the
server finds N itself (auto_threshold.py).

Depth schedule: `--speculative-depth-schedule 1-16:3,17-48:2,49-96:1,97-:0` drafts 3 steps while at
most 16 requests run, 2 up to 48, 1 up to 96 and none above (a plain step). Tiers cover every batch
size from 1 up, in order, without gaps; the last is open (`N-`); a larger batch never gets a deeper
draft (a draft step costs more, and pays less, the larger the batch). A fixed threshold N is the
same as `1-N:K,N+1-:0` (K: --speculative-num-steps). Every edge has the threshold's default
hysteresis (edge // 8): the draft gets shallower as soon as the batch passes an edge, and deeper
again only once it is that far below it (depth_schedule.DepthController walks it).

`--speculative-depth-schedule auto`: the server learns the schedule itself (auto_depth.py): per
batch-size bucket, the depth of 0..K with the most tokens per second of step time, monotone in
batch size. It is the schedule's `auto`; the threshold's `auto` keeps learning one crossover
between K and plain. The two flags exclude each other either way.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

# -- names ---------------------------------------------------------------------------------------
THRESHOLD_FLAG = "--speculative-disable-batch-threshold"
HYSTERESIS_FLAG = "--speculative-disable-hysteresis"
DEPTH_SCHEDULE_FLAG = "--speculative-depth-schedule"
# read where the flag is not given
THRESHOLD_ENV = "SGLANG_SPEC_DISABLE_BATCH_THRESHOLD"
DEPTH_SCHEDULE_ENV = "SGLANG_SPEC_DEPTH_SCHEDULE"
# `auto`: a file to append its step trace to (JSON lines, rank 0; auto_threshold.StepTrace)
AUTO_TRACE_ENV = "SGLANG_IMAGE_AUTO_TRACE"
# Not the speculation setting, but read beside it: upstream's switch of its split-KV verify
# attention (Triton backend, top-k 1), which upstream runs on AMD gfx95 only. The plugin runs it on
# NVIDIA GPUs too (verify_attention.py) unless it is set to 0 (upstream's prefill kernel then).
SPLITKV_VERIFY_ENV = "SGLANG_ENABLE_SPLITKV_VERIFY"
SPLITKV_VERIFY_LOG_LINE = "EAGLE verify attention: split-KV kernel (top-k 1; {env}=0 turns it off)"
# The split-KV verify's prefix stage one program a KV head, not a query head (verify_prefix_kernel.py):
# on unless set to 0; 0 runs upstream's own stage.
GROUPED_VERIFY_ENV = "SGLANG_IMAGE_GROUPED_VERIFY"
GROUPED_VERIFY_LOG_LINE = ("EAGLE verify attention: the prefix stage reads each KV head once for its query "
                           "heads ({env}=0 turns it off)")
# The split-KV verify's second stage with running sums over the splits and the chain
# (verify_combine_kernel.py): off unless set to 1 (upstream's stage, one warp a request and query
# head); measured up to 128 requests on the overlap scheduler only, so not yet the default.
LOOPED_COMBINE_ENV = "SGLANG_IMAGE_LOOPED_COMBINE"
LOOPED_COMBINE_LOG_LINE = ("EAGLE verify attention: the split combine runs one split and one verified token at "
                           "a time ({env}=1)")
# The grouped prefix stage splits each request's prefix into as many parts as keep the GPU busy at
# the batch's size, not always the scratch's 16 (verify_switch.prefix_parts): off unless set to 1;
# timed on kernels only, faster at short prefixes and mixed at long ones (docs/validation.md).
SPLITS_BY_LOAD_ENV = "SGLANG_IMAGE_VERIFY_SPLITS_BY_LOAD"
SPLITS_BY_LOAD_LOG_LINE = ("EAGLE verify attention: the prefix stage splits a request's prefix by the batch's "
                           "size ({env}=1)")
# Not the speculation setting either: 1 makes a prefill in plain mode write the draft's K/V from
# the plugin's CUDA graphs (prefill_kv.py); off by default until measured on a GPU.
PREFILL_KV_GRAPHS_ENV = "SGLANG_IMAGE_PREFILL_KV_GRAPHS"
# argparse destinations: not ServerArgs fields, so ServerArgs.from_cli_args skips them.
THRESHOLD_DEST = "speculative_disable_batch_threshold"
HYSTERESIS_DEST = "speculative_disable_hysteresis"
DEPTH_SCHEDULE_DEST = "speculative_depth_schedule"

AUTO: Literal["auto"] = "auto"
Threshold = int | Literal["auto"]


class Mode(StrEnum):
    """How the worker decodes a step: drafting and verifying, or with the target alone (the
    mode-change log lines and the server info name it)."""

    SPECULATIVE = "speculative"
    PLAIN = "plain"

    def other(self) -> Mode:
        return Mode.PLAIN if self is Mode.SPECULATIVE else Mode.SPECULATIVE


# -- defaults ------------------------------------------------------------------------------------
THRESHOLD_DEFAULT: Threshold = 0  # neither the flag nor its variable: off, the server always speculates
DEPTH_SCHEDULE_EXAMPLE = "1-16:3,17-48:2,49-96:1,97-:0"  # the docs' and the benchmark's schedule
SUPPORTED_ALGORITHMS = ("EAGLE", "EAGLE3")

# -- log lines -----------------------------------------------------------------------------------
# The server's start line (the 0.5.17 flavor's patch series writes the threshold's too) and the
# start of every mode-change line.
START_LOG_LINE = "Dynamic speculation disable enabled: threshold={threshold}"
SCHEDULE_START_LOG_LINE = "Dynamic speculation disable enabled: depth schedule={schedule}"
MODE_CHANGE_LOG_PREFIX = "Speculation mode ->"

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
DEPTH_SCHEDULE_HELP = (
    "A draft depth per load: comma-separated tiers LOW-HIGH:DEPTH covering every running "
    f"batch size from 1, the last open (LOW-:DEPTH), e.g. {DEPTH_SCHEDULE_EXAMPLE}; DEPTH 0 decodes "
    "with the target alone. A larger batch never drafts deeper; no depth beyond "
    "--speculative-num-steps. Each edge has hysteresis (edge // 8): shallower at once, "
    f"deeper once the batch is that far below the edge. Instead of {THRESHOLD_FLAG} (N is "
    f"the schedule 1-N:K,N+1-:0). `auto`: the server measures the step time of every depth "
    "0..K per batch-size bucket and the accept length per depth, and learns the schedule with "
    f"the most tokens/s. Without the flag the environment variable {DEPTH_SCHEDULE_ENV} is read. "
    "EAGLE/EAGLE3 with topk 1 only."
)


def start_log_line(threshold: Threshold, schedule: DepthSchedule | Literal["auto"] | None = None) -> str:
    if schedule is not None:
        return SCHEDULE_START_LOG_LINE.format(schedule=schedule)
    return START_LOG_LINE.format(threshold=threshold)


def default_hysteresis(threshold: int) -> int:
    """N // 8, at least 1 when N > 1, always < N: a fixed threshold's, and a schedule's at each of
    its edges (the last batch size of a deeper tier)."""
    if threshold <= 1:
        return 0
    return min(max(1, threshold // 8), threshold - 1)


# -- the threshold -------------------------------------------------------------------------------
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


# -- the depth schedule --------------------------------------------------------------------------
_TIER = re.compile(r"(\d+)-(\d*):(\d+)")


class ScheduleError(ValueError):
    """A schedule that does not parse, leaves a gap, or drafts deeper at a larger batch."""


@dataclass(frozen=True)
class Tier:
    """Batch sizes low..high (None: no upper end) draft `depth` steps."""

    low: int
    high: int | None
    depth: int

    def __str__(self) -> str:
        return f"{self.low}-{'' if self.high is None else self.high}:{self.depth}"


@dataclass(frozen=True)
class DepthSchedule:
    """Tiers in batch-size order; adjacent tiers of one depth are one tier."""

    tiers: tuple[Tier, ...]

    def __str__(self) -> str:
        return ",".join(map(str, self.tiers))

    @property
    def depths(self) -> list[int]:
        """Every depth the schedule runs, deepest first."""
        return sorted({t.depth for t in self.tiers}, reverse=True)

    @property
    def deepest(self) -> int:
        return self.tiers[0].depth

    def depth_at(self, batch_size: int) -> int:
        """The depth of the tier holding this batch size (no hysteresis)."""
        return self.tiers[self.tier_of(batch_size)].depth

    def tier_of(self, batch_size: int) -> int:
        for i, tier in enumerate(self.tiers):
            if tier.high is None or batch_size <= tier.high:
                return i
        raise AssertionError("the last tier is open")  # parse_schedule() guarantees it


def parse_schedule(text: str, *, source: str = DEPTH_SCHEDULE_FLAG) -> DepthSchedule:
    """`LOW-HIGH:DEPTH,...,LOW-:DEPTH` into a schedule; a ScheduleError names `source` and the fix."""
    raw = text.strip()
    if not raw:
        raise ScheduleError(f"{source}: empty; give tiers like {DEPTH_SCHEDULE_EXAMPLE}")
    tiers: list[Tier] = []
    for part in raw.split(","):
        m = _TIER.fullmatch(part.strip())
        if m is None:
            raise ScheduleError(
                f"{source}: {part.strip()!r} is not a tier; write LOW-HIGH:DEPTH (the last one "
                f"LOW-:DEPTH, open), e.g. {DEPTH_SCHEDULE_EXAMPLE}")
        low, high, depth = int(m[1]), int(m[2]) if m[2] else None, int(m[3])
        tiers.append(Tier(low, high, depth))
    return validated_schedule(tiers, source=source)


def validated_schedule(tiers: Sequence[Tier], *, source: str = DEPTH_SCHEDULE_FLAG) -> DepthSchedule:
    """The tiers as a schedule, refused where they leave a gap, overlap, do not start at 1, do not
    end open, or draft deeper at a larger batch; adjacent tiers of one depth merged."""
    example = DEPTH_SCHEDULE_EXAMPLE
    expected = 1
    for i, tier in enumerate(tiers):
        last = i == len(tiers) - 1
        if tier.low != expected:
            where = "the first tier must start at 1" if i == 0 else f"tier {tier} must start at {expected}"
            raise ScheduleError(f"{source}: {where} (tiers cover every batch size, in order), e.g. {example}")
        if tier.high is None and not last:
            raise ScheduleError(f"{source}: only the last tier may be open ({tier}), e.g. {example}")
        if tier.high is not None and last:
            raise ScheduleError(
                f"{source}: the last tier must be open, {tier.low}-:{tier.depth} (every larger batch "
                f"gets a depth), e.g. {example}")
        if tier.high is not None and tier.high < tier.low:
            raise ScheduleError(f"{source}: tier {tier} ends before it starts")
        if i and tier.depth > tiers[i - 1].depth:
            raise ScheduleError(
                f"{source}: tier {tier} drafts deeper than tier {tiers[i - 1]} below it; a larger batch "
                "never gets a deeper draft (it costs more and pays less there)")
        expected = (tier.high or 0) + 1
    merged: list[Tier] = []
    for tier in tiers:
        if merged and merged[-1].depth == tier.depth:
            merged[-1] = Tier(merged[-1].low, tier.high, tier.depth)
        else:
            merged.append(tier)
    return DepthSchedule(tuple(merged))


def parse_schedule_or_auto(text: str, *, source: str = DEPTH_SCHEDULE_FLAG) -> DepthSchedule | Literal["auto"]:
    """The schedule flag's value: `auto` (any case), or a schedule as parse_schedule reads it (a
    ScheduleError names `source` and says `auto` is the other choice)."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return parse_schedule(text, source=source)
    except ScheduleError as e:
        raise ScheduleError(f"{e}; or `auto`: the server learns a depth per load") from None


def schedule_from_threshold(threshold: int, steps: int) -> DepthSchedule:
    """A fixed threshold N as a schedule: K steps up to N, none above."""
    return validated_schedule([Tier(1, threshold, steps), Tier(threshold + 1, None, 0)])


def check_against_steps(schedule: DepthSchedule, steps: int, *, source: str = DEPTH_SCHEDULE_FLAG) -> None:
    """Refuse a depth the server was not launched for: the KV reserve and the graphs' widths are
    sized once, for --speculative-num-steps K."""
    if schedule.deepest > steps:
        raise ScheduleError(
            f"{source}: depth {schedule.deepest} is deeper than --speculative-num-steps {steps}; "
            f"launch with --speculative-num-steps {schedule.deepest} "
            f"--speculative-num-draft-tokens {schedule.deepest + 1}, or draft at most {steps}")
    if schedule.deepest < 1:
        raise ScheduleError(f"{source}: no tier drafts; drop the schedule to serve without speculation")


# -- the launcher's flags ------------------------------------------------------------------------
def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Register the three flags (argparse then names the flag in any parse error)."""
    parser.add_argument(THRESHOLD_FLAG, dest=THRESHOLD_DEST, type=_argparse_type(parse_threshold),
                        default=None, metavar="N|auto", help=THRESHOLD_HELP)
    parser.add_argument(HYSTERESIS_FLAG, dest=HYSTERESIS_DEST, type=_argparse_type(parse_hysteresis),
                        default=None, metavar="H", help=HYSTERESIS_HELP)
    parser.add_argument(DEPTH_SCHEDULE_FLAG, dest=DEPTH_SCHEDULE_DEST,
                        type=_argparse_type(parse_schedule_or_auto), default=None,
                        metavar="LOW-HIGH:DEPTH,...|auto", help=DEPTH_SCHEDULE_HELP)


# -- resolution and validation -------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Setting:
    """The resolved switch: threshold 0 and no schedule means off."""

    threshold: Threshold
    hysteresis: int
    # a draft depth per load, fixed or `auto` (learned by the server); then threshold 0
    schedule: DepthSchedule | Literal["auto"] | None = None

    @property
    def enabled(self) -> bool:
        return (self.schedule is not None or self.threshold == AUTO
                or (isinstance(self.threshold, int) and self.threshold > 0))


OFF = Setting(threshold=THRESHOLD_DEFAULT, hysteresis=0)


def resolve_threshold(flag: str | int | None, environ: Mapping[str, str] | None = None) -> Threshold:
    """The flag wins; else the environment variable; else the default (off)."""
    if flag is not None:
        return parse_threshold(flag)
    raw = (os.environ if environ is None else environ).get(THRESHOLD_ENV)
    if raw is None or raw.strip() == "":
        return THRESHOLD_DEFAULT
    return parse_threshold(raw, source=f"{THRESHOLD_ENV} (the fallback for {THRESHOLD_FLAG})")


def resolve_schedule(flag: DepthSchedule | str | None,
                     environ: Mapping[str, str] | None = None) -> DepthSchedule | Literal["auto"] | None:
    """The flag wins; else the environment variable; else none. `auto` (either) stays `auto`."""
    if isinstance(flag, DepthSchedule):
        return flag
    if flag is not None:
        return parse_schedule_or_auto(flag)
    raw = (os.environ if environ is None else environ).get(DEPTH_SCHEDULE_ENV)
    if raw is None or raw.strip() == "":
        return None
    return parse_schedule_or_auto(raw, source=f"{DEPTH_SCHEDULE_ENV} (the fallback for {DEPTH_SCHEDULE_FLAG})")


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
        if threshold != 0:
            why = (f"`auto` for {THRESHOLD_FLAG} learns where plain beats K draft steps, for "
                   f"{DEPTH_SCHEDULE_FLAG} a depth 0..K per load" if schedule == AUTO
                   else "a threshold N is the schedule 1-N:K,N+1-:0")
            raise ValueError(
                f"{DEPTH_SCHEDULE_FLAG}={schedule} and {THRESHOLD_FLAG}={threshold} are both set "
                f"(flag or environment): give one; {why}"
            )
        if hysteresis_flag is not None:
            raise ValueError(
                f"{HYSTERESIS_FLAG} applies to {THRESHOLD_FLAG}; each edge of "
                f"{DEPTH_SCHEDULE_FLAG} keeps its own (edge // 8): drop the hysteresis flag"
            )
        _check_server(f"{DEPTH_SCHEDULE_FLAG}={schedule}", server)
        steps = server.speculative_num_steps
        if schedule == AUTO:
            if steps is not None and steps < 1:
                raise ScheduleError(
                    f"{DEPTH_SCHEDULE_FLAG}=auto learns depths 0..K of --speculative-num-steps K; "
                    f"got K={steps}: launch with --speculative-num-steps 1 or more")
        elif steps is not None:
            check_against_steps(schedule, steps)
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
