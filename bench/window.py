"""One window of the paired benchmark: a closed loop of clients on one server, the output tokens of
a counted span, then every request in flight aborted; with the server's decode steps, GPU seconds
and host counters read at the span's ends, and the time to first token of the requests it sent."""
from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from bench import diagnose, hostinfo, servers
from smoke import client
from smoke.client import Prompt

WINDOW_END_S = 1.5  # a window's end: the abort, the requests coming back, the next cache flush
# sglang's meta_info with --enable-metrics (0.5.23): the scheduler's end of the request's prefill
# minus its arrival at the tokenizer, in seconds
FIRST_TOKEN_KEY = "first_token_latency"


def flush_cache(base: str) -> None:
    """Empty the radix cache before a window: every window starts from the same empty cache."""
    try:
        client.post(base + "/flush_cache?timeout=10", {}, 30)
    except client.HTTPFailure:
        pass


def abort_all(base: str) -> bool:
    """Every request of the server aborted (sglang's /abort_request with abort_all); False where the
    server refused, and the requests in flight then finish on their own."""
    try:
        client.post(base + "/abort_request", {"abort_all": True}, 30)
        return True
    except client.HTTPFailure:
        return False


def tokens_between(requests: list[tuple[float, float, int]], lo: float, hi: float) -> float:
    """Output tokens produced in [lo, hi]: each request's (start, end, tokens) spread evenly over its
    lifetime."""
    return sum(n * max(0.0, min(end, hi) - max(start, lo)) / (end - start)
               for start, end, n in requests if end > start)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0 to 1) of `values`, linear between the two nearest ranks."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    below = int(at)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (at - below)


def first_token_ms(requests: Iterable[tuple[float, dict[str, Any], bool]], lo: float, hi: float,
                   aborted_at: float) -> dict[str, Any] | None:
    """Time to first token of the requests started in [lo, hi], each (start, meta_info, whether it
    got a token): p50 and p90 in ms over `n` requests, from the server's own stamp (FIRST_TOKEN_KEY).
    A request cut short before its first token counts its age at the abort, a lower bound
    (`censored`: how many): the server's stamp (the abort's arrival) where it sent one, else the
    client's. None where no such request carries the key (a server that does not send it)."""
    started = [(start, meta, got) for start, meta, got in requests if lo <= start <= hi]
    if not any(FIRST_TOKEN_KEY in meta for _, meta, _ in started):
        return None
    seconds: list[float] = []
    censored = 0
    for start, meta, got_token in started:
        if not got_token:
            seconds.append(float(meta.get(FIRST_TOKEN_KEY, aborted_at - start)))
            censored += 1
        elif FIRST_TOKEN_KEY in meta:
            seconds.append(float(meta[FIRST_TOKEN_KEY]))
    return {"p50": round(1000 * percentile(seconds, 0.5), 1), "p90": round(1000 * percentile(seconds, 0.9), 1),
            "n": len(seconds), "censored": censored}


