"""The plugin against the real sglang 0.5.23 wheel, on a CPU: discovery through its entry point
(the built wheel's dist-info on the path), hooks applied and checked at start, the flag, the
environment variable, validation, the start log line, and the worker's switch as far as it runs
without a GPU. Each probe prints one JSON line; it runs in a child forked from one warm
interpreter that imported torch and the sglang modules the probes use (tests/forkserver.py), with
the plugin's site first on its path but the plugin not loaded: each probe loads it itself, over
upstream modules already imported (its hooks reach them as SGLang's hook registry propagates them).
A probe with another path (no plugin, a second plugin) runs in a fresh interpreter, and so do
tests/build/test_pod_start.py's, which load the plugin before sglang's server arguments are imported.

GPU-only pieces faked (test_worker_switch): the worker's build_adaptive_runtime_state (captures
attention backends and CUDA graphs) and apply_runtime_state (swaps them); the EAGLEWorkerV2 object
is made without its __init__ (which loads models). Everything else is upstream's code.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sglang_image import pins, plugin_check, plugin_wheel
from sglang_image_plugin import targets
from smoke import checks
from tests.forkserver import forked_probes, warm_imports
from tests.plugin.eagle3_draft import EAGLE3_LEAVES
from tests.probe import probe_result

SGLANG_VERSION = "0.5.23"
FLAVOR = f"sglang-{SGLANG_VERSION}"
TREE_CACHE = pins.REPO_ROOT / ".cache" / "trees"
ENV = "SGLANG_SPEC_DISABLE_BATCH_THRESHOLD"
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1,
              "eos_token_id": 2}


@pytest.fixture(scope="module")
def tree(sglang_tree: Callable[[str, bool], Path]) -> Path:
    """The real sglang 0.5.23, unpacked as the wheel ships it (the plugin changes no file)."""
    if FLAVOR in pins.flavor_names():
        return sglang_tree(FLAVOR, False)
    # Until the flavor's lock is merged: the same wheel from PyPI, by pip.
    cache = Path(os.environ.get("SGLANG_IMAGE_CACHE", pins.REPO_ROOT / ".cache")) / "plugin-wheels"
    dest = TREE_CACHE / f"{FLAVOR}-wheel"
    if not (dest / ".complete").exists():
        wheels = sorted(cache.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if not wheels:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                            f"sglang=={SGLANG_VERSION}", "-d", str(cache)], check=True)
            wheels = sorted(cache.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        shutil.rmtree(dest, ignore_errors=True)
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extractall(dest)
        (dest / ".complete").write_text("ok\n")
    return dest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config-only Llama: enough for the server arguments to resolve on a CPU."""
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


# What the warm interpreter imports before it forks the probes: upstream's modules only (the
# plugin is what each probe loads and checks). A module that fails to import here fails in the probe
# that needs it, with its traceback.
WARM_MODULES = (
    "torch", "sglang.srt.plugins", "sglang.srt.plugins.hook_registry", "sglang.srt.server_args",
    "sglang.srt.arg_groups.overrides", "sglang.srt.speculative.spec_info",
    "sglang.srt.speculative.eagle_info", "sglang.srt.speculative.eagle_worker_v2",
    "sglang.srt.speculative.spec_utils", "sglang.srt.model_executor.forward_batch_info",
    "sglang.srt.managers.scheduler", "sglang.srt.managers.overlap_utils",
    "sglang.srt.managers.utils", "sglang.srt.managers.scheduler_components.internal_state",
    "sglang.srt.layers.logits_processor",
)


@pytest.fixture(scope="module")
def run_in_tree(run_in_tree, tree, plugin_site):  # type: ignore[no-untyped-def]
    """conftest's run_in_tree, but a probe in `tree` with the plugin's site first on its path
    (nearly all of them) forks from one warm interpreter of that path (see the docstring)."""
    fresh = run_in_tree
    path = f"{plugin_site}:{tree}"
    with forked_probes(warm_imports(WARM_MODULES), server_env={"PYTHONPATH": path}) as forked:
        def run(where: Path, code: str, env: dict[str, str] | None = None,
                timeout: int = 600) -> subprocess.CompletedProcess[str]:
            rest = {k: v for k, v in (env or {}).items() if k != "PYTHONPATH"}
            if where == tree and (env or {}).get("PYTHONPATH", path) == path:
                return forked(where, code, env=rest, timeout=timeout)
            return fresh(where, code, env=env, timeout=timeout)

        yield run


PRELUDE = textwrap.dedent("""
    import json, logging, sys
    def emit(obj):
        print("RESULT " + json.dumps(obj), flush=True)
""")

# Launcher-side: plugins loaded as the launcher loads them, then the server arguments built,
# resolved and checked as Engine._launch_subprocesses does.
LAUNCHER = textwrap.dedent("""
    import contextlib, io, pickle
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args

    def launch(model, extra):
        argv = ["--model-path", model, "--skip-tokenizer-init", "--device", "cpu",
                "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", model,
                "--speculative-eagle-topk", "1", "--speculative-num-steps", "3",
                "--speculative-num-draft-tokens", "4", *extra]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                sa = prepare_server_args(argv)
        except SystemExit as e:
            return {"argparse_exit": e.code, "stderr": err.getvalue()[-400:]}
        sa.resolve_once()
        try:
            sa.check_server_args()
        except ValueError as e:
            return {"error": str(e)}
        from sglang_image_plugin import state
        from sglang_image_plugin.state import ArgsState
        setting = state.peek(pickle.loads(pickle.dumps(sa)), ArgsState).setting
        return {"threshold": setting.threshold, "hysteresis": setting.hysteresis}
""")


def _probe(run_in_tree: Callable[..., subprocess.CompletedProcess[str]], tree: Path,
           site: Path | None, *parts: str, env: dict[str, str] | None = None) -> Any:
    """Run the parts (each dedented) after PRELUDE; the plugin's site first on the path."""
    path = f"{site}:{tree}" if site is not None else str(tree)
    code = PRELUDE + "".join(textwrap.dedent(part) for part in parts)
    proc = run_in_tree(tree, code,
                       env={"PYTHONPATH": path, **(env or {})}, timeout=900)
    return probe_result(proc)


def test_wheel_is_reproducible_and_declares_the_entry_point(tmp_path: Path) -> None:
    first = plugin_wheel.build_wheel(tmp_path / "a")
    second = plugin_wheel.build_wheel(tmp_path / "b")
    assert first.name == "sglang_image_plugin-0.1.0-py3-none-any.whl"
    assert first.read_bytes() == second.read_bytes()
    with zipfile.ZipFile(first) as zf:
        entry_points = zf.read("sglang_image_plugin-0.1.0.dist-info/entry_points.txt").decode()
        metadata = zf.read("sglang_image_plugin-0.1.0.dist-info/METADATA").decode()
        names = set(zf.namelist())
    assert "[sglang.srt.plugins]\nsglang_image = sglang_image_plugin:register" in entry_points
    assert "sglang_image_plugin/upstream_digests.json" in names
    # Python: the plugin uses enum.StrEnum (3.11). sglang: exactly the releases whose relied-on
    # code was reviewed (the digests' versions), which the plugin also enforces at start.
    assert "\nRequires-Python: >=3.11\n" in metadata
    pinned = sorted(line.split("==")[1] for line in metadata.splitlines()
                    if line.startswith("Requires-Dist: sglang=="))
    assert pinned == sorted(plugin_check.load_digests())


