"""Sluice's erasure-coded KV / prefix store (design: docs/kvstore.md).

Entry points: ``kvstore.client.StoreClient`` (put_blocks, get_prefix, touch, delete),
``kvstore.codec.Codec``, ``kvstore.cluster.LocalStoreCluster`` and the node process
``python -m kvstore.node``. Importing this package starts nothing and opens no socket.
"""
