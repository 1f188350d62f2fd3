"""Decode and verification steps as CUDA graphs: one graph per (batch bucket, token bucket,
context bucket), captured on first use.

An eager decode step at real widths launches about a thousand kernels, and at small batches
the GPU waits on the host that launches them. A graph replays the forward pass up to the
``lm_head`` (every layer, the hc head and the final norm) with one launch; the ``lm_head``
runs after it, eagerly (one matmul), so a graph's output is ``[B, hidden]``, not a
``[B, vocab]`` fp32 buffer per graph (132 MB at batch 256).

A graph fixes every shape, so a decode batch of ``n`` rows whose longest row has ``L``
tokens runs in the graph of ``(batch_bucket(n), context_bucket(L))``, padded
(`engine.forward_batch.PaddedDecode`):

- Padding rows bring token 0 at position 0 and read and write only a scratch sliding-window
  slot and a scratch block, which the runner allocates past the ones the scheduler hands out.
  Their MoE routing is not counted as load (EPLB reads real traffic only).
- Attention gathers ``context_bucket // rate`` compressed entries for every row; entries past
  a row's own count are masked, as the eager path masks those past the batch's longest row.
- The compressors pool every row's window and send those that do not close in this step to
  the scratch block (the eager path computes the closing rows only).

A speculative verification step (every row 1 to ``MAX_GRAPH_QUERY`` tokens, `engine.model.verify`)
of ``T`` tokens runs in the graph of ``(batch_bucket(n), token_bucket(T, rows), context_bucket(L + Q))``,
``Q`` its most tokens in a row. Its rows' tokens are packed one after another as the batch
holds them (ragged), so a step that verifies a few drafts for most rows and five for one
costs its tokens, not its rows times its longest row: DSpark's selection saves what it is
priced to save. The padding tokens after them belong to the last row, write only the
scratch slot and block, and no real token attends to them.

Buckets. Both round a value up to a multiple of an eighth of the power of two at or above it:
batch sizes 1-8 exactly, then 10, 12, 14, 16, 20, 24, 28, 32, 40, ..., 224, 256, 320, ...;
contexts in steps of one block (256) up to 2,048, then 2,560, 3,072, 3,584, 4,096, 5,120, ...
The padding stays below 25 % of the value whatever the workload, the number of graphs grows
with the logarithm of the largest batch and context (8 per doubling), and a decode run moves
to the next context bucket once every eighth to quarter of its length.

Graphs hold the tensors they were captured with: when an MoE layer's placement or expert
weights are replaced (EPLB), every graph is dropped (`engine.model.moe.weight_epoch`).
Expert-parallel steps are not graphed (their all-to-all sizes are data dependent).
"""

from __future__ import annotations

import gc
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch

from engine.cache.pool import CompressedPool
from engine.cache.swa import SWASlots
from engine.config import BLOCK_TOKENS
from engine.forward_batch import ForwardBatch, PaddedDecode, long_tensor, upload
from engine.model import verify
from engine.model.model import DeepseekV4
from engine.model.moe import weight_epoch
from engine.model.rope import clear_cos_sin_cache

T_out = TypeVar("T_out")

#: graphs kept at once (least recently used dropped first); each holds only its inputs and
#: outputs ([B, hidden] and [B, hc, hidden]), its activations share one memory pool
MAX_GRAPHS = 64


