"""The smoke's HTTP client (smoke.client) against a real HTTP server on the loopback: server-sent
events as sglang streams them, an error answer, Prometheus text."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from smoke import client

EVENTS = [{"choices": [{"text": "he"}]}, {"choices": [{"text": "llo", "finish_reason": "length"}]}]


class StreamHandler(BaseHTTPRequestHandler):
    """POST /stream: the request's JSON body echoed as a first event, then EVENTS, then [DONE], as
    sglang writes a stream (a blank line after each event). POST /fail: a 400 with a body."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/fail":
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b"max_new_tokens must be positive")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in [{"echo": body}, *EVENTS]:
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def base() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), StreamHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_stream_is_read_event_by_event_up_to_done(base):
    events = client.sse_events(base + "/stream", {"prompt": [1, 2]}, timeout=10)
    assert events == [{"echo": {"prompt": [1, 2]}}, *EVENTS]


def test_a_stream_closed_after_some_events_returns_those(base):
    assert client.sse_events(base + "/stream", {}, timeout=10, stop_after=2) == [{"echo": {}}, EVENTS[0]]


def test_an_error_answer_is_an_http_failure_naming_the_url_and_the_body(base):
    with pytest.raises(client.HTTPFailure, match=r"HTTP 400 from .*/fail: max_new_tokens must be positive"):
        client.sse_events(base + "/fail", {}, timeout=10)
    with pytest.raises(client.HTTPFailure, match=r"HTTP 400 from .*/fail"):
        client.post_json(base + "/fail", {})


def test_prometheus_parsing():
    text = ("# HELP sglang:spec_disable_plain_mode 1 while speculation is off\n"
            "# TYPE sglang:spec_disable_plain_mode gauge\n"
            'sglang:spec_disable_plain_mode{model_name="target",engine_type="unified",tp_rank="0"} 0.0\n'
            'sglang:spec_disable_plain_steps_total{model_name="target",tp_rank="0"} 57.0\n'
            'sglang:kv_available_tokens{model_name="target"} 1966080.0\n')
    m = client.parse_prometheus(text)
    assert client.metric(m, "sglang:spec_disable_plain_steps_total") == 57.0
    assert client.metric(m, "sglang:spec_disable_plain_mode") == 0.0
    assert client.metric(m, "sglang:spec_disable_speculative_steps_total") is None


# A smoke process about to hold COUNT connections: its limit raised, then that many sockets opened
OPENS = """
import resource, socket, sys
from smoke import client
count = int(sys.argv[1])
client.allow_connections(count)
sockets = [socket.socket() for _ in range(count)]
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""
REPO = Path(__file__).resolve().parents[2]


def opens(count: int, soft: int, hard: int) -> subprocess.CompletedProcess[str]:
    """OPENS in a process that starts with these limits of open files."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", OPENS, str(count)], preexec_fn=limit, env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)


def hard_limit_for(need: int) -> int:
    """A hard limit of open files at least `need` that this process may give a child (skips where
    this host's is lower)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"this host's hard limit of open files ({hard}) is below {need}")
    return 4 * need if hard == resource.RLIM_INFINITY else min(hard, 4 * need)


def test_the_smoke_raises_its_open_files_limit_for_8n_requests_at_once():
    """N=256: the smoke sends 8N = 2048 requests at once, each a connection; a container's soft
    limit is often 1024 (Docker 25 on), which ran out at about N=126."""
    count = 8 * 256
    need = count + client.SPARE_FILES
    hard = hard_limit_for(need)
    res = opens(count, 1024, hard)
    assert res.returncode == 0, res.stderr[-2000:]
    assert int(res.stdout) == need
    # a hard limit too low: refused before any request, naming the fix
    res = opens(count, 1024, 1024)
    assert res.returncode != 0
    assert f"2048 requests at once need {need} open files, and this process may open 1024" in res.stderr
    assert f"--ulimit nofile={need}" in res.stderr and "or give a smaller N" in res.stderr
    # enough already: left as it is
    res = opens(64, 1024, hard)
    assert res.returncode == 0 and int(res.stdout) == 1024, res.stderr[-2000:]
