"""The split-KV verify attention on NVIDIA GPUs (plugin/sglang_image_plugin/verify_attention.py),
against the real sglang 0.5.23 wheel on a CPU: the start-up hook is applied, it turns upstream's
switch on for a top-k 1 chain unless it is turned off, and upstream's own Triton backend then
routes a target verify to the split-KV kernel instead of the prefill kernel. The kernels run in Triton's
interpreter (TRITON_INTERPRET=1) in float32: the interpreter computes bfloat16 wrongly."""
from __future__ import annotations

import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sglang_image_plugin import verify_attention, verify_switch
from sglang_image_plugin.setting import (
    GROUPED_VERIFY_ENV,
    LOOPED_COMBINE_ENV,
    SPLITKV_VERIFY_ENV,
    SPLITS_BY_LOAD_ENV,
)
from tests.probe import probe_result

FLAVOR = "sglang-0.5.23"


# upstream's EnvBool: unset is its default (on); false values turn it off; a value it cannot read
# leaves the default, with upstream's warning
@pytest.mark.parametrize(("value", "asked"), [(None, True), ("1", True), ("true", True), ("Y", True),
                                              ("0", False), ("false", False), ("No", False), ("n", False),
                                              ("maybe", True)])
def test_only_a_false_switch_turns_it_off(value: str | None, asked: bool) -> None:
    env = {} if value is None else {SPLITKV_VERIFY_ENV: value}
    assert verify_attention.asked_for(env) is asked


# the grouped prefix stage's switch, read the same way (verify_switch.py)
@pytest.mark.parametrize(("value", "asked"), [(None, True), ("1", True), ("0", False), ("False", False),
                                              ("n", False), ("maybe", True)])
def test_only_a_false_value_turns_the_grouped_prefix_stage_off(value: str | None, asked: bool) -> None:
    env = {} if value is None else {GROUPED_VERIFY_ENV: value}
    assert verify_switch.grouped_asked_for(env) is asked


# the grouped stage runs where its grid has a program for every multiprocessor (132 on an H100);
# with no GPU (Triton's interpreter, 0) any grid
@pytest.mark.parametrize(("bs", "kv_heads", "splits", "cores", "fills"),
                         [(4, 8, 4, 132, False), (5, 8, 4, 132, True), (1, 8, 16, 132, False),
                          (1, 8, 16, 128, True), (1, 1, 4, 0, True)])
def test_the_grouped_stage_runs_where_its_grid_fills_the_gpu(bs: int, kv_heads: int, splits: int, cores: int,
                                                             fills: bool) -> None:
    assert verify_attention.grouped_grid_fills(bs, kv_heads, splits, cores) is fills


# What both probes compare with: chain attention in float64, every verified token attending to its
# request's prefix and to the chain up to itself (GQA: query head h reads KV head h // group).
REFERENCE = textwrap.dedent("""
    import json
    import torch

    def emit(obj):
        print("RESULT " + json.dumps(obj), flush=True)

    def chain_reference(q, k, v, kb, vb, kv_indptr, kv_indices, width):
        hkv, d = kb.shape[1], kb.shape[2]
        qs = q.view(-1, q.numel() // (q.shape[0] * d), d)
        bs, hq = qs.shape[0] // width, qs.shape[1]
        ref = torch.zeros(bs * width, hq, d, dtype=torch.float64)
        for b in range(bs):
            idx = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
            for i in range(width):
                r = b * width + i
                for h in range(hq):
                    g = h // (hq // hkv)
                    keys = torch.cat([kb[idx, g], k[b * width:r + 1, g]]).double()
                    vals = torch.cat([vb[idx, g], v[b * width:r + 1, g]]).double()
                    ref[r, h] = torch.softmax(keys @ qs[r, h].double() * d ** -0.5, 0) @ vals
        return ref

    def splitkv_verify(hq, hkv, width, prefix, seed, graph_splits=False, d=16):
        # upstream's split-KV verify on random inputs: [its largest difference from chain_reference,
        # its split count, the splits its longest request's prefix filled], or the message of a
        # stage that raised
        import sglang.kernels.ops.attention.verify_splitkv as vs
        torch.manual_seed(seed)
        bs, pool = len(prefix), sum(prefix) + 8
        kb, vb = torch.randn(pool, hkv, d), torch.randn(pool, hkv, d)
        kv_indptr = torch.tensor([0, *torch.tensor(prefix).cumsum(0).tolist()], dtype=torch.int32)
        kv_indices = torch.randperm(pool)[:sum(prefix)].to(torch.int64)
        if graph_splits:  # a CUDA graph's kv_indices: the whole buffer, so upstream's 16 splits
            kv_indices = torch.cat([kv_indices, torch.zeros(bs * 8192, dtype=torch.int64)])
        qo_indptr = torch.arange(0, bs * width + 1, width, dtype=torch.int32)
        q, k, v = torch.randn(bs * width, hq, d), torch.randn(bs * width, hkv, d), torch.randn(bs * width, hkv, d)
        vs._VK_CACHE.clear()
        out = torch.zeros_like(q)
        try:
            assert vs.verify_splitkv_fwd(q, k, v, out, kb, vb, qo_indptr, kv_indptr, kv_indices, None, True,
                                         None, width, 1.0, 1.0, d ** -0.5, max_bs=bs)
        except RuntimeError as exc:
            return str(exc)
        vk = next(iter(vs._VK_CACHE.values()))
        filled = int(vk.att_lse[max(range(bs), key=lambda i: prefix[i]), 0, :, 0].isfinite().sum())
        return [(out.double() - chain_reference(q, k, v, kb, vb, kv_indptr, kv_indices, width)).abs().max().item(),
                vk.n_splits, filled]
""")


