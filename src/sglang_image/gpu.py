"""Prepare the GPU end-to-end run (`nox -s gpu-e2e`) for a GPU host without Docker.

The GPU host needs Python 3.12 with the flavor's torch (CUDA 13) and an NVIDIA driver, nothing
else: no Docker, no registry, no internet. This module downloads every other wheel the smoke needs
from PyPI on the build machine, slims the big ones (dropping shared objects the smoke never loads),
and packs them into `.gpu/wheels.tar.xz` (an ignored folder). Copy the repository with `.gpu/` to
the GPU host and run the printed command there.

There `PYTHONPATH=plugin python3 -m bench e2e --bundle .gpu ...` (plugin/: the speculation
setting's contract, which the smoke and the benchmark import by name) installs them with
`pip install --no-index --no-deps --target /tmp/site`, applies patches/<flavor>/series on top,
builds the tiny models and runs the smoke checks and the benchmark (see bench/e2e.py).

Versions and hashes come from the flavor's lock (images/flavors/<flavor>.lock) and the wheels from
the same hash-checked fetch as the image build, so the GPU run tests the image's wheels.
"""
from __future__ import annotations

import base64
import csv
import fnmatch
import hashlib
import io
import json
import lzma
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from sglang_image import plugin_wheel
from sglang_image.errors import FetchError, SglangImageError, UsageError
from sglang_image.fetch import WHEEL_CACHE, fetch_entries, fetch_wheels
from sglang_image.lock import LockEntry, normalize, reachable, read_lock, read_requirements_graph
from sglang_image.pins import REPO_ROOT, Flavor, flavor_names, load_flavor

BUNDLE_DIR = REPO_ROOT / ".gpu"

# The GPU host's own stack: these distributions and everything they require in the lock (torch's
# CUDA runtime wheels, triton, numpy, ...). The host provides them at the lock's versions; where it
# has another torch, the flavor's stack is brought there first (MAINTAINING.md, "The GPU host"),
# and the e2e run says so in one line before any server starts.
HOST_ROOTS: tuple[str, ...] = ("torch", "torchvision", "torchaudio")

# Distributions that sglang requires (directly or not) but that a server of the smoke, feature and
# bench models (Llama + EAGLE-3, CUDA graphs, triton attention) does not import. Everything else
# sglang requires in the lock goes into the bundle, so a dependency a new release adds is carried
# by default; tests/build/test_gpu_bundle.py imports the server's launch path with the bundle alone and
# fails when one of these (or anything else) turns out to be needed.
NOT_ON_LAUNCH_PATH: dict[str, str] = {
    "nvidia-cuda-nvcc": "the host's CUDA toolkit compiles run-time kernels (CUDA_HOME)",
    "nvidia-cuda-crt": "part of the CUDA toolkit (CUDA_HOME)",
    "nvidia-nvvm": "part of the CUDA toolkit (CUDA_HOME)",
    "nvidia-cuda-cccl": "part of the CUDA toolkit (CUDA_HOME)",
    "nvidia-mathdx": "cuBLASDx/cuFFTDx headers for kernels the smoke does not compile",
    "nvidia-cutlass-dsl-libs-cu12": "CuTe DSL for CUDA 12 (the flavor runs CUDA 13)",
    "flash-attn-4": "FA4 attention backend (the smoke runs triton attention)",
    "tilelang": "DSA/NSA kernels of DeepSeek-style models",
    "tokenspeed-mla": "MLA kernels of DeepSeek-style models (0.5.17; imported when chosen)",
    "z3-solver": "tilelang's solver",
    "quack-kernels": "CuTe-DSL kernels of other backends",
    "humming-kernels": "quantized MoE kernels",
    "kernels": "Hugging Face kernel hub loader",
    "kernels-data": "Hugging Face kernel hub loader",
    "sgl-deep-ep": "expert-parallel all-to-all (MoE)",
    "nvshmem4py-cu13": "expert-parallel all-to-all (MoE)",
    "nccl-extensions": "expert-parallel all-to-all (MoE)",
    "nccl4py": "expert-parallel all-to-all (MoE)",
    "cuda-tile": "cuTile kernels of other backends",
    "timm": "vision encoders of multimodal models",
    "torchcodec": "video input of multimodal models",
    "mistral-common": "Mistral tokenizers",
    "tiktoken": "tiktoken tokenizers (the smoke models ship a BPE tokenizer.json)",
    "openai-harmony": "gpt-oss chat format",
    "tml-renderers": "chat renderers of other models",
    "deepseek-recipe": "DeepSeek chat format",
    "anthropic": "the Anthropic-compatible API",
    "outlines": "the outlines grammar backend (the smoke uses xgrammar or none)",
    "outlines-core": "the outlines grammar backend",
    "llguidance": "the llguidance grammar backend",
    "smg-grpc-proto": "the gRPC server",
    "smg-grpc-servicer": "the gRPC server",
    "grpcio": "the gRPC server",
    "grpcio-health-checking": "the gRPC server",
    "grpcio-reflection": "the gRPC server",
    "datasets": "benchmark datasets (the bench generates its prompts)",
    "pyarrow": "benchmark datasets",
    "pandas": "benchmark datasets",
    "modelscope": "downloads from ModelScope (models are local)",
    "modelscope-hub": "downloads from ModelScope",
    "hf-xet": "downloads from the Hugging Face hub (models are local)",
    "cyclonedx-bom": "the image's SBOM tool",
    "ipython": "notebook helpers (a stub answers sglang's module-level import)",
    "numba": "JIT helpers of other models",
    "llvmlite": "numba's compiler",
    "scipy": "helpers of other models and samplers",
    "py-spy": "a diagnostic (the bundle carries its own pin: DIAGNOSTIC_WHEELS)",
    "blobfile": "remote model storage",
    "lxml": "remote model storage",
    "pycryptodomex": "remote model storage",
}

