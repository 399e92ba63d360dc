"""The threshold as a policy of upstream's adaptive speculation (AdaptiveSpecPolicy).

Upstream's AdaptiveController builds one runtime state per candidate step count
(draft/verify attention backends and CUDA graphs) and switches the worker between
them per decode batch. Two candidates, the configured step count K and 0, give the
switch: 0 steps is upstream's zero-step tier (no drafting; the target samples one
token per request from a one-token verify, and the draft extend keeps the draft's
KV cache filled). Pure logic: no sglang imports.
"""

from __future__ import annotations

from sglang_image_plugin.spec_disable import SpecDisableController

PLAIN_STEPS = 0


class ThresholdPolicy:
    """Steps K below the threshold, 0 above it, with the controller's hysteresis."""

    def __init__(self, controller: SpecDisableController, speculative_steps: int) -> None:
        if speculative_steps < 1:
            raise ValueError(
                f"dynamic speculation disable needs --speculative-num-steps >= 1, "
                f"got {speculative_steps}"
            )
        self.controller = controller
        self.speculative_steps = speculative_steps
        self._cuda_graph_bs: list[int] | None = None

    @property
    def candidate_steps(self) -> list[int]:
        return [PLAIN_STEPS, self.speculative_steps]

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None

    def get_steps_for_batch(self, batch_size: int) -> int:
        """Called once per decode batch before it drafts (an idle batch: 0 requests)."""
        if batch_size <= 0:
            plain = self.controller.mode != "speculative"
        else:
            plain = self.controller.step(batch_size)
        return PLAIN_STEPS if plain else self.speculative_steps

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> None:
        """The threshold does not follow acceptance."""

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        """The captured batch sizes a step count can run at (a batch pads up to the
        next captured size): plain from the resume size up, speculative up to the
        threshold."""
        if self._cuda_graph_bs is None:
            return None
        sizes = self._cuda_graph_bs
        if step == PLAIN_STEPS:
            return [v for v in sizes if v > self.controller.resume_batch_size]
        return [v for i, v in enumerate(sizes) if i == 0 or sizes[i - 1] < self.controller.threshold]