def run_probe(run_in_tree: Callable[..., subprocess.CompletedProcess[str]],
              sglang_tree: Callable[[str, bool], Path], plugin_site: Path,
              probe: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """The probe in its own process on the real 0.5.23 wheel with the plugin installed, the kernels
    in Triton's interpreter: its RESULT and the process."""
    tree = sglang_tree(FLAVOR, False)
    proc = run_in_tree(tree, REFERENCE + probe,
                       env={"PYTHONPATH": f"{plugin_site}:{tree}", "TRITON_INTERPRET": "1"}, timeout=900)
    return probe_result(proc), proc


PROBE = textwrap.dedent("""
    import json, logging, os, sys
    from types import SimpleNamespace as NS
    import torch
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(message)s")
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.kernels.ops.attention.verify_splitkv import verify_splitkv_fwd
    from sglang_image_plugin import registry, verify_attention

    def after_init(topk, gfx95=False):
        # what upstream's __init__ leaves on a GPU that is not gfx95 (its gate), then our hook
        b = object.__new__(TritonAttnBackend)
        b.topk, b.use_verify_splitkv = topk, gfx95
        verify_attention.triton_backend_init(None, b)
        return b

    torch.manual_seed(0)
    bs, hq, hkv, d, width, prefix = 3, 4, 2, 16, 4, [5, 37, 70]
    pool = 160
    kb, vb = torch.randn(pool, hkv, d), torch.randn(pool, hkv, d)
    kv_indptr = torch.tensor([0, *torch.tensor(prefix).cumsum(0).tolist()], dtype=torch.int32)
    kv_indices = torch.randperm(pool)[:sum(prefix)].to(torch.int64)
    q = torch.randn(bs * width, hq * d)
    k, v = torch.randn(bs * width, hkv, d), torch.randn(bs * width, hkv, d)

    def verify(backend):
        called = []
        def prefill_kernel(*args, **kwargs):
            called.append("prefill")
        backend.extend_attention_fwd = prefill_kernel
        backend.verify_splitkv_fwd = verify_splitkv_fwd
        backend.use_verify_shared_kv, backend.dcp_size, backend.enable_deterministic = False, 1, False
        backend.dllm_attention, backend.page_size = None, 1
        backend._can_run_dense_fp8_chunked_mha = lambda *a: False
        backend.req_to_token_pool = NS(size=8)
        backend.token_to_kv_pool = NS(get_key_buffer=lambda i: kb, get_value_buffer=lambda i: vb)
        backend.forward_metadata = NS(qo_indptr=torch.arange(0, bs * width + 1, width, dtype=torch.int32),
                                      kv_indptr=kv_indptr, kv_indices=kv_indices, custom_mask=None,
                                      mask_indptr=None, max_extend_len=width)
        layer = NS(qk_head_dim=d, v_head_dim=d, tp_q_head_num=hq, logit_capping_method="tanh", logit_cap=0.0,
                   is_cross_attention=False, attn_type=AttentionType.DECODER, sliding_window_size=-1,
                   k_scale=None, v_scale=None, scaling=d ** -0.5, layer_id=0, xai_temperature_len=-1)
        batch = NS(forward_mode=ForwardMode.TARGET_VERIFY, mha_one_shot=False, extend_seq_lens_cpu=None)
        out = backend.forward_extend(q, k, v, layer, batch, save_kv_cache=False)
        return called, out.view(-1, hq, d)

    os.environ.pop("SGLANG_ENABLE_SPLITKV_VERIFY", None)
    off = after_init(1)
    os.environ["SGLANG_ENABLE_SPLITKV_VERIFY"] = "0"
    zero = after_init(1)
    os.environ["SGLANG_ENABLE_SPLITKV_VERIFY"] = "1"
    on, tree, gfx95 = after_init(1), after_init(3), after_init(1, gfx95=True)
    called_off, _ = verify(zero)
    called_on, out = verify(on)
    emit({"hooked": registry.wraps_hook(TritonAttnBackend.__init__, verify_attention.triton_backend_init),
          "switch": [off.use_verify_splitkv, zero.use_verify_splitkv, on.use_verify_splitkv,
                     tree.use_verify_splitkv, gfx95.use_verify_splitkv],
          "called_off": called_off, "called_on": called_on,
          "max_err": (out.double() - chain_reference(q, k, v, kb, vb, kv_indptr, kv_indices, width)).abs().max().item()})
""")


def test_a_chain_verify_runs_the_split_kv_kernel_unless_turned_off(
        run_in_tree: Callable[..., subprocess.CompletedProcess[str]],
        sglang_tree: Callable[[str, bool], Path], plugin_site: Path) -> None:
    out, proc = run_probe(run_in_tree, sglang_tree, plugin_site, PROBE)
    assert out["hooked"] is True
    # unset, 1: on for a chain, not for a tree; 0: upstream's choice (off here); gfx95 keeps upstream's
    assert out["switch"] == [True, False, True, False, True]
    assert out["called_off"] == ["prefill"]  # turned off, upstream takes the prefill kernel
    assert out["called_on"] == [] and out["max_err"] < 1e-4  # with it the split-KV kernel, exact
    assert proc.stdout.count("LOG EAGLE verify attention: split-KV kernel") == 1


SCRATCH_PROBE = textwrap.dedent("""
    import types
    import torch
    import sglang.kernels.ops.attention.verify_splitkv as vs

    # an allocation that holds NaN, as reused memory may: the kernel's scratch only
    garbage = types.SimpleNamespace(**{n: getattr(torch, n) for n in dir(torch) if not n.startswith("__")})
    garbage.empty = lambda *shape, **kw: torch.full(*shape, float("nan"), **kw)
    vs.torch = garbage

    torch.manual_seed(0)
    bs, hq, hkv, d, width, prefix = 2, 4, 2, 16, 4, [40, 70]  # under 97 tokens: splits skipped
    kb, vb = torch.randn(128, hkv, d), torch.randn(128, hkv, d)
    kv_indptr = torch.tensor([0, 40, 110], dtype=torch.int32)
    kv_indices = torch.randperm(128)[:110].to(torch.int64)
    qo_indptr = torch.arange(0, bs * width + 1, width, dtype=torch.int32)
    q, k, v = torch.randn(bs * width, hq, d), torch.randn(bs * width, hkv, d), torch.randn(bs * width, hkv, d)

    def verify():
        vs._VK_CACHE.clear()  # a new server's first verify allocates the scratch
        out = torch.zeros_like(q)
        assert vs.verify_splitkv_fwd(q, k, v, out, kb, vb, qo_indptr, kv_indptr, kv_indices, None, True,
                                     None, width, 1.0, 1.0, d ** -0.5, max_bs=bs)
        return out

    upstream = verify()
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang_image_plugin import registry, verify_attention
    hooked = verify()
    emit({"hooked": registry.wraps_hook(vs.VerifySplitKV._alloc, verify_attention.zero_scratch),
          "nan_upstream": int(torch.isnan(upstream).sum()), "nan_hooked": int(torch.isnan(hooked).sum()),
          "max_err": (hooked.double() - chain_reference(q, k, v, kb, vb, kv_indptr, kv_indices, width)).abs().max().item()})
""")


def test_the_split_kv_verify_never_weighs_an_allocation_s_nan(
        run_in_tree: Callable[..., subprocess.CompletedProcess[str]],
        sglang_tree: Callable[[str, bool], Path], plugin_site: Path) -> None:
    # Triton's interpreter gave NaN in about every other run of `bench verify-kernel` at width 3:
    # the skipped splits' partial outputs are weighted by 0, and 0 x NaN is NaN
    out, _ = run_probe(run_in_tree, sglang_tree, plugin_site, SCRATCH_PROBE)
    assert out["nan_upstream"] > 0  # upstream alone, on NaN-holding memory
    assert out["hooked"] is True
    assert out["nan_hooked"] == 0 and out["max_err"] < 1e-4


GROUPED_PROBE = textwrap.dedent("""
    import logging, sys
    import torch
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(message)s")
    import sglang.kernels.ops.attention.verify_splitkv as vs
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang_image_plugin import registry, verify_attention, verify_switch

    upstream_stage = vs._verify_prefix_stage1
    class Refused:  # upstream's per-query-head stage, made to fail wherever it still runs
        def __getitem__(self, grid):
            raise RuntimeError("upstream's per-head prefix stage ran")

    def verify(hq, hkv, width, prefix):
        result = splitkv_verify(hq, hkv, width, prefix, seed=hq * 100 + width)
        return result if isinstance(result, str) else result[0]

    vs._verify_prefix_stage1 = Refused()
    # group 4 (the 8B shape's) at widths 4 and 3 (a padded token row); group 3 (padded heads);
    # group 1; prefixes that skip splits (under 97 tokens) and one that fills them
    shapes = [(8, 2, 4, [5, 37, 130]), (8, 2, 3, [64, 9]), (6, 2, 4, [40, 100]), (2, 2, 2, [33])]
    grouped = [verify(*s) for s in shapes]
    wide = verify(32, 2, 8, [20])  # 16 heads x 8 tokens: past MAX_GROUPED_ROWS, upstream's stage
    verify_switch.set_grouped_min_programs(25)  # 3 requests x 2 KV heads x 4 splits = 24 programs: too few
    small = verify(8, 2, 4, [5, 37, 130])
    verify_switch.set_grouped_min_programs(24)
    fills = verify(8, 2, 4, [5, 37, 130])
    verify_switch.set_grouped_min_programs(None)  # no GPU here: any grid runs
    verify_switch.set_grouped_prefix(False)
    off = verify(8, 2, 4, [5, 37, 130])
    vs._verify_prefix_stage1 = upstream_stage
    upstream = verify(8, 2, 4, [5, 37, 130])
    emit({"hooked": registry.wraps_hook(vs.VerifySplitKV._run_prefix_kernel, verify_attention.grouped_prefix),
          "grouped": grouped, "wide": wide, "small": small, "fills": fills, "off": off, "upstream": upstream})
""")


def test_the_split_kv_verify_reads_each_kv_head_once_for_its_query_heads(
        run_in_tree: Callable[..., subprocess.CompletedProcess[str]],
        sglang_tree: Callable[[str, bool], Path], plugin_site: Path) -> None:
    # upstream's prefix stage is made to fail: the verify still runs, through the grouped stage,
    # and equals chain attention; turned off (or a tile too wide) upstream's stage runs again
    out, proc = run_probe(run_in_tree, sglang_tree, plugin_site, GROUPED_PROBE)
    assert out["hooked"] is True
    assert all(isinstance(err, float) and err < 1e-4 for err in out["grouped"]), out["grouped"]
    assert out["wide"] == out["off"] == out["small"] == "upstream's per-head prefix stage ran"
    assert isinstance(out["fills"], float) and out["fills"] < 1e-4
    assert isinstance(out["upstream"], float) and out["upstream"] < 1e-4
    assert proc.stdout.count("LOG EAGLE verify attention: the prefix stage reads each KV head once") == 1


COMBINE_PROBE = textwrap.dedent("""
    import logging, os, sys
    import torch
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(message)s")
    import sglang.kernels.ops.attention.verify_splitkv as vs
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang_image_plugin import registry, verify_attention, verify_switch

    upstream_combine = vs._verify_combine_stage2
    class Refused:  # upstream's second stage, made to fail wherever it still runs
        def __getitem__(self, grid):
            raise RuntimeError("upstream's combine stage ran")

    def verify(hq, hkv, width, prefix, graph_splits=False):
        return splitkv_verify(hq, hkv, width, prefix, seed=hq * 100 + width + len(prefix), graph_splits=graph_splits)

    vs._verify_combine_stage2 = Refused()
    verify_switch.set_looped_combine(None)
    os.environ.pop("SGLANG_IMAGE_LOOPED_COMBINE", None)
    default = verify(8, 2, 4, [5, 37, 130])  # off unless asked for
    os.environ["SGLANG_IMAGE_LOOPED_COMBINE"] = "1"
    verify_switch.set_looped_combine(None)  # read the environment again
    # widths 4, 3 (a padded token row), 6 (L_EXT 8) and 2; groups 4, 3 and 1; 4 and 16 splits;
    # prefixes that skip splits and one that fills them
    shapes = [(8, 2, 4, [5, 37, 130]), (8, 2, 3, [64, 9]), (8, 2, 6, [40, 100], True), (6, 2, 4, [40, 100]),
              (2, 2, 2, [33], True), (8, 2, 4, [5, 37, 130], True)]
    looped = [verify(*s) for s in shapes]
    verify_switch.set_looped_combine(False)
    off = verify(8, 2, 4, [5, 37, 130])
    vs._verify_combine_stage2 = upstream_combine
    upstream = verify(8, 2, 6, [40, 100], True)
    emit({"hooked": registry.wraps_hook(vs.VerifySplitKV._run_combine_kernel, verify_attention.looped_combine),
          "default": default, "looped": looped, "off": off, "upstream": upstream})
""")


def test_the_split_kv_verify_combines_its_splits_with_running_sums_where_asked_for(
        run_in_tree: Callable[..., subprocess.CompletedProcess[str]],
        sglang_tree: Callable[[str, bool], Path], plugin_site: Path) -> None:
    # upstream's second stage is made to fail: with SGLANG_IMAGE_LOOPED_COMBINE=1 the verify still
    # runs, through the looped stage, and equals chain attention, at 4 and at a CUDA graph's 16
    # splits and at a width whose padded tile is 8 tokens; unset or off, upstream's stage runs
    out, proc = run_probe(run_in_tree, sglang_tree, plugin_site, COMBINE_PROBE)
    assert out["hooked"] is True
    assert out["default"] == out["off"] == "upstream's combine stage ran"
    assert all(isinstance(r, list) and r[0] < 1e-4 for r in out["looped"]), out["looped"]
    assert [r[1] for r in out["looped"]] == [4, 4, 16, 4, 16, 16]
    assert isinstance(out["upstream"], list) and out["upstream"][0] < 1e-4 and out["upstream"][1] == 16
    assert proc.stdout.count("LOG EAGLE verify attention: the split combine runs one split") == 1


@pytest.mark.parametrize(("value", "asked"), [(None, False), ("1", True), ("true", True), ("Y", True),
                                              ("0", False), ("no", False), ("maybe", False)])
def test_only_a_true_value_turns_the_looped_combine_or_the_splits_by_load_on(
        value: str | None, asked: bool) -> None:
    env = {} if value is None else {LOOPED_COMBINE_ENV: value}
    assert verify_switch.looped_combine_asked_for(env) is asked
    env = {} if value is None else {SPLITS_BY_LOAD_ENV: value}
    assert verify_switch.SPLITS_BY_LOAD.asked_for(env) is asked


SPLITS_PROBE = textwrap.dedent("""
    import logging, os, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(message)s")
    import sglang.kernels.ops.attention.verify_splitkv as vs
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang_image_plugin import verify_switch

    class Refused:  # upstream's prefix stage, made to fail wherever it still runs
        def __getitem__(self, grid):
            raise RuntimeError("upstream's per-head prefix stage ran")
    vs._verify_prefix_stage1 = Refused()

    def verify(width, prefix, cores):
        # a CUDA graph's kv_indices, so 16 splits of scratch; `cores`: the GPU's multiprocessors
        verify_switch.set_grouped_min_programs(cores)
        return splitkv_verify(8, 2, width, prefix, seed=width + len(prefix), graph_splits=True)

    os.environ.pop("SGLANG_IMAGE_VERIFY_SPLITS_BY_LOAD", None)
    default = [verify(4, [40, 1024, 90], 6), verify(6, [384, 33], 6)]  # off unless asked for
    os.environ["SGLANG_IMAGE_VERIFY_SPLITS_BY_LOAD"] = "1"
    verify_switch.SPLITS_BY_LOAD.set(None)  # read the environment again
    # 3 requests x 2 KV heads on 6 multiprocessors: 4 splits; 2 requests: 6; on 1: 1 split; all
    # 16 where one request cannot give 30 multiprocessors 4 programs each
    by_load = [verify(4, [40, 1024, 90], 6), verify(6, [384, 33], 6), verify(4, [40, 1024, 90], 1),
               verify(3, [1024], 30)]
    verify_switch.set_split_tokens(256)  # no part longer than 256 tokens: the longest prefix in 4
    capped = verify(4, [40, 1024, 90], 1)
    verify_switch.set_split_tokens(None)
    emit({"default": default, "by_load": by_load, "capped": capped})
""")


def test_the_grouped_prefix_stage_splits_a_prefix_by_the_batch_s_size_where_asked_for(
        run_in_tree: Callable[..., subprocess.CompletedProcess[str]],
        sglang_tree: Callable[[str, bool], Path], plugin_site: Path) -> None:
    # a server's graph has 16 splits of scratch at every batch size; with
    # SGLANG_IMAGE_VERIFY_SPLITS_BY_LOAD=1 the grouped stage cuts the longest prefix into as many
    # parts as the rule gives for the batch's size, and the verify still equals chain attention
    # (the splits past them skipped by upstream's combine); unset, all 16
    out, proc = run_probe(run_in_tree, sglang_tree, plugin_site, SPLITS_PROBE)
    assert all(isinstance(r, list) and r[0] < 1e-4 for r in out["default"] + out["by_load"]), out
    assert [r[1:] for r in out["default"]] == [[16, 16], [16, 12]]  # 64 and 32 tokens a split
    assert [r[1:] for r in out["by_load"]] == [[16, 4], [16, 6], [16, 1], [16, 16]]
    assert out["capped"][0] < 1e-4 and out["capped"][1:] == [16, 4]
    assert proc.stdout.count("LOG EAGLE verify attention: the prefix stage splits a request's prefix") == 1


@pytest.mark.parametrize(("bs", "splits"), [(1, 16), (4, 16), (5, 14), (8, 9), (16, 5), (32, 3), (64, 2),
                                            (66, 1), (256, 1)])
def test_a_larger_batch_cuts_a_prefix_into_fewer_splits(bs: int, splits: int) -> None:
    # 8 KV heads on 132 multiprocessors (an H100): 4 programs a multiprocessor, at most 16 splits
    assert verify_switch.splits_by_load(bs, 8, 16, 132) == splits


def test_a_benchmark_may_give_a_multiprocessor_more_programs_and_so_cut_a_prefix_into_more_parts() -> None:
    verify_switch.set_split_programs(16)
    try:
        assert verify_switch.splits_by_load(64, 8, 16, 132) == 5  # 16 x 132 / (64 x 8) programs
    finally:
        verify_switch.set_split_programs(None)
    assert verify_switch.splits_by_load(64, 8, 16, 132) == 2
    # a long prefix gets parts of at most MAX_SPLIT_TOKENS
    assert verify_switch.prefix_parts(128, 8, 16, 132, 512) == 1
    assert verify_switch.prefix_parts(128, 8, 16, 132, 4096) == 4
    assert verify_switch.prefix_parts(1, 8, 16, 132, 512) == 16
    assert verify_switch.prefix_parts(128, 8, 16, 132, 1 << 20) == 16
