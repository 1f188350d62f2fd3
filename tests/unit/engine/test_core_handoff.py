"""Sequence handoff between two ``EngineCore``s on the tiny checkpoint (fp32, CPU).

The contract: a sequence exported from engine A and imported into engine B continues
exactly as if it had never moved. Greedy is exact; seeded sampling draws each token from the
request's own (seed, output index) stream; a constrained request's grammar state is rebuilt
by replaying its outputs. So every handoff is compared token for token with a single-engine
run of the same request (same id, so a seed derived from the id is the same too) on a third
engine, ``ref``, with its prefix cache off: every reference run computes every token.

Bad input to ``import_sequence`` raises a ``PayloadError`` (a ValueError) naming the problem,
changes nothing on the importer, and the importer keeps serving correctly.
"""

from __future__ import annotations

import itertools
import json
import random
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from engine.core import CoreRequest, CoreStats, EngineConfig, EngineCore
from engine.kvconnector import payload as fmt
from engine.kvconnector.transfer import EngineFull
from engine.sampling.params import SamplingParams, StructuredOutput

BS = 256  # tokens per block
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
KEYS = ("alpha", "beta", "gamma")
SCHEMA = {
    "type": "object",
    "properties": {k: {"type": "string", "minLength": 3, "maxLength": 8} for k in KEYS},
    "required": list(KEYS),
    "additionalProperties": False,
}
_ids = itertools.count()


def rid(tag: str) -> str:
    return f"{tag}-{next(_ids)}"


def prompt_of(seed: int, n: int) -> list[int]:
    """``n`` random ids in [10, 1000): clear of the tiny vocabulary's special tokens."""
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def core(model: Path, **kw: object) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model), **kw))  # type: ignore[arg-type]


# -- driving ---------------------------------------------------------------------------------
@dataclass
class Run:
    tokens: list[int]
    finish_reason: str | None
    cached_tokens: int


def step_until(c: EngineCore, request_id: str, n: int | None = None, max_steps: int = 500) -> Run:
    """Step ``c`` until ``request_id`` finishes (or has ``n`` new tokens); only its messages count."""
    run = Run([], None, -1)
    for _ in range(max_steps):
        for o in c.step():
            if o.request_id != request_id:
                continue
            run.tokens += o.new_token_ids
            run.cached_tokens = o.cached_tokens
            if o.finish_reason is not None:
                run.finish_reason = o.finish_reason
                return run
        if n is not None and len(run.tokens) >= n:
            return run
    raise AssertionError(f"{request_id} did not finish in {max_steps} steps ({len(run.tokens)} tokens)")


def step_all(c: EngineCore, runs: dict[str, Run], max_steps: int = 500) -> None:
    """Step ``c`` until every request in ``runs`` finishes, appending to its ``Run``."""
    for _ in range(max_steps):
        if all(r.finish_reason is not None for r in runs.values()):
            return
        for o in c.step():
            if o.request_id in runs:
                runs[o.request_id].tokens += o.new_token_ids
                runs[o.request_id].finish_reason = o.finish_reason
    raise AssertionError(f"not finished in {max_steps} steps: {runs}")


def run_alone(c: EngineCore, request_id: str, prompt: list[int], params: SamplingParams) -> Run:
    c.add(CoreRequest(request_id, tuple(prompt), params))
    return step_until(c, request_id)


def meta_of(c: EngineCore, payload: bytes) -> dict:
    kv = c.kv
    return fmt.decode(
        payload, kind=fmt.KIND_SEQUENCE, fingerprint=kv.fingerprint, digest=kv.digest, dtype=kv.dtype
    ).meta


@dataclass
class Handoff:
    tokens: list[int]  # everything the client saw: A's messages, then B's
    at_export: list[int]  # the outputs when A exported
    payload: bytes
    meta: dict
    cached_on_a: int
    run_b: Run


