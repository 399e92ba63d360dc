"""The project's import graph: no cycle anywhere (src/, smoke/, bench/, the plugin, and between
them), and each package imports only what may be where it runs: smoke/ runs inside the image and
on a bare GPU host (nothing of the build system, nothing of bench/), the plugin runs inside
SGLang's processes (nothing of the project), bench/ drives smoke/ on a GPU host (not the build)."""
from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

from sglang_image import pins, plugin_source

ROOT = pins.REPO_ROOT
# package -> its folder
PACKAGES = {
    "sglang_image": ROOT / "src" / "sglang_image",
    "smoke": ROOT / "smoke",
    "bench": ROOT / "bench",
    "sglang_image_plugin": ROOT / "plugin" / "sglang_image_plugin",
}
# package -> the project's packages it may import
ALLOWED = {
    "sglang_image": {"sglang_image"},
    "smoke": {"smoke"},
    "bench": {"bench", "smoke"},
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


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_a_package_imports_only_what_is_where_it_runs(package: str) -> None:
    wrong = {f"{node} -> {dep}" for node, deps in import_graph().items()
             if node.split(".")[0] == package for dep in deps
             if dep.split(".")[0] not in ALLOWED[package]}
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
             "draft_extend", "tp"),
    "mechanism": ("policy", "plain_step", "draft_kv", "deferred_kv", "acceptance", "auto_threshold",
                  "auto_config", "auto_estimate", "auto_policy"),
    "state": ("state",),
    "contract": ("targets", "spec_disable", "depth_schedule"),
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
    hooks = {spec.function.split(":")[0] for spec in plugin_source.targets().HOOKS}
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
