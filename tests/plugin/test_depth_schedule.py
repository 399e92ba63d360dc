"""The draft depth per load: the schedule's grammar and refusals (the setting's contract,
plugin/sglang_image_plugin/setting.py), its hysteresis at every edge (depth_schedule.py), the graph
sizes of each depth, and a fixed threshold as its two-tier special case. No sglang needed."""
from __future__ import annotations

import argparse
import random

import pytest

from sglang_image_plugin import depth_schedule as ds
from sglang_image_plugin import setting as st
from sglang_image_plugin import spec_disable as sd
from sglang_image_plugin.acceptance import AcceptanceAroundPlain
from sglang_image_plugin.policy import DepthSchedulePolicy, ThresholdPolicy


def test_a_schedule_parses_into_tiers_that_cover_every_batch_size() -> None:
    s = st.parse_schedule(" 1-16:3, 17-48:2,49-96:1,97-:0 ")
    assert str(s) == "1-16:3,17-48:2,49-96:1,97-:0" and s.depths == [3, 2, 1, 0] and s.deepest == 3
    assert [s.depth_at(b) for b in (1, 16, 17, 48, 49, 96, 97, 100_000)] == [3, 3, 2, 2, 1, 1, 0, 0]
    # adjacent tiers of one depth are one tier; a schedule may stay speculative to the end
    assert str(st.parse_schedule("1-8:3,9-16:3,17-:1")) == "1-16:3,17-:1"
    assert str(st.parse_schedule("1-:2")) == "1-:2"
    assert st.schedule_from_threshold(16, 3) == st.parse_schedule("1-16:3,17-:0")


@pytest.mark.parametrize(("text", "why"), [
    ("", "empty"),
    ("1-16:3;17-:0", "is not a tier"),
    ("1-16:3,17-:-1", "is not a tier"),
    ("1-16:x,17-:0", "is not a tier"),
    ("2-16:3,17-:0", "the first tier must start at 1"),
    ("1-16:3,18-:0", "tier 18-:0 must start at 17"),
    ("1-16:3,10-:0", "tier 10-:0 must start at 17"),
    ("1-:3,17-:0", "only the last tier may be open"),
    ("1-16:3,17-32:0", "the last tier must be open, 17-:0"),
    ("1-16:1,17-:2", "drafts deeper than tier 1-16:1"),
    ("1-0:3,1-:0", "ends before it starts"),
])
def test_a_bad_schedule_is_refused_naming_the_flag_and_the_fix(text: str, why: str) -> None:
    with pytest.raises(st.ScheduleError, match=why) as info:
        st.parse_schedule(text)
    assert str(info.value).startswith(st.DEPTH_SCHEDULE_FLAG)
    with pytest.raises(st.ScheduleError, match=f"^{st.DEPTH_SCHEDULE_ENV}"):
        st.parse_schedule(text, source=st.DEPTH_SCHEDULE_ENV)


def test_a_depth_beyond_the_launch_depth_or_none_at_all_is_refused() -> None:
    st.check_against_steps(st.parse_schedule("1-16:3,17-:0"), 3)
    with pytest.raises(st.ScheduleError, match="depth 4 is deeper than --speculative-num-steps 3; launch with "
                                               "--speculative-num-steps 4 --speculative-num-draft-tokens 5"):
        st.check_against_steps(st.parse_schedule("1-16:4,17-:0"), 3)
    with pytest.raises(st.ScheduleError, match="no tier drafts"):
        st.check_against_steps(st.parse_schedule("1-:0"), 3)


def test_the_draft_gets_shallower_at_once_and_deeper_only_below_each_edge_s_hysteresis() -> None:
    changes: list[tuple[int, int, int]] = []
    ctl = ds.DepthController(st.parse_schedule("1-16:3,17-48:2,49-96:1,97-:0"),
                             on_change=lambda a, b, bs: changes.append((a, b, bs)))
    assert ctl.hysteresis == [2, 6, 12]  # edge // 8
    walk = [(16, 3), (17, 2), (16, 2), (15, 2), (14, 3),  # edge 16: back to 3 at 14
            (200, 0), (96, 0), (85, 0), (84, 1),          # straight to 0; edge 96: back to 1 at 84
            (43, 1), (42, 2), (1, 3)]                     # edge 48 at 42; far below: the deepest
    assert [ctl.step(b) for b, _ in walk] == [d for _, d in walk]
    assert changes == [(3, 2, 17), (2, 3, 14), (3, 0, 200), (0, 1, 84), (1, 2, 42), (2, 3, 1)]
    assert ctl.changes == 6 and ctl.steps == {3: 3, 2: 4, 1: 2, 0: 3}
    with pytest.raises(ValueError, match="need 0 <= H < 16"):
        ds.DepthController(st.parse_schedule("1-16:3,17-:0"), hysteresis=[16])
    with pytest.raises(ValueError, match="1 edge"):
        ds.DepthController(st.parse_schedule("1-16:3,17-:0"), hysteresis=[1, 2])


