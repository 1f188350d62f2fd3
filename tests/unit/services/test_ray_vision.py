"""The vision pool's plain data: a request's images round-trip the wire exactly (preprocessed
or encoded), the rows travel as ``KIND_EMBEDDING`` payloads of the engine's byte format and
are refused when corrupt or from another encoder, width or dtype; ``VisionActor`` (no Ray
here) answers one payload per image with the rows the in-process ``VisionStage`` makes."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
import torch
from PIL import Image

from engine.kvconnector.payload import KIND_EMBEDDING, KIND_NAMES, PayloadError
from engine.model.vision import VisionConfig, VisionEncoder, image_tokens
from engine.vision.stage import EncodedImage, ImagePart, RowsFormat, VisionStage
from services.api.engine_client import EngineRequest, EngineRequestError
from services.ray import wire
from services.ray.actors import raise_error
from services.ray.vision import VisionActor
from tests.unit.services.test_ray_wire import _plain

FMT = RowsFormat("f" * 64, 16, torch.float32)


def _rows(n: int, hidden: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))


def _png(width: int, height: int, seed: int = 0) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def test_a_request_with_both_image_forms_round_trips_the_wire_exactly():
    part = ImagePart(3, 4, b"\x00webp\xff", 42, 42)
    enc = EncodedImage(9, 5, "ab" * 32, FMT.pack("ab" * 32, _rows(5)))
    request = EngineRequest("r", tuple(range(20)), 4, images=(part, enc))
    raw = wire.request_to_wire(request)
    assert _plain(raw)  # bytes, ints, strings, lists and dicts only: nothing pickled
    assert raw["images"][0] == {"offset": 3, "length": 4, "data": b"\x00webp\xff", "width": 42, "height": 42}
    assert set(raw["images"][1]) == {"offset", "length", "key", "rows"}
    back = wire.request_from_wire(raw)
    assert back == request and type(back.images[0]) is ImagePart and type(back.images[1]) is EncodedImage
    assert wire.request_from_wire(wire.request_to_wire(EngineRequest("t", (1,), 1))).images == ()


def test_rows_as_tensors_do_not_travel():
    from engine.scheduler.request import ImageInput

    with pytest.raises(TypeError, match="ImagePart or an EncodedImage"):
        wire.request_to_wire(EngineRequest("r", (1, 2), 1, images=(ImageInput(0, 1, "k", _rows(1)),)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_round_trip_a_payload_exactly(dtype):
    fmt = RowsFormat("f" * 64, 16, dtype)
    rows = _rows(7).to(dtype)
    blob = fmt.pack("k" * 8, rows)
    assert blob[:4] == b"SLKV" and blob[6] == KIND_EMBEDDING and KIND_NAMES[KIND_EMBEDDING] == "embedding"
    assert fmt.verify(blob) == ("k" * 8, 7)
    key, got = fmt.unpack(blob)
    assert key == "k" * 8 and got.dtype == dtype and torch.equal(got, rows)
    img = fmt.image_input(EncodedImage(2, 7, "k" * 8, blob))
    assert (img.offset, img.length, img.key) == (2, 7, "k" * 8) and torch.equal(img.embeds, rows)


def test_a_payload_is_refused_when_corrupt_or_from_another_encoder_width_or_dtype():
    blob = FMT.pack("key", _rows(3))
    bad = bytearray(blob)
    bad[-1] ^= 1
    with pytest.raises(PayloadError, match="checksum"):
        FMT.unpack(bytes(bad))
    with pytest.raises(PayloadError, match="fingerprint"):
        RowsFormat("e" * 64, 16, torch.float32).unpack(blob)
    with pytest.raises(PayloadError, match="layout"):
        RowsFormat("f" * 64, 32, torch.float32).unpack(blob)
    with pytest.raises(PayloadError, match="dtype"):
        RowsFormat("f" * 64, 16, torch.bfloat16).unpack(blob)
    with pytest.raises(PayloadError, match="expects 4"):
        FMT.image_input(EncodedImage(0, 4, "key", blob))  # the span is not the rows'
    with pytest.raises(PayloadError, match="expects"):
        FMT.image_input(EncodedImage(0, 3, "other", blob))  # another image's rows
    with pytest.raises(PayloadError, match=r"\[length, 16\]"):
        FMT.pack("key", _rows(3, hidden=8))


@pytest.fixture(scope="module")
def stage() -> VisionStage:
    torch.manual_seed(0)
    cfg = VisionConfig(hidden_size=8, num_layers=1, num_heads=1, intermediate_size=16, text_hidden_size=16)
    return VisionStage(VisionEncoder(cfg).eval(), "f" * 64)


def test_the_actor_answers_the_rows_the_stage_makes_and_counts_them(stage):
    actor = VisionActor("unused")
    actor.stage, actor.fmt = stage, stage.rows_format(torch.float32)
    parts = [
        ImagePart(0, image_tokens(42, 84), _png(42, 84), 42, 84),
        ImagePart(20, 4, _png(42, 42, 1), 42, 42),
    ]
    payloads = asyncio.run(actor.encode([wire.image_to_wire(p) for p in parts]))
    assert isinstance(payloads, list) and all(isinstance(p, bytes) for p in payloads)
    want = stage.encode(parts)  # cached now: the same rows
    for p, blob, w in zip(parts, payloads, want, strict=True):
        key, rows = actor.fmt.unpack(blob)
        assert key == stage.key(p) == w.key and torch.equal(rows, w.embeds)
    st = actor.stats()
    assert st["vision_images_encoded"] == 2 and st["vision_cache_hits"] == 2 and st["vision_images"] == 2
    assert st["vision_calls"] == 1 and st["vision_inflight_calls"] == 0 and st["vision_encode_s"] > 0


def test_the_actor_answers_a_span_mismatch_as_a_request_error(stage):
    actor = VisionActor("unused")
    actor.stage, actor.fmt = stage, stage.rows_format(torch.float32)
    answer = asyncio.run(actor.encode([wire.image_to_wire(ImagePart(0, 5, _png(42, 42), 42, 42))]))
    assert isinstance(answer, dict)
    with pytest.raises(EngineRequestError, match="prompt span is 5"):
        raise_error(answer)
    assert actor.stats()["vision_failed_calls"] == 1


class _Call:
    """A fake actor method: ``remote`` returns an awaitable answered by ``answer``."""

    def __init__(self, answer) -> None:
        self.answer, self.seen = answer, []

    def remote(self, parts):
        self.seen.append(parts)
        return self.answer(parts)


class _Actor:
    def __init__(self, gate: asyncio.Event | None = None, dies: bool = False) -> None:
        async def answer(parts):
            import ray

            if dies:
                raise ray.exceptions.RayActorError()
            if gate is not None:
                await gate.wait()
            blobs = [FMT.pack(f"key-{p['offset']}", _rows(p["length"])) for p in parts]
            return {"payloads": blobs, "stats": {"vision_images_encoded": float(len(parts))}}

        self.encode_and_report = _Call(answer)


INFO = {"fingerprint": FMT.fingerprint, "hidden": FMT.hidden, "dtype": "float32"}


def _request(rid: str, lengths: list[int]) -> EngineRequest:
    parts = tuple(ImagePart(10 * i, n, b"img", 42, 42) for i, n in enumerate(lengths))
    return EngineRequest(rid, tuple(range(64)), 4, images=parts)


def test_the_pool_balances_by_outstanding_image_tokens_and_returns_verified_rows():
    from services.ray.vision import VisionPool

    async def run() -> None:
        gate = asyncio.Event()
        actors = [_Actor(gate), _Actor(gate)]
        pool = VisionPool(actors, [INFO, INFO], ["vision-0", "vision-1"])
        big = asyncio.create_task(pool.encode(_request("big", [8, 8])))
        await asyncio.sleep(0)
        small = asyncio.create_task(pool.encode(_request("small", [2])))
        await asyncio.sleep(0)
        assert pool.policy.work.tolist() == [16.0, 2.0]  # charged while in flight
        third = asyncio.create_task(pool.encode(_request("third", [3])))
        await asyncio.sleep(0)
        assert pool.policy.work.tolist() == [16.0, 5.0]  # the least loaded took it
        gate.set()
        out = await asyncio.gather(big, small, third)
        assert pool.policy.work.tolist() == [0.0, 0.0]  # released
        assert [len(a.encode_and_report.seen) for a in actors] == [1, 2]
        images = out[0].images
        assert all(isinstance(im, EncodedImage) for im in images)
        assert [(im.offset, im.length, im.key) for im in images] == [(0, 8, "key-0"), (10, 8, "key-10")]
        assert torch.equal(FMT.unpack(images[1].rows)[1], _rows(8))
        assert pool.stats()["vision_pool_images_encoded"] == 2.0 + 1.0  # the instances' last answers

    asyncio.run(run())


def test_a_lost_instance_is_skipped_for_the_next():
    from services.ray.vision import VisionPool

    async def run() -> None:
        actors = [_Actor(dies=True), _Actor()]
        pool = VisionPool(actors, [INFO, INFO], ["vision-0", "vision-1"])
        out = await pool.encode(_request("r", [4]))
        assert isinstance(out.images[0], EncodedImage) and pool.failures == [1, 0]
        assert pool.policy.work.tolist() == [0.0, 0.0]

    asyncio.run(run())


def test_text_requests_skip_the_pool():
    from services.ray.vision import VisionPool

    async def run() -> None:
        actor = _Actor()
        pool = VisionPool([actor], [INFO], ["vision-0"])
        request = EngineRequest("t", (1, 2, 3), 4)
        assert await pool.encode(request) is request and actor.encode_and_report.seen == []

    asyncio.run(run())


def test_a_spec_with_a_vision_pool_launches_its_instances_with_the_pools_resources():
    from services.ray.cluster_spec import ClusterSpec, derive
    from services.ray.launch import local_ray_resources, vision_config

    model = "models/trained"
    plan = derive(
        ClusterSpec.model_validate({"model": model, "mode": "local-cluster", "vision": {"replicas": 2}})
    )
    cfg = vision_config(plan)
    assert cfg.engines == 2 and cfg.num_cpus == 1.0 and dict(cfg.resources) == {"ve": 1}  # a CPU slot each
    assert dict(cfg.engine_config) == {"device": "cpu", "dtype": plan.prefill.engine["dtype"]}
    assert local_ray_resources(plan)[1]["ve"] == 2
    gpu = derive(
        ClusterSpec.model_validate({"model": model, "vision": {"replicas": 1, "gpus_per_replica": 1}})
    )
    g = vision_config(gpu)
    assert (
        g.num_cpus == 0 and dict(g.resources) == {"GPU": 1, "ve": 1} and g.engine_config["device"] == "cuda"
    )
    assert vision_config(derive(ClusterSpec.model_validate({"model": model}))) is None


def test_gpus_and_cpus_leave_the_custom_resources_as_ray_wants():
    from services.ray.actors import ray_options

    opts = ray_options({"name": "e", "resources": {"GPU": 1.0, "prefill": 1.0, "CPU": 2.0}})
    assert opts == {"name": "e", "num_gpus": 1.0, "num_cpus": 2.0, "resources": {"prefill": 1.0}}
    assert ray_options({"num_cpus": 0})["resources"] == {}
