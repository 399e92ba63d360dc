"""CPU tests of the dynamic-speculation-disable patch, run against the real (patched) 0.5.17 wheel.

Each check runs in its own process inside the unpacked tree and prints one JSON line; the
assertions happen here. The processes are forked from one warm interpreter per tree, which has
imported torch and the sglang modules once (tests/forkserver.py): a check's monkeypatches and env
die with its process. The unpatched tree is used to prove the checks can fail.
"""
from __future__ import annotations

import textwrap

import pytest

from tests.forkserver import forked_probes, warm_imports
from tests.plugin.eagle3_draft import EAGLE3_LEAVES
from tests.probe import probe_result

FLAVOR = "sglang-0.5.17"
ENV = "SGLANG_SPEC_DISABLE_BATCH_THRESHOLD"

# The CPU test venv lacks a few server-only packages that eagle_worker_v2 / scheduler import at
# module level (uvicorn, fastapi). Stub them only when missing; nothing here calls into them.
PRELUDE = textwrap.dedent(
    """
    import importlib.util, json, sys, types
    for _name in ("uvicorn", "fastapi", "fastapi.responses"):
        try:
            _found = importlib.util.find_spec(_name) is not None
        except (ModuleNotFoundError, ValueError):  # ValueError: stubbed already (warm-up)
            _found = False
        if not _found:
            class _Stub(types.ModuleType):
                def __getattr__(self, k):
                    if k.startswith("__"):
                        raise AttributeError(k)
                    return type(k, (), {})
            sys.modules[_name] = _Stub(_name)
    def emit(obj):
        print("RESULT " + json.dumps(obj))
    """
)

# A ServerArgs skeleton without __post_init__ (which would load a model config): every dataclass
# field at its argparse value, then the patch's start-time check.
SERVER_ARGS_HELPERS = textwrap.dedent(
    """
    import argparse, dataclasses
    from sglang.srt.server_args import ServerArgs

    def parse(argv):
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        return parser, parser.parse_args(["--model-path", "m", *argv])

    def checked(argv, **overrides):
        _, ns = parse(argv)
        sa = object.__new__(ServerArgs)
        for f in dataclasses.fields(ServerArgs):
            setattr(sa, f.name, getattr(ns, f.name, None))
        sa._resolved_overrides = []
        if sa.speculative_algorithm is not None and sa.speculative_eagle_topk is None:
            sa.speculative_eagle_topk = 1   # what _handle_eagle_family resolves for EAGLE3
        for k, v in overrides.items():
            setattr(sa, k, v)
        sa._check_speculative_disable()
        return sa.speculative_disable_batch_threshold, sa.speculative_disable_hysteresis
    """
)


# What the warm interpreter imports before it forks the first check (a module that fails to import
# here fails in the check that needs it, with its traceback).
WARM_MODULES = (
    "torch", "sglang.srt.server_args", "sglang.srt.speculative.spec_disable",
    "sglang.srt.speculative.spec_info", "sglang.srt.speculative.eagle_worker_v2",
    "sglang.srt.managers.scheduler", "sglang.srt.managers.overlap_utils",
    "sglang.srt.managers.schedule_batch", "sglang.srt.managers.utils",
    "sglang.srt.managers.scheduler_components.batch_result_processor",
    "sglang.srt.managers.scheduler_components.metrics_reporter",
    "sglang.srt.mem_cache.memory_pool", "sglang.srt.model_executor.forward_batch_info",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
    "sglang.srt.layers.logits_processor", "sglang.srt.observability.metrics_collector",
    "sglang.srt.disaggregation.utils", "sglang.srt.models.llama_eagle3",
)
WARMUP = PRELUDE + warm_imports(WARM_MODULES)


@pytest.fixture(scope="module")
def run_in_tree():
    """This module's checks: forked from one warm interpreter per tree (see the docstring)."""
    with forked_probes(WARMUP) as run:
        yield run


def _run(run_in_tree, tree, body: str, env: dict | None = None, helpers: str = ""):
    return probe_result(run_in_tree(tree, PRELUDE + helpers + textwrap.dedent(body), env=env, timeout=900))


# --------------------------------------------------------------------------- flags and env


def test_flags_parse_as_ints_with_help(run_in_tree, patched):
    out = _run(run_in_tree, patched, helpers=SERVER_ARGS_HELPERS, body="""
        parser, ns = parse(["--speculative-algorithm", "EAGLE3",
                            "--speculative-disable-batch-threshold", "32",
                            "--speculative-disable-hysteresis", "3"])
        _, default = parse([])
        emit({"n": ns.speculative_disable_batch_threshold, "h": ns.speculative_disable_hysteresis,
              "default": [default.speculative_disable_batch_threshold,
                          default.speculative_disable_hysteresis],
              "help": parser.format_help()})
    """)
    assert out["n"] == 32 and out["h"] == 3
    assert out["default"] == [None, None]
    assert "--speculative-disable-batch-threshold" in out["help"]
    assert "--speculative-disable-hysteresis" in out["help"]
    assert ENV in out["help"].replace("\n", "").replace(" ", "")


@pytest.mark.parametrize(
    "argv, env, expected",
    [
        ([], {}, [0, 0]),                                                   # off by default
        ([], {ENV: "64"}, [64, 8]),                                         # env used, default H = N // 8
        (["--speculative-disable-batch-threshold", "16"], {ENV: "64"}, [16, 2]),  # flag wins
        (["--speculative-disable-batch-threshold", "0"], {ENV: "64"}, [0, 0]),    # explicit 0 wins too
        (["--speculative-disable-batch-threshold", "8",
          "--speculative-disable-hysteresis", "0"], {}, [8, 0]),
        (["--speculative-disable-batch-threshold", "1"], {}, [1, 0]),      # H default stays < N
    ],
)
def test_threshold_resolution(run_in_tree, patched, argv, env, expected):
    out = _run(run_in_tree, patched, helpers=SERVER_ARGS_HELPERS, body=f"""
        import os
        os.environ.pop({ENV!r}, None)
        os.environ.update({env!r})
        emit(list(checked(["--speculative-algorithm", "EAGLE3", *{argv!r}])))
    """)
    assert out == expected


@pytest.mark.parametrize(
    "argv, env, overrides, must_contain",
    [
        (["--speculative-algorithm", "EAGLE3", "--speculative-disable-batch-threshold", "-1"], {}, {},
         ["--speculative-disable-batch-threshold", ">= 0"]),
        (["--speculative-algorithm", "EAGLE3"], {ENV: "lots"}, {},
         [ENV, "--speculative-disable-batch-threshold", "integer"]),
        (["--speculative-algorithm", "EAGLE3"], {ENV: "-5"}, {},
         [ENV, ">= 0"]),
        (["--speculative-disable-batch-threshold", "8"], {}, {},
         ["--speculative-disable-batch-threshold", "--speculative-algorithm"]),
        (["--speculative-algorithm", "EAGLE3", "--speculative-disable-batch-threshold", "8",
          "--speculative-disable-hysteresis", "8"], {}, {},
         ["--speculative-disable-hysteresis", "smaller"]),
        (["--speculative-algorithm", "EAGLE3", "--speculative-disable-batch-threshold", "8",
          "--speculative-disable-hysteresis", "-1"], {}, {},
         ["--speculative-disable-hysteresis", ">= 0"]),
        (["--speculative-algorithm", "EAGLE3", "--speculative-disable-batch-threshold", "8"], {},
         {"enable_dp_attention": True}, ["--speculative-disable-batch-threshold", "--enable-dp-attention"]),
        (["--speculative-algorithm", "EAGLE3", "--speculative-disable-batch-threshold", "8"], {},
         {"speculative_adaptive": True}, ["--speculative-disable-batch-threshold", "--speculative-adaptive"]),
        (["--speculative-algorithm", "EAGLE3", "--speculative-disable-batch-threshold", "8"], {},
         {"speculative_eagle_topk": 4}, ["--speculative-disable-batch-threshold", "--speculative-eagle-topk"]),
    ],
    ids=["negative-flag", "env-not-int", "env-negative", "no-spec-algorithm", "hysteresis-ge-threshold",
         "negative-hysteresis", "dp-attention", "adaptive", "topk"],
)
def test_bad_input_fails_naming_the_flag(run_in_tree, patched, argv, env, overrides, must_contain):
    out = _run(run_in_tree, patched, helpers=SERVER_ARGS_HELPERS, body=f"""
        import os
        os.environ.pop({ENV!r}, None)
        os.environ.update({env!r})
        try:
            checked({argv!r}, **{overrides!r})
            emit({{"error": None}})
        except ValueError as e:
            emit({{"error": str(e)}})
    """)
    assert out["error"] is not None, "expected a ValueError at start"
    for needle in must_contain:
        assert needle in out["error"], (needle, out["error"])


# --------------------------------------------------------------------------- controller


def test_controller_hysteresis_and_counters(run_in_tree, patched):
    out = _run(run_in_tree, patched, """
        from sglang.srt.speculative.spec_disable import SpecDisableController
        logs, now = [], [0.0]
        c = SpecDisableController(32, 4, log_fn=logs.append, clock=lambda: now[0], log_interval_s=5.0)
        trace = {}
        # ramp up 1..40 then down 40..1
        ramp = list(range(1, 41)) + list(range(40, 0, -1))
        trace["ramp"] = [c.step(b) for b in ramp]
        snap_after_ramp = c.snapshot()
        # hovering around N (31..33) once plain: must stay plain
        trace["hover"] = [c.step(b) for b in [33, 32, 31, 33, 30, 29, 33, 31, 28]]
        snap_hover = c.snapshot()
        # a non-eligible step runs speculative without changing the mode
        c.step(40)
        trace["ineligible"] = c.step(40, eligible=False)
        trace["mode_after_ineligible"] = c.mode
        # many flips inside the log interval -> only the first is logged
        n_logs_before = len(logs)
        for b in [40, 1, 40, 1, 40]:
            c.step(b)
        burst_logs = len(logs) - n_logs_before
        now[0] = 100.0
        c.step(1)
        emit({"trace": trace, "snap_after_ramp": snap_after_ramp, "snap_hover": snap_hover,
              "burst_logs": burst_logs, "last_log": logs[-1], "first_log": logs[0],
              "deltas": c.take_metric_deltas(), "deltas2": c.take_metric_deltas(),
              "final": c.snapshot(), "next_mode_pure": [c.next_mode(33), c.mode]})
    """)
    ramp = out["trace"]["ramp"]
    up, down = ramp[:40], ramp[40:]
    assert up == [b > 32 for b in range(1, 41)]                        # plain strictly above N
    assert down == [b > 28 for b in range(40, 0, -1)]                  # back only at <= N - H
    assert out["snap_after_ramp"] == {"threshold": 32, "hysteresis": 4, "mode": "speculative",
                                      "speculative_steps": 32 + 28, "plain_steps": 8 + 12,
                                      "mode_changes": 2}
    # hover 33 -> plain; 32,31,33,30,29,33,31 stay plain; 28 -> speculative
    assert out["trace"]["hover"] == [True] * 8 + [False]
    assert out["snap_hover"]["mode_changes"] == 4
    assert out["trace"]["ineligible"] is False and out["trace"]["mode_after_ineligible"] == "plain"
    assert out["first_log"].startswith("Speculation mode -> plain")
    assert out["burst_logs"] <= 1
    assert "Speculation mode -> speculative" in out["last_log"] and "not logged" in out["last_log"]
    mode, d_spec, d_plain = out["deltas"]
    assert mode == 0 and d_spec == out["final"]["speculative_steps"] and d_plain == out["final"]["plain_steps"]
    assert out["deltas2"] == [0, 0, 0]
    assert set(out["final"]) == {"threshold", "hysteresis", "mode", "speculative_steps",
                                 "plain_steps", "mode_changes"}
    assert out["next_mode_pure"] == ["plain", "speculative"]


