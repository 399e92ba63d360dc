"""The image's entrypoint (images/tool/entrypoint.sh) started as a pod starts it, and the server's
own argument parsing on what it runs (the real sglang 0.5.23 with the plugin, on a CPU).

A pod's environment is the image's (images/Dockerfile's ENV), then what the kubelet adds for the
Services of its namespace (every rendered topology applied into one namespace, service links on
whatever the manifests say: a user's overlay may turn them back on), then what the
LeaderWorkerSet controller adds, then the container's own env. The TP test starts a TP group's
broadcast sockets, as sglang binds them before its HTTP server, under the image's environment."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sglang_image import cli, pins, topology
from tests import deploy_checks as checks
from tests.probe import probe_result

FLAVOR = "sglang-0.5.23"
ENTRYPOINT = pins.REPO_ROOT / "images" / "tool" / "entrypoint.sh"
DOCKERFILE = pins.REPO_ROOT / "images" / "Dockerfile"
NAMESPACE = "llm"
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}


def image_environment() -> dict[str, str]:
    """The ENV of images/Dockerfile (values that name a build argument left out: PATH, CUDA_HOME)."""
    env: dict[str, str] = {}
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if line.startswith("ENV "):
            for word in shlex.split(line[4:]):
                name, _, value = word.partition("=")
                if "${" not in value:
                    env[name] = value
    assert env, "no ENV in images/Dockerfile"
    return env


# --- what a pod of each topology receives --------------------------------------------------------

SERVER_ARGS = ("--server-arg=--mem-fraction-static 0.81",
               "--server-arg=--served-model-name 'Llama 8B' --max-running-requests 48")
SERVER_ARGS_PARSED = {"mem_fraction_static": 0.81, "served_model_name": "Llama 8B",
                      "max_running_requests": 48}


def namespace(tmp_path: Path) -> list[dict[str, Any]]:
    """Every topology, rendered and built by Kustomize, as applied into one namespace (models
    `target` and `draft`: /models/target and /models/draft in the pods), with server flags
    given as people type them: a flag and its value in one argument, a quoted value."""
    out = tmp_path / "rendered"
    assert cli.main(["deploy", "--digest", "sha256:" + "ab" * 32, "--registry",
                     "registry.example.com/team", "--out", str(out), "--tp", "2",
                     "--model-path", "target", "--draft-model-path", "draft",
                     *SERVER_ARGS, *(f"--topology={t}" for t in topology.TOPOLOGIES)]) == 0
    docs = [doc for t in topology.TOPOLOGIES for doc in checks.kustomize(out / "kubernetes" / t)]
    for doc in docs:
        checks.validate(doc)
    return docs


def service_links(docs: list[dict[str, Any]]) -> dict[str, str]:
    """What the kubelet puts into a pod for each Service of its namespace that has a cluster IP
    (Kubernetes' documented variables; a headless Service gets none), each given an IP here,
    and for the API server's own Service, which every pod gets."""
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443",
           "KUBERNETES_SERVICE_PORT_HTTPS": "443", "KUBERNETES_PORT": "tcp://10.96.0.1:443",
           "KUBERNETES_PORT_443_TCP": "tcp://10.96.0.1:443", "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
           "KUBERNETES_PORT_443_TCP_PORT": "443", "KUBERNETES_PORT_443_TCP_ADDR": "10.96.0.1"}
    services = [d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") != "None"]
    assert services
    for number, service in enumerate(services, start=10):
        ip = f"10.96.12.{number}"
        name = service["metadata"]["name"].upper().replace("-", "_")
        ports = service["spec"]["ports"]
        env |= {f"{name}_SERVICE_HOST": ip, f"{name}_SERVICE_PORT": str(ports[0]["port"]),
                f"{name}_PORT": f"tcp://{ip}:{ports[0]['port']}"}
        for port in ports:
            number_proto = f"{port['port']}_{port.get('protocol', 'TCP')}"
            prefix = f"{name}_PORT_{number_proto}"
            env |= {f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}": str(port["port"]),
                    prefix: f"tcp://{ip}:{port['port']}", f"{prefix}_PROTO": "tcp",
                    f"{prefix}_PORT": str(port["port"]), f"{prefix}_ADDR": ip}
    return env


