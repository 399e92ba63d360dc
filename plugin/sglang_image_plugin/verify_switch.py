"""The switches of the split-KV verify's grouped prefix stage (verify_attention.grouped_prefix), of
its prefix cut by load and of its looped combine (verify_attention.looped_combine); the rules for
where the grouped stage runs and into how many parts it cuts a prefix (grouped_grid_fills,
splits_by_load, prefix_parts); and the tile, least grid and rule constants a benchmark may set.

SGLANG_IMAGE_GROUPED_VERIFY, read as upstream reads its own switches (EnvBool): unset or true, on;
"0", "false", "no" or "n", off (upstream's own stage, one program a query head). Read once a
process, at the first verify, which runs once a layer; `bench verify-kernel` sets it in its own
process to time both stages, the grouped one at other tiles and where a server's grid rule would
not run it. SGLANG_IMAGE_LOOPED_COMBINE and SGLANG_IMAGE_VERIFY_SPLITS_BY_LOAD are off unless set
to a true value ("1", "true", "yes", "y").
Standard library only: the bench imports it where no GPU is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from sglang_image_plugin.setting import (
    GROUPED_VERIFY_ENV,
    GROUPED_VERIFY_LOG_LINE,
    LOOPED_COMBINE_ENV,
    LOOPED_COMBINE_LOG_LINE,
    SPLITS_BY_LOAD_ENV,
    SPLITS_BY_LOAD_LOG_LINE,
)

logger = logging.getLogger("sglang_image_plugin.verify_attention")
FALSE_VALUES = ("false", "0", "no", "n")  # upstream's EnvBool: its other values leave the default
TRUE_VALUES = ("true", "1", "yes", "y")
# (BLOCK_N, num_warps) of the grouped stage; None: upstream's stage's own (verify_splitkv.block_config)
grouped_tile: tuple[int, int] | None = None
# the fewest programs the grouped stage's grid must have; None: the GPU's multiprocessors
grouped_min_programs: int | None = None
SPLIT_PROGRAMS_PER_CORE = 4  # splits_by_load: the grouped stage's programs a multiprocessor is given
# ... where a benchmark sets another (None: SPLIT_PROGRAMS_PER_CORE)
split_programs: int | None = None
# prefix_parts: a long prefix gets more parts than splits_by_load's, none longer than this many
# tokens (up to the scratch's splits): one part of 4,096 tokens at 128 requests was 9% slower than 16
MAX_SPLIT_TOKENS = 1024
split_tokens: int | None = None  # ... where a benchmark sets another (None: MAX_SPLIT_TOKENS)


def env_switch_on(name: str, environ: Mapping[str, str] | None = None, default: bool = True) -> bool:
    """A switch as upstream's EnvBool reads it: unset, `default`; a false value, off; a true value,
    on; any other value leaves the default."""
    value = (environ if environ is not None else os.environ).get(name)
    if value is None:
        return default
    if value.lower() in FALSE_VALUES:
        return False
    return True if value.lower() in TRUE_VALUES else default


class ProcessSwitch:
    """A switch read from the environment once a process, at its first use (one start line where
    it is on), that a benchmark may set in its own process."""

    def __init__(self, env: str, default: bool, log_line: str) -> None:
        self.env, self.default, self.log_line = env, default, log_line
        self.value: bool | None = None  # None: not yet read

    def asked_for(self, environ: Mapping[str, str] | None = None) -> bool:
        return env_switch_on(self.env, environ, default=self.default)

    def set(self, on: bool | None) -> None:
        """On or off in this process, whatever the environment says (None: read it again)."""
        self.value = on

    def on(self) -> bool:
        if self.value is None:
            self.value = self.asked_for()
            if self.value:
                logger.info(self.log_line.format(env=self.env))
        return self.value


GROUPED = ProcessSwitch(GROUPED_VERIFY_ENV, True, GROUPED_VERIFY_LOG_LINE)
grouped_asked_for, set_grouped_prefix, grouped_prefix_on = GROUPED.asked_for, GROUPED.set, GROUPED.on
# off until proven in servers at 256 requests, on both schedulers, beside an A/A floor
LOOPED = ProcessSwitch(LOOPED_COMBINE_ENV, False, LOOPED_COMBINE_LOG_LINE)
looped_combine_asked_for, set_looped_combine, looped_combine_on = LOOPED.asked_for, LOOPED.set, LOOPED.on
SPLITS_BY_LOAD = ProcessSwitch(SPLITS_BY_LOAD_ENV, False, SPLITS_BY_LOAD_LOG_LINE)  # off: kernels timed only


def set_grouped_tile(tile: tuple[int, int] | None) -> None:
    """The grouped stage's (BLOCK_N, num_warps) in this process, for `bench verify-kernel`'s sweep
    (None: upstream's stage's own). BLOCK_N must be a power of two of 16 or more."""
    global grouped_tile
    grouped_tile = tile


def set_grouped_min_programs(programs: int | None) -> None:
    """The fewest programs the grouped stage's grid must have to run (None: the GPU's
    multiprocessors; 0: any grid), for `bench verify-kernel`, which times the stage where the
    server would not run it."""
    global grouped_min_programs
    grouped_min_programs = programs


def set_split_programs(programs: int | None) -> None:
    """The programs a multiprocessor is given by splits_by_load in this process, for `bench
    verify-kernel`'s sweep (None: SPLIT_PROGRAMS_PER_CORE)."""
    global split_programs
    split_programs = programs


def set_split_tokens(tokens: int | None) -> None:
    """The longest part splits_by_load leaves a prefix in this process, for `bench verify-kernel`'s
    sweep (None: MAX_SPLIT_TOKENS)."""
    global split_tokens
    split_tokens = tokens


def max_split_tokens() -> int:
    return MAX_SPLIT_TOKENS if split_tokens is None else split_tokens


def prefix_parts(bs: int, kv_heads: int, splits: int, cores: int, prefix: int) -> int:
    """The parts the grouped stage, with the prefix cut by load, cuts a prefix of `prefix` tokens
    into (what the kernel derives on the GPU): splits_by_load's, or more where a part would pass
    max_split_tokens(), at most `splits`."""
    by_length = -(-prefix // max_split_tokens())
    return min(splits, max(splits_by_load(bs, kv_heads, splits, cores), by_length))


def grouped_grid_fills(bs: int, kv_heads: int, splits: int, cores: int) -> bool:
    """Whether the grouped stage's grid (a program per request, KV head and split) has a program for
    every multiprocessor. Where it has not (a few requests with long prefixes), upstream's stage,
    with `group` times the programs, keeps more of the GPU's memory bandwidth busy."""
    return bs * kv_heads * splits >= cores


def splits_by_load(bs: int, kv_heads: int, splits: int, cores: int) -> int:
    """The parts the grouped stage cuts a request's prefix into: as few as give every
    multiprocessor SPLIT_PROGRAMS_PER_CORE programs (or a benchmark's split_programs) at this batch
    size, between 1 and the scratch's `splits`."""
    per_core = SPLIT_PROGRAMS_PER_CORE if split_programs is None else split_programs
    wanted = -(-per_core * cores // max(1, bs * kv_heads))
    return max(1, min(splits, wanted))
