"""The `auto` threshold's controller against a synthetic cost model of a GPU's decode steps (CPU).

The cost model gives each mode's step seconds as fixed + per-request cost, EAGLE-3's speculative
step costing more per request (it verifies several tokens of each and drafts) and producing the
accept length in tokens per request; step times get log-normal noise, accept lengths binomial-like
noise. Traffic is closed-loop-like: stretches of steps at one batch size (log-uniform over 1-256),
a few requests up or down per step. Every figure compared is computed from the same model, never a
goal of this project.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
from dataclasses import dataclass

import pytest

from sglang_image_plugin.auto_policy import AutoPolicy, StepTrace
from sglang_image_plugin.auto_threshold import (
    AutoConfig,
    AutoController,
    Decision,
    Mode,
    Prior,
    resume_batch_size,
)
from sglang_image_plugin.policy import CatchUpPolicy
from sglang_image_plugin.setting import (
    AUTO,
    THRESHOLD_ENV,
    THRESHOLD_FLAG,
    ThresholdError,
    add_cli_args,
    parse_threshold,
    resolve_threshold,
)

MAX_BATCH = 256
# the layout the cost models below place their crossovers against (at or between its edges); the
# default is finer above 32 (auto_config.quarter_octave_edges)
POWERS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class CostModel:
    plain_fixed: float = 5e-3
    plain_per_request: float = 5e-5
    spec_fixed: float = 7e-3
    spec_per_request: float = 3e-4
    accept: float = 3.2  # tokens per request per speculative step

    def seconds(self, mode: Mode, batch: int) -> float:
        if mode is Mode.SPECULATIVE:
            return self.spec_fixed + self.spec_per_request * batch
        return self.plain_fixed + self.plain_per_request * batch

    def tok_s(self, mode: Mode, batch: int) -> float:
        return batch * (self.accept if mode is Mode.SPECULATIVE else 1.0) / self.seconds(mode, batch)

    def share_of_best(self, mode: Mode, batch: int) -> float:
        """This mode's tokens/s over the better mode's at this batch size."""
        return self.tok_s(mode, batch) / max(self.tok_s(m, batch) for m in Mode)

    def crossover(self) -> float:
        """The batch size where the two modes' tokens/s are equal."""
        a = self.accept
        return (self.spec_fixed - a * self.plain_fixed) / (a * self.plain_per_request - self.spec_per_request)


def traffic(rng: random.Random, steps: int, low: int = 1, high: int = MAX_BATCH) -> list[int]:
    out: list[int] = []
    while len(out) < steps:
        level = round(math.exp(rng.uniform(math.log(low), math.log(high))))
        for _ in range(rng.randint(50, 300)):
            out.append(min(high, max(low, level + rng.randint(-2, 2))))
    return out[:steps]


@dataclass
class Run:
    modes: list[Mode]
    policy: list[Mode]  # the crossover's mode at each step (exploration aside)
    crossovers: list[int]
    share: float  # mean over steps of the chosen mode's tokens/s over the better one's


def simulate(ctl: AutoController, model: CostModel, batches: list[int], rng: random.Random,
             noise: float = 0.15, accept_at: dict[int, float] | None = None) -> Run:
    run = Run([], [], [], 0.0)
    for step, batch in enumerate(batches):
        if accept_at and step in accept_at:
            model.accept = accept_at[step]
        mode = ctl.decide(batch)
        seconds = model.seconds(mode, batch) * math.exp(rng.gauss(0, noise))
        tokens = batch
        if mode is Mode.SPECULATIVE:
            tokens = round(batch * model.accept + rng.gauss(0, 0.8 * math.sqrt(batch)))
            tokens = max(batch, min(4 * batch, tokens))
        ctl.record(mode, batch, seconds, tokens)
        run.modes.append(mode)
        run.policy.append(ctl.mode)
        run.crossovers.append(ctl.crossover())
        run.share += model.share_of_best(mode, batch) / len(batches)
    return run


def fixed_share(model: CostModel, batches: list[int], n: int) -> float:
    """How well a fixed threshold N serves these batches: the mean share of the better mode."""
    return sum(model.share_of_best(Mode.SPECULATIVE if b <= n else Mode.PLAIN, b) for b in batches) / len(batches)


def best_fixed_threshold(model: CostModel, batches: list[int], edges: tuple[int, ...]) -> tuple[int, float]:
    """The bucket edge N that, as a fixed threshold, serves these batches best, and that share."""
    scores = {n: fixed_share(model, batches, n) for n in (0, *edges)}
    best = max(scores, key=lambda n: scores[n])
    return best, scores[best]


# where the model's crossover lies inside a bucket, the edges on either side of it serve the
# traffic within 1% of each other (the tolerance a run's share is held to below): which one the
# controller settles on depends on the batch sizes of the bucket's latest traffic and on the noise
# of its last estimates (the hysteresis keeps it there)
EDGE_SHARE = 0.01


def changes(seq: list[Mode] | list[int]) -> int:
    return sum(a != b for a, b in itertools.pairwise(seq))


# ----------------------------------------------------------------------------- the estimator
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_finds_the_crossover_of_a_cost_model(seed):
    rng = random.Random(seed)
    model = CostModel()
    cfg = AutoConfig(max_batch_size=MAX_BATCH, bucket_edges=POWERS)
    batches = traffic(rng, 20000)
    ctl = AutoController(cfg)
    run = simulate(ctl, model, batches, rng)
    best, best_share = best_fixed_threshold(model, batches, cfg.edges)
    assert best == 64 and 32 < model.crossover() < 128  # the model's crossover lies in the 33-64 bucket
    assert ctl.crossover() in (32, 64) and fixed_share(model, batches, ctl.crossover()) > best_share - EDGE_SHARE
    # it serves the traffic nearly as well as the best fixed threshold, the difference being the
    # exploration and the learning at the start, and better than either mode alone
    always = {m: sum(model.share_of_best(m, b) for b in batches) / len(batches) for m in Mode}
    assert run.share > max(always.values())
    assert run.share > best_share - cfg.explore_share - 0.01
    # its estimates rank the modes as the model does in every bucket away from the crossover
    for est in ctl.estimates():
        assert est.speculative_tok_s is not None and est.plain_tok_s is not None
        b = round(est.batch_size)
        if abs(math.log(b / model.crossover())) > 0.5:
            assert (est.speculative_tok_s > est.plain_tok_s) == (b < model.crossover()), est


def test_stable_under_noise_where_hysteresis_holds_it():
    """Noisy steps at batch sizes on both sides of the crossover for a long time: the crossover
    settles and stays; without the margin and with short averages it flaps."""
    model = CostModel()
    batches = traffic(random.Random(7), 30000, low=24, high=160)
    steady = AutoController(AutoConfig(max_batch_size=MAX_BATCH, bucket_edges=POWERS))
    run = simulate(steady, model, batches, random.Random(8), noise=0.25)
    late = run.crossovers[5000:]
    assert changes(late) <= 2 and late[-1] == 64
    # the running batch's mode changes only where the traffic crosses the crossover's band
    crossings = sum((a <= 64) != (b <= 64) for a, b in itertools.pairwise(batches[5000:]))
    assert changes(run.policy[5000:]) <= crossings + 2 * changes(late)
    jumpy = AutoController(AutoConfig(max_batch_size=MAX_BATCH, bucket_edges=POWERS, margin=0.0, memory=0.3, update_every=1))
    flappy = simulate(jumpy, model, batches, random.Random(8), noise=0.25)
    assert changes(flappy.crossovers[5000:]) > 10 * max(1, changes(late))


