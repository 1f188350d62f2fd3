"""``sluice serve --config FILE --check`` and ``services.ray.cluster_spec.derive``: every example
spec passes, a broken one exits 2 naming what to fix, and the plan carries each spec field to
the component that reads it (or lists it as unused)."""

from pathlib import Path

import pytest

from services.cli import main
from services.ray.cluster_spec import UNUSED_FIELDS, ClusterSpec, derive, load_cluster_spec

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = [
    "deploy/examples/one-host.yaml",
    "deploy/examples/one-gpu-host.yaml",
    "deploy/examples/deepseek.yaml",
    "deploy/examples/local.yaml",  # what `make run` serves
]
TRAINED = ROOT / "models" / "trained"


def _check(capsys, path):
    rc = main(["serve", "--config", str(path), "--check"])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("path", [*EXAMPLES, "deploy/cluster.example.yaml"])
def test_each_example_spec_passes_check(capsys, monkeypatch, path):
    import services.api.server

    def no_socket(*_a, **_k):
        raise AssertionError("--check must not open a socket")

    monkeypatch.setattr(services.api.server, "bind_socket", no_socket)
    rc, out, err = _check(capsys, ROOT / path)
    assert rc == 0, err
    assert f"{ROOT / path}: valid" in out
    for needle in (
        "prefill pool",
        "decode pool",
        "router: policy sluice",
        "store: ",
        "needs: ",
        "unused spec fields",
    ):
        assert needle in out


def test_example_shapes():
    one = derive(load_cluster_spec(ROOT / EXAMPLES[0]))
    assert one.prefill.layout.gpus == one.decode.layout.gpus == 0
    assert one.prefill.layout.resources_per_rank == {"CPU": 1, "prefill": 1}
    assert one.store.directory == "redis://127.0.0.1:6379/0" and len(one.store.node_ids) == 12
    gpu = derive(load_cluster_spec(ROOT / EXAMPLES[1]))
    assert gpu.prefill.layout.gpus + gpu.decode.layout.gpus == 8
    assert 2 <= gpu.prefill.layout.expert_parallel <= 4 and gpu.decode.layout.expert_parallel == 4
    ds = derive(load_cluster_spec(ROOT / EXAMPLES[2]))
    assert (ds.prefill.layout.gpus, ds.decode.layout.gpus) == (64, 64)
    assert 4 <= ds.prefill.layout.expert_parallel <= 8 and ds.decode.layout.expert_parallel == 64
    assert ds.decode.engine["speculative"] == "dspark"  # in an EP 64 decode instance: each rank's engine
    from engine.engine_config import EngineConfig

    assert EngineConfig(model=str(TRAINED), speculative="dspark", ep_size=2, ep_rank=1).spec is not None
    local = derive(load_cluster_spec(ROOT / EXAMPLES[3]))
    assert (local.prefill.layout.ranks, local.decode.layout.ranks) == (1, 1)  # one engine each, EP 1
    assert local.store.directory == "" and "a Redis started on loopback" in local.store.describe()
    assert len(ds.store.node_ids) >= 12
    assert ds.resources() == {"GPU": 128, "prefill": 64, "decode": 64, "store": 24}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            "prefill: {gpus_per_replica: 16, expert_parallel: 16}",
            "prefill expert_parallel must be 1..8 on GPUs",
        ),
        ("store: {nodes: 8}", "at least data_shards + parity_shards = 12 nodes, got 8"),
        (
            "prefill: {replicas: 1, chunk_budget: 4096}",
            "prefill.chunk_budget: Extra inputs are not permitted",
        ),
        ("decode: {gpus_per_replica: 6, expert_parallel: 4}", "must be a multiple of expert_parallel"),
        ("router_policy: fastest", "router_policy: unknown router policy 'fastest'; known:"),
        ("store: {data_shards: 40, parity_shards: 2, nodes: 42}", "store: codec 40+2"),
        ("store: {ttl_seconds: {batch: 60}}", "unknown traffic classes ['batch']"),
        ("{mode: two-datacenters, decode: {datacenter: b}}", "set redis_url"),
        ("decode: {replicas: 0}", "decode.replicas must be >= 1"),
        ("decode: {speculative: medusa}", "speculative policy 'medusa' unknown"),
        ("decode: {spec_profile: rank.json}", "decode.spec_profile is read only with decode.speculative set"),
    ],
)
def test_a_broken_spec_exits_2_saying_what_to_fix(capsys, tmp_path, text, needle):
    path = tmp_path / "cluster.yaml"
    path.write_text(text + "\n")
    rc, out, err = _check(capsys, path)
    assert rc == 2 and out == ""
    assert err.startswith(f"sluice serve: error: {path}: ")
    assert needle in err and "Traceback" not in err


def test_check_needs_a_config(capsys):
    assert main(["serve", "--check"]) == 2
    assert "--config FILE" in capsys.readouterr().err


