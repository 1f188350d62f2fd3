"""The disaggregated stack on a loopback Ray cluster, driven through the ``openai`` SDK.

One prefill and two decode instances of EP 2 (six engine actors: each rank an engine with
its own requests, the two ranks of an instance sharing their experts in lockstep over gloo;
tiny checkpoint, CPU; two engines in each pool), a 12-node KV store with its Redis directory, the router in the
API process fed by the engines' pushed state, and the API server on 127.0.0.1. A second API server over one in-process engine is the
reference: greedy answers must be equal.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import openai
import pytest

from services.api.inprocess import InProcessEngineClient
from services.ray.serving import PoolConfig, RayServingClient
from tests.integration.ray.conftest import served, wait_until
from tests.integration.services.test_local_services import LOOPBACK_PREFIXES, _pids_of_tree, _sockets_of

pytestmark = pytest.mark.integration

ENGINE = {"num_blocks": 32, "max_num_batched_tokens": 256, "cache_event_capacity": 65_536}
CHATS = (
    [{"role": "user", "content": "Write a haiku about rivers."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to five."}],
    [{"role": "user", "content": "long " * 400}],  # several prefill chunks
)


def _eplb(pool: str) -> dict:
    """EPLB on a short window and period (8 and 16 forwards), so that experts move while
    the tests run: one redundant expert per rank."""
    from dataclasses import asdict

    from services.eplb.controller import EplbConfig

    return asdict(EplbConfig(pool, num_redundant_per_rank=1, window_steps=8, period_steps=16))


@pytest.fixture(scope="module")
def stack(ray_local, model, store) -> Iterator[tuple[str, RayServingClient]]:
    """(API base URL, client). The prefill policy alternates engines (round robin), so that a
    shared prefix reaches the other prefill engine; decode placement is the 2D balancer."""
    engine = {**ENGINE, "kv_store": str(store.spec_path)}
    client = RayServingClient(
        model,
        PoolConfig(1, engine, resources={"prefill": 1}, expert_parallel=2, eplb=_eplb("prefill")),
        PoolConfig(2, engine, resources={"decode": 1}, expert_parallel=2, eplb=_eplb("decode")),
        policy="round_robin",
    )
    with served(client) as url:
        yield url, client


@pytest.fixture(scope="module")
def reference(model) -> Iterator[str]:
    with served(InProcessEngineClient(model, num_blocks=32, enable_prefix_caching=False)) as url:
        yield url


_CLIENTS: dict[str, openai.OpenAI] = {}


def _oai(url: str) -> openai.OpenAI:
    """The module's one client for ``url``: a collected client closes its open streams, and
    one never closed warns when collected (the fixture below closes them)."""
    if url not in _CLIENTS:
        _CLIENTS[url] = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    return _CLIENTS[url]


@pytest.fixture(scope="module", autouse=True)
def _close_clients():
    yield
    for oai in _CLIENTS.values():
        oai.close()
    _CLIENTS.clear()


def _chat(url: str, messages, max_tokens: int = 16, stream: bool = False):
    kw = {"model": "deepseek-chat", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    if not stream:
        return _oai(url).chat.completions.create(**kw)
    chunks = list(
        _oai(url).chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def _hog(oai: openai.OpenAI, prompt: str, max_tokens: int):
    """A streamed completion that runs until closed: no chat template, so no stop token but
    EOS, which it ignores. Its first chunk has been read."""
    stream = oai.completions.create(
        model="deepseek-chat", prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))
    return stream


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_greedy_chat_equals_one_engine(stack, reference, i):
    url, _ = stack
    want = _chat(reference, CHATS[i])
    got = _chat(url, CHATS[i])
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.completion_tokens == want.usage.completion_tokens
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    text, chunks = _chat(url, CHATS[i], stream=True)
    assert text == want.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens


def test_seeded_sampling_equals_one_engine(stack, reference):
    url, _ = stack
    kw = {"model": "deepseek-chat", "messages": CHATS[0], "max_tokens": 16, "temperature": 0.9, "seed": 7}
    want = _oai(reference).chat.completions.create(**kw).choices[0].message.content
    assert _oai(url).chat.completions.create(**kw).choices[0].message.content == want


def test_a_full_decode_pool_answers_503_and_holds_nothing(stack):
    """Both decode engines hold a long request's reservation; a request that needs more room
    than either has left is refused with 503 before any work, and nothing stays held."""
    url, client = stack
    decode = client.decode
    hogs, oai = [], _oai(url)
    try:
        for k in range(len(decode.replicas)):
            hog = _hog(oai, f"hog {k}", 4096)  # 17 of the 32 blocks
            hogs.append(hog)
        wait_until(
            lambda: [r.stats().running for r in decode.replicas] == [1] * len(hogs)
        )  # the 2D rule spread them
        refused = decode.refused
        with pytest.raises(openai.APIStatusError) as err:
            _chat(url, [{"role": "user", "content": "too much"}], max_tokens=4000)  # 16 blocks
        assert err.value.status_code == 503 and "no decode engine can take" in str(err.value)
        assert decode.refused == refused + len(decode.replicas)
    finally:
        for hog in hogs:
            hog.close()
    wait_until(
        lambda: all(r.stats().running + r.stats().extra.get("reserved", 0) == 0 for r in decode.replicas)
    )
    assert all(r.alive for r in client.prefill)  # backpressure did not mark a prefill engine down


def test_concurrent_requests_equal_one_engine(stack, reference):
    url, _ = stack
    prompts = [[{"role": "user", "content": f"Question number {k}: why?"}] for k in range(6)]
    want = [_chat(reference, p).choices[0].message.content for p in prompts]

    async def all_at_once():
        aoai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        outs = await asyncio.gather(
            *(
                aoai.chat.completions.create(
                    model="deepseek-chat", messages=p, max_tokens=16, temperature=0.0
                )
                for p in prompts
            )
        )
        await aoai.close()
        return [o.choices[0].message.content for o in outs]

    assert asyncio.run(all_at_once()) == want


def test_a_shared_prefix_on_the_other_prefill_engine_comes_from_the_store(stack):
    url, client = stack
    prefix = "shared context " * 200  # > 2 blocks of 256 tokens
    routed = list(client.router.routed)
    first = _chat(url, [{"role": "user", "content": prefix + "first question"}], max_tokens=2)
    hit_engine = [a - b for a, b in zip(client.router.routed, routed, strict=True)].index(1)
    wait_until(lambda: client.prefill[hit_engine].stats().extra.get("kv_store_blocks_written", 1) > 0)
    time.sleep(0.5)  # the write-through is asynchronous: let the blocks reach the store
    routed = list(client.router.routed)
    second = _chat(url, [{"role": "user", "content": prefix + "second question"}], max_tokens=2)
    other = [a - b for a, b in zip(client.router.routed, routed, strict=True)].index(1)
    assert other != hit_engine  # round robin: the other prefill engine, whose own cache is cold
    assert first.usage.prompt_tokens_details is None or not first.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= 512


def test_decode_placement_follows_the_2d_rule(stack):
    """A long request holds one decode engine; each next request is placed where the 2D
    balancer, given the same pushed loads, puts it: on the idle engine."""
    from router.policy import PolicyContext, RequestView
    from router.sluice import TwoDimDecode

    url, client = stack
    decode = client.decode
    assert decode is not None
    oai = _oai(url)
    hog = _hog(oai, "hold on " * 100, 2000)
    wait_until(lambda: sum(r.stats().running for r in decode.replicas) == 1)
    busy = [r.stats().running for r in decode.replicas].index(1)
    try:
        for k in range(3):
            wait_until(  # the previous request's end has been pushed: the loads are settled
                lambda: all(
                    r.stats().running + r.stats().extra.get("reserved", 0) == (i == busy)
                    for i, r in enumerate(decode.replicas)
                )
            )
            before = list(decode.placed)
            policy = TwoDimDecode(PolicyContext(len(decode.replicas), decode_cost=decode.decode_cost))
            policy.update_loads(decode.loads())
            got = _chat(url, [{"role": "user", "content": f"Place me {k}."}], max_tokens=2)
            placed = [a - b for a, b in zip(decode.placed, before, strict=True)].index(1)
            view = RequestView(f"p{k}", input_len=got.usage.prompt_tokens + 1, block_size=256)
            assert placed == policy.select(list(range(len(decode.replicas))), view) != busy
    finally:
        hog.close()


HELD = ("running", "waiting", "reserved", "held_blocks", "held_swa_slots")


def _holds(r) -> dict[str, float]:
    st = r.stats()
    counts = {"running": st.running, "waiting": st.waiting}
    return {k: float(counts.get(k, st.extra.get(k, 0.0))) for k in HELD}


@pytest.mark.parametrize("when", ["mid-handoff", "mid-decode"])
def test_an_abort_leaves_no_blocks_slots_or_reservations_on_either_side(stack, when):
    """The client goes away right after the first token (the prefill engine has handed the
    sequence off; the decode engine holds its reservation and may be importing it), or
    while the decode engine streams: afterwards no engine holds a sequence, block, SWA slot
    or reservation."""
    url, client = stack
    oai = _oai(url)
    stream = _hog(oai, f"go on {when}", 400)  # its first chunk (the prefill's token) is read
    if when == "mid-decode":
        wait_until(lambda: sum(r.stats().running for r in client.decode.replicas) == 1)
    stream.close()
    engines = [*client.prefill, *client.decode.replicas]
    idle = dict.fromkeys(HELD, 0.0)
    wait_until(lambda: all(_holds(r) == idle for r in engines), what="nothing held anywhere")


def _drive_until(url: str, done, rounds: int = 12) -> None:
    """Send rounds of 4 concurrent chats (so that the 2D balancer spreads them over the
    decode engines) until ``done()``; at most ``rounds`` rounds."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        for k in range(rounds):
            if done():
                return
            msgs = [[{"role": "user", "content": f"move the experts {k}.{j}"}] for j in range(4)]
            list(pool.map(lambda m: _chat(url, m, max_tokens=16), msgs))


