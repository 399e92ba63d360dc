"""The learned depth schedule (`--speculative-depth-schedule auto`) against a simulated server (CPU).

The server: per batch-size bucket and draft depth a step time from a cost model, per request an
accept count A (of the launch depth's K drafts) drawn from one fixed distribution, of which a step at
depth d accepts min(A, d). The oracle: the monotone schedule (a larger batch never drafts deeper)
with the most traffic-weighted log tokens/s, by brute force over every such schedule. Every figure
compared is computed from the same model, never a goal of this project.
"""
from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from sglang_image_plugin.auto_accept import AcceptHistograms
from sglang_image_plugin.auto_config import AutoConfig
from sglang_image_plugin.auto_depth import AutoDepthController, DepthDecision, monotone_best
from sglang_image_plugin.auto_depth_policy import MOVE_LOG_PREFIX, AutoDepthPolicy
from sglang_image_plugin.policy import CatchUpPolicy
from sglang_image_plugin.setting import parse_schedule
from sglang_image_plugin.spec_disable import Metrics

K = 3
MAX_BATCH = 256
EDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the buckets the server's table is given per
# each bucket's traffic runs at one batch size, clear of the hysteresis below its edge
BATCH = {1: 1, 2: 2, 4: 3, 8: 6, 16: 12, 32: 24, 64: 48, 128: 96, 256: 192}
SURVIVAL = (1.0, 0.8, 0.64, 0.512)  # P(A >= j), j = 0..K


def pmf(survival: Sequence[float]) -> list[float]:
    """P(A = a), a = 0..K (A = K: all K drafts accepted)."""
    return [survival[a] - (survival[a + 1] if a + 1 < len(survival) else 0.0) for a in range(len(survival))]


def tokens(depth: int, survival: Sequence[float] = SURVIVAL) -> float:
    """Tokens a request gets per step at `depth`: 1 + E[min(A, depth)]."""
    return sum(survival[: depth + 1])


@dataclass
class Server:
    """Tokens/s per bucket and depth as a share of the bucket's best (`ratio`); step seconds follow
    from them and the accept distribution. The default table's best depth is not monotone in batch
    size: 9-16 drafts 2, 17-32 drafts 3."""

    ratio: dict[int, list[float]] = field(default_factory=lambda: {
        1: [.5, .7, .85, 1], 2: [.5, .7, .85, 1], 4: [.5, .7, .85, 1], 8: [.6, .75, .9, 1],
        16: [.7, .85, 1, .9], 32: [.75, .88, .92, 1], 64: [.85, .92, 1, .9], 128: [.92, 1, .9, .8],
        256: [1, .9, .8, .7]})
    noise: float = 0.03

    @staticmethod
    def edge(batch: int) -> int:
        return next(e for e in EDGES if batch <= e)

    def seconds(self, depth: int, batch: int) -> float:
        best = 2 * batch / (5e-3 + 4e-5 * batch)  # the best depth's tokens/s
        return batch * tokens(depth) / (best * self.ratio[self.edge(batch)][depth])

    def counts(self, depth: int, batch: int) -> list[float]:
        """A step's requests by accepted drafts, as expected (no sampling noise)."""
        out = [0.0] * (depth + 1)
        for a, p in enumerate(pmf(SURVIVAL)):
            out[min(a, depth)] += batch * p
        return out

    def raw_best(self) -> list[int]:
        return [max(range(K + 1), key=lambda d: self.ratio[e][d]) for e in EDGES]

    def oracle(self, weights: Sequence[float]) -> tuple[int, ...]:
        """The monotone schedule with the most traffic-weighted log tokens/s (brute force)."""
        schedules = itertools.combinations_with_replacement(range(K, -1, -1), len(EDGES))
        return max(schedules, key=lambda s: sum(w * math.log(self.ratio[e][d])
                                                for w, e, d in zip(weights, EDGES, s, strict=True)))