def export_after(a: EngineCore, request_id: str, prompt: list[int], params: SamplingParams, after: int):
    """Add on A, step until ``after`` tokens, export. Checks A is rid of it afterwards."""
    a.add(CoreRequest(request_id, tuple(prompt), params))
    first = step_until(a, request_id, n=after)
    assert first.finish_reason is None and len(first.tokens) == after
    running = a.stats().running
    payload = a.export_sequence(request_id)
    for o in a.take_outputs():  # the drained steps' messages (none here: the loop is idle between steps)
        assert o.request_id == request_id and o.finish_reason is None
        first.tokens += o.new_token_ids
    # Gone from A: no longer running, unknown to abort and export, and no message ever follows.
    assert a.stats().running == running - 1
    assert request_id not in a.scheduler.requests
    assert a.abort(request_id) is False
    with pytest.raises(KeyError):
        a.export_sequence(request_id)
    assert all(o.request_id != request_id for o in a.step())
    return first, payload


def handoff(
    a: EngineCore, b: EngineCore, request_id: str, prompt: list[int], params: SamplingParams, after: int
) -> Handoff:
    first, payload = export_after(a, request_id, prompt, params, after)
    assert b.import_sequence(payload) == request_id
    rest = step_until(b, request_id)
    return Handoff(
        first.tokens + rest.tokens,
        list(first.tokens),
        payload,
        meta_of(a, payload),
        first.cached_tokens,
        rest,
    )


# -- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(checkpoint_factory) -> Path:
    return checkpoint_factory("tiny")


@pytest.fixture(scope="module")
def a(model) -> Iterator[EngineCore]:
    c = core(model)
    yield c
    c.close()


@pytest.fixture(scope="module")
def b(model) -> Iterator[EngineCore]:
    c = core(model)
    yield c
    c.close()


@pytest.fixture(scope="module")
def ref(model) -> Iterator[EngineCore]:
    """The single-engine reference: no handoff, and no prefix cache (every run computes all)."""
    c = core(model, enable_prefix_caching=False)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tokenizer(a) -> Tokenizer:
    return Tokenizer.from_file(str(a.tokenizer_path))


# -- 1. a handoff continues exactly ----------------------------------------------------------
# (tokens when exported, prompt length, whether the computed length ends inside a block).
# After ``after`` outputs the computed length is prompt + after - 1: the last sampled token is
# computed by the importer's first step.
EXPORT_POINTS = [
    pytest.param(1, 300, True, id="first-token-tail"),
    pytest.param(1, 2 * BS, False, id="first-token-boundary"),
    pytest.param(10, 291, True, id="10-tokens-tail"),
    pytest.param(10, 2 * BS - 9, False, id="10-tokens-boundary"),
]


# Greedy at every export point; seeded at a tail and at a boundary point in `make test`,
# at the other two in `make test-slow`.
HANDOFF_CASES = [
    *(pytest.param(GREEDY, *p.values, id=f"{p.id}-greedy") for p in EXPORT_POINTS),
    *(
        pytest.param(SEEDED, *p.values, id=f"{p.id}-seeded", marks=() if k in (0, 3) else pytest.mark.slow)
        for k, p in enumerate(EXPORT_POINTS)
    ),
]


@pytest.mark.parametrize(("params", "after", "plen", "tail"), HANDOFF_CASES)
def test_handoff_equals_a_single_engine_run(a, b, ref, params, after, plen, tail):
    request_id, prompt = rid("h"), prompt_of(plen * 7 + after, plen)
    want = run_alone(ref, request_id, prompt, params)
    h = handoff(a, b, request_id, prompt, params, after)
    assert h.meta["num_computed"] == plen + after - 1
    assert h.meta["has_tail"] is tail and len(h.meta["block_hashes"]) == (plen + after - 1) // BS
    assert h.at_export == want.tokens[:after]
    assert h.tokens == want.tokens and len(want.tokens) == params.max_tokens
    assert h.run_b.finish_reason == want.finish_reason == "length"


