"""``sluice serve --preset trained --speculative dspark`` through the official SDKs: the served
text equals plain decoding's offline (greedy, and seeded sampling), streamed or not, and
``/metrics`` counts the drafts it verified and accepted."""

from __future__ import annotations

import anthropic
import pytest

from engine import LLM
from engine.checkpoint.presets import SHIPPED
from tests.integration.serve_proc import ServeProcess
from tests.integration.speculation import assert_chats_equal_plain, spec_counts

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
    assert_chats_equal_plain(spec_server.url, plain, MESSAGES, max_tokens=64)
    msg = anthropic.Anthropic(
        base_url=spec_server.url, api_key="unused", timeout=120, max_retries=0
    ).messages.create(model="deepseek-chat", max_tokens=32, messages=MESSAGES)
    assert msg.content and msg.content[0].text.strip()
    counts = spec_counts(spec_server.url)
    assert counts["sluice_spec_verified_tokens_total"] > 0, counts
    assert counts["sluice_spec_accepted_tokens_total"] > 0, counts
    assert counts["sluice_spec_choose_seconds_total"] > 0, counts
    depths = {k: v for k, v in counts.items() if k.startswith("sluice_spec_depth_steps_total{")}
    assert depths and sum(depths.values()) == counts["sluice_spec_steps_total"], counts
