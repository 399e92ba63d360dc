"""What each benchmarked server is, as data: the bench starts it from its record, the report labels
and groups it by its record, and bench.json keeps the records (nothing decodes a server's name).

`plain_twin` and `eagle3_twin` are A/A twins (TWINS): a second server identical to plain or to
always-on EAGLE-3, whose ratio to it within a block is the noise floor of the procedure there.

A config named on the command line becomes one record, or one per value of a sweep: `eagle3_thr`
one per --threshold N, `eagle3_depth` one per --depth d (always-on EAGLE-3 drafting d steps and
verifying d + 1 tokens a request; `eagle3` is the launch depth, 3), `eagle3_sched` one per
--schedule (the plugin's draft depth per load; launched at the deeper of the launch depth and the
schedule's deepest tier, smoke.server.launch_steps). `eagle3_extend_verify` is `eagle3` started with
upstream's split-KV verify kernel switched off (SGLANG_ENABLE_SPLITKV_VERIFY=0): EAGLE's
target-verify attention then runs the Triton backend's prefill "extend" kernel, the path before
the plugin's change, so the two compare in the same blocks. `eagle3_headwise_verify` is `eagle3`
with the split-KV verify's prefix stage back on upstream's own, one program a query head
(SGLANG_IMAGE_GROUPED_VERIFY=0), where the plugin's reads each KV head once for its query heads.
`eagle3_upstream_combine` is `eagle3` with the split-KV verify's second stage upstream's, not the
plugin's running sums over the splits and the chain (SGLANG_IMAGE_LOOPED_COMBINE=0);
`eagle3_sched_upstream_combine` is `eagle3_sched` with it: with --server-env
SGLANG_IMAGE_LOOPED_COMBINE=1 on the others (a record's own value wins), a deeper tier's wider
verify is measured with either combine in the same blocks. `eagle3_splits_by_load` is `eagle3` with the
grouped prefix stage cutting a prefix by the batch's size (SGLANG_IMAGE_VERIFY_SPLITS_BY_LOAD=1,
opt-in), not into the graph's 16 splits.
`eagle3_thr_prefill_graphs` is
`eagle3_thr` whose prefills in plain mode write the draft's K/V from the plugin's CUDA graphs
(SGLANG_IMAGE_PREFILL_KV_GRAPHS=1), not eagerly: the two side by side. `eagle3_metadata_glue` is
`eagle3` with upstream's experimental metadata glue graph on (SGLANG_ENABLE_METADATA_GLUE_GRAPH=1):
the target runner's out-of-graph attention metadata, captured per batch size where a batch needs no
padding, so that the host's share of a speculative step can be compared in the same blocks.

A config ending in `_prefill_delayer` (`plain_prefill_delayer`, `eagle3_prefill_delayer`,
`eagle3_sched_prefill_delayer`) is its base started with upstream's prefill delayer on its queue
trigger (PREFILL_DELAYER): a prefill waits, a bounded number of passes, until the waiting queue
holds an eighth of the running requests (`--delayer-ratio`: another share, the same for every such
config of a call; at 1/16 it waits only from 32 running requests up). A closed loop of short
prompts refills each ended request with a prefill of its own, and a prefill of a few tokens costs
a whole forward of the target (its weights read once): the same per output token in every mode,
but a larger share of the time of a server that decodes faster. With the delayer beside the same server without it, that share is
measured in the same blocks. The delayer needs the overlap scheduler (upstream asserts it).
"""
from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from sglang_image_plugin.setting import (
    GROUPED_VERIFY_ENV,
    LOOPED_COMBINE_ENV,
    PREFILL_KV_GRAPHS_ENV,
    SPLITS_BY_LOAD_ENV,
)
from smoke.server import EAGLE_STEPS, launch_steps

