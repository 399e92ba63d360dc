"""Where the plugin reaches into upstream SGLang: pure data, no imports of sglang.

HOOKS: every hook the plugin installs (dotted target, hook type, the function it installs, its
group: START at plugin load, the others by the worker for the plain step it resolved). Methods
are looked up on their class at call time, so a hook there reaches every caller; a module
function that another module imported by name is reached through the registry, which rebinds
the importers' copies.
RELIED: upstream functions and classes whose behaviour the feature depends on
without hooking them (it drives upstream's adaptive state switch); a digest of
each one's source per sglang release is recorded in upstream_digests.json, and
`python -m sglang_image plugin-check` fails when one changed.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class Group(StrEnum):
    """Which hooks go in together: START at plugin load, the others installed by a worker for the
    plain step it resolved (plain_step.PlainStep.hook_groups)."""

    START = "start"
    THRESHOLD = "threshold"  # every threshold server
    KV_ONLY = "kv_only"  # a draft that writes only its K/V
    LAYOUT = "layout"  # the plain layout (overlap scheduler)
    SPECULATIVE = "speculative"  # every EAGLE server, a threshold or not (worker_init)


START = Group.START


class HookSpec(NamedTuple):
    target: str
    hook_type: str  # "before", "after", "around" or "replace" (HookType values)
    function: str  # the hook installed there, resolved with pkgutil.resolve_name
    group: Group
    why: str

_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_WORKER = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2"
_FLAGS = "sglang_image_plugin.flags"
_WORKER_HOOKS = "sglang_image_plugin.worker"
_OBSERVE = "sglang_image_plugin.observe"
_LAYOUT = "sglang_image_plugin.layout"

HOOKS: tuple[HookSpec, ...] = (
    # -- start-up: every process, whatever the flags (they are not parsed yet)
    HookSpec(f"{_SERVER_ARGS}.add_cli_args", "after", f"{_FLAGS}:add_cli_args", START,
             "adds the two flags to the CLI"),
    HookSpec(f"{_SERVER_ARGS}.from_cli_args", "around", f"{_FLAGS}:from_cli_args", START,
             "keeps the flag values on the record"),
    HookSpec(f"{_SERVER_ARGS}.check_server_args", "after", f"{_FLAGS}:check_server_args", START,
             "resolves flag/env and validates"),
    HookSpec("sglang.srt.arg_groups.speculative_hook._handle_eagle_family", "around",
             f"{_FLAGS}:eagle_running_requests", START,
             "a threshold server without --max-running-requests keeps a plain server's limit"),
    HookSpec(f"{_WORKER}.__init__", "after", f"{_WORKER_HOOKS}:worker_init", START,
             "gives the worker the threshold policy"),
    HookSpec(f"{_WORKER}.init_cuda_graphs", "before", f"{_WORKER_HOOKS}:worker_init_cuda_graphs", START,
             "resolves the plain step (auto: its policy) and installs its hooks"),
    HookSpec("sglang.srt.managers.scheduler.Scheduler.__init__", "after",
             f"{_OBSERVE}:scheduler_init", START, "metrics; the plain layout"),
    HookSpec("sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__", "after",
             "sglang_image_plugin.verify_attention:triton_backend_init", START,
             "the split-KV verify attention on NVIDIA GPUs, unless turned off"),
    HookSpec("sglang.kernels.ops.attention.verify_splitkv.VerifySplitKV._alloc", "after",
             "sglang_image_plugin.verify_attention:zero_scratch", START,
             "the split-KV verify's skipped splits weigh zeros, never an allocation's NaN"),
    HookSpec("sglang.kernels.ops.attention.verify_splitkv.VerifySplitKV._run_prefix_kernel", "around",
             "sglang_image_plugin.verify_attention:grouped_prefix", START,
             "the split-KV verify reads each KV head's prefix once for its query heads"),
    HookSpec("sglang.kernels.ops.attention.verify_splitkv.VerifySplitKV._run_combine_kernel", "around",
             "sglang_image_plugin.verify_attention:looped_combine", START,
             "the split-KV verify's combine with running sums, where asked for"),
    # -- every EAGLE server (installed by the worker, whatever its setting)
    HookSpec("sglang.srt.managers.schedule_batch.Req.update_finish_state", "after",
             "sglang_image_plugin.length_cap:cap_finished_output", Group.SPECULATIVE,
             "an aborted request's output stops at its max_new_tokens"),
    # -- every threshold server (installed by the worker)
    HookSpec(f"{_WORKER}.build_adaptive_runtime_state", "around",
             "sglang_image_plugin.plain_target:build_runtime_state", Group.THRESHOLD,
             "the zero-step state's target graph in DECODE mode"),
    HookSpec("sglang.srt.speculative.eagle_utils.eagle_prepare_for_verify", "around",
             "sglang_image_plugin.plain_target:prepare_for_verify", Group.THRESHOLD,
             "a DECODE forward batch for that graph (speculative-layout plain steps)"),
    HookSpec(f"{_WORKER}._build_trivial_verify_input", "around",
             f"{_WORKER_HOOKS}:trivial_verify_input", Group.THRESHOLD,
             "int64 draft token for the zero-step verify under the synchronous scheduler"),
    HookSpec(f"{_WORKER}.activate_step_by_batch", "around", f"{_WORKER_HOOKS}:step_decided", Group.THRESHOLD,
             "the step count of each decode batch, for the acceptance around plain phases "
             "(plain layout: decided before the batch is prepared)"),
    HookSpec(f"{_WORKER}.on_verify_complete_cpu", "before", f"{_WORKER_HOOKS}:step_verified",
             Group.THRESHOLD, "each batch's accepted drafts, for the acceptance around plain phases"),
    HookSpec("sglang.srt.managers.scheduler_components.internal_state."
             "SchedulerInternalStateController._add_speculative", "after",
             f"{_OBSERVE}:add_speculative_state", Group.THRESHOLD,
             "adds speculative_disable to the server info"),
    # -- a draft that writes only its K/V
    HookSpec("sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker._draft_extend_for_decode",
             "around", "sglang_image_plugin.draft_extend:draft_extend_for_decode", Group.KV_ONLY,
             "a plain step writes only the draft's K/V"),
    HookSpec("sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker._draft_extend_for_prefill",
             "around", "sglang_image_plugin.draft_extend:draft_extend_for_prefill", Group.KV_ONLY,
             "a prefill while the mode is plain writes only the draft's K/V"),
    # -- the plain layout (overlap scheduler)
    HookSpec("sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode", "around",
             f"{_LAYOUT}:prepare_for_decode", Group.LAYOUT, "the step's mode and the batch's layout"),
    HookSpec(f"{_WORKER}.forward_batch_generation", "around",
             f"{_LAYOUT}:forward_batch_generation", Group.LAYOUT,
             "the plain step (target DECODE forward, draft K/V)"),
    HookSpec("sglang.srt.managers.overlap_utils.FutureMap.publish", "around", f"{_LAYOUT}:publish",
             Group.LAYOUT, "a plain step's length in spec v2's convention"),
    HookSpec("sglang.srt.managers.overlap_utils.resolve_forward_inputs", "around",
             f"{_LAYOUT}:resolve_forward_inputs", Group.LAYOUT,
             "the input token of a plain-layout batch"),
    HookSpec("sglang.srt.managers.scheduler_components.batch_result_processor."
             "SchedulerBatchResultProcessor.process_batch_result_decode", "before",
             f"{_LAYOUT}:plain_result", Group.LAYOUT, "a plain step's result counted as a zero-step verify's"),
    # -- an idle server
    HookSpec("sglang.srt.managers.scheduler.Scheduler.on_idle", "before", f"{_OBSERVE}:scheduler_idle",
             Group.THRESHOLD, "the first batch after idle takes its side by N alone; auto: no step time"),
)


def hooks_of(*groups: Group) -> tuple[HookSpec, ...]:
    """The hooks of these groups, in table order."""
    return tuple(h for h in HOOKS if h.group in groups)


RELIED: tuple[str, ...] = (
    # The parser is built by add_cli_args and read by from_cli_args.
    "sglang.srt.server_args.prepare_server_args",
    f"{_SERVER_ARGS}.from_cli_args",
    f"{_SERVER_ARGS}.__reduce__",  # bookkeeping attributes reach the scheduler
    # The worker builds, switches and runs the step states.
    f"{_WORKER}.__init__",
    f"{_WORKER}.init_cuda_graphs",
    f"{_WORKER}.forward_batch_generation",
    f"{_WORKER}._build_trivial_verify_input",
    f"{_WORKER}.activate_step_by_batch",
    f"{_WORKER}.build_adaptive_runtime_state",
    f"{_WORKER}.apply_runtime_state",
    f"{_WORKER}._override_worker_state",
    "sglang.srt.speculative.eagle_worker_v2._qsa_index_share_requested",
    "sglang.srt.speculative.adaptive_runtime_state.AdaptiveController",
    "sglang.srt.speculative.adaptive_runtime_state.AdaptiveSpecPolicy",
    "sglang.srt.speculative.adaptive_spec_params.adaptive_unsupported_reason",
    # Upstream's refusals of its adaptive swap, run on an adaptive twin of the arguments
    # (flags.ADAPTIVE_CHECKS), and what they read.
    "sglang.srt.arg_groups.validation_hook.check_server_args",
    "sglang.srt.arg_groups.lora_hook.check_lora_speculative_compatibility",
    "sglang.srt.arg_groups.hisparse_hook.validate_hisparse",
    "sglang.srt.arg_groups.model_override_base.resolving_view",
    "sglang.srt.arg_groups.model_override_base._declaration_overlay",
    # The switch is driven per verify and per batch from the scheduler's loop.
    f"{_WORKER}.on_verify_complete_cpu",
    (
        "sglang.srt.managers.scheduler_components.batch_result_processor."
        "SchedulerBatchResultProcessor._resolve_spec_v2_tokens"
    ),
    # The split-KV verify (verify_attention.py): the backend's dispatch of a target verify to it,
    # with its fallback, and the kernel's own refusals.
    "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend",
    "sglang.kernels.ops.attention.verify_splitkv.verify_splitkv_fwd",
    "sglang.kernels.ops.attention.verify_splitkv.can_handle",
    # ... and how upstream reads its switch, which verify_attention.asked_for mirrors.
    "sglang.srt.environ.EnvBool.parse",
    # ... and its two stages: a skipped split's -inf weight, the combine's sum over every split.
    "sglang.kernels.ops.attention.verify_splitkv._verify_prefix_stage1",
    "sglang.kernels.ops.attention.verify_splitkv._verify_combine_stage2",
    # ... and the scratch and launch settings the grouped prefix stage shares with upstream's.
    "sglang.kernels.ops.attention.verify_splitkv.VerifySplitKV.__init__",
    "sglang.kernels.ops.attention.verify_splitkv.VerifySplitKV._alloc",
    # ... and the combine's launch, whose arguments the looped combine takes in its place
    # (verify_combine_kernel.py computes what _verify_combine_stage2 computes).
    "sglang.kernels.ops.attention.verify_splitkv.VerifySplitKV._run_combine_kernel",
    # length_cap.py: an abort marks a running request `to_finish` for one more decode pass, which
    # update_finish_state (the hook's target) takes before its length check.
    "sglang.srt.managers.scheduler.Scheduler.abort_request",
    "sglang.srt.managers.scheduler_components.output_streamer._GenerationStreamAccumulator.accept",
    # The tensor-parallel rank and group the plugin logs on and agrees over.
    "sglang.srt.runtime_context.get_parallel",
    # How the hooks are applied: the wrapper shape registry.not_taken() inspects, and the
    # registry's own application of one target, which the worker's install calls.
    "sglang.srt.plugins.load_plugins",
    "sglang.srt.plugins.hook_registry.HookRegistry",
    "sglang.srt.plugins.hook_registry.HookRegistry._apply_target",
    "sglang.srt.plugins.hook_registry._wrap_fn",
    # A threshold server's running-request limit: upstream's reset to 48 for speculation, and the
    # decode graphs sized before it (memory settings) and capped by the limit afterwards.
    "sglang.srt.arg_groups.speculative_hook._handle_eagle_family",
    "sglang.srt.arg_groups.memory_hook.handle_gpu_memory_settings",
    # (it also reads the sizes each depth state captures at: state_graphs.py sets them)
    "sglang.srt.model_executor.runner.base_cuda_graph_runner.get_batch_sizes_to_capture",
    # auto's step clock: decode steps, and the idle loop between bursts.
    "sglang.srt.managers.scheduler.Scheduler.event_loop_overlap",
    "sglang.srt.managers.scheduler.Scheduler.event_loop_normal",
    # The plain step's target (plain_target.py): the verify it stands in for and the runner and
    # batch it builds.
    "sglang.srt.speculative.eagle_utils.eagle_prepare_for_verify",
    "sglang.srt.speculative.eagle_worker_common.run_eagle_verify",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.__init__",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.load_batch",
    # The deferred draft K/V write (deferred_kv.py): a tail hook run inside each capture.
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture_one_shape",
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
    "sglang.srt.model_executor.model_runner.ModelRunner._forward_raw",
    # The K/V-only plain step (draft_kv.py): the draft extend it stands in for, the
    # one-layer EAGLE-3 draft whose modules it runs, and the pool write it makes.
    "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker._draft_extend_for_decode",
    "sglang.srt.speculative.eagle_worker_common.prepare_for_draft_extend",
    "sglang.srt.models.llama_eagle3.LlamaModel.forward",
    "sglang.srt.models.llama_eagle3.LlamaDecoderLayer.forward",
    "sglang.srt.models.llama.LlamaAttention.forward_prepare_native",
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.set_kv_buffer",
    f"{_WORKER}._stub_skipped_draft_extend",
    # The K/V-only prefill: the draft extend it stands in for (its token shift, positions and
    # slots), its caller (the draft's group entered, the lengths published before it) and the
    # tail tokens it takes from upstream.
    "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker._draft_extend_for_prefill",
    f"{_WORKER}._forward_prefill_batch",
    "sglang.srt.speculative.eagle_utils._eagle_prefill_tail_tokens",
    # Under the overlap scheduler a K/V-only prefill hands no proposal: the relay keeps a row's
    # extras when a payload has none, a draft input with rows merges and filters by row alone,
    # and a zero-step step reads only the bonus token (EAGLEWorkerV2.forward_batch_generation).
    "sglang.srt.managers.overlap_utils.RelayPayload.from_draft_input",
    "sglang.srt.speculative.eagle_info.EagleDraftInput.merge_batch",
    "sglang.srt.speculative.eagle_info.EagleDraftInput.filter_batch",
    # The plain layout (layout.py): the scheduler's decode step around the batch it
    # converts, and what reads or writes the converted fields.
    "sglang.srt.managers.scheduler.Scheduler.update_running_batch",
    "sglang.srt.managers.scheduler.Scheduler.run_batch",
    "sglang.srt.managers.scheduler.Scheduler._relay_forward_payload",
    "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode",
    "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem",
    "sglang.srt.managers.schedule_batch.ScheduleBatch.merge_batch",
    "sglang.srt.managers.schedule_batch.ScheduleBatch.copy",
    "sglang.srt.managers.overlap_utils.resolve_forward_inputs",
    "sglang.srt.managers.overlap_utils.FutureMap.publish",
    "sglang.srt.managers.overlap_utils.FutureMap.stash",
    "sglang.srt.managers.overlap_utils.FutureMap.resolve_seq_lens_cpu",
    "sglang.srt.managers.overlap_utils.FutureMap._resolve_spec_extras",
    "sglang.srt.mem_cache.allocation.alloc_for_decode_default",
    "sglang.srt.speculative.eagle_utils.eagle_prepare_for_decode",
    (
        "sglang.srt.managers.scheduler_components.batch_result_processor."
        "SchedulerBatchResultProcessor.process_batch_result_decode"
    ),
)

DIGESTS_FILE = "upstream_digests.json"
