"""What each server and router of each deployment runs: the one place where their flags are made.

The settings (deploy/serve.toml, overridden by `nox -s deploy` options) say what is served: the
model and its EAGLE-3 draft, the threshold, the TP size, replicas and nodes. `check` refuses a bad
value naming it and the fix; `pods` turns valid settings into the processes of a topology:

    single     one server, TP GPUs in one pod
    router     REPLICAS servers of TP GPUs each, and sglang-router in front of them
    multinode  one server whose TP GPUs span NODES pods (a LeaderWorkerSet group)

Every server's argv comes from `server_args`, the router's from `router_args` (its workers: a
list on one box, a label selector on Kubernetes): deploy.py only places them into Compose and
Kubernetes manifests.
"""
from __future__ import annotations

import hashlib
import ipaddress
import posixpath
import re
import shlex
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from sglang_image import threshold as thresholds
from sglang_image.errors import UsageError
from sglang_image.pins import Flavor, flavor_names, load_flavor
from sglang_image_plugin.setting import THRESHOLD_FLAG

Topology = Literal["single", "router", "multinode"]
Platform = Literal["compose", "kubernetes"]
TOPOLOGIES: tuple[Topology, ...] = ("single", "router", "multinode")

SERVER_PORT = 30000  # the image's SGLANG_IMAGE_HTTP_PORT
DIST_INIT_PORT = 20000  # torch.distributed's rendezvous on the multinode leader
ROUTER_METRICS_PORT = 29000
MODELS_MOUNT = "/models"  # where the models volume is mounted, read-only
QUANTITY_UNITS = {"Mi": "m", "Gi": "g", "Ti": "t"}  # --shm-size: Kubernetes unit -> Docker's
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a DNS label: a Kubernetes name
# SGLang 0.5.23's /health generates a token and waits up to 20 s for it (its
# HEALTH_CHECK_TIMEOUT): a check that gives up sooner fails a healthy server.
HEALTH_WAIT_S = 20
_HEALTH_WAIT = (f" (SGLang's /health may wait {HEALTH_WAIT_S} s for the token it generates: a "
                "check that gives up sooner fails a healthy, busy server)")
ROUTER_MODULE = "sglang_router.launch_router"
# The router's wheel: in the images of the flavors that lock it.
ROUTER_DISTRIBUTION = "sglang-router"
# LeaderWorkerSet puts these into every pod of a group; Kubernetes expands $(NAME) in args.
LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX = (
    "LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")

# Server flags the settings own: given through --server-arg they would contradict them.
_OWNED = {
    "--model-path": "--model-path", "--model": "--model-path",
    "--speculative-draft-model-path": "--draft-model-path",
    "--tp-size": "--tp", "--tensor-parallel-size": "--tp", "--tp": "--tp",
    "--nnodes": "--nodes", "--node-rank": "--nodes", "--dist-init-addr": "--nodes",
    "--nccl-init-addr": "--nodes", "--host": "(the image's entrypoint)",
    "--port": "(the image's entrypoint)", THRESHOLD_FLAG: "--threshold",
    "--speculative-algorithm": "(always EAGLE3: the threshold needs it)",
    "--speculative-eagle-topk": "(always 1: the threshold needs it)",
    "--speculative-num-steps": "speculative_num_steps in deploy/serve.toml",
    "--speculative-num-draft-tokens": "speculative_num_draft_tokens in deploy/serve.toml",
}
# Server flags that change the GPUs a server takes: every pod is sized for --tp (over --nodes).
_REPLICAS_INSTEAD = ("data-parallel replicas inside one server would take TP x DP GPUs, more "
                     "than its pod holds; give --replicas N instead (the router topology: N "
                     "servers behind sglang-router), or add --enable-dp-attention (data-parallel "
                     "attention inside the TP group, no more GPUs)")
_NO_PIPELINE = ("pipeline parallelism would take TP x PP GPUs, more than its pod holds; give a "
                "larger --tp, or --nodes to spread it (the multinode topology)")
