"""The e2e driver's site phases: the bundle's wheels installed into STATE/site (install), the
patch series applied and the bundle's JIT cache unpacked (patch), the server's import chain
checked (check); the host's torch stack compared with the flavor's before any of them; the
environment that puts the site on every server's path; and the kernels a call compiled brought
back as OUT/jit-cache.tar.xz (bench.jitcache)."""
from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from bench import comm as comm_mod
from bench import jitcache
from bench.call import REPO, Call
from sglang_image_plugin.setting import THRESHOLD_FLAG
from smoke.server import SOURCE_PLUGIN_DIR

# state of the installed site, and prefixes of the results measured on it: a new site drops both
SITE_STATE = ("patch", "check")
RESULT_STATE = ("smoke", "features", "bench_", "comm", "router")


def _archive_problem(path: Path, meta: dict[str, object]) -> str | None:
    """How `path` differs from the archive bundle.json describes (size, then sha256); None: it
    does not, or bundle.json says nothing of it."""
    size, sha = meta.get("size"), meta.get("sha256")
    if isinstance(size, int) and path.stat().st_size != size:
        return f"is {path.stat().st_size:,} bytes, bundle.json says {size:,}"
    if isinstance(sha, str):
        have = hashlib.sha256(path.read_bytes()).hexdigest()
        if have != sha:
            return f"has sha256 {have[:16]}..., bundle.json says {sha[:16]}..."
    return None