def test_derive_maps_engine_fields_into_engine_config():
    spec = ClusterSpec.model_validate(
        {
            "model": str(TRAINED),
            "prefill": {
                "replicas": 2,
                "gpus_per_replica": 8,
                "expert_parallel": 4,
                "chunk_token_budget": 4096,
                "host_swa_bytes": 1 << 30,
            },
            "decode": {
                "replicas": 3,
                "max_running_requests": 100,
                "fp8_weights": "w8a16",
                "host_swa_format": "mxfp8",
                "host_swa_layers": 2,
                "speculative": "dspark",
                "spec_profile": "/profiles/ep64_rank.json",
            },
            "swa_replay": "bounded",
        }
    )
    plan = derive(spec)
    pre = plan.prefill.engine_config()
    assert (pre.swa_replay, pre.host_swa_bytes, pre.host_swa_format) == ("bounded", 1 << 30, "native")
    assert (pre.model, pre.device, pre.dtype) == (str(TRAINED), "cuda", "bfloat16")
    assert pre.max_num_batched_tokens == 4096 and pre.cache_event_capacity > 0  # the router drains events
    dec = plan.decode.engine_config()
    assert (dec.device, dec.dtype, dec.max_num_seqs) == ("cpu", "float32", 100)
    assert (dec.swa_replay, dec.host_swa_bytes, dec.host_swa_format) == ("bounded", 0, "mxfp8")
    assert (pre.host_swa_layers, dec.host_swa_layers) == (None, 2)
    assert (pre.speculative, dec.speculative) == (None, "dspark")
    assert (pre.spec_profile_path, dec.spec.profile_path) == (None, "/profiles/ep64_rank.json")
    assert (pre.keep_quantized, dec.keep_quantized, dec.fp8_compute) == (False, True, "w8a16")
    assert dec.num_swa_slots >= 100  # EngineConfig needs a slot per running sequence
    assert dec.cache_event_capacity == 0
    lay = plan.prefill.layout
    assert (lay.instances, lay.expert_parallel, lay.ranks, lay.gpus_per_rank, lay.gpus) == (2, 4, 8, 2, 16)
    assert lay.resources_per_rank == {"GPU": 2, "prefill": 2}
    assert plan.decode.layout.resources_per_rank == {"CPU": 1, "decode": 1}
    assert (plan.router.policy, plan.router.num_prefill, plan.router.num_decode) == ("sluice", 2, 3)
    assert plan.prefill.eplb.num_redundant_per_rank == 4 and plan.decode.eplb.period_steps == 10000


def test_engine_config_takes_a_local_model_and_the_store_spec(tmp_path):
    plan = derive(load_cluster_spec(ROOT / "deploy/examples/deepseek.yaml"))
    spec_file = plan.store.store_spec([f"10.0.1.{i}:7000" for i in range(24)]).save(tmp_path / "store.json")
    cfg = plan.decode.engine_config(model=TRAINED, kv_store=spec_file)
    assert (cfg.model, cfg.kv_store, cfg.max_num_seqs) == (str(TRAINED), str(spec_file), 256)
    with pytest.raises(ValueError, match="checkpoint directory"):
        plan.decode.engine_config()  # /weights/... is not on this host


def test_derive_maps_store_router_api_and_datacenters():
    spec = ClusterSpec.model_validate(
        {
            "mode": "two-datacenters",
            "redis_url": "redis://r:6379/1",
            "router_policy": "cache_aware",
            "api": {"host": "0.0.0.0", "port": 9000, "max_concurrency": 40, "max_queue": 80},
            "vision": {"replicas": 2, "gpus_per_replica": 1, "datacenter": "b"},
            "prefill": {"datacenter": "a"},
            "decode": {"datacenter": "b", "gpus_per_replica": 2, "expert_parallel": 2},
            "store": {
                "data_shards": 4,
                "parity_shards": 2,
                "nodes": 6,
                "capacity_bytes": 6000,
                "ttl_seconds": {"chat": 60},
            },
        }
    )
    plan = derive(spec)
    st = plan.store
    assert (st.k, st.m, st.node_ids, st.node_capacity_bytes) == (
        4,
        2,
        tuple(f"n{i:02d}" for i in range(6)),
        1000,
    )
    assert (st.directory, dict(st.ttl_s)) == ("redis://r:6379/1", {"chat": 60.0})
    kv = st.store_spec([f"h{i}:7000" for i in range(6)])
    assert (kv.k, kv.m, kv.directory, kv.ttls()["chat"]) == (4, 2, "redis://r:6379/1", 60.0)
    assert plan.router.policy == "cache_aware"
    api = plan.api
    assert (api.host, api.port, api.max_concurrency, api.max_queue) == ("0.0.0.0", 9000, 40, 80)
    assert plan.decode.layout.resources_per_rank == {"GPU": 1, "decode": 1, "dc:b": 0.001}
    assert plan.vision.resources() == {"GPU": 2, "ve": 2, "dc:b": 0.002}
    assert plan.resources() == {"CPU": 1, "prefill": 1, "GPU": 4, "decode": 2, "ve": 2, "store": 6}