_OWN_GPUS = "a pod sees only its own GPUs, numbered from 0; leave the GPU ids to the deployment"
_GPU_COUNT = {
    "--dp-size": _REPLICAS_INSTEAD, "--data-parallel-size": _REPLICAS_INSTEAD,
    "--pp-size": _NO_PIPELINE, "--pipeline-parallel-size": _NO_PIPELINE,
    "--base-gpu-id": _OWN_GPUS, "--gpu-id-step": _OWN_GPUS,
}
DP_ATTENTION_FLAG = "--enable-dp-attention"  # --dp-size then splits the TP group: no more GPUs


@dataclass(frozen=True)
class Settings:
    """What the deployments serve (deploy/serve.toml documents each field)."""

    model_path: str = ""
    draft_model_path: str = ""
    threshold: int | str = 32
    speculative_num_steps: int = 3
    speculative_num_draft_tokens: int = 4
    tp: int = 1
    replicas: int = 2
    nodes: int = 2
    gpus_per_node: int = 8
    shm_size: str = "16Gi"
    cpu: int = 8
    memory: str = "64Gi"
    startup_minutes: int = 30
    health_period_seconds: int = 30
    health_timeout_seconds: int = 30
    health_failures: int = 4
    drain_seconds: int = 120
    router_drain_seconds: int = 150
    models_claim: str = "sglang-models"
    models_dir: str = "/srv/models"
    publish_address: str = "127.0.0.1"
    api_key_env_file: str = ""
    pull_secret: str = ""
    server_args: tuple[str, ...] = ()
    topologies: tuple[Topology, ...] = ("single", "router")

    @property
    def model(self) -> str:
        return in_models(self.model_path)

    @property
    def draft(self) -> str:
        return in_models(self.draft_model_path)

    def gpus_per_pod(self, topology: Topology) -> int:
        return self.tp // self.nodes if topology == "multinode" else self.tp


@dataclass(frozen=True)
class Pod:
    """One process of a topology: its role, its arguments (after the image's entrypoint, or
    after `python -m sglang_router.launch_router` for the router) and the GPUs it holds."""

    role: str  # "server", "worker-<i>", "router", "node-<rank>" (multinode: one pod template)
    args: tuple[str, ...]
    gpus: int


def in_models(path: str) -> str:
    """A model folder as the server sees it: relative paths lie under the models volume."""
    return posixpath.normpath(posixpath.join(MODELS_MOUNT, path))


# --- settings ------------------------------------------------------------------------------------

