"""The plain layout (the overlap scheduler): a plain step prepared, run and processed as a plain
server's decode step.

A plain step inside spec v2's batch layout pays spec v2's host work on every step: the speculative
KV reserve, eagle_prepare_for_decode, the verify bookkeeping, the relay of the draft's extras.
Here the scheduler prepares, runs and processes a plain step as a plain server's decode step: while
the mode stays plain the running batch has spec_algorithm NONE and no spec_info.

- The step's mode is decided before the batch is prepared (AROUND ScheduleBatch.prepare_for_decode):
  the worker's adaptive controller is asked there, once per step; the worker's own call in
  forward_batch_generation is then skipped (AROUND EAGLEWorkerV2.activate_step_by_batch).
- Speculative -> plain: with the lengths the last step published (one wait for that step per
  change), the rows' lengths become those and the speculative KV reserve past them is freed.
- Plain -> speculative: the batch gets a draft input that reads the FutureMap (as after a prefill);
  the catch-up step (a zero-step step with the full draft extend) runs in that layout.
- The plain step (AROUND EAGLEWorkerV2.forward_batch_generation): the target's forward under the
  zero-step state's DECODE graph, then the draft's K/V (draft_kv.write_draft_kv). The scheduler
  relays the sampled token alone (upstream keeps the draft's extras in the FutureMap) and publishes
  the length as a plain server does, one more than spec v2's (the KV written): AROUND
  FutureMap.publish publishes the step's own lengths instead (no tensor op: a plain step under
  the graph runs none of ours but the input token's gather), and resolve_forward_inputs gathers
  the input token, which upstream does for a non-speculative server only.
- Its result (BEFORE the scheduler's process_batch_result_decode) is counted as a zero-step
  verify's: the spec metrics, and the worker's verify callback, in decode order with the steps
  the policy timed (`auto`) and the acceptance watch queued.

sglang and torch are imported inside the functions only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from sglang_image_plugin import draft_kv, state
from sglang_image_plugin.state import DraftState, Layout, WorkerState

# The scheduler process's layout (one scheduler per process); set by install().
_active: PlainLayout | None = None


def _layout(worker: Any) -> Layout | None:
    own = state.peek(worker, WorkerState)
    return own.layout if own is not None else None


def _deferred(draft_worker: Any) -> Any:
    """The draft's DeferredDraftKv (deferred_kv.py), None where its K/V are written at once."""
    own = state.peek(draft_worker, DraftState)
    return own.deferred if own is not None else None


def why_not_plain_layout(scheduler: Any) -> str | None:
    """Why this scheduler cannot run plain steps in the plain layout (None: it can)."""
    if not scheduler.enable_overlap:
        return "the synchronous scheduler (--disable-overlap-schedule) keeps the speculative layout"
    if int(scheduler.page_size) != 1:
        return f"page size {scheduler.page_size} (the KV reserve is freed per token)"
    if getattr(scheduler, "is_hybrid_swa", False):
        return "a sliding-window KV pool"
    if getattr(scheduler, "enable_unified_memory", False):
        return "the unified-memory KV allocator"
    if getattr(scheduler, "future_map", None) is None:
        return "no future map"
    return None


def batch_allows(batch: Any) -> bool:
    """Requests whose per-step state spec v2 keeps its own way (grammars, penalties) or that the
    plain layout was not checked with stay in the speculative layout."""
    return not (
        batch.has_grammar
        or batch.sampling_info.penalizer_orchestrator.is_required
        or batch.return_hidden_states
        or getattr(batch, "beam_tail", None) is not None
        or getattr(batch, "hisparse_coordinator", None) is not None
        or getattr(batch, "mamba_track_indices", None) is not None
        or batch.model_config.is_encoder_decoder
    )


