"""A speculating decode pool on a loopback Ray cluster, driven through the ``openai`` SDK.

One prefill engine actor and one decode instance of EP 2 (two rank actors sharing their
experts, the MTP layer's among them, over gloo) on the trained preset (its MTP layer drafts
tokens the target accepts); the decode engines verify 3 drafts a step (``fixed-3``: they
speculate on every step, whatever this machine's profile), and the rank without the request
matches the other's MTP passes with empty ones. A sequence arrives in the decode engine by
handoff, without the MTP layer's window for its prompt (the drafter starts its window at the
handoff point), so its drafts may be worse; its tokens may not differ: greedy and seeded
answers equal plain decoding's offline, and ``/metrics`` shows the drafts verified and
accepted in the pool, and the decode balancer's cost model refitted to the verifying steps.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from engine import LLM
from engine.checkpoint.presets import SHIPPED
from services.ray.serving import PoolConfig, RayServingClient
from tests.integration.ray.conftest import served, wait_until
from tests.integration.speculation import assert_chats_equal_plain, spec_counts

pytestmark = pytest.mark.integration  # ~25 s on 2 cores

ENGINE = {"num_blocks": 64, "max_num_batched_tokens": 512}
MESSAGES = [{"role": "user", "content": "Write a Python function that parses a config file."}]


@pytest.fixture(scope="module")
def stack(ray_local) -> Iterator[tuple[str, RayServingClient]]:
    client = RayServingClient(
        SHIPPED["trained"],
        PoolConfig(1, ENGINE, resources={"prefill": 1}),
        PoolConfig(1, {**ENGINE, "speculative": "fixed-3"}, resources={"decode": 1}, expert_parallel=2),
    )
    with served(client) as url:
        yield url, client


@pytest.fixture(scope="module")
def plain() -> Iterator[LLM]:
    llm = LLM(SHIPPED["trained"])
    yield llm
    llm.close()


def test_a_speculating_decode_pool_answers_as_plain_decoding(stack, plain):
    url, client = stack
    assert_chats_equal_plain(url, plain, MESSAGES, max_tokens=48)
    counts = spec_counts(url)
    assert counts["sluice_spec_verified_tokens_total"] > 0, counts
    verified, accepted = (
        counts["sluice_spec_verified_tokens_total"],
        counts["sluice_spec_accepted_tokens_total"],
    )
    assert 0 < accepted <= verified, counts
    # the rank without a request ran the other's MTP passes empty: the group stayed in step
    empty = [r.stats().extra.get("ep_empty_mtp_passes", 0.0) for r in client.decode.replicas]
    assert len(empty) == 2 and sum(empty) > 0, empty


def test_the_decode_balancer_refits_to_the_verifying_steps(stack):
    """Every decode step of this pool drafts, and all but a sequence's first verify drafts;
    they are the steps the router's decode cost model is refitted to
    (`StepObserver.observe`), so its refit is not left at the prior."""
    from costmodel.online import DecodeStepSums

    url, client = stack
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    chat.chat.completions.create(model="deepseek-chat", messages=MESSAGES, max_tokens=16, temperature=0.0)
    wait_until(lambda: sum(DecodeStepSums.from_extra(r.stats().extra).w for r in client.decode.replicas) > 0)
    text = httpx.get(f"{url}/metrics", timeout=10).text
    refit = [ln for ln in text.splitlines() if ln.startswith("sluice_decode_cost_refit_steps")]
    assert len(refit) == 1 and float(refit[0].split()[1]) > 0, refit
