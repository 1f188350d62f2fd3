"""The same request gives the same tokens offline (``LLM``) and served (``/v1/completions``).

Both run ``EngineCore`` on the same tiny checkpoint with the default engine settings; a
seeded request draws token k from (seed, k) wherever it runs, and greedy is exact. The
completions endpoint takes the prompt as token ids as is (no BOS added) and sends
``ignore_eos=False`` and no stop ids unless asked, so the offline side uses the
``SamplingParams`` defaults for those. The served token ids are read from the engine's own
messages (the response carries text), keyed by the response id, which is the engine
request id.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import openai
import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.integration

PROMPT = [random.Random(1234).randrange(10, 1000) for _ in range(300)]


@pytest.fixture(scope="module")
def oai(api_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=api_server.v1, api_key=api_server.api_key, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def llm(tiny_model) -> Iterator[LLM]:
    engine = LLM(tiny_model)  # the API's engine settings: the EngineConfig defaults
    yield engine
    engine.close()


@pytest.fixture()
def served_tokens(api_server, monkeypatch) -> dict[str, list[int]]:
    """request id -> every token id the served engine produced for it (a stop token included)."""
    client = api_server.engine
    seen: dict[str, list[int]] = {}
    lock = threading.Lock()
    apply = client._engine._apply

    def recording(outputs, live):  # on the engine thread
        with lock:
            for out in outputs:
                seen.setdefault(out.request_id, []).extend(out.new_token_ids)
        return apply(outputs, live)

    monkeypatch.setattr(client._engine, "_apply", recording)
    return seen


def complete(oai, api_server, **kw):
    return oai.completions.create(
        model=api_server.config.served_model_name, prompt=PROMPT, max_tokens=16, **kw
    )


def offline(llm: LLM, **kw) -> tuple[list[int], str, str]:
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=16, **kw))
    c = out.outputs[0]
    return c.token_ids, c.text, c.finish_reason


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0, seed=1234), dict(temperature=0.0), dict(temperature=1.0, seed=7, ignore_eos=True)],
    ids=["seeded", "greedy", "seeded-ignore-eos"],
)
def test_offline_and_served_give_the_same_tokens(oai, api_server, llm, served_tokens, sampling):
    want, text, reason = offline(llm, **sampling)
    api_kw = {k: v for k, v in sampling.items() if k != "ignore_eos"}
    extra = {"ignore_eos": True} if sampling.get("ignore_eos") else None
    for _ in range(2):  # the second request finds the first one's prompt in the prefix cache
        r = complete(oai, api_server, extra_body=extra, **api_kw)
        assert served_tokens[r.id] == want
        choice = r.choices[0]
        assert choice.finish_reason == reason and r.usage.completion_tokens == len(want)
        assert choice.text == text
    assert (r.usage.prompt_tokens_details.cached_tokens or 0) > 0


def test_served_requests_without_a_seed_differ(oai, api_server, served_tokens):
    """No seed: each request's seed is derived from its own id, so two draws differ."""
    first, second = (complete(oai, api_server, temperature=1.0) for _ in range(2))
    assert first.id != second.id
    assert served_tokens[first.id] != served_tokens[second.id]
