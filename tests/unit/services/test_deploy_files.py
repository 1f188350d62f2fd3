"""The deployment files parse, and the example cluster spec validates against our schema."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.cluster_config import load_cluster_spec

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
