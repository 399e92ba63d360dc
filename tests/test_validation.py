"""docs/validation.md names the 0.5.17 series it validated by a digest over the diff bodies: the
committed series must still have that digest (header edits keep it, a hunk change must not pass
unnoticed), and the documented command must compute the same value."""
from __future__ import annotations

import hashlib
import re
import shutil
import subprocess

import pytest

from sglang_image import pins

VALIDATION = pins.REPO_ROOT / "docs" / "validation.md"


def body_digest(flavor_name: str) -> str:
    """sha256 over each patch's text from its first `diff --git` line, in series order."""
    digest = hashlib.sha256()
    for path in pins.load_flavor(flavor_name).series():
        text = path.read_bytes()
        digest.update(text[text.index(b"diff --git "):])
    return digest.hexdigest()


def test_committed_series_is_the_documented_one() -> None:
    row = re.search(r"\*\*S3\*\* \(today's committed series\) \| `([0-9a-f]{16})`", VALIDATION.read_text())
    assert row, "docs/validation.md has no S3 row"
    assert body_digest("sglang-0.5.17")[:16] == row.group(1), (
        "the sglang-0.5.17 hunks changed: validate them on a GPU and add a row to docs/validation.md")


@pytest.mark.skipif(shutil.which("sed") is None, reason="needs sed")
def test_documented_command_gives_the_same_digest() -> None:
    command = re.search(r"```sh\n(cd patches/sglang-0\.5\.17 .*?)\n```", VALIDATION.read_text(), re.DOTALL)
    assert command
    out = subprocess.run(["bash", "-c", command.group(1)], cwd=pins.REPO_ROOT, check=True,
                         capture_output=True, text=True).stdout
    assert out.split()[0] == body_digest("sglang-0.5.17")
