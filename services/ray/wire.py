"""Plain-data forms of what crosses between the API process and the engine actors.

Ray serialises ints, floats, strings, bytes, lists and dicts without pickling Python
objects, so every actor call takes and returns these forms, never the dataclasses
themselves. Each pair round-trips exactly (tested).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

from engine.scheduler.cache_events import CacheEvent, CacheEventBatch
from engine.scheduler.hashing import ExtraKeys
from services.api.engine_client import EngineOutput, EngineRequest, StructuredSpec


def request_to_wire(request: EngineRequest) -> dict[str, Any]:
    out = asdict(replace(request, images=()))
    out["prompt_token_ids"] = [int(t) for t in request.prompt_token_ids]
    out["stop_token_ids"] = [int(t) for t in request.stop_token_ids]
    out["images"] = [image_to_wire(im) for im in request.images]
    return out


def request_from_wire(raw: Mapping[str, Any]) -> EngineRequest:
    fields = dict(raw)
    fields["prompt_token_ids"] = tuple(int(t) for t in fields["prompt_token_ids"])
    fields["stop_token_ids"] = tuple(int(t) for t in fields.get("stop_token_ids", ()))
    if fields.get("structured") is not None:
        fields["structured"] = StructuredSpec(**fields["structured"])
    fields["images"] = tuple(image_from_wire(im) for im in fields.get("images", ()))
    return EngineRequest(**fields)


def image_to_wire(image: Any) -> dict[str, Any]:
    """One image of a request: the preprocessed image (``ImagePart``: ``data`` with its
    ``width`` and ``height``, the engine encodes it) or the rows a vision-pool instance made
    (``EncodedImage``: ``key`` and ``rows``, a ``KIND_EMBEDDING`` payload); both with the
    span (``offset``, ``length``). Rows as tensors (``ImageInput``) do not travel: pack them."""
    from engine.vision.stage import EncodedImage, ImagePart

    if isinstance(image, ImagePart):
        return {
            "offset": int(image.offset), "length": int(image.length), "data": bytes(image.data),
            "width": int(image.width), "height": int(image.height),
        }  # fmt: skip
    if isinstance(image, EncodedImage):
        return {
            "offset": int(image.offset), "length": int(image.length), "key": str(image.key),
            "rows": bytes(image.rows),
        }  # fmt: skip
    raise TypeError(f"an image travels as an ImagePart or an EncodedImage, got {type(image).__name__}")


def image_from_wire(raw: Mapping[str, Any]) -> Any:
    from engine.vision.stage import EncodedImage, ImagePart

    if "rows" in raw:
        return EncodedImage(int(raw["offset"]), int(raw["length"]), str(raw["key"]), bytes(raw["rows"]))
    return ImagePart(
        int(raw["offset"]), int(raw["length"]), bytes(raw["data"]), int(raw["width"]), int(raw["height"])
    )


def output_to_wire(output: EngineOutput) -> dict[str, Any]:
    lps = None
    if output.logprobs is not None:
        lps = [[float(lp), [[int(t), float(v)] for t, v in top]] for lp, top in output.logprobs]
    return {
        "request_id": output.request_id,
        "token_ids": [int(t) for t in output.token_ids],
        "logprobs": lps,
        "finish_reason": output.finish_reason,
        "prompt_tokens": output.prompt_tokens,
        "cached_tokens": output.cached_tokens,
        "completion_tokens": output.completion_tokens,
        "bounded_replay": output.bounded_replay,
    }


def output_from_wire(raw: Mapping[str, Any]) -> EngineOutput:
    lps = None
    if raw["logprobs"] is not None:
        lps = tuple((float(lp), [(int(t), float(v)) for t, v in top]) for lp, top in raw["logprobs"])
    return EngineOutput(
        raw["request_id"],
        tuple(int(t) for t in raw["token_ids"]),
        lps,
        raw["finish_reason"],
        int(raw["prompt_tokens"]),
        int(raw["cached_tokens"]),
        int(raw["completion_tokens"]),
        bool(raw.get("bounded_replay", False)),
    )


def events_to_wire(batch: CacheEventBatch) -> dict[str, Any]:
    return {
        "events": [[e.kind, list(e.hashes)] for e in batch.events],
        "lost": batch.lost,
        "snapshot": None if batch.snapshot is None else list(batch.snapshot),
    }


def events_from_wire(raw: Mapping[str, Any]) -> CacheEventBatch:
    snapshot = raw["snapshot"]
    return CacheEventBatch(
        tuple(CacheEvent(kind, tuple(bytes(h) for h in hashes)) for kind, hashes in raw["events"]),
        int(raw["lost"]),
        None if snapshot is None else tuple(bytes(h) for h in snapshot),
    )


def extra_keys_to_wire(keys: ExtraKeys) -> dict[str, Any]:
    return {"model_id": keys.model_id, "image_hashes": list(keys.image_hashes), "cache_salt": keys.cache_salt}


def extra_keys_from_wire(raw: Mapping[str, Any]) -> ExtraKeys:
    return ExtraKeys(raw["model_id"], tuple(raw["image_hashes"]), raw["cache_salt"])