class PlainLayout:
    """The worker's plain layout: decides each decode step's layout and converts the batch."""

    def __init__(self, worker: Any, future_map: Any, server_algorithm: Any, catch_up: Any,
                 watch: Any) -> None:
        self.worker = worker
        self.future_map = future_map
        self.server_algorithm = server_algorithm
        self.catch_up = catch_up  # policy.CatchUpPolicy: whether this plain step drafts in full
        self.watch = watch  # acceptance.AcceptanceAroundPlain or None
        self.predecided = False  # the worker's own decision call for this step is skipped
        # the lengths the scheduler's next publish takes (a plain step's batch.seq_lens: spec v2's
        # convention), None when that publish is not a plain step's
        self.plain_publish: Any = None
        self.to_plain_changes = 0
        self.to_speculative_changes = 0
        self.plain_steps = 0
        self._no_drafts: list[int] = []

    def no_drafts(self, batch_size: int) -> list[int]:
        """A plain step's accepted drafts per request (none), as the verify callback takes them;
        one list kept (its readers only read it)."""
        if len(self._no_drafts) != batch_size:
            self._no_drafts = [0] * batch_size
        return self._no_drafts

    # -- the decision, before the batch is prepared ------------------------------------------
    def prepare(self, batch: Any) -> None:
        """Decide this decode step and put the batch in its layout."""
        batch_size = len(batch.reqs)
        controller = self.worker.adaptive_controller
        controller.activate_step_by_batch(batch_size)  # the policy; the step state it runs
        speculative = self.worker.speculative_num_steps > 0
        plain = not speculative and not self.catch_up.full_draft_extend and batch_allows(batch)
        in_plain = batch.spec_algorithm.is_none()
        if not plain and in_plain and not self.fits_speculative(batch):
            # the speculative step's KV reserve does not fit now: plain once more, the catch-up
            # step later (the pool check that ran before this one counted one token per row)
            self.catch_up.defer()
            plain = True
        if plain and not in_plain:
            self.to_plain(batch)
        elif not plain and in_plain:
            self.to_speculative(batch)
        # a plain-layout step is not the worker's (its forward is ours): nothing to skip there
        self.predecided = not plain
        if self.watch is not None:  # every step, in decode order (its result: plain_result)
            self.watch.decided(self.worker.speculative_num_steps, batch_size)

    def fits_speculative(self, batch: Any) -> bool:
        """Whether the pool holds the speculative layout's KV reserve for this batch (upstream's
        own check, as the scheduler runs it before a speculative step)."""
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        batch.spec_algorithm = self.server_algorithm
        try:
            return bool(batch.check_decode_mem())
        finally:
            batch.spec_algorithm = SpeculativeAlgorithm.NONE

    def to_plain(self, batch: Any) -> None:
        """Speculative -> plain: the rows' lengths from the FutureMap (the KV written), the
        speculative KV reserve past them freed, no draft input."""
        import torch
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        fm = self.future_map
        if fm.publish_ready is not None:
            fm.publish_ready.synchronize()  # the last step's lengths are written
        lengths = fm.new_seq_lens_buf[batch.req_pool_indices].to(batch.seq_lens.dtype)
        lengths_cpu = lengths.cpu()
        req_to_token = batch.req_to_token_pool.req_to_token
        tails = []
        rows = batch.req_pool_indices_cpu.tolist()
        for req, row, length in zip(batch.reqs, rows, lengths_cpu.tolist(), strict=True):
            allocated = int(req.kv.kv_allocated_len)
            if allocated > length:
                tails.append(req_to_token[row, length:allocated])
                req.kv.kv_allocated_len = length
        if tails:
            batch.token_to_kv_pool_allocator.free(torch.cat(tails).to(torch.int64))
        batch.seq_lens = lengths
        batch.seq_lens_cpu = (lengths_cpu if batch.seq_lens_cpu is None
                              else lengths_cpu.to(batch.seq_lens_cpu.dtype))
        batch.orig_seq_lens = lengths.to(batch.orig_seq_lens.dtype)
        batch.seq_lens_sum = int(lengths_cpu.sum())
        batch.spec_info = None
        batch.spec_algorithm = SpeculativeAlgorithm.NONE
        self.to_plain_changes += 1

    def to_speculative(self, batch: Any) -> None:
        """Plain -> speculative: a draft input that reads the FutureMap at the next forward (its
        lengths, the sampled token, the draft's last proposal), as after a prefill."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.eagle_info import EagleDraftInput

        spec_info = EagleDraftInput(capture_hidden_mode=CaptureHiddenMode.LAST)
        spec_info.future_indices = batch.req_pool_indices
        batch.spec_info = spec_info
        batch.spec_algorithm = self.server_algorithm
        self.to_speculative_changes += 1

    # -- the plain step ------------------------------------------------------------------------
    def forward(self, batch: Any) -> Any:
        """The target's DECODE forward (the zero-step state's graph, hidden states for the
        draft), then the draft's K/V of the token the input token's position holds."""
        import torch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        self.predecided = False
        result = self.worker.target_worker.forward_batch_generation(
            batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        draft_worker = self.worker.draft_worker
        deferred = _deferred(draft_worker)
        if deferred is not None and result.can_run_cuda_graph:
            deferred.pending = True  # the graph wrote the previous step's and kept this one's
        else:
            # the input token sits at seq_lens - 1 (a plain step's lengths include it); made only
            # here: the step under the graph (the common one) needs no tensor of its own
            positions = (batch.seq_lens - 1).to(torch.int64)
            if deferred is None:
                runner = draft_worker.draft_runner
                with _draft_context(draft_worker):
                    draft_kv.write_draft_kv(
                        runner.model.model,
                        result.next_token_ids.to(torch.int64),
                        positions,
                        result.logits_output.hidden_states,
                        batch.out_cache_loc,
                        runner.token_to_kv_pool,
                    )
            else:
                deferred.step(batch.req_pool_indices, batch.input_ids, positions,
                              result.logits_output.hidden_states, batch.out_cache_loc)
        # the scheduler then publishes batch.seq_lens + 1 (a plain server's length): the KV
        # written, spec v2's, is batch.seq_lens itself, taken by the publish hook as it is
        self.plain_publish = batch.seq_lens
        self.plain_steps += 1
        return result

    def snapshot(self) -> dict[str, int]:
        return {"to_plain": self.to_plain_changes, "to_speculative": self.to_speculative_changes,
                "plain_steps": self.plain_steps}


def _draft_context(draft_worker: Any) -> Any:
    """The draft's tensor-parallel group, as upstream enters it around the draft's work."""
    layout = getattr(draft_worker, "parallel_layout", None)
    if layout is None:
        return contextlib.nullcontext()
    from sglang.srt.speculative.spec_utils import draft_tp_context

    return draft_tp_context(layout)


def install(scheduler: Any, catch_up: Any, watch: Any) -> str | None:
    """Give the scheduler's worker the plain layout; the reason when it cannot have it."""
    global _active
    reason = why_not_plain_layout(scheduler)
    if reason is not None:
        return reason
    worker = scheduler.model_worker
    layout = PlainLayout(worker, scheduler.future_map, scheduler.spec_algorithm, catch_up, watch)
    state.of(worker, WorkerState).layout = layout
    _active = layout
    return None