def test_spec_disable_module_has_no_torch_import(run_in_tree, patched):
    """The controller module loads and works with torch made unimportable (sys.modules[name] = None
    makes every import of it raise), loaded from its file alone, outside the sglang package."""
    out = _run(run_in_tree, patched, """
        import importlib.util
        for name in ["torch", *[n for n in sys.modules if n.startswith("torch.")]]:
            sys.modules[name] = None
        spec = importlib.util.spec_from_file_location(
            "spec_disable_alone", "sglang/srt/speculative/spec_disable.py")
        m = sys.modules["spec_disable_alone"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        try:
            import torch  # noqa: F401
            blocked = False
        except ImportError:
            blocked = True
        emit({"blocked": blocked, "start": m.start_log_line(64)})
    """)
    assert out["blocked"] is True
    assert out["start"] == "Dynamic speculation disable enabled: threshold=64"


# --------------------------------------------------------------------------- worker (CPU tensors)


def test_plain_step_result_layout(run_in_tree, patched):
    out = _run(run_in_tree, patched, """
        import torch
        from sglang.srt.speculative import eagle_worker_v2 as ew
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult
        from sglang.srt.managers.overlap_utils import RelayPayload

        bs, hidden = 3, 12
        logits = LogitsProcessorOutput(next_token_logits=torch.randn(bs, 50),
                                       hidden_states=torch.randn(bs, hidden))
        logits.next_token_logprobs = torch.tensor([-0.1, -0.2, -0.3])
        target = GenerationBatchResult(logits_output=logits, can_run_cuda_graph=True)
        target.next_token_ids = torch.tensor([7, 8, 9])
        seq_lens = torch.tensor([10, 20, 30])
        res = ew.build_plain_step_result(target, seq_lens, keep_alive="fb")
        # what _resolve_spec_v2_tokens does with it
        stride, ids, acc = res.speculative_num_draft_tokens, res.next_token_ids.tolist(), res.accept_lens.tolist()
        per_req = [ids[i * stride: i * stride + acc[i]] for i in range(bs)]
        # what the FutureMap relay reads after the draft extend filled the extras
        nd = res.next_draft_input
        nd.topk_p, nd.topk_index, nd.hidden_states = torch.ones(bs, 1), torch.zeros(bs, 1, dtype=torch.long), torch.zeros(bs, hidden)
        payload = RelayPayload.from_draft_input(nd)
        emit({"stride": stride, "per_req": per_req, "accept_dtype": str(res.accept_lens.dtype),
              "new_seq_lens": res.new_seq_lens.tolist(), "bonus": nd.bonus_tokens.tolist(),
              "logprobs": res.logits_output.next_token_logprobs.tolist(),
              "hidden_rows": res.logits_output.hidden_states.shape[0],
              "plain": res.spec_plain_step, "keep": res.extra_keep_alive_refs,
              "cg": res.can_run_cuda_graph,
              "payload": [payload.bonus_tokens.tolist(), list(payload.topk_p.shape),
                          list(payload.hidden_states.shape)],
              "default_flag": GenerationBatchResult(logits_output=None, can_run_cuda_graph=False).spec_plain_step})
    """)
    assert out["stride"] == 1
    assert out["per_req"] == [[7], [8], [9]]
    assert out["accept_dtype"] == "torch.int32"
    assert out["new_seq_lens"] == [11, 21, 31]
    assert out["bonus"] == [7, 8, 9]
    assert [len(row) for row in out["logprobs"]] == [1, 1, 1]           # spec layout [bs, accept]
    assert [row[0] for row in out["logprobs"]] == pytest.approx([-0.1, -0.2, -0.3])
    assert out["hidden_rows"] == 3
    assert out["plain"] is True and out["default_flag"] is False
    assert out["keep"] == ["fb"] and out["cg"] is True
    assert out["payload"] == [[7, 8, 9], [3, 1], [3, 12]]


def test_plain_step_tokens_resolve_as_the_spec_v2_path_does(run_in_tree, patched):
    """The scheduler's fast path for a plain step's result (_resolve_plain_step_tokens) leaves every
    request and the result as _resolve_spec_v2_tokens leaves them (tokens, kv_committed_len,
    spec_verify_ct, the correct-drafts histogram, the counters), finished and retracted requests
    included; only the adaptive controller is not fed (no verify ran), and a batch with a grammar
    keeps the general path."""
    out = _run(run_in_tree, patched, """
        import copy
        import torch
        from sglang.srt.speculative import eagle_worker_v2 as ew
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        class R:
            update_spec_correct_drafts_histogram = Req.update_spec_correct_drafts_histogram
            def __init__(self, committed, done=False, retracted=False, hist=()):
                self.kv_committed_len, self.done, self.is_retracted = committed, done, retracted
                self.spec_verify_ct, self.spec_num_correct_drafts = 5, 9
                self.spec_correct_drafts_histogram = list(hist)
                self.grammar = None
            def finished(self):
                return self.done
            def state(self):
                return [self.kv_committed_len, self.spec_verify_ct, self.spec_num_correct_drafts,
                        self.spec_correct_drafts_histogram]

        def resolve(plain_fast_path, has_grammar=False):
            reqs = [R(10), R(20, hist=[3, 1, 4]), R(30, done=True), R(40, retracted=True), R(50, hist=[0])]
            bs = len(reqs)
            logits = LogitsProcessorOutput(next_token_logits=torch.randn(bs, 50), hidden_states=torch.randn(bs, 4))
            target = GenerationBatchResult(logits_output=logits, can_run_cuda_graph=True)
            target.next_token_ids = torch.tensor([7, 8, 9, 10, 11])
            res = ew.build_plain_step_result(target, torch.tensor([10, 20, 30, 40, 50]))
            res.spec_plain_step = plain_fast_path
            fed = []
            proc = object.__new__(SchedulerBatchResultProcessor)  # a frozen dataclass: set its one field
            object.__setattr__(proc, "model_worker", type("W", (), {
                "on_verify_complete_cpu": lambda self, per_req, batch_size: fed.append(per_req)})())
            batch = type("B", (), {"reqs": reqs, "has_grammar": has_grammar,
                                   "forward_mode": ForwardMode.DECODE})()
            tokens = proc._resolve_spec_v2_tokens(res, batch)
            return {"tokens": tokens, "reqs": [r.state() for r in reqs], "fed": fed,
                    "counters": [res.num_correct_drafts, res.num_correct_drafts_per_req_cpu,
                                 res.num_block_accept_tokens, res.num_cap_tokens]}

        emit({"fast": resolve(True), "general": resolve(False), "grammar": resolve(True, has_grammar=True)})
    """)
    fast, general = out["fast"], out["general"]
    assert fast["tokens"] == general["tokens"] == [[7], [8], [9], [10], [11]]
    assert fast["reqs"] == general["reqs"]
    assert fast["reqs"][0] == [11, 6, 9, [1]] and fast["reqs"][1] == [21, 6, 9, [4, 1, 4]]
    assert fast["reqs"][2] == [30, 5, 9, []] and fast["reqs"][3] == [40, 5, 9, []]  # finished, retracted
    assert fast["counters"] == general["counters"] == [0, [0] * 5, 0, 0]
    assert general["fed"] == [[0] * 5] and fast["fed"] == []
    assert out["grammar"]["fed"] == [[0] * 5]  # a grammar batch takes the general path


def test_spec_decode_kv_need_at_page_size_one_matches_the_paged_estimate(run_in_tree, patched):
    """spec-decode-alloc-host-loop.patch: at page size 1 the next spec decode's KV need is the sum of
    the per-request shortfalls, without ceil_align; the paged estimate is unchanged."""
    out = _run(run_in_tree, patched, """
        import random
        from types import SimpleNamespace as NS
        from sglang.srt.managers import schedule_batch as sb
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        def estimate(reqs, page, reserve):
            sb.get_alloc_reserve_per_decode = lambda: reserve
            return ScheduleBatch._new_tokens_required_next_decode_spec_v2(None, reqs, page)

        def reference(reqs, page, reserve):  # upstream 0.5.17's loop
            total = 0
            for r in reqs:
                x = max(0, r.kv_committed_len + reserve - r.kv.kv_allocated_len)
                cur = r.kv.kv_allocated_len
                total += sb.ceil_align(cur + x, page) - sb.ceil_align(cur, page)
            return total

        rng = random.Random(7)
        cases = []
        for _ in range(200):
            reserve = rng.choice([2, 4, 8])
            reqs = [NS(kv_committed_len=c, kv=NS(kv_allocated_len=c + rng.randint(-2, 2 * reserve)))
                    for c in (rng.randint(1, 500) for _ in range(rng.randint(0, 40)))]
            for page in (1, 16):
                cases.append([estimate(reqs, page, reserve), reference(reqs, page, reserve)])
        emit({"cases": cases})
    """)
    assert all(got == want for got, want in out["cases"])
    assert any(got > 0 for got, _ in out["cases"]) and any(got == 0 for got, _ in out["cases"])


def test_plain_graph_runner_captures_decode_not_verify(run_in_tree, patched):
    out = _run(run_in_tree, patched, """
        from sglang.srt.speculative import eagle_worker_v2 as ew
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
        seen = {}
        def fake_capture(self):
            seen["mode"] = self.capture_forward_mode.name
            seen["hidden"] = self.capture_hidden_mode.name
            seen["ragged"] = self.ragged_verify_mode
        ew.DecodeCudaGraphRunner.capture = fake_capture
        r = object.__new__(ew._PlainDecodeCudaGraphRunner)
        r.capture_forward_mode = ForwardMode.TARGET_VERIFY   # what the base __init__ sets for a spec runner
        r.capture_hidden_mode = CaptureHiddenMode.NULL
        r.ragged_verify_mode = True
        r.capture()
        emit({**seen, "spec_info": r.get_spec_info(8),
              "subclass": issubclass(ew._PlainDecodeCudaGraphRunner, ew.DecodeCudaGraphRunner)})
    """)
    assert out == {"mode": "DECODE", "hidden": "FULL", "ragged": False, "spec_info": None, "subclass": True}


