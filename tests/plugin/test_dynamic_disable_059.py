"""Dynamic speculation disable on sglang 0.5.9 (patches/sglang-0.5.9/dynamic-speculation-disable.patch).

CPU tests against the real 0.5.9 wheel, PATCHED (and, where it shows the difference, UNPATCHED).
Every probe runs in its own process, forked from one warm interpreter per tree that imported torch
and sglang once (tests/forkserver.py). What is real and what is faked:
- real: ServerArgs (CLI registration, the _handle_speculative_disable validation), the shared
  controller (spec_disable.py), EAGLEWorkerV2.forward_batch_generation / _forward_plain_decode,
  Scheduler._resolve_spec_overlap_token_ids, FutureMap, CudaGraphRunner.can_run, the Prometheus
  collector, all on CPU tensors.
- faked: `sgl_kernel` (GPU-only, imported at module level by sglang's memory pools) is a stub
  package whose attributes are inert placeholders: nothing here calls a kernel. The target
  model, its sampler and the draft worker are small fakes named in each probe; ForwardBatch.init_new
  (which needs a live ModelRunner) is replaced by a recorder of the batch fields it would read.
Not covered here (needs a GPU): the real forward passes, CUDA graphs, attention backends.
"""
from __future__ import annotations

import textwrap

import pytest

from tests.forkserver import forked_probes, warm_imports
from tests.probe import probe_result

FLAVOR = "sglang-0.5.9"

PRELUDE = textwrap.dedent(
    '''
    import importlib.abc, importlib.machinery, json, logging, os, sys, types
    from types import SimpleNamespace as NS

    class _Inert:
        """Placeholder for a GPU-only sgl_kernel symbol (never called in these probes)."""
        def __init__(self, name): self._name = name
        def __call__(self, *a, **k): raise RuntimeError(f"sgl_kernel stub {self._name} called")
        def __getattr__(self, k):
            if k.startswith("__"): raise AttributeError(k)
            return _Inert(self._name + "." + k)

    class _StubLoader(importlib.abc.Loader):
        def create_module(self, spec):
            m = types.ModuleType(spec.name); m.__path__ = []
            def _ga(k, _n=spec.name):
                if k.startswith("__"): raise AttributeError(k)
                return _Inert(_n + "." + k)
            m.__getattr__ = _ga
            return m
        def exec_module(self, module): pass

    class _StubFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "sgl_kernel":
                return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)

    sys.meta_path.insert(0, _StubFinder())

    class Capture(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG); self.lines = []
        def emit(self, record): self.lines.append(record.getMessage())
    CAP = Capture(); logging.getLogger().addHandler(CAP); logging.getLogger().setLevel(logging.INFO)
    OUT = {}
    def done(): print("RESULT=" + json.dumps(OUT))
    '''
)


BASE_ENV = {"SGLANG_ENABLE_SPEC_V2": "", "SGLANG_SPEC_DISABLE_BATCH_THRESHOLD": ""}
# Imported once by the warm interpreter (one that fails here fails in the probe that needs it).
WARM_MODULES = (
    "torch", "sglang.srt.server_args", "sglang.srt.speculative.spec_disable",
    "sglang.srt.speculative.spec_info", "sglang.srt.speculative.eagle_info",
    "sglang.srt.speculative.eagle_worker_v2", "sglang.srt.managers.scheduler",
    "sglang.srt.managers.overlap_utils", "sglang.srt.managers.schedule_batch",
    "sglang.srt.managers.utils", "sglang.srt.metrics.collector",
    "sglang.srt.model_executor.cuda_graph_runner", "sglang.srt.model_executor.forward_batch_info",
    "sglang.srt.layers.logits_processor",
)
WARMUP = PRELUDE + warm_imports(WARM_MODULES)


@pytest.fixture(scope="module")
def run_in_tree():
    """This module's probes: forked from one warm interpreter per tree (see the docstring)."""
    with forked_probes(WARMUP, server_env=BASE_ENV) as run:
        yield run