# -- hooks ---------------------------------------------------------------------------------------
def prepare_for_decode(original: Callable[..., Any], batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ScheduleBatch.prepare_for_decode: the step's layout first."""
    layout = _active
    if layout is not None and len(batch.reqs) > 0 and (
        batch.spec_algorithm.is_none() or batch.spec_algorithm == layout.server_algorithm
    ):
        layout.prepare(batch)
    return original(batch, *args, **kwargs)


def decided_at_prepare(worker: Any) -> bool:
    """For EAGLEWorkerV2.activate_step_by_batch: this step was decided at prepare (skip it)."""
    layout = _layout(worker)
    if layout is not None and layout.predecided:
        layout.predecided = False
        return True
    return False


def forward_batch_generation(original: Callable[..., Any], worker: Any, batch: Any,
                             *args: Any, **kwargs: Any) -> Any:
    """AROUND EAGLEWorkerV2.forward_batch_generation: a plain-layout decode batch's step."""
    layout = _layout(worker)
    if batch.forward_mode.is_extend():
        deferred = _deferred(worker.draft_worker) if layout is not None else None
        if deferred is not None:  # new requests in these rows: nothing of theirs is pending
            deferred.forget(batch.req_pool_indices)
        own = state.peek(worker, WorkerState)
        note_prefill = getattr(own.controller, "note_prefill", None) if own is not None else None
        if note_prefill is not None:  # auto's step trace
            note_prefill(int(getattr(batch, "extend_num_tokens", 0) or 0))
    if (
        layout is None
        or not batch.spec_algorithm.is_none()
        or not batch.forward_mode.is_decode()
    ):
        return original(worker, batch, *args, **kwargs)
    return layout.forward(batch)


def plain_result(processor: Any, batch: Any, result: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE SchedulerBatchResultProcessor.process_batch_result_decode: a plain-layout step's
    result counted, in decode order, as upstream counts a zero-step verify's (upstream counts a
    speculative batch's alone): the server's spec metrics (its decode log divides by the
    speculative steps counted), the worker's verify callback with no draft accepted (`auto`
    pairs it with the step it timed; the acceptance watch) and each request's verify count
    (tokens per step in meta_info)."""
    layout = _active
    if (
        layout is None
        or processor.model_worker is not layout.worker
        or not batch.spec_algorithm.is_none()
        or not batch.forward_mode.is_decode()
        or not batch.reqs
    ):
        return
    batch_size = len(batch.reqs)
    processor.metrics_reporter.update_spec_metrics(batch_size, 0, num_accept_tokens=batch_size)
    layout.worker.on_verify_complete_cpu(layout.no_drafts(batch_size), batch_size=batch_size)
    # one verify per request: a finished or retracted request's count is read no more (upstream
    # skips them; counting them too saves a method call per request and step)
    for req in batch.reqs:
        req.spec_verify_ct += 1


def publish(original: Callable[..., Any], future_map: Any, future_indices: Any,
            new_seq_lens: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND FutureMap.publish: a plain step's length in spec v2's convention (the KV written):
    the step's own batch.seq_lens, which equal the new_seq_lens the scheduler passes (its
    batch.seq_lens + 1, a plain server's) less one, without a tensor op of ours."""
    layout = _active
    if layout is not None and layout.plain_publish is not None and future_map is layout.future_map:
        new_seq_lens, layout.plain_publish = layout.plain_publish, None
    return original(future_map, future_indices, new_seq_lens, *args, **kwargs)


def resolve_forward_inputs(original: Callable[..., Any], batch: Any, future_map: Any,
                           *args: Any, **kwargs: Any) -> Any:
    """AROUND overlap_utils.resolve_forward_inputs: a plain-layout batch's input token from the
    FutureMap (upstream gathers it for a non-speculative server only)."""
    result = original(batch, future_map, *args, **kwargs)
    layout = _active
    if (
        layout is not None
        and future_map is layout.future_map
        and batch.input_ids is None
        and batch.spec_algorithm.is_none()
        and batch.forward_mode.is_decode()
    ):
        batch.input_ids = future_map.output_tokens_buf[batch.req_pool_indices]
    return result
