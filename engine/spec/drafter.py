"""Chained drafting with the MTP layer, and each draft's confidence.

After a step, every sequence that sampled has a **run**: the positions whose main-model
hidden state the step computed and whose next token is now known. For a verification step
that is the position of the input token and of every accepted draft; for a prefill chunk,
the chunk's positions that fall in the last ``W - 1`` of the prompt (the MTP layer is
window-only, so earlier ones are never read).

* **Pass 1** runs the MTP layer over each run: at position ``p`` it takes the main model's
  streams at ``p`` and the embedding of the token at ``p + 1``. This writes the MTP
  layer's window for those positions (the entries later passes attend to) and, at the
  run's last position, predicts draft 1.
* **Pass j > 1** (one token per sequence, at the next position) takes pass ``j - 1``'s
  output streams and the embedding of draft ``j - 1``, and predicts draft ``j``. Its
  window writes are undone afterwards (`SWASlots.stage`): the next step's pass 1 rewrites
  those positions from the target's hidden states, and the rows they overwrote belong to
  positions that step still reads.

Drafts are greedy (``argmax``, lowest id on ties) for every request: verification keeps
the target's distribution whatever the drafts are. A draft's confidence is the checkpoint's
confidence head on ``[h_k ; e_k]``, and on the draft distribution and position where the head
reads them (`engine.model.confidence`); a checkpoint without one falls back to the draft
distribution's top probability.

The MTP state only decides which drafts are proposed, never which tokens are emitted, so
its approximations (``window_from`` where a run starts without earlier MTP entries, e.g.
after a prefix hit) change acceptance and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from engine.config import BLOCK_TOKENS
from engine.cuda_graphs import DecodeGraphs
from engine.forward_batch import ForwardBatch, SequenceInput, upload
from engine.spec.draft_graphs import DraftGraphs

if TYPE_CHECKING:
    from engine.cache.pool import CompressedPool
    from engine.cache.swa import SWASlots
    from engine.model.confidence import ConfidenceHead
    from engine.model.model import DeepseekV4
    from engine.model.mtp import MTPLayer


@dataclass(frozen=True)
class DraftRun:
    """One sequence's pass-1 run: positions ``[start, start + len(next_ids))``."""

    request_id: str
    slot: int
    block_table: Sequence[int]
    start: int
    next_ids: Sequence[int]  # the token after each position of the run
    hidden_from: int  # flat row of the run's first position in the step's hidden streams
    window_from: int  # MTP window entries below this position are not valid
    num_drafts: int  # drafts to propose after the run (0: only write the window)


@dataclass(frozen=True)
class Drafts:
    tokens: tuple[int, ...]
    confidence: tuple[float, ...]


class PendingDrafts:
    """A step's drafts, per request id, which may still be on the device (a graphed chain,
    `DraftGraphs.run`): `result` reads them, waiting for their copy only, once."""

    def __init__(self, read: Callable[[], dict[str, Drafts]]) -> None:
        self._read: Callable[[], dict[str, Drafts]] | None = read
        self._drafts: dict[str, Drafts] = {}

    @classmethod
    def ready(cls, drafts: dict[str, Drafts]) -> PendingDrafts:
        return cls(lambda: drafts)

    def result(self) -> dict[str, Drafts]:
        if self._read is not None:
            self._drafts, self._read = self._read(), None
        return self._drafts