def bundle_archive(bundle: Path) -> Path:
    """BUNDLE/wheels.tar.xz, checked against bundle.json; where it travelled in parts
    (wheels.tar.xz.part-NN), joined first. A whole archive that does not match while parts lie
    beside it (joined before every part had come) is joined again; parts that do not make the
    archive, or a copy cut short, stop the run naming what is missing."""
    whole = bundle / "wheels.tar.xz"
    meta_file = bundle / "bundle.json"
    meta: dict[str, object] = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    parts = sorted(bundle.glob("wheels.tar.xz.part-*"))
    if whole.is_file():
        problem = _archive_problem(whole, meta)
        if problem is None:
            return whole
        if not parts:
            raise SystemExit(f"{whole} {problem}: a copy cut short or of another bundle; copy .gpu/ "
                             "(or its parts) to this host again")
        whole.unlink()  # derived from the parts, which are kept: nothing is lost
    if not parts:
        raise SystemExit(f"{whole} is missing: build the bundle with nox -s gpu-e2e, then copy "
                         ".gpu/ (or its parts) to this host")
    suffixes = [p.name.rsplit("-", 1)[1] for p in parts]
    numbers = {int(x) for x in suffixes if x.isdigit()}
    gaps = sorted(set(range(max(numbers, default=-1) + 1)) - numbers)
    tmp = whole.with_suffix(".joining")
    with tmp.open("wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    problem = _archive_problem(tmp, meta)
    if gaps or problem:
        tmp.unlink()
        missing = f"part(s) {', '.join(f'{n:02d}' for n in gaps)} missing" if gaps else \
            f"joined, they {problem} (the last part missing or one cut short?)"
        raise SystemExit(f"{bundle}: the parts of wheels.tar.xz ({', '.join(suffixes)}) "
                         f"do not make the archive: {missing}; copy every part of .gpu/ to this host again")
    tmp.replace(whole)
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


class Site:
    """STATE/site, where the servers import from: made of the bundle's wheels, the plugin wheel
    beside them and the flavor's patch series (install_key)."""

    def __init__(self, call: Call):
        self.call, self.a = call, call.a
        self.path = call.site_dir
        self.host_stack_checked = False  # check_host_stack runs once a call

    def env(self) -> None:
        """Environment for every process this one starts (servers, the models' builder): the site,
        the folders its .pth files add and the stubs first on PYTHONPATH, after this tree's plugin/
        alone (the setting's contract is this tree's; the servers leave it off their path and load
        the site's plugin: smoke.server.sglang_env). This process imports from the site too (the
        grammar check's transformers and xgrammar; the metadata of the servers' sglang and plugin):
        bench.e2e.main starts it again with this environment (on_path)."""
        jit = self.call.state_dir / "jit"
        own = [str(self.path), *pth_paths(self.path), str(self.call.state_dir / "stubs")]
        given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in own]
        source = [p for p in given if Path(p).resolve() == SOURCE_PLUGIN_DIR]
        os.environ.update({
            "PYTHONPATH": os.pathsep.join(source + own + [p for p in given if p not in source]),
            "SMOKE_SERVER_PIDFILE": str(self.call.state_dir / "servers.pid"),
            "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "FLASHINFER_WORKSPACE_BASE": str(jit), "TVM_FFI_CACHE_DIR": str(jit / "tvm-ffi"),
            "TRITON_CACHE_DIR": str(jit / "triton"),
            "CUDA_HOME": os.environ.get("CUDA_HOME", "/usr/local/cuda"),
            **comm_mod.NO_MULTICAST_ENV,  # NVLink multicast off, as in bench.comm's runs
        })
        os.environ["PATH"] = f"{os.environ['CUDA_HOME']}/bin:{os.environ.get('PATH', '')}"

    def on_path(self) -> bool:
        """Whether this process started with the site on its path (its PYTHONPATH had it)."""
        return os.path.abspath(self.path) in {os.path.abspath(p) for p in sys.path if p}

    @functools.cached_property
    def flavor(self) -> str:
        """The flavor `nox -s gpu-e2e -- --flavor F` built the bundle for (BUNDLE/bundle.json): its
        series goes onto the bundle's wheels, never another's."""
        meta = self.a.bundle / "bundle.json"
        if not meta.is_file():
            raise SystemExit(f"{meta} is missing: build the bundle of the flavor with "
                             "nox -s gpu-e2e -- --flavor F and copy .gpu/ whole")
        return str(json.loads(meta.read_text())["flavor"])

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
        return jitcache.kernel_key(self.wheels_digest, self.call.state.get("patch") or [])

    def install(self) -> None:
        tarball = bundle_archive(self.a.bundle)
        key = self.install_key()
        if self.call.state.get("install") == key and (self.path / ".installed").exists():
            self.call.log("install: site already holds this bundle and series")
            return
        # a new bundle or a new series: start from a clean site (patches never applied twice)
        # ... and every result measured on the old site is stale
        for k in [k for k in self.call.state if k in SITE_STATE or k.startswith(RESULT_STATE)]:
            self.call.state.pop(k)
        shutil.rmtree(self.path, ignore_errors=True)
        stage = self.call.state_dir / "bundle"
        shutil.rmtree(stage, ignore_errors=True)
        with tarfile.open(tarball) as tar:
            for member in tar:
                if member.isfile():
                    jitcache.extract_file(tar, member, stage)
        wheels = sorted(str(p) for p in (stage / "wheels").glob("*.whl"))
        p = self.call.sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                          "--no-compile", "--disable-pip-version-check", "--target", str(self.path), *wheels],
                         "setup.log")
        if p.returncode != 0:
            raise RuntimeError(f"pip install failed: {p.stderr[-1500:]}")
        plugin = self.plugin_wheel()
        if plugin is not None:  # over any older copy an archive may hold
            p = self.call.sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                              "--no-compile", "--disable-pip-version-check", "--upgrade", "--target",
                              str(self.path), str(plugin)], "setup.log")
            if p.returncode != 0:
                raise RuntimeError(f"pip install of the plugin failed: {p.stderr[-1500:]}")
        dated = jitcache.age_site(self.path)  # FlashInfer's ninja builds then take the cached kernels
        shutil.rmtree(self.call.state_dir / "stubs", ignore_errors=True)
        shutil.copytree(stage / "stubs", self.call.state_dir / "stubs")
        shutil.rmtree(stage)
        (self.path / ".installed").write_text(key)
        self.call.state["install"] = key
        self.env()  # the new site's .pth folders on the path of every server from here on
        # this process had the site on its path before it existed: look at the path again
        importlib.invalidate_caches()
        self.call.log(f"install: {len(wheels)} wheels into {self.path} ({dated} files dated "
                      f"{time.strftime('%Y-%m-%d', time.gmtime(jitcache.SITE_MTIME))})")

    def patch(self) -> None:
        if self.call.state.get("patch"):
            self.call.log("patch: already applied to this site")
            return
        series_dir = REPO / "patches" / self.flavor
        manifest = self.call.state_dir / "patches.json"
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        p = self.call.sh([sys.executable, "-m", "sglang_image.patch", "apply", "--series-dir", str(series_dir),
                          "--site-packages", str(self.path), "--manifest", str(manifest)], "setup.log", env=env)
        self.call.log(p.stdout.strip() or p.stderr.strip()[-800:])
        if p.returncode != 0:
            raise RuntimeError(f"patch series did not apply: {p.stderr.strip()[-1500:]}")
        self.call.state["patch"] = json.loads(manifest.read_text()) if manifest.exists() else []
        shutil.copy(manifest, self.call.out / "patches.json") if manifest.exists() else None
        # kernels compiled by an earlier machine for these wheels and patches: the first server starts
        # ~1 min sooner (the key reads the manifest the apply just wrote)
        added, why = jitcache.seed(self.a.bundle / jitcache.ARCHIVE, self.call.state_dir / "jit", self.kernel_key())
        self.call.log(f"jit cache: {added} compiled files from {self.a.bundle / jitcache.ARCHIVE}" if added
                      else f"jit cache: none unpacked ({why})")
        self.call.state["jit_fingerprint"] = jitcache.fingerprint(self.call.state_dir / "jit")

    def check(self) -> None:
        if self.call.state.get("check"):
            self.call.log("check: done for this site")
            return
        self.check_host_stack()
        code = ("import importlib.metadata as md, torch, sys\n"
                "print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name(0))\n"
                "for p in ['sglang','sglang-kernel','flashinfer-python','transformers','tokenizers']:\n"
                "    print(' ', p, md.version(p))\n"
                "import sglang.srt.entrypoints.http_server\nprint('import chain OK')\n")
        p = self.call.sh([sys.executable, "-c", code], "setup.log")
        self.call.log(p.stdout.strip()[-800:])
        if p.returncode != 0:
            raise RuntimeError(f"the sglang import chain fails: {p.stderr.strip()[-1500:]}")
        h = self.call.sh([sys.executable, "-m", "sglang.launch_server", "--help"], "setup.log")
        if THRESHOLD_FLAG not in h.stdout:
            raise RuntimeError(f"`launch_server --help` does not show {THRESHOLD_FLAG} (patch not applied?)")
        self.call.state["check"] = True

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
        p = self.call.sh([sys.executable, "-c", code, json.dumps(sorted(expected))], "setup.log")
        found = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {}
        problems = host_stack_problems(expected, found)
        for line in problems:
            self.call.log(f"host stack: {line}")
        self.call.state["host_stack"] = {"expected": expected, "found": found, "problems": problems}
        refusal = torch_refusal(expected, found)
        if refusal:
            raise RuntimeError(refusal)

    def bring_back_jit_cache(self) -> None:
        """OUT/jit-cache.tar.xz when this call compiled kernels the bundle's cache lacks (copy it into
        the bundle folder for the next call: see bench.jitcache)."""
        jit = self.call.state_dir / "jit"
        now = jitcache.fingerprint(jit)
        if not self.call.state.get("install") or now == self.call.state.get("jit_fingerprint"):
            return
        if self.call.deadline.left() < 20:
            self.call.log("jit cache: not packed (the deadline is near)")
            return
        try:
            size, why = jitcache.pack(jit, self.call.out / jitcache.ARCHIVE, self.kernel_key())
        except Exception as exc:  # noqa: BLE001 - a convenience: it must not fail the run
            size, why = 0, f"{type(exc).__name__}: {exc}"
        if size:
            self.call.state["jit_fingerprint"] = now
            self.call.save()
            self.call.log(f"jit cache: {size / 2**20:.1f} MiB in OUT/{jitcache.ARCHIVE}; copy it into "
                          f"{self.a.bundle}/ so that the next fresh machine starts with these kernels compiled")
        else:
            self.call.log(f"jit cache: not packed ({why})")
