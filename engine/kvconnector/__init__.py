"""Moving KV-cache state between engines and the KV store: the versioned byte format
(:mod:`engine.kvconnector.payload`) for compressed-pool blocks and SWA slots."""
