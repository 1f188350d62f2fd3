"""A request's scheduling state (pure): tokens, computed length, blocks, slot, status.

State machine::

    WAITING --admit--> RUNNING --finish(stop|length|abort)--> FINISHED_*
       ^                  |
       +----preempt-------+   (recompute: blocks released, computed length reset)
    WAITING --abort--> FINISHED_ABORTED
    WAITING_FOR_REMOTE_KV --loaded (or failed: recompute)--> WAITING

``WAITING_FOR_REMOTE_KV``: the KV connector is fetching blocks of its prefix from the store;
the scheduler leaves it queued without blocking the requests behind it.

``num_pending`` counts tokens sampled by steps that are still in flight (asynchronous
scheduling): they are inputs of the next step before their values are known.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.scheduler.hashing import BlockHasher, ExtraKeys, ImageSpan


@dataclass(frozen=True)
class ImageInput(ImageSpan):
    """An image in a prompt: its span of placeholder tokens, its key (``ImageSpan``) and what
    replaces those positions' token embeddings: ``embeds`` [length, hidden_size], the vision
    encoder's output rows (a torch tensor of any float dtype; cast to the model's)."""

    embeds: Any = None

    def rows(self, start: int, end: int) -> tuple[int, Any] | None:
        """(offset in ``[start, end)``, its embedding rows) for the part of the span that a step
        computing positions ``[start, end)`` covers; None when it covers none."""
        lo, hi = max(start, self.offset), min(end, self.offset + self.length)
        if lo >= hi:
            return None
        return lo - start, self.embeds[lo - self.offset : hi - self.offset]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # its prefix is being fetched (KV connector)
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request's own input failed mid-run (e.g. its grammar)

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


@dataclass(eq=False)
class Request:
    """What the scheduler knows about one sequence. Lower ``priority`` is served first."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    extra_keys: ExtraKeys = field(default_factory=ExtraKeys)
    fork_of: str | None = None  # n > 1: share this request's prompt computation, then diverge
    traffic_class: str = "chat"  # the store's TTL class of the blocks it writes ("agent" | "chat")
    # A prefix hit whose SWA state is gone: "exact" or "bounded" replay; None: the engine's default
    swa_replay: str | None = None
    # Images of the prompt (engine.messages.ImageInput: span, key, embedding rows), in order:
    # their keys enter the block hashes and their rows replace the token embeddings
    images: tuple[ImageInput, ...] = ()
    # -- state, owned by the scheduler --
    arrival: int = -1
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_pending: int = 0
    block_table: list[int] = field(default_factory=list)
    swa_slot: int | None = None
    replay_until: int = 0  # compressed rows below this position are cached: read, never written
    window_from: int = 0  # the slot was rebuilt from here: raw-window positions below are absent
    # (layers, until): a host slot kept only the first ``layers`` layers' exact windows up to
    # ``until``; the replay that rebuilds the others must not overwrite them (0, 0): none
    swa_keep: tuple[int, int] = (0, 0)
    num_cached_tokens: int = -1  # prefix tokens not computed at first admission
    num_preemptions: int = 0
    error: str | None = None  # why it finished with FINISHED_ERROR
    hasher: BlockHasher | None = None
    num_registered: int = 0  # leading blocks already published in the prefix table
    # Set while its state descends from a bounded replay: positions from here on are
    # approximate, and none of its blocks, its slot or its cache events are published.
    approximate_from: int | None = None
    bounded_replays: int = 0  # admissions that used bounded replay (the response says so)
    # Blocks of its prefix held for it while it waits (local hits, blocks loaded from the
    # store): one reference each, released at admission (which takes its own) or at finish.
    pinned_blocks: list[int] = field(default_factory=list)
    # Speculation: the drafts the last step proposed for this sequence's next tokens, and
    # each one's confidence (empty: none; cleared when the sequence is preempted)
    drafts: tuple[int, ...] = ()
    draft_conf: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.swa_replay not in (None, "exact", "bounded"):
            raise ValueError(
                f"request {self.request_id!r}: swa_replay must be 'exact' or 'bounded', got {self.swa_replay!r}"
            )
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt is empty")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus generated (pending ones excluded)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return self.num_tokens + self.num_pending

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without copying the whole sequence (a decode step
        asks for one token of a long one)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_outputs_with_pending(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    @property
    def tokens_to_compute(self) -> int:
        return self.num_tokens_with_pending - self.num_computed

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)
