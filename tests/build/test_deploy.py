"""The deployment manifests (nox -s deploy, and nox -s publish's): what each pod receives, built by
the real Kustomize and checked against the Kubernetes and LeaderWorkerSet schemas; the Compose
files through Compose v2; bad input refused before any file is written; deploy/example in step."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from sglang_image import cli, deploy, pins, publish, topology
from sglang_image.errors import UsageError
from tests import deploy_checks as checks

DIGEST = "sha256:" + "ab" * 32
REGISTRY = "registry.example.com/team"
IMAGE = f"{REGISTRY}/sglang-image@{DIGEST}"
ENTRYPOINT_ARGS = ["--host", "0.0.0.0", "--port", "30000"]  # images/tool/entrypoint.sh adds them


def render(tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "rendered"
    assert cli.main(["deploy", "--digest", DIGEST, "--registry", REGISTRY, "--out", str(out),
                     *extra]) == 0
    return out


def built(out: Path, topology_name: str) -> dict[tuple[str, str], dict[str, Any]]:
    """The overlay as `kubectl apply -k` sends it, each document validated: (kind, name) -> doc."""
    docs = checks.kustomize(out / "kubernetes" / topology_name)
    for doc in docs:
        checks.validate(doc)
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod_spec["containers"]
    return dict(only)


def check_server_pod(spec: dict[str, Any], gpus: int) -> dict[str, Any]:
    """What every server pod has: the image by digest, uid 1000, /dev/shm sized, its GPUs, the
    models read-only, probes on /health with the start-up allowance. Returns its container."""
    c = container(spec)
    assert c["image"] == IMAGE
    assert spec["securityContext"]["runAsUser"] == 1000 and spec["securityContext"]["runAsNonRoot"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert c["resources"]["requests"]["nvidia.com/gpu"] == gpus
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"] == {"medium": "Memory",
                                                               "sizeLimit": "16Gi"}
    models = mounts[topology.MODELS_MOUNT]
    assert models["readOnly"] and volumes[models["name"]]["persistentVolumeClaim"] == {
        "claimName": "sglang-models", "readOnly": True}
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] == 30 * 60
    # /health generates a token and may wait 20 s (sglang 0.5.23): no probe gives up sooner.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["timeoutSeconds"] >= 25 and c[probe]["httpGet"]["path"] == "/health"
    # Not BestEffort (evicted first): CPU and memory requested, the memory above /dev/shm's.
    assert c["resources"]["requests"]["cpu"] == "8"
    assert c["resources"]["requests"]["memory"] == "64Gi"
    # No service-link variables (SGLANG_PORT=tcp://... beside a Service named sglang).
    assert spec["enableServiceLinks"] is False and spec["automountServiceAccountToken"] is False
    # A drain before SIGTERM, within the grace; compiled kernels outlive a container restart.
    assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] > int(c["lifecycle"]["preStop"]["exec"][
        "command"][1])
    cache = volumes[mounts["/home/sglang/.cache"]["name"]]
    assert cache == {"name": cache["name"], "emptyDir": {}}
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["TRITON_CACHE_DIR"].startswith("/home/sglang/.cache/")
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith("/home/sglang/.cache/")
    # Metrics on, served on the http port that a PodMonitor scrapes.
    assert "--enable-metrics" in c["args"]
    return c


def check_serving_flags(argv: dict[str, list[str]], tp: int) -> None:
    assert argv["--model-path"] == ["/models/Llama-3.1-8B-Instruct"]
    assert argv["--speculative-draft-model-path"] == ["/models/EAGLE3-LLaMA3.1-Instruct-8B"]
    assert argv["--speculative-algorithm"] == ["EAGLE3"]
    assert argv["--speculative-eagle-topk"] == ["1"]
    assert argv["--tp-size"] == [str(tp)]
    assert argv[topology.THRESHOLD_FLAG] == ["32"]


# --- what each pod receives ----------------------------------------------------------------------

def test_single_server_pod(tmp_path: Path) -> None:
    out = render(tmp_path, "--topology", "single", "--tp", "2")
    objects = built(out, "single")
    assert set(objects) == {("ServiceAccount", "sglang-single"), ("Deployment", "sglang-single"),
                            ("Service", "sglang-single")}
    deployment = objects[("Deployment", "sglang-single")]
    assert deployment["spec"]["replicas"] == 1
    spec = deployment["spec"]["template"]["spec"]
    c = check_server_pod(spec, gpus=2)
    check_serving_flags(checks.flags(ENTRYPOINT_ARGS + c["args"]), tp=2)
    assert "--nnodes" not in c["args"]
    # The Service reaches the pod: its selector matches the template's labels, its port the pod's.
    service = objects[("Service", "sglang-single")]["spec"]
    assert service["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert service["ports"][0]["targetPort"] == c["ports"][0]["name"]


@pytest.mark.parametrize("replicas", [2, 3])
def test_router_and_its_workers(tmp_path: Path, replicas: int) -> None:
    out = render(tmp_path, "--topology", "router", "--replicas", str(replicas))
    objects = built(out, "router")
    statefulset = objects[("StatefulSet", "sglang-router-worker")]
    headless = objects[("Service", statefulset["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    c = check_server_pod(statefulset["spec"]["template"]["spec"], gpus=1)
    check_serving_flags(checks.flags(c["args"]), tp=1)
    assert statefulset["spec"]["replicas"] == replicas
    router = objects[("Deployment", "sglang-router")]["spec"]["template"]["spec"]
    rc = container(router)
    assert rc["image"] == IMAGE and rc["command"][1:] == ["-m", "sglang_router.launch_router"]
    # No GPU: neither requested nor, through the image's NVIDIA_VISIBLE_DEVICES=all, every GPU
    # of the node.
    assert "nvidia.com/gpu" not in json.dumps(rc["resources"])
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in rc["env"]
    # It finds the workers by label in its own namespace: exactly the StatefulSet's pods, on the
    # port their container listens on (`kubectl scale` reaches it).
    router_flags = checks.flags(rc["args"])
    assert "--worker-urls" not in router_flags and "--service-discovery" in router_flags
    selector = dict(item.split("=", 1) for item in router_flags["--selector"])
    assert selector.items() <= pod_labels.items()
    assert router_flags["--service-discovery-port"] == [str(c["ports"][0]["containerPort"])]
    namespace_env = next(e for e in rc["env"] if e["name"] == "POD_NAMESPACE")
    assert namespace_env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert router_flags["--service-discovery-namespace"] == ["$(POD_NAMESPACE)"]
    # With the least RBAC it needs: a watch on the pods of its namespace (a Role, no ClusterRole).
    assert router["serviceAccountName"] == "sglang-router" and router["automountServiceAccountToken"]
    role = objects[("Role", "sglang-router")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    binding = objects[("RoleBinding", "sglang-router")]
    assert binding["roleRef"]["name"] == "sglang-router"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "sglang-router"}]
    assert not [kind for kind, _ in objects if kind.startswith("Cluster")]
    # The servers get no API token.
    assert statefulset["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    # It waits for the servers as long as they may take to start.
    assert router_flags["--worker-startup-timeout-secs"] == [str(30 * 60)]
    assert rc["readinessProbe"]["httpGet"]["path"] == "/readiness"
    # The servers report their model as /models/...: the router reads the tokenizer there, from
    # the same claim, read-only (else it would look for it on a hub).
    (mount,) = rc["volumeMounts"]
    assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert router["volumes"] == [{"name": "models", "persistentVolumeClaim": {
        "claimName": "sglang-models", "readOnly": True}}]
    service = objects[("Service", "sglang-router")]["spec"]
    assert service["selector"].items() <= objects[("Deployment", "sglang-router")]["spec"][
        "template"]["metadata"]["labels"].items()
    assert objects[("PodDisruptionBudget", "sglang-router-worker")]["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize(("options", "pace"), [
    ([], (30, 30, 4)),  # deploy/serve.toml's
    (["--health-period-seconds", "45", "--health-timeout-seconds", "40",
      "--health-failures", "6"], (45, 40, 6)),
])
def test_the_router_checks_health_at_the_servers_pace(tmp_path: Path, options: list[str],
                                                      pace: tuple[int, int, int]) -> None:
    """The router's health check asks /health as the servers' readiness probe does: as often,
    waiting as long, as many failures before a server is out (its defaults, a 5 s timeout and 3
    failures, ejected busy servers the kubelet still counted as ready), on Kubernetes and on
    one box alike."""
    out = render(tmp_path, "--topology", "router", *options)
    objects = built(out, "router")
    pod = objects[("StatefulSet", "sglang-router-worker")]["spec"]["template"]["spec"]
    readiness = container(pod)["readinessProbe"]
    assert (readiness["periodSeconds"], readiness["timeoutSeconds"],
            readiness["failureThreshold"]) == pace
    rc = container(objects[("Deployment", "sglang-router")]["spec"]["template"]["spec"])
    compose = checks.compose_config(out / "compose.router.yaml", tmp_path)["services"]
    for args in (rc["args"], compose["sglang-router"]["command"]):
        router_flags = checks.flags(args)
        assert router_flags["--health-check-endpoint"] == [readiness["httpGet"]["path"]]
        assert int(router_flags["--health-check-interval-secs"][0]) == readiness["periodSeconds"]
        assert int(router_flags["--health-check-timeout-secs"][0]) >= readiness["timeoutSeconds"]
        assert int(router_flags["--health-failure-threshold"][0]) >= readiness[
            "failureThreshold"]


# What the LeaderWorkerSet controller puts into each pod of a group (v0.10.0,
# pkg/utils/pod/pod_utils.go, AddLWSVariables): the leader's address under the group's subdomain
# (the LeaderWorkerSet's name), the group size and the pod's index, ahead of the container's env.
def lws_environment(lws: dict[str, Any], group: int, index: int, namespace: str
                    ) -> dict[str, str]:
    name = lws["metadata"]["name"]
    return {"LWS_LEADER_ADDRESS": f"{name}-{group}.{name}.{namespace}",
            "LWS_GROUP_SIZE": str(lws["spec"]["leaderWorkerTemplate"]["size"]),
            "LWS_WORKER_INDEX": str(index)}


@pytest.mark.parametrize(("tp", "nodes"), [(16, 2), (8, 4), (2, 2)])
def test_each_node_of_a_multinode_server(tmp_path: Path, tp: int, nodes: int) -> None:
    out = render(tmp_path, "--topology", "multinode", "--tp", str(tp), "--nodes", str(nodes))
    objects = built(out, "multinode")
    lws = objects[("LeaderWorkerSet", "sglang-multinode")]
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == nodes
    gpus = tp // nodes
    seen_ranks = []
    for index in range(nodes):
        pod = template["leaderTemplate" if index == 0 else "workerTemplate"]
        c = check_server_pod(pod["spec"], gpus=gpus)
        env = {**lws_environment(lws, 0, index, "llm"),
               **{e["name"]: e["value"] for e in c["env"]}}
        argv = checks.flags(ENTRYPOINT_ARGS + [checks.expand(a, env) for a in c["args"]])
        check_serving_flags(argv, tp=tp)
        assert argv["--nnodes"] == [str(nodes)]
        leader = f"sglang-multinode-0.sglang-multinode.llm:{topology.DIST_INIT_PORT}"
        assert argv["--dist-init-addr"] == [leader]
        seen_ranks += argv["--node-rank"]
        # The GPUs of every node together are the server's TP size.
        assert c["resources"]["limits"]["nvidia.com/gpu"] * int(argv["--nnodes"][0]) == tp
    assert seen_ranks == [str(i) for i in range(nodes)]
    # The rendezvous port of --dist-init-addr is declared on every rank.
    for key in ("leaderTemplate", "workerTemplate"):
        ports = container(template[key]["spec"])["ports"]
        assert {"name": "dist-init", "containerPort": topology.DIST_INIT_PORT} in ports, key
    # No two of its pods on one node, whatever group: required, on the node's hostname, over
    # the pods of both templates (of every group: the selector names no group).
    for key in ("leaderTemplate", "workerTemplate"):
        (term,) = template[key]["spec"]["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        selector = term["labelSelector"]["matchLabels"]
        assert not [k for k in selector if k.startswith("leaderworkerset.sigs.k8s.io/")]
        for other in ("leaderTemplate", "workerTemplate"):
            assert selector.items() <= template[other]["metadata"]["labels"].items()
    # Clients reach the leader (rank 0, the HTTP server) only, by our labels alone (a name
    # prefix renames the LeaderWorkerSet, not the label the controller would put on its pods).
    service = objects[("Service", "sglang-multinode-leader")]["spec"]["selector"]
    assert not [k for k in service if k.startswith("leaderworkerset.sigs.k8s.io/")]
    assert service.items() <= template["leaderTemplate"]["metadata"]["labels"].items()
    assert not service.items() <= template["workerTemplate"]["metadata"]["labels"].items()


@pytest.mark.parametrize("minutes", [30, 45])
def test_no_rollout_fails_within_the_startup_budget(tmp_path: Path, minutes: int) -> None:
    """Every Deployment waits out its servers' startup budget (the startup probe's period x
    failures) and a margin for the pull before Kubernetes marks the rollout failed (its default,
    600 s, failed `kubectl rollout status` on a healthy first start); the router's too, which is
    not ready before a server is. StatefulSets and LeaderWorkerSets have no such deadline."""
    out = render(tmp_path, "--tp", "2", "--startup-minutes", str(minutes),
                 *(f"--topology={t}" for t in topology.TOPOLOGIES))
    docs = [d for t in topology.TOPOLOGIES for d in built(out, t).values()]
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert sorted(deployments) == ["sglang-router", "sglang-single"]
    startup = container(deployments["sglang-single"]["spec"]["template"]["spec"])["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget == minutes * 60
    for name, deployment in deployments.items():
        assert deployment["spec"]["progressDeadlineSeconds"] == budget + 600, name
    for d in docs:
        if d["kind"] in ("StatefulSet", "LeaderWorkerSet"):
            assert "progressDeadlineSeconds" not in json.dumps(d), d["kind"]


def seconds(duration: str) -> int:
    """A Go duration as Compose writes it (2m20s) in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, duration
    hours, minutes, secs = (int(g or 0) for g in parts.groups())
    return hours * 3600 + minutes * 60 + secs


