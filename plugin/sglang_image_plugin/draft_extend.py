"""The hooks around the draft's two draft extends where a plain step writes only the draft's K/V
(draft_kv.py; installed where the worker's plain step has that part, targets.Group.KV_ONLY).

A plain step other than the catch-up step, and a prefill while the mode is plain, write the
one-layer EAGLE-3 draft's K/V alone instead of upstream's full draft extend; everything else runs
upstream's. sglang and torch are imported inside the functions only.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from sglang_image_plugin import draft_kv, state
from sglang_image_plugin.state import DraftState


def draft_extend_for_decode(original: Callable[..., Any], draft_worker: Any, batch: Any,
                            batch_result: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND EagleDraftWorker._draft_extend_for_decode: a plain step other than the catch-up
    writes the draft's K/V alone (installed where the worker's plain step has the K/V-only part;
    with the plain layout, it first flushes what the last plain-layout step left pending)."""
    own = state.peek(draft_worker, DraftState) or DraftState()
    catch_up, deferred = own.catch_up, own.deferred
    if deferred is not None and draft_worker.speculative_num_steps == 0 and not batch.forward_mode.is_idle():
        # (layout) what the last plain-layout step left pending, before this step writes its own:
        # the token fed now sits at seq_lens (spec v2's lengths exclude it)
        deferred.flush(batch.req_pool_indices, batch.input_ids, batch.seq_lens)
    if (
        catch_up is None
        or draft_worker.speculative_num_steps != 0
        or catch_up.full_draft_extend
        or batch.forward_mode.is_idle()
    ):
        return original(draft_worker, batch, batch_result, *args, **kwargs)
    import torch
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    runner = draft_worker.draft_runner
    # One token per request (stride 1): sampled at position seq_lens, the slot the target's
    # forward wrote (batch.out_cache_loc), the target's hidden states there.
    draft_kv.write_draft_kv(
        runner.model.model,
        batch_result.next_token_ids.to(torch.int64),
        batch.seq_lens.to(torch.int64),
        batch_result.logits_output.hidden_states,
        batch.out_cache_loc,
        runner.token_to_kv_pool,
    )
    # The proposal the scheduler relays: upstream's placeholders for a skipped draft extend (no
    # plain step reads them; the catch-up step replaces them). It reads these three of its worker.
    stub_owner = SimpleNamespace(device=draft_worker.device, topk=draft_worker.topk,
                                 draft_worker=draft_worker)
    EAGLEWorkerV2._stub_skipped_draft_extend(stub_owner, batch, batch_result)
    return None


def draft_extend_for_prefill(original: Callable[..., Any], draft_worker: Any, batch: Any,
                             target_hidden_states: Any, next_token_ids: Any,
                             mm_input_embeds: Any = None, *args: Any, **kwargs: Any) -> Any:
    """AROUND EagleDraftWorker._draft_extend_for_prefill: while the mode is plain, a prefill
    writes the draft's K/V of its tokens alone (installed where the worker's plain step has the
    K/V-only part). Its proposal for the new requests is upstream's placeholders, or none where
    the overlap scheduler's FutureMap relays it by row (the plain layout): no plain step reads
    it, and the catch-up step, which runs before any speculative step while the mode is plain
    (CatchUpPolicy.draft_stale), drafts for every request. Speculative mode, the catch-up
    step's turn, a mixed or idle batch and multimodal inputs run upstream's draft extend."""
    own = state.peek(draft_worker, DraftState)
    catch_up = own.catch_up if own is not None else None
    if catch_up is None or not catch_up.draft_stale or mm_input_embeds is not None:
        return original(draft_worker, batch, target_hidden_states, next_token_ids,
                        mm_input_embeds, *args, **kwargs)
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    if batch.forward_mode != ForwardMode.EXTEND:
        return original(draft_worker, batch, target_hidden_states, next_token_ids,
                        mm_input_embeds, *args, **kwargs)
    from sglang.srt.speculative import eagle_worker_v2
    from sglang.srt.speculative.eagle_info import EagleDraftInput
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    # the target's slots (the plan's, untranslated: why_not_kv_only) and its hidden states, from
    # the captured graphs (prefill_kv.py) where the prefill fits them
    prefill = own.prefill if own is not None else None
    if prefill is None or not prefill.write(
            batch, eagle_worker_v2._eagle_prefill_tail_tokens(batch, next_token_ids), target_hidden_states):
        runner = draft_worker.draft_runner
        tokens, positions = draft_kv.prefill_inputs(batch, next_token_ids)
        draft_kv.write_draft_kv(runner.model.model, tokens, positions, target_hidden_states,
                                batch.out_cache_loc, runner.token_to_kv_pool)
    next_draft_input = EagleDraftInput(bonus_tokens=next_token_ids, num_tokens_per_req=1,
                                       num_tokens_for_logprob_per_req=1)
    if own is not None and own.proposal_by_row:
        # The overlap scheduler relays the proposal through its FutureMap, which keeps a row's
        # draft extras when the payload has none (FutureMap.stash), and the batch's draft input
        # merges, filters and resolves by row (future_indices): no placeholders to make, nor to
        # scatter into the FutureMap, per prefill.
        return next_draft_input
    stub_owner = SimpleNamespace(device=draft_worker.device, topk=draft_worker.topk,
                                 draft_worker=draft_worker)
    EAGLEWorkerV2._stub_skipped_draft_extend(stub_owner, batch,
                                             SimpleNamespace(next_draft_input=next_draft_input))
    return next_draft_input
