"""SM120 patches (patches/<flavor>/sm120-*.patch): the gates choose the intended path.

Each test runs the same probe in its own process against the PATCHED tree and the UNPATCHED
(pristine) tree of a flavor, with the device capability faked as (12, 0), (10, 0) and (9, 0),
and asserts both the intended patched behaviour and that it differs from the pristine wheel.
A patch that a flavor dropped has a test showing that flavor's unpatched wheel already behaves,
where the older wheel does not.

Fakes (kept minimal; all live inside the probe's subprocess):
- torch.cuda.is_available / torch.version.cuda / torch.cuda.get_device_capability /
  device_count / get_device_name: this CPU machine has no GPU; sglang's gates
  (utils.common._check_cuda_device_version, get_device_sm, get_device_name) read exactly these.
  They are faked AFTER the real modules are imported (importing with a fake GPU would try to
  load GPU-only kernels), and the lru_caches of sglang.srt.utils.common are cleared per
  capability. Module-level constants (communicator._is_sm*_supported, DEEPGEMM_*) are
  re-evaluated with importlib.reload.
- Per test, the few objects that only exist inside a running server or on a GPU are named
  where they are faked (runtime context, process group, symmetric-memory allocator, CUDA
  driver bindings).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_image import fetch
from tests.probe import probe_result

FLAVORS = ["sglang-0.5.17", "sglang-0.5.9"]
CAPS = ["12.0", "10.0", "9.0"]

PRELUDE = textwrap.dedent(
    """
    import importlib, json, logging, sys, types
    from types import SimpleNamespace as NS
    import torch

    # Import the real modules while torch is honestly CPU-only.
    import sglang.srt.server_args  # noqa: F401
    {imports}

    CAP = [(9, 0)]
    torch.cuda.is_available = lambda: True           # fake: see module docstring
    torch.version.cuda = "13.0"                      # fake: gates compare it to 12.8
    torch.cuda.get_device_capability = lambda device=None: CAP[0]
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_name = lambda device=None: "FAKE GPU"
    import sglang.srt.utils.common as _common

    def set_cap(cap):
        CAP[0] = tuple(int(x) for x in cap.split("."))
        for name in dir(_common):
            fn = getattr(_common, name)
            if hasattr(fn, "cache_clear"):
                fn.cache_clear()

    class Capture(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.lines = []
        def emit(self, record):
            self.lines.append(record.levelname + " " + record.getMessage())

    CAPTURE = Capture()
    logging.getLogger().addHandler(CAPTURE)
    logging.getLogger().setLevel(logging.DEBUG)

    def logs():
        lines, CAPTURE.lines[:] = list(CAPTURE.lines), []
        return lines

    def attempt(fn):
        try:
            return {{"ok": fn()}}
        except Exception as e:  # the probe records the failure mode
            return {{"error": type(e).__name__, "msg": str(e)[:200]}}

    OUT = {{}}
    """
)
EPILOGUE = '\nprint("RESULT " + json.dumps(OUT, default=str))\n'


@pytest.fixture(scope="module")
def run_in_tree(run_in_tree, forked_in_tree):
    """This module's probes fork from one warm interpreter per tree (tests/forkserver.py; the
    session's, conftest's forked_in_tree) that has imported what every probe imports first, torch
    and sglang.srt.server_args, with torch honestly CPU-only; each probe fakes the GPU in its own
    child. A probe with its own PYTHONPATH runs in a fresh interpreter (conftest's run_in_tree): a
    fork keeps the server's path."""
    fresh = run_in_tree

    def run(tree, code, env=None, timeout=600):
        if env:
            return fresh(tree, code, env=env, timeout=timeout)
        return forked_in_tree(tree, code, timeout=timeout)

    return run


def probe(sglang_tree, run_in_tree, flavor: str, patched: bool, body: str,
          imports: str = "") -> dict:
    code = PRELUDE.format(imports=imports) + textwrap.dedent(body) + EPILOGUE
    return probe_result(run_in_tree(sglang_tree(flavor, patched), code, timeout=600),
                        what=f"probe ({flavor}, patched={patched})")


def both(sglang_tree, run_in_tree, flavor, body, imports=""):
    """(patched, unpatched) results; the two subprocesses run side by side."""
    trees = {p: sglang_tree(flavor, p) for p in (True, False)}  # build trees in this thread
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(probe, lambda f, p: trees[p], run_in_tree, flavor, p, body,
                               imports) for p in (True, False)]
        return futures[0].result(), futures[1].result()


# --------------------------------------------------------------------------- sm120-support.patch

# Where each flavor decides Olmo2's attention backend (0.5.23 moved it to a per-model module).
OLMO2_OVERRIDES = {
    "sglang-0.5.17": "from sglang.srt.arg_groups.overrides import _olmo2_overrides",
    "sglang-0.5.23": "from sglang.srt.arg_groups.model_overrides.olmo2 import _olmo2_overrides",
}
SUPPORT_OLMO2 = """
for cap in CAPS:
    set_cap(cap)
    sa = NS(attention_backend=None)
    hf = NS(architectures=["Olmo2ForCausalLM"])
    OUT["olmo2/" + cap] = _olmo2_overrides(sa, hf).get("attention_backend")
"""