# Diagnostics that travel with the bundle but are not in the image: py-spy samples the scheduler's
# stacks from outside (the bench's --pyspy-seconds), so host time is seen without profiler overhead.
# Pinned here, hash-checked like the lock's wheels (py-spy is a static binary: no dependencies).
DIAGNOSTIC_WHEELS: tuple[LockEntry, ...] = (
    LockEntry("py-spy", "0.4.3", ("8a4277225f470d394a85cca0cdd944bef87f0097b6f20150a6dd3ac2e92806b8",),
              verified=True, note="manylinux x86_64 wheel; binary lands in SITE/bin/py-spy"),
)


@dataclass(frozen=True)
class Slim:
    """How one wheel is slimmed: glob patterns of files to drop, strip debug info from .so files."""

    drop: tuple[str, ...] = ()
    strip_debug: bool = False


# Keys: normalized distribution names. Only files the smoke never loads are dropped: the FA3/FlashMLA/
# SM100 kernels (the smoke uses --attention-backend triton), sglang's gRPC/
# multimodal/server native cores (not used by `launch_server` for a Llama text model).
SLIMMING: dict[str, Slim] = {
    "sglang": Slim(drop=("sglang/srt/server/_core*.so", "sglang/srt/grpc/_core*.so",
                         "sglang/srt/multimodal/_core*.so", "sglang/multimodal_gen/*")),
    "sglang-kernel": Slim(drop=("sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/*",
                                "sgl_kernel/flashmla_ops.abi3.so", "sgl_kernel/infllm_ops*.so")),
    "xgrammar": Slim(drop=("xgrammar/lib/*",), strip_debug=True),
    "zstandard": Slim(strip_debug=True), "pybase64": Slim(strip_debug=True),
    "setproctitle": Slim(strip_debug=True), "torch-memory-saver": Slim(strip_debug=True),
}

# sglang/utils.py imports IPython at module level (only print_highlight uses it); the GPU host need
# not have IPython. A stub module keeps sglang's files pristine, so the patch series applies to upstream text.
IPYTHON_STUB = {
    "IPython/__init__.py": '"""Stub for the GPU smoke run: sglang imports IPython.display at module level."""\n',
    "IPython/display.py": "HTML = None\ndisplay = None\n",
}


@dataclass
class BundleReport:
    path: Path
    size: int
    wheels: list[tuple[str, int]] = field(default_factory=list)
    source: str = ""


# Distributions sglang imports when the server starts but does not declare (they reach its lock
# through other requirements, some of them NOT_ON_LAUNCH_PATH): carried as if sglang required them.
# tests/build/test_gpu_bundle.py finds such imports; each was also seen failing on a GPU host.
UNDECLARED_IMPORTS: dict[str, str] = {
    "dill": "sglang/srt/sampling/custom_logit_processor.py (via the configs package)",
    "jsonschema": "sglang/srt/entrypoints/openai/serving_chat.py",
}


# What the image carries beside the server that a GPU run starts: the router of deploy/'s router
# topology (bench.router runs it in front of two servers). Bundled with what it requires, where
# the flavor's lock has it.
IMAGE_TOOLS: dict[str, str] = {
    "sglang-router": "the router of deploy/'s router topology (the e2e driver's router phase)",
}