@pytest.mark.parametrize(("options", "drain", "router_drain"), [
    ([], 120, 150),  # deploy/serve.toml's
    (["--drain-seconds", "300", "--router-drain-seconds", "400"], 300, 400),
])
def test_stopping_servers_drain_and_the_router_outlives_them(
        tmp_path: Path, options: list[str], drain: int, router_drain: int) -> None:
    """SIGTERM reaches a server after its preStop (the Service and the router drop it first);
    SGLang then finishes its running requests: the grace holds the preStop, drain_seconds and
    SGLang's exit (its 5 s look, its schedulers' 15 s). The router's grace is longer, and its own
    drain covers the servers': a request it passed on is answered before it stops. Compose's
    stop_grace_period comes from the same settings."""
    out = render(tmp_path, "--tp", "2", *options, *(f"--topology={t}" for t in topology.TOPOLOGIES))
    docs = [d for t in topology.TOPOLOGIES for d in built(out, t).values()]
    graces = {}
    for owner, _, spec in pod_templates(docs):
        c = container(spec)
        assert c["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "15"]}}, owner
        graces[owner] = spec["terminationGracePeriodSeconds"]
    router = graces.pop("sglang-router")
    assert set(graces.values()) == {15 + drain + 20}, graces
    assert router == 15 + router_drain + 20 and router > max(graces.values())
    rc = container(next(d for d in docs if d["kind"] == "Deployment"
                        and d["metadata"]["name"] == "sglang-router")["spec"]["template"]["spec"])
    assert checks.flags(rc["args"])["--shutdown-grace-period-secs"] == [str(router_drain)]
    assert router - 15 > router_drain > drain
    single = checks.compose_config(out / "compose.yaml", tmp_path)["services"]["sglang"]
    assert seconds(single["stop_grace_period"]) == drain + 20
    services = checks.compose_config(out / "compose.router.yaml", tmp_path)["services"]
    assert {seconds(services[f"sglang-worker-{i}"]["stop_grace_period"]) for i in (0, 1)} == {
        drain + 20}
    assert seconds(services["sglang-router"]["stop_grace_period"]) == router_drain + 20
    assert checks.flags(services["sglang-router"]["command"])["--shutdown-grace-period-secs"] == [
        str(router_drain)]


def pod_templates(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, str],
                                                             dict[str, Any]]]:
    """(owner, labels as the pods carry them, pod spec) of every pod template."""
    found = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            template = d["spec"]["template"]
            found.append((d["metadata"]["name"], template["metadata"]["labels"], template["spec"]))
        elif d["kind"] == "LeaderWorkerSet":  # the controller adds the group's name to each pod
            group = {"leaderworkerset.sigs.k8s.io/name": d["metadata"]["name"]}
            for key in ("leaderTemplate", "workerTemplate"):
                template = d["spec"]["leaderWorkerTemplate"][key]
                found.append((f"{d['metadata']['name']} {key}",
                              {**template["metadata"]["labels"], **group}, template["spec"]))
    return found


