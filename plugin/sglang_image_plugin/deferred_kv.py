"""The draft's K/V of a plain step, written inside the next plain step's target CUDA graph.

A one-layer EAGLE-3 draft's K/V at position p need the token at p + 1, which a plain step samples
after its graph has run. So each plain step's graph writes the previous plain step's K/V (the token
it is fed now is the one they need) and keeps its own rows' target hidden states, positions and KV
slots for the next: no launch on the host for the draft. The write is recorded into the zero-step
state's DECODE graph through ModelRunner.capture_tail_hooks (0.5.17's _DeferredDraftKv, there a
hook of our patch); a step that runs without that graph does the same bookkeeping eagerly.
Inside the graph the previous step's K/V, which need only the token fed now, are written on a side
stream beside the target's forward (ModelRunner.capture_head_hooks, before it), and the step keeps
its own rows after joining it: the draft's ~25 kernels (two GEMMs, the rest small) then share the
GPU with the 8B target's forward instead of following it.

Per request row (the req_to_token row): the pending position (-1: none), KV slot and hidden state.
A step writes a row's pending K/V when a position is pending (>= 0) and it is just before the
row's position now (its previous step was a plain step of the same request); every other row, and
a padded graph row (row 0, position 0, slot 0: upstream pads with zeros and never gives row 0 or
slot 0 to a request), writes the pool's padding slot 0 at position 0. A pending position of -1
(nothing pending) must never reach the rope: at position 0 it looks "just before", and the rope's
cos/sin table read at -1 is out of bounds (the graph capture, whose dummy rows all sit at 0, and the
first padded step after it). A prefill forgets its
rows; the catch-up step, and a speculative-layout plain step, first flush what is pending before
the token they are fed. Known price: a request's last plain step leaves one draft position
unwritten (a later request reusing the whole sequence from the radix cache may draft one token
worse there; outputs are the target's).

torch and sglang are imported inside the functions only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from sglang_image_plugin import draft_kv, state
from sglang_image_plugin.state import DraftState


class SideStream:
    """A CUDA stream beside the current one: work forked onto it is recorded into a graph being
    captured as a parallel branch, and the current stream waits for it at the join. Upstream forks
    its in-graph metadata prep the same way, but its helper (forked_metadata_prep) keeps one
    pending join that the graph runner requires joined right after the forward, before the tail
    hooks: this one is joined in the tail."""

    def __init__(self, device: Any) -> None:
        import torch

        self.stream = torch.cuda.Stream(device=device)
        self.done = torch.cuda.Event()

    @contextlib.contextmanager
    def beside(self) -> Iterator[None]:
        import torch

        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
            self.done.record()

    def join(self) -> None:
        import torch

        torch.cuda.current_stream().wait_event(self.done)


class DeferredDraftKv:
    """The pending draft K/V of each request row, and the step that writes and keeps them."""

    def __init__(self, model: Any, pool: Any, rows: int, hidden_size: int, dtype: Any,
                 device: Any, side: Any = None) -> None:
        import torch

        self.model = model
        self.pool = pool
        self.side = side  # a SideStream: write_ahead forks the pending write onto it (None: no fork)
        self._ahead = False  # write_ahead wrote this step's pending K/V; step() joins them
        # on the host: a plain-layout step ran since the last flush (else a flush has nothing to
        # write, and a speculative-layout plain step after another skips it)
        self.pending = False
        # on the device, read inside the graph: off where the scheduler keeps the speculative
        # layout (observe.scheduler_init runs after the graph that holds the step was captured)
        self.enabled = torch.ones((1,), dtype=torch.bool, device=device)
        self.pos = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.loc = torch.zeros((rows,), dtype=torch.int64, device=device)
        self.hidden = torch.zeros((rows, hidden_size), dtype=dtype, device=device)

    def _write_pending(self, rows: Any, tokens: Any, positions: Any) -> Any:
        """Write the pending K/V of `rows` whose pending position is `positions` - 1, with the
        tokens fed at `positions`; the others write the padding slot. Returns rows as int64."""
        import torch

        rows = rows.to(torch.int64)
        pending = self.pos[rows]
        valid = (pending >= 0) & (pending == positions.to(torch.int64) - 1) & self.enabled
        zero = torch.zeros_like(pending)
        draft_kv.write_draft_kv(self.model, tokens.to(torch.int64), torch.where(valid, pending, zero),
                                self.hidden[rows], torch.where(valid, self.loc[rows], zero), self.pool)
        return rows

    def write_ahead(self, rows: Any, tokens: Any, positions: Any) -> None:
        """Before the target's forward of a plain step fed `tokens` at `positions`: the previous
        step's pending K/V, on the side stream (they read only what that step kept and the tokens
        fed now); step() joins them before it keeps this step's. Without a side stream, step()
        writes them."""
        if self.side is None:
            return
        with self.side.beside():
            self._write_pending(rows, tokens, positions)
        self._ahead = True

    def step(self, rows: Any, tokens: Any, positions: Any, hidden: Any, loc: Any) -> None:
        """A plain step fed `tokens` at `positions` (its KV slots `loc`, the target's hidden states
        `hidden`): the previous step's pending K/V (unless write_ahead wrote them), then this
        step's kept. Fixed shapes only: it is recorded into a CUDA graph."""
        import torch

        if self._ahead:
            self._ahead = False
            self.side.join()  # the pending K/V read the books this step overwrites
            rows = rows.to(torch.int64)
        else:
            rows = self._write_pending(rows, tokens, positions)
        self.pending = True
        positions = positions.to(torch.int64)
        self.pos[rows] = torch.where(self.enabled, positions, torch.full_like(positions, -1))
        self.loc[rows] = loc.to(torch.int64)
        self.hidden[rows] = hidden.to(self.hidden.dtype)

    def flush(self, rows: Any, tokens: Any, positions: Any) -> None:
        """Before a step that writes its own draft K/V (the catch-up step's full draft extend, a
        speculative-layout plain step): the pending K/V before `positions`, then none pending."""
        if not self.pending:
            return
        self.forget(self._write_pending(rows, tokens, positions))
        self.pending = False

    def forget(self, rows: Any) -> None:
        """Nothing pending for these rows (at a prefill: they hold new requests)."""
        import torch

        # index_fill_ passes -1 to the kernel; `pos[rows] = -1` would copy it from the host
        # first, a blocking copy that waits for every queued forward (one per prefill)
        self.pos.index_fill_(0, rows.to(torch.int64), -1)

    def reset(self) -> None:
        """After graph capture (its runs fed dummy rows)."""
        self.pos.fill_(-1)
        self.pending = False
        self._ahead = False

    def disable(self) -> None:
        """The scheduler keeps the speculative layout, where each plain step writes its own draft
        K/V: the step recorded in the graph then keeps and writes nothing (a row that a new
        request reuses would otherwise have its old pending K/V written at a freed slot)."""
        self.enabled.fill_(False)
        self.reset()


