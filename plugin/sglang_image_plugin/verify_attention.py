"""The EAGLE verify's attention on NVIDIA GPUs through upstream's split-KV kernel.

With speculative top-k 1 the verify tree is a causal chain, and SGLang's Triton attention backend
can run it as split-KV (flash-decode) attention over each request's prefix
(sglang.kernels.ops.attention.verify_splitkv). Without it, the verify goes through the prefill
kernel, which walks every request's whole prefix serially, one program per request and head,
with a query tile of which only the d + 1 verified tokens are real: on the 8B shape its cost grows
with batch and context and not with draft depth, and it is most of the verify's excess over a
plain decode step at 32-128 requests. Upstream enables the split-KV path on AMD gfx95 only, under
its own switch SGLANG_ENABLE_SPLITKV_VERIFY (default on); this hook extends that gate to NVIDIA
GPUs, under the same switch read as upstream reads it: unset or true, on; "0", "false", "no" or
"n", off (the prefill kernel, upstream's choice on NVIDIA). Measured on the 8B shape, a server
with it decodes 1.04-1.41x faster than without from 1 to 128 requests, with outputs equal to plain
(docs/validation.md). The kernel refuses what it cannot compute as the prefill kernel does (ragged
verify widths, sliding windows, sinks, logit caps) and upstream then falls back, per call.

The kernel's first stage skips the prefix splits a request's length does not reach (each split
covers at least 32 tokens, so every request under 97 tokens has some) and writes only their -inf
log-sum-exp; the combine stage weights their partial outputs by exp(-inf) = 0. Those outputs lie
in a scratch buffer allocated with torch.empty, and 0 x NaN is NaN: where the allocation holds a
NaN or inf, the request's attention output is NaN. Triton's interpreter shows it on a CPU about
every other run; on a GPU it takes reused memory holding such a value, so it is rare, never seen
in our runs, and silent when it happens. zero_scratch clears the buffer once, when it is
allocated; the kernel writes only finite values into it after that.

Upstream's prefix stage runs a program per query head, so the query heads of a GQA group each read
their KV head's prefix: a verify reads the prefix's K/V `group` times where a plain decode step
reads it once, and that excess grows with batch and context. grouped_prefix runs the same stage
with one program per KV head (verify_prefix_kernel.py), into the same scratch, unless
SGLANG_IMAGE_GROUPED_VERIFY is 0 (upstream's stage then) or the group's tile would pass
MAX_GROUPED_ROWS rows (a wide group or verify: upstream's stage, whose tile is the verify's width),
or its grid would have fewer programs than the GPU has multiprocessors (a few requests with long
prefixes: upstream's stage has `group` times the programs there).

Upstream derives the split count from kv_indices' length over the batch size, and in a server's
CUDA graph kv_indices is the graph's whole buffer, so the count is its largest, 16, at every batch
size and context. Each split writes a float32 partial output of the verified tokens x head dim per
query head, which the second stage reads back: at 64 requests and short prefixes that is more
traffic than the prefix's K/V. verify_switch.splits_by_load, where
SGLANG_IMAGE_VERIFY_SPLITS_BY_LOAD=1 asks for it, has the grouped stage cut a prefix into only as
many parts as keep every multiprocessor verify_switch.SPLIT_PROGRAMS_PER_CORE programs busy at the
batch's size (16 for a few requests, 1 from 66 requests on a GPU of 132 multiprocessors and 8 KV
heads), and a long prefix into more, none longer than verify_switch.MAX_SPLIT_TOKENS: the batch
size is fixed in a graph and the prefix's length is read on the GPU, so the rule is safe to
capture, and the rest of the splits write only the -inf log-sum-exp that the second stage skips.
Off unless asked for: on one H100, before the cap on a part's length, it made a layer's verify at
a 512-token prefix 1.08-1.54x faster from 32 requests, but at 4,096 tokens from 9% slower to 19%
faster (docs/validation.md); the cap has not run on a GPU.

Upstream's second stage, one warp a request and query head, holds every split's partial output
at once; in a server's CUDA graph the split count is upstream's largest (16), as the graph's
kv_indices is the whole buffer, and that tile outgrows a warp's registers, twice over from a
verified width of 5. looped_combine runs the same stage with running sums
(verify_combine_kernel.py) where SGLANG_IMAGE_LOOPED_COMBINE=1 asks for it. On one H100 it takes a
layer's verify of 6 tokens a request at 64 requests from 0.46 to 0.20 ms, and always-on EAGLE-3
decodes 1.01-1.03x faster from 1 to 128 requests (docs/validation.md); off until proven at 256
requests on both schedulers.

sglang, torch and triton are imported inside the hooks only: they run in a process that has them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

from sglang_image_plugin import verify_switch
from sglang_image_plugin.setting import SPLITKV_VERIFY_ENV, SPLITKV_VERIFY_LOG_LINE
from sglang_image_plugin.verify_switch import (
    env_switch_on,
    grouped_grid_fills,
    grouped_prefix_on,
    looped_combine_on,
    splits_by_load,
)

logger = logging.getLogger(__name__)
_logged = False  # one line a process: a server builds a backend per depth state and for the draft
MAX_GROUPED_ROWS = 64  # query heads x verified tokens (both padded) one program of the grouped stage takes


def asked_for(environ: Mapping[str, str] | None = None) -> bool:
    """Upstream's switch as sglang.srt.environ reads it (EnvBool, default on): off only for a false
    value; upstream warns of a value it cannot read and keeps its default."""
    return env_switch_on(SPLITKV_VERIFY_ENV, environ)


@functools.cache
def on_rocm() -> bool:
    import torch

    return torch.version.hip is not None


def triton_backend_init(result: None, backend: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER TritonAttnBackend.__init__: the split-KV verify on where upstream left it off for a
    top-k 1 chain, the switch not turned off, and a GPU that is not AMD's (upstream decides there)."""
    global _logged
    if backend.use_verify_splitkv or getattr(backend, "topk", 0) != 1 or not asked_for() or on_rocm():
        return result
    backend.use_verify_splitkv = True
    if not _logged:
        _logged = True
        logger.info(SPLITKV_VERIFY_LOG_LINE.format(env=SPLITKV_VERIFY_ENV))
    return result


