"""Stand-ins for smoke.server.Server and the variants' functions in tests that run no GPU server."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from smoke.server import SmokeError


def port_recording_server(ports: list[int]) -> type:
    """A Server that records the port it is given and cannot start (there is no GPU here)."""

    class NoServer:
        def __init__(self, cfg: Any, port: int, log: Any, deadline: Any = None) -> None:
            ports.append(port)

        def start(self, timeout: float) -> None:
            raise SmokeError("no GPU here")

        def past_margin(self) -> bool:
            return False

        def stop(self) -> None:
            pass

    return NoServer


class VariantRecorder:
    """Stands in for a variant's function (the smoke's run_variant and run_auto_variant, the
    feature matrix's run_variant): records each call's variant, port and thread, and how many
    calls were in flight at once. With a barrier, a call waits there for the other one (and fails
    after its timeout, instead of hanging, when the variants run one after the other)."""

    def __init__(self, barrier: threading.Barrier | None = None, slow: tuple[str, ...] = (),
                 crash: tuple[str, ...] = ()):
        self.barrier, self.slow, self.crash = barrier, slow, crash
        self.calls: list[tuple[str, int | None, str]] = []
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = 0

    def record(self, name: str, port: int | None, failure: Callable[[], Exception],
               report: dict[str, Any]) -> dict[str, Any]:
        """One call of variant `name`: `report` back, or `failure()` raised where it crashes."""
        with self.lock:
            self.calls.append((name, port, threading.current_thread().name))
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.barrier is not None:
                self.barrier.wait()
            time.sleep(0.3 if name in self.slow else 0.01)  # a slow one ends last
            if name in self.crash:
                raise failure()
            return report
        finally:
            with self.lock:
                self.in_flight -= 1