def test_plain_draft_extend_graph_accepts_one_token_steps(run_in_tree, patched):
    """The upstream draft-extend runner takes its width from server_args (the speculative width,
    4 here), so its graph rejects a 1-token plain step; the plain state's runner is pinned to 1 and
    is the class the plain capture builds (upstream's whitelist picks it from module globals)."""
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES, body="""
        import contextlib
        def runner(cls):
            r = object.__new__(cls)
            r.captured_req_width = 4          # what the base __init__ assigns from server_args
            r.require_mlp_tp_gather = r.disable_padding = r.require_mlp_sync = False
            r.max_bs = 256
            return r
        one_token = NS(spec_info=NS(num_tokens_per_req=1), seq_lens=torch.zeros(200))
        base, plain = runner(ew.EAGLEDraftExtendCudaGraphRunner), runner(ew._PlainDraftExtendCudaGraphRunner)

        # _build_plain_state with fakes: which class is in the module globals while it captures?
        seen = {}
        class Stop(Exception):
            pass
        def capture():
            seen["class_during_capture"] = ew.EAGLEDraftExtendCudaGraphRunner.__name__
        def stop(**kw):
            raise Stop()
        for name in ("speculative_moe_backend_context", "speculative_moe_a2a_backend_context"):
            setattr(ew, name, contextlib.nullcontext)
        w = object.__new__(ew.EAGLEWorkerV2)
        w._draft_worker = NS(draft_tp_context=lambda group: contextlib.nullcontext(),
                             draft_runner=NS(tp_group=None, attn_backend=None),
                             init_attention_backend=lambda: None, _capture_cuda_graphs=capture,
                             draft_extend_attn_backend=None, cuda_graph_runner_for_draft_extend=None)
        w._override_worker_state = lambda *a, **k: contextlib.nullcontext()
        w._target_worker = NS(model_runner=NS(init_new_workspace=False, _get_attention_backend=stop))
        try:
            w._build_plain_state()
        except Stop:
            pass
        emit({"base": base.can_run_graph(one_token), "plain": plain.can_run_graph(one_token),
              "width": plain.captured_req_width, **seen,
              "class_after": ew.EAGLEDraftExtendCudaGraphRunner.__name__,
              "looked_up_by_name": "EAGLEDraftExtendCudaGraphRunner"
              in ew.EagleDraftWorker._capture_cuda_graphs.__code__.co_names})
    """)
    assert out["base"] is False, "upstream runner accepts 1-token steps now: the pinned class may be droppable"
    assert out == {"base": False, "plain": True, "width": 1,
                   "class_during_capture": "_PlainDraftExtendCudaGraphRunner",
                   "class_after": "EAGLEDraftExtendCudaGraphRunner", "looked_up_by_name": True}


WORKER_FAKES = """
import torch
from types import SimpleNamespace as NS
from sglang.srt.speculative import eagle_worker_v2 as ew
from sglang.srt.speculative.spec_disable import SpecDisableController
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

class SpecPathTaken(Exception):
    pass

def make_worker(threshold, hysteresis):
    w = object.__new__(ew.EAGLEWorkerV2)
    w.adaptive_controller = None
    w.speculative_num_steps = 3
    w.spec_disable = SpecDisableController(threshold, hysteresis, log_fn=lambda m: None)
    w._draft_tail_stale = False
    w._decided_plain = None
    w._plain_layout_ok = False
    def _spec_ctx(*a, **k):
        raise SpecPathTaken()
    w._draft_worker = NS(draft_tp_context=_spec_ctx, draft_runner=NS(tp_group=None))
    return w

def make_batch(bs, **kw):
    b = NS(forward_mode=ForwardMode.DECODE, is_extend_in_batch=False,
           seq_lens=torch.arange(10, 10 + bs), spec_info=NS(bonus_tokens=torch.arange(100, 100 + bs)),
           has_grammar=False, sampling_info=NS(penalizer_orchestrator=NS(is_required=False)),
           req_pool_indices=torch.arange(bs), seq_lens_cpu=None,
           spec_algorithm=SpeculativeAlgorithm.EAGLE3)
    b.__dict__.update(kw)
    return b

def target_result(bs, hidden_states):
    # what the target worker returns for a plain step: tokens 5, 6, 7 and its hidden states
    lo = LogitsProcessorOutput(next_token_logits=torch.zeros(bs, 5), hidden_states=hidden_states)
    r = GenerationBatchResult(logits_output=lo, can_run_cuda_graph=True)
    r.next_token_ids = torch.tensor([5, 6, 7])
    return r

def fake_forward_batch_init_new(batch, model_runner, capture_hidden_mode=None,
                                return_hidden_states_before_norm=False):
    return NS(seq_lens=batch.seq_lens, positions=batch.seq_lens - 1, input_ids=batch.input_ids,
              out_cache_loc=batch.out_cache_loc, forward_mode=batch.forward_mode,
              req_pool_indices=batch.req_pool_indices,
              spec_info=batch.spec_info, seq_lens_cpu=None, seq_lens_sum=None, orig_seq_lens=None,
              capture_hidden_mode=capture_hidden_mode)

def give_req_to_token(w):
    req_to_token = torch.arange(4 * 64).reshape(4, 64)
    w.req_to_token_pool = NS(req_to_token=req_to_token)
    return req_to_token

def install_plain_step_fakes(w, events, target_event, target_hidden, draft_event, draft_logits):
    # target: tokens 5, 6, ...; the draft: a K/V-only model and a DECODE forward; both record to events
    mr = NS(attn_backend="spec-target", decode_cuda_graph_runner="spec-graph", war_fastpath_read_done_event=None)
    def target_forward(batch, forward_batch=None):
        bs = forward_batch.seq_lens.shape[0]
        events.append(target_event(mr, forward_batch))
        mr.war_fastpath_read_done_event = "target-read-done"
        lo = LogitsProcessorOutput(next_token_logits=torch.zeros(bs, 5), hidden_states=target_hidden(bs))
        r = GenerationBatchResult(logits_output=lo, can_run_cuda_graph=True)
        r.next_token_ids = torch.arange(5, 5 + bs)
        return r
    w._target_worker = NS(model_runner=mr, forward_batch_generation=target_forward)
    ew.ForwardBatch.init_new = staticmethod(fake_forward_batch_init_new)
    draft_pool = object()
    class KvOnly:
        def write_kv_only(self, tokens, positions, target_hidden, loc, pool):
            events.append(("kv_only", tokens.tolist(), positions.tolist(), target_hidden[:, 0].tolist(),
                           loc.tolist(), pool is draft_pool))
    def draft_forward(fb):
        events.append(draft_event(fb))
        n = fb.input_ids.shape[0]
        return NS(logits_output=LogitsProcessorOutput(next_token_logits=draft_logits(n),
                                                      hidden_states=torch.full((n, 4), 7.0)))
    draft_runner = NS(tp_group=None, attn_backend="spec-dr", decode_cuda_graph_runner=None,
                      token_to_kv_pool=draft_pool, forward=draft_forward, device_timer=None,
                      war_fastpath_read_done_event=None)
    def speculate(batch):
        raise SpecPathTaken()
    w._draft_worker = NS(draft_runner=draft_runner, draft_tp_context=lambda g: ew.empty_context(),
                         draft=speculate)
    w._plain_state = ew._PlainStepState("plain-target", "plain-graph", "plain-de", "plain-dr", "plain-deg",
                                        draft_kv_only_model=KvOnly())
    for name in ("speculative_moe_backend_context", "speculative_moe_a2a_backend_context"):
        setattr(ew, name, ew.empty_context)
    return mr, draft_runner
"""


# A real FutureMap on the CPU (its spec algorithm a stand-in), and a count of device-to-host copies.
FUTURE_MAP_FAKES = """
from sglang.srt.managers.overlap_utils import FutureMap

class Algo:
    def is_some(self):
        return True
    def is_none(self):
        return False
    def is_ngram(self):
        return False

def future_map():
    return FutureMap(torch.device("cpu"), Algo(), NS(req_to_token=torch.zeros(16, 8, dtype=torch.int32)))

def resolve_batch(rows):
    return NS(spec_info=NS(future_indices=torch.tensor(rows)), req_pool_indices_cpu=torch.tensor(rows),
              seq_lens=None, seq_lens_cpu=None, seq_lens_sum=None)

d2h = []
_real_cpu = torch.Tensor.cpu
def _counting_cpu(self, *a, **k):
    d2h.append(1)
    return _real_cpu(self, *a, **k)
torch.Tensor.cpu = _counting_cpu
"""

def test_decision_routes_steps(run_in_tree, patched):
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES, body="""
        res = []
        w = make_worker(4, 1)
        w._forward_plain_decode = lambda batch, on_publish=None: "plain"
        def route(batch):
            try:
                return w.forward_batch_generation(batch)
            except SpecPathTaken:
                return "spec"
        for bs in [2, 4, 5, 4, 3, 6]:
            res.append(route(make_batch(bs)))
        grammar = route(make_batch(8, has_grammar=True))
        penalty = route(make_batch(8, sampling_info=NS(penalizer_orchestrator=NS(is_required=True))))
        idle = route(make_batch(8, forward_mode=ForwardMode.IDLE))
        emit({"res": res, "grammar": grammar, "penalty": penalty, "idle": idle,
              "snap": w.spec_disable.snapshot()})
    """)
    assert out["res"] == ["spec", "spec", "plain", "plain", "spec", "plain"]
    assert out["grammar"] == "spec" and out["penalty"] == "spec" and out["idle"] == "spec"
    assert out["snap"]["mode"] == "plain" and out["snap"]["plain_steps"] == 3


def test_plain_step_on_cpu_with_fakes(run_in_tree, patched):
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES, body="""
        bs, hidden = 3, 6
        w = make_worker(1, 0)
        events = []
        spec_backend, spec_graph = object(), object()
        plain_backend, plain_graph = object(), object()
        mr = NS(attn_backend=spec_backend, decode_cuda_graph_runner=spec_graph)
        def target_forward(batch, forward_batch=None):
            events.append(("target", mr.attn_backend is plain_backend,
                           mr.decode_cuda_graph_runner is plain_graph, forward_batch.seq_lens.tolist(),
                           forward_batch.positions.tolist(), forward_batch.input_ids.tolist(),
                           forward_batch.out_cache_loc.tolist(), forward_batch.forward_mode.name,
                           forward_batch.spec_info is None))
            return target_result(bs, torch.ones(bs, hidden))
        w._target_worker = NS(model_runner=mr, forward_batch_generation=target_forward)
        req_to_token = give_req_to_token(w)
        ew.ForwardBatch.init_new = staticmethod(fake_forward_batch_init_new)
        dw = NS(speculative_num_draft_tokens=4, draft_extend_attn_backend="spec-de", cuda_graph_runner_for_draft_extend="spec-deg",
                draft_runner=NS(tp_group=None, attn_backend="spec-dr"), draft_tp_context=lambda g: ew.empty_context())
        def draft_extend(batch, result):
            events.append(("draft_extend", dw.speculative_num_draft_tokens, dw.draft_extend_attn_backend,
                           dw.draft_runner.attn_backend, dw.cuda_graph_runner_for_draft_extend,
                           result.accept_lens.tolist(), result.next_token_ids.tolist(),
                           batch.out_cache_loc.tolist(), batch.seq_lens.tolist()))
        dw._draft_extend_for_decode = draft_extend
        w._draft_worker = dw
        w._plain_state = ew._PlainStepState(plain_backend, plain_graph, "plain-de", "plain-dr", "plain-deg")
        w._plain_draft_decode_eligible = lambda out: False   # the fallback: upstream's 1-token draft extend
        batch = make_batch(bs, req_pool_indices=torch.tensor([2, 0, 3]))
        published = []
        res = w.forward_batch_generation(batch, on_publish=lambda sl: (published.append(sl.tolist()), events.append(("publish",))))
        emit({"events": events, "published": published,
              "restored": [mr.attn_backend is spec_backend, mr.decode_cuda_graph_runner is spec_graph,
                           dw.speculative_num_draft_tokens, dw.draft_extend_attn_backend,
                           dw.draft_runner.attn_backend, dw.cuda_graph_runner_for_draft_extend],
              "stride": res.speculative_num_draft_tokens, "plain": res.spec_plain_step,
              "expected_loc": [int(req_to_token[2, 10]), int(req_to_token[0, 11]), int(req_to_token[3, 12])]})
    """)
    target, publish, extend = out["events"]
    assert target[0] == "target" and target[1] is True and target[2] is True  # plain backend + DECODE graph
    assert target[3] == [11, 12, 13]            # forward sees post-write length
    assert target[4] == [10, 11, 12]            # bonus token fed at position seq_lens
    assert target[5] == [100, 101, 102]         # input = previous bonus tokens
    assert target[6] == out["expected_loc"]     # KV slot req_to_token[req, seq_len]
    assert target[7] == "DECODE" and target[8] is True
    assert publish == ["publish"] and out["published"] == [[11, 12, 13]]  # published before draft extend
    assert extend[0] == "draft_extend"
    assert extend[1:5] == [1, "plain-de", "plain-dr", "plain-deg"]      # 1-token draft-extend state
    assert extend[5] == [1, 1, 1] and extend[6] == [5, 6, 7]
    assert extend[7] == out["expected_loc"]     # draft KV written at the same slot
    assert extend[8] == [10, 11, 12]            # ScheduleBatch keeps the spec-v2 convention
    assert out["restored"] == [True, True, 4, "spec-de", "spec-dr", "spec-deg"]
    assert out["stride"] == 1 and out["plain"] is True


