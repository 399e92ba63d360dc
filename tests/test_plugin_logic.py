"""The plugin's pure logic (patches/plugin/sglang_image_plugin): flags, validation, the
hysteresis controller and the threshold policy. No sglang needed."""
from __future__ import annotations

import argparse
import sys

import pytest

from sglang_image.plugin import PLUGIN_DIR

sys.path.insert(0, str(PLUGIN_DIR))

from sglang_image_plugin import spec_disable as sd
from sglang_image_plugin.policy import ThresholdPolicy

EAGLE3 = sd.ServerView(speculative_algorithm="EAGLE3", speculative_eagle_topk=1,
                       speculative_adaptive=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    sd.add_cli_args(parser)
    return parser


def test_flags_parse_numbers_and_name_the_flag_on_bad_input() -> None:
    ns = _parser().parse_args([sd.THRESHOLD_FLAG, "32", sd.HYSTERESIS_FLAG, "3"])
    assert (ns.speculative_disable_batch_threshold, ns.speculative_disable_hysteresis) == (32, 3)
    assert _parser().parse_args([]).speculative_disable_batch_threshold is None
    for bad, words in (("-1", ">= 0"), ("12x", "non-negative integer"), ("", "non-negative")):
        with pytest.raises(argparse.ArgumentError) as err:
            _parser().parse_args([sd.THRESHOLD_FLAG, bad])
        assert sd.THRESHOLD_FLAG in str(err.value) and words in str(err.value)


def test_auto_is_refused_until_the_self_tuning_threshold_ships(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sd, "auto_available", lambda: False)
    with pytest.raises(argparse.ArgumentError, match="auto is not available in this build"):
        _parser().parse_args([sd.THRESHOLD_FLAG, "auto"])
    with pytest.raises(ValueError, match=f"{sd.THRESHOLD_ENV}.*auto is not available"):
        sd.resolve_and_validate(threshold_flag=None, hysteresis_flag=None, server=EAGLE3,
                                environ={sd.THRESHOLD_ENV: "auto"})
    monkeypatch.setattr(sd, "auto_available", lambda: True)
    assert _parser().parse_args([sd.THRESHOLD_FLAG, "AUTO"]).speculative_disable_batch_threshold == "auto"


def test_env_is_the_fallback_and_the_flag_wins() -> None:
    def resolve(flag: sd.Threshold | None, env: dict[str, str]) -> sd.Setting:
        return sd.resolve_and_validate(threshold_flag=flag, hysteresis_flag=None, server=EAGLE3,
                                       environ=env)

    assert resolve(None, {}) == sd.OFF
    assert resolve(None, {sd.THRESHOLD_ENV: " 64 "}) == sd.Setting(threshold=64, hysteresis=8)
    assert resolve(16, {sd.THRESHOLD_ENV: "64"}) == sd.Setting(threshold=16, hysteresis=2)
    assert resolve(0, {sd.THRESHOLD_ENV: "64"}) == sd.OFF
    with pytest.raises(ValueError, match=f"{sd.THRESHOLD_ENV} \\(the fallback for {sd.THRESHOLD_FLAG}\\)"):
        resolve(None, {sd.THRESHOLD_ENV: "many"})


@pytest.mark.parametrize(("server", "hysteresis", "message"), [
    (sd.ServerView(speculative_algorithm=None, speculative_eagle_topk=None,
                   speculative_adaptive=False), None, "needs --speculative-algorithm EAGLE"),
    (sd.ServerView(speculative_algorithm="NGRAM", speculative_eagle_topk=None,
                   speculative_adaptive=False), None, "needs --speculative-algorithm EAGLE"),
    (sd.ServerView(speculative_algorithm="EAGLE3", speculative_eagle_topk=4,
                   speculative_adaptive=False), None, "needs --speculative-eagle-topk 1"),
    (sd.ServerView(speculative_algorithm="EAGLE3", speculative_eagle_topk=1,
                   speculative_adaptive=True), None, "cannot be combined with --speculative-adaptive"),
    (sd.ServerView(speculative_algorithm="EAGLE", speculative_eagle_topk=1,
                   speculative_adaptive=False, adaptive_unsupported_reason="attention DP"),
     None, "not supported here: attention DP"),
    (EAGLE3, 8, "--speculative-disable-hysteresis must be smaller"),
])
def test_unsupported_combinations_are_refused_naming_the_flag(
        server: sd.ServerView, hysteresis: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        sd.resolve_and_validate(threshold_flag=8, hysteresis_flag=hysteresis, server=server,
                                environ={})
    assert sd.THRESHOLD_FLAG in str(err.value) or sd.HYSTERESIS_FLAG in str(err.value)


def test_default_hysteresis_and_start_line() -> None:
    assert [sd.default_hysteresis(n) for n in (1, 2, 8, 9, 32, 64, 100)] == [0, 1, 1, 1, 4, 8, 12]
    assert sd.start_log_line(32) == "Dynamic speculation disable enabled: threshold=32"


def test_controller_hysteresis_counts_and_rate_limited_log() -> None:
    lines: list[str] = []
    now = [0.0]
    ctl = sd.SpecDisableController(8, 2, log_fn=lines.append, clock=lambda: now[0],
                                   log_interval_s=5.0)
    trace = [1, 8, 9, 8, 7, 6, 7, 9, 12, 6, 5]
    modes = []
    for i, bs in enumerate(trace):
        now[0] = float(i)
        modes.append("P" if ctl.step(bs) else "S")
    # plain above 8; back only at <= 6
    assert "".join(modes) == "SSPPPSSPPSS"
    assert (ctl.speculative_steps, ctl.plain_steps, ctl.mode_changes) == (6, 5, 4)
    # changes at t=2, 5, 7, 9: the ones within 5 s of the last logged line are folded
    assert lines == [
        "Speculation mode -> plain (batch size 9 > threshold 8); mode_changes=1",
        ("Speculation mode -> plain (batch size 9 > threshold 8); mode_changes=3; "
         "1 earlier change(s) not logged"),
    ]
    assert ctl.snapshot() == {"threshold": 8, "hysteresis": 2, "mode": "speculative",
                              "speculative_steps": 6, "plain_steps": 5, "mode_changes": 4}
    with pytest.raises(ValueError, match="0 <= H < N"):
        sd.SpecDisableController(4, 4)


def test_policy_maps_the_mode_to_step_counts_and_prunes_graph_sizes() -> None:
    ctl = sd.SpecDisableController(32, 4, log_fn=lambda _: None)
    policy = ThresholdPolicy(ctl, speculative_steps=3)
    assert policy.candidate_steps == [0, 3]
    assert policy.cuda_graph_bs_for_step(0) is None  # graphs off
    policy.set_cuda_graph_bs([64, 1, 2, 4, 8, 16, 24, 32, 40, 48])
    # plain runs at batch sizes > 28 (padded up to 32, 40, ...); speculative at <= 32
    assert policy.cuda_graph_bs_for_step(0) == [32, 40, 48, 64]
    assert policy.cuda_graph_bs_for_step(3) == [1, 2, 4, 8, 16, 24, 32]
    steps = [policy.get_steps_for_batch(bs) for bs in (4, 33, 0, 30, 28, 0, 27)]
    assert steps == [3, 0, 0, 0, 3, 3, 3]
    assert (ctl.speculative_steps, ctl.plain_steps) == (3, 2)  # idle batches are not steps
    assert policy.on_verify_complete([1, 2], 2) is None
    with pytest.raises(ValueError, match="--speculative-num-steps >= 1"):
        ThresholdPolicy(ctl, speculative_steps=0)