def selectors(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, str]]]:
    """(what, label selector) of every object that selects pods, the router's discovery too."""
    found = []
    for d in docs:
        what = f"{d['kind']} {d['metadata']['name']}"
        if d["kind"] == "Service":
            found.append((what, d["spec"]["selector"]))
        elif d["kind"] in ("Deployment", "StatefulSet", "PodDisruptionBudget"):
            found.append((what, d["spec"]["selector"]["matchLabels"]))
        for owner, _, spec in pod_templates([d]):
            for term in spec.get("affinity", {}).get("podAntiAffinity", {}).get(
                    "requiredDuringSchedulingIgnoredDuringExecution", []):
                found.append((f"{owner} anti-affinity", term["labelSelector"]["matchLabels"]))
        if d["kind"] == "Deployment" and "--selector" in json.dumps(d):
            args = container(d["spec"]["template"]["spec"])["args"]
            found.append((f"{what} --selector",
                          dict(a.split("=", 1) for a in checks.flags(args)["--selector"])))
    return found


def test_every_topology_fits_one_namespace(tmp_path: Path) -> None:
    """Every topology applied into one namespace: no two objects share a kind and name (nor
    with the Service the LeaderWorkerSet controller makes, named after the group), and each
    selector picks pods of its own topology only."""
    out = render(tmp_path, "--tp", "2", *(f"--topology={t}" for t in topology.TOPOLOGIES))
    docs = [d for t in topology.TOPOLOGIES for d in built(out, t).values()]
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    names += [("Service", d["metadata"]["name"]) for d in docs if d["kind"] == "LeaderWorkerSet"]
    assert sorted(n for n in names if names.count(n) > 1) == []
    templates = pod_templates(docs)
    assert len(templates) == 5  # single, router's workers, the router, leader and follower
    instance = "app.kubernetes.io/instance"
    for what, selector in selectors(docs):
        assert selector.get(instance), what
        matched = [owner for owner, labels, _ in templates if selector.items() <= labels.items()]
        assert matched, f"{what} selects no pod"
        owners = {next(labels[instance] for o, labels, _ in templates if o == owner)
                  for owner in matched}
        assert owners == {selector[instance]}, (what, matched)
    # The router's discovery and the workers' disruption budget: the router topology's servers,
    # not a multinode rank, nor the router itself.
    by_what = dict(selectors(docs))
    for what in ("Deployment sglang-router --selector", "PodDisruptionBudget sglang-router-worker"):
        assert [o for o, labels, _ in templates
                if by_what[what].items() <= labels.items()] == ["sglang-router-worker"], what