@pytest.mark.parametrize("flavor", sorted(OLMO2_OVERRIDES))
def test_support_olmo2_attention_backend(sglang_tree, run_in_tree, flavor):
    body = f"CAPS = {CAPS!r}\n" + OLMO2_OVERRIDES[flavor] + "\n" + SUPPORT_OLMO2
    new, old = both(sglang_tree, run_in_tree, flavor, body)
    assert new["olmo2/12.0"] == "triton"
    assert new["olmo2/10.0"] == "trtllm_mha" and new["olmo2/9.0"] == "fa3"
    # the pristine wheel picks fa3 on SM120, whose backend asserts major 8 or 9
    assert old["olmo2/12.0"] == "fa3"
    assert old["olmo2/10.0"] == new["olmo2/10.0"] and old["olmo2/9.0"] == new["olmo2/9.0"]


DEEPGEMM = """
import sglang.srt.layers.deep_gemm_wrapper.configurer as dg
import deep_gemm  # the flavor's pinned sgl-deep-gemm wheel (imports without a GPU)
REAL = deep_gemm
OLD = types.ModuleType("deep_gemm")  # a build without the SM120 kernels' entry points
OLD.fp8_einsum = lambda *a: None
for cap in CAPS:
    set_cap(cap)
    for name, module in (("", REAL), ("no_sm120_apis/", OLD)):
        sys.modules["deep_gemm"] = module
        m = importlib.reload(dg)
        OUT[name + "enabled/" + cap] = m.ENABLE_JIT_DEEPGEMM
        OUT[name + "blackwell/" + cap] = m.DEEPGEMM_BLACKWELL
        OUT[name + "ue8m0/" + cap] = getattr(m, "DEEPGEMM_SCALE_UE8M0", None)
"""


@pytest.fixture(scope="module")
def deep_gemm_dir(tmp_path_factory):
    """Factory: the flavor's pinned sgl-deep-gemm wheel, unpacked on its own (hash-checked)."""
    from sglang_image import pins, trees

    made = {}

    def make(flavor):
        if flavor not in made:
            dest = tmp_path_factory.mktemp("deep_gemm")
            with tempfile.TemporaryDirectory() as tmp:
                wheels = fetch.fetch_wheels(pins.load_flavor(flavor), Path(tmp), only=["sgl-deep-gemm"])
                trees.unpack_wheels(wheels, dest)
            made[flavor] = dest
        return made[flavor]

    return make


@pytest.mark.parametrize("flavor", ["sglang-0.5.17", "sglang-0.5.23"])
def test_support_deepgemm_on_sm120_is_what_the_series_assumes(sglang_tree, run_in_tree,
                                                               deep_gemm_dir, flavor):
    """sm120-support leaves DeepGEMM to upstream, with the flavor's pinned sgl-deep-gemm (which
    imports without a GPU): 0.5.17 keeps it off on SM120; 0.5.23 enables it there when deep_gemm has
    the SM120 entry points, which the pinned wheel has. The SM100-only flag stays off on SM120."""
    extra = deep_gemm_dir(flavor)
    tree = sglang_tree(flavor, True)
    code = PRELUDE.format(imports="") + f"CAPS = {CAPS!r}\n" + textwrap.dedent(DEEPGEMM) + EPILOGUE
    out = probe_result(run_in_tree(tree, code, env={"PYTHONPATH": f"{tree}:{extra}"}))
    assert out["blackwell/12.0"] is False
    assert out["enabled/10.0"] is True and out["blackwell/10.0"] is True
    assert out["enabled/9.0"] is True and out["blackwell/9.0"] is False
    if flavor == "sglang-0.5.17":
        assert out["enabled/12.0"] is False and out["no_sm120_apis/enabled/12.0"] is False
    else:
        assert out["enabled/12.0"] is True and out["ue8m0/12.0"] is True
        assert out["no_sm120_apis/enabled/12.0"] is False  # a deep_gemm without SM120 kernels: off
        assert out["no_sm120_apis/enabled/9.0"] is True  # that probe is SM120's only


# ServerArgs with its field defaults and without __post_init__ (which would load a model).
FRESH_ARGS = """
from sglang.srt.server_args import ServerArgs
import dataclasses

def fresh_args(**kw):
    sa = object.__new__(ServerArgs)  # skip __post_init__ (it would load a model)
    for f in dataclasses.fields(ServerArgs):
        if f.default is not dataclasses.MISSING:
            setattr(sa, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(sa, f.name, f.default_factory())
    sa.model_path = "dummy-model"
    for k, v in kw.items():
        setattr(sa, k, v)
    return sa
"""