def test_eplb_moves_experts_while_serving_and_outputs_stay_equal(stack, reference):
    """EPLB runs in every EP instance's serving loop: experts are re-placed (weights moved
    between the ranks) while requests run, and greedy answers still equal one engine's."""
    url, client = stack
    ranks = [*client.prefill, *client.decode.replicas]

    def moved() -> float:
        return sum(r.stats().extra.get("eplb_layers_moved", 0.0) for r in ranks)

    def every_rank_forwarded() -> bool:
        return all(r.stats().extra.get("ep_forwards", 0.0) > 0 for r in ranks)

    _drive_until(url, lambda: moved() > 0 and every_rank_forwarded())
    assert moved() > 0, [r.stats().extra for r in ranks]
    assert every_rank_forwarded(), [r.stats().extra for r in ranks]
    for messages in CHATS[:2]:
        assert (
            _chat(url, messages).choices[0].message.content
            == _chat(reference, messages).choices[0].message.content
        )


def _families(url: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(family, sample_name: str, **labels) -> float:
    return sum(
        s.value
        for s in family.samples
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_metrics_per_pool_and_engine_and_request_ids_across_processes(stack, caplog):
    """``/metrics`` has TTFT per prefill engine, TPOT and the handoff gap per decode engine,
    queue depth, running requests, KV tokens and handoff bytes per engine, and the EPLB
    imbalance of every EP rank, and the decode balancer's cost model beside its refit to the
    steps the decode engines served; one request's id is in the API process's log and in the
    logs of the prefill and the decode actor that served it."""
    import logging
    from pathlib import Path

    import ray

    url, client = stack
    with caplog.at_level(logging.INFO, logger="services.ray.replica"):
        answer = _chat(url, [{"role": "user", "content": "Name three metrics."}], max_tokens=8)
    rid = answer.id
    line = next(
        r.getMessage() for r in caplog.records if rid in r.getMessage() and "prefill on" in r.getMessage()
    )
    prefill_name, decode_name = line.split("prefill on ")[1].split(", decode on ")
    decode_name = decode_name.split(" ")[0]
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())

    def actor_lines() -> list[str]:
        return [
            ln
            for f in logs.glob("worker-*.err")
            for ln in f.read_text(errors="replace").splitlines()
            if rid in ln
        ]

    wait_until(lambda: len(actor_lines()) >= 3, 10, "the actors' request lines")
    lines = actor_lines()
    assert any("sluice.engine[prefill" in ln and "handing off" in ln for ln in lines), lines
    assert any("sluice.engine[decode" in ln and "resuming from" in ln for ln in lines), lines

    fam = _families(url)
    ttft = fam["sluice_pool_time_to_first_token_seconds"]
    assert (
        _value(ttft, "sluice_pool_time_to_first_token_seconds_count", pool="prefill", engine=prefill_name)
        >= 1
    )
    tpot = fam["sluice_pool_time_per_output_token_seconds"]
    assert (
        _value(tpot, "sluice_pool_time_per_output_token_seconds_count", pool="decode", engine=decode_name)
        >= 1
    )
    gap = fam["sluice_handoff_seconds"]
    assert _value(gap, "sluice_handoff_seconds_count", engine=decode_name) >= 1
    engines = {r.name for r in client.prefill} | {r.name for r in client.decode.replicas}
    for name in (
        "sluice_pool_queued_requests",
        "sluice_pool_running_requests",
        "sluice_pool_kv_tokens",
        "sluice_pool_waiting_kv_tokens",
    ):
        assert {s.labels["engine"] for s in fam[name].samples} == engines, name
    assert _value(fam["sluice_pool_handoff_bytes"], "sluice_pool_handoff_bytes_total", engine=decode_name) > 0

    # every rank of every EP instance reports its EPLB window imbalance (>= 1 by definition)
    def reporting() -> set[str]:
        fam = _families(url)
        return (
            {s.labels["engine"] for s in fam["sluice_eplb_imbalance"].samples}
            if "sluice_eplb_imbalance" in fam
            else set()
        )

    _drive_until(url, lambda: reporting() == engines)
    assert reporting() == engines
    assert all(s.value >= 1.0 for s in _families(url)["sluice_eplb_imbalance"].samples)

    # the decode balancer's cost model, and its refit to the decode steps the engines pushed
    from costmodel.online import DecodeStepSums

    wait_until(lambda: sum(DecodeStepSums.from_extra(r.stats().extra).w for r in client.decode.replicas) > 0)
    fam = _families(url)
    assert fam["sluice_decode_cost_refit_steps"].samples[0].value > 0
    terms = ("d0", "d1", "d2")
    placement = {s.labels["term"]: s.value for s in fam["sluice_decode_cost_model"].samples}
    refit = {s.labels["term"]: s.value for s in fam["sluice_decode_cost_refit"].samples}
    assert placement == {t: getattr(client.decode.decode_cost, t) for t in terms}
    assert refit == {t: getattr(client.decode.refitted, t) for t in terms} != placement
    err = {s.labels["model"]: s.value for s in fam["sluice_decode_cost_rel_rmse"].samples}
    assert err["refit"] <= err["prior"] == err["placement"]  # no table beside the checkpoint


def test_every_listener_is_on_loopback(stack, store):
    """Ray (GCS, raylet, workers: the engine actors), the store nodes, Redis and the API
    server: everything this test started listens on loopback only (``ss -ltnp``)."""
    pids = _pids_of_tree(os.getpid())
    assert set(store.pids()) <= pids
    addrs = _sockets_of(pids)
    url, _ = stack
    assert any(a.endswith(":" + url.rsplit(":", 1)[1]) for a in addrs), "the API server listens"
    assert len(addrs) >= 3 + 12 + 1, f"expected Ray, 12 store nodes and Redis to listen: {addrs}"
    exposed = [a for a in addrs if not a.startswith(LOOPBACK_PREFIXES)]
    assert exposed == [], f"listening beyond loopback: {exposed}"