def measure(base: str, prompt_at: Callable[[int], Prompt], concurrency: int, settle_s: float, window_s: float,
            timeout: float, stop_at: float, scrape: Callable[[str], dict[str, float]] | None = None,
            counters: Callable[[], dict[str, float]] | None = None) -> dict[str, Any]:
    """One window: `concurrency` clients each send the stream's next prompt when their last request
    ends; the tokens of [settle_s, settle_s + window_s] are counted; then sending stops and every
    request in flight is aborted (kept as a prefix). A window that would end past `stop_at` (the
    call's deadline) is not started ("cut"). `counters` (the server's host counters) are read at
    the counted span's ends, as `scrape` is; `span` is that span (time.time()). `ttft_ms`: the time
    to first token of the requests started in the span (first_token_ms), where the server sends it."""
    t0 = time.time()
    lo_at, hi_at = t0 + settle_s, t0 + settle_s + window_s
    if hi_at + WINDOW_END_S > stop_at:
        return {"cut": True}
    lock = threading.Lock()
    nxt, stop = [0], [False]
    tag = f"bench-{int(t0 * 1000)}"
    done: list[tuple[float, float, client.Result, Prompt]] = []

    def worker() -> None:
        while True:
            with lock:
                if stop[0] or time.time() >= hi_at:
                    return
                i = nxt[0]
                nxt[0] += 1
            p = prompt_at(i)
            start = time.time()
            r = client.generate(base, p, timeout, rid=f"{tag}-{i}")
            with lock:
                done.append((start, time.time(), r, p))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, lo_at - time.time()))
    lo, before = time.time(), scrape(base) if scrape else {}
    host_before = counters() if counters else {}
    time.sleep(max(0.0, hi_at - time.time()))
    hi, after = time.time(), scrape(base) if scrape else {}
    host_after = counters() if counters else {}
    with lock:
        stop[0] = True
    aborted_at = time.time()
    aborted = abort_all(base)
    for t in threads:
        t.join(timeout)
    tail = time.time() - aborted_at
    complete, cut_short, errors = [], [], []
    over_max = empty = 0
    for start, end, r, p in done:
        if r.error is None and len(r.output_ids or []) == p.max_new_tokens:
            complete.append((start, end, r))
        elif end >= aborted_at:  # in flight at the end: aborted, what it returned must be a prefix
            cut_short.append((start, min(end, aborted_at), r))
            # an aborted request can hold no more than it asked for, and an empty one is not compared
            over_max += len(r.output_ids or []) > p.max_new_tokens
            empty += not r.output_ids
        else:
            errors.append(r)
    spans = [(s, e, len(r.output_ids or [])) for s, e, r in complete + cut_short]
    toks = tokens_between(spans, lo, hi)
    lens = [r.meta["spec_accept_length"] for _, _, r in complete if "spec_accept_length" in r.meta]
    steps = diagnose.decode_steps(before, after)
    m: dict[str, Any] = {
        "requests": len(complete), "aborted": len(cut_short), "errors": len(errors),
        "first_error": errors[0].error if errors else None, "output_tokens": round(toks),
        "seconds": round(hi - lo, 3), "tok_per_s": round(toks / (hi - lo), 1) if hi > lo else 0.0,
        "accept_length": round(statistics.mean(lens), 3) if lens else None, "steps": steps,
        "tail_s": round(tail, 2), "abort_all": aborted, "cut": False,
        "outputs": {r.key: r.output_ids for _, _, r in complete},
        "prefixes": {r.key: r.output_ids for _, _, r in cut_short if r.output_ids},
        "abort_reasons": {r.key: r.meta.get("finish_reason") for _, _, r in cut_short if r.output_ids},
        "aborted_over_max": over_max, "aborted_empty": empty}
    ttft = first_token_ms([(s, r.meta, bool(r.output_ids)) for s, _, r in complete + cut_short], lo, hi, aborted_at)
    if ttft:
        m["ttft_ms"] = ttft
    gpu = diagnose.gpu_seconds(before, after) if scrape else {}
    if gpu:
        m["gpu_s"] = gpu
    if counters:
        m["span"] = [lo, hi]
        m["counters"] = hostinfo.counters_delta(host_before, host_after)
    return m


def host_counters(pgid: int | None) -> Callable[[], dict[str, float]] | None:
    """What a window reads of a server's host time at its counted span's ends: the CPU seconds of
    all its processes and its scheduler thread's counters (hostinfo.thread_counters, `scheduler_`
    first); None for a server of no known process group."""
    if pgid is None:
        return None
    pids = servers.group_pids(pgid)
    scheduler = hostinfo.scheduler_pid(pids)

    def read() -> dict[str, float]:
        out = {"server_cpu_s": hostinfo.process_cpu_seconds(pids)}
        if scheduler is not None:
            out |= {f"scheduler_{k}": v for k, v in hostinfo.thread_counters(scheduler).items()}
        return out

    return read