def test_the_first_batch_after_an_idle_server_walks_the_schedule_from_its_start() -> None:
    ctl = ds.DepthController(st.parse_schedule("1-16:3,17-48:2,49-96:1,97-:0"))
    assert [ctl.step(b) for b in (200, 90)] == [0, 0]  # 90 is above 96's resume size (84): held
    ctl.note_idle()
    assert [ctl.step(b) for b in (90, 96, 97, 90)] == [1, 1, 0, 0]  # by the tiers alone, then held
    ctl.note_idle()
    assert ctl.step(16) == 3 and ctl.changes == 4


def test_each_depth_captures_graphs_only_where_it_can_run() -> None:
    ctl = ds.DepthController(st.parse_schedule("1-16:3,17-48:2,49-96:1,97-:0"))
    captured = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 224, 256]
    assert ctl.run_range(3) == (1, 16) and ctl.run_range(2) == (15, 48)
    assert ctl.run_range(1) == (43, 96) and ctl.run_range(0) == (85, None)
    assert ctl.graph_sizes(3, captured) == [1, 2, 4, 8, 12, 16]
    assert ctl.graph_sizes(2, captured) == [16, 24, 32, 40, 48]
    assert ctl.graph_sizes(1, captured) == [48, 64, 80, 96]
    assert ctl.graph_sizes(0, captured) == [96, 128, 160, 192, 224, 256]
    # every batch size the walk can meet has a graph of its depth at or above it
    rnd = random.Random(7)
    for _ in range(3000):
        b = rnd.randint(1, 256)
        d = ctl.step(b)
        assert any(v >= b for v in ctl.graph_sizes(d, captured)), (b, d)


def test_a_threshold_is_the_two_tier_schedule_step_for_step() -> None:
    # The threshold's policy and the schedule 1-N:K,N+1-:0 with its hysteresis decide every
    # step alike, and capture the same graphs for each depth.
    rnd = random.Random(3)
    captured = [1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 96, 128, 256]
    for n, h in ((16, 2), (32, 4), (5, 0), (64, 8)):
        policy = ThresholdPolicy(sd.SpecDisableController(n, h, log_fn=lambda _: None), speculative_steps=3)
        policy.set_cuda_graph_bs(captured)
        ctl = ds.DepthController(st.schedule_from_threshold(n, 3), hysteresis=[h])
        b = n
        for _ in range(4000):
            b = max(1, min(256, b + rnd.randint(-3, 3)))
            assert policy.get_steps_for_batch(b) == ctl.step(b), (n, h, b)
        for depth in (0, 3):
            assert policy.cuda_graph_bs_for_step(depth) == ctl.graph_sizes(depth, captured), (n, depth)


def test_the_schedule_s_policy_runs_each_depth_reports_it_and_logs_each_change_once() -> None:
    lines: list[str] = []
    now = [0.0]
    seen: list[tuple[str, int]] = []

    class Seen(sd.Metrics):
        def observe(self, plain_mode: bool, speculative_steps: int, plain_steps: int) -> None:
            seen.append(("plain" if plain_mode else "speculative", speculative_steps + plain_steps))

        def observe_depth(self, depth: int) -> None:
            seen.append(("depth", depth))

    policy = DepthSchedulePolicy(ds.DepthController(st.parse_schedule("1-16:3,17-48:2,49-:0")),
                                 log_fn=lines.append, clock=lambda: now[0])
    policy.metrics = Seen()
    assert policy.candidate_steps == [0, 2, 3]
    policy.set_cuda_graph_bs([1, 2, 4, 8, 16, 24, 32, 48, 64, 128])
    assert policy.cuda_graph_bs_for_step(3) == [1, 2, 4, 8, 16]
    assert policy.cuda_graph_bs_for_step(2) == [16, 24, 32, 48]
    assert policy.cuda_graph_bs_for_step(0) == [48, 64, 128]
    assert [policy.get_steps_for_batch(b) for b in (8, 20, 0, 60)] == [3, 2, 2, 0]
    assert seen == [("speculative", 1), ("depth", 3), ("speculative", 1), ("depth", 2),
                    ("plain", 1), ("depth", 0)]  # an idle batch is no step
    # the first change is logged; the next, within the interval, is counted into the one after
    assert lines == ["Speculation depth -> 2 (was 3; batch size 20; schedule 1-16:3,17-48:2,49-:0); depth_changes=1"]
    now[0] = 10.0
    assert policy.get_steps_for_batch(45) == 0 and policy.get_steps_for_batch(2) == 3  # 45: above 48 - 6
    assert lines[-1] == ("Speculation depth -> 3 (was 0; batch size 2; schedule 1-16:3,17-48:2,49-:0); "
                         "depth_changes=3; 1 earlier change(s) not logged")
    snap = policy.snapshot()
    assert snap == {"schedule": "1-16:3,17-48:2,49-:0", "depth": 3, "mode": "speculative",
                    "steps_by_depth": {"0": 2, "2": 1, "3": 2}, "speculative_steps": 3, "plain_steps": 2,
                    "depth_changes": 3, "mode_changes": 2}