def _run(run_in_tree, tree, body: str, env: dict | None = None) -> dict:
    code = PRELUDE + textwrap.dedent(body) + "\ndone()\n"
    return probe_result(run_in_tree(tree, code, env={**BASE_ENV, **(env or {})}), marker="RESULT=")


# ServerArgs without __post_init__ (which needs a model and a device): all dataclass defaults,
# then the fields a case sets, then the real _handle_speculative_disable().
VALIDATE = '''
import dataclasses
from sglang.srt.server_args import ServerArgs

def check(env=None, **fields):
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        sa = object.__new__(ServerArgs)
        for f in dataclasses.fields(ServerArgs):
            if f.default is not dataclasses.MISSING:
                setattr(sa, f.name, f.default)
            elif f.default_factory is not dataclasses.MISSING:
                setattr(sa, f.name, f.default_factory())
        base = dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1,
                    disable_overlap_schedule=False)
        base.update(fields)
        for k, v in base.items():
            setattr(sa, k, v)
        try:
            sa._handle_speculative_disable()
        except ValueError as e:
            return {"error": str(e)}
        return {"threshold": sa.speculative_disable_batch_threshold,
                "hysteresis": sa.speculative_disable_hysteresis}
    finally:
        os.environ.clear(); os.environ.update(saved)

V2 = {"SGLANG_ENABLE_SPEC_V2": "True"}
'''


def test_flag_env_and_validation(run_in_tree, patched):
    out = _run(run_in_tree, patched, VALIDATE + '''
OUT["flag_wins"] = check(V2 | {"SGLANG_SPEC_DISABLE_BATCH_THRESHOLD": "8"},
                         speculative_disable_batch_threshold=64)
OUT["env_used"] = check(V2 | {"SGLANG_SPEC_DISABLE_BATCH_THRESHOLD": "16"})
OUT["explicit_h"] = check(V2, speculative_disable_batch_threshold=32, speculative_disable_hysteresis=4)
OUT["off"] = check({}, speculative_algorithm=None)          # nothing given: off, no checks
OUT["zero_flag_beats_env"] = check({"SGLANG_SPEC_DISABLE_BATCH_THRESHOLD": "16"},
                                   speculative_disable_batch_threshold=0, speculative_algorithm=None)
OUT["negative"] = check(V2, speculative_disable_batch_threshold=-1)
OUT["env_not_int"] = check(V2 | {"SGLANG_SPEC_DISABLE_BATCH_THRESHOLD": "lots"})
OUT["no_algorithm"] = check(V2, speculative_disable_batch_threshold=8, speculative_algorithm=None)
OUT["v1_worker"] = check({}, speculative_disable_batch_threshold=8, disable_overlap_schedule=True)
OUT["v1_env_only"] = check({"SGLANG_SPEC_DISABLE_BATCH_THRESHOLD": "8"}, disable_overlap_schedule=True)
OUT["dp_attention"] = check(V2, speculative_disable_batch_threshold=8, enable_dp_attention=True)
OUT["ngram"] = check(V2, speculative_disable_batch_threshold=8, speculative_algorithm="NGRAM")
OUT["standalone"] = check(V2, speculative_disable_batch_threshold=8, speculative_algorithm="STANDALONE")
OUT["multi_layer"] = check(V2, speculative_disable_batch_threshold=8, enable_multi_layer_eagle=True)
OUT["h_too_big"] = check(V2, speculative_disable_batch_threshold=8, speculative_disable_hysteresis=8)
OUT["h_negative"] = check(V2, speculative_disable_batch_threshold=8, speculative_disable_hysteresis=-2)
OUT["pp"] = check(V2, speculative_disable_batch_threshold=8, pp_size=2)

import argparse
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
ns = parser.parse_args(["--model-path", "m", "--speculative-disable-batch-threshold", "48",
                        "--speculative-disable-hysteresis", "6"])
OUT["parsed"] = [ns.speculative_disable_batch_threshold, ns.speculative_disable_hysteresis]
ns = parser.parse_args(["--model-path", "m"])
OUT["parsed_default"] = [ns.speculative_disable_batch_threshold, ns.speculative_disable_hysteresis]
import contextlib, io
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        parser.parse_args(["--model-path", "m", "--speculative-disable-batch-threshold", "1.5"])
        OUT["bad_cli"] = "accepted"
    except SystemExit:
        OUT["bad_cli"] = err.getvalue()
''')
    assert out["flag_wins"] == {"threshold": 64, "hysteresis": 8}   # default H = N // 8
    assert out["env_used"] == {"threshold": 16, "hysteresis": 2}
    assert out["explicit_h"] == {"threshold": 32, "hysteresis": 4}
    assert out["off"] == {"threshold": 0, "hysteresis": 0}
    assert out["zero_flag_beats_env"] == {"threshold": 0, "hysteresis": 0}
    flag = "--speculative-disable-batch-threshold"
    for case in ("negative", "no_algorithm", "v1_worker", "dp_attention", "ngram", "standalone",
                 "multi_layer", "pp"):
        assert flag in out[case].get("error", ""), (case, out[case])
    assert "SGLANG_SPEC_DISABLE_BATCH_THRESHOLD" in out["env_not_int"]["error"]
    assert flag in out["env_not_int"]["error"]
    for case in ("v1_worker", "v1_env_only"):
        assert "SGLANG_ENABLE_SPEC_V2=True" in out[case]["error"], out[case]
    for case in ("h_too_big", "h_negative"):
        assert "--speculative-disable-hysteresis" in out[case]["error"], out[case]
    assert out["parsed"] == [48, 6]
    assert out["parsed_default"] == [None, None]
    assert flag in out["bad_cli"] and "invalid int value" in out["bad_cli"]


