"""`nox -s smoke` without a GPU: the PARTIAL check, inside the image the tests build (real engine)."""
from __future__ import annotations

from pathlib import Path

import pytest

from sglang_image import image_smoke, pins, smoke_schedule
from sglang_image.build import BuildResult
from sglang_image_plugin.setting import DEPTH_SCHEDULE_FLAG

pytestmark = pytest.mark.docker


@pytest.fixture(autouse=True)
def _engine_under_test(docker_host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """smoke finds its engine through DOCKER_HOST: the one the light image was built on."""
    monkeypatch.setenv("DOCKER_HOST", docker_host)


def test_partial_smoke_passes_on_the_light_image(light_image: BuildResult, tmp_path: Path) -> None:
    res = image_smoke.smoke_image(light_image.tags[0], gpu=False, out_dir=tmp_path)
    assert res.mode == "partial" and res.report.get("light") is True, res.log_tail
    assert res.ok, image_smoke.describe(res)
    checks = {c["name"]: c for c in res.report["checks"]}
    manifest = next(c for n, c in checks.items() if n.startswith("patch manifest"))
    assert manifest["ok"] and not manifest["skipped"]
    assert checks["patched files present and compiling"]["ok"]
    # what the light image cannot show is said, not faked
    assert checks["pip check"]["skipped"]
    assert "PARTIAL" in image_smoke.describe(res) and "[skip]" in image_smoke.describe(res)


def test_partial_smoke_with_a_schedule_expects_the_schedule_s_flag(light_image: BuildResult,
                                                                  tmp_path: Path) -> None:
    """The smoke in the image takes --expect-schedule; a light image says the flag unchecked."""
    schedule = smoke_schedule.parse(smoke_schedule.EXAMPLE)
    res = image_smoke.smoke_image(light_image.tags[0], gpu=False, out_dir=tmp_path, schedule=schedule)
    assert res.ok, image_smoke.describe(res)
    checks = {c["name"]: c for c in res.report["checks"]}
    assert checks[f"launch_server --help shows {DEPTH_SCHEDULE_FLAG}"]["skipped"]
    assert f"depth schedule={schedule}" in image_smoke.describe(res)


def test_partial_smoke_fails_when_the_image_has_other_patches(
        light_image: BuildResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = image_smoke.expected_series(pins.load_flavor())
    tampered = [dict(real[0], sha256="0" * 64), *real[1:]]
    monkeypatch.setattr(image_smoke, "expected_series", lambda flavor=None: tampered)
    res = image_smoke.smoke_image(light_image.tags[0], gpu=False, out_dir=tmp_path)
    assert not res.ok
    assert f"sha256 differs for ['{real[0]['name']}']" in image_smoke.describe(res)
