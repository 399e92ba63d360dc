"""GPU proof of the SM120 all-reduce patches (torch symmetric memory two-shot, FlashInfer allreduce
fusion) on a 2-GPU machine, with a tiny Qwen3 model (sglang runs it through LayerCommunicator).

    PYTHONPATH=plugin python3 -m bench comm --bundle .gpu --state /tmp/smoke-state --out "$OUT" [--deadline 560]

= `python3 -m bench e2e --phases install,patch,models,comm` (same options; every phase resumes from
the state dir, so the same command on the warm machine continues where the deadline stopped it).

Runs, in priority order, each with the same greedy prompts (token-for-token comparison):
  tp2_ref        TP=2, no flag (the reference outputs)
  tp2_symm_mem   TP=2 --enable-torch-symm-mem --disable-custom-all-reduce: log shows the two-shot
                 all-reduce over P2P (multicast off) and its first call
  tp2_fusion     TP=2 --flashinfer-allreduce-fusion-backend trtllm: log shows the fused kernel launched
                 (the first start JIT-compiles flashinfer's trtllm comm module: minutes)
  tp1_ref, tp1_symm_mem, tp1_fusion   TP=1 without / with each flag: starts, same outputs; the
                 fusion run warns that it will NOT be applied (tensor parallelism is 1)
Every run: no Traceback/CUDA error in the log, the "hf" prompt gives expected.json's continuation
(HF transformers, float32), every prompt gives tp2_ref's outputs. NVLink multicast is off in every
server's environment (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
"""
from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smoke import client
from smoke.checks import check_log_clean, check_no_errors, check_outputs
from smoke.client import Prompt
from smoke.deadline import Deadline
from smoke.server import Server, ServerConfig, SmokeError, log_tail

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}
SYMM_FLAGS = ("--enable-torch-symm-mem",)
FUSION_FLAGS = ("--flashinfer-allreduce-fusion-backend", "trtllm")
SYMM_TWO_SHOT = "torch symm mem: multicast unavailable, using two-shot all-reduce over P2P"
SYMM_FIRST_CALL = "torch symm mem: first all-reduce via two_shot_all_reduce_"
SYMM_ANY = "torch symm mem:"
FUSION_LAUNCHED = "FlashInfer allreduce fusion: fused allreduce+residual+RMSNorm kernel launched"
FUSION_TP1_WARNING = "will NOT be applied: tensor parallelism is 1"
REFERENCE = "tp2_ref"


@dataclass(frozen=True)
class CommRun:
    name: str
    tp: int
    flags: tuple[str, ...] = ()
    expect: tuple[str, ...] = ()   # log lines (substrings) that must appear
    absent: tuple[str, ...] = ()   # ... and that must not
    start_timeout: float = 300


RUNS = (
    CommRun(REFERENCE, 2, absent=(SYMM_ANY, FUSION_LAUNCHED)),
    CommRun("tp2_symm_mem", 2, SYMM_FLAGS + ("--disable-custom-all-reduce",),
            expect=(SYMM_TWO_SHOT, SYMM_FIRST_CALL)),
    CommRun("tp2_fusion", 2, FUSION_FLAGS, expect=(FUSION_LAUNCHED,), start_timeout=420),
    CommRun("tp1_ref", 1, absent=(SYMM_ANY, FUSION_LAUNCHED)),
    CommRun("tp1_symm_mem", 1, SYMM_FLAGS),
    CommRun("tp1_fusion", 1, FUSION_FLAGS, expect=(FUSION_TP1_WARNING,), absent=(FUSION_LAUNCHED,)),
)
RUN_NAMES = tuple(r.name for r in RUNS)


# ----------------------------------------------------------------------------- checks (pure)
def find_lines(log_text: str, expect: tuple[str, ...] = (), absent: tuple[str, ...] = ()
               ) -> dict[str, str | None]:
    """{pattern: first log line containing it (stripped) or None} for expect + absent."""
    lines = log_text.splitlines()
    return {pat: next((ln.strip()[:400] for ln in lines if pat in ln), None) for pat in expect + absent}


