"""Tensor parallelism: the log line once per group, rank 0's values and decisions on every rank.

sglang and torch are imported inside the functions only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang_image_plugin.auto_depth import DepthDecision
from sglang_image_plugin.auto_threshold import Decision

logger = logging.getLogger(__name__)


def tp_rank() -> int:
    """This process's rank in its TP group (0 where none is published: a process of its own)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        return int(get_parallel().tp_rank)
    except RuntimeError:
        return 0


def log_on_rank0(message: str) -> None:
    """Log once per TP group (every rank decides alike)."""
    if tp_rank() == 0:
        logger.info(message)


def tp_group(server_args: Any) -> Any:
    """The tensor-parallel group (sglang's GroupCoordinator) when there is more than one
    rank; None for one."""
    from sglang.srt.arg_groups.overrides import resolving_view

    if int(resolving_view(server_args).tp_size or 1) <= 1:
        return None
    from sglang.srt.runtime_context import get_parallel

    group = get_parallel().tp_group
    return group if group.world_size > 1 else None


def broadcast_ints(cpu_group: Any, src: int, values: list[int]) -> list[int]:
    """Rank `src`'s values on every rank of the group (a CPU, gloo, broadcast)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(tensor, src=src, group=cpu_group)
    return [int(v) for v in tensor.tolist()]


def tp_agree(cpu_group: Any, src: int, buckets: int) -> Callable[[Decision], Decision]:
    """`auto` under tensor parallelism: every rank takes rank `src`'s Decision. Each rank
    measures its own step times, and ranks that chose different step counts would run
    collectives of different shapes (where a trial runs is agreed too); the controller calls
    this at the same steps on every rank (once per AutoConfig.update_every decode steps), from
    the scheduler's thread."""

    def agree(decision: Decision) -> Decision:
        flags = [int(i in decision.undecided) for i in range(buckets)]
        values = broadcast_ints(cpu_group, src, [decision.split, decision.trial, *flags])
        return Decision(values[0], frozenset(i for i, f in enumerate(values[2:]) if f), values[1])

    return agree


def tp_agree_depths(cpu_group: Any, src: int) -> Callable[[DepthDecision], DepthDecision]:
    """The learned depth schedule under tensor parallelism: every rank takes rank `src`'s
    DepthDecision (each bucket's depth and the depth it explores next), as tp_agree does for the
    threshold's `auto` (every AutoConfig.update_every decode steps, from the scheduler's thread)."""

    def agree(decision: DepthDecision) -> DepthDecision:
        buckets = len(decision.depths)
        values = broadcast_ints(cpu_group, src, [*decision.depths, *decision.explore])
        return DepthDecision(tuple(values[:buckets]), tuple(values[buckets:]))

    return agree
