"""`nox -s patches`: check, edit, export or rebase the flavors' patch series.

check (the default) applies each flavor's series to its real, hash-checked wheels with zero fuzz,
one line per patch, and checks the plugin against the wheel where the flavor carries it; edit,
export and rebase carry the series as git commits (patchwork.py) and say what to do next.
"""
from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from rich.console import Console

from sglang_image import patch, patchwork, pins, plugin_check, trees
from sglang_image.errors import UsageError
from sglang_image.pins import Flavor

Action = Literal["check", "edit", "export", "rebase"]
ACTIONS: tuple[Action, ...] = get_args(Action)
USAGE = ("check [FLAVOR...] | edit FLAVOR | export FLAVOR | rebase FROM TO | rebase --continue "
         "[TO]")

console = Console(highlight=False, soft_wrap=True)


@dataclass(frozen=True, kw_only=True)
class PatchesOptions:
    """What `nox -s patches` was asked for: the action and the flavors it names after it (the
    target flavor is run's `flavor`); checked when made."""

    action: Action = "check"
    flavors: tuple[Flavor, ...] = ()  # check: those to check (none: every flavor); rebase: FROM
    resume: bool = False  # rebase --continue: after the stopped patch's conflicts are fixed

    def __post_init__(self) -> None:
        if self.resume and self.action != "rebase":
            raise UsageError(f"--continue goes with rebase, not {self.action}: nox -s patches -- "
                             "rebase --continue [TO_FLAVOR]")


def from_words(words: Sequence[str], resume: bool) -> tuple[Flavor | None, PatchesOptions]:
    """`[ACTION] FLAVOR...` as typed: the flavor to act on (None: check's every flavor, or the
    rebase in progress) and the options, or a UsageError naming the usage."""
    rest = list(words)
    action: Action = next((a for a in ACTIONS if rest and rest[0] == a), "check")
    if rest and rest[0] == action:
        rest.pop(0)
    flavors = tuple(pins.load_flavor(n) for n in rest)
    if action == "check":
        return None, PatchesOptions(flavors=flavors, resume=resume)
    rebase_from_to = action == "rebase" and not resume
    if len(flavors) not in ((2,) if rebase_from_to else (0, 1)):
        raise UsageError(f"usage: nox -s patches -- {USAGE}")
    if rebase_from_to:
        return flavors[1], PatchesOptions(action=action, flavors=flavors[:1])
    if action == "rebase":  # --continue: the target named, or the one rebase in progress
        return (flavors[0] if flavors else None), PatchesOptions(action=action, resume=True)
    # edit and export: the flavor named, or the default one
    return (flavors[0] if flavors else pins.load_flavor()), PatchesOptions(action=action,
                                                                        resume=resume)


def check_series(flavors: Sequence[Flavor]) -> int:
    """Applies every flavor's series to its real, hash-checked wheels (one line per patch) and
    checks the plugin's hook targets for flavors that carry it; 1 when anything failed."""
    failures = 0
    for flavor in flavors:
        with tempfile.TemporaryDirectory(prefix=f"{flavor.name}-") as tmp:
            trees.prepare_tree(flavor, Path(tmp), patched=False)
            results = patch.apply_series(flavor.series(), Path(tmp), keep_going=True)
            plugin_problems = plugin_check.check_flavor(flavor, Path(tmp))
        console.print(f"[bold]{flavor.name}[/]: {len(results)} patches on "
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


def _rebase_in_progress(flavor: Flavor | None) -> Path:
    if flavor is not None:
        return patchwork.WORK_ROOT / flavor.name
    found = sorted(p.parents[1] for p in patchwork.WORK_ROOT.glob("*/.git/sglang-image-rebase.json"))
    if len(found) != 1:
        raise UsageError(f"{len(found)} rebases in progress under {patchwork.WORK_ROOT}: "
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


def run(flavor: Flavor | None, options: PatchesOptions) -> int:
    """`nox -s patches`: the action on `flavor` (check: None, every flavor or options.flavors;
    rebase: the target, from options.flavors[0]; rebase --continue: None, the one in progress)."""
    if options.action == "check":
        return check_series(options.flavors or [pins.load_flavor(n) for n in pins.flavor_names()])
    if options.action == "rebase" and options.resume:
        return _report_rebase(patchwork.rebase_continue(_rebase_in_progress(flavor)))
    assert flavor is not None  # from_words gives edit, export and rebase their flavor
    if options.action == "edit":
        repo = patchwork.edit(flavor)
        console.print(f"work tree: {repo}\n  one commit per patch after the tag 'upstream'; amend, "
                      f"add or reorder commits (git rebase -i upstream), then:\n"
                      f"  nox -s patches -- export {flavor.name}")
        return 0
    if options.action == "export":
        for e in patchwork.export(flavor):
            note = " (new: fill in its DEP-3 header)" if e.header_added else ""
            console.print(f"  {'written' if e.changed else 'same   '} {e.name}{note}")
        return check_series([flavor])
    return _report_rebase(patchwork.rebase(options.flavors[0], flavor))