def test_controller_hysteresis_and_logs(run_in_tree, patched):
    out = _run(run_in_tree, patched, '''
from sglang.srt.speculative.spec_disable import SpecDisableController
t = [0.0]
c = SpecDisableController(8, 2, clock=lambda: t[0], log_interval_s=5.0)
seq = [1, 8, 9, 8, 7, 6, 9, 12, 5, 6, 9]
OUT["plain"] = []
for bs in seq:
    OUT["plain"].append(c.step(bs)); t[0] += 1.0
OUT["snapshot"] = c.snapshot()
OUT["mode_logs"] = [l for l in CAP.lines if "Speculation mode ->" in l]
''')
    # > 8 -> plain; back only at <= 8 - 2 = 6
    assert out["plain"] == [False, False, True, True, True, False, True, True, False, False, True]
    assert out["snapshot"] == {"threshold": 8, "hysteresis": 2, "mode": "plain",
                               "speculative_steps": 5, "plain_steps": 6, "mode_changes": 5}
    # rate limited: changes at t=2, 5, 6, 8, 10 -> logged at 2 and 8 (5 s apart)
    assert len(out["mode_logs"]) == 2
    assert "not logged" in out["mode_logs"][1]


# A fake V2 worker around the REAL EAGLEWorkerV2 methods. Target: records the DECODE batch it
# is given and "samples" token 100 + request index; hidden states are per-token rows.
WORKER = '''
import torch
import sglang.srt.speculative.eagle_worker_v2 as ew
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.spec_disable import SpecDisableController
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.utils import GenerationBatchResult

STRIDE, H = 4, 6
SEEN = {}

def fake_init_new(batch, model_runner):      # replaces ForwardBatch.init_new (needs a live runner)
    SEEN["fb"] = dict(
        forward_mode=batch.forward_mode.name, input_ids=batch.input_ids.tolist(),
        out_cache_loc=batch.out_cache_loc.tolist(), seq_lens=batch.seq_lens.tolist(),
        seq_lens_cpu=batch.seq_lens_cpu.tolist(), seq_lens_sum=batch.seq_lens_sum,
        spec_info=batch.spec_info, capture_hidden_mode=batch.capture_hidden_mode.name)
    return NS(batch_size=len(batch.seq_lens))
ew.ForwardBatch = NS(init_new=fake_init_new)

class FakeRunner:
    def sample(self, logits_output, forward_batch):
        return 100 + torch.arange(forward_batch.batch_size, dtype=torch.int64)

class FakeTarget:
    model_runner = FakeRunner()
    def forward_batch_generation(self, model_worker_batch=None, forward_batch=None,
                                 is_verify=False, skip_attn_backend_init=False):
        assert model_worker_batch is None and is_verify
        bs = forward_batch.batch_size
        hs = torch.arange(bs * H, dtype=torch.float32).reshape(bs, H) + 1
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=torch.zeros(bs, 11),
                                                hidden_states=hs),
            can_run_cuda_graph=False)

class FakeDraft:
    draft_runner = NS(tp_group=None)
    calls = []
    def draft_tp_context(self, group):
        import contextlib; return contextlib.nullcontext()
    def _draft_extend_for_decode(self, batch, result):
        FakeDraft.calls.append(dict(out_cache_loc=batch.out_cache_loc.tolist(),
                                    seq_lens=batch.seq_lens.tolist(),
                                    forward_mode=batch.forward_mode.name,
                                    next_token_ids=result.next_token_ids.tolist(),
                                    accept_lens=result.accept_lens.tolist()))
        # what the real one leaves for the future map
        d = result.next_draft_input
        d.topk_p = torch.ones(len(batch.seq_lens), 1)
        d.topk_index = torch.zeros(len(batch.seq_lens), 1, dtype=torch.int64)
        d.hidden_states = torch.zeros(len(batch.seq_lens), H)
    def draft(self, batch):
        raise AssertionError("draft must not run on a plain step")

def make_worker(threshold, hysteresis=0):
    w = object.__new__(ew.EAGLEWorkerV2)
    w.speculative_num_draft_tokens = STRIDE
    w.speculative_num_steps = STRIDE - 1
    w.topk = 1
    w.device = "cpu"
    w.enable_nan_detection = False
    w._target_worker = FakeTarget()
    w._draft_worker = FakeDraft()
    # req_to_token: request pool row r holds slots 1000*r + position
    w.req_to_token_pool = NS(req_to_token=(torch.arange(4)[:, None] * 1000
                                           + torch.arange(64)[None, :]).to(torch.int32))
    w.server_args = NS(speculative_disable_batch_threshold=threshold,
                       speculative_disable_hysteresis=hysteresis)
    w._init_spec_disable()
    w.verify = lambda batch: (_ for _ in ()).throw(AssertionError("verify must not run"))
    return w

def make_batch():
    from sglang.srt.managers.schedule_batch import ModelWorkerBatch
    import dataclasses
    kw = {f.name: None for f in dataclasses.fields(ModelWorkerBatch)
          if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    b = ModelWorkerBatch(**kw)
    b.forward_mode = ForwardMode.DECODE
    b.req_pool_indices = torch.tensor([2, 0, 3], dtype=torch.int64)
    b.seq_lens = torch.tensor([10, 5, 7], dtype=torch.int64)      # committed lengths L
    b.seq_lens_cpu = b.seq_lens.clone(); b.seq_lens_sum = 22
    b.orig_seq_lens = b.seq_lens.clone()
    b.input_ids = torch.tensor([0, 0, 0]); b.out_cache_loc = None
    b.capture_hidden_mode = CaptureHiddenMode.LAST
    b.is_extend_in_batch = False
    b.spec_info = EagleDraftInput(verified_id=torch.tensor([7, 8, 9], dtype=torch.int32))
    return b
'''