def head_hook(deferred: DeferredDraftKv, runner_class: type) -> Any:
    """ModelRunner.capture_head_hooks entry: inside the zero-step state's DECODE graph (and its
    warm-up runs), before the target's forward, the pending K/V written beside it."""

    def hook(graph_runner: Any, forward_batch: Any) -> None:
        if not isinstance(graph_runner, runner_class):
            return
        deferred.write_ahead(forward_batch.req_pool_indices, forward_batch.input_ids,
                             forward_batch.positions)

    return hook


def tail_hook(deferred: DeferredDraftKv, runner_class: type) -> Any:
    """ModelRunner.capture_tail_hooks entry: inside the zero-step state's DECODE graph (and its
    warm-up runs), the deferred step; nothing in any other graph of the target."""

    def hook(graph_runner: Any, out: Any, forward_batch: Any, num_tokens: int) -> None:
        if not isinstance(graph_runner, runner_class):
            return
        deferred.step(forward_batch.req_pool_indices, forward_batch.input_ids,
                      forward_batch.positions, out.hidden_states, forward_batch.out_cache_loc)

    return hook


def why_not_in_graph(worker: Any) -> str | None:
    """Why the graph cannot write the draft's K/V here (None: it can)."""
    from sglang.srt.arg_groups.overrides import resolving_view

    if int(resolving_view(worker.server_args).tp_size or 1) > 1:
        return "tensor parallelism (the draft's group is entered around its work on the host)"
    model = worker.draft_worker.draft_runner.model.model
    if getattr(model, "fc", None) is None:
        return "the draft has no fc layer over the target's hidden states"
    return None


def install(worker: Any, runner_class: type) -> DeferredDraftKv:
    """Before the zero-step state's capture (where why_not_in_graph is None): the worker's
    DeferredDraftKv and the target's tail hook that writes it."""
    draft_worker = worker.draft_worker
    own = state.of(draft_worker, DraftState)
    if own.deferred is not None:
        assert isinstance(own.deferred, DeferredDraftKv)
        return own.deferred
    runner = draft_worker.draft_runner
    target = worker.target_worker.model_runner
    fc = runner.model.model.fc
    # the pending write forks onto a side stream where the graph runner has head hooks (on CUDA)
    heads: list[Any] | None = (getattr(target, "capture_head_hooks", None)
                               if fc.weight.device.type == "cuda" else None)
    deferred = DeferredDraftKv(
        runner.model.model,
        runner.token_to_kv_pool,
        rows=int(target.req_to_token_pool.req_to_token.shape[0]),
        hidden_size=int(fc.weight.shape[1]),
        dtype=fc.weight.dtype,
        device=fc.weight.device,
        side=SideStream(fc.weight.device) if heads is not None else None,
    )
    if heads is not None:
        heads.append(head_hook(deferred, runner_class))
    target.capture_tail_hooks.append(tail_hook(deferred, runner_class))
    own.deferred = deferred
    return deferred
