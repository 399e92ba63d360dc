"""The GPU bundle (`nox -s gpu-e2e`) against the default flavor's real wheels, on a CPU: what it
carries is derived from the lock, and the server's launch path imports with the bundle and the
host's torch stack alone (a module the bundle lacks fails here, not on the GPU host).
"""
from __future__ import annotations

import ast
import fnmatch
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from bench.site import host_stack_problems, torch_refusal
from sglang_image import gpu, lock, pins, plugin_wheel

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
    "sglang_image_plugin.flags", "sglang_image_plugin.worker", "sglang_image_plugin.observe",
    "sglang_image_plugin.tp", "sglang_image_plugin.registry", "sglang_image_plugin.plain_step",
)

IMPORT_GUARDS = ("ImportError", "ModuleNotFoundError", "Exception", "BaseException")


def module_file(name: str, roots: list[Path]) -> Path | None:
    """Where `name` lives under the roots: a package folder (namespace packages too), a .py file
    or an extension module of any Python version (the bundle's are cp312; this test may run on
    another Python, so nothing is imported: the check reads files)."""
    parts = name.split(".")
    for root in roots:
        base = root.joinpath(*parts)
        if (base / "__init__.py").is_file():
            return base / "__init__.py"
        if base.with_suffix(".py").is_file():
            return base.with_suffix(".py")
        if base.parent.is_dir() and any(base.parent.glob(f"{parts[-1]}.*so")):
            return next(base.parent.glob(f"{parts[-1]}.*so"))
        if base.is_dir():
            return base
    return None


def _guarded(handlers: list[ast.ExceptHandler]) -> bool:
    names = set()
    for h in handlers:
        for node in ([h.type] if not isinstance(h.type, ast.Tuple) else h.type.elts):
            if isinstance(node, ast.Name):
                names.add(node.id)
        if h.type is None:
            names.add("BaseException")
    return bool(names & set(IMPORT_GUARDS))


# (module, digest of its file's bytes) -> what it imports: the check runs on a copy of the same
# files with folders left out, and parsing thousands of files twice would cost as much again.
_IMPORTS_SEEN: dict[tuple[str, bytes], list[str]] = {}


def unconditional_imports(path: Path, module: str) -> list[str]:
    """The modules a module imports whenever it is imported: top-level import statements and those
    in `try:` blocks that do not catch the ImportError (not in `if` blocks: platform branches)."""
    data = path.read_bytes()
    key = (module, hashlib.sha256(data).digest())
    if key not in _IMPORTS_SEEN:
        _IMPORTS_SEEN[key] = _parse_imports(data.decode(errors="replace"), path, module)
    return list(_IMPORTS_SEEN[key])