def _steps(watch: AcceptanceAroundPlain, n: int, depth: int, accepted: int = 0) -> None:
    for _ in range(n):
        watch.decided(depth, 2)
        watch.verified([accepted if depth else 0] * 2)


def test_the_acceptance_watch_pairs_a_plain_phase_only_with_steps_of_one_depth() -> None:
    # Accept lengths of two draft depths differ (a chain accepts at most d): a plain phase is
    # judged by the depth it interrupted, and only where speculation resumes at that depth.
    watch = AcceptanceAroundPlain(window=3)
    _steps(watch, 3, 3, accepted=2)
    _steps(watch, 1, 0)
    _steps(watch, 3, 2, accepted=1)  # resumed at depth 2: not comparable with depth 3
    assert watch.view()["phases_measured"] == 0
    _steps(watch, 2, 3, accepted=2)  # depth 3 again, but the window before the next phase is
    _steps(watch, 1, 0)              # 2 steps of depth 3 only (the depth-2 steps do not count)
    _steps(watch, 3, 3, accepted=2)
    assert watch.view()["phases_measured"] == 0
    _steps(watch, 1, 0)
    _steps(watch, 3, 3, accepted=1)  # before 3.0 at depth 3, after 2.0 at depth 3
    view = watch.view()
    assert (view["phases_measured"], view["last_before"], view["last_after"], view["last_depth"]) == (1, 3.0, 2.0, 3)


def test_the_schedule_resolves_from_flag_or_environment_and_refuses_what_cannot_run() -> None:
    eagle3 = st.ServerView(speculative_algorithm="EAGLE3", speculative_eagle_topk=1,
                           speculative_adaptive=False, speculative_num_steps=3)

    def resolve(environ: dict[str, str], **flags: object) -> st.Setting:
        return st.resolve_and_validate(threshold_flag=flags.get("threshold"),  # type: ignore[arg-type]
                                       hysteresis_flag=flags.get("hysteresis"),  # type: ignore[arg-type]
                                       schedule_flag=flags.get("schedule"),  # type: ignore[arg-type]
                                       server=flags.get("server", eagle3), environ=environ)  # type: ignore[arg-type]

    got = resolve({}, schedule="1-16:3,17-:0")
    assert got.enabled and got.schedule == st.parse_schedule("1-16:3,17-:0") and got.threshold == 0
    assert resolve({st.DEPTH_SCHEDULE_ENV: "1-8:2,9-:1"}).schedule == st.parse_schedule("1-8:2,9-:1")
    assert resolve({st.DEPTH_SCHEDULE_ENV: "1-8:2,9-:1"}, schedule="1-:3").schedule == st.parse_schedule("1-:3")
    with pytest.raises(st.ScheduleError, match=f"^{st.DEPTH_SCHEDULE_ENV} .the fallback"):
        resolve({st.DEPTH_SCHEDULE_ENV: "1-8:2"})
    with pytest.raises(ValueError, match="are both set .flag or environment.: give one"):
        resolve({st.THRESHOLD_ENV: "16"}, schedule="1-16:3,17-:0")
    with pytest.raises(ValueError, match="each edge .* keeps its own"):
        resolve({}, schedule="1-16:3,17-:0", hysteresis=2)
    with pytest.raises(st.ScheduleError, match="depth 4 is deeper than --speculative-num-steps 3"):
        resolve({}, schedule="1-16:4,17-:0")
    with pytest.raises(ValueError, match=r"^--speculative-depth-schedule=1-16:3,17-:0 needs --speculative-eagle-topk 1"):
        resolve({}, schedule="1-16:3,17-:0", server=st.ServerView(
            speculative_algorithm="EAGLE3", speculative_eagle_topk=4, speculative_adaptive=False))
    assert st.start_log_line(0, st.parse_schedule("1-16:3,17-:0")) == \
        "Dynamic speculation disable enabled: depth schedule=1-16:3,17-:0"
    # the launcher's parser names the flag on bad input
    parser = argparse.ArgumentParser(exit_on_error=False)
    st.add_cli_args(parser)
    assert getattr(parser.parse_args([st.DEPTH_SCHEDULE_FLAG, "1-4:1,5-:0"]), st.DEPTH_SCHEDULE_DEST) == st.parse_schedule("1-4:1,5-:0")
    with pytest.raises(argparse.ArgumentError, match="the last tier must be open"):
        parser.parse_args([st.DEPTH_SCHEDULE_FLAG, "1-4:1,5-8:0"])


