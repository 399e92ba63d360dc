"""Shared fixtures: real, unpacked (and patched) SGLang wheels, and a Docker engine."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_image import lock, patch, pins, plugin_wheel, trees
from tests.forkserver import ProbeRunner, forked_probes, warm_imports

REPO_ROOT = pins.REPO_ROOT
TREE_CACHE = REPO_ROOT / ".cache" / "trees"

# torch._dynamo, which sglang imports, makes its compile cache folder on import, by default in the
# temporary directory (/tmp/torchinductor_$USER): the tests and every process they start keep it
# under .cache instead, so that a run leaves nothing in /tmp.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO_ROOT / ".cache" / "torchinductor"))

pytest_plugins = ["tests.build.conftest_docker"]

# A passed test's tmp_path is removed when it ends (tmp_path_retention_policy = "failed"). Trees of
# tens of thousands of files take seconds of disk waits to delete: the folder is moved aside at
# once and deleted by a worker thread while the next tests run; the run waits for it at its end.
_PASSED = pytest.StashKey[bool]()
_deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tmp-path-deleter")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[_PASSED] = report.passed
    return report


@pytest.fixture
def tmp_path(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """pytest's tmp_path (kept when the test failed), deleted beside the next tests when it passed."""
    yield tmp_path
    if request.node.stash.get(_PASSED, False) and tmp_path.is_dir():
        aside = tmp_path.with_name(tmp_path.name + ".deleted")
        tmp_path.rename(aside)
        tmp_path.mkdir()  # pytest removes this empty one itself
        _deleter.submit(shutil.rmtree, aside, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    _deleter.shutdown(wait=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    """After a run whose temporary folders pytest removed (tmp_path_retention_policy = "failed":
    a passed run keeps none), remove its per-user root too, so a passed run leaves nothing in the
    temporary directory. A failed test's folder is kept, and so is the root then."""
    import getpass
    import tempfile

    user_root = Path(tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}"
    if not user_root.is_dir() or user_root.is_symlink():
        return
    for entry in user_root.iterdir():
        if entry.is_symlink() and not entry.exists():  # pytest-current, pointing at a removed run
            entry.unlink()
    try:
        user_root.rmdir()
    except OSError:  # not empty: a failed test's folder, or another run's
        pass


# Pure-Python libraries a flavor's sglang imports at module level. A tree carries the flavor's own
# pin of each whose version differs from this test environment's, so probes import the flavor's
# sglang with what it was released against (0.5.23 needs transformers 5.19, say).
PROBE_DEPENDENCIES = ("transformers", "tokenizers", "huggingface-hub", "safetensors")


def probe_extras(flavor: pins.Flavor) -> tuple[str, ...]:
    """Distributions of PROBE_DEPENDENCIES pinned in the flavor's lock at another version than here."""
    from importlib.metadata import PackageNotFoundError, version

    pinned = {e.name: e.version for e in lock.read_lock(flavor.lock_path)}
    extras = []
    for name in PROBE_DEPENDENCIES:
        try:
            have = version(name)
        except PackageNotFoundError:
            have = None
        if name in pinned and pinned[name] != have:
            extras.append(name)
    return tuple(extras)


def _tree_key(flavor: pins.Flavor, patched: bool, extras: tuple[str, ...]) -> str:
    """Changes whenever the pins, the series or any patch of it changes: the tree is then rebuilt."""
    import hashlib

    digest = hashlib.sha256(flavor.toml_path.read_bytes() + ",".join(extras).encode())
    if not patched:
        return "pristine-" + digest.hexdigest()[:12]
    for path in [flavor.patch_dir / "series", *flavor.series()]:
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def sglang_tree() -> Callable[[str, bool], Path]:
    """Factory: sglang_tree(flavor, patched) -> a dir holding the flavor's real sglang/ and
    flashinfer/ packages, unpacked from the hash-checked wheels (with the flavor's probe_extras),
    with the series applied if patched. Trees are cached under .cache/trees and rebuilt when the
    pins or the series change."""
    made: dict[tuple[str, bool], Path] = {}

    def make(flavor_name: str, patched: bool = True) -> Path:
        if (flavor_name, patched) in made:
            return made[(flavor_name, patched)]
        flavor = pins.load_flavor(flavor_name)
        extras = probe_extras(flavor)
        dest = TREE_CACHE / f"{flavor_name}-{_tree_key(flavor, patched, extras)}"
        if not (dest / ".complete").exists():
            shutil.rmtree(dest, ignore_errors=True)
            if patched:
                # The pristine tree's files, hard-linked (hundreds of MB each), and a copy of its
                # own of each file the series changes, which the series then patches.
                pristine = make(flavor_name, False)
                shutil.copytree(pristine, dest, copy_function=os.link,
                                ignore=shutil.ignore_patterns(".complete"))
                for patch_file in flavor.series():
                    for fp in patch.parse_patch(patch_file.read_text(), patch_file.name):
                        for target in {dest / p for p in (fp.old_path, fp.new_path) if p}:
                            if target.is_file():
                                data = target.read_bytes()
                                target.unlink()
                                target.write_bytes(data)
                patch.apply_series(flavor.series(), dest)
            else:
                trees.prepare_tree(flavor, dest, patched=False, extra=extras)
            (dest / ".complete").write_text("ok\n")
        made[(flavor_name, patched)] = dest
        return dest

    return make


@pytest.fixture(scope="module")
def patched(request: pytest.FixtureRequest, sglang_tree: Callable[[str, bool], Path]) -> Path:
    """The test module's FLAVOR, unpacked with its series applied."""
    return sglang_tree(request.module.FLAVOR, True)


@pytest.fixture(scope="module")
def pristine(request: pytest.FixtureRequest, sglang_tree: Callable[[str, bool], Path]) -> Path:
    """The test module's FLAVOR, unpacked as the wheel ships it (proves a check can fail)."""
    return sglang_tree(request.module.FLAVOR, False)


@pytest.fixture(scope="session")
def run_in_tree() -> Callable[..., subprocess.CompletedProcess[str]]:
    """run_in_tree(tree, code, env=None, timeout=600): `python -c code` with the tree first on
    PYTHONPATH, in its own process (each flavor's sglang needs its own interpreter)."""

    def run(tree: Path, code: str, env: dict[str, str] | None = None,
            timeout: int = 600) -> subprocess.CompletedProcess[str]:
        full_env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
        return subprocess.run([sys.executable, "-c", code], cwd=tree, env=full_env, check=False,
                              capture_output=True, text=True, timeout=timeout)

    return run


# The session's warm interpreters (forked_in_tree): the last test that uses them, by node id, and
# what stops them (some 800 MB each): they stop once that test is torn down, not at the run's end.
_FORKED = pytest.StashKey[tuple[str, contextlib.ExitStack]]()


@pytest.fixture(scope="session")
def forked_in_tree(request: pytest.FixtureRequest) -> Iterator[ProbeRunner]:
    """forked_in_tree(tree, code, env=None, timeout=600, path=None): run_in_tree's answer, but the
    code runs in a child forked from one warm interpreter per (tree, path) that the test modules
    share (tests/forkserver.py): importing torch and sglang.srt.server_args, which most probes
    start with, happens once a tree instead of once a probe. `path`: the interpreter's PYTHONPATH
    where it is not the tree alone. For probes that need no environment at import time; `env`
    applies in the child only. The interpreters stop after the last test that uses them."""
    with contextlib.ExitStack() as stack:
        run = stack.enter_context(forked_probes(warm_imports(("torch", "sglang.srt.server_args"))))
        users = [i.nodeid for i in request.session.items if "forked_in_tree" in i.fixturenames]
        if users:
            request.session.stash[_FORKED] = (users[-1], stack)
        yield run


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    result = yield
    last = item.session.stash.get(_FORKED, None)
    if last is not None and last[0] == item.nodeid:
        last[1].close()  # the fixture's own exit at the session's end then has nothing left to do
    return result


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin's wheel (built here) as pip would install it: its files and dist-info (entry
    points). One a session, so that probes with it on their path share a warm interpreter."""
    import zipfile

    out = tmp_path_factory.mktemp("plugin")
    wheel = plugin_wheel.build_wheel(out / "dist")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(out / "site")
    return out / "site"
