"""Runner glue: ``SchedulerOutput -> ForwardBatch -> logits -> sampler -> RunnerOutput`` (torch).

The executor owns each live request's sampling state (params, seed, token history, grammar)
so that it can run on the device thread while the scheduler prepares the next step: it
never reads the scheduler's mutable ``Request`` objects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import RowInput, TokenLogprobs, sample_row
from engine.scheduler.host_slots import HostSlot
from engine.scheduler.output import PENDING_TOKEN, RunnerOutput, SchedulerOutput, SlotSave
from engine.structured.grammar import GrammarError
from engine.structured.matcher import GrammarState


class LogitsRunner(Protocol):
    """What the executor needs of Engine I's ``ModelRunner``: ``execute`` returns an object
    with ``.logits [num_sampled, vocab]`` fp32; ``pool.copy_block`` and ``copy_slot`` copy a
    compressed block and an SWA slot (for n > 1 forks)."""

    pool: Any
    swa: Any

    def execute(self, batch: ForwardBatch) -> Any: ...

    def copy_slot(self, src: int, dst: int) -> None: ...


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
    def __init__(
        self, runner: LogitsRunner, device: str = "cpu", kv: Any = None, host_slots: Any = None
    ) -> None:
        self.runner = runner
        self.device = device
        self.kv = kv  # engine.kvconnector.worker.KVWorker: loads and write-through snapshots
        self.host_slots = host_slots  # engine.scheduler.host_slots.HostSlotPool: ended turns' slots
        self.states: dict[str, SamplingState] = {}
        self._failed: dict[str, str] = {}  # request id -> why its grammar failed

    def save_slots(self, saves: Sequence[SlotSave]) -> None:
        """Copy retained slots (and their partial blocks) into the host slot pool."""
        for save in saves:
            tail = (
                None
                if save.partial_block is None
                else self.kv.pack_block(self.runner.pool, save.partial_block)
            )
            slot = self.kv.pack_slot(
                self.runner.swa, save.slot, self.host_slots.format, self.host_slots.layers
            )
            self.host_slots.put(HostSlot(save.anchor, save.num_tokens, save.tail, slot, tail))

    def add(self, request_id: str, state: SamplingState) -> None:
        self.states[request_id] = state
        self._failed.pop(request_id, None)  # a reused id starts clean

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if out.slot_saves:  # first: a retained slot this step reuses still holds its turn's state
            self.save_slots(out.slot_saves)
        for rid in out.finished_ids:
            self.states.pop(rid, None)
            self._failed.pop(rid, None)
        for src, dst in out.block_copies:  # forks made by the previous step
            self.runner.pool.copy_block(src, dst)
        for src, dst in out.slot_copies:
            self.runner.copy_slot(src, dst)
        for block, payload in out.kv_loads:  # verified when queued; checked again on write
            self.kv.load_block(self.runner.pool, block, payload)
        for slot, payload in out.slot_loads:
            self.kv.load_slot(self.runner.swa, slot, payload)
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
                    swa_keep=s.swa_keep,
                    embeds=s.embeds,
                )
            )
        logits = self.runner.execute(ForwardBatch.from_sequences(seqs, device=self.device)).logits  # [R, V]
        if out.kv_saves and self.kv is not None:
            self.kv.save(self.runner.pool, out.kv_saves)
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs | None] = {}
        row = 0
        for s in out.seqs:
            if not s.sample:
                continue
            for rid in (s.request_id, *s.fork_children):  # fork children share the parent's row
                tok, lp = self._sample(rid, logits[row], s.output_index)
                sampled[rid] = tok
                logprobs[rid] = lp
            row += 1
        failed = {rid: self._failed[rid] for rid in sampled if rid in self._failed}
        return RunnerOutput(out.step, sampled, dict(logprobs), failed)

    def _resolve(self, request_id: str, token: int) -> int:
        if token != PENDING_TOKEN:
            return token
        return self.states[request_id].output_token_ids[-1]

    def _sample(self, rid: str, row_logits, output_index: int) -> tuple[int, TokenLogprobs | None]:
        st = self.states[rid]
        if st.done:  # stopped in the previous step; the scheduler drops this result
            return st.output_token_ids[-1], None
        if output_index != len(st.output_token_ids):
            raise RuntimeError(f"{rid}: sampling output {output_index}, have {len(st.output_token_ids)}")
        mask = self._grammar_step(rid, lambda g: g.allowed_mask())
        res = sample_row(
            row_logits,
            RowInput(st.params, st.seed, output_index, st.prompt_token_ids, st.output_token_ids, mask),
        )
        if st.grammar is not None and not st.grammar.is_finished:
            self._grammar_step(rid, lambda g: g.accept(res.token_id))
        st.output_token_ids.append(res.token_id)
        return res.token_id, res.logprobs

    def _grammar_step(self, rid: str, op: Callable[[GrammarState], Any]) -> Any:
        """Run a grammar operation; a GrammarError fails this request only (recorded in
        ``self._failed`` for the step's RunnerOutput), never the batch or the engine."""
        grammar = self.states[rid].grammar
        if grammar is None or rid in self._failed:
            return None
        try:
            return op(grammar)
        except GrammarError as exc:
            self._failed[rid] = str(exc)
            return None
