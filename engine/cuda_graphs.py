"""Decode steps as CUDA graphs: one graph per (batch bucket, context bucket), captured on first use.

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

from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.cache.pool import CompressedPool
from engine.cache.swa import SWASlots
from engine.config import BLOCK_TOKENS
from engine.forward_batch import ForwardBatch, PaddedDecode, upload
from engine.model.model import DeepseekV4
from engine.model.moe import weight_epoch
from engine.model.rope import clear_cos_sin_cache

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


def graphable(batch: ForwardBatch) -> bool:
    """A plain decode batch: one sampled token per row, no images, no kept host-slot layers,
    no replayed rows, no speculative drafts."""
    return (
        batch.is_decode
        and bool(batch.sample_cpu)
        and all(batch.sample_cpu)
        and bool(batch.input_ids_cpu)
        and batch.block_table_cpu is not None
        and not batch.embeds
        and not batch.swa_keep_cpu
        and not batch.num_logits_cpu
        and not any(batch.cached_until)
    )


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [6 * B + B * blocks] int64: ids, pos, computed, slot, window_from, real, table
    # the batch it was captured with: its other tensors (row starts, lengths, sample flags) are
    # read by every replay, so they must live as long as the graph (freed, their memory would
    # be handed to other tensors)
    batch: ForwardBatch
    final: torch.Tensor  # [B, D] normed hidden rows (the lm_head's input)
    hidden: torch.Tensor  # [B, hc, D] final hc streams


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
        self.graphs: OrderedDict[tuple[int, int], _Graph] = OrderedDict()
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.epoch = weight_epoch()
        self.captures = 0  # graphs captured so far (metrics, tests)
        self.replays = 0

    def _layout(self, b: int, blocks: int) -> list[int]:
        return [b] * 6 + [b * blocks]

    def _static_batch(self, inputs: torch.Tensor, b: int, context: int) -> ForwardBatch:
        blocks = context // BLOCK_TOKENS
        ids, pos, computed, slot, window_from, real, table = inputs.split(self._layout(b, blocks))
        ones = torch.ones(b, dtype=torch.long, device=self.device)
        return ForwardBatch(
            input_ids=ids,
            positions=pos,
            query_start=torch.arange(b, device=self.device),
            query_len=ones,
            num_computed=computed,
            swa_slot=slot,
            block_table=table.view(b, blocks),
            sample=ones.bool(),
            query_start_cpu=tuple(range(b)),
            query_len_cpu=(1,) * b,
            num_computed_cpu=(0,) * b,  # not read on the padded path: shapes come from `padded`
            swa_slot_cpu=tuple(range(b)),
            sample_cpu=(True,) * b,
            padded=PaddedDecode(context, window_from, real, self.scratch_block),
        )

    def _host_inputs(self, batch: ForwardBatch | None, b: int, blocks: int) -> torch.Tensor:
        """The static inputs of ``batch`` padded to ``b`` rows and ``blocks`` table columns
        (``None``: every row padding)."""
        n = 0 if batch is None else batch.num_seqs
        pad = b - n
        ids, computed, slots, window_from = (
            ((), (), (), ())
            if batch is None
            else (batch.input_ids_cpu, batch.num_computed_cpu, batch.swa_slot_cpu, batch.window_from)
        )
        head = torch.tensor(
            [*ids] + [0] * pad
            + [*computed] + [0] * pad  # positions: one token per row
            + [*computed] + [0] * pad
            + [*slots] + [self.scratch_slot] * pad
            + [*window_from] + [0] * pad
            + [1] * n + [0] * pad,
            dtype=torch.long,
        )  # fmt: skip
        table = torch.full((b, blocks), -1, dtype=torch.long)
        if batch is not None:
            src = batch.block_table_cpu
            assert src is not None
            width = min(blocks, src.shape[1])
            table[:n, :width] = src[:, :width]
        table[n:] = self.scratch_block
        return torch.cat([head, table.flatten()])

    def _capture(self, b: int, context: int) -> _Graph:
        blocks = context // BLOCK_TOKENS
        inputs = torch.zeros(sum(self._layout(b, blocks)), dtype=torch.long, device=self.device)
        static = self._static_batch(inputs, b, context)
        # every row padding while warming up and capturing: the caches' real rows stay untouched
        inputs.copy_(self._host_inputs(None, b, blocks).to(self.device))
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up (kernel selection, Triton compiles) off the capture
            clear_cos_sin_cache()
            self.model.final_hidden(static, self.pool, self.swa)
        torch.cuda.current_stream(self.device).wait_stream(side)
        clear_cos_sin_cache()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            final, hidden = self.model.final_hidden(static, self.pool, self.swa)
        clear_cos_sin_cache()
        self.captures += 1
        return _Graph(graph, inputs, static, final, hidden)

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass of a `graphable` batch -> (logits [n, vocab], hidden [n, hc, D]).
        ``hidden`` is a view of the graph's output: valid until the next step."""
        if weight_epoch() != self.epoch:
            self.graphs.clear()
            self.epoch = weight_epoch()
        n = batch.num_seqs
        b = batch_bucket(n)
        context = context_bucket(max(batch.num_computed_cpu) + 1)
        if not self.capture:
            inputs = upload(self._host_inputs(batch, b, context // BLOCK_TOKENS), self.device)
            batch.write_fed(inputs)  # the ids lead the inputs: row i's id at index i
            final, hidden = self.model.final_hidden(
                self._static_batch(inputs, b, context), self.pool, self.swa
            )
            return self.model.logits(final[:n]), hidden[:n]
        key = (b, context)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(b, context)
            self.graphs[key] = entry
            while len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        host = self._host_inputs(batch, b, context // BLOCK_TOKENS)
        entry.inputs.copy_(host.pin_memory(), non_blocking=True)  # the host allocator keeps it until copied
        batch.write_fed(entry.inputs)  # the previous step's tokens, read on the device
        entry.graph.replay()
        self.replays += 1
        return self.model.logits(entry.final[:n]), entry.hidden[:n]
