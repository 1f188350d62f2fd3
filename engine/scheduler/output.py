"""The dataclasses that cross the step boundary: SchedulerOutput in, RunnerOutput out.

``schedule() -> SchedulerOutput``, ``execute(SchedulerOutput) -> RunnerOutput``,
``update(SchedulerOutput, RunnerOutput)``. Every scheduled sequence is described in full
(tokens of the step, positions, block table, slot), so a runner keeps no scheduling state
of its own except each sequence's last sampled token (for ``PENDING_TOKEN``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PENDING_TOKEN = -1  # an input token sampled by the previous, still in-flight step


# a request's drafts for its next step: (draft tokens, their confidences)
DraftProposal = tuple[tuple[int, ...], tuple[float, ...]]
# a step's drafts, by request id
StepDrafts = Mapping[str, DraftProposal]


@dataclass(slots=True)
class ScheduledSeq:
    """One request's part of a step, as the scheduler hands it to the executor: read, never
    written, after it is built. Not ``frozen``: one is built per running request per step, and
    a frozen dataclass's ``__init__`` (``object.__setattr__`` per field) took 1.86 us against
    0.46 here (docs/engine-runtime.md, "The step contract")."""

    request_id: str
    token_ids: tuple[int, ...]  # [num_new]; PENDING_TOKEN = this request's last sampled token
    start_pos: int  # tokens already in the caches (== num_computed before the step)
    block_table: tuple[int, ...]  # physical blocks covering positions [0, start_pos + num_new)
    swa_slot: int
    reset_slot: bool  # the slot holds no state for this sequence: clear it before use
    replay_until: int  # positions below it have cached compressed rows: read, do not write
    window_from: int  # raw-window positions below it are not in the slot (replay into a fresh slot)
    swa_keep: tuple[int, int]  # (layers, until): those layers' rings hold exact state below until: keep it
    # (offset among token_ids, rows [n, hidden]): image embeddings replacing those tokens' embeddings
    embeds: tuple[tuple[int, Any], ...]
    sample: bool  # produce logits for the last token and sample the next one
    output_index: int  # index of the sampled token among this request's outputs (seeding)
    fork_children: tuple[str, ...] = ()  # n > 1: also sample each child's first token from this row
    # speculative verification: the last ``num_drafts`` tokens are drafts; the step samples
    # the target at every one of the last num_drafts + 1 positions and keeps the drafts up
    # to the first that differs from the target's token (RunnerOutput.tokens)
    num_drafts: int = 0

    @property
    def num_new(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SlotSave:
    """A retained slot to keep in host memory: its state is exact at ``num_tokens``."""

    slot: int
    partial_block: int | None  # the block holding the tail's compressed rows
    anchor: bytes  # hash of the last full block before num_tokens
    num_tokens: int
    tail: tuple[int, ...]  # tokens after the anchor block


@dataclass(frozen=True)
class SchedulerOutput:
    step: int
    seqs: tuple[ScheduledSeq, ...]
    finished_ids: frozenset[str] = frozenset()  # finished/aborted since the previous step
    preempted_ids: frozenset[str] = frozenset()
    predicted_time_s: float = 0.0  # cost-model estimate of this step (0 without a model)
    # Applied before the forward, in order (forks made by an earlier step): physical block
    # copies (a parent's partial block) and SWA slot copies (the parent's window state).
    block_copies: tuple[tuple[int, int], ...] = ()
    slot_copies: tuple[tuple[int, int], ...] = ()
    # KV connector, worker side. Applied before the forward: verified payloads written into a
    # physical block (a store hit, an imported sequence's blocks) or an SWA slot (an import).
    kv_loads: tuple[tuple[int, bytes], ...] = ()
    slot_loads: tuple[tuple[int, bytes], ...] = ()
    # After the forward: blocks published in the prefix table since the previous step, as
    # (block, hash, traffic class), to snapshot for the store. Each is pinned (one reference)
    # until this step's ``update``, so it cannot be reused before its bytes are out.
    kv_saves: tuple[tuple[int, bytes, str], ...] = ()
    # Before anything else: retained slots to copy into the host slot pool (turns that ended),
    # while their state (and their partial block) is still the one they retained.
    slot_saves: tuple[SlotSave, ...] = ()
    # Speculation: drafts per sequence the step proposes for the next (0: no MTP work at
    # all); -1: the executor's own setting
    draft_depth: int = -1

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)

    @property
    def prompt_tokens(self) -> int:
        """Tokens of sequences that neither decode nor verify drafts: prompts (their chunks)
        and replayed windows, which a disaggregated deployment's prefill pool would compute
        (a one-token row that samples has a decode row's shape, and counts as one)."""
        return sum(s.num_new for s in self.seqs if not (s.sample and s.num_new == 1 + s.num_drafts))

    @property
    def num_sampled(self) -> int:
        return sum(1 for s in self.seqs if s.sample)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class RunnerOutput:
    """Sampled tokens, in the order of the ``sample=True`` sequences of the step."""

    step: int
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, object] = field(default_factory=dict)  # per request, sampler-defined
    # Requests whose own input failed in this step (a grammar the matcher cannot follow):
    # they end with FINISHED_ERROR and this message; the rest of the batch is unaffected.
    failed: dict[str, str] = field(default_factory=dict)
    # Speculation. ``tokens``: every token a request emitted this step when it is more than
    # ``sampled``'s one (its accepted drafts and the target's token after them), with their
    # ``token_logprobs``; ``drafts``: the drafts (tokens, confidences) each request proposes
    # for its next step (a mapping that may read them from the device when first looked at:
    # `engine.spec.speculation.NextDrafts`).
    tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)
    token_logprobs: dict[str, tuple[object, ...]] = field(default_factory=dict)
    drafts: StepDrafts = field(default_factory=dict)
