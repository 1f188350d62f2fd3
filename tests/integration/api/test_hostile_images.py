"""The hostile image corpus against real servers, through the official SDKs.

A long streaming text request runs through the ``openai`` SDK while every corpus case is
sent (``openai`` data-URL ``image_url`` parts; a few as ``anthropic`` base64 image blocks);
each gets its 4xx and message in under a second, the long request finishes normally and
the server keeps serving. The remote-URL cases that need remote images switched on go to
a second server whose allow-list holds ``localhost``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import anthropic
import openai
import pytest

from services.api.config import ApiConfig
from tests.data.hostile_images import Hostile, accepted, corpus
from tests.integration.api.conftest import RunningServer, _serve

# slow: 41 cases through two SDKs beside a long stream (~17 s): `make test-slow`; the unit
# tests hold every case to its 400 in under 1 s in `make test`
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ANTHROPIC_CASES = (
    "truncated PNG (cut inside IDAT)", "PNG decompression bomb (8000x8000, real zlib)", "SVG (image/svg+xml)",
    "animated GIF (2 frames)", "zero bytes", "wrong content type (text/plain)",
)  # fmt: skip


@pytest.fixture(scope="module")
def remote_server(tiny_model) -> Iterator[RunningServer]:
    cfg = ApiConfig(allow_remote_images=True, image_url_allow_hosts=("localhost",), max_concurrency=2)
    yield from _serve(tiny_model, cfg)


def oai_client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=server.api_key or "none", timeout=30, max_retries=0)


def image_chat(client: openai.OpenAI, url: str) -> object:
    content = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": url}}]
    return client.chat.completions.create(
        model="deepseek-chat", messages=[{"role": "user", "content": content}], max_tokens=2
    )


def refused_via_openai(client: openai.OpenAI, case: Hostile) -> str | None:
    t0 = time.monotonic()
    try:
        image_chat(client, case.url)
    except openai.APIStatusError as exc:
        elapsed = time.monotonic() - t0
        if exc.status_code != case.status or case.expect not in str(exc.message) or elapsed >= 1.0:
            return f"{case.name}: {exc.status_code} in {elapsed:.2f}s: {exc.message[:200]}"
        return None
    return f"{case.name}: accepted"


def refused_via_anthropic(client: anthropic.Anthropic, case: Hostile) -> str | None:
    assert case.anthropic_source is not None
    content = [{"type": "image", "source": case.anthropic_source}, {"type": "text", "text": "what is this"}]
    t0 = time.monotonic()
    try:
        client.messages.create(
            model="deepseek-chat",
            max_tokens=2,
            messages=[{"role": "user", "content": content}],  # type: ignore[typeddict-item]
        )
    except anthropic.APIStatusError as exc:
        elapsed = time.monotonic() - t0
        if exc.status_code != case.status or case.expect not in str(exc.message) or elapsed >= 1.0:
            return f"anthropic {case.name}: {exc.status_code} in {elapsed:.2f}s: {exc.message[:200]}"
        return None
    return f"anthropic {case.name}: accepted"


def test_hostile_images_get_their_4xx_fast_while_a_long_request_streams(api_server, remote_server):
    client = oai_client(api_server)
    claude = anthropic.Anthropic(
        base_url=api_server.url, api_key=api_server.api_key, timeout=30, max_retries=0
    )
    started, good = threading.Event(), {"chunks": 0, "finish": None, "end": 0.0}

    def long_request() -> None:
        stream = client.chat.completions.create(
            model="deepseek-chat", stream=True, max_tokens=800, seed=3,
            messages=[{"role": "user", "content": "Tell me a long story about the sea. " * 20}],
        )  # fmt: skip
        for chunk in stream:
            good["chunks"] += 1
            started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                good["finish"] = chunk.choices[0].finish_reason
        good["end"] = time.monotonic()

    worker = threading.Thread(target=long_request)
    worker.start()
    assert started.wait(60), "the long request never started streaming"
    failures: list[str] = []
    remote = oai_client(remote_server)
    for case in corpus():
        failure = refused_via_openai(remote if case.remote_on else client, case)
        if failure:
            failures.append(failure)
    by_name = {c.name: c for c in corpus()}
    for name in ANTHROPIC_CASES:
        failure = refused_via_anthropic(claude, by_name[name])
        if failure:
            failures.append(failure)
    hostile_done = time.monotonic()
    worker.join(120)
    assert not worker.is_alive()
    assert not failures, "\n".join(failures)
    assert good["finish"] in ("length", "stop") and good["chunks"] > 1
    assert good["end"] > hostile_done, "the long request was not in flight during the corpus"
    # the server still serves: a good image and a text request, both protocols
    ok = image_chat(client, dict(accepted())["CMYK JPEG (Adobe APP14)"])
    assert ok.choices[0].finish_reason in ("length", "stop")  # type: ignore[attr-defined]
    reply = claude.messages.create(
        model="deepseek-chat", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.stop_reason in ("max_tokens", "end_turn")
    assert api_server.engine.stats().running == 0


def test_a_good_image_carries_its_token_count(api_server):
    """The converted request holds recipe's preprocessed image and its V4.1 token count."""
    from services.api.convert import Converter

    converter = Converter(api_server.config, api_server.engine.model_info())
    body = {
        "model": "deepseek-chat", "max_tokens": 2,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": dict(accepted())["JPEG 64x48 YCbCr"], "detail": "low"}},
            {"type": "text", "text": "what is this"},
        ]}],
    }  # fmt: skip
    prep = converter.prepare("chat", json.dumps(body).encode(), body)
    assert prep.images is not None
    (image,) = prep.images.images
    assert image.detail == "low" and image.tokens > 1 and prep.images.token_counts == (image.tokens,)
