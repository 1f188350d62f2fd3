"""Handoffs over gRPC (``services.ray.handoff``) on a loopback Ray cluster, through the
``openai`` SDK: one prefill and two decode engines (tiny checkpoint, CPU), a 12-node KV store
with its Redis directory. The prefill engine keeps each payload in its outbox and serves it
from its own gRPC server; the decode engine fetches it by ticket.

Outputs equal one engine's; the outbox lets a payload go when its request ends or is
aborted; a decode engine killed mid-stream is replaced from the payload still held (the
handoff point), and when that payload is gone too the request is prefilled again; the
handoff servers listen on loopback only.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import openai
import pytest

from services.ray.handoff import HandoffConfig
from services.ray.serving import PoolConfig, RayServingClient
from tests.integration.ray.conftest import completion_stream, completion_text, served, wait_until

pytestmark = pytest.mark.integration

ENGINE = {"num_blocks": 32, "max_num_batched_tokens": 128}
HELD = ("running", "waiting", "reserved", "held_blocks", "held_swa_slots", "handoffs_held")
ADMIN_KEY = "operator-key"


@pytest.fixture(scope="module")
def stack(ray_local, model, store) -> Iterator[tuple[str, RayServingClient]]:
    engine = {**ENGINE, "kv_store": str(store.spec_path)}
    client = RayServingClient(
        model,
        PoolConfig(1, engine, resources={"prefill": 1}),
        PoolConfig(2, engine, resources={"decode": 1}),
        handoff=HandoffConfig(transport="grpc"),
    )
    with served(client, admin_keys=(ADMIN_KEY,)) as url:
        yield url, client


def _extra(replica, key: str) -> float:
    return float(replica.stats().extra.get(key, 0.0))


def _holds(r) -> dict[str, float]:
    st = r.stats()
    counts = {"running": st.running, "waiting": st.waiting}
    return {k: float(counts.get(k, st.extra.get(k, 0.0))) for k in HELD}


def _nothing_held(client: RayServingClient) -> None:
    engines = [*client.prefill, *client.decode.replicas]
    idle = dict.fromkeys(HELD, 0.0)
    try:
        wait_until(lambda: all(_holds(r) == idle for r in engines), what="nothing held anywhere")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {[(r.name, _holds(r)) for r in engines]}") from None


def test_outputs_equal_one_engine_and_the_payload_goes_over_grpc(stack, reference):
    url, client = stack
    (prefill,) = client.prefill
    fetched = sum(_extra(r, "handoff_fetched") for r in client.decode.replicas)
    put = _extra(prefill, "handoff_outbox_put")
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    ref = openai.OpenAI(base_url=f"{reference}/v1", api_key="unused", timeout=120, max_retries=0)
    for content in ("Write a haiku about rivers.", "long " * 300):
        kw = {"model": "deepseek-chat", "messages": [{"role": "user", "content": content}], "max_tokens": 12}
        want = ref.chat.completions.create(**kw, temperature=0.0).choices[0].message.content
        assert oai.chat.completions.create(**kw, temperature=0.0).choices[0].message.content == want
        seeded = {**kw, "temperature": 0.9, "seed": 11}
        want = ref.chat.completions.create(**seeded).choices[0].message.content
        assert oai.chat.completions.create(**seeded).choices[0].message.content == want
    wait_until(lambda: _extra(prefill, "handoff_outbox_put") == put + 4, what="four payloads put")
    wait_until(
        lambda: sum(_extra(r, "handoff_fetched") for r in client.decode.replicas) == fetched + 4,
        what="four payloads fetched over gRPC",
    )
    assert sum(_extra(r, "handoff_fetched_bytes") for r in client.decode.replicas) > 0
    _nothing_held(client)  # each payload let go when its request ended
    assert _extra(prefill, "handoff_outbox_dropped") >= 4


@pytest.mark.parametrize("when", ["mid-handoff", "mid-decode"])
def test_an_abort_leaves_no_payload_blocks_slots_or_reservations(stack, when):
    url, client = stack
    stream = completion_stream(url, f"go on {when}", 400)
    next(iter(stream))  # the prefill's token: the payload is in the outbox
    if when == "mid-decode":
        wait_until(lambda: sum(r.stats().running for r in client.decode.replicas) == 1)
    stream.close()
    _nothing_held(client)


def _kill_the_decoding_engine(client: RayServingClient) -> int:
    wait_until(
        lambda: sum(r.stats().running for r in client.decode.replicas) == 1, what="the request decoding"
    )
    victim = next(r for r in client.decode.replicas if r.stats().running == 1)
    pid = int(victim.stats().extra["pid"])
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.slow  # make test-slow: two killed engines and their restarts (~40 s on 2 cores)
@pytest.mark.parametrize("payload", ["held", "gone"])
def test_a_decode_engine_killed_mid_stream_resumes_from_the_outbox_or_prefills_again(
    stack, reference, payload
):
    """``held``: the second decode engine fetches the payload the prefill engine still holds
    (the outbox serves it twice). ``gone``: the payload was let go first, so the fetch fails
    (NOT_FOUND) and the request is prefilled again from the KV store. Either way the client's
    text equals a clean run's."""
    import ray

    url, client = stack
    (prefill,) = client.prefill
    prompt, n = f"the decode engine dies, payload {payload}: ", 200
    want = completion_text(reference, prompt, n)
    served_before = _extra(prefill, "handoff_outbox_fetched")
    recoveries = prefill.recoveries
    got, killed = [], None
    for chunk in completion_stream(url, prompt, n):
        if chunk.choices:
            got.append(chunk.choices[0].text)
        if killed is None and len(got) == 10:
            if payload == "gone":
                (rid,) = prefill.handoffs
                assert ray.get(prefill.actor.drop_handoff.remote(rid), timeout=30)
            killed = _kill_the_decoding_engine(client)
    assert "".join(got) == want
    assert prefill.recoveries == recoveries + (1 if payload == "held" else 2)
    fetched = _extra(prefill, "handoff_outbox_fetched") - served_before
    assert fetched == (2 if payload == "held" else 2)  # held: twice; gone: first, then the new payload
    wait_until(
        lambda: (
            all(r.alive for r in client.decode.replicas)
            and killed not in {int(r.stats().extra["pid"]) for r in client.decode.replicas}
        ),
        what="the killed engine back in a new process",
    )
    _nothing_held(client)


