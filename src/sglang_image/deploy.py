"""`nox -s deploy -- --digest sha256:... --registry HOST/NAMESPACE`: the deployment manifests.

Writes, for one published image (by its digest) and the settings of deploy/serve.toml (options
override them), a Compose file for one box and Kustomize overlays for Kubernetes:

    OUT/compose.yaml               one server (`docker compose up -d`)
    OUT/compose.router.yaml        REPLICAS servers and sglang-router, on one box
    OUT/kubernetes/single/         one server on one node          (kubectl apply -k ...)
    OUT/kubernetes/router/         REPLICAS servers behind sglang-router
    OUT/kubernetes/multinode/      one server across NODES nodes (a LeaderWorkerSet)
    OUT/kubernetes/monitoring/     PodMonitors of them all (optional: the Prometheus Operator)

Every value is checked before any file is written; the flags come from topology.py. `nox -s
publish` writes the same with the digest it pushed.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape

from sglang_image import pins, plan, topology
from sglang_image.errors import UsageError
from sglang_image.pins import Flavor
from sglang_image.topology import (
    DIST_INIT_PORT,
    MODELS_MOUNT,
    QUANTITY_UNITS,
    ROUTER_METRICS_PORT,
    ROUTER_MODULE,
    SERVER_PORT,
    Settings,
    Topology,
    box_gpus,
    fits_one_box,
    pods,
    worker_host,
)

SETTINGS = pins.REPO_ROOT / "deploy" / "serve.toml"
DEFAULT_OUT = pins.REPO_ROOT / "out" / "deploy"
EXAMPLE_OUT = pins.REPO_ROOT / "deploy" / "example"
EXAMPLE_IMAGE = "registry.example.com/team/sglang-image@sha256:" + "0" * 64
# deploy/example: deploy/serve.toml rendered for an example image, every topology, TP 2
EXAMPLE_OPTIONS: dict[str, Any] = {"tp": 2, "topologies": list(topology.TOPOLOGIES)}
MARKER = "sglang-image-deploy.json"  # what was rendered, and the sign that OUT is ours to replace
PYTHON = "/opt/venv/bin/python"
HEALTHCHECK = [PYTHON, "/opt/sglang-image/tool/healthcheck.py"]  # the image's own
LWS_API = "leaderworkerset.x-k8s.io/v1"
HOSTNAME_LABEL = "kubernetes.io/hostname"  # the node, as the scheduler's topology key
NAME = "sglang"  # the Service clients use in every topology, and the service account
LABELS = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/part-of": plan.IMAGE_REPO}
ENV = {"HF_HUB_OFFLINE": "1"}  # models come from the volume: never from a hub at run time
# The router runs the image but needs no GPU: without this the NVIDIA container runtime would
# give it every GPU of its node (the image asks for all of them).
ROUTER_ENV = {"NVIDIA_VISIBLE_DEVICES": "void"}
# Kernels compiled at run time (FlashInfer's JIT, Triton, TorchInductor) land under the home
# folder: a volume there outlives a container restart (a liveness restart compiles nothing again).
CACHE_MOUNT = "/home/sglang/.cache"
# The image sets the same two (images/Dockerfile); a manifest names them for an image built before.
CACHE_ENV = {"TRITON_CACHE_DIR": f"{CACHE_MOUNT}/triton",
             "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_MOUNT}/torchinductor"}
# The API key every server (and the router) then requires: from Compose's env file
# (api_key_env_file), read by the image's entrypoint (images/tool/entrypoint.sh), never written
# into a manifest.
API_KEY_ENV = "SGLANG_IMAGE_API_KEY"


# --- Compose -------------------------------------------------------------------------------------

def _compose_server(s: Settings, image: str, args: Sequence[str], gpus: Sequence[str],
                    cache: str) -> dict[str, Any]:
    return {
        "image": image,
        "command": list(args),
        "user": "1000:1000",
        "shm_size": _docker_size(s.shm_size),
        "environment": {**ENV, **CACHE_ENV},
        **_api_key(s),
        # the kernels it compiled, in a named volume: a new container compiles nothing again
        "volumes": [_models_bind(s), {"type": "volume", "source": cache, "target": CACHE_MOUNT}],
        "ulimits": {"memlock": -1, "stack": 67108864},
        "deploy": {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "device_ids": list(gpus), "capabilities": ["gpu"]}]}}},
        "healthcheck": {"test": ["CMD", *HEALTHCHECK], "interval": "30s", "timeout": "30s",
                        "retries": 3, "start_period": f"{s.startup_minutes}m"},
        # SIGTERM, then this long to drain (no preStop here: nothing routes by endpoints)
        "stop_grace_period": f"{s.drain_seconds + EXIT_S}s",
        "restart": "unless-stopped",
    }


def _models_bind(s: Settings) -> dict[str, Any]:
    return {"type": "bind", "source": s.models_dir, "target": MODELS_MOUNT, "read_only": True}


def _docker_size(quantity: str) -> str:
    return quantity[:-2] + QUANTITY_UNITS[quantity[-2:]]


def _api_key(s: Settings) -> dict[str, Any]:
    """The env file that holds API_KEY_ENV, where one is set (Compose refuses to start without
    the file)."""
    return {"env_file": [s.api_key_env_file]} if s.api_key_env_file else {}


def _published(s: Settings) -> list[dict[str, Any]]:
    """The server port on the host, on publish_address only (loopback by default: a server
    without an API key is no service for every interface)."""
    return [{"target": SERVER_PORT, "published": str(SERVER_PORT), "host_ip": s.publish_address,
             "protocol": "tcp"}]


def _cache_volume(service: str) -> str:
    return f"{service}-cache"


def compose_single(s: Settings, image: str) -> dict[str, Any]:
    (server,) = pods(s, "single", "compose")
    service = _compose_server(s, image, server.args, box_gpus(s, 0), _cache_volume(NAME))
    return {"name": NAME, "services": {NAME: {**service, "ports": _published(s)}},
            "volumes": {_cache_volume(NAME): {}}}


# The router's healthcheck (no curl in the image): 200 once a server behind it is healthy.
_READINESS = ("import urllib.request; urllib.request."
              f"urlopen('http://127.0.0.1:{SERVER_PORT}/readiness', timeout=4)")


def compose_router(s: Settings, image: str) -> dict[str, Any]:
    *workers, router = pods(s, "router", "compose")
    services = {worker_host(i): _compose_server(s, image, w.args, box_gpus(s, i),
                                                _cache_volume(worker_host(i)))
                for i, w in enumerate(workers)}
    volumes: dict[str, Any] = {_cache_volume(name): {} for name in services}
    services[f"{NAME}-router"] = {
        "image": image,
        "entrypoint": _router_entrypoint(s),
        "command": list(router.args),
        "user": "1000:1000",
        "environment": {**ENV, **ROUTER_ENV},
        **_api_key(s),
        # the servers' tokenizer, read where they report it (else the router asks a hub)
        "volumes": [_models_bind(s)],
        "ports": _published(s),
        "depends_on": {name: {"condition": "service_healthy"} for name in services},
        "healthcheck": {"test": ["CMD", PYTHON, "-c", _READINESS],
                        "interval": "10s", "timeout": "5s", "retries": 3},
        # Compose stops it first (it depends on the servers): the servers still answer what
        # it passed them while it drains
        "stop_grace_period": f"{s.router_drain_seconds + EXIT_S}s",
        "restart": "unless-stopped",
    }
    return {"name": f"{NAME}-router", "services": services, "volumes": volumes}


# With an API key the router passes it to the servers and requires it of its clients: its
# --api-key, added from the env file by a shell ($$: Compose's escape of a $ it must leave alone).
_ROUTER_WITH_KEY = (f'if [ -n "$${{{API_KEY_ENV}:-}}" ]; then set -- "$$@" --api-key '
                    f'"$${API_KEY_ENV}"; fi; exec {PYTHON} -m {ROUTER_MODULE} "$$@"')


def _router_entrypoint(s: Settings) -> list[str]:
    if not s.api_key_env_file:
        return [PYTHON, "-m", ROUTER_MODULE]
    return ["/bin/sh", "-c", _ROUTER_WITH_KEY, f"{NAME}-router"]


# --- Kubernetes ----------------------------------------------------------------------------------
# Every object of a topology is named sglang-<topology>[-part] and labelled with its instance
# (topology.instance) and its model (topology.model_label): two topologies in one namespace share
# no name and no selector, and two models (each under a name prefix) no selector. No object is
# shared between them (each has its own service account): deleting one leaves the other whole.

def _labels(s: Settings, topology_name: Topology, component: str) -> dict[str, str]:
    return {**topology.labels(s, topology_name, component), **LABELS}


def _meta(s: Settings, name: str, topology_name: Topology, component: str) -> dict[str, Any]:
    return {"name": name, "labels": _labels(s, topology_name, component)}


STARTUP_PERIOD_S = 30  # the startup probe's: startup_minutes of them before a start has failed
LIVENESS_PERIOD_S, LIVENESS_FAILURES = 60, 5  # a restart only after 5 minutes unanswered


def _probe(path: str, period: int, failures: int, timeout: int = 5,
           port: str = "http") -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "timeoutSeconds": timeout, "failureThreshold": failures}


_CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
# A deleted pod first keeps serving while the Service and the router drop it (seconds); then
# SIGTERM. SGLang 0.5.23 drains on it: /health answers 503, running requests finish (it looks
# every 5 s, with no limit of its own), then its schedulers get 15 s to exit (sglang/srt/managers/
# tokenizer_manager.py: SignalHandler.sigterm_handler, sigterm_watchdog,
# _SCHEDULER_EXIT_TIMEOUT_SECS). sglang-router stops taking connections and waits for the
# requests it passed on (--shutdown-grace-period-secs). The grace is the sum; then SIGKILL.
PRE_STOP_S = 15
EXIT_S = 20  # SGLang's 5 s look and its schedulers' 15 s; the router needs less
_PRE_STOP = {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_S)]}}}


def server_grace(s: Settings) -> int:
    """A server pod's terminationGracePeriodSeconds: its drain and exit after the preStop."""
    return PRE_STOP_S + s.drain_seconds + EXIT_S