SUPPORT_059 = """
import sglang.srt.layers.deep_gemm_wrapper.configurer as dg
# fake: deep_gemm is a GPU-only package; the gate only checks that it imports.
sys.modules["deep_gemm"] = types.ModuleType("deep_gemm")
""" + FRESH_ARGS + """

def adjust(hf, **kw):
    sa = fresh_args(**kw)
    sa.get_model_config = lambda: NS(hf_config=hf)  # fake: no model on disk
    ServerArgs._handle_model_specific_adjustments(sa)
    return sa

from sglang.srt.layers.attention import attention_registry as reg
import sglang.srt.layers.attention.fla.utils as fla_utils
# fakes: the real hybrid_linear_attn_backend module needs sgl_kernel (GPU-only) and its
# backends allocate GPU state; check_environments probes the GPU toolchain. Recording the
# GDN backend construction is all the assert test needs.
BUILT = []
hlab = types.ModuleType("sglang.srt.layers.attention.hybrid_linear_attn_backend")
hlab.GDNAttnBackend = lambda runner: BUILT.append("gdn") or "gdn"
hlab.HybridLinearAttnBackend = lambda full, linear, layers: ("hybrid", linear)
for _n in ("KimiLinearAttnBackend", "LightningAttentionBackend", "Mamba2AttnBackend"):
    setattr(hlab, _n, object)
sys.modules[hlab.__name__] = hlab
fla_utils.check_environments = lambda: None

def gdn(backend):
    # fake runner: only the fields attn_backend_wrapper reads
    runner = NS(hybrid_gdn_config=object(), use_mla_backend=False,
                mambaish_config=NS(full_attention_layer_ids=[0]),
                server_args=NS(attention_backend=backend))
    BUILT[:] = []
    try:
        reg.attn_backend_wrapper(runner, object())
    except AssertionError:
        return "rejected"
    return "accepted" if BUILT == ["gdn"] else "not-built"

for cap in CAPS:
    set_cap(cap)
    m = importlib.reload(dg)
    OUT["deepgemm/" + cap] = m.ENABLE_JIT_DEEPGEMM
    OUT["deepgemm_blackwell/" + cap] = m.DEEPGEMM_BLACKWELL
    oss = NS(architectures=["GptOssForCausalLM"], quantization_config={"quant_method": "mxfp4"})
    OUT["gptoss_moe/" + cap] = attempt(lambda: adjust(oss).moe_runner_backend)
    olmo = NS(architectures=["Olmo2ForCausalLM"])
    OUT["olmo2/" + cap] = attempt(lambda: adjust(olmo).attention_backend)
    OUT["gdn_flashinfer/" + cap] = gdn("flashinfer")
    OUT["gdn_triton/" + cap] = gdn("triton")
"""


def test_support_059_gates(sglang_tree, run_in_tree):
    body = f"CAPS = {CAPS!r}\n" + SUPPORT_059
    new, old = both(sglang_tree, run_in_tree, "sglang-0.5.9", body, imports=(
        "import sglang.srt.configs.model_config, sglang.srt.layers.attention.attention_registry"))
    # DeepGEMM: off on SM120, SM100-only flag uses is_sm100_supported()
    assert new["deepgemm/12.0"] is False and old["deepgemm/12.0"] is True
    assert new["deepgemm_blackwell/12.0"] is False and old["deepgemm_blackwell/12.0"] is True
    assert new["deepgemm/10.0"] is True and new["deepgemm_blackwell/10.0"] is True
    assert new["deepgemm/9.0"] is True and new["deepgemm_blackwell/9.0"] is False
    # GPT-OSS MXFP4: flashinfer_mxfp4 (SM100-only trtllm-gen) only on SM100
    assert old["gptoss_moe/12.0"] == {"ok": "flashinfer_mxfp4"}
    assert new["gptoss_moe/12.0"]["ok"] != "flashinfer_mxfp4"
    assert new["gptoss_moe/10.0"] == old["gptoss_moe/10.0"] == {"ok": "flashinfer_mxfp4"}
    assert new["gptoss_moe/9.0"] == old["gptoss_moe/9.0"]
    # Olmo2: no fa3 on SM120
    assert old["olmo2/12.0"] == {"ok": "fa3"} and new["olmo2/12.0"] == {"ok": "triton"}
    assert new["olmo2/10.0"] == {"ok": "trtllm_mha"} and new["olmo2/9.0"] == {"ok": "fa3"}
    # hybrid GDN: flashinfer (SM120's default) accepted on SM120 only
    assert old["gdn_flashinfer/12.0"] == "rejected" and new["gdn_flashinfer/12.0"] == "accepted"
    assert new["gdn_flashinfer/10.0"] == old["gdn_flashinfer/10.0"] == "rejected"
    assert new["gdn_triton/12.0"] == "accepted" and new["gdn_triton/10.0"] == "accepted"


# ------------------------------------------------------------ sm120-flashinfer-allreduce-fusion

