"""A step's drafting chain as CUDA graphs (`DraftGraphs`): the drafter's passes
(`engine.spec.drafter`) over fixed-shape padded batches, chained on the device."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import BLOCK_TOKENS
from engine.cuda_graphs import MAX_GRAPH_QUERY, MAX_GRAPHS, DecodeGraphs, HostRows, batch_bucket, token_bucket
from engine.forward_batch import ForwardBatch, PaddedDecode, long_tensor, upload
from engine.model.moe import weight_epoch
from engine.step_state import ToHost

if TYPE_CHECKING:
    from engine.spec.drafter import Drafter, DraftRun


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
    with the others (`SWASlots.stage`). The host reads the drafts once, after the last pass,
    and only when it needs them (`run`; the eager chain reads each pass's). Prefill runs (up to a window long) draft eagerly.
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
        row padding), packed from the runs as they are (`DecodeGraphs.pack`). A padding row's
        ``last`` is the graph's last token: its later passes read and write only the scratch
        slot (``live`` 0), whichever token it starts from. The chain's table has one column:
        the MTP layer attends to its window only."""
        runs = runs or ()
        lens = [len(r.next_ids) for r in runs]
        rows = HostRows(
            lens,
            [int(x) for r in runs for x in r.next_ids],
            [r.start for r in runs],
            [r.slot for r in runs],
            [r.window_from for r in runs],
            long_tensor([[r.block_table[0] if r.block_table else -1] for r in runs]) if runs else None,
        )
        ends = list(itertools.accumulate(lens))
        last = [e - 1 for e in ends] + [t - 1] * (b - len(runs))
        drafts = [r.num_drafts for r in runs] + [0] * (b - len(runs))
        live = [int(d > j) for j in range(depth) for d in drafts]
        return torch.cat([self.graphs.pack(rows, b, q, 1, t), long_tensor(last + live)])

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
    ) -> Callable[[], tuple[list[list[int]], list[list[float]]]]:
        """Queue the chain for ``runs`` (`applies`) -> a reader of per run, its drafts and their
        confidences at depth 1 .. max(num_drafts); pass 1 writes the windows, and is all that
        runs (no head, no draft) where no run wants a draft. Nothing here waits for the
        device: the drafts' copy to the host starts behind the chain, and the reader waits
        for that copy only, so the host can apply the step's tokens while the chain runs."""
        b = batch_bucket(len(runs))
        count = sum(len(r.next_ids) for r in runs)
        # as `DecodeGraphs.run` shapes a step: one token a row, or the rows' tokens packed
        q, t = (1, b) if count == len(runs) else (MAX_GRAPH_QUERY, token_bucket(count, b))
        depth = max(r.num_drafts for r in runs)
        host = self._host_inputs(runs, b, q, t, depth)
        chain = self._chain(b, q, t, depth)
        rows = [r.hidden_from + j for r in runs for j in range(len(r.next_ids))]
        index = upload(long_tensor(rows + [0] * (t - count)), hidden.device)
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
        # one copy to the host: token ids are exact in float64
        both = ToHost(torch.stack([tokens.double(), conf.double()]).transpose(1, 2).contiguous())
        if staged is not None:  # queued behind the chain, which has read the rows by then
            staged.undo([True] * int(staged.positions.shape[0]))

        def read() -> tuple[list[list[int]], list[list[float]]]:
            chains, confs = both.tolist()
            return [[int(x) for x in row] for row in chains], confs

        return read
