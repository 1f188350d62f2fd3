"""The vision-encoder pool on a loopback Ray cluster, driven through the ``openai`` SDK.

One prefill and one decode engine actor and a vision pool of two ``VisionActor``s (one CPU
slot each; tiny checkpoint with its random encoder). A chat with one image is encoded on a
vision instance, its rows travel to the prefill engine as a ``KIND_EMBEDDING`` payload and
the engines do not encode: greedy output equals an offline ``LLM.chat`` with the same image.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from PIL import Image

from services.ray.serving import PoolConfig, RayServingClient
from tests.integration.ray.conftest import served, wait_until
from tests.integration.services.test_local_services import LOOPBACK_PREFIXES, _pids_of_tree, _sockets_of

# slow: a Ray deployment with a vision pool (~60-85 s on 2 cores); `make test-slow` runs it
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINE = {"num_blocks": 32, "max_num_batched_tokens": 256}
TEXT = "Here is a long preamble so that the prompt spans full cache blocks. " * 12
MAX_TOKENS = 8


def _png(seed: int) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, size=(48, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def _messages(*seeds: int) -> list[dict]:
    images = [
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(_png(s)).decode()},
        }
        for s in seeds
    ]
    return [{"role": "user", "content": [
        {"type": "text", "text": TEXT}, *images, {"type": "text", "text": "What is in the picture?"},
    ]}]  # fmt: skip


@pytest.fixture(scope="module")
def stack(ray_local, model) -> Iterator[tuple[str, RayServingClient]]:
    client = RayServingClient(
        model,
        PoolConfig(1, ENGINE, resources={"prefill": 1}),
        PoolConfig(1, ENGINE, resources={"decode": 1}),
        vision=PoolConfig(2, resources={"ve": 0.5}, num_cpus=1),  # one CPU slot per instance
        policy="round_robin",
    )
    with served(client) as url:
        yield url, client


def _oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def _vision_stats(client: RayServingClient) -> list[dict[str, float]]:
    import ray

    return ray.get([a.stats.remote() for a in client.vision.actors], timeout=60)


def _engines(client: RayServingClient) -> list:
    return [*client.prefill, *client.decode.replicas]


def test_a_chat_with_an_image_equals_an_offline_llm_chat_and_is_encoded_in_the_pool(stack, model):
    from engine import LLM, SamplingParams

    url, client = stack
    messages = _messages(10)
    r = _oai(url).chat.completions.create(
        model="deepseek-chat", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0
    )
    with LLM(model) as llm:
        (out,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), thinking=False)
    offline = out.outputs[0]
    assert offline.token_ids and r.usage.prompt_tokens == len(out.prompt_token_ids)
    assert r.usage.completion_tokens == len(offline.token_ids)
    assert r.choices[0].message.content == offline.text
    # encoded once, on a vision instance; neither engine ran its encoder
    per = _vision_stats(client)
    assert sum(s["vision_images_encoded"] for s in per) == 1
    assert sum(s["vision_payload_bytes"] for s in per) > 0
    # the engines hold no encoder at all (their stats would carry its counters)
    assert all("vision_images_encoded" not in e.stats().extra for e in _engines(client))
    assert client.stats().extra["vision_pool_images_encoded"] == 1
    assert client.stats().extra["vision_pool_outstanding_image_tokens"] == 0  # released


def test_a_chat_with_two_images_equals_an_offline_llm_chat(stack, model):
    from engine import LLM, SamplingParams

    url, client = stack
    messages = _messages(20, 21)
    r = _oai(url).chat.completions.create(
        model="deepseek-chat", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0
    )
    with LLM(model) as llm:
        (out,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), thinking=False)
    assert r.usage.prompt_tokens == len(out.prompt_token_ids)
    assert r.usage.completion_tokens == len(out.outputs[0].token_ids)
    # the server holds back a trailing incomplete UTF-8 sequence; LLM decodes it as U+FFFD
    assert r.choices[0].message.content == out.outputs[0].text.rstrip("\ufffd")
    assert all(e.stats().extra.get("vision_images_encoded", 0.0) == 0.0 for e in _engines(client))


@pytest.mark.parametrize("seeds", [(30,), (31, 32)])
def test_an_anthropic_chat_with_images_equals_an_offline_llm_messages(stack, model, seeds):
    """Base64 image blocks through the ``anthropic`` SDK (one, then two), encoded on the pool,
    equal ``LLM.messages`` (recipe's Messages rendering) with the same images."""
    import anthropic

    from engine import LLM, SamplingParams

    url, client = stack
    images = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(_png(s)).decode()}}
        for s in seeds
    ]  # fmt: skip
    messages = [{"role": "user", "content": [{"type": "text", "text": TEXT}, *images]}]
    claude = anthropic.Anthropic(base_url=url, api_key="unused", timeout=120, max_retries=0)
    msg = claude.messages.create(
        model="deepseek-chat", max_tokens=MAX_TOKENS, messages=messages, extra_body={"temperature": 0.0}
    )
    with LLM(model) as llm:
        out = llm.messages(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), thinking=False)
    u = msg.usage  # input_tokens leaves out the tokens read from the cache
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == len(
        out.prompt_token_ids
    )
    assert u.output_tokens == len(out.outputs[0].token_ids)
    assert msg.content[0].text == out.outputs[0].text.rstrip("\ufffd")
    assert all(e.stats().extra.get("vision_images_encoded", 0.0) == 0.0 for e in _engines(client))


def test_the_same_image_again_is_a_cache_hit_on_the_idle_first_instance(stack):
    url, client = stack
    before = _vision_stats(client)
    oai = _oai(url)
    kw = {"model": "deepseek-chat", "max_tokens": 4, "temperature": 0.0}
    first = oai.chat.completions.create(messages=_messages(11), **kw)
    again = oai.chat.completions.create(messages=_messages(11), **kw)
    assert again.choices[0].message.content == first.choices[0].message.content
    after = _vision_stats(client)
    # both idle at each call: least outstanding work breaks the tie on the lowest index
    assert after[0]["vision_images_encoded"] - before[0]["vision_images_encoded"] == 1
    assert after[0]["vision_cache_hits"] - before[0]["vision_cache_hits"] == 1
    assert after[1]["vision_calls"] == before[1]["vision_calls"]
    wait_until(lambda: all(e.stats().running == 0 for e in _engines(client)))
    assert all(e.stats().extra.get("vision_images_encoded", 0.0) == 0.0 for e in _engines(client))


def test_vision_metrics_are_exposed(stack):
    import httpx

    url, _ = stack
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for name in ("sluice_vision_images_encoded", "sluice_vision_cache_hits", "sluice_vision_encode_seconds",
                 "sluice_vision_queued_images", "sluice_vision_outstanding_image_tokens"):  # fmt: skip
        assert f'{name}{{instance="vision-0"}}' in text or f'{name}_total{{instance="vision-0"}}' in text, (
            name
        )


def test_every_listener_is_still_on_loopback(stack):
    pids = _pids_of_tree(os.getpid())
    _, client = stack
    assert {int(s["pid"]) for s in _vision_stats(client)} <= pids  # the vision actors run under this test
    addrs = _sockets_of(pids)
    assert len(addrs) >= 3, f"expected Ray and the API server to listen: {addrs}"
    exposed = [a for a in addrs if not a.startswith(LOOPBACK_PREFIXES)]
    assert exposed == [], f"listening beyond loopback: {exposed}"