FUSION_DRIVER = """
class Drv:  # fake CUDA driver bindings (cuda-python is GPU-only): just the calls made
    class CUresult:
        CUDA_SUCCESS = 0
        CUDA_ERROR_NOT_SUPPORTED = 801
    class CUmemAllocationGranularity_flags:
        CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
    class CUmulticastGranularity_flags:
        CU_MULTICAST_GRANULARITY_RECOMMENDED = 1
    class CUmulticastObjectProp:
        pass
    @staticmethod
    def cuMemGetAllocationGranularity(prop, flag):
        return 0, 2 << 20
    @staticmethod
    def cuMulticastGetGranularity(prop, flag):
        return 801, 0  # PCIe board / NVLS off: multicast not supported

"""

FUSION_0517 = """
import sglang.srt.layers.communicator as comm_mod
import sglang.srt.layers.flashinfer_comm_fusion as fcf
from sglang.srt.arg_groups import overrides as o

""" + FUSION_DRIVER + """
for cap in CAPS:
    set_cap(cap)
    c = importlib.reload(comm_mod)
    # fakes: runtime context and DP-attention state exist only in a running server;
    # flashinfer's availability probe needs a GPU.
    c.get_exec = lambda: NS(comm=NS(flashinfer_allreduce_fusion_backend="auto"))
    c.is_dp_attention_enabled = lambda: False
    c._is_flashinfer_available = True
    c.is_flashinfer_allreduce_unavailable = lambda: False
    OUT["gate/" + cap] = c.apply_flashinfer_allreduce_fusion(8)
    OUT["resolve_auto/" + cap] = attempt(lambda: fcf._resolve_backend("auto"))
    OUT["resolve_mnnvl/" + cap] = attempt(lambda: fcf._resolve_backend("mnnvl"))
    OUT["preflight_no_multicast/" + cap] = attempt(
        lambda: fcf._flashinfer_trtllm_workspace_allocation_sizes(
            Drv, NS(requestedHandleTypes=1), 2, 128, 4096, torch.bfloat16))
    hf = NS(architectures=["Qwen3MoeForCausalLM"])
    view = dict(flashinfer_allreduce_fusion_backend=None, tp_size=2, enable_dp_attention=False,
                nnodes=1, moe_a2a_backend="none", get_model_config=lambda: NS(hf_config=hf),
                enforce_disable_flashinfer_allreduce_fusion=False)
    OUT["auto_enable/" + cap] = o._flashinfer_allreduce_fusion_auto_enable(NS(**view))
    o.is_flashinfer_available = lambda: True  # fake: needs a GPU
    logs()
    o._enforce_disable_allreduce_fusion(NS(**dict(view, flashinfer_allreduce_fusion_backend="auto", tp_size=1)))
    OUT["warn_tp1/" + cap] = [l for l in logs() if l.startswith("WARNING")]
    o._enforce_disable_allreduce_fusion(NS(**dict(view, flashinfer_allreduce_fusion_backend="auto")))
    OUT["warn_tp2/" + cap] = [l for l in logs() if l.startswith("WARNING")]
"""


def assert_fusion_gate_backend_preflight_warning(new: dict, old: dict) -> None:
    """What the allreduce-fusion patch changes, patched (`new`) against pristine (`old`), in every
    flavor it has: the gate, the backend choice, the workspace preflight, auto-enable, the warning."""
    # gate: SM120 admitted when requested, SM90/SM100 unchanged
    assert new["gate/12.0"] is True and old["gate/12.0"] is False
    assert new["gate/10.0"] is old["gate/10.0"] is True
    assert new["gate/9.0"] is old["gate/9.0"] is True
    # backend: SM120 auto -> trtllm (pristine raised); mnnvl still refused on SM120
    assert new["resolve_auto/12.0"] == {"ok": "trtllm"}
    assert old["resolve_auto/12.0"]["error"] == "ValueError"
    assert new["resolve_auto/10.0"] == old["resolve_auto/10.0"] == {"ok": "mnnvl"}
    assert new["resolve_auto/9.0"] == old["resolve_auto/9.0"] == {"ok": "trtllm"}
    assert new["resolve_mnnvl/12.0"]["error"] == "ValueError"
    # preflight: no multicast granularity is not an error any more
    assert "ok" in new["preflight_no_multicast/12.0"]
    assert old["preflight_no_multicast/12.0"]["error"] == "RuntimeError"
    # opt-in only: never auto-enabled on SM120, auto-enable on SM90/SM100 unchanged
    assert new["auto_enable/12.0"] == old["auto_enable/12.0"] == {}
    for cap in ("10.0", "9.0"):
        assert new["auto_enable/" + cap] == old["auto_enable/" + cap] == {
            "flashinfer_allreduce_fusion_backend": "auto"}
    # flag given but cannot apply: a warning (pristine: silent)
    for cap in CAPS:
        assert any("will NOT be applied" in l and "tensor parallelism is 1" in l
                   for l in new["warn_tp1/" + cap]), new["warn_tp1/" + cap]
        assert not any("will NOT be applied" in l for l in old["warn_tp1/" + cap])
        assert new["warn_tp2/" + cap] == []


