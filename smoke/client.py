"""Standard-library HTTP client for an sglang server (no requests/aiohttp: runs anywhere): JSON
requests, server-sent-event streams, the server's load, info and metrics."""
from __future__ import annotations

import contextlib
import json
import resource
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

# open files a smoke process holds beside its requests' connections: the servers' logs and pipes,
# the interpreter's own
SPARE_FILES = 256


class HTTPFailure(Exception):
    pass


def allow_connections(count: int) -> None:
    """Lets this process hold `count` connections at once (and SPARE_FILES): its soft limit of open
    files raised where it is lower, as sglang's servers raise theirs. A container's is often 1024
    (Docker 25 on: 1024:524288), fewer than the 8N requests the smoke sends at once from N=128 on.
    SystemExit naming the fix where the hard limit is lower too."""
    need = count + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise SystemExit(f"{count} requests at once need {need} open files, and this process may open "
                         f"{hard} (its hard limit, ulimit -Hn): raise it (docker run --ulimit "
                         f"nofile={need}, or ulimit -Hn {need} as root) or give a smaller N")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


@contextlib.contextmanager
def _failures_named(req: urllib.request.Request | str) -> Iterator[None]:
    """An HTTP error status or a failed connection, read or timeout inside: an HTTPFailure naming
    the URL (and the body of an error answer)."""
    try:
        yield
    except urllib.error.HTTPError as exc:
        body = exc.read()[:2000].decode("utf-8", "replace")
        raise HTTPFailure(f"HTTP {exc.code} from {getattr(req, 'full_url', req)}: {body}") from exc
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        raise HTTPFailure(f"{getattr(req, 'full_url', req)}: {exc}") from exc


def _open(req: urllib.request.Request | str, timeout: float) -> tuple[int, bytes]:
    with _failures_named(req), urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def _json_request(url: str, payload: Any) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(payload).encode(),
                                  headers={"Content-Type": "application/json"})


def get_text(url: str, timeout: float = 30) -> str:
    return _open(url, timeout)[1].decode("utf-8", "replace")


def get_json(url: str, timeout: float = 30) -> Any:
    return json.loads(get_text(url, timeout))


def post(url: str, payload: Any, timeout: float = 600) -> str:
    """POST a JSON body; the answer as text (some endpoints answer plain text)."""
    return _open(_json_request(url, payload), timeout)[1].decode("utf-8", "replace")


def post_json(url: str, payload: Any, timeout: float = 600) -> Any:
    return json.loads(post(url, payload, timeout))


def sse_events(url: str, payload: Any, timeout: float,
               stop_after: int | None = None) -> list[dict[str, Any]]:
    """POST a JSON body; the JSON events of its server-sent-events answer. With stop_after, the
    connection is closed after that many (the server must abort the request). `timeout` bounds
    the whole stream (the socket's own timeout bounds each read only)."""
    req = _json_request(url, payload)
    events: list[dict[str, Any]] = []
    ends_at = time.time() + timeout
    with _failures_named(req), urllib.request.urlopen(req, timeout=timeout) as answer:
        for raw in answer:
            if time.time() > ends_at:
                raise TimeoutError(f"the stream ran past its timeout ({timeout:.0f}s)")
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            events.append(json.loads(data))
            if stop_after is not None and len(events) >= stop_after:
                break
    return events


def healthy(base: str) -> bool:
    try:
        return _open(base + "/health", 5)[0] == 200
    except HTTPFailure:
        return False


@dataclass(frozen=True)
class Prompt:
    key: str
    input_ids: tuple[int, ...]
    max_new_tokens: int


@dataclass
class Result:
    key: str
    output_ids: list[int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0


def generate(base: str, p: Prompt, timeout: float = 600, rid: str | None = None) -> Result:
    """Greedy generation; `rid` names the request so that /abort_request can stop it."""
    t0 = time.time()
    payload: dict[str, Any] = {"input_ids": list(p.input_ids),
                               "sampling_params": {"temperature": 0, "max_new_tokens": p.max_new_tokens,
                                                   "ignore_eos": True}}
    if rid is not None:
        payload["rid"] = rid
    try:
        r = post_json(base + "/generate", payload, timeout)
    except HTTPFailure as exc:
        return Result(p.key, error=str(exc), seconds=time.time() - t0)
    ids = r.get("output_ids")
    if ids is None:
        return Result(p.key, error=f"no output_ids in response: {str(r)[:300]}", seconds=time.time() - t0)
    return Result(p.key, list(ids), r.get("meta_info") or {}, None, time.time() - t0)


def run_concurrent(base: str, prompts: Sequence[Prompt], concurrency: int,
                   timeout: float = 600) -> list[Result]:
    """Sends all prompts with at most `concurrency` in flight; results in prompt order."""
    if concurrency <= 1:
        return [generate(base, p, timeout) for p in prompts]
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda p: generate(base, p, timeout), prompts))


def in_background(fn: Callable[[], Any]) -> Any:
    """Starts fn in a thread; returns the future (call .result())."""
    pool = ThreadPoolExecutor(max_workers=1)
    fut = pool.submit(fn)
    pool.shutdown(wait=False)
    return fut


def abort(base: str, rid: str) -> None:
    post(base + "/abort_request", {"rid": rid}, timeout=30)


def get_json_object(url: str, timeout: float = 30) -> dict[str, Any]:
    """A JSON object from url; anything else is an HTTPFailure naming what came back."""
    d = get_json(url, timeout)
    if not isinstance(d, dict):
        raise HTTPFailure(f"GET {url}: expected a JSON object, got {str(d)[:200]}")
    return d


def server_info(base: str) -> dict[str, Any]:
    return get_json_object(base + "/get_server_info")


def load(base: str) -> dict[str, Any]:
    """DP rank 0 of /v1/loads (num_running_reqs, num_used_tokens, max_total_num_tokens, ...)."""
    d = get_json_object(base + "/v1/loads?include=core")
    first: dict[str, Any] = d["loads"][0]
    return first


def metrics(base: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value}; {} when metrics are off."""
    try:
        text = get_text(base + "/metrics")
    except HTTPFailure:
        return {}
    return parse_prometheus(text)


def parse_prometheus(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            continue
    return out


def metric(values: dict[str, float], name: str) -> float | None:
    """Sum of every sample of metric `name` (any labels)."""
    hits = [v for k, v in values.items() if k == name or k.startswith(name + "{")]
    return sum(hits) if hits else None
