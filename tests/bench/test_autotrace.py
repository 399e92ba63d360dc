"""auto's step trace (bench.autotrace): read back per bucket and mode, replayed through a fresh
controller."""
from __future__ import annotations

import json
from typing import Any

import pytest

from bench import report as bench_report


def test_auto_s_step_trace_is_read_back_per_bucket_and_mode(tmp_path, capsys):
    from bench import autotrace
    from bench.__main__ import main as bench_main

    def step(kind, batch, seconds, tokens, prefills=0, recorded=True):
        return {"t": 0.0, "kind": kind, "batch": batch, "seconds": seconds, "tokens": tokens,
                "recorded": recorded, "prefills": prefills, "crossover": 64}

    # at 64 requests: plain steps of 5 ms, a quarter of them 9 ms with a prefill; speculative steps
    # of 15 ms, three quarters of them 19 ms with one (requests end three times as often)
    records = ([step("plain", 64, 0.005, 64)] * 30 + [step("plain", 64, 0.009, 64, 1)] * 10
               + [step("speculative", 63, 0.015, 189)] * 10 + [step("speculative", 64, 0.019, 192, 1)] * 30
               + [step("plain", 64, 0.1, 64, recorded=False), step("catch-up", 64, 0.007, 64, recorded=False),
                  {"t": 1.0, "kind": "prefill", "tokens": 48}, step("speculative", 1, 0.006, 3)])
    path = tmp_path / "eagle3_auto_steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"t": 2.0, "kind": "spe')  # cut short
    rows = {(r.low, r.high, r.kind): r for r in autotrace.summarize(autotrace.read(path))}
    assert set(rows) == {(57, 64, "plain"), (57, 64, "speculative"), (1, 1, "speculative")}
    plain, spec = rows[(57, 64, "plain")], rows[(57, 64, "speculative")]
    assert (plain.steps, plain.left_out, plain.with_prefill) == (40, 1, 0.25)
    assert plain.median_ms == pytest.approx(5.0) and plain.mean_ms == pytest.approx(6.0)
    assert plain.tok_s_median == pytest.approx(64 / 0.005) and plain.tok_s_sums == pytest.approx(64 / 0.006)
    assert spec.median_ms == pytest.approx(19.0) and spec.mean_batch == pytest.approx(63.75)
    assert spec.tok_s_sums == pytest.approx((10 * 189 + 30 * 192) / (10 * 0.015 + 30 * 0.019))
    # each mode ran 40 steps in a row there: one dwell each, its first 4 steps left out
    assert (plain.dwells, spec.dwells, rows[(1, 1, "speculative")].dwells) == (1, 1, 0)
    assert plain.tok_s_dwells == pytest.approx(36 * 64 / (26 * 0.005 + 10 * 0.009))
    assert spec.tok_s_dwells == pytest.approx((6 * 189 + 30 * 192) / (6 * 0.015 + 30 * 0.019))
    lines = autotrace.render(list(rows.values()))
    by_medians = (spec.tok_s_median / plain.tok_s_median)
    by_sums = (spec.tok_s_sums / plain.tok_s_sums)
    by_dwells = (spec.tok_s_dwells / plain.tok_s_dwells)
    assert (f"57-64 speculative / plain: {by_medians:.3f}x by the medians, {by_sums:.3f}x by the sums, "
            f"{by_dwells:.3f}x by the dwells") in lines
    assert any(line.startswith("57-64 plain: 40 steps (+1 left out), batch 64.0, 25% with a prefill") for line in lines)
    # the same lines from the report's dicts, and from the command line
    assert autotrace.render([r.as_dict() for r in rows.values()]) == lines
    assert bench_main(["auto-trace", str(path)]) == 0
    assert lines[0] in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no such trace"):
        bench_main(["auto-trace", str(tmp_path / "none.jsonl")])


def test_a_trial_s_steps_are_read_back_as_one_line():
    """A trial's steps carry its bucket: one line says where and when it ran, what each mode made
    there meanwhile (a step in another bucket, or one not recorded, aside) and how the crossover
    moved."""
    from bench import autotrace

    def step(t, kind, batch, seconds, tokens, trial=None, crossover=160, recorded=True):
        return {"t": t, "kind": kind, "batch": batch, "seconds": seconds, "tokens": tokens,
                "recorded": recorded, "prefills": 0, "crossover": crossover,
                **({"trial": trial} if trial else {})}

    records = [step(0.0, "plain", 192, 0.01, 192),
               *[step(1.0, "speculative", 190, 0.03, 570, "161-192") for _ in range(10)],
               step(1.5, "plain", 128, 0.008, 128, "161-192"),  # another bucket
               step(1.6, "plain", 192, 0.5, 192, "161-192", recorded=False),  # not recorded
               *[step(2.0, "plain", 192, 0.01, 192, "161-192") for _ in range(10)],
               step(3.0, "speculative", 190, 0.03, 570, crossover=192)]
    lines = autotrace.trials(records)
    ratio = (5700 / 0.3) / (1920 / 0.1)
    assert lines == [(f"trial at 161-192 from 1.0s: 10 speculative / 10 plain steps recorded there; "
                      f"speculative / plain {ratio:.3f}x by the sums; crossover 160 -> 192")]
    assert autotrace.trials(records[:1]) == []


