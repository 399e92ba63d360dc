"""Every command line of the project: `python -m sglang_image COMMAND ...`, behind the nox sessions.

noxfile.py stays a table of contents; each session calls one command here. This module owns every
parser (one sub-command per session, each with its usage in nox terms). `add_flavor` turns
`--flavor` into a loaded, checked `pins.Flavor` while the arguments are parsed; the command then
makes the stage's options (each checks itself when made, before any work) and calls the stage's
`run(flavor, options)`. A stage raises an SglangImageError when it fails: only `main` catches it,
prints it and returns its exit code; `main_inner` lets it through (for tests).

The one parser elsewhere is `python -m sglang_image.patch`, the stdlib-only applier that runs
inside the image, where the dependencies of this module are not.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from sglang_image import (
    base,
    build,
    deploy,
    docker_engine,
    gpu,
    image_smoke,
    imageref,
    lock,
    patch_series,
    pins,
    plugin_check,
    publish,
    smoke_schedule,
    threshold,
    topology,
)
from sglang_image.errors import PARTIAL_EXIT_CODE, SglangImageError, exit_code_table
from sglang_image.plan import IMAGE_REPO, BuildOptions
from sglang_image_plugin.setting import DEPTH_SCHEDULE_FLAG, THRESHOLD_FLAG

error_console = Console(stderr=True, highlight=False, soft_wrap=True)


# --- --flavor, in one place -------------------------------------------------------------------

def add_flavor(parser: argparse.ArgumentParser, what: str, *,
               default_help: str | None = None) -> None:
    """`--flavor FLAVOR`, parsed into a loaded `pins.Flavor` (args.flavor): an unknown or malformed
    flavor stops the parse with PinError (exit 12). Absent, it is the default flavor; with
    `default_help`, None instead (the command finds it elsewhere, as that text says)."""
    names = pins.flavor_names()
    if default_help is None:
        listing = ", ".join(f"{n} (default)" if n == pins.DEFAULT_FLAVOR else n for n in names)
        parser.add_argument("--flavor", type=pins.load_flavor, default=pins.DEFAULT_FLAVOR,
                            metavar="FLAVOR", help=f"{what}: {listing}")
    else:
        parser.add_argument("--flavor", type=pins.load_flavor, default=None, metavar="FLAVOR",
                            help=f"{what}: {', '.join(names)} (default: {default_help})")


def _stage_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], command: str,
                  help_text: str, description: str | None = None) -> argparse.ArgumentParser:
    return sub.add_parser(command, help=help_text, prog=f"nox -s {command} --",
                          description=description or help_text, epilog=exit_code_table(),
                          formatter_class=argparse.RawDescriptionHelpFormatter)


# --- build --------------------------------------------------------------------------------------

def _add_build(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _stage_parser(sub, "build", "build a flavor's image through the Docker engine",
                      "Build the image of a flavor from its pinned, hash-checked wheels, networking "
                      "off, through the Docker engine (where none answers, it starts the project's "
                      "own and says how to stop it).")
    add_flavor(p, "the SGLang release and its pinned stack")
    p.add_argument("--tag", help="the image's tag (default: sglang-image:VERSION-FLAVOR)")
    p.add_argument("--base", metavar="IMAGE",
                   help="build on this image instead of the flavor's pinned base, e.g. the tag nox "
                        "-s base printed (default: the flavor's base, pulled by digest when the "
                        "engine lacks it)")
    p.add_argument("--no-cache", action="store_true",
                   help="rebuild everything: neither reuse an image built from the same inputs nor "
                        "the engine's build cache (default: reuse them)")
    # SGLang and the patches without the heavy dependencies: seconds and megabytes, not a working
    # server; for the tests only.
    p.add_argument("--light", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=lambda a: build.run(a.flavor, BuildOptions(
        tag=a.tag, base=a.base, no_cache=a.no_cache, light=a.light)))


# --- base ---------------------------------------------------------------------------------------

def _add_base(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _stage_parser(sub, "base", "make a base image from Debian packages (no image hub needed)",
                      (base.__doc__ or "").split("\n\n")[0])
    add_flavor(p, "whose Python goes into the base")
    p.add_argument("--tag", help="default: localhost/sglang-image-base:<suite>-py<X.Y>")
    p.add_argument("--suite", default=base.DEFAULT_SUITE,
                   help=f"Debian release (debootstrap; default: {base.DEFAULT_SUITE})")
    p.add_argument("--python-prefix", type=Path,
                   help="a CPython installation to copy (default: found on this host)")
    p.add_argument("--fresh", action="store_true",
                   help=f"run debootstrap again instead of reusing {base.ROOTFS_CACHE}")
    p.set_defaults(func=lambda a: base.run(a.flavor, base.BaseOptions(
        tag=a.tag, suite=a.suite, python_prefix=a.python_prefix, fresh=a.fresh)))


# --- engine -------------------------------------------------------------------------------------

def _add_engine(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    state = docker_engine.DEFAULT_STATE
    p = _stage_parser(sub, "engine", "start the project's own Docker engine, or stop it",
                      "Start the project's own Docker engine (Debian's dockerd, state under "
                      f"{state}) where none answers, or stop it.")
    p.add_argument("action", nargs="?", choices=("start", "stop"), default="start",
                   help="start (default): start dockerd in the background unless an engine "
                        "answers, and print the DOCKER_HOST to export; stop: stop the one started "
                        "here and remove what it left in /tmp")
    p.add_argument("--state", type=Path, default=state,
                   help=f"the engine's data, socket and log (default: {state})")
    p.set_defaults(func=lambda a: docker_engine.run(None, docker_engine.EngineOptions(
        action=a.action, state=a.state)))


# --- smoke --------------------------------------------------------------------------------------

def _add_smoke(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _stage_parser(sub, "smoke", "smoke-test the built image (full with a GPU, PARTIAL without)",
                      image_smoke.__doc__)
    p.add_argument("image_pos", nargs="?", metavar="IMAGE", help="the image to test (or --image)")
    p.add_argument("--image", default=None,
                   help="the image to test (default: the tag nox -s build gives the flavor, "
                        "sglang-image:VERSION-FLAVOR)")
    add_flavor(p, "the flavor whose patch series the image must carry",
               default_help="the one the image was built for; without an image: "
                            f"{pins.DEFAULT_FLAVOR}")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gpu", dest="gpu", action="store_true", default=None,
                   help="run the full smoke on the GPUs (default: when nvidia-smi lists a GPU)")
    g.add_argument("--no-gpu", dest="gpu", action="store_false",
                   help="run only the PARTIAL check, even on a GPU host")
    p.add_argument("--out", type=Path, default=None,
                   help="where logs and reports go (default: out/smoke)")
    p.add_argument("--threshold", type=threshold.parse, default=None,
                   help=f"the EAGLE-3 servers' {THRESHOLD_FLAG}: N running requests, or auto "
                        "where the flavor has it (default: the smoke's own small N, which the "
                        "tiny model's load crosses both ways); the feature matrix takes N of 2 to "
                        f"{image_smoke.MATRIX_MAX_THRESHOLD}")
    p.add_argument(smoke_schedule.OPTION, type=smoke_schedule.parse, default=None,
                   metavar="LOW-HIGH:DEPTH,...",
                   help=f"instead of --threshold: the EAGLE-3 servers' {DEPTH_SCHEDULE_FLAG}, a draft "
                        f"depth per load, e.g. {smoke_schedule.EXAMPLE} (the servers launch with "
                        f"--speculative-num-steps {smoke_schedule.SMOKE_STEPS}, or the deepest tier's "
                        "depth where that is deeper; flavors with the plugin; the top edge at most "
                        f"{image_smoke.MATRIX_MAX_THRESHOLD}); the smoke and the feature matrix run in "
                        "and across every tier (default: none, the threshold)")
    p.add_argument("--accept-partial", action="store_true",
                   help=f"exit 0 when the PARTIAL check passes (default: exit "
                        f"{PARTIAL_EXIT_CODE})")
    p.add_argument("--records", type=Path, default=None,
                   help="where passed smokes are recorded (default: out/smoke-records)")
    p.set_defaults(func=lambda a: image_smoke.run(a.flavor, image_smoke.ImageSmokeOptions(
        image=a.image or a.image_pos, gpu=a.gpu, out_dir=a.out, threshold=a.threshold,
        schedule=a.schedule, accept_partial=a.accept_partial, records=a.records)))


# --- publish ------------------------------------------------------------------------------------

def _add_publish(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _stage_parser(sub, "publish", "push the image, its SBOM and labels to a registry",
                      (publish.__doc__ or "").split("\n\n")[0])
    p.epilog = ("Fetch a published SBOM back: nox -s publish -- --fetch-sbom "
                "REGISTRY/NAMESPACE/sglang-image@sha256:... [--out sbom.cdx.json]\n\n"
                + exit_code_table())
    p.add_argument("--registry", type=publish.parse_registry, metavar="HOST[:PORT]/NAMESPACE",
                   help="e.g. registry.example.com/team (credentials: `docker login HOST[:PORT]` "
                        "first)")
    add_flavor(p, "whose image to publish (the tag nox -s build gives it)")
    p.add_argument("--image", help="local image; default: the build's tag of the flavor")
    p.add_argument("--allow-partial-smoke", action="store_true",
                   help="publish an image that passed only the PARTIAL (no GPU) smoke")
    p.add_argument("--verify-host", help="DOCKER_HOST of a second engine to pull the image back "
                                         "through (default: a temporary engine with a fresh data "
                                         "root)")
    p.add_argument("--smoke-records", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--fetch-sbom", metavar="REFERENCE",
                   help="fetch the SBOM of REGISTRY/REPOSITORY@sha256:... and exit")
    p.add_argument("--out", type=Path, default=Path(publish.SBOM_TITLE), help="for --fetch-sbom")
    p.add_argument("--deploy-out", type=Path, default=deploy.DEFAULT_OUT,
                   help="where the Compose and Kubernetes manifests of the pushed digest go "
                        "(settings: deploy/serve.toml; default: out/deploy)")
    p.add_argument("--no-deploy", action="store_true",
                   help="write no manifests (nox -s deploy writes them later)")
    p.set_defaults(func=_publish)


def _publish(a: argparse.Namespace) -> int:
    return publish.run(a.flavor, publish.PublishOptions(
        target=a.registry, image=a.image, allow_partial_smoke=a.allow_partial_smoke,
        verify_host=a.verify_host, smoke_records=a.smoke_records,
        deploy_out=None if a.no_deploy else a.deploy_out, fetch_sbom=a.fetch_sbom,
        sbom_out=a.out))


# --- deploy -------------------------------------------------------------------------------------

def _add_deploy(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _stage_parser(sub, "deploy", "write the Compose and Kubernetes manifests of a published image",
                      (deploy.__doc__ or "").split("\n\n")[0])
    p.add_argument("--digest", type=imageref.parse_digest,
                   help="the image's digest, sha256:... (what `nox -s publish` printed)")
    p.add_argument("--registry", type=lambda text: imageref.parse_registry(text, IMAGE_REPO),
                   metavar="HOST[:PORT]/NAMESPACE", help="where it was published")
    p.add_argument("--out", type=Path, default=None,
                   help=f"where to write (default: {deploy.DEFAULT_OUT.relative_to(pins.REPO_ROOT)}"
                        "; a folder of an earlier rendering is replaced)")
    p.add_argument("--settings", type=Path, default=deploy.SETTINGS,
                   help="the settings file (default: deploy/serve.toml)")
    add_flavor(p, "the image's flavor, where known (`--threshold auto` is refused for one without "
                  "it)", default_help="none, the threshold is not checked against a flavor")
    p.add_argument("--topology", action="append", choices=topology.TOPOLOGIES,
                   help="render only this topology (repeat for more; default: those of the "
                        "settings file)")
    for name, (kind, text) in deploy.OPTIONS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=text)
    p.add_argument("--server-arg", action="append", dest="server_args", metavar="ARG",
                   help="one more SGLang server flag for every server, e.g. "
                        "--server-arg=--mem-fraction-static=0.85 (repeat for more)")
    # maintainers: deploy/example, for an example image (MAINTAINING.md)
    p.add_argument("--example", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=_deploy)


def _deploy(a: argparse.Namespace) -> int:
    overrides = {name: getattr(a, name) for name in (*deploy.OPTIONS, "server_args")}
    overrides["topologies"] = a.topology
    image = a.registry.by_digest(a.digest) if a.registry and a.digest else None
    return deploy.run(a.flavor, deploy.DeployOptions(
        image=image, out=a.out, settings=a.settings, overrides=overrides, example=a.example))


# --- gpu-e2e ------------------------------------------------------------------------------------

def _add_gpu_e2e(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _stage_parser(sub, "gpu-e2e",
                      "build the GPU machine's wheel bundle and print the device command",
                      gpu.__doc__)
    add_flavor(p, "the flavor whose wheels, series and plugin to bundle")
    p.add_argument("--skip-build", action="store_true",
                   help="only print the command to run on the GPU host (default: build first)")
    p.add_argument("--force", action="store_true",
                   help="rebuild the archive even if it is current (default: reuse it)")
    p.add_argument("--host-provides", default="", metavar="DIST,...",
                   help="distributions of the lock the GPU host already has at the lock's version "
                        "(e.g. nvidia-cutlass-dsl brought with its torch stack): left out of the "
                        "bundle, and checked on the host before any server starts (default: none)")
    p.add_argument("--part-mib", type=int, default=0, metavar="N",
                   help="also write the archive in parts of at most N MiB (wheels.tar.xz.part-NN) "
                        "for a copy of limited size; the host joins them (default: 0, no parts)")
    p.add_argument("--xz-level", type=int, default=6, choices=range(10), metavar="0-9",
                   help="xz level of the archive: 1 packs several times faster on a small or busy "
                        "machine, some 20%% larger (default: 6)")
    p.set_defaults(func=lambda a: gpu.run(a.flavor, gpu.BundleOptions(
        skip_build=a.skip_build, force=a.force,
        host_provides=tuple(n.strip() for n in a.host_provides.split(",") if n.strip()),
        part_mib=a.part_mib, xz_level=a.xz_level)))


# --- plugin-check -------------------------------------------------------------------------------

def _add_plugin_check(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _stage_parser(sub, "plugin-check",
                      "check the plugin's hook targets against an unpacked sglang wheel",
                      (plugin_check.__doc__ or "").split("\n\n")[0])
    p.add_argument("--site-packages", type=Path, required=True,
                   help="an unpacked sglang wheel (the directory holding sglang/)")
    add_flavor(p, "the flavor whose sglang release the wheel is",
               default_help="the release the wheel's dist-info names")
    p.add_argument("--sglang-version", help="default: the flavor's, else read from its dist-info")
    p.add_argument("--record", action="store_true",
                   help="after review: record this release's digests of the relied-on code")
    p.set_defaults(func=lambda a: plugin_check.run(a.flavor, plugin_check.PluginCheckOptions(
        site_packages=a.site_packages, sglang_version=a.sglang_version, record=a.record)))


# --- patches ------------------------------------------------------------------------------------

def _add_patches(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _stage_parser(sub, "patches", "check, edit, export or rebase the patch series",
                      (patch_series.__doc__ or "").split("\n\n")[0])
    p.add_argument("words", nargs="*", metavar="[ACTION] FLAVOR",
                   help=f"{patch_series.USAGE} (default: check every flavor)")
    p.add_argument("--continue", dest="cont", action="store_true",
                   help="rebase: resume after fixing the stopped patch's conflicts")
    p.set_defaults(func=lambda a: patch_series.run(*patch_series.from_words(a.words, a.cont)))


# --- lock ---------------------------------------------------------------------------------------

def _add_lock(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _stage_parser(sub, "lock", "regenerate the hash-pinned lock of flavors")
    p.add_argument("flavors", nargs="*", metavar="FLAVOR", type=pins.load_flavor,
                   help=f"the flavors to lock (default: all: {', '.join(pins.flavor_names())})")
    p.set_defaults(func=lambda a: max(
        lock.run(f, lock.LockOptions())
        for f in (a.flavors or [pins.load_flavor(n) for n in pins.flavor_names()])))


# --- the command line -----------------------------------------------------------------------------

COMMANDS: tuple[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None], ...] = (
    _add_build, _add_base, _add_engine, _add_smoke, _add_publish, _add_deploy, _add_gpu_e2e,
    _add_plugin_check, _add_patches, _add_lock,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang_image", epilog=exit_code_table(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main_inner(argv: Sequence[str] | None = None) -> int:
    """Parses (a bad --flavor raises here), runs the command; its errors pass through."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return int(args.func(args))


def main(argv: Sequence[str] | None = None) -> int:
    """main_inner, with an SglangImageError printed and turned into its exit code."""
    try:
        return main_inner(argv)
    except SglangImageError as exc:
        error_console.print(f"[bold red]error:[/] {escape(str(exc))}")
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