def test_plain_step_result_shape(run_in_tree, patched):
    out = _run(run_in_tree, patched, WORKER + '''
w = make_worker(threshold=2)
OUT["start_line"] = [l for l in CAP.lines if l.startswith("Dynamic speculation disable enabled")]
b = make_batch()
res = w.forward_batch_generation(b)          # bs 3 > 2 -> plain
OUT["fb"] = {k: v for k, v in SEEN["fb"].items() if k != "spec_info"}
OUT["fb_spec_info_is_none"] = SEEN["fb"]["spec_info"] is None
OUT["draft_extend"] = FakeDraft.calls
OUT["next_token_ids"] = res.next_token_ids.tolist()
OUT["next_token_dtype"] = str(res.next_token_ids.dtype)
OUT["accept_lens"] = res.accept_lens.tolist()
OUT["accept_dtype"] = str(res.accept_lens.dtype)
OUT["hidden_shape"] = list(res.logits_output.hidden_states.shape)
OUT["hidden_rows_nonzero"] = [int(r.abs().sum() > 0) for r in res.logits_output.hidden_states]
d = res.next_draft_input
OUT["verified_id"] = d.verified_id.tolist(); OUT["verified_dtype"] = str(d.verified_id.dtype)
OUT["new_seq_lens"] = d.new_seq_lens.tolist()
OUT["has_event"] = d.verify_done is not None
OUT["restored"] = dict(seq_lens=b.seq_lens.tolist(), seq_lens_cpu=b.seq_lens_cpu.tolist(),
                       seq_lens_sum=b.seq_lens_sum, mode=b.forward_mode.name,
                       orig=b.orig_seq_lens.tolist())
OUT["snapshot"] = w.spec_disable.snapshot()

# The overlap scheduler's consumers, real 0.5.9 code:
# 1) FutureMap stores next_draft_input (all must be real tensors)
from sglang.srt.managers.overlap_utils import FutureMap
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
import sglang.srt.managers.overlap_utils as ou
ou.spec_need_hidden_states = lambda: True
fm = FutureMap(4, 8, 32, torch.device("cpu"), SpeculativeAlgorithm.EAGLE3)
idx = fm.alloc_future_indices(3)
fm.store_to_map(idx, res)
OUT["future_verified"] = fm.verified_id_buf[idx.indices].tolist()
OUT["future_seq_lens"] = fm.new_seq_lens_buf[idx.indices].tolist()
# 2) the output processor's token resolution (stride = speculative_num_draft_tokens)
from sglang.srt.managers.scheduler import Scheduler
res.copy_done = torch.cpu.Event()
res.copy_to_cpu(return_logprob=False)
reqs = [NS(kv_committed_len=L, spec_verify_ct=0, spec_accepted_tokens=0,
           update_spec_acceptance_histogram=lambda n: None) for L in (10, 5, 7)]
fake_sched = NS(draft_worker=NS(speculative_num_draft_tokens=STRIDE))
tokens = Scheduler._resolve_spec_overlap_token_ids(fake_sched, res, NS(reqs=reqs))
OUT["resolved_tokens"] = tokens
OUT["committed"] = [r.kv_committed_len for r in reqs]
OUT["num_accepted"] = res.num_accepted_tokens
''')
    assert out["start_line"] == ["Dynamic speculation disable enabled: threshold=2"]
    # the target saw a plain DECODE batch: verified ids at position L, slot req_to_token[r, L]
    assert out["fb"] == {
        "forward_mode": "DECODE", "input_ids": [7, 8, 9],
        "out_cache_loc": [2010, 5, 3007], "seq_lens": [11, 6, 8], "seq_lens_cpu": [11, 6, 8],
        "seq_lens_sum": 25, "capture_hidden_mode": "FULL"}
    assert out["fb_spec_info_is_none"]
    # then the existing draft extend ran on the verify-shaped result, with the stride slots
    assert out["draft_extend"] == [{
        "out_cache_loc": [2010, 2011, 2012, 2013, 5, 6, 7, 8, 3007, 3008, 3009, 3010],
        "seq_lens": [10, 5, 7], "forward_mode": "DECODE",
        "next_token_ids": [100, 0, 0, 0, 101, 0, 0, 0, 102, 0, 0, 0],
        "accept_lens": [1, 1, 1]}]
    assert out["next_token_dtype"] == "torch.int32" and out["accept_dtype"] == "torch.int32"
    assert out["hidden_shape"] == [12, 6]
    assert out["hidden_rows_nonzero"] == [1, 0, 0, 0] * 3
    assert out["verified_id"] == [100, 101, 102] and out["verified_dtype"] == "torch.int32"
    assert out["new_seq_lens"] == [11, 6, 8] and out["has_event"]
    assert out["restored"] == {"seq_lens": [10, 5, 7], "seq_lens_cpu": [10, 5, 7],
                               "seq_lens_sum": 22, "mode": "DECODE", "orig": [10, 5, 7]}
    assert out["snapshot"]["plain_steps"] == 1 and out["snapshot"]["mode"] == "plain"
    assert out["future_verified"] == [100, 101, 102] and out["future_seq_lens"] == [11, 6, 8]
    assert out["resolved_tokens"] == [[100], [101], [102]]
    assert out["committed"] == [11, 6, 8] and out["num_accepted"] == 0


