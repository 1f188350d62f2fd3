"""Penalty state kept on the device, one row per penalised request (torch).

Repetition, presence and frequency penalties read a request's whole history: repetition the
set of its prompt and output tokens, presence and frequency its output tokens' counts. Built
from the token ids at every step, that history goes up to the device again each step (a
4,096-token prompt at batch 256 is a million ids a step). Here each penalised request owns a
row of ``seen [V]`` (bool) and ``counts [V]`` (fp32, exact up to 2^24): the prompt goes up once,
when the row is made, and each token the device samples is added on the device right after
its draw (`record`), so a decode step uploads only row indices. A row whose request had
tokens sampled elsewhere (verified drafts, sampled on the host; an imported sequence) catches
up from the host's history when next gathered. Row 0 is all zeros: the rows of a batch with
no penalties.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.forward_batch import upload
from engine.sampling.sampler import RowInput


class PenaltyRows:
    def __init__(self, vocab: int, device: torch.device | str) -> None:
        self.vocab = vocab
        self.device = torch.device(device)
        self.seen = torch.zeros(1, vocab, dtype=torch.bool, device=self.device)
        self.counts = torch.zeros(1, vocab, dtype=torch.float32, device=self.device)
        self._row: dict[str, int] = {}
        self._synced: dict[str, int] = {}  # request id -> output tokens its row holds
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._row)

    def gather(
        self, keys: Sequence[str | None], rows: Sequence[RowInput]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seen, counts)`` ``[R, V]`` for a batch: row i is request ``keys[i]``'s state brought
        up to ``rows[i].output_token_ids`` (made from its prompt the first time), or zeros where
        ``keys[i]`` is None."""
        index = []
        for key, row in zip(keys, rows):
            if key is None:
                index.append(0)
                continue
            r = self._row.get(key)
            if r is None or self._synced[key] > len(row.output_token_ids):  # new, or rolled back
                r = self._make(key, row.prompt_token_ids)
            have, outs = self._synced[key], row.output_token_ids
            if have < len(outs):
                self._add(r, outs[have:])
                self._synced[key] = len(outs)
            index.append(r)
        idx = upload(torch.tensor(index, dtype=torch.long), self.device)
        return self.seen[idx], self.counts[idx]

    def record(self, keys: Sequence[str | None], tokens: torch.Tensor) -> None:
        """Add ``tokens[i]`` (on the device, not read back) to request ``keys[i]``'s row."""
        sel = [(i, key) for i, key in enumerate(keys) if key is not None]
        if not sel:
            return
        rows = upload(torch.tensor([self._row[key] for _, key in sel], dtype=torch.long), self.device)
        tok = tokens[upload(torch.tensor([i for i, _ in sel], dtype=torch.long), self.device)]
        self.counts.index_put_((rows, tok), torch.ones(len(sel), device=self.device), accumulate=True)
        self.seen.index_put_((rows, tok), torch.ones(len(sel), dtype=torch.bool, device=self.device))
        for _, key in sel:
            self._synced[key] += 1

    def drop(self, key: str) -> None:
        r = self._row.pop(key, None)
        if r is not None:
            del self._synced[key]
            self._free.append(r)

    def _make(self, key: str, prompt: Sequence[int]) -> int:
        """A zeroed row for ``key`` holding its prompt's tokens as seen."""
        r = self._row.get(key)
        if r is None:
            if not self._free:
                self._grow()
            r = self._row[key] = self._free.pop()
        self.seen[r].zero_()
        self.counts[r].zero_()
        self._synced[key] = 0
        ids = sorted({t for t in prompt if 0 <= t < self.vocab})
        if ids:  # a scalar fill: an indexed assignment of True would copy it up synchronously
            self.seen[r].scatter_(0, upload(torch.tensor(ids, dtype=torch.long), self.device), True)
        return r

    def _add(self, r: int, tokens: Sequence[int]) -> None:
        ids = [t for t in tokens if 0 <= t < self.vocab]
        if ids:
            index = upload(torch.tensor(ids, dtype=torch.long), self.device)
            self.seen[r].scatter_(0, index, True)
            self.counts[r].index_add_(0, index, torch.ones(len(ids), device=self.device))

    def _grow(self) -> None:
        """Double the rows (row 0 stays the zero row)."""
        n = self.seen.shape[0]
        self.seen = torch.cat([self.seen, torch.zeros_like(self.seen)])
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self._free.extend(range(2 * n - 1, n - 1, -1))