def check_log_lines(log_text: str, run: CommRun) -> dict[str, str | None]:
    found = find_lines(log_text, run.expect, run.absent)
    missing = [p for p in run.expect if found[p] is None]
    unwanted = [found[p] for p in run.absent if found[p] is not None]
    problems = []
    if missing:
        problems.append("log line(s) missing: " + "; ".join(repr(p) for p in missing))
    if unwanted:
        problems.append("unexpected log line(s): " + "; ".join(repr(u) for u in unwanted))
    if problems:
        raise SmokeError(f"{run.name}: " + " | ".join(problems))
    return found


def check_hf(expected: dict[str, Any], outputs: dict[str, list[int] | None], name: str) -> None:
    got = outputs.get("hf")
    if got != expected["greedy_ids"]:
        raise SmokeError(f"{name}: the 'hf' prompt gives {got}, HF transformers (expected.json) gives "
                           f"{expected['greedy_ids']}")


def make_prompts(expected: dict[str, Any], seed: int = 0) -> list[Prompt]:
    """The HF prompt, 8 short random ones and one long one (a larger prefill all-reduce)."""
    rnd = random.Random(seed)
    vocab = int(expected["vocab_size"])
    out = [Prompt("hf", tuple(expected["prompt_ids"]), len(expected["greedy_ids"]))]
    for i in range(8):
        out.append(Prompt(f"c{i:02d}", tuple(rnd.randrange(3, vocab) for _ in range(rnd.randint(4, 40))),
                          rnd.choice([24, 32, 48])))
    out.append(Prompt("long", tuple(rnd.randrange(3, vocab) for _ in range(700)), 32))
    return out


# ----------------------------------------------------------------------------- runs
@dataclass
class CommOptions:
    model: Path                    # dir holding target/ and expected.json (`smoke models --arch qwen3`)
    out: Path                      # server logs
    deadline: Deadline = field(default_factory=lambda: Deadline(time.time() + 3600))
    runs: tuple[str, ...] = RUN_NAMES
    port: int = 30000
    mem_fraction: float = 0.15
    min_server_s: float = 120      # no server started with less left


class DeadlineStop(Exception):
    """A run's start was cut short by the call's deadline (not a failure: the next call retries)."""


def run_one(opts: CommOptions, run: CommRun, prompts: list[Prompt], expected: dict[str, Any],
            ref: dict[str, list[int]] | None, ref_name: str = REFERENCE) -> dict[str, Any]:
    cfg = ServerConfig(run.name, opts.model / "target", cuda_graph=False, mem_fraction=opts.mem_fraction,
                       enable_metrics=False, extra=("--tp-size", str(run.tp), *run.flags),
                       env=dict(NO_MULTICAST_ENV))
    log = opts.out / f"server_comm_{run.name}.log"
    log.unlink(missing_ok=True)  # a retried run is judged on its own log only
    rep: dict[str, Any] = {"name": run.name, "tp": run.tp, "flags": list(run.flags),
                           "expect": list(run.expect), "absent": list(run.absent),
                           "started_at": time.strftime("%Y-%m-%d %H:%M:%S"), "ok": False}
    srv = Server(cfg, opts.port, log)
    timeout = min(run.start_timeout, opts.deadline.left() - 40)
    try:
        try:
            srv.start(timeout)
        except SmokeError as exc:
            if "not healthy after" in exc.cause and timeout < run.start_timeout:
                raise DeadlineStop(f"{run.name}: not healthy within the {timeout:.0f}s the deadline left")
            raise
        rep["start_s"] = round(srv.start_seconds, 1)
        t0 = time.time()
        timeout_req = opts.deadline.request_timeout(180.0)
        res = client.run_concurrent(srv.base, prompts, 8, timeout_req)
        rep["requests_s"] = round(time.time() - t0, 1)
        check_no_errors(res, run.name)
        outputs = {r.key: r.output_ids for r in res}
        rep["outputs"] = outputs
        time.sleep(1)  # let the workers' log lines reach the file
        text = srv.log_text()
        rep["log_lines"] = find_lines(text, run.expect, run.absent)
        check_log_clean(text)
        check_log_lines(text, run)
        if not srv.alive():
            raise SmokeError(f"{run.name}: server process died during the test")
        if ref is not None and run.name != ref_name:
            check_outputs(ref, res, f"{run.name} vs {ref_name}")
            rep["equal_to_ref"] = ref_name
        check_hf(expected, outputs, run.name)
        rep["ok"] = True
    except DeadlineStop:
        raise
    except SmokeError as exc:
        rep["cause"] = exc.cause
    except client.HTTPFailure as exc:
        rep["cause"] = f"{run.name}: HTTP failure talking to the server: {exc}"
    except Exception as exc:  # noqa: BLE001 - any surprise still gives cause + log tail
        import traceback

        rep["cause"] = f"{run.name}: runner error: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-1200:]}"
    finally:
        srv.stop()
    if "cause" in rep:
        if "vs " + ref_name in rep["cause"]:
            rep["equal_to_ref"] = False
        text = log.read_text(errors="replace") if log.exists() else ""
        rep.setdefault("log_lines", find_lines(text, run.expect, run.absent))
        rep["log_tail"] = log_tail(log, 40)
    return rep


