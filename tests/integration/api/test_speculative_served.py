"""``sluice serve --preset trained --speculative dspark`` through the official SDKs: the served
text equals plain decoding's offline (greedy, and seeded sampling), streamed or not, and
``/metrics`` counts the drafts it verified and accepted."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from engine.checkpoint.presets import SHIPPED
from tests.integration.serve_proc import ServeProcess

# make test-slow: a server subprocess plus the offline engine (the identity itself is in
# tests/unit/engine/spec/test_speculation.py, under make test)
pytestmark = [pytest.mark.integration, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Write a Python function that parses a config file."}]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    env = {"SLUICE_HOME": str(home), "SLUICE_LOG_LEVEL": "WARNING", "SLUICE_API_KEYS": ""}
    server = ServeProcess(["--preset", "trained", "--speculative", "dspark"], env)
    try:
        server.wait_until_ready("/health")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def plain() -> LLM:
    llm = LLM(SHIPPED["trained"])
    yield llm
    llm.close()


def test_served_text_equals_plain_decoding_offline(spec_server, plain):
    client = openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="unused", timeout=120, max_retries=0)
    for kw, sp in (
        ({"temperature": 0}, SamplingParams(temperature=0.0, max_tokens=64)),
        ({"temperature": 0.8, "seed": 11}, SamplingParams(temperature=0.8, seed=11, max_tokens=64)),
    ):
        # the API renders without thinking unless asked; LLM.chat's default is the recipe's (thinking)
        want = plain.chat(MESSAGES, sp, thinking=False)[0].outputs[0].text
        r = client.chat.completions.create(model="deepseek-chat", messages=MESSAGES, max_tokens=64, **kw)
        assert r.choices[0].message.content == want, kw
        stream = client.chat.completions.create(
            model="deepseek-chat", messages=MESSAGES, max_tokens=64, stream=True, **kw
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want, kw
    msg = anthropic.Anthropic(
        base_url=spec_server.url, api_key="unused", timeout=120, max_retries=0
    ).messages.create(model="deepseek-chat", max_tokens=32, messages=MESSAGES)
    assert msg.content and msg.content[0].text.strip()
    metrics = httpx.get(f"{spec_server.url}/metrics", timeout=10).text
    counts = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("sluice_spec_") and not line.startswith("#")
    }
    assert counts["sluice_spec_verified_tokens_total"] > 0, counts
    assert counts["sluice_spec_accepted_tokens_total"] > 0, counts
    assert counts["sluice_spec_choose_seconds_total"] > 0, counts
