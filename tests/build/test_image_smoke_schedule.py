"""`nox -s smoke -- --schedule S`: a draft depth per load instead of the threshold, checked before any
container starts with the smoke's own rules, passed to the smoke and the feature matrix, and the
PARTIAL check's --help expectation. No Docker: the engine is a fake that records what would run."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sglang_image import cli, image_smoke, pins, smoke_schedule
from sglang_image.errors import UsageError
from sglang_image_plugin.setting import (
    DEPTH_SCHEDULE_EXAMPLE,
    DEPTH_SCHEDULE_FLAG,
    THRESHOLD_FLAG,
    parse_schedule,
)

EXAMPLE = smoke_schedule.EXAMPLE
REPO = pins.REPO_ROOT


def _flavors(plugin: bool) -> list[str]:
    return [n for n in pins.flavor_names() if pins.load_flavor(n).plugin == plugin]


# --- the value --------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, said", [
    ("auto", "--schedule auto: the smoke runs a fixed schedule"),
    ("AUTO", "--schedule auto: the smoke runs a fixed schedule"),
    ("1-8:3,10-:0", "--schedule: tier 10-:0 must start at 9"),
    ("1-8:3,9-24", "--schedule: '9-24' is not a tier"),
    ("1-8:1,9-:2", "drafts deeper than tier 1-8:1"),
    ("1-8:0,9-:0", "never drafts"),
    ("1-:3", "one tier, so nothing switches"),
])
def test_a_schedule_the_smoke_cannot_run_is_a_usage_error_naming_the_option(raw: str, said: str) -> None:
    with pytest.raises(UsageError, match="--schedule") as info:
        smoke_schedule.parse(raw)
    assert said in str(info.value)


def test_the_build_accepts_exactly_the_schedules_the_smoke_accepts() -> None:
    """The build may not import the smoke (tests/test_layout.py): its copy of the smoke's rules
    (the grammar is the plugin's) must agree with smoke/tiers.py parse_smoke_schedule."""
    from smoke import features
    from smoke.server import EAGLE_STEPS
    from smoke.tiers import parse_smoke_schedule

    assert smoke_schedule.SMOKE_STEPS == EAGLE_STEPS
    for raw in (EXAMPLE, DEPTH_SCHEDULE_EXAMPLE, "1-4:3,5-:0", "1-4:3,5-8:3,9-:1", "1-8:3,9-:3",
                "1-8:4,9-:0", "1-8:5,9-:3", "1-8:0,9-:0", "1-:2", "1-8:3,9-:", "0-8:3,9-:0", "1-8:2,9-:3"):
        try:
            smoke = str(parse_smoke_schedule(raw))
        except ValueError:
            smoke = "refused"
        try:
            build = str(smoke_schedule.parse(raw))
        except UsageError:
            build = "refused"
        assert build == smoke, raw
    # the example the errors and --help give runs in the feature matrix too (SystemExit if not)
    features.check_schedule(parse_schedule(EXAMPLE))


def test_only_a_flavor_with_the_plugin_has_the_schedule() -> None:
    schedule = smoke_schedule.parse(EXAMPLE)
    for name in _flavors(plugin=True):
        smoke_schedule.check_flavor(schedule, pins.load_flavor(name))
    others = _flavors(plugin=False)
    assert {"sglang-0.5.17", "sglang-0.5.9"} <= set(others)
    for name in others:
        with pytest.raises(UsageError) as info:
            smoke_schedule.check_flavor(schedule, pins.load_flavor(name))
        text = str(info.value)
        assert f"the {name} image has no depth schedule" in text and "--threshold N instead" in text
        assert all(f in text for f in _flavors(plugin=True))


# --- the options and the command line --------------------------------------------------------

def test_the_options_refuse_a_schedule_with_a_threshold_and_one_the_smoke_cannot_run() -> None:
    schedule = smoke_schedule.parse(EXAMPLE)
    assert image_smoke.ImageSmokeOptions(schedule=schedule).schedule == schedule
    for threshold in (8, "auto"):
        with pytest.raises(UsageError, match=f"--threshold {threshold} and --schedule {EXAMPLE} are "
                                             "both given: give one"):
            image_smoke.ImageSmokeOptions(threshold=threshold, schedule=schedule)
    with pytest.raises(UsageError, match="one tier, so nothing switches"):  # a schedule made elsewhere
        image_smoke.ImageSmokeOptions(schedule=parse_schedule("1-:3"))
    # a tier deeper than the smoke's launch depth runs: its servers launch that deep
    assert image_smoke.ImageSmokeOptions(schedule=parse_schedule("1-8:5,9-:3")).schedule is not None


def test_the_options_refuse_what_the_matrix_cannot_run_before_any_container() -> None:
    top = image_smoke.MATRIX_MAX_THRESHOLD
    assert image_smoke.ImageSmokeOptions(threshold=top).threshold == top  # a crossover near 256 runs
    assert image_smoke.ImageSmokeOptions(schedule=smoke_schedule.parse(f"1-64:3,65-{top}:1,{top + 1}-:0"))
    with pytest.raises(UsageError, match=f"--threshold {top + 1}: .* give N <= {top}"):
        image_smoke.ImageSmokeOptions(threshold=top + 1)
    with pytest.raises(UsageError, match=f"its top edge {top + 44} is above .* give a top edge <= {top}"):
        image_smoke.ImageSmokeOptions(schedule=smoke_schedule.parse(f"1-64:3,65-{top + 44}:1,{top + 45}-:0"))


@pytest.mark.parametrize("argv, said", [
    (["--threshold", "8", "--schedule", EXAMPLE], "--threshold 8 and --schedule"),
    (["--schedule", "1-8:3"], "--schedule: the last tier must be open"),
    (["--schedule", "auto"], "--schedule auto"),
])
def test_the_cli_refuses_a_bad_schedule_before_any_container(
        argv: list[str], said: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def no_engine(**_: Any) -> None:
        raise AssertionError("the engine was reached")

    monkeypatch.setattr(image_smoke, "ensure_engine", no_engine)
    assert cli.main(["smoke", "--image", "sglang-image:test", *argv]) == UsageError.exit_code
    assert said in capsys.readouterr().err


def test_the_cli_passes_the_schedule_on(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[image_smoke.ImageSmokeOptions] = []
    monkeypatch.setattr(image_smoke, "run", lambda flavor, options: seen.append(options) or 0)
    assert cli.main(["smoke", "--schedule", "1-8:3,9-24:2,25-64:1,65-:0"]) == 0
    assert str(seen[0].schedule) == EXAMPLE and seen[0].threshold is None


# --- what runs in the container ----------------------------------------------------------------

def test_the_full_smoke_runs_the_smoke_and_the_matrix_with_the_schedule() -> None:
    script = image_smoke.full_command(schedule=smoke_schedule.parse(EXAMPLE))[-1]
    run, features = script.split("; ")[-2:]
    assert run.startswith("python3 -m smoke run ") and run.endswith(f" --schedule {EXAMPLE}")
    assert features.startswith("python3 -m smoke features ") and features.endswith(
        f" --schedule {EXAMPLE}")
    assert "--threshold" not in script
    assert "--schedule" not in image_smoke.full_command(8)[-1]
    with pytest.raises(ValueError):
        image_smoke.full_command(8, smoke_schedule.parse(EXAMPLE))


def test_the_partial_check_expects_the_schedule_flag_only_when_asked() -> None:
    plain = ["python3", "-m", "smoke", "partial", "--expect-series",
             f"{image_smoke.OUT_MOUNT}/expected-series.json"]
    assert image_smoke.partial_command() == plain  # unchanged without a schedule
    assert image_smoke.partial_command(light=True) == [*plain, "--light"]
    assert image_smoke.partial_command(schedule=True) == [*plain, "--expect-schedule"]
    # the image's smoke takes it
    from smoke.__main__ import build_parser

    a = build_parser().parse_args(image_smoke.partial_command(True, True)[3:])
    assert a.expect_schedule and a.light


@dataclass
class FakeContainer:
    logs_text: str

    def wait(self, timeout: int) -> dict[str, int]:
        return {"StatusCode": 0}

    def logs(self) -> bytes:
        return self.logs_text.encode()

    def remove(self, force: bool) -> None:
        pass


@dataclass
class FakeEngine:
    """ensure_engine's answer: an image with a flavor label, and containers.run recorded."""

    flavor: str
    commands: list[list[str]] = field(default_factory=list)

    @property
    def client(self) -> FakeEngine:
        return self

    @property
    def images(self) -> FakeEngine:
        return self

    @property
    def containers(self) -> FakeEngine:
        return self

    def get(self, image: str) -> Any:
        return type("Image", (), {"id": "sha256:" + "a" * 64,
                                  "labels": {"io.sglang-image.flavor": self.flavor}})()

    def run(self, image: str, entrypoint: list[str], **_: Any) -> FakeContainer:
        self.commands.append(entrypoint)
        checks = [{"name": f"launch_server --help shows {flag}", "ok": True, "detail": ""}
                  for flag in (THRESHOLD_FLAG, DEPTH_SCHEDULE_FLAG)]
        return FakeContainer(json.dumps({"partial": True, "checks": checks, "ok": True}))


def _engine(monkeypatch: pytest.MonkeyPatch, flavor: str) -> FakeEngine:
    engine = FakeEngine(flavor)
    monkeypatch.setattr(image_smoke, "ensure_engine", lambda **_: engine)
    return engine


def test_a_flavor_without_the_schedule_is_refused_before_its_container_starts(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    name = _flavors(plugin=False)[0]
    engine = _engine(monkeypatch, name)
    with pytest.raises(UsageError, match=f"the {name} image has no depth schedule"):
        image_smoke.smoke_image("img:tag", gpu=True, out_dir=tmp_path,
                                schedule=smoke_schedule.parse(EXAMPLE))
    assert engine.commands == []


def test_a_schedule_smoke_runs_with_the_schedule_and_says_what_it_did_not_check(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    engine = _engine(monkeypatch, _flavors(plugin=True)[0])
    schedule = smoke_schedule.parse(EXAMPLE)
    image_smoke.smoke_image("img:tag", gpu=True, out_dir=tmp_path, schedule=schedule)
    assert engine.commands[-1] == image_smoke.full_command(schedule=schedule)
    res = image_smoke.smoke_image("img:tag", gpu=False, out_dir=tmp_path, schedule=schedule)
    assert engine.commands[-1] == image_smoke.partial_command(schedule=True)
    assert res.ok and res.schedule == schedule
    said = image_smoke.describe(res)
    assert f"depth schedule={EXAMPLE}" in said and "threshold=N" not in said
    assert f"[ok] launch_server --help shows {DEPTH_SCHEDULE_FLAG}" in said
    record = json.loads(image_smoke.write_record(res, "img:tag", tmp_path).read_text())
    assert any(f"depth schedule={EXAMPLE}" in item for item in record["detail"]["not_checked"])
    # without a schedule, the threshold's list as before
    res = image_smoke.smoke_image("img:tag", gpu=False, out_dir=tmp_path)
    assert engine.commands[-1] == image_smoke.partial_command()
    assert image_smoke.not_checked_without_gpu(res.schedule) == image_smoke.NOT_CHECKED_WITHOUT_GPU
    assert "threshold=N" in image_smoke.describe(res)


def test_the_matrix_checks_its_setting_before_any_model_or_server() -> None:
    # The full smoke's first step is the matrix's own check of its options: a setting the smoke
    # accepts but the matrix does not run (a top edge or N above 256) stops the container in
    # seconds, naming the fix, instead of after the models and the whole smoke.
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'src'}:{REPO / 'plugin'}"}

    def check(script: list[str]) -> subprocess.CompletedProcess[str]:
        first = script[-1].split("; ")[1]
        assert first.startswith("python3 -m smoke features --check ") and "smoke models" in script[-1].split("; ")[2]
        return subprocess.run(first.replace("python3", sys.executable, 1).split(), capture_output=True,
                              text=True, env=env, cwd=REPO, check=False)

    from smoke import features

    assert image_smoke.MATRIX_MAX_THRESHOLD == features.MAX_THRESHOLD  # the build's copy, for its help
    bad = check(image_smoke.full_command(schedule=smoke_schedule.parse("1-16:3,17-96:2,97-300:1,301-:0")))
    assert bad.returncode != 0 and "Give a top edge <= 256" in bad.stderr
    bad = check(image_smoke.full_command(threshold=300))
    assert bad.returncode != 0 and "Run the matrix with N <= 256" in bad.stderr
    # the smoke's example, the plugin's (top edge 96), and N where users now set it (192-256)
    for script in (image_smoke.full_command(schedule=smoke_schedule.parse(EXAMPLE)),
                   image_smoke.full_command(schedule=smoke_schedule.parse(DEPTH_SCHEDULE_EXAMPLE)),
                   image_smoke.full_command(threshold=192), image_smoke.full_command(threshold=256)):
        ok = check(script)
        assert ok.returncode == 0 and "features: the options hold" in ok.stdout, ok.stderr