def test_plain_publish_lets_the_next_resolve_skip_the_wait(run_in_tree, patched):
    """FutureMap: after a plain step's publish with host lengths, resolving a batch of those rows
    takes the host values (no D2H wait); any other publish forgets them; rows outside the plain
    batch fall back to the device copy."""
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES + FUTURE_MAP_FAKES, body="""
        fm, batch = future_map(), resolve_batch
        d2h.clear()
        rows, lens = torch.tensor([3, 5, 7]), torch.tensor([10, 20, 30])
        fm.publish(rows, lens + 1, host_seq_lens=(rows, lens + 1))
        b1 = batch([7, 3]); fm.resolve_seq_lens_cpu(b1)            # subset of the plain rows
        d2h_plain = len(d2h)
        b2 = batch([3, 9]); fm.resolve_seq_lens_cpu(b2)            # row 9 not published by it
        d2h_mixed = len(d2h) - d2h_plain
        fm.publish(rows, torch.tensor([50, 60, 70]))                # an ordinary (speculative) publish
        b3 = batch([3, 7]); fm.resolve_seq_lens_cpu(b3)
        emit({"b1": [b1.seq_lens.tolist(), b1.seq_lens_cpu.tolist(), b1.seq_lens_sum], "d2h_plain": d2h_plain,
              "d2h_mixed": d2h_mixed, "b3": [b3.seq_lens.tolist(), b3.seq_lens_cpu.tolist()],
              "forgotten": not fm._host_valid.any().item()})
    """)
    assert out["b1"] == [[31, 11], [31, 11], 42] and out["d2h_plain"] == 0
    assert out["d2h_mixed"] >= 1
    assert out["b3"] == [[50, 70], [50, 70]] and out["forgotten"] is True


def test_prefill_publish_lets_the_first_decode_after_it_skip_the_wait(run_in_tree, patched):
    """FutureMap: rows a plain step published and rows a prefill then published with their host
    lengths resolve together from the host (the first decode after a prefill used to wait for the
    prefill's forward); a verify's publish invalidates every row; the worker passes the prefill's
    lengths (test_prefill_in_plain_mode_writes_draft_kv_only checks that the worker does)."""
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES + FUTURE_MAP_FAKES, body="""
        fm, batch = future_map(), resolve_batch
        d2h.clear()
        plain_rows, plain_lens = torch.tensor([3, 5]), torch.tensor([11, 21])
        fm.publish(plain_rows, plain_lens, host_seq_lens=(plain_rows, plain_lens))     # a plain decode step
        pre_rows, pre_lens = torch.tensor([9, 2]), torch.tensor([40, 7])
        fm.publish(pre_rows, pre_lens, host_seq_lens=(pre_rows, pre_lens))             # a prefill
        merged = batch([3, 5, 9, 2]); fm.resolve_seq_lens_cpu(merged)
        d2h_merged = len(d2h)
        fm.publish(torch.tensor([3]), torch.tensor([60]))                               # a verify
        after = batch([5, 9]); fm.resolve_seq_lens_cpu(after)
        d2h_after = len(d2h) - d2h_merged

        emit({"merged": [merged.seq_lens.tolist(), merged.seq_lens_cpu.tolist(), merged.seq_lens_sum],
              "d2h_merged": d2h_merged, "after": after.seq_lens_cpu.tolist(), "d2h_after": d2h_after,
              "valid_after_verify": fm._host_valid.any().item(),
              "prefill_kwargs": [r.tolist() for r in ew._host_seq_lens_kwargs(
                  make_batch(2, req_pool_indices_cpu=torch.tensor([4, 6]), seq_lens_cpu=torch.tensor([30, 31])),
                  advance=0)["host_seq_lens"]]})
    """)
    assert out["merged"] == [[11, 21, 40, 7], [11, 21, 40, 7], 79] and out["d2h_merged"] == 0
    assert out["after"] == [21, 40] and out["d2h_after"] >= 1 and out["valid_after_verify"] is False
    assert out["prefill_kwargs"] == [[4, 6], [30, 31]]


def test_plain_step_publishes_host_lengths(run_in_tree, patched):
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES, body="""
        b = make_batch(3, req_pool_indices_cpu=torch.tensor([2, 0, 3]), seq_lens_cpu=torch.tensor([10, 11, 12]))
        rows, lens = ew._host_seq_lens_kwargs(b)["host_seq_lens"]
        emit({"rows": rows.tolist(), "lens": lens.tolist(),
              "without_cpu_mirror": ew._host_seq_lens_kwargs(make_batch(3))})
    """)
    assert out == {"rows": [2, 0, 3], "lens": [11, 12, 13], "without_cpu_mirror": {}}


def test_plain_step_draft_decode_on_cpu_with_fakes(run_in_tree, patched):
    """The draft's step after a plain target step: a DECODE forward of the draft model at the same
    KV slot, position and lengths, fed the target's hidden states; its top-1 and hidden state become
    the next draft input; the draft runner's backend and graph are restored."""
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES, body="""
        bs, hidden = 3, 6
        w = make_worker(1, 0)
        events = []
        mr = NS(attn_backend="spec-target", decode_cuda_graph_runner="spec-graph")
        target_hidden = torch.arange(bs * hidden, dtype=torch.float32).reshape(bs, hidden)
        def target_forward(batch, forward_batch=None):
            events.append(("target",))
            return target_result(bs, target_hidden)
        w._target_worker = NS(model_runner=mr, forward_batch_generation=target_forward)
        req_to_token = give_req_to_token(w)
        ew.ForwardBatch.init_new = staticmethod(fake_forward_batch_init_new)
        draft_logits = torch.tensor([[0., 9, 0, 0], [0, 0, 0, 9], [9, 0, 0, 0]])
        draft_hidden = torch.full((bs, 4), 7.0)
        draft_runner = NS(tp_group=None, attn_backend="spec-dr", decode_cuda_graph_runner="draft-graph")
        def draft_forward(fb):
            events.append(("draft_decode", draft_runner.attn_backend, draft_runner.decode_cuda_graph_runner,
                           fb.forward_mode.name, fb.input_ids.tolist(), fb.positions.tolist(), fb.seq_lens.tolist(),
                           fb.out_cache_loc.tolist(), bool(torch.equal(fb.spec_info.hidden_states, target_hidden)),
                           fb.capture_hidden_mode.name))
            return NS(logits_output=LogitsProcessorOutput(next_token_logits=draft_logits, hidden_states=draft_hidden))
        draft_runner.forward = draft_forward
        def no_extend(batch, result):
            raise AssertionError("upstream draft extend must not run")
        w._draft_worker = NS(draft_runner=draft_runner, draft_tp_context=lambda g: ew.empty_context(),
                             _draft_extend_for_decode=no_extend)
        w._plain_state = ew._PlainStepState("plain-target", "plain-graph", "plain-de", "plain-dr", "plain-deg")
        w._plain_draft_decode_eligible = lambda out: True
        for name in ("speculative_moe_backend_context", "speculative_moe_a2a_backend_context"):
            setattr(ew, name, ew.empty_context)
        batch = make_batch(bs, req_pool_indices=torch.tensor([2, 0, 3]))
        res = w.forward_batch_generation(batch, on_publish=lambda sl, **kw: events.append(("publish",)))
        nd = res.next_draft_input
        emit({"events": events, "topk_index": nd.topk_index.tolist(), "topk_p": nd.topk_p.tolist(),
              "hidden": bool(torch.equal(nd.hidden_states, draft_hidden)), "bonus": nd.bonus_tokens.tolist(),
              "restored": [draft_runner.attn_backend, draft_runner.decode_cuda_graph_runner],
              "expected_loc": [int(req_to_token[2, 10]), int(req_to_token[0, 11]), int(req_to_token[3, 12])]})
    """)
    target, publish, draft = out["events"]
    assert target == ["target"] and publish == ["publish"]
    assert draft[:4] == ["draft_decode", "plain-dr", None, "DECODE"]   # plain-state backend, eager
    assert draft[4] == [5, 6, 7]                # the tokens the target just produced
    assert draft[5] == [10, 11, 12] and draft[6] == [11, 12, 13]        # same position / lengths as the target
    assert draft[7] == out["expected_loc"] and draft[8] is True and draft[9] == "LAST"
    assert out["topk_index"] == [[1], [3], [0]] and out["topk_p"] == [[1.0], [1.0], [1.0]]
    assert out["hidden"] is True and out["bonus"] == [5, 6, 7]
    assert out["restored"] == ["spec-dr", "draft-graph"]


def test_controller_catch_up_step_before_speculation_resumes(run_in_tree, patched):
    """draft_current=False: a step that would speculate runs plain once more (counted as plain);
    the mode itself follows the batch size only."""
    out = _run(run_in_tree, patched, """
        from sglang.srt.speculative.spec_disable import SpecDisableController
        c = SpecDisableController(4, 1, log_fn=lambda m: None)
        steps = [c.step(6, draft_current=False), c.step(3, draft_current=False), c.mode,
                 c.step(3, draft_current=True), c.step(3, eligible=False, draft_current=False)]
        emit({"steps": steps, "snap": c.snapshot()})
    """)
    assert out["steps"] == [True, True, "speculative", False, False]
    assert out["snap"]["plain_steps"] == 2 and out["snap"]["speculative_steps"] == 2
    assert out["snap"]["mode_changes"] == 2


