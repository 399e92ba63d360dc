"""`nox -s smoke`: serve a generated model with EAGLE-3 and a threshold (or a draft depth per load,
--schedule) inside the built image and check its output token for token against plain decoding.

With a GPU: the full smoke. The image serves a tiny Llama target and EAGLE-3 draft generated
offline (nothing is downloaded, the container has no network); a plain server records the
reference outputs, then EAGLE-3 servers with the threshold (overlap scheduler with CUDA graphs, and
sync mode without) take load below, at and above it (with --schedule: in and across every tier),
and the feature matrix runs against them. Logs and report.json land in --out.
Without a GPU: a clearly labelled PARTIAL check (the image's imports, the threshold flag in the
server's --help, with --schedule the schedule's flag too, its patch manifest against
patches/<flavor>/series, pip check), and the list of what it did not check.

A passed smoke is recorded by image digest in out/smoke-records/: `nox -s publish` publishes only
an image that has one (a PARTIAL one only with --allow-partial-smoke).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sglang_image import smoke_schedule
from sglang_image import threshold as thresholds
from sglang_image.docker_engine import ensure_engine
from sglang_image.errors import PARTIAL_EXIT_CODE, ImageNotFoundError, SmokeError, UsageError
from sglang_image.pins import PLUGIN_PACKAGE_DIR, REPO_ROOT, Flavor, load_flavor
from sglang_image.plan import check_reference, default_tag
from sglang_image_plugin.setting import (
    AUTO,
    SCHEDULE_START_LOG_LINE,
    START_LOG_LINE,
    DepthSchedule,
    Threshold,
)

MOUNT = "/opt/sglang-smoke"
OUT_MOUNT = "/out"
FULL_TIMEOUT_S = 3600
PARTIAL_TIMEOUT_S = 900
RECORDS_DIR = REPO_ROOT / "out" / "smoke-records"
# The largest N, or schedule top edge, the feature matrix runs (smoke/features.py MAX_THRESHOLD; the
# build may not import the smoke, a test holds the two equal): the container's first step refuses
# a larger one
MATRIX_MAX_THRESHOLD = 256
MATRIX_CASES = ("greedy, logprobs, sampling, penalties, n2, long_prompt (chunked prefill), json_schema, "
                "regex, completions_stream, chat_stream, abort_stream, stop, kv_pressure (retraction)")
# What only the full smoke checks: said whenever a PARTIAL result is shown.
NOT_CHECKED_WITHOUT_GPU = (
    "the server starting on a GPU (CUDA kernels, FlashInfer JIT, CUDA graphs)",
    f"the start log line '{START_LOG_LINE.format(threshold='N')}'",
    "EAGLE-3 greedy outputs equal to plain decoding below and above the threshold",
    "speculation switching off and on with load (server info counters), accept length",
    "aborted requests in both modes and the KV pool returning to empty",
    f"the feature matrix below, above and across the threshold (python -m smoke features): {MATRIX_CASES}",
)


def not_checked_without_gpu(schedule: DepthSchedule | None = None) -> tuple[str, ...]:
    """NOT_CHECKED_WITHOUT_GPU, or with a schedule what the full smoke checks of its tiers."""
    if schedule is None:
        return NOT_CHECKED_WITHOUT_GPU
    return (NOT_CHECKED_WITHOUT_GPU[0],
            f"the start log line '{SCHEDULE_START_LOG_LINE.format(schedule=schedule)}'",
            "EAGLE-3 greedy outputs equal to plain decoding in every tier of the schedule",
            ("the draft depth following the load through every tier (server info counters), "
             "accept length"),
            "aborted requests in the first tier and the last, and the KV pool returning to empty",
            ("the feature matrix in every tier and across every edge (python -m smoke features): "
             f"{MATRIX_CASES}"))


@dataclass
class SmokeResult:
    mode: str  # "full" or "partial"
    ok: bool
    exit_code: int
    out_dir: Path
    report: dict[str, Any] = field(default_factory=dict)
    log_tail: str = ""
    image_id: str = ""  # sha256:<hex> of the image's config: what the record is keyed by
    schedule: DepthSchedule | None = None  # the servers' depth schedule, where one was asked for


@dataclass(frozen=True)
class SmokeRecord:
    """A passed smoke of one image, written by `nox -s smoke` and read by `nox -s publish`."""

    image_id: str  # sha256:<hex>, the image's config digest
    image: str  # the reference it was run as
    mode: str  # "full" or "partial"
    finished: str  # UTC, ISO 8601
    detail: dict[str, Any] = field(default_factory=dict)


def record_path(image_id: str, records_dir: Path | None = None) -> Path:
    return (records_dir or RECORDS_DIR) / f"{image_id.replace(':', '-')}.json"


def write_record(res: SmokeResult, image: str, records_dir: Path | None = None) -> Path | None:
    """Records a passed smoke (full, or PARTIAL) under the image's digest; None if it failed."""
    if not res.ok or not res.image_id:
        return None
    detail = ({"checks": res.report.get("checks", []),
               "not_checked": list(not_checked_without_gpu(res.schedule))}
              if res.mode == "partial" else {"report": str(res.out_dir / "report.json")})
    record = SmokeRecord(res.image_id, image, res.mode,
                         time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), detail)
    path = record_path(res.image_id, records_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(record), indent=1) + "\n")
    return path


