"""Runner glue: ``SchedulerOutput -> ForwardBatch -> logits -> sampler -> RunnerOutput`` (torch).

The executor owns each live request's sampling state (params, seed, token history, grammar)
so that it can run on the device thread while the scheduler prepares the next step: it
never reads the scheduler's mutable ``Request`` objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import RowInput, TokenLogprobs, sample_row
from engine.scheduler.output import PENDING_TOKEN, RunnerOutput, SchedulerOutput
from engine.structured.matcher import GrammarState


class LogitsRunner(Protocol):
    """What the executor needs of Engine I's ``ModelRunner``."""

    def execute(self, batch: ForwardBatch):  # -> object with .logits [num_sampled, vocab] fp32
        ...


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


class ModelExecutor:
    def __init__(self, runner: LogitsRunner, device: str = "cpu") -> None:
        self.runner = runner
        self.device = device
        self.states: dict[str, SamplingState] = {}

    def add(self, request_id: str, state: SamplingState) -> None:
        self.states[request_id] = state

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for rid in out.finished_ids:
            self.states.pop(rid, None)
        seqs = []
        for s in out.seqs:
            tokens = [self._resolve(s.request_id, t) for t in s.token_ids]
            seqs.append(
                SequenceInput(
                    tokens,
                    s.start_pos,
                    s.swa_slot,
                    list(s.block_table),
                    s.sample,
                    rows_cached_until=s.replay_until,
                    window_from=s.window_from,
                )
            )
        logits = self.runner.execute(ForwardBatch.from_sequences(seqs, device=self.device)).logits  # [R, V]
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs | None] = {}
        row = 0
        for s in out.seqs:
            if not s.sample:
                continue
            st = self.states[s.request_id]
            if st.done:  # stopped in the previous step; the scheduler drops this result
                sampled[s.request_id] = st.output_token_ids[-1]
                row += 1
                continue
            if s.output_index != len(st.output_token_ids):
                raise RuntimeError(
                    f"{s.request_id}: sampling output {s.output_index}, have {len(st.output_token_ids)}"
                )
            mask = st.grammar.allowed_mask() if st.grammar is not None else None
            res = sample_row(
                logits[row],
                RowInput(st.params, st.seed, s.output_index, st.prompt_token_ids, st.output_token_ids, mask),
            )
            row += 1
            if st.grammar is not None and not st.grammar.is_finished:
                st.grammar.accept(res.token_id)
            st.output_token_ids.append(res.token_id)
            sampled[s.request_id] = res.token_id
            logprobs[s.request_id] = res.logprobs
        return RunnerOutput(out.step, sampled, dict(logprobs))

    def _resolve(self, request_id: str, token: int) -> int:
        if token != PENDING_TOKEN:
            return token
        return self.states[request_id].output_token_ids[-1]
