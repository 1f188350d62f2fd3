"""What the executor keeps per live request (`SamplingState`) and per launched step
(`Launched`), and the device-to-host copies a step's finish reads (`ToHost`) (torch)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.sampling.params import SamplingParams
from engine.sampling.sampler import no_penalties, plain_greedy
from engine.scheduler.output import SchedulerOutput
from engine.structured.matcher import GrammarState


@dataclass
class SamplingState:
    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    stop_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    grammar: GrammarState | None = None

    @property
    def done(self) -> bool:
        """Its last sampled token stops it: a step already in flight samples nothing more."""
        return bool(self.output_token_ids) and self.output_token_ids[-1] in self.stop_token_ids

    # params and grammar never change for a request: classify it once, not once per step
    @functools.cached_property
    def takes_argmax(self) -> bool:
        """Plain greedy without a grammar: its token is the row's argmax."""
        return self.grammar is None and plain_greedy(self.params)

    @functools.cached_property
    def drawn_together(self) -> bool:
        """Sampled with neither a grammar nor penalties: drawn in one `sample_rows` over the
        step's such rows."""
        return self.grammar is None and not self.params.greedy and no_penalties(self.params)

    @functools.cached_property
    def host_dependent(self) -> bool:
        """A grammar or penalties: its token needs a mask or a history the host knows only once
        the previous token is sampled (`draw_masked`)."""
        return not self.takes_argmax and not self.drawn_together


@dataclass
class Launched:
    """A step whose forward pass is queued on the device (`ModelExecutor.launch`), not yet
    sampled (`ModelExecutor.finish`)."""

    out: SchedulerOutput
    result: Any  # the runner's output: logits [rows, V] (device), hidden states
    staged: Any  # verification: the ring rows to put back for rejected drafts, or None
    sampled: set[str] = field(default_factory=set)  # request ids this step samples
    top: ToHost | None = None  # every row's argmax (the tokens of plain greedy rows)
    drawn: ToHost | None = None  # the rows drawn together (`SamplingState.drawn_together`) ...
    drawn_keys: list[tuple[str, int]] = field(default_factory=list)  # ... for these (request, output index)
    # request id -> index in ``next`` of its token (plain greedy or drawn together, no drafts):
    # the next step's input token, which that step reads on the device
    feeds: dict[str, int] = field(default_factory=dict)
    next: torch.Tensor | None = None  # top's tokens, then drawn's, on the device
    host_rows: tuple[list[int], ToHost] | None = None  # the logits rows read on the host
    forget: list[str] = field(default_factory=list)  # states to drop once sampled (finished requests)
    # host-dependent rows (`SamplingState.host_dependent`): (request id, output index, logits
    # row), their tokens at ``pending_at + i`` in ``next``, sampled by `_complete` once the
    # host knows their previous token: ``completed`` then, ``masked`` their tokens
    pending: list[tuple[str, int, int]] = field(default_factory=list)
    pending_at: int = 0
    completed: bool = True
    masked: tuple[list[tuple[str, int]], ToHost] | None = None
    then: Launched | None = None  # launched while this step was in flight: completed by its finish


class ToHost:
    """A device tensor whose copy to the host starts at once (no wait); read it with
    `tolist` / `tensor`, which wait for this copy only, not for a step launched after it."""

    def __init__(self, dev: torch.Tensor) -> None:
        self.dev = dev
        self.event: Any = None
        if dev.is_cuda:
            self.host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
            self.host.copy_(dev, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = dev

    def tensor(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host

    def tolist(self) -> list[Any]:
        return self.tensor().tolist()