LAUNCH_STEPS = EAGLE_STEPS  # what `eagle3` and the switching servers draft
CONFIGS = ("plain", "plain_twin", "eagle3", "eagle3_twin", "eagle3_extend_verify", "eagle3_headwise_verify",
           "eagle3_metadata_glue", "eagle3_upstream_combine", "eagle3_splits_by_load", "eagle3_depth",
           "eagle3_adaptive", "eagle3_thr", "eagle3_thr_prefill_graphs", "eagle3_sched",
           "eagle3_sched_upstream_combine", "eagle3_auto", "plain_prefill_delayer", "eagle3_prefill_delayer",
           "eagle3_sched_prefill_delayer")
TWIN = "plain_twin"  # the A/A config: a second plain server
# each A/A config and the server it repeats: its ratio to that server within a block is the noise of
# the procedure at that server's load (where EAGLE-3 is the better mode a server is read against it;
# its twin fits one card beside EAGLE-3 and one more server, where plain's needs a fourth)
TWINS = {TWIN: "plain", "eagle3_twin": "eagle3"}
EXTEND_VERIFY = ("SGLANG_ENABLE_SPLITKV_VERIFY", "0")  # upstream's switch off: verify on the extend kernel
HEADWISE_VERIFY = (GROUPED_VERIFY_ENV, "0")  # the split-KV verify's prefix stage upstream's, per query head
PREFILL_GRAPHS = (PREFILL_KV_GRAPHS_ENV, "1")  # the plugin's prefill K/V graphs on
UPSTREAM_COMBINE = (LOOPED_COMBINE_ENV, "0")  # the split-KV verify's combine upstream's, not the plugin's
SPLITS_BY_LOAD = (SPLITS_BY_LOAD_ENV, "1")  # the verify's prefix cut by the batch's size
METADATA_GLUE = ("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "1")  # upstream's metadata glue graph on
# always-on EAGLE-3 started with one variable set: its config's name and that (variable, value)
EAGLE3_WITH = {"eagle3_extend_verify": EXTEND_VERIFY, "eagle3_headwise_verify": HEADWISE_VERIFY,
               "eagle3_metadata_glue": METADATA_GLUE, "eagle3_upstream_combine": UPSTREAM_COMBINE,
               "eagle3_splits_by_load": SPLITS_BY_LOAD}
# upstream's prefill delayer, queue trigger: hold a prefill while fewer than running / 8 requests
# wait (at most its 30 passes, 5 s): the successors of requests that end one by one prefill together
DELAYER_RATIO = 0.125  # the queue trigger's share of the running requests (upstream's typical 0.1-0.5)
DELAYER_PASSES = 30  # upstream's cap on the scheduler passes one prefill may be held (its default)


def prefill_delayer(ratio: float = DELAYER_RATIO, max_passes: int = DELAYER_PASSES) -> tuple[str, ...]:
    """Upstream's prefill delayer on its queue trigger: a prefill waits until running x ratio wait,
    for at most `max_passes` scheduler passes (named only where not upstream's default)."""
    flags = ("--enable-prefill-delayer", "--prefill-delayer-queue-min-ratio", f"{ratio:g}")
    return flags if max_passes == DELAYER_PASSES else (*flags, "--prefill-delayer-max-delay-passes", str(max_passes))


PREFILL_DELAYER = prefill_delayer()
# a config started with flags of its own: its name and (the config it is, the flags); a sweep's
# records each get them (eagle3_sched1_prefill_delayer, ...)
WITH_FLAGS = {"plain_prefill_delayer": ("plain", PREFILL_DELAYER),
              "eagle3_prefill_delayer": ("eagle3", PREFILL_DELAYER),
              "eagle3_sched_prefill_delayer": ("eagle3_sched", PREFILL_DELAYER)}
FLAG_NOTES: dict[tuple[str, ...], str] = {PREFILL_DELAYER: "prefill delayer"}
# what a server's environment changes, in its label; any other variable is named as it is
ENV_NOTES = {EXTEND_VERIFY: "extend-kernel verify", HEADWISE_VERIFY: "per-head verify prefix",
             PREFILL_GRAPHS: "prefill K/V graphs",
             METADATA_GLUE: "metadata glue graph", UPSTREAM_COMBINE: "upstream combine",
             SPLITS_BY_LOAD: "splits by load"}


def flags_note(args: tuple[str, ...]) -> str:
    """A server's own flags in its label: the delayer by name (its ratio and its cap where not the
    defaults)."""
    if args in FLAG_NOTES:
        return FLAG_NOTES[args]
    if args[:2] == PREFILL_DELAYER[:2] and len(args) in (3, 5):
        note = "prefill delayer" + ("" if args[2] == PREFILL_DELAYER[2] else f", queue ratio {args[2]}")
        return note + (f", at most {args[4]} passes" if len(args) == 5 else "")
    return shlex.join(args)


@dataclass(frozen=True)
class BenchConfig:
    """One server of the bench. `kind`: plain (no draft), fixed (EAGLE-3 always on, `steps` deep),
    threshold (the plugin's fixed threshold), schedule (its depth per load), auto (its learned
    threshold), adaptive (upstream's own)."""

    name: str
    kind: str
    steps: int = 0  # draft steps a speculative step runs (0: plain)
    threshold: int | None = None
    schedule: str | None = None  # the depth schedule (LOW-HIGH:DEPTH,...)
    twin: bool = False  # an A/A twin: a second server identical to its kind's stock one (TWINS)
    env: tuple[tuple[str, str], ...] = ()  # (variable, value) pairs the server is started with
    args: tuple[str, ...] = ()  # server flags of its own, after the bench's (WITH_FLAGS)

    @property
    def draft(self) -> bool:
        return self.steps > 0

    @property
    def switches(self) -> bool:
        """It switches between speculative and plain steps itself (a threshold, auto)."""
        return self.kind in ("threshold", "schedule", "auto")

    @property
    def learns(self) -> bool:
        """It learns its policy online (the threshold's `auto`, the schedule's `auto`): the bench
        gives it a learning pass at every concurrency before the blocks, and keeps its step trace."""
        return self.kind == "auto" or (self.kind == "schedule" and self.schedule == "auto")

    @property
    def variant(self) -> bool:
        """Started with an environment or flags of its own: another build of its kind's server."""
        return bool(self.env or self.args)

    @property
    def one_depth(self) -> int | None:
        """The draft depth it runs at every load: plain 0 (not the twin), always-on EAGLE-3 its
        steps (not a variant: a variant is not a depth; not a twin: its server is one); else None."""
        if self.variant or self.twin:
            return None
        if self.kind == "plain":
            return 0
        return self.steps if self.kind == "fixed" else None

    @property
    def label(self) -> str:
        notes = [ENV_NOTES.get(pair, "=".join(pair)) for pair in self.env]
        if self.args:
            notes.append(flags_note(self.args))
        return self.base_label + (f" ({', '.join(notes)})" if notes else "")

    @property
    def base_label(self) -> str:
        if self.kind == "plain":
            return "plain (A/A twin)" if self.twin else "plain"
        if self.kind == "fixed":
            name = "EAGLE-3" if self.steps == LAUNCH_STEPS else f"EAGLE-3 depth {self.steps}"
            return f"{name} (A/A twin)" if self.twin else name
        learned_depths = f" (depths 0-{self.steps})" if self.learns and self.steps != LAUNCH_STEPS else ""
        return {"threshold": f"EAGLE-3 + threshold {self.threshold}",
                "schedule": f"EAGLE-3 + schedule {self.schedule}{learned_depths}",
                "auto": "EAGLE-3 + auto",
                "adaptive": "EAGLE-3 adaptive (upstream)"}[self.kind]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, rec: dict[str, Any]) -> BenchConfig:
        """A record as as_dict() wrote it, read back from JSON (its env pairs come back as lists)."""
        return cls(**{**rec, "env": tuple((str(k), str(v)) for k, v in rec.get("env") or ()),
                      "args": tuple(str(a) for a in rec.get("args") or ())})


