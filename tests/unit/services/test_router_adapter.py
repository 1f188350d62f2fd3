import asyncio
import hashlib

import pytest

from services.routing.adapter import RouterAdapter, RouterAdapterConfig


def chain(n, salt=b""):
    parent, out = salt, []
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        out.append(parent)
    return out


def test_cache_events_steer_prefill_and_hex_equals_bytes():
    async def go():
        r = RouterAdapter(RouterAdapterConfig("sluice", num_prefill=3, num_decode=2))
        blocks = chain(40)
        await r.on_cache_event(2, stored=[b.hex() for b in blocks])  # engine reports hex
        view = r.request("a", 40 * 256, blocks, arrival_s=0.0)
        assert await r.route_prefill(view, [0, 1, 2]) == 2
        await r.prefill_done(2, view)
        # after the engine evicts them, the prefix no longer pulls
        await r.on_cache_event(2, removed=blocks)
        await r.on_cache_event(1, stored=blocks[:10])
        other = r.request("b", 40 * 256, blocks, arrival_s=0.1)
        assert await r.route_prefill(other, [0, 1, 2]) == 1

    asyncio.run(go())


def test_decode_stats_feed_the_2d_balancer():
    async def go():
        r = RouterAdapter(RouterAdapterConfig("sluice", num_prefill=1, num_decode=2))
        await r.on_engine_stats(
            "decode",
            [
                {"engine": 0, "running": 2, "kv_tokens": 300_000},
                {"engine": 1, "running": 20, "kv_tokens": 20_000},
            ],
        )
        long = r.request("l", 120_000, [], 0.0)
        short = r.request("s", 300, [], 0.0)
        assert await r.route_decode(short, [0, 1]) == 0
        assert await r.route_decode(long, [0, 1]) == 1
        await r.decode_done(1, long)

    asyncio.run(go())


def test_bad_stats_and_names_are_rejected():
    with pytest.raises(ValueError, match="known: cache_aware, least_load, round_robin, sluice"):
        RouterAdapterConfig("fastest")
    r = RouterAdapter(RouterAdapterConfig("least_load", num_prefill=2, num_decode=2))
    with pytest.raises(ValueError, match="'engine' in 0..1"):
        asyncio.run(r.on_engine_stats("decode", [{"engine": 5, "running": 1}]))
    with pytest.raises(ValueError, match="unknown engine stat fields"):
        asyncio.run(r.on_engine_stats("decode", [{"engine": 0, "gpu_temp": 80}]))
    with pytest.raises(ValueError, match="unknown stage"):
        asyncio.run(r.on_engine_stats("vision", []))
    with pytest.raises(ValueError, match="not hex"):
        asyncio.run(r.on_cache_event(0, stored=["zz"]))


def test_store_directory_lowers_predicted_prefill_when_enabled():
    async def go():
        cfg = RouterAdapterConfig("sluice", num_prefill=2, num_decode=1, store_fetch_s_per_block=1e-4)
        r = RouterAdapter(cfg)
        blocks = chain(64)
        view = r.request("a", 64 * 256, blocks, arrival_s=0.0)
        import numpy as np

        _, before, _ = r.prefill.scores(np.array([0, 1]), view)
        await r.on_store_directory(added=[b.hex() for b in blocks[:60]])
        _, after, _ = r.prefill.scores(np.array([0, 1]), view)
        assert (after < 0.5 * before).all()  # 60 of 64 blocks fetched instead of computed
        await r.on_store_directory(removed=blocks[:60])
        _, again, _ = r.prefill.scores(np.array([0, 1]), view)
        assert np.allclose(again, before)

    asyncio.run(go())


def test_snapshot_replaces_an_engines_view_and_engine_down_forgets_it():
    async def go():
        r = RouterAdapter(RouterAdapterConfig("round_robin", num_prefill=2))
        old, new = chain(4), chain(3, salt=b"new")
        await r.on_cache_event(0, stored=old)
        await r.on_cache_event(1, stored=old[:2])
        await r.on_cache_snapshot(0, [b.hex() for b in new])  # events were lost: rebuild
        assert r.index.match(old).tolist() == [0, 2] and r.index.match(new).tolist() == [3, 0]
        await r.on_engine_down(1)
        assert r.index.match(old).tolist() == [0, 0] and r.index.engine_blocks(1) == 0

    asyncio.run(go())
