"""An EP instance that loses a rank is restarted as a group, on a loopback Ray cluster.

One prefill engine and two decode instances of EP 2 (four decode ranks, each an engine in
lockstep with its peer over gloo). One rank of the decode instance holding a stream is
killed: its peer's collectives fail within the group's timeout, the stream continues on
the other instance from its handoff payload (the client's text equals a clean run's), and
the supervisor restarts the instance whole: both ranks in new processes, the pool at full
strength, serving again.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator

import pytest

from services.ray.serving import PoolConfig, RayServingClient
from tests.integration.ray.conftest import completion_stream, completion_text, served, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~60 s: two EP 2 instances start, then one again

ENGINE = {"num_blocks": 32, "max_num_batched_tokens": 128}


@pytest.fixture(scope="module")
def stack(ray_local, model, store) -> Iterator[tuple[str, RayServingClient]]:
    engine = {**ENGINE, "kv_store": str(store.spec_path)}
    client = RayServingClient(
        model,
        PoolConfig(1, engine, resources={"prefill": 1}),
        PoolConfig(2, engine, resources={"decode": 1}, expert_parallel=2),
    )
    with served(client) as url:
        yield url, client


def _pid(replica) -> int:
    return int(replica.stats().extra["pid"])


def test_a_decode_rank_killed_mid_stream_restarts_its_instance_and_the_stream_goes_on(stack, reference):
    url, client = stack
    ranks = client.decode.replicas
    prompt, n = "one rank of this instance dies here: ", 200
    want = completion_text(reference, prompt, n)
    got, killed, holder = [], None, None
    t_kill = 0.0
    for chunk in completion_stream(url, prompt, n):
        if chunk.choices:
            got.append(chunk.choices[0].text)
        if killed is None and len(got) == 20:
            wait_until(lambda: sum(r.stats().running for r in ranks) == 1, what="the request decoding")
            holder = next(r for r in ranks if r.stats().running == 1)
            instance = holder.name.rsplit(".", 1)[0]
            group = [r for r in ranks if r.name.startswith(instance + ".")]
            old_pids = {_pid(r) for r in group}
            # kill the holder's peer: the holder's engine fails at its next collective
            victim = next(r for r in group if r is not holder)
            killed = _pid(victim)
            os.kill(killed, signal.SIGKILL)
            t_kill = time.monotonic()
    assert killed is not None
    assert "".join(got) == want
    assert sum(p.recoveries for p in client.prefill) == 1
    # the instance comes back whole: both ranks in new processes, every decode rank up
    wait_until(
        lambda: all(r.alive for r in ranks) and not ({_pid(r) for r in group} & old_pids),
        timeout_s=120,
        what="the instance restarted as a group",
    )
    assert all(r.restarts == 1 for r in group)
    # the peer of the dead rank stopped within the group's collective timeout (5 s): no rank
    # waits on a dead one beyond the detection bound (its replica went down then)
    assert holder.down_at is not None and holder.down_at - t_kill <= 5.0 + 0.5, holder.down_at - t_kill
    assert all(r.restarts == 0 for r in ranks if r not in group)
    print(
        f"peer of the killed rank down {holder.down_at - t_kill:.2f} s after the kill; "
        f"instance {instance} back {time.monotonic() - t_kill:.1f} s after it"
    )
    # the restarted instance serves: concurrent requests spread over every decode rank
    prompts = [f"after the group restart {k}" for k in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: completion_text(url, p, 8), prompts))
    assert answers == [completion_text(reference, p, 8) for p in prompts]
    assert any(r.stats().extra.get("ep_forwards", 0.0) > 0 for r in group)
