"""Checks shared by the served-speculation tests (one process, and a Ray decode pool): a
speculating server answers chats as plain decoding does offline, and counts its drafts."""

from __future__ import annotations

import httpx
import openai

from engine import LLM, SamplingParams

# the sampling fields of each chat, the same in the API request and offline: greedy, seeded
CASES = ({"temperature": 0.0}, {"temperature": 0.8, "seed": 11})


def assert_chats_equal_plain(url: str, plain: LLM, messages: list[dict], max_tokens: int) -> None:
    """Greedy and seeded chats, whole and streamed, equal ``plain``'s offline text."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    for kw in CASES:
        # the API renders without thinking unless asked; LLM.chat's default is the recipe's (thinking)
        want = (
            plain.chat(messages, SamplingParams(max_tokens=max_tokens, **kw), thinking=False)[0]
            .outputs[0]
            .text
        )
        r = client.chat.completions.create(
            model="deepseek-chat", messages=messages, max_tokens=max_tokens, **kw
        )
        assert r.choices[0].message.content == want, kw
        stream = client.chat.completions.create(
            model="deepseek-chat", messages=messages, max_tokens=max_tokens, stream=True, **kw
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want, kw


def spec_counts(url: str) -> dict[str, float]:
    """The ``sluice_spec_*`` samples of the server's ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("sluice_spec_") and not line.startswith("#")
    }
