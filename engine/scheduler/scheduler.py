"""The scheduler: continuous batching of prefill chunks and decodes in one step (pure).

Each ``schedule()`` builds one step under a token budget and, with a cost model, a time
budget:
1. running sequences in priority order (lower ``priority`` first, then arrival): decodes
   take one token, unfinished prefills the largest chunk that fits (``chunking.py``); when
   the block pool runs dry the lowest-priority, latest-arrived running sequence is
   preempted by recompute (its blocks released, its slot retained) and requeued;
2. if nothing was preempted, waiting requests are admitted in priority order with their
   prefix-cache hit (``cache_manager.py``), as long as blocks, slots and budget last.

With speculation (``spec``), a decoding sequence that has drafts brings the ones the
policy picks (`engine.spec.policy`); it advances by one position at schedule time and by
its accepted drafts at ``update`` (speculation needs the synchronous loop).

``update()`` applies the runner's sampled tokens, finishes sequences on stop tokens or
``max_tokens``, and frees them. State advances optimistically at schedule time, so step
N+1 can be scheduled while step N runs (asynchronous scheduling): inputs not yet sampled
are sent as ``PENDING_TOKEN``.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from engine.scheduler.cache_manager import CacheManager, PrefixMatch
from engine.scheduler.chunking import largest_chunk, seq_cost
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.drafts import DraftsHandover
from engine.scheduler.host_slots import HostSlotPool
from engine.scheduler.output import PENDING_TOKEN, RunnerOutput, ScheduledSeq, SchedulerOutput, SlotSave
from engine.scheduler.request import Request, RequestStatus
from engine.spec.policy import SpecPolicy


@dataclass
class _Budget:
    tokens: int
    time: float | None  # seconds left after the per-step constant; None: unlimited
    predicted: float = 0.0


@dataclass
class StepUpdate:
    """What one ``update`` changed: new tokens per request and the requests that finished."""

    new_tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, object] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, host_slots: HostSlotPool | None = None, spec: SpecPolicy | None = None
    ) -> None:
        self.config = config
        self.spec = spec
        self.cache = CacheManager(config, host_slots)
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._finished_ids: set[str] = set()
        self._step = 0
        self._decoded_last = False  # batch-invariant steps alternate decodes and prefills
        self.num_preemptions = 0
        self._forks: dict[str, list[Request]] = {}  # parent id -> children waiting for its prompt
        self._forked: list[Request] = []  # children forked in this schedule() call
        self._block_copies: list[tuple[int, int]] = []  # for the next non-empty step
        self._slot_copies: list[tuple[int, int]] = []
        # KV connector loads, for the next non-empty step (nothing adds to them while scheduling)
        # (admission queues the loads of host-slot hits into the same lists)
        self._kv_loads: list[tuple[int, bytes]] = self.cache.kv_loads
        self._slot_loads: list[tuple[int, bytes]] = self.cache.slot_loads
        # the last update's drafts, given to their requests when the next step is scheduled
        self.drafts = DraftsHandover()

    # -- requests --------------------------------------------------------------------------
    def add_request(self, req: Request, remote_kv: bool = False) -> None:
        """Queue ``req``. ``remote_kv``: the KV connector is fetching its prefix; it is not
        admitted before ``remote_kv_ready`` (blocks the caller pinned stay in
        ``req.pinned_blocks`` and are released at admission or finish)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the scheduler")
        if len(req.prompt_token_ids) + req.max_tokens > self.config.num_blocks * self.config.block_size:
            raise ValueError(
                f"request {req.request_id!r} needs up to {len(req.prompt_token_ids) + req.max_tokens} "
                f"tokens but the cache holds {self.config.num_blocks * self.config.block_size}"
            )
        req.arrival = next(self._arrivals)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV if remote_kv else RequestStatus.WAITING
        self.requests[req.request_id] = req
        self._finished_ids.discard(req.request_id)  # an id reused before the next step: not finished
        parent = self.requests.get(req.fork_of) if req.fork_of else None
        if parent is not None and parent is not req and parent.num_outputs_with_pending == 0:
            self._forks.setdefault(parent.request_id, []).append(req)  # forked after its prefill
        else:
            self._enqueue(req)

    def remote_kv_ready(self, request_id: str) -> None:
        """The connector's fetch for a waiting request ended (loaded, or failed: recompute)."""
        req = self.requests.get(request_id)
        if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            req.status = RequestStatus.WAITING

    def add_running(self, req: Request) -> None:
        """Adopt a sequence imported from another engine: its block table, slot, computed
        length and outputs are set, and the loads of its state are already queued."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the scheduler")
        if len(self.running) >= self.config.max_num_seqs:
            raise ValueError(f"engine runs its maximum of {self.config.max_num_seqs} sequences")
        req.arrival = next(self._arrivals)
        req.status = RequestStatus.RUNNING
        self.requests[req.request_id] = req
        self._finished_ids.discard(req.request_id)  # e.g. handed back to the engine that exported it
        self.running.append(req)

    def queue_kv_load(self, block: int, payload: bytes) -> None:
        """Write a verified block payload into ``block`` before the next executed step."""
        self._kv_loads.append((block, payload))

    def queue_slot_load(self, slot: int, payload: bytes) -> None:
        self._slot_loads.append((slot, payload))

    def take_idle_saves(self) -> list[tuple[int, bytes, str]]:
        """Blocks published while no step runs (a finish after the last step): the caller
        snapshots them itself, with nothing in flight, then releases each pin."""
        saves, self.cache.pending_saves = self.cache.pending_saves, []
        return saves

    def take_idle_host_saves(self) -> list[SlotSave]:
        """Slots retained while no step runs (a turn that ended after the last step): the
        caller copies them to the host pool itself, with nothing in flight."""
        saves, self.cache.host_saves = self.cache.host_saves, []
        return saves

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; False if unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.cache.free(req, retain_slot=True)
        elif req.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KV):
            self.cache.unpin(req)
            if req in self.waiting:
                self.waiting.remove(req)
            else:
                for parent_id, group in list(self._forks.items()):
                    if req in group:
                        group.remove(req)
                        if not group:
                            del self._forks[parent_id]
        for child in self._forks.pop(req.request_id, []):  # never forked: run on their own
            self._enqueue(child)
        req.status = status
        self.requests.pop(req.request_id, None)
        self._finished_ids.add(req.request_id)
        if self.spec is not None:
            self.spec.finished(req.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._forks)

    def has_ready(self) -> bool:
        """Unfinished work a step can make progress on (not only requests awaiting remote KV)."""
        waiting = any(r.status == RequestStatus.WAITING for r in self.waiting)
        return bool(self.running or self._forks or waiting)

    # -- step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.drafts.give()
        cfg = self.config
        time_left = None
        if cfg.step_time_budget_s is not None and cfg.cost_model is not None:
            time_left = cfg.step_time_budget_s - cfg.cost_model.c
        budget = _Budget(cfg.max_num_batched_tokens, time_left)
        seqs: list[ScheduledSeq] = []
        # Copies for forks made by earlier steps; forks made now are copied before the next.
        block_copies, slot_copies = tuple(self._block_copies), tuple(self._slot_copies)
        self._block_copies.clear()
        self._slot_copies.clear()
        if cfg.batch_invariant:  # one kind per step; the other when the first has nothing
            first = self._phase()
            for phase in (first, "prefill" if first == "decode" else "decode"):
                preempted = self._schedule_running(budget, seqs, phase)
                if not preempted and phase == "prefill":
                    self._admit_waiting(budget, seqs)
                if seqs or preempted:
                    self._decoded_last = phase == "decode"
                    break
        else:
            preempted = self._schedule_running(budget, seqs)
            if not preempted:
                self._admit_waiting(budget, seqs)
        self.running.extend(self._forked)
        self._forked.clear()
        for req in self.running:
            self.cache.register_full_blocks(req)
        self._step += 1
        predicted = budget.predicted + (cfg.cost_model.c if cfg.cost_model is not None and seqs else 0.0)
        out = SchedulerOutput(
            self._step,
            tuple(seqs),
            frozenset(self._finished_ids),
            frozenset(preempted),
            predicted,
            block_copies,
            slot_copies,
            tuple(self._kv_loads) if seqs else (),
            tuple(self._slot_loads) if seqs else (),
            tuple(self.cache.pending_saves) if seqs else (),
            tuple(self.cache.host_saves) if seqs else (),
            self.spec.depth if self.spec is not None else -1,
        )
        if seqs:  # an empty step is not executed: keep the ids, copies and loads for the next one
            self._finished_ids.clear()
            self.cache.pending_saves.clear()
            self.cache.host_saves.clear()
            self._kv_loads.clear()
            self._slot_loads.clear()
        else:
            self._block_copies[:0] = block_copies
            self._slot_copies[:0] = slot_copies
        return out

    def _phase(self) -> str:
        """Batch-invariant steps: "decode" or "prefill", alternating when both have work."""
        decodes = any(r.tokens_to_compute == 1 for r in self.running)
        prefills = bool(self.waiting) or any(r.tokens_to_compute > 1 for r in self.running)
        if decodes and prefills:
            return "prefill" if self._decoded_last else "decode"
        return "decode" if decodes else "prefill"

    def _schedule_running(
        self, budget: _Budget, seqs: list[ScheduledSeq], phase: str | None = None
    ) -> set[str]:
        preempted: set[str] = set()
        running = sorted(self.running, key=Request.sort_key)
        drafts = self._plan_drafts(running, budget.tokens) if self.spec is not None else {}
        i = 0
        while i < len(running):
            req = running[i]
            if phase is not None and (req.tokens_to_compute == 1) != (phase == "decode"):
                i += 1  # the other kind's step
                continue
            n = self._num_new(req, req.num_computed, req.tokens_to_compute, budget, not seqs)
            if n == 0:
                i += 1
                continue
            verify = drafts.get(req.request_id, ()) if n == 1 else ()
            while not self.cache.grow(req, req.num_computed + n + len(verify)):
                victim = running.pop()  # lowest priority, latest arrival
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is req:
                    break
            else:
                seqs.append(self._emit(req, n, reset=False, budget=budget, drafts=verify))
                i += 1
        self.running = running
        return preempted

    def _plan_drafts(self, running: list[Request], tokens: int) -> dict[str, tuple[int, ...]]:
        """The drafts each decoding sequence verifies this step (the policy's choice; it also
        sets how many the step drafts for the next, ``spec.depth``)."""
        assert self.spec is not None
        decoding = [r for r in running if r.tokens_to_compute == 1]
        if not decoding:  # prompts only: the requests running or admitted now decode next
            self.spec.prepare(min(len(running) + len(self.waiting), self.config.max_num_seqs))
            return {}
        cands = [r for r in decoding if r.num_pending == 0]
        if not any(r.drafts for r in cands):
            # nothing to verify: no drafts, or every input still on the device (a pipelined
            # step, speculation off); an adaptive policy still counts the step, sets the depth
            # and probes now and then (`DraftingDepth._probe`)
            if self.spec.adaptive:
                self.spec.idle(len(cands or decoding))
            return {}
        # drafts past max_tokens could never be emitted
        room = [max(min(len(r.drafts), r.max_tokens - len(r.output_token_ids) - 1), 0) for r in cands]
        ks, _ = self.spec.choose(
            [r.request_id for r in cands], [r.draft_conf[:n] for r, n in zip(cands, room)], tokens
        )
        return {r.request_id: r.drafts[:k] for r, k in zip(cands, ks) if k}

    def _admit_waiting(self, budget: _Budget, seqs: list[ScheduledSeq]) -> None:
        for req in list(self.waiting):
            if len(self.running) >= self.config.max_num_seqs or budget.tokens <= 0:
                return
            if req.num_pending or req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                continue
            m: PrefixMatch = self.cache.match(req)
            n = self._num_new(req, m.start, req.num_tokens - m.start, budget, not seqs)
            if n == 0 or not self.cache.can_admit(m, m.start + n):
                return  # strict priority: nothing overtakes the head of the queue
            reset = self.cache.admit(req, m)
            if not self.cache.grow(req, req.num_computed + n):  # pragma: no cover - can_admit checked
                raise RuntimeError("block pool changed between can_admit and grow")
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            seqs.append(self._emit(req, n, reset=reset, budget=budget))

    def _num_new(self, req: Request, start: int, remaining: int, budget: _Budget, first: bool) -> int:
        if remaining <= 0 or budget.tokens <= 0:
            return 0
        if req.num_outputs_with_pending >= req.max_tokens:
            return 0  # its last token is being sampled by a step in flight
        if remaining == 1:
            return 1  # decodes are never held back by the time budget
        if self.config.batch_invariant:  # chunks end at multiples of the chunk size, or wait
            chunk = self.config.invariant_chunk_tokens
            n = min(remaining, chunk - start % chunk)
            return n if n <= budget.tokens else 0
        model = self.config.cost_model
        time_left = None if budget.time is None else budget.time - budget.predicted
        n = (
            min(remaining, budget.tokens)
            if model is None
            else largest_chunk(model, start, min(remaining, budget.tokens), time_left)
        )
        return max(n, 1) if first else n

    def _emit(
        self, req: Request, n: int, reset: bool, budget: _Budget, drafts: tuple[int, ...] = ()
    ) -> ScheduledSeq:
        """``drafts``: a decode (n = 1) that also verifies these drafts (num_computed advances
        by the accepted ones at ``update``)."""
        start = req.num_computed
        known = req.token_ids_between(start, start + n)
        tokens = tuple(known) + (PENDING_TOKEN,) * (n - len(known)) + drafts
        sample = start + n == req.num_tokens_with_pending
        req.num_computed += n
        children = self._fork_children(req) if sample and req.num_outputs_with_pending == 0 else ()
        req.num_computed -= n
        seq = ScheduledSeq(
            request_id=req.request_id,
            token_ids=tokens,
            start_pos=start,
            block_table=tuple(req.block_table),
            swa_slot=req.swa_slot if req.swa_slot is not None else -1,
            reset_slot=reset,
            replay_until=req.replay_until,
            window_from=req.window_from,
            swa_keep=req.swa_keep,
            embeds=tuple(r for img in req.images if (r := img.rows(start, start + n)) is not None),
            sample=sample,
            output_index=req.num_outputs_with_pending if sample else -1,
            fork_children=children,
            num_drafts=len(drafts),
        )
        req.num_computed += n
        if sample:
            req.num_pending += 1
        budget.tokens -= n + len(drafts)
        if self.config.cost_model is not None:
            budget.predicted += seq_cost(self.config.cost_model, n + len(drafts), start)
        return seq

    def _fork_children(self, parent: Request) -> tuple[str, ...]:
        """Fork the children waiting for ``parent``, whose prompt this step completes: they
        take its state after the step (copies run before the next step) and their first
        token is sampled from the parent's logits row."""
        forked = []
        for child in self._forks.pop(parent.request_id, []):
            room = len(self.running) + len(self._forked) < self.config.max_num_seqs
            copies = self.cache.fork(parent, child) if room else None
            if copies is None:
                self._enqueue(child)  # no room now: it runs on its own later (prefix cache)
                continue
            block_copy, slot_copy = copies
            if block_copy is not None:
                self._block_copies.append(block_copy)
            self._slot_copies.append(slot_copy)
            child.status = RequestStatus.RUNNING
            child.num_pending = 1
            self._forked.append(child)
            forked.append(child.request_id)
        return tuple(forked)

    def _preempt(self, req: Request) -> None:
        self.cache.free(req, retain_slot=True)
        req.num_computed = 0
        req.replay_until = 0
        req.window_from = 0
        req.swa_keep = (0, 0)
        req.drafts, req.draft_conf = (), ()
        req.num_registered = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        keys = [r.sort_key() for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, req.sort_key()), req)

    # -- update ----------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: RunnerOutput) -> StepUpdate:
        """Apply step ``out``'s sampled tokens. Tokens of requests finished meanwhile are dropped.
        The drafts the step proposes are given out when the next step is scheduled
        (`DraftsHandover`): a graphed drafting chain may still be on the device, and reading
        them here would wait for it before the step's tokens reach anyone."""
        self.drafts.give()  # the step before's, if no step was scheduled since
        upd = StepUpdate()
        self.cache.blocks.release([block for block, _, _ in out.kv_saves])  # snapshots taken
        drafting: list[Request] = []
        for seq in out.seqs:
            if not seq.sample:
                continue
            for rid in (seq.request_id, *seq.fork_children):
                req = self._apply(rid, seq.num_drafts, result, upd)
                if req is not None:
                    drafting.append(req)
        if self.spec is not None:
            self.drafts.hold(result.drafts, drafting)
        return upd

    def _apply(self, rid: str, num_drafts: int, result: RunnerOutput, upd: StepUpdate) -> Request | None:
        """One sampled sequence's tokens: every accepted draft and the token after them.
        Returns the request if it still runs (its drafts, `DraftsHandover`, are still to come)."""
        req = self.requests.get(rid)
        if req is None or req.status.finished:
            return None  # finished or aborted while this step was in flight
        tokens = result.tokens.get(rid) or (result.sampled[rid],)
        lps = result.token_logprobs.get(rid) or (result.logprobs.get(rid),)
        req.num_pending -= 1
        if num_drafts:  # the accepted drafts' positions are computed now
            req.num_computed += len(tokens) - 1
        if self.spec is not None:
            self.spec.stats.accepted += len(tokens) - 1 if num_drafts else 0
            self.spec.observe(rid, len(tokens) - 1 if num_drafts else 0)
        req.drafts, req.draft_conf = (), ()  # verified: the step's new drafts come later
        upd.new_tokens[rid] = tokens[-1]
        if rid in result.logprobs:
            upd.logprobs[rid] = lps if len(tokens) > 1 else lps[0]
        for token in tokens:
            req.output_token_ids.append(token)
            status = None
            if rid in result.failed:
                req.error = result.failed[rid]
                status = RequestStatus.FINISHED_ERROR
            elif token in req.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif len(req.output_token_ids) >= req.max_tokens:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self.finish(req, status)
                upd.finished.append(req)
                return None
        return req
