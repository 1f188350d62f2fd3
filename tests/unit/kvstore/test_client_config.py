"""StoreClientConfig validation: every mistake names what to fix."""

from __future__ import annotations

import pytest


def test_client_config_validation_is_actionable() -> None:
    from kvstore.client import StoreClientConfig
    from kvstore.placement import NodeAddress

    nodes = tuple(NodeAddress(f"n{i}", f"127.0.0.1:{7000 + i}") for i in range(12))
    with pytest.raises(ValueError, match="needs at least 12 nodes"):
        StoreClientConfig(nodes=nodes[:11])
    with pytest.raises(ValueError, match="min_write_shards"):
        StoreClientConfig(nodes=nodes, min_write_shards=9)
    with pytest.raises(ValueError, match="ttl_s needs"):
        StoreClientConfig(nodes=nodes, ttl_s={"agent": 1.0})
    with pytest.raises(ValueError, match="unique"):
        StoreClientConfig(nodes=(*nodes[:11], nodes[0]))
    with pytest.raises(ValueError, match="group_bytes must be >= 0"):
        StoreClientConfig(nodes=nodes, group_bytes=-1)
    assert StoreClientConfig(nodes=nodes).write_quorum == 11
    assert StoreClientConfig(nodes=nodes).group_bytes == 1 << 20
