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


@pytest.mark.parametrize("path", ["deploy/ray/cluster.yaml", "deploy/kuberay/raycluster.yaml"])
def test_ray_manifests_parse(path):
    doc = yaml.safe_load((ROOT / path).read_text())
    text = yaml.safe_dump(doc)
    for resource in ("prefill", "decode"):
        assert resource in text


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