def server_pods(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, str]]]:
    """(which, pod spec, what a controller adds to its env) of every server pod."""
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            spec = doc["spec"]["template"]["spec"]
            if spec["containers"][0]["ports"][0]["containerPort"] == topology.SERVER_PORT and \
                    "command" not in spec["containers"][0]:  # the router replaces the entrypoint
                yield doc["metadata"]["name"], spec, {}
        elif doc["kind"] == "LeaderWorkerSet":
            name, template = doc["metadata"]["name"], doc["spec"]["leaderWorkerTemplate"]
            for index, key in ((0, "leaderTemplate"), (1, "workerTemplate")):
                lws = {"LWS_LEADER_ADDRESS": f"{name}-0.{name}.{NAMESPACE}",
                       "LWS_GROUP_SIZE": str(template["size"]), "LWS_WORKER_INDEX": str(index)}
                yield f"{name} rank {index}", template[key]["spec"], lws


def pod_environment(spec: dict[str, Any], links: dict[str, str], controller: dict[str, str]
                    ) -> dict[str, str]:
    """The image's environment under the kubelet's (service links, whatever the pod spec says),
    the controller's and the container's own, each $(NAME) expanded as Kubernetes does."""
    env = {**image_environment(), **links, **controller}
    for item in spec["containers"][0].get("env", []):
        if "value" in item:
            env[item["name"]] = checks.expand(item["value"], env)
    return env


def start_entrypoint(args: list[str], env: dict[str, str], tmp: Path
                     ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    """sh images/tool/entrypoint.sh ARGS under `env`, its python a stand-in that records the argv
    and environment the server would start with (None: it did not start)."""
    record = tmp / f"started-{len(list(tmp.glob('started-*')))}.json"
    stand_in = tmp / f"python-{record.stem}"
    stand_in.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                        f"open({str(record)!r}, 'w').write(json.dumps("
                        "{'argv': sys.argv[1:], 'env': dict(os.environ)}))\n")
    stand_in.chmod(0o755)
    full = {**env, "PATH": os.environ["PATH"], "SGLANG_PYTHON": str(stand_in)}
    proc = subprocess.run(["sh", str(ENTRYPOINT), *args], env=full, capture_output=True,
                          text=True, check=False, timeout=60)
    started = json.loads(record.read_text()) if record.exists() else None
    if started is not None:
        started["env"].pop("SGLANG_PYTHON")
    return proc, started