def test_a_seed_derived_from_the_request_id_travels(a, b, ref):
    """No seed given: A derives one from its engine seed and the id; the payload carries it."""
    params = replace(SEEDED, seed=None)
    request_id, prompt = rid("derived"), prompt_of(11, 300)
    want = run_alone(ref, request_id, prompt, params)
    assert handoff(a, b, request_id, prompt, params, after=5).tokens == want.tokens
    other = run_alone(ref, rid("derived"), prompt, params)  # another id: another seed
    assert other.tokens != want.tokens


def test_handoff_with_synchronous_scheduling(model, ref):
    a_sync, b_sync = core(model, async_scheduling=False), core(model, async_scheduling=False)
    try:
        request_id, prompt = rid("sync"), prompt_of(12, 400)
        want = run_alone(ref, request_id, prompt, SEEDED)  # async reference: the same tokens
        assert handoff(a_sync, b_sync, request_id, prompt, SEEDED, after=10).tokens == want.tokens
    finally:
        a_sync.close()
        b_sync.close()


@pytest.mark.parametrize(("pipe_a", "pipe_b"), [(True, True), (True, False)], ids=["both", "exporter"])
def test_handoff_with_pipelined_steps(model, ref, pipe_a, pipe_b):
    """Pipelined steps (the CUDA default; here forced on the CPU): a step may be in flight when
    the sequence is exported. Its token is drained into the export, so A hands over one more
    token than it had streamed, and the whole answer still equals one engine's run."""
    a_pipe, b_pipe = core(model, pipeline_steps=pipe_a), core(model, pipeline_steps=pipe_b)
    try:
        assert a_pipe.config.pipelines_steps is pipe_a and b_pipe.config.pipelines_steps is pipe_b
        for params, after, plen in ((GREEDY, 1, 300), (SEEDED, 10, 2 * BS - 9)):
            request_id, prompt = rid("pipe"), prompt_of(plen + after, plen)
            want = run_alone(ref, request_id, prompt, params)
            h = handoff(a_pipe, b_pipe, request_id, prompt, params, after)
            assert len(h.at_export) == after + int(pipe_a)  # the step in flight, drained
            assert h.meta["num_computed"] == plen + len(h.at_export) - 1
            assert h.tokens == want.tokens and h.run_b.finish_reason == "length"
    finally:
        a_pipe.close()
        b_pipe.close()


@pytest.mark.parametrize(
    ("after", "temperature"),
    [
        pytest.param(1, 0.0, id="1-greedy"),
        pytest.param(12, 1.0, id="12-seeded"),
        pytest.param(1, 1.0, id="1-seeded", marks=pytest.mark.slow),
        pytest.param(12, 0.0, id="12-greedy", marks=pytest.mark.slow),
    ],
)
def test_handoff_of_a_json_schema_request(a, b, ref, tokenizer, temperature, after):
    params = SamplingParams(
        temperature=temperature,
        seed=99,
        max_tokens=64,
        structured=StructuredOutput(json_schema=json.dumps(SCHEMA)),
    )
    request_id, prompt = rid("json"), prompt_of(13, 300)
    want = run_alone(ref, request_id, prompt, params)
    text = tokenizer.decode(want.tokens, skip_special_tokens=True)
    assert text.startswith('{"') and len(want.tokens) > after + 5  # the object goes on
    h = handoff(a, b, request_id, prompt, params, after)
    assert h.tokens == want.tokens and h.run_b.finish_reason == want.finish_reason
    prefix = tokenizer.decode(h.at_export, skip_special_tokens=True)
    assert prefix.startswith("{")  # exported inside the object: what A produced does not parse yet
    with pytest.raises(json.JSONDecodeError):
        json.loads(prefix)
    assert want.finish_reason == "stop"  # the grammar closed the object on B: it parses
    assert set(json.loads(text)) == set(KEYS)


