"""A plain step's draft work as the draft's K/V alone (a one-layer Llama EAGLE-3 draft).

Upstream's zero-step tier runs a full draft extend after every plain step: a forward of the
draft (attention, MLP, LM head) and its top-k, only to produce the next proposal, which the
next plain step does not use. For a one-layer EAGLE-3 draft the K/V at position p depend only
on the token sampled there and the target's hidden state at p, so a plain step writes just
those (embedding, fc, norms, K/V projection, rope, KV write) and hands the scheduler the
proposal's placeholders. The step that would resume speculation runs one more plain step with
the full draft extend (the catch-up step, CatchUpPolicy), so the first speculative step
drafts from a current proposal and the draft's KV cache covers every plain-decoded token.

A prefill while the mode is plain (the catch-up step still to come) writes only the draft's K/V of
the new tokens too, with the target's batch, slots and hidden states: no draft batch, metadata,
forward, logits or top-k of its own; the catch-up step then drafts for the new requests as for
the others.

Here: whether a draft can (why_not_kv_only) and the K/V write itself; the hooks around upstream's
two draft extends that run it are draft_extend.py's. sglang and torch are imported inside the
functions only.
"""

from __future__ import annotations

from typing import Any


def why_not_kv_only(draft_worker: Any, rejection_sampling: bool) -> str | None:
    """Why a plain step cannot write the draft's K/V alone here (None: it can)."""
    from sglang.srt.models.llama_eagle3 import LlamaModel

    runner = draft_worker.draft_runner
    outer = getattr(runner, "model", None)
    model = getattr(outer, "model", None)
    if not isinstance(model, LlamaModel):
        return f"the draft is {type(outer).__name__}, not a Llama EAGLE-3 draft"
    if len(model.layers) != 1:
        return f"the draft has {len(model.layers)} layers (a deeper layer's K/V need attention)"
    if model.is_mrope_enabled:
        return "the draft uses mrope positions"
    if getattr(runner.token_to_kv_pool, "requires_physical_write_loc", False):
        return f"the draft's KV pool ({type(runner.token_to_kv_pool).__name__}) translates slots"
    for name, owner in (("draft", runner), ("target", draft_worker.target_worker.model_runner)):
        translator = getattr(owner, "kv_index_translator", None)
        if translator is not None and translator.is_translating:
            return f"the {name}'s KV slots are translated"
    if getattr(draft_worker, "seed_dsa_topk_from_draft_extend", False):
        return "the draft seeds its indexer top-k from the draft extend"
    if rejection_sampling:
        return "rejection sampling carries the draft's probabilities between steps"
    return None


def write_draft_kv(model: Any, tokens: Any, positions: Any, target_hidden: Any, loc: Any,
                   pool: Any) -> None:
    """Write a one-layer EAGLE-3 draft's K/V for these tokens and nothing else: the same
    modules in the same order as LlamaModel.forward up to its attention, so the cache holds
    what a full forward writes there."""
    import torch

    layer = model.layers[0]
    attn = layer.self_attn
    embeds = layer.input_layernorm(model.embed_tokens(tokens))
    hidden = target_hidden
    if hidden.shape[-1] != embeds.shape[-1]:
        if model.input_norm is not None:
            hidden = model.input_norm(hidden)
        if model.fc_norm is not None:
            chunks = hidden.chunk(model.num_aux_hidden_states, dim=-1)
            hidden = torch.cat([norm(c) for norm, c in zip(model.fc_norm, chunks, strict=True)],
                               dim=-1)
        hidden = model.fc(hidden)
    hidden = layer.hidden_norm(hidden)
    x = torch.cat([embeds, hidden], dim=-1)
    kv_weight = kv_rows(attn)
    if kv_weight is None:
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    else:
        # K and V alone: the projection's K/V rows (two thirds of its FLOPs and weight reads are
        # Q's, which no K/V-only write reads)
        k, v = torch.nn.functional.linear(x, *kv_weight).split([attn.kv_size, attn.kv_size], dim=-1)
        q = torch.empty_like(k)  # the rope rotates a query in place too: a scratch one, unread
    _, k = attn.rotary_emb(positions, q, k)
    radix = attn.attn
    pool.set_kv_buffer(
        radix,
        loc,
        k.reshape(-1, radix.tp_k_head_num, radix.qk_head_dim),
        v.reshape(-1, radix.tp_v_head_num, radix.v_head_dim),
        radix.k_scale,
        radix.v_scale,
    )


def kv_rows(attn: Any) -> tuple[Any, Any] | None:
    """The K/V rows of the attention's fused QKV projection (weight, bias), where it is an
    unquantized linear whose weight holds [Q; K; V] row blocks (this rank's shard); None
    elsewhere (the full projection then runs and Q is dropped)."""
    proj = attn.qkv_proj
    method = getattr(proj, "quant_method", None)
    weight = getattr(proj, "weight", None)
    if (
        type(method).__name__ != "UnquantizedLinearMethod"
        or getattr(proj, "use_intel_amx_backend", False)  # a packed weight: rows are not rows
        or weight is None
        or weight.dim() != 2
        or weight.shape[0] != attn.q_size + 2 * attn.kv_size
    ):
        return None
    rows = slice(attn.q_size, attn.q_size + 2 * attn.kv_size)
    bias = getattr(proj, "bias", None)
    return weight[rows], (bias[rows] if bias is not None and not getattr(proj, "skip_bias_add", False)
                          else None)


def prefill_positions(batch: Any) -> tuple[Any, Any]:
    """A prefill's positions (each request's from its prefix length on) and each request's last
    row, as numpy int64 arrays, from the batch's host-side lengths alone."""
    import numpy as np

    lens = np.asarray(batch.extend_lens, dtype=np.int64)
    ends = np.cumsum(lens) - 1
    offsets = np.asarray(batch.prefix_lens, dtype=np.int64) - (ends + 1 - lens)
    return np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(offsets, lens), ends


def prefill_inputs(batch: Any, next_token_ids: Any) -> tuple[Any, Any]:
    """The draft's tokens and positions for a prefill's K/V, as upstream's draft extend feeds its
    forward: at each position p the token at p + 1 (each request's last position takes its tail
    token: the sampled one, or a chunked request's next prompt token), at the target's positions
    (prefix length onwards). Upstream's per-request loop, vectorised in numpy (a handful of
    torch CPU ops on tensors this small cost 4x as much host time), one host-to-device copy."""
    import torch
    from sglang.srt.speculative import eagle_worker_v2

    input_ids = batch.input_ids
    device = input_ids.device
    positions_np, ends = prefill_positions(batch)
    count = int(input_ids.shape[0])
    # positions and each request's last index in one buffer; pinned, so the copy does not make
    # the host wait for the target's forward
    host = torch.empty(count + len(ends), dtype=torch.int64, pin_memory=input_ids.is_cuda)
    view = host.numpy()
    view[:count] = positions_np
    view[count:] = ends
    on_device = host.to(device, non_blocking=True)
    positions, last = on_device[:count], on_device[count:]
    tokens = torch.empty_like(input_ids)
    tokens[:-1] = input_ids[1:]
    tokens[last] = eagle_worker_v2._eagle_prefill_tail_tokens(batch, next_token_ids)
    return tokens.to(torch.int64), positions
