"""The EAGLE-3 worker's hooks: its threshold, schedule or `auto` policy, its plain step (resolved once,
its hooks installed by need), the zero-step verify's token type, and the step decisions and
verify results that the acceptance watch pairs.

sglang is imported inside the hooks only: they run in a process that has it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from sglang_image_plugin import flags, plain_step, prefill_kv, registry, spec_disable, state
from sglang_image_plugin.acceptance import AcceptanceAroundPlain
from sglang_image_plugin.auto_config import AutoConfig
from sglang_image_plugin.auto_depth import AutoDepthController
from sglang_image_plugin.auto_depth_policy import AutoDepthPolicy
from sglang_image_plugin.auto_policy import StepTrace
from sglang_image_plugin.auto_threshold import AutoController
from sglang_image_plugin.depth_schedule import DepthController
from sglang_image_plugin.layout import decided_at_prepare
from sglang_image_plugin.policy import (
    AutoThresholdPolicy,
    CatchUpPolicy,
    DepthSchedulePolicy,
    ThresholdPolicy,
)
from sglang_image_plugin.setting import (
    AUTO,
    AUTO_TRACE_ENV,
    THRESHOLD_FLAG,
    DepthSchedule,
    start_log_line,
)
from sglang_image_plugin.state import AcceptanceWatch, ArgsState, DraftState, WorkerState
from sglang_image_plugin.targets import Group, hooks_of
from sglang_image_plugin.tp import (
    broadcast_ints,
    log_on_rank0,
    tp_agree,
    tp_agree_depths,
    tp_group,
    tp_rank,
)


def worker_init(result: None, worker: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER EAGLEWorkerV2.__init__: above the threshold the worker runs upstream's
    zero-step state; the switch is upstream's AdaptiveController with our policy (for
    `auto`, installed by worker_init_cuda_graphs, once the server's batch limit is known)."""
    registry.check_once()
    registry.install(hooks_of(Group.SPECULATIVE), "speculative")
    server_args = worker.server_args
    on_args = state.peek(server_args, ArgsState)
    setting = on_args.setting if on_args is not None else None
    if setting is None:  # a launch path that skipped check_server_args
        setting = flags.resolve_setting(server_args)
    if not setting.enabled or not worker._hosts_draft:
        return
    from sglang.srt.speculative import eagle_worker_v2

    hf_config = worker._draft_worker.draft_runner.model_config.hf_config
    if eagle_worker_v2._qsa_index_share_requested(hf_config):
        raise ValueError(
            f"{THRESHOLD_FLAG} is not supported with a draft that shares QSA "
            "indices across its steps (index_share_for_mtp_iteration): its index buffers "
            "belong to one step count (as with --speculative-adaptive)"
        )
    own = state.of(worker, WorkerState)
    own.acceptance = AcceptanceAroundPlain()
    if isinstance(setting.schedule, DepthSchedule):
        policy = DepthSchedulePolicy(DepthController(setting.schedule), log_fn=log_on_rank0)
        worker.adaptive_controller = eagle_worker_v2.AdaptiveController(worker, policy)
        own.controller = policy
    elif setting.threshold == AUTO or setting.schedule == AUTO:
        own.auto_pending = True
        own.auto_depth = setting.schedule == AUTO
    else:
        assert isinstance(setting.threshold, int)
        controller = spec_disable.SpecDisableController(
            setting.threshold,
            setting.hysteresis,
            log_fn=log_on_rank0,
        )
        worker.adaptive_controller = eagle_worker_v2.AdaptiveController(
            worker, ThresholdPolicy(controller, worker.speculative_num_steps)
        )
        own.controller = controller
    log_on_rank0(start_log_line(setting.threshold, setting.schedule))


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
    init_cuda_graphs then builds both step states (every depth 0..K, for the learned depth
    schedule) for every captured batch size.

    `auto`'s cold start: no prior. Upstream keeps no per-batch-size replay timings (its capture
    time is graph building, not a step), so the controller starts as always-on EAGLE-3 does and
    measures the plain mode in each batch-size bucket it meets, at a bounded rate
    (AutoConfig.explore_steps / explore_gap of the steps)."""
    own = state.peek(worker, WorkerState)
    if own is None or not own.auto_pending and own.controller is None:
        return  # no threshold on this worker
    auto = own.auto_pending
    step = plain_step.resolve(worker)
    own.plain_step = step
    registry.install(hooks_of(*step.hook_groups()), "plain-step")
    max_running_requests = int(worker.target_worker.model_runner.max_running_requests)
    if auto:
        own.auto_pending = False
        from sglang.srt.speculative import eagle_worker_v2

        group = tp_group(worker.server_args)
        if group is not None:
            # One bucket layout for all ranks, then rank 0's decisions.
            max_running_requests = broadcast_ints(group.cpu_group, group.ranks[0],
                                                  [max_running_requests])[0]
        config = AutoConfig(max_batch_size=max_running_requests)
        trace_path = os.environ.get(AUTO_TRACE_ENV)
        trace = StepTrace(trace_path) if trace_path and tp_rank() == 0 else None
        policy: AutoThresholdPolicy | AutoDepthPolicy
        if own.auto_depth:
            depths = AutoDepthController(
                config, worker.speculative_num_steps,
                agree=None if group is None else tp_agree_depths(group.cpu_group, group.ranks[0]))
            policy = AutoDepthPolicy(depths, log_fn=log_on_rank0, trace=trace)
            what = (f"Speculation depth schedule: auto, learned online per batch-size bucket up to "
                    f"{max_running_requests} running requests and per depth 0..{depths.max_depth}; "
                    f"starting at depth {depths.max_depth} everywhere")
        else:
            agree = None if group is None else tp_agree(group.cpu_group, group.ranks[0], len(config.edges))
            policy = AutoThresholdPolicy(AutoController(config, agree=agree), worker.speculative_num_steps,
                                         log_fn=log_on_rank0, trace=trace)
            what = (f"Speculation crossover: auto, learned online per batch-size bucket up to "
                    f"{max_running_requests} running requests; starting speculative everywhere")
        worker.adaptive_controller = eagle_worker_v2.AdaptiveController(worker, policy)
        own.controller = policy
        log_on_rank0(
            what + ("; tensor-parallel ranks follow rank 0's estimate" if group is not None else "")
            + (f"; its steps traced to {trace_path}" if trace is not None else ""))
    adaptive = worker.adaptive_controller
    lines = step.log_lines()
    if step.kv_only:
        catch_up = CatchUpPolicy(adaptive.params)
        adaptive.params = catch_up
        draft = state.of(worker._draft_worker, DraftState)
        draft.catch_up = catch_up
        draft.prefill, prefill_line = prefill_kv.install(worker)
        lines.append(prefill_line)
    for line in lines:
        log_on_rank0(line)
    log_on_rank0(_running_limit_line(worker, max_running_requests))


def _running_limit_line(worker: Any, max_running_requests: int) -> str:
    """How many requests the server runs at once, and why; how far its decode graphs reach."""
    from sglang.srt.arg_groups.overrides import resolving_view

    decode = resolving_view(worker.server_args).cuda_graph_config.decode
    sizes = [] if decode.backend == "disabled" else list(decode.bs or [])
    graphs = (f"decode CUDA graphs up to batch {min(max(sizes), max_running_requests)}" if sizes
              else "no decode CUDA graphs")
    on_args = state.peek(worker.server_args, ArgsState)
    why = ("the limit of the same server without speculation: no --max-running-requests"
           if on_args is not None and on_args.running_limit else "--max-running-requests")
    return f"Running-request limit {max_running_requests} ({why}); {graphs}"


def step_decided(original: Callable[..., Any], worker: Any, batch_size: int, *args: Any,
                 **kwargs: Any) -> Any:
    """AROUND EAGLEWorkerV2.activate_step_by_batch: the step count chosen for a decode batch
    (0: a plain step, the catch-up step included), for the acceptance around plain phases. In
    the plain layout the step was decided before its batch was prepared: nothing to do here."""
    if decided_at_prepare(worker):
        return None
    result = original(worker, batch_size, *args, **kwargs)
    watch = _acceptance(worker)
    if watch is not None:
        watch.decided(worker.speculative_num_steps, int(batch_size))
    return result


def step_verified(worker: Any, num_correct_drafts_per_req: list[int], *args: Any,
                  **kwargs: Any) -> None:
    """BEFORE EAGLEWorkerV2.on_verify_complete_cpu: that batch's accepted drafts per request."""
    watch = _acceptance(worker)
    if watch is not None:
        watch.verified(num_correct_drafts_per_req)


def _acceptance(worker: Any) -> AcceptanceWatch | None:
    own = state.peek(worker, WorkerState)
    return own.acceptance if own is not None else None


