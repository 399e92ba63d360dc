"""What a server says of itself during and after its load (its speculation mode, KV pool, running
limit, log), and every config's outputs compared with plain decoding's."""
from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

from bench import autotrace
from bench.window import flush_cache
from sglang_image_plugin.setting import AUTO_TRACE_ENV
from smoke import client
from smoke.checks import check_log_clean, spec_state
from smoke.server import Server, SmokeError


def speculation_state(base: str) -> dict[str, Any]:
    """The server's dynamic speculation disable state, from /server_info (sglang >= 0.5.23 logs a
    deprecation warning for each /get_server_info, which older ones alone serve)."""
    try:
        info = client.get_json(base + "/server_info")
    except client.HTTPFailure:
        info = client.server_info(base)
    return spec_state(info)


def mode_of(base: str) -> tuple[str | None, int | None, int | None]:
    """A threshold server's mode, crossover (auto) and mode-change count; Nones where it says nothing."""
    try:
        st = speculation_state(base)
    except (SmokeError, client.HTTPFailure, ValueError):
        return None, None, None
    crossover = st.get("crossover")
    return st.get("mode"), crossover if isinstance(crossover, int) else None, st.get("mode_changes")


def _state_text(base: str, key: str) -> str | None:
    """One text field of the server's speculation state; None where it says nothing."""
    try:
        value = speculation_state(base).get(key)
    except (SmokeError, client.HTTPFailure, ValueError):
        return None
    return value if isinstance(value, str) else None


def trial_of(base: str) -> str | None:
    """The batch-size bucket (low-high) where an `auto` server runs a trial now; None where none
    runs or it says nothing."""
    return _state_text(base, "trial")


def learned_schedule_of(base: str) -> str | None:
    """The depth schedule a schedule server runs now (`auto`: the one it learned), in the flag's
    grammar; None where it says nothing."""
    return _state_text(base, "schedule")


def kv_used_after_flush(base: str) -> int | None:
    """Tokens still held in the KV pool once the load is over and the radix cache flushed (0 when
    every request gave back what it took)."""
    for _ in range(10):
        flush_cache(base)
        try:
            used = int(client.load(base).get("num_used_tokens") or 0)
        except (client.HTTPFailure, KeyError, IndexError, TypeError, ValueError):
            return None
        if used == 0:
            return 0
        time.sleep(1)
    return used


def running_limit(base: str) -> int | None:
    """The server's running-request limit (/server_info), None where it says none."""
    try:
        states = client.get_json(base + "/server_info").get("internal_states") or [{}]
        return int(states[0]["effective_max_running_requests_per_dp"])
    except (client.HTTPFailure, KeyError, IndexError, TypeError, ValueError):
        return None


# sglang 0.5.23's line for a Triton kernel compiled while the server served requests: a stall of
# that long in whatever window held it
SERVING_COMPILE = re.compile(r"^\[([\d-]+ [\d:]+)\] Triton kernel '(\w+)' took ([\d.]+) s to compile after "
                             r"serving started", re.MULTILINE)


def serving_compiles(log_text: str) -> list[dict[str, Any]]:
    """The Triton kernels a server's log says it compiled while serving: when, which, how long."""
    return [{"at": m.group(1), "kernel": m.group(2), "seconds": float(m.group(3))}
            for m in SERVING_COMPILE.finditer(log_text)]


def server_checks(name: str, srv: Server, top: int, switching: bool) -> tuple[dict[str, Any], list[str]]:
    """After a server's load: its KV pool back to empty, its running-request limit, its mode
    counters (a server `switching` between modes itself), its log clean. Every figure is kept, whichever check fails (the failures listed)."""
    info: dict[str, Any] = {"kv_used_after_flush": kv_used_after_flush(srv.base),
                            "running_limit": running_limit(srv.base)}
    problems = []
    if info["kv_used_after_flush"]:
        problems.append(f"{name}: {info['kv_used_after_flush']} KV tokens still in use after the "
                        "load and a cache flush")
    if info["running_limit"] is not None and info["running_limit"] < top:
        problems.append(f"{name}: runs at most {info['running_limit']} requests at once, below the "
                        f"top concurrency {top}")
    if switching:
        try:
            info["speculative_disable"] = speculation_state(srv.base)
        except (SmokeError, client.HTTPFailure, ValueError) as exc:
            problems.append(f"{name}: no speculation state: {getattr(exc, 'cause', exc)}")
    trace = srv.cfg.env.get(AUTO_TRACE_ENV)
    if trace and Path(trace).is_file():  # auto's steps, written out as the server went idle after the load
        info["step_trace"] = [r.as_dict() for r in autotrace.summarize(autotrace.read(Path(trace)))]
    log_text = srv.log_text()
    compiles = serving_compiles(log_text)
    if compiles:
        info["serving_compiles"] = compiles
    try:
        check_log_clean(log_text)
    except SmokeError as exc:
        problems.append(f"{name}: {exc.cause} ({srv.log_path.name})")
    return info, problems


