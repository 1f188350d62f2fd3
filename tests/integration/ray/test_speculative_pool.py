"""A speculating decode pool on a loopback Ray cluster, driven through the ``openai`` SDK.

One prefill and one decode engine actor on the trained preset (its MTP layer drafts tokens
the target accepts); the decode engine verifies 3 drafts a step (``fixed-3``: it speculates
on every step, whatever this machine's profile). A sequence arrives in the decode engine by
handoff, without the MTP layer's window for its prompt (the drafter starts its window at the
handoff point), so its drafts may be worse; its tokens may not differ: greedy and seeded
answers equal plain decoding's offline, and ``/metrics`` shows the drafts verified and
accepted in the pool.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from engine.checkpoint.presets import SHIPPED
from services.ray.serving import PoolConfig, RayServingClient
from tests.integration.ray.conftest import served

pytestmark = pytest.mark.integration  # ~15 s on 2 cores

ENGINE = {"num_blocks": 64, "max_num_batched_tokens": 512}
MESSAGES = [{"role": "user", "content": "Write a Python function that parses a config file."}]


@pytest.fixture(scope="module")
def stack(ray_local) -> Iterator[str]:
    client = RayServingClient(
        SHIPPED["trained"],
        PoolConfig(1, ENGINE, resources={"prefill": 1}),
        PoolConfig(1, {**ENGINE, "speculative": "fixed-3"}, resources={"decode": 1}),
    )
    with served(client) as url:
        yield url


@pytest.fixture(scope="module")
def plain() -> Iterator[LLM]:
    llm = LLM(SHIPPED["trained"])
    yield llm
    llm.close()


def _spec_counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("sluice_spec_") and not line.startswith("#")
    }


def test_a_speculating_decode_pool_answers_as_plain_decoding(stack, plain):
    oai = openai.OpenAI(base_url=f"{stack}/v1", api_key="unused", timeout=120, max_retries=0)
    for kw, sp in (
        ({"temperature": 0}, SamplingParams(temperature=0.0, max_tokens=48)),
        ({"temperature": 0.8, "seed": 5}, SamplingParams(temperature=0.8, seed=5, max_tokens=48)),
    ):
        want = plain.chat(MESSAGES, sp, thinking=False)[0].outputs[0].text
        got = oai.chat.completions.create(model="deepseek-chat", messages=MESSAGES, max_tokens=48, **kw)
        assert got.choices[0].message.content == want, kw
        stream = oai.chat.completions.create(
            model="deepseek-chat", messages=MESSAGES, max_tokens=48, stream=True, **kw
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want, kw
    counts = _spec_counts(stack)
    assert counts["sluice_spec_verified_tokens_total"] > 0, counts
    assert 0 < counts["sluice_spec_accepted_tokens_total"] <= counts["sluice_spec_verified_tokens_total"], (
        counts
    )
