"""Errors that end a command: each says what failed, why, and how to fix it.

One exit code per cause, for scripts: EXIT_CODES at the end lists them all (every command's --help
prints it; MAINTAINING.md has the same table).

Stdlib only: this module is also imported inside the image (the patch stage runs there).
"""
from __future__ import annotations


class SglangImageError(Exception):
    """Base of every expected failure; the CLIs catch only this and exit with `exit_code`."""

    exit_code = 1


class UsageError(SglangImageError):
    """A bad option or argument (the code argparse exits with for its own usage errors)."""

    exit_code = 2


class PinError(SglangImageError):
    """A flavor file is missing, malformed or incomplete (12: argparse's usage errors exit 2)."""

    exit_code = 12


class LockError(SglangImageError):
    """A lock file is missing, stale or cannot be regenerated."""

    exit_code = 3


class FetchError(SglangImageError):
    """A wheel could not be downloaded."""

    exit_code = 4


class HashMismatchError(FetchError):
    """A downloaded wheel does not match the hash in the lock."""

    exit_code = 5


class PatchApplyError(SglangImageError):
    """A patch of the series does not apply exactly (zero fuzz)."""

    exit_code = 6


class DockerUnavailableError(SglangImageError):
    """No Docker engine answers."""

    exit_code = 7


class BuildError(SglangImageError):
    """The image build failed."""

    exit_code = 8


# The smoke's PARTIAL check (no GPU) passed: not a pass of the smoke, unless accepted. Not an error.
PARTIAL_EXIT_CODE = 11


class SmokeError(SglangImageError):
    """The smoke test ran and a check failed (inside the image: smoke.server.SmokeError)."""

    exit_code = 9


class PublishError(SglangImageError):
    """Pushing the image failed."""

    exit_code = 10


class ImageNotFoundError(SglangImageError):
    """The image to smoke-test or publish is not in the Docker engine."""

    exit_code = 13


class PluginError(SglangImageError):
    """The plugin cannot be built, or does not fit a sglang release."""

    exit_code = 14


# Exit code -> its cause, for the documentation and --help (tests/build/test_errors.py keeps them in step).
EXIT_CODES: dict[int, str] = {
    0: "done (smoke: the full GPU smoke passed)",
    1: "an unexpected error (a bug: the traceback says where)",
    UsageError.exit_code: "a bad option or argument",
    LockError.exit_code: "the flavor's lock is missing, stale or incomplete (nox -s lock -- FLAVOR)",
    FetchError.exit_code: "a pinned wheel could not be downloaded",
    HashMismatchError.exit_code: "a wheel does not match the hash in the lock",
    PatchApplyError.exit_code: "a patch does not apply with zero fuzz",
    DockerUnavailableError.exit_code: "no Docker engine answers",
    BuildError.exit_code: "the image build failed (or its base image is missing)",
    SmokeError.exit_code: "the smoke test ran and a check failed",
    PublishError.exit_code: "publishing failed, or the image has no passed smoke",
    PARTIAL_EXIT_CODE: "smoke: only the PARTIAL check (no GPU) passed; 0 with --accept-partial",
    PinError.exit_code: "a flavor file is missing or malformed (unknown --flavor)",
    ImageNotFoundError.exit_code: "the image to smoke-test or publish is not in the engine",
    PluginError.exit_code: "the plugin cannot be built, or does not fit the sglang release",
}


def exit_code_table() -> str:
    """EXIT_CODES as the epilog of every command's --help."""
    return "exit codes:\n" + "\n".join(f"  {code:>2}  {cause}"
                                        for code, cause in sorted(EXIT_CODES.items()))