def load(path: Path) -> Settings:
    """The settings file (TOML), every key checked against Settings' fields."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path}: no such settings file (the repository's is deploy/serve.toml)"
                         ) from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path} is not valid TOML: {exc}") from None
    known = {f.name for f in fields(Settings)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UsageError(f"{path}: unknown settings {unknown}; known: {sorted(known)}")
    values: dict[str, Any] = dict(data)
    for key in ("server_args", "topologies"):
        if key in values:
            if not isinstance(values[key], list):
                raise UsageError(f"{path}: {key} must be a list, got {values[key]!r}")
            values[key] = tuple(values[key])
    return Settings(**values)


def override(settings: Settings, options: Mapping[str, Any]) -> Settings:
    """Settings with the options that were given (None: not given) put over them."""
    given: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v)
                             for k, v in options.items() if v is not None}
    if "server_args" in given:
        given["server_args"] = settings.server_args + given["server_args"]
    return replace(settings, **given)


def check(s: Settings, flavor: Flavor | None = None) -> Settings:
    """The settings, checked (threshold normalised), or a UsageError naming the value and the
    fix. `flavor`: the image's flavor where known (`auto` needs the plugin)."""
    threshold = thresholds.parse(s.threshold)
    if flavor is not None:
        thresholds.check_flavor(threshold, flavor)
    for name in ("model_path", "draft_model_path"):
        _check_model(name, getattr(s, name))
    for name, low in (("tp", 1), ("replicas", 1), ("nodes", 1), ("gpus_per_node", 1), ("cpu", 1),
                      ("speculative_num_steps", 1), ("speculative_num_draft_tokens", 2),
                      ("startup_minutes", 1), ("health_period_seconds", 1),
                      ("health_timeout_seconds", HEALTH_WAIT_S + 5), ("health_failures", 1),
                      ("drain_seconds", 1), ("router_drain_seconds", 1)):
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UsageError(f"{_option(name)} {value!r}: must be a whole number >= {low}"
                             + (_HEALTH_WAIT if name == "health_timeout_seconds" else ""))
    if s.router_drain_seconds <= s.drain_seconds:
        raise UsageError(f"--router-drain-seconds {s.router_drain_seconds} is not longer than "
                         f"--drain-seconds {s.drain_seconds}: a stopping router would drop the "
                         "requests that its stopping servers still finish; give more than "
                         f"{s.drain_seconds}")
    if s.health_timeout_seconds > s.health_period_seconds:
        raise UsageError(f"--health-timeout-seconds {s.health_timeout_seconds} is longer than "
                         f"--health-period-seconds {s.health_period_seconds}: a check would start "
                         "before the last one gave up; give a period at least as long")
    bad = [t for t in s.topologies if t not in TOPOLOGIES]
    if bad or not s.topologies:
        raise UsageError(f"--topology {','.join(s.topologies)!r}: choose among "
                         f"{', '.join(TOPOLOGIES)}")
    if flavor is not None:
        _check_router(s, flavor)
    _check_gpus(s)
    server_args = split_server_args(s.server_args)
    _check_server_args(server_args)
    for name in ("models_claim", "pull_secret"):
        value = getattr(s, name)
        if not isinstance(value, str) or not (_NAME.match(value) or name == "pull_secret"
                                              and value == ""):
            raise UsageError(f"{_option(name)} {value!r}: give a Kubernetes object name (lower-"
                             "case letters, digits and '-', e.g. sglang-models)")
    if not isinstance(s.models_dir, str) or not s.models_dir.startswith("/"):
        raise UsageError(f"--models-dir {s.models_dir!r}: give the host folder (absolute) that "
                         f"Compose mounts read-only at {MODELS_MOUNT}, e.g. /srv/models")
    _check_compose(s)
    _check_quantity("shm_size", s.shm_size)
    _check_quantity("memory", s.memory)
    if mebibytes(s.memory) <= mebibytes(s.shm_size):
        raise UsageError(f"--memory {s.memory}: a server's memory request holds its /dev/shm "
                         f"(--shm-size {s.shm_size}, memory-backed) and the process besides: "
                         "give more")
    return replace(s, threshold=threshold, server_args=server_args)


def _option(name: str) -> str:
    """The option that sets a setting (`nox -s deploy -- --help`)."""
    return "--" + name.replace("_", "-")


def _check_model(name: str, path: str) -> None:
    flag = "--model-path" if name == "model_path" else "--draft-model-path"
    example = "Llama-3.1-8B-Instruct" if name == "model_path" else "EAGLE3-LLaMA3.1-Instruct-8B"
    if not isinstance(path, str) or not path.strip():
        raise UsageError(f"no {'model' if name == 'model_path' else 'EAGLE-3 draft'} path: give "
                         f"{flag} PATH, its folder in the models volume (mounted read-only at "
                         f"{MODELS_MOUNT}), e.g. {flag} {example}, or set {name} in "
                         "deploy/serve.toml")
    full = in_models(path)
    if ".." in path.split("/") or not full.startswith(MODELS_MOUNT + "/"):
        raise UsageError(f"{flag} {path!r} is not a folder inside the models volume "
                         f"({MODELS_MOUNT}): give a path relative to it, or under {MODELS_MOUNT}/")


def _check_router(s: Settings, flavor: Flavor) -> None:
    """The router topology only where the flavor's image carries sglang-router (the router pod
    runs that image): elsewhere it would crash-loop on `No module named sglang_router`."""
    if "router" not in s.topologies or flavor.requires(ROUTER_DISTRIBUTION):
        return
    having = [n for n in flavor_names() if load_flavor(n).requires(ROUTER_DISTRIBUTION)]
    others = [t for t in s.topologies if t != "router"] or ["single"]
    raise UsageError(f"--topology router: the {flavor.name} image has no {ROUTER_DISTRIBUTION}, "
                     "so its router pod would crash-loop; the flavors whose image has it: "
                     f"{', '.join(having) or 'none'}. Publish one of them, or render without "
                     f"the router: {' '.join(f'--topology {t}' for t in others)}")


