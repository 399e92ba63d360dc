"""One call of the GPU-host driver (`python -m bench e2e`): its flags, its deadline, the state
folder and the state kept there between calls (a warm machine keeps /tmp), its log and the commands
it runs. Each phase (bench.site, bench.run_phases) works through it."""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from smoke.deadline import Deadline

REPO = Path(__file__).resolve().parents[1]


class Deadline_(Exception):
    """A phase stopped before its end because the call's deadline was near."""


class Call:
    """What every phase of one call shares; the state is written out with save()."""

    def __init__(self, a: argparse.Namespace, phases: tuple[str, ...]):
        self.a = a
        self.phases = phases  # the phases this call runs, in order
        self.t0 = time.time()
        self.deadline = Deadline(self.t0 + a.deadline)
        self.state_dir: Path = a.state
        self.out: Path = a.out
        self.logs = self.state_dir / "logs"
        self.site_dir = self.state_dir / "site"
        self.models_dir = self.state_dir / "models"
        for d in (self.state_dir, self.out, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.state_file = self.state_dir / "state.json"
        if a.fresh and self.state_file.exists():
            self.state_file.unlink()
        self.state: dict[str, Any] = (json.loads(self.state_file.read_text())
                                      if self.state_file.exists() else {})
        self.log_path = self.out / "e2e.log"

    def log(self, msg: str) -> None:
        line = f"[e2e {time.strftime('%H:%M:%S')} +{time.time() - self.t0:5.0f}s] {msg}"
        print(line, flush=True)
        with self.log_path.open("a") as f:
            f.write(line + "\n")

    def save(self) -> None:
        self.state_file.write_text(json.dumps(self.state, indent=1))

    def sh(self, cmd: list[str], log_name: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        self.log("$ " + " ".join(cmd))
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, **kw)
        with (self.logs / log_name).open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n{p.stdout}\n{p.stderr}\n")
        return p
