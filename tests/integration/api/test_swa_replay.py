"""Bounded replay through the API, driven by the ``openai`` SDK: opt-in per request
(``swa_replay``), reported in ``usage``, refused with a clear 400 when malformed.

The tiny checkpoint (4 layers, 32-token window) rebuilds a missing window state by replaying
124 tokens exactly or 31 bounded. Each prompt shares a 768-token prefix with the warm-up
request and differs after it, so no retained slot matches: the hit needs a replay.
"""

from __future__ import annotations

import random
import re

import httpx
import openai
import pytest

from tests.integration.api.conftest import RunningServer

pytestmark = pytest.mark.integration

_rng = random.Random(5)
PREFIX = [_rng.randrange(10, 900) for _ in range(768)]


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return PREFIX + [rng.randrange(10, 900) for _ in range(40)]


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=server.api_key, timeout=120, max_retries=0)


def _complete(server: RunningServer, seed: int, **extra):
    return _client(server).completions.create(
        model="deepseek-chat", prompt=_prompt(seed), max_tokens=4, temperature=0, extra_body=extra or None
    )


def test_bounded_replay_is_opt_in_and_reported_in_usage(api_server):
    _complete(api_server, 1)  # publishes the prefix blocks
    exact = _complete(api_server, 2)
    usage = exact.usage.model_extra or {}
    assert "swa_replay" not in usage and exact.usage.prompt_tokens_details.cached_tokens == 768 - 124
    bounded = _complete(api_server, 3, swa_replay="bounded")
    usage = bounded.usage.model_extra or {}
    assert usage.get("swa_replay") == "bounded"
    assert bounded.usage.prompt_tokens_details.cached_tokens == 768 - 31
    stats = api_server.engine.stats().extra
    assert stats["swa_replays_bounded"] >= 1 and stats["swa_replays_exact"] >= 1
    headers = {"Authorization": f"Bearer {api_server.api_key}"}
    text = httpx.get(f"{api_server.url}/metrics", headers=headers, timeout=30).text
    for kind, per in (("bounded", 31), ("exact", 124)):
        n = float(re.search(rf'sluice_swa_replays_total{{kind="{kind}"}} (\S+)', text).group(1))
        tokens = float(re.search(rf'sluice_swa_replayed_tokens_total{{kind="{kind}"}} (\S+)', text).group(1))
        assert n >= 1 and tokens == n * per, (kind, n, tokens)
    assert re.search(r'sluice_swa_slots{state="retained"} [1-9]', text)  # the exact turns' slots


def test_bounded_replay_in_a_chat_stream(api_server):
    client = _client(api_server)
    text = "word " * 400  # several blocks of the rendered prompt
    for suffix, extra in (("one", None), ("two", {"swa_replay": "bounded"})):
        chunks = list(
            client.chat.completions.create(
                model="deepseek-chat", messages=[{"role": "user", "content": text + suffix}], max_tokens=3,
                temperature=0, stream=True, stream_options={"include_usage": True}, extra_body=extra,
            )
        )  # fmt: skip
        usage = next(c.usage for c in chunks if c.usage is not None)
    assert (usage.model_extra or {}).get("swa_replay") == "bounded"


def test_a_malformed_swa_replay_is_a_clear_400(api_server):
    with pytest.raises(openai.BadRequestError) as err:
        _complete(api_server, 4, swa_replay="fast")
    assert "swa_replay must be 'exact'" in str(err.value) and err.value.body["param"] == "swa_replay"
    assert _complete(api_server, 4).choices[0].finish_reason == "length"  # the server is fine
