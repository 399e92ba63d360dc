"""The split-KV verify's prefix stage with one program per KV head, not per query head.

Upstream's first stage (verify_splitkv._verify_prefix_stage1) runs a program per request, query
head and split: the query heads of one GQA group each read their KV head's prefix, so a verify
reads the prefix's K/V `group` times (4 on the 8B shape), where a plain decode step's grouped
kernel reads it once. This stage computes the same partial outputs and log-sum-exps into the same
scratch, one program per request, KV head and split, its query tile the group's heads times the
verified tokens (16 rows on the 8B shape, a full tensor-core tile); upstream's second stage then
combines the splits with the chain's own causal part as before. The arithmetic per row is
upstream's, line for line. `active_splits` (at most the scratch's N_SPLITS) is how many parts a
request's prefix is cut into, more where a part would pass `max_split_len` tokens; the splits past
them write the -inf log-sum-exp of a split the request does not reach, as upstream's stage does
for a short prefix.

Imported by the hook only (verify_attention.grouped_prefix): it needs triton and sglang.
"""
from __future__ import annotations

from typing import Any

import triton
import triton.language as tl
from sglang.kernels.ops.attention.verify_splitkv import (
    _MIN_BLOCK_KV,  # the split sizes stage 2 assumes
)

from sglang_image_plugin import verify_switch


