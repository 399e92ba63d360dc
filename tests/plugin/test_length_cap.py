"""An aborted request's output stops at its max_new_tokens (plugin/sglang_image_plugin/length_cap.py),
against the real sglang 0.5.23 wheel on a CPU: upstream's own Req.update_finish_state, before and
after the worker installs the hook."""
from __future__ import annotations

import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.probe import probe_result

FLAVOR = "sglang-0.5.23"

PROBE = textwrap.dedent("""
    from types import SimpleNamespace as NS
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
    from sglang_image_plugin import length_cap, registry, worker

    def finish(output, cap, aborted):
        # a running request after its last decode pass: `aborted`, Scheduler.abort_request had
        # marked it to_finish before that pass; the pass's tokens are in output_ids
        req = object.__new__(Req)
        req.finished_reason, req.finished_len = None, None
        req.to_finish = FINISH_ABORT() if aborted else None
        req.output_ids = list(output)
        req.sampling_params = NS(max_new_tokens=cap)
        req.update_finish_state(3)
        return {"reason": type(req.finished_reason).__name__, "finished_len": req.finished_len,
                "emitted": list(req.output_ids_through_stop)}

    def cases():
        return {"overrun": finish(range(7), 5, True),  # the pass accepted 3 and crossed the cap by 2
                "under": finish(range(4), 5, True),  # aborted before its cap: all of it
                "at": finish(range(5), 5, True)}

    before = cases()
    # a server whose worker runs without a threshold (always-on EAGLE-3): worker_init returns
    # early for its setting, after installing the hook
    worker.worker_init(None, NS(server_args=NS(), _hosts_draft=True))
    emit({"before": before, "after": cases(),
          "hooked": registry.wraps_hook(Req.update_finish_state, length_cap.cap_finished_output)})
""")


def test_an_aborted_output_stops_at_its_max_new_tokens(
        run_in_tree: Callable[..., subprocess.CompletedProcess[str]],
        sglang_tree: Callable[[str, bool], Path], plugin_site: Path) -> None:
    tree = sglang_tree(FLAVOR, False)
    code = "import json\ndef emit(obj):\n    print('RESULT ' + json.dumps(obj), flush=True)\n" + PROBE
    proc = run_in_tree(tree, code, env={"PYTHONPATH": f"{plugin_site}:{tree}"}, timeout=900)
    out: dict[str, Any] = probe_result(proc)
    # upstream alone: the abort wins over the length check and all 7 tokens go out
    assert out["before"]["overrun"] == {"reason": "FINISH_ABORT", "finished_len": None, "emitted": list(range(7))}
    assert out["hooked"] is True
    assert out["after"]["overrun"] == {"reason": "FINISH_ABORT", "finished_len": 5, "emitted": list(range(5))}
    # within the cap nothing changes
    for case in ("under", "at"):
        assert out["after"][case] == out["before"][case]
        assert out["after"][case]["finished_len"] is None
    assert out["after"]["under"]["emitted"] == list(range(4))
