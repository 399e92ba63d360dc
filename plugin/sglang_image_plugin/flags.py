"""The flags' hooks: the setting's flags (setting.py), their validation against what upstream
allows, and a threshold server's running-request limit. The resolved Setting travels to the scheduler
on the record (ServerArgs pickles bookkeeping attributes with it).

sglang is imported inside the hooks only: they run in a process that has it.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
from collections.abc import Callable
from typing import Any

from sglang_image_plugin import registry, setting, state
from sglang_image_plugin.setting import Setting
from sglang_image_plugin.state import ArgsState

logger = logging.getLogger(__name__)

SKIP_DRAFT_EXTEND_ENV = "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND"
# Upstream's warning when it applies that limit (sglang/srt/arg_groups/speculative_hook.py).
UPSTREAM_LIMIT_WARNING = "Max running requests is reset to 48 for speculative decoding"


def add_cli_args(result: None, parser: argparse.ArgumentParser) -> None:
    """AFTER ServerArgs.add_cli_args: the setting's flags."""
    registry.check_once()
    setting.add_cli_args(parser)


def from_cli_args(original: Callable[..., Any], cls: type, args: argparse.Namespace) -> Any:
    """AROUND ServerArgs.from_cli_args: keep the parsed flags on the record."""
    server_args = original(cls, args)
    flags = (
        getattr(args, setting.THRESHOLD_DEST, None),
        getattr(args, setting.HYSTERESIS_DEST, None),
        getattr(args, setting.DEPTH_SCHEDULE_DEST, None),
    )
    state.of(server_args, ArgsState).flags = flags
    return server_args


def _flags(server_args: Any) -> tuple[Any, Any, Any]:
    """The flags as parsed (threshold, hysteresis, depth schedule), Nones where from_cli_args did
    not see them."""
    args = state.peek(server_args, ArgsState)
    return args.flags if args is not None else (None, None, None)


def resolve_setting(server_args: Any, environ: dict[str, str] | None = None) -> Setting:
    """The validated setting for these (resolved) server arguments; ValueError names
    the flag. Off without looking further when neither the flag nor the env is set,
    so servers that do not use the feature are not touched."""
    environ = dict(os.environ) if environ is None else environ
    threshold_flag, hysteresis_flag, schedule_flag = _flags(server_args)
    if threshold_flag is None and schedule_flag is None and not any(
            environ.get(var, "").strip() for var in (setting.THRESHOLD_ENV, setting.DEPTH_SCHEDULE_ENV)):
        if hysteresis_flag is not None:
            raise ValueError(
                f"{setting.HYSTERESIS_FLAG} needs {setting.THRESHOLD_FLAG} "
                f"(or {setting.THRESHOLD_ENV})"
            )
        return setting.OFF

    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    reason = None
    if cfg.speculative_algorithm in setting.SUPPORTED_ALGORITHMS:
        reason = upstream_adaptive_refusal(server_args)
        if reason is None and (cfg.pp_size or 1) > 1:
            reason = "pipeline parallelism (--pp-size > 1) is not supported"
        if reason is None and environ.get(SKIP_DRAFT_EXTEND_ENV, "").strip() not in ("", "0", "false"):
            reason = (
                f"{SKIP_DRAFT_EXTEND_ENV} leaves the draft's KV cache stale while plain; unset it"
            )
    view = setting.ServerView(
        speculative_algorithm=cfg.speculative_algorithm,
        speculative_eagle_topk=cfg.speculative_eagle_topk,
        speculative_adaptive=bool(cfg.speculative_adaptive),
        speculative_num_steps=cfg.speculative_num_steps,
        adaptive_unsupported_reason=reason,
    )
    return setting.resolve_and_validate(
        threshold_flag=threshold_flag,
        hysteresis_flag=hysteresis_flag,
        server=view,
        environ=environ,
        schedule_flag=schedule_flag,
    )


# Upstream's own refusals of its adaptive state swap, which the threshold drives too.
# Each runs on a copy of the server arguments with --speculative-adaptive on: what it
# refuses there (and not for the arguments as given) is refused for the threshold, in
# upstream's words, so a refusal upstream adds to these checks reaches us unchanged.
ADAPTIVE_CHECKS: tuple[str, ...] = (
    # the worker-level conditions (topk, attention DP, multi-layer EAGLE, TBO, ...)
    "sglang.srt.speculative.adaptive_spec_params.adaptive_unsupported_reason",
    # the cross-family validation: LoRA (cuda-graph metadata not rebuilt by the swap),
    # PP speculation, ...
    "sglang.srt.arg_groups.validation_hook.check_server_args",
    # HiSparse's statically sized swap state (a resolution pass, not in the above)
    "sglang.srt.arg_groups.hisparse_hook.validate_hisparse",
)
_ADAPTIVE_SOURCE = "sglang-image-plugin: adaptive twin"