def router_grace(s: Settings) -> int:
    """The router pod's: longer than a server's (router_drain_seconds > drain_seconds), so that
    the requests it passed on finish on servers that drain as long."""
    return PRE_STOP_S + s.router_drain_seconds + EXIT_S


def startup_failures(s: Settings) -> int:
    """The startup probe's failureThreshold: startup_minutes of its periods."""
    return s.startup_minutes * 60 // STARTUP_PERIOD_S


# Before the startup probe's clock runs, the pod is scheduled and the image (gigabytes) pulled.
PROGRESS_MARGIN_S = 600


def progress_deadline(s: Settings) -> int:
    """progressDeadlineSeconds of every Deployment: the servers' startup budget (the startup
    probe's period x failures) and a margin, not Kubernetes' default 600 s, which marks a
    healthy first start (weights, graphs, kernel compilation) failed. The router's Deployment
    gets it too: it is not ready before a server is."""
    return STARTUP_PERIOD_S * startup_failures(s) + PROGRESS_MARGIN_S


def _server_pod(s: Settings, image: str, args: Sequence[str], gpus: int, account: str,
                ports: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """A server's pod spec: uid 1000, /dev/shm sized, the GPUs, CPU and memory requested, the
    models read-only, a kernel cache, probes on /health that allow the first start (kernel
    compilation) its minutes, and a drain before it stops. `ports`: more than its http."""
    container = {
        "name": NAME,
        "image": image,
        "args": list(args),
        "env": [{"name": k, "value": v} for k, v in {**ENV, **CACHE_ENV}.items()],
        # /metrics (--enable-metrics) is served on this port too
        "ports": [{"name": "http", "containerPort": SERVER_PORT}, *ports],
        "resources": {"requests": {"nvidia.com/gpu": gpus, "cpu": str(s.cpu),
                                   "memory": s.memory},
                      "limits": {"nvidia.com/gpu": gpus}},
        "volumeMounts": [_MODELS_MOUNT, {"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "cache", "mountPath": CACHE_MOUNT}],
        # /health generates a token (SGLang 0.5.23): every probe waits health_timeout_seconds;
        # the readiness probe's pace is the router's health check's too (topology.router_args).
        "startupProbe": _probe("/health", STARTUP_PERIOD_S, startup_failures(s),
                               s.health_timeout_seconds),
        "readinessProbe": _probe("/health", s.health_period_seconds, s.health_failures,
                                 s.health_timeout_seconds),
        "livenessProbe": _probe("/health", LIVENESS_PERIOD_S, LIVENESS_FAILURES,
                                s.health_timeout_seconds),
        "lifecycle": _PRE_STOP,
        "securityContext": _CONTAINER_SECURITY,
    }
    spec = _pod(container, account, volumes=[
        _models_volume(s), {"name": "dshm", "emptyDir": {"medium": "Memory",
                                                          "sizeLimit": s.shm_size}},
        {"name": "cache", "emptyDir": {}}])
    return {**spec, "terminationGracePeriodSeconds": server_grace(s)}


_MODELS_MOUNT = {"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True}


def _models_volume(s: Settings) -> dict[str, Any]:
    return {"name": "models", "persistentVolumeClaim": {"claimName": s.models_claim,
                                                        "readOnly": True}}


def _pod(container: dict[str, Any], account: str, volumes: list[dict[str, Any]],
         api_token: bool = False) -> dict[str, Any]:
    return {
        "serviceAccountName": account,
        "automountServiceAccountToken": api_token,
        # No <SERVICE>_PORT=tcp://... variables from the namespace's Services in the container.
        "enableServiceLinks": False,
        "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
    }


def _account(s: Settings, name: str, topology_name: Topology, component: str,
             api_token: bool = False) -> dict[str, Any]:
    account: dict[str, Any] = {"apiVersion": "v1", "kind": "ServiceAccount",
                               "metadata": _meta(s, name, topology_name, component),
                               "automountServiceAccountToken": api_token}
    if s.pull_secret:
        account["imagePullSecrets"] = [{"name": s.pull_secret}]
    return account


def _service(s: Settings, name: str, selector: dict[str, str], topology_name: Topology,
             component: str, *, headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": selector,
        "ports": [{"name": "http", "port": SERVER_PORT, "targetPort": "http"}],
    }
    if headless:  # each server by its own name, from its first start on
        spec |= {"clusterIP": "None", "publishNotReadyAddresses": True}
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(s, name, topology_name, component), "spec": spec}


def client_service(topology_name: Topology) -> str:
    """The Service clients use. multinode: the LeaderWorkerSet controller makes a headless
    Service named after the group itself (its pods' DNS), so clients get the leader's."""
    name = topology.instance(topology_name)
    return f"{name}-leader" if topology_name == "multinode" else name


def kube_single(s: Settings, image: str) -> dict[str, list[dict[str, Any]]]:
    (server,) = pods(s, "single")
    name = topology.instance("single")
    selector = _labels(s, "single", "server")
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(s, name, "single", "server"),
        "spec": {"replicas": 1, "strategy": {"type": "Recreate"},  # the GPUs are freed first
                 "progressDeadlineSeconds": progress_deadline(s),
                 "selector": {"matchLabels": selector},
                 "template": {"metadata": {"labels": selector},
                              "spec": _server_pod(s, image, server.args, server.gpus, name)}},
    }
    return {"server.yaml": [_account(s, name, "single", "server"), deployment,
                            _service(s, client_service("single"), selector, "single", "server")]}


# What the router's service discovery asks of the API server: a watch on its namespace's pods.
ROUTER_RULES = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]


def kube_router(s: Settings, image: str) -> dict[str, list[dict[str, Any]]]:
    *workers, router = pods(s, "router")
    if len({w.args for w in workers}) != 1:  # one StatefulSet template holds every worker
        raise AssertionError("the router topology's servers differ")
    name = topology.instance("router")
    worker_name = f"{name}-worker"
    worker_sel = _labels(s, "router", "worker")
    if not topology.router_worker_labels(s).items() <= worker_sel.items():
        raise AssertionError("the router's service discovery would miss its workers")
    statefulset = {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": _meta(s, worker_name, "router", "worker"),
        "spec": {"serviceName": worker_name, "replicas": len(workers),
                 "podManagementPolicy": "Parallel",  # every server compiles at once
                 "selector": {"matchLabels": worker_sel},
                 "template": {"metadata": {"labels": worker_sel},
                              "spec": _server_pod(s, image, workers[0].args, workers[0].gpus,
                                                  worker_name)}},
    }
    budget = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
              "metadata": _meta(s, worker_name, "router", "worker"),
              "spec": {"maxUnavailable": 1, "selector": {"matchLabels": worker_sel}}}
    router_sel = _labels(s, "router", "router")
    container = {
        "name": "router", "image": image, "command": [PYTHON, "-m", ROUTER_MODULE],
        "args": list(router.args),
        "ports": [{"name": "http", "containerPort": SERVER_PORT},
                  {"name": "metrics", "containerPort": ROUTER_METRICS_PORT}],
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "env": [{"name": topology.NAMESPACE_ENV,
                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                *({"name": k, "value": v} for k, v in {**ENV, **ROUTER_ENV}.items())],
        # the servers' tokenizer, read where they report it (else the router asks a hub)
        "volumeMounts": [_MODELS_MOUNT],
        "readinessProbe": _probe("/readiness", 5, 3),  # 503 until a server is healthy
        "livenessProbe": _probe("/liveness", 10, 3),
        "lifecycle": _PRE_STOP,
        "securityContext": _CONTAINER_SECURITY,
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(s, name, "router", "router"),
        "spec": {"replicas": 1, "progressDeadlineSeconds": progress_deadline(s),
                 "selector": {"matchLabels": router_sel},
                 "template": {"metadata": {"labels": router_sel},
                              "spec": {**_pod(container, name, [_models_volume(s)],
                                              api_token=True),
                                       "terminationGracePeriodSeconds": router_grace(s)}}},
    }
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _meta(s, name, "router", "router"), "rules": ROUTER_RULES}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": _meta(s, name, "router", "router"),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": name}]}
    return {"workers.yaml": [_account(s, worker_name, "router", "worker"),
                             _service(s, worker_name, worker_sel, "router", "worker",
                                      headless=True),
                             statefulset, budget],
            "router.yaml": [_account(s, name, "router", "router", api_token=True), role, binding,
                            deployment,
                            _service(s, client_service("router"), router_sel, "router", "router")]}


