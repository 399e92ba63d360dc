"""The smoke run's prompts: random token ids (keys p000, p001, ... in the order made, the same for
the same seed) in sets, one per load, shaped by a threshold N (make_prompts) or by a depth
schedule's edges (make_schedule_prompts, smoke.tiers)."""
from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from sglang_image_plugin.setting import DepthSchedule
from smoke.client import Prompt
from smoke.tiers import Tiers


class PromptMaker:
    """Prompts of random token ids, keyed p000, p001, ... in the order made; the same for the
    same seed."""

    def __init__(self, expected: dict[str, Any], seed: int = 0) -> None:
        self.rnd = random.Random(seed)
        self.vocab = int(expected["vocab_size"])
        self.n = 0
        self.hf = Prompt("hf", tuple(expected["prompt_ids"]), len(expected["greedy_ids"]))

    def __call__(self, k: int, new: Sequence[int]) -> list[Prompt]:
        out = []
        for _ in range(k):
            ids = tuple(self.rnd.randrange(3, self.vocab) for _ in range(self.rnd.randint(4, 40)))
            out.append(Prompt(f"p{self.n:03d}", ids, self.rnd.choice(list(new))))
            self.n += 1
        return out


def make_prompts(expected: dict[str, Any], threshold: int, seed: int = 0) -> dict[str, list[Prompt]]:
    mk = PromptMaker(expected, seed)
    sets = {
        "below": [mk.hf] + mk(3, [48, 64]),
        "at": mk(threshold, [32, 48]),
        "above": mk(8 * threshold, [32, 48, 64]),
        "ramp_long": mk(2, [1024]),  # long enough to run through all three bursts
    }
    for i in range(3):
        sets[f"ramp_burst{i}"] = mk(4 * threshold, [24, 32])
    sets["after"] = mk(2, [48, 64]) + sets["above"][:2]  # two prefixes first seen while disabled
    # aborts: 8N long requests (plain mode), every other one aborted mid-generation; then one
    # long request alone (speculative mode) aborted, and a short one after it
    sets["abort_plain"] = mk(8 * threshold, [384])
    sets["abort_spec"] = mk(1, [1024])
    sets["abort_after"] = mk(2, [48])
    return sets


def make_schedule_prompts(expected: dict[str, Any], schedule: DepthSchedule,
                          seed: int = 0) -> dict[str, list[Prompt]]:
    """A depth schedule's loads (Tiers): below (one at a time), each edge load (its size at once,
    long enough that all of them run together before the first ends, as a load just above an
    edge must; its last request longer still, so the batch ends at 1 and the server in the first
    tier, where the next load starts), 8x the top edge at once, after (one at a time), the ramp's
    long requests and bursts, the aborts (8x the top edge in the last tier, one alone in the
    first)."""
    tiers = Tiers(schedule)
    mk = PromptMaker(expected, seed)
    sets = {"below": [mk.hf] + mk(3, [48, 64])}
    for name, size in tiers.edge_loads():
        sets[name] = mk(size - 1, [64, 96]) + mk(1, [112])
    sets["above"] = mk(tiers.above, [32, 48, 64])
    sets["after"] = mk(2, [48, 64]) + sets["above"][:2]
    sets["ramp_long"] = mk(2, [1024])
    for i, size in enumerate(tiers.ramp_bursts()):
        sets[f"ramp_burst{i}"] = mk(size, [24, 32])
    sets["abort_plain"] = mk(tiers.above, [384])
    sets["abort_spec"] = mk(1, [1024])
    sets["abort_after"] = mk(2, [48])
    return sets


def unique_prompts(sets: dict[str, list[Prompt]]) -> list[Prompt]:
    seen: dict[str, Prompt] = {}
    for ps in sets.values():
        for p in ps:
            seen.setdefault(p.key, p)
    return list(seen.values())
