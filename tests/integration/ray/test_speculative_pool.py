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

import pytest

from engine import LLM
from engine.checkpoint.presets import SHIPPED
from services.ray.serving import PoolConfig, RayServingClient
from tests.integration.ray.conftest import served
from tests.integration.speculation import assert_chats_equal_plain, spec_counts

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


def test_a_speculating_decode_pool_answers_as_plain_decoding(stack, plain):
    assert_chats_equal_plain(stack, plain, MESSAGES, max_tokens=48)
    counts = spec_counts(stack)
    assert counts["sluice_spec_verified_tokens_total"] > 0, counts
    verified, accepted = (
        counts["sluice_spec_verified_tokens_total"],
        counts["sluice_spec_accepted_tokens_total"],
    )
    assert 0 < accepted <= verified, counts
