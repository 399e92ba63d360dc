"""An aborted request's output stops at its max_new_tokens, as plain decoding's does.

A request aborted while it runs (a client gone, /abort_request, a timeout) is marked `to_finish`
and runs one more decode pass (sglang.srt.managers.scheduler.Scheduler.abort_request). Under
speculation that pass can accept up to the draft depth + 1 tokens, past the request's
max_new_tokens, and Req.update_finish_state takes `to_finish` before its length check: the
output then carries up to 3 tokens more than the request asked for (seen on the 8B shape at
64-256 requests, docs/validation.md). Plain decoding adds one token a pass and finishes at the
cap, so this is speculation's alone. Upstream caps a stop found past the cap
(_cap_finished_len_at_max_new_tokens) but not this path; when it does, this hook finds
finished_len set and does nothing.
"""

from __future__ import annotations

from typing import Any


def cap_finished_output(result: None, req: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Req.update_finish_state: a request finished without a length of its own (the
    `to_finish` path) emits at most max_new_tokens of its output."""
    if req.finished_len is None and req.finished_reason is not None:
        cap = req.sampling_params.max_new_tokens
        if cap is not None and len(req.output_ids) > cap:
            req.finished_len = cap
    return result
