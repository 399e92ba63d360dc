"""The load (bench.workload): the prompts of a window, the same on every server, and their
output lengths around the mean."""
from __future__ import annotations

import statistics
from pathlib import Path

from bench import options, ramp, workload


def test_window_workload_and_ramp_schedule():
    assert workload.workload(3000, 8, 256, 0, 5) == workload.workload(3000, 8, 256, 0, 5)  # the same for every server
    assert workload.workload(3000, 8, 256, 0, 5) != workload.workload(3000, 8, 256, 1, 5)  # another block, other prompts
    assert workload.workload(3000, 8, 256, 0, 9)[:5] == workload.workload(3000, 8, 256, 0, 5)  # one stream, cut anywhere
    assert all(32 <= len(p.input_ids) <= workload.MAX_PROMPT_LEN for p in workload.workload(3000, 8, 256, 0, 50))
    assert workload.ramp_prompt(3000, 64, "ramp-3-1") == workload.ramp_prompt(3000, 64, "ramp-3-1")
    assert ramp.ramp_levels((1, 4, 16), 2) == [1, 4, 16, 4, 1, 4, 16, 4, 1]
    assert ramp.ramp_levels((1, 4, 16), 0) == []


def test_output_lengths_vary_alike_on_every_server_around_the_mean():
    # One length for all made a window's requests end in step on a server that keeps them in step
    # (plain steps) and apart on one that does not (speculation): the second then prefilled their
    # successors in 39 small batches a window against 10 (GPU, 8B shape, 64 requests, 2026-12-04).
    prompts = workload.workload(3072, 64, 256, 101, 400, spread=0.25)
    lengths = [p.max_new_tokens for p in prompts]
    assert min(lengths) >= 192 and max(lengths) <= 320 and len(set(lengths)) > 50
    assert abs(statistics.fmean(lengths) - 256) < 8
    assert prompts == workload.workload(3072, 64, 256, 101, 400, spread=0.25)  # every server gets the same
    alike = workload.workload(3072, 64, 256, 101, 400)
    assert all(p.max_new_tokens == 256 for p in alike)
    assert [p.input_ids for p in alike] == [p.input_ids for p in prompts]  # the spread changes the lengths alone
    opts = options.BenchOptions(models=Path("m"), out=Path("o"), concurrency=(1, 256))
    assert workload.pool_tokens(opts) == int(1.1 * 256 * (64 + 320))  # room for every request at its longest
