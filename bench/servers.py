"""The bench's servers: started side by side, kept across calls, each on CPUs of its own.

- Side by side: every bench server gets the same fixed KV pool (--max-total-tokens) and a memory
  share that holds it whatever the others have taken meanwhile, so no server waits for another's
  start (the smoke's start lock is for servers whose pool depends on the memory free at start).
- Kept: a server runs in its own process session and is recorded in a registry file (its options'
  key, process group, port, log, CPUs). The next call with the registry finds it alive and uses it;
  a dead one is said and started again; one recorded with other options is stopped and started
  anew. `stop_all` ends them (the bench when it is complete, or `--stop`).
- Own CPUs: the measuring process keeps the last CLIENT_CPUS of this process's CPUs; each server
  is pinned, once healthy, to the next `cpus_per_server` free ones (all its processes and threads),
  so a loaded server shares no CPU with the client or with another server; with two or more, its
  scheduler thread has the first to itself (pin_group). A host with too few CPUs pins nothing,
  and says so.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import hostinfo
from sglang_image_plugin.setting import AUTO_TRACE_ENV
from smoke import client
from smoke.server import Server, ServerConfig, SmokeError, group_running, port_free

CLIENT_CPUS = 1  # the measuring process: one core runs its GIL-bound HTTP clients


@dataclass
class Entry:
    """A running server as the registry records it."""
    key: str
    pgid: int
    port: int
    log: str
    cpus: tuple[int, ...] = ()
    scheduler_cpu: int | None = None  # the CPU its scheduler thread has to itself (pin_group)
    warmed: bool = False
    launched_at: float = 0.0
    start_s: float = 0.0  # from the launch until it first answered

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Entry:
        return cls(**{**d, "cpus": tuple(d.get("cpus") or ())})  # type: ignore[arg-type]


def options_key(cfg: ServerConfig, extra: str = "") -> str:
    """What a server was started with (flags without the port, environment, the caller's extra: the
    installed site, the models): a server is reused only for the same key."""
    argv = cfg.argv(0)
    i = argv.index("--port") if "--port" in argv else -1
    if i >= 0:
        argv = argv[:i] + argv[i + 2:]
    blob = json.dumps({"argv": argv, "env": cfg.env, "extra": extra}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def clear_step_trace(cfg: ServerConfig) -> None:
    """A server about to start gets a step trace of its own: the file is named after the config,
    and the plugin appends, so an earlier server of the same name left its steps there. Unlinked,
    not truncated: one still exiting flushes into its own, removed file, not into the new one's."""
    trace = cfg.env.get(AUTO_TRACE_ENV)
    if trace:
        Path(trace).unlink(missing_ok=True)