def test_a_dwell_is_a_long_enough_run_of_one_mode_in_one_bucket():
    """A burst of a few steps is no dwell; any other step ends a run (another mode or bucket, one
    not recorded); the prefills between steps do not, their time being in the next step's."""
    from bench import autotrace

    def step(kind, batch, recorded=True):
        return {"kind": kind, "batch": batch, "seconds": 0.01, "tokens": batch, "recorded": recorded}

    need = autotrace.DWELL_SKIP + autotrace.DWELL_STEPS
    prefill = {"kind": "prefill", "tokens": 40}
    records = ([step("plain", 200)] * (need - 1) + [step("speculative", 200)]  # one short of a dwell
               + [step("plain", 200), prefill] * need  # a dwell, prefills between its steps
               + [step("plain", 250)] * need  # another bucket: a dwell of its own
               + [step("plain", 200)] * 6 + [step("plain", 200, recorded=False)] + [step("plain", 200)] * (need - 6))
    runs = autotrace.dwells(records)
    assert {k: [len(r) for r in v] for k, v in runs.items()} == {
        (193, 224, "plain"): [autotrace.DWELL_STEPS], (225, 256, "plain"): [autotrace.DWELL_STEPS]}


def served_step(ctl: Any, mode: Any, batch: int, seconds: float, clock: float) -> dict[str, Any]:
    """One step of a server's controller (3 tokens a request speculating), recorded there, and its
    trace record as the server writes it."""
    from sglang_image_plugin.setting import Mode

    tokens = batch * (3 if mode is Mode.SPECULATIVE else 1)
    ctl.record(mode, batch, seconds, tokens)
    return {"t": clock, "kind": str(mode), "batch": batch, "seconds": seconds, "tokens": tokens,
            "recorded": True, "prefills": 0, "crossover": ctl.crossover()}


def test_a_replay_takes_the_server_s_limit_from_its_trace():
    """A server of 4,096 running requests at loads of 256 and 192 (plain 4% ahead at 256, noisy
    steps; speculation wins at 192): the replay with the trace's own settings moves as the server
    did, its buckets up to the server's limit (the first step's crossover), not the power of two
    above the traffic (the unmeasured buckets above 256 take part in where the split goes)."""
    import math
    import random

    from bench import autotrace
    from sglang_image_plugin import auto_threshold as auto

    rng = random.Random(1)
    ctl = auto.AutoController(auto.AutoConfig(max_batch_size=4096, step_noise=0.0))
    seconds_at = {(True, 256): 32.8e-3, (False, 256): 10.5e-3, (True, 192): 28.6e-3, (False, 192): 9.5e-3}
    records, clock = [], 0.0
    for batch in (256, 192, 256, 192):
        for _ in range(1500):
            mode = ctl.decide(batch)
            is_spec = mode is auto.Mode.SPECULATIVE
            seconds = seconds_at[is_spec, batch] * math.exp(rng.gauss(0, 0.1))
            records.append(served_step(ctl, mode, batch, seconds, clock))
            clock += seconds
    served = autotrace.server_changes(records)
    assert served[0][1] == 4096 and len(served) > 1
    replayed, _ = autotrace.replay(records, {"step_noise": 0.0})
    assert replayed == served[1:]


def test_a_trace_replayed_with_its_own_settings_moves_as_the_server_did_and_with_others_shows_theirs(tmp_path, capsys):
    """--replay: the steps of a trace through a fresh controller. With the settings that made the
    trace it must move its crossover exactly as the server did (else it would not show what another
    setting changes); with today's step_noise, the lucky burst of the auto test moves nothing."""
    import math
    import random

    from bench import autotrace
    from bench.__main__ import main as bench_main
    from sglang_image_plugin import auto_threshold as auto

    rng = random.Random(0)
    ctl = auto.AutoController(auto.AutoConfig(max_batch_size=64, step_noise=0.0))
    settled = ctl.config.edges[-2]  # the edge below the 64 bucket, where plain wins
    plain = {16: 4.82e-3, 64: 6.1e-3}
    spec = {16: 9.3e-3, 64: 19.7e-3}  # 1.55x plain's tokens/s at 16, 0.93x at 64
    records, clock, bursts, last = [], 0.0, 0, None
    for phase, (batch, steps) in enumerate([(16, 3000), (64, 8000)]):
        for _ in range(steps):
            mode = ctl.decide(batch)
            is_spec = mode is auto.Mode.SPECULATIVE
            seconds = (spec if is_spec else plain)[batch] * math.exp(rng.gauss(0, 0.03))
            if phase == 1 and is_spec and ctl.crossover() == settled:
                bursts += last is not auto.Mode.SPECULATIVE
                seconds *= 0.88 if bursts == 2 else 1.0
            last = mode
            records.append(served_step(ctl, mode, batch, seconds, clock))
            clock += seconds
    served = autotrace.server_changes(records)
    assert [c for _, c in served] == [64, settled, 64, settled]  # the burst moved it (and back)
    same, _ = autotrace.replay(records, {"step_noise": 0.0})
    assert same == served[1:]  # (the server started at its max batch: no change to replay there)
    today, estimates = autotrace.replay(records, {})
    assert [c for _, c in today] == [settled] and "57-64" in estimates
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert bench_main(["auto-trace", str(path), "--replay", "step_noise=0"]) == 0
    out = capsys.readouterr().out
    assert f"the server's crossover: 64 at 0.0s, {settled} at " in out and f"replayed (step_noise=0): {settled} at " in out
    assert bench_main(["auto-trace", str(path), "--replay", "", "--leave-out-prefills", "next"]) == 0
    assert f"replayed (defaults; steps with a prefill left out: next): {settled} at " in capsys.readouterr().out
    for bad in ("noise=1", "step_noise=", "step_noise=much", "bucket_edges=1"):
        with pytest.raises(SystemExit, match="--replay"):
            bench_main(["auto-trace", str(path), "--replay", bad])


