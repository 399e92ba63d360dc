"""The GPU bundle (`nox -s gpu-e2e`) against the default flavor's real wheels, on a CPU: what it
carries is derived from the lock, and the server's launch path imports with the bundle and the
host's torch stack alone (a module the bundle lacks fails here, not on the GPU host).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sglang_image import gpu, lock, pins
from smoke.e2e import host_stack_problems, pth_paths

FLAVOR = "sglang-0.5.23"

# What a Llama + EAGLE-3 server with CUDA graphs imports: the launcher, the scheduler with the
# worker, the model and its draft, the graph runners, and the modules the launch path imports
# lazily (inside functions) that were seen failing on a GPU host when the bundle lacked them:
# layers/dual_gemm.py (Llama's MLP) -> cutedsl_dual_gemm -> cutlass; the EAGLE draft's CUDA-graph
# capture -> dsa_backend -> flash_mla_interface -> flash_mla.
LAUNCH_PATH = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.speculative.eagle_worker_v2",
    "sglang.srt.speculative.eagle_draft_cuda_graph_runner",
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.llama",
    "sglang.srt.models.llama_eagle3",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.dual_gemm",
    "sglang.kernels.ops.gemm.cutedsl_dual_gemm",
    "sglang.srt.layers.attention.dsa_backend",
    "sglang.kernels.ops.attention.flash_mla_interface",
    "sglang.srt.constrained.xgrammar_backend",
    "sglang_image_plugin.hooks",
)

# Imports each module of argv[1:] with only sys.path (python -S: no site-packages) and prints,
# per module, the top-level module that could not be found, if any. Other errors (a CUDA library
# that cannot load without a GPU) mean the module was found: only a missing module is the
# bundle's fault.
PROBE = textwrap.dedent("""
    import importlib, json, sys
    out = {}
    for name in sys.argv[1:]:
        try:
            importlib.import_module(name)
            out[name] = None
        except ModuleNotFoundError as e:
            out[name] = (e.name or "?").split(".")[0]
        except BaseException as e:
            out[name] = None
    print("RESULT " + json.dumps(out))
""")


def test_bundle_is_sglangs_requirements_less_the_host_stack() -> None:
    flavor = pins.load_flavor(FLAVOR)
    members = set(gpu.bundle_members(flavor))
    host = gpu.host_stack(flavor)
    # the modules a GPU host lacked on the first 0.5.23 run are carried
    assert {"nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "sgl-flash-mla",
            "sgl-deep-gemm", "sglang", "sglang-kernel", "flashinfer-python"} <= members
    # the host's stack is not: torch and what it requires in the lock
    assert {"torch", "triton", "nvidia-nccl-cu13", "numpy"} <= host
    assert not members & host
    assert not members & set(gpu.NOT_ON_LAUNCH_PATH)
    # a requirement a new release adds is carried without anyone listing it
    graph = lock.read_requirements_graph(flavor.lock_path)
    graph["sglang"].add("brand-new-dependency")
    graph["brand-new-dependency"] = set()
    stop = host | set(gpu.NOT_ON_LAUNCH_PATH)
    assert "brand-new-dependency" in lock.reachable(graph, ["sglang"], stop=stop)


def test_an_exclusion_that_is_not_in_the_lock_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(gpu.NOT_ON_LAUNCH_PATH, "no-such-dist", "a typo")
    with pytest.raises(gpu.FetchError, match=r"\['no-such-dist'\] \(NOT_ON_LAUNCH_PATH"):
        gpu.bundle_members(pins.load_flavor(FLAVOR))


def test_host_stack_lines_name_what_differs() -> None:
    expected = {"torch": "2.14.1", "torchvision": "0.29.2", "triton": "3.8.0"}
    found = {"torch": "2.11.0+cu130", "torchvision": "0.29.2", "triton": None}
    lines = host_stack_problems(expected, found)
    assert lines[0].startswith("torch is 2.11.0+cu130 here, the flavor pins 2.14.1")
    assert lines[1] == "triton 3.8.0 is not installed here"
    assert len(lines) == 2
    assert host_stack_problems({"torch": "2.14.1"}, {"torch": "2.14.1+cu130"}) == []


def _host_view(flavor: pins.Flavor, dest: Path) -> Path:
    """The host's torch stack as this test environment has it, alone in one folder: links to the
    top-level modules of each installed distribution of gpu.host_stack."""
    dest.mkdir()
    for name in sorted(gpu.host_stack(flavor)):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files or ()}
        for top in tops:
            if top.endswith((".dist-info", ".data")) or top in ("..", "bin"):
                continue
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (dest / top).exists():
                (dest / top).symlink_to(source)
    return dest


@pytest.mark.network
def test_launch_path_imports_with_the_bundle_and_the_host_stack_alone(tmp_path: Path) -> None:
    flavor = pins.load_flavor(FLAVOR)
    stage = gpu.stage_bundle(flavor, tmp_path)  # what build_bundle packs, unpacked
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--target", str(site), *map(str, sorted(stage.glob("*.whl")))],
                   check=True)
    host = _host_view(flavor, tmp_path / "host")
    path = [str(site), *pth_paths(site), str(tmp_path / "stubs"), str(host)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONDONTWRITEBYTECODE": "1",
           "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-S", "-c", PROBE, *LAUNCH_PATH], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    missing = {mod: top for mod, top in json.loads(lines[-1][7:]).items() if top}
    assert missing == {}, (
        f"the launch path imports modules that neither the bundle nor the host stack has: "
        f"{missing} (add their distribution to the lock or take it out of NOT_ON_LAUNCH_PATH)")