@triton.jit
def _verify_prefix_grouped_stage1(
    Q, K_Buffer, V_Buffer, sm_scale, k_scale, v_scale, qo_indptr, kv_indptr, kv_indices, Att_Out, Att_Lse,
    active_splits,  # the parts a request's prefix is cut into, <= N_SPLITS (a runtime value: no recompiles)
    max_split_len,  # ... more parts where one would pass this many tokens (at most N_SPLITS)
    stride_qbs, stride_qh, stride_buf_kbs, stride_buf_kh, stride_buf_vbs, stride_buf_vh,
    stride_ob, stride_oh, stride_os, stride_ol, stride_lb, stride_lh, stride_ls,
    GROUP: tl.constexpr,  # query heads a KV head serves
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    N_SPLITS: tl.constexpr, L_EXT: tl.constexpr,  # L_EXT: verified tokens a request, padded as upstream's
    HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr, BLOCK_DMODEL: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_BLOCK_KV: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_kv_head = tl.program_id(1)
    split_kv_id = tl.program_id(2)

    offs_d = tl.arange(0, BLOCK_DMODEL)
    offs_dv = tl.arange(0, BLOCK_DV)
    # row r of the tile: query head cur_kv_head * GROUP + r // L_EXT, verified token r % L_EXT
    offs_r = tl.arange(0, GROUP_PAD * L_EXT)
    head_in_group = offs_r // L_EXT
    offs_l = offs_r % L_EXT
    cur_head = cur_kv_head * GROUP + head_in_group

    cur_q_start = tl.load(qo_indptr + cur_batch)
    l_ext = tl.load(qo_indptr + cur_batch + 1) - cur_q_start
    mask_r = (offs_l < l_ext) & (head_in_group < GROUP)

    cur_batch_kv_start_idx = tl.load(kv_indptr + cur_batch)
    cur_batch_seq_len = tl.load(kv_indptr + cur_batch + 1) - cur_batch_kv_start_idx
    parts = tl.minimum(tl.maximum(tl.cdiv(cur_batch_seq_len, max_split_len), active_splits), N_SPLITS)
    kv_len_per_split = tl.cdiv(tl.cdiv(cur_batch_seq_len, parts), MIN_BLOCK_KV) * MIN_BLOCK_KV
    split_kv_start = kv_len_per_split * split_kv_id
    split_kv_end = tl.minimum(split_kv_start + kv_len_per_split, cur_batch_seq_len)

    offs_lse = cur_batch * stride_lb + cur_head * stride_lh + split_kv_id * stride_ls + offs_l
    if split_kv_end > split_kv_start:
        e_max = tl.zeros([GROUP_PAD * L_EXT], dtype=tl.float32) - float("inf")
        e_sum = tl.zeros([GROUP_PAD * L_EXT], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD * L_EXT, BLOCK_DV], dtype=tl.float32)
        offs_q = (cur_q_start + offs_l)[:, None] * stride_qbs + cur_head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(Q + offs_q, mask=mask_r[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        q_k = q.to(K_Buffer.dtype.element_ty)
        base_offs_k = cur_kv_head * stride_buf_kh + offs_d[:, None]
        base_offs_v = cur_kv_head * stride_buf_vh + offs_dv[None, :]
        for start_n in tl.range(split_kv_start, split_kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_mask = offs_n < split_kv_end
            kv_loc = tl.load(kv_indices + cur_batch_kv_start_idx + offs_n, mask=n_mask, other=0)
            k = tl.load(K_Buffer + kv_loc[None, :] * stride_buf_kbs + base_offs_k,
                        mask=(offs_d[:, None] < HEAD_DIM) & n_mask[None, :], other=0.0)
            qk = tl.dot(q_k, k)
            qk *= sm_scale * k_scale
            qk = tl.where(n_mask[None, :], qk, float("-inf"))  # the whole prefix is visible to every row
            v = tl.load(V_Buffer + kv_loc[:, None] * stride_buf_vbs + base_offs_v,
                        mask=n_mask[:, None] & (offs_dv[None, :] < V_HEAD_DIM), other=0.0)
            n_e_max = tl.maximum(tl.max(qk, 1), e_max)
            re_scale = tl.exp(e_max - n_e_max)
            p = tl.exp(qk - n_e_max[:, None])
            acc *= re_scale[:, None]
            acc += tl.dot(p.to(v.dtype), v)
            e_sum = e_sum * re_scale + tl.sum(p, 1)
            e_max = n_e_max
        acc *= v_scale
        offs_o = (cur_batch * stride_ob + cur_head[:, None] * stride_oh + split_kv_id * stride_os
                  + offs_l[:, None] * stride_ol + offs_dv[None, :])
        tl.store(Att_Out + offs_o, acc / e_sum[:, None], mask=mask_r[:, None] & (offs_dv[None, :] < V_HEAD_DIM))
        tl.store(Att_Lse + offs_lse, e_max + tl.log(e_sum), mask=mask_r)
    else:
        # a split the request does not reach: the -inf weight upstream's second stage skips
        tl.store(Att_Lse + offs_lse, tl.zeros([GROUP_PAD * L_EXT], tl.float32) - float("inf"), mask=mask_r)


def run(vk: Any, bs: int, q_extend: Any, k_buffer: Any, v_buffer: Any, qo_indptr: Any, kv_indptr: Any,
        kv_indices: Any, sm_scale: float, k_scale: float, v_scale: float, *, active_splits: int | None = None,
        max_split_len: int = 1 << 30) -> None:
    """What VerifySplitKV._run_prefix_kernel launches, with this stage: the same scratch (vk.att_out,
    vk.att_lse), grid and, unless a benchmark set another (verify_switch.grouped_tile), tile and
    warps; a prefix cut into `active_splits` parts (None: the scratch's vk.n_splits, as upstream's),
    or more where a part would pass `max_split_len` tokens."""
    out, lse = vk.att_out, vk.att_lse
    active = vk.n_splits if active_splits is None else max(1, min(active_splits, vk.n_splits))
    block_n, num_warps = verify_switch.grouped_tile or (vk.block_n, vk.num_warps)
    _verify_prefix_grouped_stage1[(bs, vk.h_kv, vk.n_splits)](
        q_extend, k_buffer, v_buffer, sm_scale, k_scale, v_scale, qo_indptr, kv_indptr, kv_indices, out, lse,
        active, max(1, max_split_len), q_extend.stride(0), q_extend.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3), lse.stride(0), lse.stride(1), lse.stride(2),
        GROUP=vk.group, GROUP_PAD=triton.next_power_of_2(vk.group), N_SPLITS=vk.n_splits, L_EXT=vk.l_pad,
        HEAD_DIM=vk.head_dim, V_HEAD_DIM=vk.v_head_dim, BLOCK_DMODEL=triton.next_power_of_2(vk.head_dim),
        BLOCK_DV=triton.next_power_of_2(vk.v_head_dim), BLOCK_N=block_n, MIN_BLOCK_KV=_MIN_BLOCK_KV,
        num_warps=num_warps, num_stages=1)