# --- the real sglang -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The models volume as the pods mount it at /models: a target and a draft."""
    path = tmp_path_factory.mktemp("models")
    for sub in ("target", "draft"):
        (path / sub).mkdir()
        (path / sub / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


# Each case's environment is the process's own from the first line of the server's code on;
# /models is where the models volume is mounted here; this machine has no GPU.
PRELUDE = """
import contextlib, io, json, os, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
CASES = json.loads(sys.argv[1])

def parsed(case):
    argv = case["argv"]
    assert argv[:2] == ["-m", "sglang.launch_server"], argv
    argv = [a.replace("/models/", MODELS + "/") for a in argv[2:]] + ["--device", "cpu"]
    os.environ.clear()
    os.environ.update(case["env"])
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return prepare_server_args(argv)
    except SystemExit as e:
        raise AssertionError(f"argparse exit {e.code}: {err.getvalue()[-500:]}")
"""

PARSE = PRELUDE + """
out = {}
for name, case in CASES.items():
    try:
        a = parsed(case)
        out[name] = {"host": a.host, "port": a.port, "tp": a.tp_size, "nnodes": a.nnodes,
                     "rank": a.node_rank, "mem_fraction_static": a.mem_fraction_static,
                     "served_model_name": a.served_model_name,
                     "max_running_requests": a.max_running_requests, "api_key": a.api_key}
    except Exception as e:
        out[name] = {"error": f"{type(e).__name__}: {e}"[-600:]}
print("RESULT " + json.dumps(out))
"""


def in_volume(arg: str, models: Path) -> str:
    """An argument with the pods' models volume (/models) where it is mounted here."""
    return arg.replace(f"{topology.MODELS_MOUNT}/", f"{models}/")


def run_sglang(sglang_tree: Callable[[str, bool], Path], run_in_tree: Callable[..., Any],
               plugin_site: Path, models: Path, code: str, cases: dict[str, Any]) -> Any:
    tree = sglang_tree(FLAVOR, False)
    code = f"MODELS = {str(models)!r}\n" + code
    proc = run_in_tree(tree, code.replace("sys.argv[1]", repr(json.dumps(cases))),
                       env={"PYTHONPATH": f"{plugin_site}:{tree}"}, timeout=900)
    return probe_result(proc)


def test_every_server_pod_starts_under_the_kubelet_environment(
        tmp_path: Path, sglang_tree: Callable[[str, bool], Path],
        run_in_tree: Callable[..., Any], plugin_site: Path, models: Path) -> None:
    docs = namespace(tmp_path)
    links = service_links(docs)
    cases: dict[str, Any] = {}
    for name, spec, controller in server_pods(docs):
        # Links as the kubelet adds them by default (the manifests turn them off: checked too).
        assert spec.get("enableServiceLinks") is False, name
        env = pod_environment(spec, links, controller)
        args = [in_volume(checks.expand(a, env), models)
                for a in spec["containers"][0]["args"]]
        proc, started = start_entrypoint(args, env, tmp_path)
        assert proc.returncode == 0 and started is not None, (name, proc.stderr)
        cases[name] = started
    assert len(cases) == 4  # single, the router's workers, both multinode ranks
    result = run_sglang(sglang_tree, run_in_tree, plugin_site, models, PARSE, cases)
    for name, parsed in result.items():
        assert "error" not in parsed, (name, parsed)
        # It listens where its Service and probes look.
        assert (parsed["host"], parsed["port"]) == ("0.0.0.0", topology.SERVER_PORT), name
        assert parsed["tp"] == 2, name
        # The server flags given with spaces reach the parser split as a shell would.
        assert {k: parsed[k] for k in SERVER_ARGS_PARSED} == SERVER_ARGS_PARSED, name
    assert {result[n]["rank"] for n in result if "rank " in n} == {0, 1}


def test_the_entrypoint_refuses_a_port_that_is_no_number(tmp_path: Path) -> None:
    env = {**image_environment(), "SGLANG_IMAGE_HTTP_PORT": "tcp://10.96.12.34:30000"}
    proc, started = start_entrypoint(["--model-path", "/models/target"], env, tmp_path)
    assert proc.returncode == 2 and started is None
    assert "SGLANG_IMAGE_HTTP_PORT=tcp://10.96.12.34:30000 is not a port number" in proc.stderr
    assert "enableServiceLinks: false" in proc.stderr


def other_user() -> dict[str, int]:
    """Runs a process as uid 65534 where the tests run as root (root reads any folder)."""
    return {"user": 65534, "group": 65534} if os.geteuid() == 0 else {}


@pytest.mark.parametrize(("argv", "message"), [
    (["--model-path", "{missing}"],
     ("error: --model-path {missing}: no such folder in the container: mount the models volume "
      "(read-only, readable by uid 1000) so that it holds {missing}, or give the path of the "
      "model inside it")),
    (["--model-path", "{target}", "--speculative-draft-model-path={missing}"],
     "error: --speculative-draft-model-path {missing}: no such folder"),
    (["--model={missing}"], "error: --model {missing}: no such folder"),
    (["--model-path", "{target}", "--speculative-draft-model", "{locked}"],
     ("error: --speculative-draft-model {locked} is not readable by uid {uid}: make the models "
      "volume readable by uid 1000, the image's user (on the host: chmod -R a+rX; on Kubernetes: "
      "fsGroup 1000)")),
    (["--model-path", "{unreadable_config}"], ("error: --model-path {unreadable_config} is not "
                                               "readable by uid {uid}")),
])
def test_the_entrypoint_names_a_model_path_it_cannot_read(argv: list[str], message: str) -> None:
    """An absolute model or draft path that is missing (a typo, a volume not mounted) or that
    the image's user cannot read: one line naming the flag, the path and the fix, exit 2, and
    the server is not started (it would end in a transformers traceback about repo ids)."""
    # Outside pytest's own folders, which only their owner may enter; removed at the end.
    volume = Path(tempfile.mkdtemp(prefix="sglang-image-models-"))
    try:
        volume.chmod(0o755)
        for name in ("target", "locked", "unreadable_config"):
            (volume / name).mkdir()
            (volume / name / "config.json").write_text(json.dumps(TINY_LLAMA))
            (volume / name).chmod(0o755)
            (volume / name / "config.json").chmod(0o644)
        (volume / "locked").chmod(0o700 if os.geteuid() == 0 else 0o000)
        (volume / "unreadable_config" / "config.json").chmod(0o600 if os.geteuid() == 0 else 0)
        paths = {name: str(volume / name) for name in ("target", "locked", "unreadable_config",
                                                       "missing")}
        uid = 65534 if os.geteuid() == 0 else os.geteuid()
        env = {**image_environment(), "PATH": os.environ["PATH"],
               "SGLANG_PYTHON": "/nonexistent/python"}  # never reached
        proc = subprocess.run(["sh", str(ENTRYPOINT), *(a.format(**paths) for a in argv)],
                              env=env, capture_output=True, text=True, check=False, timeout=60,
                              cwd=volume, **other_user())
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stdout == ""
        assert proc.stderr.startswith(message.format(**paths, uid=uid)), proc.stderr
    finally:
        for path in volume.rglob("*"):
            path.chmod(0o755)
        shutil.rmtree(volume)


def test_the_entrypoint_starts_a_readable_model_and_a_hub_name(tmp_path: Path,
                                                               models: Path) -> None:
    for argv in (["--model-path", f"{models}/target", "--speculative-draft-model-path",
                  f"{models}/draft"],
                 [f"--model={models}/target"],
                 ["--model-path", "meta-llama/Llama-3.1-8B-Instruct"]):  # SGLang's to resolve
        proc, started = start_entrypoint(argv, image_environment(), tmp_path)
        assert proc.returncode == 0 and started is not None, proc.stderr
        assert started["argv"][-len(argv):] == argv


def test_the_entrypoint_passes_the_api_key_of_its_environment(
        tmp_path: Path, sglang_tree: Callable[[str, bool], Path],
        run_in_tree: Callable[..., Any], plugin_site: Path, models: Path) -> None:
    """SGLANG_IMAGE_API_KEY (Compose's env file) becomes the server's --api-key, kept off the
    command line that `docker inspect` shows; an --api-key among the arguments wins; unset or
    empty, the server has none."""
    args = ["--model-path", f"{models}/target"]
    cases = {}
    for name, env, extra in (("from the env", {"SGLANG_IMAGE_API_KEY": "k1"}, []),
                             ("given too", {"SGLANG_IMAGE_API_KEY": "k1"}, ["--api-key", "k2"]),
                             ("empty", {"SGLANG_IMAGE_API_KEY": ""}, []), ("unset", {}, [])):
        proc, started = start_entrypoint(args + extra, {**image_environment(), **env}, tmp_path)
        assert proc.returncode == 0 and started is not None, (name, proc.stderr)
        cases[name] = started
    assert cases["from the env"]["argv"][-4:] == ["--api-key", "k1", *args]
    result = run_sglang(sglang_tree, run_in_tree, plugin_site, models, PARSE, cases)
    assert {name: parsed.get("api_key", parsed) for name, parsed in result.items()} == {
        "from the env": "k1", "given too": "k2", "empty": None, "unset": None}


# --- TP >= 2: the group's sockets and the HTTP port ----------------------------------------------

def free_window(start: int, width: int = 9) -> int:
    """The first port from `start` on where it and the `width - 1` after it are free here."""
    for port in range(start, start + 2000):
        try:
            for p in range(port, port + width):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
                with socket.socket() as s:
                    s.bind(("0.0.0.0", p))
        except OSError:
            continue
        return port
    raise AssertionError(f"no {width} free ports from {start}")


# What a TP group does before the HTTP server binds: each group coordinator's writer creates a
# MessageQueue (shm_broadcast), whose XPUB socket binds a port of its own. Eight of them (a
# TP 8 server's rank 0 alone makes several), then the HTTP server's bind as uvicorn makes it.
TP_GROUP = PRELUDE + """
import socket
from sglang.srt.distributed.device_communicators.shm_broadcast import MessageQueue
(case,) = CASES.values()
args = parsed(case)
queues = [MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2) for _ in range(8)]
ports = [q.handle.local_subscribe_port for q in queues]
http = socket.socket()
http.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    http.bind((args.host, args.port))
    http.listen()
    bound = "ok"
except OSError as e:
    bound = str(e)
http.close()
for q in queues:
    q.local_socket.close()
    del q.buffer
print("RESULT " + json.dumps({"port": args.port, "queue_ports": ports, "http": bound}))
"""


def test_a_tp_group_binds_its_sockets_beside_the_http_port(
        tmp_path: Path, sglang_tree: Callable[[str, bool], Path],
        run_in_tree: Callable[..., Any], plugin_site: Path, models: Path) -> None:
    """The image's environment as `docker run` gives it (its port moved to a free one where this
    host uses 30000), the entrypoint, then a TP group's sockets: none takes the HTTP port."""
    port = free_window(topology.SERVER_PORT)
    env = {k: (str(port) if v == str(topology.SERVER_PORT) else v)
           for k, v in image_environment().items()}
    proc, started = start_entrypoint(["--model-path", f"{models}/target", "--tp-size", "2"],
                                     env, tmp_path)
    assert proc.returncode == 0 and started is not None, proc.stderr
    result = run_sglang(sglang_tree, run_in_tree, plugin_site, models, TP_GROUP,
                        {"tp2": started})
    assert result["port"] == port
    assert port not in result["queue_ports"], result
    assert result["http"] == "ok", result
