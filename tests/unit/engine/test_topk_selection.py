"""The indexer's top-k (engine/model/compressor.py `topk_lowest_index`).

It is defined as the first k of a stable descending sort: the k largest scores, equal ones
lowest index first. Long rows on the CPU take a selection (`torch.topk`) instead of the
sort; these tests hold it to the definition on the inputs where the two could part: ties
on the k-th score, -inf padding past a short row's entries, NaN, a row of one value, and
the running top-k of chunked prefill built on it.
"""

from __future__ import annotations

import pytest
import torch

from engine.model import compressor, prefill
from engine.model.compressor import Indexer, topk_lowest_index


def _definition(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : min(k, scores.shape[-1])]


def _rows(kind: str, rows: int, n: int, g: torch.Generator) -> torch.Tensor:
    if kind == "relu":  # the indexer's scores: varied, many exact zeros
        return torch.relu(torch.randn(rows, n, generator=g))
    if kind == "coarse":  # few distinct values: ties on the boundary in every row
        return torch.randint(0, 4, (rows, n), generator=g).float()
    if kind == "padded":  # rows with fewer entries than k, -inf past them (decode's mask)
        s = torch.randn(rows, n, generator=g)
        counts = torch.randint(0, n + 1, (rows,), generator=g)
        counts[0] = 1
        return s.masked_fill(torch.arange(n)[None, :] >= counts[:, None], float("-inf"))
    if kind == "nan":
        s = torch.randn(rows, n, generator=g)
        s[0, 3] = s[rows - 1, n - 1] = float("nan")
        return s
    if kind == "equal":
        return torch.zeros(rows, n)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["relu", "coarse", "padded", "nan", "equal"])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 64, 8), (7, 200, 16), (16, 1024, 100), (3, 50, 60)])
def test_equals_the_stable_sort(kind: str, rows: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + n)
    s = _rows(kind, rows, n, g)
    assert torch.equal(topk_lowest_index(s, k), _definition(s, k))


def test_the_selection_path_is_taken_and_equal(monkeypatch) -> None:
    """Scores large enough for the selection (`SELECT_MIN_RATIO`, `SELECT_MIN_ELEMENTS`) take
    it, and it is also called directly, so a change of the dispatch rule cannot leave it
    untested."""
    calls = _count_selections(monkeypatch)
    g = torch.Generator().manual_seed(3)
    for kind in ("relu", "coarse", "padded", "nan", "equal"):
        s = _rows(kind, 9, 8 * 64, g)
        assert s.shape[-1] >= compressor.SELECT_MIN_RATIO * 32 and s.numel() >= compressor.SELECT_MIN_ELEMENTS
        assert torch.equal(compressor._topk_by_selection(s, 32), _definition(s, 32))
        assert torch.equal(topk_lowest_index(s, 32), _definition(s, 32))
    assert calls == [9 * 8 * 64] * 10


def _count_selections(monkeypatch) -> list[int]:
    """The sizes of the scores each `_topk_by_selection` call gets, from now on."""
    calls: list[int] = []
    select = compressor._topk_by_selection

    def counted(scores: torch.Tensor, k: int) -> torch.Tensor:
        calls.append(scores.numel())
        return select(scores, k)

    monkeypatch.setattr(compressor, "_topk_by_selection", counted)
    return calls


def test_any_leading_shape() -> None:
    g = torch.Generator().manual_seed(4)
    s = torch.relu(torch.randn(2, 3, 300, generator=g)).round(decimals=1)
    assert torch.equal(topk_lowest_index(s, 20), _definition(s, 20))
    row = s[0, 0]
    assert torch.equal(topk_lowest_index(row, 20), _definition(row, 20))


@pytest.mark.parametrize("tile", [700, 10_000])
def test_running_topk_of_long_rows_equals_one_sort(tile: int, monkeypatch) -> None:
    """Chunked prefill's running top-k on rows where the selection path runs (entries many
    times k), with exact ties on the boundary."""
    calls = _count_selections(monkeypatch)
    g = torch.Generator().manual_seed(5)
    ix = Indexer(hidden=8, q_lora=8, dim=4, n_heads=2, rate=4, topk=3, eps=1e-6)
    c, e = 6, 1500
    q = torch.randint(-2, 3, (c, 2, 4), generator=g).float()
    keys = torch.randint(-2, 3, (e, 4), generator=g).float()
    w = torch.randint(0, 2, (c, 2), generator=g).float()
    count = torch.tensor([0, 2, 30, 700, 1500, 1500])
    scores = torch.relu(torch.einsum("chd,ed->che", q, keys)) * ix.dim**-0.5
    scores = (scores * w.unsqueeze(-1)).sum(dim=1)
    scores = scores.masked_fill(torch.arange(e)[None, :] >= count[:, None], float("-inf"))
    want = _definition(scores, ix.topk)
    calls.clear()
    top, valid = prefill.select_topk(ix, q, w, keys, count, tile_elements=tile * c * 2)
    assert calls  # the running top-k took the selection
    assert torch.equal(valid, want < count[:, None])
    assert torch.equal(torch.where(valid, top, -1), torch.where(valid, want, -1))
