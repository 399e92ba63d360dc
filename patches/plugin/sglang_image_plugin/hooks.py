"""The start-up and worker hook functions of targets.HOOKS (HookRegistry call conventions): the
flags, the worker's policy and plain step, metrics and server info. The plain step's own hooks
live with its parts (plain_target.py, draft_kv.py, layout.py).

sglang is imported inside the hooks only: they run in a process that has it.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from sglang_image_plugin import draft_kv, layout, plain_step, registry, spec_disable
from sglang_image_plugin.acceptance import AcceptanceAroundPlain
from sglang_image_plugin.auto_threshold import AutoConfig, AutoController, Decision
from sglang_image_plugin.policy import AutoThresholdPolicy, CatchUpPolicy, ThresholdPolicy
from sglang_image_plugin.spec_disable import Setting
from sglang_image_plugin.targets import hooks_of

logger = logging.getLogger(__name__)

# Bookkeeping attributes on ServerArgs (not fields: pickled to the scheduler by
# ServerArgs.__reduce__, never part of the resolved configuration).
FLAGS_ATTR = "_sglang_image_spec_disable_flags"
SETTING_ATTR = spec_disable.SETTING_ATTR
# On EAGLEWorkerV2: the controller (auto: the policy), read by the observability hooks.
CONTROLLER_ATTR = "sglang_image_spec_disable"
# On EAGLEWorkerV2: `auto` waits for init_cuda_graphs to install its policy.
AUTO_PENDING_ATTR = "_sglang_image_spec_disable_auto_pending"
# On EAGLEWorkerV2: the accept length before and after each plain phase (acceptance.py).
ACCEPTANCE_ATTR = "_sglang_image_acceptance_around_plain"
SKIP_DRAFT_EXTEND_ENV = "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND"
# On ServerArgs: upstream's running-request limit for speculation was not applied (bookkeeping).
RUNNING_LIMIT_ATTR = "_sglang_image_plain_running_limit"
# Upstream's warning when it applies that limit (sglang/srt/arg_groups/speculative_hook.py).
UPSTREAM_LIMIT_WARNING = "Max running requests is reset to 48 for speculative decoding"

# Set by register(): checks once per process, from the first hook that runs, that every
# hook is in place (the loader applies them only after all plugins have registered).
_hook_check: Callable[[], None] | None = None


def set_hook_check(check: Callable[[], None]) -> None:
    global _hook_check
    _hook_check = check


def _check_hooks_once() -> None:
    global _hook_check
    check, _hook_check = _hook_check, None
    if check is not None:
        check()


def add_cli_args(result: None, parser: argparse.ArgumentParser) -> None:
    """AFTER ServerArgs.add_cli_args: the two flags."""
    _check_hooks_once()
    spec_disable.add_cli_args(parser)


def from_cli_args(original: Callable[..., Any], cls: type, args: argparse.Namespace) -> Any:
    """AROUND ServerArgs.from_cli_args: keep the parsed flags on the record."""
    server_args = original(cls, args)
    flags = (
        getattr(args, spec_disable.THRESHOLD_DEST, None),
        getattr(args, spec_disable.HYSTERESIS_DEST, None),
    )
    setattr(server_args, FLAGS_ATTR, flags)
    return server_args


def resolve_setting(server_args: Any, environ: dict[str, str] | None = None) -> Setting:
    """The validated setting for these (resolved) server arguments; ValueError names
    the flag. Off without looking further when neither the flag nor the env is set,
    so servers that do not use the feature are not touched."""
    environ = dict(os.environ) if environ is None else environ
    threshold_flag, hysteresis_flag = getattr(server_args, FLAGS_ATTR, (None, None))
    if threshold_flag is None and not environ.get(spec_disable.THRESHOLD_ENV, "").strip():
        if hysteresis_flag is not None:
            raise ValueError(
                f"{spec_disable.HYSTERESIS_FLAG} needs {spec_disable.THRESHOLD_FLAG} "
                f"(or {spec_disable.THRESHOLD_ENV})"
            )
        return spec_disable.OFF

    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    reason = None
    if cfg.speculative_algorithm in spec_disable.SUPPORTED_ALGORITHMS:
        reason = upstream_adaptive_refusal(server_args)
        if reason is None and (cfg.pp_size or 1) > 1:
            reason = "pipeline parallelism (--pp-size > 1) is not supported"
        if reason is None and environ.get(SKIP_DRAFT_EXTEND_ENV, "").strip() not in ("", "0", "false"):
            reason = (
                f"{SKIP_DRAFT_EXTEND_ENV} leaves the draft's KV cache stale while plain; unset it"
            )
    view = spec_disable.ServerView(
        speculative_algorithm=cfg.speculative_algorithm,
        speculative_eagle_topk=cfg.speculative_eagle_topk,
        speculative_adaptive=bool(cfg.speculative_adaptive),
        adaptive_unsupported_reason=reason,
    )
    return spec_disable.resolve_and_validate(
        threshold_flag=threshold_flag,
        hysteresis_flag=hysteresis_flag,
        server=view,
        environ=environ,
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
    setattr(server_args, SETTING_ATTR, resolve_setting(server_args))


def _threshold_requested(server_args: Any) -> bool:
    """Whether the flag or the variable asks for a threshold (a bad value: validation names it)."""
    threshold_flag, _ = getattr(server_args, FLAGS_ATTR, (None, None))
    try:
        return spec_disable.resolve_threshold(threshold_flag) != 0
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
    setattr(server_args, RUNNING_LIMIT_ATTR, True)
    return result


def _log_on_rank0(message: str) -> None:
    """Log once per TP group (every rank decides alike)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        rank = get_parallel().tp_rank
    except RuntimeError:  # no rank published: a process of its own
        rank = 0
    if rank == 0:
        logger.info(message)


