"""The store spec file: round trip, validation messages, the size bound, atomic save."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from kvstore.directory import InMemoryDirectory
from kvstore.lazypool import LazyPool
from kvstore.placement import NodeAddress
from kvstore.retention import DEFAULT_TTL_S
from kvstore.spec import MAX_SPEC_BYTES, StoreSpec, open_store_client, redacted


def nodes(n: int = 12, prefix: str = "n") -> tuple[NodeAddress, ...]:
    return tuple(NodeAddress(f"{prefix}{i:02d}", f"127.0.0.1:{7000 + i}") for i in range(n))


def doc(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {
        "version": 1,
        "nodes": [{"id": f"n{i:02d}", "address": f"127.0.0.1:{7000 + i}"} for i in range(12)],
        "directory": "redis://127.0.0.1:6379/0",
    }
    base.update(changes)
    return base


def test_round_trip_json_and_file(tmp_path: Path) -> None:
    spec = StoreSpec(nodes(14), "redis://:secret@redis:6380/3", k=10, m=4, ttl_s={"chat": 60})
    again = StoreSpec.from_json(spec.to_json())
    assert again == spec and again.ttl_s == {"chat": 60}
    assert again.ttls() == {**DEFAULT_TTL_S, "chat": 60.0}
    path = spec.save(tmp_path / "store.json")
    assert StoreSpec.load(path) == spec
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # a Redis URL may carry a password
    assert [p.name for p in tmp_path.iterdir()] == ["store.json"]  # no temporary file left
    assert "secret" not in spec.describe() and "14 nodes, 10+4" in spec.describe()


def test_defaults_and_minimal_document() -> None:
    spec = StoreSpec.from_dict({"nodes": doc()["nodes"], "directory": "memory"})
    assert (spec.k, spec.m, dict(spec.ttl_s), spec.shared) == (10, 2, {}, False)
    assert spec.ttls() == dict(DEFAULT_TTL_S)
    assert json.loads(spec.to_json())["codec"] == {"k": 10, "m": 2}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"nodes": doc()["nodes"][:11]}, "places each object on 12 distinct nodes, but the spec lists 11"),
        (
            {"nodes": [*doc()["nodes"], {"id": "n03", "address": "127.0.0.1:9"}]},  # type: ignore[list-item]
            "node ids must be unique; repeated: n03",
        ),
        ({"directory": "http://redis:6379/0"}, "directory must be 'memory' or a Redis URL"),
        ({"directory": "redis://:6379/0"}, "names no host"),
        ({"directory": "redis://redis:port/0"}, "the port must be a number"),
        ({"directory": "redis://redis:6379/zero"}, "the database after the host must be a number"),
        ({"directory": "unix://"}, "needs a socket path"),
        ({"directory": 5}, '"directory" must be a string'),
        (
            {"nodes": [{"id": "a", "address": "nowhere"}]},
            "nodes[0]: node address 'nowhere' must be host:port",
        ),
        ({"nodes": [{"id": "a"}]}, 'nodes[0] must be {"id": ..., "address": "host:port"}'),
        ({"codec": {"k": 10, "m": 2, "w": 1}}, '"codec" must be'),
        ({"codec": {"k": 0}}, "codec 0+2"),
        ({"ttl_s": {"gold": 5}}, "unknown traffic classes ['gold']"),
        ({"ttl_s": {"chat": 0}}, "ttl_s values must be positive seconds"),
        ({"version": 2}, "version 2 is not supported"),
        ({"node": []}, "unknown keys ['node']"),
    ],
)
def test_validation_messages(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as exc:
        StoreSpec.from_dict(doc(**changes))
    assert message in str(exc.value)


def test_missing_fields_and_non_objects() -> None:
    with pytest.raises(ValueError, match='needs "nodes" and "directory"'):
        StoreSpec.from_dict({"nodes": []})
    with pytest.raises(ValueError, match="is a JSON object, got list"):
        StoreSpec.from_json("[]")
    with pytest.raises(ValueError, match="not valid JSON"):
        StoreSpec.from_json("{nodes")


def test_load_names_the_file_and_bounds_its_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"store spec .*absent.json: cannot read it: No such file"):
        StoreSpec.load(tmp_path / "absent.json")
    big = tmp_path / "big.json"
    big.write_text(json.dumps(doc()) + " " * MAX_SPEC_BYTES)
    with pytest.raises(ValueError, match=f"larger than the limit of {MAX_SPEC_BYTES} bytes"):
        StoreSpec.load(big)
    with pytest.raises(ValueError, match="exceeds the limit"):
        StoreSpec.from_json("x" * (MAX_SPEC_BYTES + 1))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc(directory="ftp://x")))
    with pytest.raises(ValueError, match=r"store spec .*bad.json: directory must be"):
        StoreSpec.load(bad)


def test_save_replaces_atomically(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    first, second = StoreSpec(nodes(12), "memory"), StoreSpec(nodes(12, "m"), "memory")
    first.save(path)
    seen: list[StoreSpec] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            seen.append(StoreSpec.load(path))  # never a partial file

    t = threading.Thread(target=reader)
    t.start()
    for i in range(50):
        (second if i % 2 else first).save(path)
    stop.set()
    t.join()
    assert seen and set(seen) <= {first, second}
    assert sorted(os.listdir(tmp_path)) == ["spec.json"]


def test_redacted() -> None:
    assert redacted("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redacted("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"
    assert redacted("redis://h:1/0") == "redis://h:1/0"


def test_open_store_client_memory_and_overrides() -> None:
    client = open_store_client(
        StoreSpec(nodes(13), "memory", k=9, m=3, ttl_s={"agent": 5}), read_timeout_s=0.5
    )
    try:
        assert isinstance(client.directory, InMemoryDirectory)
        assert (client.config.codec.k, client.config.codec.m, client.config.read_timeout_s) == (9, 3, 0.5)
        assert client.config.ttl_s["agent"] == 5 and len(client.transports) == 13
    finally:
        client.close()
    with pytest.raises(TypeError):
        open_store_client(StoreSpec(nodes(12), "memory"), no_such_field=1)


def test_lazy_pool_starts_on_first_use_and_refuses_after_shutdown() -> None:
    pool = LazyPool(1, "t-lazy")
    assert not pool.started
    gate = threading.Event()
    first = pool.submit(gate.wait, 5)
    queued = pool.submit(time.sleep, 0)
    assert pool.started
    threading.Timer(0.1, gate.set).start()
    pool.shutdown()  # waits for the running one, cancels the queued one
    assert first.result() is True and queued.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(time.sleep, 0)
