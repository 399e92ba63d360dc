"""A server's checks after its load and the outputs compared with plain decoding's
(bench.checks)."""
from __future__ import annotations

import json
from pathlib import Path

from bench import checks
from bench import report as bench_report
from smoke.server import ServerConfig


def test_outputs_and_aborted_prefixes_are_compared_with_plain_decoding():
    outs = {"plain": {"a": [1, 2], "b": [2, 3]}, "eagle3": {"a": [1, 2], "b": [9, 3]}}
    prefixes = {"plain": {"c": [5]}, "eagle3": {"c": [5], "b": [2]}, "plain_twin": {"a": [7]}}
    problems, details = checks.compared_outputs(outs, prefixes, "block 1 c=4")
    assert problems == [
        "block 1 c=4 eagle3: 1 output(s) differ from plain (e.g. b)",
        ("block 1 c=4 plain_twin: 1 aborted output(s) not a prefix of plain's "
         "(e.g. a: differs at token 0 of 1, plain's 2: got [7] want [1, 2])")]
    assert [(d["server"], d["bad"], [e["key"] for e in d["examples"]]) for d in details] == [("plain_twin", 1, ["a"])]


def test_an_aborted_output_not_a_prefix_of_plain_s_says_where_it_leaves_it():
    # A GPU run failed blocks at 64 and 128 requests with aborted EAGLE-3 outputs that were no
    # prefix of plain's, and nothing said how: the failure now names the first differing token,
    # both lengths and the tokens around it; bench.json keeps the first 5 of each block and server,
    # with the server's finish_reason of each.
    plain = list(range(100, 120))  # 20 tokens
    keys = [f"c64-{i}" for i in range(7)]
    outs = {"plain": {k: plain for k in keys}}
    changed = plain[:12]
    changed[9] = 7
    bad = {keys[0]: changed,  # differs inside: at token 9 of its 12
           keys[1]: [*plain[:-1], 5, 6],  # longer than plain's complete output, and differs before its end
           **{k: [1] for k in keys[2:]},
           "c64-ok": plain[:4],
           # all of plain's output and more: not a wrong token but a length past max_new_tokens,
           # which over_max() reports from the window's count (a GPU run: 1-7 a block at 192-256)
           "c64-over": [*plain, 5, 6]}
    outs["plain"]["c64-ok"] = outs["plain"]["c64-over"] = plain
    reasons = {"eagle3": {keys[0]: {"type": "abort", "message": "Abort all requests"}}}
    problems, details = checks.compared_outputs(outs, {"eagle3": bad}, "block 3 c=64", reasons)
    assert problems == [(
        "block 3 c=64 eagle3: 7 aborted output(s) not a prefix of plain's (e.g. c64-0: differs at token 9 "
        "of 12, plain's 20, finish abort: got [106, 107, 108, 7, 110, 111] want [106, 107, 108, 109, 110, 111, 112, 113])")]
    (d,) = details
    assert (d["where"], d["server"], d["bad"], len(d["examples"])) == ("block 3 c=64", "eagle3", 7, 5)
    first, longer = d["examples"][:2]
    assert first == {"key": "c64-0", "aborted_len": 12, "plain_len": 20, "differs_at": 9, "longer": False,
                     "from": 6, "got": [106, 107, 108, 7, 110, 111], "want": [106, 107, 108, 109, 110, 111, 112, 113],
                     "finish_reason": {"type": "abort", "message": "Abort all requests"}}
    assert longer == {"key": "c64-1", "aborted_len": 21, "plain_len": 20, "differs_at": 19, "longer": True,
                      "from": 16, "got": [116, 117, 118, 5, 6], "want": [116, 117, 118, 119], "finish_reason": None}
    assert checks.detail_text(longer) == ("c64-1: differs at token 19 of 21, plain's 20 (longer than plain's): "
                                          "got [116, 117, 118, 5, 6] want [116, 117, 118, 119]")
    assert d["examples"][2]["differs_at"] == 0 and d["examples"][2]["from"] == 0
    assert "c64-over" not in {e["key"] for e in d["examples"]}


def test_an_aborted_output_past_its_max_new_tokens_fails_its_block():
    # an abort's last speculative pass could accept tokens past the request's max_new_tokens
    # (upstream took the abort before the length check); the window counts them, plain's or not
    windows = {"plain": {"aborted_over_max": 0}, "eagle3": {"aborted_over_max": 3}, "old": {}}
    assert checks.over_max(windows, "block 2 c=256") == [
        "block 2 c=256 eagle3: 3 aborted output(s) longer than their max_new_tokens"]
    assert checks.over_max({"eagle3": {"aborted_over_max": 0}}, "block 1 c=1") == []


