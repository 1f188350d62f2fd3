"""Prefill -> decode handoff between two Ray actors on the loopback Ray cluster.

A prefill ``EngineActor`` runs the prompt and samples the first token, exports the sequence
as the engine's handoff bytes; the driver passes the ObjectRef of those bytes (never the
bytes) to a decode ``EngineActor``, which imports the sequence and decodes it to its end.
Every request is compared token for token with a single ``EngineCore`` in this process
(prefix cache off: it computes every token) on the same tiny checkpoint (fp32, CPU).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest

from engine.core import CoreRequest, EngineCore
from services.ray.actors import sampling_params
from services.ray.disagg import DisaggregatedGenerator
from tests.integration.services.test_local_services import LOOPBACK_PREFIXES, _pids_of_tree, _sockets_of

pytestmark = pytest.mark.integration

BS = 256  # tokens per KV block
CHUNK = 512  # the prefill engine's max_num_batched_tokens: longer prompts run in chunks
TIMEOUT_S = 120
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
SEEDED = {"temperature": 1.0, "seed": 1234, "max_tokens": 12, "ignore_eos": True}


def prompt_of(seed: int, n: int) -> list[int]:
    """``n`` random ids in [10, 1000): clear of the tiny vocabulary's special tokens."""
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def reference(ref: EngineCore, request_id: str, prompt: list[int], sampling: dict) -> tuple[list[int], str]:
    ref.add(CoreRequest(request_id, tuple(prompt), sampling_params(sampling)))
    tokens: list[int] = []
    for _ in range(10_000):
        for o in ref.step():
            assert o.request_id == request_id
            tokens += o.new_token_ids
            if o.finish_reason is not None:
                return tokens, o.finish_reason
    raise AssertionError(f"{request_id} did not finish")


def assert_nothing_held(*actors) -> None:
    import ray

    for stats in ray.get([a.stats.remote() for a in actors], timeout=TIMEOUT_S):
        held = {
            k: stats[k] for k in ("running", "waiting", "sequences", "held_blocks", "held_slots", "kv_tokens")
        }
        assert held == dict.fromkeys(held, 0), stats


# -- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def actors(ray_local, model) -> Iterator[tuple[object, object]]:
    import ray

    from services.ray.actors import remote_engine_actor

    prefill = remote_engine_actor("prefill", str(model), {"max_num_batched_tokens": CHUNK})
    decode = remote_engine_actor("decode", str(model))
    ray.get([prefill.stats.remote(), decode.stats.remote()], timeout=TIMEOUT_S)  # both engines are up
    yield prefill, decode
    for a in (prefill, decode):
        ray.kill(a)  # frees the pool resources for the session's other Ray tests


@pytest.fixture(scope="module")
def gen(actors) -> DisaggregatedGenerator:
    return DisaggregatedGenerator(*actors, timeout_s=TIMEOUT_S)


# -- tests -----------------------------------------------------------------------------------
# (prompt length, what it exercises): one block's tail; exactly two blocks; a prompt over
# three blocks that the prefill engine runs in two chunks (max_num_batched_tokens = 512).
PROMPTS = [(5, "tiny"), (300, "tail"), (2 * BS, "boundary"), (1000, "chunked-4-blocks")]