# The eagle3 draft model's code (LlamaModel.forward, its decoder layer, LlamaAttention.forward) run
# for real around small torch leaves (sglang's own layers need a GPU process group to build).
def test_draft_kv_only_write_equals_the_full_forward(run_in_tree, patched):
    """write_kv_only puts into the draft KV cache exactly the K/V that a full forward of the
    one-layer EAGLE-3 draft hands to attention, at the given slots; deeper drafts are refused."""
    out = _run(run_in_tree, patched, helpers=EAGLE3_LEAVES, body="""
        model = make_draft()
        with torch.no_grad():
            k_full, v_full = full_forward_kv(model, TOKENS, POSITIONS, TARGET_HIDDEN)
            pool, other_pos = RecordingPool(), RecordingPool()
            model.write_kv_only(TOKENS, POSITIONS, TARGET_HIDDEN, SLOTS, pool)
            model.write_kv_only(TOKENS, POSITIONS + 1, TARGET_HIDDEN, SLOTS, other_pos)
        (layer, wloc, k, v, ks, vs), = pool.writes
        emit({"k_equal": bool(torch.equal(k, k_full)), "v_equal": bool(torch.equal(v, v_full)),
              "layer": layer is model.layers[0].self_attn.attn, "loc": wloc.tolist(), "scales": [ks, vs],
              "position_matters": not torch.equal(other_pos.writes[0][2], k),
              "supports_one_layer": model.supports_kv_only_write(),
              "supports_two_layers": make_draft(2).supports_kv_only_write()})
    """)
    assert out == {"k_equal": True, "v_equal": True, "layer": True, "loc": [70, 71, 12, 99],
                   "scales": [None, None], "position_matters": True,
                   "supports_one_layer": True, "supports_two_layers": False}


def test_deferred_draft_kv_writes_each_plain_step_at_the_next(run_in_tree, patched):
    """_DeferredDraftKv (the plain DECODE graph's tail, here run eagerly with the real one-layer
    draft): a plain step stores its rows' hidden states, positions and slots per request slot, and
    the next step writes the K/V of the rows whose stored position is just before theirs, with the
    token fed now: exactly what an immediate write_kv_only would have written. Rows without such
    a step before (new, forgotten by a prefill, after a speculative gap) and padded graph rows
    (position 0) write the pool's padding slot 0; padded rows store into the spare row only."""
    out = _run(run_in_tree, patched, helpers=EAGLE3_LEAVES, body="""
        from sglang.srt.speculative import eagle_worker_v2 as ew
        model = make_draft()
        pool = RecordingPool()
        d = ew._DeferredDraftKv(model, pool, 8, 3 * TARGET, torch.float32, "cpu")
        hidden = {}
        def step(reqs, positions, tokens, slots):
            h = torch.randn(len(reqs), 3 * TARGET)
            for r, p, hh in zip(reqs, positions, h):
                hidden[(r, p)] = hh
            pool.writes.clear()
            with torch.no_grad():
                d.step(torch.tensor(tokens), torch.tensor(positions), torch.tensor(reqs),
                       torch.tensor(slots, dtype=torch.int32), h)
            (_, loc, k, v, _, _), = pool.writes
            return loc.tolist(), k, v
        def expected(tokens, positions, hiddens, slots):
            ref = RecordingPool()
            with torch.no_grad():
                model.write_kv_only(torch.tensor(tokens), torch.tensor(positions), torch.stack(hiddens),
                                    torch.tensor(slots), ref)
            return ref.writes[0][2], ref.writes[0][3]
        first = step([2, 0, 3], [10, 20, 30], [5, 6, 7], [100, 200, 300])[0]
        loc, k, v = step([0, 3, 1], [21, 31, 4], [8, 9, 1], [201, 301, 400])   # req 1 is new
        ek, ev = expected([8, 9], [20, 30], [hidden[(0, 20)], hidden[(3, 30)]], [200, 300])
        due = {"loc": loc, "same_kv": bool(torch.allclose(k[:2], ek, atol=1e-6) and torch.allclose(v[:2], ev, atol=1e-6))}
        d.forget(torch.tensor([3]))                                            # req 3's slot: a prefill
        loc2 = step([0, 3, 0, 0], [22, 32, 0, 0], [1, 2, 0, 0], [202, 302, 0, 0])[0]  # 2 padded rows
        kept = [d.positions[0].item(), d.slots[0].item(), d.positions[8].item()]
        gap = step([0], [26], [3], [206])[0]                                   # speculative steps between
        emit({"first": first, "due": due, "after_forget_and_padding": loc2, "kept": kept, "gap": gap,
              "spare_row": d.spare_row})
    """)
    assert out["first"] == [0, 0, 0]                                 # nothing pending yet
    assert out["due"] == {"loc": [200, 300, 0], "same_kv": True}       # req 1 new: padding slot
    assert out["after_forget_and_padding"] == [201, 0, 0, 0]          # req 3 forgotten, padding rows
    assert out["kept"] == [22, 202, 0] and out["spare_row"] == 8      # padding stored into the spare row
    assert out["gap"] == [0]                                           # 22 is not 26 - 1


def test_draft_kv_only_write_only_where_it_holds(run_in_tree, patched):
    """The K/V-only plain step needs a one-layer EAGLE-3 draft, a plain MHA KV pool (not a
    subclass with its own layout), no decode context parallelism and a greedy chain."""
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES + EAGLE3_LEAVES, body="""
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MHATokenToKVPoolFP4
        def chosen(n_layers=1, pool_cls=MHATokenToKVPool, dcp=1, topk=1):
            w = make_worker(4, 0)
            w.topk = topk
            inner = make_draft(n_layers)
            w._draft_worker = NS(seed_dsa_topk_from_draft_extend=False,
                                 draft_runner=NS(model=NS(model=inner), token_to_kv_pool=object.__new__(pool_cls)))
            ew.get_spec = lambda: NS(speculative_use_rejection_sampling=False)
            ew.get_parallel = lambda: NS(attn_dcp_size=dcp)
            return w._draft_kv_only_model() is inner
        emit({"one_layer": chosen(), "two_layers": chosen(2), "fp4_pool": chosen(pool_cls=MHATokenToKVPoolFP4),
              "dcp": chosen(dcp=2), "tree": chosen(topk=4)})
    """)
    assert out == {"one_layer": True, "two_layers": False, "fp4_pool": False, "dcp": False, "tree": False}


def test_plain_steps_write_draft_kv_only_then_catch_up(run_in_tree, patched):
    """In plain mode the draft's step writes only its K/V (the target's tokens, the positions and
    slots of the target's step, its hidden states) and carries the incoming proposal through; the
    step that would resume speculation runs one full plain step (the draft's DECODE forward) first,
    then speculation resumes."""
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES, body="""
        hidden = 6
        w = make_worker(2, 0)
        events = []
        install_plain_step_fakes(
            w, events, target_event=lambda mr, fb: ("target", fb.seq_lens.shape[0]),
            target_hidden=lambda bs: torch.full((bs, hidden), float(bs)),
            draft_event=lambda fb: ("draft_decode", fb.input_ids.tolist()), draft_logits=lambda n: torch.eye(n, 4))
        req_to_token = give_req_to_token(w)
        w._plain_draft_decode_eligible = lambda out: True
        def batch(bs):
            incoming = NS(bonus_tokens=torch.arange(100, 100 + bs), topk_p=torch.full((bs, 1), 0.5),
                          topk_index=torch.arange(bs)[:, None] + 40, hidden_states=torch.full((bs, 4), 3.0))
            return make_batch(bs, req_pool_indices=torch.arange(bs), spec_info=incoming), incoming
        results, stale = [], []
        for bs in (3, 3, 2, 2):
            b, incoming = batch(bs)
            try:
                res = w.forward_batch_generation(b, on_publish=lambda sl, **kw: None)
                nd = res.next_draft_input
                results.append({"plain": res.spec_plain_step, "topk_index": nd.topk_index[:, 0].tolist(),
                                "passed_through": nd.topk_p is incoming.topk_p
                                and nd.hidden_states is incoming.hidden_states})
            except SpecPathTaken:
                results.append("spec")
            stale.append(w._draft_tail_stale)
        emit({"events": events, "results": results, "stale": stale, "snap": w.spec_disable.snapshot(),
              "expected_loc": [int(req_to_token[r, 10 + r]) for r in range(3)]})
    """)
    ev = out["events"]
    assert ev[0] == ["target", 3]
    assert ev[1] == ["kv_only", [5, 6, 7], [10, 11, 12], [3.0, 3.0, 3.0], out["expected_loc"], True]
    assert ev[2][0] == "target" and ev[3][0] == "kv_only"
    assert ev[4] == ["target", 2] and ev[5] == ["draft_decode", [5, 6]]   # the catch-up step: full draft
    assert len(ev) == 6                                                    # then speculation: no plain step
    plain1, plain2, catch_up, spec = out["results"]
    assert plain1 == plain2 == {"plain": True, "topk_index": [40, 41, 42], "passed_through": True}
    assert catch_up == {"plain": True, "topk_index": [0, 1], "passed_through": False}
    assert spec == "spec"
    assert out["stale"] == [True, True, False, False]
    assert out["snap"]["plain_steps"] == 3 and out["snap"]["speculative_steps"] == 1
    assert out["snap"]["mode"] == "speculative"


