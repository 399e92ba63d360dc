"""`python -m bench verify-kernel` on a CPU: upstream's two verify kernels of the real sglang 0.5.23
wheel in Triton's interpreter, tiny shapes, float32 (the interpreter computes bfloat16 wrongly),
with the plugin installed as in the image (its hooks load as in a server: without its scratch
hook, width 3 gave NaN in about every other run)."""
from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import verify_kernel
from tests.bench.conftest import REPO

TINY = ["--device", "cpu", "--dtype", "float32", "--batch", "2", "--context", "40", "--width", "2,3",
        "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--repeats", "1"]


def test_both_kernels_time_the_same_verify_and_agree(
        run_in_tree: Callable[..., subprocess.CompletedProcess[str]],
        sglang_tree: Callable[[str, bool], Path], plugin_site: Path, tmp_path: Path) -> None:
    tree = sglang_tree("sglang-0.5.23", False)
    env = {"PYTHONPATH": f"{plugin_site}:{tree}:{REPO}:{REPO / 'src'}", "TRITON_INTERPRET": "1"}

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        code = "import sys; from bench.__main__ import main; sys.exit(main(sys.argv[1:]))"
        return run_in_tree(tree, code.replace("sys.argv[1:]", repr(["verify-kernel", *TINY, *extra])), env=env)

    ok = run("--out", str(tmp_path), "--grouped-tiles", "16x1,64x2", "--folded", "--split-programs", "4,16",
             "--split-tokens", "16")
    assert ok.returncode == 0, ok.stderr[-2000:]
    rows = json.loads((tmp_path / "verify_kernel.json").read_text())
    assert [(r["batch"], r["context"], r["width"]) for r in rows] == [(2, 40, 2), (2, 40, 3)]
    assert all(r["prefill_ms"] > 0 and r["splitkv_ms"] > 0 and r["max_diff"] <= 1e-5 for r in rows)
    # the split-KV kernel with upstream's own prefix stage (one program a query head) beside it
    assert all(r["headwise_ms"] > 0 and r["headwise_diff"] <= 1e-5 for r in rows)
    # and with the plugin's looped combine, at a server's split count (its graph's kv_indices is
    # the whole buffer: 16 splits, whatever the context)
    assert all(r["looped_ms"] > 0 and r["looped_diff"] <= 1e-5 and r["splits"] == 16 for r in rows)
    assert all(r["upstream_combine_ms"] > 0 and r["upstream_combine_diff"] <= 1e-5 for r in rows)
    assert "| batch | context | width | splits | upstream combine ms | looped combine ms |" in (
        tmp_path / "verify_kernel.md").read_text()
    # and with the prefix cut by the batch's size too (no GPU here: the parts are not named)
    assert all(r["by_load_ms"] > 0 and r["by_load_diff"] <= 1e-5 and r["by_load_splits"] is None for r in rows)
    # the prefix cut by load at each number of programs a core asked for, each checked as the others
    assert [[(rule, diff <= 1e-5) for rule, _, _, diff in r["split_rules"]] for r in rows] == [
        [("4 a core", True), ("16 a core", True), ("16 tokens", True)]] * 2
    assert "| batch | context | width | 16 splits ms | 4 a core | 16 a core | 16 tokens |" in (
        tmp_path / "verify_kernel.md").read_text()
    # the plugin's stage again at each tile asked for, each checked as the others
    assert [[(label, diff <= 1e-5) for label, _, diff in r["tiles"]] for r in rows] == [
        [("16x1", True), ("64x2", True)]] * 2
    assert "| batch | context | width | 16x1 | 64x2 |" in (tmp_path / "verify_kernel.md").read_text()
    # the plain step's attention beside them, and the verify through the decode kernel with the
    # verified tokens folded into the query-head group: the same output as the prefill kernel's
    assert all(r["decode_ms"] > 0 and r["folded_ms"] > 0 and r["folded_diff"] <= 1e-5 for r in rows)
    assert "| 2 | 40 | 3 |" in (tmp_path / "verify_kernel.md").read_text()
    # every difference is above the tolerance: the command fails, naming the case; the split count
    # from the context, as an eager verify derives it
    bad = run("--tolerance", "-1", "--grouped-tiles", "64x2", "--no-graph-splits", "--folded",
              "--out", str(tmp_path / "eager"))
    assert bad.returncode == 1
    assert [r["splits"] for r in json.loads((tmp_path / "eager" / "verify_kernel.json").read_text())] == [4, 4]
    assert "FAILED: batch 2, context 40, width 3: the looped-combine split-KV and prefill kernels'" in bad.stdout
    assert "FAILED: batch 2, context 40, width 3: the splits-by-load split-KV and prefill kernels'" in bad.stdout
    assert "FAILED: batch 2, context 40, width 2: the split-KV and prefill kernels' outputs differ" in bad.stdout
    assert "FAILED: batch 2, context 40, width 2: the per-head split-KV and prefill kernels' outputs" in bad.stdout
    assert "FAILED: batch 2, context 40, width 3: the split-KV at tile 64x2 and prefill kernels'" in bad.stdout
    assert "FAILED: batch 2, context 40, width 3: the folded decode and prefill kernels' outputs differ" in bad.stdout
    # without --folded, or where the folded group passes the decode kernel's head tile, no folded figure
    plain = run("--out", str(tmp_path / "unfolded"))
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert all(r["folded_ms"] is None for r in json.loads((tmp_path / "unfolded" / "verify_kernel.json").read_text()))


def test_the_e2e_kernels_phase_runs_it_and_keeps_the_table_in_its_log(
        run_in_tree: Callable[..., subprocess.CompletedProcess[str]],
        sglang_tree: Callable[[str, bool], Path], plugin_site: Path, tmp_path: Path) -> None:
    tree = sglang_tree("sglang-0.5.23", False)
    env = {"PYTHONPATH": f"{plugin_site}:{tree}:{REPO / 'src'}", "TRITON_INTERPRET": "1"}
    argv = ["e2e", "--bundle", str(tmp_path / "none"), "--state", str(tmp_path / "st"), "--out",
            str(tmp_path / "out"), "--phases", "kernels", "--kernel-args", " ".join(TINY)]
    code = f"import sys, os; os.chdir({str(REPO)!r}); from bench.__main__ import main; sys.exit(main({argv!r}))"
    proc = run_in_tree(tree, code, env=env)
    log = (tmp_path / "out" / "e2e.log").read_text()
    assert proc.returncode == 0, log[-2000:]
    assert "| 2 | 40 | 3 |" in log and "RESULT: PASS" in log
    assert (tmp_path / "st" / "logs" / "verify_kernel.json").is_file()


@pytest.mark.parametrize("text", ["48x4", "8x4", "64", "64x0", "x4", "64x4,big"])
def test_a_tile_that_is_not_block_n_x_warps_is_refused_naming_the_form(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="give BLOCK_NxWARPS, BLOCK_N a power of two from 16"):
        verify_kernel._tiles(text)
    assert verify_kernel._tiles("16x1, 64x8") == [(16, 1), (64, 8)]


def test_a_folded_group_past_the_decode_kernel_s_head_tile_is_not_folded() -> None:
    # upstream's grouped decode kernel maps a tile of 16 query heads to one KV head: a folded
    # group of 24 (group 4 x width 6, the 8B shape at depth 5) would read the wrong KV head
    assert [verify_kernel.foldable(w, 4) for w in (2, 4, 5, 6, 8)] == [True, True, False, False, True]
    assert verify_kernel.foldable(3, 2) and verify_kernel.foldable(8, 1)