def host_stack(flavor: Flavor) -> set[str]:
    """The distributions the GPU host provides: HOST_ROOTS and what they require in the lock."""
    return reachable(read_requirements_graph(flavor.lock_path), HOST_ROOTS)


def bundle_members(flavor: Flavor, host_provides: tuple[str, ...] = ()) -> list[str]:
    """The bundled distributions: sglang and everything it requires in the flavor's lock, less
    the host's stack, NOT_ON_LAUNCH_PATH and `host_provides` (what the host already has at the
    lock's version), and what only those require."""
    graph = read_requirements_graph(flavor.lock_path)
    # The exclusions serve every flavor: one is a typo only when no flavor's lock has it.
    unknown = sorted(set(NOT_ON_LAUNCH_PATH).difference(*(
        read_requirements_graph(load_flavor(name).lock_path) for name in flavor_names())))
    if unknown:
        raise FetchError(f"GPU bundle: {unknown} (NOT_ON_LAUNCH_PATH in sglang_image/gpu.py) "
                         f"are in no flavor's lock: remove them there")
    unknown = sorted(set(UNDECLARED_IMPORTS) - set(graph))
    if unknown:
        raise FetchError(f"GPU bundle: {unknown} (UNDECLARED_IMPORTS in sglang_image/gpu.py) are "
                         f"not in {flavor.lock_path.name}: add them to the flavor's requirements")
    provided = {normalize(n) for n in host_provides}
    if provided - set(graph):
        raise FetchError(f"--host-provides {','.join(sorted(provided - set(graph)))}: not in "
                         f"{flavor.lock_path.name}; name distributions of the lock")
    stop = host_stack(flavor) | set(NOT_ON_LAUNCH_PATH) | provided
    tools = [name for name in IMAGE_TOOLS if name in graph]
    return sorted(reachable(graph, ["sglang", *tools, *UNDECLARED_IMPORTS], stop=stop))


def bundle_requirements(flavor: Flavor,
                        host_provides: tuple[str, ...] = ()) -> tuple[list[str], str]:
    """`name==version` of each bundled wheel, from the flavor's lock, and where they came from."""
    locked = {e.name: e.version for e in read_lock(flavor.lock_path)}
    source = (f"sglang's requirements and {', '.join(IMAGE_TOOLS)} in "
              f"{flavor.lock_path.relative_to(REPO_ROOT)} less the "
              f"host's torch stack and {len(NOT_ON_LAUNCH_PATH)} not on the launch path")
    if host_provides:
        source += f", and {','.join(host_provides)} (--host-provides)"
    return [f"{n}=={locked[n]}" for n in bundle_members(flavor, host_provides)], source


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _strip(data: bytes) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        so = Path(tmp, "x.so")
        so.write_bytes(data)
        sections = subprocess.run(["readelf", "-S", str(so)], check=False, capture_output=True,
                                  text=True).stdout
        if ".debug_" not in sections:
            return data
        subprocess.run(["strip", "--strip-debug", str(so)], check=True)
        return so.read_bytes()


def repack(wheel: Path, out_dir: Path, slim: Slim) -> Path:
    """Same file name, files dropped/stripped, RECORD regenerated, entries STORED (xz packs better)."""
    out = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as zin:
        record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        entries = []
        for info in zin.infolist():
            name = info.filename
            if name == record or name.endswith("/"):
                continue
            if any(fnmatch.fnmatch(name, g) for g in slim.drop):
                continue
            data = zin.read(name)
            if slim.strip_debug and data[:4] == b"\x7fELF":
                data = _strip(data)
            entries.append((info, data))
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for info, data in entries:
        writer.writerow([info.filename, _record_hash(data), len(data)])
    writer.writerow([record, "", ""])
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zout:
        for info, data in entries:
            zi = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            zi.external_attr = info.external_attr
            zout.writestr(zi, data)
        zi = zipfile.ZipInfo(record, date_time=(2026, 1, 1, 0, 0, 0))
        zout.writestr(zi, buf.getvalue())
    return out


def fetch_diagnostics(flavor: Flavor, dest: Path, cache: Path = WHEEL_CACHE) -> list[Path]:
    """The DIAGNOSTIC_WHEELS, downloaded once into the wheel cache and hash-checked on every use."""
    return fetch_entries(list(DIAGNOSTIC_WHEELS), flavor, dest, cache, "sglang_image/gpu.py DIAGNOSTIC_WHEELS")