def _parse_imports(text: str, path: Path, module: str) -> list[str]:
    tree = ast.parse(text)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found.append(base)
                found.extend(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
            elif isinstance(node, ast.Try) and not _guarded(node.handlers):
                visit(node.body)

    visit(tree.body)
    return [name for name in found if name]


def missing_on_launch(entries: tuple[str, ...], roots: list[Path], host_tops: set[str]) -> dict[str, str]:
    """Each module the entries import unconditionally (transitively, through the bundle's own
    modules) that neither the bundle nor the host stack nor the standard library has, with the
    module that imports it. `from X import name` counts X, and X.name where that is a module."""
    missing: dict[str, str] = {}
    seen: set[str] = set()
    todo = [(entry, "(launch path)") for entry in entries]
    located: dict[str, Path | None] = {}

    def where(name: str) -> Path | None:  # module_file, each name looked up once
        if name not in located:
            located[name] = module_file(name, roots)
        return located[name]

    while todo:
        name, importer = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top in ("__future__", "__main__") or top in host_tops:
            continue
        path = where(name)
        parts = name.split(".")
        if path is None and any(str(where(".".join(parts[:i]))).endswith(".so")
                                for i in range(1, len(parts))):
            continue  # inside an extension module: its submodules and names are not files
        if path is None:
            parent = name.rpartition(".")[0]
            if parent and where(parent) is not None and "." in name and \
                    name.rsplit(".", 1)[1] not in ("*",) and importer != "(launch path)":
                continue  # `from package import attribute`: an attribute, not a module
            missing[name] = importer
            continue
        for i in range(1, name.count(".") + 1):  # importing a.b.c runs a and a.b first
            todo.append((".".join(name.split(".")[:i]), importer))
        if path.suffix == ".py":
            todo.extend((imported, name) for imported in unconditional_imports(path, name))
    return missing


def host_tops(flavor: pins.Flavor) -> set[str]:
    """The top-level modules of the host stack's distributions (as installed here, and each
    distribution's own name)."""
    tops = set()
    for name in gpu.host_stack(flavor):
        tops.add(name.replace("-", "_"))
        try:
            files = importlib.metadata.distribution(name).files or ()
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in files:
            first = Path(str(f)).parts[0]
            if not first.endswith((".dist-info", ".data")) and first not in ("..", "bin"):
                tops.add(first.removesuffix(".py").split(".")[0])
    return tops


def test_bundle_is_sglangs_requirements_less_the_host_stack() -> None:
    flavor = pins.load_flavor(FLAVOR)
    members = set(gpu.bundle_members(flavor))
    host = gpu.host_stack(flavor)
    # the modules a GPU host lacked on the first 0.5.23 run are carried
    assert {"nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "sgl-flash-mla",
            "sgl-deep-gemm", "sglang", "sglang-kernel", "flashinfer-python"} <= members
    # ... and what sglang imports without declaring it (seen missing on a GPU host too)
    assert {"dill", "jsonschema", "rpds-py", "sentencepiece"} <= members
    # the router the image carries, for the router run on a GPU host
    assert "sglang-router" in members
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


def test_an_exclusion_of_another_flavor_does_not_stop_a_bundle() -> None:
    # 0.5.23's MoE stack is not in 0.5.17's lock; the older flavor must still bundle
    older = pins.load_flavor("sglang-0.5.17")
    assert "sgl-deep-ep" not in lock.read_requirements_graph(older.lock_path)
    members = set(gpu.bundle_members(older, ("torch",)))
    assert "sglang" in members and not members & set(gpu.NOT_ON_LAUNCH_PATH)


def test_host_stack_lines_name_what_differs() -> None:
    expected = {"torch": "2.14.1", "torchvision": "0.29.2", "triton": "3.8.0"}
    found = {"torch": "2.11.0+cu130", "torchvision": "0.29.2", "triton": None}
    lines = host_stack_problems(expected, found)
    assert lines[0].startswith("torch is 2.11.0+cu130 here, the flavor pins 2.14.1")
    assert lines[1] == "triton 3.8.0 is not installed here"
    assert len(lines) == 2
    assert host_stack_problems({"torch": "2.14.1"}, {"torch": "2.14.1+cu130"}) == []


def test_a_call_on_another_torch_is_refused_before_it_installs_anything(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # A GPU call whose flavor stack was not on the path installed, built models, and failed in its
    # first server's imports 75 s later (2026-12-04); now it stops at once and says why.
    from bench import e2e
    from bench.__main__ import build_parser

    assert torch_refusal({"torch": "2.14.1"}, {"torch": "2.14.1+cu130"}) is None
    assert "this Python has torch 2.11.0, the flavor pins 2.14.1" in (torch_refusal({"torch": "2.14.1"},
                                                                                    {"torch": "2.11.0"}) or "")
    assert "torch is not installed" in (torch_refusal({"torch": "2.14.1"}, {"torch": None}) or "")
    assert torch_refusal({}, {"torch": "2.11.0"}) is None  # a bundle that names no stack
    monkeypatch.setattr(os, "environ", dict(os.environ))  # run() exports the servers' environment
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "bundle.json").write_text(json.dumps({"host_stack": {"torch": "9.9.9"}}))

    def run(phases: str) -> tuple[int, str]:
        out = tmp_path / f"out-{phases}"
        drv = e2e.E2E(build_parser().parse_args(["e2e", "--bundle", str(bundle), "--state", str(tmp_path / "st"),
                                                 "--out", str(out), "--phases", phases]))
        return drv.run(), (out / "e2e.log").read_text()

    code, log = run("install,patch,models,features")
    assert code == 1 and f"this Python has torch {importlib.metadata.version('torch')}, the flavor pins 9.9.9" in log
    assert "== install" not in log and "nothing was run" in log


@pytest.mark.network
def test_launch_path_imports_what_the_bundle_and_the_host_stack_have(tmp_path: Path) -> None:
    flavor = pins.load_flavor(FLAVOR)
    wheels = gpu.fetch_wheels(flavor, tmp_path / "fetched", only=gpu.bundle_members(flavor))
    wheels.append(plugin_wheel.build_wheel(tmp_path / "plugin"))
    site = tmp_path / "site"
    for wheel in wheels:
        lay_out(wheel, site)
    stubs = tmp_path / "stubs"
    for rel, text in gpu.IPYTHON_STUB.items():
        (stubs / rel).parent.mkdir(parents=True, exist_ok=True)
        (stubs / rel).write_text(text)
    roots = [site, stubs, *dsl_packages(site)]
    tops = host_tops(flavor)
    assert missing_on_launch(LAUNCH_PATH, roots, tops) == {}
    # and the check can fail: the modules a GPU host lacked on the first 0.5.23 run (the same
    # files, hard-linked: only the folders are new)
    without = tmp_path / "without"
    shutil.copytree(site, without, ignore=shutil.ignore_patterns("flash_mla", "cutlass"),
                    copy_function=os.link)
    missing = missing_on_launch(LAUNCH_PATH, [without, stubs, *dsl_packages(without)],
                                tops)
    assert {name.split(".")[0] for name in missing} == {"flash_mla", "cutlass"}, missing
    assert missing["flash_mla"] == "sglang.kernels.ops.attention.flash_mla_interface"


def lay_out(wheel: Path, site: Path) -> None:
    """A wheel's files as pip --target lays them out, less what the bundle's slimming drops: the
    Python sources and .pth files with their bytes, extension modules as empty files (the scan
    needs their names only; a few hundred MB less on disk)."""
    slim = gpu.SLIMMING.get(lock.normalize(wheel.name.split("-")[0]), gpu.Slim())
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if name.endswith("/") or any(fnmatch.fnmatch(name, g) for g in slim.drop):
                continue
            if name.endswith((".py", ".pth")):
                zf.extract(info, site)
            elif name.endswith(".so") or ".so." in name:
                (site / name).parent.mkdir(parents=True, exist_ok=True)
                (site / name).touch()


def dsl_packages(site: Path) -> list[Path]:
    """nvidia-cutlass-dsl's .pth puts nvidia_cutlass_dsl/dsl_packages on the path (bench.site's
    pth_paths asks `site` for it on the GPU host; here it is read off the file, nothing is run)."""
    pth = site / "nvidia_cutlass_dsl_packages.pth"
    assert "dsl_packages" in pth.read_text(), pth.read_text()
    return [site / "nvidia_cutlass_dsl" / "dsl_packages"]


def test_host_provides_leaves_out_what_the_host_has_and_refuses_unknown_names() -> None:
    flavor = pins.load_flavor(FLAVOR)
    members = gpu.bundle_members(flavor, ("nvidia-cutlass-dsl", "sgl-flash-mla"))
    assert "sgl-flash-mla" not in members and "nvidia-cutlass-dsl" not in members
    # what only the left-out distribution requires goes with it
    assert "nvidia-cutlass-dsl-libs-cu13" not in members
    assert "flashinfer-python" in members
    with pytest.raises(gpu.FetchError, match="--host-provides no-such-dist: not in"):
        gpu.bundle_members(flavor, ("no-such-dist",))


def archive_in_parts(tmp_path: Path) -> tuple[Path, bytes, list[Path], Path]:
    """A 3 MiB archive written in 1 MiB parts (4), and an empty host folder to copy them to."""
    archive = tmp_path / "src" / "wheels.tar.xz"
    archive.parent.mkdir()
    data = os.urandom(3 * 2**20 + 123)
    archive.write_bytes(data)
    host = tmp_path / "host"
    host.mkdir()
    return archive, data, gpu.write_parts(archive, 1), host


def test_parts_join_back_into_the_archive(tmp_path: Path) -> None:
    from bench.site import bundle_archive

    archive, data, parts, host = archive_in_parts(tmp_path)
    assert [p.name for p in parts] == [f"wheels.tar.xz.part-0{i}" for i in range(4)]
    for part in parts:  # only the parts travelled
        (host / part.name).write_bytes(part.read_bytes())
    assert bundle_archive(host).read_bytes() == data
    assert gpu.write_parts(archive, 0) == [] and not list(archive.parent.glob("*.part-*"))


def test_a_join_with_a_part_missing_stops_naming_it_and_is_made_again_once_all_came(tmp_path: Path) -> None:
    # The archive's size and sha256 in bundle.json: a join made while a part was still on its way
    # is refused (the part named, no joined file left), and a stale whole archive beside a full
    # set of parts is joined again; a whole archive cut short without parts stops the run.
    from bench.site import bundle_archive

    _, data, parts, host = archive_in_parts(tmp_path)
    meta = json.dumps({"size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    (host / "bundle.json").write_text(meta)
    for part in parts[1:]:  # part-00 not here yet
        (host / part.name).write_bytes(part.read_bytes())
    with pytest.raises(SystemExit, match=r"part\(s\) 00 missing; copy every part"):
        bundle_archive(host)
    assert not (host / "wheels.tar.xz").exists() and not (host / "wheels.tar.xz.joining").exists()
    (host / "wheels.tar.xz").write_bytes(parts[1].read_bytes())  # what an older join left
    (host / parts[0].name).write_bytes(parts[0].read_bytes())
    assert bundle_archive(host).read_bytes() == data  # joined again from the full set
    (host / parts[-1].name).unlink()  # the last part missing: only the size can tell
    (host / "wheels.tar.xz").unlink()
    with pytest.raises(SystemExit, match="bytes, bundle.json says 3,145,851 .the last part missing"):
        bundle_archive(host)
    for part in host.glob("*.part-*"):
        part.unlink()
    (host / "wheels.tar.xz").write_bytes(data[:-1])
    with pytest.raises(SystemExit, match="wheels.tar.xz is 3,145,850 bytes, bundle.json says 3,145,851: a copy cut short"):
        bundle_archive(host)
    assert (host / "wheels.tar.xz").exists()  # no parts to make it from: kept as it is
