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

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from engine.config import BLOCK_TOKENS
from engine.cuda_graphs import MAX_GRAPH_QUERY, MAX_GRAPHS, DecodeGraphs, batch_bucket, token_bucket
from engine.forward_batch import ForwardBatch, PaddedDecode, SequenceInput, upload
from engine.model.moe import weight_epoch

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
    def draft(self, hidden: torch.Tensor, runs: Sequence[DraftRun]) -> dict[str, Drafts]:
        """``hidden`` [T, hc, D]: the step's final main-model streams."""
        if not runs:
            return {}
        if self.graphs is not None:
            short: list[DraftRun] = []
            long: list[DraftRun] = []
            for r in runs:
                (short if self.graphs.applies([r]) else long).append(r)
            if short and long:  # a prompt's run beside decodes (`ModelRunner.split`)
                drafts = self.draft(hidden, short)
                load = self.load.clone()
                drafts.update(self.draft(hidden, long))
                self.load.add_(load)
                return drafts
        if self.graphs is not None and self.graphs.applies(runs):
            chains, chain_conf = self.graphs.run(hidden, runs)
            return {
                r.request_id: Drafts(tuple(chains[i][: r.num_drafts]), tuple(chain_conf[i][: r.num_drafts]))
                for i, r in enumerate(runs)
                if r.num_drafts
            }
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
            return {}
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
        return {
            r.request_id: Drafts(tuple(d), tuple(c)) for r, d, c in zip(runs, drafted, confs) if r.num_drafts
        }

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


@dataclass
class _Chain:
    """A drafting chain's static tensors (and its graph, once captured)."""

    # int64: pass 1's padded batch (`DecodeGraphs.layout`, one table column), then ``last``
    # and ``live``
    inputs: torch.Tensor
    batch: ForwardBatch  # pass 1's static batch (its tensors are read by every replay)
    streams: torch.Tensor  # [t, hc, D] the runs' main-model streams, copied in
    last: torch.Tensor  # [B] each row's last run token in pass 1's flat tokens
    live: torch.Tensor  # [depth, B] 1 where the row wants pass j + 1's draft (MoE load)
    graph: torch.cuda.CUDAGraph | None = None  # None: the padded chain runs eagerly
    out: tuple[torch.Tensor, torch.Tensor] | None = None  # graphed: drafts, confidences [depth, B]


