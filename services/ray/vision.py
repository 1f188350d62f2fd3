"""The vision-encoder pool on Ray: ``VisionActor`` per instance, ``VisionPool`` in the API.

A deployment whose spec has ``vision.replicas > 0`` runs that many ``VisionActor``s (one per
GPU; one CPU slot each on a CPU cluster), each placed by its pool's Ray resources (``ve``)
and holding a ``VisionStage`` (the checkpoint's encoder behind its LRU cache). The API
process encodes a request's images there before the request reaches an engine:

1. ``VisionPool.encode`` picks an instance with the router's vision policy
   (``router.sluice.LeastOutstandingWork``): the fewest image tokens in flight from this
   API process; the request's image tokens are charged to it until its answer arrives;
2. the images travel as plain dicts (``services.ray.wire.image_to_wire``: the recipe's
   preprocessed bytes, their size and the span); the instance answers one payload per
   image: the rows in the engine's byte format (``engine.kvconnector.payload``, kind
   ``KIND_EMBEDDING``, see ``engine.vision.stage.RowsFormat``), never pickled;
3. the API verifies each payload (checksums, encoder fingerprint, width, dtype, key and
   row count) and puts an ``EncodedImage`` (span, key, payload) in the request in place of
   the image; the engine actor decodes the rows and does not encode again.

Errors travel as data, as the engine actors' do (``services.ray.actors.error_of``). An
instance that dies mid-call is skipped for that request and the next best one tries.

Metrics (``VisionPool.families``): per instance, the images it encoded, its cache hits,
its encode seconds and its queue (images waiting for the encoder), as of its last answer;
the image tokens in flight from this API process (the policy's charge); calls and their
round-trip time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from services.api.engine_client import EngineRequest, EngineRequestError, EngineUnavailable
from services.ray.actors import DEFAULT_MAX_RESTARTS, error_of, raise_error, ray_options

log = logging.getLogger(__name__)
DEFAULT_CACHE_BYTES = 256 << 20


def _dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class VisionActor:
    """One vision-pool instance: the checkpoint's ``VisionStage`` on ``device`` at ``dtype``
    (the engines' dtype: rows travel in it). Every call takes and returns plain data."""

    def __init__(
        self,
        checkpoint: str,
        device: str = "cpu",
        dtype: str = "float32",
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self.checkpoint, self.device, self.dtype = str(checkpoint), device, _dtype(dtype)
        self.cache_bytes = int(cache_bytes)
        self.stage: Any = None  # engine.vision.stage.VisionStage, once started
        self.fmt: Any = None  # engine.vision.stage.RowsFormat
        self._starting = asyncio.Lock()
        self.calls = self.images = self.inflight = self.failed = self.payload_bytes = 0

    async def start(self) -> dict[str, Any]:
        """Load the encoder (once); returns how its rows travel: ``fingerprint``, ``hidden``,
        ``dtype``, and this process's ``pid``."""
        from engine.vision.stage import VisionStage

        async with self._starting:
            if self.stage is None:
                stage = await asyncio.to_thread(
                    VisionStage.from_model_dir, self.checkpoint, self.device, self.dtype, self.cache_bytes
                )
                if stage is None:
                    raise ValueError(f"{self.checkpoint} has no vision encoder: a vision pool needs one")
                self.fmt = stage.rows_format(self.dtype)
                self.stage = stage
        return {
            "pid": os.getpid(),
            "fingerprint": self.fmt.fingerprint,
            "hidden": int(self.fmt.hidden),
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    async def encode(self, parts: Sequence[Mapping[str, Any]]) -> list[bytes] | dict[str, Any]:
        """One payload per image (``image_to_wire`` dicts of ``ImagePart``s), in order; an
        error as data (``error_of``) when the images cannot be encoded."""
        answer = await self.encode_and_report(parts)
        return answer["payloads"] if "payloads" in answer else {"error": answer["error"]}

    async def encode_and_report(self, parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """``encode``, answered with this instance's stats after it: ``{"payloads", "stats"}``
        (or ``{"error", "stats"}``)."""
        from engine.vision.stage import ImagePart
        from services.ray.wire import image_from_wire

        self.calls += 1
        self.inflight += 1
        try:
            if self.stage is None:
                raise EngineUnavailable("the vision encoder is not started")
            images = [image_from_wire(p) for p in parts]
            if not all(isinstance(im, ImagePart) for im in images):
                raise EngineRequestError(
                    "a vision instance encodes preprocessed images (data, width, height)"
                )
            try:
                payloads = await asyncio.to_thread(self.stage.encode_payloads, images, self.fmt)
            except ValueError as exc:  # the encoder and the prompt's span disagree
                raise EngineRequestError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - travels as data
            self.failed += 1
            return {**error_of(exc), "stats": self.stats()}
        finally:
            self.inflight -= 1
        self.images += len(payloads)
        self.payload_bytes += sum(len(p) for p in payloads)
        return {"payloads": payloads, "stats": self.stats()}

    def stats(self) -> dict[str, float]:
        """The encoder's counters (``VisionStage.stats``: images encoded, cache hits, encode
        seconds, queue, cache bytes) and this actor's: calls, images answered, calls in
        flight, failures, payload bytes sent, pid."""
        out = dict(self.stage.stats()) if self.stage is not None else {}
        out.update(
            vision_calls=float(self.calls),
            vision_images=float(self.images),
            vision_inflight_calls=float(self.inflight),
            vision_failed_calls=float(self.failed),
            vision_payload_bytes=float(self.payload_bytes),
            pid=float(os.getpid()),
        )
        return out

    async def ready(self) -> bool:
        return self.stage is not None

    async def close(self) -> None:
        self.stage = None


def remote_vision_actor(
    checkpoint: str,
    device: str = "cpu",
    dtype: str = "float32",
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    **options: Any,
) -> Any:
    """Start a ``VisionActor`` on Ray (call ``start`` next); ``options`` go to
    ``ray.remote(...).options`` (``num_cpus``, ``resources``, ``name``); ``GPU`` and ``CPU``
    in ``resources`` become ``num_gpus`` / ``num_cpus``, as Ray wants them."""
    import ray

    opts: dict[str, Any] = {"max_concurrency": 1000, "max_restarts": DEFAULT_MAX_RESTARTS, **options}
    return (
        ray.remote(VisionActor)
        .options(**ray_options(opts))
        .remote(str(checkpoint), device, str(dtype), int(cache_bytes))
    )


class VisionPool:
    """The API process's side of the vision instances (``actors``, started: ``infos`` are
    what their ``start`` returned; ``names`` label metrics)."""

    def __init__(
        self,
        actors: Sequence[Any],
        infos: Sequence[Mapping[str, Any]],
        names: Sequence[str],
        *,
        call_timeout_s: float = 120.0,
    ) -> None:
        from prometheus_client import CollectorRegistry, Histogram

        from engine.vision.stage import RowsFormat
        from router.sluice import LeastOutstandingWork
        from services.api.metrics import LATENCY_BUCKETS

        if not actors or not (len(actors) == len(infos) == len(names)):
            raise ValueError("a vision pool needs >= 1 instance, each with its start info and name")
        formats = {(i["fingerprint"], int(i["hidden"]), str(i["dtype"])) for i in infos}
        if len(formats) != 1:
            raise ValueError(f"the vision instances disagree on their encoder or rows: {sorted(formats)}")
        ((fingerprint, hidden, dtype),) = formats
        self.fmt = RowsFormat(fingerprint, hidden, _dtype(dtype))
        self.actors, self.names = list(actors), list(names)
        self.call_timeout_s = call_timeout_s
        self.policy = LeastOutstandingWork(len(self.actors))
        n = len(self.actors)
        self.calls, self.images, self.failures = [0] * n, [0] * n, [0] * n
        self.instance_stats: list[dict[str, float]] = [{} for _ in range(n)]
        self.registry = CollectorRegistry(auto_describe=True)
        self.latency = Histogram(
            "sluice_vision_call_seconds",
            "Round trip of an encode call to a vision instance, from the API process, per instance.",
            ["instance"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip

    async def encode(self, request: EngineRequest) -> EngineRequest:
        """``request`` with each preprocessed image (``ImagePart``) replaced by its rows from a
        vision instance (``EncodedImage``); unchanged without one. ``EngineRequestError`` when
        the images cannot be encoded, ``EngineUnavailable`` when no instance answers."""
        from engine.vision.stage import ImagePart
        from router.sluice import VisionRequest

        parts = [im for im in request.images if isinstance(im, ImagePart)]
        if not parts:
            return request
        work = VisionRequest(request.request_id, sum(int(p.length) for p in parts))
        tried: list[int] = []
        while True:
            candidates = [i for i in range(len(self.actors)) if i not in tried]
            if not candidates:
                raise EngineUnavailable(
                    f"no vision instance could encode the images of {request.request_id!r}"
                )
            i = self.policy.select(candidates, work)
            tried.append(i)
            try:
                payloads = await self._call(i, parts)
            except _InstanceLost as exc:
                log.warning("request %s: vision instance %s lost (%s); trying another", request.request_id,
                            self.names[i], exc)  # fmt: skip
                continue
            finally:
                self.policy.on_complete(i, work)
            break
        encoded = iter(self._verified(parts, payloads))
        images = tuple(next(encoded) if isinstance(im, ImagePart) else im for im in request.images)
        return replace(request, images=images)

    async def _call(self, i: int, parts: Sequence[Any]) -> list[bytes]:
        import ray

        from services.ray.wire import image_to_wire

        self.calls[i] += 1
        t0 = time.perf_counter()
        try:
            answer = await asyncio.wait_for(
                self.actors[i].encode_and_report.remote([image_to_wire(p) for p in parts]),
                self.call_timeout_s,
            )
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            self.failures[i] += 1
            raise _InstanceLost(str(exc)) from None
        except (TimeoutError, ray.exceptions.RayError) as exc:
            self.failures[i] += 1
            raise EngineUnavailable(f"vision instance {self.names[i]} did not encode: {exc!r}") from None
        finally:
            self.latency.labels(instance=self.names[i]).observe(time.perf_counter() - t0)
        self.instance_stats[i] = dict(answer.get("stats", {}))
        raise_error(answer)
        payloads = list(answer["payloads"])
        if len(payloads) != len(parts):
            raise EngineUnavailable(
                f"vision instance {self.names[i]} answered {len(payloads)} payloads for {len(parts)} images"
            )
        self.images[i] += len(parts)
        return payloads

    def _verified(self, parts: Sequence[Any], payloads: Sequence[bytes]) -> list[Any]:
        """Each image's ``EncodedImage``, its payload verified: corrupt bytes, rows of another
        encoder, width or dtype, or a row count that is not the span's are refused."""
        from engine.kvconnector.payload import PayloadError
        from engine.vision.stage import EncodedImage

        out = []
        for p, blob in zip(parts, payloads, strict=True):
            try:
                key, length = self.fmt.verify(blob)
            except PayloadError as exc:
                raise EngineUnavailable(f"a vision instance answered an unusable payload: {exc}") from None
            if length != p.length:
                raise EngineRequestError(
                    f"the vision encoder made {length} rows for a {p.width}x{p.height} image whose prompt "
                    f"span is {p.length} tokens"
                )
            out.append(EncodedImage(p.offset, p.length, key, bytes(blob)))
        return out

    async def refresh(self) -> list[dict[str, float]]:
        """Every instance's stats now (one call each; an instance that does not answer keeps
        its last)."""
        answers = await asyncio.gather(
            *(asyncio.wait_for(a.stats.remote(), self.call_timeout_s) for a in self.actors),
            return_exceptions=True,
        )
        for i, ans in enumerate(answers):
            if isinstance(ans, Mapping):
                self.instance_stats[i] = dict(ans)
        return [dict(s) for s in self.instance_stats]

    def stats(self) -> dict[str, float]:
        """Totals over the instances (as of their last answers), prefixed ``vision_pool_``."""
        keys = ("vision_images_encoded", "vision_cache_hits", "vision_encode_s", "vision_queue")
        out = {
            f"vision_pool_{k.removeprefix('vision_')}": sum(s.get(k, 0.0) for s in self.instance_stats)
            for k in keys
        }
        out["vision_pool_calls"] = float(sum(self.calls))
        out["vision_pool_outstanding_image_tokens"] = float(self.policy.work.sum())
        return out

    def families(self) -> Iterator[Any]:
        """The vision series, labelled by ``instance`` (see the module doc)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield from self.registry.collect()
        series = (
            ("sluice_vision_images_encoded", "Images the instance's encoder ran on.", "vision_images_encoded", True),
            ("sluice_vision_cache_hits", "Images the instance answered from its encoder cache.", "vision_cache_hits", True),
            ("sluice_vision_encode_seconds", "Seconds the instance's encoder ran.", "vision_encode_s", True),
            ("sluice_vision_queued_images", "Images waiting for the instance's encoder.", "vision_queue", False),
        )  # fmt: skip
        for name, doc, key, counter in series:
            fam = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=["instance"])
            for n, s in zip(self.names, self.instance_stats):
                fam.add_metric([n], float(s.get(key, 0.0)))
            yield fam
        work = GaugeMetricFamily(
            "sluice_vision_outstanding_image_tokens",
            "Image tokens this API process has in flight on the instance (the balancer's charge).",
            labels=["instance"],
        )
        calls = CounterMetricFamily(
            "sluice_vision_calls", "Encode calls sent to the instance.", labels=["instance"]
        )
        for k, n in enumerate(self.names):
            work.add_metric([n], float(self.policy.work[k]))
            calls.add_metric([n], float(self.calls[k]))
        yield work
        yield calls


class _InstanceLost(Exception):
    """The vision instance's process died during the call."""
