"""Host slots that keep only the first layers' windows (``EngineConfig.host_swa_layers``).

On a hit, the kept layers' exact windows are loaded and the other layers are rebuilt by a
bounded replay (``W - 1`` tokens) that must not overwrite the kept ones
(``ForwardBatch.swa_keep``). Such a slot is approximate: only requests that accept
approximate state use it, and they are marked and publish nothing.
"""

from __future__ import annotations

import pytest
import torch

from engine.core import EngineCore
from engine.engine_config import EngineConfig
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.kvconnector import caches
from engine.kvconnector.payload import PayloadError, layout_digest
from engine.runner import ModelRunner, RunnerConfig
from engine.scheduler.hashing import chain_hashes
from tests.engine_steps import prompt
from tests.unit.engine.test_host_slots import _conversation

FP = b"host-slot-layers"


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return checkpoint_factory("tiny")  # 4 layers, window 32, CSA and HCA layers


def test_a_slot_payload_of_the_first_layers_writes_those_layers_only(model):
    runner = ModelRunner(model, RunnerConfig(num_blocks=4, num_slots=3, with_mtp=False))
    swa = runner.swa
    g = torch.Generator().manual_seed(0)
    for t in swa._all():
        t.copy_(torch.randn(t.shape, generator=g))
    digest = layout_digest(runner.spec, torch.float32)
    full = caches.pack_slot(swa, 0, FP, digest)
    two = caches.pack_slot(swa, 0, FP, digest, layers=2)
    assert len(two) < len(full)
    before = [t.clone() for t in swa.slot_tensors(1)]
    assert caches.unpack_slot_into(two, swa, 1, FP, digest)["layers"] == 2
    kept = {t.data_ptr() for t in swa.slot_tensors(1, 2)}
    for src, dst, old in zip(swa.slot_tensors(0), swa.slot_tensors(1), before):
        assert torch.equal(dst, src if dst.data_ptr() in kept else old)
    assert sum(1 for _ in swa.slot_tensors(1, 2)) < len(before)
    with pytest.raises(IndexError, match="layers"):
        caches.pack_slot(swa, 0, FP, digest, layers=swa.num_layers + 1)
    # a peer's payload that claims more layers than this engine's slot has is refused
    from engine.kvconnector.payload import KIND_SLOT, encode

    bogus = encode(KIND_SLOT, FP, digest, torch.float32, [b"\0" * 8], {"layers": swa.num_layers + 1})
    with pytest.raises(PayloadError, match="layers"):
        caches.unpack_slot_into(bogus, swa, 2, FP, digest)


def test_the_replay_keeps_the_loaded_layers_and_does_not_depend_on_its_chunking(model):
    """Replay the last W - 1 tokens over a slot that holds the first 2 layers: in one chunk, in
    chunks of 5 and one token at a time (the vectorised decode path). All leave the same state,
    and the kept layers' windows are the exact ones, untouched."""
    runner = ModelRunner(model, RunnerConfig(num_blocks=4, num_slots=4, with_mtp=False))
    swa, w = runner.swa, runner.model_cfg.sliding_window
    hit, keep = 512, 2
    ids = prompt(hit, 5)
    table = list(range(3))
    for a in range(0, hit, 256):
        runner.execute(ForwardBatch.from_sequences([SequenceInput(ids[a : a + 256], a, 0, table, False)]))
    digest = layout_digest(runner.spec, torch.float32)
    payload = caches.pack_slot(swa, 0, FP, digest, layers=keep)
    for slot in (1, 2, 3):
        g = torch.Generator().manual_seed(1)  # the same noise in both: rows never replayed compare equal
        for t in swa.slot_tensors(slot):
            t.copy_(torch.randn(t.shape, generator=g) * 100)  # stale state must not leak
        caches.unpack_slot_into(payload, swa, slot, FP, digest)
    start = hit - (w - 1)

    def seq(lo: int, hi: int, slot: int) -> SequenceInput:
        return SequenceInput(ids[lo:hi], lo, slot, table, False, hit, start, (keep, hit))

    runner.execute(ForwardBatch.from_sequences([seq(start, hit, 1)]))
    for p in range(start, hit):
        batch = ForwardBatch.from_sequences([seq(p, p + 1, 2)])
        assert batch.is_decode
        runner.execute(batch)
    for p in range(start, hit, 5):
        runner.execute(ForwardBatch.from_sequences([seq(p, min(hit, p + 5), 3)]))
    for a, b, c in zip(swa.slot_tensors(1), swa.slot_tensors(2), swa.slot_tensors(3)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
    pos = torch.arange(start, hit) % w
    for layer in range(swa.num_layers):
        same = torch.equal(swa.window[layer][1, pos], swa.window[layer][0, pos])
        assert same == (layer < keep), layer  # kept: exact; the others: rebuilt, approximate


def test_an_engine_with_partial_host_slots_serves_only_approximate_requests(model):
    cfg = dict(model=str(model), num_swa_slots=2, max_num_seqs=2, host_swa_bytes=64 << 20, host_swa_layers=2)
    exact = EngineCore(EngineConfig(**cfg))
    _, tokens, last = _conversation(exact, 120)
    assert last.cached_tokens == 512 - 124 and not last.bounded_replay  # an exact replay instead
    assert exact.stats().extra["swa_slot_hits_host"] == 0
    native = EngineCore(
        EngineConfig(model=str(model), num_swa_slots=2, max_num_seqs=2, host_swa_bytes=64 << 20)
    )
    assert tokens == _conversation(native, 120)[1]

    lossy = EngineCore(EngineConfig(**cfg, swa_replay="bounded"))
    follow, approx, last = _conversation(lossy, 120)
    # the host slot (600 + 19 tokens) less the bounded replay of the unkept layers (31)
    assert last.cached_tokens == 600 + 19 - 31 and last.bounded_replay
    extra = lossy.stats().extra
    assert extra["swa_slot_hits_host"] == 1 and extra["swa_replays_bounded"] == 1
    mine = chain_hashes((follow + approx)[:768], 256, lossy.extra_keys)
    assert mine[1] in set(lossy.cached_hashes()) and mine[2] not in set(lossy.cached_hashes())
    agree = sum(a == b for a, b in zip(approx, tokens)) / len(tokens)
    print(f"2 of 4 layers kept vs exact: greedy agreement {agree:.2f} over {len(tokens)} tokens")


def test_keeping_every_layer_is_the_exact_pool_and_more_is_refused(model):
    layers = EngineCore(EngineConfig(model=str(model), host_swa_bytes=1 << 20)).runner.swa.num_layers
    every = EngineCore(EngineConfig(model=str(model), host_swa_bytes=1 << 20, host_swa_layers=layers))
    assert every.host_slots is not None and every.host_slots.layers is None and not every.host_slots.lossy
    with pytest.raises(ValueError, match="host_swa_layers"):
        EngineCore(EngineConfig(model=str(model), host_swa_bytes=1 << 20, host_swa_layers=layers + 1))
    with pytest.raises(ValueError, match="host_swa_layers"):
        EngineConfig(model=str(model), host_swa_layers=0)
