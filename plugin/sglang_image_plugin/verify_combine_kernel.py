"""The split-KV verify's second stage, one split and one verified token at a time.

Upstream's second stage (verify_splitkv._verify_combine_stage2, one warp a request and query head)
holds every split's partial output at once, an [N_SPLITS, L_EXT, Dv] float32 tile, and forms the
chain's own causal part as an [L_EXT, L_EXT, D] product. In a server the verify runs inside a
CUDA graph whose kv_indices is the graph's whole buffer, so upstream's split count, derived from
that buffer's length, is its largest, 16: at head dim 128 that tile is 8,192 values in one warp
at a verified width of 3-4 (L_EXT 4) and 16,384 at 5-8 (L_EXT 8), far past the registers a warp
has. This stage computes the same output with running sums: the splits' log-sum-exp maximum first,
then one split's partial output at a time, weighted; the chain's part one key at a time with an
online softmax; the two merged by their log-sum-exps as upstream merges them. Its largest tile is
[L_EXT, Dv]. A split the request's prefix does not reach (its -inf log-sum-exp) is not read at all.

Imported by the hook only (verify_attention.looped_combine): it needs triton and sglang.
"""
from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

COMBINE_WARPS = 4  # a request and query head: [L_EXT, 128] float32 running sums over 128 threads


@triton.jit
def _verify_combine_looped(
    Att_Out, Att_Lse, Q, K_Extend, V_Extend, O_Out, sm_scale, qo_indptr,
    stride_ob, stride_oh, stride_os, stride_ol, stride_lb, stride_lh, stride_ls,
    stride_qbs, stride_qh, stride_kebs, stride_keh, stride_vebs, stride_veh, stride_oobs, stride_ooh,
    kv_group_num: tl.constexpr, N_SPLITS: tl.constexpr, L_EXT: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr, BLOCK_DMODEL: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    cur_kv_head = cur_head // kv_group_num

    offs_d = tl.arange(0, BLOCK_DMODEL)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_l = tl.arange(0, L_EXT)
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < V_HEAD_DIM

    cur_q_start = tl.load(qo_indptr + cur_batch)
    l_ext = tl.load(qo_indptr + cur_batch + 1) - cur_q_start
    mask_l = offs_l < l_ext

    # ---- (a) the prefix splits, combined by their log-sum-exps, one split at a time
    lse_base = Att_Lse + cur_batch * stride_lb + cur_head * stride_lh + offs_l
    m_p = tl.zeros([L_EXT], dtype=tl.float32) - float("inf")
    for s in tl.static_range(N_SPLITS):
        m_p = tl.maximum(m_p, tl.load(lse_base + s * stride_ls, mask=mask_l, other=float("-inf")))
    denom_p = tl.zeros([L_EXT], dtype=tl.float32)
    acc_p = tl.zeros([L_EXT, BLOCK_DV], dtype=tl.float32)
    out_base = Att_Out + cur_batch * stride_ob + cur_head * stride_oh + offs_l[:, None] * stride_ol + offs_dv[None, :]
    for s in tl.static_range(N_SPLITS):
        lse_s = tl.load(lse_base + s * stride_ls, mask=mask_l, other=float("-inf"))
        w = tl.exp(lse_s - m_p)  # -inf -> 0
        reached = mask_l & (lse_s > float("-inf"))  # a split the prefix does not reach: no read
        ao = tl.load(out_base + s * stride_os, mask=reached[:, None] & mask_dv[None, :], other=0.0)
        acc_p += ao * w[:, None]
        denom_p += w
    o_prefix = acc_p / denom_p[:, None]
    lse_prefix = m_p + tl.log(denom_p)

    # ---- (b) the chain's own causal part: verified token i sees tokens 0..i, one key at a time
    q = tl.load(Q + (cur_q_start + offs_l)[:, None] * stride_qbs + cur_head * stride_qh + offs_d[None, :],
                mask=mask_l[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    m_d = tl.zeros([L_EXT], dtype=tl.float32) - float("inf")
    denom_d = tl.zeros([L_EXT], dtype=tl.float32)
    acc_d = tl.zeros([L_EXT, BLOCK_DV], dtype=tl.float32)
    for j in tl.static_range(L_EXT):
        valid_j = j < l_ext
        k_j = tl.load(K_Extend + (cur_q_start + j) * stride_kebs + cur_kv_head * stride_keh + offs_d,
                      mask=mask_d & valid_j, other=0.0).to(tl.float32)
        v_j = tl.load(V_Extend + (cur_q_start + j) * stride_vebs + cur_kv_head * stride_veh + offs_dv,
                      mask=mask_dv & valid_j, other=0.0).to(tl.float32)
        s_j = tl.sum(q * k_j[None, :], 1) * sm_scale
        seen = (offs_l >= j) & mask_l & valid_j
        s_j = tl.where(seen, s_j, float("-inf"))
        m_new = tl.maximum(m_d, s_j)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        alpha = tl.exp(m_d - m_safe)
        p = tl.exp(s_j - m_safe)
        acc_d = acc_d * alpha[:, None] + p[:, None] * v_j[None, :]
        denom_d = denom_d * alpha + p
        m_d = m_new
    o_draft = acc_d / denom_d[:, None]
    lse_draft = m_d + tl.log(denom_d)

    # ---- (c) the two merged by their log-sum-exps, as upstream's stage merges them
    m = tl.maximum(lse_prefix, lse_draft)
    wp = tl.exp(lse_prefix - m)
    wd = tl.exp(lse_draft - m)
    o = (o_prefix * wp[:, None] + o_draft * wd[:, None]) / (wp + wd)[:, None]
    tl.store(O_Out + (cur_q_start + offs_l)[:, None] * stride_oobs + cur_head * stride_ooh + offs_dv[None, :],
             o.to(O_Out.dtype.element_ty), mask=mask_l[:, None] & mask_dv[None, :])


def run(vk: Any, bs: int, q_extend: Any, k_extend: Any, v_extend: Any, o_out: Any, qo_indptr: Any,
        sm_scale: float) -> None:
    """What VerifySplitKV._run_combine_kernel launches, with this stage: the same scratch
    (vk.att_out, vk.att_lse), grid (a program per request and query head) and output."""
    out, lse = vk.att_out, vk.att_lse
    _verify_combine_looped[(bs, vk.h_q)](
        out, lse, q_extend, k_extend, v_extend, o_out, sm_scale, qo_indptr,
        out.stride(0), out.stride(1), out.stride(2), out.stride(3), lse.stride(0), lse.stride(1), lse.stride(2),
        q_extend.stride(0), q_extend.stride(1), k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1), o_out.stride(0), o_out.stride(1),
        kv_group_num=vk.group, N_SPLITS=vk.n_splits, L_EXT=vk.l_pad, HEAD_DIM=vk.head_dim,
        V_HEAD_DIM=vk.v_head_dim, BLOCK_DMODEL=triton.next_power_of_2(vk.head_dim),
        BLOCK_DV=triton.next_power_of_2(vk.v_head_dim), num_warps=COMBINE_WARPS, num_stages=1)