def place_plugin_wheel(flavor: Flavor, bundle_dir: Path) -> Path | None:
    """The plugin's wheel in the bundle folder (plugin flavors; older ones removed)."""
    bundle_dir.mkdir(parents=True, exist_ok=True)
    for old in bundle_dir.glob("sglang_image_plugin-*.whl"):
        old.unlink()
    return plugin_wheel.build_wheel(bundle_dir) if flavor.plugin else None


def record_plugin(meta_path: Path, wheel: Path | None) -> None:
    """bundle.json names the plugin wheel beside the archive and its sha256 (checked on the host)."""
    meta = json.loads(meta_path.read_text())
    meta["plugin_wheel"] = (None if wheel is None else
                            {"name": wheel.name, "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest()})
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")


def bundle_key(requirements: list[str]) -> str:
    """Changes when a pin, a hash, the slimming or the stub changes: the archive is then rebuilt."""
    text = json.dumps([requirements, sorted((k, v.drop, v.strip_debug) for k, v in SLIMMING.items()),
                       IPYTHON_STUB, [(e.requirement, e.hashes) for e in DIAGNOSTIC_WHEELS]],
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def stage_bundle(flavor: Flavor, tmp: Path, cache: Path = WHEEL_CACHE,
                 host_provides: tuple[str, ...] = ()) -> Path:
    """The bundle's files under tmp: wheels/ (fetched by hash, slimmed) and stubs/; returns
    tmp/wheels. tmp/fetched holds the wheels as fetched."""
    wheels = fetch_wheels(flavor, tmp / "fetched", only=bundle_members(flavor, host_provides),
                          cache=cache)
    wheels += fetch_diagnostics(flavor, tmp / "fetched", cache)
    stage = tmp / "wheels"
    stage.mkdir()
    for whl in wheels:
        repack(whl, stage, SLIMMING.get(normalize(whl.name.split("-")[0]), Slim()))
    for rel, text in IPYTHON_STUB.items():
        p = tmp / "stubs" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return stage


def build_bundle(flavor: Flavor, bundle_dir: Path = BUNDLE_DIR,
                 cache: Path = WHEEL_CACHE, force: bool = False,
                 host_provides: tuple[str, ...] = (), part_mib: int = 0,
                 xz_level: int = 6) -> BundleReport:
    """Build (or reuse) BUNDLE/wheels.tar.xz and bundle.json; with part_mib, also the archive in
    parts of at most that many MiB (wheels.tar.xz.part-NN), for a copy of limited size."""
    requirements, source = bundle_requirements(flavor, host_provides)
    key = bundle_key(requirements)
    # The plugin wheel travels beside the archive (it changes far more often than the hundreds of
    # MB of wheels): the same bytes, by hash, as the image installs.
    plugin_wheel = place_plugin_wheel(flavor, bundle_dir)
    tar_path = bundle_dir / "wheels.tar.xz"
    meta_path = bundle_dir / "bundle.json"
    if not force and tar_path.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("key") == key and meta.get("sha256") == hashlib.sha256(tar_path.read_bytes()).hexdigest():
            write_parts(tar_path, part_mib)
            record_plugin(meta_path, plugin_wheel)
            return BundleReport(tar_path, tar_path.stat().st_size,
                                [(w["name"], w["stored_size"]) for w in meta["wheels"]],
                                meta["source"] + " (cached bundle)")
    bundle_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        stage = stage_bundle(flavor, Path(tmp), cache, host_provides)
        plain_tar = Path(tmp, "bundle.tar")
        with tarfile.open(plain_tar, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for p in sorted(Path(tmp).rglob("*")):
                if p.is_file() and p.parent.name != "fetched" and p != plain_tar:
                    ti = tar.gettarinfo(str(p), arcname=str(p.relative_to(tmp)))
                    ti.uid = ti.gid = 0
                    ti.uname = ti.gname = ""
                    ti.mtime = 1767225600  # 2026-01-01
                    with open(p, "rb") as fh:
                        tar.addfile(ti, fh)
        compress(plain_tar, tar_path.with_suffix(".tmp"), xz_level).replace(tar_path)
        sizes = [(w.name, w.stat().st_size) for w in sorted(stage.glob("*.whl"))]
    digest = hashlib.sha256(tar_path.read_bytes()).hexdigest()
    locked = {e.name: e.version for e in read_lock(flavor.lock_path)}
    host = {n: locked[n] for n in (*HOST_ROOTS, "triton", *map(normalize, host_provides))
            if n in locked}
    manifest = {"flavor": flavor.name, "source": source, "key": key, "sha256": digest,
                "host_stack": host,
                "size": tar_path.stat().st_size, "requirements": [r.split()[0] for r in requirements],
                "wheels": [{"name": n, "stored_size": s} for n, s in sizes]}
    (bundle_dir / "bundle.json").write_text(json.dumps(manifest, indent=1) + "\n")
    record_plugin(meta_path, plugin_wheel)
    write_parts(tar_path, part_mib)
    return BundleReport(tar_path, tar_path.stat().st_size, sizes, source)


def compress(source: Path, dest: Path, level: int = 6) -> Path:
    """xz of source into dest at `level`: the xz tool on every core where it is installed
    (hundreds of MB of stored wheels), else Python's lzma on one."""
    xz = shutil.which("xz")
    if xz:
        with dest.open("wb") as out:
            subprocess.run([xz, f"-{level}", "-T0", "-c", str(source)], stdout=out, check=True)
    else:
        with source.open("rb") as src, lzma.open(dest, "wb", preset=level) as out:
            shutil.copyfileobj(src, out, 2**20)
    return dest


def write_parts(tar_path: Path, part_mib: int) -> list[Path]:
    """tar_path in parts of at most part_mib MiB beside it (none for 0); `bench e2e` joins them
    where the whole archive did not travel."""
    for old in tar_path.parent.glob(tar_path.name + ".part-*"):
        old.unlink()
    if part_mib <= 0:
        return []
    parts: list[Path] = []
    size = part_mib * 2**20
    with tar_path.open("rb") as whole:
        while chunk := whole.read(size):
            part = tar_path.with_name(f"{tar_path.name}.part-{len(parts):02d}")
            part.write_bytes(chunk)
            parts.append(part)
    return parts


def host_command(*, phases: str = "all", out: str = "out/gpu-e2e") -> str:
    """The command to run in the repository's root on the GPU host (the bundle in .gpu/; plugin/ on
    PYTHONPATH: the smoke and the benchmark import the speculation setting's contract from it)."""
    return (f"mkdir -p {out} && PYTHONUNBUFFERED=1 PYTHONPATH=plugin${{PYTHONPATH:+:$PYTHONPATH}} "
            f"python3 -m bench e2e --bundle .gpu "
            f"--state /tmp/smoke-state --out {out} --phases {phases}")


@dataclass(frozen=True, kw_only=True)
class BundleOptions:
    """What `nox -s gpu-e2e` was asked for, besides the flavor; checked when made (the names of
    host_provides against the lock, by build_bundle)."""

    skip_build: bool = False  # only print the command to run on the GPU host
    force: bool = False  # rebuild the archive even if it is current
    host_provides: tuple[str, ...] = ()  # distributions of the lock the GPU host already has
    part_mib: int = 0  # also write the archive in parts of at most this many MiB (0: none)
    xz_level: int = 6

    def __post_init__(self) -> None:
        if self.part_mib < 0:
            raise UsageError(f"--part-mib {self.part_mib}: give a size in MiB >= 1, or 0 for "
                             "one archive")
        if not 0 <= self.xz_level <= 9:
            raise UsageError(f"--xz-level {self.xz_level}: give 0 (fastest) to 9 (smallest)")


def run(flavor: Flavor, options: BundleOptions) -> int:
    """`nox -s gpu-e2e`: builds (or reuses) the flavor's bundle and prints the command to run on
    the GPU host."""
    if not options.skip_build:
        rep = build_bundle(flavor, force=options.force, host_provides=options.host_provides,
                           part_mib=options.part_mib, xz_level=options.xz_level)
        print(f"bundle: {rep.path.relative_to(REPO_ROOT)} {rep.size / 2**20:.1f} MiB "
              f"({len(rep.wheels)} wheels; {rep.source})")
    bundle = BUNDLE_DIR / "wheels.tar.xz"
    if not bundle.is_file():
        raise SglangImageError(f"{bundle} missing; build it with: nox -s gpu-e2e")
    print("\nCopy this repository with .gpu/ to the GPU host (Python 3.12, the flavor's torch, an "
          "NVIDIA driver) and run in its root:\n"
          f"  {host_command()}\n"
          "When it writes jit-cache.tar.xz to its output folder, copy that into .gpu/: the next run "
          "on a fresh host then starts with its kernels compiled.")
    return 0
