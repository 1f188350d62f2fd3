"""Scheduler configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.scheduler.chunking import StepCostModel

DEFAULT_TOKEN_BUDGET = 32_768
#: the batch-invariant mode's prompt chunk: eight 256-token blocks, so chunk ends fall on block
#: and compressor-window boundaries (an engine with a smaller token budget takes that, rounded
#: down to a block)
INVARIANT_CHUNK_TOKENS = 2048


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int  # physical compressed-cache blocks in the pool
    num_swa_slots: int  # sliding-window slots in the pool (>= max_num_seqs is sensible)
    block_size: int = 256
    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_TOKEN_BUDGET
    step_time_budget_s: float | None = None  # None: chunks limited by the token budget only
    cost_model: StepCostModel | None = None
    enable_prefix_caching: bool = True
    # A prefix hit whose exact SWA slot state is gone: "replay" recomputes the last
    # ``swa_replay_tokens`` tokens of the hit (reading, not writing, their cached compressed
    # rows) to rebuild the window exactly; "recompute" drops such a hit entirely.
    swa_miss_policy: Literal["replay", "recompute"] = "replay"
    swa_replay_tokens: int = 256
    # Bounded replay (opt-in): replay only this many tokens of such a hit (the model's
    # window - 1), with the raw window truncated to them. Approximate: the request's state is
    # marked, and nothing computed from it is published (docs/engine-runtime.md). 0: not
    # offered. ``bounded_replay`` makes it the default of requests that do not choose.
    bounded_replay_tokens: int = 0
    bounded_replay: bool = False
    # > 0: the block manager buffers this many stored/removed block events for a router
    # (drop-oldest past it; engine/scheduler/cache_events.py); 0: no events are recorded
    cache_event_capacity: int = 0
    # KV connector write-through: every newly published block is listed in the step's
    # ``kv_saves`` (and pinned until that step ran) for the worker to snapshot for the store.
    save_new_blocks: bool = False
    # Batch-invariant steps (the engine's batch-invariant mode): a step holds decodes (with
    # their drafts) or prefill chunks, never both, alternating when both wait, so a decode
    # always takes the decode path; and a prompt is cut only at multiples of
    # ``invariant_chunk_tokens`` from position 0 (the time budget does not size chunks), so
    # its chunks are the same whatever shares the step.
    batch_invariant: bool = False
    invariant_chunk_tokens: int = INVARIANT_CHUNK_TOKENS

    def __post_init__(self) -> None:
        for name in ("num_blocks", "num_swa_slots", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_invariant and (
            self.invariant_chunk_tokens % self.block_size
            or not 0 < self.invariant_chunk_tokens <= self.max_num_batched_tokens
        ):
            raise ValueError(
                f"SchedulerConfig.invariant_chunk_tokens ({self.invariant_chunk_tokens}) must be a "
                f"multiple of block_size ({self.block_size}) and at most max_num_batched_tokens "
                f"({self.max_num_batched_tokens})"
            )
        if self.cache_event_capacity < 0:
            raise ValueError(
                f"SchedulerConfig.cache_event_capacity must be >= 0 (0 = off), got {self.cache_event_capacity}"
            )
        if self.swa_replay_tokens < 0:
            raise ValueError(f"SchedulerConfig.swa_replay_tokens must be >= 0, got {self.swa_replay_tokens}")
        if self.bounded_replay_tokens < 0:
            raise ValueError(
                f"SchedulerConfig.bounded_replay_tokens must be >= 0, got {self.bounded_replay_tokens}"
            )
        if self.bounded_replay and self.bounded_replay_tokens == 0:
            raise ValueError("SchedulerConfig.bounded_replay needs bounded_replay_tokens > 0 (window - 1)")
        if self.swa_miss_policy not in ("replay", "recompute"):
            raise ValueError(
                f"SchedulerConfig.swa_miss_policy must be 'replay' or 'recompute', got {self.swa_miss_policy!r}"
            )
        if self.step_time_budget_s is not None:
            if self.step_time_budget_s <= 0:
                raise ValueError(f"step_time_budget_s must be > 0 or None, got {self.step_time_budget_s}")
            if self.cost_model is None:
                raise ValueError(
                    "step_time_budget_s needs a cost_model (fit one with `sluice bench engine --profile`)"
                )
