"""``sluice serve --preset trained`` (what `make run` serves) answers the official ``openai``
SDK with text and no control tokens: the first-use path of a fresh clone."""

from __future__ import annotations

import openai
import pytest

from tests.integration.serve_proc import ServeProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trained_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    env = {"SLUICE_HOME": str(home), "SLUICE_LOG_LEVEL": "WARNING", "SLUICE_API_KEYS": ""}
    server = ServeProcess(["--preset", "trained"], env)
    try:
        server.wait_until_ready("/health")
        yield server
    finally:
        server.stop()
    assert not (home / "checkpoints").exists()  # the shipped preset is not generated


def test_chat_through_the_openai_sdk_has_text_and_no_special_tokens(trained_server):
    client = openai.OpenAI(base_url=f"{trained_server.url}/v1", api_key="unused", timeout=60, max_retries=0)
    assert "trained" in {m.id for m in client.models.list().data}
    messages = [{"role": "user", "content": "Write a Python function that reverses a list."}]
    r = client.chat.completions.create(model="deepseek-chat", messages=messages, max_tokens=48, temperature=0)
    content = r.choices[0].message.content
    assert content and content.strip(), r
    assert "<｜" not in content and "<|" not in content, content
    stream = client.chat.completions.create(
        model="deepseek-chat", messages=messages, max_tokens=48, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == content  # greedy: the same text streamed
