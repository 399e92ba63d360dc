"""bench.comm (the 2-GPU all-reduce proof) on CPU: the log-line checks on the messages the patched
sglang 0.5.17 and 0.5.23 really log, the output comparison, the Qwen3 model generator, the deadline handling and
the command line. Nothing pretends to be an sglang server.
"""
from __future__ import annotations

import ast
import json
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import comm
from bench.__main__ import build_parser
from smoke import models
from smoke.checks import check_outputs
from smoke.client import Result
from smoke.deadline import Deadline
from smoke.server import SmokeError

LOG_HEAD = """\
$ python3 -m sglang.launch_server --model-path /tmp/smoke-state/models/qwen3/target --host 127.0.0.1 --port 30000 --tp-size 2
[2026-11-30 09:10:02] server_args=ServerArgs(model_path='/tmp/smoke-state/models/qwen3/target', tp_size=2, attention_backend='triton', ...)
[2026-11-30 09:10:09 TP0] Load weight begin. avail mem=138.72 GB
[2026-11-30 09:10:09 TP1] Load weight begin. avail mem=138.72 GB
[2026-11-30 09:10:09 TP0] Load weight end. elapsed=0.05 s, type=Qwen3ForCausalLM, dtype=torch.bfloat16, avail mem=138.70 GB, mem usage=0.01 GB.
[2026-11-30 09:10:10 TP0] KV Cache is allocated. #tokens: 1966080, K size: 3.75 GB, V size: 3.75 GB
[2026-11-30 09:10:14] INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)
[2026-11-30 09:10:15 TP0] Prefill batch, #new-seq: 8, #new-token: 190, #cached-token: 0, token usage: 0.00, #running-req: 0, #queue-req: 0,
"""