def traffic(rng: random.Random, steps: int, weights: Sequence[float], stretch: tuple[int, int] = (10, 30)) -> list[int]:
    """Stretches of steps at each bucket's batch size, the buckets drawn by `weights`."""
    out: list[int] = []
    sizes = [BATCH[e] for e in EDGES]
    while len(out) < steps:
        out += [rng.choices(sizes, weights)[0]] * rng.randint(*stretch)
    return out[:steps]


def learned(ctl: AutoDepthController) -> tuple[int, ...]:
    return tuple(ctl.schedule.depth_at(BATCH[e]) for e in EDGES)


def drive(ctl: AutoDepthController, server: Server, batches: Sequence[int], rng: random.Random) -> list[tuple[int, ...]]:
    """Each step decided, timed and verified; the learned schedule after each step."""
    out = []
    for batch in batches:
        depth = ctl.decide(batch)
        if depth:
            ctl.accept.add_counts(depth, server.counts(depth, batch))
        ctl.record(depth, batch, server.seconds(depth, batch) * math.exp(rng.gauss(0, server.noise)))
        out.append(learned(ctl))
    return out


# ----------------------------------------------------------------------------- acceptance
def test_the_accept_length_of_every_depth_from_steps_cut_off_at_theirs() -> None:
    # Steps mostly at depth 1, some at 2, few at 3: a step at depth d says only that A >= d of a
    # request that accepted all d. P(A >= j) is recovered from the steps deep enough to show it.
    rng = random.Random(5)
    survival = (1.0, 0.85, 0.6, 0.3)
    draws = pmf(survival)
    hist = AcceptHistograms(K, memory=0.9999)
    for _ in range(6000):
        depth = rng.choices((1, 2, 3), (0.7, 0.2, 0.1))[0]
        hist.add(depth, [min(a, depth) for a in rng.choices(range(K + 1), draws, k=16)])
    got = hist.survival()
    assert got is not None
    assert got == pytest.approx(survival, abs=0.02)
    assert hist.tokens_per_request() == pytest.approx([tokens(d, survival) for d in range(K + 1)], abs=0.03)
    # the mean accepted drafts of every step pooled, as a single accept length would be, is far off
    pooled = sum(sum(a * n for a, n in enumerate(c)) / sum(c) * sum(c) for c in hist.counts.values())
    assert pooled / sum(sum(c) for c in hist.counts.values()) < tokens(3, survival) - 1 - 0.5
    # no step deeper than 2: the third draft's chance is taken as the second's (a prior)
    shallow = AcceptHistograms(K, memory=0.99)
    shallow.add_counts(2, [10, 20, 70])  # P(A >= 1) = 0.9; P(A >= 2 | A >= 1) = 70 / 90
    assert shallow.survival() == pytest.approx([1, 0.9, 0.7, 0.7 * 70 / 90])
    assert AcceptHistograms(K, 0.99).survival() is None
    hist.add(1, [0, 1, 5])  # more than the depth drafted: counted as all accepted
    assert hist.counts[1][1] == pytest.approx(hist.counts[1][1])  # (no IndexError)


