"""The router run of the GPU host (bench.router, the e2e driver's `router` phase) on the CPU: the
real sglang-router, started with the flags deploy/ renders, in front of two stand-in threshold
servers in processes of their own (tests/bench/fake_threshold_server.py), and a stand-in plain server.
The run must cross each server's threshold both ways, compare every output with the plain
server's, and lose no request when the second server is killed with requests in flight."""
from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from bench import router
from smoke.deadline import Deadline
from smoke.server import ServerConfig
from tests.bench.conftest import free_port_base
from tests.deploy_checks import need

FAKE = Path(__file__).with_name("fake_threshold_server.py")


class FakeThresholdServer(ServerConfig):
    """The run's own config of a server, started as the stand-in instead of sglang."""

    wrong: bool = False

    def argv(self, port: int) -> list[str]:
        threshold = int(self.threshold) if self.threshold is not None else 0
        return [sys.executable, str(FAKE), str(port), self.name, str(threshold), str(self.model),
                *(["--wrong"] if self.wrong else [])]


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """The run's servers become stand-ins; set wrong[name] to make one answer differently."""
    if importlib.util.find_spec("sglang_router") is None:
        need("sglang-router", "the test dependency group installs it")
    wrong: dict[str, bool] = {}
    configs = router.server_configs

    def fake_configs(opts: router.RouterOptions) -> dict[str, ServerConfig]:
        out: dict[str, ServerConfig] = {}
        for name, cfg in configs(opts).items():
            fake = FakeThresholdServer(name, cfg.model, draft=cfg.draft, threshold=cfg.threshold)
            fake.wrong = wrong.get(name, False)
            out[name] = fake
        return out

    monkeypatch.setattr(router, "server_configs", fake_configs)
    return wrong


def options(tmp_path: Path, **kw: object) -> router.RouterOptions:
    (tmp_path / "models" / "target").mkdir(parents=True, exist_ok=True)
    (tmp_path / "models" / "expected.json").write_text(json.dumps({"vocab_size": 3072}))
    base = {"threshold": 4, "levels": (2, 24, 8, 24), "requests_per_client": 2, "output_len": 20,
            "kill_level": 3, "kill_when_running": 2,
            # the servers take port, port + 1 and port + 2: all three free, below the ephemeral range
            # (one free port there and the next two taken by a client socket failed a full run)
            "port": free_port_base(4),
            "deadline": Deadline(time.time() + 300)}
    base.update(kw)
    return router.RouterOptions(models=tmp_path / "models", out=tmp_path / "out", **base)  # type: ignore[arg-type]


def test_a_server_killed_mid_load_costs_no_request_and_each_crosses_its_threshold(fakes, tmp_path):
    rep = router.run_router(options(tmp_path))
    assert rep["failures"] == [], rep["summary"]
    assert rep["requests"] == 2 * (2 + 24 + 8 + 24) and rep["errors"] == 0
    assert rep["compared"] == rep["requests"] and rep["mismatches"] == 0
    # the kill met requests in flight on the killed server, and the router answered them elsewhere
    assert rep["killed"]["server"] == "worker-1" and rep["killed"]["running_on_it"] >= 2
    assert rep["levels"][3]["steps"]["worker-1"] is None  # gone after the kill
    # 2 clients: speculative steps, never a plain one (the router may send both to one server;
    # each server's speculating at some level is the run's own check, failures == [] above);
    # 24 clients over two servers: about 12 each, plain steps on both
    assert sum(rep["levels"][0]["steps"][w]["speculative"] for w in router.WORKERS) > 0
    for w in router.WORKERS:
        assert rep["levels"][0]["steps"][w]["plain"] == 0
        assert rep["levels"][1]["steps"][w]["plain"] > 0
    # the router ran with the flags deploy/ renders, on loopback
    flags = rep["router_flags"]
    assert flags[flags.index("--policy") + 1] == "cache_aware"
    assert flags[flags.index("--cb-failure-threshold") + 1] == "3"
    assert flags[flags.index("--host") + 1] == "127.0.0.1"
    assert (tmp_path / "out" / "router.json").exists()
    assert "0 failed" in rep["summary"] and "killed worker-1" in rep["summary"]


