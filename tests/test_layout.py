"""The project's import graph: no cycle anywhere (src/, smoke/, bench/, the plugin, and between
them), and each package imports only what may be where it runs: smoke/ runs inside the image and
on a bare GPU host (nothing of the build system, nothing of bench/), the plugin runs inside
SGLang's processes (nothing of the project), bench/ drives smoke/ on a GPU host (not the build).
Of the plugin, the others import its contract for the speculation setting (setting.py) and the
standard-library modules named below, by name, never its hooks; those import where sglang and
torch are absent."""
from __future__ import annotations

import ast
import graphlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_image import pins
from sglang_image_plugin import targets

ROOT = pins.REPO_ROOT
# package -> its folder
PACKAGES = {
    "sglang_image": ROOT / "src" / "sglang_image",
    "smoke": ROOT / "smoke",
    "bench": ROOT / "bench",
    "sglang_image_plugin": ROOT / "plugin" / "sglang_image_plugin",
}
# The plugin's modules that import where sglang, torch and a GPU are absent: the setting's
# contract, the hook table plugin-check reads, `auto`'s controller (the bench replays its trace)
# and the switch of the verify's grouped prefix stage (`bench verify-kernel` sets it to time
# upstream's stage beside the plugin's). Each imports only these
# (and the package's __init__, which runs first).
CONTRACT = "sglang_image_plugin.setting"
PLUGIN_STANDARD_LIBRARY_ONLY = {CONTRACT, "sglang_image_plugin.targets",
                                "sglang_image_plugin.auto_threshold", "sglang_image_plugin.auto_config",
                                "sglang_image_plugin.auto_estimate", "sglang_image_plugin.depth_schedule",
                                "sglang_image_plugin.verify_switch"}
# package -> the project's packages (or single modules) it may import
ALLOWED = {
    "sglang_image": {"sglang_image", CONTRACT, "sglang_image_plugin.targets"},
    "smoke": {"smoke", CONTRACT, "sglang_image_plugin.depth_schedule"},
    "bench": {"bench", "smoke", CONTRACT, "sglang_image_plugin.auto_threshold",
              "sglang_image_plugin.auto_estimate", "sglang_image_plugin.depth_schedule",
              "sglang_image_plugin.verify_switch"},
    "sglang_image_plugin": {"sglang_image_plugin"},
}