def test_two_models_in_one_namespace_stay_apart(tmp_path: Path) -> None:
    """Two models rendered for one namespace, each under a name prefix of its own (an overlay's
    namePrefix): every object and pod carries its model, and no selector of one (Services,
    workloads, the budget, the router's discovery, the anti-affinity, the PodMonitors) matches a
    pod of the other. Without the model in the labels, each router would route to the other
    model's servers."""
    rendered = {}
    for prefix, model in (("llama-", "Llama-3.1-8B-Instruct"), ("qwen-", "team/Qwen3 8B")):
        out = tmp_path / prefix.strip("-")
        assert cli.main(["deploy", "--digest", DIGEST, "--registry", REGISTRY, "--out", str(out),
                         "--tp", "2", "--model-path", model,
                         *(f"--topology={t}" for t in topology.TOPOLOGIES)]) == 0
        docs = []
        for overlay in (*topology.TOPOLOGIES, "monitoring"):
            mine = tmp_path / f"{prefix}{overlay}"
            mine.mkdir()
            (mine / "kustomization.yaml").write_text(yaml.safe_dump({
                "resources": [f"../{out.name}/kubernetes/{overlay}"], "namePrefix": prefix}))
            docs += checks.kustomize(mine)
        rendered[model] = docs
    names = [(d["kind"], d["metadata"]["name"]) for docs in rendered.values() for d in docs]
    assert sorted(n for n in names if names.count(n) > 1) == []
    for model, docs in rendered.items():
        (other,) = (d for m, d in rendered.items() if m != model)
        own = pod_templates(docs)
        monitors = [(f"PodMonitor {d['metadata']['name']}", d["spec"]["selector"]["matchLabels"])
                    for d in docs if d["kind"] == "PodMonitor"]
        for what, selector in [*selectors(docs), *monitors]:
            assert [o for o, pod_labels, _ in own if selector.items() <= pod_labels.items()], what
            assert not [o for o, pod_labels, _ in pod_templates(other)
                        if selector.items() <= pod_labels.items()], (what, "selects", model)
        accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
        services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
        for owner, _, spec in own:  # the prefix reached every reference (a LeaderWorkerSet's too)
            assert spec["serviceAccountName"] in accounts, owner
        for d in docs:
            if d["kind"] == "StatefulSet":
                assert d["spec"]["serviceName"] in services
        # ... because every object, pod and selector names its model
        label = topology.model_label(topology.Settings(model_path=model))
        assert label == {"Llama-3.1-8B-Instruct": "Llama-3.1-8B-Instruct",
                         "team/Qwen3 8B": "team-Qwen3-8B"}[model]
        for d in docs:
            assert d["metadata"]["labels"][topology.MODEL_LABEL] == label, d["metadata"]["name"]
        for what, selector in [*selectors(docs), *monitors]:
            assert selector[topology.MODEL_LABEL] == label, what
        for owner, pod_labels, _ in own:
            assert pod_labels[topology.MODEL_LABEL] == label, owner


