"""The project's import graph: no cycle anywhere (src/, smoke/, bench/, the plugin, and between
them), and each package imports only what may be where it runs: smoke/ runs inside the image and
on a bare GPU host (nothing of the build system, nothing of bench/), the plugin runs inside
SGLang's processes (nothing of the project), bench/ drives smoke/ on a GPU host (not the build)."""
from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

from sglang_image import pins

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


def project_imports(path: Path, package: str, folders: dict[str, Path] = PACKAGES) -> set[str]:
    """`package.module` names of the project that a source file imports, at module level or inside
    a function alike (a local import is an edge too), except under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
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


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            node = f"{package}.{path.stem}"
            graph[node] = project_imports(path, package) - {node}
    return graph


def test_every_package_is_found() -> None:
    graph = import_graph()
    for package, folder in PACKAGES.items():
        assert f"{package}.__init__" in graph, folder
    assert {"smoke.runner", "smoke.server", "bench.e2e", "bench.comm", "sglang_image.cli"} <= set(graph)


def test_no_import_cycle_in_the_project() -> None:
    graphlib.TopologicalSorter(import_graph()).prepare()  # raises CycleError naming the cycle


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
