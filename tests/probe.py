"""Reading what a probe (a `python -c` run inside an unpacked sglang tree) printed."""
from __future__ import annotations

import json
import subprocess
from typing import Any


def probe_result(proc: subprocess.CompletedProcess[str], marker: str = "RESULT ", what: str = "probe") -> Any:
    """The JSON after `marker` on the probe's last such line; fails with its output otherwise."""
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(marker)]
    assert proc.returncode == 0 and lines, (
        f"{what} failed rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )
    return json.loads(lines[-1][len(marker):])
