"""`python -m bench verify-kernel`: the EAGLE verify's attention alone, one layer, no server.

Upstream's two kernels for a target verify with speculative top-k 1 (a causal chain): the prefill
kernel (`extend_attention_fwd`, what SGLang's Triton backend runs for a verify on NVIDIA GPUs) and
the split-KV verify kernel (`verify_splitkv_fwd`, what it runs by default with this image's
plugin, whose hooks are loaded here as in a server: its prefix stage one program a KV head), and
beside it `per-head`, the split-KV kernel with upstream's own prefix stage (one program a query
head; SGLANG_IMAGE_GROUPED_VERIFY=0 in a server). At each batch size, context length and verify
width asked for, the same inputs go through each: each one's time (CUDA events, the median of
--repeats runs after a warm-up), times --layers for a decode step's share, and the largest
difference of their outputs. A server runs the plugin's stage only where its grid has a program
for every multiprocessor, so at a few requests the split-KV column is upstream's stage. With
--grouped-tiles the plugin's stage runs again at each tile asked for (BLOCK_N x warps; its default
is upstream's stage's own), whatever the grid, in a table of its own. `looped` is the split-KV
kernel with the plugin's looped combine stage (SGLANG_IMAGE_LOOPED_COMBINE=1 in a server), timed
against the same kernel with upstream's combine stage.
The split count is a server's by default: its verify runs in a CUDA graph whose kv_indices is the
graph's whole buffer, so upstream derives its largest split count, 16, whatever the context;
--no-graph-splits derives it from the context, as an eager verify does (as row 77 and earlier ran).
A difference beyond --tolerance fails the command. The shape's defaults are the 8B shape's (32
query heads, 8 KV heads, head dim 128); the default contexts bracket the benchmark's short
prompts (about 200 tokens) and a chat's (2,048).

Beside them, two figures to weigh the verify's attention against: `decode`, upstream's flash-decode
kernel (`decode_attention_fwd`) with one query a request over the same prefix, the attention a
plain decode step pays at that load; and `folded`, the verify computed by that same decode kernel
with each request's d + 1 queries folded into its query-head group (every verified token sees the
whole prefix, so one pass over the prefix's K/V serves all of them), the chain's own causal
(d + 1) x (d + 1) part in plain torch, and the two merged by their log-sum-exps (upstream's
`merge_state_triton`): what the verify could cost without a kernel of its own (its torch part
unfused, so an upper bound). Its output is checked against the prefill kernel's as the split-KV
kernel's is. `folded` runs only with --folded, and only where the folded group (query heads a KV
head serves x verified tokens) is at most the decode kernel's head tile, 16, or a multiple of it:
upstream's grouped decode kernel maps a head tile to one KV head, so a group of 24 (width 6 on the
8B shape) reads the wrong KV head for a third of its rows. At one request and width 4 it differed
from the prefill kernel by 0.038 on an H100, which is not explained yet; no server runs it.

`splits by load` is the looped combine with the grouped prefix stage cutting each prefix into as
many parts as the batch's size needs, none longer than 1,024 tokens
(SGLANG_IMAGE_VERIFY_SPLITS_BY_LOAD=1 in a server), where the plugin's stage runs; its column names
the parts. --split-programs and --split-tokens time it again at other values of those two constants.

Needs sglang (the image's, or the GPU host's site) and a GPU; with --device cpu and
TRITON_INTERPRET=1 it runs Triton's interpreter on tiny shapes (float32: the interpreter computes
bfloat16 wrongly), which is what the CPU tests do.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GRAPH_PREFIX = 8192  # the average prefix at and above which upstream splits a verify 16 ways
DECODE_HEAD_TILE = 16  # decode_attention._GROUPED_BLOCK_H: the query heads one program of the grouped kernel takes


@dataclass(frozen=True)
class Case:
    batch: int
    context: int  # prefix tokens a request has before the verified ones
    width: int  # tokens verified per request (draft steps + 1)


@dataclass(frozen=True)
class Timing:
    case: Case
    prefill_ms: float
    splitkv_ms: float | None  # None: the split-KV kernel refused the case (upstream then falls back)
    max_diff: float | None
    decode_ms: float | None = None  # one query a request over the same prefix: a plain step's attention
    folded_ms: float | None = None  # the verify through the decode kernel, queries folded into the group
    folded_diff: float | None = None  # its largest difference from the prefill kernel's output
    headwise_ms: float | None = None  # the split-KV kernel with upstream's per-query-head prefix stage
    headwise_diff: float | None = None
    tiles: tuple[tuple[str, float, float], ...] = ()  # --grouped-tiles: (BLOCK_NxWARPS, ms, difference)
    # --split-programs, --split-tokens: (the rule's setting, the parts a prefix was cut into, ms, difference)
    split_rules: tuple[tuple[str, int | None, float, float], ...] = ()
    looped_ms: float | None = None  # the split-KV kernel with the plugin's looped combine stage
    upstream_combine_ms: float | None = None  # ... with upstream's combine stage instead
    upstream_combine_diff: float | None = None
    looped_diff: float | None = None
    splits: int | None = None  # the split-KV kernel's split count
    by_load_ms: float | None = None  # the looped combine with the prefix cut into by_load_splits parts
    by_load_diff: float | None = None
    by_load_splits: int | None = None  # the parts the grouped stage cut a prefix into (None: its stage did not run)

    @property
    def speedup(self) -> float | None:
        return self.prefill_ms / self.splitkv_ms if self.splitkv_ms else None


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers separated by commas")
    return values


def _tiles(text: str) -> list[tuple[int, int]]:
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        n, _, w = item.partition("x")
        if not (n.isdigit() and w.isdigit()) or int(n) < 16 or int(n) & (int(n) - 1) or int(w) < 1:
            raise argparse.ArgumentTypeError(
                f"{item!r}: give BLOCK_NxWARPS, BLOCK_N a power of two from 16 (e.g. 32x4,64x4,64x8)")
        out.append((int(n), int(w)))
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batch", type=_ints, default=[16, 64, 128, 256], help="requests verified together")
    ap.add_argument("--context", type=_ints, default=[256, 2048], help="prefix tokens per request")
    ap.add_argument("--width", type=_ints, default=[2, 3, 4], help="tokens verified per request (depth + 1)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32, help="layers a decode step runs (the step's share)")
    ap.add_argument("--kv-splits", type=int, default=8,
                    help="the decode kernel's most KV splits a request (SGLang's --triton-attention-num-kv-splits)")
    ap.add_argument("--grouped-tiles", type=_tiles, default=[],
                    help="also time the plugin's grouped prefix stage at these tiles, BLOCK_NxWARPS "
                         "(e.g. 32x4,64x4,64x8; its default is upstream's stage's own, 32x4 at head dim 128), "
                         "whatever the grid")
    ap.add_argument("--split-programs", type=_ints, default=[],
                    help="also time the looped combine with the prefix cut by the batch's size at each of "
                         "these programs a multiprocessor (the rule of SGLANG_IMAGE_VERIFY_SPLITS_BY_LOAD=1; "
                         "its default 4), e.g. 4,8,16")
    ap.add_argument("--split-tokens", type=_ints, default=[],
                    help="... and at each of these longest parts, in tokens, a prefix is left in (its default "
                         "1024), e.g. 512,2048,8192")
    ap.add_argument("--graph-splits", action=argparse.BooleanOptionalAction, default=True,
                    help="the split-KV kernel's split count as in a server's CUDA graph (16: the graph's "
                         "kv_indices is its whole buffer); --no-graph-splits: from the context")
    ap.add_argument("--folded", action="store_true",
                    help="also time the verify through the decode kernel, its queries folded into the "
                         "query-head group, where the group fits the kernel's head tile (see above)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tolerance", type=float, default=0.02,
                    help="the largest difference of the two kernels' outputs allowed (inputs of unit scale)")
    ap.add_argument("--out", type=Path, default=None, help="write the table (.md) and the figures (.json) here")


def _timer(device: str) -> Callable[[Callable[[], Any], int], float]:
    """Median ms of fn over n runs: CUDA events on a GPU, the wall clock elsewhere."""
    import torch

    def on_gpu(fn: Callable[[], Any], n: int) -> float:
        times = []
        for _ in range(n):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
        return statistics.median(times)

    def on_host(fn: Callable[[], Any], n: int) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times)

    return on_gpu if device.startswith("cuda") else on_host


def measure(case: Case, a: argparse.Namespace) -> Timing:
    import torch
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang.kernels.ops.attention.verify_splitkv import verify_splitkv_fwd

    from sglang_image_plugin import verify_switch

    dtype, dev = getattr(torch, a.dtype), a.device
    g = torch.Generator(device="cpu").manual_seed(case.batch * 7919 + case.context * 31 + case.width)
    def randn(*shape: int) -> Any:
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=dev)

    bs, n, w = case.batch, case.context, case.width
    pool = bs * n + 1  # slot 0 unused, as in SGLang's pool
    k_buf, v_buf = randn(pool, a.kv_heads, a.head_dim), randn(pool, a.kv_heads, a.head_dim)
    kv_indptr = torch.arange(0, bs * n + 1, n, dtype=torch.int32, device=dev)
    kv_indices = (torch.randperm(pool - 1, generator=g) + 1).to(torch.int64).to(dev)  # scattered, as in use
    if a.graph_splits:  # a graph's kv_indices: its whole buffer, past what kv_indptr reaches
        kv_indices = torch.cat([kv_indices, torch.zeros(bs * GRAPH_PREFIX, dtype=torch.int64, device=dev)])
    qo_indptr = torch.arange(0, bs * w + 1, w, dtype=torch.int32, device=dev)
    q = randn(bs * w, a.heads, a.head_dim)
    k, v = randn(bs * w, a.kv_heads, a.head_dim), randn(bs * w, a.kv_heads, a.head_dim)
    o_prefill, o_split = torch.zeros_like(q), torch.zeros_like(q)
    scale = a.head_dim ** -0.5

    def prefill() -> None:
        extend_attention_fwd(q, k, v, o_prefill, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, None,
                             True, None, w, 1.0, 1.0, scale)

    def split(out: Any = o_split) -> bool:
        return bool(verify_splitkv_fwd(q, k, v, out, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, None,
                                       True, None, w, 1.0, 1.0, scale, max_bs=bs))

    def split_with(switches: dict[verify_switch.ProcessSwitch, bool], out: Any) -> bool:
        """The split-KV kernel with some of the plugin's verify switches set, then set back."""
        was = {switch: switch.on() for switch in switches}
        for switch, on in switches.items():
            switch.set(on)
        try:
            return split(out)
        finally:
            for switch, on in was.items():
                switch.set(on)

    o_head, o_looped, o_load, o_up = (torch.zeros_like(q) for _ in range(4))
    # upstream's prefix stage; upstream's combine; the looped combine; it with the prefix cut by
    # the batch's size
    headwise = functools.partial(split_with, {verify_switch.GROUPED: False}, o_head)
    upstream_combine = functools.partial(split_with, {verify_switch.LOOPED: False}, o_up)
    looped = functools.partial(split_with, {verify_switch.LOOPED: True, verify_switch.SPLITS_BY_LOAD: False}, o_looped)
    by_load = functools.partial(split_with, {verify_switch.LOOPED: True, verify_switch.SPLITS_BY_LOAD: True}, o_load)

    decode, folded, o_folded = _decode_kernel_paths(case, a, q, k, v, k_buf, v_buf, kv_indptr, kv_indices, scale)

    timed = _timer(dev)
    prefill()
    ran = split()  # also the warm-up (Triton compiles on first use)
    headwise()
    upstream_combine()
    looped()
    by_load()
    decode()
    if folded is not None:
        folded()
    prefill_ms = timed(prefill, a.repeats)
    decode_ms = round(timed(decode, a.repeats), 4)
    folded_ms = None if folded is None else round(timed(folded, a.repeats), 4)
    outs = [("prefill", o_prefill)] + ([("folded decode", o_folded)] if folded is not None else []) + (
        [("split-KV", o_split), ("per-head split-KV", o_head), ("looped-combine split-KV", o_looped),
         ("splits-by-load split-KV", o_load), ("upstream-combine split-KV", o_up)] if ran else [])
    for name, out in outs:
        if nans := int(torch.isnan(out).sum()):
            raise RuntimeError(f"the {name} kernel gave NaN in {nans} of {out.numel()} values at {case}")
        if not out.abs().max().item() > 0:  # equal outputs must not be two untouched buffers
            raise RuntimeError(f"the {name} kernel wrote no output at {case}")
    folded_diff = None if folded is None else round((o_prefill.float() - o_folded.float()).abs().max().item(), 6)
    if not ran:
        return Timing(case, round(prefill_ms, 4), None, None, decode_ms=decode_ms, folded_ms=folded_ms,
                      folded_diff=folded_diff)
    split_ms, headwise_ms, looped_ms = timed(split, a.repeats), timed(headwise, a.repeats), timed(looped, a.repeats)
    by_load_ms, upstream_combine_ms = timed(by_load, a.repeats), timed(upstream_combine, a.repeats)
    from sglang.kernels.ops.attention.verify_splitkv import choose_n_splits

    splits = choose_n_splits(kv_indices.shape[0] / bs)  # what verify_splitkv_fwd derived
    cores = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 0
    by_load_splits = (verify_switch.prefix_parts(bs, a.kv_heads, splits, cores, n)
                      if cores and verify_switch.grouped_grid_fills(bs, a.kv_heads, splits, cores) else None)
    diff = (o_prefill.float() - o_split.float()).abs().max().item()
    headwise_diff = round((o_prefill.float() - o_head.float()).abs().max().item(), 6)
    tiles = []
    for block_n, warps in a.grouped_tiles:
        o_tile = torch.zeros_like(q)
        verify_switch.set_grouped_tile((block_n, warps))
        verify_switch.set_grouped_min_programs(0)  # the stage itself, where a server would not run it too
        try:
            split(o_tile)  # a tile compiles on first use
            tile_ms = timed(functools.partial(split, o_tile), a.repeats)
        finally:
            verify_switch.set_grouped_tile(None)
            verify_switch.set_grouped_min_programs(None)
        tiles.append((f"{block_n}x{warps}", round(tile_ms, 4),
                      round((o_prefill.float() - o_tile.float()).abs().max().item(), 6)))
    swept = []
    rules = [(f"{p} a core", p, None) for p in a.split_programs] + [(f"{t} tokens", None, t) for t in a.split_tokens]
    for label, per_core, tokens in rules:
        o_swept = torch.zeros_like(q)
        verify_switch.set_split_programs(per_core)
        verify_switch.set_split_tokens(tokens)
        try:
            split_with({verify_switch.LOOPED: True, verify_switch.SPLITS_BY_LOAD: True}, o_swept)
            swept_ms = timed(functools.partial(
                split_with, {verify_switch.LOOPED: True, verify_switch.SPLITS_BY_LOAD: True}, o_swept), a.repeats)
            parts = (verify_switch.prefix_parts(bs, a.kv_heads, splits, cores, n)
                     if cores and verify_switch.grouped_grid_fills(bs, a.kv_heads, splits, cores) else None)
        finally:
            verify_switch.set_split_programs(None)
            verify_switch.set_split_tokens(None)
        swept.append((label, parts, round(swept_ms, 4),
                      round((o_prefill.float() - o_swept.float()).abs().max().item(), 6)))
    return Timing(case, round(prefill_ms, 4), round(split_ms, 4), round(diff, 6), decode_ms=decode_ms,
                  folded_ms=folded_ms, folded_diff=folded_diff,
                  headwise_ms=round(headwise_ms, 4), headwise_diff=headwise_diff, tiles=tuple(tiles),
                  looped_ms=round(looped_ms, 4),
                  looped_diff=round((o_prefill.float() - o_looped.float()).abs().max().item(), 6), splits=splits,
                  by_load_ms=round(by_load_ms, 4), by_load_splits=by_load_splits,
                  upstream_combine_ms=round(upstream_combine_ms, 4), split_rules=tuple(swept),
                  upstream_combine_diff=round((o_prefill.float() - o_up.float()).abs().max().item(), 6),
                  by_load_diff=round((o_prefill.float() - o_load.float()).abs().max().item(), 6))