@pytest.mark.parametrize("seed", [3, 8])
def test_tracks_a_shift_of_acceptance(seed):
    """The draft's acceptance falls (harder prompts) then recovers: the crossover follows both ways,
    from the live accept length of the buckets that speculate and from exploration."""
    rng = random.Random(seed)
    model = CostModel()
    batches = traffic(rng, 36000)
    cfg = AutoConfig(max_batch_size=MAX_BATCH, bucket_edges=POWERS)
    ctl = AutoController(cfg)
    # (2.03: the crossover falls at the edge of two buckets, not within one where the modes are
    # too close to tell apart)
    run = simulate(ctl, model, batches, rng, accept_at={12000: 2.03, 24000: 3.2})
    bests = []
    for start, accept in ((0, 3.2), (12000, 2.03), (24000, 3.2)):
        model.accept = accept
        best, _ = best_fixed_threshold(model, batches[start:start + 12000], cfg.edges)
        bests.append(best)
        assert run.crossovers[start + 11999] == best, (start, accept)
        # and it got there within a few thousand steps
        assert run.crossovers[start + 4000:start + 12000].count(best) > 0.9 * 8000
    assert bests == [64, 16, 64]


def test_exploration_is_bounded_and_covers_every_bucket_visited():
    rng = random.Random(5)
    cfg = AutoConfig(max_batch_size=MAX_BATCH, explore_steps=4, explore_gap=128)
    ctl = AutoController(cfg)
    batches = traffic(rng, 20000)
    run = simulate(ctl, CostModel(), batches, rng)
    explored = sum(m is not p for m, p in zip(run.modes, run.policy))
    assert explored == ctl.explore_steps + ctl.trial_steps and ctl.explore_steps > 0
    assert ctl.explore_steps <= cfg.explore_share * len(batches) + cfg.explore_steps
    # trials: one at a time, on either side of the crossover, one a bucket every trial_gap steps
    assert ctl.trial_steps <= 2 * (len(batches) // cfg.trial_gap + 1) * (cfg.most_trial_steps + 2)
    assert all(e.speculative_tok_s and e.plain_tok_s for e in ctl.estimates())
    # a steady load in one bucket re-measures the other mode once per stale period, no more
    steady = AutoController(AutoConfig(max_batch_size=MAX_BATCH, stale_steps=2000))
    simulate(steady, CostModel(), [200] * 20000, random.Random(6))
    assert steady.crossover() < 200
    assert steady.explore_steps <= (20000 // 2000 + 1) * steady.config.explore_steps


def test_prior_gives_the_first_crossover_and_measurements_replace_it():
    model = CostModel()
    sizes = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
    prior = Prior(model.accept, {b: model.seconds(Mode.SPECULATIVE, b) for b in sizes},
                  {b: model.seconds(Mode.PLAIN, b) for b in sizes})
    cfg = AutoConfig(max_batch_size=MAX_BATCH, bucket_edges=POWERS)
    assert AutoController(cfg, prior).crossover() == 64
    assert AutoController(cfg).crossover() == MAX_BATCH  # no prior: speculate, as EAGLE-3 does
    # a prior that believes speculation always pays is corrected by the steps
    wrong = Prior(4.0, {b: model.seconds(Mode.PLAIN, b) for b in sizes},
                  {b: model.seconds(Mode.PLAIN, b) for b in sizes})
    ctl = AutoController(cfg, wrong)
    assert ctl.crossover() == MAX_BATCH
    rng = random.Random(4)
    simulate(ctl, model, traffic(rng, 12000), rng)
    assert ctl.crossover() == 64


def test_tensor_parallel_ranks_agree_through_the_callback():
    """Every re-estimate goes through `agree` (a TP hook broadcasts rank 0's), at the same steps."""
    asked: list[Decision] = []

    def rank0_says(decision: Decision) -> Decision:
        asked.append(decision)
        return Decision(3, frozenset())  # rank 0's view: buckets 1, 2, 3-4 speculate

    cfg = AutoConfig(max_batch_size=MAX_BATCH, update_every=16)
    ctl = AutoController(cfg, agree=rank0_says)
    rng = random.Random(2)
    run = simulate(ctl, CostModel(), traffic(rng, 640), rng)
    assert len(asked) == 640 // 16 and set(run.crossovers[16:]) == {4}
    assert all(p is Mode.PLAIN for p, b in zip(run.policy[16:], traffic(random.Random(2), 640)[16:])
               if b > 4)


def test_ranks_with_their_own_step_times_run_their_trials_alike():
    """Tensor-parallel ranks time their steps apart (each its own noise) and must still run
    every step in the same mode: a trial's blocks end by counts of steps, and whether its pairs
    have decided (which rests on each rank's seconds) reaches the ranks through rank 0's
    Decision, as the crossover does."""
    said: list[Decision] = []

    def rank0_tells(decision: Decision) -> Decision:
        said.append(decision)
        return decision

    cfg = AutoConfig(max_batch_size=4096)
    ranks = [AutoController(cfg, agree=rank0_tells), AutoController(cfg, agree=lambda _: said[-1])]
    noise = [random.Random(1), random.Random(2)]
    rng = random.Random(3)
    modes: list[list[Mode]] = [[], []]
    for _ in range(30000):
        batch = 220 - rng.randint(0, 6) if rng.random() < 0.9 else 128  # near a tie: trials
        step = [ctl.decide(batch) for ctl in ranks]  # rank 0 first, as its broadcast comes first
        for r, ctl in enumerate(ranks):
            mode = step[r]
            seconds = h100_line(H100_MEDIAN[mode], batch) * math.exp(noise[r].gauss(0, 0.6))
            ctl.record(mode, batch, seconds, round(batch * H100_ACCEPT) if mode is Mode.SPECULATIVE else batch)
            modes[r].append(mode)
    assert ranks[0].trial_steps > 0
    assert modes[0] == modes[1]
    assert [c.crossover() for c in ranks] == [ranks[0].crossover()] * 2


def test_switches_like_a_fixed_threshold_around_the_crossover():
    assert [resume_batch_size(n) for n in (0, 1, 2, 8, 16, 64, 256)] == [0, 1, 1, 7, 14, 56, 224]
    prior = Prior(3.2, {b: CostModel().seconds(Mode.SPECULATIVE, b) for b in (1, 64, 128)},
                  {b: CostModel().seconds(Mode.PLAIN, b) for b in (1, 64, 128)})
    cfg = AutoConfig(max_batch_size=MAX_BATCH, stale_steps=10**9, explore_steps=1, explore_gap=10**6)
    ctl = AutoController(cfg, prior)
    n = ctl.crossover()
    assert n == 64
    seen = [ctl.decide(b) for b in (60, 64, 65, 60, 57, 56, 65)]
    # (the first step explores: nothing recent was measured)
    assert seen[1:] == [Mode.SPECULATIVE, Mode.PLAIN, Mode.PLAIN, Mode.PLAIN, Mode.SPECULATIVE, Mode.PLAIN]


def test_the_first_batch_after_an_idle_server_takes_its_side_by_the_crossover_alone():
    prior = Prior(3.2, {b: CostModel().seconds(Mode.SPECULATIVE, b) for b in (1, 64, 128)},
                  {b: CostModel().seconds(Mode.PLAIN, b) for b in (1, 64, 128)})
    cfg = AutoConfig(max_batch_size=MAX_BATCH, stale_steps=10**9, explore_steps=1, explore_gap=10**6)
    ctl = AutoController(cfg, prior)
    assert ctl.crossover() == 64
    ctl.decide(1)  # the first step explores
    assert [ctl.decide(b) for b in (65, 64, 60)] == [Mode.PLAIN] * 3  # held plain down to 56
    ctl.note_idle()
    assert [ctl.decide(b) for b in (64, 65, 64)] == [Mode.SPECULATIVE, Mode.PLAIN, Mode.PLAIN]


def test_state_for_server_info():
    ctl = AutoController(AutoConfig(max_batch_size=8))
    ctl.record(ctl.decide(4), 4, 0.01, 4)
    st = ctl.state()
    assert st["threshold"] == AUTO and st["crossover"] == 8
    assert st["speculative_steps"] + st["plain_steps"] == 1  # type: ignore[operator]
    assert set(st) >= {"mode", "accept_length", "explore_steps", "mode_changes", "crossover_changes"}


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("raw,want", [("auto", AUTO), ("AUTO", AUTO), (" auto ", AUTO), ("16", 16),
                                      (" 8 ", 8), ("0", 0), (32, 32)])
def test_threshold_values(raw, want):
    assert parse_threshold(raw) == want


@pytest.mark.parametrize("raw", ["auto16", "16auto", "auto,16", "auto 16", "-1", "-0", "+4", "1.5",
                                 "1e3", "0x10", "²", "garbage", "", "  ", -3, 2.0, True, None])
def test_bad_threshold_values_are_refused_naming_the_flag(raw):
    with pytest.raises(ThresholdError) as ei:
        parse_threshold(raw)
    assert THRESHOLD_FLAG in str(ei.value)
    if isinstance(raw, str) and raw.strip():
        assert "auto" in str(ei.value) and repr(raw) in str(ei.value)


def test_zero_is_refused_where_off_is_not_a_choice():
    assert parse_threshold("0") == 0
    with pytest.raises(ThresholdError, match=">= 1"):
        parse_threshold("0", allow_zero=False)


def test_flag_wins_over_the_environment_and_a_bad_environment_names_both():
    assert resolve_threshold(None, {}) == 0
    assert resolve_threshold(None, {THRESHOLD_ENV: "auto"}) == AUTO
    assert resolve_threshold("12", {THRESHOLD_ENV: "auto"}) == 12
    assert resolve_threshold(None, {THRESHOLD_ENV: " "}) == 0
    with pytest.raises(ThresholdError) as ei:
        resolve_threshold(None, {THRESHOLD_ENV: "auto-ish"})
    assert THRESHOLD_ENV in str(ei.value) and THRESHOLD_FLAG in str(ei.value)


def test_argparse_shows_the_message(capsys):
    ap = argparse.ArgumentParser()
    add_cli_args(ap)  # the flag as the plugin adds it to sglang's parser
    assert ap.parse_args([THRESHOLD_FLAG, "auto"]).speculative_disable_batch_threshold == AUTO
    with pytest.raises(SystemExit):
        ap.parse_args([THRESHOLD_FLAG, "auto32"])
    assert "'auto32' is not a batch-size threshold" in capsys.readouterr().err


@pytest.mark.parametrize("kw,word", [({"max_batch_size": 0}, "max_batch_size"),
                                     ({"bucket_edges": (1, 4, 2, 8)}, "bucket_edges"),
                                     ({"bucket_edges": (1, 2, 4)}, "bucket_edges"),
                                     ({"margin": -0.1}, "margin"), ({"memory": 1.0}, "memory"),
                                     ({"explore_steps": 10, "explore_gap": 5}, "explore_steps"),
                                     ({"update_every": 0}, "update_every"),
                                     ({"min_samples": 0}, "min_samples"),
                                     ({"step_noise": 1.0}, "step_noise")])
def test_bad_config_is_refused(kw, word):
    with pytest.raises(ValueError, match=word):
        AutoConfig(**{"max_batch_size": 8, **kw})


def test_bad_steps_are_refused():
    ctl = AutoController(AutoConfig(max_batch_size=8))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="batch_size"):
            ctl.decide(bad)  # type: ignore[arg-type]
    for args in ((Mode.PLAIN, 4, 0.0, 4), (Mode.PLAIN, 4, float("nan"), 4), (Mode.PLAIN, 4, 0.01, -1),
                 ("plain", 4, 0.01, 4), (Mode.PLAIN, 0, 0.01, 0)):
        with pytest.raises((ValueError, TypeError), match="record"):
            ctl.record(*args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prior"):
        Prior(0.5, {1: 0.01}, {1: 0.01})
    with pytest.raises(ValueError, match="prior"):
        Prior(2.0, {0: 0.01}, {1: -1.0})


def test_step_times_are_compared_at_one_batch_size():
    """Plain steps measured at 126 and 129 requests (two buckets, a noisy steep slope between
    them), speculative ones at 110 and 196: the 129-256 bucket's estimate compares both at the
    batch size its traffic runs at, extrapolating plain's time no steeper than in proportion."""
    model = CostModel()
    ctl = AutoController(AutoConfig(max_batch_size=MAX_BATCH, bucket_edges=POWERS))
    for _ in range(ctl.config.min_samples):
        for batch, seconds in ((126, 0.0110), (129, 0.0129)):
            ctl.record(Mode.PLAIN, batch, seconds, batch)
        for batch in (110, 196):
            ctl.record(Mode.SPECULATIVE, batch, model.seconds(Mode.SPECULATIVE, batch), round(batch * model.accept))
    top = ctl.estimates()[-1]
    assert (top.low, top.high) == (129, 256) and 129 < top.batch_size < 196
    assert top.plain_tok_s is not None and top.speculative_tok_s is not None
    # a plain step costs no more per request than at 129 (not the noisy slope's 3x), and
    # speculation loses there, as in the model
    assert top.plain_tok_s >= 129 / 0.0129 - 1e-6
    assert top.plain_tok_s > top.speculative_tok_s
    assert model.tok_s(Mode.PLAIN, round(top.batch_size)) > model.tok_s(Mode.SPECULATIVE, round(top.batch_size))


def test_a_mode_s_dwells_carry_its_prefills_and_its_bursts_do_not():
    """Speculation dwells in 161-192 (one step in four carries a 10 ms prefill), plain runs there
    only in bursts of 6 and dwells at 256 (one in three carries one). Each mode's median is
    multiplied by what its dwells pay over it, the first steps of each run left out; plain's at
    192, with no dwell there, is the nearest bucket's. Without any plain dwell, neither is
    corrected."""
    from sglang_image_plugin.auto_estimate import DWELL_SKIP, DWELL_STEPS, OVERHEAD_CHUNKS

    ctl = AutoController(AutoConfig(max_batch_size=256))
    mid, top = ctl._bucket(190), ctl._bucket(250)

    def run(mode: Mode, batch: int, steps: int, base: float, every: int) -> None:
        for k in range(steps):
            seconds = base + (0.010 if k % every == every - 1 else 0.0)
            ctl.record(mode, batch, seconds, round(batch * 3) if mode is Mode.SPECULATIVE else batch)

    for _ in range(4):
        run(Mode.SPECULATIVE, 190, DWELL_SKIP + 2 * DWELL_STEPS, 0.030, 4)
        run(Mode.PLAIN, 190, 6, 0.0095, 1000)  # a burst: no prefill falls in it, no dwell
    assert ctl._buckets[mid].overhead[Mode.SPECULATIVE].chunks == 8
    assert ctl._buckets[mid].overhead[Mode.PLAIN].chunks == 0
    assert ctl._overheads(mid) == ({Mode.SPECULATIVE: 1.0, Mode.PLAIN: 1.0}, 0.0)  # no plain dwell yet
    run(Mode.PLAIN, 250, DWELL_SKIP + OVERHEAD_CHUNKS * DWELL_STEPS - 1, 0.0105, 3)
    assert ctl._buckets[top].overhead[Mode.PLAIN].chunks == OVERHEAD_CHUNKS - 1  # the last chunk not full
    run(Mode.PLAIN, 250, 1, 0.0105, 3)
    overhead, variance = ctl._overheads(mid)
    # spec: 4 of 16 steps 10 ms longer over a 30 ms median; plain (from 256): 5 of 16 over 10.5 ms
    assert overhead[Mode.SPECULATIVE] == pytest.approx(1 + 4 * 0.010 / 16 / 0.030)
    assert overhead[Mode.PLAIN] == pytest.approx(1 + 5 * 0.010 / 16 / 0.0105, rel=0.02)
    assert variance >= 0
    est = next(e for e in ctl.estimates() if e.low <= 190 <= e.high)
    assert (est.speculative_overhead, est.plain_overhead) == (overhead[Mode.SPECULATIVE], overhead[Mode.PLAIN])
    assert "by dwells" in ctl.estimates_text()


def test_a_clear_win_in_one_bucket_does_not_carry_a_tied_one_with_it():
    """A load of 256 passes 161-192 as it arrives: there the two modes tie (plain 1% ahead, within
    the margin), at 225-256 plain wins by 20%. The crossover moves below 256 but not below 192: a
    bucket goes along with a move only where its own figures favour it by the margin and their
    noise (on the GPU the prefix rule took 161-192 to plain with 225-256, and the hysteresis held
    it there, where speculation made 1.09x; docs/validation.md rows 58 and 61)."""
    cfg = AutoConfig(max_batch_size=4096)
    ctl = AutoController(cfg)
    accept = 3
    # (batch, speculative seconds, plain tok/s over speculative tok/s)
    for batch, spec_seconds, plain_ahead in ((190, 0.030, 1.01), (250, 0.036, 1.2)):
        plain_seconds = batch / (plain_ahead * accept * batch / spec_seconds)
        for _ in range(cfg.window):
            ctl.record(Mode.SPECULATIVE, batch, spec_seconds, accept * batch)
            ctl.record(Mode.PLAIN, batch, plain_seconds, batch)
    for _ in range(cfg.update_every):
        ctl.decide(250)
    assert ctl.crossover() == 192, ctl.estimates_text()


# ----------------------------------------------------------------------------- the upstream protocol
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class RecordingController(AutoController):
    def __init__(self, config: AutoConfig) -> None:
        super().__init__(config)
        self.recorded: list[tuple[Mode, int, float, int]] = []

    def record(self, mode: Mode, batch_size: int, step_seconds: float, output_tokens: int) -> None:
        self.recorded.append((mode, batch_size, step_seconds, output_tokens))
        super().record(mode, batch_size, step_seconds, output_tokens)


def run_overlapped(policy: AutoPolicy, clock: Clock, model: CostModel, batches: list[int]) -> list[int]:
    """sglang's overlap loop: the policy is asked before each batch, which is launched before the
    host waits for the batch before it; that batch's verify result comes then. So the host asks
    for the next batch once the previous batch is done, and each interval between two asks is the
    previous step's time."""
    steps, late, previous = [], None, 0.0
    for batch in batches:
        k = policy.get_steps_for_batch(batch)
        steps.append(k)
        clock.now += previous  # the wait for the step before
        if late is not None:
            policy.on_verify_complete(*late)
        accepted = round(model.accept - 1) if k else 0  # accepted drafts per request
        late = ([accepted] * batch, batch)
        previous = model.seconds(Mode.SPECULATIVE if k else Mode.PLAIN, batch)
    return steps


def test_policy_times_each_step_and_pairs_it_with_its_late_result():
    clock, model = Clock(), CostModel(accept=3.0)
    ctl = RecordingController(AutoConfig(max_batch_size=MAX_BATCH, bucket_edges=POWERS))
    policy = AutoPolicy(ctl, 3, clock)
    assert policy.candidate_steps == [0, 3]
    batches = traffic(random.Random(11), 12000)
    steps = run_overlapped(policy, clock, model, batches)
    # the interval after each ask times the step before it: a step is recorded, with its own mode
    # and tokens and the time of the step before it, where that step was of the same mode; the
    # first step of a mode after the other is left out (and the last step: no next ask timed it)
    same = [i for i in range(1, len(batches) - 1) if (steps[i] == 3) == (steps[i - 1] == 3)]
    assert len(ctl.recorded) == len(same) and policy.dropped == 0
    assert len(same) < len(batches) - 2  # the modes did change
    for (mode, batch, seconds, tokens), i in zip(ctl.recorded, same, strict=True):
        assert batch == batches[i] and (mode is Mode.SPECULATIVE) == (steps[i] == 3)
        assert seconds == pytest.approx(model.seconds(mode, batches[i - 1]))
        assert tokens == (3 * batch if steps[i] else batch)
    best, best_share = best_fixed_threshold(model, batches, ctl.config.edges)
    assert best == 64 and ctl.crossover() in (32, 64)
    assert fixed_share(model, batches, ctl.crossover()) > best_share - EDGE_SHARE


def first_step(policy: AutoPolicy, batch: int = 4) -> None:
    """One step and its result, so that the next step of its mode is compared (the first after
    an idle gap is not: its interval times the prefill before it)."""
    policy.get_steps_for_batch(batch)
    policy.on_verify_complete([0 if policy.controller.mode is Mode.PLAIN else 2] * batch, batch)


def test_policy_leaves_out_idle_gaps_and_resyncs_after_lost_results():
    clock = Clock()
    ctl = RecordingController(AutoConfig(max_batch_size=MAX_BATCH))
    policy = AutoPolicy(ctl, 3, clock)
    first_step(policy)
    policy.get_steps_for_batch(4)
    clock.now += 0.01
    assert policy.get_steps_for_batch(0) in (0, 3)  # idle: the step before has no time
    clock.now += 5.0
    policy.on_verify_complete([2, 2, 2, 2], 4)
    assert ctl.recorded == [] and policy.dropped == 1
    policy.get_steps_for_batch(8)
    clock.now += 0.02
    policy.get_steps_for_batch(8)
    policy.on_verify_complete([1] * 5, 5)  # not the waiting step's batch: the queues lost step
    assert ctl.recorded == [] and policy.dropped == 3
    clock.now += 0.02
    policy.get_steps_for_batch(8)
    clock.now += 0.03
    policy.get_steps_for_batch(8)
    policy.on_verify_complete([1] * 8, 8)
    assert len(ctl.recorded) == 1 and ctl.recorded[0][1:] == (8, pytest.approx(0.03), 16)
    with pytest.raises(ValueError, match="speculative-num-steps"):
        AutoPolicy(ctl, 0, clock)
    policy.set_cuda_graph_bs([8, 1, 4])
    assert policy.cuda_graph_bs_for_step(0) == policy.cuda_graph_bs_for_step(3) == [1, 4, 8]


def test_policy_charges_no_step_with_the_scheduler_s_idle_gap():
    # A single-GPU scheduler asks for no zero-size batch when it runs dry: it goes idle (on_idle),
    # and the next burst's first decode step would time the last step before the pause as the
    # whole pause (seconds instead of milliseconds), charging that mode at that batch size.
    clock = Clock()
    ctl = RecordingController(AutoConfig(max_batch_size=MAX_BATCH))
    policy = AutoPolicy(ctl, 3, clock)
    for burst in range(2):
        policy.get_steps_for_batch(4)  # the first step of a burst: left out
        for _ in range(2):
            clock.now += 0.01
            policy.get_steps_for_batch(4)
            policy.on_verify_complete([2] * 4, 4)
        clock.now += 0.01
        policy.note_idle()  # the burst is over; its last step's result comes with the idle loop
        policy.on_verify_complete([2] * 4, 4)
        clock.now += 30.0  # a pause between bursts
    seconds = [rec[2] for rec in ctl.recorded]
    assert seconds == [pytest.approx(0.01)] * 2
    assert policy.dropped == 2  # the steps the pauses followed
    policy.note_idle()
    policy.note_idle()  # the idle loop runs many times: nothing more to drop
    assert policy.dropped == 2


def test_policy_leaves_the_catch_up_step_out_and_keeps_the_pairing():
    # The catch-up step before speculation resumes was decided speculative but drafts nothing: its
    # result (one token per request) must not lower the speculative accept length; the step after
    # it times the catch-up step, so it is left out too; the steps after those still pair with
    # their own results.
    clock = Clock()
    ctl = RecordingController(AutoConfig(max_batch_size=MAX_BATCH))
    policy = AutoPolicy(ctl, 3, clock)
    first_step(policy)
    policy.get_steps_for_batch(4)
    policy.leave_out_last()  # the catch-up step
    clock.now += 0.01
    policy.get_steps_for_batch(4)
    policy.on_verify_complete([0] * 4, 4)
    clock.now += 0.02
    policy.get_steps_for_batch(4)
    policy.on_verify_complete([2] * 4, 4)
    clock.now += 0.03
    policy.get_steps_for_batch(4)
    policy.on_verify_complete([2] * 4, 4)
    assert [rec[1:] for rec in ctl.recorded] == [(4, pytest.approx(0.03), 12)]
    assert policy.dropped == 0


def test_the_scheduler_idle_hook_reaches_auto_s_policy():
    from types import SimpleNamespace

    from sglang_image_plugin import observe, state
    from sglang_image_plugin.state import WorkerState

    def eagle_worker(controller: object) -> SimpleNamespace:
        worker = SimpleNamespace()
        state.of(worker, WorkerState).controller = controller  # type: ignore[assignment]
        return worker

    clock = Clock()
    ctl = RecordingController(AutoConfig(max_batch_size=MAX_BATCH))
    policy = AutoPolicy(ctl, 3, clock)
    scheduler = SimpleNamespace(draft_worker=eagle_worker(policy))
    first_step(policy)
    policy.get_steps_for_batch(4)
    observe.scheduler_idle(scheduler)  # BEFORE Scheduler.on_idle
    policy.on_verify_complete([2] * 4, 4)
    assert policy.dropped == 1 and ctl.recorded == []
    # a fixed threshold's controller has no step clock; a server without the feature, no worker
    observe.scheduler_idle(SimpleNamespace(draft_worker=eagle_worker(object())))
    observe.scheduler_idle(SimpleNamespace())


# ----------------------------------------------------------------------------- a benchmark's traffic
class OverlapLoop:
    """sglang's overlap scheduler as `auto` sees it, driving the plugin's policies (AutoPolicy
    behind CatchUpPolicy, as a server with the default plain step runs them): each iteration asks
    for a decode batch, launches it, then waits for the batch before it (whose verify result comes
    then); a prefill is an iteration of its own between two decode steps; the first use of each
    step shape carries a compile; the scheduler goes idle between loads. GPU costs of an 8B-shaped
    model with a three-step chain draft (accept length 3), as the H200 runs them."""

    HOST = 0.3e-3  # the host's own work per iteration
    COMPILE = 0.3  # a first use's compile

    def __init__(self, policy: CatchUpPolicy, rng: random.Random) -> None:
        self.policy, self.rng = policy, rng
        self.clock = Clock()
        policy.inner._clock = self.clock
        self.gpu_free = 0.0
        self.waiting: tuple[float, tuple[list[int], int] | None] | None = None
        self.compiled: set[tuple[str, int]] = set()
        self.kinds: list[tuple[str, int]] = []
        # steps of these kinds share the GPU with other servers' (each takes shared_by times as long)
        self.shared_kinds: frozenset[str] = frozenset()
        self.shared_by = 4

    @staticmethod
    def gpu_seconds(kind: str, batch: int) -> float:
        if kind == "speculative":
            return 6.07e-3 + 0.195e-3 * (batch - 1)
        plain = 4.42e-3 + 0.0266e-3 * (batch - 1)
        return plain + 0.6e-3 + 0.02e-3 * batch if kind == "catch-up" else plain

    def _launch(self, key: tuple[str, int], seconds: float, result: tuple[list[int], int] | None) -> None:
        if key not in self.compiled:
            self.compiled.add(key)
            seconds += self.COMPILE
        self.clock.now += self.HOST
        self.gpu_free = max(self.clock.now, self.gpu_free) + seconds
        self._wait()
        self.waiting = (self.gpu_free, result)

    def _wait(self) -> None:
        if self.waiting is not None:
            done, result = self.waiting
            self.clock.now = max(self.clock.now, done) + self.HOST
            if result is not None:
                self.policy.on_verify_complete(*result)
            self.waiting = None

    def prefill(self, requests: int) -> None:
        self.policy.inner.note_prefill(32 * requests)  # what the server's prefill hook reports
        self._launch(("prefill", 1 << (requests - 1).bit_length()), 2e-3 + 0.3e-3 * requests, None)

    def decode(self, batch: int) -> int:
        """One decode step; the tokens each request gets."""
        steps = self.policy.get_steps_for_batch(batch)
        kind = "speculative" if steps else ("catch-up" if self.policy.full_draft_extend else "plain")
        self.kinds.append((kind, batch))
        seconds = self.gpu_seconds(kind, batch) * math.exp(self.rng.gauss(0, 0.05))
        seconds *= self.shared_by if kind in self.shared_kinds else 1
        self._launch((kind, batch), seconds, ([2] * batch if steps else [0] * batch, batch))
        return 3 if steps else 1

    def idle(self) -> None:
        self._wait()
        self.policy.note_idle()

    def load(self, clients: int, output_len: int, *, requests: int | None = None,
             seconds: float | None = None) -> None:
        """Closed-loop clients until `requests` are done or `seconds` passed (then all abort)."""
        left, new, done, start = [output_len] * clients, clients, 0, self.clock.now
        while True:
            if new:
                self.prefill(new)
                new = 0
            batch = sum(1 for n in left if n > 0)
            if batch == 0:
                break
            tokens = self.decode(batch)
            over = seconds is not None and self.clock.now - start >= seconds
            for i, n in enumerate(left):
                if n > 0:
                    left[i] = 0 if over else n - tokens
                    if left[i] <= 0 and not over and (requests is None or (done := done + 1) + batch <= requests):
                        left[i], new = output_len, new + 1
        self.idle()


def test_a_benchmark_s_traffic_through_the_overlap_loop():
    """The paired bench's traffic (a warm-up of short requests at each concurrency, then 4 s loads
    of 256-token requests at 1, 16, 64 and 256 clients, idle between them) through the overlap
    loop: at 1 and 16 requests the server speculates (1.9x and 1.5x plain's tokens/s in this
    model), at 256 it decodes plain (speculation 0.6x). Each interval the policy times is the
    step before's, a prefill wave or a first use's compile: a controller that averages them, or
    compares a mode's first step after the other, learns either mode's speed wrong."""
    ctl = AutoController(AutoConfig(max_batch_size=4096))
    loop = OverlapLoop(CatchUpPolicy(AutoPolicy(ctl, 3)), random.Random(0))
    for clients in (1, 16, 64, 256):
        loop.load(clients, 32, requests=max(2, clients))
    for clients in (1, 16, 64, 256):
        phase = len(loop.kinds)
        for _ in range(4):
            loop.load(clients, 256, seconds=4.0)
        steps = [kind for kind, batch in loop.kinds[phase:] if batch == clients]
        speculative = steps.count("speculative") / len(steps)
        if clients <= 16:
            assert speculative > 0.9, (clients, speculative, ctl.estimates_text())
        elif clients == 256:
            assert speculative < 0.1, (clients, speculative, ctl.estimates_text())
    assert 16 <= ctl.crossover() <= 64, ctl.estimates_text()


def test_a_mode_timed_while_the_gpu_was_shared_is_timed_again():
    """Four servers warming up side by side, as the bench did: on the H200 the others' requests
    overlapped this server's speculative steps at one request (21 steps timed at 85 tok/s, 4x
    slow) but not its first plain burst (5 steps at 227 tok/s, as alone). Then the bench's loads at
    1 and 16 clients, alone. Speculation, never timed again at one request (plain won there), kept
    the server plain at 1 and, by the prefix rule, at 16 (0.45x and 0.62x of a fixed threshold).
    Now those steps go stale (about one 4 s load at one request) and speculation is explored again,
    its new steps replacing the old; and when the crossover rises to 16, a batch of 16 running
    plain takes its side at once (the batch-size hysteresis held it plain)."""
    ctl = AutoController(AutoConfig(max_batch_size=4096))
    loop = OverlapLoop(CatchUpPolicy(AutoPolicy(ctl, 3)), random.Random(0))
    loop.shared_kinds = frozenset({"speculative", "catch-up"})
    for clients in (1, 16, 64, 256):
        loop.load(clients, 32, requests=max(2, clients))
    loop.shared_kinds = frozenset()
    for clients in (1, 16):
        shares = []
        for _ in range(4):
            start = len(loop.kinds)
            loop.load(clients, 256, seconds=4.0)
            steps = [kind for kind, batch in loop.kinds[start:] if batch == clients]
            shares.append(steps.count("speculative") / len(steps))
        assert min(shares[2:]) > 0.95, (clients, shares, ctl.estimates_text())


def test_the_trace_holds_every_step_the_estimate_was_made_of_and_the_prefills_between():
    """The step trace (SGLANG_IMAGE_AUTO_TRACE) is what reading a server's choice offline needs:
    each step's kind, batch, time and tokens as the estimate got them, the steps it left out, and
    the prefills that fell inside the intervals."""
    ctl = RecordingController(AutoConfig(max_batch_size=4096))
    trace: list[dict[str, object]] = []
    loop = OverlapLoop(CatchUpPolicy(AutoPolicy(ctl, 3, trace=trace.append)), random.Random(0))
    prefills = 0
    real_prefill = loop.prefill

    def counted(requests: int) -> None:
        nonlocal prefills
        prefills += 1
        real_prefill(requests)

    loop.prefill = counted  # type: ignore[method-assign]
    for clients in (1, 16, 64, 256):
        loop.load(clients, 64, seconds=4.0)
    steps = [r for r in trace if r["kind"] != "prefill"]
    recorded = [(Mode(r["kind"]), r["batch"], r["seconds"], r["tokens"]) for r in steps if r["recorded"]]
    assert len(recorded) == len(ctl.recorded) > 200, len(recorded)
    assert [(m, b, t) for m, b, _, t in recorded] == [(m, b, t) for m, b, _, t in ctl.recorded]
    assert all(abs(a[2] - b[2]) < 1e-5 for a, b in zip(recorded, ctl.recorded, strict=True))
    left_out = [r for r in steps if not r["recorded"]]
    assert {r["kind"] for r in left_out} >= {"catch-up", "speculative", "plain"}  # the first of each kind
    assert sum(1 for r in trace if r["kind"] == "prefill") == prefills
    # each prefill falls inside the interval of the step decided before it (but the first of a load)
    assert prefills - 4 <= sum(int(r["prefills"]) for r in steps) <= prefills
    assert [r["t"] for r in steps] == sorted(r["t"] for r in steps)


def test_the_step_trace_file_is_written_out_when_the_server_goes_idle(tmp_path):
    path = tmp_path / "trace.jsonl"
    clock = Clock()
    policy = AutoPolicy(AutoController(AutoConfig(max_batch_size=64)), 3, clock=clock, trace=StepTrace(str(path)))
    for _ in range(5):
        steps = policy.get_steps_for_batch(4)  # a cold start measures plain first
        clock.now += 0.01
        policy.on_verify_complete([2 if steps else 0] * 4, 4)
    assert path.read_text() == ""  # buffered while the server runs
    policy.note_idle()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["plain"] * 5
    assert [r["recorded"] for r in lines] == [False, True, True, True, False]  # first of its kind; no time
    assert lines[1]["seconds"] == 0.01 and lines[1]["tokens"] == 4 and lines[1]["batch"] == 4
    with pytest.raises(ValueError, match=r"SGLANG_IMAGE_AUTO_TRACE=.*/no/such/dir/t.jsonl: cannot append .* unset it"):
        StepTrace(str(tmp_path / "no" / "such" / "dir" / "t.jsonl"))


def test_a_burst_of_steps_that_happened_to_run_fast_does_not_outvote_a_window():
    """GPU, 8B shape, 64 requests: plain won there by 7% and the crossover sat at 32. Speculation,
    stale in the 33-64 bucket, was timed again in a burst; its 4 steps replaced the 30 before
    them (their own spread was tight, so they "differed beyond their noise") and, read as 4%
    ahead of plain, moved the crossover to 64 for the next half minute. Here one such burst runs
    12% fast. The estimate takes no step time as surer than AutoConfig.step_noise: the crossover
    holds; without that floor (0) it moves."""

    def crossovers(step_noise: float, seed: int) -> set[int]:
        rng = random.Random(seed)
        ctl = AutoController(AutoConfig(max_batch_size=256, bucket_edges=POWERS, step_noise=step_noise))
        model = CostModel(plain_fixed=4.42e-3, plain_per_request=0.0266e-3, spec_fixed=6.07e-3,
                          spec_per_request=0.216e-3, accept=3.0)
        assert model.share_of_best(Mode.SPECULATIVE, 64) == pytest.approx(0.93, abs=0.01)
        bursts, last, seen = 0, None, set()
        for phase, (batch, steps) in enumerate([(16, 3000), (64, 12000)]):
            for _ in range(steps):
                mode = ctl.decide(batch)
                seconds = model.seconds(mode, batch) * math.exp(rng.gauss(0, 0.03))
                if phase == 1 and mode is Mode.SPECULATIVE and ctl.crossover() == 32:
                    bursts += last is not Mode.SPECULATIVE
                    if bursts == 2:  # the second re-timing burst after the crossover fell to 32
                        seconds *= 0.88
                last = mode
                ctl.record(mode, batch, seconds, batch * (3 if mode is Mode.SPECULATIVE else 1))
                if phase == 1 and bursts >= 1:
                    seen.add(ctl.crossover())
        return seen

    for seed in range(3):
        assert crossovers(AutoConfig(max_batch_size=1).step_noise, seed) == {32}, seed
    assert any(64 in crossovers(0.0, seed) for seed in range(3))


# ----------------------------------------------------------------------------- an H100's loads at 192 and 256
# Shaped like an H100's 8B-shape server (EAGLE-3 chain draft, 3.07 tokens per request per
# speculative step; docs/validation.md rows 48, 53 and 54): median decode steps linear in the batch
# through two points, plain 9.5 ms at 192 requests and 10.5 ms at 256, speculative 29.2 ms and
# 36.6 ms; and between the steps prefill batches of ~10.5 ms, 0.20 and 0.22 a plain step, 0.36 and
# 0.46 a speculative one (a plain step is short, so the arrivals reach it in more, smaller
# batches: per token plain pays more). By the medians speculation makes 1.00x plain's tokens/s at
# 192 and 0.88x at 256, as the server's medians had it; over whole loads, prefills in, 1.08x and
# 0.95x, as the bench's windows had it.
H100_MEDIAN = {Mode.PLAIN: ((192, 9.5e-3), (256, 10.5e-3)), Mode.SPECULATIVE: ((192, 29.2e-3), (256, 36.6e-3))}
H100_PREFILLS = {Mode.PLAIN: ((192, 0.20), (256, 0.22)), Mode.SPECULATIVE: ((192, 0.36), (256, 0.46))}
H100_ACCEPT = 3.07
H100_PREFILL = 10.5e-3


def h100_line(points: tuple[tuple[int, float], tuple[int, float]], batch: int) -> float:
    (b0, v0), (b1, v1) = points
    return v0 + (v1 - v0) * (batch - b0) / (b1 - b0)


def h100_load(rng: random.Random, clients: int, seconds: float, ctl: AutoController | None = None,
              fixed: Mode | None = None, last: Mode | None = None,
              waves: int = 1) -> tuple[int, float, Mode | None]:
    """One load of closed-loop clients for `seconds` of the model's time, decided by `ctl` (or in
    one `fixed` mode): the tokens, the seconds and the last step's mode. Steps get 5% noise, a
    prefill batch 8-13 ms; with `waves` > 1 the prefill batches come that many at once, as often
    over `waves` (the same share of the time, lumpier); the first step after a change of mode is
    left out, as the policy does (it times the step before)."""
    tokens, now = 0, 0.0
    while now < seconds:
        batch = clients - rng.randint(0, clients // 32)
        mode = fixed or ctl.decide(batch)  # type: ignore[union-attr]
        step = h100_line(H100_MEDIAN[mode], batch) * math.exp(rng.gauss(0, 0.05))
        prefills = min(max(h100_line(H100_PREFILLS[mode], batch), 0.0), 1.0)
        if rng.random() < prefills / waves:
            step += sum(rng.uniform(8e-3, 13e-3) for _ in range(waves))
        made = round(batch * H100_ACCEPT) if mode is Mode.SPECULATIVE else batch
        if ctl is not None and mode is last:
            ctl.record(mode, batch, step, made)
        last, now, tokens = mode, now + step, tokens + made
    if ctl is not None:
        ctl.note_idle()
    return tokens, now, last


def test_the_h100_model_s_modes_cross_between_192_and_256_over_whole_loads():
    rng = random.Random(99)

    def tok_s(mode: Mode, clients: int) -> float:
        runs = [h100_load(rng, clients, 4.0, fixed=mode) for _ in range(20)]
        return sum(t for t, _, _ in runs) / sum(s for _, s, _ in runs)

    assert tok_s(Mode.SPECULATIVE, 192) > 1.06 * tok_s(Mode.PLAIN, 192)
    assert tok_s(Mode.SPECULATIVE, 256) < 0.97 * tok_s(Mode.PLAIN, 256)
    for clients in (192, 256):  # the medians say otherwise: within noise at 192, plain by 12% at 256
        median = {m: clients * (H100_ACCEPT if m is Mode.SPECULATIVE else 1) / h100_line(H100_MEDIAN[m], clients)
                  for m in Mode}
        assert median[Mode.SPECULATIVE] / median[Mode.PLAIN] < (1.03 if clients == 192 else 0.9)


def test_a_crossover_between_two_powers_of_two_is_found_at_the_bench_s_loads():
    """The bench's loads on that H100 (above): four windows of 4.5 s at each load, rising (16, 64,
    128, 192, 256), then falling (256, 192: what a load of 256 taught the server decides 192),
    sixteen servers. Over the loads from the first 256 on, each server's tokens/s at 192 and at
    256 over the better fixed mode's, as the model gives them: at least 0.97x on average at both.
    The step medians alone say plain at 192 within their noise: a server that compared them
    learned 160 after a load of 256 (row 54) and decoded 161-192 plain, 0.93x here. What each
    mode's dwells add to its median step (plain's short steps meet more prefill batches per
    token) tells the two apart. A server whose first noisy move set 161-192 plain may hold it
    (the hysteresis), so the bar is the average, not every server."""
    rng = random.Random(99)
    best = {}
    for clients in (192, 256):
        made = {m: [h100_load(rng, clients, 4.5, fixed=m) for _ in range(20)] for m in Mode}
        best[clients] = max(sum(t for t, _, _ in runs) / sum(s for _, s, _ in runs) for runs in made.values())
    shares: dict[int, list[float]] = {192: [], 256: []}
    crossovers = []
    for seed in range(16):
        rng = random.Random(seed)
        cfg = AutoConfig(max_batch_size=4096)  # the GPU's server: no --max-running-requests
        ctl = AutoController(cfg)
        last: Mode | None = None
        served = {192: [0.0, 0.0], 256: [0.0, 0.0]}
        for order, clients in enumerate((16, 64, 128, 192, 256, 256, 192)):
            for _ in range(4):
                tokens, seconds, last = h100_load(rng, clients, 4.5, ctl, last=last)
                if order >= 4:
                    served[clients][0] += tokens
                    served[clients][1] += seconds
        for clients, (tokens, seconds) in served.items():
            shares[clients].append(tokens / seconds / best[clients])
        crossovers.append(ctl.crossover())
        assert ctl.explore_steps <= cfg.explore_share * ctl.steps + cfg.explore_steps
    for clients, got in shares.items():
        assert statistics.fmean(got) >= 0.97, (clients, [round(x, 3) for x in got], crossovers)
    assert statistics.median(crossovers) in (192, 224), crossovers


def test_a_tie_set_on_a_warm_up_s_few_steps_is_tried_and_set_right():
    """On a GPU (docs/validation.md row 70) a learning pass at 192 requests timed plain in 161-192
    on 5 steps that ran fast, before either mode had dwelt there, and set that bucket plain; from
    then on its figures favoured speculation (1.15x) but within the noise that the prefills' waves
    leave in them (what each mode's dwells add to its median), and the bucket stayed plain for
    minutes at 0.89x of the better mode. Here the H100 model with its prefills in waves of 16:
    a trial (paired blocks of both modes, their tokens over their seconds) sets it right within
    eight loads of 192 in most of 32 servers (without: 18), and the loads make 0.975x of the
    better mode or more on average (without: 0.964x). Blocks this noisy decide a few wrongly."""
    rng = random.Random(99)
    runs = [h100_load(rng, 192, 4.5, fixed=Mode.SPECULATIVE, waves=16) for _ in range(40)]
    best = sum(t for t, _, _ in runs) / sum(s for _, s, _ in runs)  # speculation: 1.09x plain here
    shares, crossovers, texts = [], [], []
    for seed in range(32):
        rng = random.Random(seed)
        ctl = AutoController(AutoConfig(max_batch_size=4096))
        last: Mode | None = None
        for clients in (16, 64, 128):
            for _ in range(4):
                _, _, last = h100_load(rng, clients, 4.5, ctl, last=last, waves=16)
        for i in range(40):  # the learning pass: speculation timed steadily, plain in one fast burst
            ctl.decide(190)
            ctl.record(Mode.SPECULATIVE, 190, 29.2e-3 * (1 + 0.02 * (i % 3)), round(190 * H100_ACCEPT))
        for _ in range(5):
            ctl.record(Mode.PLAIN, 190, 7.5e-3, 190)
        for _ in range(ctl.config.update_every):  # its last steps, their times lost to the load's end
            ctl.decide(190)
        ctl.note_idle()
        assert ctl.crossover() < 161, ctl.estimates_text()
        tokens = seconds = 0.0
        for _ in range(8):
            t, s, last = h100_load(rng, 192, 4.5, ctl, last=last, waves=16)
            tokens, seconds = tokens + t, seconds + s
        shares.append(tokens / seconds / best)
        crossovers.append(ctl.crossover())
        texts.append(ctl.estimates_text())
        assert ctl.trial_steps <= 2 * (ctl.config.most_trial_steps + 2) and ctl.state()["trial_steps"] == ctl.trial_steps
    # the log line names the trial's figure, e.g. "161-192: trial speculative / plain 1.098x [...]"
    assert sum("161-192: trial speculative / plain" in t for t in texts) >= 24, texts
    assert sum(c >= 192 for c in crossovers) >= 22, crossovers
    assert statistics.fmean(shares) >= 0.975, [round(x, 3) for x in shares]


@pytest.mark.parametrize("plain_ms", [(10.01, 89.395, 6.937, 11.149, 44.476), (11.5, 89.4, 10.9, 13.2, 44.5)],
                         ids=["says-plain", "says-speculative"])
def test_a_bucket_far_from_the_crossover_whose_figures_do_not_decide_is_explored_again(plain_ms):
    """256 requests on a server of 4096 (the crossover at 4096, far above): plain timed in one
    burst as the load arrived, two of its five steps carrying prefills (the GPU's own five, or a
    like five whose median falls on the slow side), speculation steadily at 37.4 ms. The bucket's
    figures say plain (or speculation) only within their noise, and the split holds. Plain is
    timed again one explore_gap after the first burst, not stale_steps later; its steps (10.5 ms:
    plain makes 1.16x speculation's tokens/s) then move the crossover below 256 well before."""
    cfg = AutoConfig(max_batch_size=4096)
    assert len([e for e in cfg.edges if e > 256]) > 2  # far from the split at the top
    ctl = AutoController(cfg)
    bursts: list[int] = []
    late: list[float] = list(plain_ms)
    last = None
    for step in range(1, cfg.stale_steps):
        mode = ctl.decide(256)
        if mode is not ctl.mode and mode is not last:
            bursts.append(step)
        if mode is last:  # the first step of a mode times the step before: left out
            seconds = (late.pop(0) if late else 10.5) if mode is Mode.PLAIN else 37.4 * (1 + 0.01 * (step % 5 - 2))
            ctl.record(mode, 256, seconds / 1000, round(256 * 3.08) if mode is Mode.SPECULATIVE else 256)
        last = mode
        if len(bursts) == 1 and step == bursts[0] + cfg.explore_gap - 1:
            assert ctl.crossover() == 4096, ctl.estimates_text()  # the first burst decided nothing
        if ctl.crossover() < 256:
            break
    assert bursts[:2] == [1, 1 + cfg.explore_gap], (bursts, ctl.estimates_text())
    assert ctl.crossover() < 256 and step < cfg.stale_steps // 2, (step, ctl.estimates_text())


def test_the_default_buckets_are_powers_of_two_then_four_per_octave():
    assert AutoConfig(max_batch_size=4096).edges == (
        1, 2, 4, 8, 16, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512,
        640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096)
    assert AutoConfig(max_batch_size=100).edges == (1, 2, 4, 8, 16, 32, 40, 48, 56, 64, 80, 96, 100)
    assert AutoConfig(max_batch_size=1).edges == (1,) and AutoConfig(max_batch_size=24).edges[-2:] == (16, 24)
    assert AutoConfig(max_batch_size=256, bucket_edges=POWERS).edges == POWERS  # a server's own