def _check_gpus(s: Settings) -> None:
    if "multinode" in s.topologies:
        if s.nodes < 2:
            raise UsageError(f"--nodes {s.nodes}: the multinode topology spans 2 nodes or more "
                             "(one node is the single topology)")
        if s.tp % s.nodes:
            raise UsageError(f"--tp {s.tp} over --nodes {s.nodes}: each node must hold the same "
                             f"number of GPUs, so TP must be a multiple of the node count (e.g. "
                             f"--tp {s.nodes * max(1, s.tp // s.nodes)})")
        if s.tp // s.nodes > s.gpus_per_node:
            raise UsageError(f"--tp {s.tp} over --nodes {s.nodes} needs {s.tp // s.nodes} GPUs "
                             f"per pod, more than a node holds (--gpus-per-node "
                             f"{s.gpus_per_node}): give more --nodes")
    one_pod = [t for t in s.topologies if t != "multinode"]
    if one_pod and s.tp > s.gpus_per_node:
        raise UsageError(f"--tp {s.tp}: a {'/'.join(one_pod)} server holds all its TP GPUs in "
                         f"one pod, and a node has {s.gpus_per_node} (--gpus-per-node): give "
                         f"--tp {s.gpus_per_node} or less, or render only the multinode topology "
                         f"(--topology multinode --nodes {-(-s.tp // s.gpus_per_node)})")


def _spelled(flag: str, table: Mapping[str, str]) -> str | None:
    """The flag of `table` that `flag` names: itself, or the flag it abbreviates (SGLang's
    parser takes a unique prefix, --tensor-parallel for --tensor-parallel-size)."""
    if flag in table:
        return flag
    if flag.startswith("--") and len(flag) > 3:
        return next((known for known in table if known.startswith(flag)), None)
    return None


def split_server_args(args: Sequence[object]) -> tuple[str, ...]:
    """The server flags as SGLang's parser must get them, one argv element each. A flag with
    words after it in one argument (`--server-arg='--tp-size 4'`, as people type it; as one argv
    element the server would refuse it and the pod crash-loop) is split as a shell splits a line
    (shlex: quotes keep a value with spaces whole). A value given as an argument of its own, and
    an argument without whitespace, stay as they are. Refused with the fix, where the split
    cannot be told: an unclosed quote, or words after `--flag=` (a value with spaces, or more
    flags?)."""
    split: list[str] = []
    for arg in args:
        if not isinstance(arg, str):
            raise UsageError(f"server_args: {arg!r} is not a string")
        if not arg.startswith("-") or not any(c.isspace() for c in arg):
            split.append(arg)
            continue
        try:
            words = shlex.split(arg)
        except ValueError as exc:
            raise UsageError(f"--server-arg {arg!r} cannot be split as a shell would ({exc}): "
                             "close the quote, or give the flag and its value as two arguments: "
                             f"--server-arg={arg.split()[0]} --server-arg=VALUE") from None
        flag, equals, value = arg.partition("=")
        if len(words) > 1 and equals and not any(c.isspace() for c in flag):
            raise UsageError(
                f"--server-arg {arg!r}: the words after {flag}= may be one value with spaces or "
                "more flags; give the flag and its value as two arguments: "
                f"--server-arg={flag} --server-arg={shlex.quote(value)}")
        split += words
    return tuple(split)


def _check_server_args(args: Sequence[str]) -> None:
    flags = [arg.split("=", 1)[0] for arg in args if arg.startswith("--")]
    for arg in args:
        flag = arg.split("=", 1)[0]
        owned = _spelled(flag, _OWNED)
        if owned is not None:
            raise UsageError(f"--server-arg {arg!r}: the deployment sets {owned} itself; give "
                             f"{_OWNED[owned]} instead")
        gpus = _spelled(flag, _GPU_COUNT)
        if gpus is None or (gpus in ("--dp-size", "--data-parallel-size")
                            and DP_ATTENTION_FLAG in flags):
            continue
        raise UsageError(f"--server-arg {arg!r}: {gpus} changes the GPUs a server takes: "
                         f"{_GPU_COUNT[gpus]}")