@pytest.mark.parametrize("after", [1, pytest.param(10, marks=pytest.mark.slow)])
def test_handoff_of_a_request_that_hit_a_prefix_on_a(a, b, ref, after):
    """A second request shares 520 tokens (two full blocks) with a first one on A: it skips
    most of them; handed to B it continues like a cold single-engine run of it."""
    first = prompt_of(20 + after, 600)
    run_alone(a, rid("warm"), first, GREEDY)
    prompt = first[:520] + prompt_of(30 + after, 80)
    for params in (GREEDY, SEEDED):
        request_id = rid("prefix")
        want = run_alone(ref, request_id, prompt, params)
        assert want.cached_tokens == 0
        h = handoff(a, b, request_id, prompt, params, after)
        # 2 blocks hit; the last L * (W - 1) = 124 tokens of them are replayed for the window
        assert h.cached_on_a == 2 * BS - 124 == h.meta["num_cached_tokens"]
        assert h.run_b.cached_tokens == h.cached_on_a  # B reports what the request skipped
        assert h.tokens == want.tokens


def test_exported_blocks_stay_cached_on_the_exporter(a, ref):
    prompt = prompt_of(40, 600)
    before = a.stats()
    _, payload = export_after(a, rid("leave"), prompt, GREEDY, after=3)
    after = a.stats()
    assert after.running == before.running and after.kv_tokens == 0 == before.kv_tokens
    assert len(meta_of(a, payload)["block_hashes"]) == 2
    # A third request with the same first 300 tokens hits the exported sequence's first block.
    third_prompt = prompt[:300] + prompt_of(41, 50)
    third = run_alone(a, rid("third"), third_prompt, GREEDY)
    assert third.cached_tokens == BS - 124
    assert third.tokens == run_alone(ref, rid("third"), third_prompt, GREEDY).tokens


@pytest.mark.parametrize("holder_running", [True, False], ids=["held-by-a-running-request", "idle-cached"])
def test_import_reuses_the_blocks_the_importer_caches(model, a, ref, holder_running):
    b2 = core(model)
    try:
        shared = prompt_of(50, 520)
        holder_prompt = shared + prompt_of(51, 80)
        holder = rid("holder")
        b2.add(CoreRequest(holder, tuple(holder_prompt), replace(GREEDY, max_tokens=16)))
        held = step_until(b2, holder, n=1 if holder_running else None)
        cached = b2.scheduler.cache.blocks.lookup(_hashes(b2, shared), count=False)
        assert len(cached) == 2
        request_id, prompt = rid("reuse"), shared + prompt_of(52, 80)
        first, payload = export_after(a, request_id, prompt, GREEDY, after=1)  # 600 computed: 3 blocks
        before = b2.stats()
        b2.import_sequence(payload)
        table = b2.scheduler.requests[request_id].block_table
        assert len(table) == 3 and table[:2] == cached  # B's own copies of the shared blocks
        drop = before.free_blocks - b2.stats().free_blocks
        # held blocks are not free already: only the third is taken; idle cached ones leave the LRU
        assert drop == (1 if holder_running else 3)
        runs = {request_id: Run(list(first.tokens), None, -1), holder: held}
        step_all(b2, runs)
        assert runs[request_id].tokens == run_alone(ref, rid("x"), prompt, GREEDY).tokens
        assert held.tokens == run_alone(ref, rid("x"), holder_prompt, replace(GREEDY, max_tokens=16)).tokens
    finally:
        b2.close()


