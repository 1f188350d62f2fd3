"""The sglang-router binary as a bench peer: real process, simulated engines on loopback."""

import asyncio

import numpy as np
import pytest

from router.evaluate import reference, replay_builder, simulate
from router.sim import SimConfig
from router.trace import Trace
from services.bench._router_peer import _replay, block_text

pytest.importorskip("sglang_router")
pytestmark = pytest.mark.integration


def chats(n_conv=6, turns=4):
    rows, next_id = [], 0
    for c in range(n_conv):
        blocks = []
        for t in range(turns):
            blocks = blocks + list(range(next_id, next_id + 3))
            next_id += 3
            rows.append((c * 0.05 + t * 1.0, list(blocks)))
    rows.sort(key=lambda r: r[0])
    return Trace(
        "chats",
        np.array([r[0] for r in rows]),
        np.array([len(r[1]) * 512 for r in rows]),
        np.full(len(rows), 8),
        tuple(tuple(r[1]) for r in rows),
    )


def test_block_text_keeps_block_prefix_structure():
    a, b = block_text((1, 2, 3)), block_text((1, 2, 4))
    assert a[:26] == b[:26] and a[26:39] != b[26:39]  # shared blocks are shared characters
    words = block_text(tuple(range(1000))).split()
    assert len(set(words)) == 1000 and len({w[:2] for w in words}) > 200  # distinct, diverge early


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_sglang_router_routes_every_request_and_keeps_chats_on_their_engine():
    trace = chats()
    cfg = SimConfig(num_prefill=3, num_decode=2)
    rec = asyncio.run(_replay(trace, cfg, scale=1.0, budget_s=4.0))
    assert rec["errors"] == []
    assert sorted(rec["prefill"]) == list(range(len(trace)))
    assert set(rec["decode"].values()) <= {0, 1}
    # cache-aware: every later turn of a chat goes where its first turn went
    first: dict[int, int] = {}
    for i, blocks in enumerate(trace.blocks):
        first.setdefault(blocks[0], rec["prefill"][i])
        assert rec["prefill"][i] == first[blocks[0]]
    # and the choices replay through the simulator into a full cache hit on later turns
    ref = reference(trace, cfg)
    res, _ = simulate(trace, *replay_builder(rec["prefill"], rec["decode"])(cfg), cfg, 1.0)
    assert res.cached_tokens.sum() / trace.input_len.sum() == pytest.approx(ref.hit_rate_inf)