def foldable(width: int, group: int) -> bool:
    """Whether upstream's grouped decode kernel computes a verify folded into the query-head group:
    it maps each tile of DECODE_HEAD_TILE query heads to one KV head, so a folded group (its query
    heads x verified tokens) must fit one tile or fill whole tiles."""
    rows = width * group
    return rows <= DECODE_HEAD_TILE or rows % DECODE_HEAD_TILE == 0


def _decode_kernel_paths(case: Case, a: argparse.Namespace, q: Any, k: Any, v: Any, k_buf: Any, v_buf: Any,
                         kv_indptr: Any, kv_indices: Any, scale: float) -> tuple[Callable[[], None],
                                                                                 Callable[[], None] | None, Any]:
    """`decode` (one query a request over the prefix) and `folded` (the verify through the same
    kernel; None without --folded or where the folded group does not fit the kernel's head tile),
    and the buffer `folded` writes its output into, laid out as the prefill kernel's."""
    import torch
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.kernels.ops.attention.merge_state import merge_state_triton
    from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

    bs, w, dev = case.batch, case.width, a.device
    heads, kv_heads, dim = a.heads, a.kv_heads, a.head_dim
    group = heads // kv_heads
    cores = torch.cuda.get_device_properties(dev).multi_processor_count if dev.startswith("cuda") else 8
    seq_lens = torch.full((bs,), case.context, dtype=torch.int32, device=dev)

    def kernel_args(n_heads: int) -> tuple[Any, Any, Any]:
        """The decode kernel's scratch for n_heads query heads a request, and its KV splits as the
        Triton backend sets them (metadata.get_num_kv_splits_triton)."""
        splits = torch.empty(bs, dtype=torch.int32, device=dev)
        get_num_kv_splits_triton[(1,)](splits, seq_lens, bs, 1, n_heads, kv_heads, a.kv_splits, cores,
                                       MAX_NUM_SEQ=max(256, 1 << (bs - 1).bit_length()))
        logits = torch.empty(bs, n_heads, a.kv_splits, dim, dtype=torch.float32, device=dev)
        lse = torch.empty(bs, n_heads, a.kv_splits, dtype=torch.float32, device=dev)
        return splits, logits, lse

    q_one = q.view(bs, w, heads, dim)[:, -1].contiguous()  # a plain step's one query a request
    o_one = torch.empty_like(q_one)
    one = kernel_args(heads)

    def decode() -> None:
        decode_attention_fwd(q_one, k_buf, v_buf, o_one, kv_indptr, kv_indices, one[1], one[2], one[0],
                             a.kv_splits, scale, 1.0, 1.0)

    # the w queries of a request as w x group heads of each KV head: [bs, kv_heads * w * group, dim]
    q_fold = q.view(bs, w, kv_heads, group, dim).permute(0, 2, 1, 3, 4).reshape(bs, kv_heads * w * group, dim)
    o_fold = torch.empty_like(q_fold)
    fold = kernel_args(kv_heads * w * group)
    chain = torch.ones(w, w, dtype=torch.bool, device=dev).tril()
    out = torch.empty_like(q)
    if not a.folded or not foldable(w, group):
        return decode, None, out

    def folded() -> None:
        fold[2].fill_(-float("inf"))  # splits a request does not reach stay out of the sum
        decode_attention_fwd(q_fold, k_buf, v_buf, o_fold, kv_indptr, kv_indices, fold[1], fold[2], fold[0],
                             a.kv_splits, scale, 1.0, 1.0)
        lse_prefix = torch.logsumexp(fold[2], dim=-1).view(bs, kv_heads, w, group).permute(0, 2, 1, 3)
        o_prefix = o_fold.view(bs, kv_heads, w, group, dim).permute(0, 2, 1, 3, 4).float()
        # the chain's own tokens: query i sees verified tokens 0..i
        qc = q.view(bs, w, kv_heads, group, dim).float()
        kc, vc = k.view(bs, w, kv_heads, dim).float(), v.view(bs, w, kv_heads, dim).float()
        s = torch.einsum("bikgd,bjkd->bkgij", qc, kc) * scale
        s = s.masked_fill(~chain, -float("inf"))
        lse_chain = torch.logsumexp(s, dim=-1).permute(0, 3, 1, 2)  # [bs, w, kv_heads, group]
        o_chain = torch.einsum("bkgij,bjkd->bikgd", torch.softmax(s, dim=-1), vc)
        merged, _ = merge_state_triton(o_prefix.reshape(bs * w, heads, dim), lse_prefix.reshape(bs * w, heads),
                                       o_chain.reshape(bs * w, heads, dim), lse_chain.reshape(bs * w, heads))
        out.copy_(merged)

    return decode, folded, out


