"""Stand-ins for smoke.server.Server in tests that run no GPU server."""
from __future__ import annotations

from typing import Any

from smoke.server import SmokeError


def port_recording_server(ports: list[int]) -> type:
    """A Server that records the port it is given and cannot start (there is no GPU here)."""

    class NoServer:
        def __init__(self, cfg: Any, port: int, log: Any) -> None:
            ports.append(port)

        def start(self, timeout: float) -> None:
            raise SmokeError("no GPU here")

        def stop(self) -> None:
            pass

    return NoServer
