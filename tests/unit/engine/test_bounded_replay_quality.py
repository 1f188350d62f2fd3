"""Bounded SWA replay (``W - 1`` tokens) against exact state (`engine.replay_quality`).

On the shipped ``trained`` preset, over held-out stdlib prompts, bounded replay must keep the
greedy token at >= 90% of teacher-forced decode positions (the bar of the bounded-replay
issue), while each prompt's KL stays measurably above zero (the truncation really happens) and
the exact-replay control (``L * (W - 1)`` tokens) matches exact state: agreement 1, KL at
rounding level. A tiny random checkpoint checks the harness's shapes and the control fast.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import BLOCK_TOKENS
from engine.prompts import heldout_prompts, random_prompts
from engine.replay_quality import SlotVariant, default_hit, exact_replay, measure

TRAINED = Path(__file__).resolve().parents[3] / "models" / "trained"
CONTROL_KL = 1e-9  # KL of the exact-replay control: float64 log-softmax of fp32 logits, rounding only
# Bounded replay must move the distributions: the mean KL over prompts above MEAN_KL, every prompt's
# above PROMPT_KL (10x the control's bound; measured: mean 2.7e-4, smallest 1.4e-5 on these 16 prompts).
MEAN_KL = 1e-5
PROMPT_KL = 1e-8


def test_default_hit_is_the_smallest_block_multiple_above_exact_replay() -> None:
    assert BLOCK_TOKENS == 256
    assert exact_replay(8, 128) == 1016 and default_hit(8, 128) == 1024
    assert exact_replay(6, 128) == 762 and default_hit(6, 128) == 768
    assert default_hit(4, 32) == 256  # 124 -> 256
    assert default_hit(2, 129) == 512  # 256 is not strictly above 256


def test_harness_shapes_and_exact_control_on_a_tiny_random_checkpoint(checkpoint_factory) -> None:
    path = checkpoint_factory("tiny")  # 4 layers, window 32: H = 256, exact replay 124
    hit, suffix, decode = 256, 20, 6
    prompts = random_prompts(1024, 3, hit + suffix, seed=1)
    assert (
        prompts == random_prompts(1024, 3, hit + suffix, seed=1) != random_prompts(1024, 3, hit + suffix, 2)
    )
    ticks: list[tuple[int, int]] = []
    q = measure(path, prompts, hit, decode, batch=2, progress=lambda d, t: ticks.append((d, t)))
    assert ticks == [(2, 3), (3, 3)]  # two batches: the last one partial
    assert (q.hit, q.suffix, q.decode, q.layers, q.window, q.replay, q.exact_replay) == (
        256, 20, 6, 4, 32, 31, 124
    )  # fmt: skip
    assert len(q.prompts) == 3
    for p in q.prompts:
        assert p.agreement in {k / decode for k in range(decode + 1)}
        assert p.control_agreement == 1.0 and abs(p.control_kl) < CONTROL_KL
        assert p.kl >= 0.0 and p.free_run is not None and 0 <= p.free_run <= decode
    assert q.control_agreement == 1.0 and q.control_kl < CONTROL_KL
    assert q.mean_kl > MEAN_KL and q.min_kl > PROMPT_KL  # the bounded path really is truncated here too
    with pytest.raises(ValueError, match="multiple of 256"):
        measure(path, prompts, 128, decode)  # not a block multiple


def test_host_slot_variants_on_a_tiny_random_checkpoint(checkpoint_factory) -> None:
    """A native slot of every layer is exact; keeping layer 0 only is bounded replay (its window
    is exact under any replay: it depends on the embeddings alone); keeping all but the last
    layer is closer to exact than bounded replay; MXFP8 moves the distributions a little."""
    path = checkpoint_factory("tiny")
    prompts = random_prompts(1024, 3, 256 + 20, seed=1)
    names = ["native", "mxfp8", "native:1", "native:3"]
    q = measure(
        path, prompts, 256, 6, batch=3, free_run=False, variants=[SlotVariant.parse(n) for n in names]
    )
    got = {v["variant"]: v for v in q.summary()["variants"]}
    assert list(got) == names
    assert got["native"]["mean_agreement"] == 1.0 and got["native"]["mean_kl"] < CONTROL_KL
    assert got["native:1"]["mean_kl"] == pytest.approx(q.mean_kl, rel=1e-6)
    assert got["native:3"]["mean_kl"] < q.mean_kl / 10
    assert 0 < got["mxfp8"]["mean_kl"] < q.mean_kl
    for bad in ("fp4", "native:0", "mxfp8:x"):
        with pytest.raises(ValueError, match="slot variant"):
            SlotVariant.parse(bad)


@pytest.mark.slow  # 16 held-out prompts x 64 decode steps (~36 s): `make test-slow`
def test_bounded_replay_keeps_greedy_agreement_on_held_out_text() -> None:
    hit = default_hit(8, 128)
    prompts = heldout_prompts(TRAINED, 16, hit + 64)
    assert len(prompts) == 16 and all(len(p) == hit + 64 and p[0] == 0 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 16
    variants = [SlotVariant("mxfp8"), SlotVariant("native", 4)]  # host slots: MXFP8; half the layers kept
    q = measure(TRAINED, prompts, hit, 64, batch=16, free_run=False, variants=variants)
    assert (q.layers, q.window, q.hit) == (8, 128, 1024) and q.hit > q.exact_replay
    assert len(q.prompts) == 16
    # the control: the harness sees only the truncation (the fresh slots start as noise)
    assert q.control_agreement == 1.0 and q.control_kl < CONTROL_KL
    # the truncation is real: every prompt's distributions move
    assert q.mean_kl > MEAN_KL and q.min_kl > PROMPT_KL, q.summary()
    assert q.mean_agreement >= 0.90, q.summary()
    for k in range(len(variants)):
        assert q.variant_summary(k)["mean_agreement"] >= 0.90, q.summary()
