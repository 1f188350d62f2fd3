"""Images in the engine: a span of placeholder tokens whose embeddings are the vision
encoder's rows (``ImageInput``), whose key enters the block hashes of the blocks it overlaps.

Embedding rows here are seeded random tensors: the engine's contract does not depend on the
encoder (tests/unit/engine/test_vision_encoder.py covers that).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.core import EngineCore
from engine.engine_config import EngineConfig
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.messages import CoreRequest, ImageInput
from engine.runner import ModelRunner, RunnerConfig
from engine.scheduler.hashing import ImageSpan, chain_hashes
from tests.engine_steps import GREEDY, prompt

PLACEHOLDER = 7  # any id: the span's embeddings replace its tokens'


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return checkpoint_factory("tiny")


def _rows(n: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))


def _with_span(tokens: list[int], offset: int, length: int) -> list[int]:
    return tokens[:offset] + [PLACEHOLDER] * length + tokens[offset + length :]


def test_an_image_key_enters_the_hash_of_every_block_it_overlaps_and_the_chain_after():
    tokens = _with_span(prompt(1024, 1), 300, 300)  # blocks of 256: the image overlaps blocks 1 and 2
    plain = chain_hashes(tokens, 256)
    a = chain_hashes(tokens, 256, images=[ImageSpan(300, 300, "a" * 64)])
    b = chain_hashes(tokens, 256, images=[ImageSpan(300, 300, "b" * 64)])
    assert a[0] == b[0] == plain[0]  # before the image: a text-only prefix still matches
    assert all(x != y for x, y in zip(a[1:], b[1:])) and all(x != y for x, y in zip(a[1:], plain[1:]))
    assert a == chain_hashes(tokens, 256, images=[ImageSpan(300, 300, "a" * 64)])  # deterministic
    # pinned: the block layout is a wire format (store keys, router index, handoff checks)
    assert a[1].hex()[:16] == "6e0a3c7eeefb937d"


def test_image_rows_replace_the_token_embeddings_from_the_images_position_on(model):
    runner = ModelRunner(model, RunnerConfig(num_blocks=8, num_slots=3, with_mtp=False))
    hidden = runner.model_cfg.hidden_size
    tokens = _with_span(prompt(400, 2), 100, 50)
    rows = _rows(50, hidden, 0)

    def run(slot: int, table: list[int], embeds: torch.Tensor, chunks: list[int]) -> torch.Tensor:
        out, start = [], 0
        for end in chunks:
            img = ImageInput(100, 50, "k", embeds).rows(start, end)
            seq = SequenceInput(
                tokens[start:end], start, slot, table, end == len(tokens), embeds=[img] if img else []
            )
            out.append(runner.execute(ForwardBatch.from_sequences([seq])).hidden)
            start = end
        return torch.cat(out)

    whole = run(0, [0, 1], rows, [400])
    split = run(1, [2, 3], rows, [120, 130, 400])  # two chunk boundaries inside the image's span
    torch.testing.assert_close(whole, split, rtol=1e-4, atol=1e-4)
    changed = rows.clone()
    changed[10] += 1.0  # one row of the image (one patch group)
    other = run(2, [4, 5], changed, [400])
    same = (other - whole).abs().flatten(1).amax(1) < 1e-6
    assert same[:110].all() and not same[110:].any()  # unchanged before position 110, changed from it


def test_an_engine_request_with_an_image_hits_the_cache_only_for_the_same_image(model):
    core = EngineCore(EngineConfig(model=str(model)))
    hidden = core.runner.model_cfg.hidden_size
    tokens = _with_span(prompt(800, 3), 600, 190)  # ends 10 tokens before the prompt's end

    def run(rid: str, seed: int) -> tuple[list[int], int]:
        img = ImageInput(600, 190, f"image-{seed}", _rows(190, hidden, seed))
        core.add(CoreRequest(rid, tuple(tokens), replace(GREEDY, max_tokens=8), images=(img,)))
        out: list[int] = []
        for _ in range(200):
            for o in core.step():
                out += o.new_token_ids
                if o.finish_reason is not None:
                    return out, o.cached_tokens
        raise AssertionError(rid)

    first, _ = run("a", 1)
    again, cached = run("b", 1)
    assert again == first and cached == 768 - 4 * 31  # 3 blocks, the image's included, less a replay
    other, cached = run("c", 2)
    assert cached == 512 - 4 * 31  # only the 2 blocks before the image
    assert other != first  # the model really sees the image rows
    with pytest.raises(ValueError, match="embeddings must be"):
        core.add(
            CoreRequest("d", tuple(tokens), GREEDY, images=(ImageInput(600, 190, "x", _rows(10, hidden, 0)),))
        )
    with pytest.raises(ValueError, match="overlaps the previous"):
        spans = (
            ImageInput(300, 200, "x", _rows(200, hidden, 0)),
            ImageInput(400, 10, "y", _rows(10, hidden, 0)),
        )
        core.add(CoreRequest("e", tuple(tokens), GREEDY, images=spans))


def test_a_sequence_with_an_image_hands_off_with_its_rows_and_keys(model):
    """The importer checks the block hashes with the image keys and gets the rows (which a
    preemption would need to recompute the image's positions); its tokens equal one engine's."""
    a, b, alone = (EngineCore(EngineConfig(model=str(model))) for _ in range(3))
    hidden = a.runner.model_cfg.hidden_size
    tokens = _with_span(prompt(800, 4), 600, 190)
    img = ImageInput(600, 190, "image-4", _rows(190, hidden, 4))
    params = replace(GREEDY, max_tokens=10)

    def steps(core: EngineCore, rid: str, n: int | None = None) -> list[int]:
        out: list[int] = []
        for _ in range(200):
            for o in core.step():
                if o.request_id == rid:
                    out += o.new_token_ids
                    if o.finish_reason is not None or (n is not None and len(out) >= n):
                        return out
        raise AssertionError(rid)

    alone.add(CoreRequest("r", tuple(tokens), params, images=(img,)))
    want = steps(alone, "r")
    a.add(CoreRequest("r", tuple(tokens), params, images=(img,)))
    first = steps(a, "r", n=1)
    payload = a.export_sequence("r")
    first += [t for o in a.take_outputs() if o.request_id == "r" for t in o.new_token_ids]
    assert b.import_sequence(payload) == "r"
    (req,) = [r for r in b.scheduler.requests.values() if r.request_id == "r"]
    assert req.images[0].key == "image-4" and torch.equal(req.images[0].embeds, img.embeds)
    assert first + steps(b, "r") == want


def test_one_pixel_changes_the_states_from_the_images_position_on_and_not_before(model):
    """Through the real path: recipe preprocessing, the checkpoint's vision encoder, the rows
    in place of the span. The final streams are bit-equal before the image and at its first
    position (the learned image-begin row, which no pixel changes), and differ at every
    position after it (the tower attends over all patches, so every cell's row moves)."""
    import io

    import numpy as np
    from PIL import Image

    from engine.vision.stage import ImagePart, VisionStage

    stage = VisionStage.from_model_dir(model)
    assert stage is not None
    rgb = np.random.default_rng(5).integers(0, 256, size=(40, 60, 3), dtype=np.uint8)
    poked = rgb.copy()
    poked[10, 20] = 255 - poked[10, 20]

    def part(pixels: np.ndarray, offset: int) -> ImagePart:
        import deepseek_recipe as dr

        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        info = dr.OpenCvImagePreprocessor().preprocess(
            buf.getvalue(), dr.PreprocessOptions("auto", 8192, 512)
        )
        n = dr.MultiModalData([info]).image_token_adjustment() + 1
        return ImagePart(offset, n, bytes(info.data), info.width, info.height)

    a, b = part(rgb, 100), part(poked, 100)
    assert a.length == b.length and a.data != b.data
    (img_a,), (img_b,) = stage.encode([a]), stage.encode([b])
    assert img_a.key != img_b.key
    runner = ModelRunner(model, RunnerConfig(num_blocks=8, num_slots=2, with_mtp=False))
    tokens = _with_span(prompt(100 + a.length + 40, 6), 100, a.length)

    def hidden(img: ImageInput, slot: int, table: list[int]) -> torch.Tensor:
        seq = SequenceInput(tokens, 0, slot, table, True, embeds=[img.rows(0, len(tokens))])
        return runner.execute(ForwardBatch.from_sequences([seq])).hidden

    ha, hb = hidden(img_a, 0, [0, 1]), hidden(img_b, 1, [2, 3])
    same = (ha - hb).abs().flatten(1).amax(1) == 0
    assert same[:101].all() and not same[101:].any()