def reference_for(run: CommRun, done: dict[str, Any]) -> tuple[str, dict[str, list[int]] | None]:
    """tp2_ref when it passed (all runs must equal it); on a one-GPU machine, tp1_ref for TP=1 runs."""
    for name in (REFERENCE, f"tp{run.tp}_ref"):
        if name != run.name and done.get(name, {}).get("ok"):
            return name, done[name].get("outputs")
    return REFERENCE, None


def run_comm(opts: CommOptions, state: dict[str, Any],
             progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every run not in state["runs"] yet, in order; `progress(report)` after each one (e2e writes
    report.json/summary.txt to OUT then). Finished runs (pass or fail) are kept in `state`."""
    opts.out.mkdir(parents=True, exist_ok=True)
    expected = json.loads((opts.model / "expected.json").read_text())
    prompts = make_prompts(expected)
    done = state.setdefault("runs", {})
    report: dict[str, Any] = {"model": str(opts.model), "runs": done, "failures": [], "skipped": []}

    def refresh() -> dict[str, Any]:
        report["failures"] = [{"variant": f"comm {n}", "cause": r.get("cause"), "log_tail": r.get("log_tail")}
                              for n, r in done.items() if not r.get("ok")]
        if progress:
            progress(report)
        return report

    for run in RUNS:
        if run.name not in opts.runs or run.name in done:
            continue
        if opts.deadline.left() < opts.min_server_s:
            report["skipped"].append(f"{run.name} (deadline)")
            continue
        ref_name, ref = reference_for(run, done)
        try:
            done[run.name] = run_one(opts, run, prompts, expected, ref, ref_name)
        except DeadlineStop as exc:
            report["skipped"].append(str(exc))
        refresh()
    return refresh()


def summarize(report: dict[str, Any]) -> str:
    lines = ["comm (tiny Qwen3, greedy, token-for-token vs tp2_ref, or tp1_ref where tp2_ref did not run):"]
    for name in RUN_NAMES:
        r = report.get("runs", {}).get(name)
        if r is None:
            continue
        eq = r.get("equal_to_ref")
        lines.append(f"  {name:13s} {'PASS' if r.get('ok') else 'FAIL'}  tp={r['tp']} "
                     f"flags={' '.join(r['flags']) or '-'}  started {r['started_at']}  "
                     f"start {r.get('start_s', '-')}s  equal_to_ref={'-' if eq is None else eq}")
        for pat, line in (r.get("log_lines") or {}).items():
            if pat in r.get("expect", ()):
                label = "found" if line else "MISSING"
            else:
                label = "PRESENT (unwanted)" if line else "absent (ok)"
            lines.append(f"      {label}: {pat!r}" + (f" -> {line}" if line else ""))
        if r.get("cause"):
            lines.append(f"      cause: {r['cause'][:1500]}\n--- server log tail ---\n{r.get('log_tail')}")
    for s in report.get("skipped", []):
        lines.append(f"  SKIPPED {s}")
    return "\n".join(lines)
