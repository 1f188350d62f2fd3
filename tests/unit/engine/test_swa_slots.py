"""`SWASlots`: its rings as views of a few banks, and the staging of rows a speculative step
may overwrite (`SWASlots.stage`, `StagedRows.undo`)."""

from __future__ import annotations

import torch

from engine.cache.spec import CacheSpec
from engine.cache.swa import SWASlots
from engine.config import ModelConfig
from tests.unit.engine.refmodel import BASE
from tests.unit.engine.test_cache_spec import FLASH


def _slots(cfg: dict, num_slots: int = 4) -> SWASlots:
    spec = CacheSpec.from_model(ModelConfig.from_dict(cfg))
    swa = SWASlots(spec, num_slots, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    for bank in swa.banks:
        bank.copy_(torch.randn(bank.shape, generator=gen))
    return swa


def _snapshot(swa: SWASlots) -> list[torch.Tensor]:
    return [t.clone() for t in swa.layer_rings(range(swa.num_layers))]


def test_every_ring_is_a_view_of_one_bank_entry_of_its_shape() -> None:
    swa = _slots({**BASE, "model_type": "deepseek_v4"})
    rings = swa.layer_rings(range(swa.num_layers))
    assert len(swa.banks) == len({tuple(r.shape) for r in rings}) < len(rings)
    entries = {(b, i) for b, bank in enumerate(swa.banks) for i in range(bank.shape[0])}
    homes = set()
    for ring in rings:
        (home,) = [
            (b, i) for b, bank in enumerate(swa.banks) for i in range(bank.shape[0])
            if bank[i].data_ptr() == ring.data_ptr() and bank[i].shape == ring.shape
        ]  # fmt: skip
        homes.add(home)
        assert ring.is_contiguous()
    assert homes == entries  # each entry is one ring's, none shared
    # V4-Flash's 168 rings (43 layers and the MTP layer's window): the windows and the HCA
    # layers' compressor rings share a shape
    flash = SWASlots(CacheSpec.from_model(ModelConfig.from_dict(FLASH)), 1, torch.float32, "meta")
    assert len(flash.layer_rings(range(flash.num_layers))) == 168 and len(flash.banks) == 3


def test_undo_puts_back_exactly_the_rejected_rows_of_every_staged_ring() -> None:
    swa = _slots({**BASE, "model_type": "deepseek_v4"})
    layers = range(swa.num_layers)
    # slot 1 verifies three drafts at 9..11, slot 3 two at 40..41; a ring shorter than a
    # position wraps it (p % R), each slot's positions on distinct rows of every ring
    slots, positions = [1, 1, 1, 3, 3], [9, 10, 11, 40, 41]
    rejected = [False, True, True, False, True]
    before = _snapshot(swa)
    staged = swa.stage(layers, slots, positions)
    for ring in swa.layer_rings(layers):  # the step writes every staged row
        r = ring.shape[1]
        for s, p in zip(slots, positions):
            ring[s, p % r] = 1000.0 + p
    staged.undo(rejected)
    for ring, old in zip(swa.layer_rings(layers), before):
        r = ring.shape[1]
        want = old.clone()
        for s, p, rej in zip(slots, positions, rejected):
            if not rej:
                want[s, p % r] = 1000.0 + p
        assert torch.equal(ring, want)


def test_staging_some_layers_leaves_the_others_alone() -> None:
    swa = _slots({**BASE, "model_type": "deepseek_v4"})
    before = _snapshot(swa)
    staged = swa.stage([1], [0, 2], [5, 6])
    for ring in swa.layer_rings(range(swa.num_layers)):
        ring[0, 5 % ring.shape[1]] = -1.0
    staged.undo([True, True])
    after = swa.layer_rings(range(swa.num_layers))
    mine = {r.data_ptr() for r in swa.layer_rings([1])}
    for ring, old in zip(after, before):
        if ring.data_ptr() in mine:
            assert torch.equal(ring, old)  # staged: put back
        else:
            assert not torch.equal(ring, old)  # not staged: keeps the write


def test_copy_slot_copies_every_ring_and_nothing_else() -> None:
    swa = _slots({**BASE, "model_type": "deepseek_v4"})
    before = _snapshot(swa)
    swa.copy_slot(0, 2)
    for ring, old in zip(swa.layer_rings(range(swa.num_layers)), before):
        want = old.clone()
        want[2] = old[0]
        assert torch.equal(ring, want)
