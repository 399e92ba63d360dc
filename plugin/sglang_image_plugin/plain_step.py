"""The plain step of a threshold server: what it runs, resolved once per worker.

A plain step decodes one token per request with the target alone, so that outputs equal a plain
server's, and keeps the draft's KV cache current, so that acceptance is back at once when
speculation resumes. Where each part lives:

- target: a DECODE forward under the zero-step state's own DECODE CUDA graph
  (plain_target.py), instead of upstream's one-token TARGET_VERIFY graph with its tree mask;
- draft: a one-layer Llama EAGLE-3 draft writes only its K/V (draft_kv.py), for plain steps and
  for prefills while the mode is plain, and the step that would resume speculation runs one more
  plain step with the full draft extend (policy.CatchUpPolicy); any other draft runs upstream's
  full draft extend;
- layout: under the overlap scheduler the scheduler prepares, runs and processes the step as a
  plain server's decode step (layout.py); otherwise spec v2's layout with a one-token verify;
- the draft's K/V write: inside the next plain step's target graph (deferred_kv.py), where the
  plain layout runs on one GPU; otherwise right after the step. A prefill's, from one captured
  graph per padded token count where asked for (prefill_kv.py), on one GPU.

`resolve` decides all of it once, at `init_cuda_graphs` (the pools exist, the graphs are not yet
captured); the hooks read the one PlainStep on the worker, and only the hooks its parts need are
installed (targets.HOOKS, by group). sglang is imported inside the functions only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from sglang_image_plugin.targets import Group


@dataclass(frozen=True)
class PlainStep:
    """What this worker's plain steps run; each `*_reason` says why a part does not apply."""

    kv_only_reason: str | None
    layout_reason: str | None
    deferred_reason: str | None

    @property
    def kv_only(self) -> bool:
        return self.kv_only_reason is None

    @property
    def layout(self) -> bool:
        return self.layout_reason is None

    @property
    def deferred(self) -> bool:
        return self.deferred_reason is None

    def hook_groups(self) -> tuple[Group, ...]:
        groups = [Group.THRESHOLD]
        if self.kv_only:
            groups.append(Group.KV_ONLY)
        if self.layout:
            groups.append(Group.LAYOUT)
        return tuple(groups)

    def view(self) -> dict[str, str]:
        """For the server info (speculative_disable.plain_step) and the start line."""
        return {
            "target": "decode graph",
            "draft": "kv only" if self.kv_only else "full draft extend",
            "layout": "plain" if self.layout else "speculative",
            "draft_kv_write": ("in the next step's graph" if self.deferred
                               else "after each step" if self.kv_only else "draft extend"),
        }

    def log_lines(self) -> list[str]:
        """One line per part, with the reason where a part does not apply (the smoke reads the
        draft's line)."""
        draft = ("plain steps and prefills in plain mode write only the draft's K/V, one catch-up "
                 "step before speculation resumes" if self.kv_only
                 else f"plain steps run the draft's full step: {self.kv_only_reason}")
        layout = ("plain steps run in the plain layout" if self.layout
                  else f"plain steps keep the speculative layout: {self.layout_reason}")
        write = ("the plain step's graph writes the previous plain step's draft K/V"
                 if self.deferred else f"the draft's K/V are written after each plain step: "
                 f"{self.deferred_reason}")
        return [f"Plain step: {draft}", f"Plain step: {layout}"] + (
            [f"Plain step: {write}"] if self.kv_only else [])

    def in_speculative_layout(self, reason: str) -> PlainStep:
        """This plain step where the scheduler cannot run the plain layout after all (the
        scheduler's own check: layout.why_not_plain_layout): each plain step then writes its own
        draft K/V."""
        return replace(self, layout_reason=reason, deferred_reason="the speculative layout")


def layout_reason_from_args(server_args: Any) -> str | None:
    """Why the scheduler these arguments make cannot run plain steps in the plain layout (the
    scheduler confirms it at its start: layout.why_not_plain_layout)."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    if cfg.disable_overlap_schedule:
        return "the synchronous scheduler (--disable-overlap-schedule) keeps the speculative layout"
    if int(cfg.page_size or 1) != 1:
        return f"page size {cfg.page_size} (the KV reserve is freed per token)"
    return None


def resolve(worker: Any) -> PlainStep:
    """The worker's plain step, from its draft, its pools and its server arguments."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from sglang_image_plugin import deferred_kv, draft_kv

    cfg = resolving_view(worker.server_args)
    kv_only = draft_kv.why_not_kv_only(worker._draft_worker,
                                          bool(cfg.speculative_use_rejection_sampling))
    layout = (layout_reason_from_args(worker.server_args) if kv_only is None
              else "the draft runs its full step (the plain layout writes only its K/V)")
    if kv_only is not None:
        deferred: str | None = "the draft runs its full step"
    elif layout is not None:
        deferred = "the speculative layout writes the draft's K/V in the draft extend"
    else:
        deferred = deferred_kv.why_not_in_graph(worker)
    return PlainStep(kv_only_reason=kv_only, layout_reason=layout, deferred_reason=deferred)