def _check_compose(s: Settings) -> None:
    try:
        ipaddress.ip_address(s.publish_address)
    except ValueError:
        raise UsageError(f"--publish-address {s.publish_address!r}: give the host's IP address "
                         "that Compose publishes port 30000 on: 127.0.0.1 (this host only), "
                         "0.0.0.0 (every interface) or one of its own") from None
    if not isinstance(s.api_key_env_file, str) or (s.api_key_env_file
                                                   and not s.api_key_env_file.startswith("/")):
        raise UsageError(f"--api-key-env-file {s.api_key_env_file!r}: give the host file "
                         "(absolute, outside the rendered folder, which a new rendering replaces) "
                         "that holds SGLANG_IMAGE_API_KEY=KEY, or nothing for no key")


def _check_quantity(name: str, text: object) -> None:
    number = text.rstrip("MGTi") if isinstance(text, str) else ""
    if not number.isdigit() or int(number) == 0 or str(text)[len(number):] not in QUANTITY_UNITS:
        what = "the shared memory" if name == "shm_size" else "the memory"
        raise UsageError(f"{_option(name)} {text!r}: give {what} as a quantity in Mi, Gi or Ti, "
                         "e.g. 16Gi")


def mebibytes(quantity: str) -> int:
    """A checked quantity (Mi, Gi or Ti) in Mi."""
    return int(quantity[:-2]) * {"Mi": 1, "Gi": 1024, "Ti": 1024**2}[quantity[-2:]]


# --- what each pod runs --------------------------------------------------------------------------

def server_args(s: Settings, *, multinode: bool = False) -> tuple[str, ...]:
    """The server's flags (after the image's entrypoint, which adds --host and --port). With
    `multinode`, the rank and rendezvous come from the LeaderWorkerSet's environment."""
    args = ["--model-path", s.model, "--tp-size", str(s.tp), "--enable-metrics",
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", s.draft,
            "--speculative-num-steps", str(s.speculative_num_steps),
            "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(s.speculative_num_draft_tokens),
            THRESHOLD_FLAG, str(s.threshold)]
    if multinode:
        args += ["--nnodes", f"$({LWS_GROUP_SIZE})", "--node-rank", f"$({LWS_WORKER_INDEX})",
                 "--dist-init-addr", f"$({LWS_LEADER_ADDRESS}):{DIST_INIT_PORT}"]
    return (*args, *s.server_args)


WORKER = "sglang-worker"  # the router topology's servers on one box (Compose services)
APP = "sglang"  # app.kubernetes.io/name of every object


def instance(topology: Topology) -> str:
    """app.kubernetes.io/instance of a topology's objects, and the stem of their names: two
    topologies in one namespace share no name and no selector."""
    return f"{APP}-{topology}"


# The model a deployment serves, on every object and in every selector: two models rendered
# into one namespace (each under a name prefix of its own) select only their own pods.
MODEL_LABEL = "sglang-image.io/model"
_LABEL_VALUE_MAX = 63


def model_label(s: Settings) -> str:
    """The model as a label value: its folder in the models volume, each character a label
    value cannot hold as '-', alphanumeric at both ends; one longer than 63 characters is cut,
    with a hash of the whole folder, so that two long names stay apart."""
    folder = posixpath.relpath(s.model, MODELS_MOUNT)
    value = re.sub(r"[^A-Za-z0-9._-]", "-", folder).strip("-._") or "model"
    if len(value) > _LABEL_VALUE_MAX:
        digest = hashlib.sha256(folder.encode()).hexdigest()[:8]
        value = f"{value[:_LABEL_VALUE_MAX - 9].rstrip('-._')}-{digest}"
    return value


def labels(s: Settings, topology: Topology, component: str) -> dict[str, str]:
    """The labels of a topology's objects and pods, and the selectors' (with `component`)."""
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": instance(topology),
            "app.kubernetes.io/component": component, MODEL_LABEL: model_label(s)}