def _adaptive_twin(server_args: Any) -> Any:
    """A copy of the server arguments (as the scheduler receives them: pickled) whose resolved
    view reads --speculative-adaptive as on: a declaration on top of the resolution's, which
    every check reads through (the record itself is sealed once resolved)."""
    twin = pickle.loads(pickle.dumps(server_args))
    overrides = list(getattr(twin, "_resolved_overrides", None) or ())
    overrides.append((_ADAPTIVE_SOURCE, {"speculative_adaptive": True}))
    twin._resolved_overrides = overrides
    return twin


def _run_check(check: Any, server_args: Any) -> str | None:
    """What one upstream check refuses (its message), None when it passes."""
    try:
        result = check(server_args)
    except (ValueError, AssertionError, NotImplementedError) as e:
        return str(e) or type(e).__name__
    return result if isinstance(result, str) else None


def upstream_adaptive_refusal(server_args: Any) -> str | None:
    """Why upstream would refuse its adaptive swap for these arguments; None if it would not."""
    import pkgutil

    from sglang.srt.arg_groups.overrides import resolving_view

    twin = _adaptive_twin(server_args)
    for dotted in ADAPTIVE_CHECKS:
        check = pkgutil.resolve_name(dotted)
        if dotted.endswith("validate_hisparse") and not resolving_view(server_args).enable_hisparse:
            continue  # upstream runs it only for --enable-hisparse
        refused = _run_check(check, twin)
        if refused is None:
            continue
        # A query (it returns the reason) answers for the swap whatever the arguments; a
        # validator (it raises) that refuses the arguments as given already stopped the launch
        # with upstream's own message.
        if dotted.endswith("adaptive_unsupported_reason") or _run_check(check, server_args) is None:
            return refused
    return None


def check_server_args(result: None, server_args: Any) -> None:
    """AFTER ServerArgs.check_server_args: bad input stops the launch here, naming
    the flag; the scheduler processes read the resolved setting from the record."""
    state.of(server_args, ArgsState).setting = resolve_setting(server_args)


def _threshold_requested(server_args: Any) -> bool:
    """Whether a flag or a variable asks for a threshold or a schedule with plain steps (a bad
    value: validation names it)."""
    threshold_flag, _, schedule_flag = _flags(server_args)
    try:
        schedule = setting.resolve_schedule(schedule_flag)
        if schedule == setting.AUTO:
            return True  # a learned schedule may decode plain at any batch size
        if schedule is not None:
            return 0 in schedule.depths
        return setting.resolve_threshold(threshold_flag) != 0
    except ValueError:
        return False


class _DropMessage(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def eagle_running_requests(original: Callable[..., Any], server_args: Any, *args: Any,
                           **kwargs: Any) -> Any:
    """AROUND speculative_hook._handle_eagle_family: upstream caps a speculative server's running
    requests at 48 unless --max-running-requests is given; a threshold server decodes plain above
    its threshold, and that cap would keep it below a plain server's throughput at any load it
    cannot reach. Without the flag it keeps the limit of the same server without speculation
    (its decode graphs, sized before this, then reach that far too)."""
    from sglang.srt.arg_groups.overrides import resolving_view

    if resolving_view(server_args).max_running_requests is not None or not _threshold_requested(
            server_args):
        return original(server_args, *args, **kwargs)
    upstream_logger = logging.getLogger(original.__module__)
    quiet = _DropMessage(UPSTREAM_LIMIT_WARNING)
    upstream_logger.addFilter(quiet)
    try:
        result = original(server_args, *args, **kwargs)
    finally:
        upstream_logger.removeFilter(quiet)
    stash = getattr(server_args, "_resolved_overrides", None) or []
    for source, fields in stash:
        if source == "_handle_eagle_family" and "max_running_requests" in fields:
            del fields["max_running_requests"]
    state.of(server_args, ArgsState).running_limit = True
    return result