def test_fusion_0517_gate_backend_preflight_warning(sglang_tree, run_in_tree):
    body = f"CAPS = {CAPS!r}\n" + FUSION_0517
    new, old = both(sglang_tree, run_in_tree, "sglang-0.5.17", body,
                    imports="import sglang.srt.layers.communicator")
    assert_fusion_gate_backend_preflight_warning(new, old)


FUSION_0523 = """
import sglang.srt.layers.layer_boundary.residual.add_norm as add_norm_mod
import sglang.srt.layers.flashinfer_comm_fusion as fcf
from sglang.srt.arg_groups import overrides as o
""" + FUSION_DRIVER + """
for cap in CAPS:
    set_cap(cap)
    a = importlib.reload(add_norm_mod)
    # fakes: runtime context and DP-attention state exist only in a running server;
    # flashinfer's availability probe needs a GPU.
    a.get_exec = lambda: NS(comm=NS(flashinfer_allreduce_fusion_backend="auto"))
    a.is_dp_attention_enabled = lambda: False
    a.uses_cutedsl_ar_fusion = lambda: False
    a._is_flashinfer_available = True
    a.is_flashinfer_allreduce_unavailable = lambda: False
    OUT["gate/" + cap] = a.flashinfer_ar_fusion_applies(8)
    OUT["resolve_auto/" + cap] = attempt(lambda: fcf._resolve_backend("auto"))
    OUT["resolve_mnnvl/" + cap] = attempt(lambda: fcf._resolve_backend("mnnvl"))
    OUT["resolve_cutedsl/" + cap] = attempt(lambda: fcf._resolve_backend("cutedsl"))
    OUT["preflight_no_multicast/" + cap] = attempt(
        lambda: fcf._flashinfer_trtllm_workspace_allocation_sizes(
            Drv, NS(requestedHandleTypes=1), 2, 128, 4096, torch.bfloat16))
    hf = NS(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=4096)
    view = dict(flashinfer_allreduce_fusion_backend=None, tp_size=2, attn_dp_size=1,
                ep_join_mode="none", nnodes=1, moe_a2a_backend="none",
                disable_custom_all_reduce=False,
                enforce_disable_flashinfer_allreduce_fusion=False)
    o.model_config_of = lambda v: NS(hf_config=hf)  # fake: a ModelConfig needs a model on disk
    OUT["auto_enable/" + cap] = o._flashinfer_allreduce_fusion_auto_enable(NS(**view))
    with override_platform(has_flashinfer=True):  # fake: flashinfer's probe needs a GPU
        logs()
        o._enforce_disable_allreduce_fusion(NS(**dict(view, flashinfer_allreduce_fusion_backend="auto", tp_size=1)))
        OUT["warn_tp1/" + cap] = [l for l in logs() if l.startswith("WARNING")]
        o._enforce_disable_allreduce_fusion(NS(**dict(view, flashinfer_allreduce_fusion_backend="auto", attn_dp_size=2)))
        OUT["warn_dp/" + cap] = [l for l in logs() if l.startswith("WARNING")]
        o._enforce_disable_allreduce_fusion(NS(**dict(view, flashinfer_allreduce_fusion_backend="auto")))
        OUT["warn_tp2/" + cap] = [l for l in logs() if l.startswith("WARNING")]
"""


def test_fusion_0523_gate_backend_preflight_warning(sglang_tree, run_in_tree):
    body = f"CAPS = {CAPS!r}\nfrom sglang.srt.runtime_context import override_platform\n" + FUSION_0523
    new, old = both(sglang_tree, run_in_tree, "sglang-0.5.23", body,
                    imports="import sglang.srt.layers.layer_boundary.residual.add_norm")
    assert_fusion_gate_backend_preflight_warning(new, old)
    # 0.5.23 also refuses cutedsl on SM120 and warns under DP attention
    assert new["resolve_cutedsl/12.0"]["error"] == "ValueError"
    for cap in CAPS:
        assert any("DP attention is enabled" in l for l in new["warn_dp/" + cap])
        assert not any("will NOT be applied" in l for l in old["warn_dp/" + cap])


FUSION_059 = """
import sglang.srt.layers.communicator as comm_mod
""" + FRESH_ARGS + """
_plain_fresh_args = fresh_args

def fresh_args(**kw):
    sa = _plain_fresh_args(**kw)
    sa.get_model_config = lambda: NS(hf_config=NS(architectures=["Qwen3MoeForCausalLM"]))
    return sa

import sglang.srt.server_args as sa_mod
sa_mod.is_flashinfer_available = lambda: True  # fake: needs a GPU
for cap in CAPS:
    set_cap(cap)
    c = importlib.reload(comm_mod)
    # fakes: global server args exist only in a running server; flashinfer probe needs a GPU
    c.get_global_server_args = lambda: NS(enable_flashinfer_allreduce_fusion=True)
    c.is_dp_attention_enabled = lambda: False
    c._is_flashinfer_available = True
    OUT["gate/" + cap] = c.apply_flashinfer_allreduce_fusion(8)
    sa = fresh_args(tp_size=2)
    ServerArgs._handle_model_specific_adjustments(sa)
    OUT["auto_enable/" + cap] = sa.enable_flashinfer_allreduce_fusion
    logs()
    sa = fresh_args(tp_size=1, enable_flashinfer_allreduce_fusion=True)
    ServerArgs._handle_model_specific_adjustments(sa)
    OUT["warn_tp1/" + cap] = [l for l in logs() if l.startswith("WARNING")]
"""


