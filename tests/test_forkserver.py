"""The fork server the probe tests share (tests/forkserver.py): each probe's failure, output, env and
state stay its own."""
from __future__ import annotations

from pathlib import Path

from tests.forkserver import forked_probes

WARMUP = "import json\nprint('a warm-up that prints must not garble the answers')\n"


def test_each_probe_is_isolated_and_can_fail(tmp_path: Path) -> None:
    with forked_probes(WARMUP, server_env={"FROM_SERVER": "yes"}) as run:
        ok = run(tmp_path, "import json, os, sys\nprint(json.dumps([os.environ.get('FROM_SERVER'), "
                           "os.environ.get('X'), sys.argv]))\nimport json as j\nj.MARK = 1\n",
                 env={"X": "1"})
        assert ok.returncode == 0 and ok.stdout.strip() == '["yes", "1", ["-c"]]', ok
        # the previous probe's env and monkeypatch are gone; the warm-up's modules are there
        nxt = run(tmp_path, "import json, os, sys\nprint(os.environ.get('X'), hasattr(json, 'MARK'), "
                            "'json' in sys.modules)\n")
        assert nxt.stdout.strip() == "None False True", nxt
        failed = run(tmp_path, "print('before')\nraise ValueError('boom')\n")
        assert failed.returncode == 1 and "before" in failed.stdout and "ValueError: boom" in failed.stderr
        assert run(tmp_path, "import sys\nsys.exit(3)\n").returncode == 3
        hung = run(tmp_path, "import time\ntime.sleep(60)\n", timeout=1)
        assert hung.returncode == -9
        assert run(tmp_path, "print('still serving')\n").stdout == "still serving\n"
