"""A stand-in for an SGLang server as the router run meets it, in a process of its own (so that it
can be killed as a crashed server would be): what sglang-router asks of a worker (/health,
/server_info, /model_info), greedy /generate with `input_ids` (output ids a function of the
prompt, a few ms per token), /v1/loads, /flush_cache, and a threshold server's
speculative_disable state: a token decoded while more requests than the threshold run counts as a
plain step, otherwise as a speculative one.

    python tests/bench/fake_threshold_server.py PORT NAME THRESHOLD MODEL_DIR [--wrong]

THRESHOLD 0: a plain server (no speculative_disable state). --wrong: outputs that differ from a
plain server's.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PORT, NAME, THRESHOLD, MODEL = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
WRONG = "--wrong" in sys.argv
LOCK = threading.Lock()
STATE: dict[str, Any] = {"running": 0, "speculative_steps": 0, "plain_steps": 0, "mode_changes": 0,
                         "mode": "speculative"}


def step() -> None:
    with LOCK:
        mode = "plain" if STATE["running"] > THRESHOLD else "speculative"
        STATE["mode_changes"] += mode != STATE["mode"]
        STATE["mode"] = mode
        STATE[f"{mode}_steps"] += 1


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def send(self, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path in ("/health", "/health_generate"):
            self.send({})
        elif path in ("/model_info", "/get_model_info"):
            self.send({"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True})
        elif path in ("/server_info", "/get_server_info"):
            info: dict[str, Any] = {"tp_size": 1, "dp_size": 1, "model_path": MODEL}
            if THRESHOLD:
                with LOCK:
                    info["internal_states"] = [{"speculative_disable": {
                        "threshold": THRESHOLD, **{k: STATE[k] for k in
                                                   ("mode", "speculative_steps", "plain_steps", "mode_changes")}}}]
            self.send(info)
        elif path == "/v1/loads":
            with LOCK:
                self.send({"loads": [{"num_running_reqs": STATE["running"], "num_used_tokens": 0}]})
        elif path == "/v1/models":
            self.send({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        else:
            self.send({})

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path.split("?")[0] != "/generate":
            return self.send({})
        ids = req["input_ids"]
        with LOCK:
            STATE["running"] += 1
        try:
            out = []
            for j in range(req["sampling_params"]["max_new_tokens"]):
                time.sleep(0.01)
                step()
                out.append((sum(ids) + j + (1 if WRONG else 0)) % 97)
        finally:
            with LOCK:
                STATE["running"] -= 1
        self.send({"output_ids": out, "meta_info": {"id": NAME, "finish_reason": {"type": "length"},
                                                    "completion_tokens": len(out)}})

    def log_message(self, *args: Any) -> None:
        pass


ThreadingHTTPServer.request_queue_size = 256  # the router and the clients connect at once
server = ThreadingHTTPServer(("127.0.0.1", PORT), Handler)
server.daemon_threads = True
server.serve_forever()
