"""A running sequence as plain data: what ``export_sequence`` writes and ``import_sequence`` reads.

The payload (kind ``KIND_SEQUENCE``) is the common header plus JSON metadata (this
``SequenceState``) and sections: the SWA slot payload, the partial tail block's payload if
the computed length ends inside a block, then one payload per full block (each a verified
block payload of its own, in block order). Full blocks are also named by their chained
hashes, which the importer recomputes from the tokens and its own extra keys: a sequence
from another model, or with another cache salt, is refused before any state changes.

What travels, and why it suffices for the importer to continue exactly:
- tokens so far (prompt, outputs) and the computed length: positions and the block chain;
- blocks and slot: the compressed cache below the computed length and the window state at it;
- sampler state: the parameters and the seed; each token's randomness is keyed by (seed,
  output index), so nothing else of the sampler is needed;
- grammar state: the constraint's source; the importer compiles it and replays the outputs
  through the matcher, which lands in the same state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.sampling.params import SamplingParams, StructuredOutput

HANDOFF_VERSION = 1
MAX_REQUEST_ID_CHARS = 256


@dataclass(frozen=True)
class SequenceState:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    num_computed: int  # tokens in the caches; the rest of the tokens are computed by the importer
    params: SamplingParams
    seed: int
    stop_token_ids: tuple[int, ...]
    priority: int
    traffic_class: str
    num_cached_tokens: int  # prompt tokens its first engine served from a cache
    replay_until: int
    window_from: int
    block_hashes: tuple[bytes, ...]  # full blocks below num_computed
    has_tail: bool
    # After a bounded replay: positions from here on are approximate; the importer publishes
    # none of the blocks past it (None: the state is exact).
    approximate_from: int | None = None
    bounded_replays: int = 0
    # The prompt's images as (offset, length, key): their keys are in the block hashes; their
    # embedding rows travel as the payload's last sections, one per image, in this order
    images: tuple[tuple[int, int, str], ...] = ()

    def to_meta(self) -> dict[str, Any]:
        params = dataclasses.asdict(self.params)
        return {
            "handoff_version": HANDOFF_VERSION,
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "output_token_ids": list(self.output_token_ids),
            "num_computed": self.num_computed,
            "params": params,
            "seed": self.seed,
            "stop_token_ids": list(self.stop_token_ids),
            "priority": self.priority,
            "traffic_class": self.traffic_class,
            "num_cached_tokens": self.num_cached_tokens,
            "replay_until": self.replay_until,
            "window_from": self.window_from,
            "block_hashes": [h.hex() for h in self.block_hashes],
            "has_tail": self.has_tail,
            "approximate_from": self.approximate_from,
            "bounded_replays": self.bounded_replays,
            "images": [list(i) for i in self.images],
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any], block_size: int, vocab_size: int) -> SequenceState:
        """Parse and check metadata; raises ValueError naming the first inconsistency."""
        if meta.get("handoff_version") != HANDOFF_VERSION:
            raise ValueError(
                f"sequence handoff version {meta.get('handoff_version')!r}, this engine reads {HANDOFF_VERSION}"
            )
        try:
            st = cls._build(meta)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"sequence metadata is malformed: {exc!r}") from None
        st._check(block_size, vocab_size)
        return st

    @classmethod
    def _build(cls, meta: dict[str, Any]) -> SequenceState:
        p = dict(meta["params"])
        if p.get("structured") is not None:
            p["structured"] = StructuredOutput(**p["structured"])
        p["stop"] = tuple(p.get("stop", ()))
        p["stop_token_ids"] = tuple(p.get("stop_token_ids", ()))
        return cls(
            request_id=str(meta["request_id"]),
            prompt_token_ids=tuple(int(t) for t in meta["prompt_token_ids"]),
            output_token_ids=tuple(int(t) for t in meta["output_token_ids"]),
            num_computed=int(meta["num_computed"]),
            params=SamplingParams(**p),
            seed=int(meta["seed"]),
            stop_token_ids=tuple(int(t) for t in meta["stop_token_ids"]),
            priority=int(meta["priority"]),
            traffic_class=str(meta["traffic_class"]),
            num_cached_tokens=int(meta["num_cached_tokens"]),
            replay_until=int(meta["replay_until"]),
            window_from=int(meta["window_from"]),
            block_hashes=tuple(bytes.fromhex(h) for h in meta["block_hashes"]),
            has_tail=bool(meta["has_tail"]),
            approximate_from=None if meta.get("approximate_from") is None else int(meta["approximate_from"]),
            bounded_replays=int(meta.get("bounded_replays", 0)),
            images=tuple((int(o), int(n), str(k)) for o, n, k in meta.get("images", ())),
        )

    def _check(self, block_size: int, vocab_size: int) -> None:
        if not 0 < len(self.request_id) <= MAX_REQUEST_ID_CHARS:
            raise ValueError(f"request id must have 1 to {MAX_REQUEST_ID_CHARS} characters")
        tokens = self.prompt_token_ids + self.output_token_ids
        if not self.prompt_token_ids or any(not 0 <= t < vocab_size for t in tokens):
            raise ValueError(f"tokens must be non-empty and within [0, {vocab_size})")
        # At least the last token is left to compute (a sequence with nothing to compute never
        # steps again), and the replay markers lie within the computed length.
        if not 0 < self.num_computed < len(tokens):
            raise ValueError(f"num_computed {self.num_computed} outside (0, {len(tokens)})")
        for name in ("replay_until", "window_from"):
            if not 0 <= getattr(self, name) <= self.num_computed:
                raise ValueError(
                    f"{name} {getattr(self, name)} outside [0, num_computed {self.num_computed}]"
                )
        if self.approximate_from is not None and not 0 <= self.approximate_from <= self.num_computed:
            raise ValueError(
                f"approximate_from {self.approximate_from} outside [0, num_computed {self.num_computed}]"
            )
        if self.bounded_replays < 0:
            raise ValueError(f"bounded_replays must be >= 0, got {self.bounded_replays}")
        end = 0
        for offset, length, _ in self.images:
            if offset < end or length < 1 or offset + length > len(self.prompt_token_ids):
                raise ValueError(
                    f"image span [{offset}, {offset + length}) out of order or outside the prompt"
                )
            end = offset + length
        if len(self.output_token_ids) >= self.params.max_tokens:
            raise ValueError("the sequence has already produced max_tokens tokens")
        if len(self.block_hashes) != self.num_computed // block_size:
            raise ValueError(
                f"{len(self.block_hashes)} block hashes for {self.num_computed} computed tokens "
                f"(blocks of {block_size})"
            )
        if self.has_tail != bool(self.num_computed % block_size):
            raise ValueError("the tail block flag disagrees with the computed length")
        if any(len(h) != 32 for h in self.block_hashes):
            raise ValueError("block hashes must be 32 bytes")