def expand(configs: tuple[str, ...], thresholds: tuple[int, ...] = (16,),
           depths: tuple[int, ...] = (), schedules: tuple[str, ...] = (),
           auto_depth: int = LAUNCH_STEPS, delayer_ratio: float = DELAYER_RATIO,
           delayer_passes: int = DELAYER_PASSES) -> list[BenchConfig]:
    """The servers of the named configs, in order (a sweep's in its values' order). A schedule
    server launches at its deepest tier (3 at least); the schedule `auto` at `auto_depth`, the
    deepest it can learn."""
    out: list[BenchConfig] = []
    for name in configs:
        if name == "plain":
            out.append(BenchConfig(name, "plain"))
        elif name in TWINS:
            out.append(replace(expand((TWINS[name],))[0], name=name, twin=True))
        elif name == "eagle3":
            out.append(BenchConfig(name, "fixed", LAUNCH_STEPS))
        elif name in EAGLE3_WITH:
            out.append(BenchConfig(name, "fixed", LAUNCH_STEPS, env=(EAGLE3_WITH[name],)))
        elif name == "eagle3_depth":
            out += [BenchConfig(f"eagle3_depth{d}", "fixed", d) for d in depths]
        elif name == "eagle3_thr":
            out += [BenchConfig(f"eagle3_thr{n}", "threshold", LAUNCH_STEPS, threshold=n) for n in thresholds]
        elif name == "eagle3_thr_prefill_graphs":
            out += [BenchConfig(f"eagle3_thr{n}_prefill_graphs", "threshold", LAUNCH_STEPS, threshold=n,
                                env=(PREFILL_GRAPHS,)) for n in thresholds]
        elif name in ("eagle3_sched", "eagle3_sched_upstream_combine"):
            upstream = name == "eagle3_sched_upstream_combine"
            out += [BenchConfig(f"eagle3_sched{i}" + ("_upstream_combine" if upstream else ""), "schedule",
                                auto_depth if sched == "auto" else launch_steps(sched, LAUNCH_STEPS), schedule=sched,
                                env=(UPSTREAM_COMBINE,) if upstream else ())
                    for i, sched in enumerate(schedules, 1)]
        elif name == "eagle3_auto":
            out.append(BenchConfig(name, "auto", LAUNCH_STEPS))
        elif name == "eagle3_adaptive":
            out.append(BenchConfig(name, "adaptive", LAUNCH_STEPS))
        elif name in WITH_FLAGS:
            base, flags = WITH_FLAGS[name]
            flags = prefill_delayer(delayer_ratio, delayer_passes) if flags == PREFILL_DELAYER else flags
            suffix = name.removeprefix(base)
            out += [replace(rec, name=rec.name + suffix, args=flags)
                    for rec in expand((base,), thresholds, depths, schedules, auto_depth)]
        else:
            raise ValueError(f"unknown bench config {name!r}: one of {', '.join(CONFIGS)}")
    return out


