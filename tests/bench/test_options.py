"""`bench run`'s options (bench.options): the defaults, the values refused by flag, and the
state a resumed call must match."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import options
from bench.__main__ import build_parser
from tests.bench.conftest import bench_options


def test_state_file_of_other_options_is_refused(tmp_path):
    opts = bench_options("--pairs", "2")
    state, save = options.load_state(tmp_path / "s.json", opts)
    state["blocks_done"] = ["1:0"]
    save({})
    assert options.load_state(tmp_path / "s.json", bench_options("--pairs", "2"))[0]["blocks_done"] == ["1:0"]
    # where the servers run and whether this call only launches them: the same measurement
    assert options.load_state(tmp_path / "s.json", bench_options("--pairs", "2", "--port", "31000"))[0]
    with pytest.raises(SystemExit, match="--state .*other options"):
        options.load_state(tmp_path / "s.json", bench_options("--pairs", "3"))


def test_loads_are_measured_in_the_order_given():
    """A switching server carries what one load taught it into the next: 256 then 192 shows a
    crossover learned at the higher load, which a rising order never does."""
    from bench import throughput

    bench = throughput.Bench(bench_options("--concurrency", "256,192", "--pairs", "2"), {"partial": {"calls": 1}},
                             100, ["plain"], None)
    assert bench.blocks_left() == [(256, 0), (256, 1), (192, 0), (192, 1)]


def test_options_and_refused_values():
    o = bench_options()
    assert o.concurrency == (1, 4, 16, 64, 256) and o.configs == options.DEFAULT_CONFIGS == ("plain", "eagle3", "eagle3_thr")
    assert o.pairs == 6 and o.window_s == 3.0 and o.settle_s == 1.0 and o.out == Path("out/bench")
    assert o.registry is None and o.cpus_per_server == 0  # pinning is asked for, not the default
    o = bench_options("--concurrency", "256,1,8", "--configs", "plain,plain_twin,eagle3_auto",
                      "--server-args", "--gc-threshold 7 8", "--threshold", "32,8", "--state", "st.json")
    assert o.concurrency == (256, 1, 8) and o.configs == ("plain", "plain_twin", "eagle3_auto")
    assert o.thresholds == (8, 32) and o.server_args == ("--gc-threshold", "7", "8")
    assert o.registry == Path("st.json.servers.json")
    for flags, word in ((("--configs", "plain,nope"), "--configs"), (("--configs", "plain,plain"), "--configs"),
                        (("--configs", "plain_twin,eagle3"), "add plain"),
                        (("--configs", "plain,eagle3_twin"), "eagle3_twin is measured against eagle3: add eagle3"),
                        (("--concurrency", "1,0"), "--concurrency"), (("--concurrency", "1,x"), "--concurrency"),
                        (("--threshold", "0"), "--threshold"), (("--threshold", "8,8"), "--threshold"),
                        (("--threshold", "auto"), "--threshold"), (("--pairs", "-1"), "--pairs"),
                        (("--pairs", "0", "--ramp-cycles", "0"), "--ramp-cycles"),
                        (("--ramp-hold", "0"), "--ramp-hold"), (("--mem-share", "1.5"), "--mem-share"),
                        (("--max-total-tokens", "-1"), "--max-total-tokens"), (("--output-len", "0"), "--output-len"),
                        (("--window-s", "0"), "--window-s"), (("--settle-s", "-1"), "--settle-s"),
                        (("--cpus-per-server", "-1"), "--cpus-per-server"),
                        (("--output-spread", "1"), "--output-spread"), (("--output-spread", "-0.1"), "--output-spread"),
                        (("--auto-learn-s", "-1"), "--auto-learn-s"),
                        (("--launch-only",), "--launch-only needs --state")):
        with pytest.raises(SystemExit, match=word):
            bench_options(*flags)
    ap = argparse.ArgumentParser()
    options.add_arguments(ap)
    with pytest.raises(SystemExit, match="--models"):
        options.options(ap.parse_args([]))
    e2e = build_parser().parse_args(["e2e", "--bench-pairs", "5", "--bench-configs", "plain,eagle3_thr"])
    assert options.tuning_options(e2e, "bench-")["pairs"] == 5
    with pytest.raises(SystemExit, match="--bench-pairs"):
        options.tuning_options(build_parser().parse_args(["e2e", "--bench-pairs", "-2"]), "bench-")
    assert bench_options("--pairs", "0", "--ramp-cycles", "1").pairs == 0  # the ramp alone
