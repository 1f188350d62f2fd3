"""Sluice on Ray: engines inside Ray actors.

``actors.EngineActor`` holds one ``EngineCore`` (role "prefill" or "decode") and speaks
plain data only; ``disagg.DisaggregatedGenerator`` runs one request through a prefill actor
and a decode actor, the sequence crossing between them as the engine's own versioned
handoff bytes (``engine/kvconnector/handoff.py``) carried by Ray's object store. Nothing
here imports Ray at module import time. What does not exist yet (router, pools, EP groups,
supervision): docs/kv-connector.md, "Handoff between Ray actors".
"""
