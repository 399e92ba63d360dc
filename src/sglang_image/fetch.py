"""Download the flavor's wheels by hash into a wheelhouse (cached), for its Python and platform.

pip does the downloading (it knows the index protocol, platform tags and mirrors configured on the
machine); we pass the lock's hashes so pip refuses a wrong file, and check every wheel's sha256
again ourselves so the error names the wheel and the fix whatever pip printed.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from sglang_image.errors import FetchError, HashMismatchError
from sglang_image.lock import LockEntry, normalize, read_lock
from sglang_image.pins import REPO_ROOT, Flavor
from sglang_image.progress import Progress

WHEEL_CACHE = Path(os.environ.get("SGLANG_IMAGE_CACHE", REPO_ROOT / ".cache")) / "wheels"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_distribution(path: Path) -> str:
    return normalize(path.name.split("-", 1)[0])


def run_counting(cmd: list[str], progress: Progress, start: str = "Collecting ") -> tuple[int, str]:
    """Runs `cmd` and returns (exit status, stdout and stderr); each line of its output that begins
    with `start` (pip: one per wheel it begins to fetch) counts one on `progress`, which is asked
    every second to say how far it got, output or not (one wheel can take minutes)."""
    output: list[str] = []
    started = [0]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        stream = proc.stdout
        assert stream is not None

        def read() -> None:
            for line in stream:
                output.append(line)
                if line.startswith(start):
                    started[0] += 1

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while reader.is_alive():
            reader.join(timeout=1)
            progress.add(started[0] - progress.done)
    return proc.returncode, "".join(output)


def _pip_download(entries: list[LockEntry], flavor: Flavor, dest: Path,
                  log: Callable[[str], None] | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text("".join(
            f"{e.requirement} " + " ".join(f"--hash=sha256:{h}" for h in e.hashes) + "\n"
            for e in entries))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
               "--only-binary=:all:", "--implementation", "cp",
               "--python-version", flavor.python_version, "--progress-bar", "off",
               "-d", str(dest), "-r", str(req)]
        for platform in flavor.platforms:
            if platform != "any":
                cmd += ["--platform", platform]
        progress = Progress(log or (lambda _: None), "fetch: pip download", len(entries),
                            unit="wheels", scale=1)
        returncode, text = run_counting(cmd, progress)
    if returncode == 0:
        return
    if "DO NOT MATCH THE HASHES" in text:
        lines = [ln.strip() for ln in text.splitlines() if "Expected sha256" in ln or "Got" in ln
                 or "==" in ln and "from" in ln]
        raise HashMismatchError(
            f"a wheel of {flavor.name} does not match its hash in {flavor.lock_path.name}:\n  "
            + "\n  ".join(lines[-6:]) + "\nEither the index serves a different file (stop and "
            "investigate) or the lock is wrong: regenerate it with nox -s lock -- " + flavor.name)
    raise FetchError(f"pip download failed for {flavor.name}:\n{text.strip()[-2500:]}\n"
                     "Check the network to the package index, or the lock: nox -s lock -- "
                     + flavor.name)


def verify_wheel(path: Path, entry: LockEntry, lock_name: str) -> None:
    actual = sha256_of(path)
    if actual not in entry.hashes:
        raise HashMismatchError(
            f"{path.name}: sha256 {actual} is not one of the {len(entry.hashes)} hashes that "
            f"{lock_name} pins for {entry.requirement}. Delete the file and fetch again; if it "
            f"persists, the index serves another file than the lock was made from.")


def fetch_wheels(flavor: Flavor, dest: Path, only: Iterable[str] | None = None,
                 cache: Path = WHEEL_CACHE) -> list[Path]:
    """Returns the wheels of the lock (or of the `only` distributions) placed in `dest`."""
    entries = read_lock(flavor.lock_path)
    if only is not None:
        wanted = {normalize(n) for n in only}
        entries = [e for e in entries if e.name in wanted]
        found = {e.name for e in entries}
        if wanted - found:
            raise FetchError(f"{sorted(wanted - found)} not in {flavor.lock_path.name}")
    unverified = [e.requirement for e in entries if not e.verified]
    if unverified:
        raise FetchError(f"{unverified}: no verified hash in {flavor.lock_path.name} (incomplete "
                         f"lock); complete it on a machine with internet: nox -s lock -- {flavor.name}")
    return fetch_entries(entries, flavor, dest, cache, flavor.lock_path.name)


def fetch_entries(entries: list[LockEntry], flavor: Flavor, dest: Path, cache: Path,
                  pinned_in: str, log: Callable[[str], None] | None = None) -> list[Path]:
    """Pinned wheels placed in `dest`: downloaded once into `cache` (for the flavor's Python and
    platforms) and checked against their hashes on every use; `pinned_in` names where the pins live,
    `log` gets a line on how far a long download got."""
    cache.mkdir(parents=True, exist_ok=True)
    dest.mkdir(parents=True, exist_ok=True)
    by_name = {e.name: e for e in entries}

    def cached() -> dict[str, Path]:
        have: dict[str, Path] = {}
        for wheel in cache.glob("*.whl"):
            entry = by_name.get(wheel_distribution(wheel))
            if entry and wheel.name.split("-")[1] == entry.version.replace("-", "_"):
                have[entry.name] = wheel
        return have

    # One download into a cache at a time (two builds, or a build beside the tests): a wheel another
    # fetch is still writing is neither fetched twice nor read half written.
    with (cache / ".fetch.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        missing = [e for e in entries if e.name not in cached()]
        if missing:
            if log is not None:
                log(f"fetch: {len(missing)} of {len(entries)} wheels not in {cache}, downloading")
            _pip_download(missing, flavor, cache, log)
    have = cached()
    result = []
    for entry in entries:
        wheel = have.get(entry.name)
        if wheel is None:
            raise FetchError(f"pip reported success but no wheel of {entry.requirement} is in {cache}")
        verify_wheel(wheel, entry, pinned_in)
        target = dest / wheel.name
        if target.resolve() != wheel.resolve():
            if target.exists():
                target.unlink()
            try:
                os.link(wheel, target)
            except OSError:
                shutil.copy2(wheel, target)
        result.append(target)
    return result
