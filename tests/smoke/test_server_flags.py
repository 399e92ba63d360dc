"""Every server the smoke, the feature matrix and the benchmark start gets flags its flavor's sglang
parses: each configuration's argv goes through the flavor's real `prepare_server_args` (0.5.17 with
its series, 0.5.23 with the plugin) on a CPU. 0.5.23 split --cuda-graph-max-bs per phase, where the
old spelling is an ambiguous prefix that stopped every smoke server at start."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench import options, throughput
from smoke import features, runner, scenario, variant_runs
from smoke.server import EAGLE_STEPS, ServerConfig, cuda_graph_max_bs_flag
from smoke.tiers import parse_smoke_schedule
from tests.probe import probe_result

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}

PARSE = """
import contextlib, io, json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
out = {}
for name, argv in json.loads(sys.argv[1]).items():
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            prepare_server_args(argv + ["--device", "cpu"])  # this machine has no GPU
        out[name] = "ok"
    except SystemExit as e:
        out[name] = f"argparse exit {e.code}: {err.getvalue()[-300:]}"
print("RESULT " + json.dumps(out))
"""


def configurations(models: Path, release: tuple[int, ...], auto: bool) -> dict[str, list[str]]:
    """The argv (after `-m sglang.launch_server`) of every kind of server the project starts."""
    smoke_opts = scenario.SmokeOptions(models=models, out=models)
    bench_opts = options.BenchOptions(models=models, out=models, configs=(
        "plain", "eagle3", "eagle3_thr", "eagle3_adaptive", "eagle3_auto"))
    feature_opts = features.FeatureOptions(models=models, out=models)
    configs: dict[str, ServerConfig] = {
        "smoke_plain": ServerConfig("plain", models / "target", cuda_graph=False),
        "smoke_overlap": ServerConfig("overlap", models / "target", draft=models / "draft",
                                      threshold=smoke_opts.threshold),
        "smoke_sync": ServerConfig("sync", models / "target", draft=models / "draft",
                                   threshold=smoke_opts.threshold, overlap=False),
        "feature_plain": features.server_config("plain", feature_opts, draft=False),
        "feature_sync": features.server_config("thr", feature_opts, draft=True, overlap=False),
    }
    for name in ("plain", "eagle3", "eagle3_thr16", "eagle3_adaptive"):
        configs[f"bench_{name}"] = throughput.server_config(name, bench_opts)
    if auto:  # the plugin's settings: auto, and a depth schedule (the smoke's and the matrix's)
        configs["smoke_auto"] = ServerConfig("auto", models / "target", draft=models / "draft",
                                             threshold=runner.AUTO)
        configs["bench_eagle3_auto"] = throughput.server_config("eagle3_auto", bench_opts)
        schedule = parse_smoke_schedule("1-8:3,9-24:2,25-64:1,65-:0")
        sched_opts = scenario.SmokeOptions(models=models, out=models, schedule=schedule)
        configs["smoke_schedule"] = variant_runs.variant_server(
            sched_opts, scenario.VARIANTS["overlap"], models / "draft", None, reach=256, port=None,
            schedule=schedule)[0].cfg
        configs["feature_schedule"] = features.server_config(
            "sched", features.FeatureOptions(models=models, out=models, threshold=64,
                                             schedule=str(schedule)), draft=True)
        # a tier deeper than the launch depth: the plugin refuses it unless the server launches
        # that deep, so each launcher must raise its draft steps (smoke.server.launch_steps)
        deep = parse_smoke_schedule("1-8:5,9-:3")
        configs["smoke_schedule_deep"] = variant_runs.variant_server(
            scenario.SmokeOptions(models=models, out=models, schedule=deep), scenario.VARIANTS["overlap"],
            models / "draft", None, reach=256, port=None, schedule=deep)[0].cfg
        configs["feature_schedule_deep"] = features.server_config(
            "sched", features.FeatureOptions(models=models, out=models, threshold=64, schedule=str(deep)),
            draft=True)
        deep_opts = dataclasses.replace(bench_opts, configs=("eagle3_sched",), schedules=(str(deep),))
        configs["bench_eagle3_sched_deep"] = throughput.server_config("eagle3_sched1", deep_opts)
        # upstream's prefill delayer beside a server (0.5.23's flags; bench.configs.PREFILL_DELAYER)
        delayed_opts = dataclasses.replace(bench_opts, configs=("eagle3_sched_prefill_delayer",),
                                           schedules=(str(deep),))
        configs["bench_eagle3_sched_prefill_delayer"] = throughput.server_config(
            "eagle3_sched1_prefill_delayer", delayed_opts)
    out = {}
    for name, cfg in configs.items():
        cfg.release = release
        argv = cfg.argv(30000)
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        out[name] = argv[3:]
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models")
    for sub in ("target", "draft"):
        (path / sub).mkdir()
        (path / sub / "config.json").write_text(json.dumps(TINY_LLAMA))
    # what the bench writes beside its out folder for --speculative-adaptive (0.5.17 reads it)
    (path / "adaptive_config.json").write_text(json.dumps(throughput.ADAPTIVE_CONFIG))
    return path


def test_the_flag_of_the_largest_captured_batch_follows_the_release() -> None:
    assert cuda_graph_max_bs_flag((0, 5, 17)) == "--cuda-graph-max-bs"
    assert cuda_graph_max_bs_flag((0, 5, 9)) == "--cuda-graph-max-bs"
    assert cuda_graph_max_bs_flag((0, 5, 23)) == "--cuda-graph-max-bs-decode"


def test_a_schedule_deeper_than_the_launch_depth_launches_its_server_that_deep(tmp_path: Path) -> None:
    # the plugin refuses a tier deeper than --speculative-num-steps; a smoke, matrix or bench
    # server of such a schedule launches at its deepest tier, every other EAGLE-3 server at 3
    def steps(cfg: ServerConfig) -> tuple[str, str]:
        a = cfg.argv(30000)
        return a[a.index("--speculative-num-steps") + 1], a[a.index("--speculative-num-draft-tokens") + 1]

    draft = tmp_path / "draft"
    assert steps(ServerConfig("s", tmp_path, draft=draft, schedule="1-8:5,9-:3")) == ("5", "6")
    assert steps(ServerConfig("s", tmp_path, draft=draft, schedule="1-8:2,9-:0")) == (str(EAGLE_STEPS), "4")
    assert steps(ServerConfig("s", tmp_path, draft=draft, schedule="auto")) == (str(EAGLE_STEPS), "4")
    assert steps(ServerConfig("s", tmp_path, draft=draft, threshold=16)) == (str(EAGLE_STEPS), "4")
    assert steps(ServerConfig("s", tmp_path, draft=draft, spec_steps=6, schedule="1-8:5,9-:3")) == ("6", "7")
    assert "--speculative-num-steps" not in ServerConfig("p", tmp_path, schedule="1-8:5,9-:3").argv(30000)


@pytest.mark.parametrize(("flavor", "release", "patched", "with_plugin"), [
    ("sglang-0.5.23", (0, 5, 23), False, True),
    ("sglang-0.5.17", (0, 5, 17), True, False),
])
def test_every_server_configuration_parses_on_its_flavor(
        sglang_tree: Callable[[str, bool], Path], forked_in_tree: Callable[..., Any], models: Path,
        plugin_site: Path, flavor: str, release: tuple[int, ...], patched: bool,
        with_plugin: bool) -> None:
    tree = sglang_tree(flavor, patched)
    argvs = configurations(models, release, auto=with_plugin)
    path = f"{plugin_site}:{tree}" if with_plugin else str(tree)
    proc = forked_in_tree(tree, PARSE.replace("sys.argv[1]", repr(json.dumps(argvs))), path=path,
                          timeout=900)
    result = probe_result(proc)
    assert result == {name: "ok" for name in argvs}
