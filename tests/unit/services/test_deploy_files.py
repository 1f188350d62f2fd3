"""The deployment files parse, and the example cluster spec validates against our schema."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.ray.cluster_spec import load_cluster_spec

ROOT = Path(__file__).resolve().parents[3]


def test_example_cluster_spec_validates():
    spec = load_cluster_spec(ROOT / "deploy" / "cluster.example.yaml")
    assert spec.mode == "two-datacenters"
    assert spec.prefill.datacenter != spec.decode.datacenter


def _serve_args(command: str):
    """``sluice serve ...`` inside a shell line, parsed by sluice's own argument parser."""
    import argparse
    import shlex

    from services.commands import serve

    words = shlex.split(command)
    words = words[words.index("sluice") + 1 :]
    words = words[: next((i for i, w in enumerate(words) if w in (">", "&", "&&", "2>&1")), len(words))]
    parser = argparse.ArgumentParser(prog="sluice")
    serve.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(words)


def _check_serves_its_pools(command: str, capacity: dict[str, float]) -> None:
    """The server the manifest starts names an example spec the image carries, in a mode
    that joins the Ray cluster, and the hosts the manifest declares offer every resource
    the spec's pools ask for (GPUs, and the `prefill` / `decode` pool resources)."""
    from services.ray.cluster_spec import derive

    args = _serve_args(command)
    assert args.command == "serve" and args.config is not None and args.store is not None
    assert args.ray_address == "auto"
    in_image = Path("/opt/sluice")
    assert args.config.is_relative_to(in_image / "deploy/examples"), args.config
    assert "COPY deploy/examples deploy/examples" in (ROOT / "deploy/docker/Dockerfile").read_text()
    spec = load_cluster_spec(ROOT / args.config.relative_to(in_image))
    assert spec.mode == "ray-cluster"
    need = derive(spec).resources()
    for resource in ("GPU", "prefill", "decode"):
        assert capacity.get(resource, 0) >= need.get(resource, 0) > 0, (resource, capacity, need)


def test_ray_up_file_starts_the_pools_of_an_example_spec():
    doc = yaml.safe_load((ROOT / "deploy/ray/cluster.yaml").read_text())
    capacity: dict[str, float] = {}
    for node in doc["available_node_types"].values():
        for k, v in node["resources"].items():
            capacity[k] = capacity.get(k, 0) + v * node["min_workers"]
    assert sum(n["min_workers"] for n in doc["available_node_types"].values()) <= len(
        doc["provider"]["worker_ips"]
    )
    (command,) = [c for c in doc["head_start_ray_commands"] if "sluice serve" in c]
    _check_serves_its_pools(command, capacity)


def test_kuberay_manifest_starts_the_pools_of_an_example_spec():
    import json

    doc = yaml.safe_load((ROOT / "deploy/kuberay/raycluster.yaml").read_text())
    capacity: dict[str, float] = {}
    for group in doc["spec"]["workerGroupSpecs"]:
        params = group["rayStartParams"]
        offered = {"GPU": float(params.get("num-gpus", 0)), **json.loads(json.loads(params["resources"]))}
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == offered["GPU"]
        for k, v in offered.items():
            capacity[k] = capacity.get(k, 0) + v * group["replicas"]
    head = doc["spec"]["headGroupSpec"]["template"]
    assert head["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    (container,) = head["spec"]["containers"]
    (command,) = container["args"]
    assert command.startswith("${KUBERAY_GEN_RAY_START_CMD/--block/} &&")  # Ray's head first
    _check_serves_its_pools(command, capacity)
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert str(Path(_serve_args(command).store).parent) in mounts


def test_the_image_installs_every_package():
    """Every top-level package pyproject installs is copied into the image."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"][
        "include"
    ]
    dockerfile = (ROOT / "deploy/docker/Dockerfile").read_text()
    for pattern in include:
        name = pattern.rstrip("*")
        where = name if (ROOT / name).is_dir() else f"proto/{name}"
        assert (ROOT / where).is_dir(), pattern
        top = where.split("/")[0]
        assert f"COPY {top} {top}" in dockerfile, f"{top} is not copied into the image"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_compose_file_is_valid():
    subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"], check=True)


def test_compose_publishes_only_on_loopback():
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    published = [p for svc in doc["services"].values() for p in svc.get("ports", [])]
    assert published and all(p.startswith("127.0.0.1:") for p in published)


def test_compose_api_uses_the_store_services_through_its_spec():
    from kvstore.spec import StoreSpec

    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = doc["services"]
    command = services["api"]["command"]
    assert command[0] == "serve" and "--store" in command
    in_container = command[command.index("--store") + 1]
    mounts = {}  # container path -> (repo path, options) of the bind mounts from the repo
    for volume in services["api"]["volumes"]:
        if volume.startswith("./"):
            host, container, *options = volume.split(":")
            mounts[container] = (host, options)
    assert in_container in mounts, f"{in_container} is not mounted into the api container"
    host_path, options = mounts[in_container]
    assert options == ["ro"]
    spec = StoreSpec.load(ROOT / host_path)

    stores = {name: svc for name, svc in services.items() if name.startswith("store-")}
    assert len(stores) == 12
    expected = {}
    for name, svc in stores.items():
        args = svc["command"]
        assert args[:2] == ["store", "node"]
        expected[args[args.index("--node-id") + 1]] = f"{name}:{args[args.index('--port') + 1]}"
    assert {n.node_id: n.address for n in spec.nodes} == expected  # exactly the 12 services
    assert (spec.k, spec.m) == (10, 2)

    redis_cmd = services["redis"]["command"]
    port = redis_cmd[redis_cmd.index("--port") + 1] if "--port" in redis_cmd else "6379"
    assert spec.directory == f"redis://redis:{port}/0"
    assert set(services["api"]["depends_on"]) == {"redis", *stores}
    assert "SLUICE_REDIS_URL" not in services["api"].get("environment", {})  # the spec names the directory