# ----------------------------------------------------------------------------- the schedule
@pytest.mark.parametrize("weights", [[1] * 9, [1, 1, 1, 1, 1, 3, 1, 1, 1]], ids=["even", "heavy-17-32"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_learns_the_best_monotone_schedule_of_a_cost_model(weights: list[int], seed: int) -> None:
    server = Server()
    raw = server.raw_best()
    assert raw != sorted(raw, reverse=True)  # the per-bucket best is not monotone (16: 2, 32: 3)
    best = server.oracle(weights)
    assert best == ((3, 3, 3, 3, 2, 2, 2, 1, 0) if weights[5] == 1 else (3, 3, 3, 3, 3, 3, 2, 1, 0))
    rng = random.Random(seed)
    ctl = AutoDepthController(AutoConfig(max_batch_size=MAX_BATCH, bucket_edges=EDGES), K)
    assert learned(ctl) == (3,) * 9  # cold start: K everywhere
    history = drive(ctl, server, traffic(rng, 40_000, weights), rng)
    # learned within 30,000 steps, and held from there on
    assert set(history[30_000:]) == {best}, (history[-1], ctl.estimates_text())
    assert str(ctl.schedule) == {1: "1-8:3,9-64:2,65-128:1,129-:0", 3: "1-32:3,33-64:2,65-128:1,129-:0"}[weights[5]]
    assert ctl.accept.tokens_per_request() == pytest.approx([tokens(d) for d in range(K + 1)])


def test_the_programme_resolves_a_non_monotone_best_with_the_least_loss() -> None:
    # Two buckets, figures known: the first gains 15% at depth 2, the second loses 8% there. Each
    # alone would go its own way; monotone, both go to 2 (it loses less than it gains) unless the
    # second bucket's traffic outweighs the first's.
    from sglang_image_plugin.auto_depth import Cell

    def row(values: dict[int, float]) -> dict[int, Cell]:
        return {d: Cell(math.log(v), 1e-6, True) for d, v in values.items()}

    table = [row({3: 1.0, 2: 1.15}), row({3: 1.0, 2: 0.92})]
    assert monotone_best(table, [0.5, 0.5], [3, 3], K, 0.02) == [2, 2]
    assert monotone_best(table, [0.2, 0.8], [3, 3], K, 0.02) == [3, 3]
    # a gain within the margin does not count: the schedule stays
    assert monotone_best([row({3: 1.0, 2: 1.015}), row({3: 1.0, 2: 1.01})], [0.5, 0.5], [3, 3], K, 0.02) == [3, 3]
    # nothing known: the current schedule, whatever it is
    assert monotone_best([{}, {}], [0.5, 0.5], [2, 1], K, 0.02) == [2, 1]


@dataclass
class Shaped:
    """A step-cost shape instead of a table: the target verifies depth + 1 tokens a request, the
    draft adds a fixed and a per-request cost per depth and one draft extend; the best depth falls
    from 3 at small batches through 2 and 1 to plain-or-1 at 256, its neighbours a few percent
    behind near each crossover."""

    survival: tuple[float, ...] = (1.0, 0.85, 0.7, 0.6)

    def seconds(self, depth: int, batch: int) -> float:
        if depth == 0:
            return 5e-3 + 6e-5 * batch
        return 5e-3 + 6e-5 * batch * (depth + 1) + 0.8e-3 + depth * (0.5e-3 + 2e-6 * batch)

    def tok_s(self, depth: int, batch: int) -> float:
        return batch * tokens(depth, self.survival) / self.seconds(depth, batch)

    def counts(self, depth: int, batch: int) -> list[float]:
        out = [0.0] * (depth + 1)
        for a, p in enumerate(pmf(self.survival)):
            out[min(a, depth)] += batch * p
        return out


def test_at_a_steady_load_it_serves_within_3_percent_of_the_best_depth() -> None:
    # After a learning pass of 8,000 steps at one load, the next 2,000 (exploration included)
    # get at least 97% of the tokens/s the best depth at each step's batch size would.
    model = Shaped()
    for load in (1, 8, 24, 48, 64, 80, 100, 128, 160, 200, 256):
        rng = random.Random(load)
        ctl = AutoDepthController(AutoConfig(max_batch_size=MAX_BATCH), K)
        spent = best = 0.0
        for step in range(10_000):
            batch = max(1, min(MAX_BATCH, load + rng.randint(-max(1, load // 16), max(1, load // 16))))
            depth = ctl.decide(batch)
            if depth:
                ctl.accept.add_counts(depth, model.counts(depth, batch))
            ctl.record(depth, batch, model.seconds(depth, batch) * math.exp(rng.gauss(0, 0.03)))
            if step >= 8_000:
                tokens_now = batch * tokens(depth, model.survival)
                spent += model.seconds(depth, batch)
                best += tokens_now / max(model.tok_s(d, batch) for d in range(K + 1))
        assert best / spent >= 0.97, (load, best / spent, ctl.estimates_text())


# ----------------------------------------------------------------------------- exploration
def test_exploration_is_bounded_and_times_every_depth_of_every_bucket_visited() -> None:
    server = Server()
    rng = random.Random(4)
    cfg = AutoConfig(max_batch_size=MAX_BATCH, bucket_edges=EDGES)
    ctl = AutoDepthController(cfg, K)
    batches = traffic(rng, 30_000, [1] * 9)
    explored_at = []
    for step, batch in enumerate(batches):
        before = ctl.explore_steps
        depth = ctl.decide(batch)
        if ctl.explore_steps > before:
            explored_at.append(step)
        if depth:
            ctl.accept.add_counts(depth, server.counts(depth, batch))
        ctl.record(depth, batch, server.seconds(depth, batch))
    # bursts of at most explore_steps, their starts at least explore_gap apart
    starts = [s for i, s in enumerate(explored_at) if i == 0 or s - explored_at[i - 1] > cfg.explore_steps]
    assert all(b - a >= cfg.explore_gap for a, b in itertools.pairwise(starts))
    assert ctl.explore_steps <= (len(batches) // cfg.explore_gap + 1) * cfg.explore_steps
    assert ctl.explore_steps / len(batches) <= cfg.explore_share
    # every depth of every bucket got its figure
    for est in ctl.estimates():
        assert sorted(est["tok_s"]) == ["0", "1", "2", "3"], est  # type: ignore[call-overload]


# ----------------------------------------------------------------------------- the policy
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Recording(AutoDepthController):
    def __init__(self, config: AutoConfig) -> None:
        super().__init__(config, K)
        self.recorded: list[tuple[int, int, float]] = []
        self.accepted: list[int] = []  # the depth of each result taken as acceptance

    def record_accepted(self, depth: int, num_correct_drafts_per_req: Sequence[int]) -> None:
        self.accepted.append(depth)
        super().record_accepted(depth, num_correct_drafts_per_req)

    def record(self, depth: int, batch_size: int, step_seconds: float) -> None:
        self.recorded.append((depth, batch_size, step_seconds))
        super().record(depth, batch_size, step_seconds)


def run_overlapped(policy: AutoDepthPolicy | CatchUpPolicy, clock: Clock, server: Server,
                   batches: Sequence[int], rng: random.Random) -> list[int]:
    """sglang's overlap loop: each interval between two asks is the previous step's time; a
    step's verify result (each request's min(A, depth), A drawn) comes once the next step is
    launched. A catch-up step (plain) verifies no draft."""
    steps, late, previous = [], None, 0.0
    draws = pmf(SURVIVAL)
    for batch in batches:
        k = policy.get_steps_for_batch(batch)
        steps.append(k)
        clock.now += previous
        if late is not None:
            policy.on_verify_complete(*late)
        late = ([min(a, k) for a in rng.choices(range(K + 1), draws, k=batch)], batch)
        previous = server.seconds(k, batch)
    return steps


def test_the_first_step_after_a_change_of_depth_is_left_out() -> None:
    clock, server = Clock(), Server(noise=0.0)
    ctl = Recording(AutoConfig(max_batch_size=MAX_BATCH))
    policy = AutoDepthPolicy(ctl, step_clock=clock, log_fn=lambda _: None)
    assert policy.candidate_steps == [0, 1, 2, 3]
    policy.set_cuda_graph_bs([8, 1, 4])
    assert all(policy.cuda_graph_bs_for_step(d) == [1, 4, 8] for d in range(K + 1))
    rng = random.Random(2)
    batches = traffic(rng, 6000, [1] * 9)
    steps = run_overlapped(policy, clock, server, batches, rng)
    # recorded: each step whose step before ran at the same depth, with that step's time
    same = [i for i in range(1, len(batches) - 1) if steps[i] == steps[i - 1]]
    assert len(ctl.recorded) == len(same) < len(batches) - 2 and policy.dropped == 0
    assert len({d for d, _, _ in ctl.recorded}) == K + 1  # every depth ran
    for (depth, batch, seconds), i in zip(ctl.recorded, same, strict=True):
        assert (depth, batch) == (steps[i], batches[i])
        assert seconds == pytest.approx(server.seconds(depth, batches[i - 1]))
    # the accepted drafts of every drafting step, timed or not
    assert ctl.accept.tokens_per_request() == pytest.approx([tokens(d) for d in range(K + 1)], abs=0.05)


def test_the_catch_up_step_s_result_is_no_depth_s_acceptance() -> None:
    # Cold start explores the plain step first; the step that would draft again runs the catch-up
    # step (plain, decided at depth K): its result verifies no draft and is no depth's acceptance.
    clock, server = Clock(), Server(noise=0.0)
    ctl = Recording(AutoConfig(max_batch_size=MAX_BATCH))
    policy = CatchUpPolicy(AutoDepthPolicy(ctl, step_clock=clock, log_fn=lambda _: None))
    steps = run_overlapped(policy, clock, server, [4] * 12, random.Random(3))
    assert steps == [0] * 7 + [3] * 5 and policy.catch_up_steps == 1
    # the 4 drafting steps whose results came (the last one's comes with the next step)
    assert ctl.accepted == [3] * 4


class Seen(Metrics):
    def __init__(self) -> None:
        self.depths: list[int] = []
        self.plain: list[bool] = []

    def observe(self, plain_mode: bool, speculative_steps: int, plain_steps: int) -> None:
        self.plain.append(plain_mode)

    def observe_depth(self, depth: int) -> None:
        self.depths.append(depth)


def test_each_move_is_logged_with_its_reason_traced_and_shown() -> None:
    clock, server = Clock(), Server(noise=0.0)
    lines: list[str] = []
    traced: list[dict[str, object]] = []
    ctl = AutoDepthController(AutoConfig(max_batch_size=MAX_BATCH, bucket_edges=EDGES), K)
    # the log line's clock is the steps' (one line per 5 s of them at most)
    policy = AutoDepthPolicy(ctl, step_clock=clock, log_fn=lines.append, clock=clock, trace=traced.append)
    policy.metrics = seen = Seen()
    rng = random.Random(1)
    batches = traffic(rng, 30_000, [1] * 9)
    run_overlapped(policy, clock, server, batches, rng)
    moves = [r for r in traced if r["kind"] == "move"]
    assert ctl.schedule_changes == len(moves) >= 2
    assert 1 <= len(lines) <= ctl.schedule_changes
    first = moves[0]
    assert lines[0].startswith(f"{MOVE_LOG_PREFIX} {first['after']} (auto, was 1-:3; ")
    # the reason: each moved bucket, its depth before and after, the tok/s of each depth timed there
    buckets = first["buckets"]
    assert isinstance(buckets, list)
    for bucket in buckets:
        assert f"{bucket['low']}-{bucket['high']}: {bucket['before']} -> {bucket['after']} (" in lines[0]
        for depth, tok_s in bucket["tok_s"].items():
            assert f"d{depth} {tok_s:.0f}" in lines[0]
    # (a bucket moved for its own figures, others with it where monotonicity moves them)
    assert any(str(b["after"]) in b["tok_s"] for b in buckets)
    assert lines[-1].endswith(f"schedule_changes={ctl.schedule_changes}") or "not logged" in lines[-1]
    # the steps' trace records carry their depth and the schedule they ran under
    steps = [r for r in traced if r["kind"] in ("speculative", "plain")]
    assert {r["depth"] for r in steps} == {0, 1, 2, 3} and all("schedule" in r for r in steps)
    # server info: the learned schedule in the flag's grammar, per bucket and depth the figures
    snap = policy.snapshot()
    assert snap["schedule"] == "auto" and parse_schedule(snap["learned"]) == ctl.schedule
    assert snap["learned"] == "1-8:3,9-64:2,65-128:1,129-:0"
    assert snap["schedule_changes"] == ctl.schedule_changes and snap["depth_changes"] > 0
    assert set(snap["steps_by_depth"]) == {"0", "1", "2", "3"} and snap["unrecorded_steps"] == 0
    top = snap["estimates"][-1]
    assert (top["low"], top["high"], top["depth"]) == (129, 256, 0) and set(top["tok_s"]) == {"0", "1", "2", "3"}
    assert snap["accept_length_by_depth"] == pytest.approx(
        {str(d): tokens(d) for d in range(K + 1)}, abs=0.05)
    # the metrics: each step's depth (the gauge), plain or not
    assert len(seen.depths) == len(batches) and set(seen.depths) == {0, 1, 2, 3}
    assert seen.plain == [d == 0 for d in seen.depths]


def test_tensor_parallel_ranks_follow_rank_0() -> None:
    # Rank 1 times its steps differently (its own estimate would learn another schedule): through
    # `agree` it takes rank 0's decision at every update, and decides every step alike.
    server, other = Server(), Server(ratio={e: list(reversed(r)) for e, r in Server().ratio.items()})
    decisions: list[DepthDecision] = []

    def rank0(decision: DepthDecision) -> DepthDecision:
        decisions.append(decision)
        return decision

    cfg = AutoConfig(max_batch_size=MAX_BATCH)
    ctl0 = AutoDepthController(cfg, K, agree=rank0)
    ctl1 = AutoDepthController(cfg, K, agree=lambda _: decisions[-1])
    alone = AutoDepthController(cfg, K)
    rng = random.Random(9)
    diverged = 0
    for batch in traffic(rng, 12_000, [1] * 9):
        d0, d1, d = ctl0.decide(batch), ctl1.decide(batch), alone.decide(batch)
        assert d0 == d1
        diverged += d != d0
        for ctl, srv, depth in ((ctl0, server, d0), (ctl1, other, d1), (alone, other, d)):
            if depth:
                ctl.accept.add_counts(depth, srv.counts(depth, batch))
            ctl.record(depth, batch, srv.seconds(depth, batch) * math.exp(rng.gauss(0, 0.03)))
    assert ctl0.schedule_text == ctl1.schedule_text != alone.schedule_text and diverged > 0


def test_bad_input_is_refused() -> None:
    cfg = AutoConfig(max_batch_size=MAX_BATCH)
    with pytest.raises(ValueError, match="needs --speculative-num-steps >= 1"):
        AutoDepthController(cfg, 0)
    ctl = AutoDepthController(cfg, K)
    for call, match in ((lambda: ctl.decide(0), "batch_size"), (lambda: ctl.record(4, 1, 0.01), "depth 4"),
                        (lambda: ctl.record(1, 1, math.nan), "step_seconds"),
                        (lambda: ctl.record_accepted(0, [0]), "depth 0 not in 1..3")):
        with pytest.raises(ValueError, match=match):
            call()


def test_the_acceptance_watch_pairs_plain_phases_at_the_learned_depth() -> None:
    # The learned schedule changes depth often (exploration bursts, its tiers): the watch still
    # pairs a plain phase only with steps of one depth on either side, and the accept length
    # after it equals the one before (every request accepts 2 of 3 drafts: min(2, depth)).
    from sglang_image_plugin.acceptance import AcceptanceAroundPlain

    clock, server = Clock(), Server(noise=0.0)
    policy = CatchUpPolicy(AutoDepthPolicy(AutoDepthController(AutoConfig(max_batch_size=MAX_BATCH), K),
                                           step_clock=clock, log_fn=lambda _: None))
    watch = AcceptanceAroundPlain()
    late = None
    for batch in traffic(random.Random(6), 20_000, [1] * 9, stretch=(100, 400)):
        k = policy.get_steps_for_batch(batch)
        watch.decided(k, batch)
        clock.now += server.seconds(k, batch)
        if late is not None:
            policy.on_verify_complete(late, len(late))
            watch.verified(late)
        late = [min(2, k)] * batch
    view = watch.view()
    assert view["phases_measured"] >= 3 and view["last_depth"] in (1, 2, 3)
    assert view["last_before"] == view["last_after"] == 1 + min(2, view["last_depth"])
    assert view["worst_after_over_before"] == 1.0
