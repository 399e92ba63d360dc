"""The whole GPU run as one resumable driver (for the device machine: no Docker, no internet).

    python3 -m bench e2e --bundle .gpu --state /tmp/smoke-state --out "$OUT" [--deadline 560]
                         [--phases all|install,patch,models,smoke,bench,comm] [--fresh]
                         [--parallel-variants]

Phases, each skipped when the state dir says it is done (a warm machine keeps /tmp between calls,
so the same command a second time resumes where the deadline stopped the first; a smoke, bench or
comm result counts as done only for the same options, and a site installed from another bundle or
patch series is refused unless this call installs again):
  install  unpack .gpu/wheels.tar.xz, pip install --no-index --no-deps --target SITE, IPython stub
  patch    PYTHONPATH=src python -m sglang_image.patch apply --series-dir patches/<flavor>
           --site-packages SITE --manifest STATE/patches.json (on a fresh SITE only: never twice)
           then unpacks the bundle's jit-cache.tar.xz for these wheels and patches (bench.jitcache)
  check    imports the server chain; `launch_server --help` must show the threshold flag
  models   the models of the selected phases: --smoke-size, --bench-size (--device cuda: seconds)
  smoke    plain reference server, EAGLE-3 + threshold (overlap on, CUDA graphs) and
           (--disable-overlap-schedule, no CUDA graphs) with every check of smoke.runner
  features the feature matrix of smoke.features (sampling, logprobs, stops, streams, grammars,
           penalties, n > 1, chunked prefill, KV pressure, aborts) across the mode changes
  bench    the paired benchmark of bench.throughput (--bench-*: configs, concurrency, pairs, the
           A/A twin); its servers outlive the call (recorded in STATE/bench-servers.json), so the
           next call goes on with them; they stop when the bench is complete or with --stop
  comm     TP=2/TP=1 runs of a tiny Qwen3 with torch symm mem / FlashInfer allreduce fusion (bench.comm;
           needs 2 GPUs; `python3 -m bench comm` = this driver with install,patch,models,comm)
  router   sglang-router with deploy/'s rendered flags in front of two threshold servers (1B-shaped
           models): load across each threshold, outputs equal to plain, a server killed mid-load
           with no request lost (bench.router; --router-*)
The models phase builds only the models of the selected phases (all when none of
smoke/bench/comm/router is).
No server is started with less than ~150 s left before the deadline; what is done is written to
OUT (report.json, summary.txt, e2e.log, logs.tar.gz: at most 8 files come back), and the kernels
compiled in this call as jit-cache.tar.xz, for the bundle folder (bench.jitcache).
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import comm as comm_mod
from bench import jitcache
from bench import router as router_mod
from bench import servers as bench_servers
from bench.options import BenchOptions, add_tuning_arguments, tuning_options
from bench.throughput import run_bench
from smoke import features as features_mod
from smoke import names, runner
from smoke.deadline import Deadline

PHASES = ("install", "patch", "check", "models", "smoke", "features", "bench", "comm", "router")
RUN_PHASES = ("smoke", "features", "bench", "comm", "router")  # marked done in the state once complete
# state of the installed site, and prefixes of the results measured on it: a new site drops both
SITE_STATE = ("patch", "check")
RESULT_STATE = ("smoke", "features", "bench_", "comm", "router")
# model dir -> (`smoke models` args, the phases that use it)
MODELS = {"tiny": (["--size", "tiny", "--draft", "first"], ("smoke", "features")),
          "1b": (["--size", "1b", "--draft", "chain"], ("bench", "router", "smoke", "features")),
          "8b": (["--size", "8b", "--draft", "chain"], ("bench",)),
          "qwen3": (["--arch", "qwen3", "--size", "tp2"], ("comm",))}
REPO = Path(__file__).resolve().parents[1]
FLAG = names.THRESHOLD_FLAG


def bundle_archive(bundle: Path) -> Path:
    """BUNDLE/wheels.tar.xz; where it travelled in parts (wheels.tar.xz.part-NN), joined first."""
    whole = bundle / "wheels.tar.xz"
    parts = sorted(bundle.glob("wheels.tar.xz.part-*"))
    if not whole.is_file() and parts:
        tmp = whole.with_suffix(".joining")
        with tmp.open("wb") as out:
            for part in parts:
                out.write(part.read_bytes())
        tmp.replace(whole)
    if not whole.is_file():
        raise SystemExit(f"{whole} is missing: build the bundle with nox -s gpu-e2e, then copy "
                         ".gpu/ (or its parts) to this host")
    return whole


def pth_paths(site: Path) -> list[str]:
    """The folders the site's .pth files add to sys.path, as `site` would add them for a
    site-packages folder (path lines, and `import` lines such as nvidia-cutlass-dsl's, which puts
    its dsl_packages folder first): a PYTHONPATH entry or a `pip --target` site runs none of them,
    so they are asked of `site.addsitedir` in a child interpreter and put on PYTHONPATH."""
    if not site.is_dir() or not any(site.glob("*.pth")):
        return []
    code = ("import json, site, sys\n"
            "before = list(sys.path)\n"
            "site.addsitedir(sys.argv[1])\n"
            "print(json.dumps([p for p in sys.path if p not in before and p != sys.argv[1]]))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True,
                          check=False, env={**os.environ, "PYTHONPATH": str(site)})
    if proc.returncode != 0:
        raise SystemExit(f"the .pth files of {site} fail: {proc.stderr.strip()[-800:]}")
    return [str(p) for p in json.loads(proc.stdout.strip().splitlines()[-1])]


def same_release(have: str, want: str) -> bool:
    """Whether two versions are one release (a local version suffix such as +cu130 aside)."""
    return have.split("+")[0] == want.split("+")[0]


def host_stack_problems(expected: dict[str, str], found: dict[str, str | None]) -> list[str]:
    """One line per distribution of the flavor's torch stack that the host lacks or has at another
    version (a local version suffix such as +cu130 counts as the same release)."""
    lines = []
    for name, want in sorted(expected.items()):
        have = found.get(name)
        if have is None:
            lines.append(f"{name} {want} is not installed here")
        elif not same_release(have, want):
            lines.append(f"{name} is {have} here, the flavor pins {want}: servers run on this "
                         "host's stack, not the image's (bring the flavor's stack: MAINTAINING.md)")
    return lines


def torch_refusal(expected: dict[str, str], found: dict[str, str | None]) -> str | None:
    """Why servers must not start on this host's torch: none installed, or another release than
    the flavor pins (the server would fail deep in its imports, or measure another stack)."""
    want = expected.get("torch")
    if want is None:
        return None
    have = found.get("torch")
    if have is None:
        return (f"host stack: torch is not installed for this Python: install the flavor's torch {want} "
                "first (MAINTAINING.md)")
    if not same_release(have, want):
        return (f"host stack: this Python has torch {have}, the flavor pins {want}: put the flavor's "
                "torch stack on its path before this command (MAINTAINING.md); nothing was run")
    return None


class E2E:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.t0 = time.time()
        self.deadline = Deadline(self.t0 + a.deadline)
        self.state_dir: Path = a.state
        self.out: Path = a.out
        self.logs = self.state_dir / "logs"
        self.site = self.state_dir / "site"
        self.models = self.state_dir / "models"
        for d in (self.state_dir, self.out, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.state_file = self.state_dir / "state.json"
        if a.fresh and self.state_file.exists():
            self.state_file.unlink()
        self.state: dict[str, Any] = (json.loads(self.state_file.read_text())
                                      if self.state_file.exists() else {})
        self.failures: list[str] = []
        self.host_stack_checked = False  # check_host_stack runs once a call
        self.log_path = self.out / "e2e.log"
        self.phases = PHASES if a.phases == "all" else tuple(a.phases.split(","))

    # ------------------------------------------------------------------ helpers
    def log(self, msg: str) -> None:
        line = f"[e2e {time.strftime('%H:%M:%S')} +{time.time() - self.t0:5.0f}s] {msg}"
        print(line, flush=True)
        with self.log_path.open("a") as f:
            f.write(line + "\n")

    def save(self) -> None:
        self.state_file.write_text(json.dumps(self.state, indent=1))

    def env(self) -> None:
        """Environment for this process and every server it starts."""
        jit = self.state_dir / "jit"
        own = [str(self.site), *pth_paths(self.site), str(self.state_dir / "stubs")]
        os.environ.update({
            "PYTHONPATH": os.pathsep.join(own + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                 if p and p not in own]),
            "SMOKE_SERVER_PIDFILE": str(self.state_dir / "servers.pid"),
            "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "FLASHINFER_WORKSPACE_BASE": str(jit), "TVM_FFI_CACHE_DIR": str(jit / "tvm-ffi"),
            "TRITON_CACHE_DIR": str(jit / "triton"),
            "CUDA_HOME": os.environ.get("CUDA_HOME", "/usr/local/cuda"),
            **comm_mod.NO_MULTICAST_ENV,  # NVLink multicast is off on the lent machines
        })
        os.environ["PATH"] = f"{os.environ['CUDA_HOME']}/bin:{os.environ.get('PATH', '')}"
        for p in reversed(own):
            if p not in sys.path:
                sys.path.insert(0, p)

    def sh(self, cmd: list[str], log_name: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        self.log("$ " + " ".join(cmd))
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, **kw)
        with (self.logs / log_name).open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n{p.stdout}\n{p.stderr}\n")
        return p

    # ------------------------------------------------------------------ phases
    def series_digest(self) -> str:
        d = REPO / "patches" / self.flavor
        h = hashlib.sha256()
        for p in sorted(d.glob("*")) if d.is_dir() else []:
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        return h.hexdigest()

    @functools.cached_property
    def wheels_digest(self) -> str:
        """sha256 of the bundle's wheels (tens of MB: read once per call)."""
        return hashlib.sha256(bundle_archive(self.a.bundle).read_bytes()).hexdigest()

    def install_key(self) -> str:
        """What the site is made of: the bundle's wheels, the plugin wheel beside them and the
        patch series."""
        plugin = self.plugin_wheel()
        plugin_digest = hashlib.sha256(plugin.read_bytes()).hexdigest() if plugin else "-"
        return f"{self.wheels_digest}:{plugin_digest}:{self.series_digest()}"

    def plugin_wheel(self) -> Path | None:
        """The plugin wheel beside the archive (plugin flavors), checked against bundle.json."""
        meta = self.a.bundle / "bundle.json"
        entry = json.loads(meta.read_text()).get("plugin_wheel") if meta.is_file() else None
        if not entry:
            return None
        wheel: Path = self.a.bundle / str(entry["name"])
        if not wheel.is_file():
            raise SystemExit(f"{wheel} is missing: copy it with the bundle (nox -s gpu-e2e writes it)")
        if hashlib.sha256(wheel.read_bytes()).hexdigest() != entry["sha256"]:
            raise SystemExit(f"{wheel}: sha256 differs from {meta}: rebuild the bundle "
                             "(nox -s gpu-e2e) and copy both")
        return wheel

    def kernel_key(self) -> str:
        return jitcache.kernel_key(self.wheels_digest, self.state.get("patch") or [])

    def phase_install(self) -> None:
        tarball = bundle_archive(self.a.bundle)
        key = self.install_key()
        if self.state.get("install") == key and (self.site / ".installed").exists():
            self.log("install: site already holds this bundle and series")
            return
        # a new bundle or a new series: start from a clean site (patches never applied twice)
        # ... and every result measured on the old site is stale
        for k in [k for k in self.state if k in SITE_STATE or k.startswith(RESULT_STATE)]:
            self.state.pop(k)
        shutil.rmtree(self.site, ignore_errors=True)
        stage = self.state_dir / "bundle"
        shutil.rmtree(stage, ignore_errors=True)
        with tarfile.open(tarball) as tar:
            for member in tar:
                if member.isfile():
                    jitcache.extract_file(tar, member, stage)
        wheels = sorted(str(p) for p in (stage / "wheels").glob("*.whl"))
        p = self.sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                     "--no-compile", "--disable-pip-version-check", "--target", str(self.site), *wheels],
                    "setup.log")
        if p.returncode != 0:
            raise RuntimeError(f"pip install failed: {p.stderr[-1500:]}")
        plugin = self.plugin_wheel()
        if plugin is not None:  # over any older copy an archive may hold
            p = self.sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                         "--no-compile", "--disable-pip-version-check", "--upgrade", "--target",
                         str(self.site), str(plugin)], "setup.log")
            if p.returncode != 0:
                raise RuntimeError(f"pip install of the plugin failed: {p.stderr[-1500:]}")
        dated = jitcache.age_site(self.site)  # FlashInfer's ninja builds then take the cached kernels
        shutil.rmtree(self.state_dir / "stubs", ignore_errors=True)
        shutil.copytree(stage / "stubs", self.state_dir / "stubs")
        shutil.rmtree(stage)
        (self.site / ".installed").write_text(key)
        self.state["install"] = key
        self.env()  # the new site's .pth folders on the path of every server from here on
        self.log(f"install: {len(wheels)} wheels into {self.site} ({dated} files dated "
                 f"{time.strftime('%Y-%m-%d', time.gmtime(jitcache.SITE_MTIME))})")

    def phase_patch(self) -> None:
        if self.state.get("patch"):
            self.log("patch: already applied to this site")
            return
        series_dir = REPO / "patches" / self.flavor
        manifest = self.state_dir / "patches.json"
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        p = self.sh([sys.executable, "-m", "sglang_image.patch", "apply", "--series-dir", str(series_dir),
                     "--site-packages", str(self.site), "--manifest", str(manifest)], "setup.log", env=env)
        self.log(p.stdout.strip() or p.stderr.strip()[-800:])
        if p.returncode != 0:
            raise RuntimeError(f"patch series did not apply: {p.stderr.strip()[-1500:]}")
        self.state["patch"] = json.loads(manifest.read_text()) if manifest.exists() else []
        shutil.copy(manifest, self.out / "patches.json") if manifest.exists() else None
        # kernels compiled by an earlier machine for these wheels and patches: the first server starts
        # ~1 min sooner (the key reads the manifest the apply just wrote)
        added, why = jitcache.seed(self.a.bundle / jitcache.ARCHIVE, self.state_dir / "jit", self.kernel_key())
        self.log(f"jit cache: {added} compiled files from {self.a.bundle / jitcache.ARCHIVE}" if added
                 else f"jit cache: none unpacked ({why})")
        self.state["jit_fingerprint"] = jitcache.fingerprint(self.state_dir / "jit")

    def phase_check(self) -> None:
        if self.state.get("check"):
            self.log("check: done for this site")
            return
        self.check_host_stack()
        code = ("import importlib.metadata as md, torch, sys\n"
                "print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name(0))\n"
                "for p in ['sglang','sglang-kernel','flashinfer-python','transformers','tokenizers']:\n"
                "    print(' ', p, md.version(p))\n"
                "import sglang.srt.entrypoints.http_server\nprint('import chain OK')\n")
        p = self.sh([sys.executable, "-c", code], "setup.log")
        self.log(p.stdout.strip()[-800:])
        if p.returncode != 0:
            raise RuntimeError(f"the sglang import chain fails: {p.stderr.strip()[-1500:]}")
        h = self.sh([sys.executable, "-m", "sglang.launch_server", "--help"], "setup.log")
        if FLAG not in h.stdout:
            raise RuntimeError(f"`launch_server --help` does not show {FLAG} (patch not applied?)")
        self.state["check"] = True

    def check_host_stack(self) -> None:
        """One line before any server starts where the host's torch stack is not the flavor's (the
        import chain would otherwise fail deep inside, or run on another torch); raises where its
        torch is missing or another release (torch_refusal). Once a call."""
        if self.host_stack_checked:
            return
        self.host_stack_checked = True
        meta = self.a.bundle / "bundle.json"
        expected = json.loads(meta.read_text()).get("host_stack", {}) if meta.is_file() else {}
        code = ("import importlib.metadata as md, json, sys\n"
                "out = {}\n"
                "for name in json.loads(sys.argv[1]):\n"
                "    try: out[name] = md.version(name)\n"
                "    except md.PackageNotFoundError: out[name] = None\n"
                "print(json.dumps(out))\n")
        p = self.sh([sys.executable, "-c", code, json.dumps(sorted(expected))], "setup.log")
        found = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {}
        problems = host_stack_problems(expected, found)
        for line in problems:
            self.log(f"host stack: {line}")
        self.state["host_stack"] = {"expected": expected, "found": found, "problems": problems}
        refusal = torch_refusal(expected, found)
        if refusal:
            raise RuntimeError(refusal)

    def phase_models(self) -> None:
        # in a subprocess: the driver must not keep GPU memory while the servers run
        # the smoke and the feature matrix run on --smoke-size, the bench on --bench-size, the
        # router run on the 1B shape; all of them when no phase that runs servers is selected
        by_phase = {"smoke": self.a.smoke_size, "features": self.a.smoke_size,
                    "bench": self.a.bench_size, "router": "1b", "comm": "qwen3"}
        wanted = list(dict.fromkeys(by_phase[ph] for ph in self.phases if ph in by_phase)
                      or dict.fromkeys(["tiny", self.a.bench_size, "qwen3"]))
        for name in wanted:
            args = list(MODELS[name][0])
            if "bench" in MODELS[name][1]:  # one 1B folder for the bench, the smoke and the router
                args += ["--draft-accept", str(self.a.bench_draft_accept)]
            d = self.models / name
            if (d / "expected.json").exists() and self.state.get(f"models_{name}") == args:
                continue
            shutil.rmtree(d, ignore_errors=True)
            p = self.sh([sys.executable, "-m", "smoke", "models", str(d), "--device", "cuda", *args],
                        "setup.log", cwd=str(REPO))
            if p.returncode != 0:
                raise RuntimeError(f"models {name}: {p.stderr.strip()[-1500:]}")
            self.state[f"models_{name}"] = args
            self.save()
            self.log(f"models {name}: {p.stdout.strip().splitlines()[-1]}")

    def phase_smoke(self) -> None:
        st = self.resumable("smoke")
        auto, threshold = smoke_threshold(self.a.threshold)
        opts = runner.SmokeOptions(models=self.models / self.a.smoke_size, out=self.logs, auto=auto,
                                   threshold=threshold,
                                   deadline=self.deadline, mem_fraction=0.15,
                                   variants=tuple(self.a.smoke_variants.split(",")),
                                   parallel_variants=self.a.parallel_variants)
        rep = runner.run_smoke(opts, st)
        self.state["smoke_report"] = rep
        self.log("\n" + runner.summarize(rep))
        if rep.get("skipped"):
            raise Deadline_(f"smoke: skipped {rep['skipped']}")

    def phase_features(self) -> None:
        st = self.resumable("features")
        opts = features_mod.FeatureOptions(models=self.models / self.a.smoke_size, out=self.logs,
                                           graph_bs=self.a.feature_graph_bs,
                                           threshold=smoke_threshold(self.a.threshold)[1],
                                           deadline=self.deadline,
                                           variants=tuple(self.a.feature_variants.split(",")),
                                           parallel_variants=self.a.parallel_variants,
                                           cases=self.feature_cases(),
                                           # progress in e2e.log, and the state on disk as each
                                           # case is done: a call killed from outside keeps them
                                           progress=self.log, save_state=self.save)
        rep = features_mod.run_features(opts, st)
        self.state["features_report"] = rep
        self.log("\n" + features_mod.summarize(rep))
        if rep.get("skipped"):
            raise Deadline_(f"features: skipped {rep['skipped']}")

    def feature_cases(self) -> tuple[str, ...]:
        return runner.comma_list(self.a.feature_cases, features_mod.CASE_NAMES, "--feature-cases")

    def options_digest(self, ph: str) -> str:
        """The options a run phase's result depends on: a later call that changes any of them runs the
        phase again instead of reporting the earlier result as its own."""
        opts: Any = {"smoke": [self.a.threshold, self.a.smoke_variants, self.a.smoke_size],
                     "features": [self.a.threshold, self.a.feature_variants, self.a.smoke_size,
                                  self.a.feature_graph_bs, sorted(self.feature_cases())],
                     "bench": [self.a.bench_size, self.a.bench_draft_accept,
                               {k: v for k, v in tuning_options(self.a, "bench-").items()
                                if k != "launch_only"}],
                     "comm": [self.a.comm_runs],
                     "router": [self.a.router_threshold, self.a.router_levels, self.a.router_kill,
                                self.a.bench_draft_accept]}[ph]
        return hashlib.sha256(json.dumps(opts, default=str).encode()).hexdigest()[:10]

    @functools.cached_property
    def flavor(self) -> str:
        """The flavor `nox -s gpu-e2e -- --flavor F` built the bundle for (BUNDLE/bundle.json): its
        series goes onto the bundle's wheels, never another's."""
        meta = self.a.bundle / "bundle.json"
        if not meta.is_file():
            raise SystemExit(f"{meta} is missing: build the bundle of the flavor with "
                             "nox -s gpu-e2e -- --flavor F and copy .gpu/ whole")
        return str(json.loads(meta.read_text())["flavor"])

    @property
    def bench_key(self) -> str:
        """One bench per model size, mode and options: a later call with other ones runs its own, and
        the report keeps both."""
        return str(self.a.bench_size) + "-" + self.options_digest("bench")

    def resumable(self, ph: str) -> dict[str, Any]:
        """The resume state of the smoke or comm phase, emptied when its options changed."""
        if self.state.get(f"{ph}_options") != self.options_digest(ph):
            self.state[ph] = {}
            self.state[f"{ph}_options"] = self.options_digest(ph)
        phase: dict[str, Any] = self.state.setdefault(ph, {})
        return phase

    @property
    def bench_registry(self) -> Path:
        """Where the bench's servers are recorded: they outlive a call on a warm machine."""
        return self.state_dir / "bench-servers.json"

    def phase_bench(self) -> None:
        opts = BenchOptions(
            models=self.models / self.a.bench_size, out=self.logs / f"bench_{self.a.bench_size}", deadline=self.deadline,
            pyspy_dirs=(self.site / "bin",), registry=self.bench_registry,
            key_extra=str(self.state.get("install", "")), **tuning_options(self.a, "bench-"))
        if opts.launch_only:  # the servers start meanwhile; the call that measures keeps the report
            rep = run_bench(opts, {})
            self.log(f"bench: servers of {self.a.bench_size} launched: {', '.join(rep['configs'])}")
            return
        runs = self.state.setdefault("bench_runs", {})
        if (runs.get(self.bench_key) or {}).get("result", {}).get("failures"):
            # a failed phase runs again (as the others do), not its earlier failure replayed
            self.log("bench: the run of an earlier call with these options failed: measured anew")
            runs[self.bench_key] = {}
        st = runs.setdefault(self.bench_key, {})

        def progress(rep: dict[str, Any]) -> None:  # every finished unit is kept, even if this call is killed
            self.state.setdefault("bench_reports", {})[self.bench_key] = rep
            self.save()
            self.finish([])

        rep = run_bench(opts, st, progress)
        self.state.setdefault("bench_reports", {})[self.bench_key] = rep
        self.log("\n" + rep["table"])
        if rep.get("start_failures"):
            raise RuntimeError("a server did not start (the next call starts it again): "
                               + "; ".join(f.splitlines()[0] for f in rep["start_failures"]))
        if rep.get("skipped"):
            raise Deadline_(f"bench: skipped {rep['skipped']}")

    def phase_comm(self) -> None:
        st = self.resumable("comm")
        opts = comm_mod.CommOptions(model=self.models / "qwen3", out=self.logs, deadline=self.deadline,
                                    runs=tuple(self.a.comm_runs.split(",")))

        def progress(rep: dict[str, Any]) -> None:  # OUT is current after every server
            self.state["comm_report"] = rep
            self.save()
            self.finish([])

        rep = comm_mod.run_comm(opts, st, progress)
        self.state["comm_report"] = rep
        self.log("\n" + comm_mod.summarize(rep))
        if rep.get("skipped"):
            raise Deadline_(f"comm: skipped {rep['skipped']}")

    def phase_router(self) -> None:
        opts = router_mod.RouterOptions(
            models=self.models / "1b", out=self.logs / "router", deadline=self.deadline,
            threshold=self.a.router_threshold,
            levels=tuple(int(c) for c in self.a.router_levels.split(",")),
            kill_level=self.a.router_levels.count(",") if self.a.router_kill else -1)
        if self.deadline.left() < 420:  # three starts side by side, the router, the levels
            raise Deadline_(f"router: not started with {self.deadline.left():.0f}s left (~420 s needed)")
        rep = router_mod.run_router(opts)
        self.state["router_report"] = rep
        self.log("\n" + rep["summary"])

    # ------------------------------------------------------------------ driver
    def stale_site(self) -> str | None:
        """Why the selected phases would run on a site that no longer matches this tree (its bundle or
        series changed since the install, and this call does not install again), else None."""
        installed = self.state.get("install")
        if "install" in self.phases or not installed or not any(p in self.phases for p in RUN_PHASES):
            return None
        if not (self.a.bundle / "wheels.tar.xz").exists() or self.install_key() == installed:
            return None
        return (f"the site in {self.site} holds another bundle or patch series than this tree's "
                f"({self.a.bundle}, patches/{self.flavor}): add install,patch,check to --phases (or use --fresh)")

    def kill_leftover_servers(self) -> None:
        """Servers of an earlier call killed mid-run (setsid: they outlive it) still hold the port."""
        pidfile = self.state_dir / "servers.pid"
        if not pidfile.exists():
            return
        for line in pidfile.read_text().split():
            pgid = int(line)
            try:
                cmd = Path(f"/proc/{pgid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"sglang.launch_server" in cmd:
                self.log(f"killing the leftover server process group {pgid}")
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        pidfile.unlink()
        time.sleep(2)

    def stop_servers(self) -> int:
        """--stop: every server earlier calls left running (the bench's, and any smoke leftover)."""
        self.kill_leftover_servers()
        n = bench_servers.stop_recorded(self.bench_registry, say=self.log)
        self.log(f"stopped {n} bench server(s)")
        return 0

    def run(self) -> int:
        phases = self.phases
        self.env()
        if self.a.stop:
            return self.stop_servers()
        self.kill_leftover_servers()
        steps: dict[str, Callable[[], None]] = {
            "install": self.phase_install, "patch": self.phase_patch, "check": self.phase_check,
            "models": self.phase_models, "smoke": self.phase_smoke, "features": self.phase_features,
            "bench": self.phase_bench,
            "comm": self.phase_comm, "router": self.phase_router}
        stale = self.stale_site()
        if stale:
            self.log(f"FAILED: {stale}")
            return 1
        if any(ph in phases for ph in ("check", "models", *RUN_PHASES)):
            # before the install too: a call on the wrong torch otherwise installs, builds models
            # and fails in its first server's imports, minutes later
            try:
                self.check_host_stack()
            except RuntimeError as exc:
                self.log(f"FAILED: {exc}")
                return 1
        incomplete = []
        for ph in phases:
            done_key = (f"{ph}_done_" + (self.bench_key if ph == "bench" else self.options_digest(ph))
                        if ph in RUN_PHASES else "")
            if done_key and self.state.get(done_key):
                self.log(f"{ph}: done in an earlier call")
                continue
            self.log(f"== {ph} ({self.deadline.left():.0f}s left)")
            try:
                steps[ph]()
                launch_only = ph == "bench" and self.a.bench_launch_only  # nothing measured yet
                if done_key and not self.phase_failures(ph) and not launch_only:
                    self.state[done_key] = True  # a failed phase runs again on the next call
            except Deadline_ as exc:
                incomplete.append(str(exc))
                self.log(f"{ph}: stopped by the deadline: {exc}")
            except Exception as exc:  # noqa: BLE001 - one failing phase must not lose the others
                self.failures.append(f"{ph}: {exc}")
                self.log(f"{ph}: FAILED: {exc}\n{traceback.format_exc()[-1500:]}")
                if ph == "install":
                    break
            finally:
                self.save()
                self.finish(incomplete)  # OUT always holds the latest state, even if killed later
        self.finish(incomplete)
        self.bring_back_jit_cache()
        if incomplete:
            self.log("INCOMPLETE: run the same command again on the warm machine to resume: "
                     + "; ".join(incomplete))
            return 3
        failures = self.all_failures()
        self.log("RESULT: " + ("PASS" if not failures else "FAIL"))
        for f in failures:
            self.log("  FAILED " + f[:2000])
        return 1 if failures else 0

    def phase_failures(self, ph: str) -> list[Any]:
        """The failed checks a run phase's report holds (its report from this call)."""
        report = (self.state.get("bench_reports", {}).get(self.bench_key) if ph == "bench"
                  else self.state.get(f"{ph}_report"))
        return list((report or {}).get("failures", []))

    def all_failures(self) -> list[str]:
        """This call's phase failures + the checks' failures of every call (kept in the state)."""
        out = list(self.failures)
        smoke = self.state.get("smoke_report") or {}
        out += [f"smoke {f['variant']}: {f['cause']}" for f in smoke.get("failures", [])]
        feats = self.state.get("features_report") or {}
        out += [f"features {f['variant']} {f['case']} {f['mode']}: {f['cause']}"
                for f in feats.get("failures", [])]
        for key, bench in self.state.get("bench_reports", {}).items():
            out += [f"bench {key}: {f.splitlines()[0]}" for f in bench.get("failures", [])]
        out += [f"router: {f.splitlines()[0]}" for f in (self.state.get("router_report") or {}).get("failures", [])]
        comm = self.state.get("comm_report") or {}
        out += [f"{f['variant']}: {f['cause']}" for f in comm.get("failures", [])]
        return out

    def bring_back_jit_cache(self) -> None:
        """OUT/jit-cache.tar.xz when this call compiled kernels the bundle's cache lacks (copy it into
        the bundle folder for the next call: see bench.jitcache)."""
        jit = self.state_dir / "jit"
        now = jitcache.fingerprint(jit)
        if not self.state.get("install") or now == self.state.get("jit_fingerprint"):
            return
        if self.deadline.left() < 20:
            self.log("jit cache: not packed (the deadline is near)")
            return
        try:
            size, why = jitcache.pack(jit, self.out / jitcache.ARCHIVE, self.kernel_key())
        except Exception as exc:  # noqa: BLE001 - a convenience: it must not fail the run
            size, why = 0, f"{type(exc).__name__}: {exc}"
        if size:
            self.state["jit_fingerprint"] = now
            self.save()
            self.log(f"jit cache: {size / 2**20:.1f} MiB in OUT/{jitcache.ARCHIVE}; copy it into "
                     f"{self.a.bundle}/ so that the next fresh machine starts with these kernels compiled")
        else:
            self.log(f"jit cache: not packed ({why})")

    def finish(self, incomplete: list[str]) -> None:
        report: dict[str, Any] = {"elapsed_s": round(time.time() - self.t0, 1), "failures": self.all_failures(),
                  "incomplete": incomplete, "patches": self.state.get("patch"),
                  "smoke": self.state.get("smoke_report"),
                  "features": self.state.get("features_report"), "bench": self.state.get("bench_reports") or None,
                  "comm": self.state.get("comm_report"), "router": self.state.get("router_report")}
        (self.out / "report.json").write_text(json.dumps(report, indent=1))
        parts = []
        if report["smoke"]:
            parts.append(runner.summarize(report["smoke"]))
        if report["features"]:
            parts.append(features_mod.summarize(report["features"]))
        for key, bench in (report["bench"] or {}).items():
            parts.append(f"bench {key}:\n{bench['table']}")
        if report["comm"]:
            parts.append(comm_mod.summarize(report["comm"]))
        if report["router"]:
            parts.append(report["router"]["summary"])
        if report["failures"] or incomplete:
            parts.append("\n".join([f"FAILED {f[:300]}" for f in report["failures"]]
                                   + [f"INCOMPLETE {i}" for i in incomplete]))
        (self.out / "summary.txt").write_text("\n\n".join(parts) + "\n")
        buf = self.out / "logs.tar.gz"
        with tarfile.open(buf, "w:gz") as tar:
            for p in sorted(self.logs.rglob("*")):  # the benches' files in a folder per model size
                if p.is_file():
                    # keep each log's last 4 MiB: the whole bundle must stay under 16 MiB
                    data = p.read_bytes()[-4 * 2**20:]
                    ti = tarfile.TarInfo(str(p.relative_to(self.logs)))
                    ti.size = len(data)
                    tar.addfile(ti, io.BytesIO(data))
            for name in MODELS:
                e = self.models / name / "expected.json"
                if e.exists():
                    tar.add(e, arcname=f"expected_{name}.json")


class Deadline_(Exception):
    """A phase stopped before its end because the call's deadline was near."""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--bundle", type=Path, default=Path(".gpu"))
    ap.add_argument("--state", type=Path, default=Path("/tmp/smoke-state"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--deadline", type=float, default=560, help="seconds from the start")
    ap.add_argument("--phases", default="all", help=f"'all' or a comma list of {','.join(PHASES)}")
    ap.add_argument("--threshold", default=str(runner.DEFAULT_THRESHOLD),
                    help=f"smoke threshold N (default {runner.DEFAULT_THRESHOLD}), or auto (the smoke "
                         f"phase's servers run auto; the feature matrix keeps N={runner.DEFAULT_THRESHOLD})")
    ap.add_argument("--smoke-variants", default="overlap,sync", help="smoke phase: comma list of overlap,sync")
    ap.add_argument("--feature-variants", default="overlap,sync",
                    help="features phase: comma list of overlap,sync (CUDA graphs on in both)")
    ap.add_argument("--smoke-size", default="tiny", choices=[n for n, (_, used_by) in MODELS.items() if "smoke" in used_by],
                    help="smoke and features phases: the models (tiny, or the bench's 1B shape)")
    ap.add_argument("--feature-graph-bs", type=int, default=64,
                    help="features phase: decode CUDA graphs captured up to this batch "
                         f"(at most {features_mod.PRESSURE_REQUESTS})")
    ap.add_argument("--feature-cases", default=",".join(features_mod.CASE_NAMES),
                    help="features phase: comma list of the cases to run (default: all)")
    ap.add_argument("--parallel-variants", action="store_true",
                    help="smoke and features phases: the variants side by side, each server on a "
                         "port of its own (for a GPU with memory for two servers)")
    ap.add_argument("--bench-draft-accept", type=float, default=0.85,
                    help="chain draft of the 1B-shaped models: designed accept length ~3.2 (3 steps)")
    ap.add_argument("--bench-size", default="1b", choices=[n for n, (_, used_by) in MODELS.items() if "bench" in used_by],
                    help="bench model shape: 1b (host-bound at high load on a fast GPU) or 8b (GPU-bound)")
    add_tuning_arguments(ap, "bench-")
    ap.add_argument("--comm-runs", default=",".join(comm_mod.RUN_NAMES),
                    help="comm phase: comma list of runs, in this order")
    ap.add_argument("--router-threshold", type=int, default=16,
                    help="router phase: each server's threshold N (an integer)")
    ap.add_argument("--router-levels", default=",".join(map(str, router_mod.RouterOptions.levels)),
                    help="router phase: clients through the router, level after level (comma list)")
    ap.add_argument("--router-kill", action=argparse.BooleanOptionalAction, default=True,
                    help="router phase: kill the second server during the last level")
    ap.add_argument("--fresh", action="store_true", help="forget the state of earlier calls")
    ap.add_argument("--stop", action="store_true",
                    help="stop the servers earlier calls left running (the bench's outlive a call), and exit")


def smoke_threshold(text: str) -> tuple[bool, int]:
    """--threshold: (auto, N); with auto the loads (and the feature matrix) use the default N.
    ValueError names a bad value."""
    parsed = names.parse_threshold(text)
    auto = parsed == runner.AUTO
    return auto, runner.DEFAULT_THRESHOLD if auto else int(parsed)


def main(a: argparse.Namespace) -> int:
    if a.phases != "all":
        runner.comma_list(a.phases, PHASES, "--phases")
    runner.comma_list(a.smoke_variants, runner.VARIANTS, "--smoke-variants")
    runner.comma_list(a.feature_variants, features_mod.VARIANT_FLAGS, "--feature-variants")
    runner.comma_list(a.feature_cases, features_mod.CASE_NAMES, "--feature-cases")
    runner.comma_list(a.comm_runs, comm_mod.RUN_NAMES, "--comm-runs")
    try:
        _, threshold = smoke_threshold(a.threshold)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    phases = PHASES if a.phases == "all" else a.phases.split(",")
    if "features" in phases and not a.stop:  # auto: the matrix runs at the default N
        features_mod.check_threshold(threshold)
    if not 1 <= a.feature_graph_bs <= features_mod.PRESSURE_REQUESTS:
        raise SystemExit(f"--feature-graph-bs {a.feature_graph_bs}: give 1 to "
                         f"{features_mod.PRESSURE_REQUESTS} (the feature servers' running-request limit)")
    tuning_options(a, "bench-")  # exits naming a bad --bench-* value before any work
    try:
        levels = [int(c) for c in a.router_levels.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1 or a.router_threshold < 1:
        raise SystemExit(f"--router-levels {a.router_levels} --router-threshold {a.router_threshold}: "
                         "give client counts >= 1 as a comma list (e.g. 2,8,96) and a threshold >= 1")
    return E2E(a).run()