def round_up_eighth(n: int, floor: int = 1) -> int:
    """``n`` rounded up to a multiple of max(floor, 2^(bit_length(n - 1) - 3))."""
    step = max(floor, 1 << max(0, (n - 1).bit_length() - 3))
    return -(-n // step) * step


def batch_bucket(n: int) -> int:
    return round_up_eighth(n)


def context_bucket(tokens: int) -> int:
    return round_up_eighth(max(tokens, 1), BLOCK_TOKENS)


#: most tokens per row of a graphed verification step (an input token and 5 drafts)
MAX_GRAPH_QUERY = 6


def token_bucket(tokens: int, rows: int) -> int:
    """A verification graph's token count: ``tokens`` rounded up to a multiple of half its row
    bucket (under half a token of padding a row; at most ``2 * MAX_GRAPH_QUERY`` buckets a
    row bucket, against the ``MAX_GRAPH_QUERY - 1`` of padding every row to the longest)."""
    step = max(1, rows // 2)
    return -(-tokens // step) * step


def graphable(batch: ForwardBatch) -> bool:
    """A plain decode batch (one sampled token per row) or a verification batch (1 to
    ``MAX_GRAPH_QUERY`` tokens per row, on the vectorised path, no input token read on the
    device): no images, no kept host-slot layers, no replayed rows."""
    if not batch.is_decode and not (
        max(batch.query_len_cpu, default=0) <= MAX_GRAPH_QUERY and verify.applies(batch) and batch.fed is None
    ):
        return False
    return (
        bool(batch.sample_cpu)
        and all(batch.sample_cpu)
        and bool(batch.input_ids_cpu)
        and batch.block_table_cpu is not None
        and not batch.embeds
        and not batch.swa_keep_cpu
        and not any(batch.cached_until)
    )


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    # int64, the layout of `DecodeGraphs.layout`
    inputs: torch.Tensor
    # the batch it was captured with: its other tensors (row starts, lengths, sample flags) are
    # read by every replay, so they must live as long as the graph (freed, their memory would
    # be handed to other tensors)
    batch: ForwardBatch
    final: torch.Tensor  # [T, D] normed hidden rows (the lm_head's input)
    hidden: torch.Tensor  # [T, hc, D] final hc streams


class HostRows(NamedTuple):
    """A padded step's real rows as the host knows them (`DecodeGraphs.pack`): each row's
    token count, the tokens one after another, its first position, slot and window start,
    and its block table [rows, columns] (None: no rows)."""

    lens: Sequence[int]
    ids: Sequence[int]
    computed: Sequence[int]
    slots: Sequence[int]
    window_from: Sequence[int]
    table: torch.Tensor | None


class DecodeGraphs:
    def __init__(
        self,
        model: DeepseekV4,
        pool: CompressedPool,
        swa: SWASlots,
        scratch_block: int,
        scratch_slot: int,
        device: torch.device | str,
        capture: bool = True,
    ) -> None:
        """``capture=False`` runs the same padded batches eagerly (CPU tests of the padding,
        and a way to tell a capture problem from a padding one on the GPU)."""
        self.model, self.pool, self.swa = model, pool, swa
        self.scratch_block, self.scratch_slot = scratch_block, scratch_slot
        self.device = torch.device(device)
        self.capture = capture
        # (rows, tokens a row at most, tokens, context) -> graph
        self.graphs: OrderedDict[tuple[int, int, int, int], _Graph] = OrderedDict()
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.epoch = weight_epoch()
        self.captures = 0  # graphs captured so far (metrics, tests)
        self.replays = 0
        self.verify_steps = 0  # verification steps run padded (graphed or not)

    @staticmethod
    def layout(b: int, q: int, blocks: int, t: int) -> list[int]:
        """The static inputs' parts, for ``b`` rows of up to ``q`` tokens, ``t`` tokens in all
        (``b`` where ``q`` is 1) and ``blocks`` table columns: ids, positions, real [T];
        computed, slot, window_from [B]; with ``q > 1`` write slot, row [T], first token, own
        tokens [B]; the table [B * blocks]."""
        return [t, t, t, b, b, b] + ([t, t, b, b] if q > 1 else []) + [b * blocks]

    def static_batch(self, inputs: torch.Tensor, b: int, q: int, context: int, t: int) -> ForwardBatch:
        blocks = context // BLOCK_TOKENS
        ids, pos, real, computed, slot, window_from, *rest = inputs.split(self.layout(b, q, blocks, t))
        if q > 1:
            write_slot, seq, start, qlen, table = rest
            padded = PaddedDecode(
                context, window_from, real, self.scratch_block, q, write_slot, seq, start, qlen
            )
        else:
            start, qlen, table = torch.arange(b, device=self.device), torch.ones_like(computed), rest[0]
            padded = PaddedDecode(context, window_from, real, self.scratch_block)
        return ForwardBatch(
            input_ids=ids,
            positions=pos,
            query_start=start,
            query_len=qlen,
            num_computed=computed,
            swa_slot=slot,
            block_table=table.view(b, blocks),
            sample=torch.ones(b, dtype=torch.bool, device=self.device),
            query_len_cpu=(q,) * b,  # the most a row brings: its own count is ``padded.qlen``
            num_computed_cpu=(0,) * b,  # not read on the padded path: shapes come from `padded`
            swa_slot_cpu=tuple(range(b)),
            sample_cpu=(True,) * b,
            num_logits_cpu=(q,) * b if q > 1 else (),
            padded=padded,
        )

    def host_inputs(self, batch: ForwardBatch | None, b: int, q: int, blocks: int, t: int) -> torch.Tensor:
        """The static inputs of ``batch`` padded to ``b`` rows and ``blocks`` table columns
        (``None``: every row padding). With ``q > 1`` the rows' tokens are packed as the batch
        holds them and ``t - T`` padding tokens follow, on the last row."""
        if batch is None:
            return self.pack(HostRows((), (), (), (), (), None), b, q, blocks, t)
        table = batch.block_table_cpu
        assert table is not None
        rows = HostRows(
            batch.query_len_cpu, batch.input_ids_cpu, batch.num_computed_cpu, batch.swa_slot_cpu,
            batch.window_from, table,
        )  # fmt: skip
        return self.pack(rows, b, q, blocks, t)

    def pack(self, rows: HostRows, b: int, q: int, blocks: int, t: int) -> torch.Tensor:
        """`host_inputs` of rows given as plain lists (`HostRows`; the drafting chain's runs
        are packed so, with no `ForwardBatch` built for them)."""
        n = len(rows.lens)
        pad = b - n
        ids, computed = rows.ids, rows.computed
        per_row = (
            [*computed] + [0] * pad,
            [*rows.slots] + [self.scratch_slot] * pad,
            [*rows.window_from] + [0] * pad,
        )
        if q == 1:
            parts = [[*ids] + [0] * pad, [*per_row[0]], [1] * n + [0] * pad, *per_row]
        else:
            extra = t - len(ids)
            starts = list(itertools.accumulate(rows.lens, initial=0))[:n]
            parts = [
                [*ids] + [0] * extra,
                [n0 + j for n0, k in zip(computed, rows.lens) for j in range(k)]
                + [per_row[0][b - 1]] * extra,
                [1] * len(ids) + [0] * extra,
                *per_row,
                [s for s, k in zip(rows.slots, rows.lens) for _ in range(k)] + [self.scratch_slot] * extra,
                [i for i, k in enumerate(rows.lens) for _ in range(k)] + [b - 1] * extra,
                starts + [0] * pad,
                [*rows.lens] + [0] * pad,
            ]
        head = long_tensor([x for part in parts for x in part])
        table = torch.full((b, blocks), -1, dtype=torch.long)
        if rows.table is not None:
            width = min(blocks, rows.table.shape[1])
            table[:n, :width] = rows.table[:, :width]
        table[n:] = self.scratch_block
        return torch.cat([head, table.flatten()])

    def capture_graph(self, fn: Callable[[], T_out]) -> tuple[torch.cuda.CUDAGraph, T_out]:
        """Capture ``fn`` (which reads only static tensors, every row padding) into a graph in
        this object's memory pool: (graph, ``fn``'s outputs, rewritten by each replay)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up (kernel selection, Triton compiles) off the capture
            clear_cos_sin_cache()
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        clear_cos_sin_cache()
        graph = torch.cuda.CUDAGraph()
        # A dead engine's graph freed by the cycle collector mid-capture resets a CUDA graph,
        # which no capture survives: collect first, and not while capturing.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.mempool):
                out = fn()
        finally:
            if collecting:
                gc.enable()
        clear_cos_sin_cache()
        self.captures += 1
        return graph, out

    def _capture(self, b: int, q: int, t: int, context: int) -> _Graph:
        blocks = context // BLOCK_TOKENS
        inputs = torch.zeros(sum(self.layout(b, q, blocks, t)), dtype=torch.long, device=self.device)
        static = self.static_batch(inputs, b, q, context, t)
        # every row padding while warming up and capturing: the caches' real rows stay untouched
        inputs.copy_(self.host_inputs(None, b, q, blocks, t).to(self.device))
        graph, (final, hidden) = self.capture_graph(
            lambda: self.model.final_hidden(static, self.pool, self.swa)
        )
        return _Graph(graph, inputs, static, final, hidden)

    def release(self) -> None:
        """Drop every captured graph now (a closed engine): their memory is freed here, not by
        the cycle collector at some later point inside another engine's step."""
        self.graphs.clear()

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass of a `graphable` batch -> (logits [rows, vocab] at its
        ``logit_indices``, hidden [T, hc, D] in its token order). ``hidden`` may be a view of
        the graph's output: valid until the next step."""
        if weight_epoch() != self.epoch:
            self.graphs.clear()
            self.epoch = weight_epoch()
        n = batch.num_seqs
        b = batch_bucket(n)
        longest = max(batch.query_len_cpu)
        context = context_bucket(max(batch.num_computed_cpu) + longest)
        # a verification step's graph holds any rows of up to MAX_GRAPH_QUERY tokens: its
        # shapes follow its token count, not its longest row
        q, t = (1, b) if longest == 1 else (MAX_GRAPH_QUERY, token_bucket(batch.num_tokens, b))
        host = self.host_inputs(batch, b, q, context // BLOCK_TOKENS, t)
        if not self.capture:
            inputs = upload(host, self.device)
            batch.write_fed(inputs)  # the ids lead the inputs: the batch's token i at index i
            final, hidden = self.model.final_hidden(
                self.static_batch(inputs, b, q, context, t), self.pool, self.swa
            )
        else:
            key = (b, q, t, context)
            entry = self.graphs.get(key)
            if entry is None:
                entry = self._capture(b, q, t, context)
                self.graphs[key] = entry
                while len(self.graphs) > MAX_GRAPHS:
                    self.graphs.popitem(last=False)
            self.graphs.move_to_end(key)
            entry.inputs.copy_(
                host.pin_memory(), non_blocking=True
            )  # the host allocator keeps it until copied
            batch.write_fed(entry.inputs)  # the previous step's tokens, read on the device
            entry.graph.replay()
            self.replays += 1
            final, hidden = entry.final, entry.hidden
        if q == 1:
            return self.model.logits(final[:n]), hidden[:n]
        self.verify_steps += 1
        # the batch's tokens lead the graph's, in its order: its logit rows are the graph's
        return self.model.logits(final[batch.logit_indices]), hidden[: batch.num_tokens]
