"""Host microseconds per decode step of the plain layout's glue (layout.py), against a plain
server's same step, on the CPU with the real sglang wheel.

    PYTHONPATH=plugin:.cache/trees/sglang-0.5.23-pristine-<key> python tools/plain_step_host_bench.py

One plain-layout step is what the scheduler runs of ours per decode step while the mode stays
plain: the AROUND hook on ScheduleBatch.prepare_for_decode (upstream's preparation itself left
out: it is the plain server's), resolve_forward_inputs, EAGLEWorkerV2.forward_batch_generation
(the target's forward a stub returning ready tensors; the draft's K/V deferred into the graph),
FutureMap.publish, and the BEFORE hook on process_batch_result_decode with the worker's verify
callback (upstream's, wrapped by the plugin's acceptance hook) and a fixed threshold's policy.
The plain server's step: upstream's resolve_forward_inputs, the same stub forward and
FutureMap.publish on a non-speculative FutureMap. Tensors live on the CPU, so a tensor op costs
its dispatch and allocation but no kernel launch: the difference is the glue's host work, a
CUDA launch per tensor op (a few microseconds each) comes on top on a GPU host. Numbers only:
it asserts nothing. Before/after a change: `git stash push plugin/`, run, `git stash pop`, run.
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace as NS
from typing import Any


def _setup(batch_size: int) -> dict[str, Any]:
    import torch
    from sglang.srt.managers.overlap_utils import FutureMap, RelayPayload, resolve_forward_inputs
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
    from sglang.srt.speculative import spec_utils
    from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang_image_plugin import layout as L
    from sglang_image_plugin import state
    from sglang_image_plugin import worker as W
    from sglang_image_plugin.acceptance import AcceptanceAroundPlain
    from sglang_image_plugin.policy import CatchUpPolicy, ThresholdPolicy
    from sglang_image_plugin.spec_disable import SpecDisableController
    from sglang_image_plugin.state import DraftState, WorkerState

    spec_utils.spec_need_hidden_states = lambda: True  # (reads the server's published config)
    eagle, none = SpeculativeAlgorithm.EAGLE3, SpeculativeAlgorithm.NONE
    rows = torch.arange(1, batch_size + 1)
    req_to_token = torch.zeros((batch_size + 1, 8), dtype=torch.int32)
    fm = FutureMap(torch.device("cpu"), eagle, NS(req_to_token=req_to_token))
    fm_plain = FutureMap(torch.device("cpu"), none, NS(req_to_token=req_to_token))
    for f in (fm, fm_plain):
        f.stash(rows, RelayPayload(bonus_tokens=torch.zeros(batch_size, dtype=torch.int64)))
    reqs = [NS(spec_verify_ct=0) for _ in range(batch_size)]

    def batch() -> Any:
        return NS(reqs=reqs, req_pool_indices=rows, seq_lens=torch.full((batch_size,), 100),
                  spec_algorithm=none, spec_info=None, forward_mode=ForwardMode.DECODE,
                  input_ids=None, prefill_input_ids_cpu=None, mix_running_indices=None,
                  enable_overlap=True, out_cache_loc=torch.zeros(batch_size, dtype=torch.int64),
                  has_grammar=False, sampling_info=NS(penalizer_orchestrator=NS(is_required=False)),
                  return_hidden_states=False, model_config=NS(is_encoder_decoder=False))

    result = NS(next_token_ids=torch.zeros(batch_size, dtype=torch.int64), can_run_cuda_graph=True,
                logits_output=NS(hidden_states=torch.zeros(batch_size, 8)))
    target = NS(forward_batch_generation=lambda b, capture_hidden_mode=None: result)

    class Worker:  # the EAGLE-3 worker as the hooks and upstream's verify callback use it
        speculative_num_steps = 0
        on_verify_complete_cpu = _wrap_fn(EAGLEWorkerV2.on_verify_complete_cpu, W.step_verified,
                                          HookType.BEFORE)

        def apply_runtime_state(self, runtime_state: Any) -> None:
            self.speculative_num_steps = runtime_state

    worker = Worker()
    worker.target_worker = target  # type: ignore[attr-defined]
    worker.draft_worker = NS(draft_runner=NS(model=None))  # type: ignore[attr-defined]
    controller = SpecDisableController(8, 1, log_fn=lambda line: None)
    catch_up = CatchUpPolicy(ThresholdPolicy(controller, 3))
    adaptive = AdaptiveController(worker, catch_up)
    adaptive._states = {0: 0, 3: 3}
    worker.adaptive_controller = adaptive  # type: ignore[attr-defined]
    own = state.of(worker, WorkerState)
    own.acceptance = AcceptanceAroundPlain()
    state.of(worker.draft_worker, DraftState).deferred = NS(pending=False)
    lay = L.PlainLayout(worker, fm, eagle, catch_up, own.acceptance)
    own.layout = lay
    L._active = lay
    processor = NS(model_worker=worker, metrics_reporter=NS(
        update_spec_metrics=lambda bs, n, num_accept_tokens=0: None))
    upstream_prepare = _wrap_fn(lambda b: None, L.prepare_for_decode, HookType.AROUND)
    resolve = _wrap_fn(resolve_forward_inputs, L.resolve_forward_inputs, HookType.AROUND)
    forward = _wrap_fn(lambda w, b: None, L.forward_batch_generation, HookType.AROUND)
    publish = _wrap_fn(FutureMap.publish, L.publish, HookType.AROUND)
    process = _wrap_fn(lambda p, b, r: None, L.plain_result, HookType.BEFORE)

    b_threshold, b_plain = batch(), batch()

    def threshold_step() -> None:
        b = b_threshold
        upstream_prepare(b)
        b.input_ids = None
        resolve(b, fm)
        r = forward(worker, b)
        publish(fm, rows, b.seq_lens + 1)
        process(processor, b, r)

    def plain_step() -> None:
        b = b_plain
        b.input_ids = None
        resolve_forward_inputs(b, fm_plain)
        r = target.forward_batch_generation(b)
        fm_plain.publish(rows, b.seq_lens + 1)
        del r

    # the batch starts in the plain layout; a few steps take the threshold's controller (8) into
    # plain mode and settle the acceptance watch's queue
    for _ in range(4):
        threshold_step()
    return {"threshold": threshold_step, "plain": plain_step}


def _per_step_us(steps: dict[str, Any], count: int, rounds: int) -> dict[str, float]:
    """The least time per step over rounds that alternate the two steps (a shared host's noise
    only adds time)."""
    best = {name: float("inf") for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(count):
                step()
            best[name] = min(best[name], (time.perf_counter() - start) / count * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    print(f"{'batch':>6} {'plain us':>9} {'threshold us':>13} {'glue us':>8}")
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        best = _per_step_us(_setup(batch_size), args.steps, args.rounds)
        plain, threshold = best["plain"], best["threshold"]
        print(f"{batch_size:>6} {plain:>9.1f} {threshold:>13.1f} {threshold - plain:>8.1f}")


if __name__ == "__main__":
    main()
