"""Command line behind the nox sessions: `python -m sglang_image COMMAND ...`.

noxfile.py stays a table of contents; each session calls one command here.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console

from sglang_image import (
    build,
    deploy,
    gpu,
    lock,
    patch,
    patchwork,
    pins,
    plugin,
    publish,
    smoke,
    trees,
)
from sglang_image.errors import SglangImageError

console = Console(highlight=False, soft_wrap=True)


def check_plugin_targets(flavor: pins.Flavor, tree: Path) -> list[str]:
    """Problems of the project's plugin against the flavor's unpacked upstream `tree` (empty: none).

    Flavors without the plugin have none. For the others: every hook target resolves in this tree
    and every upstream definition the plugin relies on is unchanged since its digest was recorded.
    """
    if not flavor.plugin:
        return []
    return plugin.check_hook_targets(tree, flavor.sglang_version)


def check_all_series(flavor_names: Sequence[str]) -> int:
    """Applies every flavor's series to its real, hash-checked wheels (one line per patch) and
    checks the plugin's hook targets for flavors that carry it."""
    failures = 0
    for name in flavor_names:
        flavor = pins.load_flavor(name)
        with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
            trees.prepare_tree(flavor, Path(tmp), patched=False)
            results = patch.apply_series(flavor.series(), Path(tmp), keep_going=True)
            plugin_problems = check_plugin_targets(flavor, Path(tmp))
        console.print(f"[bold]{name}[/]: {len(results)} patches on "
                      f"{', '.join(flavor.patch_targets)} (zero fuzz)")
        for r in results:
            if r.ok:
                console.print(f"  [green]applied[/] {r.name}  ({', '.join(r.files)})")
            else:
                failures += 1
                console.print(f"  [red]FAILED[/]  {r.message}")
        if flavor.plugin:
            for problem in plugin_problems:
                console.print(f"  [red]plugin[/]  {problem}")
            if not plugin_problems:
                console.print("  [green]plugin[/]  hook targets exist, relied-on upstream code unchanged")
            failures += len(plugin_problems)
    return 1 if failures else 0


def cmd_patches(args: argparse.Namespace) -> int:
    words = list(args.words)
    action = words.pop(0) if words and words[0] in ("check", "edit", "export", "rebase") else "check"
    args.flavors = words
    if action == "check":
        return check_all_series(args.flavors or pins.flavor_names())
    if action == "edit":
        flavor = pins.load_flavor(args.flavors[0] if args.flavors else None)
        repo = patchwork.edit(flavor)
        console.print(f"work tree: {repo}\n  one commit per patch after the tag 'upstream'; amend, "
                      f"add or reorder commits (git rebase -i upstream), then:\n"
                      f"  nox -s patches -- export {flavor.name}")
        return 0
    if action == "export":
        flavor = pins.load_flavor(args.flavors[0] if args.flavors else None)
        for e in patchwork.export(flavor):
            note = " (new: fill in its DEP-3 header)" if e.header_added else ""
            console.print(f"  {'written' if e.changed else 'same   '} {e.name}{note}")
        return check_all_series([flavor.name])
    if action == "rebase":
        if args.cont:
            repo = _rebase_in_progress(args.flavors)
            return _report_rebase(patchwork.rebase_continue(repo))
        if len(args.flavors) != 2:
            raise SystemExit("usage: nox -s patches -- rebase FROM_FLAVOR TO_FLAVOR "
                             "| rebase --continue [TO_FLAVOR]")
        source, target = (pins.load_flavor(n) for n in args.flavors)
        return _report_rebase(patchwork.rebase(source, target))
    raise SystemExit(f"unknown action {action!r}: check, edit, export or rebase")


