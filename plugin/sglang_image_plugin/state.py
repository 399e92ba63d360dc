"""The plugin's bookkeeping on upstream's objects: one state object on each, under one attribute.

ServerArgs carries an ArgsState (ServerArgs.__reduce__ pickles it with the record to the scheduler
processes), each EAGLE-3 worker a WorkerState and its draft worker a DraftState. `of` gives an
object's state, made on first use; `peek` reads it without making one (None: the plugin left
nothing there, e.g. a server without a threshold).

The bottom of the plugin's layers (tests/test_layout.py): it imports no mechanism and no hook. A
field holding one of their objects is typed by a Protocol here, which says what its readers use
of it; mypy checks the object put there against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from sglang_image_plugin.setting import Setting
    from sglang_image_plugin.spec_disable import Metrics


class Controller(Protocol):
    """WorkerState.controller: spec_disable.SpecDisableController, policy.AutoThresholdPolicy,
    policy.DepthSchedulePolicy or auto_depth_policy.AutoDepthPolicy, as the observability hooks
    read it (observe.py)."""

    metrics: Metrics  # where it reports (the scheduler attaches Prometheus)

    def snapshot(self) -> dict[str, Any]: ...


class AcceptanceWatch(Protocol):
    """WorkerState.acceptance: acceptance.AcceptanceAroundPlain."""

    def decided(self, depth: int, batch_size: int) -> None: ...

    def verified(self, num_correct_drafts_per_req: Sequence[int]) -> None: ...

    def view(self) -> dict[str, Any]: ...


class PlainStepParts(Protocol):
    """WorkerState.plain_step: plain_step.PlainStep, as the hooks read it."""

    @property
    def kv_only(self) -> bool: ...

    @property
    def deferred(self) -> bool: ...

    @property
    def layout_reason(self) -> str | None: ...

    def view(self) -> dict[str, str]: ...

    def in_speculative_layout(self, reason: str) -> PlainStepParts: ...


class Layout(Protocol):
    """WorkerState.layout: layout.PlainLayout, as its hooks read it."""

    predecided: bool

    def forward(self, batch: Any) -> Any: ...


class CatchUp(Protocol):
    """DraftState.catch_up: policy.CatchUpPolicy, as the draft's hooks read it."""

    @property
    def full_draft_extend(self) -> bool: ...

    @property
    def draft_stale(self) -> bool: ...


class DeferredWrite(Protocol):
    """DraftState.deferred: deferred_kv.DeferredDraftKv, as the hooks read it."""

    pending: bool

    def step(self, rows: Any, tokens: Any, positions: Any, hidden: Any, loc: Any) -> None: ...

    def flush(self, rows: Any, tokens: Any, positions: Any) -> None: ...

    def forget(self, rows: Any) -> None: ...

    def disable(self) -> None: ...


class PrefillWrite(Protocol):
    """DraftState.prefill: prefill_kv.PrefillDraftKv, as the draft's prefill hook reads it."""

    def write(self, batch: Any, tail_tokens: Any, target_hidden: Any) -> bool: ...


# Not a ServerArgs field, nor a worker's: upstream never reads or resolves it.
ATTR = "_sglang_image"


@dataclass
class ArgsState:
    """On ServerArgs: the flags as parsed, the setting resolved from them, the limit."""

    flags: tuple[Any, Any, Any] = (None, None, None)  # (threshold, hysteresis, schedule) as parsed
    setting: Setting | None = None  # resolved and validated by check_server_args
    running_limit: bool = False  # upstream's running-request cap for speculation was not applied


@dataclass
class WorkerState:
    """On EAGLEWorkerV2: what its threshold decides with and what its plain step is."""

    # the threshold's controller, `auto`'s policy or the schedule's; read by the observability hooks
    controller: Controller | None = None
    auto_pending: bool = False  # `auto` waits for init_cuda_graphs to make its policy
    auto_depth: bool = False  # that `auto` is the depth schedule's (else the threshold's)
    acceptance: AcceptanceWatch | None = None  # accept length around plain phases
    plain_step: PlainStepParts | None = None  # resolved once, at init_cuda_graphs
    layout: Layout | None = None  # the plain layout, where the scheduler runs it
    # GPU bytes each extra depth's runtime state took at its build (plain_target.py)
    state_memory: dict[int, int] = field(default_factory=dict)


@dataclass
class DraftState:
    """On EagleDraftWorker: how a plain step treats the draft."""

    catch_up: CatchUp | None = None  # whether this plain step drafts in full (K/V-only draft)
    deferred: DeferredWrite | None = None  # the K/V a plain-layout step left for the next
    prefill: PrefillWrite | None = None  # a K/V-only prefill's buffers and graphs (none: eager)
    # the overlap scheduler's FutureMap relays the proposal by request row (the plain layout's
    # scheduler): a K/V-only prefill then hands none (draft_extend.draft_extend_for_prefill)
    proposal_by_row: bool = False


State = TypeVar("State", ArgsState, WorkerState, DraftState)


def peek(obj: Any, kind: type[State]) -> State | None:
    """The state of `kind` on `obj`, None where there is none (or no `obj`)."""
    found = getattr(obj, ATTR, None)
    return found if isinstance(found, kind) else None


def of(obj: Any, kind: type[State]) -> State:
    """The state of `kind` on `obj`, made and attached on first use."""
    found = peek(obj, kind)
    if found is None:
        found = kind()
        setattr(obj, ATTR, found)
    return found