def project_imports(path: Path, package: str, folders: dict[str, Path] = PACKAGES, *,
                    type_checking: bool = False) -> set[str]:
    """`package.module` names of the project that a source file imports, at module level or inside
    a function alike (a local import is an edge too); under `if TYPE_CHECKING:` only with
    `type_checking` (an import for the type checker alone is a dependency all the same)."""
    tree = ast.parse(path.read_text())
    skip = set() if type_checking else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
        and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .x import y
                base = package if node.level == 1 else ""
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            top = name.split(".")[0]
            if top in folders:
                if "." in name:
                    found.add(".".join(name.split(".")[:2]))
                else:  # from pkg import module (or a name of pkg/__init__.py)
                    for alias in node.names:
                        module = folders[top] / f"{alias.name}.py"
                        found.add(f"{top}.{alias.name}" if module.is_file() else f"{top}.__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in folders:
                    found.add(".".join(parts[:2]) if len(parts) > 1 else f"{parts[0]}.__init__")
    return found


def import_graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            node = f"{package}.{path.stem}"
            graph[node] = project_imports(path, package, type_checking=type_checking) - {node}
    return graph


def test_every_package_is_found() -> None:
    graph = import_graph()
    for package, folder in PACKAGES.items():
        assert f"{package}.__init__" in graph, folder
    assert {"smoke.runner", "smoke.server", "bench.e2e", "bench.comm", "sglang_image.cli"} <= set(graph)


def test_no_import_cycle_in_the_project() -> None:
    """TYPE_CHECKING imports counted: a cycle that only the type checker walks is still a tangle
    (the plugin's state.py typed its fields with the classes of the modules that use it)."""
    # raises CycleError naming the cycle
    graphlib.TopologicalSorter(import_graph(type_checking=True)).prepare()


def test_the_graph_sees_local_imports_and_a_cycle_fails(tmp_path: Path) -> None:
    """The check above can fail: a function-level import back into a module is an edge and closes a
    cycle (how server -> runner hid one)."""
    (tmp_path / "a.py").write_text("from smoke import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from smoke.a import X\n")
    graph = {f"smoke.{p.stem}": project_imports(p, "smoke", {"smoke": tmp_path})
             for p in tmp_path.glob("*.py")}
    assert graph == {"smoke.a": {"smoke.b"}, "smoke.b": {"smoke.a"}}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()


def not_allowed(graph: dict[str, set[str]], package: str) -> set[str]:
    """The edges from `package` to a package or module it may not import."""
    return {f"{node} -> {dep}" for node, deps in graph.items()
            if node.split(".")[0] == package for dep in deps
            if dep.split(".")[0] not in ALLOWED[package] and dep not in ALLOWED[package]}


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_a_package_imports_only_what_is_where_it_runs(package: str) -> None:
    wrong = not_allowed(import_graph(), package)
    assert not wrong, wrong


# The plugin's layers, top to bottom: a module imports only modules of its own layer or below,
# TYPE_CHECKING imports counted. A new module must be placed here (the test below fails until it is).
#   hook:      adapts upstream SGLang: the functions targets.HOOKS installs, what sets them up
#              (the registry, the worker's and the flags' hooks), upstream's tensor-parallel group
#   mechanism: what a plain step and the policies do, on the objects the hooks hand them
#   state:     the plugin's bookkeeping on upstream's objects (state.py), typed by Protocols of its
#              own, not by the classes the mechanisms and hooks keep there
#   contract:  the settings and the hook table: flags, env, parsing, validation (pure data and
#              logic; spec_disable and depth_schedule also hold their own pure controllers)
LAYER_ORDER = ("contract", "state", "mechanism", "hook")
LAYERS = {f"sglang_image_plugin.{module}": layer for layer, modules in {
    "hook": ("__init__", "registry", "flags", "worker", "observe", "layout", "plain_target",
             "draft_extend", "tp", "verify_attention", "length_cap"),
    "mechanism": ("policy", "plain_step", "draft_kv", "deferred_kv", "prefill_kv", "gpu_memory", "acceptance",
                  "state_graphs", "auto_threshold", "verify_prefix_kernel", "verify_combine_kernel",
                  "auto_config", "auto_estimate", "auto_policy", "auto_accept", "auto_depth",
                  "auto_depth_policy"),
    "state": ("state",),
    "contract": ("setting", "targets", "spec_disable", "depth_schedule", "verify_switch"),
}.items() for module in modules}


def plugin_graph() -> dict[str, set[str]]:
    return {node: deps for node, deps in import_graph(type_checking=True).items()
            if node.startswith("sglang_image_plugin.")}


def layer_violations(graph: dict[str, set[str]], layers: dict[str, str]) -> set[str]:
    """The edges that import upward: `module (layer) -> module (layer)`."""
    rank = {layer: i for i, layer in enumerate(LAYER_ORDER)}
    return {f"{node} ({layers[node]}) -> {dep} ({layers[dep]})"
            for node, deps in graph.items() for dep in deps
            if rank[layers[dep]] > rank[layers[node]]}


def test_every_plugin_module_has_a_layer() -> None:
    modules = set(plugin_graph())
    assert sorted(modules - set(LAYERS)) == [], "place the new plugin module in LAYERS"
    assert sorted(set(LAYERS) - modules) == [], "LAYERS names a module that is gone"


def test_the_plugin_imports_only_downward() -> None:
    """A mechanism never imports a hook; state imports neither; the contract imports only itself."""
    assert sorted(layer_violations(plugin_graph(), LAYERS)) == []


def test_every_hook_lives_in_a_hook_module() -> None:
    """A module that upstream calls into (targets.HOOKS) is a hook, whatever else it holds."""
    hooks = {spec.function.split(":")[0] for spec in targets.HOOKS}
    assert hooks and {m: LAYERS[m] for m in sorted(hooks) if LAYERS[m] != "hook"} == {}


def test_an_upward_import_fails_the_layers(tmp_path: Path) -> None:
    """The layer check can fail: a mechanism importing a hook, if only for the type checker."""
    (tmp_path / "hooked.py").write_text("from sglang_image_plugin import low\n")
    (tmp_path / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sglang_image_plugin import hooked\n")
    folders = {"sglang_image_plugin": tmp_path}
    graph = {f"sglang_image_plugin.{p.stem}": project_imports(p, "sglang_image_plugin", folders,
                                                              type_checking=True)
             for p in tmp_path.glob("*.py")}
    layers = {"sglang_image_plugin.hooked": "hook", "sglang_image_plugin.low": "mechanism"}
    assert layer_violations(graph, layers) == {
        "sglang_image_plugin.low (mechanism) -> sglang_image_plugin.hooked (hook)"}


def test_of_the_plugin_the_others_import_the_contract_not_the_hooks(tmp_path: Path) -> None:
    """A smoke module that imports a hook module of the plugin fails the check above; the contract
    passes it."""
    (tmp_path / "a.py").write_text("from sglang_image_plugin.setting import THRESHOLD_FLAG\n")
    (tmp_path / "b.py").write_text("from sglang_image_plugin import worker\n")
    (tmp_path / "c.py").write_text("def f():\n    import sglang_image_plugin.flags\n")
    folders = {**PACKAGES, "smoke": tmp_path}
    graph = {f"smoke.{p.stem}": project_imports(p, "smoke", folders) for p in tmp_path.glob("*.py")}
    assert not_allowed(graph, "smoke") == {"smoke.b -> sglang_image_plugin.worker",
                                           "smoke.c -> sglang_image_plugin.flags"}


def test_what_the_others_import_of_the_plugin_imports_only_itself() -> None:
    """The plugin's modules the others import reach, within the plugin, only each other and the
    package's __init__ (which imports them first): none of the hooks."""
    graph = import_graph()
    allowed = PLUGIN_STANDARD_LIBRARY_ONLY | {"sglang_image_plugin.__init__", "sglang_image_plugin.registry"}
    for module in PLUGIN_STANDARD_LIBRARY_ONLY | {"sglang_image_plugin.__init__"}:
        assert graph[module] <= allowed, (module, graph[module] - allowed)
    assert {dep for deps in (ALLOWED[p] for p in ALLOWED if p != "sglang_image_plugin")
            for dep in deps if dep.startswith("sglang_image_plugin")} <= PLUGIN_STANDARD_LIBRARY_ONLY


def test_the_contract_imports_without_sglang_torch_or_site_packages() -> None:
    """What the build system, the smoke and the bench import of the plugin, in an interpreter that
    has the standard library and plugin/ alone (-S: no site-packages; sglang and torch refused):
    where the plugin is not installed (the build, an image of a flavor without it, a GPU host
    before its install)."""
    code = ("import json, sys\n"
            "sys.modules['sglang'] = sys.modules['torch'] = None\n"
            f"for name in {sorted(PLUGIN_STANDARD_LIBRARY_ONLY)!r}:\n"
            "    __import__(name)\n"
            "from sglang_image_plugin.setting import THRESHOLD_FLAG, parse_threshold\n"
            "loaded = sorted(k for k, v in sys.modules.items() if v is not None)\n"
            "print(json.dumps([THRESHOLD_FLAG, parse_threshold('Auto'), loaded]))\n")
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                          check=False, env={"PYTHONPATH": str(ROOT / "plugin")}, cwd=ROOT / "plugin")
    assert proc.returncode == 0, proc.stderr
    flag, auto, modules = json.loads(proc.stdout)
    assert (flag, auto) == ("--speculative-disable-batch-threshold", "auto")
    loaded = {m for m in modules if m.startswith("sglang_image_plugin.")}
    assert loaded == PLUGIN_STANDARD_LIBRARY_ONLY | {"sglang_image_plugin.registry"}, loaded
    assert not {m.split(".")[0] for m in modules} & {"sglang", "torch", "numpy"}
