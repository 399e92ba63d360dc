"""What a smoke run is asked: the EAGLE-3 server variants (Variant, VARIANTS), the run's options
(SmokeOptions) and the threshold every smoke entry point defaults to (DEFAULT_THRESHOLD)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sglang_image_plugin.setting import DepthSchedule
from smoke import endurance
from smoke.deadline import Deadline

# The smoke's threshold: small, so that the tiny model's load crosses it both ways in seconds. Every
# smoke entry point (`python -m smoke run` and `features`, e2e, `nox -s smoke`) takes its default
# from this one name.
DEFAULT_THRESHOLD = 4
REQUEST_TIMEOUT_S = 180  # a tiny-model request takes seconds; a hang must not outlive the deadline
# The variants' threads (side by side) save at once; the caller's save_state writes all of it.
SAVE_LOCK = threading.Lock()


@dataclass
class Variant:
    name: str
    overlap: bool
    cuda_graph: bool


VARIANTS = {"overlap": Variant("eagle_overlap", True, True),
            "sync": Variant("eagle_sync", False, False)}


def print_now(line: str) -> None:
    print(line, flush=True)


def nothing_to_save() -> None:
    pass


@dataclass
class SmokeOptions:
    models: Path
    out: Path
    threshold: int = DEFAULT_THRESHOLD  # shapes the loads (N, 8N); the server's too unless auto
    auto: bool = False  # the EAGLE-3 servers run the threshold `auto`
    # the EAGLE-3 servers run this depth schedule instead of a threshold; the loads come from its
    # edges (then `threshold` is its top edge)
    schedule: DepthSchedule | None = None
    ramp_minutes: float = 0.0  # the endurance ramp after the loads (0: none)
    ramp_hold_s: float = endurance.DEFAULT_HOLD_S
    ramp_max_growth_mib: float = endurance.DEFAULT_MAX_GROWTH_MIB
    variants: tuple[str, ...] = ("overlap", "sync")
    port: int = 30000
    mem_fraction: float = 0.15
    deadline: Deadline = field(default_factory=lambda: Deadline(time.time() + 3600))
    health_timeout: float = 480
    min_server_s: float = 150  # do not start a server with less time than this left
    cuda_graph: bool = True
    # the variants' servers side by side, each on its own port: opt-in, as it needs a GPU with
    # memory for two servers (mem_fraction each)
    parallel_variants: bool = False
    # a line as each step ends (the e2e driver: e2e.log): a call stopped from outside still shows
    # where it was
    progress: Callable[[str], None] = print_now
    # called as the resume state keeps a piece of work (the references, a variant) and as a server
    # is up: the caller may write the state and its outputs (the e2e driver: OUT, the servers' logs
    # so far in logs.tar.gz), so that a call stopped from outside leaves them
    save_state: Callable[[], None] = nothing_to_save

    def request_timeout(self) -> float:
        return self.deadline.request_timeout(REQUEST_TIMEOUT_S)

    def note(self, who: str, what: str) -> None:
        """A progress line: `who` did `what`, and the time left."""
        self.progress(f"smoke {who}: {what} (left {self.deadline.left():.0f}s)")

    def save(self) -> None:
        """save_state, one thread at a time."""
        with SAVE_LOCK:
            self.save_state()