def mismatches(outputs: dict[str, dict[str, Any]], where: str, reference: str = "plain") -> list[str]:
    """Every config's outputs against plain decoding's (`reference`: the server that decoded plain)
    for the same prompts (greedy: they must be equal)."""
    ref = outputs.get(reference, {})
    problems = []
    for name, got in outputs.items():
        bad = [k for k, v in got.items() if name != reference and v is not None and ref.get(k) not in (None, v)]
        if bad:
            problems.append(f"{where} {name}: {len(bad)} output(s) differ from {reference} (e.g. {bad[0]})")
    return problems


def digest(ids: list[int] | None) -> str | None:
    """A ramp output as kept in the state until every config's ramp is done (compared with plain's)."""
    return None if ids is None else hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


PREFIX_EXAMPLES = 5  # bad aborted outputs described per block and server (bench.json)
BEFORE, AFTER = 3, 5  # tokens shown before and from the first difference


def prefix_detail(key: str, got: list[int], want: list[int], finish_reason: Any = None) -> dict[str, Any]:
    """Where an aborted output leaves plain's complete one: both lengths, the first differing
    token (plain's length where the aborted one is longer: then it cannot be a prefix), the tokens
    around it from both (from token `from`), and the server's finish_reason of the aborted one."""
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    lo = max(0, at - BEFORE)
    return {"key": key, "aborted_len": len(got), "plain_len": len(want), "differs_at": at,
            "longer": len(got) > len(want), "from": lo, "got": got[lo:at + AFTER], "want": want[lo:at + AFTER],
            "finish_reason": finish_reason}


def detail_text(d: dict[str, Any]) -> str:
    """A detail in a few words: `c64-74: differs at token 118 of 131, plain's 256: got [..] want [..]`."""
    reason = d.get("finish_reason")
    finish = f", finish {reason.get('type')}" if isinstance(reason, dict) and reason.get("type") else ""
    longer = " (longer than plain's)" if d["longer"] else ""
    return (f"{d['key']}: differs at token {d['differs_at']} of {d['aborted_len']}, plain's {d['plain_len']}"
            f"{longer}{finish}: got {d['got']} want {d['want']}")


def compared_outputs(outputs: dict[str, dict[str, Any]], prefixes: dict[str, dict[str, Any]], where: str,
                     reasons: dict[str, dict[str, Any]] | None = None,
                     reference: str = "plain") -> tuple[list[str], list[dict[str, Any]]]:
    """mismatches() of the complete outputs, and every aborted output a prefix of plain's; with,
    per server that has aborted outputs that are not, the first PREFIX_EXAMPLES of them described
    (prefix_detail; `reasons`: server -> key -> finish_reason of its aborted outputs)."""
    problems = mismatches(outputs, where, reference)
    details: list[dict[str, Any]] = []
    ref = outputs.get(reference, {})
    for name, got in prefixes.items():
        if name == reference:
            continue
        # plain's complete output ran to max_new_tokens: one that starts with all of it and goes on
        # ran past its length, which over_max() reports from every window (plain's or not)
        bad = [k for k, v in got.items() if k in ref and ref[k] is not None and v != ref[k][:len(v)]
               and v[:len(ref[k])] != ref[k]]
        if bad:
            why = (reasons or {}).get(name, {})
            examples = [prefix_detail(k, got[k], ref[k], why.get(k)) for k in bad[:PREFIX_EXAMPLES]]
            details.append({"where": where, "server": name, "bad": len(bad), "examples": examples})
            problems.append(f"{where} {name}: {len(bad)} aborted output(s) not a prefix of {reference}'s "
                            f"(e.g. {detail_text(examples[0])})")
    return problems, details


def over_max(windows: dict[str, dict[str, Any]], where: str) -> list[str]:
    """Every server whose aborted outputs ran past their max_new_tokens in this block (a window's
    `aborted_over_max`): a request gets no more tokens than it asked for, aborted or not."""
    return [f"{where} {name}: {w['aborted_over_max']} aborted output(s) longer than their max_new_tokens"
            for name, w in windows.items() if w.get("aborted_over_max")]