def test_speculative_step_when_small_and_hysteresis(run_in_tree, patched):
    out = _run(run_in_tree, patched, WORKER + '''
w = make_worker(threshold=2, hysteresis=1)
calls = []
def spec_path(batch):
    calls.append("spec")
    raise StopIteration   # stop right after the decision: the draft would run here
w._draft_worker.draft = spec_path
def run(bs_keep, mode=ForwardMode.DECODE):
    b = make_batch()
    b.forward_mode = mode
    for name in ("req_pool_indices", "seq_lens", "seq_lens_cpu", "orig_seq_lens"):
        setattr(b, name, getattr(b, name)[:bs_keep])
    b.seq_lens_sum = int(b.seq_lens.sum())
    b.spec_info.verified_id = b.spec_info.verified_id[:bs_keep]
    try:
        w.forward_batch_generation(b); calls.append("plain")
    except StopIteration:
        pass
for bs in (2, 3, 2, 1, 3):
    run(bs)
OUT["calls"] = calls
OUT["snapshot"] = w.spec_disable.snapshot()
''')
    # N=2, H=1: bs 2 spec, 3 plain, 2 still plain (back only at <= 1), 1 spec, 3 plain
    assert out["calls"] == ["spec", "plain", "plain", "spec", "plain"]
    assert out["snapshot"]["mode_changes"] == 3