def table(rows: list[Timing], layers: int) -> str:
    lines = [("| batch | context | width | prefill kernel ms | split-KV ms | speed-up | "
              f"per step, {layers} layers: prefill / split-KV ms | largest difference | "
              f"per-head split-KV ms | per step ms | its difference | "
              f"decode ms (one query) | folded decode ms | per step: decode / folded ms | folded's difference |"),
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def ms(x: float | None, digits: int = 3) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    def diff(x: float | None) -> str:
        return "-" if x is None else f"{x:g}"

    for r in rows:
        c = r.case
        head = (f" {ms(r.headwise_ms)} | {ms(r.headwise_ms and r.headwise_ms * layers, 2)} | "
                f"{diff(r.headwise_diff)} |")
        tail = (f" {ms(r.decode_ms)} | {ms(r.folded_ms)} | "
                f"{ms(r.decode_ms and r.decode_ms * layers, 2)} / {ms(r.folded_ms and r.folded_ms * layers, 2)} | "
                f"{diff(r.folded_diff)} |")
        if r.splitkv_ms is None:
            lines.append(f"| {c.batch} | {c.context} | {c.width} | {r.prefill_ms:.3f} | refused | - | "
                         f"{r.prefill_ms * layers:.2f} / - | - |" + head + tail)
            continue
        lines.append(f"| {c.batch} | {c.context} | {c.width} | {r.prefill_ms:.3f} | {r.splitkv_ms:.3f} | "
                     f"{r.speedup:.2f}x | {r.prefill_ms * layers:.2f} / {r.splitkv_ms * layers:.2f} | {r.max_diff:g} |"
                     + head + tail)
    if any(r.looped_ms is not None for r in rows):
        lines += ["", ("The split-KV verify with the plugin's looped combine stage "
                       "(SGLANG_IMAGE_LOOPED_COMBINE=1), ms, against the same kernel with upstream's combine, and "
                       "with the prefix also cut by "
                       "the batch's size (SGLANG_IMAGE_VERIFY_SPLITS_BY_LOAD=1; its parts, - where upstream's "
                       "prefix stage runs):"), "",
                  ("| batch | context | width | splits | upstream combine ms | looped combine ms | speed-up | "
                   f"per step, {layers} layers: upstream / looped ms | its difference | "
                   "splits by load ms (parts) | per step ms | its difference |"),
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r.case.batch} | {r.case.context} | {r.case.width} | {r.splits} | {ms(r.upstream_combine_ms)} | "
                  f"{ms(r.looped_ms)} | {r.upstream_combine_ms / r.looped_ms:.2f}x | "
                  f"{ms(r.upstream_combine_ms * layers, 2)} / {ms(r.looped_ms * layers, 2)} | {diff(r.looped_diff)} | "
                  f"{ms(r.by_load_ms)} ({r.by_load_splits or '-'}) | {ms(r.by_load_ms and r.by_load_ms * layers, 2)} | "
                  f"{diff(r.by_load_diff)} |"
                  for r in rows if r.looped_ms and r.upstream_combine_ms]
    if any(r.split_rules for r in rows):
        labels = [label for label, _, _, _ in next(r.split_rules for r in rows if r.split_rules)]
        lines += ["", ("The looped combine with the prefix cut by the batch's size, at each number of programs a "
                       "multiprocessor is given (--split-programs) and each longest part (--split-tokens), ms "
                       "(the parts a prefix was cut into; - where upstream's prefix stage runs):"), "",
                  "| batch | context | width | 16 splits ms | " + " | ".join(labels) + " |",
                  "|---:|---:|---:|---:|" + "---:|" * len(labels)]
        lines += [f"| {r.case.batch} | {r.case.context} | {r.case.width} | {ms(r.looped_ms)} | "
                  + " | ".join(f"{t:.3f} ({parts or '-'})" for _, parts, t, _ in r.split_rules) + " |"
                  for r in rows if r.split_rules]
    if any(r.tiles for r in rows):
        labels = [label for label, _, _ in next(r.tiles for r in rows if r.tiles)]
        lines += ["", "The plugin's grouped prefix stage by tile (BLOCK_N x warps), the whole split-KV verify, ms:", "",
                  "| batch | context | width | " + " | ".join(labels) + " |",
                  "|---:|---:|---:|" + "---:|" * len(labels)]
        lines += [f"| {r.case.batch} | {r.case.context} | {r.case.width} | "
                  + " | ".join(f"{ms} ({d:g})" for _, ms, d in r.tiles) + " |" for r in rows if r.tiles]
    return "\n".join(lines) + "\n"


