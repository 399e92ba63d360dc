"""Free ports on loopback for the servers, registries and routers the tests start."""
from __future__ import annotations

import socket
from contextlib import ExitStack


def free_ports(n: int) -> list[int]:
    """n distinct free ports on loopback: each socket stays bound until all are chosen (one at a
    time, the kernel may hand the port it just took back a second time, and a process given two
    of them then fails to bind one)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def free_port() -> int:
    return free_ports(1)[0]