def test_plain_layout_conversions(run_in_tree, patched):
    """prepare_decode_layout, the scheduler's hook before a decode batch is prepared: at a plain
    step the batch becomes a plain server's decode batch: each row's length after the in-flight
    step from the FutureMap (host values when every row has one; else read back from the device,
    a one-off wait), each request's speculative tail past its length freed in one call and
    kv_allocated_len = length, spec_algorithm NONE, no spec_info. When speculation resumes (after
    the catch-up step if the draft's proposals are stale) it goes back: spec_info gathers from the
    FutureMap by req_pool_indices. Sync mode, an unsupported setup or no FutureMap keep the
    speculative layout."""
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES + FUTURE_MAP_FAKES, body="""
        fresh_map = future_map
        req_to_token = torch.arange(8 * 32, dtype=torch.int32).reshape(8, 32)
        rows = [5, 1, 6]
        def batch(allocated=(20, 14, 9), overlap=True, freed=None):
            reqs = [NS(req_pool_idx=r, kv=NS(kv_allocated_len=a)) for r, a in zip(rows, allocated)]
            allocator = NS(free=lambda idx: freed.append(idx.tolist()))
            b = make_batch(3, reqs=reqs, req_pool_indices=torch.tensor(rows),
                           req_pool_indices_cpu=torch.tensor(rows), seq_lens=torch.tensor([11, 7, 3]),
                           seq_lens_cpu=None, orig_seq_lens=None, seq_lens_sum=21,
                           enable_overlap=overlap, token_to_kv_pool_allocator=allocator,
                           req_to_token_pool=NS(req_to_token=req_to_token), device="cpu",
                           spec_info=NS(future_indices=torch.tensor(rows)))
            b.batch_size = lambda: len(b.reqs)
            return b
        def worker(ok=True):
            w = make_worker(2, 0)
            w._plain_layout_ok = ok
            w._decided_plain = None
            w.speculative_algorithm = SpeculativeAlgorithm.EAGLE3
            return w
        def publish(fm, lens, host):
            r, l = torch.tensor(rows), torch.tensor(lens)
            fm.publish(r, l, host_seq_lens=(r, l) if host else None)
        def layout(b):
            return "plain" if b.spec_algorithm.is_none() else "spec"
        def tails(lens, allocated=(20, 14, 9)):
            out = []
            for r, n, a in zip(rows, lens, allocated):
                out += req_to_token[r, n:a].tolist()
            return [out]

        res = {}
        for source, host in (("device", False), ("host", True)):
            w, fm, freed = worker(), fresh_map(), []
            b = batch(freed=freed)
            publish(fm, [12, 8, 4], host=host)   # the in-flight step's publish (a verify: device only)
            d2h.clear()
            w.prepare_decode_layout(b, fm)           # bs 3 > 2: plain
            res[source] = [w._decided_plain, layout(b), b.spec_info is None, b.seq_lens.tolist(),
                           b.seq_lens_cpu.tolist(), b.orig_seq_lens.tolist(), str(b.orig_seq_lens.dtype),
                           b.seq_lens_sum, [r.kv.kv_allocated_len for r in b.reqs], freed == tails([12, 8, 4]),
                           len(d2h)]
        w.prepare_decode_layout(b, fm)               # still plain: stays
        res["stays"] = [w._decided_plain, layout(b), len(freed)]
        w._draft_tail_stale = True                   # plain steps wrote the draft's K/V only
        b.reqs, b.req_pool_indices = b.reqs[:2], b.req_pool_indices[:2]
        w.prepare_decode_layout(b, fm)               # bs 2 <= 2 - 0: speculative, but catch up first
        res["catch_up"] = [w._decided_plain, layout(b), w.spec_disable.mode]
        w._draft_tail_stale = False
        w.prepare_decode_layout(b, fm)
        res["back"] = [w._decided_plain, layout(b), b.spec_info.future_indices.tolist(),
                       b.spec_algorithm is SpeculativeAlgorithm.EAGLE3]

        def stays_speculative(w, b, fm):
            w.prepare_decode_layout(b, fm)
            return [w._decided_plain, layout(b)]
        fm = fresh_map(); publish(fm, [12, 8, 4], host=True)
        res["sync"] = stays_speculative(worker(), batch(overlap=False, freed=[]), fm)
        res["unsupported"] = stays_speculative(worker(ok=False), batch(freed=[]), fm)
        res["no_future_map"] = stays_speculative(worker(), batch(freed=[]), None)
        emit(res)
    """)
    for source, reads_back in (("device", 1), ("host", 0)):
        decided, lay, no_spec_info, seq_lens, seq_lens_cpu, orig, orig_dtype, total, allocated, freed_tails, \
            d2h = out[source]
        assert [decided, lay, no_spec_info] == [True, "plain", True], source
        assert seq_lens == seq_lens_cpu == orig == [12, 8, 4] and orig_dtype == "torch.int32", source
        assert total is None and allocated == [12, 8, 4], source
        assert freed_tails is True, source       # [length, kv_allocated_len) of each request, one free
        assert d2h == reads_back, source
    assert out["stays"] == [True, "plain", 1]
    assert out["catch_up"] == [True, "plain", "speculative"]
    assert out["back"] == [False, "spec", [5, 1], True]
    for case in ("sync", "unsupported", "no_future_map"):
        assert out[case] == [True, "spec"], case


def test_plain_layout_step_runs_a_plain_decode_then_the_draft(run_in_tree, patched):
    """A plain-layout batch (spec_algorithm NONE) goes to _forward_plain_layout: the target's
    DECODE forward of the batch as prepared (post-write lengths, its own input ids and slots) under
    the plain backend and graph, no spec-v2 result layout; then, while the mode is plain, the
    draft's K/V only at the same positions and slots (no proposal: the FutureMap keeps the last),
    and the target graph's read-done event moves to the runner the scheduler's WAR barrier reads.
    On the catch-up step the draft's full DECODE step runs on the same lengths (not advanced again)
    and its proposal is relayed; the batch is left as the scheduler prepared it."""
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES, body="""
        hidden = 6
        w = make_worker(2, 0)
        w.speculative_algorithm = SpeculativeAlgorithm.EAGLE3
        w._decided_plain = True
        events = []
        mr, draft_runner = install_plain_step_fakes(
            w, events,
            target_event=lambda mr, fb: ("target", mr.attn_backend, mr.decode_cuda_graph_runner,
                                         fb.seq_lens.tolist(), fb.positions.tolist(), fb.input_ids.tolist(),
                                         fb.out_cache_loc.tolist()),
            target_hidden=lambda bs: torch.full((bs, hidden), 2.0),
            draft_event=lambda fb: ("draft_decode", fb.input_ids.tolist(), fb.seq_lens.tolist(),
                                    fb.positions.tolist(), fb.spec_info.hidden_states[:, 0].tolist()),
            draft_logits=lambda n: torch.eye(n, 4).flip(1))
        input_ids = torch.tensor([100, 101, 102])
        b = make_batch(3, spec_algorithm=SpeculativeAlgorithm.NONE, spec_info=None,
                       seq_lens=torch.tensor([11, 12, 13]), input_ids=input_ids,
                       out_cache_loc=torch.tensor([70, 71, 72]))
        w.spec_disable.step(3)                              # mode plain
        p = w.forward_batch_generation(b)
        p_state = {"plain": p.spec_plain_step, "draft_input": p.next_draft_input, "accept": p.accept_lens,
                   "stride": p.speculative_num_draft_tokens, "stale": w._draft_tail_stale,
                   "war": [draft_runner.war_fastpath_read_done_event, mr.war_fastpath_read_done_event],
                   "backends": [mr.attn_backend, mr.decode_cuda_graph_runner]}
        w.spec_disable.step(1)                              # speculative again: the catch-up step
        draft_runner.war_fastpath_read_done_event = None
        c = w.forward_batch_generation(b)
        nd = c.next_draft_input
        emit({"events": events, "p": {k: v if not hasattr(v, "tolist") else v.tolist() for k, v in p_state.items()},
              "c": {"topk_index": nd.topk_index[:, 0].tolist(), "bonus": nd.bonus_tokens.tolist(),
                    "hidden": nd.hidden_states[:, 0].tolist(), "stale": w._draft_tail_stale,
                    "kept": len(c.extra_keep_alive_refs)},
              "batch_after": [b.input_ids is input_ids, b.spec_info is None, b.spec_algorithm.is_none(),
                              b.seq_lens.tolist()]})
    """)
    ev = out["events"]
    assert ev[0] == ["target", "plain-target", "plain-graph", [11, 12, 13], [10, 11, 12], [100, 101, 102],
                     [70, 71, 72]]
    assert ev[1] == ["kv_only", [5, 6, 7], [10, 11, 12], [2.0, 2.0, 2.0], [70, 71, 72], True]
    assert out["p"] == {"plain": True, "draft_input": None, "accept": None, "stride": None, "stale": True,
                        "war": ["target-read-done", None], "backends": ["spec-target", "spec-graph"]}
    assert ev[2][0] == "target"
    assert ev[3] == ["draft_decode", [5, 6, 7], [11, 12, 13], [10, 11, 12], [2.0, 2.0, 2.0]]
    assert len(ev) == 4
    assert out["c"] == {"topk_index": [3, 2, 1], "bonus": [5, 6, 7], "hidden": [7.0, 7.0, 7.0],
                        "stale": False, "kept": 1}
    assert out["batch_after"] == [True, True, True, [11, 12, 13]]


def test_plain_steps_defer_the_draft_kv_to_the_next_target_forward(run_in_tree, patched):
    """With _DeferredDraftKv a plain step launches no K/V write of its own (it only marks the draft's
    proposal stale): the target's plain DECODE graph writes the previous step's K/V, and where that
    graph did not run the worker runs the same step eagerly with the forward's inputs and hidden
    states. A prefill forgets its requests' slots. The catch-up step still runs the full draft."""
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES, body="""
        w = make_worker(2, 0)
        w.speculative_algorithm = SpeculativeAlgorithm.EAGLE3
        events = []
        mr, draft_runner = install_plain_step_fakes(
            w, events, target_event=lambda mr, fb: ("target",),
            target_hidden=lambda bs: torch.full((bs, 6), 2.0),
            draft_event=lambda fb: ("draft_decode",), draft_logits=lambda n: torch.eye(n, 4))
        class Deferred(ew._DeferredDraftKv):   # the real step_batch, a recording step
            def __init__(self):
                pass
            def step(self, input_ids, positions, req_pool_indices, out_cache_loc, hidden_states):
                events.append(("deferred", input_ids.tolist(), positions.tolist(), req_pool_indices.tolist(),
                               out_cache_loc.tolist(), hidden_states[:, 0].tolist()))
            def forget(self, req_pool_indices):
                events.append(("forget", req_pool_indices.tolist()))
        w._plain_state.deferred_draft_kv = Deferred()
        graph_ran = [True]
        target_forward = w._target_worker.forward_batch_generation
        def forward(batch, forward_batch=None):
            r = target_forward(batch, forward_batch=forward_batch)
            r.can_run_cuda_graph = graph_ran[0]
            return r
        w._target_worker.forward_batch_generation = forward
        def plain_batch():
            return make_batch(3, spec_algorithm=SpeculativeAlgorithm.NONE, spec_info=None,
                              seq_lens=torch.tensor([11, 12, 13]), input_ids=torch.tensor([100, 101, 102]),
                              out_cache_loc=torch.tensor([70, 71, 72]), req_pool_indices=torch.tensor([4, 1, 2]))
        w.spec_disable.step(3)                                   # mode plain
        w._decided_plain = True
        w.forward_batch_generation(plain_batch())                # under the graph
        in_graph = list(events); events.clear()
        stale = w._draft_tail_stale
        graph_ran[0] = False
        w._decided_plain = True
        w.forward_batch_generation(plain_batch())                # eager
        eager = list(events); events.clear()
        w.spec_disable.step(1)                                   # the catch-up step
        w._decided_plain = False
        graph_ran[0] = True
        w.forward_batch_generation(plain_batch())
        catch_up = list(events); events.clear()
        prefill = NS(forward_mode=ForwardMode.EXTEND, is_extend_in_batch=True, seq_lens=torch.tensor([8]),
                     req_pool_indices=torch.tensor([5]))
        w._prefill_draft_kv_only = lambda batch, out: True       # the draft's prefill is another test's
        w._target_worker.forward_batch_generation = lambda batch, capture_hidden_mode=None: target_result(1, None)
        w.forward_batch_generation(prefill)
        emit({"in_graph": in_graph, "stale": stale, "eager": eager, "catch_up": catch_up, "prefill": events})
    """)
    assert out["in_graph"] == [["target"]] and out["stale"] is True        # no write of its own
    assert out["eager"] == [["target"], ["deferred", [100, 101, 102], [10, 11, 12], [4, 1, 2], [70, 71, 72],
                                         [2.0, 2.0, 2.0]]]
    assert out["catch_up"] == [["target"], ["draft_decode"]]
    assert out["prefill"] == [["forget", [5]]]


