"""A stand-in for an SGLang server as the smoke run meets it, in a process of its own: /health,
/get_server_info, /v1/loads, /metrics, /flush_cache, greedy /generate with `input_ids` and a
`rid`, /abort_request. A loop decodes every running request at once, a step every few ms; each
step's draft depth is decided by the plugin's own policy, as in a server: DepthSchedulePolicy over
a DepthController for --speculative-depth-schedule, a SpecDisableController for
--speculative-disable-batch-threshold (their server-info views, log lines and counters are the
plugin's); neither flag: a plain server. A step at depth d decodes d + 1 tokens of a request.
Outputs are a function of the prompt alone (output_ids), at every depth, unless --wrong-at-depth D:
a token decoded at depth D is one off. --step-s S: a step every S seconds (a slow server).

    python tests/smoke/fake_schedule_server.py --port P [sglang's flags] [--wrong-at-depth D] [--step-s S]

Imported by the tests for output_ids (the plain reference a models dir's expected.json records).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# the plugin's sources: a server started by the smoke gets PYTHONPATH without them (an installed
# plugin is a server's own), and here there is none installed
PLUGIN = str(Path(__file__).resolve().parents[2] / "plugin")
VOCAB = 3000
STEP_S = 0.003


def output_ids(prompt: Sequence[int], n: int) -> list[int]:
    """The greedy output of any server here, plain or not: a function of the prompt."""
    s = sum(prompt)
    return [(s * 31 + j * 7) % (VOCAB - 3) + 3 for j in range(n)]


@dataclass
class Request:
    ids: list[int]
    max_new: int
    rid: str
    out: list[int] = field(default_factory=list)
    steps: int = 0
    aborted: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class Fake:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.lock = threading.Lock()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.by_rid: dict[str, Request] = {}
        self.steps = {"speculative": 0, "plain": 0}
        self.accepted: list[float] = []
        self.policy: Any = None
        self.controller: Any = None
        if a.speculative_depth_schedule:
            from sglang_image_plugin.depth_schedule import DepthController
            from sglang_image_plugin.policy import DepthSchedulePolicy
            from sglang_image_plugin.setting import parse_schedule, start_log_line

            schedule = parse_schedule(a.speculative_depth_schedule)
            self.policy = DepthSchedulePolicy(DepthController(schedule), log_fn=log)
            log(start_log_line(0, schedule))
        elif a.speculative_disable_batch_threshold:
            from sglang_image_plugin.setting import default_hysteresis, start_log_line
            from sglang_image_plugin.spec_disable import SpecDisableController

            n = int(a.speculative_disable_batch_threshold)
            self.controller = SpecDisableController(n, default_hysteresis(n), log_fn=log)
            log(start_log_line(n))

    def depth(self, batch_size: int) -> int:
        if self.policy is not None:
            depth: int = self.policy.get_steps_for_batch(batch_size)
            return depth
        if self.controller is not None:
            return 0 if self.controller.step(batch_size) else self.a.speculative_num_steps
        return 0

    def loop(self) -> None:
        while True:
            time.sleep(self.a.step_s)
            with self.lock:
                while self.waiting and len(self.running) < self.a.max_running_requests:
                    self.running.append(self.waiting.pop(0))
                if not self.running:
                    continue
                depth = self.depth(len(self.running))
                self.steps["plain" if depth == 0 else "speculative"] += 1
                for r in list(self.running):
                    if not r.aborted:
                        ref = output_ids(r.ids, r.max_new)
                        for _ in range(min(depth + 1, r.max_new - len(r.out))):
                            tok = ref[len(r.out)]
                            r.out.append(tok + 1 if depth == self.a.wrong_at_depth else tok)
                        r.steps += 1
                    if r.aborted or len(r.out) >= r.max_new:
                        self.running.remove(r)
                        self.accepted.append(len(r.out) / max(1, r.steps))
                        r.done.set()

    def state(self) -> dict[str, Any] | None:
        with self.lock:
            if self.policy is not None:
                st: dict[str, Any] = self.policy.snapshot()
                return st
            return self.controller.snapshot() if self.controller is not None else None

    def metrics(self) -> str:
        labels = '{model_name="fake"}'
        with self.lock:
            used = sum(len(r.ids) + len(r.out) for r in self.running)
            lines = [f"sglang:kv_used_tokens{labels} {used}", f"sglang:kv_available_tokens{labels} {100000 - used}"]
            owner = self.policy.controller if self.policy is not None else self.controller
            if owner is not None:
                plain = (self.policy.controller.depth == 0 if self.policy is not None
                         else self.controller.mode == "plain")
                lines += [f"sglang:spec_disable_plain_mode{labels} {int(plain)}",
                          f"sglang:spec_disable_speculative_steps_total{labels} {self.steps['speculative']}",
                          f"sglang:spec_disable_plain_steps_total{labels} {self.steps['plain']}"]
            if self.policy is not None and sum(self.steps.values()):
                lines.append(f"sglang:spec_disable_depth{labels} {self.policy.controller.depth}")
        return "\n".join(lines) + "\n"


def log(line: str) -> None:
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {line}", flush=True)


def handler(fake: Fake) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def send(self, body: Any, content_type: str = "application/json") -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == "/get_server_info":
                st = fake.state()
                internal = {"avg_spec_accept_length": (sum(fake.accepted) / len(fake.accepted)
                                                       if fake.accepted else None)}
                if st is not None:
                    internal["speculative_disable"] = st
                self.send({"internal_states": [internal]})
            elif path == "/v1/loads":
                with fake.lock:
                    used = sum(len(r.ids) + len(r.out) for r in fake.running)
                    self.send({"loads": [{"num_running_reqs": len(fake.running),
                                          "num_waiting_reqs": len(fake.waiting), "num_used_tokens": used,
                                          "max_total_num_tokens": 100000}]})
            elif path == "/metrics":
                self.send(fake.metrics(), "text/plain")
            else:  # /health, /flush_cache
                self.send({})

        def do_POST(self) -> None:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            path = self.path.split("?")[0]
            if path == "/abort_request":
                with fake.lock:
                    if req.get("rid") in fake.by_rid:
                        fake.by_rid[req["rid"]].aborted = True
                return self.send({})
            if path != "/generate":
                return self.send({})
            r = Request(list(req["input_ids"]), int(req["sampling_params"]["max_new_tokens"]),
                        str(req.get("rid") or id(req)))
            with fake.lock:
                fake.by_rid[r.rid] = r
                fake.waiting.append(r)
            r.done.wait()
            finish = {"type": "abort"} if r.aborted else {"type": "length"}
            meta = {"finish_reason": finish, "completion_tokens": len(r.out), "spec_verify_ct": r.steps,
                    "spec_accept_length": len(r.out) / max(1, r.steps)}
            self.send({"output_ids": r.out, "meta_info": meta})

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def main() -> None:
    sys.path.insert(0, PLUGIN)
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--speculative-depth-schedule")
    ap.add_argument("--speculative-disable-batch-threshold")
    ap.add_argument("--speculative-num-steps", type=int, default=3)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--wrong-at-depth", type=int, default=-1)
    ap.add_argument("--step-s", type=float, default=STEP_S)
    a, _ = ap.parse_known_args()
    fake = Fake(a)
    threading.Thread(target=fake.loop, daemon=True).start()
    ThreadingHTTPServer.request_queue_size = 512
    server = ThreadingHTTPServer(("127.0.0.1", a.port), handler(fake))
    server.daemon_threads = True
    log("The server is fired up and ready to roll!")
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