def test_a_kill_that_meets_no_request_in_flight_fails_the_run(fakes, tmp_path):
    # On the H200 a fixed delay met a drained server (the level took 1.6 s, the kill came at 3 s):
    # a kill that cannot lose a request proves nothing, and says so instead of passing.
    rep = router.run_router(options(tmp_path, levels=(2, 8), kill_level=1, kill_when_running=10**6,
                                    kill_wait_s=0.3))
    assert rep["killed"]["server"] == "worker-1" and rep["killed"]["running_on_it"] < 10**6
    assert any("no request could be lost" in f and "worker-1" in f for f in rep["failures"]), rep["failures"]


def round_robin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's router with its rendered flags, its policy pinned to round robin: the servers
    take the requests in turn (the rendered cache_aware may send every request to one)."""
    rendered = router.rendered_router_flags

    def pinned(replicas: int, threshold: int) -> list[str]:
        flags = rendered(replicas, threshold)
        flags[flags.index("--policy") + 1] = "round_robin"
        return flags

    monkeypatch.setattr(router, "rendered_router_flags", pinned)


def test_outputs_that_differ_from_plain_fail_the_run(fakes, tmp_path, monkeypatch):
    # Deterministic: in turn, worker-0 answers half of the 20 requests, each of them wrong (with
    # cache_aware it could get none of them, and the run pass by luck).
    round_robin(monkeypatch)
    fakes["worker-0"] = True
    rep = router.run_router(options(tmp_path, levels=(2, 8), kill_level=-1))
    assert rep["router_flags"][rep["router_flags"].index("--policy") + 1] == "round_robin"
    assert rep["requests"] == 20 and rep["mismatches"] == 10 and rep["errors"] == 0
    assert any("differ from the plain server's" in f for f in rep["failures"])
    # and 8 clients over two servers never reach threshold 4's plain mode: said, not passed
    assert any("did not cross its threshold 4 both ways" in f for f in rep["failures"])


def test_the_rendered_router_flags_map_onto_loopback():
    rendered = router.rendered_router_flags(2, 16)
    argv = router.on_loopback(rendered, ["http://127.0.0.1:1", "http://127.0.0.1:2"], 5, 6)
    urls = argv[argv.index("--worker-urls") + 1:argv.index("--worker-urls") + 3]
    assert urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert argv[argv.index("--port") + 1] == "5" and argv[argv.index("--prometheus-port") + 1] == "6"
    assert len(argv) == len(rendered)


def test_the_e2e_router_phase_runs_on_the_1b_models_and_fails_with_the_run(tmp_path, monkeypatch):
    import os

    from bench import e2e
    from bench.__main__ import build_parser

    seen: dict[str, router.RouterOptions] = {}

    def run_router(opts: router.RouterOptions) -> dict[str, object]:
        seen["opts"] = opts
        return {"failures": ["worker-0: the load did not cross its threshold 8 both ways"],
                "summary": "router in front of worker-0, worker-1"}

    monkeypatch.setattr(router, "run_router", run_router)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    drv = e2e.E2E(build_parser().parse_args([
        "e2e", "--bundle", str(tmp_path / "bundle"), "--state", str(tmp_path / "state"), "--out",
        str(tmp_path / "out"), "--phases", "router", "--router-threshold", "8", "--router-levels", "2,40"]))
    drv.call.deadline.at = time.time() + 600
    assert drv.run() == 1
    opts = seen["opts"]
    assert opts.models == tmp_path / "state" / "models" / "1b"
    assert (opts.threshold, opts.levels, opts.kill_level) == (8, (2, 40), 1)
    log = (tmp_path / "out" / "e2e.log").read_text()
    assert "FAILED router: worker-0: the load did not cross" in log
    with pytest.raises(SystemExit, match="--router-levels 2,x"):
        e2e.main(build_parser().parse_args(["e2e", "--router-levels", "2,x"]))