def test_future_map_relays_a_plain_layout_step(run_in_tree, patched):
    """FutureMap on a speculative server: a plain-layout step's relay (its token only) keeps each
    row's draft proposal; the next plain-layout batch gathers its input ids from the token buffer
    (as a non-speculative server's) and resolves no spec extras."""
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES + FUTURE_MAP_FAKES, body="""
        from sglang.srt.managers.overlap_utils import RelayPayload, resolve_forward_inputs

        fm = future_map()
        fm._forward_buf_initialized, fm.need_topk, fm.need_hidden_states = True, True, True
        fm.topk_p_buf, fm.topk_index_buf = torch.zeros(16, 1), torch.zeros(16, 1, dtype=torch.int64)
        fm.hidden_states_buf, fm.draft_probs_buf = torch.zeros(16, 4), None
        rows = torch.tensor([3, 9])
        fm.stash(rows, RelayPayload(bonus_tokens=torch.tensor([11, 12]), topk_p=torch.tensor([[0.5], [0.25]]),
                                    topk_index=torch.tensor([[40], [41]]), hidden_states=torch.ones(2, 4)))
        fm.stash(rows, RelayPayload(bonus_tokens=torch.tensor([21, 22])))   # a plain-layout step
        b = NS(prefill_input_ids_cpu=None, input_ids=None, req_pool_indices=torch.tensor([9, 3]),
               enable_overlap=True, spec_algorithm=SpeculativeAlgorithm.NONE, spec_info=None)
        resolve_forward_inputs(b, fm)
        emit({"input_ids": b.input_ids.tolist(), "topk_index": fm.topk_index_buf[rows, 0].tolist(),
              "topk_p": fm.topk_p_buf[rows, 0].tolist(), "hidden": fm.hidden_states_buf[rows, 0].tolist(),
              "spec_info": b.spec_info})
    """)
    assert out == {"input_ids": [22, 21], "topk_index": [40, 41], "topk_p": [0.5, 0.25], "hidden": [1.0, 1.0],
                   "spec_info": None}


def test_plain_layout_result_counts_a_verify_per_request(run_in_tree, patched):
    """A plain-layout step's result is processed as a non-speculative one (one token per request,
    kv_committed_len untouched: plain steps commit at prepare) and counts per request as a verify
    with no accepted draft, so meta_info's spec_accept_length stays tokens per step; a plain
    server's result counts nothing."""
    out = _run(run_in_tree, patched, """
        import torch
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult
        from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        class R:
            def __init__(self, hist):
                self.kv_committed_len, self.spec_verify_ct = 10, 5
                self.spec_correct_drafts_histogram = list(hist)
            def state(self):
                return [self.kv_committed_len, self.spec_verify_ct, self.spec_correct_drafts_histogram]

        def process(plain_layout_step):
            reqs = [R([]), R([2, 1])]
            res = GenerationBatchResult(logits_output=LogitsProcessorOutput(next_token_logits=None),
                                        can_run_cuda_graph=True)
            res.next_token_ids = torch.tensor([7, 8])
            res.spec_plain_step = plain_layout_step
            batch = type("B", (), {"reqs": reqs, "return_logprob": False,
                                   "spec_algorithm": SpeculativeAlgorithm.NONE})()
            proc = object.__new__(SchedulerBatchResultProcessor)
            tokens, _ = proc._normalize_decode_outputs(batch=batch, result=res, logits_output=res.logits_output,
                                                       next_token_ids=res.next_token_ids)
            return {"tokens": tokens, "reqs": [r.state() for r in reqs]}

        emit({"plain_layout": process(True), "plain_server": process(False)})
    """)
    assert out["plain_layout"] == {"tokens": [[7], [8]], "reqs": [[10, 6, [1]], [10, 6, [3, 1]]]}
    assert out["plain_server"] == {"tokens": [[7], [8]], "reqs": [[10, 5, []], [10, 5, [2, 1]]]}


def test_prefill_in_plain_mode_writes_draft_kv_only(run_in_tree, patched):
    """A prefill while the mode is plain writes only the draft's K/V: each request's tokens shifted
    by one (its last position takes the sampled token), at its own positions and slots, with the
    target's hidden states; the new requests get placeholder proposals and speculation waits for a
    catch-up step. In speculative mode upstream's draft extend runs."""
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES, body="""
        import contextlib
        w = make_worker(2, 0)
        calls, timed = [], []
        class Timer:  # sglang's DeviceTimer interface (its CUDA events need a GPU)
            inside = None
            @contextlib.contextmanager
            def wrap(self, metadata):
                self.inside = metadata["category"]
                yield
                self.inside = None
        timer = Timer()
        class KvOnly:
            def write_kv_only(self, tokens, positions, target_hidden, loc, pool):
                calls.append([tokens.tolist(), positions.tolist(), target_hidden[:, 0].tolist(), loc.tolist()])
                timed.append(timer.inside)
        draft_runner = NS(tp_group=None, token_to_kv_pool="draft-pool",
                          spec_algorithm=NS(is_standalone=lambda: False), device_timer=timer,
                          model_config=NS(spec_hidden_size=4, dtype=torch.bfloat16))
        w._draft_worker = NS(draft_runner=draft_runner, draft_tp_context=lambda g: ew.empty_context())
        w._plain_state = ew._PlainStepState("t", "g", "de", "dr", "deg", draft_kv_only_model=KvOnly())
        def prefill_batch():
            return NS(forward_mode=ForwardMode.EXTEND, input_ids=torch.tensor([10, 11, 12, 20, 21]),
                      extend_lens=[3, 2], prefix_lens=[5, 0], chunked_req_next_prompt_token=None,
                      seq_lens=torch.tensor([8, 2]), is_extend_in_batch=True,
                      out_cache_loc=torch.tensor([40, 41, 42, 50, 51]),
                      req_pool_indices_cpu=torch.tensor([4, 6]), seq_lens_cpu=torch.tensor([8, 2]))
        def result():
            lo = LogitsProcessorOutput(next_token_logits=torch.zeros(2, 5),
                                       hidden_states=torch.arange(5, dtype=torch.float32)[:, None].repeat(1, 6))
            r = GenerationBatchResult(logits_output=lo, can_run_cuda_graph=True)
            r.next_token_ids = torch.tensor([13, 22])
            return r
        in_spec_mode = w._prefill_draft_kv_only(prefill_batch(), result())
        for bs in (3, 3):
            w.spec_disable.step(bs)
        r = result()
        w._target_worker = NS(forward_batch_generation=lambda batch, capture_hidden_mode=None: r)
        w.speculative_algorithm = NS(is_standalone=lambda: False)
        # through the worker's entry point (the draft worker has no upstream draft extend to call)
        published = []
        publish = lambda sl, **kw: published.append([sl.tolist(), [t.tolist() for t in kw.get("host_seq_lens", ())]])
        in_plain_mode = w.forward_batch_generation(prefill_batch(), on_publish=publish) is r and len(calls) == 1
        nd = r.next_draft_input
        emit({"in_spec_mode": in_spec_mode, "in_plain_mode": in_plain_mode, "calls": calls, "timed": timed,
              "stale": w._draft_tail_stale, "bonus": nd.bonus_tokens.tolist(),
              "shapes": [list(nd.topk_p.shape), list(nd.topk_index.shape), list(nd.hidden_states.shape)],
              "hidden_dtype": str(nd.hidden_states.dtype), "published": published})
    """)
    assert out["in_spec_mode"] is False and out["in_plain_mode"] is True
    # the prefill's lengths reach the FutureMap on the host too: the next decode need not wait for it
    assert out["published"] == [[[8, 2], [[4, 6], [8, 2]]]]
    assert out["calls"] == [[[11, 12, 13, 21, 22], [5, 6, 7, 0, 1], [0.0, 1.0, 2.0, 3.0, 4.0],
                             [40, 41, 42, 50, 51]]]
    assert out["stale"] is True and out["bonus"] == [13, 22]
    assert out["shapes"] == [[2, 1], [2, 1], [2, 4]] and out["hidden_dtype"] == "torch.bfloat16"
    assert out["timed"] == ["draft_kv_only"]  # inside the device timer's window (GPU-time split)


def test_plain_draft_decode_only_for_greedy_chains(run_in_tree, patched):
    """The DECODE-mode draft step produces a top-1 proposal: a tree (topk > 1), rejection sampling,
    an attention backend not known to build decode metadata from seq_lens under a draft spec_info,
    or a missing target hidden state keeps upstream's draft extend."""
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES, body="""
        def eligible(topk, hidden=True, rejection=False, backend=ew.TritonAttnBackend):
            w = make_worker(1, 0)
            w.topk = topk
            w._draft_worker = NS(seed_dsa_topk_from_draft_extend=False)
            w._plain_state = NS(draft_runner_attn_backend=object.__new__(backend))
            ew.get_spec = lambda: NS(speculative_use_rejection_sampling=rejection)
            lo = LogitsProcessorOutput(next_token_logits=torch.zeros(2, 5),
                                       hidden_states=torch.zeros(2, 4) if hidden else None)
            return w._plain_draft_decode_eligible(GenerationBatchResult(logits_output=lo, can_run_cuda_graph=True))
        class OtherBackend:
            pass
        emit({"chain": eligible(1), "tree": eligible(4), "no_hidden": eligible(1, hidden=False),
              "rejection": eligible(1, rejection=True),
              "flashinfer": eligible(1, backend=ew.FlashInferAttnBackend),
              "other_backend": eligible(1, backend=OtherBackend)})
    """)
    assert out == {"chain": True, "tree": False, "no_hidden": False, "rejection": False,
                   "flashinfer": True, "other_backend": False}


def test_draft_decode_graph_metadata_sees_no_spec_info(run_in_tree, patched):
    """The graph's attention backend builds DECODE metadata without the spec_info (which carries the
    target's hidden states for the draft model); the spec_info is back afterwards, also on failure."""
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES, body="""
        seen = []
        class Backend:
            page_size = 7
            def init_forward_metadata_out_graph(self, fb, in_capture=False):
                seen.append((fb.spec_info, in_capture))
                if in_capture == "boom":
                    raise RuntimeError("boom")
        view = ew._MetadataWithoutSpecInfo(Backend())
        fb = NS(spec_info="hidden-carrier")
        view.init_forward_metadata_out_graph(fb, in_capture=True)
        after = fb.spec_info
        try:
            view.init_forward_metadata_out_graph(fb, in_capture="boom")
        except RuntimeError:
            pass
        emit({"seen": seen, "after": after, "after_error": fb.spec_info, "passthrough": view.page_size})
    """)
    assert out == {"seen": [[None, True], [None, "boom"]], "after": "hidden-carrier",
                   "after_error": "hidden-carrier", "passthrough": 7}


def test_draft_decode_graph_captures_decode_at_one_token(run_in_tree, patched):
    """The runner is upstream's draft-extend runner at 1 token/req, captured in DECODE mode with the
    spec_info-free metadata view (upstream's capture loop is replaced by a recorder here)."""
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES, body="""
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
        recorded = {}
        def fake_capture(self):
            recorded.update(mode=self.forward_mode.name, capture_mode=self.capture_forward_mode.name,
                            view=type(self.attn_backend).__name__,
                            same=self.attn_backend is self.draft_extend_attn_backend,
                            inner=self.attn_backend._backend, width=self.captured_req_width)
        DecodeCudaGraphRunner.capture = fake_capture
        r = object.__new__(ew._PlainDraftDecodeCudaGraphRunner)
        r.forward_mode = r.capture_forward_mode = ew.ForwardMode.DRAFT_EXTEND_V2
        r.draft_extend_attn_backend = r.attn_backend = "triton-backend"
        r.captured_req_width = 4          # what the base __init__ assigns: ignored
        r.capture()
        emit(recorded)
    """)
    assert out == {"mode": "DECODE", "capture_mode": "DECODE", "view": "_MetadataWithoutSpecInfo",
                   "same": True, "inner": "triton-backend", "width": 1}


