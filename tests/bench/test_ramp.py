"""The ramp (bench.ramp): tokens/s and modes per level."""
from __future__ import annotations

from bench import ramp


def test_ramp_windows_spread_each_request_over_its_lifetime():
    # request 1: 100 tokens over 1-3 s; request 2: 50 tokens over 2.5-3.5 s; 2 s windows
    windows = ramp.ramp_windows([1, 2], 2.0, [(1.0, 3.0, 100), (2.5, 3.5, 50)],
                                 [(0.5, "speculative", None), (1.0, "plain", 32), (2.5, "plain", 16)])
    assert [w["tok_per_s"] for w in windows] == [25.0, 50.0]  # 50 / 2 s; (50 + 50) / 2 s
    assert [w["plain_share"] for w in windows] == [0.5, 1.0] and [w["crossover"] for w in windows] == [32, 16]