@pytest.mark.parametrize(("plen", "what"), PROMPTS, ids=[w for _, w in PROMPTS])
def test_greedy_through_two_actors_equals_one_engine(gen, actors, ref, plen, what):
    import ray

    request_id, prompt = f"greedy-{what}", prompt_of(plen, plen)
    want, reason = reference(ref, request_id, prompt, GREEDY)
    steps_before = ray.get(actors[0].stats.remote(), timeout=TIMEOUT_S)["steps"]
    got = gen.generate(request_id, prompt, GREEDY)
    prefill_steps = ray.get(actors[0].stats.remote(), timeout=TIMEOUT_S)["steps"] - steps_before
    assert prefill_steps >= -(-plen // CHUNK)  # one step per prompt chunk on the prefill actor
    assert got.handed_off and got.prefill_tokens == 1 and got.first_token == want[0]
    assert got.tokens == want and len(want) == GREEDY["max_tokens"]
    assert got.finish_reason == reason == "length"
    assert got.info["prompt_tokens"] == plen
    assert_nothing_held(*actors)


def test_seeded_sampling_through_two_actors_equals_one_engine(gen, actors, ref):
    prompt = prompt_of(7, 700)
    runs = {}
    for request_id, sampling in (
        ("seeded-a", SEEDED),
        ("seeded-b", {**SEEDED, "seed": 99, "top_k": 50, "top_p": 0.9}),
    ):
        want, reason = reference(ref, request_id, prompt, sampling)
        got = gen.generate(request_id, prompt, sampling)
        assert got.tokens == want and got.finish_reason == reason == "length"
        runs[request_id] = got.tokens
    assert runs["seeded-a"] != runs["seeded-b"]  # the seed matters...
    assert gen.generate("seeded-c", prompt, SEEDED).tokens == runs["seeded-a"]  # ...and only the seed
    assert_nothing_held(*actors)


def test_a_request_that_ends_on_the_prefill_actor_is_not_handed_off(gen, actors, ref):
    sampling = {**GREEDY, "max_tokens": 1}
    prompt = prompt_of(3, 40)
    got = gen.generate("one-token", prompt, sampling)
    assert not got.handed_off and got.finish_reason == "length"
    assert got.tokens == reference(ref, "one-token", prompt, sampling)[0]
    assert_nothing_held(*actors)


def test_abort_on_the_decode_actor_mid_request_frees_everything(actors, ref):
    import ray

    prefill, decode = actors
    prompt = prompt_of(11, 600)
    info_ref, handoff_ref = prefill.prefill.options(num_returns=2).remote("abort-mid", prompt, GREEDY)
    info = ray.get(info_ref, timeout=TIMEOUT_S)
    part = ray.get(decode.resume.remote(handoff_ref, max_new_tokens=3), timeout=TIMEOUT_S)
    assert part["finish_reason"] is None and len(part["tokens"]) >= 3
    want, _ = reference(ref, "abort-mid", prompt, GREEDY)
    assert info["tokens"] + part["tokens"] == want[: len(info["tokens"]) + len(part["tokens"])]
    stats = ray.get(decode.stats.remote(), timeout=TIMEOUT_S)
    assert stats["running"] == 1 and stats["held_blocks"] >= 3 and stats["held_slots"] == 1
    more = ray.get(decode.decode.remote("abort-mid", max_new_tokens=2), timeout=TIMEOUT_S)
    assert more["finish_reason"] is None and len(more["tokens"]) >= 2
    assert ray.get(decode.abort.remote("abort-mid"), timeout=TIMEOUT_S) is True
    assert ray.get(decode.abort.remote("abort-mid"), timeout=TIMEOUT_S) is False
    with pytest.raises(ray.exceptions.RayTaskError, match="no running request"):
        ray.get(decode.decode.remote("abort-mid"), timeout=TIMEOUT_S)
    assert_nothing_held(prefill, decode)


def test_a_handoff_never_resumed_holds_nothing(actors):
    import ray

    prefill, decode = actors
    info_ref, handoff_ref = prefill.prefill.options(num_returns=2).remote(
        "never-resumed", prompt_of(12, 400), GREEDY
    )
    assert ray.get(info_ref, timeout=TIMEOUT_S)["finish_reason"] is None
    del handoff_ref  # dropped: the bytes leave the object store, nothing was imported
    assert ray.get(prefill.abort.remote("never-resumed"), timeout=TIMEOUT_S) is False  # already gone
    assert ray.get(decode.abort.remote("never-resumed"), timeout=TIMEOUT_S) is False  # never there
    assert_nothing_held(prefill, decode)


def test_a_refused_payload_changes_nothing_on_the_decode_actor(actors):
    import ray

    _, decode = actors
    with pytest.raises(ray.exceptions.RayTaskError, match="PayloadError|payload"):
        ray.get(decode.resume.remote(b"not a sequence payload"), timeout=TIMEOUT_S)
    assert_nothing_held(decode)


def test_every_ray_listener_is_on_loopback(actors):
    import ray

    pids = _pids_of_tree(os.getpid()) - {os.getpid()}
    actor_pids = {s["pid"] for s in ray.get([a.stats.remote() for a in actors], timeout=TIMEOUT_S)}
    assert actor_pids <= pids, "the engine actors run in this cluster's worker processes"
    addrs = _sockets_of(pids)
    assert len(addrs) >= 3, f"expected Ray's GCS, raylet and workers to listen: {addrs}"
    assert _sockets_of(actor_pids), "the actors' workers listen too (their gRPC servers)"
    exposed = [a for a in addrs if not a.startswith(LOOPBACK_PREFIXES)]
    assert exposed == [], f"Ray listens beyond loopback: {exposed}"
