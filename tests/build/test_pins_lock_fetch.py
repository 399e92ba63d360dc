"""Flavors as data, their locks, and the hash-checked fetch (real downloads from PyPI)."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from sglang_image import fetch, lock, pins
from sglang_image.errors import HashMismatchError, LockError, PinError
from sglang_image.progress import Progress

SIX = "six==1.16.0"
SIX_SHA256 = "8abb2f1d86890a2dfb989f9a77cfcfd3e47c2a354b01111771326f8aa26e0254"


@pytest.mark.parametrize("name", pins.flavor_names())
def test_flavor_loads_and_lock_is_fresh(name: str) -> None:
    flavor = pins.load_flavor(name)
    assert flavor.base_image.digest.startswith("sha256:")
    assert f"sglang=={flavor.sglang_version}" in flavor.requirements
    lock.check_fresh(flavor)  # fails when the toml changed after the lock was made
    entries = {e.name: e for e in lock.read_lock(flavor.lock_path)}
    assert entries["sglang"].version == flavor.sglang_version
    for pinned in ("flashinfer-python", "transformers", flavor.kernel_package, "torch"):
        assert entries[pinned].version == flavor.pinned(pinned), pinned


def test_default_flavor_lock_is_complete() -> None:
    entries = lock.require_complete(pins.load_flavor())
    assert len(entries) > 150 and all(e.hashes for e in entries)


def test_old_flavor_lock_marks_unreachable_wheels() -> None:
    flavor = pins.load_flavor("sglang-0.5.9")
    unverified = {e.requirement for e in lock.read_lock(flavor.lock_path) if not e.verified}
    assert unverified == {"torch==2.9.1+cu130", "sgl-kernel==0.3.21+cu130"}
    with pytest.raises(LockError, match=r"nox -s lock -- sglang-0\.5\.9"):
        lock.require_complete(flavor)


def test_unknown_flavor_and_unpinned_base(tmp_path: Path) -> None:
    with pytest.raises(PinError, match="known flavors: sglang-0.5.17"):
        pins.load_flavor("sglang-9.9.9")
    text = pins.load_flavor().toml_path.read_text()
    bad = text.replace('digest = "sha256:', 'digest = "latest-', 1)
    (tmp_path / "x.toml").write_text(bad)
    with pytest.raises(PinError, match="a tag alone is not a pin"):
        pins.load_flavor("x", flavor_dir=tmp_path)


def _flavor_with_lock(tmp_path: Path, line: str) -> pins.Flavor:
    lock_path = tmp_path / "demo.lock"
    lock_path.write_text(line + "\n")
    return dataclasses.replace(pins.load_flavor(), lock_path=lock_path)


@pytest.mark.network
def test_fetch_checks_hash_and_caches(tmp_path: Path) -> None:
    flavor = _flavor_with_lock(tmp_path, f"{SIX} --hash=sha256:{SIX_SHA256}")
    cache = tmp_path / "cache"
    [wheel] = fetch.fetch_wheels(flavor, tmp_path / "house", cache=cache)
    assert fetch.sha256_of(wheel) == SIX_SHA256
    mtime = next(cache.glob("*.whl")).stat().st_mtime_ns
    fetch.fetch_wheels(flavor, tmp_path / "house2", cache=cache)  # from the cache
    assert next(cache.glob("*.whl")).stat().st_mtime_ns == mtime


@pytest.mark.network
def test_fetch_refuses_a_wheel_whose_hash_differs(tmp_path: Path) -> None:
    wrong = "0" * 64
    flavor = _flavor_with_lock(tmp_path, f"{SIX} --hash=sha256:{wrong}")
    with pytest.raises(HashMismatchError) as err:
        fetch.fetch_wheels(flavor, tmp_path / "house", cache=tmp_path / "cache")
    assert "six" in str(err.value) and "nox -s lock" in str(err.value)
    assert not list((tmp_path / "house").glob("*.whl"))


def test_a_corrupted_cached_wheel_is_refused(tmp_path: Path) -> None:
    flavor = _flavor_with_lock(tmp_path, f"{SIX} --hash=sha256:{SIX_SHA256}")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "six-1.16.0-py2.py3-none-any.whl").write_bytes(b"not the wheel")
    with pytest.raises(HashMismatchError, match="six-1.16.0-py2.py3-none-any.whl"):
        fetch.fetch_wheels(flavor, tmp_path / "house", cache=cache)


@pytest.mark.network
def test_gpu_bundle_diagnostics_are_hash_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """py-spy travels in the GPU bundle: fetched from PyPI once, verified against its pin on every use."""
    from sglang_image import gpu

    cache = tmp_path / "cache"
    [wheel] = gpu.fetch_diagnostics(pins.load_flavor(), tmp_path / "out", cache=cache)
    assert wheel.name.startswith("py_spy-0.4.3-") and fetch.sha256_of(wheel) in gpu.DIAGNOSTIC_WHEELS[0].hashes
    tampered = dataclasses.replace(gpu.DIAGNOSTIC_WHEELS[0], hashes=("0" * 64,))
    monkeypatch.setattr(gpu, "DIAGNOSTIC_WHEELS", (tampered,))
    with pytest.raises(HashMismatchError, match="py_spy-0.4.3-.*DIAGNOSTIC_WHEELS"):
        gpu.fetch_diagnostics(pins.load_flavor(), tmp_path / "out2", cache=cache)  # the cached wheel


def test_a_long_download_says_how_far_it_got() -> None:
    """pip downloads the missing wheels of a cold build for minutes: each wheel it begins counts,
    and the count is said while it runs (here at every check: `every` is 0)."""
    lines: list[str] = []
    progress = Progress(lines.append, "fetch: pip download", 3, unit="wheels", scale=1, every=0.0)
    pip = ("import time\nfor n in 'ab':\n    print('Collecting', n, flush=True)\n"
           "    print('  Downloading', n, flush=True)\ntime.sleep(1.2)\n")
    returncode, output = fetch.run_counting([sys.executable, "-c", pip], progress)
    assert returncode == 0 and "Downloading b" in output
    assert lines[-1] == "fetch: pip download: 2 of 3 wheels (66%)"
    returncode, output = fetch.run_counting([sys.executable, "-c", "print('no'); exit(3)"], progress)
    assert (returncode, output) == (3, "no\n")


def test_src_has_no_import_cycle_and_the_applier_is_stdlib_only() -> None:
    import graphlib
    import sys

    from tests.test_layout import project_imports  # the project's one import-graph walker

    src = pins.REPO_ROOT / "src" / "sglang_image"
    graph = {p.stem: {dep.split(".")[1] for dep in project_imports(p, "sglang_image")} - {p.stem}
             for p in src.glob("*.py")}
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle
    # patch.py runs inside the image before any third-party package is trusted
    assert graph["patch"] == {"errors"} and graph["errors"] == set()
    import ast

    tops = {(a.name if isinstance(n, ast.Import) else n.module or "").split(".")[0]
            for n in ast.walk(ast.parse((src / "patch.py").read_text()))
            if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert tops - {"sglang_image", "__future__"} <= set(sys.stdlib_module_names), tops


def test_plugin_flag_is_flavor_data(tmp_path: Path) -> None:
    assert pins.DEFAULT_FLAVOR == "sglang-0.5.23" and pins.load_flavor().plugin is True
    assert pins.load_flavor("sglang-0.5.17").plugin is False  # absent: no plugin
    text = pins.load_flavor().toml_path.read_text().replace("plugin = true", 'plugin = "yes"')
    (tmp_path / "x.toml").write_text(text)
    with pytest.raises(PinError, match="'plugin' must be true or false"):
        pins.load_flavor("x", flavor_dir=tmp_path)


def test_each_version_is_written_once_in_the_flavor_file(tmp_path: Path) -> None:
    """[lock] requirements are the one record of a version: the stack reads them, a version
    written again in [stack] is refused by name, and a stack pin missing from [lock] too."""
    flavor = pins.load_flavor()
    assert flavor.pinned(flavor.kernel_package)  # [stack] names the kernel, [lock] pins it
    changed = dataclasses.replace(flavor, requirements=tuple(
        "sglang==9.9.9" if r.startswith("sglang==") else r for r in flavor.requirements))
    assert changed.sglang_version == "9.9.9"
    text = flavor.toml_path.read_text()
    (tmp_path / "again.toml").write_text(text.replace("[stack]\n", '[stack]\nsglang = "0.5.23"\n'))
    with pytest.raises(PinError, match=r"\[stack\]: \['sglang'\].*written once, in \[lock\]"):
        pins.load_flavor("again", flavor_dir=tmp_path)
    without = "".join(line for line in text.splitlines(keepends=True)
                      if not line.strip().startswith('"transformers=='))
    (tmp_path / "missing.toml").write_text(without)
    with pytest.raises(PinError, match="requirements pin no transformers: add 'transformers==VERSION'"):
        pins.load_flavor("missing", flavor_dir=tmp_path)