def worker_init(result: None, worker: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER EAGLEWorkerV2.__init__: above the threshold the worker runs upstream's
    zero-step state; the switch is upstream's AdaptiveController with our policy (for
    `auto`, installed by worker_init_cuda_graphs, once the server's batch limit is known)."""
    _check_hooks_once()
    server_args = worker.server_args
    setting = getattr(server_args, SETTING_ATTR, None)
    if setting is None:  # a launch path that skipped check_server_args
        setting = resolve_setting(server_args)
    if not setting.enabled or not worker._hosts_draft:
        return
    from sglang.srt.speculative import eagle_worker_v2

    hf_config = worker._draft_worker.draft_runner.model_config.hf_config
    if eagle_worker_v2._qsa_index_share_requested(hf_config):
        raise ValueError(
            f"{spec_disable.THRESHOLD_FLAG} is not supported with a draft that shares QSA "
            "indices across its steps (index_share_for_mtp_iteration): its index buffers "
            "belong to one step count (as with --speculative-adaptive)"
        )
    setattr(worker, ACCEPTANCE_ATTR, AcceptanceAroundPlain())
    if setting.threshold == spec_disable.AUTO:
        setattr(worker, AUTO_PENDING_ATTR, True)
    else:
        assert isinstance(setting.threshold, int)
        controller = spec_disable.SpecDisableController(
            setting.threshold,
            setting.hysteresis,
            log_fn=_log_on_rank0,
        )
        worker.adaptive_controller = eagle_worker_v2.AdaptiveController(
            worker, ThresholdPolicy(controller, worker.speculative_num_steps)
        )
        setattr(worker, CONTROLLER_ATTR, controller)
    _log_on_rank0(spec_disable.start_log_line(setting.threshold))


def trivial_verify_input(original: Callable[..., Any], worker: Any, batch: Any) -> Any:
    """AROUND EAGLEWorkerV2._build_trivial_verify_input: the zero-step verify's draft
    token as int64. Upstream roots it at the previous bonus token, which verify()
    writes as int32; the overlap scheduler's future map hands it back as int64, but
    the synchronous scheduler (--disable-overlap-schedule) passes verify's own
    tensor on, and verify_tree_greedy accepts only int64 candidates (it stopped the
    scheduler at its first plain step)."""
    verify_input = original(worker, batch)
    draft_token = getattr(verify_input, "draft_token", None)
    if draft_token is not None and draft_token.dtype != _int64():
        verify_input.draft_token = draft_token.to(_int64())
    return verify_input


def _int64() -> Any:
    import torch

    return torch.int64


def worker_init_cuda_graphs(worker: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE EAGLEWorkerV2.init_cuda_graphs: the memory pools exist, the graphs are not captured
    yet. Resolves the plain step (plain_step.py), installs the hooks its parts need, wraps the
    policy for a K/V-only draft (CatchUpPolicy), and for `auto` makes the self-tuning policy (the
    server's max running requests, its largest bucket, is known now); upstream's
    init_cuda_graphs then builds both step states for every captured batch size.

    `auto`'s cold start: no prior. Upstream keeps no per-batch-size replay timings (its capture
    time is graph building, not a step), so the controller starts as always-on EAGLE-3 does and
    measures the plain mode in each batch-size bucket it meets, at a bounded rate
    (AutoConfig.explore_steps / explore_gap of the steps)."""
    auto = bool(getattr(worker, AUTO_PENDING_ATTR, False))
    if not auto and getattr(worker, CONTROLLER_ATTR, None) is None:
        return  # no threshold on this worker
    step = plain_step.resolve(worker, auto)
    setattr(worker, plain_step.ATTR, step)
    registry.install(hooks_of(*step.hook_groups()), "plain-step")
    max_running_requests = int(worker.target_worker.model_runner.max_running_requests)
    if auto:
        setattr(worker, AUTO_PENDING_ATTR, False)
        from sglang.srt.speculative import eagle_worker_v2

        agree = None
        group = _tp_group(worker.server_args)
        if group is not None:
            # One bucket layout for all ranks, then rank 0's decisions.
            max_running_requests = broadcast_ints(group.cpu_group, group.ranks[0],
                                                  [max_running_requests])[0]
            buckets = len(AutoConfig(max_batch_size=max_running_requests).edges)
            agree = tp_agree(group.cpu_group, group.ranks[0], buckets)
        policy = AutoThresholdPolicy(
            AutoController(AutoConfig(max_batch_size=max_running_requests), agree=agree),
            worker.speculative_num_steps,
            log_fn=_log_on_rank0,
        )
        worker.adaptive_controller = eagle_worker_v2.AdaptiveController(worker, policy)
        setattr(worker, CONTROLLER_ATTR, policy)
        _log_on_rank0(
            f"Speculation crossover: auto, learned online per batch-size bucket up to "
            f"{max_running_requests} running requests; starting speculative everywhere"
            + ("; tensor-parallel ranks follow rank 0's estimate" if group is not None else ""))
    adaptive = worker.adaptive_controller
    if step.kv_only:
        catch_up = CatchUpPolicy(adaptive.params)
        adaptive.params = catch_up
        setattr(worker._draft_worker, draft_kv.KV_ONLY_ATTR, catch_up)
    for line in step.log_lines():
        _log_on_rank0(line)
    _log_on_rank0(_running_limit_line(worker, max_running_requests))


def _running_limit_line(worker: Any, max_running_requests: int) -> str:
    """How many requests the server runs at once, and why; how far its decode graphs reach."""
    from sglang.srt.arg_groups.overrides import resolving_view

    decode = resolving_view(worker.server_args).cuda_graph_config.decode
    sizes = [] if decode.backend == "disabled" else list(decode.bs or [])
    graphs = (f"decode CUDA graphs up to batch {min(max(sizes), max_running_requests)}" if sizes
              else "no decode CUDA graphs")
    why = ("the limit of the same server without speculation: no --max-running-requests"
           if getattr(worker.server_args, RUNNING_LIMIT_ATTR, False)
           else "--max-running-requests")
    return f"Running-request limit {max_running_requests} ({why}); {graphs}"


def _tp_group(server_args: Any) -> Any:
    """The tensor-parallel group (sglang's GroupCoordinator) when there is more than one
    rank; None for one."""
    from sglang.srt.arg_groups.overrides import resolving_view

    if int(resolving_view(server_args).tp_size or 1) <= 1:
        return None
    from sglang.srt.runtime_context import get_parallel

    group = get_parallel().tp_group
    return group if group.world_size > 1 else None


def broadcast_ints(cpu_group: Any, src: int, values: list[int]) -> list[int]:
    """Rank `src`'s values on every rank of the group (a CPU, gloo, broadcast)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(tensor, src=src, group=cpu_group)
    return [int(v) for v in tensor.tolist()]


def tp_agree(cpu_group: Any, src: int, buckets: int) -> Callable[[Decision], Decision]:
    """`auto` under tensor parallelism: every rank takes rank `src`'s Decision. Each rank
    measures its own step times, and ranks that chose different step counts would run
    collectives of different shapes; the controller calls this at the same steps on every
    rank (once per AutoConfig.update_every decode steps), from the scheduler's thread."""

    def agree(decision: Decision) -> Decision:
        flags = [int(i in decision.undecided) for i in range(buckets)]
        values = broadcast_ints(cpu_group, src, [decision.split, *flags])
        return Decision(values[0], frozenset(i for i, f in enumerate(values[1:]) if f))

    return agree


class PrometheusMetrics(spec_disable.Metrics):
    """sglang:spec_disable_* next to the scheduler's own metrics (same labels)."""

    def __init__(self, labels: dict[str, str]) -> None:
        from prometheus_client import Counter, Gauge

        self._crossover: Any = None

        self._plain_mode = Gauge(
            name="sglang:spec_disable_plain_mode",
            documentation="1 while speculation is disabled (plain decode), else 0.",
            labelnames=list(labels),
            multiprocess_mode="mostrecent",
        ).labels(**labels)
        self._speculative_steps = Counter(
            name="sglang:spec_disable_speculative_steps_total",
            documentation="Decode steps that ran draft + verify.",
            labelnames=list(labels),
        ).labels(**labels)
        self._plain_steps = Counter(
            name="sglang:spec_disable_plain_steps_total",
            documentation="Decode steps that ran without drafting.",
            labelnames=list(labels),
        ).labels(**labels)
        self._labels = labels
        self._published_mode: bool | None = None

    def observe_crossover(self, crossover: int) -> None:
        if self._crossover is None:  # made on first use: a fixed threshold has none
            from prometheus_client import Gauge

            self._crossover = Gauge(
                name="sglang:spec_disable_crossover",
                documentation=(
                    "Threshold auto: the batch size up to which the server speculates now "
                    "(0: never; its max running requests: always)."
                ),
                labelnames=list(self._labels),
                multiprocess_mode="mostrecent",
            ).labels(**self._labels)
        self._crossover.set(crossover)

    def observe(self, plain_mode: bool, speculative_steps: int, plain_steps: int) -> None:
        """Every decode step: the gauge only when the mode changed, the step counter."""
        if plain_mode != self._published_mode:
            self._plain_mode.set(int(plain_mode))
            self._published_mode = plain_mode
        if speculative_steps:
            self._speculative_steps.inc(speculative_steps)
        if plain_steps:
            self._plain_steps.inc(plain_steps)


def scheduler_init(result: None, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.__init__: metrics for the controller, when metrics are on; the plain
    layout where the worker's plain step has it (layout.py) and this scheduler can run it."""
    worker: Any = getattr(scheduler, "draft_worker", None)
    controller = getattr(worker, CONTROLLER_ATTR, None)
    collector = getattr(scheduler, "metrics_collector", None)
    labels = getattr(collector, "labels", None)
    if controller is not None and labels is not None:
        controller.metrics = PrometheusMetrics(dict(labels))
    step = plain_step.of(worker)
    if worker is None or controller is None or step is None or not step.kv_only:
        return
    draft = worker._draft_worker
    reason = step.layout_reason
    if reason is None and scheduler.model_worker is not worker:
        reason = "the scheduler runs another worker than the EAGLE-3 one"
    if reason is None:
        reason = layout.install(scheduler, getattr(draft, draft_kv.KV_ONLY_ATTR),
                                getattr(worker, ACCEPTANCE_ATTR, None))
    if reason is None:
        return
    # every plain step stays a speculative-layout one and writes its own K/V: a deferred step
    # already captured into the graph is switched off there and nothing is flushed
    deferred = getattr(draft, draft_kv.DEFERRED_ATTR, None)
    if deferred is not None:
        deferred.disable()
    setattr(draft, draft_kv.DEFERRED_ATTR, None)
    if reason != step.layout_reason:
        setattr(worker, plain_step.ATTR, replace(step, layout_reason=reason,
                                                 deferred_reason="the speculative layout"))
        _log_on_rank0(f"Plain step: plain steps keep the speculative layout: {reason}")


def scheduler_idle(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE Scheduler.on_idle: `auto` times a step until the next decode step; an idle gap
    between them is no step time (AutoPolicy.note_idle)."""
    controller = getattr(getattr(scheduler, "draft_worker", None), CONTROLLER_ATTR, None)
    note_idle = getattr(controller, "note_idle", None)
    if note_idle is not None:
        note_idle()


def step_decided(original: Callable[..., Any], worker: Any, batch_size: int, *args: Any,
                 **kwargs: Any) -> Any:
    """AROUND EAGLEWorkerV2.activate_step_by_batch: the step count chosen for a decode batch
    (0: a plain step, the catch-up step included), for the acceptance around plain phases. In
    the plain layout the step was decided before its batch was prepared: nothing to do here."""
    if layout.decided_at_prepare(worker):
        return None
    result = original(worker, batch_size, *args, **kwargs)
    watch = getattr(worker, ACCEPTANCE_ATTR, None)
    if watch is not None:
        watch.decided(worker.speculative_num_steps > 0, int(batch_size))
    return result


def step_verified(worker: Any, num_correct_drafts_per_req: list[int], *args: Any,
                  **kwargs: Any) -> None:
    """BEFORE EAGLEWorkerV2.on_verify_complete_cpu: that batch's accepted drafts per request."""
    watch = getattr(worker, ACCEPTANCE_ATTR, None)
    if watch is not None:
        watch.verified(num_correct_drafts_per_req)


def add_speculative_state(result: None, state_controller: Any, state: dict[str, Any]) -> None:
    """AFTER SchedulerInternalStateController._add_speculative: the server info."""
    worker = getattr(state_controller.scheduler, "draft_worker", None)
    controller = getattr(worker, CONTROLLER_ATTR, None)
    if controller is not None:
        state["speculative_disable"] = controller.snapshot()
        step = plain_step.of(worker)
        if step is not None:
            state["speculative_disable"]["plain_step"] = step.view()
        watch = getattr(worker, ACCEPTANCE_ATTR, None)
        if watch is not None:
            state["speculative_disable"]["acceptance_around_plain"] = watch.view()
