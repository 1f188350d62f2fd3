"""What disaggregated serving adds to an engine client: the ``Handoff`` that ends a
prefill stream, and the ``Reservations`` a decode engine holds for sequences on their way.

Both are used by ``services.api.inprocess.InProcessEngineClient`` (on its engine thread,
``services.api.engine_thread``, for the reservations); docs/disaggregation.md describes the path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Handoff:
    """The last item of a ``prefill`` stream whose request goes on elsewhere: the sequence's
    payload (the engine's versioned byte format) for ``resume`` on another engine."""

    request_id: str
    payload: bytes


class Reservations:
    """Room promised to sequences that will be imported (decode role), kept by the engine
    thread: request id -> (blocks, tokens). Room is the engine's own numbers: blocks it can
    allocate (free, evictable cached, retained slots' partial blocks) minus the blocks
    running sequences still need to reach their ``max_tokens`` minus reserved blocks; SWA
    slots minus reservations; places among ``max_num_seqs`` minus reservations."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[int, int]] = {}
        self.refused = 0

    def room(self, core: Any) -> dict[str, int]:
        sched = core.scheduler
        cache, bs = sched.cache, core.block_size
        owed = sum(
            max(-(-(len(r.prompt_token_ids) + r.max_tokens) // bs) - len(r.block_table), 0)
            for r in sched.requests.values()
        )
        reserved_blocks = sum(b for b, _ in self.held.values())
        n = len(self.held)
        return {
            "blocks": cache.blocks.num_available + cache.slots.num_retained_partials - owed - reserved_blocks,
            "slots": cache.slots.num_available - n,
            "seqs": sched.config.max_num_seqs - len(sched.requests) - n,
            "owed_blocks": owed,
            "reserved_blocks": reserved_blocks,
        }

    def reserve(self, core: Any, request_id: str, n_tokens: int, max_tokens: int) -> bool:
        """Hold ``ceil((n_tokens + max_tokens) / block_size)`` blocks, an SWA slot and a
        sequence place for ``request_id`` if the engine has them beside what it promised;
        reserving again replaces the request's reservation. False: nothing held."""
        if n_tokens < 1 or max_tokens < 0:
            raise ValueError(f"reserve needs n_tokens >= 1 and max_tokens >= 0, got {n_tokens}, {max_tokens}")
        previous = self.held.pop(request_id, None)
        tokens = int(n_tokens) + int(max_tokens)
        blocks = -(-tokens // core.block_size)
        room = self.room(core)
        if blocks <= room["blocks"] and room["slots"] >= 1 and room["seqs"] >= 1:
            self.held[request_id] = (blocks, tokens)
            return True
        if previous is not None:
            self.held[request_id] = previous
        self.refused += 1
        return False

    def release(self, request_id: str) -> bool:
        return self.held.pop(request_id, None) is not None

    def over(self, core: Any) -> bool:
        room = self.room(core)
        return room["blocks"] < 0 or room["slots"] < 0 or room["seqs"] < 0