def test_fusion_059_gate_and_warning(sglang_tree, run_in_tree):
    body = f"CAPS = {CAPS!r}\n" + FUSION_059
    new, old = both(sglang_tree, run_in_tree, "sglang-0.5.9", body, imports=(
        "import sglang.srt.layers.communicator, sglang.srt.configs.model_config"))
    assert new["gate/12.0"] is True and old["gate/12.0"] is False
    assert new["gate/10.0"] is old["gate/10.0"] is True
    assert new["gate/9.0"] is old["gate/9.0"] is True
    assert new["auto_enable/12.0"] is False and old["auto_enable/12.0"] is False
    assert new["auto_enable/10.0"] is True and new["auto_enable/9.0"] is True
    for cap in CAPS:
        assert any("will NOT be applied" in l for l in new["warn_tp1/" + cap])
        assert not any("will NOT be applied" in l for l in old["warn_tp1/" + cap])


# ------------------------------------------------------------- sm120-flashinfer-trtllm-comm

FI_JIT = """
import flashinfer.jit.comm as jc
from flashinfer.compilation_context import CompilationContext
for cap in CAPS:
    set_cap(cap)
    # the shared context re-reads the (faked) capability
    jc.current_compilation_context.TARGET_CUDA_ARCHS = CompilationContext().TARGET_CUDA_ARCHS
    OUT["trtllm_comm/" + cap] = attempt(
        lambda: [f for f in jc.gen_trtllm_comm_module().extra_cuda_cflags if "gencode" in f])
"""


@pytest.mark.parametrize("flavor", FLAVORS)
def test_flashinfer_jit_trtllm_comm_sm120(sglang_tree, run_in_tree, flavor):
    body = f"CAPS = {CAPS!r}\n" + FI_JIT
    new, old = both(sglang_tree, run_in_tree, flavor, body, imports="import flashinfer.jit.comm")
    assert "No supported CUDA architectures" in old["trtllm_comm/12.0"]["msg"]
    assert any("sm_120" in f for f in new["trtllm_comm/12.0"]["ok"])
    for cap, sm in (("10.0", "sm_100"), ("9.0", "sm_90")):
        assert new["trtllm_comm/" + cap] == old["trtllm_comm/" + cap]
        assert any(sm in f for f in new["trtllm_comm/" + cap]["ok"])


def test_flashinfer_072_needs_no_trtllm_comm_patch(sglang_tree, run_in_tree):
    """Why 0.5.23's series has no sm120-flashinfer-trtllm-comm: its flashinfer (0.7.2, unpatched)
    builds the trtllm comm module for SM12x, where 0.5.17's (0.6.15.post1, unpatched) refuses."""
    body = f"CAPS = {CAPS!r}\n" + FI_JIT
    imports = "import flashinfer.jit.comm"
    with ThreadPoolExecutor(max_workers=2) as pool:
        trees = {f: sglang_tree(f, False) for f in ("sglang-0.5.23", "sglang-0.5.17")}
        new, old = pool.map(lambda f: probe(lambda *_: trees[f], run_in_tree, f, False, body, imports),
                            trees)
    assert any("sm_120" in f for f in new["trtllm_comm/12.0"]["ok"])
    assert "No supported CUDA architectures" in old["trtllm_comm/12.0"]["msg"]
    for cap, sm in (("10.0", "sm_100"), ("9.0", "sm_90")):
        assert any(sm in f for f in new["trtllm_comm/" + cap]["ok"])


ALLREDUCE_KERNELS = "flashinfer/data/include/flashinfer/comm/trtllm_allreduce.cuh"


def _arch_guards_on(source: str, arch: int, tmp_path: Path) -> list[bool]:
    """Which of the file's `#if ... __CUDA_ARCH__ ...` guards the C preprocessor keeps for `arch`."""
    guards = [ln for ln in source.splitlines() if ln.startswith("#if") and "__CUDA_ARCH__" in ln]
    probe = tmp_path / f"guards{arch}.c"
    probe.write_text("".join(f"{g}\nguard_{i}_on\n#endif\n" for i, g in enumerate(guards)))
    cpp = subprocess.run([shutil.which("cpp") or "cpp", "-P", f"-D__CUDA_ARCH__={arch}", str(probe)],
                         check=True, capture_output=True, text=True).stdout
    return [f"guard_{i}_on" in cpp for i in range(len(guards))]