def test_draft_decode_graph_replays_when_it_can(run_in_tree, patched):
    """The plain step's draft forward replays the graph with a draft-extend spec_info (target hidden
    states, width 1); without a graph, or when the graph cannot take the batch, it runs eagerly with
    the eager spec_info put back."""
    out = _run(run_in_tree, patched, helpers=WORKER_FAKES, body="""
        hidden = torch.ones(3, 6)
        lo = LogitsProcessorOutput(next_token_logits=torch.zeros(3, 5), hidden_states=hidden)
        result = GenerationBatchResult(logits_output=lo, can_run_cuda_graph=True)
        calls = []
        class Graph:
            def __init__(self, ok):
                self.ok = ok
            def can_run_graph(self, fb):
                calls.append(("can_run", type(fb.spec_info).__name__, fb.spec_info.num_tokens_per_req,
                              bool(torch.equal(fb.spec_info.hidden_states, hidden))))
                return self.ok
            def execute(self, fb):
                calls.append(("execute",))
                return "graph-output"
        def run(graph):
            w = make_worker(1, 0)
            w._plain_state = NS(draft_decode_graph=graph)
            fb = NS(spec_info="eager-spec-info")
            got = w._plain_draft_decode_graph(fb, result)
            return [got, fb.spec_info if got is None else type(fb.spec_info).__name__]
        emit({"none": run(None), "cannot": run(Graph(False)), "can": run(Graph(True)), "calls": calls})
    """)
    assert out["none"] == [None, "eager-spec-info"]
    assert out["cannot"] == [None, "eager-spec-info"]
    assert out["can"] == ["graph-output", "EagleDraftExtendInput"]
    assert out["calls"] == [["can_run", "EagleDraftExtendInput", 1, True]] * 2 + [["execute"]]


def test_spec_decode_alloc_records_allocated_lengths(run_in_tree, patched):
    """spec-decode-alloc-host-loop.patch: the per-request loop reads the lengths with one tolist(),
    no tensor index per request (counted on the tensor); the recorded lengths are unchanged (max of
    the old and the next length, per request, as ints)."""
    out = _run(run_in_tree, patched, """
        from types import SimpleNamespace as NS
        import torch
        from sglang.srt.mem_cache import allocation
        indexed = []
        class CountingTensor(torch.Tensor):
            def __getitem__(self, key):
                indexed.append(key)
                return super().__getitem__(key)
        reqs = [NS(kv=NS(kv_allocated_len=n)) for n in (10, 40, 7)]
        nxt = torch.tensor([16, 32, 8], dtype=torch.int32).as_subclass(CountingTensor)
        allocation.alloc_for_spec_decode(None, None, reqs=reqs, req_pool_indices=None, cur_kv_lens=None,
                                         cur_kv_lens_cpu=None, nxt_kv_lens=None, nxt_kv_lens_cpu=nxt,
                                         num_needed_tokens=0)
        emit({"lens": [r.kv.kv_allocated_len for r in reqs],
              "types": sorted({type(r.kv.kv_allocated_len).__name__ for r in reqs}),
              "tensor_indexed": len(indexed)})
    """)
    assert out == {"lens": [16, 40, 8], "types": ["int"], "tensor_indexed": 0}


# --------------------------------------------------------------------------- observability


def test_prometheus_metrics_and_internal_state_hook(run_in_tree, patched):
    out = _run(run_in_tree, patched, r"""
        import os, tempfile
        from prometheus_client import generate_latest, REGISTRY
        from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector
        from sglang.srt.speculative.spec_disable import SpecDisableController
        from prometheus_client import Counter, Gauge
        # The full collector needs a whole ServerArgs; build only the patch's metrics, from the
        # collector's own __init__ source, on a bare instance, then call its real method.
        import inspect, re
        src_init = inspect.getsource(SchedulerMetricsCollector.__init__)
        c = object.__new__(SchedulerMetricsCollector)
        c.labels = {"model_name": "m"}
        labels = c.labels
        for attr in ("spec_disable_plain_mode", "spec_disable_speculative_steps_total",
                     "spec_disable_plain_steps_total"):
            block = re.search(r"self\." + attr + r" = (Gauge|Counter)\((.*?)\n        \)", src_init, re.S)
            kwargs = eval("dict(" + block.group(2) + ")")
            setattr(c, attr, (Gauge if block.group(1) == "Gauge" else Counter)(**kwargs))
        ctl = SpecDisableController(2, 0)
        for b in [1, 3, 3]:
            ctl.step(b)
        c.observe_spec_disable(*ctl.take_metric_deltas())
        text = generate_latest(REGISTRY).decode()
        lines = [l for l in text.splitlines() if l.startswith("sglang:spec_disable")]
        src = open("sglang/srt/managers/scheduler.py").read()
        emit({"lines": lines, "hook": 'ret["speculative_disable"] = spec_disable.snapshot()' in src})
    """)
    lines = out["lines"]
    assert any(l.startswith("sglang:spec_disable_plain_mode{") and l.endswith(" 1.0") for l in lines), lines
    assert any(l.startswith("sglang:spec_disable_plain_steps_total{") and l.endswith(" 2.0") for l in lines), lines
    assert any(l.startswith("sglang:spec_disable_speculative_steps_total{") and l.endswith(" 1.0") for l in lines), lines
    assert out["hook"]


def test_patched_modules_import_and_compile(run_in_tree, patched):
    out = _run(run_in_tree, patched, """
        import importlib, py_compile
        files = ["sglang/srt/speculative/spec_disable.py", "sglang/srt/speculative/eagle_worker_v2.py",
                 "sglang/srt/server_args.py", "sglang/srt/managers/scheduler.py", "sglang/srt/managers/utils.py",
                 "sglang/srt/managers/scheduler_components/batch_result_processor.py",
                 "sglang/srt/observability/metrics_collector.py"]
        import os, tempfile
        with tempfile.TemporaryDirectory() as tmp:
            for f in files:
                py_compile.compile(f, cfile=os.path.join(tmp, os.path.basename(f) + "c"), doraise=True)
        for m in ["sglang.srt.speculative.eagle_worker_v2", "sglang.srt.managers.scheduler",
                  "sglang.srt.server_args"]:
            importlib.import_module(m)
        emit({"ok": True})
    """)
    assert out == {"ok": True}


# --------------------------------------------------------------------------- the checks can fail


def test_unpatched_tree_lacks_the_flag(run_in_tree, pristine):
    out = _run(run_in_tree, pristine, """
        import argparse, importlib.util
        from sglang.srt.server_args import ServerArgs
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        try:
            parser.parse_args(["--model-path", "m", "--speculative-disable-batch-threshold", "8"])
            parsed = True
        except SystemExit:
            parsed = False
        emit({"parsed": parsed, "help": "--speculative-disable-batch-threshold" in parser.format_help(),
              "module": importlib.util.find_spec("sglang.srt.speculative.spec_disable") is not None})
    """)
    assert out == {"parsed": False, "help": False, "module": False}


# --------------------------------------------------------------------------- regressions found on the GPU


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Tiny Llama target + EAGLE-3 draft (smoke generator, CPU, a few seconds)."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path_factory.mktemp("tiny_models")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "smoke", "models", str(out), "--device", "cpu", "--size", "tiny", "--draft", "first"],
        cwd=root, check=False, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "target", out / "draft"


REAL_SERVER_ARGS = """
import os
from sglang.srt.server_args import ServerArgs
kw = dict(
    model_path={target!r}, device="cpu", speculative_algorithm="EAGLE3",
    speculative_draft_model_path={draft!r}, speculative_num_steps=3, speculative_eagle_topk=1,
    speculative_num_draft_tokens=4,
)
if {flag!r} is not None:
    kw["speculative_disable_batch_threshold"] = {flag!r}
sa = ServerArgs(**kw)
sa.check_server_args()   # 0.5.17: a plain field assignment here raises 'assigned after resolution'
sa.check_server_args()   # idempotent: resolving again gives the same values
emit([sa.speculative_disable_batch_threshold, sa.speculative_disable_hysteresis])
"""


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [(4, None, [4, 1]), (None, "16", [16, 2]), (8, "16", [8, 1])],
    ids=["flag", "env", "flag-wins"],
)
def test_real_server_args_check_resolves_without_assignment(run_in_tree, patched, tiny_models, flag, env, expected):
    """Regression: the resolved threshold/hysteresis are written back via ServerArgs.override();
    a bare assignment after resolution raises AttributeError on 0.5.17 (seen at GPU start)."""
    target, draft = tiny_models
    body = REAL_SERVER_ARGS.format(target=str(target), draft=str(draft), flag=flag)
    assert _run(run_in_tree, patched, body, env={ENV: env} if env is not None else None) == expected


METRICS_REPORTER = """
import time
from types import SimpleNamespace as NS
from sglang.srt.managers.scheduler_components import metrics_reporter as mr
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.disaggregation.utils import DisaggregationMode

mr.get_spec = lambda: NS(speculative_num_draft_tokens=4, speculative_num_steps=3)
rep = object.__new__(mr.SchedulerMetricsReporter)
batch = NS(reqs=[object()] * 32, forward_iter=None, dp_cooperation_info=None, batch_size=lambda: 32)
rep.scheduler = NS(
    running_batch=batch, spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE3"),
    pool_stats_observer=NS(get_pool_stats=lambda: NS(get_decode_usage_msg_parts=lambda: ["token usage: 0.10"])),
    forward_ct=7, waiting_queue=[], disaggregation_mode=DisaggregationMode.NULL,
    server_args=NS(language_only=False, encoder_transfer_backend=None),
    enable_priority_scheduling=False, draft_worker=None,
    kv_events_publisher=NS(publish_kv_events=lambda: None),
)
rep.current_scheduler_metrics_enabled = False
rep.enable_mfu_metrics = False
rep.is_stats_logging_rank = True
rep.forward_ct_decode = 40
rep.decode_log_interval = 40
rep.last_decode_stats_tic = time.perf_counter() - 1.0
rep.num_generated_tokens = 32 * 40
rep.step_time_dict = {{}}
rep._graph_backend_label = "cuda graph"
# Every step of the interval was plain: no speculative forward was counted.
rep.spec_num_accept_tokens = rep.spec_num_forward_ct = 0
rep.spec_num_cap_tokens = rep.spec_num_block_accept_tokens = 0
rep.spec_total_num_accept_tokens = rep.spec_total_num_forward_ct = 0
logged = []
mr.logger.info = lambda msg, *a: logged.append(msg % a if a else msg)
rep.report_decode_stats(can_run_cuda_graph=True, running_batch=batch)
emit(logged)
"""


def test_metrics_reporter_interval_of_plain_steps_only(run_in_tree, patched):
    """Regression: report_decode_stats divided by spec_num_forward_ct, which is 0 when every step
    of the logging interval was a plain step (ZeroDivisionError in the scheduler loop on the GPU)."""
    logged = _run(run_in_tree, patched, METRICS_REPORTER.format())
    assert len(logged) == 1 and "accept len: 0.00" in logged[0], logged


def test_metrics_reporter_regression_check_can_fail(run_in_tree, pristine):
    proc = run_in_tree(pristine, PRELUDE + textwrap.dedent(METRICS_REPORTER.format()), timeout=900)
    assert proc.returncode != 0 and "ZeroDivisionError" in proc.stderr, proc.stderr[-3000:]