def router_worker_labels(s: Settings) -> dict[str, str]:
    """The router topology's servers on Kubernetes: the labels of the StatefulSet's pods, which
    the router's service discovery selects (only these pods: not a multinode rank, not the
    router, not another model's)."""
    return labels(s, "router", "worker")


# The router reads its own namespace from this variable (the downward API): it watches the pods
# of that namespace alone, which a Role allows (a cluster-wide watch would need a ClusterRole).
NAMESPACE_ENV = "POD_NAMESPACE"


def worker_host(index: int) -> str:
    """A router topology server's name on one box (Compose), as the router resolves it."""
    return f"{WORKER}-{index}"


def worker_urls(s: Settings) -> tuple[str, ...]:
    """The router's workers on one box (Compose); Kubernetes finds them by label instead."""
    return tuple(f"http://{worker_host(i)}:{SERVER_PORT}" for i in range(s.replicas))


def worker_discovery(s: Settings) -> tuple[str, ...]:
    """sglang-router's flags that find the workers on Kubernetes: the pods of its namespace with
    router_worker_labels, each taken in once Ready and dropped once deleted (`kubectl scale`
    reaches it), on the servers' port."""
    return ("--service-discovery", "--selector",
            *(f"{k}={v}" for k, v in router_worker_labels(s).items()),
            "--service-discovery-port", str(SERVER_PORT),
            "--service-discovery-namespace", f"$({NAMESPACE_ENV})")


def router_args(s: Settings, platform: Platform) -> tuple[str, ...]:
    """sglang-router's flags: the workers (a list on one box, a label selector on Kubernetes), a
    start-up wait as long as theirs, a health check on the pace of the servers' readiness probe
    (its period, its timeout, its failures before a server is out: the router ejects no server
    that Kubernetes still counts as ready; its defaults, 5 s and 3 failures, ejected busy
    servers), and a circuit that opens after 3 failed attempts, fewer than the 5 attempts of one
    request: a request that meets a dead server is retried on a live one (with the default 10,
    the next requests fail until the health check catches up)."""
    workers = (("--worker-urls", *worker_urls(s)) if platform == "compose"
               else worker_discovery(s))
    return (*workers, "--host", "0.0.0.0",
            "--port", str(SERVER_PORT), "--policy", "cache_aware",
            "--worker-startup-timeout-secs", str(s.startup_minutes * 60),
            "--health-check-endpoint", "/health",
            "--health-check-interval-secs", str(s.health_period_seconds),
            "--health-check-timeout-secs", str(s.health_timeout_seconds),
            "--health-failure-threshold", str(s.health_failures),
            "--cb-failure-threshold", "3",
            "--shutdown-grace-period-secs", str(s.router_drain_seconds),
            "--prometheus-host", "0.0.0.0", "--prometheus-port", str(ROUTER_METRICS_PORT))


def pods(s: Settings, topology: Topology, platform: Platform = "kubernetes") -> list[Pod]:
    """The processes of a topology, in order (multinode: one entry per node rank, all of them
    from one pod template whose $(LWS_...) references each pod resolves itself)."""
    if topology == "single":
        return [Pod("server", server_args(s), s.tp)]
    if topology == "router":
        workers = [Pod(f"worker-{i}", server_args(s), s.tp) for i in range(s.replicas)]
        return [*workers, Pod("router", router_args(s, platform), 0)]
    template = server_args(s, multinode=True)
    return [Pod(f"node-{rank}", template, s.gpus_per_pod("multinode"))
            for rank in range(s.nodes)]


def box_gpus(s: Settings, index: int) -> tuple[str, ...]:
    """The GPUs of the router topology's server `index` on one box (Compose): consecutive blocks
    of TP; server 0 of the single topology gets the first block."""
    return tuple(str(gpu) for gpu in range(index * s.tp, (index + 1) * s.tp))


def fits_one_box(s: Settings) -> bool:
    """The router topology's servers fit the GPUs of one box (its Compose file is written)."""
    return s.replicas * s.tp <= s.gpus_per_node
