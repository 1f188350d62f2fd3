import re

import pytest

from services.ray.cluster_spec import ClusterSpec, load_cluster_spec


def _write(tmp_path, text):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def test_defaults_follow_deepseek():
    spec = ClusterSpec()
    assert spec.prefill.eplb.redundant_experts_per_gpu == 4
    assert (spec.prefill.eplb.window_steps, spec.prefill.eplb.period_steps) == (100, 1000)
    assert spec.decode.eplb.redundant_experts_per_gpu == 1
    assert (spec.decode.eplb.window_steps, spec.decode.eplb.period_steps) == (1000, 10000)
    assert (spec.store.data_shards, spec.store.parity_shards) == (10, 2)
    assert spec.store.ttl_seconds == {"agent": 259200, "chat": 604800}
    assert spec.api.host == "127.0.0.1"


def test_a_full_spec_loads(tmp_path):
    spec = load_cluster_spec(
        _write(
            tmp_path,
            """
mode: two-datacenters
redis_url: redis://127.0.0.1:6379/0
prefill: {replicas: 4, gpus_per_replica: 4, expert_parallel: 4, datacenter: a}
decode: {replicas: 1, gpus_per_replica: 64, expert_parallel: 64, datacenter: b}
interconnect_gbps: {a-b: 400}
""",
        )
    )
    assert spec.decode.expert_parallel == 64 and spec.interconnect_gbps["a-b"] == 400


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("prefil: {replicas: 2}", "prefil"),  # a typo is an error, not ignored
        ("store: {nodes: 5}", "at least data_shards + parity_shards = 12"),
        ("mode: ray-cluster", "needs redis_url"),
        ("decode: {datacenter: b}", "set mode two-datacenters"),
        (
            "prefill: {eplb: {redundant_experts_per_gpu: 4, window_steps: 10, period_steps: 5}}",
            "window_steps",
        ),
        ("api: {port: 70000}", "api.port"),
        ("- just a list", "mapping at the top level"),
    ],
)
def test_bad_specs_are_rejected_naming_the_field(tmp_path, text, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        load_cluster_spec(_write(tmp_path, text))