def zero_scratch(result: None, verify: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER VerifySplitKV._alloc: the partial-output scratch starts at zero, not as whatever the
    allocation held (see the module's docstring). Not while a CUDA graph is being captured: a
    memset captured there would run at every replay; the warm-up forward before the capture
    allocates the buffer first."""
    import torch

    scratch = verify.att_out
    if scratch.is_cuda and torch.cuda.is_current_stream_capturing():
        return result
    scratch.zero_()
    return result


@functools.cache
def multiprocessors(device: Any) -> int:
    """The GPU's streaming multiprocessors; 0 where there is no GPU (Triton's interpreter)."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def grouped_prefix(original: Any, verify: Any, bs: int, *args: Any, **kwargs: Any) -> Any:
    """AROUND VerifySplitKV._run_prefix_kernel: the prefix stage with one program per request, KV
    head and split (see the module's docstring), unless it is turned off, its tile too wide or its
    grid too small for the GPU."""
    import triton

    rows = triton.next_power_of_2(verify.group) * verify.l_pad
    # on AMD GPUs upstream's tuned stage stays
    if kwargs or rows > MAX_GROUPED_ROWS or on_rocm() or not grouped_prefix_on():
        return original(verify, bs, *args, **kwargs)
    least = verify_switch.grouped_min_programs
    cores = multiprocessors(args[0].device) if least is None else least
    if not grouped_grid_fills(bs, verify.h_kv, verify.n_splits, cores):
        return original(verify, bs, *args, **kwargs)
    from sglang_image_plugin import verify_prefix_kernel

    if verify_switch.SPLITS_BY_LOAD.on():
        active = splits_by_load(bs, verify.h_kv, verify.n_splits, cores or multiprocessors(args[0].device))
        verify_prefix_kernel.run(verify, bs, *args, active_splits=active,
                                 max_split_len=verify_switch.max_split_tokens())
    else:
        verify_prefix_kernel.run(verify, bs, *args)
    return None


def looped_combine(original: Any, verify: Any, bs: int, *args: Any, **kwargs: Any) -> Any:
    """AROUND VerifySplitKV._run_combine_kernel: the second stage with running sums, one split and
    one verified token at a time (verify_combine_kernel.py), where SGLANG_IMAGE_LOOPED_COMBINE asks
    for it; upstream's stage otherwise, and on AMD GPUs."""
    if kwargs or on_rocm() or not looped_combine_on():
        return original(verify, bs, *args, **kwargs)
    from sglang_image_plugin import verify_combine_kernel

    verify_combine_kernel.run(verify, bs, *args)
    return None
