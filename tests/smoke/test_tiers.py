"""The loads the smoke run and the feature matrix derive from a schedule's edges (smoke.tiers), and
the walk of a schedule they are computed with, held to the plugin's own (DepthController) step for
step: each smoke load reaches the depth of its size and none of a larger batch and leaves the server
in the first tier, the loads together visit every tier and every edge, the matrix's fillers hold
each tier and cross each edge both ways from wherever the server was; a threshold N is the
two-tier schedule."""
from __future__ import annotations

import itertools
import random

import pytest

from sglang_image_plugin.setting import DEPTH_SCHEDULE_EXAMPLE, ScheduleError
from smoke import runner
from smoke.cases import CASE_CONCURRENCY, make_cases
from smoke.tiers import THRESHOLD_MODES, Tiers, parse_smoke_schedule
from tests.smoke.matrix_fakes import EXPECTED

SCHEDULES = ["1-8:3,9-24:2,25-64:1,65-:0", DEPTH_SCHEDULE_EXAMPLE, "1-2:3,3-4:2,5-:0", "1-4:3,5-:0",
             "1-1:2,2-:1", "1-12:3,13-40:1,41-:0", "1-16:3,17-17:2,18-:0"]
PROMPTS = {"vocab_size": 3000, "prompt_ids": [5, 6, 7], "greedy_ids": [1] * 24}


@pytest.mark.parametrize("text", SCHEDULES)
def test_the_smoke_walks_a_schedule_as_the_plugin_s_controller_does(text):
    """The smoke imports the plugin's contract alone; its walk is DepthController's, step for step,
    from every tier, over batch sizes that go up and down across every edge and its hysteresis."""
    from sglang_image_plugin.depth_schedule import DepthController

    tiers = Tiers(parse_smoke_schedule(text))
    rnd = random.Random(text)
    near = {e + k for i, e in enumerate(tiers.edges) for k in range(-tiers.hysteresis(i) - 2, 3)}
    around = sorted(b for b in {1, *near, 4 * tiers.top} if b >= 1)
    for start in range(tiers.count):
        sizes = [rnd.choice(around) for _ in range(400)] + list(range(1, 4 * tiers.top + 1)) \
            + list(range(4 * tiers.top, 0, -1))
        ctl = DepthController(tiers.schedule)
        ctl.tier = start
        assert tiers.walk(sizes, start) == [ctl.step(b) for b in sizes]
        assert [tiers.resume(i) for i in range(1, tiers.count)] == \
            [ctl.resume_below(i) for i in range(1, tiers.count)]


def depth_after(tiers: Tiers, tier: int, batch_sizes: list[int]) -> int:
    """The depth the server is at after decode steps of these batch sizes, from `tier`."""
    return tiers.walk(batch_sizes, tier)[-1]


def batches_of(lengths: list[int]) -> list[int]:
    """The running batch of each step of a load sent at once, a token a step: it shrinks as its
    requests end."""
    return [sum(1 for n in lengths if n > j) for j in range(max(lengths))]


@pytest.mark.parametrize("text", SCHEDULES)
def test_every_smoke_load_runs_its_tier_and_the_loads_visit_every_tier_and_edge(text):
    tiers = Tiers(parse_smoke_schedule(text))
    sets = runner.make_schedule_prompts(PROMPTS, tiers.schedule)
    first = tiers.depths[0]
    sizes = {1}
    for name, size in tiers.edge_loads():
        lengths = [p.max_new_tokens for p in sets[name]]
        assert len(lengths) == size
        walked = tiers.walk(batches_of(lengths))  # from the first tier, where the last load left it
        assert tiers.depth_at(size) in walked, name
        assert min(walked) == tiers.depth_at(size), f"{name}: a depth of a larger batch ran"
        assert walked[-1] == first, f"{name}: the server is not back in the first tier after it"
        sizes.add(size)
    assert {tiers.depth_at(s) for s in sizes | {tiers.above}} == set(tiers.schedule.depths)
    for i, edge in enumerate(tiers.edges):  # at each edge and right above it
        assert {edge, edge + 1} <= sizes
        assert edge - tiers.hysteresis(i) in sizes  # where a server above it comes back
    assert len(sets["above"]) == tiers.above and tiers.depth_at(tiers.above) == tiers.depths[-1]
    keys = [p.key for p in runner.unique_prompts(sets)]
    assert len(keys) == len(set(keys)) and runner.make_schedule_prompts(PROMPTS, tiers.schedule) == sets


