"""One exit code per cause: every error class has its own, the README's table is EXIT_CODES, and
the users' --help speaks in nox terms with every option explained."""
from __future__ import annotations

import re

import pytest

from sglang_image import cli, errors, image_smoke, pins, threshold


def _error_classes() -> list[type[errors.SglangImageError]]:
    found, todo = [], [errors.SglangImageError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_every_error_has_its_own_documented_code() -> None:
    assert errors.PluginError in _error_classes()
    codes = [cls.exit_code for cls in _error_classes()]
    assert len(codes) == len(set(codes)), codes
    assert set(codes) | {0, errors.PARTIAL_EXIT_CODE} == set(errors.EXIT_CODES)


def test_the_readme_table_is_exit_codes() -> None:
    text = (pins.REPO_ROOT / "README.md").read_text().split("## Exit codes")[1].split("\n## ")[0]
    rows = dict(re.findall(r"^\| (\d+) \| (.+) \|$", text, re.MULTILINE))
    assert {int(k): v.replace("`", "") for k, v in rows.items()} == errors.EXIT_CODES


def test_smoke_help_is_in_nox_terms(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["smoke", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: nox -s smoke --") and "python -m" not in out.split("exit codes")[0]
    assert "docker.types" not in out and "SmokeError" not in out
    for option in ("--gpu", "--no-gpu", "--out", "--threshold"):
        line = next(x for x in out.splitlines() if x.strip().startswith(option))
        assert len(line.split()) > 1 or option == "--threshold", line  # explained on its line
    assert "(default: out/smoke)" in out and "13  the image to smoke-test" in out


def test_threshold_takes_a_number_or_auto_where_the_flavor_has_it() -> None:
    assert threshold.parse("8") == 8 and threshold.parse("auto") == "auto"
    for bad in ("0", "x"):
        with pytest.raises(Exception, match="number|1 or more"):
            threshold.parse(bad)
    plugin_flavors = [n for n in pins.flavor_names() if pins.load_flavor(n).plugin]
    others = [n for n in pins.flavor_names() if not pins.load_flavor(n).plugin]
    assert plugin_flavors and others
    threshold.check_flavor("auto", pins.load_flavor(plugin_flavors[0]))
    threshold.check_flavor(8, pins.load_flavor(others[0]))
    with pytest.raises(errors.UsageError, match="no automatic threshold"):
        threshold.check_flavor("auto", pins.load_flavor(others[0]))
    assert "--threshold auto" in image_smoke.full_command("auto")[-1]


def test_build_help_lists_flavors_and_hides_the_test_build(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["build", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: nox -s build --")
    assert all(name in out for name in pins.flavor_names()) and f"{pins.DEFAULT_FLAVOR} (default)" in out
    assert "--no-cache" in out and "rebuild everything" in out and "--light" not in out
