"""Decode placement over several decode actors: the router's 2D balancer, then a reservation.

One prefill ``EngineActor`` and two decode ones on the loopback Ray cluster (tiny
checkpoint, fp32, CPU): ``small`` has 8 KV blocks (2048 tokens), ``big`` the default 256.
The pool's choice is checked against ``router.sluice.TwoDimDecode`` called here with the
same loads; refusals, ``PoolFull``, an abort between reserve and resume, and greedy output
against a single ``EngineCore`` are checked with the actors' own counters.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.ray.pool import DecodePool, PooledGenerator, PoolFull
from tests.integration.ray.test_disagg_handoff import prompt_of, reference

pytestmark = pytest.mark.integration

TIMEOUT_S = 120
SMALL_BLOCKS = 8
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
LONG = {"temperature": 0.0, "max_tokens": 1500, "ignore_eos": True}  # runs until aborted
HELD = (
    "running", "waiting", "sequences", "held_blocks", "held_slots", "kv_tokens",
    "reserved", "reserved_blocks", "reserved_tokens", "owed_blocks",
)  # fmt: skip


def get(ref):
    import ray

    return ray.get(ref, timeout=TIMEOUT_S)


def assert_nothing_held(*actors) -> None:
    for stats in get([a.stats.remote() for a in actors]):
        held = {k: stats[k] for k in HELD}
        assert held == dict.fromkeys(HELD, 0), stats


def router_choice(stats: list[dict], request_id: str, n_tokens: int) -> int:
    """The router's 2D decode balancer, fresh, on loads read from the same stats."""
    from router.policy import EngineLoad, PolicyContext, RequestView
    from router.sluice import TwoDimDecode

    policy = TwoDimDecode(PolicyContext(len(stats)))
    policy.update_loads(
        [EngineLoad(i, running=s["running"], kv_tokens=s["kv_tokens"]) for i, s in enumerate(stats)]
    )
    return policy.select(list(range(len(stats))), RequestView(request_id, input_len=n_tokens))


# -- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def actors(ray_local, model) -> Iterator[tuple[object, object, object]]:
    """(prefill, small decode, big decode)."""
    import ray

    from services.ray.actors import remote_engine_actor

    # The session's cluster has 2 CPUs and each live actor keeps the one it was placed with
    # (CPU is absent from ``ray.available_resources()`` with two up): three need num_cpus=0.
    prefill = remote_engine_actor("prefill", str(model), {"max_num_batched_tokens": 512}, num_cpus=0)
    small = remote_engine_actor("decode", str(model), {"num_blocks": SMALL_BLOCKS}, num_cpus=0)
    big = remote_engine_actor("decode", str(model), num_cpus=0)
    get([a.stats.remote() for a in (prefill, small, big)])  # all engines are up
    yield prefill, small, big
    for a in (prefill, small, big):
        ray.kill(a)  # frees the pool resources for the session's other Ray tests


@pytest.fixture
def loaded(actors) -> Iterator[list[str]]:
    """Two long-running sequences (600 and 700 tokens, max_tokens 1500) on ``big``."""
    prefill, _, big = actors
    ids = []
    for i, n in enumerate((600, 700)):
        rid = f"long-{i}"
        _, handoff = prefill.prefill.options(num_returns=2).remote(rid, prompt_of(100 + i, n), LONG)
        out = get(big.resume.remote(handoff, max_new_tokens=1))
        assert out["request_id"] == rid and out["finish_reason"] is None
        ids.append(rid)
    yield ids
    for rid in ids:
        get(big.abort.remote(rid))
    assert_nothing_held(*actors)