def test_auto_is_the_schedule_the_server_learns_and_excludes_a_threshold() -> None:
    eagle3 = st.ServerView(speculative_algorithm="EAGLE3", speculative_eagle_topk=1,
                           speculative_adaptive=False, speculative_num_steps=3)

    def resolve(environ: dict[str, str], **flags: object) -> st.Setting:
        return st.resolve_and_validate(threshold_flag=flags.get("threshold"),  # type: ignore[arg-type]
                                       hysteresis_flag=flags.get("hysteresis"),  # type: ignore[arg-type]
                                       schedule_flag=flags.get("schedule"),  # type: ignore[arg-type]
                                       server=flags.get("server", eagle3), environ=environ)  # type: ignore[arg-type]

    assert st.parse_schedule_or_auto(" Auto ") == st.AUTO
    assert st.parse_schedule_or_auto("1-8:2,9-:0") == st.parse_schedule("1-8:2,9-:0")
    with pytest.raises(st.ScheduleError, match="is not a tier; .*; or `auto`: the server learns"):
        st.parse_schedule_or_auto("auto32")
    got = resolve({}, schedule="auto")
    assert got == st.Setting(threshold=0, hysteresis=0, schedule=st.AUTO) and got.enabled
    assert resolve({st.DEPTH_SCHEDULE_ENV: "AUTO"}).schedule == st.AUTO
    assert resolve({st.DEPTH_SCHEDULE_ENV: "auto"}, schedule="1-:3").schedule == st.parse_schedule("1-:3")
    assert st.start_log_line(0, st.AUTO) == "Dynamic speculation disable enabled: depth schedule=auto"
    # with a threshold (auto or N, flag or variable), or a hysteresis, it is refused
    for environ, flags in (({}, {"threshold": "auto"}), ({st.THRESHOLD_ENV: "32"}, {}),
                           ({st.THRESHOLD_ENV: "auto"}, {})):
        with pytest.raises(ValueError, match="=auto and --speculative-disable-batch-threshold=.* are both "
                                             "set .*: give one; `auto` for"):
            resolve(environ, schedule="auto", **flags)
    with pytest.raises(ValueError, match="each edge .* keeps its own"):
        resolve({}, schedule="auto", hysteresis=2)
    with pytest.raises(st.ScheduleError, match="auto learns depths 0..K .* got K=0"):
        resolve({}, schedule="auto", server=st.ServerView(
            speculative_algorithm="EAGLE3", speculative_eagle_topk=1, speculative_adaptive=False,
            speculative_num_steps=0))
    with pytest.raises(ValueError, match=r"^--speculative-depth-schedule=auto needs --speculative-eagle-topk 1"):
        resolve({}, schedule="auto", server=st.ServerView(
            speculative_algorithm="EAGLE3", speculative_eagle_topk=4, speculative_adaptive=False))
    parser = argparse.ArgumentParser(exit_on_error=False)
    st.add_cli_args(parser)
    assert getattr(parser.parse_args([st.DEPTH_SCHEDULE_FLAG, "auto"]), st.DEPTH_SCHEDULE_DEST) == st.AUTO
    with pytest.raises(argparse.ArgumentError, match="or `auto`"):
        parser.parse_args([st.DEPTH_SCHEDULE_FLAG, "automatic"])