def _rebase_in_progress(flavor_names: Sequence[str]) -> Path:
    if flavor_names:
        return patchwork.WORK_ROOT / pins.load_flavor(flavor_names[0]).name
    found = sorted(p.parents[1] for p in patchwork.WORK_ROOT.glob("*/.git/sglang-image-rebase.json"))
    if len(found) != 1:
        raise SystemExit(f"{len(found)} rebases in progress under {patchwork.WORK_ROOT}: "
                         "name the target flavor: nox -s patches -- rebase --continue FLAVOR")
    return found[0]


def _report_rebase(result: patchwork.RebaseResult) -> int:
    for o in result.outcomes:
        mark = "[green]carried[/]" if o.carried else "[red]stopped[/]"
        console.print(f"  {mark} {o.name}: {o.detail}")
    target = result.repo.name
    if result.stopped is not None:
        console.print(f"work tree: {result.repo}\n  {result.stopped.name} is applied there with "
                      f"conflict markers. Fix each file, `git add` (or `git rm`) it (to drop the "
                      f"patch: `git reset --hard HEAD`; export leaves out empty ones), then:\n"
                      f"  nox -s patches -- rebase --continue {target}")
        return 1
    console.print(f"work tree: {result.repo} (one commit per patch after 'upstream'). Check them, "
                  f"then: nox -s patches -- export {target}")
    return 0


def cmd_lock(args: argparse.Namespace) -> int:
    for name in args.flavors or pins.flavor_names():
        flavor = pins.load_flavor(name)
        path = lock.regenerate(flavor)
        entries = lock.read_lock(path)
        unverified = [e.requirement for e in entries if not e.verified]
        console.print(f"{name}: {len(entries)} packages -> {path.relative_to(pins.REPO_ROOT)}"
                      + (f" [yellow](incomplete: {', '.join(unverified)})[/]" if unverified else ""))
    return 0


# Stages with their own argument parsers (each its own `nox -s NAME -- --help`): everything after
# the command goes to them.
STAGE_COMMANDS: list[tuple[str, Callable[[list[str]], int], str]] = [
    ("build", build.main, "build a flavor's image through the Docker engine"),
    ("smoke", smoke.main, "smoke-test the built image (full with a GPU, PARTIAL without)"),
    ("publish", publish.main, "push the image, its SBOM and labels to a registry"),
    ("deploy", deploy.main, "write the Compose and Kubernetes manifests of a published image"),
    ("gpu-e2e", gpu.main, "build the GPU machine's wheel bundle and print the device command"),
    ("plugin-check", plugin.main, "check the plugin's hook targets against an unpacked sglang wheel"),
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_image")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("patches", help="check, edit, export or rebase the patch series",
                       prog="nox -s patches --")
    p.add_argument("words", nargs="*", metavar="[ACTION] FLAVOR",
                   help="check (default) [FLAVOR...] | edit FLAVOR | export FLAVOR | rebase FROM TO"
                        " | rebase --continue [TO]")
    p.add_argument("--continue", dest="cont", action="store_true",
                   help="rebase: resume after fixing the stopped patch's conflicts")
    p.set_defaults(func=cmd_patches)
    p = sub.add_parser("lock", help="regenerate the hash-pinned lock of flavors",
                       prog="nox -s lock --")
    p.add_argument("flavors", nargs="*", metavar="FLAVOR",
                   help=f"the flavors to lock (default: all: {', '.join(pins.flavor_names())})")
    p.set_defaults(func=cmd_lock)
    # Stages with their own argument parsers: everything after the command goes to them.
    # (Listed here for --help; dispatched before argparse, which would eat their options.)
    for command, _, help_text in STAGE_COMMANDS:
        sub.add_parser(command, help=help_text, add_help=False)
    argv = list(sys.argv[1:] if argv is None else argv)
    stages = {command: stage_main for command, stage_main, _ in STAGE_COMMANDS}
    if argv and argv[0] in stages:
        stage_main, rest = stages[argv[0]], argv[1:]
        args = argparse.Namespace(func=lambda _: stage_main(rest))
    else:
        args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except SglangImageError as exc:
        console.print(f"[red]error:[/] {exc}")
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