def test_cuda_graph_guard(run_in_tree, patched, pristine):
    probe = '''
import torch
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
r = object.__new__(CudaGraphRunner)
r.require_mlp_tp_gather = False; r.enable_pdmux = False; r.disable_padding = False
r.max_bs = 8; r.graphs = {}; r.require_mlp_sync = False; r.is_encoder_decoder = False
r.capture_hidden_mode = CaptureHiddenMode.FULL; r.enable_two_batch_overlap = False
r.model_runner = NS(spec_algorithm=SpeculativeAlgorithm.EAGLE3)
r.capture_forward_mode = ForwardMode.TARGET_VERIFY    # a speculative target's graphs
def fb(mode):
    return NS(forward_mode=mode, batch_size=4, capture_hidden_mode=CaptureHiddenMode.FULL,
              spec_info=None, input_ids=torch.zeros(4))
OUT["decode_on_verify_graph"] = bool(r.can_run(fb(ForwardMode.DECODE)))
OUT["verify_on_verify_graph"] = bool(r.can_run(fb(ForwardMode.TARGET_VERIFY)))
OUT["idle_on_verify_graph"] = bool(r.can_run(fb(ForwardMode.IDLE)))
r.capture_forward_mode = ForwardMode.DECODE           # a non-speculative server
OUT["decode_on_decode_graph"] = bool(r.can_run(fb(ForwardMode.DECODE)))
'''
    new = _run(run_in_tree, patched, probe)
    old = _run(run_in_tree, pristine, probe)
    assert old["decode_on_verify_graph"] is True      # the 0.5.9 hazard: verify graph for DECODE
    assert new["decode_on_verify_graph"] is False
    for key in ("verify_on_verify_graph", "idle_on_verify_graph", "decode_on_decode_graph"):
        assert new[key] is True and old[key] is True, key