def kube_multinode(s: Settings, image: str) -> dict[str, list[dict[str, Any]]]:
    nodes = pods(s, "multinode")
    if len({p.args for p in nodes}) != 1:  # one template, resolved by each pod's LWS variables
        raise AssertionError("the multinode pods differ")
    name = topology.instance("multinode")
    leader, follower = ({"labels": _labels(s, "multinode", role)}
                        for role in ("leader", "follower"))
    # The leader's torch.distributed rendezvous (--dist-init-addr), declared on every rank.
    spec = _server_pod(s, image, nodes[0].args, nodes[0].gpus, name,
                       ports=[{"name": "dist-init", "containerPort": DIST_INIT_PORT}])
    # No two pods of this LeaderWorkerSet on one node: a group spans `nodes` nodes, and two
    # groups (replicas) never share one, so that one lost node takes one group down, not two.
    group = {k: v for k, v in leader["labels"].items() if k != "app.kubernetes.io/component"}
    spec["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": group}, "topologyKey": HOSTNAME_LABEL}]}}
    lws = {
        "apiVersion": LWS_API, "kind": "LeaderWorkerSet",
        "metadata": _meta(s, name, "multinode", "server"),
        "spec": {"replicas": 1, "startupPolicy": "LeaderCreated",
                 "leaderWorkerTemplate": {
                     "size": len(nodes), "restartPolicy": "RecreateGroupOnPodRestart",
                     "leaderTemplate": {"metadata": leader, "spec": spec},
                     "workerTemplate": {"metadata": follower, "spec": spec}}},
    }
    # The leader by our labels alone (they name the model): a name prefix of a user's overlay,
    # which renames the LeaderWorkerSet, leaves the selector right.
    leader_sel = _labels(s, "multinode", "leader")
    return {"leaderworkerset.yaml": [
        _account(s, name, "multinode", "server"), lws,
        _service(s, client_service("multinode"), leader_sel, "multinode", "leader")]}


