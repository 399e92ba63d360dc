"""Where a decode step's GPU time goes, by forward kind: the device timer's categories (CUDA events
around each forward: the target's decode or verify, the draft's decode steps and its extend over
the accepted tokens, prefills) per decode step, medians over the blocks. A kind whose time does
not shrink with draft depth is where a shallower draft cannot win (docs/validation.md row 45).
An interval opens with an event recorded before the host prepares the forward: a graph replay
follows it at once, but an eager prefill's preparation counts too wherever the GPU reaches the
event idle (docs/validation.md row 78)."""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

# the device timer's category -> the column it goes in, in the table's order
KINDS = {"decode": "decode", "target_verify": "verify", "eagle_draft": "draft",
         "eagle_draft_extend": "draft extend", "extend": "prefill"}
OTHER = "other"


def gpu_ms_by_kind(result: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per concurrency and config: GPU ms per decode step of each kind (only windows the device
    timer timed; a kind a config never ran is left out)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for c, blocks in sorted(result.get("blocks", {}).items(), key=lambda kv: int(kv[0])):
        row: dict[str, dict[str, float]] = {}
        for name in result.get("configs", []):
            ws = [w for b in blocks if (w := b["windows"].get(name)) and w.get("steps") and w.get("gpu_s")]
            if not ws:
                continue
            per_kind: dict[str, list[float]] = {}
            for w in ws:
                shares: dict[str, float] = {}
                for category, seconds in w["gpu_s"].items():
                    kind = KINDS.get(category, OTHER)
                    shares[kind] = shares.get(kind, 0.0) + 1000 * seconds / w["steps"]
                for kind, ms in shares.items():
                    per_kind.setdefault(kind, []).append(ms)
            row[name] = {k: round(statistics.median(v), 2) for k, v in per_kind.items()}
        if row:
            out[c] = row
    return out


def lines(result: dict[str, Any], label: Callable[[str], str]) -> list[str]:
    """The table, or nothing where no window was timed (the bench without --device-timer)."""
    table = gpu_ms_by_kind(result)
    if not table:
        return []
    kinds = [k for k in (*KINDS.values(), OTHER) if any(k in cell for row in table.values() for cell in row.values())]
    out = [("GPU ms per decode step by forward kind (the device timer; medians over the blocks; prefill: "
            "the prefills that fell between the decode steps, run eagerly: where the GPU waits for the host, "
            "their column also counts the host's preparation of them):"), "",
           "| concurrency | server | " + " | ".join(kinds) + " |", "|---:|---|" + "---:|" * len(kinds)]
    for c, row in table.items():
        for name, cell in row.items():
            out.append(f"| {c} | {label(name)} | " + " | ".join(f"{cell[k]:.2f}" if k in cell else "-" for k in kinds) + " |")
    return [*out, ""]
