"""The real sglang-router (the PyPI package, the version the image carries) with the flags the
router topology renders, on loopback in front of two stand-in SGLang servers: it routes, it
survives a server's death, and health flows from the servers to the router's readiness (what
its Kubernetes readiness probe and Compose healthcheck read)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests

from bench import router as router_run
from sglang_image import topology
from tests.build.sglang_workers import Worker, workers
from tests.deploy_checks import expand, flags, need
from tests.ports import free_port, free_ports

DEADLINE_S = 60  # each wait below; the router checks health every second here


def wait_until(what: str, check: Callable[[], bool], log: Path) -> None:
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        try:
            if check():
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not within {DEADLINE_S}s: {what}\n{log.read_text()[-3000:]}")


def loopback_argv(rendered: tuple[str, ...], urls: dict[str, str], port: int,
                  metrics: int, *, fast_health: bool) -> list[str]:
    """The rendered router flags with the servers' and the router's addresses on loopback (as
    the GPU host's router run maps them) and, with `fast_health`, the health checks every second
    (the rendered pace is 10 s) and an open circuit closed after 2 s (60 s)."""
    argv = router_run.on_loopback(list(rendered), [urls[u] for u in rendered if u in urls], port, metrics)
    if fast_health:  # and an open circuit closes after 2 s, not 60
        argv += ["--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                 "--health-success-threshold", "1", "--cb-timeout-duration-secs", "2"]
    return argv


class Router:
    def __init__(self, base: str) -> None:
        self.base = base
        self.headers: dict[str, str] = {}

    def readiness(self) -> tuple[int, dict[str, Any]]:
        r = requests.get(f"{self.base}/readiness", timeout=5)
        return r.status_code, r.json()

    def healthy(self) -> dict[str, bool]:
        listed = requests.get(f"{self.base}/workers", timeout=5).json()["workers"]
        return {w["url"]: w["is_healthy"] for w in listed}

    def generate(self, text: str) -> requests.Response:
        return requests.post(f"{self.base}/generate", timeout=30, headers=self.headers,
                             json={"text": text, "sampling_params": {"max_new_tokens": 1}})


@contextmanager
def router_process(argv: list[str], log: Path,
                   stopped: list[subprocess.Popen[bytes]] | None = None, *,
                   entrypoint: list[str] | None = None,
                   env: dict[str, str] | None = None) -> Iterator[Router]:
    """The router on loopback until the block ends (`stopped`: its process, for a test that
    stops it itself; `entrypoint`: what starts it, else `python -m sglang_router...`)."""
    if importlib.util.find_spec("sglang_router") is None:
        need("sglang-router", "the test dependency group installs it")
    port = argv[argv.index("--port") + 1]
    # Nothing leaves the host: were the router to look for a tokenizer on a hub, it would
    # ask a closed port on loopback (the test then fails on its log).
    env = {**os.environ, **(env or {}), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    start = entrypoint or [sys.executable, "-m", topology.ROUTER_MODULE]
    with log.open("w") as out:
        proc = subprocess.Popen([*start, *argv], stdout=out, stderr=subprocess.STDOUT, env=env)
    if stopped is not None:
        stopped.append(proc)
    try:
        router = Router(f"http://127.0.0.1:{port}")
        wait_until("the router answers /liveness",
                   lambda: requests.get(f"{router.base}/liveness", timeout=2).ok, log)
        yield router
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # It read the servers' tokenizer where they report their model (a local folder here, the
    # models volume in the manifests), and asked no hub for it.
    assert "HuggingFace" not in log.read_text() and "Loading tokenizer" in log.read_text()


def start(tmp_path: Path, servers: list[Worker], *, fast_health: bool, **settings: Any
          ) -> tuple[list[str], Path]:
    s = topology.check(topology.Settings(model_path="m", draft_model_path="d",
                                         replicas=len(servers), **settings))
    urls = dict(zip(topology.worker_urls(s), (w.url for w in servers), strict=True))
    argv = loopback_argv(topology.router_args(s, "compose"), urls, *free_ports(2),
                         fast_health=fast_health)
    assert flags(argv)["--worker-urls"] == [w.url for w in servers]
    return argv, tmp_path / "router.log"


def all_answered_by(router: Router, survivor: Worker, count: int) -> None:
    """After a server's death: `count` requests, each answered by `survivor`, none failed."""
    before = survivor.generated()
    for i in range(count):
        reply = router.generate(f"after {i}")
        assert reply.status_code == 200, reply.text
        assert reply.json()["text"] == f"{survivor.name}: after {i}"
    assert survivor.generated() == before + count


def test_a_server_death_costs_no_request(tmp_path: Path) -> None:
    """At the rendered pace (a health check every 10 s): the requests that meet a dead server are
    retried on the live one at once, none fails. (With the router's default circuit breaker, 10
    failures where a request makes 5 attempts, the first two after a death fail.)"""
    with workers(tmp_path, "worker-0", "worker-1") as servers:
        argv, log = start(tmp_path, servers, fast_health=False)
        with router_process(argv, log) as router:
            wait_until("both servers healthy", lambda: router.readiness()[1].get(
                "healthy_workers") == 2, log)
            for i in range(6):
                assert router.generate(f"warm {i}").status_code == 200
            busy, other = sorted(servers, key=Worker.generated, reverse=True)
            assert busy.generated() > 0
            busy.stop()
            all_answered_by(router, other, 8)


def test_health_flows_from_the_servers_to_the_router(tmp_path: Path) -> None:
    """Health checks every second here: a server joins once healthy, is routed to, leaves when
    it dies, the router is not ready without a healthy server, and a restarted one comes back."""
    with workers(tmp_path, "worker-0", "worker-1") as (first, second):
        second.healthy = False  # still loading its model: SGLang answers /health with 503
        argv, log = start(tmp_path, [first, second], fast_health=True)
        with router_process(argv, log) as router:
            # Health flows: ready with the one healthy server; the starting one waits outside.
            wait_until("ready with one healthy server",
                       lambda: router.readiness() == (200, {"status": "ready",
                                                            "healthy_workers": 1,
                                                            "total_workers": 1}), log)
            for i in range(4):
                reply = router.generate(f"early {i}")
                assert reply.status_code == 200 and reply.json()["text"] == f"worker-0: early {i}"
            second.healthy = True
            wait_until("the second server joins once healthy",
                       lambda: router.healthy() == {first.url: True, second.url: True}, log)
            # It routes: distinct prompts, each answered by a server, the text passed through.
            for i in range(8):
                reply = router.generate(f"prompt {i} " * (i + 1))
                assert reply.status_code == 200, reply.text
                assert reply.json()["text"].split(": ", 1)[1] == f"prompt {i} " * (i + 1)
            assert first.generated() + second.generated() == 12
            # A server dies: every request still gets an answer, from the other one.
            first.stop()
            all_answered_by(router, second, 6)
            wait_until("the dead server is marked unhealthy",
                       lambda: router.healthy() == {first.url: False, second.url: True}, log)
            assert router.readiness()[0] == 200
            # The last healthy one falls ill: the router is not ready (its probe takes it out of
            # the Service) and says why.
            second.healthy = False
            wait_until("not ready without a healthy server",
                       lambda: router.readiness()[0] == 503, log)
            assert router.readiness()[1]["reason"] == "insufficient healthy workers"
            assert router.generate("nobody").status_code == 503
            # A server back on its address (a restarted pod) is routed to again.
            back = Worker("worker-0-restarted", tmp_path, first.port)
            try:
                wait_until("ready again", lambda: router.readiness()[0] == 200, log)
                wait_until("routed to again (once its circuit closes)",
                           lambda: router.generate("welcome back").json().get("text")
                           == "worker-0-restarted: welcome back", log)
            finally:
                back.stop()
    # What the router asked of a server: health, then its metadata, then the requests it routed.
    asked = first.paths()
    assert {"/health", "/generate"} <= asked
    assert asked & {"/server_info", "/get_server_info"} and asked & {"/model_info",
                                                                     "/get_model_info"}


def test_a_stopping_router_answers_what_it_passed_on(tmp_path: Path) -> None:
    """SIGTERM (a rolling update, `docker compose down`) mid-request: with the rendered
    --shutdown-grace-period-secs the router takes no new connection and waits for the requests
    it passed on, then exits; the servers, draining shorter, answer them."""
    import threading

    with workers(tmp_path, "worker-0") as (server,):
        server.delay = 4.0  # a request still decoding when the router is told to stop
        argv, log = start(tmp_path, [server], fast_health=True, drain_seconds=10,
                          router_drain_seconds=20)
        assert flags(argv)["--shutdown-grace-period-secs"] == ["20"]
        stopped: list[subprocess.Popen[bytes]] = []
        with router_process(argv, log, stopped) as router:
            wait_until("ready", lambda: router.readiness()[0] == 200, log)
            replies: list[requests.Response] = []
            in_flight = threading.Thread(target=lambda: replies.append(router.generate("long")))
            in_flight.start()
            wait_until("the request reached the server", lambda: server.generated() == 1, log)
            (proc,) = stopped
            sent = time.monotonic()
            proc.terminate()
            wait_until("no new connection taken", lambda: not reachable(router), log)
            in_flight.join()
            assert proc.wait(timeout=30) == 0
            assert replies[0].status_code == 200 and replies[0].json()["text"] == "worker-0: long"
            assert time.monotonic() - sent < 20  # it left once the request was answered


def test_the_compose_router_takes_the_key_of_the_env_file(tmp_path: Path) -> None:
    """The Compose router as rendered with api_key_env_file, started by its own entrypoint (the
    shell, SGLANG_IMAGE_API_KEY as Compose gives it from the file) in front of servers that
    require the key: it passes the key to them, and requires it of its clients."""
    from sglang_image import deploy

    key = "k3y-from-the-env-file"
    env_file = tmp_path / "sglang.env"
    env_file.write_text(f"{deploy.API_KEY_ENV}={key}\n")
    with workers(tmp_path, "worker-0", "worker-1") as servers:
        for server in servers:
            server.api_key = key
        s = topology.check(topology.Settings(model_path="m", draft_model_path="d",
                                             api_key_env_file=str(env_file)))
        service = deploy.compose_router(s, "image")["services"]["sglang-router"]
        assert service["env_file"] == [str(env_file)]
        # What the container runs: Compose turns $$ into $; this host's python for the image's.
        entrypoint = [a.replace("$$", "$").replace(deploy.PYTHON, sys.executable)
                      for a in service["entrypoint"]]
        urls = dict(zip(topology.worker_urls(s), (w.url for w in servers), strict=True))
        argv = loopback_argv(tuple(service["command"]), urls, *free_ports(2),
                             fast_health=True)
        log = tmp_path / "router.log"
        with router_process(argv, log, entrypoint=entrypoint,
                            env={deploy.API_KEY_ENV: key}) as router:
            wait_until("both servers healthy", lambda: router.readiness()[1].get(
                "healthy_workers") == 2, log)
            assert router.generate("no key").status_code == 401
            router.headers = {"Authorization": "Bearer wrong"}
            assert router.generate("a wrong key").status_code == 401
            router.headers = {"Authorization": f"Bearer {key}"}
            reply = router.generate("with the key")
            assert reply.status_code == 200, reply.text
            assert reply.json()["text"].endswith(": with the key")
        assert sum(w.generated() for w in servers) == 1


def reachable(router: Router) -> bool:
    try:
        router.generate("new")
    except requests.ConnectionError:
        return False
    return True


def test_the_stand_in_dies_as_a_crashed_server(tmp_path: Path) -> None:
    """Stopping a stand-in closes its kept-alive connections too (else a router would keep
    reaching a 'dead' server through them and the test above could not fail)."""
    with workers(tmp_path, "w") as (w,), requests.Session() as session:
        assert session.get(f"{w.url}/health", timeout=5).status_code == 200
        w.stop()
        with pytest.raises(requests.ConnectionError):
            session.get(f"{w.url}/health", timeout=5)


def test_the_router_takes_the_kubernetes_discovery_flags() -> None:
    """On Kubernetes the router finds its workers by label in its own namespace (which a Role
    allows): its own parser takes the rendered flags, with $(POD_NAMESPACE) as the pod has it."""
    if importlib.util.find_spec("sglang_router") is None:
        need("sglang-router", "the test dependency group installs it")
    from sglang_router.launch_router import parse_router_args

    s = topology.check(topology.Settings(model_path="m", draft_model_path="d"))
    rendered = topology.router_args(s, "kubernetes")
    assert "--worker-urls" not in rendered
    args = parse_router_args([expand(a, {topology.NAMESPACE_ENV: "llm"}) for a in rendered])
    assert args.service_discovery and not args.worker_urls
    assert args.selector == topology.router_worker_labels(s)
    assert args.selector[topology.MODEL_LABEL] == "m"  # the model: not another model's servers
    assert args.service_discovery_namespace == "llm"
    assert args.service_discovery_port == topology.SERVER_PORT


def test_the_router_takes_the_rendered_health_check() -> None:
    """Its own parser reads the health check as rendered: the servers' readiness pace (period,
    timeout, failures), not its defaults (5 s, 3 failures), on Kubernetes and on one box."""
    if importlib.util.find_spec("sglang_router") is None:
        need("sglang-router", "the test dependency group installs it")
    from sglang_router.launch_router import parse_router_args

    s = topology.check(topology.Settings(model_path="m", draft_model_path="d",
                                         health_period_seconds=40, health_timeout_seconds=35,
                                         health_failures=5))
    for platform in ("kubernetes", "compose"):
        rendered = topology.router_args(s, platform)
        args = parse_router_args([expand(a, {topology.NAMESPACE_ENV: "llm"}) for a in rendered])
        assert (args.health_check_interval_secs, args.health_check_timeout_secs,
                args.health_failure_threshold) == (40, 35, 5), platform
        assert args.health_check_endpoint == "/health"