def test_metrics_and_server_info(run_in_tree, patched):
    out = _run(run_in_tree, patched, '''
import tempfile
from sglang.srt.metrics.collector import SchedulerMetricsCollector
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.speculative.spec_disable import SpecDisableController
import prometheus_client
import dataclasses
from sglang.srt.server_args import ServerArgs
sa = object.__new__(ServerArgs)      # defaults only (no __post_init__: no model, no device)
for f in dataclasses.fields(ServerArgs):
    if f.default is not dataclasses.MISSING:
        setattr(sa, f.name, f.default)
    elif f.default_factory is not dataclasses.MISSING:
        setattr(sa, f.name, f.default_factory())
c = SchedulerMetricsCollector(labels={"model_name": "m", "engine_type": "unified", "tp_rank": 0,
                                      "pp_rank": 0, "moe_ep_rank": 0}, server_args=sa)
ctl = SpecDisableController(4, 1)
sched = NS(server_args=NS(speculative_disable_batch_threshold=4), draft_worker=NS(spec_disable=ctl),
           enable_metrics=True, current_scheduler_metrics_enabled=True, metrics_collector=c)
Scheduler.init_spec_disable(sched)
for bs in (1, 2, 6, 7, 5, 2):      # N=4, H=1: s s p p p(5 > 3) s
    ctl.step(bs)
c.observe_spec_disable(*ctl.take_metric_deltas())
text = prometheus_client.generate_latest().decode()
OUT["metrics"] = sorted(l for l in text.splitlines()
                        if l.startswith("sglang:spec_disable") and "_created" not in l)
# a worker without the feature (e.g. V1 EAGLEWorker) is refused at scheduler start
bad = NS(server_args=NS(speculative_disable_batch_threshold=4), draft_worker=NS(),
         enable_metrics=False, current_scheduler_metrics_enabled=False)
try:
    Scheduler.init_spec_disable(bad); OUT["refused"] = None
except ValueError as e:
    OUT["refused"] = str(e)
OUT["snapshot"] = ctl.snapshot()
''')
    values = {line.split("{")[0]: line.rsplit(" ", 1)[1] for line in out["metrics"]}
    assert values == {"sglang:spec_disable_plain_mode": "0.0",
                      "sglang:spec_disable_speculative_steps_total": "3.0",
                      "sglang:spec_disable_plain_steps_total": "3.0"}, out["metrics"]
    assert "--speculative-disable-batch-threshold" in out["refused"]
    assert "SGLANG_ENABLE_SPEC_V2=True" in out["refused"]
    assert out["snapshot"] == {"threshold": 4, "hysteresis": 1, "mode": "speculative",
                               "speculative_steps": 3, "plain_steps": 3, "mode_changes": 2}


def test_unpatched_tree_has_none_of_it(run_in_tree, pristine):
    out = _run(run_in_tree, pristine, '''
import argparse, contextlib, io, dataclasses
from sglang.srt.server_args import ServerArgs
OUT["field"] = any(f.name == "speculative_disable_batch_threshold" for f in dataclasses.fields(ServerArgs))
parser = argparse.ArgumentParser(); ServerArgs.add_cli_args(parser)
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        parser.parse_args(["--model-path", "m", "--speculative-disable-batch-threshold", "8"])
        OUT["cli"] = "accepted"
    except SystemExit:
        OUT["cli"] = err.getvalue()
import sglang.srt.speculative.eagle_worker_v2 as ew
OUT["plain_step"] = hasattr(ew.EAGLEWorkerV2, "_forward_plain_decode")
''')
    assert out["field"] is False and out["plain_step"] is False
    assert "unrecognized arguments" in out["cli"]