def test_every_field_is_used_and_the_vision_pool_takes_only_its_own(capsys, tmp_path):
    """No spec field is accepted and then ignored: the unused list is empty, and the vision
    pool refuses the engine pools' fields it has no use for (it has no experts to shard and
    no KV cache)."""
    assert UNUSED_FIELDS == ()
    assert derive(ClusterSpec()).unused == ()
    rc, out, _ = _check(capsys, ROOT / EXAMPLES[0])
    assert rc == 0 and "unused spec fields: none" in out
    for field in ("expert_parallel: 8", "host_swa_bytes: 1024", "eplb: {}"):
        path = tmp_path / "spec.yaml"
        path.write_text(f"vision: {{replicas: 1, {field}}}\n")
        with pytest.raises(ValueError, match=f"vision.{field.split(':')[0]}: Extra inputs are not permitted"):
            load_cluster_spec(path)


def test_engines_with_a_host_slot_pool_share_slots_through_the_stores_redis(tmp_path):
    from kvstore.spec import NodeAddress
    from kvstore.spec import StoreSpec as KVStoreSpec
    from services.ray.launch import pool_config

    spec = ClusterSpec.model_validate(
        {"model": str(TRAINED), "prefill": {"host_swa_bytes": 1 << 30}, "decode": {"replicas": 1}}
    )
    plan = derive(spec)
    nodes = tuple(NodeAddress(f"n{i:02d}", f"127.0.0.1:{7000 + i}") for i in range(12))
    shared = KVStoreSpec(nodes, "redis://127.0.0.1:6390/0").save(tmp_path / "a.json")
    alone = KVStoreSpec(nodes, "memory").save(tmp_path / "b.json")
    assert pool_config(plan.prefill, str(shared)).engine_config["swa_directory"] == "redis://127.0.0.1:6390/0"
    assert "swa_directory" not in pool_config(plan.decode, str(shared)).engine_config  # no host pool
    assert "swa_directory" not in pool_config(plan.prefill, str(alone)).engine_config  # one process only


def test_the_handoff_transport_follows_the_datacentres_and_the_link():
    """``auto`` is the object store within one datacentre and gRPC between two; the fetch
    deadline takes the declared link between the pools' datacentres."""
    from engine.kvconnector.handoff_server import DEFAULT_LINK_GBPS

    one = derive(ClusterSpec()).handoff
    assert (one.transport, one.host, one.link_gbps) == ("object_store", "127.0.0.1", DEFAULT_LINK_GBPS)
    two_dc = {"mode": "two-datacenters", "redis_url": "redis://r:6379/0", "decode": {"datacenter": "b"}}
    two = derive(ClusterSpec.model_validate({**two_dc, "interconnect_gbps": {"b-a": 400}})).handoff
    assert (two.transport, two.link_gbps) == ("grpc", 400.0)
    forced = ClusterSpec.model_validate(
        {
            "handoff": {
                "transport": "grpc",
                "bind_host": "0.0.0.0",
                "max_held_bytes": 1 << 30,
                "ttl_seconds": 30,
            }
        }
    )
    h = derive(forced).handoff
    assert (h.transport, h.host, h.max_held_bytes, h.ttl_s) == ("grpc", "0.0.0.0", 1 << 30, 30.0)
    assert "handoff: grpc (servers on 0.0.0.0" in "\n".join(derive(forced).summary())
    for links, why in (({"a-c": 10}, "not 'x-y'"), ({"a-b-c": 10}, "not 'x-y'"), ({"a-b": 0}, "> 0")):
        with pytest.raises(ValueError, match=why):
            ClusterSpec.model_validate({**two_dc, "interconnect_gbps": links})


def test_fp8_activations_on_one_pool_need_them_on_the_other():
    """w8a8 computes other caches than w8a16 or bf16: a handoff between the pools would carry
    a cache the decode engine cannot use, so the spec is refused; both w8a8 is fine."""
    base = {"model": str(TRAINED), "prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    spec = ClusterSpec.model_validate({**base, "decode": {"replicas": 1, "fp8_weights": "w8a8"}})
    with pytest.raises(ValueError, match="both be w8a8"):
        derive(spec)
    both = {"replicas": 1, "fp8_weights": "w8a8"}
    plan = derive(ClusterSpec.model_validate({**base, "prefill": both, "decode": both}))
    assert plan.decode.engine["fp8_compute"] == "w8a8" and plan.prefill.engine["keep_quantized"]
