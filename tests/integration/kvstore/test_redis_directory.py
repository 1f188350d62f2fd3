"""The Redis directory against the Directory contract, with Redis's own TTL clock."""

from __future__ import annotations

import time

import pytest
import redis

from kvstore.directory import BlockMeta
from kvstore.redis_directory import RedisDirectory
from tests.unit.kvstore.directory_contract import NODES, check_directory_contract, meta

pytestmark = pytest.mark.integration


def test_redis_directory_contract(redis_url: str) -> None:
    d = RedisDirectory(redis_url)
    try:
        check_directory_contract(d, time.sleep)
    finally:
        d.close()


def test_schema_and_one_round_trip_prefix_lookup(redis_url: str) -> None:
    d = RedisDirectory(redis_url)
    r = redis.Redis.from_url(redis_url)
    try:
        d.commit(meta(1, cls="agent"), 3 * 86400)
        name = f"sluice:kv:blk:{(bytes([1]) * 32).hex()}"
        fields = r.hgetall(name)
        assert set(fields) == {b"oid", b"nodes", b"size", b"cls", b"mask", b"at"}
        assert fields[b"cls"] == b"agent" and 3 * 86400 - 5 < r.ttl(name) <= 3 * 86400
        d.lookup_prefix([bytes([1]) * 32])  # loads the script
        before = r.info("commandstats")
        chain = [bytes([i]) * 32 for i in range(1, 200)]
        assert len(d.lookup_prefix(chain)) == 1
        after = r.info("commandstats")
        calls = {c: after[c]["calls"] - before.get(c, {"calls": 0})["calls"] for c in after}
        # One call from the client (one round trip); on the server the run stops at the
        # first missing block: 2 HMGETs for 199 keys.
        assert calls["cmdstat_evalsha"] == 1 and calls["cmdstat_hmget"] == 2
        assert {c for c, n in calls.items() if n} == {"cmdstat_evalsha", "cmdstat_hmget", "cmdstat_info"}
    finally:
        d.close()
        r.close()


def test_grouped_rows_schema_row_count_and_one_round_trip_release(redis_url: str) -> None:
    d = RedisDirectory(redis_url)
    r = redis.Redis.from_url(redis_url)
    try:
        oid = b"\x42" * 16
        rows = [
            BlockMeta(bytes([90 + i]) * 32, oid, NODES, 300, "chat", 0xFFF, 5, offset=100 * i, length=100)
            for i in range(3)
        ]
        d.commit_many([(m, 7 * 86400) for m in rows])
        name = f"sluice:kv:blk:{rows[1].key.hex()}"
        fields = r.hgetall(name)
        count_key = f"sluice:kv:obj:{oid.hex()}"
        assert fields[b"off"] == b"100" and fields[b"len"] == b"100" and fields[b"grp"] == count_key.encode()
        assert r.get(count_key) == b"3" and 7 * 86400 - 5 < r.ttl(count_key) <= 7 * 86400
        d.release([rows[0].key])  # loads the script
        before = r.info("commandstats")
        removed, freed = d.release([rows[1].key, rows[2].key])
        after = r.info("commandstats")
        calls = {c: after[c]["calls"] - before.get(c, {"calls": 0})["calls"] for c in after}
        assert calls["cmdstat_evalsha"] == 1 and removed == 2 and [m.key for m in freed] == [rows[2].key]
        assert not r.exists(count_key) and not r.exists(name)
    finally:
        d.close()
        r.close()