def test_flashinfer_072_compiles_the_custom_all_reduce_kernels_for_sm120(sglang_tree, tmp_path):
    """Why 0.5.23's series no longer refuses trtllm_custom_all_reduce on SM12x: in flashinfer 0.7.2
    the kernels' arch guards keep the same bodies at __CUDA_ARCH__ 1200 as at 900; in 0.6.15.post1
    (0.5.17's pin, unpatched) some bodies compile empty on SM12x."""
    if shutil.which("cpp") is None:
        pytest.skip("no C preprocessor")
    for flavor, same in (("sglang-0.5.23", True), ("sglang-0.5.17", False)):
        source = (sglang_tree(flavor, False) / ALLREDUCE_KERNELS).read_text()
        on_sm90, on_sm120 = (_arch_guards_on(source, arch, tmp_path) for arch in (900, 1200))
        assert on_sm90 and all(on_sm90), flavor
        assert (on_sm120 == on_sm90) is same, (flavor, on_sm120)


HEADER = "flashinfer/data/include/flashinfer/comm/trtllm_allreduce_fusion.cuh"
CLAMP_RE = re.compile(r"(  int max_cluster_size = 8;.*?\n  int cluster_size;\n.*?\n  }\n)", re.DOTALL)
HARNESS = """
#include <cstdio>
int main() {
  int sms[] = {90, 100, 120};
  int tpts[] = {256, 512, 896, 1024, 1536, 2048, 4096};
  for (int SM : sms) for (int threads_per_token : tpts) {
%s
    std::printf("%%d %%d %%d\\n", SM, threads_per_token, cluster_size);
  }
}
"""