# -- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n_tokens", [40, 1500])
def test_the_pool_places_by_the_2d_rule(actors, loaded, n_tokens):
    _, small, big = actors
    pool = DecodePool([small, big], timeout_s=TIMEOUT_S)
    stats = pool.stats()
    assert stats[1]["running"] == 2 and stats[1]["kv_tokens"] > 1300 and stats[0]["running"] == 0
    assert stats[1]["owed_blocks"] > 0  # the running sequences' decode budgets are promised
    want = router_choice(stats, "new", n_tokens)
    got = pool.choose("new", n_tokens, GREEDY["max_tokens"])
    assert got == want == 0  # the idle engine, whatever the request's length
    s = get(small.stats.remote())
    assert s["reserved"] == 1 and s["reserved_tokens"] == n_tokens + GREEDY["max_tokens"]
    assert s["reserved_blocks"] == -(-s["reserved_tokens"] // s["block_size"])
    assert pool.release(got, "new") is True and pool.release(got, "new") is False
    assert get(small.stats.remote())["reserved"] == 0


def test_reservations_count_as_used_and_a_refusal_holds_nothing(actors):
    _, small, _ = actors
    bs = get(small.stats.remote())["block_size"]
    assert get(small.reserve.remote("r1", 4 * bs - 12, 12)) is True  # 4 blocks
    assert get(small.reserve.remote("r2", 3 * bs, 0)) is True  # 3 more: 7 of 8
    assert get(small.reserve.remote("r3", bs + 1, 0)) is False  # 2 blocks: only 1 left
    s = get(small.stats.remote())
    assert (s["reserved"], s["reserved_blocks"], s["room_blocks"], s["refused"] >= 1) == (2, 7, 1, True)
    assert get(small.reserve.remote("r3", bs, 0)) is True  # exactly the last block
    for rid in ("r1", "r2", "r3"):
        assert get(small.abort.remote(rid)) is True  # abort releases a reservation too
    assert_nothing_held(small)


def test_an_import_without_reservation_may_not_take_reserved_room(actors):
    import ray

    prefill, small, _ = actors
    bs = get(small.stats.remote())["block_size"]
    assert get(small.reserve.remote("holder", SMALL_BLOCKS * bs - 12, 12)) is True  # every block
    _, handoff = prefill.prefill.options(num_returns=2).remote("intruder", prompt_of(5, 300), GREEDY)
    with pytest.raises(ray.exceptions.RayTaskError, match="EngineFull|reservations"):
        get(small.resume.remote(handoff))
    assert get(small.stats.remote())["reserved"] == 1
    assert get(small.release.remote("holder")) is True
    assert_nothing_held(prefill, small)


def test_a_refusal_goes_to_the_next_best_and_all_refusing_is_pool_full(actors, loaded):
    _, small, big = actors
    pool = DecodePool([small, big], timeout_s=TIMEOUT_S)
    stats = pool.stats()
    n = SMALL_BLOCKS * stats[0]["block_size"] + 100  # more than ``small`` has at all
    assert router_choice(stats, "too-long-for-small", n) == 0  # the rule alone would pick small
    assert pool.choose("too-long-for-small", n, 12) == 1  # small refused, big took it
    after = pool.stats()
    assert after[0]["refused"] == stats[0]["refused"] + 1 and after[0]["reserved"] == 0
    assert after[1]["reserved"] == 1
    assert pool.release(1, "too-long-for-small")

    huge = stats[1]["total_blocks"] * stats[1]["block_size"]
    with pytest.raises(PoolFull, match=r"no decode engine can take 'huge'.*decode\[1\].*Retry after") as err:
        pool.choose("huge", huge, 12)
    assert (err.value.request_id, err.value.n_tokens, err.value.max_tokens) == ("huge", huge, 12)
    assert [s["reserved"] for s in pool.stats()] == [0, 0]


def test_an_abort_between_reserve_and_resume_frees_everything(actors):
    prefill, small, big = actors
    pool = DecodePool([small, big], timeout_s=TIMEOUT_S)
    gen = PooledGenerator(prefill, pool, timeout_s=TIMEOUT_S)
    info_ref, handoff_ref = prefill.prefill.options(num_returns=2).remote("mid", prompt_of(21, 900), GREEDY)
    info = get(info_ref)
    assert info["finish_reason"] is None
    e = pool.choose(
        "mid", info["prompt_tokens"] + len(info["tokens"]), GREEDY["max_tokens"] - len(info["tokens"])
    )
    assert get(pool.actors[e].stats.remote())["reserved"] == 1
    assert gen.abort("mid") is True  # the reservation was there
    assert gen.abort("mid") is False
    del handoff_ref  # never resumed
    assert_nothing_held(*actors)


@pytest.mark.parametrize("plen", [300, 1000])
def test_greedy_through_the_pool_equals_one_engine(actors, ref, plen):
    prefill, small, big = actors
    gen = PooledGenerator(prefill, DecodePool([small, big], timeout_s=TIMEOUT_S), timeout_s=TIMEOUT_S)
    request_id, prompt = f"pool-greedy-{plen}", prompt_of(plen, plen)
    want, reason = reference(ref, request_id, prompt, GREEDY)
    got = gen.generate(request_id, prompt, GREEDY)
    assert got.handed_off and got.decode_index in (0, 1) and got.prefill_tokens == 1
    assert got.tokens == want and got.finish_reason == reason == "length"
    assert_nothing_held(*actors)
