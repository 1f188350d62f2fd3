"""The plain messages that cross the engine core's boundary (``engine/core.py``): a request
in, per-step outputs and counters out. No live scheduler or model object is among them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.sampling.params import SamplingParams
from engine.scheduler.request import ImageInput

__all__ = ["CoreRequest", "CoreStats", "ImageInput", "SeqOutput"]


@dataclass(frozen=True)
class CoreRequest:
    """One sequence to generate (``params.n == 1``; ``LLM`` expands n into forks)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 0
    traffic_class: str = "chat"  # the store TTL class of the blocks it writes
    fork_of: str | None = None  # share this request's prompt computation (n > 1)
    seed: int | None = None  # None: params.seed, else derived from the engine seed and the id
    swa_replay: str | None = None  # "exact" | "bounded" (a hit without its SWA state); None: default
    images: tuple[ImageInput, ...] = ()  # in prompt order, spans within the prompt, not overlapping


@dataclass(slots=True)
class SeqOutput:
    """What one step produced for one request. ``new_token_ids`` include a terminating stop
    token (``stop_token`` names it); ``finish_reason`` is set on the last message only. Read,
    never written, once built; not ``frozen`` for the reason `ScheduledSeq` is not (one a
    running request a step)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[Any, ...]  # one TokenLogprobs (or None) per new token
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_token: int | None
    error: str | None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens not computed (prefix cache, store, retained slot)
    output_tokens: int
    bounded_replay: bool = False  # its state came from a bounded replay: the output is approximate


@dataclass(frozen=True)
class CoreStats:
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    kv_tokens: int  # tokens in the caches of running sequences
    steps: int
    extra: dict[str, float]
