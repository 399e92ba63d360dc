"""The plain step's target: a DECODE forward under the zero-step state's own DECODE CUDA graph.

Upstream's zero-step tier runs a one-token TARGET_VERIFY graph (extend attention with a custom mask
over the whole prefix). The zero-step runtime state here captures its target graph with
PlainDecodeCudaGraphRunner (a DecodeCudaGraphRunner that captures DECODE with the hidden states
the draft needs). In the plain layout (layout.py) the step runs that graph directly; in spec v2's
layout a zero-step verify builds its forward batch in DECODE's convention (sequence lengths
include the token) and upstream's verify bookkeeping (sampling, grammars, penalties, logprobs,
the stride-1 result) runs as before, on the same token, position and KV slot. Where the draft
writes only its K/V and the plain layout runs, the deferred write (deferred_kv.py) is recorded
into this graph. sglang is imported inside the functions only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

from sglang_image_plugin import deferred_kv, gpu_memory, state, state_graphs
from sglang_image_plugin.state import WorkerState
from sglang_image_plugin.tp import log_on_rank0

logger = logging.getLogger(__name__)


@functools.cache
def runner_class() -> type:
    """DecodeCudaGraphRunner capturing DECODE (no verify input) with the target's hidden states."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    class PlainDecodeCudaGraphRunner(DecodeCudaGraphRunner):  # type: ignore[misc]
        def capture(self) -> None:
            self.capture_forward_mode = ForwardMode.DECODE
            self.ragged_verify_mode = False
            hidden: Any = getattr(self, "capture_hidden_mode")  # noqa: B009 - typed Any
            self.capture_hidden_mode = max(hidden, CaptureHiddenMode.FULL)
            super().capture()

        def get_spec_info(self, num_tokens: int) -> None:
            return None

    return PlainDecodeCudaGraphRunner


@contextlib.contextmanager
def _decode_runner_for_capture() -> Iterator[None]:
    """build_adaptive_runtime_state looks the target's runner class up in eagle_worker_v2's
    globals: the plain class for the zero-step state's capture only."""
    from sglang.srt.speculative import eagle_worker_v2

    saved = eagle_worker_v2.DecodeCudaGraphRunner
    eagle_worker_v2.DecodeCudaGraphRunner = runner_class()
    try:
        yield
    finally:
        eagle_worker_v2.DecodeCudaGraphRunner = saved


def build_runtime_state(original: Callable[..., Any], worker: Any, speculative_num_steps: int,
                        speculative_num_draft_tokens: int, *args: Any, **kwargs: Any) -> Any:
    """AROUND EAGLEWorkerV2.build_adaptive_runtime_state: the zero-step state's target graph in
    DECODE mode, with the deferred draft K/V write where the plain step has it."""
    own = state.peek(worker, WorkerState)
    step = own.plain_step if own is not None else None
    held_before = gpu_memory.held_bytes()
    with state_graphs.capture_at(worker, speculative_num_steps, kwargs.get("cuda_graph_bs")) as sizes:
        if sizes is not None:
            kwargs["cuda_graph_bs"] = sizes
        if speculative_num_steps != 0 or step is None:
            built = original(worker, speculative_num_steps, speculative_num_draft_tokens, *args, **kwargs)
        else:
            deferred = deferred_kv.install(worker, runner_class()) if step.deferred else None
            with _decode_runner_for_capture():
                built = original(worker, speculative_num_steps, speculative_num_draft_tokens, *args, **kwargs)
            if deferred is not None:
                deferred.reset()  # the capture's runs fed dummy rows
    if own is not None:
        _count_state_memory(own, speculative_num_steps, held_before, sizes)
    return built


def _count_state_memory(own: WorkerState, depth: int, held_before: int | None, graph_sizes: Any) -> None:
    """What one depth's runtime state took (its graphs, attention workspaces) goes into the server
    info and the log: each extra depth costs memory the KV pool no longer has."""
    taken = gpu_memory.took(held_before, gpu_memory.held_bytes())
    if taken is None:
        return
    own.state_memory[depth] = taken
    sizes = sorted(int(b) for b in graph_sizes or ())
    if sizes:
        graphs = f"graphs at {len(sizes)} batch sizes up to {sizes[-1]}"
    else:
        graphs = "no graphs" if state_graphs.decode_graph_config() is None else "graphs at the launch's batch sizes"
    log_on_rank0(f"Speculation state depth {depth}: {own.state_memory[depth] / 2**30:.2f} GiB ({graphs}); "
                 f"the extra depth states take {sum(own.state_memory.values()) / 2**30:.2f} GiB "
                 "beside the launch depth's")


def prepare_for_verify(original: Callable[..., Any], verify_input: Any, req_to_token_pool: Any,
                       batch: Any, target_worker: Any) -> Any:
    """AROUND eagle_utils.eagle_prepare_for_verify: a one-token verify whose target runs the plain
    DECODE graph gets a DECODE forward batch (lengths include the token, no verify input)."""
    runner: Any = target_worker.model_runner.decode_cuda_graph_runner
    if (
        verify_input.draft_token_num != 1
        or batch.forward_mode.is_idle()
        or not isinstance(runner, runner_class())
        or batch.hisparse_coordinator is not None
        or getattr(batch, "mamba_track_indices", None) is not None
    ):
        return original(verify_input, req_to_token_pool, batch, target_worker)
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_uniform_func
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )

    bs = len(batch.req_pool_indices)
    batch.input_ids = verify_input.draft_token
    if verify_input.prepared_out_cache_loc is not None:
        batch.out_cache_loc = verify_input.prepared_out_cache_loc
    else:
        batch.out_cache_loc = assign_extend_cache_locs_uniform_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=req_to_token_pool.req_to_token,
            start_offset=batch.seq_lens,
            batch_size=bs,
            draft_token_num=1,
            device=batch.device,
        )
    verify_input.seq_lens_cpu = batch.seq_lens_cpu
    verify_input.seq_lens_sum = (
        int(batch.seq_lens_cpu.sum()) if batch.seq_lens_cpu is not None else None
    )
    saved = (batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.spec_info)
    # DECODE's convention: the lengths include the token fed now (spec v2's exclude it)
    batch.forward_mode = ForwardMode.DECODE
    batch.seq_lens = saved[0] + 1
    batch.seq_lens_cpu = None if saved[1] is None else saved[1] + 1
    batch.seq_lens_sum = None if saved[2] is None else saved[2] + bs
    batch.spec_info = None
    try:
        forward_batch = ForwardBatch.init_new(
            batch,
            target_worker.model_runner,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            return_hidden_states_before_norm=False,
            kv_loc_plan=verify_input.kv_loc_plan,
        )
    finally:
        batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.spec_info = saved
        batch.forward_mode = ForwardMode.TARGET_VERIFY
    plain_runner: Any = runner
    can_run = bool(plain_runner.can_run_graph(forward_batch))
    if can_run:
        plain_runner.load_batch(forward_batch)
        forward_batch.mark_forward_metadata_ready()
    return forward_batch, can_run