class Drafter:
    def __init__(
        self,
        model: DeepseekV4,
        pool: CompressedPool,
        swa: SWASlots,
        head: ConfidenceHead | None,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        """``graphs``: the runner's decode graphs; with them, chains whose runs are short
        enough (decode and verification steps) run as graphs of their own (`DraftGraphs`)."""
        if not len(model.mtp):
            raise ValueError("speculative decoding needs the checkpoint's MTP layer")
        self.model, self.pool, self.swa, self.head = model, pool, swa, head
        self.layer = cast("MTPLayer", model.mtp[0])
        self.cache_layer = model.cfg.num_hidden_layers
        self.window = model.cfg.sliding_window
        self.graphs = DraftGraphs(self, graphs) if graphs is not None else None

    @property
    def load(self) -> torch.Tensor:
        """The MTP layer's MoE load counters [n_routed_experts] (what EPLB records): after
        `draft`, its tokens over every pass (`ModelRunner.execute` zeroes them each step)."""
        return self.layer.mlp.last_load

    @torch.inference_mode()
    def draft(self, hidden: torch.Tensor, runs: Sequence[DraftRun]) -> PendingDrafts:
        """``hidden`` [T, hc, D]: the step's final main-model streams. A graphed chain's drafts
        are read when asked for (`PendingDrafts.result`); the eager chain reads each pass's."""
        if not runs:
            return PendingDrafts.ready({})
        if self.graphs is not None:
            short: list[DraftRun] = []
            long: list[DraftRun] = []
            for r in runs:
                (short if self.graphs.applies([r]) else long).append(r)
            if short and long:  # a prompt's run beside decodes (`ModelRunner.split`)
                pending = self.draft(hidden, short)
                load = self.load.clone()
                eager = self.draft(hidden, long).result()
                self.load.add_(load)
                return PendingDrafts(lambda: {**pending.result(), **eager})
        if self.graphs is not None and self.graphs.applies(runs):
            read = self.graphs.run(hidden, runs)

            def result() -> dict[str, Drafts]:
                chains, chain_conf = read()
                return {
                    r.request_id: Drafts(
                        tuple(chains[i][: r.num_drafts]), tuple(chain_conf[i][: r.num_drafts])
                    )
                    for i, r in enumerate(runs)
                    if r.num_drafts
                }

            return PendingDrafts(result)
        dev = hidden.device
        batch = ForwardBatch.from_sequences(
            [
                SequenceInput(r.next_ids, r.start, r.slot, r.block_table, window_from=r.window_from)
                for r in runs
            ],
            device=dev,
        )
        rows = torch.cat([torch.arange(r.hidden_from, r.hidden_from + len(r.next_ids)) for r in runs]).to(dev)
        wanted = [r.num_drafts for r in runs]
        if not any(wanted):  # the runs only write the MTP window: no draft, no head
            self.layer_pass(hidden[rows], batch)
            return PendingDrafts.ready({})
        tokens, conf, out = self._pass(hidden[rows], batch, 1)
        drafted: list[list[int]] = [[] for _ in runs]
        confs: list[list[float]] = [[] for _ in runs]
        for i, n in enumerate(wanted):
            if n:
                drafted[i].append(int(tokens[i]))
                confs[i].append(float(conf[i]))
        streams = out[
            batch.sample_indices
        ]  # [B, hc, D] each run's last position (a copy: written in place below)
        depth = max(wanted)
        if depth > 1:
            load = self.load.clone()  # the MTP layer's MoE load over every pass of the chain
            live = [i for i, n in enumerate(wanted) if n > 1]
            ends = {i: runs[i].start + len(runs[i].next_ids) for i in live}  # pass 2's position
            staged = self.swa.stage(
                [self.cache_layer],
                [runs[i].slot for i in live for _ in range(wanted[i] - 1)],
                [ends[i] + j for i in live for j in range(wanted[i] - 1)],
            )
            try:
                for j in range(1, depth):
                    live = [i for i in live if wanted[i] > j]
                    pos = {i: ends[i] + j - 1 for i in live}
                    step = ForwardBatch.from_sequences(
                        [
                            SequenceInput(
                                [drafted[i][-1]], pos[i], runs[i].slot, _cover(runs[i].block_table, pos[i] + 1),
                                window_from=runs[i].window_from,
                            )
                            for i in live
                        ],
                        device=dev,
                    )  # fmt: skip
                    idx = upload(torch.tensor(live, dtype=torch.long), dev)
                    tokens, conf, out = self._pass(streams[idx], step, j + 1)
                    load += self.load
                    for n, i in enumerate(live):
                        drafted[i].append(int(tokens[n]))
                        confs[i].append(float(conf[n]))
                    streams[idx] = out
            finally:
                staged.undo([True] * int(staged.positions.shape[0]))
            self.load.copy_(load)
        return PendingDrafts.ready(
            {
                r.request_id: Drafts(tuple(d), tuple(c))
                for r, d, c in zip(runs, drafted, confs)
                if r.num_drafts
            }
        )

    def _pass(
        self, streams: torch.Tensor, batch: ForwardBatch, position: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One MTP pass (drafting the step's draft ``position``, 1-based) -> (draft token,
        confidence) at each sequence's last position, and the output streams [T, hc, D]."""
        emb, out = self.layer_pass(streams, batch)
        rows = batch.sample_indices
        tokens, conf = self.predict(out[rows], emb[rows], position)
        return tokens, conf, out

    def layer_pass(self, streams: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over ``batch`` (writing its window) -> (input embeddings, output streams);
        index tensors made anew (a chain's static batch runs to warm up, then to be captured)."""
        batch.forget_memo()
        ids = batch.input_ids
        emb = self.model.model.embed_tokens(ids)
        return emb, self.layer(streams, emb, batch, self.pool, self.swa, self.cache_layer, ids)

    def predict(
        self, streams: torch.Tensor, emb: torch.Tensor, position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer's output streams [B, hc, D] at each sequence's last position and the
        embedding of its input token there [B, D], drafting the step's draft ``position`` ->
        (draft token [B], confidence [B])."""
        h = self.layer.norm(self.layer.hc_head(streams))
        logits = self.model.lm_head(h).float()
        tokens = logits.argmax(dim=-1)
        if self.head is not None:
            conf = self.head(h.float(), emb.float(), logits, position)
        else:
            conf = torch.softmax(logits, dim=-1).max(dim=-1).values
        return tokens, conf


def _cover(table: Sequence[int], end: int) -> list[int]:
    """The block table padded to cover ``end`` positions: the MTP layer is window-only and
    never reads or writes blocks, but a `ForwardBatch` names one for every position."""
    need = -(-end // BLOCK_TOKENS)
    out = list(table)
    return out + [out[-1]] * (need - len(out)) if len(out) < need else out