def main(a: argparse.Namespace) -> int:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # the kernels as a server of the image runs them (verify_attention's hooks)
    rows = [measure(Case(b, n, w), a) for b in a.batch for n in a.context for w in a.width]
    text = (f"EAGLE verify attention, one layer: {a.heads} query heads, {a.kv_heads} KV heads, head dim "
            f"{a.head_dim}, {a.dtype} on {a.device}; median of {a.repeats} runs\n\n" + table(rows, a.layers))
    print(text, end="", flush=True)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "verify_kernel.md").write_text(text)
        (a.out / "verify_kernel.json").write_text(json.dumps(
            [{**asdict(r.case), **{k: x for k, x in asdict(r).items() if k != "case"}} for r in rows], indent=1) + "\n")
    bad = [(r, name, diff) for r in rows
           for name, diff in (("split-KV", r.max_diff), ("per-head split-KV", r.headwise_diff),
                              ("looped-combine split-KV", r.looped_diff),
                              ("splits-by-load split-KV", r.by_load_diff),
                              ("upstream-combine split-KV", r.upstream_combine_diff),
                              ("folded decode", r.folded_diff),
                              *((f"split-KV at tile {label}", d) for label, _, d in r.tiles),
                              *((f"splits by load at {label}", d) for label, _, _, d in r.split_rules))
           if diff is not None and diff > a.tolerance]
    for r, name, diff in bad:
        print(f"FAILED: batch {r.case.batch}, context {r.case.context}, width {r.case.width}: the {name} and "
              f"prefill kernels' outputs differ by {diff:g}, more than --tolerance {a.tolerance:g}", flush=True)
    return 1 if bad else 0
