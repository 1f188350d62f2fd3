"""Engine actors that crash mid-request, on a loopback Ray cluster, through the ``openai`` SDK.

A decode engine killed mid-stream: the stream continues on another decode engine from the
handoff payload, and the client's text equals a clean run's. A prefill engine killed
mid-prompt: the router retries the request on the other prefill engine. Either way Ray
restarts the killed actor and its engine comes back: the pool is at full strength again.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator

import openai
import pytest

from services.ray.serving import PoolConfig, RayServingClient
from tests.integration.ray.conftest import completion_stream, completion_text, served, wait_until

# slow: a Ray stack with a store, killed engines (~45 s on 2 cores); `make test-slow` runs it
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINE = {"num_blocks": 32, "max_num_batched_tokens": 128}


@pytest.fixture(scope="module")
def stack(ray_local, model, store) -> Iterator[tuple[str, RayServingClient]]:
    engine = {**ENGINE, "kv_store": str(store.spec_path)}
    client = RayServingClient(
        model,
        PoolConfig(2, engine, resources={"prefill": 1}),
        PoolConfig(2, engine, resources={"decode": 1}),
        policy="round_robin",
    )
    with served(client) as url:
        yield url, client


def _lost_object():
    """An ObjectRef that cannot be read: the output of a task that failed, as a payload
    whose node was lost cannot be read (a call taking it as an argument fails)."""
    import ray

    @ray.remote(num_cpus=0, max_retries=0)
    def gone() -> bytes:
        raise RuntimeError("the node holding this handoff payload is gone")

    return gone.remote()


def _kill(replica) -> int:
    pid = int(replica.stats().extra["pid"])
    os.kill(pid, signal.SIGKILL)
    return pid


def _at_full_strength(replicas, killed_pid: int) -> None:
    wait_until(
        lambda: (
            all(r.alive for r in replicas)
            and killed_pid not in {int(r.stats().extra["pid"]) for r in replicas}
        ),
        what="every engine up again, the killed one in a new process",
    )


def test_a_decode_engine_killed_mid_stream_the_client_gets_the_rest_unchanged(stack, reference):
    url, client = stack
    decode = client.decode
    prompt, n = "the decode engine dies here: ", 300
    want = completion_text(reference, prompt, n)
    stream = completion_stream(url, prompt, n)
    got, killed = [], None
    for chunk in stream:
        if chunk.choices:
            got.append(chunk.choices[0].text)
        if killed is None and len(got) == 20:
            wait_until(
                lambda: sum(r.stats().running for r in decode.replicas) == 1, what="the request decoding"
            )
            victim = next(r for r in decode.replicas if r.stats().running == 1)
            killed = _kill(victim)
    assert killed is not None
    assert "".join(got) == want
    assert sum(p.recoveries for p in client.prefill) == 1
    _at_full_strength(decode.replicas, killed)
    assert sum(r.restarts for r in decode.replicas) == 1
    assert completion_text(url, "after the restart", 8) == completion_text(reference, "after the restart", 8)


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_a_prefill_engine_killed_mid_prompt_is_retried_on_the_other(stack, reference):
    url, client = stack
    prompt = " ".join(f"word{i}" for i in range(1500))  # many 128-token chunks
    want = completion_text(reference, prompt, 16)
    failovers = client.router.failovers
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the API answers once the first token is there
        answer = pool.submit(completion_text, url, prompt, 16)
        wait_until(lambda: any(r.stats().running for r in client.prefill), what="the prompt prefilling")
        victim = next(r for r in client.prefill if r.stats().running)
        killed = _kill(victim)
        assert answer.result(timeout=120) == want
    assert client.router.failovers == failovers + 1
    _at_full_strength(client.prefill, killed)


def test_with_the_handoff_point_and_the_store_gone_the_stream_ends_within_5_s(stack, store):
    """Runs last: it stops the store. The decode engine dies after the request's payload
    was freed from Ray's object store and the store's nodes stopped: nothing to resume or
    re-prefill from, so the stream ends with a clear error, within 5 s of the kill."""
    import ray

    url, client = stack
    decode = client.decode
    stream = completion_stream(url, "nothing to come back to: ", 400)
    chunks = iter(stream)
    next(chunks)
    wait_until(lambda: sum(r.stats().running for r in decode.replicas) == 1, what="the request decoding")
    (handoff,) = [h for p in client.prefill for h in p.handoffs.values()]
    handoff.payload_ref = _lost_object()  # as when the node holding the payload is lost
    with pytest.raises(ray.exceptions.RayError):
        ray.get(handoff.payload_ref, timeout=5)
    store.stop()
    victim = next(r for r in decode.replicas if r.stats().running == 1)
    killed = _kill(victim)
    t0 = time.monotonic()
    with pytest.raises(
        openai.APIError, match="cannot continue: its decode engine died, its handoff payload is gone"
    ):
        for _ in chunks:
            pass
    assert time.monotonic() - t0 < 5.0
    del killed  # its restart cannot load an engine: the store it names is gone
