"""Errors that end a command: each says what failed, why, and how to fix it.

Stdlib only: this module is also imported inside the image (the patch stage runs there).
"""
from __future__ import annotations


class SglangImageError(Exception):
    """Base of every expected failure; the CLIs catch only this and exit with `exit_code`."""

    exit_code = 1


class PinError(SglangImageError):
    """A flavor file is missing, malformed or incomplete."""

    exit_code = 2


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


class SmokeError(SglangImageError):
    """The smoke test found a wrong result (inside the image, smoke.runner.SmokeError: same failure)."""

    exit_code = 9


class PublishError(SglangImageError):
    """Pushing the image failed."""

    exit_code = 10
