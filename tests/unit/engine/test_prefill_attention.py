"""Prefill attention in bounded query chunks (engine/model/prefill.py).

The chunked computations must not change a token's result: the indexer's running top-k
equals one sort over the whole row, ties included, for any tile; attention split into
chunks of any size equals one chunk and an independent dense reference (sliding window,
HCA entries, sinks); and a runner whose steps take many chunks gives the logits of one
that takes one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.model import prefill
from engine.model.compressor import Indexer, topk_lowest_index
from engine.runner import ModelRunner, RunnerConfig


def _indexer(topk: int) -> Indexer:
    return Indexer(hidden=8, q_lora=8, dim=4, n_heads=2, rate=4, topk=topk, eps=1e-6)


def _whole_row(ix: Indexer, q, w, keys, count) -> tuple[torch.Tensor, torch.Tensor]:
    scores = F.relu(torch.einsum("chd,ed->che", q.float(), keys.float())) * ix.dim**-0.5
    scores = (scores * w.unsqueeze(-1)).sum(dim=1)
    ids = torch.arange(keys.shape[0])
    scores = scores.masked_fill(ids[None, :] >= count[:, None], float("-inf"))
    top = topk_lowest_index(scores, ix.topk)
    return top, top < count[:, None]


@pytest.mark.parametrize("tile", [1, 3, 7, 64, 10_000])
def test_running_topk_equals_one_sort_with_ties(tile: int) -> None:
    g = torch.Generator().manual_seed(0)
    ix = _indexer(topk=5)
    c, e = 9, 23
    # coarse integer values: many ReLU zeros and exact ties on the top-k boundary
    q = torch.randint(-2, 3, (c, 2, 4), generator=g).float()
    keys = torch.randint(-2, 3, (e, 4), generator=g).float()
    w = torch.randint(0, 2, (c, 2), generator=g).float()
    count = torch.tensor([0, 1, 2, 5, 8, 13, 21, 23, 23])
    want_top, want_valid = _whole_row(ix, q, w, keys, count)
    top, valid = prefill.select_topk(ix, q, w, keys, count, tile_elements=tile * c * 2)
    assert torch.equal(valid, want_valid)
    assert torch.equal(torch.where(valid, top, -1), torch.where(want_valid, want_top, -1))


def _dense_reference(q, raw_pos, raw, entries, rate, window, sinks):
    """Attention of queries at positions ``raw_pos[-n:]`` over every raw key within the window
    and every complete entry, one softmax with the sink: no chunks, no gathers."""
    n = q.shape[0]
    qpos = raw_pos[-n:]
    keys = torch.cat([raw, entries])
    d = qpos[:, None] - raw_pos[None, :]
    vis = torch.cat(
        [(d >= 0) & (d < window), torch.arange(entries.shape[0])[None, :] < ((qpos + 1) // rate)[:, None]],
        dim=1,
    )
    logits = torch.einsum("qhd,kd->qhk", q, keys) * q.shape[-1] ** -0.5
    logits = logits.masked_fill(~vis[:, None, :], float("-inf"))
    logits = torch.cat([logits, sinks.view(1, -1, 1).expand(n, -1, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("qhk,kd->qhd", probs, keys)


@pytest.mark.parametrize("workspace", [1, 5_000, 1 << 30])  # one query per chunk, a few, all at once
def test_chunked_attention_equals_a_dense_reference(workspace: int) -> None:
    g = torch.Generator().manual_seed(1)
    heads, hd, window, rate = 3, 8, 6, 4
    n0, n = 9, 17  # a continued prefill: positions 9..25; the ring holds 4..8 (window - 1 rows)
    ring = torch.randn(window - 1, hd, generator=g)
    new = torch.randn(n, hd, generator=g)
    q = torch.randn(n, heads, hd, generator=g)
    entries = torch.randn((n0 + n) // rate, hd, generator=g)
    sinks = torch.randn(heads, generator=g)
    lo = n0 - window + 1
    raw = prefill.window_rows(ring, new, window)
    out = prefill.attend_sequence(q, raw, n0, lo, window, sinks, (entries, rate), workspace=workspace)
    want = _dense_reference(q, torch.arange(lo, n0 + n), torch.cat([ring, new]), entries, rate, window, sinks)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_a_fresh_sequence_sees_no_position_below_zero() -> None:
    g = torch.Generator().manual_seed(2)
    heads, hd, window = 2, 4, 5
    new = torch.randn(7, hd, generator=g)
    q = torch.randn(7, heads, hd, generator=g)
    sinks = torch.zeros(heads)
    raw = prefill.window_rows(new[:0], new, window)
    out = prefill.attend_sequence(q, raw, 0, 0, window, sinks, workspace=1)
    want = _dense_reference(q, torch.arange(0, 7), new, new[:0], 4, window, sinks)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["csa_small_topk", "csa_ties"])
def test_many_chunks_give_the_logits_of_one(reference, name: str, monkeypatch) -> None:
    """A whole runner step (every layer type, the indexer's top-k) with a workspace of one
    query per chunk and a one-entry indexer tile, against the default budget."""
    path, _ = reference(name)
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(3)).tolist()

    def logits() -> torch.Tensor:
        runner = ModelRunner(path, RunnerConfig(num_blocks=2, num_slots=1))
        first = runner.execute(ForwardBatch.from_sequences([SequenceInput(ids[:40], 0, 0, [0, 1])]))
        rest = runner.execute(ForwardBatch.from_sequences([SequenceInput(ids[40:], 40, 0, [0, 1])]))
        return torch.stack([first.logits[0], rest.logits[0]])

    want = logits()
    monkeypatch.setattr(prefill, "WORKSPACE_BYTES", 1)
    monkeypatch.setattr(prefill, "INDEX_TILE_ELEMENTS", 1)
    torch.testing.assert_close(logits(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile, least", [(1, 1), (40, 2), (1 << 20, 64)])
def test_the_kernel_paths_choices_are_the_whole_row_top_k_padded_with_minus_one(
    tile, least, monkeypatch
) -> None:
    """`_choices` (the CUDA kernel's entry lists): per query the whole-row top-k, -1 past the
    entries complete at it, in any chunking of queries and entries."""
    g = torch.Generator().manual_seed(6)
    ix = _indexer(topk=5)
    n0, n, rate = 3, 30, 4
    e = (n0 + n) // rate
    q = torch.randint(-2, 3, (n, 2, 4), generator=g).float()
    w = torch.randint(0, 2, (n, 2), generator=g).float()
    keys = torch.randint(-2, 3, (e, 4), generator=g).float()
    monkeypatch.setattr(prefill, "INDEX_TILE_ELEMENTS", tile)
    monkeypatch.setattr(prefill, "INDEX_MIN_QUERIES", least)
    got = prefill._choices((ix, q, w, keys), n0, n, rate, e)
    count = torch.arange(n0 + 1, n0 + n + 1) // rate
    top, valid = _whole_row(ix, q, w, keys, count)
    assert got.shape == (n, 5)
    assert torch.equal(got, torch.where(valid, top, -1))


def test_the_kernels_switch_off_process_wide() -> None:
    """`set_kernels(False)` (``sluice bench engine --no-kernels``) leaves every replacing
    kernel unused, so one process can measure what they are worth."""
    from engine import kernels
    from engine.kernels import hyper, prefill_attention, rowwise

    x = torch.zeros(2, 4, 8)
    try:
        kernels.set_kernels(False)
        assert not kernels.kernels_on()
        assert not (hyper.usable(x) or rowwise.usable(x) or prefill_attention.usable(x))
    finally:
        kernels.set_kernels(True)
    assert kernels.kernels_on() == kernels.triton_available()
