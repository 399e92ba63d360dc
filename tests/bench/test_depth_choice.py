"""The depth schedule a bench of fixed depths measured best (bench.depth_choice): the best depth per
load within blocks, never deeper at a larger load, edges between the loads, the launch flags."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from bench import depth_choice, options, pairing, throughput
from bench.__main__ import build_parser, main
from sglang_image_plugin.setting import parse_schedule
from tests.bench.conftest import bench_options
from tests.bench.test_merge import MODEL

LEVELS = (1, 16, 32, 64, 128, 256)
# tokens/s over plain's per depth and load: deep drafts pay at light load, plain past 128
SPEED = {1: {0: 1.0, 3: 2.5, 5: 2.9, 7: 3.1}, 16: {0: 1.0, 3: 2.2, 5: 2.5, 7: 2.6},
         32: {0: 1.0, 3: 1.9, 5: 2.0, 7: 1.95}, 64: {0: 1.0, 3: 1.6, 5: 1.5, 7: 1.3},
         128: {0: 1.0, 3: 1.3, 5: 1.1, 7: 0.9}, 256: {0: 1.0, 3: 0.9, 5: 0.8, 7: 0.7}}
DEPTH = {"plain": 0, "eagle3": 3, "eagle3_depth5": 5, "eagle3_depth7": 7}


def result(speed: dict[int, dict[int, float]] = SPEED,
           configs: tuple[str, ...] = ("plain", "eagle3", "eagle3_depth")) -> dict:
    """A result as a `bench run` call of these servers makes it, each window at `speed` times
    plain's, on a host whose speed drifts from block to block (the ratios within a block stay)."""
    o = options.BenchOptions(models=Path("m"), out=Path("o"), concurrency=LEVELS, configs=configs, pairs=3,
                             depths=(5, 7))
    res = throughput.new_result(o, MODEL)
    names = options.server_names(o)
    res.update(configs=names, config_records={n: rec.as_dict() for n, rec in options.config_records(o).items()})
    for c in LEVELS:
        res["blocks"][str(c)] = [
            {"block": k + 1, "order": pairing.block_order(names, k),
             "windows": {n: {"tok_per_s": 100.0 * c * (1.0, 0.7, 1.2)[k] * speed[c].get(DEPTH.get(n, 3), 1.0),
                             "errors": 0} for n in names}}
            for k in range(3)]
    return res


def test_the_best_depth_at_each_load_becomes_tiers_with_edges_between_the_loads():
    loads, left_out, not_compared = depth_choice.choose(result())
    assert [ld.best for ld in loads] == [ld.kept for ld in loads] == [7, 7, 5, 3, 3, 0]
    assert all(ld.kept_over_best == 1.0 and ld.via is None for ld in loads) and left_out == not_compared == []
    assert loads[2].best_over_next is not None and loads[2].best_over_next.median == pytest.approx(2.0 / 1.95)
    text = depth_choice.schedule_text(loads)
    assert text == "1-22:7,23-45:5,46-181:3,182-:0"  # isqrt(16*32) = 22, (32*64) 45, (128*256) 181
    assert [t.depth for t in parse_schedule(text).tiers] == [7, 5, 3, 0]
    assert depth_choice.launch_flags(loads).startswith(
        "--speculative-num-steps 7 --speculative-num-draft-tokens 8 --speculative-depth-schedule 1-22:7,")


def test_a_larger_load_never_gets_a_deeper_draft_than_a_smaller_one():
    # at 64 depth 5 measured a hair ahead of 3 though 32 had 3 best: the schedule keeps 3 at both
    # sides or 5 at both, whichever loses less in all (here 3 at 32 and 64, 5 at 64 given up)
    speed = {**SPEED, 32: {0: 1.0, 3: 2.0, 5: 1.8, 7: 1.7}, 64: {0: 1.0, 3: 1.60, 5: 1.62, 7: 1.3}}
    loads, _, _ = depth_choice.choose(result(speed))
    assert [ld.best for ld in loads] == [7, 7, 3, 5, 3, 0]
    assert [ld.kept for ld in loads] == [7, 7, 3, 3, 3, 0]
    assert loads[3].kept_over_best == pytest.approx(1.60 / 1.62)
    assert depth_choice.schedule_text(loads) == "1-22:7,23-181:3,182-:0"
    assert all(a.kept >= b.kept for a, b in itertools.pairwise(loads))


def test_only_servers_of_one_depth_each_count_and_fewer_than_two_are_refused():
    loads, left_out, _ = depth_choice.choose(result(configs=("plain", "eagle3", "eagle3_depth",
                                                          "eagle3_upstream_combine")))
    assert left_out == ["eagle3_upstream_combine"] and [ld.kept for ld in loads] == [7, 7, 5, 3, 3, 0]
    with pytest.raises(depth_choice.NoDepths, match=r"servers of 1 draft depth\(s\) \(eagle3\)"):
        depth_choice.choose(result(configs=("eagle3", "eagle3_upstream_combine")))


def test_the_command_prints_the_table_and_the_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(result()))
    assert main(["schedule", str(path)]) == 0
    out = capsys.readouterr().out
    # at 32 requests, the median block (drift 1.0): depth 7, 5, 3, plain
    assert "| 32 | 6,240 | 6,400 | 6,080 | 3,200 | 5 | 5 | 1.00x | 1.03x [1.03-1.03] |" in out
    assert out.rstrip().endswith("(edges: the geometric middle of the loads measured on either side)")
    path.write_text("{}")
    with pytest.raises(SystemExit, match="servers of 0 draft depth"):
        main(["schedule", str(path)])