class DraftGraphs:
    """The drafting chain of a decode or verification step as CUDA graphs: one per (batch
    bucket, pass 1's tokens, depth), captured on first use in the decode graphs' memory pool.

    Pass 1 runs the MTP layer over the runs as a verification graph holds a step's rows
    (`DecodeGraphs.host_inputs`): a decode step's runs (one token each) one a row, a
    verification step's (its input token and accepted drafts) packed one after another,
    ``token_bucket(T, rows)`` tokens in all, the padding tokens after them writing only the
    scratch slot. Passes 2..depth chain on the device: each pass's argmax is the next pass's
    input token and its output streams the next pass's input. Every real row runs every pass;
    drafts past a row's ``num_drafts`` are dropped on the host, their window writes put back
    with the others (`SWASlots.stage`). The host reads the drafts once, after the last pass
    (the eager chain reads each pass's). Prefill runs (up to a window long) draft eagerly.
    With the decode graphs' ``capture`` off, the same padded chain runs eagerly (CPU tests)."""

    def __init__(self, drafter: Drafter, graphs: DecodeGraphs) -> None:
        self.drafter, self.graphs = drafter, graphs
        self.chains: OrderedDict[tuple[int, int, int, int], _Chain] = OrderedDict()  # (b, q, t, depth)
        self.epoch = weight_epoch()
        self.replays = 0
        self.chains_run = 0  # drafting chains run padded (graphed or not)

    def release(self) -> None:
        """Drop every captured drafting chain now (a closed engine; `DecodeGraphs.release`)."""
        self.chains.clear()

    @staticmethod
    def applies(runs: Sequence[DraftRun]) -> bool:
        return max(len(r.next_ids) for r in runs) <= MAX_GRAPH_QUERY

    def _passes(self, c: _Chain) -> tuple[torch.Tensor, torch.Tensor]:
        """Every pass of the chain on its static tensors -> (drafts, confidences) [depth, B]
        (a chain of depth 0 only writes the MTP window: [0, B] each)."""
        d, g, batch = self.drafter, self.graphs, c.batch
        assert batch.padded is not None
        b, dev = c.last.shape[0], batch.input_ids.device
        emb, out = d.layer_pass(c.streams, batch)
        if not c.live.shape[0]:
            return torch.zeros(0, b, dtype=torch.long, device=dev), torch.zeros(0, b, device=dev)
        rows, emb = out[c.last], emb[c.last]
        token, conf = d.predict(rows, emb, 1)
        tokens, confs = [token], [conf]
        load = d.load.clone()
        ends = batch.positions[c.last] + 1
        ones = torch.ones(b, dtype=torch.long, device=dev)
        scratch = torch.full((b, 1), g.scratch_block, dtype=torch.long, device=dev)  # never read
        for j in range(1, c.live.shape[0]):
            pos = ends + (j - 1)
            step = ForwardBatch(
                input_ids=token,
                positions=pos,
                query_start=torch.arange(b, device=dev),
                query_len=ones,
                num_computed=pos,
                swa_slot=batch.swa_slot,
                block_table=scratch,  # the MTP layer is window-only
                sample=ones.bool(),
                query_start_cpu=tuple(range(b)),
                query_len_cpu=(1,) * b,
                num_computed_cpu=(0,) * b,
                swa_slot_cpu=tuple(range(b)),
                sample_cpu=(True,) * b,
                padded=PaddedDecode(BLOCK_TOKENS, batch.padded.window_from, c.live[j], g.scratch_block),
            )
            emb = d.model.model.embed_tokens(token)
            rows = d.layer(rows, emb, step, d.pool, d.swa, d.cache_layer, token)
            token, conf = d.predict(rows, emb, j + 1)
            tokens.append(token)
            confs.append(conf)
            load += d.load
        d.load.copy_(load)
        return torch.stack(tokens), torch.stack(confs)

    def _build(self, b: int, q: int, t: int, depth: int) -> _Chain:
        g, dev = self.graphs, self.graphs.device
        layout = sum(g.layout(b, q, 1, t))
        inputs = torch.zeros(layout + b + depth * b, dtype=torch.long, device=dev)
        last, live = inputs[layout:].split([b, depth * b])
        embed = self.drafter.model.model.embed_tokens.weight
        streams = torch.zeros(
            t, self.drafter.model.cfg.hc_mult, embed.shape[1], dtype=embed.dtype, device=dev
        )
        chain = _Chain(
            inputs, g.static_batch(inputs[:layout], b, q, BLOCK_TOKENS, t), streams, last, live.view(depth, b)
        )
        if g.capture:
            inputs.copy_(self._host_inputs(None, b, q, t, depth).to(dev))  # all padding while capturing
            chain.graph, chain.out = g.capture_graph(lambda: self._passes(chain))
        return chain

    def _host_inputs(
        self, runs: Sequence[DraftRun] | None, b: int, q: int, t: int, depth: int
    ) -> torch.Tensor:
        """`_Chain.inputs` for ``runs`` padded to ``b`` rows and ``t`` tokens (``None``: every
        row padding). A padding row's ``last`` is the graph's last token: its later passes
        read and write only the scratch slot (``live`` 0), whichever token it starts from."""
        g = self.graphs
        batch = (
            None
            if runs is None
            else ForwardBatch.from_sequences(
                [
                    SequenceInput(r.next_ids, r.start, r.slot, r.block_table, window_from=r.window_from)
                    for r in runs
                ]
            )
        )
        runs = runs or ()
        ends = torch.tensor([len(r.next_ids) for r in runs], dtype=torch.long).cumsum(0) - 1
        last = torch.cat([ends, torch.full((b - len(runs),), t - 1, dtype=torch.long)])
        live = [int(i < len(runs) and runs[i].num_drafts > j) for j in range(depth) for i in range(b)]
        return torch.cat([g.host_inputs(batch, b, q, 1, t), last, torch.tensor(live, dtype=torch.long)])

    def _chain(self, b: int, q: int, t: int, depth: int) -> _Chain:
        """The captured chain of this shape (captured now if new); a fresh one when not capturing."""
        if not self.graphs.capture:
            return self._build(b, q, t, depth)
        if weight_epoch() != self.epoch:  # graphs hold the expert tensors they were captured with
            self.chains.clear()
            self.epoch = weight_epoch()
        key = (b, q, t, depth)
        chain = self.chains.get(key)
        if chain is None:
            chain = self.chains[key] = self._build(b, q, t, depth)
            while len(self.chains) > MAX_GRAPHS:
                self.chains.popitem(last=False)
        self.chains.move_to_end(key)
        return chain

    def run(
        self, hidden: torch.Tensor, runs: Sequence[DraftRun]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Draft for ``runs`` (`applies`) -> per run, its drafts and their confidences at depth
        1 .. max(num_drafts); pass 1 writes the windows, and is all that runs (no head, no
        draft) where no run wants a draft."""
        b = batch_bucket(len(runs))
        count = sum(len(r.next_ids) for r in runs)
        # as `DecodeGraphs.run` shapes a step: one token a row, or the rows' tokens packed
        q, t = (1, b) if count == len(runs) else (MAX_GRAPH_QUERY, token_bucket(count, b))
        depth = max(r.num_drafts for r in runs)
        host = self._host_inputs(runs, b, q, t, depth)
        chain = self._chain(b, q, t, depth)
        rows = [r.hidden_from + j for r in runs for j in range(len(r.next_ids))]
        index = upload(torch.tensor(rows + [0] * (t - count), dtype=torch.long), hidden.device)
        ends = [r.start + len(r.next_ids) for r in runs]
        staged = (
            self.drafter.swa.stage(
                [self.drafter.cache_layer],
                [r.slot for r in runs for _ in range(depth - 1)],
                [e + j for e in ends for j in range(depth - 1)],
            )
            if depth > 1
            else None
        )
        if chain.inputs.is_cuda:
            host = host.pin_memory()  # copied without waiting; the host allocator keeps it until then
        chain.inputs.copy_(host, non_blocking=True)
        torch.index_select(hidden, 0, index, out=chain.streams)
        if chain.graph is None:
            tokens, conf = self._passes(chain)
        else:
            assert chain.out is not None
            chain.graph.replay()
            self.replays += 1
            tokens, conf = chain.out
        self.chains_run += 1
        # one read of the device: token ids are exact in float64
        both = torch.stack([tokens.double(), conf.double()]).transpose(1, 2).tolist()
        if staged is not None:
            staged.undo([True] * int(staged.positions.shape[0]))
        return [[int(t) for t in row] for row in both[0]], both[1]


def _cover(table: Sequence[int], end: int) -> list[int]:
    """The block table padded to cover ``end`` positions: the MTP layer is window-only and
    never reads or writes blocks, but a `ForwardBatch` names one for every position."""
    need = -(-end // BLOCK_TOKENS)
    out = list(table)
    return out + [out[-1]] * (need - len(out)) if len(out) < need else out
