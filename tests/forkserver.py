"""A warm interpreter per unpacked sglang tree that runs each probe in a forked child.

Importing torch and sglang takes most of a probe's time. The server imports them once (its warm-up
code), then forks a fresh child per probe: each child starts from the same warm state, runs the
probe's code as `__main__` with its own environment changes, and exits; nothing a probe does
(monkeypatches, env, globals) reaches the next one. A probe that fails, raises or hangs fails alone.
The answer looks like subprocess.run's, so tests read it as they read a `python -c` run.

Limits: modules the warm-up imported saw the server's environment, not a probe's `env` (a probe
that needs an env var read at import time must use a fresh interpreter: run_in_tree); no CUDA.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

# Runs in the server process: warm-up, then one JSON request per stdin line, one answer per line.
_SERVER = r'''
import json, os, signal, sys, tempfile, time, traceback
_requests, _answers = sys.stdin, os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # the server's own prints (warm-up imports) must not mix with the answers
try:
    exec(compile(sys.argv[1], "<warm-up>", "exec"), {"__name__": "__warmup__"})
    _answers.write(json.dumps({"ready": True}) + "\n")
except BaseException:
    _answers.write(json.dumps({"ready": False, "error": traceback.format_exc()}) + "\n")
    _answers.flush()
    sys.exit(1)
_answers.flush()
for _line in _requests:
    _req = json.loads(_line)
    _out, _err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    sys.stdout.flush(); sys.stderr.flush()
    _pid = os.fork()
    if _pid == 0:
        os.dup2(_out.fileno(), 1); os.dup2(_err.fileno(), 2)
        _code = 0
        try:
            sys.argv[:] = ["-c"]  # as in `python -c CODE`
            for _k, _v in _req["env"].items():
                if _v is None:
                    os.environ.pop(_k, None)
                else:
                    os.environ[_k] = _v
            exec(compile(_req["code"], "<probe>", "exec"), {"__name__": "__main__"})
        except SystemExit as _exc:
            _code = _exc.code if isinstance(_exc.code, int) else (0 if _exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            _code = 1
        try:
            sys.stdout.flush(); sys.stderr.flush()
        finally:
            os._exit(_code)
    _deadline, _status = time.monotonic() + _req["timeout"], None
    while _status is None:
        _done, _st = os.waitpid(_pid, os.WNOHANG)
        if _done:
            _status = _st
        elif time.monotonic() > _deadline:
            os.kill(_pid, signal.SIGKILL)
            _status = os.waitpid(_pid, 0)[1]
        else:
            time.sleep(0.02)
    _rc = os.waitstatus_to_exitcode(_status)
    _texts = []
    for _f in (_out, _err):
        _f.seek(0); _texts.append(_f.read().decode("utf-8", "replace")); _f.close()
    _answers.write(json.dumps({"rc": _rc, "stdout": _texts[0], "stderr": _texts[1]}) + "\n")
    _answers.flush()
'''


class ForkServer:
    """Probes in forked children of one warm interpreter in `tree` (see the module docstring)."""

    def __init__(self, tree: Path, warmup: str, env: dict[str, str] | None = None) -> None:
        self.tree = tree
        full_env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                    **(env or {})}
        # The server's own stderr (import warnings) goes to a file: a full pipe would block it.
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()  # one request at a time, whichever thread asks
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER, warmup], cwd=tree, env=full_env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, text=True)
        ready = self._answer()
        if not ready.get("ready"):
            self.close()
            raise RuntimeError(f"fork server warm-up failed in {tree}:\n{ready.get('error')}")

    def _answer(self) -> dict[str, Any]:
        stdout: IO[str] | None = self._proc.stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            self._proc.wait()
            self._stderr.seek(0)
            stderr = self._stderr.read()
            raise RuntimeError(f"fork server in {self.tree} died (rc={self._proc.poll()}):\n{stderr[-6000:]}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def run(self, code: str, env: dict[str, str | None] | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """Runs `code` as `__main__` in a forked child with `env` applied (None removes a variable)."""
        stdin = self._proc.stdin
        assert stdin is not None
        with self._lock:
            stdin.write(json.dumps({"code": code, "env": env or {}, "timeout": timeout}) + "\n")
            stdin.flush()
            a = self._answer()
        return subprocess.CompletedProcess(["<forked probe>"], a["rc"], a["stdout"], a["stderr"])

    def close(self) -> None:
        """Stops the server. Between probes it holds nothing to save (each probe's child has exited
        and its output files are gone): SIGTERM stops it at once, where an exit at the end of its
        input would first tear down torch and sglang (seconds a server)."""
        if self._proc.stdin:
            self._proc.stdin.close()
        self._proc.terminate()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout:
            self._proc.stdout.close()
        self._stderr.close()


ProbeRunner = Callable[..., "subprocess.CompletedProcess[str]"]


def warm_imports(modules: tuple[str, ...]) -> str:
    """Code for a server's warm-up: import each module once, so that every forked check finds it
    loaded (a module a tree cannot import is left to the checks that need it, which then fail)."""
    return ("import importlib\n"
            f"for _m in {modules!r}:\n"
            "    try:\n"
            "        importlib.import_module(_m)\n"
            "    except Exception:\n"
            "        pass\n")


@contextmanager
def forked_probes(warmup: str, server_env: dict[str, str] | None = None) -> Iterator[ProbeRunner]:
    """run(tree, code, env=None, timeout=600, path=None), like conftest's run_in_tree, but each
    tree gets one warm ForkServer (started on first use with `warmup` and `server_env`); all close
    on exit. `path`: the server's PYTHONPATH where it is not the tree alone (a plugin's site first,
    say); each (tree, path) gets a server of its own, as a fork keeps its server's path."""
    servers: dict[tuple[Path, str | None], ForkServer] = {}
    locks: dict[tuple[Path, str | None], threading.Lock] = {}
    guard = threading.Lock()

    def run(tree: Path, code: str, env: dict[str, str | None] | None = None,
            timeout: float = 600, path: str | None = None) -> subprocess.CompletedProcess[str]:
        key = (tree, path)
        with guard:
            lock = locks.setdefault(key, threading.Lock())
        with lock:  # one server per key, however many threads ask first; keys start side by side
            if key not in servers:
                servers[key] = ForkServer(tree, warmup, {**(server_env or {}),
                                                         **({"PYTHONPATH": path} if path else {})})
        return servers[key].run(code, env, timeout)

    try:
        yield run
    finally:
        for server in servers.values():
            server.close()