def test_a_server_that_did_not_start_is_no_depth_to_choose_from():
    res = result()
    res["configs"].remove("eagle3_depth7")  # configured, but it never started (not_run)
    for blocks in res["blocks"].values():
        for block in blocks:
            del block["windows"]["eagle3_depth7"]
    loads, left_out, _ = depth_choice.choose(res)
    assert [ld.kept for ld in loads] == [5, 5, 5, 3, 3, 0] and left_out == []


def test_depths_of_two_calls_are_compared_through_the_server_both_ran():
    # one card holds three 8B servers: plain, eagle3 and depth 5 in one call, eagle3 and depth 7 in
    # another, on a host 30% slower; merged, no block holds every depth, and each depth is set
    # against eagle3 within its own blocks
    first, second = result(configs=("plain", "eagle3", "eagle3_depth")), result(configs=("plain", "eagle3", "eagle3_depth"))
    for c, blocks in first["blocks"].items():
        for block, other in zip(blocks, second["blocks"][c], strict=True):
            del block["windows"]["eagle3_depth7"]
            other["windows"] = {n: {**w, "tok_per_s": 0.7 * w["tok_per_s"]} for n, w in other["windows"].items()
                                if n in ("eagle3", "eagle3_depth7")}
    merged = {**first, "blocks": {c: blocks + second["blocks"][c] for c, blocks in first["blocks"].items()}}
    loads, left_out, not_compared = depth_choice.choose(merged)
    assert [ld.best for ld in loads] == [ld.kept for ld in loads] == [7, 7, 5, 3, 3, 0]
    assert {ld.via for ld in loads} == {"eagle3"} and left_out == not_compared == []
    # at 32 depth 5 (2.0x plain) over depth 7 (1.95x), each over eagle3 (1.9x) in its own blocks
    assert loads[2].best_over_next is not None and loads[2].best_over_next.median == pytest.approx(2.0 / 1.95)
    md = "\n".join(depth_choice.render(*depth_choice.choose(merged)))
    assert "| 1.03x [1.03-1.03]+ |" in md and "+: no block held every depth (merged calls): each depth over eagle3" in md
    # plain in a call of its own beside eagle3: the load is compared through eagle3, and a depth
    # kept below the best (64 keeps 3 though 5 led there) is priced within the blocks holding both
    speed = {**SPEED, 32: {0: 1.0, 3: 2.0, 5: 1.8, 7: 1.7}, 64: {0: 1.0, 3: 1.60, 5: 1.62, 7: 1.3}}
    slow = result(speed)
    for blocks in slow["blocks"].values():
        for block in blocks:
            del block["windows"]["plain"]
    plain_call = result(speed)
    for blocks in plain_call["blocks"].values():
        for block in blocks:
            block["windows"] = {n: w for n, w in block["windows"].items() if n in ("plain", "eagle3")}
    both = {**slow, "blocks": {c: b + plain_call["blocks"][c] for c, b in slow["blocks"].items()}}
    loads, _, _ = depth_choice.choose(both)
    assert (loads[3].kept, loads[3].best, loads[3].via) == (3, 5, "eagle3")
    assert loads[3].kept_over_best == pytest.approx(1.60 / 1.62)
    # a depth that ran beside no server the others share cannot be placed: that load is named
    alone = {c: [{"block": 9, "order": [], "windows": {n: w for n, w in b["windows"].items() if n == "eagle3_depth7"}}
                 for b in second["blocks"][c]] if c == "64" else second["blocks"][c] for c in second["blocks"]}
    lone = {**first, "blocks": {c: blocks + alone[c] for c, blocks in first["blocks"].items()}}
    loads, _, not_compared = depth_choice.choose(lone)
    assert [ld.concurrency for ld in loads] == [1, 16, 32, 128, 256] and not_compared == [64]
    assert "Not compared (a depth that ran neither beside the others nor beside one server they share): " \
           "at 64 requests." in depth_choice.render(loads, [], not_compared)


def test_a_bench_runs_the_schedule_a_bench_of_fixed_depths_measured(tmp_path: Path):
    # --schedule from:BENCH_JSON: read when the options are, so that one call's depths give the
    # next call's schedule server without a round trip, and its record holds the tiers themselves
    path = tmp_path / "depths.json"
    path.write_text(json.dumps(result()))
    opts = bench_options("--configs", "plain,eagle3,eagle3_sched", "--schedule", f"from:{path};1-16:3,17-:0")
    assert opts.schedules == ("1-22:7,23-45:5,46-181:3,182-:0", "1-16:3,17-:0")
    rec = options.config_records(opts)["eagle3_sched1"]
    assert (rec.steps, rec.schedule) == (7, "1-22:7,23-45:5,46-181:3,182-:0")
    with pytest.raises(SystemExit, match=r"--schedule 'from:.*missing.json': .*missing.json: not a bench result"):
        bench_options("--configs", "eagle3_sched", "--schedule", f"from:{tmp_path / 'missing.json'}")
    # e2e on the GPU host takes it as --bench-schedule, refused before any work
    e2e = build_parser().parse_args(["e2e", "--bench-configs", "eagle3_sched", "--bench-schedule",
                                     f"from:{tmp_path / 'missing.json'}"])
    with pytest.raises(SystemExit, match=r"^--bench-schedule 'from:.*missing.json': .*not a bench result"):
        options.tuning_options(e2e, "bench-")
    plain_best = {c: {0: 2.0, 3: 1.0, 5: 0.9, 7: 0.8} for c in LEVELS}
    path.write_text(json.dumps(result(plain_best)))
    with pytest.raises(SystemExit, match="plain decoding made the most at every load measured: no schedule drafts"):
        bench_options("--configs", "eagle3_sched", "--schedule", f"from:{path}")