def passed_smoke(image_id: str, records_dir: Path | None = None) -> SmokeRecord | None:
    """The record of a passed smoke of exactly this image (config digest), or None.

    One file per image: a full pass is not replaced by a later PARTIAL pass; a failed run of
    the image removes it (main)."""
    path = record_path(image_id, records_dir)
    try:
        data = json.loads(path.read_text())
        record = SmokeRecord(**data)
    except (OSError, ValueError, TypeError):
        return None
    return record if record.image_id == image_id else None


def expected_series(flavor: Flavor) -> list[dict[str, str]]:
    """[{"name", "sha256"}] of patches/<flavor>/series, in order: what the image's manifest must say."""
    return [{"name": p.name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for p in flavor.series()]


def host_has_gpu() -> bool:
    """nvidia-smi lists a GPU on this host (the engine then gets a DeviceRequest for all of them)."""
    if shutil.which("nvidia-smi") is None:
        return False
    p = subprocess.run(["nvidia-smi", "-L"], check=False, capture_output=True, text=True)
    return p.returncode == 0 and "GPU" in p.stdout


def full_command(threshold: Threshold | None = None,
                 schedule: DepthSchedule | None = None) -> list[str]:
    """The smoke, then the feature matrix, with `threshold` or `schedule` (neither: the smoke's own
    default threshold)."""
    if threshold is not None and schedule is not None:
        raise ValueError("a threshold or a schedule, not both")
    given = "" if threshold is None else f" --threshold {threshold}"
    # the matrix crosses a fixed N both ways; with auto it runs at the smoke's default N
    matrix = "" if threshold == AUTO else given
    if schedule is not None:  # both run it: the smoke through its tiers, the matrix in each
        given = matrix = f" --schedule {schedule}"
    # the matrix's own refusals (N or a top edge above MATRIX_MAX_THRESHOLD, its tiers, the open
    # files) before any model or server, not after the smoke
    script = (f"set -e; python3 -m smoke features --check --models /tmp/models --out {OUT_MOUNT}/features{matrix}; "
              "python3 -m smoke models /tmp/models --device cuda; "
              f"python3 -m smoke run --models /tmp/models --out {OUT_MOUNT}{given}; "
              f"python3 -m smoke features --models /tmp/models --out {OUT_MOUNT}/features{matrix}")
    return ["bash", "-c", script]


def partial_command(light: bool = False, schedule: bool = False) -> list[str]:
    """The PARTIAL check; with `schedule`, the server's --help must show the schedule's flag too."""
    return ["python3", "-m", "smoke", "partial", "--expect-series",
            f"{OUT_MOUNT}/expected-series.json", *(["--light"] if light else []),
            *(["--expect-schedule"] if schedule else [])]


# The plugin's package beside the smoke, as in the repository: the smoke imports the speculation
# setting's contract from it by name (sglang_image_plugin.setting), and a flavor's image without the
# plugin has none of its own. On the smoke's PYTHONPATH only: the smoke leaves it off its servers'
# (smoke.server.sglang_env), where it would shadow the image's installed plugin.
PLUGIN_MOUNT = f"{MOUNT}/plugin"


def container_kwargs(*, gpu: bool, out_dir: Path) -> dict[str, Any]:
    """Arguments of client.containers.run besides image and command (pure: unit-tested)."""
    import docker.types

    kw: dict[str, Any] = {
        # the smoke, and the plugin's package it imports the setting's contract from
        "volumes": {str(REPO_ROOT / "smoke"): {"bind": f"{MOUNT}/smoke", "mode": "ro"},
                    str(PLUGIN_PACKAGE_DIR): {"bind": f"{PLUGIN_MOUNT}/sglang_image_plugin", "mode": "ro"},
                    str(out_dir): {"bind": OUT_MOUNT, "mode": "rw"}},
        "working_dir": MOUNT,
        "environment": {"PYTHONPATH": f"{MOUNT}:{PLUGIN_MOUNT}", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                        "TRANSFORMERS_OFFLINE": "1"},
        "network_mode": "none",
        "shm_size": "8g",
        "detach": True,
    }
    if gpu:
        kw["device_requests"] = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
    return kw


def image_flavor(image: str, labels: dict[str, str], flavor: str | None) -> str | None:
    """The flavor whose series the image must carry: its label's, unless --flavor says otherwise,
    which is refused (the comparison would fail for the wrong reason)."""
    built = labels.get("io.sglang-image.flavor")
    if flavor and built and flavor != built:
        raise SmokeError(f"{image} was built for flavor {built}, not {flavor}: drop --flavor, or "
                         f"pass the image of {flavor} (nox -s build -- --flavor {flavor})")
    return flavor or built


def image_missing(image: str) -> ImageNotFoundError:
    return ImageNotFoundError(f"image {image} is not in the Docker engine: build it (nox -s build, "
                              f"or nox -s build -- --flavor FLAVOR), or name another with --image")


def smoke_image(image: str, *, flavor: Flavor | None = None, gpu: bool | None = None,
                out_dir: Path | None = None, threshold: Threshold | None = None,
                schedule: DepthSchedule | None = None) -> SmokeResult:
    """Runs the smoke (full with a GPU, else PARTIAL) in `image` against `flavor`'s series (None:
    the flavor the image was built for, by its label), with `threshold` or `schedule`."""
    import docker.errors

    gpu = host_has_gpu() if gpu is None else gpu
    out_dir = (out_dir or REPO_ROOT / "out" / "smoke").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    out_dir.chmod(0o777)  # the image runs as uid 1000: let it read the series and write reports
    engine = ensure_engine(log=lambda msg: print(f"» {msg}", file=sys.stderr))
    try:
        found = engine.client.images.get(image)
    except docker.errors.ImageNotFound:
        raise image_missing(image) from None
    # Run the image by its ID: the record names exactly what ran, even if the tag moves.
    image_id, labels = str(found.id), found.labels or {}
    built_for = image_flavor(image, labels, flavor.name if flavor else None)
    if flavor is None:
        flavor = load_flavor(built_for)  # the image's own flavor (the default without a label)
    if threshold is not None:
        thresholds.check_flavor(threshold, flavor)
    if schedule is not None:
        smoke_schedule.check_flavor(schedule, flavor)
    (out_dir / "expected-series.json").write_text(json.dumps(expected_series(flavor), indent=1))
    light = labels.get("io.sglang-image.light") == "true"
    cmd = (full_command(threshold, schedule) if gpu and not light
           else partial_command(light, schedule is not None))
    try:
        # The image's entrypoint starts the server: replace it, the command is the runner.
        container = engine.client.containers.run(image_id, entrypoint=cmd,
                                                 **container_kwargs(gpu=gpu, out_dir=out_dir))
    except docker.errors.ImageNotFound:
        raise image_missing(image) from None
    except docker.errors.APIError as exc:
        hint = (" (no GPU support in this engine? install the NVIDIA container toolkit, or run "
                "without a GPU for the PARTIAL check)") if gpu else ""
        raise SmokeError(f"could not start the smoke container from {image}: {exc}{hint}") from exc
    try:
        status = container.wait(timeout=FULL_TIMEOUT_S if gpu else PARTIAL_TIMEOUT_S)
        code = int(status.get("StatusCode", 1))
        logs = container.logs().decode("utf-8", "replace")
    finally:
        try:
            container.remove(force=True)
        except docker.errors.APIError:
            pass
    (out_dir / ("smoke-full.log" if gpu else "smoke-partial.log")).write_text(logs)
    tail = "\n".join(logs.splitlines()[-60:])
    if gpu:
        rp = out_dir / "report.json"
        report = json.loads(rp.read_text()) if rp.is_file() else {}
        return SmokeResult("full", code == 0, code, out_dir, report, tail, image_id, schedule)
    report = {}
    for line in reversed(logs.splitlines()):
        if line.startswith("{") and '"partial"' in line:
            report = json.loads(line)
            break
    (out_dir / "partial.json").write_text(json.dumps(report, indent=1))
    return SmokeResult("partial", code == 0 and bool(report.get("ok")), code, out_dir, report, tail,
                       image_id, schedule)


def describe(res: SmokeResult) -> str:
    if res.mode == "partial":
        verdict = "passed" if res.ok else "FAILED"
        lines = [(f"PARTIAL smoke {verdict} (no GPU on this host): image checks only, NOT a "
                  "pass of the smoke. Not checked without a GPU:")]
        lines += [f"  - {item}" for item in not_checked_without_gpu(res.schedule)]
        lines.append("The full smoke: nox -s smoke on a GPU host with Docker (nox -s gpu-e2e "
                     "runs the same checks on the same wheels on a GPU host without Docker, but "
                     "not on this image). Checks run here:")
        for c in res.report.get("checks", []):
            mark = "skip" if c.get("skipped") else ("ok" if c["ok"] else "FAIL")
            lines.append(f"  [{mark}] {c['name']}" + ("" if c["ok"] and not c.get("skipped")
                                                      else f": {c['detail'][:500]}"))
        if not res.report:
            lines.append("  no report from the container; its log tail:\n" + res.log_tail)
        return "\n".join(lines)
    return (f"FULL smoke: {'PASS' if res.ok else 'FAIL'} (exit {res.exit_code}); report and logs in "
            f"{res.out_dir}\n{res.log_tail}")


@dataclass(frozen=True, kw_only=True)
class ImageSmokeOptions:
    """What `nox -s smoke` was asked for, besides the flavor; checked when made (the threshold or
    the schedule against the flavor in `run`, once the image's flavor is known)."""

    image: str | None = None  # default: the tag nox -s build gives the flavor
    gpu: bool | None = None  # default: when nvidia-smi lists a GPU
    out_dir: Path | None = None  # default: out/smoke
    threshold: Threshold | None = None  # default: the smoke's own (smoke/scenario.py)
    schedule: DepthSchedule | None = None  # instead of the threshold: a draft depth per load
    accept_partial: bool = False  # exit 0, not PARTIAL_EXIT_CODE, when the PARTIAL check passes
    records: Path | None = None  # default: RECORDS_DIR

    def __post_init__(self) -> None:
        if self.image is not None:
            check_reference(self.image, "--image", digest=True)
        if self.schedule is not None:
            if self.threshold is not None:
                raise UsageError(
                    f"--threshold {self.threshold} and --schedule {self.schedule} are both given: "
                    "give one (a threshold N is the schedule "
                    f"1-N:{smoke_schedule.SMOKE_STEPS},N+1-:0 on the smoke's servers)")
            smoke_schedule.check(self.schedule)
            top = max(t.high for t in self.schedule.tiers if t.high is not None)
            if top > MATRIX_MAX_THRESHOLD:
                raise UsageError(f"--schedule {self.schedule}: its top edge {top} is above the "
                                 f"{MATRIX_MAX_THRESHOLD} the smoke's feature matrix runs (its decode "
                                 f"graphs go to {MATRIX_MAX_THRESHOLD}); give a top edge <= "
                                 f"{MATRIX_MAX_THRESHOLD}")
        if isinstance(self.threshold, int) and self.threshold > MATRIX_MAX_THRESHOLD:
            # refused here, not after the image has started: the matrix runs N up to its ceiling
            raise UsageError(f"--threshold {self.threshold}: the smoke's feature matrix runs N up to "
                             f"{MATRIX_MAX_THRESHOLD} (its decode graphs go to {MATRIX_MAX_THRESHOLD}); "
                             f"give N <= {MATRIX_MAX_THRESHOLD}")


def run(flavor: Flavor | None, options: ImageSmokeOptions) -> int:
    """`nox -s smoke`: runs it, says what it checked, records a pass under the image's digest (a
    failure removes an earlier pass of the image and raises SmokeError); returns 0, or
    PARTIAL_EXIT_CODE for a PARTIAL pass unless accepted. `flavor` None: the one the image was
    built for; without an image either, the default flavor's image."""
    image = options.image
    if image is None:
        flavor = flavor or load_flavor()
        image = default_tag(flavor)
    res = smoke_image(image, flavor=flavor, gpu=options.gpu, out_dir=options.out_dir,
                      threshold=options.threshold, schedule=options.schedule)
    print(describe(res))
    if not res.ok:
        stale = record_path(res.image_id, options.records)
        if res.image_id and stale.is_file():  # an earlier pass of this image no longer counts
            stale.unlink()
            print(f"removed the earlier pass of {res.image_id}: {stale}")
        raise SmokeError(f"the {res.mode} smoke of {image} failed (exit {res.exit_code}): the "
                         f"checks above say which; logs and reports in {res.out_dir}")
    existing = passed_smoke(res.image_id, options.records)
    if res.mode == "full" or existing is None or existing.mode == "partial":
        path = write_record(res, image, options.records)
        print(f"recorded: {path} ({res.mode} smoke of {res.image_id})")
    if res.mode == "partial" and not options.accept_partial:
        print(f"exit {PARTIAL_EXIT_CODE}: PARTIAL is not a pass (--accept-partial exits 0 for it)")
        return PARTIAL_EXIT_CODE
    return 0