@pytest.mark.parametrize("flavor", FLAVORS)
def test_flashinfer_header_cluster_clamp(sglang_tree, flavor, tmp_path):
    new = (sglang_tree(flavor, True) / HEADER).read_text()
    old = (sglang_tree(flavor, False) / HEADER).read_text()
    assert "max_cluster_size" not in old and "cluster_size = 8;" in old
    assert "cfg.numAttrs = SM >= 90 ? ((SM >= 120 && cluster_size == 1) ? 1 : 2) : 0;" in new
    m = CLAMP_RE.search(new)
    assert m, "clamp block not found"
    gxx = shutil.which("g++") or shutil.which("c++")
    if gxx is None:
        pytest.skip("no C++ compiler to run the clamp logic")
    src = tmp_path / "clamp.cc"
    src.write_text(HARNESS % m.group(1))
    subprocess.run([gxx, "-std=c++17", "-o", str(tmp_path / "clamp"), str(src)], check=True)
    rows = subprocess.run([str(tmp_path / "clamp")], capture_output=True, text=True,
                          check=True).stdout.split("\n")
    got = {(int(a), int(b)): int(c) for a, b, c in (r.split() for r in rows if r)}
    for tpt in (256, 512, 896, 1024, 1536, 2048, 4096):
        assert got[(90, tpt)] == 8 and got[(100, tpt)] == 8  # SM90/SM100 unchanged
        # SM120: smallest cluster keeping a block <= 1024 threads
        assert got[(120, tpt)] == max(1, -(-tpt // 1024))


CUSTOM_AR = """
import flashinfer.comm.trtllm_ar as ar
LAUNCHED = []
# fake: the JIT module (its build needs nvcc and a GPU); records what would be launched
ar.get_trtllm_comm_module = lambda: NS(trtllm_custom_all_reduce=lambda *a: LAUNCHED.append(len(a)))
inp = NS(is_cuda=True, device="cuda:0")  # fake: a CUDA tensor; the kernel is never run here
args = [inp] + [None] * 40
for cap in CAPS:
    set_cap(cap)
    LAUNCHED[:] = []
    OUT[cap] = attempt(lambda: ar.trtllm_custom_all_reduce(*args[:ar_nargs]) or "launched")
    OUT["launched/" + cap] = bool(LAUNCHED)
"""


@pytest.mark.parametrize("flavor", FLAVORS)
def test_flashinfer_custom_all_reduce_refuses_sm12x(sglang_tree, run_in_tree, flavor):
    """The non-fused custom all-reduce kernels compile to empty bodies on SM12x in these flashinfer
    releases: the patched wheel refuses before launching; the pristine one launches them."""
    body = (f"CAPS = {CAPS!r}\nimport inspect\nimport flashinfer.comm.trtllm_ar as _ar\n"
            "ar_nargs = len(inspect.signature(_ar.trtllm_custom_all_reduce).parameters)\n" + CUSTOM_AR)
    new, old = both(sglang_tree, run_in_tree, flavor, body, imports="import flashinfer.comm.trtllm_ar")
    assert new["12.0"]["error"] == "NotImplementedError" and "SM12x" in new["12.0"]["msg"]
    assert new["launched/12.0"] is False
    assert old["12.0"] == {"ok": "launched"} and old["launched/12.0"] is True
    for cap in ("10.0", "9.0"):
        assert new[cap] == old[cap] == {"ok": "launched"}


# ----------------------------------------------------------------- sm120-torch-symm-mem.patch

SYMM = """
import torch.distributed as dist
import sglang.srt.distributed.device_communicators.torch_symm_mem as sm
from sglang.srt.distributed.device_communicators.all_reduce_utils import (
    TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES as SIZES)

CALLS = []
# fakes: no symmetric-memory allocator, process group or P2P on a CPU box. The communicator
# only needs buffer allocation, a rendezvous handle's multicast_ptr, the group size, the
# peers' device ids and can_device_access_peer.
sm.torch_symm_mem_available = True
# 0.5.17 reads the runtime context (exists only in a running server) on SM90/SM100
sm.get_exec = lambda: NS(comm=NS(enable_scattered_sconv=False))
torch.cuda.set_device = lambda d: None
torch.cuda.current_device = lambda: 0
torch.ops.symm_mem = NS(
    multimem_all_reduce_=lambda buf, op, name: CALLS.append("multimem"),
    two_shot_all_reduce_=lambda buf, op, name: CALLS.append("two_shot"))

def build(cap, ws, multicast, p2p):
    set_cap(cap)
    sm.torch_symm_mem = NS(
        empty=lambda n, device, dtype: torch.zeros(min(n, 4096), dtype=dtype),
        rendezvous=lambda buf, name: NS(multicast_ptr=0xBEEF if multicast else 0))
    dist.get_world_size = lambda group=None: ws
    def all_gather_object(out, obj, group=None):
        out[:] = list(range(ws))
    dist.all_gather_object = all_gather_object
    torch.cuda.can_device_access_peer = lambda a, b: p2p
    logs()
    try:
        c = sm.TorchSymmMemCommunicator(NS(group_name="tp"), "cpu")
    except Exception as e:
        return {"error": type(e).__name__}, logs()
    res = {"disabled": c.disabled, "max_size_mib": getattr(c, "max_size", 0) // (1 << 20)}
    if not c.disabled:
        CALLS[:] = []
        c.all_reduce(torch.ones(64, dtype=torch.bfloat16))
        res["kernel"] = CALLS[-1]
    return res, logs()

for cap in CAPS:
    for ws in (2, 8):
        for mc in (0, 1):
            key = f"{cap}/ws{ws}/mc{mc}"
            OUT[key], lines = build(cap, ws, mc, True)
            OUT[key + "/log"] = [l for l in lines if "torch symm mem" in l]
    OUT[f"{cap}/ws8/mc0/nop2p"], _ = build(cap, 8, 0, False)
OUT["table12"] = SIZES.get(12)
"""


@pytest.mark.parametrize("flavor", [*FLAVORS, "sglang-0.5.23"])
def test_torch_symm_mem_two_shot_without_multicast(sglang_tree, run_in_tree, flavor):
    body = f"CAPS = {CAPS!r}\n" + SYMM
    new, old = both(sglang_tree, run_in_tree, flavor, body,
                    imports="import sglang.srt.distributed.device_communicators.torch_symm_mem")
    # table key 12, sized for PCIe (smaller than the NVLink tables)
    assert new["table12"] == {"2": 32, "4": 16, "6": 8, "8": 8} or new["table12"] == {
        "2": 32 << 20, "4": 16 << 20, "6": 8 << 20, "8": 8 << 20}
    assert old["table12"] is None
    # SM120 (PCIe, no multicast): enabled, two-shot, PCIe-sized window, the proof log line
    r = new["12.0/ws8/mc0"]
    assert r == {"disabled": False, "max_size_mib": 8, "kernel": "two_shot"}
    assert any("multicast unavailable, using two-shot all-reduce over P2P" in l
               for l in new["12.0/ws8/mc0/log"])
    if flavor == "sglang-0.5.9":
        assert old["12.0/ws8/mc0"] == {"error": "KeyError"}  # pristine crashes at startup
    else:
        assert old["12.0/ws8/mc0"]["disabled"] is True
    # no P2P: stays disabled (before any allocation)
    assert new["12.0/ws8/mc0/nop2p"]["disabled"] is True
    for cap in ("10.0", "9.0"):
        assert new[f"{cap}/ws8/mc0/nop2p"]["disabled"] is True
        # multicast missing: pristine disables itself, patched runs two-shot over P2P
        for ws in (2, 8):
            assert old[f"{cap}/ws{ws}/mc0"]["disabled"] is True
            assert new[f"{cap}/ws{ws}/mc0"]["kernel"] == "two_shot"
        # multicast present: unchanged choice (multimem for ws 8, two-shot for ws 2)
        assert new[f"{cap}/ws8/mc1"] == old[f"{cap}/ws8/mc1"]
        assert new[f"{cap}/ws8/mc1"]["kernel"] == "multimem"
        assert new[f"{cap}/ws2/mc1"] == old[f"{cap}/ws2/mc1"]
        assert new[f"{cap}/ws2/mc1"]["kernel"] == "two_shot"
