"""The feature matrix's requests: each sent with the timeout the call's deadline leaves it, its
answer (a /generate body, a stream's events) read into an Outcome for the verdicts."""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from smoke import client
from smoke.deadline import Deadline
from smoke.verdicts import CaseFailure, Outcome

# The deadline: every request ends REQUEST_MARGIN_S before it, and none starts with less than
# MIN_REQUEST_S left (Deadline.request_budget).
REQUEST_CAP_S = 600.0    # a request that hangs fails after this long, deadline or not
DEADLINE = "deadline: "  # an Outcome's error that starts so: the deadline, not the server, stopped it


@dataclass(frozen=True)
class Request:
    """One request of a case: `kind` picks the endpoint and how its answer is read."""
    kind: str                       # generate | completions_stream | chat_stream | abort_stream
    payload: dict[str, Any]


def _finish(meta: dict[str, Any]) -> Any:
    fr = meta.get("finish_reason")
    if isinstance(fr, dict):  # {"type": "stop", "matched": id or str} / {"type": "length", ...}
        return [fr.get("type"), fr.get("matched")]
    return fr


def read_generate(answer: Any) -> Outcome:
    out = Outcome()
    for item in answer if isinstance(answer, list) else [answer]:
        meta = item.get("meta_info") or {}
        if item.get("output_ids") is None:
            raise CaseFailure(f"no output_ids in the answer: {str(item)[:300]}")
        out.ids.append(list(item["output_ids"]))
        out.text.append(item.get("text") or "")
        out.finish.append(_finish(meta))
        out.logprobs.append([float(t[0]) for t in meta.get("output_token_logprobs") or []])
        out.top.append([[(int(t[1]), float(t[0])) for t in pos or []]
                        for pos in meta.get("output_top_logprobs") or []])
    return out


def read_stream(events: list[dict[str, Any]], chat: bool) -> Outcome:
    text, finish = [], None
    for ev in events:
        if "error" in ev:
            raise CaseFailure(f"error event in the stream: {str(ev)[:300]}")
        for ch in ev.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
            text.append(piece or "")
            finish = ch.get("finish_reason") or finish
    return Outcome(text=["".join(text)], finish=[finish])


def cut_by_deadline(outs: Sequence[Outcome]) -> bool:
    """Whether the deadline stopped one of these requests (or kept it from starting)."""
    return any(o.error is not None and o.error.startswith(DEADLINE) for o in outs)


def send(base: str, req: Request, deadline: Deadline, cap: float = REQUEST_CAP_S) -> Outcome:
    """One request, its timeout taken from the deadline as it starts; one the deadline stopped or
    kept from starting answers an error that starts with DEADLINE."""
    timeout = deadline.request_budget(cap)
    if timeout is None:
        return Outcome(error=f"{DEADLINE}not started, {deadline.left():.0f}s left")
    try:
        return _send(base, req, timeout)
    except (client.HTTPFailure, OSError, ValueError) as exc:
        # a timeout the deadline shortened ran out with the deadline: not the server's failure
        why = DEADLINE if timeout < cap and deadline.request_budget(REQUEST_CAP_S) is None else ""
        return Outcome(error=f"{why}{type(exc).__name__}: {exc}"[:600])


def _send(base: str, req: Request, timeout: float) -> Outcome:
    try:
        if req.kind == "generate":
            return read_generate(client.post_json(base + "/generate", req.payload, timeout))
        if req.kind in ("completions_stream", "chat_stream"):
            path = "/v1/chat/completions" if req.kind == "chat_stream" else "/v1/completions"
            return read_stream(client.sse_events(base + path, req.payload, timeout), req.kind == "chat_stream")
        if req.kind == "abort_stream":
            events = client.sse_events(base + "/generate", req.payload, timeout, stop_after=4)
            return Outcome(text=[str(len(events))])
        raise ValueError(f"unknown request kind {req.kind}")
    except CaseFailure as exc:
        return Outcome(error=str(exc))


def send_all(base: str, reqs: Sequence[Request], concurrency: int, deadline: Deadline) -> list[Outcome]:
    if concurrency <= 1:
        return [send(base, r, deadline) for r in reqs]
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda r: send(base, r, deadline), reqs))