def test_the_handoff_server_listens_on_loopback(stack):
    from tests.conftest import listening_sockets
    from tests.integration.services.test_local_services import LOOPBACK_PREFIXES

    _, client = stack
    (prefill,) = client.prefill
    port = prefill.info["handoff_address"].rsplit(":", 1)[1]
    pid = int(prefill.stats().extra["pid"])
    addrs = [addr for addr, proc in listening_sockets() if f"pid={pid}," in proc]
    assert any(a.endswith(f":{port}") for a in addrs), f"the handoff server listens on {port}: {addrs}"
    assert all(a.startswith(LOOPBACK_PREFIXES) for a in addrs), addrs


def _admin(url: str, capsys, *argv: str) -> tuple[int, str]:
    """``sluice admin ARGV --url URL --json``, in this process (real HTTP to the server)."""
    from services.cli import main

    capsys.readouterr()
    rc = main(["admin", *argv, "--url", url, "--json"])
    return rc, capsys.readouterr().out


def test_a_drained_decode_engine_finishes_its_request_and_takes_no_new_one(
    stack, reference, capsys, monkeypatch
):
    """``sluice admin drain`` (``POST /admin/engines/NAME/drain``): the engine streams the rest
    of the request it holds (text equal to a clean run), new requests all go to the other
    decode engine, ``--wait`` returns once it holds nothing, and ``undrain`` makes it a
    candidate again. A drain set on the engine actor from outside this API process (as
    another API replica's endpoint does) reaches this process's router with the engine's
    pushed state. Wrong keys and unknown engines are refused with a message."""
    import json

    import httpx
    import ray

    url, client = stack
    monkeypatch.setenv("SLUICE_ADMIN_KEYS", ADMIN_KEY)
    decode = client.decode
    prompt, n = "drain this engine: ", 120
    want = completion_text(reference, prompt, n)
    chunks = iter(completion_stream(url, prompt, n))
    got = [c.choices[0].text for c in [next(chunks)] if c.choices]
    wait_until(lambda: sum(r.stats().running for r in decode.replicas) == 1, what="the request decoding")
    busy = next(i for i, r in enumerate(decode.replicas) if r.stats().running == 1)
    name = decode.replicas[busy].name
    rc, out = _admin(url, capsys, "drain", name)
    assert rc == 0 and json.loads(out)["draining"] is True
    try:
        assert not client.drained(name)  # it still holds the request
        before = list(decode.placed)
        for k in range(3):
            completion_text(url, f"while draining {k}", 4)
        assert decode.placed[busy] == before[busy] and sum(decode.placed) == sum(before) + 3
        got += [c.choices[0].text for c in chunks if c.choices]
        assert "".join(got) == want
        rc, out = _admin(url, capsys, "drain", name, "--wait", "--timeout-s", "30", "--poll-s", "0.1")
        assert rc == 0 and json.loads(out)["drained"] is True
        rc, out = _admin(url, capsys, "engines")
        rows = {r["name"]: r for r in json.loads(out)}
        assert rows[name]["draining"] and rows[name]["drained"] and rows[name]["running"] == 0
        assert set(rows) == {r.name for r in [*client.prefill, *decode.replicas]}
    finally:
        assert _admin(url, capsys, "undrain", name)[0] == 0
    assert not decode.replicas[busy].draining
    key = {"Authorization": f"Bearer {ADMIN_KEY}"}
    refused = httpx.post(f"{url}/admin/engines/decode-9/drain", headers=key)
    assert refused.status_code == 404 and name in refused.json()["error"]["message"]
    assert httpx.get(f"{url}/admin/engines", headers={"Authorization": "Bearer not-it"}).status_code == 401
    assert httpx.get(f"{url}/admin/engines").status_code == 401
    # drained from outside this API process: on the actor, as another replica's endpoint does
    other = decode.replicas[1 - busy]
    ray.get(other.actor.set_draining.remote(True))
    try:
        wait_until(lambda: other.draining, what=f"{other.name}'s pushed drain")
        placed = decode.placed[busy]
        completion_text(url, "after draining", 4)
        assert decode.placed[busy] == placed + 1, "the undrained engine takes requests again"
    finally:
        ray.get(other.actor.set_draining.remote(False))
    wait_until(lambda: not other.draining, what=f"{other.name} accepting again")