class ChecksServer:
    def __init__(self, log: Path, env: dict[str, str] | None = None):
        self.base, self.log_path = "http://x", log
        self.cfg = ServerConfig("x", log.parent, env=env or {})

    def log_text(self) -> str:
        return self.log_path.read_text()


def test_server_checks_keep_every_figure_whichever_check_fails(monkeypatch, tmp_path):
    # The KV pool check of every server, a threshold server's too, even where its log shows an
    # error (it used to be dropped with the log check's exception) or its limit is too low.
    log = tmp_path / "server_bench_eagle3_thr16.2.log"
    log.write_text("Traceback (most recent call last)\nRuntimeError: boom\n")
    monkeypatch.setattr(checks, "kv_used_after_flush", lambda base: 12)
    monkeypatch.setattr(checks, "running_limit", lambda base: 48)
    monkeypatch.setattr(checks, "speculation_state", lambda base: {"threshold": 16})
    info, problems = checks.server_checks("eagle3_thr16", ChecksServer(log), 256, True)
    assert info == {"kv_used_after_flush": 12, "running_limit": 48,
                    "speculative_disable": {"threshold": 16}}
    assert problems[0] == "eagle3_thr16: 12 KV tokens still in use after the load and a cache flush"
    assert problems[1] == "eagle3_thr16: runs at most 48 requests at once, below the top concurrency 256"
    assert problems[2].startswith("eagle3_thr16: server log shows an error") and log.name in problems[2]
    log.write_text("all fine\n")
    monkeypatch.setattr(checks, "kv_used_after_flush", lambda base: 0)
    monkeypatch.setattr(checks, "running_limit", lambda base: 256)
    assert checks.server_checks("eagle3_thr16", ChecksServer(log), 256, True)[1] == []
    # auto's step trace, where its server wrote one, is read back into the report
    trace = tmp_path / "eagle3_auto_steps.jsonl"
    env = {"SGLANG_IMAGE_AUTO_TRACE": str(trace)}
    assert "step_trace" not in checks.server_checks("eagle3_auto", ChecksServer(log, env), 256, True)[0]
    trace.write_text("".join(json.dumps({"t": 0.0, "kind": k, "batch": 8, "seconds": 0.01, "tokens": n,
                                         "recorded": True, "prefills": 0}) + "\n"
                             for k, n in (("plain", 8), ("speculative", 24)) for _ in range(4)))
    info, problems = checks.server_checks("eagle3_auto", ChecksServer(log, env), 256, True)
    assert problems == [] and [r["kind"] for r in info["step_trace"]] == ["plain", "speculative"]
    md = bench_report.markdown({"configs": ["eagle3_auto"], "servers": {"eagle3_auto": info}})
    assert "- EAGLE-3 + auto steps: 5-8 speculative / plain: 3.000x by the medians, 3.000x by the sums" in md


def test_a_kernel_compiled_while_serving_is_kept_and_reported(monkeypatch, tmp_path):
    """A Triton compile inside a counted window stalls it (1.38 s in one block of a GPU run): the
    server's checks keep each such line of its log and the report names it beside the server."""
    log = tmp_path / "server_bench_eagle3_sched1.1.log"
    log.write_text("[2026-12-08 00:33:16] Prefill batch, #new-seq: 2\n"
                   "[2026-12-08 00:34:49] Triton kernel '_fwd_kernel' took 1.38 s to compile after serving "
                   "started. Serving-time compilation can stall the engine; pre-compile it during engine init.\n")
    monkeypatch.setattr(checks, "kv_used_after_flush", lambda base: 0)
    monkeypatch.setattr(checks, "running_limit", lambda base: 64)
    info, problems = checks.server_checks("eagle3", ChecksServer(log), 64, False)
    assert problems == []
    assert info["serving_compiles"] == [{"at": "2026-12-08 00:34:49", "kernel": "_fwd_kernel", "seconds": 1.38}]
    md = bench_report.markdown({"configs": ["eagle3"], "servers": {"eagle3": info}})
    assert "- EAGLE-3: Triton kernels compiled while serving" in md
    assert "_fwd_kernel 1.38 s at 2026-12-08 00:34:49" in md
    log.write_text("[2026-12-08 00:33:16] Prefill batch, #new-seq: 2\n")
    assert "serving_compiles" not in checks.server_checks("eagle3", ChecksServer(log), 64, False)[0]
