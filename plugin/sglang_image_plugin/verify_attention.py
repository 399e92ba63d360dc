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

sglang and torch are imported inside the hook only: it runs in a process that has them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from sglang_image_plugin.setting import SPLITKV_VERIFY_ENV, SPLITKV_VERIFY_LOG_LINE

logger = logging.getLogger(__name__)
_FALSE = ("false", "0", "no", "n")  # upstream's EnvBool: its other values leave the default, on
_logged = False  # one line a process: a server builds a backend per depth state and for the draft


def asked_for(environ: Mapping[str, str] | None = None) -> bool:
    """Upstream's switch as sglang.srt.environ reads it (EnvBool, default on): off only for a false
    value; upstream warns of a value it cannot read and keeps its default."""
    value = (environ if environ is not None else os.environ).get(SPLITKV_VERIFY_ENV)
    return value is None or value.lower() not in _FALSE


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
