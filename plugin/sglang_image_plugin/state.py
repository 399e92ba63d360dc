"""The plugin's bookkeeping on upstream's objects: one state object on each, under one attribute.

ServerArgs carries an ArgsState (ServerArgs.__reduce__ pickles it with the record to the scheduler
processes), each EAGLE-3 worker a WorkerState and its draft worker a DraftState. `of` gives an
object's state, made on first use; `peek` reads it without making one (None: the plugin left
nothing there, e.g. a server without a threshold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from sglang_image_plugin.acceptance import AcceptanceAroundPlain
    from sglang_image_plugin.deferred_kv import DeferredDraftKv
    from sglang_image_plugin.layout import PlainLayout
    from sglang_image_plugin.plain_step import PlainStep
    from sglang_image_plugin.policy import AutoThresholdPolicy, CatchUpPolicy, DepthSchedulePolicy
    from sglang_image_plugin.setting import Setting
    from sglang_image_plugin.spec_disable import SpecDisableController

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
    controller: SpecDisableController | AutoThresholdPolicy | DepthSchedulePolicy | None = None
    auto_pending: bool = False  # `auto` waits for init_cuda_graphs to make its policy
    acceptance: AcceptanceAroundPlain | None = None  # accept length around plain phases
    plain_step: PlainStep | None = None  # resolved once, at init_cuda_graphs
    layout: PlainLayout | None = None  # the plain layout, where the scheduler runs it


@dataclass
class DraftState:
    """On EagleDraftWorker: how a plain step treats the draft."""

    catch_up: CatchUpPolicy | None = None  # whether this plain step drafts in full (K/V-only draft)
    deferred: DeferredDraftKv | None = None  # the K/V a plain-layout step left for the next
    # the overlap scheduler's FutureMap relays the proposal by request row (the plain layout's
    # scheduler): a K/V-only prefill then hands none (draft_kv.draft_extend_for_prefill)
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
