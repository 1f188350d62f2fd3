"""Runner glue: ``SchedulerOutput -> ForwardBatch -> logits -> sampler -> RunnerOutput`` (torch).

The executor owns each live request's sampling state (params, seed, token history, grammar)
so that it can run on the device thread while the scheduler prepares the next step: it
never reads the scheduler's mutable ``Request`` objects.

**Speculation** (with a `Drafter`): a sequence's drafts are verified by sampling the target
at each position in order, exactly as plain decoding would, so a seed gives the same tokens
with and without speculation; ring rows of rejected positions are put back, and the MTP
layer drafts the next step's tokens (`engine.spec.speculation`).

**Where tokens are sampled.** On the device, from the logits, with nothing read back at
launch: plain greedy rows take the row's argmax; rows drawn together (no grammar, no
penalties) one `draw_rows`; rows with a grammar mask or penalties (`host_dependent`) one
`draw_masked`, whose mask and token history the host knows only once the previous token is
sampled. So those are sampled when the previous step *finishes*: at launch when no step is
in flight before this one, else in that step's `finish`, right after its tokens are applied
(``Launched.then``). Every kind of row therefore feeds the next step's input token on the
device, and pipelined steps need not wait for grammars or penalties. Verified drafts are
sampled on the host, in order (each position's mask follows the previous draft).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from engine.forward_batch import ForwardBatch, SequenceInput, long_tensor, upload
from engine.sampling.penalties import PenaltyRows
from engine.sampling.sampler import (
    RowInput,
    TokenLogprobs,
    draw_masked,
    draw_rows,
    no_penalties,
    sample_row,
    token_logprobs,
)
from engine.scheduler.host_slots import HostSlot
from engine.scheduler.output import PENDING_TOKEN, RunnerOutput, SchedulerOutput, SlotSave
from engine.spec.drafter import Drafter
from engine.spec.speculation import Speculation
from engine.step_rows import draws, pick, rows_needed
from engine.step_state import Launched, SamplingState, ToHost
from engine.structured.grammar import GrammarError
from engine.structured.matcher import GrammarState

# a step's token and logprobs per request, and the tokens (with their logprobs) of each that
# emitted more than one (verified drafts): `RunnerOutput`'s
_Sampled = tuple[
    dict[str, int], dict[str, TokenLogprobs | None], dict[str, tuple[int, ...]], dict[str, tuple[object, ...]]
]


class LogitsRunner(Protocol):
    """What the executor needs of Engine I's ``ModelRunner``: ``execute`` returns an object
    with ``.logits [num_sampled, vocab]`` fp32; ``pool.copy_block`` and ``copy_slot`` copy a
    compressed block and an SWA slot (for n > 1 forks)."""

    pool: Any
    swa: Any
    model_cfg: Any

    def execute(self, batch: ForwardBatch) -> Any: ...

    def copy_slot(self, src: int, dst: int) -> None: ...


class ModelExecutor:
    """Launches and finishes steps on one runner; owns the live requests' sampling states,
    shared with its `Speculation` (verification and drafting)."""

    def __init__(
        self,
        runner: LogitsRunner,
        device: str = "cpu",
        kv: Any = None,
        host_slots: Any = None,
        drafter: Drafter | None = None,
        num_drafts: int = 0,
    ) -> None:
        self.runner = runner
        self.device = device
        self.kv = kv  # engine.kvconnector.worker.KVWorker: loads and write-through snapshots
        self.host_slots = host_slots  # engine.scheduler.host_slots.HostSlotPool: ended turns' slots
        self.states: dict[str, SamplingState] = {}
        self._failed: dict[str, str] = {}  # request id -> why its grammar failed
        # verification and drafting read these two dicts: never rebound
        self.speculation = Speculation(drafter, num_drafts, self.states, self._failed)
        self._drawn: dict[tuple[str, int], int] = {}  # this step's tokens drawn together
        self.fed_tokens = 0  # input tokens read from the previous step's device tokens (pipelined)
        self.penalties: PenaltyRows | None = None  # penalised requests' histories on the device

    @property
    def drafter(self) -> Drafter | None:
        """The MTP drafter (speculation), or None."""
        return self.speculation.drafter

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
        if self.penalties is not None:
            self.penalties.drop(request_id)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step: its forward pass, then its sampling."""
        return self.finish(self.launch(out))

    def follows(self, out: SchedulerOutput, prev: Launched) -> bool:
        """Whether ``out`` can be launched while ``prev`` (launched, not finished) is on the
        device: each input token ``prev`` samples is on the device (an argmax or a draw,
        `Launched.feeds`), and no draft is verified (speculation reads the host)."""
        if any(s.num_drafts for s in out.seqs) or not prev.completed:
            return False
        return all(
            s.request_id in prev.feeds
            for s in out.seqs
            if s.request_id in prev.sampled and PENDING_TOKEN in s.token_ids
        )

    def launch(self, out: SchedulerOutput, prev: Launched | None = None) -> Launched:
        """Queue ``out``'s forward pass on the device and return without reading any result.
        ``prev``: the step launched before it and not finished yet (`follows` must hold); the
        input tokens it samples are read on the device. On CUDA nothing here waits for
        the device, so the host can finish ``prev`` while this step runs."""
        self._before(out, prev)
        if self.speculation.lockstep is not None:  # an EP rank: its group's MTP passes this step
            self.speculation.lockstep.agree(self.speculation.pass_bound(out))
        seqs, fed_at, fed_rows = self._inputs(out, prev)
        staged = self.speculation.stage(self.runner, out)
        batch = ForwardBatch.from_sequences(seqs, device=self.device)
        if fed_at:
            assert prev is not None and prev.next is not None
            index = upload(long_tensor(fed_at + fed_rows), prev.next.device)
            batch = dataclasses.replace(
                batch, fed=(index[: len(fed_at)], prev.next[index[len(fed_at) :]]), fed_cpu=tuple(fed_at)
            )
            self.fed_tokens += len(fed_at)
        launched = Launched(out, self.runner.execute(batch), staged)
        self._sample_on_device(launched)
        if launched.pending:
            if prev is None:
                self._complete(launched)
            else:
                prev.then = launched
        return launched

    def _sample_on_device(self, launched: Launched) -> None:
        """Queue the step's device sampling: every row's argmax (in one op: a plain greedy
        request's token; argmax is exact and row by row, lowest id on ties) and the rows drawn
        together; reserve the host-dependent rows' slots (sampled by `_complete`); note which
        requests' tokens the next step can read there."""
        out, logits = launched.out, launched.result.logits  # [rows, V]: num_drafts + 1 per sequence
        greedy: dict[str, int] = {}
        row = 0
        for s in out.seqs:
            if not s.sample:
                continue
            for rid in (s.request_id, *s.fork_children):  # fork children share the parent's row
                launched.sampled.add(rid)
                st = self.states.get(rid)
                if st is not None and st.takes_argmax:
                    greedy[rid] = -1 if s.num_drafts or st.done else row
                elif st is not None and st.host_dependent and not (s.num_drafts or st.done):
                    launched.pending.append((rid, s.output_index, row))  # drafts: verified on the host
            row += s.num_drafts + 1
        parts = []
        if greedy and logits.shape[0]:
            launched.top = ToHost(logits.argmax(-1))
            parts.append(launched.top.dev)
            launched.feeds.update((rid, r) for rid, r in greedy.items() if r >= 0)
        keys, rows, params, seeds = draws(out, self.states)
        if rows:
            launched.drawn = ToHost(draw_rows(pick(logits, rows), params, seeds))
            launched.drawn_keys = keys
            base = logits.shape[0] if parts else 0
            parts.append(launched.drawn.dev)
            drafting = {s.request_id for s in out.seqs if s.num_drafts}
            launched.feeds.update((rid, base + i) for i, (rid, _) in enumerate(keys) if rid not in drafting)
        if launched.pending:  # their slots in ``next``, written by `_complete`
            launched.pending_at = sum(p.shape[0] for p in parts)
            launched.completed = False
            parts.append(torch.zeros(len(launched.pending), dtype=torch.long, device=logits.device))
            launched.feeds.update(
                (rid, launched.pending_at + i) for i, (rid, _, _) in enumerate(launched.pending)
            )
        if parts:
            launched.next = parts[0] if len(parts) == 1 else torch.cat(parts)
        need = rows_needed(out, self.states)
        if need:  # one transfer (a copy per row would wait for the device once per row)
            launched.host_rows = (need, ToHost(pick(logits, need)))

    def _before(self, out: SchedulerOutput, prev: Launched | None) -> None:
        """The step's work before its forward pass: slot saves, finished requests, copies, loads."""
        if out.slot_saves:  # first: a retained slot this step reuses still holds its turn's state
            self.save_slots(out.slot_saves)
        for rid in out.finished_ids:
            if prev is not None and rid in prev.sampled:  # prev's sampling still reads its state
                prev.forget.append(rid)
            else:
                self._forget(rid)
        for src, dst in out.block_copies:  # forks made by the previous step
            self.runner.pool.copy_block(src, dst)
        for src, dst in out.slot_copies:
            self.runner.copy_slot(src, dst)
        for block, payload in out.kv_loads:  # verified when queued; checked again on write
            self.kv.load_block(self.runner.pool, block, payload)
        for slot, payload in out.slot_loads:
            self.kv.load_slot(self.runner.swa, slot, payload)

    def _inputs(
        self, out: SchedulerOutput, prev: Launched | None
    ) -> tuple[list[SequenceInput], list[int], list[int]]:
        """The step's sequences, and the flat token indices whose ids are ``prev``'s device
        tokens (with their index in ``prev.next``): such a pending token is a placeholder 0."""
        seqs = []
        fed_at: list[int] = []
        fed_rows: list[int] = []
        flat = 0
        for s in out.seqs:
            tokens = list(s.token_ids)
            for j, t in enumerate(tokens):
                if t != PENDING_TOKEN:
                    continue
                if prev is not None and s.request_id in prev.feeds:
                    fed_at.append(flat + j)
                    fed_rows.append(prev.feeds[s.request_id])
                    tokens[j] = 0  # the runner writes the device id over it
                else:
                    tokens[j] = self._resolve(s.request_id, t)
            flat += len(tokens)
            seqs.append(
                SequenceInput(
                    tokens,
                    s.start_pos,
                    s.swa_slot,
                    s.block_table,
                    s.sample,
                    rows_cached_until=s.replay_until,
                    window_from=s.window_from,
                    swa_keep=s.swa_keep,
                    embeds=s.embeds,
                    num_logits=s.num_drafts + 1,
                )
            )
        return seqs, fed_at, fed_rows

    def _complete(self, launched: Launched) -> None:
        """Queue the sampling of ``launched``'s host-dependent rows, now that every earlier
        token of theirs is applied: the grammar's mask, the penalties' history; their tokens go
        into ``launched.next`` (the next step's input) and start their copy to the host. A
        request stopped meanwhile is skipped; one whose grammar failed (or allows nothing) is
        sampled without a mask and reported failed, as the host sampler always did."""
        launched.completed = True
        keys: list[tuple[str, int]] = []
        rows: list[int] = []
        slots: list[int] = []
        inputs: list[RowInput] = []
        for i, (rid, index, row) in enumerate(launched.pending):
            st = self.states.get(rid)
            if st is None or st.done:
                continue
            if index != len(st.output_token_ids):
                raise RuntimeError(f"{rid}: sampling output {index}, have {len(st.output_token_ids)}")
            mask = self._grammar_step(rid, lambda g: g.allowed_mask())
            if mask is not None and not bool(mask.any()):
                self._failed[rid] = "the grammar allows no token at this point"
                mask = None
            keys.append((rid, index))
            rows.append(row)
            slots.append(launched.pending_at + i)
            inputs.append(RowInput(st.params, st.seed, index, st.prompt_token_ids, st.output_token_ids, mask))
        if not rows:
            return
        logits = pick(launched.result.logits, rows)
        penalised = [key[0] if not no_penalties(row.params) else None for key, row in zip(keys, inputs)]
        book = None
        if any(penalised):
            if self.penalties is None:
                self.penalties = PenaltyRows(logits.shape[1], logits.device)
            book = self.penalties
        tokens = draw_masked(logits, inputs, book.gather(penalised, inputs) if book is not None else None)
        if book is not None:
            book.record(penalised, tokens)
        assert launched.next is not None
        launched.next.index_copy_(0, upload(long_tensor(slots), tokens.device), tokens)
        launched.masked = (keys, ToHost(tokens))

    def holds(self, launched: Launched) -> bool:
        """Whether ``launched`` may stay unfinished while the next step launches: nothing of it
        is read on the host after the next step could overwrite it (no store snapshot of its
        blocks, no drafts from its hidden states, no verified ring rows to put back)."""
        out = launched.out
        return not (out.kv_saves or launched.staged is not None or self.draft_depth(out))

    def draft_depth(self, out: SchedulerOutput) -> int:
        """Drafts the MTP layer proposes after ``out`` (`Speculation.draft_depth`)."""
        return self.speculation.draft_depth(out)

    def finish(self, launched: Launched) -> RunnerOutput:
        """Sample a launched step (waiting for its device work) and return its result; then
        queue the sampling of the step launched after it (`_complete`)."""
        if not launched.completed:  # its predecessor never finished (it raised)
            self._complete(launched)
        out, result, staged = launched.out, launched.result, launched.staged
        if out.kv_saves and self.kv is not None:
            self.kv.save(self.runner.pool, out.kv_saves)
        top, host = self._read_results(launched)
        sampled, logprobs, emitted, emitted_lps = self._sample_seqs(out, top, host)
        depth = self.draft_depth(out)
        drafts = self.speculation.draft(out, result.hidden, sampled, emitted, depth) if depth else {}
        if staged is not None:  # undo the rows of every position past the accepted ones: the
            # main layers' rings, which the drafting chain (the MTP layer's window) never
            # reads, so the chain is queued first and the device runs it while these launch
            self.speculation.undo_rejected(staged, out, emitted)
        if self.speculation.lockstep is not None:
            self.speculation.lockstep.pad()
        failed = {rid: self._failed[rid] for rid in sampled if rid in self._failed}
        self._hand_over(launched)
        return RunnerOutput(out.step, sampled, dict(logprobs), failed, emitted, emitted_lps, drafts)

    def _read_results(self, launched: Launched) -> tuple[list[int], dict[int, Any]]:
        """Read the step's copies to the host (each waits for its own copy only): every row's
        argmax and the logits rows read on the host (by row), returned, and the tokens drawn
        on the device, kept in ``self._drawn`` for `_sample`."""
        top: list[int] = (
            launched.top.tolist() if launched.top is not None else [-1] * launched.result.logits.shape[0]
        )
        # the rows a sampler reads on the host (`needs_row`); the others are never read, so no
        # per-row view of the device logits is made (~3 us each, 256 a step at batch 256)
        host = (
            {}
            if launched.host_rows is None
            else dict(zip(launched.host_rows[0], launched.host_rows[1].tensor()))
        )
        self._drawn = (
            dict(zip(launched.drawn_keys, launched.drawn.tolist())) if launched.drawn is not None else {}
        )
        if launched.masked is not None:
            self._drawn.update(zip(launched.masked[0], launched.masked[1].tolist()))
        return top, host

    def _sample_seqs(self, out: SchedulerOutput, top: list[int], host: dict[int, Any]) -> _Sampled:
        """Each sampling sequence's token and logprobs, in order, and where it verified drafts,
        every token it emits (with their logprobs) when that is more than one."""
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs | None] = {}
        emitted: dict[str, tuple[int, ...]] = {}
        emitted_lps: dict[str, tuple[object, ...]] = {}
        row = 0
        for s in out.seqs:
            if not s.sample:
                continue
            if s.num_drafts:
                rows = [host.get(r) for r in range(row, row + s.num_drafts + 1)]
                toks, lps = self.speculation.verify(s, rows, top[row : row + s.num_drafts + 1], self._sample)
                sampled[s.request_id], logprobs[s.request_id] = toks[0], lps[0]
                if len(toks) > 1:
                    emitted[s.request_id], emitted_lps[s.request_id] = tuple(toks), tuple(lps)
                row += s.num_drafts + 1
                continue
            for rid in (s.request_id, *s.fork_children):  # fork children share the parent's row
                tok, lp = self._sample(rid, host.get(row), s.output_index, top[row])
                sampled[rid] = tok
                logprobs[rid] = lp
            row += 1
        return sampled, logprobs, emitted, emitted_lps

    def _hand_over(self, launched: Launched) -> None:
        """Once the step is sampled: drop the states of requests finished while it was on the
        device, and queue the sampling of the step launched after it."""
        for rid in launched.forget:  # finished while this step was on the device
            self._forget(rid)
        if launched.then is not None:  # every token of this step is applied: sample the next
            then, launched.then = launched.then, None
            self._complete(then)

    def _forget(self, rid: str) -> None:
        if self.penalties is not None:
            self.penalties.drop(rid)
        self.states.pop(rid, None)
        self._failed.pop(rid, None)
        self.speculation.forget(rid)

    def _resolve(self, request_id: str, token: int) -> int:
        if token != PENDING_TOKEN:
            return token
        return self.states[request_id].output_token_ids[-1]

    def _sample(self, rid: str, row_logits, output_index: int, top: int) -> tuple[int, TokenLogprobs | None]:
        """``top``: the row's argmax, the token of a plain greedy request (no grammar, no
        penalties), which then never copies its row to the host unless it asks for logprobs.
        ``row_logits``: the row on the host where `needs_row` asked for it, else None (unread)."""
        st = self.states[rid]
        if st.done:  # stopped in the previous step; the scheduler drops this result
            return st.output_token_ids[-1], None
        if output_index != len(st.output_token_ids):
            raise RuntimeError(f"{rid}: sampling output {output_index}, have {len(st.output_token_ids)}")
        drawn = self._drawn.get((rid, output_index))
        lps: TokenLogprobs | None = None
        if drawn is not None or st.takes_argmax:  # sampled on the device
            token = top if drawn is None else drawn
            if st.params.logprobs is not None:
                lps = token_logprobs(row_logits, token, st.params.logprobs)
        else:  # a verified draft of a grammar or penalised request: on the host, in order
            mask = self._grammar_step(rid, lambda g: g.allowed_mask())
            row = RowInput(st.params, st.seed, output_index, st.prompt_token_ids, st.output_token_ids, mask)
            res = sample_row(row_logits, row)
            token, lps = res.token_id, res.logprobs
        if st.grammar is not None and not st.grammar.is_finished:
            self._grammar_step(rid, lambda g: g.accept(token))
        st.output_token_ids.append(token)
        return token, lps

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
