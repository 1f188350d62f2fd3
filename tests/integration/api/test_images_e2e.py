"""Images reach the model, through the ``openai`` and ``anthropic`` SDKs on the tiny checkpoint
(random weights, a random vision encoder): each image's placeholder expands to the V4.1
token count, the encoder's rows replace those positions' embeddings, the image's key enters
the block hashes, and the encoder's output is cached.
"""

from __future__ import annotations

import base64
import io

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image

from engine.vision import prepare

pytestmark = pytest.mark.integration

TEXT = "Here is a long preamble so that the prompt spans full cache blocks. " * 12


def _png(seed: int, poke: bool = False) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, size=(48, 64, 3), dtype=np.uint8)
    if poke:
        rgb[20, 30] = 255 - rgb[20, 30]  # one pixel
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _messages(data: bytes | None) -> list[dict]:
    content: list[dict] = [{"type": "text", "text": TEXT}]
    if data is not None:
        content.append({"type": "image_url", "image_url": {"url": _url(data)}})
    content.append({"type": "text", "text": "What is in the picture?"})
    return [{"role": "user", "content": content}]


def _chat(oai: openai.OpenAI, data: bytes | None):
    return oai.chat.completions.create(
        model="deepseek-chat", messages=_messages(data), max_tokens=6, temperature=0.0, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip


def _rendered(api_server, messages: list[dict]) -> int:
    """The prompt's length as recipe renders it: one placeholder token per image."""
    import deepseek_recipe as dr

    opts = dr.ConversionOptions().with_model_alias("deepseek-chat", dr.ModelVersion.DeepseekV41Flash)
    conv = dr.ChatCompletionRequest({"model": "deepseek-chat", "messages": messages}).convert(
        opts.with_default_thinking_mode(False)
    )
    tok = dr.Tokenizer.from_file(api_server.engine.model_info().tokenizer_path)
    return len(dr.DeepseekV41Encoding().with_tokenizer(tok).encode(conv.conversation))


@pytest.fixture(scope="module")
def oai(api_server):
    return openai.OpenAI(base_url=api_server.v1, api_key=api_server.api_key, timeout=120, max_retries=0)


def test_an_image_expands_to_its_token_count_reaches_the_model_and_is_cached(oai, api_server):
    image = _png(1)
    tokens = prepare(image, "auto", 8192, 512).num_tokens  # what the recipe counts for it
    before = api_server.engine.stats().extra
    first = _chat(oai, image)
    # the image's one placeholder became its token count
    assert first.usage.prompt_tokens == _rendered(api_server, _messages(image)) - 1 + tokens
    again = _chat(oai, image)
    after = api_server.engine.stats().extra
    assert after["vision_images_encoded"] - before.get("vision_images_encoded", 0) == 1
    assert after["vision_cache_hits"] - before.get("vision_cache_hits", 0) == 1  # not encoded again
    assert again.choices[0].message.content == first.choices[0].message.content
    hit = again.usage.prompt_tokens_details.cached_tokens
    assert hit >= 512 - 4 * 31  # the blocks holding the image hit the prefix cache
    poked = _chat(oai, _png(1, poke=True))  # the same text and a one-pixel-different image
    assert poked.usage.prompt_tokens == first.usage.prompt_tokens
    assert poked.usage.prompt_tokens_details.cached_tokens < 256  # a miss from the image's block on
    lp = [t.logprob for t in first.choices[0].logprobs.content[0].top_logprobs]
    lq = [t.logprob for t in poked.choices[0].logprobs.content[0].top_logprobs]
    assert lp != lq  # the pixel reached the logits


def test_an_anthropic_base64_image_block_is_served(api_server):
    claude = anthropic.Anthropic(
        base_url=api_server.url, api_key=api_server.api_key, timeout=120, max_retries=0
    )
    data = base64.b64encode(_png(2)).decode()
    msg = claude.messages.create(
        model="deepseek-chat", max_tokens=4,
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
            {"type": "text", "text": "Describe it."},
        ]}],
    )  # fmt: skip
    assert msg.usage.input_tokens > prepare(_png(2), "auto", 8192, 512).num_tokens


@pytest.fixture()
def served_tokens(api_server, monkeypatch) -> dict[str, list[int]]:
    """request id -> every token id the served engine produced for it (read on its thread)."""
    client = api_server.engine
    seen: dict[str, list[int]] = {}
    apply = client._engine._apply

    def recording(outputs, live):
        for out in outputs:
            seen.setdefault(out.request_id, []).extend(out.new_token_ids)
        return apply(outputs, live)

    monkeypatch.setattr(client._engine, "_apply", recording)
    return seen


def _anthropic_messages(count: int) -> list[dict]:
    blocks: list[dict] = [{"type": "text", "text": TEXT}]
    for k in range(count):
        data = base64.b64encode(_png(10 + k)).decode()
        blocks.append(
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
        )
    return [{"role": "user", "content": blocks}]


@pytest.mark.parametrize("count", [1, 2])
def test_served_greedy_tokens_equal_an_offline_llm_chat_with_the_same_images(
    count, oai, api_server, tiny_model, served_tokens
):
    from engine import LLM, SamplingParams

    content: list[dict] = [{"type": "text", "text": TEXT}]
    for k in range(count):
        content.append({"type": "image_url", "image_url": {"url": _url(_png(10 + k))}})
    messages = [{"role": "user", "content": content}]
    r = oai.chat.completions.create(model="deepseek-chat", messages=messages, max_tokens=8, temperature=0.0)
    served = served_tokens[r.id]
    with LLM(tiny_model) as llm:
        (out,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8), thinking=False)
    offline = out.outputs[0].token_ids
    assert len(out.prompt_token_ids) == r.usage.prompt_tokens
    assert offline and served[: len(offline)] == offline


@pytest.mark.parametrize("count", [1, 2])
def test_anthropic_greedy_tokens_equal_an_offline_llm_messages_with_the_same_images(
    count, api_server, tiny_model, served_tokens
):
    """Base64 image blocks through the ``anthropic`` SDK (whose 2.x ``create`` has no
    ``temperature``: it goes in the body) equal ``LLM.messages``, recipe's Messages rendering."""
    from engine import LLM, SamplingParams

    claude = anthropic.Anthropic(
        base_url=api_server.url, api_key=api_server.api_key, timeout=120, max_retries=0
    )
    messages = _anthropic_messages(count)
    msg = claude.messages.create(
        model="deepseek-chat", max_tokens=8, messages=messages, extra_body={"temperature": 0.0}
    )
    with LLM(tiny_model) as llm:
        out = llm.messages(messages, SamplingParams(temperature=0.0, max_tokens=8), thinking=False)
    offline = out.outputs[0].token_ids
    u = msg.usage  # Anthropic's input_tokens leaves out the tokens read from the cache
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == len(
        out.prompt_token_ids
    )
    assert msg.usage.output_tokens == len(offline)
    assert offline and served_tokens[msg.id][: len(offline)] == offline