def test_discovered_applied_and_checked_at_start(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    out = _probe(run_in_tree, tree, plugin_site, """
        from importlib.metadata import entry_points
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        load_plugins()
        import sglang_image_plugin
        from sglang_image_plugin.targets import HOOKS, START
        eps = [(ep.name, ep.value, ep.dist.name) for ep in entry_points(group="sglang.srt.plugins")]
        emit({"eps": eps, "not_taken": sglang_image_plugin.hooks_not_taken(),
              "patched": sorted(t for t in HookRegistry._patched),
              "start": sorted(h.target for h in HOOKS if h.group == START),
              "per_step": sorted(h.target for h in HOOKS if h.group != START)})
    """)
    assert out["eps"] == [["sglang_image", "sglang_image_plugin:register", "sglang-image-plugin"]]
    assert out["not_taken"] == []
    # at load only the start-up hooks: a server without a threshold runs none of the others
    assert set(out["start"]) <= set(out["patched"]) and not set(out["per_step"]) & set(out["patched"])


def test_a_hook_that_does_not_take_stops_the_process(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # A release without one of the targets: the framework would log and carry on.
    # The check runs in the first hook of the process: the launcher's CLI hook.
    code = PRELUDE + textwrap.dedent("""
        from sglang.srt.arg_groups import speculative_hook
        del speculative_hook._handle_eagle_family
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.server_args import prepare_server_args
        prepare_server_args(["--model-path", "unused"])
        emit({"still": "running"})
    """)
    proc = run_in_tree(tree, code, env={"PYTHONPATH": f"{plugin_site}:{tree}"}, timeout=900)
    assert proc.returncode == 1 and "RESULT" not in proc.stdout
    assert "sglang-image-plugin: hooks did not take" in proc.stderr
    assert "speculative_hook._handle_eagle_family: cannot be resolved" in proc.stderr
    # a per-step hook that does not take stops the worker that installs it, the same way
    code = PRELUDE + textwrap.dedent("""
        from sglang.srt.managers.scheduler_components import internal_state
        del internal_state.SchedulerInternalStateController._add_speculative
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang_image_plugin import registry
        from sglang_image_plugin.targets import Group, hooks_of
        registry.install(hooks_of(Group.THRESHOLD), "plain-step")
        emit({"still": "running"})
    """)
    proc = run_in_tree(tree, code, env={"PYTHONPATH": f"{plugin_site}:{tree}"}, timeout=900)
    assert proc.returncode == 1 and "RESULT" not in proc.stdout
    assert ("SchedulerInternalStateController._add_speculative: cannot be resolved"
            in proc.stderr)


def test_flag_env_and_validation_through_the_launcher(run_in_tree, tree, plugin_site, model_dir) -> None:  # type: ignore[no-untyped-def]
    out = _probe(run_in_tree, tree, plugin_site, LAUNCHER, f"""
        m = {str(model_dir)!r}
        emit({{
            "flag": launch(m, ["--speculative-disable-batch-threshold", "32"]),
            "flag_h": launch(m, ["--speculative-disable-batch-threshold", "32",
                                 "--speculative-disable-hysteresis", "2"]),
            "off": launch(m, []),
            "negative": launch(m, ["--speculative-disable-batch-threshold", "-4"]),
            "garbage": launch(m, ["--speculative-disable-batch-threshold", "lots"]),
            "auto": launch(m, ["--speculative-disable-batch-threshold", "auto"]),
            "auto_mixed": launch(m, ["--speculative-disable-batch-threshold", "auto32"]),
            "auto_h": launch(m, ["--speculative-disable-batch-threshold", "auto",
                                 "--speculative-disable-hysteresis", "2"]),
            "h_too_big": launch(m, ["--speculative-disable-batch-threshold", "4",
                                    "--speculative-disable-hysteresis", "4"]),
            "topk": launch(m, ["--speculative-disable-batch-threshold", "8",
                               "--speculative-eagle-topk", "4"]),
            "adaptive": launch(m, ["--speculative-disable-batch-threshold", "8",
                                   "--speculative-adaptive"]),
        }})
    """)
    assert out["flag"] == {"threshold": 32, "hysteresis": 4}
    assert out["flag_h"] == {"threshold": 32, "hysteresis": 2}
    assert out["off"] == {"threshold": 0, "hysteresis": 0}
    assert out["auto"] == {"threshold": "auto", "hysteresis": 0}
    for key, value in (("negative", "-4"), ("garbage", "lots"), ("auto_mixed", "auto32")):
        assert out[key]["argparse_exit"] == 2
        assert "argument --speculative-disable-batch-threshold" in out[key]["stderr"]
        assert f"{value!r} is not a batch-size threshold; give `auto`" in out[key]["stderr"]
    assert "--speculative-disable-hysteresis applies to a fixed" in out["auto_h"]["error"]
    assert "--speculative-disable-hysteresis must be smaller" in out["h_too_big"]["error"]
    assert "needs --speculative-eagle-topk 1 (got 4)" in out["topk"]["error"]
    assert "cannot be combined with --speculative-adaptive" in out["adaptive"]["error"]

    env_out = _probe(run_in_tree, tree, plugin_site, LAUNCHER, f"""
        emit(launch({str(model_dir)!r}, []))
    """, env={ENV: "48"})
    assert env_out == {"threshold": 48, "hysteresis": 6}
    bad_env = _probe(run_in_tree, tree, plugin_site, LAUNCHER, f"""
        emit(launch({str(model_dir)!r}, []))
    """, env={ENV: "plenty"})
    assert f"{ENV} (the fallback for --speculative-disable-batch-threshold)" in bad_env["error"]
    assert "'plenty' is not a batch-size threshold" in bad_env["error"]
    env_auto = _probe(run_in_tree, tree, plugin_site, LAUNCHER, f"""
        emit(launch({str(model_dir)!r}, []))
    """, env={ENV: "auto"})
    assert env_auto == {"threshold": "auto", "hysteresis": 0}


def test_a_threshold_server_keeps_a_plain_servers_running_limit(run_in_tree, tree, plugin_site, model_dir) -> None:  # type: ignore[no-untyped-def]
    # Upstream resets an EAGLE server's --max-running-requests to 48 unless given: a threshold
    # server could then never run the batches where it decodes plain. Without the flag it keeps
    # the limit of the same server without speculation (unset: sized from the KV pool at start);
    # given, the flag wins; without a threshold upstream's 48 stays, with its warning.
    out = _probe(run_in_tree, tree, plugin_site, """
        import contextlib, io, logging
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.server_args import prepare_server_args
        from sglang.srt.arg_groups.overrides import resolving_view
        from sglang_image_plugin import state
        from sglang_image_plugin.state import ArgsState
        def limit(extra, plain=False):
            argv = ["--model-path", MODEL, "--skip-tokenizer-init", "--device", "cpu", *extra]
            if not plain:
                argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", MODEL,
                         "--speculative-eagle-topk", "1", "--speculative-num-steps", "3",
                         "--speculative-num-draft-tokens", "4"]
            sa = prepare_server_args(argv)
            seen = []
            class Capture(logging.Handler):
                def emit(self, record):
                    seen.append(record.getMessage())
            capture = Capture()
            logging.getLogger().addHandler(capture)
            try:
                sa.resolve_once()
            finally:
                logging.getLogger().removeHandler(capture)
            return [resolving_view(sa).max_running_requests,
                    any("reset to 48" in m for m in seen),
                    state.of(sa, ArgsState).running_limit]
        emit({"threshold": limit(["--speculative-disable-batch-threshold", "16"]),
              "auto": limit(["--speculative-disable-batch-threshold", "auto"]),
              "schedule_auto": limit(["--speculative-depth-schedule", "auto"]),
              "given": limit(["--speculative-disable-batch-threshold", "16", "--max-running-requests", "64"]),
              "no_threshold": limit([]), "off": limit(["--speculative-disable-batch-threshold", "0"]),
              "plain": limit([], plain=True)})
    """.replace("MODEL", repr(str(model_dir))))
    assert out["threshold"] == [None, False, True] and out["auto"] == [None, False, True]
    assert out["schedule_auto"] == [None, False, True]  # a learned schedule may decode plain anywhere
    assert out["given"] == [64, False, False]
    assert out["no_threshold"] == [48, True, False] and out["off"] == [48, True, False]
    assert out["plain"] == [None, False, False]  # the limit a threshold server now keeps


def test_another_plugin_on_the_same_targets_keeps_its_hooks(run_in_tree, tree, plugin_site, model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A second plugin, discovered after ours, hooks two of our targets. SGLang applies the
    # hooks once every plugin has registered; a plugin that applied them itself would leave
    # the later plugin's hooks on those targets unapplied (already-patched targets are skipped).
    other = tmp_path / "other"
    (other / "other_plugin").mkdir(parents=True)
    (other / "other_plugin" / "__init__.py").write_text(textwrap.dedent("""
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
        SEEN = []
        def add_flag(result, parser):
            parser.add_argument("--other-plugin-flag", default=None)
        def around_verify(original, worker, *args, **kwargs):
            SEEN.append("init")
            return original(worker, *args, **kwargs)
        def before_graphs(worker, *args, **kwargs):
            SEEN.append("graphs")
        def register():
            HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", add_flag,
                                  HookType.AFTER)
            HookRegistry.register(
                "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.init_cuda_graphs",
                before_graphs, HookType.BEFORE)
            HookRegistry.register(
                "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2._build_trivial_verify_input",
                around_verify, HookType.AROUND)
    """))
    dist = other / "other_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: other-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\nother = other_plugin:register\n")
    out = _probe(run_in_tree, tree, plugin_site, """
        from importlib.metadata import entry_points
        from sglang.srt.plugins import load_plugins
        load_plugins()
        import sglang_image_plugin, other_plugin
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
        import argparse
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        ns = parser.parse_args(["--model-path", "m", "--other-plugin-flag", "x",
                                "--speculative-disable-batch-threshold", "8"])
        from sglang_image_plugin import registry, worker
        from sglang_image_plugin.targets import Group, hooks_of
        graphs = EAGLEWorkerV2.__dict__["init_cuda_graphs"]
        verify_before = EAGLEWorkerV2.__dict__["_build_trivial_verify_input"]
        # a threshold worker installs its per-step hooks over the other plugin's, which stay
        registry.install(hooks_of(Group.THRESHOLD), "plain-step")
        verify = EAGLEWorkerV2.__dict__["_build_trivial_verify_input"]
        emit({"order": [ep.name for ep in entry_points(group="sglang.srt.plugins")],
              "not_taken": sglang_image_plugin.hooks_not_taken(),
              "other": ns.other_plugin_flag, "ours": ns.speculative_disable_batch_threshold,
              "both_at_start": [registry.wraps_hook(graphs, other_plugin.before_graphs),
                                registry.wraps_hook(graphs, worker.worker_init_cuda_graphs)],
              "theirs_before_install": registry.wraps_hook(verify_before, other_plugin.around_verify),
              "both_after_install": [registry.wraps_hook(verify, other_plugin.around_verify),
                                     registry.wraps_hook(verify, worker.trivial_verify_input)],
              "again": registry.install(hooks_of(Group.THRESHOLD), "plain-step") is None
                       and EAGLEWorkerV2.__dict__["_build_trivial_verify_input"] is verify})
    """, env={"PYTHONPATH": f"{plugin_site}:{other}:{tree}"})
    assert out["order"] == ["sglang_image", "other"]
    assert out["not_taken"] == []
    assert out["other"] == "x" and out["ours"] == 8
    assert out["both_at_start"] == [True, True]
    assert out["theirs_before_install"] and out["both_after_install"] == [True, True]
    assert out["again"]  # a second install wraps nothing twice


def test_a_release_the_plugin_was_not_checked_on_stops_at_start(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    code = PRELUDE + textwrap.dedent("""
        import importlib.metadata
        real = importlib.metadata.version
        importlib.metadata.version = lambda name: "0.5.99" if name == "sglang" else real(name)
        from sglang.srt.plugins import load_plugins
        load_plugins()
        emit({"still": "running"})
    """)
    proc = run_in_tree(tree, code, env={"PYTHONPATH": f"{plugin_site}:{tree}"}, timeout=900)
    assert proc.returncode == 1 and "RESULT" not in proc.stdout
    assert ("sglang-image-plugin was checked against sglang 0.5.23, and this is sglang 0.5.99"
            in proc.stderr)


def test_what_upstream_refuses_for_its_adaptive_swap_is_refused(run_in_tree, tree, plugin_site, model_dir) -> None:  # type: ignore[no-untyped-def]
    # Each refusal is upstream's own check run on an adaptive twin of the arguments; the same
    # arguments without the threshold start (the refusal is the plugin's, not upstream's).
    lora = ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj"]
    out = _probe(run_in_tree, tree, plugin_site, LAUNCHER, f"""
        m = {str(model_dir)!r}
        emit({{"lora": launch(m, ["--speculative-disable-batch-threshold", "8", *{lora!r}]),
               "lora_plain": launch(m, {lora!r}),
               "lora_auto": launch(m, ["--speculative-disable-batch-threshold", "auto",
                                       *{lora!r}])}})
    """)
    assert out["lora_plain"] == {"threshold": 0, "hysteresis": 0}
    for key in ("lora", "lora_auto"):
        assert "is not supported here: " in out[key]["error"]
        assert "runtime-state swap does not rebuild LoRA cuda-graph metadata" in out[key]["error"]


def test_zero_step_verify_hands_int64_draft_tokens_to_the_tree_kernel(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # Under --disable-overlap-schedule the plain step's draft token is the previous verify's
    # bonus token as verify wrote it (int32); verify_tree_greedy (kernels/jit/csrc/speculative/
    # tree.cuh) accepts only int64 candidates and stopped the scheduler at its first plain step.
    out = _probe(run_in_tree, tree, plugin_site, """
        import torch
        from types import SimpleNamespace as NS
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang_image_plugin import registry
        from sglang_image_plugin.targets import Group, hooks_of
        registry.install(hooks_of(Group.THRESHOLD), "plain-step")  # as a threshold worker does
        from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
        from sglang.srt.speculative.eagle_info import EagleDraftInput
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        worker = EAGLEWorkerV2.__new__(EAGLEWorkerV2)
        worker.device, worker.topk = "cpu", 1
        worker._target_worker = NS(model_runner=NS(attn_backend=NS(verify_mask=None,
                                                                   max_context_len=64)))
        batch = NS(forward_mode=ForwardMode.DECODE, seq_lens=torch.tensor([5, 7, 9]),
                   seq_lens_sum=21, seq_lens_cpu=None,
                   spec_info=EagleDraftInput(bonus_tokens=torch.tensor([11, 12, 13],
                                                                       dtype=torch.int32)))
        verify = EAGLEWorkerV2._build_trivial_verify_input(worker, batch)
        candidates = verify.draft_token.reshape(3, verify.draft_token_num)
        emit({"dtype": str(candidates.dtype), "tokens": candidates.flatten().tolist(),
              "retrieve": str(verify.retrieve_index.dtype)})
    """)
    assert out == {"dtype": "torch.int64", "tokens": [11, 12, 13], "retrieve": "torch.int64"}


def test_without_the_plugin_the_flag_does_not_exist(run_in_tree, tree, model_dir) -> None:  # type: ignore[no-untyped-def]
    out = _probe(run_in_tree, tree, None, LAUNCHER, f"""
        emit(launch({str(model_dir)!r}, ["--speculative-disable-batch-threshold", "32"]))
    """)
    assert out["argparse_exit"] == 2
    assert "unrecognized arguments: --speculative-disable-batch-threshold" in out["stderr"]


# The worker as the scheduler process gets it; `hook` is the plugin's AFTER hook on its __init__.
WORKER = textwrap.dedent("""
    import pickle
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
    from sglang.srt.managers.scheduler_components.internal_state import (
        SchedulerInternalStateController)
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    sa = prepare_server_args(["--model-path", MODEL, "--skip-tokenizer-init", "--device", "cpu",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", MODEL,
        "--speculative-eagle-topk", "1", "--speculative-num-steps", "3",
        "--speculative-num-draft-tokens", "4", *ARGS])
    sa.resolve_once()
    sa.check_server_args()
    sa = pickle.loads(pickle.dumps(sa))  # as the scheduler process receives it

    records = []  # (after prepare_server_args, whose logging.basicConfig(force=True) resets)
    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger().addHandler(Capture())
    logging.getLogger().setLevel(logging.INFO)

    # The worker as upstream's __init__ leaves it, without models (GPU).
    worker = EAGLEWorkerV2.__new__(EAGLEWorkerV2)
    worker.server_args = sa
    worker._hosts_draft = True
    worker.speculative_num_steps = 3
    worker.speculative_num_draft_tokens = 4
    worker.adaptive_controller = None
    from types import SimpleNamespace as NS  # the draft's config, as its runner holds it
    worker._draft_worker = NS(draft_runner=NS(model_config=NS(hf_config=NS(**HF_CONFIG))))
    # The target's runner once the memory pools exist (before init_cuda_graphs).
    worker._target_worker = NS(model_runner=NS(max_running_requests=256))
    # The hooked __init__'s AFTER part (the original __init__ loads models).
    init = EAGLEWorkerV2.__init__
    hook = next(c.cell_contents for c in init.__closure__ if callable(c.cell_contents)
                and getattr(c.cell_contents, "__module__", "") == "sglang_image_plugin.worker")
    # The hooked init_cuda_graphs' BEFORE part (the original captures CUDA graphs).
    graphs_hook = next(c.cell_contents for c in EAGLEWorkerV2.init_cuda_graphs.__closure__
                       if getattr(c.cell_contents, "__module__", "") == "sglang_image_plugin.worker")
""")

SWITCH = textwrap.dedent("""
    hook(None, worker)

    # Fakes of the GPU-only state capture and swap (see the module docstring).
    built = []
    def build_adaptive_runtime_state(speculative_num_steps, speculative_num_draft_tokens,
                                     cuda_graph_bs=None):
        built.append([speculative_num_steps, speculative_num_draft_tokens, cuda_graph_bs])
        return ("state", speculative_num_steps, speculative_num_draft_tokens)
    def apply_runtime_state(state):
        worker.speculative_num_steps, worker.speculative_num_draft_tokens = state[1], state[2]
    worker.build_adaptive_runtime_state = build_adaptive_runtime_state
    worker.apply_runtime_state = apply_runtime_state

    graphs_hook(worker)  # init_cuda_graphs: ours first, then upstream's part below
    controller = worker.adaptive_controller
    policy = type(controller.params).__name__ if controller is not None else None
    if controller is not None:  # what EAGLEWorkerV2.init_cuda_graphs does with it
        controller.register(("state", 3, 4), steps=3)
        controller.init_states(cuda_graph_bs=[1, 2, 4, 8, 16, 24, 32, 40, 48, 64])
    steps = []
    for bs in TRACE:
        EAGLEWorkerV2.activate_step_by_batch(worker, bs)  # upstream, as forward does per decode
        steps.append(worker.speculative_num_steps)
""")


# Probe code: a stand-in for upstream's Scheduler with what the observability hooks read, and
# the plugin's Scheduler.__init__ hook (found in the hooked method's closure) run on it.
ATTACH_SCHEDULER = """
        class Scheduler:  # what the observability hooks read of upstream's Scheduler
            draft_worker = worker
            spec_algorithm = SpeculativeAlgorithm.EAGLE3
            class metrics_reporter:
                spec_total_num_forward_ct = 0
            class metrics_collector:
                labels = {"model_name": "m", "engine_type": "unified"}
        from sglang.srt.managers.scheduler import Scheduler as Upstream
        scheduler_hook = next(c.cell_contents for c in Upstream.__init__.__closure__
                              if getattr(c.cell_contents, "__module__", "") == "sglang_image_plugin.observe")
        scheduler_hook(None, Scheduler)
"""


def test_worker_switch_and_observability(run_in_tree, tree, plugin_site, model_dir) -> None:  # type: ignore[no-untyped-def]
    head = (f"MODEL = {str(model_dir)!r}\nARGS = ['--speculative-disable-batch-threshold', '32']\n"
            "TRACE = [1, 16, 32, 33, 40, 64, 31, 29, 28, 27, 40, 0, 20]\nHF_CONFIG = {}\n")
    body = """
""" + ATTACH_SCHEDULER + """        EAGLEWorkerV2.activate_step_by_batch(worker, 50)
        state_controller = SchedulerInternalStateController(Scheduler, record_step_time=False)
        state = {}
        state_controller._add_speculative(state)   # upstream's, hooked
        from prometheus_client import REGISTRY
        metrics = {name: REGISTRY.get_sample_value(name, Scheduler.metrics_collector.labels)
                   for name in ("sglang:spec_disable_plain_mode",
                                "sglang:spec_disable_plain_steps_total",
                                "sglang:spec_disable_speculative_steps_total")}
        emit({"built": built, "steps": steps, "state": state, "metrics": metrics, "policy": policy,
              "start": [r for r in records if r.startswith("Dynamic speculation disable")],
              "limit": [r for r in records if r.startswith("Running-request limit")],
              "modes": [r for r in records if r.startswith("Speculation mode")]})
    """
    out = _probe(run_in_tree, tree, plugin_site, LAUNCHER, head, WORKER, SWITCH, body)
    assert out["policy"] == "ThresholdPolicy"
    # upstream's controller built the plain (zero-step, one-token) state for batch sizes > 28
    assert out["built"] == [[0, 1, [32, 40, 48, 64]]]
    # 3 draft steps up to 32 requests; none above; back at <= 28 (hysteresis 4); idle keeps it
    assert out["steps"] == [3, 3, 3, 0, 0, 0, 0, 0, 3, 3, 0, 0, 3]
    assert out["start"] == ["Dynamic speculation disable enabled: threshold=32"]
    assert out["limit"] == [("Running-request limit 256 (the limit of the same server without "
                             "speculation: no --max-running-requests); decode CUDA graphs up to "
                             "batch 32")]
    assert out["modes"][0] == "Speculation mode -> plain (batch size 33 > threshold 32); mode_changes=1"
    assert out["state"]["speculative_disable"] == {
        "threshold": 32, "hysteresis": 4, "mode": "plain", "speculative_steps": 6,
        "plain_steps": 7, "mode_changes": 5,
        # the fake worker's draft has no model: the plain step keeps the full draft extend
        "plain_step": {"target": "decode graph", "draft": "full draft extend",
                       "layout": "speculative", "draft_kv_write": "draft extend"},
        # no verify results came in this trace: nothing measured, the decisions wait unpaired
        "acceptance_around_plain": {"window_steps": 64, "phases_measured": 0,
                                    "unpaired_steps": 5}}
    # counted since the metrics were attached: one plain step at 50 requests
    assert out["metrics"] == {"sglang:spec_disable_plain_mode": 1.0,
                              "sglang:spec_disable_plain_steps_total": 1.0,
                              "sglang:spec_disable_speculative_steps_total": 0.0}


def test_worker_walks_a_depth_schedule_through_upstream_s_controller(run_in_tree, tree, plugin_site, model_dir) -> None:  # type: ignore[no-untyped-def]
    # --speculative-depth-schedule: upstream's controller builds one state per depth of the
    # schedule, each only at the graph sizes that depth can run at, and switches the worker
    # between them per decode batch as the schedule's controller walks (hysteresis per edge).
    head = (f"MODEL = {str(model_dir)!r}\nARGS = ['--speculative-depth-schedule', '1-8:3,9-32:2,33-:0']\n"
            "TRACE = [1, 8, 9, 8, 7, 32, 33, 64, 30, 28, 27, 0, 2]\nHF_CONFIG = {}\n")
    body = """
""" + ATTACH_SCHEDULER + """        EAGLEWorkerV2.activate_step_by_batch(worker, 50)
        state = {}
        SchedulerInternalStateController(Scheduler, record_step_time=False)._add_speculative(state)
        from prometheus_client import REGISTRY
        depth = REGISTRY.get_sample_value("sglang:spec_disable_depth", Scheduler.metrics_collector.labels)
        emit({"built": built, "steps": steps, "state": state["speculative_disable"], "policy": policy,
              "depth_gauge": depth,
              "start": [r for r in records if r.startswith("Dynamic speculation disable")],
              "depths": [r for r in records if r.startswith("Speculation depth")]})
    """
    out = _probe(run_in_tree, tree, plugin_site, LAUNCHER, head, WORKER, SWITCH, body)
    assert out["policy"] == "DepthSchedulePolicy"
    # depth 3 is the launch state (registered as such); depth 2 runs at 8 (hysteresis 1 under
    # 8) to 32, plain from 29 (32 - 4) up
    assert sorted(out["built"]) == [[0, 1, [32, 40, 48, 64]], [2, 3, [8, 16, 24, 32]]]
    # deeper only below each edge's hysteresis; shallower at once; idle keeps the depth
    assert out["steps"] == [3, 3, 2, 2, 3, 2, 0, 0, 0, 2, 2, 2, 3]
    assert out["start"] == ["Dynamic speculation disable enabled: depth schedule=1-8:3,9-32:2,33-:0"]
    assert out["depths"][0] == ("Speculation depth -> 2 (was 3; batch size 9; schedule 1-8:3,9-32:2,33-:0); "
                                "depth_changes=1")
    st = out["state"]
    assert (st["schedule"], st["depth"], st["mode"]) == ("1-8:3,9-32:2,33-:0", 0, "plain")
    assert st["steps_by_depth"] == {"0": 4, "2": 5, "3": 4} and st["depth_changes"] == 7
    assert out["depth_gauge"] == 0.0  # the step at 50 requests, once the metrics were attached


def test_each_extra_depth_state_captures_graphs_only_at_its_own_batch_sizes(run_in_tree, tree, plugin_site, model_dir) -> None:  # type: ignore[no-untyped-def]
    # 0.5.23's init_cuda_graphs hands init_states the legacy --cuda-graph-bs-decode (None unless
    # set), and its state build overrides only that legacy field, while the graph runners capture
    # at cuda_graph_config.decode.bs: every depth state captured graphs at every size. Through
    # upstream's controller as 0.5.23 calls it and the plugin's hook around the state build, the
    # capture (a stand-in for upstream's) sees each depth's own sizes where the runners read them,
    # and the launch's sizes are back after each build.
    head = (f"MODEL = {str(model_dir)!r}\nARGS = ['--speculative-depth-schedule', '1-8:3,9-32:2,33-:0']\n"
            "HF_CONFIG = {}\n")
    body = """
        hook(None, worker)
        from sglang.srt.model_executor.cuda_graph_config import Backend
        from sglang.srt.runtime_context import get_exec, publish
        from sglang_image_plugin import plain_target
        publish(sa, role="test")  # as the scheduler's process does before its worker starts
        decode = get_exec().graph.cuda_graph_config.decode  # a CPU server has graphs off
        decode.backend, decode.bs = Backend.FULL, [1, 2, 4, 8, 16, 24, 32, 40, 48, 64]
        seen = []
        def capture(worker_, steps, tokens, cuda_graph_bs=None):  # upstream's capture, faked
            seen.append([steps, list(get_exec().graph.cuda_graph_config.decode.bs), cuda_graph_bs])
            return ("state", steps, tokens)
        def build(speculative_num_steps, speculative_num_draft_tokens, cuda_graph_bs=None):
            return plain_target.build_runtime_state(capture, worker, speculative_num_steps,
                                                    speculative_num_draft_tokens, cuda_graph_bs=cuda_graph_bs)
        worker.build_adaptive_runtime_state = build  # the hooked method, around the fake capture
        worker.apply_runtime_state = lambda state: None
        graphs_hook(worker)
        legacy = get_exec().graph.cuda_graph_bs_decode
        worker.adaptive_controller.register(("state", 3, 4), steps=3)
        worker.adaptive_controller.init_states(cuda_graph_bs=legacy)  # as 0.5.23's init_cuda_graphs
        emit({"legacy": legacy, "seen": sorted(seen), "after": list(decode.bs)})
    """
    out = _probe(run_in_tree, tree, plugin_site, LAUNCHER, head, WORKER, body)
    assert out["legacy"] is None
    # depth 2 runs at 8 (hysteresis 1 under 8) to 32, plain from 29 (32 - 4) up
    assert out["seen"] == [[0, [32, 40, 48, 64], [32, 40, 48, 64]], [2, [8, 16, 24, 32], [8, 16, 24, 32]]]
    assert out["after"] == [1, 2, 4, 8, 16, 24, 32, 40, 48, 64]


def test_worker_reports_the_accept_length_before_and_after_a_plain_phase(run_in_tree, tree, plugin_site, model_dir) -> None:  # type: ignore[no-untyped-def]
    # Through upstream's own worker methods, as the overlap scheduler calls them: a decode
    # batch's step count is chosen (activate_step_by_batch), then the batch before it verifies
    # (on_verify_complete_cpu). 70 speculative steps at 8 requests accepting 2 drafts each, 5
    # plain steps at 40, then 70 speculative steps whose first 16 accept 1 draft.
    head = (f"MODEL = {str(model_dir)!r}\nARGS = ['--speculative-disable-batch-threshold', '32']\n"
            "TRACE = []\nHF_CONFIG = {}\n")
    body = """
        sizes = [8] * 70 + [40] * 5 + [8] * 70
        previous = None
        since_plain = None  # speculative steps since the last plain step
        for bs in sizes:
            EAGLEWorkerV2.activate_step_by_batch(worker, bs)
            if previous is not None:
                EAGLEWorkerV2.on_verify_complete_cpu(worker, previous, batch_size=len(previous))
            if worker.speculative_num_steps == 0:
                since_plain, accepted = 0, 0
            else:
                since_plain = None if since_plain is None else since_plain + 1
                accepted = 1 if since_plain is not None and since_plain <= 16 else 2
            previous = [accepted] * bs
        EAGLEWorkerV2.on_verify_complete_cpu(worker, previous, batch_size=len(previous))
        EAGLEWorkerV2.activate_step_by_batch(worker, 8)
        EAGLEWorkerV2.on_verify_complete_cpu(worker, [2] * 7, batch_size=7)  # rows do not match
""" + ATTACH_SCHEDULER + """        state = {}
        SchedulerInternalStateController(Scheduler, record_step_time=False)._add_speculative(state)
        emit(state["speculative_disable"]["acceptance_around_plain"])
    """
    out = _probe(run_in_tree, tree, plugin_site, LAUNCHER, head, WORKER, SWITCH, body)
    # before: 3 tokens per request and step; after (8 <= 28 resumes at once): 16 steps at 2,
    # then 48 at 3; the last result, one row short, is not paired with its decision
    assert out == {"window_steps": 64, "phases_measured": 1, "unpaired_steps": 1,
                   "last_before": 3.0, "last_after": round((16 * 2 + 48 * 3) / 64, 4), "last_depth": 3,
                   "worst_after_over_before": round((16 * 2 + 48 * 3) / 64 / 3, 4)}


def test_worker_decode_kv_catches_up_before_speculating_where_the_draft_allows(run_in_tree, tree, plugin_site, model_dir) -> None:  # type: ignore[no-untyped-def]
    # Once the pools exist (init_cuda_graphs), a one-layer Llama EAGLE-3 draft gets the catch-up
    # policy (plain states at every captured size, one plain step with the full draft extend
    # before speculation resumes); another draft keeps the threshold policy, and the log says why
    # (its draft line is what the smoke reads).
    head = (f"MODEL = {str(model_dir)!r}\nARGS = ['--speculative-disable-batch-threshold', '32']\n"
            "TRACE = [1, 33, 40, 20, 20, 1]\nHF_CONFIG = {}\n")
    llama_draft = """
        from sglang.srt.models.llama_eagle3 import LlamaModel
        model = object.__new__(LlamaModel)
        torch_nn = __import__("torch").nn
        torch_nn.Module.__init__(model)
        model.layers, model.is_mrope_enabled = [object()], False
        worker._draft_worker.draft_runner.model = NS(model=model)
        worker._draft_worker.draft_runner.token_to_kv_pool = NS(requires_physical_write_loc=False)
        worker._draft_worker.draft_runner.kv_index_translator = NS(is_translating=False)
        worker._draft_worker.target_worker = NS(model_runner=NS(kv_index_translator=None))
"""
    body = """
        from sglang_image_plugin import state
        from sglang_image_plugin.state import DraftState
        emit({"policy": policy, "built": built, "steps": steps,
              "kv_only": state.of(worker._draft_worker, DraftState).catch_up is controller.params,
              "lines": [r for r in records if r.startswith("Plain step:")]})
    """
    out = _probe(run_in_tree, tree, plugin_site, LAUNCHER, head, WORKER, llama_draft, SWITCH, body)
    assert out["policy"] == "CatchUpPolicy" and out["kv_only"]
    assert out["built"] == [[0, 1, [1, 2, 4, 8, 16, 24, 32, 40, 48, 64]]]
    assert out["steps"] == [3, 0, 0, 0, 3, 3]  # 20 <= 28 resumes after one catch-up step
    assert out["lines"][0] == ("Plain step: plain steps and prefills in plain mode write only the "
                               "draft's K/V, one catch-up step before speculation resumes")
    assert checks.draft_plain_step({}, "\n".join(out["lines"])) == "kv_only"  # what the smoke reads
    # no CUDA graphs for its prefills unless asked for, and the log says why; asked for, this
    # draft cannot have them either
    assert out["lines"][-1] == ("Plain step: prefills in plain mode write the draft's K/V eagerly: "
                                "SGLANG_IMAGE_PREFILL_KV_GRAPHS is not 1 (off by default)")
    asked = _probe(run_in_tree, tree, plugin_site, LAUNCHER, head, WORKER, llama_draft, SWITCH, body,
                   env={"SGLANG_IMAGE_PREFILL_KV_GRAPHS": "1"})
    assert asked["lines"][-1] == ("Plain step: prefills in plain mode write the draft's K/V eagerly: "
                                  "the draft has no fc layer over the target's hidden states")
    other = _probe(run_in_tree, tree, plugin_site, LAUNCHER, head, WORKER, SWITCH, body)
    assert other["policy"] == "ThresholdPolicy" and not other["kv_only"]
    assert other["steps"] == [3, 0, 0, 3, 3, 3]
    assert other["lines"][0] == ("Plain step: plain steps run the draft's full step: the draft is "
                                 "NoneType, not a Llama EAGLE-3 draft")
    assert checks.draft_plain_step({}, "\n".join(other["lines"])) == "full"


def test_worker_untouched_without_a_threshold(run_in_tree, tree, plugin_site, model_dir) -> None:  # type: ignore[no-untyped-def]
    head = f"MODEL = {str(model_dir)!r}\nARGS = []\nTRACE = [1, 64, 1]\nHF_CONFIG = {{}}\n"
    body = """
        emit({"controller": worker.adaptive_controller is None, "steps": steps,
              "start": [r for r in records if r.startswith("Dynamic speculation disable")]})
    """
    out = _probe(run_in_tree, tree, plugin_site, LAUNCHER, head, WORKER, SWITCH, body)
    assert out == {"controller": True, "steps": [3, 3, 3], "start": []}


def test_worker_refuses_a_draft_sharing_qsa_indices(run_in_tree, tree, plugin_site, model_dir) -> None:  # type: ignore[no-untyped-def]
    head = (f"MODEL = {str(model_dir)!r}\nARGS = ['--speculative-disable-batch-threshold', '8']\n"
            "TRACE = []\nHF_CONFIG = {'index_share_for_mtp_iteration': True}\n")
    body = """
        try:
            hook(None, worker)
        except ValueError as e:
            emit({"error": str(e)})
    """
    out = _probe(run_in_tree, tree, plugin_site, LAUNCHER, head, WORKER, body)
    assert "--speculative-disable-batch-threshold is not supported with a draft that shares QSA" \
        in out["error"]


def _doctored_copy(tree: Path, dest: Path) -> Path:
    """The files the check reads, copied from the wheel (and its dist-info)."""
    for dotted in [h.target for h in targets.HOOKS] + list(targets.RELIED):
        located = plugin_check._locate(tree, dotted)
        assert located is not None, dotted
        copy = dest / located[0].relative_to(tree)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(located[0], copy)
    shutil.copytree(next(tree.glob("sglang-*.dist-info")), dest / f"sglang-{SGLANG_VERSION}.dist-info")
    return dest


def test_hook_target_check_passes_on_the_wheel_and_names_what_changed(tree: Path, tmp_path: Path) -> None:
    assert plugin_check.check_hook_targets(tree, SGLANG_VERSION) == []
    doctored = _doctored_copy(tree, tmp_path / "site")
    assert plugin_check.check_hook_targets(doctored, SGLANG_VERSION) == []
    worker = doctored / "sglang/srt/speculative/eagle_worker_v2.py"
    text = worker.read_text()
    worker.write_text(text.replace("draft_token_num=1,", "draft_token_num=2,", 1))
    state = doctored / "sglang/srt/managers/scheduler_components/internal_state.py"
    state.write_text(state.read_text().replace("def _add_speculative(", "def _add_spec_info(", 1))
    problems = plugin_check.check_hook_targets(doctored, SGLANG_VERSION)
    assert problems == [
        ("hook target sglang.srt.managers.scheduler_components.internal_state."
         "SchedulerInternalStateController._add_speculative (after: adds speculative_disable to "
         f"the server info) does not exist in sglang {SGLANG_VERSION}: move the hook"),
        ("sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2._build_trivial_verify_input "
         f"changed in sglang {SGLANG_VERSION} since the plugin was checked against it: review it, "
         "then record the digests again"),
    ]
    assert any("no digests recorded for sglang 0.5.99" in p
               for p in plugin_check.check_hook_targets(tree, "0.5.99"))


def test_plugin_check_command(tree: Path) -> None:
    from sglang_image.cli import main

    assert main(["plugin-check", "--site-packages", str(tree)]) == 0


# The clocks the auto policy times its steps (perf_counter) and rate-limits its mode line
# (monotonic) with, as it reads them when built: the trace's.
FAKE_CLOCK = textwrap.dedent("""
    import math, random, time
    CLOCK = [0.0]
    time.perf_counter = time.monotonic = lambda: CLOCK[0]
""")

# A synthetic step-time trace through upstream's adaptive controller: per decode batch,
# EAGLEWorkerV2.activate_step_by_batch (as forward_batch_generation calls it), then the
# previous batch's verify result through EAGLEWorkerV2.on_verify_complete_cpu (as the
# overlap scheduler delivers it, a step late); the clock moves by the cost model's step
# time for the chosen mode, with 10% noise. A speculative step accepts 2 drafts per request
# (3 tokens); the model's crossover lies at 32 requests: speculative 7 ms + 0.4 ms per
# request for 3 tokens each, plain 5 ms + 0.05 ms per request for one.
AUTO_TRACE = textwrap.dedent("""
    rng = random.Random(0)
    def seconds(steps, bs):
        return 7e-3 + 4e-4 * bs if steps else 5e-3 + 5e-5 * bs
    def traffic(n):
        out = []
        while len(out) < n:
            level = round(math.exp(rng.uniform(0, math.log(256))))
            out += [min(256, max(1, level + rng.randint(-2, 2))) for _ in range(rng.randint(50, 300))]
        return out[:n]
    late = []
    def run(batches, crossovers=None):
        out = []
        for bs in batches:
            EAGLEWorkerV2.activate_step_by_batch(worker, bs)
            k = worker.speculative_num_steps
            out.append(k)
            if late:
                drafts, size = late.pop()
                EAGLEWorkerV2.on_verify_complete_cpu(worker, drafts, batch_size=size)
            late.append(([2 if k else 0] * bs, bs))
            CLOCK[0] += seconds(k, bs) * math.exp(rng.gauss(0, 0.1))
            if crossovers is not None:
                crossovers.append(controller.params.controller.crossover())
        return out
""")


def test_worker_auto_learns_the_crossover_and_reports_it(run_in_tree, tree, plugin_site, model_dir) -> None:  # type: ignore[no-untyped-def]
    head = (f"MODEL = {str(model_dir)!r}\nARGS = ['--speculative-disable-batch-threshold', 'auto']\n"
            "TRACE = []\nHF_CONFIG = {}\n")
    body = """
        from sglang_image_plugin.auto_policy import AutoPolicy
        ctl = controller.params.controller
        learned = run(traffic(20000))
        crossover = ctl.crossover()
        explored, tried = ctl.explore_steps, ctl.trial_steps
        # a ramp up through the crossover to the top and back, 8 steps per batch size
        ramp = [b for b in [*range(1, 257), *range(256, 0, -1)] for _ in range(8)]
        crossovers = []
        ramp_steps = run(ramp, crossovers)

""" + ATTACH_SCHEDULER + """        state = {}
        SchedulerInternalStateController(Scheduler, record_step_time=False)._add_speculative(state)
        from prometheus_client import REGISTRY
        emit({"policy": policy, "is_auto_policy": isinstance(controller.params, AutoPolicy),
              "max_batch_size": ctl.config.max_batch_size, "built": built,
              "crossover": crossover, "ramp_crossovers": sorted(set(crossovers)),
              "ramp": ramp, "ramp_steps": ramp_steps, "ramp_explored": ctl.explore_steps - explored,
              "ramp_tried": ctl.trial_steps - tried, "trial_bound": 2 * (len(ramp) // ctl.config.trial_gap + 1)
              * (ctl.config.most_trial_steps + 2), "burst": ctl.config.explore_steps,
              "unrecorded": controller.params.dropped, "state": state["speculative_disable"],
              "gauge": REGISTRY.get_sample_value("sglang:spec_disable_crossover",
                                                 Scheduler.metrics_collector.labels),
              "start": [r for r in records if r.startswith("Dynamic speculation disable")],
              "lines": [r for r in records if r.startswith("Speculation ")]})
    """
    out = _probe(run_in_tree, tree, plugin_site, LAUNCHER, head, WORKER, FAKE_CLOCK, SWITCH,
                 AUTO_TRACE, body)
    assert out["start"] == ["Dynamic speculation disable enabled: threshold=auto"]
    assert out["policy"] == "AutoThresholdPolicy" and out["is_auto_policy"]
    assert out["max_batch_size"] == 256  # the target's max running requests
    # upstream built the zero-step state for every captured size: the crossover moves
    assert out["built"] == [[0, 1, [1, 2, 4, 8, 16, 24, 32, 40, 48, 64]]]
    # learned from the trace: the cost model's crossover (32), held through the ramp
    assert out["crossover"] == 32 and out["ramp_crossovers"] == [32]
    assert out["unrecorded"] <= 1  # every step timed and paired with its result, the last aside
    # on the ramp the worker switches as a fixed threshold 32 would (plain above 32,
    # speculative again at <= 28), except for the bounded exploration and trial steps
    expected, mode = [], 3
    for bs in out["ramp"]:
        mode = 0 if mode == 3 and bs > 32 else 3 if mode == 0 and bs <= 28 else mode
        expected.append(mode)
    mismatches = sum(a != b for a, b in zip(out["ramp_steps"], expected, strict=True))
    assert mismatches == out["ramp_explored"] + out["ramp_tried"]
    assert out["ramp_explored"] <= (len(out["ramp"]) // 256 + 1) * out["burst"]
    assert out["ramp_tried"] <= out["trial_bound"]
    assert 0 in out["ramp_steps"] and 3 in out["ramp_steps"]
    # reported: server info, the gauge, the mode line
    assert out["state"]["threshold"] == "auto" and out["state"]["crossover"] == 32
    assert out["gauge"] == 32.0
    assert out["lines"][0] == ("Speculation crossover: auto, learned online per batch-size "
                               "bucket up to 256 running requests; starting speculative everywhere")
    assert any(line.startswith("Speculation crossover -> 32 (auto, was ") for line in out["lines"])


# A synthetic trace for the learned depth schedule through upstream's adaptive controller, as
# AUTO_TRACE drives the threshold's `auto`: per bucket the tokens/s of each depth as a share of the
# best (the best depth 3 up to 16 requests, 2 up to 64, 1 up to 128, plain above, each by 10% or
# more), a request accepting A = 0, 1, 2 or 3 of K = 3 drafts in turn (min(A, depth) at a depth).
DEPTH_TRACE = textwrap.dedent("""
    rng = random.Random(0)
    RATIO = [(16, [.5, .7, .85, 1]), (64, [.7, .85, 1, .85]), (128, [.85, 1, .9, .75]), (256, [1, .85, .75, .6])]
    TOKENS = [1, 1.75, 2.25, 2.5]  # 1 + E[min(A, depth)]
    def seconds(k, bs):
        share = next(r for edge, r in RATIO if bs <= edge)[k]
        return bs * TOKENS[k] / (share * 2 * bs / (5e-3 + 4e-5 * bs))
    def traffic(n):
        out = []
        while len(out) < n:
            level = round(math.exp(rng.uniform(0, math.log(256))))
            out += [min(256, max(1, level + rng.randint(-2, 2))) for _ in range(rng.randint(20, 60))]
        return out[:n]
    late = []
    def run(batches):
        out = []
        for bs in batches:
            EAGLEWorkerV2.activate_step_by_batch(worker, bs)
            k = worker.speculative_num_steps
            out.append(k)
            if late:
                drafts, size = late.pop()
                EAGLEWorkerV2.on_verify_complete_cpu(worker, drafts, batch_size=size)
            late.append(([min(i % 4, k) for i in range(bs)], bs))
            CLOCK[0] += seconds(k, bs) * math.exp(rng.gauss(0, 0.03))
        return out
""")


def test_worker_learns_a_depth_schedule_through_upstream_s_controller(run_in_tree, tree, plugin_site, model_dir) -> None:  # type: ignore[no-untyped-def]
    # --speculative-depth-schedule auto: upstream's controller builds a state for every depth 0..K
    # at every captured size (the schedule is learned at run time); the policy times each depth
    # per bucket and learns the schedule of the cost model; the worker then walks it.
    head = (f"MODEL = {str(model_dir)!r}\nARGS = ['--speculative-depth-schedule', 'auto']\n"
            "TRACE = []\nHF_CONFIG = {}\n")
    body = """
        ctl = controller.params.controller
        run(traffic(30000))
        learned = ctl.schedule_text
        explored = ctl.explore_steps
        ramp = [b for b in [*range(1, 257), *range(256, 0, -1)] for _ in range(4)]
        ramp_steps = run(ramp)

""" + ATTACH_SCHEDULER + """        EAGLEWorkerV2.activate_step_by_batch(worker, 200)
        state = {}
        SchedulerInternalStateController(Scheduler, record_step_time=False)._add_speculative(state)
        from prometheus_client import REGISTRY
        emit({"policy": policy, "built": built, "learned": learned, "ramp": ramp, "ramp_steps": ramp_steps,
              "ramp_explored": ctl.explore_steps - explored, "burst": ctl.config.explore_steps,
              "state": state["speculative_disable"],
              "depth_gauge": REGISTRY.get_sample_value("sglang:spec_disable_depth",
                                                       Scheduler.metrics_collector.labels),
              "start": [r for r in records if r.startswith("Dynamic speculation disable")],
              "lines": [r for r in records if r.startswith("Speculation depth schedule")]})
    """
    out = _probe(run_in_tree, tree, plugin_site, LAUNCHER, head, WORKER, FAKE_CLOCK, SWITCH,
                 DEPTH_TRACE, body)
    assert out["start"] == ["Dynamic speculation disable enabled: depth schedule=auto"]
    assert out["policy"] == "AutoDepthPolicy"
    # depth 3 is the launch state; every other depth at every captured size
    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48, 64]
    assert sorted(out["built"]) == [[0, 1, sizes], [1, 2, sizes], [2, 3, sizes]]
    assert out["learned"] == "1-16:3,17-64:2,65-128:1,129-:0"
    # on the ramp the worker walks the learned schedule (hysteresis edge // 8), exploration aside
    from sglang_image_plugin.depth_schedule import DepthController
    from sglang_image_plugin.setting import parse_schedule
    walk = DepthController(parse_schedule(out["learned"]))
    expected = [walk.step(bs) for bs in out["ramp"]]
    mismatches = sum(a != b for a, b in zip(out["ramp_steps"], expected, strict=True))
    assert mismatches == out["ramp_explored"] <= (len(out["ramp"]) // 256 + 1) * out["burst"]
    st = out["state"]
    assert (st["schedule"], st["learned"], st["depth"], st["mode"]) == ("auto", out["learned"], 0, "plain")
    assert st["accept_length_by_depth"] == pytest.approx({"0": 1.0, "1": 1.75, "2": 2.25, "3": 2.5}, abs=0.1)
    # each bucket's learned depth is the learned schedule's at its top (buckets: powers of two to
    # 32, then four per octave)
    assert [e["high"] for e in st["estimates"]] == [1, 2, 4, 8, 16, 32, 40, 48, 56, 64, 80, 96, 112, 128,
                                                    160, 192, 224, 256]
    assert [e["depth"] for e in st["estimates"]] == [3] * 5 + [2] * 5 + [1] * 4 + [0] * 4
    assert out["depth_gauge"] == 0.0  # the step at 200 requests, once the metrics were attached
    assert out["lines"][0] == ("Speculation depth schedule: auto, learned online per batch-size bucket up "
                               "to 256 running requests and per depth 0..3; starting at depth 3 everywhere")
    assert any(line.startswith("Speculation depth schedule -> ") for line in out["lines"][1:])


def test_worker_auto_from_the_environment(run_in_tree, tree, plugin_site, model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    head = f"MODEL = {str(model_dir)!r}\nARGS = []\nTRACE = [1] * 8\nHF_CONFIG = {{}}\n"
    body = """
        import json as _json, os as _os
        inner = getattr(controller.params, "inner", controller.params)
        for k in steps:  # the steps' verify results, in decode order
            inner.on_verify_complete([2 if k else 0], 1)
        inner.note_idle()  # the scheduler goes idle: the step trace is written out
        with open(_os.environ["SGLANG_IMAGE_AUTO_TRACE"]) as fh:
            traced = [_json.loads(line)["kind"] for line in fh]
        emit({"policy": policy, "steps": steps, "traced": traced,
              "start": [r for r in records if r.startswith("Dynamic speculation disable")],
              "auto": [r for r in records if r.startswith("Speculation crossover: auto")]})
    """
    trace = tmp_path / "auto-steps.jsonl"
    out = _probe(run_in_tree, tree, plugin_site, LAUNCHER, head, WORKER, FAKE_CLOCK, SWITCH, body,
                 env={ENV: "auto", "SGLANG_IMAGE_AUTO_TRACE": str(trace)})
    # cold start: speculative, after one burst measuring plain (nothing measured yet)
    assert out["policy"] == "AutoThresholdPolicy" and out["steps"] == [0] * 6 + [3, 3]
    assert out["start"] == ["Dynamic speculation disable enabled: threshold=auto"]
    # the step trace the environment asked for: the steps settled so far, and where it goes
    assert out["traced"] == ["plain"] * 6 + ["speculative"] * 2
    assert out["auto"] and out["auto"][0].endswith(f"; its steps traced to {trace}")


ENTRYPOINT = pins.REPO_ROOT / "images" / "tool" / "entrypoint.sh"


@pytest.mark.parametrize(("plugins", "argv", "env_threshold", "starts"), [
    ("other", ["--speculative-disable-batch-threshold", "8"], None, False),
    ("other, extra", [], "16", False),
    ("other,sglang_image", ["--speculative-disable-batch-threshold", "8"], "16", True),
    ("", ["--speculative-disable-batch-threshold", "8"], None, True),  # empty: every plugin
    ("other", ["--model-path", "m"], None, True),  # the feature is not asked for
])
def test_image_entrypoint_refuses_a_plugin_allowlist_without_ours(
        tmp_path: Path, plugins: str, argv: list[str], env_threshold: str | None,
        starts: bool) -> None:
    # SGLang would skip the plugin and ignore the environment variable without a word.
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho STARTED \"$@\"\n")
    python.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "SGLANG_PYTHON": str(python), "SGLANG_PLUGINS": plugins}
    if env_threshold is not None:
        env["SGLANG_SPEC_DISABLE_BATCH_THRESHOLD"] = env_threshold
    proc = subprocess.run(["sh", str(ENTRYPOINT), *argv], env=env, capture_output=True,
                          text=True, check=False)
    if starts:
        assert proc.returncode == 0 and proc.stdout.startswith("STARTED -m sglang.launch_server")
    else:
        assert proc.returncode == 2 and "STARTED" not in proc.stdout
        assert f"SGLANG_PLUGINS={plugins} leaves out sglang_image" in proc.stderr
        assert "add sglang_image to SGLANG_PLUGINS" in proc.stderr


def test_plain_target_swaps_the_zero_step_runner_only(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # A worker with a plain step (every threshold worker): the zero-step state's target graph is
    # captured in DECODE mode (no verify input, hidden states for the draft); every other state,
    # and every state of a worker without a threshold, keeps upstream's runner. Where the plain
    # step defers the draft's K/V write, the graph writes them (a tail hook on the target's
    # runner, its books cleared after the capture's dummy runs); elsewhere no hook.
    out = _probe(run_in_tree, tree, plugin_site, """
        import torch
        from types import SimpleNamespace as NS
        from sglang.srt.speculative import eagle_worker_v2
        from sglang_image_plugin import plain_step, plain_target, state
        from sglang_image_plugin.state import DraftState, WorkerState
        seen = []
        def original(worker, steps, tokens, *a, **k):
            seen.append([steps, eagle_worker_v2.DecodeCudaGraphRunner.__name__])
        def worker(step, hooks=None):
            dw = NS(draft_runner=NS(model=NS(model=NS(fc=torch.nn.Linear(36, 16, bias=False))),
                                    token_to_kv_pool=None))
            w = NS(draft_worker=dw, target_worker=NS(model_runner=NS(
                capture_tail_hooks=hooks if hooks is not None else [],
                req_to_token_pool=NS(req_to_token=torch.zeros(8, 4)))))
            if step is not None:
                state.of(w, WorkerState).plain_step = step
            return w
        deferred = plain_step.PlainStep(kv_only_reason=None, layout_reason=None, deferred_reason=None)
        eager = plain_step.PlainStep(kv_only_reason=None, layout_reason="sync", deferred_reason="sync")
        plain_target.build_runtime_state(original, worker(eager), 0, 1)
        plain_target.build_runtime_state(original, worker(eager), 3, 4)
        plain_target.build_runtime_state(original, worker(None), 0, 1)
        cls = plain_target.runner_class()
        def graph_run(step):
            hooks = []
            w = worker(step, hooks)
            def capture(worker, steps, tokens, *a, **k):
                d = state.of(w.draft_worker, DraftState).deferred
                if d is not None:
                    d.pos[1] = 5  # what a capture run with dummy rows leaves
            plain_target.build_runtime_state(capture, w, 0, 1)
            d = state.of(w.draft_worker, DraftState).deferred
            return [len(hooks), None if d is None else [list(d.hidden.shape), d.pos.tolist()]]
        emit({"seen": seen, "base": [b.__name__ for b in cls.__mro__[1:3]],
              "spec_info": cls.get_spec_info(None, 8),
              "restored": eagle_worker_v2.DecodeCudaGraphRunner.__name__,
              "graph": [graph_run(deferred), graph_run(eager)]})
    """)
    assert out["seen"] == [[0, "PlainDecodeCudaGraphRunner"], [3, "DecodeCudaGraphRunner"],
                           [0, "DecodeCudaGraphRunner"]]
    assert out["base"][0] == "DecodeCudaGraphRunner" and out["spec_info"] is None
    assert out["restored"] == "DecodeCudaGraphRunner"
    assert out["graph"] == [[1, [[8, 36], [-1] * 8]], [0, None]]



def test_each_depth_state_s_memory_is_logged_and_in_the_server_info(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # Each runtime state upstream builds for a depth other than the launch one takes GPU memory
    # (its graphs, an attention workspace) that the KV pool no longer has: counted per depth from
    # what this process's allocator holds before and after its build, logged with the running
    # total, and shown in the server info. Without a GPU nothing is counted.
    out = _probe(run_in_tree, tree, plugin_site, """
        import logging
        from types import SimpleNamespace as NS
        from sglang_image_plugin import gpu_memory, observe, plain_step, plain_target, state
        from sglang_image_plugin.state import WorkerState
        lines = []
        class Keep(logging.Handler):
            def emit(self, record):
                lines.append(record.getMessage())
        logging.getLogger("sglang_image_plugin").addHandler(Keep())
        logging.getLogger("sglang_image_plugin").setLevel(logging.INFO)
        def original(worker, steps, tokens, *a, **k):
            return steps
        w = NS(draft_worker=None, target_worker=NS(model_runner=NS(capture_tail_hooks=[])))
        own = state.of(w, WorkerState)
        own.plain_step = plain_step.PlainStep(kv_only_reason=None, layout_reason="sync", deferred_reason="sync")
        own.controller = NS(snapshot=lambda: {"depth": 3})
        gib = 2 ** 30
        helds = iter([1 * gib, 1.5 * gib, 1.5 * gib, 2.25 * gib])
        gpu_memory.held_bytes = lambda: int(next(helds))
        built = [plain_target.build_runtime_state(original, w, 0, 1, cuda_graph_bs=[64, 128, 256]),
                 plain_target.build_runtime_state(original, w, 1, 2, cuda_graph_bs=[1, 2, 4, 8, 16])]
        info = {}
        observe.add_speculative_state(None, NS(scheduler=NS(draft_worker=w)), info)
        gpu_memory.held_bytes = lambda: None
        bare = NS(draft_worker=None)
        state.of(bare, WorkerState).controller = NS(snapshot=lambda: {"depth": 3})
        plain_target.build_runtime_state(original, bare, 2, 3, cuda_graph_bs=[8])
        info_bare = {}
        observe.add_speculative_state(None, NS(scheduler=NS(draft_worker=bare)), info_bare)
        emit({"built": built, "memory": own.state_memory, "info": info["speculative_disable"],
              "bare": info_bare["speculative_disable"],
              "lines": [x for x in lines if x.startswith("Speculation state depth")]})
    """)
    gib = 2 ** 30
    assert out["built"] == [0, 1]
    assert out["memory"] == {"0": gib // 2, "1": 3 * gib // 4}
    assert out["info"]["state_memory_gib"] == {"0": 0.5, "1": 0.75}
    assert out["bare"] == {"depth": 3}
    assert out["lines"] == [
        ("Speculation state depth 0: 0.50 GiB (graphs at 3 batch sizes up to 256); the extra depth "
         "states take 0.50 GiB beside the launch depth's"),
        ("Speculation state depth 1: 0.75 GiB (graphs at 5 batch sizes up to 16); the extra depth "
         "states take 1.25 GiB beside the launch depth's")]


# The fake draft's worker: its runner (model, KV pool, slot translators), as the hooks read it.
EAGLE3_DRAFT = EAGLE3_LEAVES + """
def draft_worker(model, steps=0, pool=None, catch_up=None, translating=False):
    from sglang_image_plugin import state
    from sglang_image_plugin.state import DraftState
    class Algo:
        def is_standalone(self):
            return False
    runner = NS(model=NS(model=model), token_to_kv_pool=pool if pool is not None else RecordingPool(),
                kv_index_translator=NS(is_translating=translating), spec_algorithm=Algo(),
                model_config=NS(spec_hidden_size=D, dtype=torch.float32))
    w = NS(draft_runner=runner, speculative_num_steps=steps, topk=1, device="cpu",
           target_worker=NS(model_runner=NS(kv_index_translator=NS(is_translating=False))))
    if catch_up is not None:
        state.of(w, DraftState).catch_up = catch_up
    return w
"""


def test_draft_kv_only_write_equals_the_full_forward(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # decode-kv: write_draft_kv puts into the draft's KV cache exactly the K/V that upstream's full
    # forward of the one-layer EAGLE-3 draft hands to attention, at the given slots.
    out = _probe(run_in_tree, tree, plugin_site, EAGLE3_DRAFT, """
        from sglang_image_plugin import draft_kv
        model = make_draft()
        with torch.no_grad():
            k_full, v_full = full_forward_kv(model, TOKENS, POSITIONS, TARGET_HIDDEN)
            pool, other = RecordingPool(), RecordingPool()
            draft_kv.write_draft_kv(model, TOKENS, POSITIONS, TARGET_HIDDEN, SLOTS, pool)
            draft_kv.write_draft_kv(model, TOKENS, POSITIONS + 1, TARGET_HIDDEN, SLOTS, other)
        (layer, wloc, k, v, ks, vs), = pool.writes
        emit({"k_equal": bool(torch.equal(k, k_full)), "v_equal": bool(torch.equal(v, v_full)),
              "layer": layer is model.layers[0].self_attn.attn, "loc": wloc.tolist(), "scales": [ks, vs],
              "position_matters": not torch.equal(other.writes[0][2], k),
              "one_layer": draft_kv.why_not_kv_only(draft_worker(model), False),
              "two_layers": draft_kv.why_not_kv_only(draft_worker(make_draft(2)), False),
              "translated": draft_kv.why_not_kv_only(draft_worker(model, translating=True), False),
              "rejection": draft_kv.why_not_kv_only(draft_worker(model), True)})
    """)
    assert out["k_equal"] and out["v_equal"] and out["layer"] and out["position_matters"]
    assert out["loc"] == [70, 71, 12, 99] and out["scales"] == [None, None]
    assert out["one_layer"] is None
    assert out["two_layers"] == "the draft has 2 layers (a deeper layer's K/V need attention)"
    assert out["translated"] == "the draft's KV slots are translated"
    assert out["rejection"] == "rejection sampling carries the draft's probabilities between steps"


def test_draft_kv_only_write_projects_k_and_v_alone(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # GPU time per plain step (issue 41; profile of the 8B-shaped threshold server: the plain
    # step's K/V projection GEMM 0.03 ms of its 0.16 ms over plain's): an unquantized fused QKV
    # projection runs its K/V rows alone, and the K/V written are the full projection's. A
    # quantized one (another linear method) runs whole.
    out = _probe(run_in_tree, tree, plugin_site, EAGLE3_DRAFT, """
        from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
        from sglang_image_plugin import draft_kv

        class FusedQKV(nn.Module):  # sglang's QKVParallelLinear on one rank: [Q; K; V] weight rows
            def __init__(self, weight, method):
                super().__init__()
                self.weight, self.bias, self.skip_bias_add = nn.Parameter(weight), None, False
                self.quant_method, self.calls = method, 0
            def forward(self, x):
                self.calls += 1
                return torch.nn.functional.linear(x, self.weight), None

        class OtherMethod:  # a quantized linear's method
            pass

        model = make_draft()
        attn = model.layers[0].self_attn
        weight = attn.qkv_proj.lin.weight.detach().clone()
        res = {}
        with torch.no_grad():
            for name, method in (("unquantized", UnquantizedLinearMethod()), ("quantized", OtherMethod())):
                attn.qkv_proj = FusedQKV(weight, method)
                k_full, v_full = full_forward_kv(model, TOKENS, POSITIONS, TARGET_HIDDEN)
                full_calls = attn.qkv_proj.calls
                pool = RecordingPool()
                draft_kv.write_draft_kv(model, TOKENS, POSITIONS, TARGET_HIDDEN, SLOTS, pool)
                (_, _, k, v, _, _), = pool.writes
                res[name] = {"projection_calls": attn.qkv_proj.calls - full_calls,
                             "k": torch.allclose(k, k_full, rtol=1e-6, atol=1e-6),
                             "v": torch.allclose(v, v_full, rtol=1e-6, atol=1e-6)}
        emit(res)
    """)
    assert out["unquantized"] == {"projection_calls": 0, "k": True, "v": True}, out
    assert out["quantized"] == {"projection_calls": 1, "k": True, "v": True}, out


def test_plain_step_writes_draft_kv_only_except_catch_up_speculative_and_idle(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # The hook around EagleDraftWorker._draft_extend_for_decode: a plain (zero-step) step of a
    # worker set up for decode-kv writes the draft's K/V of the token it sampled, at the slot its
    # target wrote, and leaves placeholders for the proposal; the catch-up step, a speculative
    # step, an idle batch and a worker without decode-kv run upstream's full draft extend.
    out = _probe(run_in_tree, tree, plugin_site, EAGLE3_DRAFT, """
        from sglang_image_plugin import draft_extend, draft_kv
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        model = make_draft()
        calls = []
        def original(worker, batch, result, *a, **k):
            calls.append(k.get("kv_loc_plan", "none"))
        def batch(mode=ForwardMode.TARGET_VERIFY):
            return NS(forward_mode=mode, seq_lens=torch.tensor([5, 9, 30], dtype=torch.int32),
                      out_cache_loc=torch.tensor([70, 71, 99]))
        def result():
            return NS(next_token_ids=torch.tensor([3, 17, 8], dtype=torch.int32),
                      logits_output=NS(hidden_states=torch.randn(3, 3 * TARGET)),
                      next_draft_input=NS(topk_p=None, topk_index=None, hidden_states=None))
        kv_only, full = NS(full_draft_extend=False), NS(full_draft_extend=True)
        routed = {}
        for name, worker, b in [("no_setup", draft_worker(model), batch()),
                                ("speculative", draft_worker(model, steps=3, catch_up=kv_only), batch()),
                                ("catch_up", draft_worker(model, catch_up=full), batch()),
                                ("idle", draft_worker(model, catch_up=kv_only), batch(ForwardMode.IDLE))]:
            n = len(calls)
            draft_extend.draft_extend_for_decode(original, worker, b, result(), kv_loc_plan="plan")
            routed[name] = calls[n:] == ["plan"] and not worker.draft_runner.token_to_kv_pool.writes
        pool = RecordingPool()
        worker, b, r = draft_worker(model, pool=pool, catch_up=kv_only), batch(), result()
        with torch.no_grad():
            draft_extend.draft_extend_for_decode(original, worker, b, r, kv_loc_plan="plan")
            ref = RecordingPool()
            draft_kv.write_draft_kv(model, torch.tensor([3, 17, 8]), torch.tensor([5, 9, 30]),
                                    r.logits_output.hidden_states, torch.tensor([70, 71, 99]), ref)
        (_, loc, k, v, _, _), = pool.writes
        nd = r.next_draft_input
        emit({"routed": routed, "calls": len(calls), "loc": loc.tolist(),
              "same_kv": bool(torch.equal(k, ref.writes[0][2]) and torch.equal(v, ref.writes[0][3])),
              "stubs": [list(nd.topk_p.shape), str(nd.topk_p.dtype), list(nd.topk_index.shape),
                        str(nd.topk_index.dtype), list(nd.hidden_states.shape)]})
    """)
    assert out["routed"] == {"no_setup": True, "speculative": True, "catch_up": True, "idle": True}
    assert out["calls"] == 4  # the K/V-only step did not call upstream's draft extend
    assert out["loc"] == [70, 71, 99] and out["same_kv"]
    assert out["stubs"] == [[3, 1], "torch.float32", [3, 1], "torch.int64", [3, 16]]


# A prefill of three requests for the draft's extend, on the real ForwardBatch.init_new and
# upstream's real EagleDraftWorker._draft_extend_for_prefill: request 0 extends 3 tokens after a
# cached prefix of 5, request 1 a whole prompt of 2, request 2 a chunk of 3 after 4 whose next
# prompt token is 47 (its tail). The draft's runner runs the real one-layer LlamaModel.forward
# with upstream's rope; its attention records the K/V it would write. Stand-ins: the batch's and
# requests' unused fields (None), the server-wide config reads (parallel widths, MoE backends,
# rejection sampling) and the target's forward.
PREFILL_FAKES = EAGLE3_DRAFT + """
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_parallel
from sglang.srt.speculative import eagle_worker_v2 as ew
import contextlib
ew.get_spec = lambda: NS(speculative_use_rejection_sampling=False)
ew.speculative_moe_backend_context = ew.speculative_moe_a2a_backend_context = contextlib.nullcontext

class Unset(NS):
    def __getattr__(self, name):
        return None

class DraftRunner:  # the draft's ModelRunner as the draft extend uses it
    device, is_draft_worker, prefill_attention_backend_str = "cpu", True, "torch_native"
    lora_manager = canary_manager = None
    ngram_embedding_manager = NS(enabled=False)
    kv_index_translator = NS(is_translating=False)
    spec_algorithm = NS(is_standalone=lambda: False)
    def __init__(self, model, dtype):
        self.model, self.forwards = NS(model=model), 0
        self.token_to_kv_pool = RecordingPool()
        self.model_config = NS(model_is_mrope=False, requires_mm_token_modalities=False,
                               spec_hidden_size=D, dtype=dtype)
    def forward(self, fb):
        self.forwards += 1
        self.positions = fb.positions.tolist()
        hidden, aux = self.model.model.forward(fb.input_ids, fb.positions, fb)
        last = torch.cumsum(fb.extend_seq_lens, 0) - 1
        logits = (hidden[last].float() @ torch.arange(D * VOCAB, dtype=torch.float32).reshape(D, VOCAB).sin())
        return NS(logits_output=LogitsProcessorOutput(next_token_logits=logits, hidden_states=aux[0][last]))

class Plan:  # the target prefill's plan: the draft writes the target's slots
    def bind(self, fb, translator, cols=None):
        fb.out_cache_loc = SLOTS3

SLOTS3 = torch.tensor([40, 41, 42, 50, 51, 60, 61, 62])
SAMPLED = torch.tensor([13, 22, 31])

def prefill_batch(mode=ForwardMode.EXTEND):
    reqs = [Unset(rid=r, extend_end=e, full_untruncated_fill_ids=[0] * f)
            for r, e, f in (("a", 8, 8), ("b", 2, 2), ("c", 7, 12))]
    return Unset(forward_mode=mode, input_ids=torch.tensor([10, 11, 12, 20, 21, 30, 31, 32]),
                 extend_lens=[3, 2, 3], prefix_lens=[5, 0, 4], extend_num_tokens=8,
                 seq_lens=torch.tensor([8, 2, 7]), seq_lens_cpu=torch.tensor([8, 2, 7]),
                 out_cache_loc=SLOTS3, reqs=reqs, req_pool_indices=torch.tensor([4, 6, 9]),
                 extend_logprob_start_lens=[0, 0, 0], chunked_req=reqs[2],
                 chunked_req_next_prompt_token=47)

def prefill_draft(dtype=torch.float32, catch_up=None):
    torch.manual_seed(1)
    model = make_draft()
    model.layers[0].self_attn.rotary_emb = real_rope()
    model = model.to(dtype)
    runner = DraftRunner(model, dtype)
    dw = object.__new__(ew.EagleDraftWorker)
    dw.__dict__.update(draft_runner=runner, speculative_algorithm=runner.spec_algorithm, topk=1,
                       device="cpu", seed_dsa_topk_from_draft_extend=False,
                       parallel_layout=NS(tp_group=None))
    if catch_up is not None:
        state.of(dw, DraftState).catch_up = catch_up
    return dw, runner

def target_hidden(dtype=torch.float32):
    torch.manual_seed(2)
    return torch.randn(8, 3 * TARGET).to(dtype)

def parallel():
    return get_parallel().override(moe_ep_size=1, attn_dcp_size=1)
"""


def test_kv_only_prefill_writes_the_full_draft_extends_kv(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # A prefill while the mode is plain: the K/V the hook writes into the draft's pool equal, bit
    # for bit, in float32 and in bfloat16, what upstream's full draft extend of the same prefill
    # hands to the draft's attention (the tokens shifted by one, each request's tail, the
    # positions after its cached prefix), at the target's slots; the new requests get
    # upstream's placeholder proposal and their sampled tokens as bonus tokens.
    out = _probe(run_in_tree, tree, plugin_site, PREFILL_FAKES, """
        from sglang_image_plugin import draft_extend, state
        from sglang_image_plugin.state import DraftState
        original = ew.EagleDraftWorker._draft_extend_for_prefill
        res = {}
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            with torch.no_grad(), parallel():
                full, full_runner = prefill_draft(dtype)
                original(full, prefill_batch(), target_hidden(dtype), SAMPLED, None, kv_loc_plan=Plan())
                k_full, v_full = full.draft_runner.model.model.layers[0].self_attn.attn.seen[-1]
                only, runner = prefill_draft(dtype, catch_up=NS(draft_stale=True))
                nd = draft_extend.draft_extend_for_prefill(original, only, prefill_batch(), target_hidden(dtype),
                                                       SAMPLED, None, kv_loc_plan=Plan())
            (layer, loc, k, v, _, _), = runner.token_to_kv_pool.writes
            res[name] = {"k": bool(torch.equal(k, k_full)), "v": bool(torch.equal(v, v_full)),
                         "dtype": str(k.dtype), "loc": loc.tolist(), "forwards": runner.forwards,
                         "positions": full_runner.positions,
                         "stubs": [nd.topk_p.tolist(), nd.topk_index.tolist(), list(nd.hidden_states.shape),
                                   nd.bonus_tokens.tolist(), nd.num_tokens_per_req]}
        emit(res)
    """)
    for name in ("float32", "bfloat16"):
        got = out[name]
        assert got["k"] and got["v"], name
        assert got["dtype"] == f"torch.{name}"
        assert got["loc"] == [40, 41, 42, 50, 51, 60, 61, 62] and got["forwards"] == 0
        assert got["positions"] == [5, 6, 7, 0, 1, 4, 5, 6]
        assert got["stubs"] == [[[0.0]] * 3, [[0]] * 3, [3, 16], [13, 22, 31], 1]


def test_a_kv_only_prefill_from_fixed_buffers_writes_what_the_eager_path_writes(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # The prefill's draft K/V from prefill_kv.py's fixed buffers (on a GPU replayed as one graph
    # per token count; here the same code eagerly), through the hook: the real rows' K/V equal,
    # bit for bit, what upstream's full draft extend hands to attention, at the target's slots;
    # the padding (8 tokens to a count of 12) writes the padding slot 0 only. A second, smaller
    # prefill of other requests after it: nothing of the first leaks into its tokens (its tails
    # included). A prefill above the largest count falls back to the eager write.
    out = _probe(run_in_tree, tree, plugin_site, PREFILL_FAKES, """
        from sglang_image_plugin import draft_extend, prefill_kv, state
        from sglang_image_plugin.state import DraftState
        original = ew.EagleDraftWorker._draft_extend_for_prefill
        def small_batch():
            # two whole prompts of 3 and 2 tokens, at slots 7-11
            reqs = [Unset(rid=r, extend_end=e, full_untruncated_fill_ids=[0] * e) for r, e in (("d", 3), ("e", 2))]
            return Unset(forward_mode=ForwardMode.EXTEND, input_ids=torch.tensor([3, 4, 5, 6, 7]),
                         extend_lens=[3, 2], prefix_lens=[0, 0], extend_num_tokens=5,
                         seq_lens=torch.tensor([3, 2]), seq_lens_cpu=torch.tensor([3, 2]),
                         out_cache_loc=torch.tensor([7, 8, 9, 10, 11]), reqs=reqs,
                         req_pool_indices=torch.tensor([1, 2]), extend_logprob_start_lens=[0, 0],
                         chunked_req=None, chunked_req_next_prompt_token=None)
        res = {}
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            with torch.no_grad(), parallel():
                full, _ = prefill_draft(dtype)
                k_full, v_full = [], []
                for batch, hidden, sampled in ((prefill_batch(), target_hidden(dtype), SAMPLED),
                                               (small_batch(), target_hidden(dtype)[:5] + 1, torch.tensor([9, 8]))):
                    plan = Plan() if batch.extend_num_tokens == 8 else NS(bind=lambda fb, t, cols=None: setattr(fb, "out_cache_loc", batch.out_cache_loc))
                    original(full, batch, hidden, sampled, None, kv_loc_plan=plan)
                    k, v = full.draft_runner.model.model.layers[0].self_attn.attn.seen[-1]
                    k_full.append(k)
                    v_full.append(v)
                only, runner = prefill_draft(dtype, catch_up=NS(draft_stale=True))
                model = runner.model.model
                own = state.of(only, DraftState)
                own.prefill = prefill_kv.PrefillDraftKv(model, runner.token_to_kv_pool, hidden_size=3 * TARGET,
                                                        dtype=dtype, device="cpu", counts=(6, 12))
                draft_extend.draft_extend_for_prefill(original, only, prefill_batch(), target_hidden(dtype), SAMPLED, None)
                draft_extend.draft_extend_for_prefill(original, only, small_batch(), target_hidden(dtype)[:5] + 1,
                                                      torch.tensor([9, 8]), None)
                big = prefill_kv.PrefillDraftKv(model, runner.token_to_kv_pool, hidden_size=3 * TARGET,
                                                dtype=dtype, device="cpu", counts=(4,))
                own.prefill = big
                draft_extend.draft_extend_for_prefill(original, only, small_batch(), target_hidden(dtype)[:5] + 1,
                                                      torch.tensor([9, 8]), None)
            writes = runner.token_to_kv_pool.writes
            res[name] = {
                "locs": [w[1].tolist() for w in writes],
                "real_equal": [bool(torch.equal(w[2][:n], k_full[i][:n]) and torch.equal(w[3][:n], v_full[i][:n]))
                               for (i, n), w in zip(((0, 8), (1, 5), (1, 5)), writes)],
                "counts": [big.count_for(n) for n in (1, 4, 5)] + [own.prefill is big],
            }
        emit(res)
    """)
    for name in ("float32", "bfloat16"):
        got = out[name]
        assert got["locs"] == [[40, 41, 42, 50, 51, 60, 61, 62, 0, 0, 0, 0],
                               [7, 8, 9, 10, 11, 0],
                               [7, 8, 9, 10, 11]], name  # padded to 12, to 6, then eager
        assert got["real_equal"] == [True, True, True], name
        assert got["counts"] == [4, 4, None, True]


def test_the_prefill_buffers_check_themselves_against_the_eager_write(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # PrefillDraftKv.check, as a server runs it after the capture: made-up tokens written by both
    # paths at the pool's slots 1..40, read back; the same K/V (here both eager, padded 40 to 48),
    # and a fault in the buffered path (each position one off) shows as a difference of the order
    # of the K/V themselves.
    out = _probe(run_in_tree, tree, plugin_site, PREFILL_FAKES, """
        from sglang_image_plugin import prefill_kv
        class BufferPool:  # a KV pool that keeps what it is given, by slot
            def __init__(self):
                self.k, self.v = torch.zeros(64, KV_HEADS, HD), torch.zeros(64, KV_HEADS, HD)
            def set_kv_buffer(self, layer, loc, k, v, k_scale=None, v_scale=None):
                self.k[loc], self.v[loc] = k, v
            def get_key_buffer(self, layer_id):
                return self.k
            def get_value_buffer(self, layer_id):
                return self.v
        _, runner = prefill_draft()
        model = runner.model.model
        model.layers[0].self_attn.attn.layer_id = 0
        pool = BufferPool()
        prefill = prefill_kv.PrefillDraftKv(model, pool, hidden_size=3 * TARGET, dtype=torch.float32,
                                            device="cpu", counts=(16, 48))
        res = {"same": prefill.check(), "written": int((pool.k[1:41].abs().sum((1, 2)) > 0).sum()),
               "untouched": float(pool.k[41:].abs().sum())}
        run = prefill._run
        def off_by_one(b):
            prefill.idx[:b] += 1
            run(b)
        prefill._run = off_by_one
        res["faulty"] = prefill.check()
        emit(res)
    """)
    assert out["same"] <= 1e-6 and out["written"] == 40 and out["untouched"] == 0.0, out
    assert out["faulty"] > 0.02, out


def test_kv_only_prefill_under_the_plain_layout_hands_no_placeholder_proposal(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # Host work per prefill while the mode is plain (issue 41): where the overlap scheduler's
    # FutureMap relays the draft's proposal by row (the plain layout), a K/V-only prefill makes
    # no placeholder proposal (three tensors) for the scheduler to scatter into the FutureMap
    # (three more ops): the real FutureMap then relays the sampled tokens and keeps the rows'
    # extras, which a zero-step step does not read and the catch-up step replaces; the batch's
    # draft input merges by row. Elsewhere (the synchronous scheduler merges the proposals
    # themselves) upstream's placeholders stay.
    out = _probe(run_in_tree, tree, plugin_site, PREFILL_FAKES, """
        import sglang.srt.speculative.spec_utils as spec_utils
        spec_utils.spec_need_hidden_states = lambda: True  # (reads the server's published config)
        from sglang.srt.managers.overlap_utils import FutureMap, RelayPayload
        from sglang.srt.speculative.eagle_info import EagleDraftInput
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang_image_plugin import draft_extend, state
        from sglang_image_plugin.state import DraftState
        original = ew.EagleDraftWorker._draft_extend_for_prefill
        rows = torch.tensor([4, 6, 9])
        res = {}
        for by_row in (False, True):
            fm = FutureMap(torch.device("cpu"), SpeculativeAlgorithm.EAGLE3,
                           NS(req_to_token=torch.zeros((16, 64), dtype=torch.int32)))
            # these rows' extras as a speculative step left them
            fm.stash(rows, RelayPayload(bonus_tokens=torch.tensor([1, 2, 3]), topk_p=torch.full((3, 1), 0.5),
                                        topk_index=torch.tensor([[7], [8], [9]]), hidden_states=torch.ones(3, 16)))
            dw, runner = prefill_draft(catch_up=NS(draft_stale=True))
            state.of(dw, DraftState).proposal_by_row = by_row
            with torch.no_grad(), parallel():
                nd = draft_extend.draft_extend_for_prefill(original, dw, prefill_batch(), target_hidden(), SAMPLED,
                                                       None, kv_loc_plan=Plan())
            fm.stash(rows, RelayPayload.from_draft_input(nd))   # as Scheduler._relay_forward_payload does
            nd.future_indices = rows                            # as run_batch sets it
            other = EagleDraftInput(bonus_tokens=torch.tensor([5]))
            other.future_indices = torch.tensor([2])
            nd.merge_batch(other)
            res[str(by_row)] = [[x is None for x in (nd.topk_p, nd.topk_index, nd.hidden_states)],
                                fm.output_tokens_buf[rows].tolist(), fm.topk_p_buf[rows].tolist(),
                                fm.topk_index_buf[rows].tolist(), fm.hidden_states_buf[rows].sum().item(),
                                len(runner.token_to_kv_pool.writes), nd.future_indices.tolist()]
        emit(res)
    """)
    placeholders, by_row = out["False"], out["True"]
    assert placeholders == [[False] * 3, [13, 22, 31], [[0.0]] * 3, [[0]] * 3, 0.0, 1, [4, 6, 9, 2]]
    assert by_row == [[True] * 3, [13, 22, 31], [[0.5]] * 3, [[7], [8], [9]], 48.0, 1, [4, 6, 9, 2]]


def test_prefill_runs_the_draft_forward_only_where_speculation_needs_it(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # Through upstream's EAGLEWorkerV2._forward_prefill_batch with the plugin's K/V-only hooks
    # installed as the worker installs them: while the mode is plain (a plain step ran since the
    # last full draft step) the prefill runs no forward of the draft and writes only its K/V;
    # in speculative mode, on the catch-up step's turn, after speculation resumed, for a mixed
    # batch and without a threshold it runs upstream's draft extend, unchanged (the same
    # proposal and K/V as upstream's own code without the plugin's hooks).
    out = _probe(run_in_tree, tree, plugin_site, PREFILL_FAKES, """
        from sglang_image_plugin import registry, state
        from sglang_image_plugin.policy import CatchUpPolicy
        from sglang_image_plugin.state import DraftState
        from sglang_image_plugin.targets import Group, hooks_of
        unhooked = ew.EagleDraftWorker._draft_extend_for_prefill
        registry.install(hooks_of(Group.KV_ONLY), "plain-step")
        def policy(*steps):
            inner = NS(get_steps_for_batch=lambda bs: steps_left.pop(0))
            steps_left = list(steps)
            p = CatchUpPolicy(inner)
            for _ in steps:
                p.get_steps_for_batch(8)
            return p
        def prefill(catch_up, mode=ForwardMode.EXTEND):
            dw, runner = prefill_draft(catch_up=catch_up)
            worker = object.__new__(ew.EAGLEWorkerV2)
            result = GenerationBatchResult(logits_output=LogitsProcessorOutput(
                next_token_logits=None, hidden_states=target_hidden()))
            result.next_token_ids = SAMPLED
            worker.__dict__.update(_draft_worker=dw, _target_worker=NS(
                forward_batch_generation=lambda b, **k: (setattr(result, "kv_loc_plan", Plan()), result)[1]),
                speculative_algorithm=runner.spec_algorithm)
            with torch.no_grad(), parallel():
                out = ew.EAGLEWorkerV2._forward_prefill_batch(worker, prefill_batch(mode))
            seen = runner.model.model.layers[0].self_attn.attn.seen
            return runner, out.next_draft_input, seen
        def upstream():  # the same prefill's draft extend, the hooks left out
            dw, runner = prefill_draft()
            with torch.no_grad(), parallel():
                nd = unhooked(dw, prefill_batch(), target_hidden(), SAMPLED, None, kv_loc_plan=Plan())
            return nd, runner.model.model.layers[0].self_attn.attn.seen
        ref, ref_seen = upstream()
        res = {}
        for name, catch_up, mode in (("plain", policy(0), ForwardMode.EXTEND),
                                     ("plain_again", policy(3, 0, 0), ForwardMode.EXTEND),
                                     ("speculative", policy(3), ForwardMode.EXTEND),
                                     ("catch_up_turn", policy(0, 3), ForwardMode.EXTEND),
                                     ("resumed", policy(0, 3, 3), ForwardMode.EXTEND),
                                     ("no_threshold", None, ForwardMode.EXTEND),
                                     ("mixed", policy(0), ForwardMode.MIXED)):
            runner, nd, seen = prefill(catch_up, mode)
            same = (torch.equal(nd.topk_p, ref.topk_p) and torch.equal(nd.topk_index, ref.topk_index)
                    and torch.equal(nd.hidden_states, ref.hidden_states)
                    and len(seen) == 1 and all(torch.equal(a, b) for a, b in zip(seen[0], ref_seen[0])))
            res[name] = [runner.forwards, len(runner.token_to_kv_pool.writes), bool(same)]
        emit(res)
    """)
    assert out["plain"] == [0, 1, False] and out["plain_again"] == [0, 1, False]
    for name in ("speculative", "catch_up_turn", "resumed", "no_threshold", "mixed"):
        assert out[name] == [1, 0, True], name


# The plain layout (layout.py) against upstream's real FutureMap and
# resolve_forward_inputs on the CPU; the batch, the worker and the pool are stand-ins.
LAYOUT_FAKES = """
    import torch
    from types import SimpleNamespace as NS
    from sglang.srt.managers.overlap_utils import FutureMap, RelayPayload, resolve_forward_inputs
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    import sglang.srt.speculative.spec_utils as spec_utils
    spec_utils.spec_need_hidden_states = lambda: True  # (reads the server's published config)
    import sglang.srt.managers.overlap_utils as overlap_utils
    overlap_utils.gather_spec_extras = lambda i, p, t, o, h: (  # (a triton kernel upstream)
        p[i], t[i], o[i], None if h is None else h[i])
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang_image_plugin import draft_extend, draft_kv, layout as L, state
    from sglang_image_plugin.state import DraftState, WorkerState
    from sglang_image_plugin.acceptance import AcceptanceAroundPlain
    from sglang_image_plugin.policy import CatchUpPolicy
    EAGLE = SpeculativeAlgorithm.EAGLE3
    ROWS = torch.tensor([3, 5, 7])
    REQ_TO_TOKEN = torch.arange(16 * 64, dtype=torch.int32).reshape(16, 64)  # slot = row * 64 + pos

    def setup(inner_steps, fits=True, inner=None):
        fm = FutureMap(torch.device("cpu"), EAGLE, NS(req_to_token=REQ_TO_TOKEN))
        # the last speculative step: lengths 10, 20, 30 (the KV written), its proposal
        fm.publish(ROWS, torch.tensor([10, 20, 30]))
        fm.stash(ROWS, RelayPayload(bonus_tokens=torch.tensor([100, 101, 102]),
                                    topk_p=torch.ones(3, 1), topk_index=torch.tensor([[7], [8], [9]]),
                                    hidden_states=torch.ones(3, 4)))
        freed = []
        # (a Req keeps its row under kv, as the batch does on the host: nothing else is read)
        reqs = [NS(kv=NS(kv_allocated_len=a, kv_committed_len=a - 9), spec_verify_ct=0, is_retracted=False,
                   finished=lambda: False) for a in (18, 28, 38)]
        batch = NS(reqs=reqs, req_pool_indices=ROWS, req_pool_indices_cpu=ROWS.clone(),
                   seq_lens=torch.zeros(3, dtype=torch.int64),
                   seq_lens_cpu=None, orig_seq_lens=torch.zeros(3, dtype=torch.int32), seq_lens_sum=None,
                   spec_info=NS(), spec_algorithm=EAGLE, req_to_token_pool=NS(req_to_token=REQ_TO_TOKEN),
                   token_to_kv_pool_allocator=NS(free=lambda t: freed.extend(t.tolist())),
                   has_grammar=False, sampling_info=NS(penalizer_orchestrator=NS(is_required=False)),
                   return_hidden_states=False, model_config=NS(is_encoder_decoder=False),
                   forward_mode=ForwardMode.DECODE, input_ids=None, out_cache_loc=None,
                   prefill_input_ids_cpu=None, mix_running_indices=None, enable_overlap=True)
        checked = []
        batch.check_decode_mem = lambda: (checked.append(batch.spec_algorithm), fits)[1]
        inner = inner or NS(get_steps_for_batch=lambda bs: inner_steps.pop(0), on_verify_complete=lambda n, batch_size=0: None)
        policy = CatchUpPolicy(inner)
        worker = NS(speculative_num_steps=3)
        worker.adaptive_controller = NS(activate_step_by_batch=lambda bs: setattr(
            worker, "speculative_num_steps", policy.get_steps_for_batch(bs)))
        watch = AcceptanceAroundPlain()
        decided = []
        real_decided = watch.decided
        watch.decided = lambda spec, bs: (decided.append(spec), real_decided(spec, bs))
        lay = L.PlainLayout(worker, fm, EAGLE, policy, watch)
        state.of(worker, WorkerState).layout = lay
        L._active = lay
        # the worker's verify callback as upstream's and the plugin's hooks make it: the policy's
        # on_verify_complete, the acceptance watch
        verified = []
        worker.on_verify_complete_cpu = lambda n, batch_size=0: (
            verified.append(list(n)), policy.on_verify_complete(n, batch_size=batch_size), watch.verified(n))
        metrics = []
        processor = NS(model_worker=worker,
                       metrics_reporter=NS(update_spec_metrics=lambda *a, **k: metrics.append([list(a), k])))
        return NS(fm=fm, batch=batch, worker=worker, policy=policy, lay=lay, freed=freed, watch=watch,
                  decided=decided, checked=checked, metrics=metrics, verified=verified, processor=processor)

    def upstream_plain_prepare(batch):  # what ScheduleBatch.prepare_for_decode does for NONE
        batch.out_cache_loc = REQ_TO_TOKEN[batch.req_pool_indices, batch.seq_lens].to(torch.int64)
        batch.seq_lens = batch.seq_lens + 1

    writes = []
    draft_kv.write_draft_kv = lambda model, tokens, positions, hidden, loc, pool: writes.append(
        [tokens.tolist(), positions.tolist(), loc.tolist()])

    def plain_step(s, sampled):
        upstream_plain_prepare(s.batch)
        s.batch.input_ids = None
        L.resolve_forward_inputs(resolve_forward_inputs, s.batch, s.fm)
        fed = s.batch.input_ids.tolist()
        s.worker.target_worker = NS(forward_batch_generation=lambda b, capture_hidden_mode=None: NS(
            next_token_ids=torch.tensor(sampled), logits_output=NS(hidden_states=torch.zeros(3, 4))))
        s.worker.draft_worker = NS(draft_runner=NS(model=NS(model=None), token_to_kv_pool=None))
        result = L.forward_batch_generation(lambda *a, **k: "speculative path", s.worker, s.batch)
        # the scheduler then publishes a plain server's length and relays the sampled token alone
        L.publish(FutureMap.publish, s.fm, ROWS, s.batch.seq_lens + 1)
        s.fm.stash(ROWS, RelayPayload(bonus_tokens=result.next_token_ids))
        # ... and processes the result (under overlap one step later; the batch as it ran)
        L.plain_result(s.processor, NS(**vars(s.batch)), result)
        return fed
"""


def test_plain_layout_round_trip_through_the_real_future_map(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # SGLANG_IMAGE_PLAIN_STEP=layout: speculative -> plain takes the published lengths and frees the
    # speculative KV reserve past them; plain steps are fed their input token from the FutureMap,
    # write the draft's K/V at the input token's position and slot and publish spec v2's lengths;
    # the catch-up step returns to the speculative layout, whose resolve then reads those lengths,
    # the last sampled token and the draft's proposal from before the plain phase.
    out = _probe(run_in_tree, tree, plugin_site, LAYOUT_FAKES, """
        s = setup([3, 0, 0, 3, 3])
        res = {}
        s.lay.prepare(s.batch)                                   # 1: speculative, decided here
        res["spec_first"] = [s.batch.spec_algorithm == EAGLE, L.decided_at_prepare(s.worker),
                             L.decided_at_prepare(s.worker)]
        s.lay.prepare(s.batch)                                   # 2: speculative -> plain
        res["to_plain"] = [s.batch.spec_algorithm.is_none(), s.batch.spec_info is None,
                           s.batch.seq_lens.tolist(), s.batch.seq_lens_cpu.tolist(), s.batch.seq_lens_sum,
                           [r.kv.kv_allocated_len for r in s.batch.reqs], sorted(s.freed),
                           L.decided_at_prepare(s.worker)]
        s.batch.input_ids = None
        resolve_forward_inputs(s.batch, s.fm)
        res["upstream_leaves_input_ids"] = s.batch.input_ids is None
        res["fed"] = [plain_step(s, [200, 201, 202])]
        res["published_1"] = s.fm.new_seq_lens_buf[ROWS].tolist()
        s.lay.prepare(s.batch)                                   # 3: plain again, no conversion
        res["fed"].append(plain_step(s, [300, 301, 302]))
        res["published_2"] = s.fm.new_seq_lens_buf[ROWS].tolist()
        s.lay.prepare(s.batch)                                   # 4: the catch-up step, speculative layout
        res["catch_up"] = [s.batch.spec_algorithm == EAGLE, s.worker.speculative_num_steps,
                           s.policy.full_draft_extend, [a.name for a in s.checked],
                           L.decided_at_prepare(s.worker)]
        s.fm.resolve_seq_lens_cpu(s.batch)
        s.batch.input_ids = None
        L.resolve_forward_inputs(resolve_forward_inputs, s.batch, s.fm)
        info = s.batch.spec_info
        res["resolved"] = [s.batch.seq_lens.tolist(), s.batch.seq_lens_cpu.tolist(),
                           info.bonus_tokens.tolist(), info.topk_index.tolist(), s.batch.input_ids is None]
        s.lay.prepare(s.batch)                                   # 5: speculative
        res["after"] = [s.worker.speculative_num_steps, s.decided, s.lay.snapshot(),
                        [r.spec_verify_ct for r in s.batch.reqs], writes, s.metrics, s.verified]
        # the catch-up's KV reserve does not fit: plain once more, the catch-up at the next chance
        d = setup([0, 3, 3, 3], fits=False)
        d.lay.prepare(d.batch)
        upstream_plain_prepare(d.batch)
        d.lay.prepare(d.batch)
        deferred = [d.batch.spec_algorithm.is_none(), d.policy.full_draft_extend, d.policy.catch_up_steps]
        d.batch.check_decode_mem = lambda: True
        d.lay.prepare(d.batch)
        res["deferred"] = deferred + [d.batch.spec_algorithm == EAGLE, d.policy.full_draft_extend,
                                      d.worker.speculative_num_steps, d.policy.catch_up_steps]
        emit(res)
    """)
    assert out["spec_first"] == [True, True, False]
    tails = sorted([*range(3 * 64 + 10, 3 * 64 + 18), *range(5 * 64 + 20, 5 * 64 + 28),
                    *range(7 * 64 + 30, 7 * 64 + 38)])
    assert out["to_plain"] == [True, True, [10, 20, 30], [10, 20, 30], 60, [10, 20, 30], tails, False]
    assert out["upstream_leaves_input_ids"]  # what the resolve hook is for
    assert out["fed"] == [[100, 101, 102], [200, 201, 202]]
    assert out["published_1"] == [11, 21, 31] and out["published_2"] == [12, 22, 32]
    # the catch-up step: zero steps with the full draft extend, in the speculative layout, once
    # upstream's pool check passed for that layout
    assert out["catch_up"] == [True, 0, True, ["EAGLE3"], True]
    assert out["resolved"] == [[12, 22, 32], [12, 22, 32], [300, 301, 302], [[7], [8], [9]], True]
    steps, decided, snapshot, verify_ct, writes, metrics, verified = out["after"]
    # a speculative server's decode log divides by the speculative steps it counted: a plain-layout
    # step's result counts as one accepting one token per request (it stopped the scheduler on a GPU)
    assert metrics == [[[3, 0], {"num_accept_tokens": 3}]] * 2
    # every step decided once, at prepare, with its draft depth (the catch-up step is a plain one,
    # depth 0); a plain-layout step's result reaches the worker's verify callback with no draft
    # accepted
    assert steps == 3 and decided == [3, 0, 0, 0, 3]
    assert verified == [[0, 0, 0]] * 2
    assert snapshot == {"to_plain": 1, "to_speculative": 1, "plain_steps": 2}
    assert verify_ct == [2, 2, 2]  # a plain step counts as a verify of no draft (tokens per step)
    assert writes == [[[200, 201, 202], [10, 20, 30], [3 * 64 + 10, 5 * 64 + 20, 7 * 64 + 30]],
                      [[300, 301, 302], [11, 21, 31], [3 * 64 + 11, 5 * 64 + 21, 7 * 64 + 31]]]
    assert out["deferred"] == [True, False, 0, True, True, 0, 1]


def test_auto_pairs_each_plain_layout_step_with_its_own_result(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # `auto` times every decode step from its decision and pairs it with the next verify result.
    # A plain-layout step has no verify of upstream's: its result must still reach the worker's
    # callback, in decode order, or a later speculative result is taken for a plain step's. The
    # catch-up step is neither mode's figure and is left out; so is the first step of a kind
    # after another (its interval times the step before it).
    out = _probe(run_in_tree, tree, plugin_site, LAYOUT_FAKES, """
        from sglang_image_plugin.auto_policy import AutoPolicy
        from sglang_image_plugin.auto_threshold import Mode

        class ScriptedController:  # the two calls AutoPolicy makes of its AutoController
            def __init__(self, modes):
                self.modes, self.records, self.mode = modes, [], Mode.SPECULATIVE
            def decide(self, batch_size):
                self.mode = self.modes.pop(0)
                return self.mode
            def record(self, mode, batch_size, seconds, tokens):
                self.records.append([mode.value, batch_size, seconds, tokens])

        S, P = Mode.SPECULATIVE, Mode.PLAIN
        ctl = ScriptedController([S, S, P, P, P, S, S, S, S])
        ticks = iter(range(100))
        auto = AutoPolicy(ctl, 3, clock=lambda: float(next(ticks)))
        s = setup([], inner=auto)
        for accepted in ([1, 1, 1], [2, 2, 2]):                   # speculative
            s.lay.prepare(s.batch)
            s.worker.on_verify_complete_cpu(accepted, batch_size=3)  # (upstream's, for a speculative batch)
        for tokens in ([200, 201, 202], [300, 301, 302], [400, 401, 402]):
            s.lay.prepare(s.batch)                               # plain
            plain_step(s, tokens)
        s.lay.prepare(s.batch)                                   # the catch-up step
        s.worker.on_verify_complete_cpu([0, 0, 0], batch_size=3)
        for accepted in ([2, 2, 2], [1, 1, 1]):                   # speculative
            s.lay.prepare(s.batch)
            s.worker.on_verify_complete_cpu(accepted, batch_size=3)
        s.lay.prepare(s.batch)
        # a prefill batch through the worker reaches auto's step trace (the step it fell in)
        traced = []
        auto._trace = traced.append
        state.of(s.worker, WorkerState).controller = auto
        s.worker.draft_worker = NS()
        prefill = NS(forward_mode=ForwardMode.EXTEND, spec_algorithm=EAGLE, req_pool_indices=torch.tensor([9]),
                     extend_num_tokens=48)
        ran = L.forward_batch_generation(lambda *a, **k: "prefill", s.worker, prefill)
        emit({"records": ctl.records, "dropped": auto.dropped, "catch_up": s.policy.catch_up_steps,
              "watch": s.watch.view(), "ran": ran, "traced": traced,
              "in_step": auto._pending[-1].prefills})
    """)
    assert out["records"] == [["speculative", 3, 1.0, 9], ["plain", 3, 1.0, 3], ["plain", 3, 1.0, 3],
                              ["speculative", 3, 1.0, 6]]
    assert out["dropped"] == 0 and out["catch_up"] == 1
    assert out["watch"]["unpaired_steps"] == 0
    assert out["ran"] == "prefill" and [r["tokens"] for r in out["traced"]] == [48] and out["in_step"] == 1


def test_deferred_draft_kv_writes_what_the_immediate_write_does_one_step_later(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # layout: each plain step (inside the target's graph) writes the previous plain step's draft K/V
    # with the token it is fed, and keeps its own; the catch-up step flushes the last. The draft's
    # cache then holds, slot for slot, what decode-kv's immediate write after each step holds;
    # rows with nothing pending (a first plain step, a prefilled row, graph padding) write only the
    # pool's padding slot 0. A plain-layout step without the graph keeps the same books eagerly.
    out = _probe(run_in_tree, tree, plugin_site, EAGLE3_DRAFT, """
        from sglang_image_plugin import deferred_kv, draft_kv
        from sglang_image_plugin.deferred_kv import DeferredDraftKv
        model = make_draft()
        rows = torch.tensor([3, 5, 7])
        fed = torch.randint(0, VOCAB, (5, 3))                 # fed[t]: the tokens step t is fed
        pos = [torch.tensor([10, 20, 30]) + t for t in range(5)]
        loc = [torch.tensor([100, 200, 300]) + t for t in range(5)]
        hid = [torch.randn(3, 3 * TARGET) for _ in range(5)]

        def slots(pool):
            got = {}
            for _, wloc, k, v, _, _ in pool.writes:
                for i, s in enumerate(wloc.tolist()):
                    got.setdefault(s, []).append(torch.cat([k[i].flatten(), v[i].flatten()]))
            return got

        with torch.no_grad():
            ref = RecordingPool()   # decode-kv: after step t, its K/V with the token it sampled (fed[t + 1])
            for t in range(3):
                draft_kv.write_draft_kv(model, fed[t + 1], pos[t], hid[t], loc[t], ref)
            pool = RecordingPool()
            d = DeferredDraftKv(model, pool, rows=16, hidden_size=3 * TARGET, dtype=torch.float32, device="cpu")
            for t in range(3):
                d.step(rows, fed[t], pos[t], hid[t], loc[t])
            first_step_slots = pool.writes[0][1].tolist()
            d.flush(rows, fed[3], pos[3])                      # the catch-up step
            after_flush = d.pos[rows].tolist()
            writes_after_flush = len(pool.writes)
            d.flush(rows, fed[3], pos[3])                      # nothing pending now: no write
            second_flush_writes = len(pool.writes) - writes_after_flush
            r, g = slots(ref), slots(pool)
            padding_writes = len(g.pop(0, []))
            same = sorted(r) == sorted(g) and all(
                len(g[s]) == 1 and torch.allclose(r[s][0], g[s][0], atol=1e-6) for s in r)

            # a prefilled row forgets; graph padding (row 0, position 0, slot 0) stays on slot 0
            p2 = RecordingPool()
            d2 = DeferredDraftKv(model, p2, rows=16, hidden_size=3 * TARGET, dtype=torch.float32, device="cpu")
            d2.step(rows, fed[0], pos[0], hid[0], loc[0])
            d2.forget(torch.tensor([5]))
            padded = torch.tensor([3, 5, 7, 0, 0])
            d2.step(padded, torch.cat([fed[1], fed[1][:2]]), torch.cat([pos[1], torch.zeros(2, dtype=torch.int64)]),
                    torch.cat([hid[1], hid[1][:2]]), torch.cat([loc[1], torch.zeros(2, dtype=torch.int64)]))
            forgot = p2.writes[-1][1].tolist()

            # the tail hook acts inside the plain DECODE graph only
            class Plain: pass
            class Other: pass
            p3 = RecordingPool()
            d3 = DeferredDraftKv(model, p3, rows=16, hidden_size=3 * TARGET, dtype=torch.float32, device="cpu")
            hook = deferred_kv.tail_hook(d3, Plain)
            fb = NS(req_pool_indices=rows, input_ids=fed[0], positions=pos[0], out_cache_loc=loc[0])
            hook(Other(), NS(hidden_states=hid[0]), fb, 3)
            other_writes = len(p3.writes)
            hook(Plain(), NS(hidden_states=hid[0]), fb, 3)
            plain_writes = [len(p3.writes), d3.pos[rows].tolist()]

            # switched off (the scheduler keeps the speculative layout) after steps were kept: the
            # step, as the captured graph still runs it, writes only the padding slot and keeps none
            p4 = RecordingPool()
            d4 = DeferredDraftKv(model, p4, rows=16, hidden_size=3 * TARGET, dtype=torch.float32, device="cpu")
            d4.step(rows, fed[0], pos[0], hid[0], loc[0])
            d4.disable()
            d4.step(rows, fed[1], pos[1], hid[1], loc[1])
            d4.step(rows, fed[2], pos[2], hid[2], loc[2])
            off = [[w[1].tolist() for w in p4.writes], d4.pos[rows].tolist()]
        emit({"same": same, "ref_slots": sorted(r), "padding_writes": padding_writes,
              "first_step_slots": first_step_slots, "after_flush": after_flush,
              "second_flush_writes": second_flush_writes, "forgot": forgot,
              "other_writes": other_writes, "plain_writes": plain_writes, "off": off})
    """)
    assert out["ref_slots"] == [100, 101, 102, 200, 201, 202, 300, 301, 302]
    assert out["same"]
    assert out["first_step_slots"] == [0, 0, 0] and out["padding_writes"] == 3  # the first step's
    assert out["after_flush"] == [-1, -1, -1] and out["second_flush_writes"] == 0
    assert out["forgot"] == [100, 0, 300, 0, 0]
    assert out["other_writes"] == 0 and out["plain_writes"] == [1, [10, 20, 30]]
    assert out["off"] == [[[0, 0, 0]] * 3, [-1, -1, -1]]


def test_deferred_draft_kv_writes_the_pending_k_v_beside_the_target_s_forward(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # Issue 41 (8B shape, 64 requests, P9): the threshold server's plain step spent 3% more GPU
    # time than a plain server's, the draft's K/V write (~25 kernels, two GEMMs) following the
    # target's forward in the graph. Those K/V need only the previous step's books and the token
    # fed now: the head hook forks them onto a side stream before the forward, and the tail joins
    # that stream before it keeps this step's books (which the pending write reads). The draft's
    # cache holds what the write after the forward gave; a runner other than the plain DECODE
    # graph's forks nothing.
    out = _probe(run_in_tree, tree, plugin_site, EAGLE3_DRAFT, """
        import contextlib
        from sglang_image_plugin import deferred_kv
        from sglang_image_plugin.deferred_kv import DeferredDraftKv

        events = []
        class Side:  # a SideStream that records where the work falls
            @contextlib.contextmanager
            def beside(self):
                events.append("fork")
                yield
                events.append("forked")
            def join(self):
                events.append("join")

        class LoggingPool(RecordingPool):
            def set_kv_buffer(self, layer, loc, k, v, k_scale=None, v_scale=None):
                events.append("write")
                super().set_kv_buffer(layer, loc, k, v, k_scale, v_scale)

        class Plain: pass
        class Other: pass
        model = make_draft()
        rows = torch.tensor([3, 5, 7])
        fed = torch.randint(0, VOCAB, (4, 3))
        pos = [torch.tensor([10, 20, 30]) + t for t in range(4)]
        loc = [torch.tensor([100, 200, 300]) + t for t in range(4)]
        hid = [torch.randn(3, 3 * TARGET) for _ in range(4)]

        def run(side, runner):
            pool = LoggingPool()
            d = DeferredDraftKv(model, pool, rows=16, hidden_size=3 * TARGET, dtype=torch.float32,
                                device="cpu", side=side)
            head, tail = deferred_kv.head_hook(d, Plain), deferred_kv.tail_hook(d, Plain)
            kept = []
            for t in range(4):
                fb = NS(req_pool_indices=rows, input_ids=fed[t], positions=pos[t], out_cache_loc=loc[t])
                head(runner, fb)
                events.append("forward")
                tail(runner, NS(hidden_states=hid[t]), fb, 3)
                kept.append(d.pos[rows].tolist())
            return pool, kept

        with torch.no_grad():
            forked, forked_kept = run(Side(), Plain())
            forked_events = list(events)
            events.clear()
            serial, serial_kept = run(None, Plain())
            serial_events = list(events)
            events.clear()
            other, _ = run(Side(), Other())
            other_events = list(events)
        same = len(forked.writes) == len(serial.writes) and all(
            torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
            for a, b in zip(forked.writes, serial.writes))
        emit({"forked": forked_events, "serial": serial_events, "other": other_events, "same": same,
              "kept": forked_kept == serial_kept, "slots": [w[1].tolist() for w in forked.writes]})
    """)
    # each step: the pending write on the side stream, the forward beside it, the join, the keep
    assert out["forked"] == ["fork", "write", "forked", "forward", "join"] * 4
    assert out["serial"] == ["forward", "write"] * 4  # without a side stream: after the forward
    assert out["other"] == ["forward"] * 4  # another graph: nothing
    assert out["same"] and out["kept"]
    assert out["slots"] == [[0, 0, 0], [100, 200, 300], [101, 201, 301], [102, 202, 302]]


def test_deferred_draft_kv_forgets_and_flushes_without_a_host_value(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # Host time per plain step (issue 41; py-spy of the 8B-shaped threshold server at 256
    # requests: 0.24 ms a step in forget alone): `pos[rows] = -1` on a GPU tensor makes -1 a
    # host tensor that the index_put copies to the device, a blocking copy that waits for every
    # forward queued before it, at every prefill. The forget (each prefill) and the flush (the
    # catch-up step) pass no host value to an indexed write; their books stay the same.
    out = _probe(run_in_tree, tree, plugin_site, EAGLE3_DRAFT, """
        from torch.utils._python_dispatch import TorchDispatchMode
        from sglang_image_plugin.deferred_kv import DeferredDraftKv

        class HostValues(TorchDispatchMode):  # indexed writes given a 0-dim (host scalar) value
            def __init__(self):
                super().__init__()
                self.seen = []
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func.overloadpacket.__name__)
                if name.startswith("index_put") and any(
                        isinstance(a, torch.Tensor) and a.dim() == 0 for a in args):
                    self.seen.append(name)
                return func(*args, **(kwargs or {}))

        model = make_draft()
        rows = torch.tensor([3, 5, 7])
        with torch.no_grad():
            d = DeferredDraftKv(model, RecordingPool(), rows=16, hidden_size=3 * TARGET,
                                dtype=torch.float32, device="cpu")
            d.step(rows, torch.tensor([1, 2, 3]), torch.tensor([10, 20, 30]), torch.randn(3, 3 * TARGET),
                   torch.tensor([100, 200, 300]))
            with HostValues() as forget_mode:
                d.forget(torch.tensor([5], dtype=torch.int32))
            after_forget = d.pos[rows].tolist()
            with HostValues() as flush_mode:
                d.flush(rows, torch.tensor([4, 5, 6]), torch.tensor([11, 21, 31]))
            after_flush = d.pos[rows].tolist()
        emit({"forget": forget_mode.seen, "flush": flush_mode.seen,
              "after_forget": after_forget, "after_flush": after_flush})
    """)
    assert out["forget"] == [] and out["flush"] == [], out
    assert out["after_forget"] == [10, -1, 30] and out["after_flush"] == [-1, -1, -1]


def test_deferred_step_never_ropes_a_position_before_the_first(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # What crashed the server at start with the 1B-shaped models: the graph capture runs the deferred
    # step on dummy rows (row 0, position 0, slot 0) with nothing pending (-1), and -1 == 0 - 1 read
    # as "pending just before": the rope then read its cos/sin table at -1 (an illegal memory access
    # on the GPU). Here upstream's rope runs on the CPU, where that read is an index error. The
    # first padded step after the capture met the same rows. Nothing pending must write slot 0 at
    # position 0; a real pending position still writes (and position 0 pending before 1 too).
    out = _probe(run_in_tree, tree, plugin_site, EAGLE3_DRAFT, """
        from sglang_image_plugin.deferred_kv import DeferredDraftKv
        model = make_draft()
        model.layers[0].self_attn.rotary_emb = real_rope()
        def deferred(pool):
            return DeferredDraftKv(model, pool, rows=16, hidden_size=3 * TARGET, dtype=torch.float32,
                                   device="cpu")
        result = {}
        with torch.no_grad():
            pool = RecordingPool()
            d = deferred(pool)
            dummy = torch.zeros(4, dtype=torch.int64)
            try:  # the capture's run: every row a dummy one
                d.step(dummy, dummy, dummy, torch.zeros(4, 3 * TARGET), dummy)
                result["capture"] = [w[1].tolist() for w in pool.writes]
            except IndexError as e:
                result["capture"] = f"IndexError: {e}"
            d.reset()
            before = len(pool.writes)
            rows, at = torch.tensor([3, 5, 0]), torch.tensor([0, 20, 0])  # a request at 0, one at 20, padding
            d.step(rows, torch.tensor([4, 6, 0]), at, torch.randn(3, 3 * TARGET), torch.tensor([30, 50, 0]))
            d.step(rows, torch.tensor([7, 8, 0]), at + torch.tensor([1, 1, 0]), torch.randn(3, 3 * TARGET),
                   torch.tensor([31, 51, 0]))
            result["steps"] = [w[1].tolist() for w in pool.writes[before:]]
        emit(result)
    """)
    assert out["capture"] == [[0, 0, 0, 0]]
    # the first step: nothing pending anywhere; the second writes both requests' previous slots
    assert out["steps"] == [[0, 0, 0], [30, 50, 0]]


def test_layout_hands_the_draft_kv_to_the_graph_and_keeps_its_books_without_it(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # With the deferral installed, a plain-layout step that ran the graph writes nothing more (the
    # graph did); one without the graph keeps the books eagerly, with the input token at seq_lens - 1;
    # a prefill forgets its rows; a speculative-layout zero-step step (the catch-up included) flushes
    # what is pending before the draft writes its own K/V, with the token it is fed at seq_lens.
    out = _probe(run_in_tree, tree, plugin_site, LAYOUT_FAKES, """
        calls = []
        rec = NS(step=lambda *a: calls.append(["step"] + [t.tolist() for t in a[:3]] + [a[4].tolist()]),
                 forget=lambda rows: calls.append(["forget", rows.tolist()]),
                 flush=lambda *a: calls.append(["flush"] + [t.tolist() for t in a]))
        s = setup([0, 0, 0])
        s.lay.prepare(s.batch)
        upstream_plain_prepare(s.batch)
        s.batch.input_ids = torch.tensor([100, 101, 102])
        s.worker.draft_worker = NS(draft_runner=NS(model=NS(model=None), token_to_kv_pool=None))
        state.of(s.worker.draft_worker, DraftState).deferred = rec
        for graph in (True, False):
            s.worker.target_worker = NS(forward_batch_generation=lambda b, capture_hidden_mode=None: NS(
                next_token_ids=torch.tensor([1, 2, 3]), can_run_cuda_graph=graph,
                logits_output=NS(hidden_states=torch.zeros(3, 4))))
            L.forward_batch_generation(lambda *a, **k: "speculative path", s.worker, s.batch)
        writes_before = len(writes)
        graph_step_marked = getattr(rec, "pending", False)  # (the graph's step: a flush is due)
        prefill = NS(forward_mode=ForwardMode.EXTEND, spec_algorithm=EAGLE, req_pool_indices=torch.tensor([9]))
        L.forward_batch_generation(lambda *a, **k: "prefill", s.worker, prefill)
        # the draft extend of a speculative-layout zero-step step
        dw = NS(speculative_num_steps=0)
        state.of(dw, DraftState).deferred = rec
        verified = NS(forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=torch.tensor([3, 5]),
                      input_ids=torch.tensor([7, 8]), seq_lens=torch.tensor([12, 22]))
        draft_extend.draft_extend_for_decode(lambda *a, **k: calls.append(["full draft extend"]), dw, verified, None)
        dw.speculative_num_steps = 3
        draft_extend.draft_extend_for_decode(lambda *a, **k: calls.append(["speculative extend"]), dw, verified, None)
        emit({"calls": calls, "immediate_writes": writes_before, "marked": graph_step_marked})
    """)
    assert out["immediate_writes"] == 0 and out["marked"] is True
    assert out["calls"] == [
        ["step", [3, 5, 7], [100, 101, 102], [10, 20, 30], [3 * 64 + 10, 5 * 64 + 20, 7 * 64 + 30]],
        ["forget", [9]],
        ["flush", [3, 5], [7, 8], [12, 22]], ["full draft extend"],
        ["speculative extend"]]


def test_a_plain_step_under_the_graph_makes_no_tensor_of_the_hooks_own(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # Host work per plain step (issue 41): the hooks of a plain-layout step that ran the graph
    # (the draft's K/V deferred into it) run one tensor op, the input token's gather that a plain
    # server's resolve runs too. The draft's positions are made only where a write needs them on
    # the host, and the publish takes the step's own lengths (batch.seq_lens, spec v2's
    # convention) for the scheduler's batch.seq_lens + 1 instead of subtracting one again.
    out = _probe(run_in_tree, tree, plugin_site, LAYOUT_FAKES, """
        from torch.overrides import TorchFunctionMode

        class Ops(TorchFunctionMode):  # every torch function and tensor method called
            def __init__(self):
                super().__init__()
                self.names = []
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", str(func))
                if name != "__get__":  # (a tensor property read)
                    self.names.append(name)
                return func(*args, **(kwargs or {}))

        s = setup([0, 0])
        s.lay.prepare(s.batch)                                   # speculative -> plain
        upstream_plain_prepare(s.batch)
        s.worker.draft_worker = NS(draft_runner=NS(model=NS(model=None), token_to_kv_pool=None))
        pending = NS(pending=False)
        state.of(s.worker.draft_worker, DraftState).deferred = pending
        result = NS(next_token_ids=torch.tensor([1, 2, 3]), can_run_cuda_graph=True,
                    logits_output=NS(hidden_states=torch.zeros(3, 4)))
        s.worker.target_worker = NS(forward_batch_generation=lambda b, capture_hidden_mode=None: result)
        res = {}
        for step in range(2):
            names = []
            if step:  # plain again: no conversion (the first step's is a one-off per change)
                with Ops() as ops:
                    L.prepare_for_decode(lambda b: None, s.batch)
                names += ops.names
                upstream_plain_prepare(s.batch)
            upstream_new = s.batch.seq_lens + 1                  # (the scheduler's, a plain server's)
            published = []
            with Ops() as ops:
                s.batch.input_ids = None
                L.resolve_forward_inputs(resolve_forward_inputs, s.batch, s.fm)
                L.forward_batch_generation(lambda *a, **k: "speculative path", s.worker, s.batch)
                L.publish(lambda fm, idx, lens: published.append(lens), s.fm, ROWS, upstream_new)
                L.plain_result(s.processor, s.batch, result)
            names += ops.names
            res[step] = [names, published[0] is s.batch.seq_lens,
                         (upstream_new - 1).tolist() == published[0].tolist(), pending.pending]
        # through the real FutureMap: a plain step's publish writes spec v2's lengths, the next
        # publish (no plain step before it) what it is given
        L.forward_batch_generation(lambda *a, **k: "speculative path", s.worker, s.batch)
        L.publish(FutureMap.publish, s.fm, ROWS, s.batch.seq_lens + 1)
        res["plain"] = s.fm.new_seq_lens_buf[ROWS].tolist() == s.batch.seq_lens.tolist()
        L.publish(FutureMap.publish, s.fm, ROWS, s.batch.seq_lens + 1)
        res["next"] = s.fm.new_seq_lens_buf[ROWS].tolist() == (s.batch.seq_lens + 1).tolist()
        emit(res)
    """)
    for step in ("0", "1"):
        assert out[step] == [["__getitem__"], True, True, True], out[step]
    assert out["plain"] and out["next"]


def test_a_scheduler_without_the_plain_layout_drops_the_deferred_write(run_in_tree, tree, plugin_site) -> None:  # type: ignore[no-untyped-def]
    # A scheduler that cannot run the plain layout although the server arguments let the worker
    # expect it (here: overlap off): every plain step writes its own draft K/V in the speculative
    # layout, so the draft worker keeps no deferral to flush, the deferred step that the zero-step
    # graph captured before the scheduler existed is switched off (no prefill there forgets a
    # reused row: its old pending K/V would go to a freed slot), and the plain step says so.
    out = _probe(run_in_tree, tree, plugin_site, """
        from types import SimpleNamespace as NS
        from sglang_image_plugin import observe, plain_step, state
        from sglang_image_plugin.state import DraftState, WorkerState
        def scheduler(overlap):
            draft = NS()
            deferred = NS(disabled=False)
            deferred.disable = lambda: setattr(deferred, "disabled", True)
            state.of(draft, DraftState).catch_up = object()
            state.of(draft, DraftState).deferred = deferred
            worker = NS(_draft_worker=draft)
            state.of(worker, WorkerState).controller = NS()
            state.of(worker, WorkerState).plain_step = plain_step.PlainStep(
                kv_only_reason=None, layout_reason=None, deferred_reason=None)
            s = NS(draft_worker=worker, model_worker=worker, enable_overlap=overlap, page_size=1,
                   future_map=object(), spec_algorithm="EAGLE3", metrics_reporter=None)
            observe.scheduler_init(None, s)
            kept = state.of(draft, DraftState).deferred
            step = state.of(worker, WorkerState).plain_step
            return [kept is deferred, deferred.disabled, state.of(worker, WorkerState).layout is not None,
                    step.layout, step.deferred, state.of(draft, DraftState).proposal_by_row]
        emit({"sync": scheduler(False), "overlap": scheduler(True)})
    """)
    # sync: dropped and switched off in the graph that already holds it; overlap: kept, on (and
    # the FutureMap relays the draft's proposal by row: a K/V-only prefill hands none)
    assert out == {"sync": [False, True, False, False, False, False],
                   "overlap": [True, False, True, True, True, True]}