def test_a_long_model_folder_is_a_label_value() -> None:
    long = "org/" + "Very-Long-Model-Name-" * 4 + "Instruct"
    value = topology.model_label(topology.Settings(model_path=long))
    assert len(value) == 63 and value.startswith("org-Very-Long") and re.fullmatch(
        r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", value)
    other = topology.model_label(topology.Settings(model_path=long + "-2"))
    assert other != value and len(other) == 63
    assert topology.model_label(topology.Settings(model_path="/models/-x-/")) == "x"


def test_every_pod_meets_pod_security_restricted(tmp_path: Path) -> None:
    """Every pod template, the LeaderWorkerSet's included, is admitted in a namespace that
    enforces the "restricted" Pod Security Standard (and the check refuses a pod it must)."""
    out = render(tmp_path, "--tp", "2", *(f"--topology={t}" for t in topology.TOPOLOGIES))
    docs = [d for t in topology.TOPOLOGIES for d in built(out, t).values()]
    templates = pod_templates(docs)
    assert len(templates) == 5
    for owner, _, spec in templates:
        assert checks.pod_security_violations(spec) == [], owner
    _, _, spec = templates[0]
    bad = copy.deepcopy(spec)
    bad["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    bad["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    del bad["securityContext"]["seccompProfile"]
    assert checks.pod_security_violations(bad) == [
        "volume host", "sglang: allowPrivilegeEscalation is not false", "sglang: seccomp profile"]


def test_the_pod_monitors_scrape_every_server_and_the_router(tmp_path: Path) -> None:
    out = render(tmp_path, "--tp", "2", *(f"--topology={t}" for t in topology.TOPOLOGIES))
    docs = [d for t in topology.TOPOLOGIES for d in built(out, t).values()]
    monitors = checks.kustomize(out / "kubernetes" / "monitoring")
    scraped: dict[str, str] = {}
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["kind"] == "PodMonitor"
        selector = monitor["spec"]["selector"]
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        for owner, labels, spec in pod_templates(docs):
            if selector["matchLabels"].items() <= labels.items() and all(
                    labels.get(e["key"]) in e["values"]
                    for e in selector.get("matchExpressions", [])):
                ports = {p["name"] for p in container(spec)["ports"]}
                assert endpoint["port"] in ports, (owner, endpoint)
                scraped[owner] = endpoint["port"]
    # Every server that serves /metrics (a multinode group's leader, not its other ranks).
    assert scraped == {"sglang-single": "http", "sglang-router-worker": "http",
                       "sglang-router": "metrics", "sglang-multinode leaderTemplate": "http"}


def test_the_expansion_is_kubernetes_own() -> None:
    env = {"A": "1", "B": "x"}
    assert checks.expand("$(A):$(B)", env) == "1:x"
    assert checks.expand("$(C)", env) == "$(C)"  # unknown: kept
    assert checks.expand("$$(A)", env) == "$(A)"  # escaped
    assert checks.flags(["--a", "1", "--b", "x", "y"]) == {"--a": ["1"], "--b": ["x", "y"]}


def test_one_code_path_makes_every_server_flag() -> None:
    """The manifests take the servers' argv and the router's worker list from topology.py, and
    the Compose router's worker list names the Compose services it runs."""
    s = topology.check(topology.Settings(model_path="m", draft_model_path="d", tp=2,
                                         replicas=3, topologies=topology.TOPOLOGIES))
    single = deploy.kube_single(s, IMAGE)["server.yaml"][1]
    assert container(single["spec"]["template"]["spec"])["args"] == list(
        topology.pods(s, "single")[0].args)
    compose = deploy.compose_router(s, IMAGE)["services"]
    router = compose["sglang-router"]["command"]
    urls = checks.flags(router)["--worker-urls"]
    assert urls == [f"http://{name}:30000" for name in compose if name != "sglang-router"]
    assert [compose[f"sglang-worker-{i}"]["deploy"]["resources"]["reservations"]["devices"][0][
        "device_ids"] for i in range(3)] == [["0", "1"], ["2", "3"], ["4", "5"]]


# --- the schemas can fail ------------------------------------------------------------------------

def test_the_schemas_refuse_a_broken_manifest(tmp_path: Path) -> None:
    out = render(tmp_path, "--topology", "single", "--topology", "multinode", "--tp", "2")
    deployment = built(out, "single")[("Deployment", "sglang-single")]
    broken = copy.deepcopy(deployment)
    broken["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        checks.validate(broken)
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["startupprobe"] = {}  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        checks.validate(broken)
    lws = built(out, "multinode")[("LeaderWorkerSet", "sglang-multinode")]
    for path, value in ((("spec", "leaderWorkerTemplate", "size"), "two"),
                        (("spec", "leaderWorkerTemplate", "restartPolicy"), "Sometimes"),
                        (("spec", "leaderWorkerTemplate", "sizes"), 2)):
        broken = copy.deepcopy(lws)
        node = broken
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            checks.validate(broken)
    broken = copy.deepcopy(lws)
    broken["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0][
        "volumeMounts"][0]["readonly"] = True  # misspelt, inside the pod template
    with pytest.raises(jsonschema.ValidationError, match="readonly"):
        checks.validate(broken)
    broken = copy.deepcopy(lws)  # a field the API server would drop without a word
    broken["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["label"] = {"a": "b"}
    with pytest.raises(jsonschema.ValidationError, match="label"):
        checks.validate(broken)
    # The pod templates are also checked as Kubernetes' own PodTemplate.
    template = copy.deepcopy(lws["spec"]["leaderWorkerTemplate"]["workerTemplate"])
    template["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = [1]
    with pytest.raises(kubernetes_validate.ValidationError):
        checks.validate_kubernetes({"apiVersion": "v1", "kind": "PodTemplate",
                                    "metadata": {"name": "t"}, "template": template})


def test_the_lws_schema_is_the_recorded_one() -> None:
    schema = json.loads(checks.LWS_SCHEMA.read_text())
    spec = schema["properties"]["spec"]["properties"]
    assert {"leaderWorkerTemplate", "replicas", "startupPolicy"} <= set(spec)
    assert '"description"' not in checks.LWS_SCHEMA.read_text()  # as tools/lws-crd-schema writes
    assert "x-kubernetes-int-or-string" in checks.LWS_SCHEMA.read_text()  # the rest as upstream
    readme = (checks.LWS_SCHEMA.parent / "README.md").read_text()
    assert "v0.10.0" in readme and "kubernetes-sigs/lws" in readme


# --- Compose -------------------------------------------------------------------------------------

def test_compose_files_through_compose_v2(tmp_path: Path) -> None:
    out = render(tmp_path, "--tp", "2", "--replicas", "2", "--shm-size", "8Gi")
    single = checks.compose_config(out / "compose.yaml", tmp_path)
    server = single["services"]["sglang"]
    assert server["image"] == IMAGE and server["user"] == "1000:1000"
    assert server["shm_size"] == str(8 * 1024**3)
    volume, _ = server["volumes"]  # and the kernel cache
    assert volume["target"] == "/models" and volume["read_only"] is True
    (gpus,) = server["deploy"]["resources"]["reservations"]["devices"]
    assert gpus["device_ids"] == ["0", "1"] and gpus["capabilities"] == ["gpu"]
    check_serving_flags(checks.flags(server["command"]), tp=2)
    assert server["healthcheck"]["start_period"] == "30m0s"
    router = checks.compose_config(out / "compose.router.yaml", tmp_path)["services"]
    depends = router["sglang-router"]["depends_on"]
    assert sorted(depends) == ["sglang-worker-0", "sglang-worker-1"]
    assert {dep["condition"] for dep in depends.values()} == {"service_healthy"}
    assert router["sglang-router"]["entrypoint"][1:] == ["-m", "sglang_router.launch_router"]
    assert router["sglang-router"]["volumes"] == router["sglang-worker-0"]["volumes"][:1]
    # Compose itself refuses a broken file (the check can fail).
    text = (out / "compose.yaml").read_text().replace("shm_size: 8g", "shm_size: eight")
    (tmp_path / "broken.yaml").write_text(text)
    with pytest.raises(checks.ComposeError, match="shm_size|eight"):
        checks.compose_config(tmp_path / "broken.yaml", tmp_path)


@pytest.mark.parametrize(("options", "address"), [([], "127.0.0.1"),
                                                  (["--publish-address", "0.0.0.0"], "0.0.0.0")])
def test_compose_keeps_kernels_and_publishes_on_loopback(tmp_path: Path, options: list[str],
                                                         address: str) -> None:
    """Every Compose server keeps its compiled kernels in a named volume of its own (a new
    container compiles nothing again); port 30000 is published on loopback unless opened; no
    API key unless an env file is given."""
    out = render(tmp_path, "--tp", "2", *options)
    for name, services, volumes in (("compose.yaml", ["sglang"], ["sglang-cache"]),
                                    ("compose.router.yaml", ["sglang-worker-0", "sglang-worker-1"],
                                     ["sglang-worker-0-cache", "sglang-worker-1-cache"])):
        config = checks.compose_config(out / name, tmp_path)
        assert sorted(config["volumes"]) == volumes, name
        for service, volume in zip(services, volumes, strict=True):
            server = config["services"][service]
            cache = [v for v in server["volumes"] if v["target"] == "/home/sglang/.cache"]
            assert cache == [{"type": "volume", "source": volume,
                              "target": "/home/sglang/.cache"}], (name, service)
            env = server["environment"]
            assert env["TRITON_CACHE_DIR"].startswith("/home/sglang/.cache/")
            assert env["TORCHINDUCTOR_CACHE_DIR"].startswith("/home/sglang/.cache/")
            assert "SGLANG_IMAGE_API_KEY" not in env and "env_file" not in server
        published = [s for s in config["services"].values() if "ports" in s]
        assert [s["ports"] for s in published] == [[{
            "mode": "ingress", "host_ip": address, "target": 30000, "published": "30000",
            "protocol": "tcp"}]], name


def test_compose_takes_the_api_key_from_an_env_file(tmp_path: Path) -> None:
    """With api_key_env_file every server and the router get SGLANG_IMAGE_API_KEY from it (the
    image's entrypoint turns it into --api-key; the router's shell into its own), and the key
    is in no rendered file."""
    env_file = tmp_path / "sglang.env"
    env_file.write_text("SGLANG_IMAGE_API_KEY=s3cret-key\n")
    out = render(tmp_path, "--api-key-env-file", str(env_file))
    assert "s3cret" not in "".join(p.read_text() for p in out.rglob("*") if p.is_file())
    for name in ("compose.yaml", "compose.router.yaml"):
        services = checks.compose_config(out / name, tmp_path)["services"]
        assert {s: v["environment"]["SGLANG_IMAGE_API_KEY"] for s, v in services.items()} == {
            s: "s3cret-key" for s in services}, name
    router = checks.compose_config(out / "compose.router.yaml", tmp_path)["services"][
        "sglang-router"]
    assert router["entrypoint"][:2] == ["/bin/sh", "-c"]
    assert "--api-key" in router["entrypoint"][2]
    # Compose refuses to start without the file (a key that silently went missing would open
    # the server to anyone who reaches it).
    env_file.unlink()
    with pytest.raises(checks.ComposeError, match="sglang.env"):
        checks.compose_config(out / "compose.yaml", tmp_path)


def test_no_compose_router_where_one_box_cannot_hold_it(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = render(tmp_path, "--tp", "4", "--replicas", "3")
    assert not (out / "compose.router.yaml").exists() and (out / "kubernetes" / "router").is_dir()
    assert "3 servers of TP 4 need more than the 8 GPUs of one box" in capsys.readouterr().err


# --- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("options", "message"), [
    (["--threshold", "-3"], r"--threshold: '-3' is not a batch-size threshold; give `auto`.*N >= 1"),
    (["--threshold", "0"], r"--threshold: '0' is not a batch-size threshold"),
    (["--threshold", "many"], r"--threshold: 'many' is not a batch-size threshold; give `auto`"),
    (["--threshold", "auto", "--flavor", "sglang-0.5.17"], r"no automatic threshold"),
    # the router pod runs the image: sglang-0.5.9's has no sglang-router (the default
    # topologies, single and router, and the router alone are refused; naming what can run it)
    (["--flavor", "sglang-0.5.9"], (r"--topology router: the sglang-0.5.9 image has no "
                                    r"sglang-router.*crash-loop; the flavors whose image has it: "
                                    r"sglang-0.5.17, sglang-0.5.23\. .*--topology single$")),
    (["--flavor", "sglang-0.5.9", "--topology", "router", "--topology", "multinode"],
     r"sglang-0.5.9 image has no sglang-router.*without the router: --topology multinode$"),
    (["--tp", "16"], r"--tp 16.*8 \(--gpus-per-node\).*--topology multinode"),
    (["--tp", "3", "--topology", "multinode"], r"--tp 3 over --nodes 2.*multiple"),
    (["--tp", "32", "--nodes", "2", "--topology", "multinode"], r"16 GPUs per pod.*--nodes"),
    (["--nodes", "1", "--topology", "multinode"], r"--nodes 1"),
    (["--replicas", "0"], r"--replicas 0"),
    (["--model-path", ""], r"no model path: give --model-path PATH"),
    (["--draft-model-path", " "], r"no EAGLE-3 draft path"),
    (["--model-path", "../etc"], r"--model-path '../etc' is not a folder inside"),
    (["--server-arg=--tp-size=4"], r"sets --tp-size itself; give --tp"),
    # flags that change the GPUs a server takes, in every spelling its parser accepts
    (["--server-arg=--tensor-parallel-size=4"], r"sets --tensor-parallel-size itself; give --tp"),
    (["--server-arg=--tensor-parallel=4"], r"sets --tensor-parallel-size itself; give --tp"),
    (["--server-arg=--dp-size=2"], r"--dp-size changes the GPUs a server takes.*--replicas N"),
    (["--server-arg=--data-parallel-size", "--server-arg=2"], r"--data-parallel-size changes"),
    (["--server-arg=--pp-size=2"], r"--pp-size changes the GPUs.*pipeline parallelism"),
    (["--server-arg=--base-gpu-id=1"], r"--base-gpu-id changes.*its own GPUs"),
    (["--health-timeout-seconds", "10"], (r"--health-timeout-seconds 10: must be a whole "
                                          r"number >= 25 \(SGLang's /health may wait 20 s")),
    (["--health-timeout-seconds", "40"], (r"--health-timeout-seconds 40 is longer than "
                                          r"--health-period-seconds 30")),
    (["--health-failures", "0"], r"--health-failures 0: must be a whole number >= 1"),
    # one argument with spaces, as people type it: split as a shell would, then checked
    (["--server-arg=--tp-size 4"], r"sets --tp-size itself; give --tp"),
    (["--server-arg=--mem-fraction-static 0.8 --dp-size 2"], r"--dp-size changes the GPUs"),
    # ... or refused with the exact fix where the split cannot be told
    (["--server-arg=--chat-template 'my template"],
     (r"cannot be split as a shell would \(No closing quotation\): close the quote, or give the "
      r"flag and its value as two arguments: --server-arg=--chat-template --server-arg=VALUE$")),
    (['--server-arg=--json-model-override-args={"rope_theta": 5e5}'],
     (r"the words after --json-model-override-args= may be one value with spaces or more flags; "
      r"give the flag and its value as two arguments: --server-arg=--json-model-override-args "
      r"--server-arg='\{\"rope_theta\": 5e5\}'$")),
    # the router must outlive its servers' drain, else it drops what they still finish
    (["--router-drain-seconds", "100"], (r"--router-drain-seconds 100 is not longer than "
                                         r"--drain-seconds 120: .*give more than 120$")),
    (["--drain-seconds", "200"], (r"--router-drain-seconds 150 is not longer than --drain-seconds "
                                  r"200")),
    (["--drain-seconds", "0"], r"--drain-seconds 0: must be a whole number >= 1"),
    (["--publish-address", "localhost"], (r"--publish-address 'localhost': give the host's IP "
                                          r"address .*127.0.0.1 \(this host only\)")),
    (["--api-key-env-file", "sglang.env"], (r"--api-key-env-file 'sglang.env': give the host "
                                            r"file \(absolute")),
    (["--shm-size", "16GB"], r"--shm-size '16GB'"),
    (["--models-claim", "My_Models"], r"--models-claim 'My_Models'"),
    (["--digest", "sha256:abc"], r"--digest 'sha256:abc' is not an image digest"),
    (["--registry", "https://ghcr.io/x"], r"--registry 'https://ghcr.io/x'"),
])
def test_bad_input_is_refused_before_any_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              options: list[str], message: str) -> None:
    out = tmp_path / "rendered"
    argv = ["--digest", DIGEST, "--registry", REGISTRY, "--out", str(out), *options]
    assert cli.main(["deploy", *argv]) == UsageError.exit_code
    err = " ".join(capsys.readouterr().err.split())
    assert re.search(message, err), err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_flavor_without_the_router_renders_the_other_topologies(tmp_path: Path) -> None:
    out = render(tmp_path, "--flavor", "sglang-0.5.9", "--topology", "single",
                 "--topology", "multinode", "--tp", "2")
    assert {p.name for p in (out / "kubernetes").iterdir()} == {"single", "multinode",
                                                                "monitoring"}
    assert pins.load_flavor("sglang-0.5.23").requires("sglang_router")  # the wheel's own name
    assert not pins.load_flavor("sglang-0.5.9").requires("sglang-router")


def test_a_server_arg_with_spaces_is_split_as_a_shell_would(tmp_path: Path) -> None:
    """`--server-arg='--flag value'` reaches the server as two argv elements (as one, SGLang's
    parser refuses it and the pod crash-loops); quotes keep a value with spaces whole; a value
    given as an argument of its own, or `--flag='one value'`, stays whole."""
    out = render(tmp_path, "--topology", "single", "--server-arg=--mem-fraction-static 0.81",
                 "--server-arg=--served-model-name 'Llama 8B' --enable-cache-report",
                 "--server-arg=--json-model-override-args",
                 '--server-arg={"rope_theta": 500000}', "--server-arg=--chat-template='a b'")
    c = container(built(out, "single")[("Deployment", "sglang-single")]["spec"]["template"]["spec"])
    assert c["args"][-8:] == ["--mem-fraction-static", "0.81", "--served-model-name", "Llama 8B",
                              "--enable-cache-report", "--json-model-override-args",
                              '{"rope_theta": 500000}', "--chat-template=a b"]
    marker = json.loads((out / deploy.MARKER).read_text())
    assert marker["settings"]["server_args"][:2] == ["--mem-fraction-static", "0.81"]


def test_data_parallel_attention_keeps_the_gpus(tmp_path: Path) -> None:
    """--dp-size with --enable-dp-attention splits the TP group (no more GPUs): rendered."""
    out = render(tmp_path, "--topology", "single", "--tp", "2",
                 "--server-arg=--dp-size=2", "--server-arg=--enable-dp-attention")
    c = container(built(out, "single")[("Deployment", "sglang-single")]["spec"]["template"]["spec"])
    assert c["args"][-2:] == ["--dp-size=2", "--enable-dp-attention"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_a_settings_file_is_checked_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = tmp_path / "serve.toml"
    base = deploy.SETTINGS.read_text()
    for text, message in ((base + "gpus = 2\n", "unknown settings ['gpus']"),
                          (base.replace('model_path = "Llama-3.1-8B-Instruct"', 'model_path = ""'),
                           "no model path"),
                          (base.replace("threshold = 32", "threshold = -1"), "--threshold: '-1' is not a batch-size threshold"),
                          ("tp = [", "not valid TOML")):
        settings.write_text(text)
        out = tmp_path / "out"
        assert cli.main(["deploy", "--digest", DIGEST, "--registry", REGISTRY, "--out", str(out),
                         "--settings", str(settings)]) == UsageError.exit_code
        assert message in capsys.readouterr().err and not out.exists()


def test_an_earlier_rendering_is_replaced_anything_else_kept(tmp_path: Path) -> None:
    out = render(tmp_path, "--topology", "single", "--topology", "router")
    assert (out / "kubernetes" / "router").is_dir()
    render(tmp_path, "--topology", "single")  # the same folder, fewer topologies
    assert not (out / "kubernetes" / "router").exists() and (out / deploy.MARKER).is_file()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert cli.main(["deploy", "--digest", DIGEST, "--registry", REGISTRY,
                     "--out", str(mine)]) == 2
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_help_is_in_nox_terms(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["deploy", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: nox -s deploy --") and "exit codes:" in out
    for option in ("--digest", "--registry", "--threshold", "--tp", "--replicas", "--nodes",
                   "--model-path", "--out"):
        assert option in out


# --- the example and publish ---------------------------------------------------------------------

def test_deploy_example_is_the_rendering_of_serve_toml(tmp_path: Path) -> None:
    """deploy/example is what the renderer writes for deploy/serve.toml (an example image):
    `nox -s deploy -- --example` writes it again."""
    assert cli.main(["deploy", "--example", "--out", str(tmp_path / "example")]) == 0
    expected = {p.relative_to(tmp_path / "example"): p.read_text()
                for p in (tmp_path / "example").rglob("*") if p.is_file()}
    committed = {p.relative_to(deploy.EXAMPLE_OUT): p.read_text()
                 for p in deploy.EXAMPLE_OUT.rglob("*") if p.is_file()}
    assert committed == expected, "deploy/example is stale: nox -s deploy -- --example"
    for overlay in topology.TOPOLOGIES:
        assert built(deploy.EXAMPLE_OUT, overlay)


def test_publish_writes_the_manifests_of_the_digest_it_pushed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pushed: list[str] = []

    def fake_publish(client: Any, image: str, target: publish.Target, **kw: Any
                     ) -> publish.PublishResult:
        pushed.append(image)
        return publish.PublishResult(f"{target.name}@{DIGEST}", DIGEST, (), "", "", False, "")

    monkeypatch.setattr(publish, "publish", fake_publish)
    monkeypatch.setattr(publish.docker_engine, "connect",
                        lambda *_: type("E", (), {"client": None}))
    out = tmp_path / "deploy"
    argv = ["--registry", REGISTRY, "--image", "img:tag", "--deploy-out", str(out)]
    assert cli.main(["publish", *argv]) == 0
    assert pushed == ["img:tag"]
    assert capsys.readouterr().out.strip() == DIGEST
    _, server, _ = yaml.safe_load_all((out / "kubernetes" / "single" / "server.yaml").read_text())
    assert container(server["spec"]["template"]["spec"])["image"] == IMAGE
    assert yaml.safe_load((out / "compose.yaml").read_text())["services"]["sglang"][
        "image"] == IMAGE
    assert json.loads((out / deploy.MARKER).read_text())["image"] == IMAGE
    # Bad settings stop the publish before anything is pushed.
    bad = tmp_path / "serve.toml"
    bad.write_text(deploy.SETTINGS.read_text().replace("threshold = 32", "threshold = -4"))
    monkeypatch.setattr(deploy, "SETTINGS", bad)
    assert cli.main(["publish", *argv, "--deploy-out",
                     str(tmp_path / "other")]) == UsageError.exit_code
    assert pushed == ["img:tag"] and not (tmp_path / "other").exists()
    assert "--threshold: '-4' is not a batch-size threshold" in capsys.readouterr().err


def test_the_readme_applies_only_what_publish_writes() -> None:
    """The README's commands name only the folders `nox -s publish` writes (deploy/serve.toml's
    topologies): a topology outside them is rendered with --topology first."""
    s = deploy.settings(deploy.SETTINGS, {})
    section = (pins.REPO_ROOT / "README.md").read_text().split("## Serve beyond one box")[1]
    section = section.split("\n## ")[0]
    applied = re.findall(r"kubectl apply -k out/deploy/kubernetes/(\w+)[`\s]*(?:(?:#|\()\s*or "
                         r"([\w, `]+))?", section)
    assert applied, section
    named = {name for first, others in applied for name in (first, *re.findall(r"\w+", others))}
    assert named <= set(s.topologies), named
    for topology_name in set(topology.TOPOLOGIES) - set(s.topologies):
        assert f"--topology {topology_name}" in section, topology_name


def test_the_docs_say_what_the_manifests_do() -> None:
    """docs/deploy.md's "What happens on..." table, in step with what is rendered from
    deploy/serve.toml: the health window, the rollout deadline, the graces."""
    s = deploy.settings(deploy.SETTINGS, {})
    text = (pins.REPO_ROOT / "docs" / "deploy.md").read_text()
    table = " ".join(text.split("## What happens on...")[1].split("\n## ")[0].split())
    for event in ("a server busy past its probe", "a rolling update", "SIGTERM mid-request",
                  "a node lost (`multinode`)"):
        assert f"| {event}" in table, event
    window = s.health_period_seconds * s.health_failures
    assert f"wait {s.health_timeout_seconds} s for each answer" in table
    assert f"after {s.health_failures} failures in a row ({window // 60} minutes)" in table
    assert f"`progressDeadlineSeconds` ({deploy.progress_deadline(s) // 60} minutes)" in table
    assert f"up to {s.drain_seconds} s" in table
    assert f"SIGKILL at {deploy.server_grace(s)} s" in table
    assert f"waits up to {s.router_drain_seconds} s" in table
    assert f"SIGKILL at {deploy.router_grace(s)} s" in table
    assert f"`stop_grace_period` {s.drain_seconds + deploy.EXIT_S} s" in table
    assert f"the router's {s.router_drain_seconds + deploy.EXIT_S} s" in table


def test_the_repository_settings_render(tmp_path: Path) -> None:
    """deploy/serve.toml as committed renders (what nox -s publish writes by default)."""
    s = deploy.settings(deploy.SETTINGS, {}, pins.load_flavor(pins.DEFAULT_FLAVOR))
    assert s.topologies == ("single", "router") and s.threshold == 32
    files = deploy.render(s, IMAGE)
    assert "compose.yaml" in files and "kubernetes/router/router.yaml" in files
    with pytest.raises(UsageError):
        topology.check(topology.override(s, {"tp": 0}))
