"""Paired windows (bench.pairing): the order of a block, the ratio within each block, its
bootstrap interval, a block with a failed window."""
from __future__ import annotations

import statistics

import pytest

from bench import pairing


def test_blocks_alternate_the_order_so_each_server_comes_first_as_often():
    orders = [pairing.block_order(["a", "b", "c"], k) for k in range(4)]
    assert orders == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"], ["c", "b", "a"]]
    firsts = [o[0] for o in orders]
    assert firsts.count("a") == firsts.count("c") == 2


def test_a_ratio_within_each_block_does_not_see_the_host_drift():
    """The host runs 30% slower in every other block and B is 0.97x A in every block: the ratio is
    0.97 with a zero-width interval, though B's tokens/s spread from 679 to 970."""
    blocks = [{"windows": {"A": {"tok_per_s": 1000 * s}, "B": {"tok_per_s": 970 * s}}}
              for s in (1.0, 0.7, 1.0, 0.7, 1.0, 0.7)]
    ratio = pairing.compare(blocks, "B", ["A"])
    assert ratio is not None and ratio.median == pytest.approx(0.97)
    assert ratio.low == pytest.approx(0.97) and ratio.high == pytest.approx(0.97)
    assert ratio.text() == "0.97x [0.97-0.97]" and ratio.as_dict()["pairs"] == 6


def test_the_bootstrap_interval_holds_the_median_and_widens_with_the_spread():
    tight = [0.99, 1.0, 1.01, 1.0, 0.995, 1.005]
    wide = [0.85, 1.0, 1.15, 0.9, 1.1, 1.0]
    lo_t, hi_t = pairing.bootstrap_interval(tight)
    lo_w, hi_w = pairing.bootstrap_interval(wide)
    assert lo_t <= statistics.median(tight) <= hi_t and lo_w <= statistics.median(wide) <= hi_w
    assert hi_t - lo_t < hi_w - lo_w
    assert min(tight) <= lo_t and hi_t <= max(tight)  # a median resampled stays within the data
    assert pairing.bootstrap_interval(tight) == (lo_t, hi_t)  # seeded: the same windows, the same interval
    with pytest.raises(ValueError):
        pairing.bootstrap_interval([])


def test_a_block_with_a_failed_window_is_left_out_of_its_ratios():
    blocks = [{"windows": {"A": {"tok_per_s": 100.0}, "B": {"tok_per_s": 90.0}}},
              {"windows": {"A": {"tok_per_s": 100.0, "errors": 2}, "B": {"tok_per_s": 10.0}}},
              {"windows": {"A": {"tok_per_s": 100.0}}},
              {"windows": {"A": {"tok_per_s": 80.0}, "B": {"tok_per_s": 72.0}, "C": {"tok_per_s": 88.0}}}]
    assert pairing.block_ratios(blocks, "B", ["A"]) == [0.9, 0.9]
    assert pairing.block_ratios(blocks, "C", ["A", "B"]) == [1.1]  # over the better of the two
    assert pairing.compare(blocks, "D", ["A"]) is None
