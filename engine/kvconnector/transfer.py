"""Sequence handoff: ``export_sequence`` and ``import_sequence`` over an ``EngineCore``'s parts.

Export (the steps in flight already applied by the caller) packs the sequence's slot, its
partial tail block and its full blocks behind a ``SequenceState`` (``handoff.py``), then
finishes it on this engine; its blocks stay in this engine's prefix cache.

Import checks everything before changing anything: the header (version, fingerprint,
layout, dtype, checksums), the metadata, every inner payload, the block hashes (recomputed
from the tokens with this engine's extra keys), the grammar replay and the room. Then it
reuses the full blocks this engine already caches, allocates the rest, queues the writes
(applied by the executor before the next forward, in step order) and adds the sequence as
running, so its next step computes the sampled token the exporter had not yet computed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.kvconnector import payload as fmt
from engine.kvconnector.handoff import SequenceState
from engine.scheduler.hashing import ImageSpan, chain_hashes
from engine.scheduler.request import ImageInput, Request, RequestStatus
from engine.step_state import SamplingState

if TYPE_CHECKING:
    from engine.core import EngineCore


class EngineFull(RuntimeError):
    """No room for an imported sequence now (blocks, slots or running sequences): back off
    and retry, or pick another engine. Nothing was changed."""


def export_sequence(core: EngineCore, request_id: str) -> bytes:
    sched, kv, runner = core.scheduler, core.kv, core.runner
    req = sched.requests.get(request_id)
    if req is None:
        raise KeyError(f"no unfinished request {request_id!r} in this engine")
    if req.status != RequestStatus.RUNNING or req.swa_slot is None or req.num_computed == 0:
        raise ValueError(
            f"request {request_id!r} is {req.status.value}: only a running sequence can be exported"
        )
    if req.num_pending or req.num_computed < req.replay_until:
        raise ValueError(
            f"request {request_id!r} is mid-step or still rebuilding its window; export it later"
        )
    bs, n = core.block_size, req.num_computed
    full = n // bs
    st = core.executor.states[request_id]
    state = SequenceState(
        request_id=request_id,
        prompt_token_ids=tuple(req.prompt_token_ids),
        output_token_ids=tuple(req.output_token_ids),
        num_computed=n,
        params=st.params,
        seed=st.seed,
        stop_token_ids=tuple(sorted(req.stop_token_ids)),
        priority=req.priority,
        traffic_class=req.traffic_class,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        replay_until=req.replay_until,
        window_from=req.window_from,
        block_hashes=tuple(sched.cache.hasher_for(req).update(req.all_token_ids)[:full]),
        has_tail=bool(n % bs),
        approximate_from=req.approximate_from,
        bounded_replays=req.bounded_replays,
        images=tuple((i.offset, i.length, i.key) for i in req.images),
    )
    sections = [kv.pack_slot(runner.swa, req.swa_slot)]
    if state.has_tail:
        sections.append(kv.pack_block(runner.pool, req.block_table[full]))
    sections += [kv.pack_block(runner.pool, b) for b in req.block_table[:full]]
    # the images' rows: a preempted or replayed sequence recomputes their positions
    sections += [
        i.embeds.to(kv.dtype).contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
        for i in req.images
    ]
    payload = fmt.encode(fmt.KIND_SEQUENCE, kv.fingerprint, kv.digest, kv.dtype, sections, state.to_meta())
    sched.finish(req, RequestStatus.FINISHED_ABORTED)  # handed over: no message, blocks stay cached
    return payload


def _parse(
    core: EngineCore, payload: bytes
) -> tuple[SequenceState, bytes, bytes | None, list[bytes], tuple[ImageInput, ...]]:
    kv = core.kv
    dec = fmt.decode(
        payload, kind=fmt.KIND_SEQUENCE, fingerprint=kv.fingerprint, digest=kv.digest, dtype=kv.dtype
    )
    try:
        state = SequenceState.from_meta(dec.meta, core.block_size, core.vocab_size)
    except ValueError as exc:
        raise fmt.PayloadError(f"sequence payload refused: {exc}") from None
    sections = [bytes(s) for s in dec.sections]
    want = 1 + int(state.has_tail) + len(state.block_hashes) + len(state.images)
    if len(sections) != want:
        raise fmt.PayloadError(f"sequence payload has {len(sections)} sections, its metadata needs {want}")
    images = _images(core, state, sections[len(sections) - len(state.images) :])
    sections = sections[: len(sections) - len(state.images)]
    slot = sections[0]
    fmt.decode(slot, kind=fmt.KIND_SLOT, fingerprint=kv.fingerprint, digest=kv.digest, dtype=kv.dtype)
    tail = sections[1] if state.has_tail else None
    blocks = sections[1 + int(state.has_tail) :]
    for b in blocks + ([tail] if tail is not None else []):
        kv.verify_block(b)
    tokens = list(state.prompt_token_ids + state.output_token_ids)
    full = len(state.block_hashes)
    spans = [ImageSpan(o, n, k) for o, n, k in state.images]
    if chain_hashes(tokens[: full * core.block_size], core.block_size, core.extra_keys, images=spans) != list(
        state.block_hashes
    ):
        raise fmt.PayloadError(
            "block hashes do not match this engine's (another model, device kind, cache salt or image)"
        )
    return state, slot, tail, blocks, images


def _images(core: EngineCore, state: SequenceState, sections: list[bytes]) -> tuple[ImageInput, ...]:
    """The images' embedding rows, one section each ([length, hidden] in the payload's dtype)."""
    hidden, width = core.runner.model_cfg.hidden_size, torch.tensor([], dtype=core.kv.dtype).element_size()
    out = []
    for (offset, length, key), raw in zip(state.images, sections):
        if len(raw) != length * hidden * width:
            raise fmt.PayloadError(
                f"image at {offset}: {len(raw)} bytes, [{length}, {hidden}] rows need {length * hidden * width}"
            )
        rows = torch.frombuffer(bytearray(raw), dtype=core.kv.dtype).view(length, hidden)
        out.append(ImageInput(offset, length, key, rows))
    return tuple(out)


def import_sequence(core: EngineCore, payload: bytes) -> tuple[Request, int]:
    """Returns the adopted request and how many of its outputs were already delivered."""
    state, slot_payload, tail, block_payloads, images = _parse(core, payload)
    sched = core.scheduler
    if state.request_id in sched.requests:
        raise ValueError(f"request id {state.request_id!r} is already in this engine")
    grammar = None
    if state.params.structured is not None:
        grammar = core.compile_grammar(state.params.structured)
        for tok in state.output_token_ids:  # the executor's rule: accept until the grammar ends
            if not grammar.is_finished:
                grammar.accept(tok)
    req = Request(
        state.request_id, list(state.prompt_token_ids), state.params.max_tokens, frozenset(state.stop_token_ids),
        state.priority, core.extra_keys, traffic_class=state.traffic_class, images=images,
    )  # fmt: skip
    req.output_token_ids = list(state.output_token_ids)
    req.approximate_from, req.bounded_replays = state.approximate_from, state.bounded_replays
    _place(core, state, req, slot_payload, tail, block_payloads)
    sched.add_running(req)
    core.executor.add(
        req.request_id,
        SamplingState(
            state.params, state.seed, list(state.prompt_token_ids), req.stop_token_ids,
            list(state.output_token_ids), grammar,
        ),
    )  # fmt: skip
    return req, len(state.output_token_ids)


def _place(
    core: EngineCore,
    state: SequenceState,
    req: Request,
    slot_payload: bytes,
    tail: bytes | None,
    blocks: list[bytes],
) -> None:
    """Give ``req`` a slot and blocks (cached ones reused), queue the writes; EngineFull if short."""
    sched = core.scheduler
    mgr, slots = sched.cache.blocks, sched.cache.slots
    # Past a bounded replay the payload's blocks are approximate: they are neither matched
    # against this engine's exact blocks nor published under their hashes.
    exact = len(state.block_hashes)
    if state.approximate_from is not None:
        exact = min(exact, state.approximate_from // core.block_size)
    local = mgr.lookup(state.block_hashes[:exact], count=False)
    mgr.acquire(local)
    need = len(blocks) - len(local) + int(tail is not None)
    # Blocks that retained slots hold for prefix reuse are given back if the import needs them.
    if (
        need > mgr.num_available + slots.num_retained_partials
        or slots.num_available == 0
        or len(sched.running) >= sched.config.max_num_seqs
    ):
        mgr.release(local)
        raise EngineFull(
            f"no room for sequence {state.request_id!r}: needs {need} blocks and a slot; "
            f"{mgr.num_available} blocks, {slots.num_available} slots free, "
            f"{len(sched.running)}/{sched.config.max_num_seqs} running"
        )
    sched.cache.make_room(need)
    slot, evicted = slots.allocate()
    if evicted is not None and evicted.partial_block is not None:
        mgr.release([evicted.partial_block])
    fresh = mgr.allocate(need)
    table = list(local)
    for i, block in enumerate(fresh[: len(blocks) - len(local)]):
        idx = len(local) + i
        sched.queue_kv_load(block, blocks[idx])
        if idx < exact:
            mgr.register(block, state.block_hashes[idx])
        table.append(block)
    if tail is not None:
        sched.queue_kv_load(fresh[-1], tail)
        table.append(fresh[-1])
    sched.queue_slot_load(slot, slot_payload)
    req.block_table, req.swa_slot = table, slot
    req.num_computed, req.replay_until, req.window_from = (
        state.num_computed,
        state.replay_until,
        state.window_from,
    )
    req.num_cached_tokens = state.num_cached_tokens
    req.num_registered = exact
