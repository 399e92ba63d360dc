"""The ramp: a closed loop whose number of clients steps up through the concurrencies and back
down, a level every few seconds; tokens/s per level and the mode a threshold server was in."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from bench.workload import ramp_prompt
from smoke import client

MODE_POLL_S = 0.5  # how often the ramp asks a threshold server for its mode


def ramp_levels(concurrency: tuple[int, ...], cycles: int) -> list[int]:
    """Up through every concurrency to the top and back down, `cycles` times."""
    levels = sorted(concurrency)
    out: list[int] = []
    for _ in range(cycles):
        out += levels[:-1] + levels[::-1][:-1]
    return [*out, levels[0]] if cycles else []


def run_ramp(base: str, levels: list[int], hold_s: float, vocab: int, output_len: int, timeout: float,
             poll: Callable[[], tuple[str | None, int | None, int | None]] | None) -> dict[str, Any]:
    """Closed loop whose number of clients follows `levels`, one every `hold_s` seconds. Returns per
    level its tokens/s (each request's tokens spread over its lifetime) and the modes polled."""
    top = max(levels)
    t0 = time.time()
    end = t0 + hold_s * len(levels)
    done: list[tuple[float, float, int, str, list[int] | None, str | None]] = []
    lock = threading.Lock()
    samples: list[tuple[float, str | None, int | None]] = []
    first_changes: list[int | None] = []

    def level_at(t: float) -> int:
        return levels[min(int((t - t0) / hold_s), len(levels) - 1)]

    def worker(w: int) -> None:
        k = 0
        while (now := time.time()) < end:
            if w >= level_at(now):
                time.sleep(0.02)
                continue
            key = f"ramp-{w}-{k}"
            k += 1
            r = client.generate(base, ramp_prompt(vocab, output_len, key), timeout)
            with lock:
                done.append((now - t0, time.time() - t0, len(r.output_ids or []), key, r.output_ids, r.error))

    def poller() -> None:
        while time.time() < end:
            mode, crossover, changes = poll() if poll else (None, None, None)
            if not first_changes:
                first_changes.append(changes)
            samples.append((time.time() - t0, mode, crossover))
            time.sleep(MODE_POLL_S)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(top)]
    threads.append(threading.Thread(target=poller, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, end - time.time()) + timeout)
    last_changes = poll()[2] if poll else None
    windows = ramp_windows(levels, hold_s, [(start, stop, n) for start, stop, n, *_ in done], samples)
    errors = [e for *_, e in done if e]
    mode_changes = (last_changes - first_changes[0] if isinstance(last_changes, int) and first_changes
                    and isinstance(first_changes[0], int) else None)
    return {"windows": windows, "requests": len(done), "errors": len(errors),
            "first_error": errors[0] if errors else None, "mode_changes": mode_changes,
            "outputs": {key: ids for *_, key, ids, err in done if not err}}


def ramp_windows(levels: list[int], hold_s: float, requests: list[tuple[float, float, int]],
                 samples: list[tuple[float, str | None, int | None]]) -> list[dict[str, Any]]:
    """One window per level: tokens/s, each request's (start s, end s, tokens) spread evenly over its
    lifetime; the share of the mode samples (s, mode, crossover) that said plain, the last crossover."""
    windows = []
    for i, level in enumerate(levels):
        lo, hi = i * hold_s, (i + 1) * hold_s
        tokens = sum(n * max(0.0, min(stop, hi) - max(start, lo)) / (stop - start)
                     for start, stop, n in requests if stop > start)
        modes = [m for t, m, _ in samples if lo <= t < hi and m]
        crossovers = [c for t, _, c in samples if lo <= t < hi and c is not None]
        windows.append({"t": lo, "level": level, "tok_per_s": round(tokens / hold_s, 1),
                        "plain_share": round(modes.count("plain") / len(modes), 2) if modes else None,
                        "crossover": crossovers[-1] if crossovers else None})
    return windows