def _hashes(c: EngineCore, tokens: list[int]) -> list[bytes]:
    from engine.scheduler.hashing import chain_hashes

    return chain_hashes(tokens[: len(tokens) // BS * BS], BS, c.extra_keys)


def test_export_mid_prefill_before_any_output(model, b, ref):
    """A chunked prefill exported between chunks (no output yet) continues on B."""
    chunked = core(model, max_num_batched_tokens=128)
    try:
        request_id, prompt = rid("chunk"), prompt_of(60, 300)
        chunked.add(CoreRequest(request_id, tuple(prompt), SEEDED))
        assert chunked.step() == []  # one 128-token chunk, no token sampled
        payload = chunked.export_sequence(request_id)
        meta = meta_of(chunked, payload)
        assert meta["num_computed"] == 128 and meta["output_token_ids"] == []
        b.import_sequence(payload)
        assert step_until(b, request_id).tokens == run_alone(ref, request_id, prompt, SEEDED).tokens
    finally:
        chunked.close()


def test_export_and_import_back_into_the_same_engine(a, ref):
    """Handing a sequence back to its exporter (say, the other engine was full) continues it."""
    request_id, prompt = rid("back"), prompt_of(70, 300)
    first, payload = export_after(a, request_id, prompt, SEEDED, after=4)
    assert a.import_sequence(payload) == request_id
    rest = step_until(a, request_id)
    assert first.tokens + rest.tokens == run_alone(ref, request_id, prompt, SEEDED).tokens


def test_a_request_id_can_be_reused_after_abort(a, ref):
    request_id, prompt = rid("reuse-id"), prompt_of(71, 100)
    a.add(CoreRequest(request_id, tuple(prompt), GREEDY))
    step_until(a, request_id, n=2)
    assert a.abort(request_id) is True
    assert [o.finish_reason for o in a.take_outputs()] == ["abort"]
    again = run_alone(a, request_id, prompt, GREEDY)  # the same id, added before any other step
    assert again.tokens == run_alone(ref, rid("x"), prompt, GREEDY).tokens


# -- 2. bad input to import_sequence ---------------------------------------------------------
SERVE_PROMPT = prompt_of(80, 64)
SERVE_PARAMS = replace(GREEDY, max_tokens=4)


@pytest.fixture(scope="module")
def serve_want(ref) -> list[int]:
    return run_alone(ref, rid("serve"), SERVE_PROMPT, SERVE_PARAMS).tokens


@pytest.fixture(scope="module")
def good(a) -> tuple[bytes, dict]:
    """A valid payload: 300-token prompt, 3 outputs (one full block, a tail)."""
    _, payload = export_after(a, rid("good"), prompt_of(81, 300), GREEDY, after=3)
    return payload, meta_of(a, payload)


@pytest.fixture(scope="module")
def foreign(checkpoint_factory) -> dict[str, bytes]:
    """Payloads of the same request from another model and from bf16 weights of this one."""
    out = {}
    for name, path, kw in (
        ("other-model", checkpoint_factory("tiny", seed=1), {}),
        ("bfloat16", checkpoint_factory("tiny"), {"dtype": "bfloat16"}),
    ):
        c = core(path, **kw)
        try:
            out[name] = export_after(c, rid(name), prompt_of(81, 300), GREEDY, after=3)[1]
        finally:
            c.close()
    return out


def _sections(payload: bytes, a: EngineCore) -> list[bytes]:
    kv = a.kv
    dec = fmt.decode(
        payload, kind=fmt.KIND_SEQUENCE, fingerprint=kv.fingerprint, digest=kv.digest, dtype=kv.dtype
    )
    return [bytes(s) for s in dec.sections]


def _reencode(a: EngineCore, sections: list[bytes], meta: dict) -> bytes:
    kv = a.kv
    return fmt.encode(fmt.KIND_SEQUENCE, kv.fingerprint, kv.digest, kv.dtype, sections, meta)


def _lie(**changes: object) -> Callable[[bytes, dict, EngineCore], bytes]:
    def build(payload: bytes, meta: dict, a: EngineCore) -> bytes:
        return _reencode(a, _sections(payload, a), {**meta, **changes})

    return build


def _with_version(version: int) -> Callable[[bytes, dict, EngineCore], bytes]:
    """Another format version, with a header checksum that is right for it."""

    def build(payload: bytes, meta: dict, a: EngineCore) -> bytes:
        buf = bytearray(payload)
        struct.pack_into("<H", buf, 4, version)
        n_sections, meta_len = struct.unpack_from("<II", buf, 32)
        size = fmt.header_bytes(n_sections, meta_len)
        struct.pack_into("<Q", buf, size - 8, fmt.checksum(bytes(buf[: size - 8])))
        return bytes(buf)

    return build


def _cut(at: Callable[[bytes], int]) -> Callable[[bytes, dict, EngineCore], bytes]:
    return lambda payload, meta, a: payload[: at(payload)]


def _header_size(payload: bytes) -> int:
    n_sections, meta_len = struct.unpack_from("<II", payload, 32)
    return fmt.header_bytes(n_sections, meta_len)


def _flip_body_byte(payload: bytes, meta: dict, a: EngineCore) -> bytes:
    buf = bytearray(payload)
    buf[-100] ^= 0xFF
    return bytes(buf)


def _swap_slot_and_block(payload: bytes, meta: dict, a: EngineCore) -> bytes:
    s = _sections(payload, a)
    return _reencode(a, [s[2], s[1], s[0]], meta)  # a block where the slot belongs


def _drop_section(payload: bytes, meta: dict, a: EngineCore) -> bytes:
    return _reencode(a, _sections(payload, a)[:-1], meta)


def _wrong_hash(payload: bytes, meta: dict, a: EngineCore) -> bytes:
    return _reencode(a, _sections(payload, a), {**meta, "block_hashes": ["ab" * 32]})


def _all_computed(payload: bytes, meta: dict, a: EngineCore) -> bytes:
    n = len(meta["prompt_token_ids"]) + len(meta["output_token_ids"])
    return _reencode(a, _sections(payload, a), {**meta, "num_computed": n})


BAD = [
    pytest.param(_cut(lambda p: 3), "not a Sluice KV payload|truncated", id="cut-in-magic"),
    pytest.param(
        _cut(lambda p: 30), "truncated: a payload header is at least 40 bytes", id="cut-in-fixed-header"
    ),
    pytest.param(_cut(lambda p: 60), "truncated: header says", id="cut-in-section-table"),
    pytest.param(
        _cut(lambda p: _header_size(p) - 1), "truncated: header says", id="cut-before-header-checksum"
    ),
    pytest.param(
        _cut(lambda p: _header_size(p) + 10), "truncated: header says .* body bytes", id="cut-in-body"
    ),
    pytest.param(_cut(lambda p: len(p) - 1), "truncated: header says .* body bytes", id="cut-last-byte"),
    pytest.param(lambda p, m, a: p + b"\0", "trailing bytes", id="one-byte-appended"),
    pytest.param(lambda p, m, a: b"", "truncated: a payload header is at least 40 bytes, got 0", id="empty"),
    pytest.param(
        lambda p, m, a: random.Random(5).randbytes(len(p)), "not a Sluice KV payload", id="random-bytes"
    ),
    pytest.param(
        lambda p, m, a: b"SLKV" + random.Random(6).randbytes(200),
        "header checksum mismatch|version|header says",
        id="random-after-magic",
    ),
    pytest.param(_with_version(2), "payload format version 2, this engine reads 1", id="format-version-2"),
    pytest.param(_flip_body_byte, "checksum mismatch in section", id="flipped-body-byte"),
    pytest.param(_swap_slot_and_block, r"payload kind 1 \(block\), expected 2 \(slot\)", id="block-as-slot"),
    pytest.param(_drop_section, "has 2 sections, its metadata needs 3", id="missing-section"),
    pytest.param(
        _lie(num_computed=BS - 1), "1 block hashes for 255 computed tokens", id="num-computed-vs-hashes"
    ),
    pytest.param(_lie(has_tail=False), "tail block flag disagrees", id="tail-flag"),
    pytest.param(_lie(handoff_version=2), "sequence handoff version 2", id="handoff-version"),
    pytest.param(_wrong_hash, "block hashes do not match", id="wrong-block-hash"),
    pytest.param(_lie(output_token_ids=[5000]), r"within \[0, 1024\)", id="token-outside-vocab"),
    pytest.param(_lie(params={"temperature": -1}), "temperature", id="bad-params"),
    pytest.param(_lie(seed="x"), "malformed|invalid literal", id="seed-not-int"),
    pytest.param(_lie(block_hashes="zz"), "sequence payload refused", id="hashes-not-hex"),
    pytest.param(_all_computed, "num_computed 303 outside", id="num-computed-all-tokens"),
    pytest.param(_lie(window_from=10_000), "window_from", id="window-beyond-computed"),
    pytest.param(_lie(replay_until=10_000), "replay_until", id="replay-beyond-computed"),
    pytest.param(lambda p, m, a: None, "dtype bfloat16, this engine's cache is float32", id="bfloat16"),
    pytest.param(lambda p, m, a: None, "model fingerprint mismatch", id="other-model"),
]


def test_the_payload_edits_change_only_what_they_name(a, good):
    """Re-encoding the sections and metadata unchanged, or writing version 1 back with the
    header checksum fixed up, gives the payload byte for byte: each bad case below differs
    from a good payload only in what it edits."""
    payload, meta = good
    assert _reencode(a, _sections(payload, a), meta) == payload
    assert _with_version(1)(payload, meta, a) == payload
    assert _with_version(2)(payload, meta, a) != payload


def _unchanged(c: EngineCore) -> tuple[CoreStats, int, list[bytes]]:
    return c.stats(), len(c.scheduler.requests), sorted(c.cached_hashes())


@pytest.mark.parametrize(("build", "message"), BAD)
def test_bad_payload_is_refused_and_the_engine_keeps_serving(
    request, a, b, good, foreign, serve_want, build, message
):
    payload, meta = good
    case = request.node.callspec.id
    bad = foreign[case] if case in foreign else build(payload, meta, a)
    before = _unchanged(b)
    try:
        with pytest.raises(fmt.PayloadError, match=message) as exc:
            b.import_sequence(bad)
    finally:  # wrongly accepted: take it out again so that it does not fail the next cases
        if b.abort(meta["request_id"]):
            b.step()
    assert isinstance(exc.value, ValueError)
    assert _unchanged(b) == before and b.take_outputs() == []
    assert run_alone(b, rid("serve"), SERVE_PROMPT, SERVE_PARAMS).tokens == serve_want


def test_grammar_replay_that_fails_is_refused(a, b, serve_want):
    params = SamplingParams(
        temperature=0.0, max_tokens=40, structured=StructuredOutput(json_schema=json.dumps(SCHEMA))
    )
    _, payload = export_after(a, rid("jsonbad"), prompt_of(82, 300), params, after=3)
    meta = meta_of(a, payload)
    outs = meta["output_token_ids"]
    before = _unchanged(b)
    # outputs after the last full block are not covered by a hash: the grammar replay catches it
    with pytest.raises(ValueError, match="violates the grammar"):
        b.import_sequence(_lie(output_token_ids=[outs[0], 5, 5])(payload, meta, a))
    schema = {**meta["params"]["structured"], "json_schema": '{"type": 5}'}
    with pytest.raises(ValueError, match="json_schema is invalid"):
        b.import_sequence(_lie(params={**meta["params"], "structured": schema})(payload, meta, a))
    assert _unchanged(b) == before
    assert run_alone(b, rid("serve"), SERVE_PROMPT, SERVE_PARAMS).tokens == serve_want


def test_importing_the_same_sequence_twice(a, b, ref):
    request_id, prompt = rid("twice"), prompt_of(83, 300)
    first, payload = export_after(a, request_id, prompt, SEEDED, after=3)
    b.import_sequence(payload)
    before = _unchanged(b)
    with pytest.raises(ValueError, match="already in this engine"):
        b.import_sequence(payload)
    assert _unchanged(b) == before
    rest = step_until(b, request_id)
    assert first.tokens + rest.tokens == run_alone(ref, request_id, prompt, SEEDED).tokens


@pytest.mark.parametrize(
    ("engine_kw", "busy_len", "short"),
    [
        pytest.param(dict(num_blocks=4, num_swa_slots=1, max_num_seqs=1), 100, "slots", id="no-seat"),
        pytest.param(dict(num_blocks=3, num_swa_slots=2, max_num_seqs=2), 600, "blocks", id="no-blocks"),
    ],
)
def test_engine_full_changes_nothing_and_a_retry_succeeds(model, a, ref, engine_kw, busy_len, short):
    tight = core(model, **engine_kw)
    try:
        busy, busy_prompt = rid("busy"), prompt_of(84, busy_len)
        busy_params = replace(GREEDY, max_tokens=8)
        tight.add(CoreRequest(busy, tuple(busy_prompt), busy_params))
        busy_run = step_until(tight, busy, n=1)
        request_id, prompt = rid("full"), prompt_of(85, 300)
        first, payload = export_after(a, request_id, prompt, SEEDED, after=3)
        before = _unchanged(tight)
        with pytest.raises(EngineFull, match="no room for sequence") as exc:
            tight.import_sequence(payload)
        assert ("0 slots free" in str(exc.value)) == (short == "slots")
        assert _unchanged(tight) == before
        busy_run.tokens += step_until(tight, busy).tokens  # the busy request is unharmed
        assert busy_run.tokens == run_alone(ref, rid("x"), busy_prompt, busy_params).tokens
        tight.import_sequence(payload)  # room now: the retry goes through
        rest = step_until(tight, request_id)
        assert first.tokens + rest.tokens == run_alone(ref, request_id, prompt, SEEDED).tokens
    finally:
        tight.close()


# -- 3. export errors ------------------------------------------------------------------------
def test_export_of_an_unknown_or_finished_request_is_a_key_error(a):
    with pytest.raises(KeyError, match="no unfinished request"):
        a.export_sequence("never-added")
    done = rid("done")
    run_alone(a, done, prompt_of(90, 50), replace(GREEDY, max_tokens=2))
    with pytest.raises(KeyError, match="no unfinished request"):
        a.export_sequence(done)


def test_export_of_a_waiting_request_is_refused_and_it_still_runs(a, ref):
    request_id, prompt = rid("waiting"), prompt_of(91, 100)
    a.add(CoreRequest(request_id, tuple(prompt), GREEDY))
    with pytest.raises(ValueError, match="is waiting: only a running sequence can be exported"):
        a.export_sequence(request_id)
    assert step_until(a, request_id).tokens == run_alone(ref, request_id, prompt, GREEDY).tokens


# -- 4. abort after import -------------------------------------------------------------------
@pytest.mark.parametrize("steps_on_b", [0, 3])
@pytest.mark.parametrize(("plen", "after"), [(300, 3), (2 * BS, 1)], ids=["tail", "boundary"])
def test_abort_after_import_frees_everything(model, a, serve_want, steps_on_b, plen, after):
    b2 = core(model)
    try:
        before = b2.stats()
        request_id = rid("abort")
        _, payload = export_after(a, request_id, prompt_of(92 + plen, plen), GREEDY, after=after)
        b2.import_sequence(payload)
        assert b2.stats().running == 1 and b2.stats().free_blocks < before.free_blocks
        if steps_on_b:
            step_until(b2, request_id, n=steps_on_b)
        assert b2.abort(request_id) is True
        assert [o.finish_reason for o in b2.step() if o.request_id == request_id] == ["abort"]
        assert b2.abort(request_id) is False
        st = b2.stats()
        assert (st.running, st.waiting, st.kv_tokens) == (0, 0, 0)
        # Every slot is available again; its slot is retained for prefix reuse, keeping the
        # block of its partial tail (if any), which the pool takes back on demand.
        assert st.extra["free_swa_slots"] == before.extra["free_swa_slots"]
        partial = b2.scheduler.cache.slots.num_retained_partials
        assert st.free_blocks + partial == before.free_blocks
        assert partial == int(bool((plen + after - 1 + steps_on_b) % BS))
        assert run_alone(b2, rid("serve"), SERVE_PROMPT, SERVE_PARAMS).tokens == serve_want
    finally:
        b2.close()
