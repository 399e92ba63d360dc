"""The command line: every parser in sglang_image.cli, --flavor declared and loaded in one place,
each option checked before any work, one rule for the Docker engine, and only `main` turning an
error into its exit code."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_image import build, cli, docker_engine, pins, plan
from sglang_image.errors import DockerUnavailableError, PinError, UsageError
from tests.deploy_checks import need

FLAVOR_COMMANDS = ("build", "base", "smoke", "publish", "gpu-e2e")


def _declarations_of(option: str) -> list[str]:
    """Where the project's Python declares `option` as a command-line argument."""
    found = []
    root = pins.REPO_ROOT
    for folder in ("src", "smoke", "bench", "tools"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" \
                        and any(isinstance(a, ast.Constant) and a.value == option for a in node.args):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_flavor_is_declared_in_one_place() -> None:
    found = _declarations_of("--flavor")
    assert found and {place.split(":")[0] for place in found} == {"src/sglang_image/cli.py"}, found
    # the search finds declarations outside src/ too (bench/e2e.py declared its own --flavor)
    assert [p.split(":")[0] for p in _declarations_of("--bundle")] == ["bench/e2e.py"]


@pytest.mark.parametrize("command", FLAVOR_COMMANDS)
def test_flavor_is_parsed_into_a_loaded_flavor(command: str) -> None:
    parser = cli.build_parser()
    given = parser.parse_args([command, "--flavor", "sglang-0.5.17"]).flavor
    assert isinstance(given, pins.Flavor) and given.name == "sglang-0.5.17"
    default = parser.parse_args([command]).flavor
    # smoke's default is the flavor the image was built for, found later from its label
    assert (default is None) if command == "smoke" else (default.name == pins.DEFAULT_FLAVOR)


@pytest.mark.parametrize("command", FLAVOR_COMMANDS)
def test_an_unknown_flavor_stops_the_parse_with_its_exit_code(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(PinError, match="unknown flavor 'sglang-9.9.9'.*known flavors"):
        cli.main_inner([command, "--flavor", "sglang-9.9.9"])
    assert cli.main([command, "--flavor", "sglang-9.9.9"]) == PinError.exit_code
    err = capsys.readouterr().err
    assert "error: unknown flavor 'sglang-9.9.9'" in err and pins.DEFAULT_FLAVOR in err


def test_help_of_every_command_is_in_nox_terms(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("build", "base", "engine", "smoke", "publish", "deploy", "gpu-e2e",
                    "plugin-check", "patches", "lock"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        out = capsys.readouterr().out
        assert out.startswith(f"usage: nox -s {command} --"), out[:200]
        assert re.search(r"^\s+7\s+no Docker engine answers$", out, re.MULTILINE), command


def _no_work(*_: object, **__: object) -> None:
    raise AssertionError("the build started work (the lock check or the engine) before refusing")


@pytest.mark.parametrize("option", [["--tag", "bad tag"], ["--tag", "Upper/Case:x"],
                                    ["--base", "no spaces allowed"]])
def test_a_bad_build_option_is_refused_before_any_work(
        option: list[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(build, "locked_entries", _no_work)
    monkeypatch.setattr(build, "ensure_engine", _no_work)
    assert cli.main(["build", *option]) == UsageError.exit_code
    err = capsys.readouterr().err
    assert f"{option[0]} {option[1]!r} is not an image reference" in err and "NAME[:TAG]" in err


def test_image_references_are_checked_as_the_engine_reads_them() -> None:
    for good in ("sglang-image:0.1.0-sglang-0.5.23", "localhost:5000/team/sglang", "my/sglang_x:1.0"):
        assert plan.BuildOptions(tag=good).tag == good
    plan.BuildOptions(base="docker.io/library/python:3.12-bookworm@sha256:" + "e" * 64)
    with pytest.raises(UsageError, match="--tag"):
        plan.BuildOptions(tag="x@sha256:" + "e" * 64)  # a tag names no digest
    assert plan.with_tag("localhost:5000/sglang") == "localhost:5000/sglang:latest"
    assert plan.with_tag("sglang:1") == "sglang:1"


@pytest.mark.parametrize("argv", [
    ["build"],
    ["base", "--tag", "localhost/test-base:1"],
    ["smoke", "--no-gpu", "--image", "sglang-image-test:none"],
    ["publish", "--registry", "127.0.0.1:5000/team", "--image", "sglang-image-test:none"],
])
def test_every_command_that_needs_an_engine_starts_the_project_s_own(
        argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rule (docker_engine.ensure_engine): where none answers, each command starts the
    project's own engine; `nox -s base` used to stop with exit 7 where `nox -s build` started it."""
    started: list[Path] = []

    def no_engine(*_: object, **__: object) -> docker_engine.Engine:
        raise DockerUnavailableError("no Docker engine answers (test)")

    def start(state: Path = docker_engine.DEFAULT_STATE, *_: object, **__: object) -> docker_engine.Engine:
        started.append(state)
        raise DockerUnavailableError("dockerd is not installed (test)")

    monkeypatch.setattr(docker_engine, "connect", no_engine)
    monkeypatch.setattr(docker_engine, "start_dockerd", start)
    if argv[0] == "smoke":
        argv = [*argv, "--out", str(tmp_path / "out")]
    assert cli.main(argv) == DockerUnavailableError.exit_code
    assert started == [docker_engine.DEFAULT_STATE]


def test_only_main_turns_an_error_into_an_exit_code(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    def failing(flavor: pins.Flavor, options: plan.BuildOptions) -> int:
        raise DockerUnavailableError(f"no engine for {flavor.name}")

    monkeypatch.setattr(build, "run", failing)
    with pytest.raises(DockerUnavailableError, match=f"no engine for {pins.DEFAULT_FLAVOR}"):
        cli.main_inner(["build"])
    assert cli.main(["build"]) == DockerUnavailableError.exit_code
    assert f"error: no engine for {pins.DEFAULT_FLAVOR}" in capsys.readouterr().err
    # no stage catches it on its own: each exposes run(flavor, options), none a main
    for module in STAGES:
        source = (pins.REPO_ROOT / "src" / "sglang_image" / f"{module}.py").read_text()
        assert not re.search(r"def main\(|return \w+\.exit_code", source), module


@pytest.mark.parametrize(("argv", "code"), [
    (["deploy", "--threshold", "many"], UsageError.exit_code),  # a refusal: 2, not nox's 1
    (["deploy", "--flavor", "sglang-9.9.9"], PinError.exit_code),
])
def test_a_nox_session_exits_with_its_command_code(tmp_path: Path, argv: list[str],
                                                   code: int) -> None:
    """`nox -s deploy -- ...` (this Python, --no-venv) exits with the command's own code, the
    README's table, where nox alone exits 1 for every failed session."""
    if importlib.util.find_spec("nox") is None:
        need("nox", "the test dependency group installs it")
    session, *rest = argv
    proc = subprocess.run(
        [sys.executable, "-m", "nox", "-f", str(pins.REPO_ROOT / "noxfile.py"), "--no-venv",
         "-s", session, "--", *rest, "--digest", "sha256:" + "ab" * 32,
         "--registry", "registry.example.com/team", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, check=False, timeout=300, cwd=tmp_path,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()
# the stage module of every command (cli.COMMANDS)
STAGES = ("build", "base", "docker_engine", "image_smoke", "publish", "deploy", "gpu",
          "plugin_check", "patch_series", "lock")


def test_every_command_is_a_stage_with_run_flavor_options() -> None:
    """Each command's parser ends in its stage's run(flavor, options): no command logic in cli.py
    (the patch and lock commands lived there)."""
    source = (pins.REPO_ROOT / "src" / "sglang_image" / "cli.py").read_text()
    assert len(STAGES) == len(cli.COMMANDS)
    for module in STAGES:
        run = importlib.import_module(f"sglang_image.{module}").run
        assert list(inspect.signature(run).parameters)[:2] == ["flavor", "options"], module
        assert f"{module}.run(" in source, module


def test_patches_words_become_the_flavor_and_the_options() -> None:
    from sglang_image.patch_series import from_words

    old, new = pins.load_flavor("sglang-0.5.17"), pins.load_flavor("sglang-0.5.23")
    assert from_words([], False)[0] is None and from_words([], False)[1].flavors == ()
    assert from_words([old.name], False)[1].flavors == (old,)  # check is the default action
    flavor, options = from_words(["rebase", old.name, new.name], False)
    assert (flavor, options.action, options.flavors) == (new, "rebase", (old,))
    assert from_words(["rebase"], True)[0] is None and from_words(["rebase"], True)[1].resume
    assert from_words(["edit"], False)[0] == pins.load_flavor()  # the default flavor
    with pytest.raises(UsageError, match="usage: nox -s patches -- check"):
        from_words(["rebase", old.name], False)
    with pytest.raises(UsageError, match="--continue goes with rebase"):
        from_words(["export", old.name], True)
    with pytest.raises(PinError, match="unknown flavor 'bogus'"):
        from_words(["bogus"], False)


def test_every_stage_s_options_check_themselves_when_made(tmp_path: Path) -> None:
    from sglang_image import gpu, image_smoke, plugin_check, publish
    from sglang_image.errors import PluginError

    with pytest.raises(UsageError, match="--image 'Not An Image' is not an image reference"):
        image_smoke.ImageSmokeOptions(image="Not An Image")
    image_smoke.ImageSmokeOptions(image="sha256:" + "a" * 64)  # an image ID is taken
    with pytest.raises(UsageError, match="--part-mib -1"):
        gpu.BundleOptions(part_mib=-1)
    with pytest.raises(UsageError, match="needs --registry"):
        publish.PublishOptions()
    with pytest.raises(UsageError, match="give start or stop"):
        docker_engine.EngineOptions(action="restart")
    with pytest.raises(PluginError, match="no sglang/ directory"):
        plugin_check.PluginCheckOptions(site_packages=tmp_path)
