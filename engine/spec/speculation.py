"""The executor's speculative side (`engine.executor.ModelExecutor` with a `Drafter`) (torch).

A sequence scheduled with ``num_drafts = k`` brings its input token and ``k`` drafts. The
target is sampled at each of the ``k + 1`` positions in order, exactly as plain decoding
would sample them (same logits row, same per-request ``(seed, output index)`` noise, same
penalties and grammar state), and the drafts are kept up to the first one that differs from
the target's token, which is emitted in its place (`Speculation.verify`). A seed therefore
gives the same tokens with and without speculation, and each emitted token follows the
target's distribution. Ring rows the rejected positions overwrote are put back
(`SWASlots.stage`: `Speculation.stage`, `Speculation.undo_rejected`), so the slot is exactly
the state of the accepted tokens. Then the MTP layer drafts the next step's tokens
(`Speculation.draft`, `engine.spec.drafter`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from engine.sampling.sampler import TokenLogprobs
from engine.scheduler.output import PENDING_TOKEN, DraftProposal, ScheduledSeq, SchedulerOutput
from engine.spec.drafter import Drafter, DraftRun, PendingDrafts
from engine.step_state import SamplingState
from engine.structured.grammar import GrammarError

if TYPE_CHECKING:
    from engine.distributed.lockstep import DraftLockstep
    from engine.executor import LogitsRunner

# the executor's host sampler (`ModelExecutor._sample`): (request id, logits row on the host or
# None, output index, the row's argmax) -> (token, logprobs)
SampleFn = Callable[[str, Any, int, int], tuple[int, TokenLogprobs | None]]


class Speculation:
    """What the executor does for speculative decoding: stage the ring rows a step's drafts
    overwrite and put back those of rejected positions, verify each sequence's drafts, and
    draft the next step's tokens with the MTP layer, keeping each request's MTP window.

    ``states`` and ``failed`` are the executor's own per-request sampling states and failed
    grammars (the same dicts): this class only reads them; the executor's sampler, which
    `verify` calls, writes them."""

    def __init__(
        self,
        drafter: Drafter | None,
        num_drafts: int,
        states: dict[str, SamplingState],
        failed: dict[str, str],
    ) -> None:
        self.drafter = drafter  # proposes num_drafts tokens per sequence per step
        self.num_drafts = num_drafts
        self.states = states
        self._failed = failed  # request id -> why its grammar failed
        # per request: (first position whose MTP window entry is valid, next position to write)
        self._mtp: dict[str, tuple[int, int]] = {}
        # an EP rank's: its MTP passes matched with its group's (`engine.distributed.lockstep`)
        self.lockstep: DraftLockstep | None = None

    def forget(self, rid: str) -> None:
        """Drop a finished request's MTP window record."""
        self._mtp.pop(rid, None)

    def draft_depth(self, out: SchedulerOutput) -> int:
        """Drafts the MTP layer proposes after ``out`` (0: none, its hidden states are not read;
        speculation that does not pay drafts nothing and keeps steps pipelined)."""
        if self.drafter is None:
            return 0
        return out.draft_depth if out.draft_depth >= 0 else self.num_drafts

    def pass_bound(self, out: SchedulerOutput) -> int:
        """The most MTP-layer passes `draft` runs after ``out``: one per draft of the deepest
        chain, none when it drafts nothing; with drafting graphs, a prompt's run beside
        decodes drafts as a second chain (`Drafter.draft`)."""
        depth = self.draft_depth(out)
        if depth == 0 or self.drafter is None:
            return 0
        return depth * (2 if self.drafter.graphs is not None else 1)

    @staticmethod
    def stage(runner: LogitsRunner, out: SchedulerOutput) -> Any:
        """Before ``out``'s forward pass: save the ring rows its drafts' positions will
        overwrite (`SWASlots.stage`), for `undo_rejected`; None when it verifies no draft."""
        verifying = [s for s in out.seqs if s.num_drafts]
        return (
            runner.swa.stage(
                range(runner.model_cfg.num_hidden_layers),  # the MTP layer's window: drafter
                [s.swa_slot for s in verifying for _ in range(s.num_drafts)],
                [s.start_pos + j for s in verifying for j in range(1, s.num_drafts + 1)],
            )
            if verifying
            else None
        )

    @staticmethod
    def undo_rejected(staged: Any, out: SchedulerOutput, emitted: dict[str, tuple[int, ...]]) -> None:
        """Put back the staged rows (`stage`) of every position past the accepted ones
        (``emitted``: the tokens of each sequence that accepted a draft)."""
        verifying = [s for s in out.seqs if s.num_drafts]
        rejected = [
            s.start_pos + j >= s.start_pos + len(emitted.get(s.request_id, (0,)))
            for s in verifying
            for j in range(1, s.num_drafts + 1)
        ]
        staged.undo(rejected)

    def verify(
        self, s: ScheduledSeq, rows: Any, top: list[int], sample: SampleFn
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Sample the target at the input token and each draft, in order (``sample``: the
        executor's host sampler); stop after the first token that differs from the next draft
        (or that ends the request)."""
        rid, k = s.request_id, s.num_drafts
        st = self.states[rid]
        drafts = s.token_ids[-k:]
        toks: list[int] = []
        lps: list[TokenLogprobs | None] = []
        for j in range(k + 1):
            tok, lp = sample(rid, rows[j], s.output_index + j, top[j])
            toks.append(tok)
            lps.append(lp)
            ended = st.done or rid in self._failed or len(st.output_token_ids) >= st.params.max_tokens
            if ended or j == k or tok != drafts[j]:
                break
        return toks, lps

    def draft(
        self,
        out: SchedulerOutput,
        hidden: Any,
        sampled: dict[str, int],
        emitted: dict[str, tuple[int, ...]],
        depth: int,
    ) -> NextDrafts:
        """Pass-1 runs of every sequence whose next tokens are known, then chained drafts for
        those that continue (`engine.spec.drafter`); read from the device when first looked
        at (`NextDrafts`)."""
        assert self.drafter is not None
        runs: list[DraftRun] = []
        flat = 0
        for s in out.seqs:
            rid, n0, q = s.request_id, s.start_pos, s.num_new
            start_row = flat
            flat += q
            st = self.states.get(rid)
            if st is None or rid in self._failed:
                continue
            history = len(st.prompt_token_ids) + len(st.output_token_ids)
            if s.num_drafts:  # positions of the input token and each accepted draft
                next_ids = list(emitted.get(rid, (sampled[rid],)))
            elif s.sample:  # a decode or a prompt's last chunk: its inputs after the first,
                # then the token sampled at its last position. Only a decode's one input can
                # be pending (a request is admitted, or readmitted after a preemption, once
                # nothing it sampled is in flight: `Scheduler._admit_waiting`), and it is not
                # needed here
                assert PENDING_TOKEN not in s.token_ids[1:], f"{rid}: a pending input inside a chunk"
                next_ids = [*s.token_ids[1:], sampled[rid]]
            elif n0 + q < history:  # an earlier prefill chunk: its next tokens are all known
                next_ids = (st.prompt_token_ids + st.output_token_ids)[n0 + 1 : n0 + q + 1]
            else:
                continue
            continues = s.sample and not st.done and len(st.output_token_ids) < st.params.max_tokens
            end = n0 + len(next_ids)
            lo = max(n0, history - self.drafter.window)  # the MTP layer is window-only
            if lo >= end:
                continue
            valid_from, upto = self._mtp.get(rid, (lo, lo))
            if upto != lo:
                valid_from = lo  # not contiguous with what this slot's MTP window holds
            self._mtp[rid] = (valid_from, end)
            runs.append(
                DraftRun(
                    rid, s.swa_slot, s.block_table, lo, next_ids[lo - n0 :], start_row + (lo - n0),
                    valid_from, depth if continues else 0,
                )
            )  # fmt: skip
        return NextDrafts(self.drafter.draft(hidden, runs), self._grammar_prefix)

    def _grammar_prefix(self, rid: str, tokens: tuple[int, ...]) -> int:
        """How many leading drafts the request's grammar allows (all without a grammar; none
        for a request already dropped)."""
        st = self.states.get(rid)
        if st is None:
            return 0
        grammar = st.grammar
        if grammar is None or rid in self._failed:
            return len(tokens)
        try:
            return grammar.valid_prefix(tokens)
        except GrammarError:
            return 0


class NextDrafts(Mapping[str, DraftProposal]):
    """The drafts (tokens, confidences) each request proposes for its next step, cut at the
    first one its grammar refuses: a step's `RunnerOutput.drafts`. The drafting chain may
    still be on the device when the step returns; the first look reads it (waiting for its
    copy only), so the scheduler applies the step's tokens, and the engine hands out its
    outputs, while the chain runs (`Scheduler.update` looks at the drafts last)."""

    def __init__(self, pending: PendingDrafts, prefix: Callable[[str, tuple[int, ...]], int]) -> None:
        self._pending: PendingDrafts | None = pending
        self._prefix = prefix
        self._drafts: dict[str, DraftProposal] = {}

    def _read(self) -> dict[str, DraftProposal]:
        if self._pending is not None:
            for rid, d in self._pending.result().items():
                keep = self._prefix(rid, d.tokens)
                self._drafts[rid] = (d.tokens[:keep], d.confidence[:keep])
            self._pending = None
        return self._drafts

    def __getitem__(self, rid: str) -> DraftProposal:
        return self._read()[rid]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())
