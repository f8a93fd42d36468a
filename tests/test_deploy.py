"""deploy/: the container recipe and the Kubernetes manifests agree with each other, with jaxserve's command line
and with docs/deployment.md (the image names, ports, probes and sizes it describes)."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from jaxserve.cli.args import parse_with_config
from jaxserve.cli.compat import normalize_option_spelling
from jaxserve.cli.main import build_parser
from jaxserve.config import MeshShape

ROOT = Path(__file__).parents[1]
DEPLOY = ROOT / "deploy"
DOCS = (ROOT / "docs" / "deployment.md").read_text()
DOCKERFILE = (DEPLOY / "Dockerfile").read_text()
ACCELERATOR_RESOURCES = ("nvidia.com/gpu", "google.com/tpu")


def documents(name: str) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((DEPLOY / name).read_text())}


def parsed(argv: list[str]):
    parser, subparsers = build_parser()
    return parse_with_config(parser, subparsers, normalize_option_spelling(argv))


def accelerators(container: dict) -> int:
    limits = container["resources"]["limits"]
    return sum(int(limits.get(name, 0)) for name in ACCELERATOR_RESOURCES)


def env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def dockerfile_env(name: str) -> str:
    return re.search(rf"\b{name}=(\S+)", DOCKERFILE).group(1)


def test_the_image_recipe_installs_extras_that_exist_and_exposes_the_ports_it_uses():
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = set(re.findall(r"^([\w-]+) = \[", section, re.MULTILINE))
    assert {"cuda", "tpu", "ray", "test"} <= extras
    for accelerator in ("cuda", "tpu", "cuda,ray"):
        assert f"--build-arg ACCELERATOR={accelerator}" in DOCS
        assert set(accelerator.split(",")) <= set(extras)
    assert 'pip install --no-cache-dir "/src[${ACCELERATOR}]"' in DOCKERFILE
    coordinator = int(dockerfile_env("JAX_COORDINATOR_PORT"))
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", DOCKERFILE, re.MULTILINE).group(1).split()}
    assert exposed == {8000, coordinator, coordinator + 1}  # the API, jax's coordinator, the step channel
    command = re.search(r"^CMD (.+)$", DOCKERFILE, re.MULTILINE).group(1)
    default = parsed(yaml.safe_load(command))
    assert default.command == "serve" and (default.host, default.port) == ("0.0.0.0", 8000)


@pytest.mark.parametrize("manifest, image", [("lws-gpu.yaml", "jaxserve:cuda"), ("lws-tpu.yaml", "jaxserve:tpu")])
def test_a_leaderworkerset_group_runs_one_mesh_from_the_same_command_on_every_pod(manifest, image):
    docs = documents(manifest)
    lws, service = docs["LeaderWorkerSet"], docs["Service"]
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"  # a mesh cannot run with a process missing
    leader, = group["leaderTemplate"]["spec"]["containers"]
    worker, = group["workerTemplate"]["spec"]["containers"]
    assert leader["image"] == worker["image"] == image and f"`{image}`" in DOCS
    # The same command line on every pod (jaxserve finds each pod's place from the LWS_* variables), one that
    # jaxserve's own parser accepts; the group's accelerators are the mesh's devices.
    assert leader["args"] == worker["args"]
    args = parsed(leader["args"])
    assert args.command == "serve" and args.coordinator is None and args.process_id is None
    tp, pp = MeshShape.of(args.mesh)
    assert group["size"] * accelerators(leader) == tp * pp and accelerators(worker) == accelerators(leader)
    assert f"`{manifest}`" in DOCS or f"deploy/{manifest}" in DOCS
    assert f"--mesh {args.mesh}" in DOCS
    # The coordinator port the image sets, on every pod; the leader opens it, the step channel and the API.
    port = int(dockerfile_env("JAX_COORDINATOR_PORT"))
    assert env(leader)["JAX_COORDINATOR_PORT"] == env(worker)["JAX_COORDINATOR_PORT"] == str(port)
    ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
    assert ports == {"http": args.port, "coordinator": port, "steps": port + 1}
    # Ready once /health answers on the API port; the Service sends to the leaders only, on that port.
    probe = leader["readinessProbe"]["httpGet"]
    assert probe == {"path": "/health", "port": args.port} and "readinessProbe" not in worker
    assert group["leaderTemplate"]["metadata"]["labels"]["role"] == "leader"
    assert service["spec"]["selector"] == {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
                                           "role": "leader"}
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [args.port]
    assert "`/health`" in DOCS and "RecreateGroupOnPodRestart" in DOCS


def test_the_kuberay_job_runs_process_0_on_the_head_with_ray_starting_the_others():
    docs = documents("kuberay.yaml")
    job, service = docs["RayJob"], docs["Service"]
    program, *argv = shlex.split(job["spec"]["entrypoint"])
    args = parsed(argv)
    assert program == "jaxserve"
    assert args.command == "serve" and args.distributed_executor_backend == "ray"
    cluster = job["spec"]["rayClusterSpec"]
    head, = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    workers = cluster["workerGroupSpecs"]
    pods = [head] + [c for g in workers for c in g["template"]["spec"]["containers"] for _ in range(g["replicas"])]
    assert {c["image"] for c in pods} == {"jaxserve:cuda-ray"} and "`jaxserve:cuda-ray`" in DOCS
    tp, pp = MeshShape.of(args.mesh)
    assert len(pods) == args.num_processes and sum(accelerators(c) for c in pods) == tp * pp
    assert {p["name"]: p["containerPort"] for p in head["ports"]}["http"] == args.port
    labels = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == {**labels, "ray.io/node-type": "head"}
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [args.port]
