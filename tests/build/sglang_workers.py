"""Stand-ins for SGLang servers behind sglang-router: small HTTP servers on loopback that answer
the endpoints the router calls (what sglang-router 0.3.2 asks of a worker: /health at start and
on every health check, /server_info and /model_info, with the older /get_* names as its fallback,
then the requests it routes) and record each request they get."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class Worker:
    """One stand-in server on 127.0.0.1:`port` (0: any free port); `healthy` is what /health
    answers; `stop()` closes the port, as a crashed server's would be. `model`: the model path it
    reports, where the router looks for the tokenizer (a folder that exists: never a hub name).
    `delay`: seconds each /generate takes (a long request in flight). `api_key`: what it then
    requires, as SGLang's --api-key does (`Authorization: Bearer KEY` on all but /health)."""

    def __init__(self, name: str, model: Path, port: int = 0) -> None:
        self.name = name
        self.model = str(model)
        self.healthy = True
        self.delay = 0.0
        self.api_key: str | None = None
        self.requests: list[tuple[str, str]] = []  # (method, path), in order
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def generated(self) -> int:
        with self._lock:
            return sum(1 for method, path in self.requests if path == "/generate")

    def paths(self) -> set[str]:
        with self._lock:
            return {path for _, path in self.requests}

    def stop(self) -> None:
        """Closes the port and every open connection (the router keeps connections alive)."""
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            for connection in self._connections:
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._thread.join(timeout=10)

    def _record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with worker._lock:
                    worker._connections.add(self.connection)

            def finish(self) -> None:
                with worker._lock:
                    worker._connections.discard(self.connection)
                super().finish()

            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _refused(self, path: str) -> bool:
                """SGLang's check of the key (sglang/srt/utils/auth.py): 401 without it."""
                key = worker.api_key
                if key is None or path.startswith(("/health", "/ready", "/metrics")) or \
                        self.headers.get("Authorization") == f"Bearer {key}":
                    return False
                self._send(401, {"error": "Unauthorized"})
                return True

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                worker._record("GET", path)
                if self._refused(path):
                    return
                if path in ("/health", "/health_generate"):
                    self._send(200 if worker.healthy else 503, {})
                elif path in ("/model_info", "/get_model_info"):
                    self._send(200, {"model_path": worker.model, "tokenizer_path": worker.model,
                                     "is_generation": True})
                elif path in ("/server_info", "/get_server_info"):
                    self._send(200, {"tp_size": 1, "dp_size": 1, "model_path": worker.model})
                elif path == "/v1/models":
                    self._send(200, {"object": "list",
                                     "data": [{"id": worker.model, "object": "model"}]})
                else:
                    self._send(404, {"error": f"no {path} here"})

            def do_POST(self) -> None:
                path = self.path.split("?")[0]
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                worker._record("POST", path)
                if self._refused(path):
                    return
                if path == "/generate":
                    text = json.loads(body or b"{}").get("text", "")
                    time.sleep(worker.delay)
                    self._send(200, {"text": f"{worker.name}: {text}",
                                     "meta_info": {"id": "0", "finish_reason": {"type": "length"},
                                                   "completion_tokens": 1}})
                else:
                    self._send(404, {"error": f"no {path} here"})

        return Handler


@contextmanager
def workers(model: Path, *names: str) -> Iterator[list[Worker]]:
    started = [Worker(name, model) for name in names]
    try:
        yield started
    finally:
        for w in started:
            try:
                w.stop()
            except OSError:
                pass
