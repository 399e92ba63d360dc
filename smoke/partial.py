"""PARTIAL check of an image without a GPU (the full smoke needs one):

    python -m smoke partial --expect-series FILE [--manifest /opt/sglang-image/patches.json]
                            [--expect-schedule]

  1. imports that need no GPU driver (torch, transformers, sglang, sglang.srt.server_args)
  2. `python -m sglang.launch_server --help` shows the threshold flag (the plugin's, or the patch's);
     with --expect-schedule the depth schedule's flag too (the plugin's)
  3. the image's patch manifest equals the repo's patches/<flavor>/series (names, order, sha256);
     FILE is [{"name", "sha256"}] computed from the repo by the caller
  4. `pip check`
With --light (an image built with `nox -s build -- --light`: SGLang and the patch targets without
their heavy dependencies, as the tests build it), 1, 2 and 4 cannot pass and are reported as
skipped; instead every file the manifest names must exist in site-packages and compile.
Prints one JSON object {"partial": true, "checks": [{"name", "ok", "detail"}], "ok"}; exit 1 on failure.
"""
from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from sglang_image_plugin.setting import DEPTH_SCHEDULE_FLAG, THRESHOLD_FLAG
from smoke.server import sglang_env

MANIFEST = Path("/opt/sglang-image/patches.json")
IMPORTS = ("torch", "transformers", "sglang", "sglang.srt.server_args")


def compare_manifest(manifest: list[dict[str, Any]], expected: list[dict[str, Any]]) -> str | None:
    """None when the image's manifest matches the series, else what differs."""
    got = [(m.get("name"), m.get("sha256")) for m in manifest]
    want = [(e["name"], e["sha256"]) for e in expected]
    if got == want:
        return None
    names_got, names_want = [g[0] for g in got], [w[0] for w in want]
    if names_got != names_want:
        return f"patches in the image {names_got} != series {names_want}"
    diff = [w[0] for g, w in zip(got, want) if g[1] != w[1]]
    return f"sha256 differs for {diff} (the image was built from other patch files)"


def help_shows_flag(help_text: str, flag: str = THRESHOLD_FLAG) -> bool:
    return flag in help_text


def patched_files_compile(manifest: list[dict[str, Any]]) -> tuple[bool, str]:
    """Every file the manifest names is in this interpreter's site-packages and compiles."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    problems, count = [], 0
    for row in manifest:
        for rel in row.get("files", []):
            path = site / rel
            count += 1
            if not path.is_file():
                problems.append(f"{rel}: missing")
            elif path.suffix == ".py":
                try:
                    compile(path.read_text(encoding="utf-8"), str(path), "exec")
                except SyntaxError as exc:
                    problems.append(f"{rel}: {exc}")
    return not problems, "; ".join(problems) or f"{count} patched files present in {site}"


def run_checks(expected: list[dict[str, Any]], manifest_path: Path = MANIFEST,
               light: bool = False, expect_schedule: bool = False) -> dict[str, Any]:
    checks = []
    # the flags --help must show: the schedule's only where the smoke was asked to run one
    flags = (THRESHOLD_FLAG, *((DEPTH_SCHEDULE_FLAG,) if expect_schedule else ()))

    def add(name: str, ok: bool, detail: str = "", skipped: bool = False) -> None:
        checks.append({"name": name, "ok": ok, "detail": detail[-1500:], "skipped": skipped})

    try:
        manifest = json.loads(manifest_path.read_text())
        problem = compare_manifest(manifest, expected)
        add(f"patch manifest {manifest_path} matches the series", problem is None, problem or "")
    except (OSError, ValueError) as exc:
        manifest = []
        add(f"patch manifest {manifest_path} matches the series", False, str(exc))
    if light:
        ok, detail = patched_files_compile(manifest)
        add("patched files present and compiling", ok, detail)
        for name in (*(f"import {m}" for m in IMPORTS),
                     *(f"launch_server --help shows {flag}" for flag in flags), "pip check"):
            add(name, True, "skipped: light image (no torch); needs the full image", skipped=True)
        return {"partial": True, "light": True, "checks": checks,
                "ok": all(c["ok"] for c in checks),
                "note": "PARTIAL (light image): manifest and patched files only"}
    for mod in IMPORTS:
        try:
            m = importlib.import_module(mod)
            add(f"import {mod}", True, getattr(m, "__version__", ""))
        except Exception as exc:  # noqa: BLE001 - report any import failure
            add(f"import {mod}", False, f"{type(exc).__name__}: {exc}")
    # the image's own sglang and plugin: not the plugin's sources the smoke imports its names from
    p = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"],
                       check=False, capture_output=True, text=True, timeout=300, env=sglang_env())
    for flag in flags:
        shown = help_shows_flag(p.stdout, flag)
        add(f"launch_server --help shows {flag}", p.returncode == 0 and shown,
            "" if shown else (p.stderr or p.stdout)[-1500:] or "flag not in --help")
    p = subprocess.run([sys.executable, "-m", "pip", "check"], check=False, capture_output=True,
                       text=True, timeout=300, env=sglang_env())
    add("pip check", p.returncode == 0, (p.stdout + p.stderr).strip())
    return {"partial": True, "checks": checks, "ok": all(c["ok"] for c in checks),
            "note": "PARTIAL: no GPU here; the full smoke (servers, EAGLE-3, threshold) needs one"}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--expect-series", type=Path, required=True)
    ap.add_argument("--manifest", type=Path, default=MANIFEST)
    ap.add_argument("--light", action="store_true", help="image built with --light (no torch)")
    ap.add_argument("--expect-schedule", action="store_true",
                    help=f"--help must show {DEPTH_SCHEDULE_FLAG} too (nox -s smoke -- --schedule S)")


def main(a: argparse.Namespace) -> int:
    rep = run_checks(json.loads(a.expect_series.read_text()), a.manifest, a.light, a.expect_schedule)
    print(json.dumps(rep))
    return 0 if rep["ok"] else 1