def output_reference(records: Mapping[str, BenchConfig]) -> str | None:
    """The server whose greedy outputs every other's are held to: plain where it ran, else another
    that decodes plain (one started with flags of its own, such as the prefill delayer, before the
    A/A twin); None where none did."""
    if "plain" in records:
        return "plain"
    plain = [name for name, rec in records.items() if rec.kind == "plain"]
    return next((name for name in plain if not records[name].twin), plain[0] if plain else None)


def from_result(result: dict[str, Any]) -> dict[str, BenchConfig]:
    """The records a result was measured with (bench.json's `config_records`); a result of an older
    bench, which kept names only, gets them from its names (a name it does not know has none)."""
    records = result.get("config_records")
    if records:
        return {name: BenchConfig.from_dict(rec) for name, rec in records.items()}
    names: list[str] = [*result.get("configs", []), *result.get("not_run", {})]
    legacy: dict[str, BenchConfig] = {}
    for name in names:
        n = name.removeprefix("eagle3_thr")
        if name.startswith("eagle3_thr") and n.isdigit():
            legacy[name] = BenchConfig(name, "threshold", LAUNCH_STEPS, threshold=int(n))
        elif name in CONFIGS and name not in ("eagle3_depth", "eagle3_thr", "eagle3_thr_prefill_graphs",
                                              "eagle3_sched", "eagle3_sched_upstream_combine",
                                              "eagle3_sched_prefill_delayer"):
            legacy[name] = expand((name,))[0]
    return legacy
