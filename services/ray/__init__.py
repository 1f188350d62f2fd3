"""The Ray deployment of Sluice.

* ``cluster_spec``: the cluster spec (``cluster.yaml``), validated, and ``derive`` -> the plan
  of every component's config (``sluice serve --config FILE --check`` prints it);
* ``local_cluster``: a local Ray instance bound to 127.0.0.1 (tests, ``make run``);
* ``actors``: ``EngineActor``, one ``EngineCore`` per actor in the prefill or decode role,
  speaking plain data; the handoff travels as the engine's own versioned bytes
  (``engine/kvconnector/handoff.py``) through Ray's object store;
* ``disagg``: one request through a prefill actor and a decode actor;
* ``pool``: ``DecodePool``, decode placement by the router's 2D balancer with reservations;
* ``epgroup``: ``EPGroup``, one engine instance as one actor per EP rank in a placement group.

Nothing here imports Ray at module import time. What does not exist yet (the API and router
on Ray, supervision, pushed router state): docs/kv-connector.md, "Handoff between Ray actors".
"""
