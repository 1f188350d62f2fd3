"""The Ray deployment of Sluice (docs/disaggregation.md).

* ``cluster_spec``: the cluster spec (``cluster.yaml``), validated;
* ``cluster_plan``: ``derive`` -> the plan of every component's config from a spec
  (``sluice serve --config FILE --check`` prints it);
* ``local_cluster``: a local Ray instance bound to 127.0.0.1 (tests, ``make run``);
* ``actors``: ``EngineActor``, one engine per asyncio actor (prefill, decode or colocated
  role), plain data in and out, its state pushed by ``watch``;
* ``wire``: the plain-data forms of requests, outputs and cache events;
* ``replica``: the API process's view of an engine actor (``RayEngineReplica``, fed by the
  pushed state);
* ``disaggregated``: a prefill replica's disaggregated request path (prefill, hand off to a
  decode engine, resume on another if that one dies);
* ``decode_set``: the decode engines' placement (``DecodeSet``: 2D balancer, reservation);
* ``serving``: ``RayServingClient``, the API's ``EngineClient`` over prefill and decode pools;
* ``pools``: ``PoolConfig``, and ``PoolActors``: the engine actors of a deployment's pools,
  made (EP instances in placement groups), named, supervised and stopped;
* ``epgroup``: ``EPGroup``, one model instance as one actor per EP rank in a placement group.

Nothing here imports Ray at module import time.
"""
