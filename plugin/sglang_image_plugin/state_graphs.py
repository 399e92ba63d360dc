"""The batch sizes at which each extra depth state captures its CUDA graphs.

Upstream's AdaptiveController.init_states asks its policy for the sizes each step count can run at
(`cuda_graph_bs_for_step`) and builds that state with them. In 0.5.23 it hands the policy the
legacy `--cuda-graph-bs-decode` (None unless set, so nothing is pruned) and
build_adaptive_runtime_state overrides only that legacy field, while the graph runners read
`cuda_graph_config.decode.bs`: every state captured graphs at every size, each depth costing the
KV pool the memory of the launch depth's graphs. Here the policy gets the sizes the runners read
and the state is built with its pruned list in their place. Drop this when upstream's
init_states reads cuda_graph_config.decode.bs. sglang is imported inside the functions only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def decode_graph_config() -> Any | None:
    """The decode phase's graph config the runners capture from (None: not published, or no
    graphs)."""
    try:
        from sglang.srt.model_executor.cuda_graph_config import Backend
        from sglang.srt.runtime_context import get_exec

        config = get_exec().graph.cuda_graph_config
    except (ImportError, ValueError, AttributeError):
        return None
    decode = getattr(config, "decode", None)
    if decode is None or decode.backend == Backend.DISABLED or not decode.bs:
        return None
    return decode


def pruned_sizes(worker: Any, steps: int, captured: list[int]) -> list[int] | None:
    """The sizes the policy gives a depth out of `captured` (None: its policy does not prune)."""
    policy: Any = getattr(getattr(worker, "adaptive_controller", None), "params", None)
    if not hasattr(policy, "cuda_graph_bs_for_step") or not hasattr(policy, "set_cuda_graph_bs"):
        return None
    policy.set_cuda_graph_bs(list(captured))
    sizes: list[int] | None = policy.cuda_graph_bs_for_step(steps)
    return sizes


@contextlib.contextmanager
def capture_at(worker: Any, steps: int, given: list[int] | None) -> Iterator[list[int] | None]:
    """Around one state's build: the runners capture at the depth's sizes, restored after. Sizes
    upstream was given (the legacy flag set, already pruned) are applied too, since its own override
    does not reach the runners either. Yields the sizes (None: nothing to prune, left as it is)."""
    decode = decode_graph_config()
    if decode is None:
        yield given
        return
    captured = list(decode.bs)
    sizes = pruned_sizes(worker, steps, captured) if given is None else given
    if sizes is None:
        yield given
        return
    # a depth no captured size reaches keeps the largest one, not none: its batches are larger than
    # any graph and run eagerly, and an empty list would fail the runners' capture
    sizes = sorted(sizes) or [max(captured)]
    saved = decode.bs
    decode.bs = sizes
    try:
        yield sizes
    finally:
        decode.bs = saved