def test_auto_s_comparison_carries_the_spread_of_fixed_thresholds_that_do_the_same_work():
    # row 38 (8B shape): at 4 requests thresholds 8, 16 and 32 all speculate, yet threshold 8 ran
    # at 0.97x of 16; auto's "0.97x of the best" there is that spread, not a wrong mode
    # row 40: at 16 requests threshold 16 decoded plain (accept length 1.00) and 32 speculated: not
    # the same mode, though 16 <= 16 (where the load came from decides at C = N)
    tok = {"4": {"eagle3_auto": 1710, "eagle3_thr8": 1722, "eagle3_thr16": 1784, "eagle3_thr32": 1779},
           "16": {"eagle3_auto": 5112, "eagle3_thr8": 3151, "eagle3_thr16": 3143, "eagle3_thr32": 5076},
           "64": {"eagle3_auto": 9554, "eagle3_thr8": 10293, "eagle3_thr16": 10127, "eagle3_thr32": 10368},
           "1": {"eagle3_auto": 475, "eagle3_thr8": 469}}
    accept = {"4": 3.1, "64": 1.0, "1": 3.1}
    accept_16 = {"eagle3_auto": 3.0, "eagle3_thr8": 1.0, "eagle3_thr16": 1.004, "eagle3_thr32": 3.1}
    names = ["eagle3_auto", "eagle3_thr8", "eagle3_thr16", "eagle3_thr32"]
    result = {"configs": names, "thresholds": [8, 16, 32], "blocks": {
        c: [{"block": b, "order": list(row), "windows": {n: {"tok_per_s": v * (1 + 0.001 * b), "output_tokens": v,
                                                            "seconds": 1.0, "requests": 4, "errors": 0,
                                                            "accept_length": accept.get(c) or accept_16[n]}
                                                        for n, v in row.items()}}
            for b in range(4)] for c, row in tok.items()}}
    auto = bench_report.auto_comparison(result)
    assert auto["4"]["best_fixed"] == 16 and auto["4"]["same_mode_floor"]["threshold"] == 8
    assert auto["4"]["same_mode_floor"]["median"] == pytest.approx(1722 / 1784, abs=1e-3)
    # at 64 all three decode plain: the lowest of the other two against the best (32)
    assert auto["64"]["best_fixed"] == 32 and auto["64"]["same_mode_floor"]["threshold"] == 16
    assert "same_mode_floor" not in auto["1"]  # threshold 8 alone there
    assert auto["16"]["best_fixed"] == 32 and "same_mode_floor" not in auto["16"]
    md = bench_report.markdown(result)
    assert "| 4 | - | 16 | 0.96x [0.96-0.96] | 0.97x [0.97-0.97] (8) |" in md


@pytest.mark.parametrize("leave_out,steps", [("none", "(10/10 steps)"), ("same", "(9/6 steps)"),
                                             ("next", "(10/5 steps)")])
def test_a_replay_can_leave_out_the_steps_a_prefill_fell_in(leave_out, steps):
    # where a prefill's GPU time lands (the step it was noted with, or the one after it under the
    # overlap scheduler) is for a GPU trace to show; the replay tries both
    from bench import autotrace

    def step(kind, prefills):
        return {"t": 0.0, "kind": kind, "batch": 64, "seconds": 0.02 if kind == "speculative" else 0.006,
                "tokens": 192 if kind == "speculative" else 64, "recorded": True, "prefills": prefills}

    records = ([step("speculative", 0)] * 9 + [step("speculative", 1)]
               + [step("plain", i in (1, 3, 5, 7)) for i in range(10)])
    _, estimates = autotrace.replay(records, {}, leave_out)
    assert estimates.startswith("57-64: ") and estimates.endswith(steps)
    with pytest.raises(ValueError, match="leave_out_prefills 'all'"):
        autotrace.replay(records, {}, "all")