@pytest.mark.parametrize("text", SCHEDULES)
def test_the_ramp_and_the_endurance_levels_cross_every_edge(text):
    tiers = Tiers(parse_smoke_schedule(text))
    bursts = tiers.ramp_bursts()
    assert {tiers.depth_at(b) for b in bursts} == set(tiers.depths[1:])  # every tier above the first
    assert bursts == bursts[::-1] and max(bursts) == 4 * tiers.top  # up and back down
    for size in bursts:
        tier = tiers.schedule.tier_of(size)
        low, high = tiers.arrival(tier)
        starts = range(tiers.count) if high is None or high >= low else range(tier + 1)
        for start in starts:  # held whatever the burst before left
            assert depth_after(tiers, start, [size] * 3) == tiers.depth_at(size), (size, start)
    levels = tiers.endurance_levels()
    cycle = [tiers.schedule.tier_of(level) for level in levels + levels[:1]]
    assert set(cycle) == set(range(tiers.count))
    assert all(a != b for a, b in itertools.pairwise(cycle))  # every level crosses an edge


NARROW = ("1-16:3,17-17:2,18-:0", "1-2:3,3-4:2,5-:0")  # a middle tier narrower than a filler and a case


@pytest.mark.parametrize("text", [s for s in SCHEDULES if s not in NARROW])
def test_the_matrix_fillers_hold_each_tier_and_cross_each_edge_both_ways(text):
    tiers = Tiers(parse_smoke_schedule(text))
    plan = tiers.matrix_plan(CASE_CONCURRENCY)
    c = plan.concurrency
    assert 1 <= c <= CASE_CONCURRENCY
    modes = plan.expand(("below", "above", "cross_up", "cross_down"))
    assert [m.name for m in modes] == [f"depth{d}" for d in tiers.depths] + \
        [f"up{e}" for e in tiers.edges] + [f"down{e}" for e in tiers.edges]
    for m in modes:
        assert isinstance(m.base, int)
        for start in range(tiers.count):  # wherever the run before left the server
            if m.kind == "in":
                held = [m.base or c] * 3 + [m.base + k for k in range(1, c + 1)] * 3
                assert set(tiers.walk(held, start)[3:]) == {m.start}, (m, start)
                continue
            assert m.extra is not None and m.extra > 0
            case_in_flight = [m.base + k for k in range(1, c + 1)]
            if m.kind == "up":
                at_start = depth_after(tiers, start, [m.base or c] * 3 + case_in_flight)
                tier = tiers.depths.index(at_start)
                crossed = [m.base + m.extra + k for k in range(1, c + 1)]
                assert (at_start, depth_after(tiers, tier, crossed)) == (m.start, m.end), (m, start)
            else:
                at_start = depth_after(tiers, start, [m.base + m.extra] * 3)
                tier = tiers.depths.index(at_start)
                assert (at_start, depth_after(tiers, tier, case_in_flight)) == (m.start, m.end), (m, start)
    # every case's requests fit the first tier alone
    for case in make_cases(EXPECTED, tiers.top, "m", concurrency=c):
        assert case.concurrency <= tiers.resume(1)


@pytest.mark.parametrize("text", NARROW)
def test_a_tier_too_narrow_for_a_filler_and_a_case_is_refused_by_name(text):
    tier = text.split(",")[1]
    with pytest.raises(ScheduleError, match=f"--schedule: tier {tier} is too narrow .* widen it"):
        Tiers(parse_smoke_schedule(text)).matrix_plan(CASE_CONCURRENCY)


@pytest.mark.parametrize("n", [2, 4, 16, 64])
def test_a_threshold_is_the_two_tier_schedule(n):
    """The threshold's own loads and matrix modes are those of the schedule 1-N:K,N+1-:0."""
    tiers = Tiers.of_threshold(n)
    assert tiers.edges == [n] and tiers.depths == [3, 0]
    sets = runner.make_prompts(PROMPTS, n)
    assert {size for _, size in tiers.edge_loads()} >= {len(sets["at"])}
    assert tiers.above == len(sets["above"]) and tiers.ramp_bursts() == [len(sets["ramp_burst0"])]
    plan = tiers.matrix_plan(CASE_CONCURRENCY)
    assert plan.concurrency == max(1, min(CASE_CONCURRENCY, n - 1))  # make_cases' for a threshold
    below, above, up, down = plan.expand(("below", "above", "cross_up", "cross_down"))
    assert (below.base, above.base, up.base, up.extra, down.base, down.extra) == (0, 4 * n, 0, 4 * n, 0, 4 * n)
    for mine, theirs in zip((below, above, up, down), THRESHOLD_MODES.values()):
        assert mine.kind == theirs.kind  # the threshold's: the filler's 4N prompts, all of them
    assert [runner.make_prompts(PROMPTS, n)[k] for k in sets] == list(sets.values())


@pytest.mark.parametrize("text,why", [
    ("1-:3", "one tier, so nothing switches"),
    ("1-8:3,10-:0", "must start at 9"),
    ("1-8:0,9-:0", "never drafts"),
])
def test_a_schedule_the_smoke_cannot_run_is_refused_naming_the_flag(text, why):
    with pytest.raises(ScheduleError, match=f"^--schedule: .*{why}"):
        parse_smoke_schedule(text)