# ----------------------------------------------------------------------------- the real messages
def _log_calls(path: Path) -> list[tuple[str, int]]:
    """(format string, number of args) of every logger.info/warning call in a source file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("info", "warning") and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.args[0].value, len(node.args) - 1))
    return out


def _message(tree: Path, rel: str, start: str, args: tuple) -> str:
    fmts = [(f, n) for f, n in _log_calls(tree / rel) if f.startswith(start)]
    assert len(fmts) == 1, (rel, start, fmts)
    fmt, n = fmts[0]
    assert n == len(args), (fmt, n)
    return fmt % args


@pytest.fixture(scope="module", params=["sglang-0.5.17", "sglang-0.5.23"])
def real_lines(sglang_tree, request) -> dict[str, str]:
    """The patched tree's own log messages, as sglang's TP workers print them."""
    tree = sglang_tree(request.param, True)
    sym = "sglang/srt/distributed/device_communicators/torch_symm_mem.py"
    return {
        "two_shot": "[2026-11-30 09:10:11 TP0] " + _message(
            tree, sym, "torch symm mem: multicast unavailable", (9, 2, 64)),
        "first_call": "[2026-11-30 09:10:15 TP0] " + _message(
            tree, sym, "torch symm mem: first all-reduce", ("two_shot_all_reduce_", 1024, 2)),
        "fused": "[2026-11-30 09:10:15 TP1] " + _message(
            tree, "sglang/srt/layers/flashinfer_comm_fusion.py", "FlashInfer allreduce fusion: fused",
            (2, 190, 512, "9.0")),
        # before logging is configured: Python's last-resort handler prints the bare message
        "tp1_warning": _message(
            tree, "sglang/srt/arg_groups/overrides.py", "FlashInfer allreduce fusion was requested",
            ("trtllm", "tensor parallelism is 1 (nothing to all-reduce)")),
    }


def _run(name: str) -> comm.CommRun:
    return next(r for r in comm.RUNS if r.name == name)


def test_expected_lines_are_found_in_the_real_messages(real_lines):
    symm = LOG_HEAD + real_lines["two_shot"] + "\n" + real_lines["first_call"] + "\n"
    found = comm.check_log_lines(symm, _run("tp2_symm_mem"))
    assert found[comm.SYMM_TWO_SHOT].startswith("[2026-11-30 09:10:11 TP0] torch symm mem: multicast")
    assert "two_shot_all_reduce_ (numel 1024" in found[comm.SYMM_FIRST_CALL]
    comm.check_log_lines(LOG_HEAD + real_lines["fused"] + "\n", _run("tp2_fusion"))
    comm.check_log_lines(real_lines["tp1_warning"] + "\n" + LOG_HEAD, _run("tp1_fusion"))
    comm.check_log_lines(LOG_HEAD, _run("tp2_ref"))
    comm.check_log_lines(LOG_HEAD, _run("tp1_symm_mem"))


def test_missing_or_unwanted_lines_fail_with_the_cause(real_lines):
    with pytest.raises(SmokeError) as e:  # symm mem asked for, but only the first line came
        comm.check_log_lines(LOG_HEAD + real_lines["two_shot"] + "\n", _run("tp2_symm_mem"))
    assert "missing" in e.value.cause and "first all-reduce via two_shot_all_reduce_" in e.value.cause
    with pytest.raises(SmokeError) as e:  # multimem instead of two-shot is not the proof either
        comm.check_log_lines(LOG_HEAD + real_lines["two_shot"] + "\n"
                             + real_lines["first_call"].replace("two_shot_all_reduce_", "multimem_all_reduce_"),
                             _run("tp2_symm_mem"))
    assert "two_shot_all_reduce_" in e.value.cause
    with pytest.raises(SmokeError) as e:
        comm.check_log_lines(LOG_HEAD, _run("tp2_fusion"))
    assert "fused allreduce+residual+RMSNorm kernel launched" in e.value.cause
    with pytest.raises(SmokeError) as e:  # the reference must not use either path
        comm.check_log_lines(LOG_HEAD + real_lines["fused"], _run("tp2_ref"))
    assert "unexpected" in e.value.cause and "TP1] FlashInfer allreduce fusion: fused" in e.value.cause
    with pytest.raises(SmokeError):  # TP=1: the fused kernel must not run, the warning must be there
        comm.check_log_lines(LOG_HEAD + real_lines["fused"], _run("tp1_fusion"))
    found = comm.find_lines(LOG_HEAD, ("x",), (comm.FUSION_LAUNCHED,))
    assert found == {"x": None, comm.FUSION_LAUNCHED: None}


def test_runs_order_flags_and_environment():
    assert comm.RUN_NAMES == ("tp2_ref", "tp2_symm_mem", "tp2_fusion", "tp1_ref", "tp1_symm_mem",
                              "tp1_fusion")
    assert _run("tp2_symm_mem").flags == ("--enable-torch-symm-mem", "--disable-custom-all-reduce")
    assert _run("tp2_fusion").flags == ("--flashinfer-allreduce-fusion-backend", "trtllm")
    assert [r.tp for r in comm.RUNS] == [2, 2, 2, 1, 1, 1]
    assert comm.NO_MULTICAST_ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                     "NVSHMEM_DISABLE_NVLS": "1"}


# ----------------------------------------------------------------------------- model (real, CPU)
@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen3")
    models.build(d, size="tp2", arch="qwen3", corpus_bytes=200_000, gen_len=24)
    return d


def test_qwen3_model_loads_with_transformers_and_reproduces_the_continuation(qwen3_model):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

    d = qwen3_model
    exp = json.loads((d / "expected.json").read_text())
    assert not (d / "draft").exists() and exp["arch"] == "qwen3"
    cfg = json.loads((d / "target" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["num_attention_heads"] % 2 == 0 and cfg["num_key_value_heads"] % 2 == 0
    assert cfg["hidden_size"] in (256, 512) and cfg["num_hidden_layers"] == 4
    with safe_open(str(d / "target" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.q_norm.weight" in keys and "model.layers.3.self_attn.k_norm.weight" in keys
    tok = AutoTokenizer.from_pretrained(d / "target")
    ids = tok(exp["prompt"], add_special_tokens=False)["input_ids"]
    assert ids == exp["prompt_ids"]
    model = AutoModelForCausalLM.from_pretrained(d / "target", dtype=torch.bfloat16).eval()
    assert isinstance(model, Qwen3ForCausalLM)
    with torch.no_grad():  # bf16 here vs float32 at generation: the margins make greedy identical
        out = model.generate(torch.tensor([ids]), max_new_tokens=len(exp["greedy_ids"]), do_sample=False)
    assert out[0, len(ids):].tolist() == exp["greedy_ids"]
    assert exp["min_top1_top2_margin"] > 5


def test_output_comparison_and_hf_check(qwen3_model):
    exp = json.loads((qwen3_model / "expected.json").read_text())
    prompts = comm.make_prompts(exp)
    assert prompts[0].key == "hf" and prompts[0].input_ids == tuple(exp["prompt_ids"])
    assert len({p.key for p in prompts}) == len(prompts) and max(len(p.input_ids) for p in prompts) >= 512
    assert comm.make_prompts(exp) == prompts  # same prompts in every run and every call
    ref = {"hf": list(exp["greedy_ids"]), "c00": [5, 6, 7, 8]}
    comm.check_hf(exp, ref, "tp2_ref")
    check_outputs(ref, [Result("hf", list(exp["greedy_ids"])), Result("c00", [5, 6, 7, 8])], "x")
    with pytest.raises(SmokeError) as e:
        check_outputs(ref, [Result("c00", [5, 6, 9, 8])], "tp2_fusion vs tp2_ref")
    assert "first difference at token 2" in e.value.cause and "tp2_fusion vs tp2_ref" in e.value.cause
    with pytest.raises(SmokeError) as e:
        comm.check_hf(exp, {"hf": exp["greedy_ids"][:-1] + [0]}, "tp1_ref")
    assert "tp1_ref" in e.value.cause


# ----------------------------------------------------------------------------- driver pieces
def test_deadline_skips_every_run_and_reports_progress(qwen3_model, tmp_path):
    calls = []
    opts = comm.CommOptions(model=qwen3_model, out=tmp_path, deadline=Deadline(time.time() + 60))
    state: dict = {"runs": {"tp2_ref": {"name": "tp2_ref", "tp": 2, "flags": [], "ok": True,
                                        "started_at": "2026-11-30 09:10:00", "start_s": 40.0,
                                        "outputs": {}, "log_lines": {comm.FUSION_LAUNCHED: None}}}}
    rep = comm.run_comm(opts, state, calls.append)
    assert [s.split()[0] for s in rep["skipped"]] == list(comm.RUN_NAMES[1:])  # tp2_ref: done earlier
    assert rep["failures"] == [] and calls and calls[-1] is rep
    text = comm.summarize(rep)
    assert "tp2_ref       PASS" in text and "SKIPPED tp2_symm_mem (deadline)" in text
    state["runs"]["tp2_fusion"] = {"name": "tp2_fusion", "tp": 2, "flags": list(comm.FUSION_FLAGS),
                                   "ok": False, "started_at": "x", "cause": "tp2_fusion: log line(s) missing",
                                   "log_tail": "tail", "log_lines": {comm.FUSION_LAUNCHED: None},
                                   "expect": [comm.FUSION_LAUNCHED], "absent": []}
    rep = comm.run_comm(opts, state)
    text = comm.summarize(rep)
    assert "absent (ok): 'FlashInfer" in text and "MISSING: 'FlashInfer" in text
    assert rep["failures"] == [{"variant": "comm tp2_fusion", "cause": "tp2_fusion: log line(s) missing",
                                "log_tail": "tail"}]
    assert "tp2_fusion" not in " ".join(rep["skipped"])


def test_command_line(tmp_path):
    a = build_parser().parse_args(["comm", "--state", str(tmp_path / "s"), "--out", str(tmp_path / "o"),
                                   "--deadline", "500"])
    assert a.phases == "install,patch,models,comm" and a.deadline == 500 and a.bundle == Path(".gpu")
    assert a.comm_runs.split(",") == list(comm.RUN_NAMES)
    a = build_parser().parse_args(["e2e", "--phases", "install,patch,models,comm", "--comm-runs", "tp2_ref"])
    assert a.comm_runs == "tp2_ref"
    a = build_parser().parse_args(["comm", "--comm-runs", "tp2_ref,nope", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="nope"):
        a.main(a)


def test_reference_is_tp2_ref_or_on_one_gpu_tp1_ref():
    by_name = {r.name: r for r in comm.RUNS}
    outs = {"a": [1, 2]}
    one_gpu = {"tp1_ref": {"ok": True, "outputs": outs}}
    assert comm.reference_for(by_name["tp1_fusion"], one_gpu) == ("tp1_ref", outs)
    assert comm.reference_for(by_name["tp1_ref"], one_gpu) == ("tp2_ref", None)  # never itself
    both = {"tp2_ref": {"ok": True, "outputs": {"a": [3]}}, **one_gpu}
    assert comm.reference_for(by_name["tp1_fusion"], both) == ("tp2_ref", {"a": [3]})
    failed = {"tp1_ref": {"ok": False, "outputs": outs}}
    assert comm.reference_for(by_name["tp1_fusion"], failed) == ("tp2_ref", None)
