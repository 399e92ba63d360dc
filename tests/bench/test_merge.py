"""Several calls' results as one (bench.merge): the union of their blocks and configs, ratios still
within each block, the sources kept, what cannot share a table refused, no input overwritten."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench import configs, merge, options, pairing, throughput
from bench import report as bench_report
from bench.__main__ import build_parser
from tests.bench.conftest import png_size

MODEL = {"size": "8b", "hidden": 4096, "layers": 32, "draft": "chain", "draft_accept": 0.85,
         "designed_accept_length": 3.08}
Rate = Callable[[int, int, str], float]  # (concurrency, block, server) -> tokens/s


def host(c: int, k: int, name: str) -> float:
    """A host whose speed drifts from block to block: EAGLE-3 2x plain at low load, 0.9x at 256,
    depth 1 0.8x; the A/A twin 1.0x."""
    plain = 100.0 * c * (1.0, 0.7, 1.2)[k % 3]
    return plain * {"plain": 1.0, "plain_twin": 1.0, "eagle3": 2.0 if c < 256 else 0.9, "eagle3_depth1": 0.8}[name]


def call_result(levels: tuple[int, ...], configs: tuple[str, ...] = ("plain", "eagle3"), pairs: int = 2,
                rate: Rate = host, date: str = "2026-12-06", **opts: Any) -> dict[str, Any]:
    """A result as one `bench run` call makes it (throughput.new_result), its windows at `rate`."""
    o = options.BenchOptions(models=Path("m"), out=Path("o"), concurrency=levels, configs=configs, pairs=pairs,
                             depths=(1,), **opts)
    result = throughput.new_result(o, MODEL)
    names = options.server_names(o)
    result.update(date=date, calls=1, configs=names, server_env=dict(o.server_env), server_args=list(o.server_args),
                  config_records={n: rec.as_dict() for n, rec in options.config_records(o).items()})
    for c in levels:
        result["blocks"][str(c)] = [
            {"block": k + 1, "order": pairing.block_order(names, k),
             "windows": {n: {"tok_per_s": rate(c, k, n), "errors": 0, "first_error": None, "seconds": 3.0,
                             "output_tokens": int(3 * rate(c, k, n)), "steps": 300,
                             "accept_length": None if n.startswith("plain") else 3.0} for n in names}}
            for k in range(pairs)]
    return result


def saved(tmp_path: Path, name: str, result: dict[str, Any]) -> Path:
    path = tmp_path / name / "bench.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(result))
    return path


def three_calls(tmp_path: Path) -> list[Path]:
    """1 and 4 requests with EAGLE-3; 256 with EAGLE-3; 256 with depth 1, on a host twice as fast
    (another day), its configs named depth first."""
    return [saved(tmp_path, "low", call_result((1, 4))),
            saved(tmp_path, "top", call_result((256,), pairs=3)),
            saved(tmp_path, "depth", call_result((256,), ("eagle3_depth", "plain"), date="2026-12-07",
                                                 rate=lambda c, k, n: 2 * host(c, k, n)))]


def merged_of(paths: list[Path]) -> dict[str, Any]:
    return merge.merge([s for p in paths for s in merge.load(p)])


def test_merged_calls_give_the_union_of_levels_and_configs_with_ratios_within_blocks(tmp_path):
    paths = three_calls(tmp_path)
    merged = merged_of(paths)
    assert merged["concurrency"] == [1, 4, 256]
    assert merged["configs"] == ["plain", "eagle3", "eagle3_depth1"]  # plain first, whatever the calls' order
    assert merged["config_records"]["eagle3_depth1"]["steps"] == 1
    # every block kept, tagged with its call; at 256 the two calls' blocks side by side
    assert [(b["source"], b["block"]) for b in merged["blocks"]["256"]] == [(2, 1), (2, 2), (2, 3), (3, 1), (3, 2)]
    assert [b["source"] for b in merged["blocks"]["1"]] == [1, 1]
    table = bench_report.level_table(merged)
    # each ratio within its own block: the third call's host was twice as fast, which no ratio shows
    assert table["256"]["eagle3"]["vs_reference"]["ratios"] == [0.9, 0.9, 0.9]
    assert table["256"]["eagle3_depth1"]["vs_reference"]["ratios"] == [0.8, 0.8]
    assert table["1"]["eagle3"]["vs_reference"]["median"] == 2.0
    # plain's tokens/s at 256 pools both calls' windows (25600 x 1.0, 0.7, 1.2, then 2.0, 1.4)
    assert table["256"]["plain"]["blocks"] == 5 and table["256"]["plain"]["tok_per_s"] == 30720.0
    assert [s["path"] for s in merged["sources"]] == [str(p.resolve()) for p in paths]
    assert [(s["date"], s["concurrency"], s["configs"]) for s in merged["sources"]] == [
        ("2026-12-06", [1, 4], ["plain", "eagle3"]), ("2026-12-06", [256], ["plain", "eagle3"]),
        ("2026-12-07", [256], ["eagle3_depth1", "plain"])]
    assert merged["date"] == "2026-12-06 to 2026-12-07" and merged["pairs_at"] == {"1": 2, "4": 2, "256": 5}


def test_the_merged_report_says_which_medians_mix_calls(tmp_path):
    md = merged_of(three_calls(tmp_path))["table"]
    assert "merged from 3 calls (listed at the end)" in md
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in md.split("| concurrency |", 1)[1].split("\n\n", 1)[0].splitlines()
            if line.startswith("| ") and line.split("|")[1].strip()[:1].isdigit()}
    assert list(rows) == ["1", "4", "256 (2 calls)"]  # 5 blocks measured of the 5 the calls meant: not partial
    # plain's median at 256 pools two calls (*); EAGLE-3's and depth 1's come from one call each
    assert rows["256 (2 calls)"] == ["30720*", "23040 (0.90x [0.90-0.90])", "34816 (0.80x [0.80-0.80])"]
    assert rows["1"] == ["85", "170 (2.00x [2.00-2.00])", "-"]  # 100 and 70: their median
    assert ("At 256 requests several calls measured the level (marked): a tokens/s median marked * pools the "
            "windows of several calls") in md
    assert "each ratio is still taken within its own block" in md
    assert "- source 3: `" + str(tmp_path / "depth" / "bench.json") + "`, 2026-12-07; concurrency 256; EAGLE-3 depth 1, plain; 2 blocks" in md
    assert "Every server: no --server-env, no --server-args." in md


def test_merge_writes_the_report_and_a_plot_and_leaves_its_inputs_alone(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    paths = three_calls(tmp_path)
    before = [p.read_bytes() for p in paths]
    a = build_parser().parse_args(["merge", "--out", str(tmp_path / "merged"), *map(str, paths)])
    assert a.main(a) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "merged" / n) for n in
                                               ("bench.json", "bench.md", "concurrency.png")]
    width, height = png_size(tmp_path / "merged" / "concurrency.png")
    assert width > 500 and height > 300
    assert "![tokens/s by concurrency](concurrency.png)" in (tmp_path / "merged" / "bench.md").read_text()
    assert [p.read_bytes() for p in paths] == before
    # the output folder of an input's bench.json: refused, the input as it was
    a = build_parser().parse_args(["merge", "--out", str(paths[0].parent), *map(str, paths)])
    with pytest.raises(SystemExit, match="low/bench.json is an input and --out .* would overwrite it: give another --out"):
        a.main(a)
    assert paths[0].read_bytes() == before[0]


def test_a_merge_merged_again_is_taken_apart_into_its_calls(tmp_path):
    paths = three_calls(tmp_path)
    first = merged_of(paths[:2])
    again = merged_of([saved(tmp_path, "first", first), paths[2]])
    assert again == merged_of(paths)  # the same sources, the same blocks: nothing lost in between
    assert [s.result for s in merge.load(tmp_path / "first" / "bench.json")] == \
        [json.loads(p.read_text()) for p in paths[:2]]


def test_failures_and_notes_of_each_call_are_kept_with_their_source(tmp_path):
    low = call_result((1,))
    low["failures"] = ["block 1 c=1 eagle3: 1 output(s) differ from plain (e.g. c1-0)"]
    low["server_events"] = ["call 1: plain: started"]
    merged = merged_of([saved(tmp_path, "a", low), saved(tmp_path, "b", call_result((256,)))])
    assert merged["failures"] == ["source 1: block 1 c=1 eagle3: 1 output(s) differ from plain (e.g. c1-0)"]
    assert merged["server_events"] == ["source 1: call 1: plain: started"]
    assert "- FAILED: source 1: block 1 c=1 eagle3" in merged["table"]
    assert "every output equal to plain decoding's" not in merged["table"]


def test_a_call_that_did_not_record_its_server_setting_is_unknown_not_refused(tmp_path):
    old = call_result((1,))
    del old["server_env"], old["server_args"]  # a bench.json from before the bench kept them
    new = call_result((256,), server_env=(("SGLANG_X", "1"),), server_args=("--gc-threshold", "5"))
    merged = merged_of([saved(tmp_path, "old", old), saved(tmp_path, "new", new)])
    assert merged["server_env"] == {"SGLANG_X": "1"} and merged["server_args"] == ["--gc-threshold", "5"]
    assert merged["sources"][0]["server_env"] is None
    assert ("Every server: --server-env `SGLANG_X=1`, --server-args `--gc-threshold 5`; not recorded by "
            "source 1 (a bench from before it kept them): unknown there") in merged["table"]
    del new["server_env"], new["server_args"]
    neither = merged_of([saved(tmp_path, "old2", old), saved(tmp_path, "new2", new)])
    assert "server_env" not in neither and "--server-env and --server-args: not recorded" in neither["table"]


def other_record(result: dict[str, Any]) -> None:
    result["config_records"]["eagle3"]["env"] = [["SGLANG_ENABLE_SPLITKV_VERIFY", "0"]]


@pytest.mark.parametrize("change, message", [
    (lambda r: r["model"].update(size="1b"), "the models differ: .*merge each model's calls on their own"),
    (lambda r: r.update(output_lengths=[256, 256]), (r"the output lengths differ: .* has \[192, 320\], .* has "
                                                     r"\[256, 256\].*same --output-len and --output-spread")),
    (lambda r: r.update(window_s=5.0), "the window seconds differ: .* has 3.0, .* has 5.0.*same --window-s"),
    (lambda r: r.update(settle_s=2.0), "the settle seconds differ: .*same --settle-s"),
    (lambda r: r.update(device_timer=True), "the device timer settings differ: .*--device-timer"),
    (other_record, ("'eagle3' is another server in .*low/bench.json .* than in .*top/bench.json "
                   r".*SPLITKV.*merge only calls whose configs of one name are the same server")),
    (lambda r: r.update(server_env={"SGLANG_X": "1"}), ("the --server-env settings differ: .* has {}, .* has "
                                                       "{'SGLANG_X': '1'}.*same --server-env")),
    (lambda r: r.update(server_args=["--gc-threshold", "5"]), "the --server-args settings differ: .*same --server-args"),
])
def test_calls_that_measured_other_things_are_refused(tmp_path, change, message):
    top = call_result((256,))
    change(top)
    paths = [saved(tmp_path, "low", call_result((1,))), saved(tmp_path, "top", top)]
    a = build_parser().parse_args(["merge", "--out", str(tmp_path / "merged"), *map(str, paths)])
    with pytest.raises(SystemExit, match="bench merge: cannot merge: " + message):
        a.main(a)
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("text, why", [
    ("[1, 2]", "not a JSON object"),
    ("{\"configs\": [], \"model\": {}}", "no 'blocks'"),
    ("no json", "Expecting value"),
    (json.dumps({**call_result((1,)), "blocks": {}}), "no blocks: a ramp alone"),
    (json.dumps({**call_result((1,)), "blocks": {"1": [{"block": 1}]}}), "not a list of blocks with windows"),
])
def test_a_file_that_is_not_a_bench_result_is_refused(tmp_path, text, why):
    (tmp_path / "x.json").write_text(text)
    with pytest.raises(merge.Refused, match=rf"x.json: not a bench result \(.*{why}.*\); give the bench.json"):
        merge.load(tmp_path / "x.json")


def test_one_call_alone_or_twice_is_refused(tmp_path):
    low = saved(tmp_path, "low", call_result((1,)))
    with pytest.raises(merge.Refused, match="one call alone: give two or more"):
        merged_of([low])
    copy = saved(tmp_path, "copy", json.loads(low.read_text()))
    with pytest.raises(merge.Refused, match="hold the same blocks .*give each call once"):
        merged_of([low, copy])


def test_each_twin_sits_beside_the_server_it_repeats():
    names = ["eagle3_extend_verify", "eagle3_twin", "eagle3_thr16", "plain_prefill_delayer", "plain_twin",
             "eagle3", "eagle3_depth5", "plain"]
    records = {r.name: r for r in configs.expand(
        ("eagle3_extend_verify", "eagle3_twin", "eagle3_thr", "plain_prefill_delayer", "plain_twin", "eagle3",
         "eagle3_depth", "plain"), depths=(5,))}
    assert merge.config_order(names, records) == [
        "plain", "plain_twin", "plain_prefill_delayer", "eagle3_depth5", "eagle3", "eagle3_twin",
        "eagle3_extend_verify", "eagle3_thr16"]