def group_pids(pgid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def pin_group(pgid: int, cpus: tuple[int, ...]) -> int | None:
    """Every thread of every process of the group on `cpus` (threads started later inherit their
    creator's). With two or more, the scheduler's main thread (hostinfo.scheduler_pid) gets the
    first to itself and every other thread the rest: the server's HTTP front and detokenizer, busy
    at high request rates, then never take the scheduler's CPU. Returns the scheduler's CPU (None:
    not set apart)."""
    pids = group_pids(pgid)
    scheduler = hostinfo.scheduler_pid(pids) if len(cpus) > 1 else None
    rest = cpus[1:] if scheduler is not None else cpus
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
            tid = int(task.name)
            try:
                os.sched_setaffinity(tid, cpus[:1] if tid == scheduler else rest)
            except OSError:
                continue  # gone meanwhile
    return cpus[0] if scheduler is not None else None


def by_core(cpus: set[int]) -> list[int]:
    """The CPUs ordered core by core, a core's sibling threads next to each other: CPUs handed out
    in this order give a server whole cores where its count allows, and two servers share at most
    the core between them (none where each CPU is a core of its own)."""
    return [cpu for core in hostinfo.cpu_topology(cpus)["cores"] for cpu in core]


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the group's live processes."""
    return hostinfo.process_cpu_seconds(group_pids(pgid))


class StillStarting(SmokeError):
    """The call's time for the start ran out while a server was still starting (not failing)."""


class ServerPool:
    """The bench's servers of one model (`scope`), recorded in `registry` (None: nothing is kept, the
    servers stop with the call)."""

    def __init__(self, registry: Path | None, scope: str, port_base: int, cpus_per_server: int,
                 say: Callable[[str], None] = print):
        self.registry, self.scope, self.port_base = registry, scope, port_base
        self.cpus_per_server, self.say = cpus_per_server, say
        self.servers: dict[str, Server] = {}
        self.entries: dict[str, Entry] = {}
        self.lock = threading.Lock()

    # ------------------------------------------------------------- the registry
    def read(self) -> dict[str, Entry]:
        if self.registry is None or not self.registry.exists():
            return {}
        raw = json.loads(self.registry.read_text())
        return {k: Entry.from_json(v) for k, v in raw.items()}

    def write(self, entries: dict[str, Entry]) -> None:
        if self.registry is None:
            return
        self.registry.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.registry.with_suffix(".tmp")
        tmp.write_text(json.dumps({k: asdict(v) for k, v in sorted(entries.items())}, indent=1))
        tmp.replace(self.registry)

    def record(self, name: str, entry: Entry | None) -> None:
        with self.lock:
            entries = self.read()
            if entry is None:
                entries.pop(self.id(name), None)
                self.entries.pop(name, None)
            else:
                entries[self.id(name)] = entry
                self.entries[name] = entry
            self.write(entries)

    def id(self, name: str) -> str:
        return f"{self.scope}/{name}"

    # ------------------------------------------------------------- CPUs and ports
    def client_cpus(self) -> tuple[int, ...]:
        """The last CPUs: the first ones take most of a machine's interrupts."""
        return tuple(by_core(os.sched_getaffinity(0))[-CLIENT_CPUS:])

    def free_cpus(self, taken: set[int]) -> tuple[int, ...]:
        """The next `cpus_per_server` CPUs held by neither the client nor a recorded server, core by
        core (by_core); () where too few are left (the server then runs where the OS puts it)."""
        if self.cpus_per_server <= 0:
            return ()
        mine = by_core(os.sched_getaffinity(0))
        free = [c for c in mine[:-CLIENT_CPUS] if c not in taken]
        return tuple(free[:self.cpus_per_server]) if len(free) >= self.cpus_per_server else ()

    def free_port(self, taken: set[int]) -> int:
        port = self.port_base
        while port in taken or not port_free(port):
            port += 1
        return port

    # ------------------------------------------------------------- servers
    def alive(self, entry: Entry, cfg: ServerConfig, port: int) -> bool:
        """The recorded group still runs the recorded server (not another process that got its pid)."""
        argv = " ".join(cfg.argv(port))
        return group_running(entry.pgid) and hostinfo.cmdline(entry.pgid) == argv

    def recorded_alive(self, configs: dict[str, ServerConfig], key_extra: str) -> dict[str, bool]:
        """The configs whose recorded server runs with the same options: name -> warmed up."""
        recorded = self.read()
        out = {}
        for name, cfg in configs.items():
            entry = recorded.get(self.id(name))
            if entry is not None and entry.key == options_key(cfg, key_extra) and group_running(entry.pgid):
                out[name] = entry.warmed
        return out

    def launch(self, configs: dict[str, ServerConfig], key_extra: str, log_for: Callable[[str], Path]) -> list[str]:
        """Each config's server found in the registry (alive, same options) or launched now, side by
        side, without waiting; the names launched."""
        recorded = self.read()
        launched: list[str] = []
        for name, cfg in configs.items():
            key = options_key(cfg, key_extra)
            entry = recorded.get(self.id(name))
            if entry is not None:
                srv = Server.attach(cfg, entry.port, Path(entry.log), entry.pgid)
                srv.t_launch = entry.launched_at
                if entry.key == key and group_running(entry.pgid):
                    self.servers[name], self.entries[name] = srv, entry
                    self.say(f"{name}: the server started earlier (process group {entry.pgid}, port "
                             f"{entry.port}) is alive: reused")
                    continue
                if entry.key != key:
                    self.say(f"{name}: recorded with other options: stopping it (process group "
                             f"{entry.pgid}), starting it anew")
                else:
                    self.say(f"{name}: the server started earlier (process group {entry.pgid}) is dead: "
                             "starting it again")
                srv.stop()  # whatever is left of its group
                self.record(name, None)
            port = self.free_port({e.port for e in self.read().values()})
            clear_step_trace(cfg)  # a reused server (above) keeps appending to its own
            srv = Server(cfg, port, log_for(name))
            srv.launch()
            assert srv.pgid is not None
            self.servers[name] = srv
            self.record(name, Entry(key, srv.pgid, port, str(srv.log_path), launched_at=srv.t_launch))
            launched.append(name)
        return launched

    def ensure(self, configs: dict[str, ServerConfig], key_extra: str, log_for: Callable[[str], Path],
               timeout: float) -> dict[str, Server]:
        """Every config's server healthy and pinned: the recorded ones reused, the others started
        side by side."""
        launched = self.launch(configs, key_extra, log_for)
        try:
            self.wait(list(configs), timeout)
        except StillStarting:
            if self.registry is None:  # nothing would find them again
                self.stop_all()
            raise  # with a registry they go on starting, for the next call
        except BaseException:
            for name in launched:  # a start that failed must not hold the GPU or a port
                self.stop(name)
            raise
        self.pin(list(configs))
        return dict(self.servers)

    def wait(self, names: list[str], timeout: float) -> None:
        """Until every server answers; the first that exits or times out raises with its log."""
        end = time.time() + timeout
        pending = list(names)
        while pending:
            for name in list(pending):
                srv = self.servers[name]
                if not srv.alive():
                    srv.wait_healthy(1)  # raises with the exit code and the log
                if client.healthy(srv.base):
                    entry = self.entries[name]
                    if not entry.start_s:  # the first time it answers: how long its start took
                        entry.start_s = round(time.time() - entry.launched_at, 1)
                        self.record(name, entry)
                    srv.start_seconds = entry.start_s
                    pending.remove(name)
            if pending and time.time() >= end:
                raise StillStarting(f"{', '.join(pending)}: still starting after {timeout:.0f}s",
                                    log=self.servers[pending[0]].log_path)
            if pending:
                time.sleep(1)

    def wait_for_other_starts(self, timeout: float) -> list[str]:
        """Until no recorded server of another scope is still starting (a start's CPU and GPU work
        must not fall into a measured window); the ones still starting at the timeout."""
        end = time.time() + timeout
        while True:
            starting = [ident for ident, e in self.read().items() if not ident.startswith(self.scope + "/")
                        and group_running(e.pgid) and not client.healthy(f"http://127.0.0.1:{e.port}")]
            if not starting or time.time() >= end:
                return starting
            time.sleep(1)

    def pin(self, names: list[str]) -> None:
        """Each server on CPUs of its own (kept from an earlier call where it has some)."""
        if self.cpus_per_server <= 0:
            return
        taken = {c for e in self.read().values() for c in e.cpus}
        for name in names:
            entry, srv = self.entries[name], self.servers[name]
            cpus = entry.cpus or self.free_cpus(taken)
            if not cpus:
                self.say(f"{name}: not pinned: fewer than {self.cpus_per_server} CPUs left beside the "
                         f"client's {CLIENT_CPUS} and the other servers'")
                continue
            assert srv.pgid is not None
            entry.scheduler_cpu = pin_group(srv.pgid, cpus)
            taken |= set(cpus)
            entry.cpus = cpus
            self.record(name, entry)

    def warmed(self, name: str) -> bool:
        return self.entries[name].warmed

    def mark_warmed(self, name: str) -> None:
        entry = self.entries[name]
        entry.warmed = True
        self.record(name, entry)

    def stop(self, name: str) -> None:
        srv = self.servers.pop(name, None)
        if srv is not None:
            srv.stop()
        self.record(name, None)

    def release(self) -> None:
        """The end of a call: without a registry nothing outlives it; with one, the servers stay."""
        if self.registry is None:
            self.stop_all()

    def stop_all(self) -> None:
        for name in list(self.servers):
            self.stop(name)


def stop_recorded(registry: Path, say: Callable[[str], None] = print) -> int:
    """`--stop`: every server the registry holds, whatever its scope; how many were running."""
    if not registry.exists():
        return 0
    n = 0
    for ident, entry in ((k, Entry.from_json(v)) for k, v in json.loads(registry.read_text()).items()):
        if group_running(entry.pgid):
            say(f"stopping {ident} (process group {entry.pgid}, port {entry.port})")
            srv = Server.attach(ServerConfig(ident, Path(".")), entry.port, Path(entry.log), entry.pgid)
            srv.stop()
            n += 1
    registry.unlink()
    return n