def pod_monitors(s: Settings) -> list[dict[str, Any]]:
    """Prometheus Operator PodMonitors (optional: kubernetes/monitoring): every server's /metrics
    on its http port (a multinode group's leader: rank 0's scheduler alone reports the server's
    series), the router's on its metrics port; of this model's pods, in every topology."""
    model = {**LABELS, topology.MODEL_LABEL: topology.model_label(s)}
    servers = {"matchLabels": model, "matchExpressions": [
        {"key": "app.kubernetes.io/component", "operator": "In",
         "values": ["server", "worker", "leader"]}]}
    router = {"matchLabels": {**model, "app.kubernetes.io/component": "router"}}
    return [{"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
             "metadata": {"name": f"{NAME}-{what}",
                          "labels": {**model, "app.kubernetes.io/component": "monitoring"}},
             "spec": {"selector": selector,
                      "podMetricsEndpoints": [{"port": port, "path": "/metrics"}]}}
            for what, selector, port in (("servers", servers, "http"),
                                         ("router", router, "metrics"))]


KUBE_TOPOLOGIES = {"single": kube_single, "router": kube_router, "multinode": kube_multinode}
# Where a name prefix of a user's overlay (two models in one namespace) must reach: Kustomize
# renames the ServiceAccount, and knows the references of built-in kinds only, not those of a
# LeaderWorkerSet's pod templates (a configuration of a base reaches every overlay of it).
KUSTOMIZE_CONFIG = "kustomizeconfig.yaml"
KUSTOMIZE_CONFIGS: dict[Topology, dict[str, Any]] = {"multinode": {"nameReference": [
    {"kind": "ServiceAccount", "fieldSpecs": [
        {"kind": "LeaderWorkerSet",
         "path": f"spec/leaderWorkerTemplate/{template}/spec/serviceAccountName"}
        for template in ("leaderTemplate", "workerTemplate")]}]}}


