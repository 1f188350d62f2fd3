"""`ForwardBatch`: the only input of the model forward (the seam with the scheduler).

A batch is a list of sequences; each contributes a contiguous run of new tokens (a prefill
chunk of any length, one decode token, or k+1 tokens for speculative verification). Tokens
are flattened into one axis of length T; per-sequence metadata says where each run starts.

Invariants (checked by :meth:`ForwardBatch.validate`):
- sequence i owns flat tokens ``[query_start[i], query_start[i] + query_len[i])``, runs are
  contiguous and in order, ``sum(query_len) == T``;
- ``positions`` of sequence i are ``num_computed[i] + arange(query_len[i])`` (absolute);
- ``block_table[i, j]`` is the physical block holding logical block j (positions
  ``[256 j, 256 j + 256)``) of the sequence's compressed state; it covers every position
  below ``num_computed[i] + query_len[i]``; unused entries are -1;
- ``swa_slot[i]`` is the sliding-window slot whose state is valid at ``num_computed[i]``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from engine.config import BLOCK_TOKENS

if TYPE_CHECKING:
    from engine.model.verify import Layout

T = TypeVar("T")


@dataclass(slots=True)
class SequenceInput:
    """One sequence's part of a step, as plain Python data (what the scheduler knows). Read,
    never written, once built; not ``frozen`` for the reason `ScheduledSeq` is not (one a
    sequence a step; docs/engine-runtime.md, "The step contract")."""

    token_ids: Sequence[int]  # the new tokens of this step
    num_computed: int  # tokens already in this sequence's caches
    swa_slot: int
    block_table: Sequence[int]  # physical block ids, logical order
    sample: bool = True  # produce logits for the last new token
    # Compressed rows covering only positions below this are already final in the blocks (a prefix
    # hit being replayed to rebuild SWA state): the step must not rewrite them. 0 = none.
    rows_cached_until: int = 0
    # Raw-window positions below this are not in the slot (SWA-state replay into a fresh slot):
    # attention ignores them. 0 = the slot is valid (fresh sequences, copied slots).
    window_from: int = 0
    # (layers, until): the first ``layers`` layers' slot rings already hold exact state for
    # positions below ``until`` (a host slot that kept only those layers): the step computes
    # those positions but does not write them there. (0, 0) = write everything.
    swa_keep: tuple[int, int] = (0, 0)
    # (offset among token_ids, rows [n, hidden]): these tokens' embeddings are replaced by the
    # rows (an image's vision-encoder output); () = every token embeds from its id
    embeds: Sequence[tuple[int, Any]] = ()
    # with sample=True: logits for this many trailing tokens (speculative verification: the
    # last token and the drafts before it, k + 1); 1 = the last token only
    num_logits: int = 1


def long_tensor(values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
    """A host int64 tensor of Python ints (a list, or equal-length lists), through numpy:
    `torch.tensor` walks a list element by element, about 3x slower for a step's thousands of
    ids and positions, which a speculating step builds a dozen times."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device: on CUDA through pinned
    memory, asynchronously (a pageable copy synchronises the stream, which would drain the
    queued step before the next could be built). The caching host allocator keeps the pinned
    buffer until the copy has run."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class PaddedDecode:
    """A decode or verification batch padded to a fixed shape (a CUDA graph's static input,
    `engine.cuda_graphs`).

    With ``query == 1`` (a decode step) every row brings one token at ``num_computed`` and is
    sampled; rows past the real ones are padding, which read and write only a scratch
    sliding-window slot and a scratch block. With ``query > 1`` (speculative verification,
    `engine.model.verify`) a row brings up to ``query`` tokens: ``qlen`` of them, the first at
    flat index ``start``, ``seq`` naming each token's row. Tokens that are not a row's own
    are padding: they write only the scratch slot and block (``write_slot``), and no real
    token attends to them. A verification graph and a drafting chain's first pass pack the
    rows' tokens one after another (ragged: a step costs its tokens, not its rows times its
    longest row). Shapes depend on ``context`` (an
    upper bound on every row's ``num_computed + query``) and the token count, never on the
    values: the compressors pool the windows that can close and send those that do not, or
    that are padding, to the scratch block, and attention gathers ``context // rate``
    compressed entries."""

    context: int
    window_from: torch.Tensor  # [B] int64 (the host tuple of a plain batch)
    real: torch.Tensor  # [T] int64: 1 for a real token, 0 for padding (MoE load counters)
    scratch_block: int
    query: int = 1
    # with query > 1, int64: [T] the slot each token's ring rows go to (its row's, or the
    # scratch slot for padding), [T] each token's row, [B] each row's first token and [B]
    # its own tokens (0 for a padding row); None with query 1 (one token a row)
    write_slot: torch.Tensor | None = None
    seq: torch.Tensor | None = None
    start: torch.Tensor | None = None
    qlen: torch.Tensor | None = None


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute positions
    query_start: torch.Tensor  # [B] int64, offset of each sequence's run in the flat tokens
    query_len: torch.Tensor  # [B] int64
    num_computed: torch.Tensor  # [B] int64, tokens already cached before this step
    swa_slot: torch.Tensor  # [B] int64
    block_table: torch.Tensor  # [B, max_blocks] int64, -1 padded
    sample: torch.Tensor  # [B] bool
    # Host copies of the per-sequence metadata, so per-sequence loops never sync a device.
    query_start_cpu: tuple[int, ...] = ()
    query_len_cpu: tuple[int, ...] = ()
    num_computed_cpu: tuple[int, ...] = ()
    swa_slot_cpu: tuple[int, ...] = ()
    rows_cached_until_cpu: tuple[int, ...] = ()
    window_from_cpu: tuple[int, ...] = ()
    swa_keep_cpu: tuple[tuple[int, int], ...] = ()
    # (flat token index, rows [n, hidden]) replacing those tokens' embeddings (images)
    embeds: tuple[tuple[int, Any], ...] = ()
    # per sequence: logits rows of its trailing tokens (with sample); () = one each
    num_logits_cpu: tuple[int, ...] = ()
    # host copies of the tokens, the sample flags and the block table (checks and CUDA graphs
    # read them without a device round trip)
    input_ids_cpu: tuple[int, ...] = ()
    sample_cpu: tuple[bool, ...] = ()
    block_table_cpu: torch.Tensor | None = None
    padded: PaddedDecode | None = None  # a CUDA graph's fixed-shape decode batch
    # (flat token indices [k], ids [k]) on the device: tokens the previous step sampled and
    # the host has not read yet (its argmax); ``input_ids`` and ``input_ids_cpu`` hold 0
    # there until `ModelRunner.execute` writes these ids over them
    fed: tuple[torch.Tensor, torch.Tensor] | None = None
    # the flat token indices of ``fed``, on the host (`select` splits a step by them)
    fed_cpu: tuple[int, ...] = ()

    def write_fed(self, ids: torch.Tensor) -> None:
        """Write the `fed` ids over their placeholders in ``ids`` (``input_ids``, or a CUDA
        graph's static inputs, which lead with them), on the device's stream."""
        if self.fed is not None:
            ids.index_copy_(0, *self.fed)

    def kept_until(self, layer: int) -> tuple[int, ...]:
        """Per sequence: ring writes of ``layer`` for positions below this are skipped (swa_keep)."""
        return tuple(until if layer < layers else 0 for layers, until in self.swa_keep_cpu) or (
            (0,) * self.num_seqs
        )

    def any_kept(self, layer: int) -> bool:
        return any(
            layer < layers and n0 < until
            for (layers, until), n0 in zip(self.swa_keep_cpu, self.num_computed_cpu)
        )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_len_cpu)

    @property
    def cached_until(self) -> tuple[int, ...]:
        return self.rows_cached_until_cpu or (0,) * self.num_seqs

    @property
    def window_from(self) -> tuple[int, ...]:
        return self.window_from_cpu or (0,) * self.num_seqs

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one token (the vectorised decode path applies)."""
        return all(n == 1 for n in self.query_len_cpu)

    def memo(self, key: Hashable, make: Callable[[], T]) -> T:
        """``make()``, once per forward pass: the index tensors that every layer derives
        alike from this batch (window positions, masks, gather indices), made by the first
        layer that needs them. On a CUDA graph's replay they are computed once a step, not once
        a layer. `forget_memo` empties it at the start of each pass, so a batch run twice (a
        graph's warm-up, then its capture) never reads one pass's tensors in another."""
        memo = self.__dict__.setdefault("_memo", {})  # a frozen dataclass: beside its fields
        if key not in memo:
            memo[key] = make()
        return memo[key]

    def forget_memo(self) -> None:
        """Drop what `memo` holds (the model's forward passes call it first)."""
        self.__dict__.pop("_memo", None)

    @cached_property
    def verify_layout(self) -> Layout:
        """Where each token sits among its sequence's (engine.model.verify), built once per step."""
        from engine.model.verify import Layout

        return Layout(self)

    @property
    def sample_indices(self) -> torch.Tensor:
        """[num_sampled] flat index of the last new token of every sequence with sample=True."""
        last = self.query_start + self.query_len - 1
        if self.padded is not None or (self.sample_cpu and all(self.sample_cpu)):
            return last  # no boolean mask: its output size would need a device round trip
        if self.sample_cpu:
            rows = [
                s + n - 1
                for s, n, keep in zip(self.query_start_cpu, self.query_len_cpu, self.sample_cpu)
                if keep
            ]
            return upload(long_tensor(rows), last.device)
        return last[self.sample]

    @property
    def logit_indices(self) -> torch.Tensor:
        """Flat indices of every token the model produces logits for: each sampled sequence's
        last ``num_logits`` tokens, in order (``sample_indices`` when every count is 1)."""
        if not self.num_logits_cpu:
            return self.sample_indices
        rows = [
            start + qlen - n + j
            for start, qlen, n, s in zip(
                self.query_start_cpu,
                self.query_len_cpu,
                self.num_logits_cpu,
                self.sample_cpu or self.sample.tolist(),
            )
            if s
            for j in range(n)
        ]
        return upload(long_tensor(rows), self.input_ids.device)

    def sequence_inputs(self, which: Sequence[int]) -> list[SequenceInput]:
        """Sequences ``which`` as the scheduler gave them (from the host copies; a `fed`
        token is its placeholder 0)."""
        if not (self.input_ids_cpu and self.sample_cpu) or self.block_table_cpu is None:
            raise ValueError("only a batch built by from_sequences can be split")
        seqs = []
        for i in which:
            start, n = self.query_start_cpu[i], self.query_len_cpu[i]
            seqs.append(
                SequenceInput(
                    self.input_ids_cpu[start : start + n],
                    self.num_computed_cpu[i],
                    self.swa_slot_cpu[i],
                    self.block_table_cpu[i].tolist(),
                    self.sample_cpu[i],
                    rows_cached_until=self.cached_until[i],
                    window_from=self.window_from[i],
                    swa_keep=self.swa_keep_cpu[i] if self.swa_keep_cpu else (0, 0),
                    embeds=tuple((at - start, rows) for at, rows in self.embeds if start <= at < start + n),
                    num_logits=self.num_logits_cpu[i] if self.num_logits_cpu else 1,
                )
            )
        return seqs

    def select(self, which: Sequence[int]) -> tuple[ForwardBatch, list[int]]:
        """The batch of sequences ``which`` (in order) alone, and the flat index here of each of
        its tokens. Its `fed` tokens are this batch's that fall in those sequences."""
        part = ForwardBatch.from_sequences(self.sequence_inputs(which), self.input_ids.device)
        flat = [
            self.query_start_cpu[i] + j for i in which for j in range(self.query_len_cpu[i])
        ]  # fmt: skip
        if self.fed is None:
            return part, flat
        where = {t: k for k, t in enumerate(flat)}
        kept = [(where[t], k) for k, t in enumerate(self.fed_cpu) if t in where]
        if not kept:
            return part, flat
        at = [new for new, _ in kept]
        index = upload(torch.tensor(at + [k for _, k in kept], dtype=torch.long), self.input_ids.device)
        fed = (index[: len(at)], self.fed[1][index[len(at) :]])
        return replace(part, fed=fed, fed_cpu=tuple(at)), flat

    @classmethod
    def from_sequences(
        cls, seqs: Sequence[SequenceInput], device: torch.device | str = "cpu"
    ) -> ForwardBatch:
        if not seqs:
            raise ValueError("a ForwardBatch needs at least one sequence")
        ids: list[int] = []
        pos: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        for s in seqs:
            n = len(s.token_ids)
            if n == 0:
                raise ValueError("every sequence in a step must contribute at least one token")
            starts.append(len(ids))
            lens.append(n)
            ids.extend(map(int, s.token_ids))
            pos.extend(range(s.num_computed, s.num_computed + n))
        b = len(seqs)
        width = max(1, max(len(s.block_table) for s in seqs))
        rows = [list(s.block_table) + [-1] * (width - len(s.block_table)) for s in seqs]
        table = long_tensor(rows)
        samples = tuple(bool(s.sample) for s in seqs)
        computed = [s.num_computed for s in seqs]
        slots = [s.swa_slot for s in seqs]
        # one upload for every device field (views of it): one copy per step, none blocking
        t = len(ids)
        flat = torch.cat(
            [
                long_tensor(ids + pos + starts + lens + computed + slots + list(samples)),
                table.flatten(),
            ]
        )
        dev = upload(flat, device)
        cuts = [t, t, b, b, b, b, b, b * width]
        ids_d, pos_d, starts_d, lens_d, computed_d, slots_d, sample_d, table_d = dev.split(cuts)
        batch = cls(
            input_ids=ids_d,
            positions=pos_d,
            query_start=starts_d,
            query_len=lens_d,
            num_computed=computed_d,
            swa_slot=slots_d,
            block_table=table_d.view(b, width),
            sample=sample_d.bool(),
            query_start_cpu=tuple(starts),
            query_len_cpu=tuple(lens),
            num_computed_cpu=tuple(computed),
            swa_slot_cpu=tuple(slots),
            rows_cached_until_cpu=tuple(s.rows_cached_until for s in seqs),
            window_from_cpu=tuple(s.window_from for s in seqs),
            swa_keep_cpu=tuple(s.swa_keep for s in seqs) if any(s.swa_keep[0] for s in seqs) else (),
            embeds=tuple((start + off, rows) for start, s in zip(starts, seqs) for off, rows in s.embeds),
            num_logits_cpu=tuple(s.num_logits for s in seqs) if any(s.num_logits != 1 for s in seqs) else (),
            input_ids_cpu=tuple(ids),
            sample_cpu=samples,
            block_table_cpu=table,
        )
        batch.validate((table >= 0).sum(dim=1).tolist())
        return batch

    def validate(self, blocks: Sequence[int] | None = None) -> None:
        """Raise ValueError if the batch breaks an invariant in the module docstring.
        ``blocks``: each sequence's count of valid block-table entries, when the caller knows
        them (else counted from the table)."""
        b = self.num_seqs
        if blocks is None:
            table = self.block_table if self.block_table_cpu is None else self.block_table_cpu
            blocks = [int(n) for n in (table >= 0).sum(dim=1).tolist()]
        if not (len(self.query_start_cpu) == len(self.num_computed_cpu) == len(self.swa_slot_cpu) == b):
            raise ValueError("per-sequence host metadata must all have one entry per sequence")
        if any(
            len(t) not in (0, b)
            for t in (
                self.rows_cached_until_cpu,
                self.window_from_cpu,
                self.swa_keep_cpu,
                self.num_logits_cpu,
            )
        ):
            raise ValueError("per-sequence host metadata must all have one entry per sequence")
        expect = 0
        for i in range(b):
            if self.query_start_cpu[i] != expect or self.query_len_cpu[i] < 1:
                raise ValueError(f"sequence {i}: runs must be contiguous, in order and non-empty")
            if self.num_logits_cpu and not 1 <= self.num_logits_cpu[i] <= self.query_len_cpu[i]:
                raise ValueError(
                    f"sequence {i}: num_logits must be in [1, query_len={self.query_len_cpu[i]}]"
                )
            expect += self.query_len_cpu[i]
            need = -(-(self.num_computed_cpu[i] + self.query_len_cpu[i]) // BLOCK_TOKENS)
            have = blocks[i]
            if have < need:
                raise ValueError(
                    f"sequence {i}: block_table has {have} blocks but positions up to "
                    f"{self.num_computed_cpu[i] + self.query_len_cpu[i]} need {need} blocks of {BLOCK_TOKENS}"
                )
        if expect != self.num_tokens or self.positions.shape[0] != expect:
            raise ValueError(f"sum(query_len)={expect} but the batch has {self.num_tokens} tokens")
        if len(set(self.swa_slot_cpu)) != b:
            raise ValueError("two sequences of one step share a sliding-window slot")
