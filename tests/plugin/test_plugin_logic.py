"""The plugin's pure logic (plugin/sglang_image_plugin): flags, validation, the
hysteresis controller and the threshold policy. No sglang needed."""
from __future__ import annotations

import argparse
import pkgutil
from types import SimpleNamespace
from typing import Any

import pytest

from sglang_image_plugin import observe, plain_step, state
from sglang_image_plugin import setting as st
from sglang_image_plugin import spec_disable as sd
from sglang_image_plugin.acceptance import AcceptanceAroundPlain
from sglang_image_plugin.auto_policy import AutoPolicy
from sglang_image_plugin.auto_threshold import AutoConfig, AutoController, Decision
from sglang_image_plugin.policy import AutoThresholdPolicy, CatchUpPolicy, ThresholdPolicy
from sglang_image_plugin.state import WorkerState
from sglang_image_plugin.targets import HOOKS, START, hooks_of

EAGLE3 = st.ServerView(speculative_algorithm="EAGLE3", speculative_eagle_topk=1,
                       speculative_adaptive=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    st.add_cli_args(parser)
    return parser


def test_flags_parse_numbers_and_auto_and_name_the_flag_on_bad_input() -> None:
    ns = _parser().parse_args([st.THRESHOLD_FLAG, "32", st.HYSTERESIS_FLAG, "3"])
    assert (ns.speculative_disable_batch_threshold, ns.speculative_disable_hysteresis) == (32, 3)
    assert _parser().parse_args([]).speculative_disable_batch_threshold is None
    assert _parser().parse_args([st.THRESHOLD_FLAG, "AUTO"]).speculative_disable_batch_threshold == "auto"
    for bad in ("-1", "12x", "", "auto32", "+4"):
        with pytest.raises(argparse.ArgumentError) as err:
            _parser().parse_args([st.THRESHOLD_FLAG, bad])
        assert st.THRESHOLD_FLAG in str(err.value)
        assert f"{bad!r} is not a batch-size threshold; give `auto`" in str(err.value)


def test_auto_resolves_from_flag_or_env_and_refuses_what_it_cannot_do() -> None:
    def resolve(flag: st.Threshold | None, env: dict[str, str], hysteresis: int | None = None,
                server: st.ServerView = EAGLE3) -> st.Setting:
        return st.resolve_and_validate(threshold_flag=flag, hysteresis_flag=hysteresis,
                                       server=server, environ=env)

    assert resolve("auto", {}) == st.Setting(threshold="auto", hysteresis=0)
    assert resolve(None, {st.THRESHOLD_ENV: " Auto "}) == st.Setting(threshold="auto", hysteresis=0)
    assert resolve(16, {st.THRESHOLD_ENV: "auto"}).threshold == 16
    assert st.start_log_line("auto") == "Dynamic speculation disable enabled: threshold=auto"
    with pytest.raises(ValueError, match=f"{st.HYSTERESIS_FLAG} applies to a fixed"):
        resolve("auto", {}, hysteresis=2)
    with pytest.raises(ValueError, match="=auto cannot be combined with --speculative-adaptive"):
        resolve("auto", {}, server=st.ServerView(speculative_algorithm="EAGLE3",
                                                 speculative_eagle_topk=1, speculative_adaptive=True))


def test_env_is_the_fallback_and_the_flag_wins() -> None:
    def resolve(flag: st.Threshold | None, env: dict[str, str]) -> st.Setting:
        return st.resolve_and_validate(threshold_flag=flag, hysteresis_flag=None, server=EAGLE3,
                                       environ=env)

    assert resolve(None, {}) == st.OFF
    assert resolve(None, {st.THRESHOLD_ENV: " 64 "}) == st.Setting(threshold=64, hysteresis=8)
    assert resolve(16, {st.THRESHOLD_ENV: "64"}) == st.Setting(threshold=16, hysteresis=2)
    assert resolve(0, {st.THRESHOLD_ENV: "64"}) == st.OFF
    with pytest.raises(ValueError, match=f"{st.THRESHOLD_ENV} \\(the fallback for {st.THRESHOLD_FLAG}\\)"):
        resolve(None, {st.THRESHOLD_ENV: "many"})
    with pytest.raises(ValueError, match=f"{st.THRESHOLD_ENV} .*'auto-8' is not a batch-size"):
        resolve(None, {st.THRESHOLD_ENV: "auto-8"})


@pytest.mark.parametrize(("server", "hysteresis", "message"), [
    (st.ServerView(speculative_algorithm=None, speculative_eagle_topk=None,
                   speculative_adaptive=False), None, "needs --speculative-algorithm EAGLE"),
    (st.ServerView(speculative_algorithm="NGRAM", speculative_eagle_topk=None,
                   speculative_adaptive=False), None, "needs --speculative-algorithm EAGLE"),
    (st.ServerView(speculative_algorithm="EAGLE3", speculative_eagle_topk=4,
                   speculative_adaptive=False), None, "needs --speculative-eagle-topk 1"),
    (st.ServerView(speculative_algorithm="EAGLE3", speculative_eagle_topk=1,
                   speculative_adaptive=True), None, "cannot be combined with --speculative-adaptive"),
    (st.ServerView(speculative_algorithm="EAGLE", speculative_eagle_topk=1,
                   speculative_adaptive=False, adaptive_unsupported_reason="attention DP"),
     None, "not supported here: attention DP"),
    (EAGLE3, 8, "--speculative-disable-hysteresis must be smaller"),
])
def test_unsupported_combinations_are_refused_naming_the_flag(
        server: st.ServerView, hysteresis: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        st.resolve_and_validate(threshold_flag=8, hysteresis_flag=hysteresis, server=server,
                                environ={})
    assert st.THRESHOLD_FLAG in str(err.value) or st.HYSTERESIS_FLAG in str(err.value)


def test_default_hysteresis_and_start_line() -> None:
    assert [st.default_hysteresis(n) for n in (1, 2, 8, 9, 32, 64, 100)] == [0, 1, 1, 1, 4, 8, 12]
    assert st.start_log_line(32) == "Dynamic speculation disable enabled: threshold=32"


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


def test_the_first_batch_after_an_idle_server_takes_its_side_by_the_threshold_alone() -> None:
    # A burst above N leaves the server plain; the next burst at N or just under it (above N - H)
    # would stay plain for as long as it runs, though no running batch is left for the hysteresis
    # to hold: the bench measured that as a threshold server 0.95x plain at its own N.
    lines: list[str] = []
    ctl = sd.SpecDisableController(192, 24, log_fn=lines.append, log_interval_s=0.0)
    policy = CatchUpPolicy(ThresholdPolicy(ctl, speculative_steps=3))
    assert policy.get_steps_for_batch(256) == 0
    assert [policy.get_steps_for_batch(b) for b in (0, 192, 190)] == [0, 0, 0]  # no idle: held plain
    scheduler = SimpleNamespace(draft_worker=SimpleNamespace())
    state.of(scheduler.draft_worker, WorkerState).controller = policy  # type: ignore[assignment]
    observe.scheduler_idle(scheduler)  # BEFORE Scheduler.on_idle: the server ran out of requests
    # the draft is stale after plain steps: one catch-up step, then speculation, at 192 <= N
    assert [(policy.get_steps_for_batch(b), policy.full_draft_extend) for b in (192, 192, 191)] == [
        (0, True), (3, True), (3, True)]
    assert lines[-1] == ("Speculation mode -> speculative (batch size 192 <= threshold 192, the first "
                         "batch since the server went idle); mode_changes=2")
    # above N after idle: plain at once, and the hysteresis holds again from there
    observe.scheduler_idle(scheduler)
    assert [policy.get_steps_for_batch(b) for b in (193, 180, 169)] == [0, 0, 0]
    assert policy.get_steps_for_batch(168) == 0 and policy.get_steps_for_batch(168) == 3  # catch-up, then 3
    assert ctl.mode_changes == 4


def test_catch_up_policy_runs_one_full_plain_step_before_speculation_resumes() -> None:
    # decode-kv: plain steps write only the draft's K/V; the step that would speculate right
    # after them runs plain once more with the full draft extend, then speculation resumes.
    ctl = sd.SpecDisableController(32, 4, log_fn=lambda _: None)
    policy = CatchUpPolicy(ThresholdPolicy(ctl, speculative_steps=3))
    assert policy.candidate_steps == [0, 3]
    policy.set_cuda_graph_bs([64, 1, 2, 4, 8, 16, 24, 32, 40, 48])
    # a catch-up step runs at or below the resume size: plain graphs at every size
    assert policy.cuda_graph_bs_for_step(0) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 64]
    assert policy.cuda_graph_bs_for_step(3) == [1, 2, 4, 8, 16, 24, 32]
    seen = []
    for bs in (4, 33, 40, 0, 20, 20, 33, 10, 36, 5, 5):
        steps = policy.get_steps_for_batch(bs)
        seen.append((steps, policy.full_draft_extend))
    plain_kv, catch_up, spec = (0, False), (0, True), (3, True)
    assert [s for s, _ in seen] == [3, 0, 0, 0, 0, 3, 0, 0, 0, 0, 3]
    assert seen[1:3] == [plain_kv, plain_kv]
    assert seen[3] == plain_kv            # an idle batch changes nothing
    assert seen[4:6] == [catch_up, spec]  # resume at 20 <= 28: one catch-up step first
    assert seen[6] == plain_kv and seen[7] == catch_up  # 33 plain, 10 resumes via a catch-up
    assert seen[8] == plain_kv and seen[9:] == [catch_up, spec]
    assert policy.catch_up_steps == 3
    assert policy.controller is ctl and policy.on_verify_complete([1], 1) is None  # delegated


def test_plain_step_installs_the_hooks_of_its_parts_only() -> None:
    # One resolved object: each part that applies brings its hook group, nothing else; what does
    # not apply says why, in the start lines and the server info.
    full = plain_step.PlainStep(kv_only_reason=None, layout_reason=None, deferred_reason=None)
    assert full.hook_groups() == ("threshold", "kv_only", "layout")
    assert {h.group for h in hooks_of(*full.hook_groups())} == {"threshold", "kv_only", "layout"}
    # every switching server, `auto` or not, hears the scheduler go idle (its hysteresis resets)
    assert "sglang.srt.managers.scheduler.Scheduler.on_idle" in {h.target for h in hooks_of("threshold")}
    sync = plain_step.PlainStep(kv_only_reason=None, layout_reason="the synchronous scheduler",
                                deferred_reason="the speculative layout")
    assert sync.hook_groups() == ("threshold", "kv_only")
    assert sync.view() == {"target": "decode graph", "draft": "kv only", "layout": "speculative",
                           "draft_kv_write": "after each step"}
    assert sync.log_lines()[1] == ("Plain step: plain steps keep the speculative layout: "
                                   "the synchronous scheduler")
    deep = plain_step.PlainStep(kv_only_reason="the draft has 2 layers", layout_reason="x",
                                deferred_reason="y")
    assert deep.hook_groups() == ("threshold",) and deep.view()["draft"] == "full draft extend"
    assert deep.log_lines() == [
        "Plain step: plain steps run the draft's full step: the draft has 2 layers",
        "Plain step: plain steps keep the speculative layout: x"]
    # the smoke reads the server info's view, and these words where a server has none
    from smoke import checks
    assert checks.draft_plain_step({"plain_step": full.view()}, "") == "kv_only"
    assert checks.draft_plain_step({"plain_step": deep.view()}, "") == "full"
    assert checks.draft_plain_step({}, full.log_lines()[0]) == "kv_only"
    assert checks.draft_plain_step({}, deep.log_lines()[0]) == "full"
    # every hook names a function that exists, and a start-up hook never depends on a group
    for spec in HOOKS:
        assert callable(pkgutil.resolve_name(spec.function)), spec
    assert {h.group for h in HOOKS} == {START, "speculative", "threshold", "kv_only", "layout"}


class RecordedMetrics(sd.Metrics):
    def __init__(self) -> None:
        self.plain: list[bool] = []
        self.crossovers: list[int] = []

    def observe(self, plain_mode: bool, speculative_steps: int, plain_steps: int) -> None:
        assert speculative_steps + plain_steps == 1
        self.plain.append(plain_mode)

    def observe_crossover(self, crossover: int) -> None:
        self.crossovers.append(crossover)


def test_auto_policy_reports_each_crossover_move_in_the_line_metrics_and_snapshot() -> None:
    """The crossover is moved through the controller's `agree` seam (a split of its
    power-of-two buckets: 6 -> 32, 7 -> 64) to see what the policy reports."""
    split = [9]  # all 9 buckets of 1..256 speculate
    ctl = AutoController(AutoConfig(max_batch_size=256, bucket_edges=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                                    update_every=4, explore_steps=1, explore_gap=10**6),
                         agree=lambda _: Decision(split[0], frozenset()))
    lines: list[str] = []
    now = [0.0]
    policy = AutoThresholdPolicy(ctl, 3, log_fn=lines.append, clock=lambda: now[0],
                                 step_clock=lambda: now[0])
    metrics = RecordedMetrics()
    policy.metrics = metrics
    assert metrics.crossovers == [256]  # published when attached
    steps = []
    for i, (bs, new_split) in enumerate([(40, 9), (40, 9), (40, 9), (40, 6), (40, 6), (40, 6),
                                         (40, 6), (40, 7), (40, 7), (0, 7), (40, 7), (40, 7)]):
        now[0] = float(i)
        split[0] = new_split
        steps.append(policy.get_steps_for_batch(bs))
    # step 1 explores plain (nothing measured yet); crossover 32 at step 4 -> plain; 64 at
    # step 8 -> speculative again (40 <= 64 - 8); the idle call keeps the mode
    assert steps == [0, 3, 3, 0, 0, 0, 0, 3, 3, 3, 3, 3]
    assert metrics.crossovers == [256, 32, 64]
    assert metrics.plain == [s == 0 for s in steps[:9] + steps[10:]]
    assert lines[0].startswith("Speculation crossover -> 32 (auto, was 256; accept length ")
    assert lines[0].endswith("mode=plain; per bucket, speculative / plain: no bucket measured in both "
                             "modes yet; mode_changes=3, crossover_changes=1")
    # the move at t=7 falls within 5 s of the line at t=3: logged once the interval passed
    assert len(lines) == 2 and lines[1].startswith("Speculation crossover -> 64 (auto, was 32;")
    assert "crossover_changes=2" in lines[1]
    # a mode change is logged with the batch size that made it, also when folded and late
    for t, bs in ((20, 100), (21, 50), (30, 60)):
        now[0] = float(t)
        policy.get_steps_for_batch(bs)
    assert lines[2:] == [
        ("Speculation mode -> plain (batch size 100 > crossover 64, auto); mode_changes=5, "
        "crossover_changes=2"),
        ("Speculation mode -> speculative (batch size 50 <= 56, crossover 64, auto); "
        "mode_changes=6, crossover_changes=2")]
    snapshot = policy.snapshot()
    assert snapshot["threshold"] == "auto" and snapshot["crossover"] == 64
    assert snapshot["mode"] == "speculative" and snapshot["max_batch_size"] == 256
    assert snapshot["estimates"] == ctl.estimates_text()
    assert isinstance(policy, AutoPolicy) and policy.candidate_steps == [0, 3]


def _tp_rank(rank: int, port: int, agree_on: bool, out: Any) -> None:
    """One tensor-parallel rank: the auto policy over the same batches as the other rank,
    its own step times (its own noise), decisions agreed through a real gloo broadcast."""
    import math
    import random

    import torch.distributed as dist

    from sglang_image_plugin import tp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    config = AutoConfig(max_batch_size=256)
    agree = tp.tp_agree(dist.group.WORLD, 0, len(config.edges)) if agree_on else None
    clock = [0.0]
    policy = AutoPolicy(AutoController(config, agree=agree), 3, lambda: clock[0])
    batches, noise = random.Random(1), random.Random(100 + rank)
    steps: list[int] = []
    late: list[tuple[list[int], int]] = []
    while len(steps) < 12000:
        level = round(math.exp(batches.uniform(0, math.log(256))))
        for _ in range(batches.randint(50, 300)):
            bs = min(256, max(1, level + batches.randint(-2, 2)))
            k = policy.get_steps_for_batch(bs)
            steps.append(k)
            if late:
                policy.on_verify_complete(*late.pop())
            late.append(([2 if k else 0] * bs, bs))
            # the cost model's crossover lies inside the 17-32 bucket: close calls
            seconds = 7e-3 + 4e-4 * bs if k else 4e-3 + 6.4e-5 * bs
            clock[0] += seconds * math.exp(noise.gauss(0, 0.2))
    dist.destroy_process_group()
    out.put((rank, steps[:12000], policy.controller.crossover_changes,
             policy.controller.explore_steps))


def _run_tp_pair(agree_on: bool) -> dict[int, tuple[list[int], int, int]]:
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, port, agree_on, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, steps, changes, explored = queue.get(timeout=300)
        results[rank] = (steps, changes, explored)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def test_tensor_parallel_ranks_take_rank0s_decisions_over_gloo() -> None:
    """Two ranks, real torch.distributed (gloo on loopback), as tp.tp_agree runs over the
    TP group's CPU group: with it every step's step count matches; without, the ranks'
    own noise makes them choose differently (which would hang a TP server)."""
    agreed = _run_tp_pair(agree_on=True)
    assert agreed[0][0] == agreed[1][0]
    assert agreed[0][1] > 0  # the crossover moved, on both alike
    alone = _run_tp_pair(agree_on=False)
    assert alone[0][0] != alone[1][0]


def _steps(watch: AcceptanceAroundPlain, n: int, accepted: int, speculative: bool = True,
           rows: int = 4) -> None:
    for _ in range(n):  # the synchronous order: decide, then verify
        watch.decided(speculative, rows)
        watch.verified([accepted if speculative else 0] * rows)


def test_acceptance_is_paired_only_with_full_windows_on_both_sides() -> None:
    watch = AcceptanceAroundPlain(window=4)
    _steps(watch, 3, 2)  # too few speculative steps before the plain phase: no "before"
    _steps(watch, 2, 0, speculative=False)
    _steps(watch, 10, 2)
    assert watch.view()["phases_measured"] == 0
    _steps(watch, 1, 0, speculative=False)  # before = the last 4 of those 10 steps: 3.0
    _steps(watch, 2, 1)  # cut short by the next plain phase: no figure
    _steps(watch, 1, 0, speculative=False)  # and with 2 steps before it, no "before" either
    assert watch.view()["phases_measured"] == 0
    _steps(watch, 4, 2)
    _steps(watch, 1, 0, speculative=False)
    _steps(watch, 4, 0)  # before 3.0 (4 full steps), after 1.0
    view = watch.view()
    assert (view["phases_measured"], view["last_before"], view["last_after"]) == (1, 3.0, 1.0)
    assert view["worst_after_over_before"] == round(1 / 3, 4)


def test_acceptance_queue_pairs_overlapped_results_and_drops_what_does_not_match() -> None:
    watch = AcceptanceAroundPlain(window=2)
    watch.decided(True, 4)
    watch.decided(True, 0)  # an idle batch: nothing to verify
    watch.decided(True, 3)
    watch.verified([1, 1, 1, 1])
    watch.verified([1, 1])  # 2 rows for a 3-row step: not guessed at
    assert watch.unpaired_steps == 1
    for _ in range(AcceptanceAroundPlain.MAX_PENDING + 2):
        watch.decided(True, 1)
    assert watch.unpaired_steps == 3  # the oldest decisions beyond the queue's bound
    with pytest.raises(ValueError, match="window"):
        AcceptanceAroundPlain(window=0)


def test_the_prefill_graphs_switch_and_their_token_counts() -> None:
    """A prefill's draft K/V stay eager unless SGLANG_IMAGE_PREFILL_KV_GRAPHS=1, and the log says
    so; a prefill is padded to the next token count, at most 1.5x its own, and one above the
    largest runs eagerly."""
    from sglang_image_plugin import prefill_kv

    for off in ({}, {prefill_kv.GRAPHS_ENV: "0"}, {prefill_kv.GRAPHS_ENV: ""}):
        assert prefill_kv.why_not_graphs(None, environ=off) == (
            "SGLANG_IMAGE_PREFILL_KV_GRAPHS is not 1 (off by default)")
    counts = prefill_kv.TOKEN_COUNTS
    assert list(counts) == sorted(counts) and counts[0] >= 1
    padded = object.__new__(prefill_kv.PrefillDraftKv)
    padded.counts = counts
    assert [padded.count_for(n) for n in (1, 16, 17, 25, 1000, 1024, 1025)] == [16, 16, 24, 32, 1024, 1024, None]
    assert all(padded.count_for(n) <= max(16, 1.5 * n) for n in range(1, counts[-1] + 1))  # type: ignore[operator]



def test_a_prefill_graph_that_fails_to_capture_leaves_the_eager_write_and_says_why(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The server starts whatever the capture does: a failure, or graphs whose K/V differ from the
    eager write's, is logged with its cause and the prefills write eagerly (no buffers kept)."""
    import torch

    from sglang_image_plugin import gpu_memory, prefill_kv

    fc = torch.nn.Linear(12, 4, bias=False)
    runner = SimpleNamespace(model=SimpleNamespace(model=SimpleNamespace(fc=fc)), token_to_kv_pool=None)
    worker = SimpleNamespace(_draft_worker=SimpleNamespace(draft_runner=runner))
    monkeypatch.setattr(prefill_kv, "why_not_graphs", lambda w: None)
    monkeypatch.setattr(gpu_memory, "held_bytes", lambda: 2**30)

    def refuse(self: Any) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(prefill_kv.PrefillDraftKv, "capture", refuse)
    assert prefill_kv.install(worker) == (
        None, ("Plain step: prefills in plain mode write the draft's K/V eagerly: their CUDA graphs "
               "failed (RuntimeError: operation not permitted when stream is capturing)"))
    monkeypatch.setattr(prefill_kv.PrefillDraftKv, "capture", lambda self: None)
    # captured, then checked against the eager write: used only where they agree
    for apart in (0.5, float("nan")):
        monkeypatch.setattr(prefill_kv.PrefillDraftKv, "check", lambda self, apart=apart: apart)
        assert prefill_kv.install(worker) == (
            None, ("Plain step: prefills in plain mode write the draft's K/V eagerly: their CUDA graphs "
                   f"wrote K/V {apart:.3g} of the largest magnitude away from the eager write's (more "
                   "than 0.02)"))
    monkeypatch.setattr(prefill_kv.PrefillDraftKv, "check", lambda self: 0.0)
    prefill, line = prefill_kv.install(worker)
    assert isinstance(prefill, prefill_kv.PrefillDraftKv) and prefill.hidden.shape == (1024, 12)
    assert line == ("Plain step: prefills in plain mode write the draft's K/V from CUDA graphs at 13 token "
                    "counts up to 1024 (0 MiB; checked against the eager write: 0 of the largest "
                    "magnitude apart)")


def test_what_start_up_state_took_is_this_process_s_own_gpu_memory(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A second server starting on the same GPU moves the device's free memory by gigabytes while
    the prefill graphs are captured (a first GPU run logged 2,342 MiB for them): what the start log
    counts is what this process's allocator holds after, less before, and nothing without a GPU."""
    import torch

    from sglang_image_plugin import gpu_memory, prefill_kv

    assert gpu_memory.held_bytes() is None  # the CPU's torch: no GPU, nothing counted
    assert gpu_memory.took(None, 5) is None and gpu_memory.took(7, 5) == 0
    mib = 2**20
    free = iter([40_000 * mib, 37_600 * mib])  # the device: the neighbour allocated 2.3 GiB meanwhile
    reserved = iter([900 * mib, 912 * mib])  # this process: 12 MiB more after the capture
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (next(free), 80_000 * mib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: next(reserved))
    fc = torch.nn.Linear(12, 4, bias=False)
    runner = SimpleNamespace(model=SimpleNamespace(model=SimpleNamespace(fc=fc)), token_to_kv_pool=None)
    worker = SimpleNamespace(_draft_worker=SimpleNamespace(draft_runner=runner))
    monkeypatch.setattr(prefill_kv, "why_not_graphs", lambda w: None)
    monkeypatch.setattr(prefill_kv.PrefillDraftKv, "capture", lambda self: None)
    monkeypatch.setattr(prefill_kv.PrefillDraftKv, "check", lambda self: 0.0)
    _, line = prefill_kv.install(worker)
    assert "(12 MiB;" in line, line