# --- rendering -----------------------------------------------------------------------------------

class _Dumper(yaml.SafeDumper):
    """Block YAML a reader follows: a pod spec shared by two templates is written out twice
    (no &anchor / *alias)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _yaml(documents: Iterable[dict[str, Any]], header: str) -> str:
    return header + "---\n".join(yaml.dump(d, Dumper=_Dumper, sort_keys=False, width=100)
                                 for d in documents)


def render(s: Settings, image: str) -> dict[str, str]:
    """Relative path -> text of every file for checked settings and an image by digest."""
    header = (f"# Rendered by `nox -s deploy` for {image}\n"
              "# from deploy/serve.toml and its options: do not edit, render again.\n")
    if image == EXAMPLE_IMAGE:
        header += ("# An example image: render yours with `nox -s deploy -- --digest sha256:... "
                   "--registry HOST/NAMESPACE`.\n")
    files: dict[str, str] = {}
    if "single" in s.topologies:
        files["compose.yaml"] = _yaml([compose_single(s, image)], header)
    if "router" in s.topologies and fits_one_box(s):
        files["compose.router.yaml"] = _yaml([compose_router(s, image)], header)
    for name in s.topologies:
        made = KUBE_TOPOLOGIES[name](s, image)
        for path, docs in made.items():
            files[f"kubernetes/{name}/{path}"] = _yaml(docs, header)
        kustomization = _kustomization([*made])
        if name in KUSTOMIZE_CONFIGS:
            files[f"kubernetes/{name}/{KUSTOMIZE_CONFIG}"] = _yaml([KUSTOMIZE_CONFIGS[name]],
                                                                   header)
            kustomization["configurations"] = [KUSTOMIZE_CONFIG]
        files[f"kubernetes/{name}/kustomization.yaml"] = _yaml([kustomization], header)
    files["kubernetes/monitoring/podmonitors.yaml"] = _yaml(pod_monitors(s), header)
    files["kubernetes/monitoring/kustomization.yaml"] = _yaml(
        [_kustomization(["podmonitors.yaml"])], header)
    files[MARKER] = json.dumps({"image": image, "settings": asdict(s)}, indent=1) + "\n"
    return files


def _kustomization(resources: list[str]) -> dict[str, Any]:
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": resources}


def check_out(out: Path) -> Path:
    """`out`, resolved, where a rendering may go: new, empty, or an earlier rendering."""
    out = out.resolve()
    if out.exists() and (not out.is_dir() or (any(out.iterdir())
                                              and not (out / MARKER).is_file())):
        raise UsageError(f"--out {out} exists and is not a rendering of `nox -s deploy`: give a "
                         "new or empty folder")
    return out


def write(files: dict[str, str], out: Path) -> Path:
    """Writes the rendering to `out` whole: a folder of an earlier rendering is replaced, any
    other non-empty folder refused (nothing written)."""
    out = check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        for relative, text in files.items():
            path = staging / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def apply_hint(out: Path, s: Settings) -> list[str]:
    """The commands that start what was written (paths relative to here where they can be)."""
    if out.is_relative_to(Path.cwd()):
        out = out.relative_to(Path.cwd())
    lines = []
    if "single" in s.topologies:
        lines.append(f"docker compose -f {out / 'compose.yaml'} up -d")
    lines += [f"kubectl apply -k {out / 'kubernetes' / t}" for t in s.topologies]
    lines.append(f"(with the Prometheus Operator: kubectl apply -k {out / 'kubernetes' / 'monitoring'})")
    if "router" in s.topologies and not fits_one_box(s):
        lines.append(f"(no compose.router.yaml: {s.replicas} servers of TP {s.tp} need more "
                     f"than the {s.gpus_per_node} GPUs of one box)")
    return lines


# --- the command ---------------------------------------------------------------------------------

# option -> what it sets (each overrides deploy/serve.toml; a setting's comment there says more)
OPTIONS: dict[str, tuple[type, str]] = {
    "threshold": (str, "N running requests above which the servers stop speculating, or auto"),
    "model_path": (str, f"the model's folder in the models volume (mounted at {MODELS_MOUNT})"),
    "draft_model_path": (str, "the EAGLE-3 draft's folder in the models volume"),
    "tp": (int, "GPUs of one server (SGLang's --tp-size; multinode: over all its nodes)"),
    "replicas": (int, "servers behind the router (router topology)"),
    "nodes": (int, "nodes one server spans (multinode topology)"),
    "gpus_per_node": (int, "GPUs of one node or box: a pod holds at most this many"),
    "shm_size": (str, "each server's /dev/shm, e.g. 16Gi"),
    "cpu": (int, "CPU cores each server requests (Kubernetes)"),
    "memory": (str, "memory each server requests, its /dev/shm included, e.g. 64Gi (Kubernetes)"),
    "startup_minutes": (int, ("how long a server may take to start (model load, first kernel "
                              "compilation) before it counts as failed")),
    "health_period_seconds": (int, ("seconds between two /health checks of a server: its "
                                    "readiness probe and the router's health check")),
    "health_timeout_seconds": (int, "how long each /health check waits for an answer"),
    "health_failures": (int, ("failed /health checks in a row before a server takes no more "
                              "requests (Kubernetes' readiness and the router alike)")),
    "drain_seconds": (int, ("how long a stopping server may finish its running requests "
                            "(Kubernetes' grace, Compose's stop_grace_period)")),
    "router_drain_seconds": (int, ("how long a stopping router waits for the requests it passed "
                                   "on: more than drain_seconds")),
    "models_claim": (str, "the PersistentVolumeClaim that holds the models (Kubernetes)"),
    "models_dir": (str, "the host folder that holds the models (Compose)"),
    "publish_address": (str, ("the host address Compose publishes port 30000 on (default "
                              "127.0.0.1; 0.0.0.0: every interface)")),
    "api_key_env_file": (str, (f"Compose: a host file with {API_KEY_ENV}=KEY; every server and "
                               "the router then require that key")),
    "pull_secret": (str, "the image pull secret of a private registry (Kubernetes)"),
}


def settings(path: Path, options: Mapping[str, Any], flavor: Flavor | None = None) -> Settings:
    """deploy/serve.toml with the options given over it, checked (UsageError otherwise)."""
    return topology.check(topology.override(topology.load(path), options), flavor)


def deploy(s: Settings, image: str, out: Path) -> Path:
    """Renders checked settings for `image` (REGISTRY/REPOSITORY@sha256:...) into `out`."""
    return write(render(s, image), out)


@dataclass(frozen=True, kw_only=True)
class DeployOptions:
    """What `nox -s deploy` was asked for, besides the image's flavor; checked when made (the
    settings and the values given over them: by `run`, before any file is written)."""

    image: str | None = None  # REGISTRY/REPOSITORY@sha256:... (imageref.Target.by_digest)
    out: Path | None = None  # default: DEFAULT_OUT (with example: EXAMPLE_OUT)
    settings: Path = SETTINGS
    overrides: Mapping[str, Any] = field(default_factory=dict)  # setting -> value (None: not given)
    example: bool = False  # maintainers: deploy/example, for EXAMPLE_IMAGE (MAINTAINING.md)

    def __post_init__(self) -> None:
        if self.image is None and not self.example:
            raise UsageError("give --digest sha256:... and --registry HOST[:PORT]/NAMESPACE "
                             "(what `nox -s publish` printed)")


def run(flavor: Flavor | None, options: DeployOptions) -> int:
    """`nox -s deploy`: checks the settings with the options over them, writes the manifests and
    says how to start them (stderr). `flavor`: the image's, where known (`auto` needs the plugin)."""
    overrides = dict(options.overrides)
    if options.example or options.image is None:  # None only with example (checked when made)
        image, out = EXAMPLE_IMAGE, options.out or EXAMPLE_OUT
        overrides |= {k: v for k, v in EXAMPLE_OPTIONS.items() if overrides.get(k) is None}
    else:
        image, out = options.image, options.out or DEFAULT_OUT
    checked = settings(options.settings, overrides, flavor)
    written = deploy(checked, image, out)
    console = Console(stderr=True, soft_wrap=True, highlight=False)
    console.print(f"[bold green]wrote[/] {escape(str(written))} for {escape(image)}")
    for line in apply_hint(written, checked):
        console.print(f"  {escape(line)}")
    return 0
